"""What a member may send this client, at most: the bounds that keep a node's memory and CPU
bounded whatever the server at the other end sends, and the small objects that count.

How it works: the connection (:mod:`._h2`) reads each frame's size in its 9-byte head and
refuses one over :data:`MAX_FRAME` (the largest it advertises, SETTINGS_MAX_FRAME_SIZE)
before its payload is buffered; it gathers a header block (HEADERS, then CONTINUATION
frames) in a :class:`HeaderBlock`, which bounds the block's size and its number of frames;
the decoded headers are bounded too (:data:`MAX_HEADER_LIST`, advertised as
SETTINGS_MAX_HEADER_LIST_SIZE, counted as RFC 9113 does). A call (:mod:`._call`) takes
gRPC messages of :data:`MAX_MESSAGE` at most, a unary answer exactly one, and a streamed
call leaves at most :data:`MAX_UNREAD` bytes of answers unread (:mod:`._pool`). Frames that
carry nothing for a call (PING, SETTINGS, an empty DATA frame, PRIORITY, a frame of an
unknown type; a header block for no call, which is decoded all the same, counts a frame a
256 bytes) spend a :class:`Budget` of :data:`MAX_IDLE` a second beyond one for each frame
this side sent.
Acknowledgements (PING, SETTINGS) are written only while the member reads them: a
connection whose transport pauses its writes (``pause_writing``: the member does not read)
stops reading, so no more frames that ask for one are taken, and at most :data:`MAX_OWED`
wait unsent. Whatever goes beyond raises :class:`~._answers.Misbehaved`, saying what the
server did: the connection is closed (every call on it fails at once with that error, which
the client turns into ``RendezvousConnectionError`` naming the member) and leaves the pool.

Why bounds at all: without them, one 16 MiB HEADERS frame held a node's event loop for 9 s;
a server that flooded PINGs and never read grew a node to 114 MiB at full CPU (each PING's
acknowledgement queued), and went on after the call had failed; endless empty CONTINUATION
frames spun the CPU; an answer that never ended was kept whole (267 MiB in 4 s).
"""

from __future__ import annotations

from collections.abc import Callable

from ._answers import Misbehaved

__all__ = [
    "MAX_CREDIT",
    "MAX_FRAME",
    "MAX_HEADER_BLOCK",
    "MAX_HEADER_FRAMES",
    "MAX_HEADER_LIST",
    "MAX_IDLE",
    "MAX_MESSAGE",
    "MAX_OWED",
    "MAX_UNREAD",
    "Budget",
    "HeaderBlock",
]

#: The largest frame taken: HTTP/2's default (RFC 9113 6.5.2), which every server sends
#: without being told otherwise, advertised all the same. etcd (grpc-go) cuts its answers
#: into frames of this size; a larger limit would only let a server make this side buffer
#: more before a frame can be judged.
MAX_FRAME = 16384
#: The largest header block taken, all its frames together (HPACK-coded). etcd's are a few
#: hundred bytes (a status, a content type; the trailers' gRPC status and message); 64 KiB
#: is a hundred times that, and decoding it takes a few milliseconds.
MAX_HEADER_BLOCK = 64 << 10
#: The most frames a header block may take (HEADERS and its CONTINUATIONs): 64 KiB in
#: frames of 16 KiB is 4; etcd sends 1. Empty CONTINUATION frames never end a block.
MAX_HEADER_FRAMES = 16
#: The largest header list taken once decoded (names, values and 32 octets an entry, as
#: SETTINGS_MAX_HEADER_LIST_SIZE counts): a block of one-byte references to a large entry
#: of the dynamic table would otherwise decode to gigabytes.
MAX_HEADER_LIST = 64 << 10
#: The largest gRPC message taken. etcd refuses requests over 1.5 MiB (its
#: ``--max-request-bytes``), so a key's value is smaller than that; gRPC's own clients take
#: answers of 4 MiB by default (etcd's Go client lifts that). aelastic's largest answers
#: are a run's member keys (a status snapshot reads every participant's key and value:
#: 177 bytes a node with 37-character host names, 181 KB at 1,024 nodes, measured on etcd
#: 3.4 by tests/backends/test_etcd_hostile.py) and a store's multi-get (values that fit
#: etcd's request limit). 16 MiB is 90 times the 1,024-node snapshot and ten values at
#: etcd's request limit; a message is buffered whole and copied once, so a node spends
#: 32 MiB on one at most, and a message declared larger is refused from its 5-byte prefix,
#: before any of it is buffered.
MAX_MESSAGE = 16 << 20
#: The most bytes of a streamed call's answers (a watch's events) received and not yet read
#: by its reader. A reader takes every message that arrived each time it runs (the event
#: loop runs it between two reads of the socket), so a legitimate stream never has more
#: than one read's worth (256 KiB) waiting.
MAX_UNREAD = 16 << 20
#: The most frames that carry nothing for a call taken within a second, beyond one for each
#: frame this side sent. etcd sends its settings, a PING for gRPC's keep-alive now and then,
#: and one for its flow-control estimate when it receives DATA (at most one a frame this side
#: sent); a thousand a second more is a flood (one read of 256 KiB holds 15,000 PINGs).
MAX_IDLE = 1000
#: The most frames sent that are kept as credit for frames that carry nothing (a burst of
#: calls is answered by a burst of PINGs; what this side sent long ago is not).
MAX_CREDIT = 100 * MAX_IDLE
#: The most acknowledgements (PING, SETTINGS) written while the member reads nothing (the
#: transport paused this side's writes; reading stops then, so only the frames already
#: received can ask for more).
MAX_OWED = 100


class HeaderBlock:
    """The fragments of one header block as its frames arrive (HEADERS, then CONTINUATION),
    within :data:`MAX_HEADER_BLOCK` bytes and :data:`MAX_HEADER_FRAMES` frames.

    Args:
        stream: The block's stream.
        flags: The HEADERS frame's flags (END_STREAM).
        fragment: The HEADERS frame's fragment.
    """

    __slots__ = ("flags", "fragments", "frames", "stream")

    def __init__(self, stream: int, flags: int, fragment: bytes) -> None:
        self.stream = stream
        self.flags = flags
        self.fragments = bytearray()
        self.frames = 0
        self.add(fragment)

    def add(self, fragment: bytes) -> None:
        """Take one more frame's fragment.

        Raises:
            Misbehaved: The block went beyond its bounds.
        """
        self.frames += 1
        if self.frames > MAX_HEADER_FRAMES:
            raise Misbehaved(
                f"it sent a header block of more than {MAX_HEADER_FRAMES} frames "
                "(CONTINUATION frames that never end it)"
            )
        if len(self.fragments) + len(fragment) > MAX_HEADER_BLOCK:
            raise Misbehaved(f"it sent a header block of more than {MAX_HEADER_BLOCK} bytes")
        self.fragments += fragment


class Budget:
    """Frames that carry nothing for a call: :data:`MAX_IDLE` within a second, plus one for
    each frame this side sent (a member answers what it receives with such frames: gRPC's
    flow-control estimate pings for DATA it receives, a thousand a second and more on a
    busy connection), at most :data:`MAX_CREDIT` of those kept.

    Args:
        clock: Seconds, monotonic (the event loop's time); read only once the budget of
            the second is spent.
    """

    __slots__ = ("_clock", "_credit", "_since", "_spent")

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._since = clock()
        self._spent = 0
        self._credit = 0

    def earn(self, frames: int) -> None:
        """This side sent ``frames`` frames: as many more may come back."""
        self._credit = min(self._credit + frames, MAX_CREDIT)

    def spend(self, what: str, weight: int = 1) -> None:
        """Count one such frame (``what``: its kind, for the message; ``weight``: as many
        frames as its cost is worth, for a header block decoded for no call).

        Raises:
            Misbehaved: Over the budget (a flood).
        """
        if self._credit >= weight:
            self._credit -= weight
            return
        self._spent += weight
        if self._spent <= MAX_IDLE:
            return
        now = self._clock()
        if now - self._since >= 1.0:
            self._since, self._spent = now, weight
            return
        raise Misbehaved(
            f"it sent more than {MAX_IDLE} frames that carry nothing for a call within a "
            f"second, beyond one for each frame this side sent (a flood; the last: {what})"
        )
