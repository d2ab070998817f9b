"""How long an attempt at a member waits, and whether a member's leader changed while it held
a request: one status probe per member and second in a process, shared by every request
waiting on that member.

How it works: a request unanswered for a while (:data:`SLOW`) makes the client ask the
member's status (no Raft round trip); a newer Raft term than the one the client last saw,
or no leader, means the request may be lost (a follower forwarded it to a leader that
died) and it is sent again; otherwise it is only slow and is waited for. Requests of one
event loop waiting on one member share a probe (a busy cluster is asked once, not by every
node of the process). A client's :class:`Terms` notes the terms it hears, for every client of
its cluster in the event loop, and waits on its attempts so.
"""

from __future__ import annotations

import asyncio
import inspect
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from ...core.race import retrieve
from ._answers import Transient

__all__ = [
    "CONNECT_TIMEOUT",
    "LAST_ATTEMPT",
    "SLOW",
    "Terms",
    "heard_term",
    "known_term",
    "leader_changed",
    "member_term",
]

_T = TypeVar("_T")

#: A request unanswered this long makes the client ask the member whether its leader changed
#: meanwhile (its status: no Raft round trip): a request that a follower forwarded to a
#: leader that died is never answered (etcd gives up after its request timeout, 5 s and
#: more), so it is sent again; a request that is only slow (a busy cluster) is waited for,
#: never sent twice (that would add load exactly when there is too much).
SLOW = 1.5
#: Seconds the one attempt of a call made after the outage's budget ran out may take.
LAST_ATTEMPT = 2.0
#: Connecting to a member: a member that does not answer in this time is passed over when
#: there are others (the only member is given the attempt's whole time: a busy etcd takes
#: long to accept a connection, and trying again only adds to its backlog; measured, 1,024
#: nodes connecting at once to one member on 2 cores had their watches time out 424 times).
CONNECT_TIMEOUT = 2.0

#: The last status probe of each member, per event loop.
_PROBES: weakref.WeakKeyDictionary[
    asyncio.AbstractEventLoop, dict[str, tuple[float, asyncio.Future[int]]]
] = weakref.WeakKeyDictionary()


#: The newest Raft term heard from each cluster (its members' URLs), per event loop: a
#: client's first request, sent before it heard a term of its own, is judged by it (else a
#: first request that a follower forwarded to a leader that died waits out etcd's timeout).
_TERMS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, ...], int]] = (
    weakref.WeakKeyDictionary()
)


def heard_term(cluster: tuple[str, ...], term: int) -> None:
    """Note that a client of ``cluster`` heard Raft term ``term``."""
    terms = _TERMS.setdefault(asyncio.get_running_loop(), {})
    if term > terms.get(cluster, 0):
        terms[cluster] = term


def known_term(cluster: tuple[str, ...]) -> int:
    """The newest Raft term this event loop's clients heard from ``cluster`` (0: none)."""
    return _TERMS.get(asyncio.get_running_loop(), {}).get(cluster, 0)


async def member_term(base: str, term_of: Callable[[str], Awaitable[int]]) -> int:
    """Member ``base``'s term (0: no leader), asked with ``term_of`` at most once a second
    per event loop (its waiters share the answer).

    Raises:
        Exception: What ``term_of`` raised (the member could not be asked).
    """
    loop = asyncio.get_running_loop()
    probes = _PROBES.setdefault(loop, {})
    entry = probes.get(base)
    if entry is None or loop.time() - entry[0] > 1.0:
        probe = asyncio.ensure_future(term_of(base))
        probe.add_done_callback(retrieve)  # its waiters may all be gone
        entry = probes[base] = (loop.time(), probe)
    return await asyncio.shield(entry[1])


async def leader_changed(
    base: str, term: int, several: bool, term_of: Callable[[str], Awaitable[int]]
) -> bool:
    """Whether member ``base`` is in a newer term than ``term`` (or cannot say), asking it
    with ``term_of`` (:func:`member_term`). A member that cannot say is passed over when
    there are ``several``; the only member is waited for (sending it the request again
    would only add to what keeps it busy: at 1,024 nodes on 2 cores, hundreds of requests
    a run were sent again). ``term`` -1: sent while the member had no leader (any leader
    since is newer)."""
    try:
        now = await member_term(base, term_of)
    except Exception:
        return several
    # A client that has not heard a term yet (a single member's first request) cannot tell
    # a newer one: only a member without a leader says the request may be lost.
    return not now or (term != 0 and now > term)


class Terms:
    """The Raft terms a client hears (noted for its cluster, :func:`heard_term`), and the
    wait on its attempts: one that takes long is abandoned only if the member's leader
    changed meanwhile.

    Args:
        cluster: The client's members (their URLs, sorted): the terms heard from it are
            noted for the event loop's other clients (:func:`heard_term`).
    """

    def __init__(self, cluster: tuple[str, ...]) -> None:
        self._cluster = cluster

    def saw(self, answer: dict[str, Any]) -> None:
        """Note the Raft term of ``answer`` (see :func:`leader_changed`)."""
        header = answer.get("header") or {}
        heard_term(self._cluster, int(header.get("raft_term", 0) or 0))

    async def patiently(
        self, url: str, sending: Awaitable[_T], term_of: Callable[[str], Awaitable[int]]
    ) -> _T:
        """Await ``sending``, an attempt at member ``url``: one that takes long is
        abandoned only if the member's leader changed meanwhile (see :data:`SLOW`), which
        ``term_of`` asks the member (its term; 0: no leader)."""
        # The newest term this process heard from the cluster (this client's answers,
        # another node's, an earlier round's); if none yet (a first request), the first
        # heard meanwhile (its watch's): a newer term at the member means an election after
        # that term was heard, so after the sending.
        sent_in = known_term(self._cluster)
        if not sent_in and len(self._cluster) > 1:
            # None heard yet (this process's first requests): the member's term first, so
            # that an election after the sending is told (before, a first request sent
            # while the leader died waited out etcd's timeout when the watch had not been
            # answered before the election either). No leader: sent into an election.
            try:
                sent_in = await member_term(url, term_of) or -1
            except BaseException:
                if inspect.iscoroutine(sending):
                    sending.close()  # never awaited: nothing was sent
                raise
        attempt = asyncio.ensure_future(sending)
        try:
            while True:
                done, _ = await asyncio.wait({attempt}, timeout=SLOW)
                if done:
                    return attempt.result()
                term = sent_in or known_term(self._cluster)
                changed = await leader_changed(url, term, len(self._cluster) > 1, term_of)
                if attempt.done():  # answered while the member was asked: never sent again
                    return attempt.result()
                if changed:
                    raise Transient("the member's leader changed while it had the request")
        finally:
            if not attempt.done():
                attempt.cancel()
                await asyncio.wait({attempt})
            if not attempt.cancelled():
                attempt.exception()  # retrieved (what is raised here replaces it)
