"""Which of a node's requests the run's watch answers: a join that would only wait again.

How it works: a backend remembers, per node, where its last request left it (:class:`Known`:
its list, the status token and round then, the secret it is listed under). A node's next
join is carried out in full (a read, maybe a write) only when what the watch brought since
may change its answer; otherwise :func:`join_waits` says until when it waits, and the
backend answers with a lease renewal and the watched status. A participant of a forming
round waits until the last call ends; a node on the wait list, while its round stays
complete. News that changes neither (a round's lost member or its wait list, when the
round stays the node's; the last call starting, for the round's participants) is answered
from the watched header too: at 1,024 nodes each such change made every waiting node read
the run at once (a thousand reads, each counting the lists), for the same answer.

When the last call ends, the round is completed by the participant whose request started
it (:attr:`~._apply.RunPort.last_calls`): the others wait a little longer
(:data:`GRACE_MS`, spread over the nodes) for the watch to tell them, and ask themselves
only if it did not (the setter's process died). Before, every participant asked at the
last call's end, each read the run and tried the completion's write: one won, the others'
writes failed and were read again, 2,000 requests at 1,024 nodes for one completion.
Nothing here does I/O.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from ...core.state import NodeDesc, Request, Status
from ...core.token import Token, make
from ._layout import Header

__all__ = ["GRACE_MS", "Known", "join_waits"]

#: How long after the last call's end a participant that did not start it waits for the
#: completion, at least (ms); each node adds up to as much again, from its name.
GRACE_MS = 500


@dataclass(frozen=True)
class Known:
    """Where a node's last request left it, as its backend knows.

    Attributes:
        where: Its list (``p``, ``w``, ``r``; ``None``: in none).
        token: The status token then; ``round`` the round then.
        secret: The secret it is listed under.
    """

    where: str | None
    token: Token
    round: int
    secret: str


def join_waits(
    request: Request,
    known: Known,
    latest: Status,
    header: Header | None,
    now: int,
    ends_last_call: bool,
) -> tuple[bool, int | None]:
    """Whether ``request`` (a join of a node left as ``known``) would only wait again, as
    far as the watch tells (``latest``, and ``header``, the last header it brought), and
    until when (ms, ``None``: until news); ``ends_last_call``: the node's own request
    started the last call of ``header`` (it completes the round at its end)."""
    if request.expired or latest.closed or latest.round != known.round:
        return False, None
    news = latest.token != known.token
    if news and (header is None or make(header.epoch, header.gen) != latest.token):
        return False, None  # the watch's status is not the header's: a reply's, read anew
    if known.where == "w":
        return latest.complete, None
    if known.where != "p" or latest.complete:
        return False, None
    deadline = latest.deadline_ms  # (this process's: from when it saw the last call start)
    if deadline is None or deadline > now:
        return True, deadline
    if ends_last_call:
        return False, None
    fallback = deadline + GRACE_MS + _spread(request.node)
    return (True, fallback) if now < fallback else (False, None)


def _spread(node: NodeDesc) -> int:
    """A node's share of :data:`GRACE_MS` (ms): the nodes that ask after a lost setter
    do not all ask at once."""
    return zlib.crc32(node.key.encode()) % GRACE_MS
