"""What a connection (:mod:`._h2`) sends, within the member's flow-control windows (RFC 9113
5.2, 6.9): each call's messages cut into DATA frames as the windows allow.

How it works: a call's data waits in its backlog; :meth:`Windows.frames` cuts off what fits
both the connection's window and the call's (frames of 16 KiB at most) and returns it as
DATA frames to write, ending the stream after the last byte when the call asked for that;
a call whose data does not fit waits in a list until the member opens a window (a
WINDOW_UPDATE, or SETTINGS_INITIAL_WINDOW_SIZE moving every stream's window), when
:meth:`Windows.unblocked` returns what now fits. A window the member opens beyond 2^31-1
breaks the protocol (:class:`~._answers.Misbehaved`). Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

from ._answers import Misbehaved
from ._call import Call
from ._frames import BIG, DATA, END_STREAM, frame

__all__ = ["Windows"]

_FRAME = 16384  # largest frame sent (the default every peer takes)


class Windows:
    """The member's windows for what this side sends (see the module docstring)."""

    def __init__(self) -> None:
        #: The member's initial stream window (a new call's).
        self.initial = 65535
        self._connection = 65535
        self._blocked: list[Call] = []

    def frames(self, call: Call) -> bytes:
        """DATA frames of ``call``'s backlog that fit the windows now (the rest waits)."""
        backlog = call.backlog
        out = bytearray()
        while backlog:
            size = min(len(backlog), self._connection, call.window, _FRAME)
            if size <= 0:
                if call not in self._blocked:
                    self._blocked.append(call)
                break
            self._connection -= size
            call.window -= size
            last = size == len(backlog) and call.end_after_backlog
            out += frame(DATA, END_STREAM if last else 0, call.stream, bytes(backlog[:size]))
            del backlog[:size]
        else:
            if call.end_after_backlog and not out:
                out += frame(DATA, END_STREAM, call.stream)
            call.end_after_backlog = False
        return bytes(out)

    def set_initial(self, value: int, calls: Iterable[Call]) -> None:
        """The member's SETTINGS_INITIAL_WINDOW_SIZE: every open stream's window moves.

        Raises:
            Misbehaved: Over 2^31-1.
        """
        if value > BIG:
            raise Misbehaved(f"it sent an initial window of {value} (over 2^31-1)")
        change, self.initial = value - self.initial, value
        for call in calls:
            call.window += change

    def update(self, call: Call | None, increment: int) -> None:
        """A WINDOW_UPDATE: of the connection (``call`` ``None``) or of ``call``'s stream.

        Raises:
            Misbehaved: An increment of 0, or a window over 2^31-1.
        """
        if not increment:
            raise Misbehaved("it sent a WINDOW_UPDATE of 0")
        if call is None:
            self._connection += increment
            window = self._connection
        else:
            call.window += increment
            window = call.window
        if window > BIG:
            raise Misbehaved(f"it opened a window of {window} bytes (over 2^31-1)")

    def unblocked(self) -> bytes:
        """DATA frames of the calls that waited for a window, as far as they fit now."""
        blocked, self._blocked = self._blocked, []
        return b"".join(self.frames(call) for call in blocked if not call.done.done())
