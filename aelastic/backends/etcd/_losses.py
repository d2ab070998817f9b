"""The members etcd dropped from a complete round, by name, from the history of the deletions.

How it works: when a node's lease expires etcd deletes its keys and tells nobody why; the
counts show how many members a round lost, not who. :func:`lost_names` reads the history of
the deletions of the node lists (``p/`` to ``q/``: a watch without puts, from the revision
the run's header accounted for, up to the revision a request read) and names each
participant whose key was deleted there, but those of the header's own write (accounted
already), those that were done (their ``pd/`` key deleted at the same revision: etcd sends a
revision's events together) and those that left (their ``q/`` key, finished, or ``l/`` key,
unfinished, there at the read revision: a leave writes its mark with its delete; one small
read of those keys, 32 a transaction). Without puts, the history holds no join: a round
whose joins churned costs what its losses do.

Its work is bounded, whatever the round's size. A round that lost a member usually saw its
survivors leave first (their collectives broke), and the member's lease ran out after: a
thousand leaves, then one drop. Every request that reads the run before the drop is
accounted for looks its name up, so a lookup that read and checked each leave cost the
round O(N²): at 1,024 nodes, 422,749 deletion events read and 6,706 checks in one recovery
that never formed. So the lookup first reads the newest mark's revision (one read: the
``l/`` and ``q/`` keys by creation, newest first, one of each), and the history after it,
where no member left: the drops there are the names, checked once (the count of ``p/`` keys
at the mark, against the read's, says how many deletions that window holds: it ends with
the last, never waiting for more). Only when that window holds fewer than asked does it
read the history before the mark, at most ``_EVENTS`` deletions, checked ``_CHECKED`` at a
time. Best effort: history compacted away, a member that does not answer, or drops among
more leaves than the bound leave names out (the lost sample and the hosts counted in the
job's health miss them; the counts stay exact).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from ...core.errors import RendezvousConnectionError
from ...core.race import wait_within
from ._client import EtcdClient, EtcdError, b64, unb64
from ._layout import RunKeys, prefix_end
from ._plan import View
from ._ranges import members_of, range_of, range_op

__all__ = ["lost_names"]

_MISSED = (ConnectionError, EtcdError, RendezvousConnectionError, TimeoutError)
#: Keys checked in one read, two ranges each (etcd refuses a transaction of more than 128
#: operations).
_CHECKED = 32
#: Deletions read before the newest mark, at most, by one lookup.
_EVENTS = 256
#: Seconds without a message after which a window's history is taken as read.
_IDLE = 2.0


async def lost_names(
    client: EtcdClient, keys: RunKeys, view: View, count: int, name_of: Callable[[str], str]
) -> list[str]:
    """Up to ``count`` members etcd removed from the complete round of ``view`` since its
    header's last write, in order (see the module docstring); ``name_of(key)`` is the node's
    name in a ``p/`` key."""
    header = view.header
    assert header is not None
    start = header.accounted + 1
    try:
        mark = await _newest_mark(client, keys, view.revision)
    except _MISSED:
        return []
    later: list[str] = []
    if mark >= start:
        # The complete round's p/ keys deleted after the mark (none is added while it stays
        # complete): the window after it ends at the last of them, with no wait for more.
        with contextlib.suppress(*_MISSED):
            gone = await _participants_at(client, keys, mark) - view.participants
            if gone > 0:
                window = _Window(client, keys, view, count, first=mark + 1, last=None)
                later = await window.names(expect=gone)
        if len(later) >= count:
            return [name_of(key) for key in later[:count]]
        window = _Window(client, keys, view, count - len(later), first=start, last=mark)
        earlier = await window.names()
    else:
        earlier = await _Window(client, keys, view, count, first=start, last=None).names()
    return [name_of(key) for key in (earlier + later)[:count]]


async def _newest_mark(client: EtcdClient, k: RunKeys, revision: int) -> int:
    """The revision of the newest ``l/`` or ``q/`` mark at ``revision`` (0: none)."""
    newest = {"limit": 1, "sort_order": "DESCEND", "sort_target": "CREATE", "keys_only": True}
    body = {"success": [
        range_op(m, prefix_end(m), revision=revision, **newest) for m in (k.left, k.finished)
    ]}  # fmt: skip
    answer = await client.call("/v3/kv/txn", body, "lost names")
    found = [m.create for r in answer.get("responses", []) for m in members_of(
        range_of(r).get("kvs", []))]  # fmt: skip
    return max(found, default=0)


async def _participants_at(client: EtcdClient, k: RunKeys, revision: int) -> int:
    """How many ``p/`` keys the run had at ``revision``."""
    ops = [range_op(k.participants, prefix_end(k.participants), count_only=True, revision=revision)]
    answer = await client.call("/v3/kv/txn", {"success": ops}, "lost names")
    return int(range_of(answer.get("responses", [{}])[0]).get("count", 0))


class _Window:
    """The drops among the deletions from revision ``first`` to ``last`` (``None``: the
    read's revision, past which no deletion is known to come: read until idle). A window up
    to a mark ends at the mark's own revision (its leave's deletion is there) and reads at
    most ``_EVENTS`` deletions; one after the newest mark holds drops (and members done or
    finished after it), checked once ``count`` are found."""

    def __init__(
        self, client: EtcdClient, keys: RunKeys, view: View, count: int, first: int,
        last: int | None,
    ) -> None:  # fmt: skip
        self._client, self._k, self._view, self._count = client, keys, view, count
        self._first = first
        self._bounded = last is not None
        self._end = view.revision if last is None else last
        self.found: list[str] = []  # p/ keys deleted, not yet checked for a leave
        self.kept: list[str] = []  # p/ keys checked: dropped
        self._batch: list[str] = []  # the keys deleted at one revision

    async def names(self, expect: int | None = None) -> list[str]:
        """The names (at most ``count``); ``expect``: how many ``p/`` keys the window is
        known to delete (it ends at the last of them)."""
        k = self._k
        body = {"create_request": {
            "key": b64(k.participants), "range_end": b64(prefix_end(k.finished)),
            "start_revision": self._first, "filters": ["NOPUT"],
        }}  # fmt: skip
        at, read, deleted = 0, 0, 0
        try:
            async with self._client.stream("/v3/watch", body, timeout=5.0) as messages:
                async for message in _until(messages, _IDLE):
                    if message.get("compact_revision") or message.get("canceled"):
                        break
                    ended = False
                    for event in message.get("events", []):
                        kv = event.get("kv", {})
                        revision = int(kv.get("mod_revision", 0))
                        if revision > self._end:
                            ended = True
                            break
                        if revision != at:
                            self._settle()
                            at = revision
                        key = unb64(kv.get("key")).decode(errors="replace")
                        deleted += key.startswith(k.participants)
                        if revision != self._view.header_mod:
                            read += 1
                            self._batch.append(key)
                    ended = ended or at >= self._end or (self._bounded and read >= _EVENTS)
                    ended = ended or (expect is not None and deleted >= expect)
                    if await self._enough(ended):  # a revision's events come in one message
                        return self.kept[: self._count]
                    if ended:
                        break
        except _MISSED:
            pass  # the names are for the sample and the health only: the counts stay exact
        with contextlib.suppress(*_MISSED):
            await self._enough(True)
        return self.kept[: self._count]

    def _settle(self) -> None:
        k, batch = self._k, self._batch
        done = {key[len(k.done) :] for key in batch if key.startswith(k.done)}
        for key in batch:
            if key.startswith(k.participants) and key[len(k.participants) :] not in done:
                self.found.append(key)
        batch.clear()

    async def _enough(self, ended: bool) -> bool:
        """Whether ``count`` names are found, once those found are checked (after the
        newest mark: when they could be enough; before it, ``_CHECKED`` at a time)."""
        self._settle()
        need = self._count - len(self.kept)
        due = len(self.found) >= (_CHECKED if self._bounded else need)
        if self.found and (due or ended):
            self.kept.extend(
                await _not_left(self._client, self._k, self.found, self._view.revision)
            )
            self.found.clear()
        return len(self.kept) >= self._count


async def _not_left(client: EtcdClient, k: RunKeys, found: list[str], revision: int) -> list[str]:
    """The ``p/`` keys of ``found`` whose node has neither a ``q/`` nor an ``l/`` key at
    ``revision`` (it did not leave, finished or not: etcd dropped it)."""
    kept: list[str] = []
    for start in range(0, len(found), _CHECKED):
        chunk = found[start : start + _CHECKED]
        marks = [m + key[len(k.participants) :] for key in chunk for m in (k.finished, k.left)]
        body = {"success": [range_op(m, count_only=True, revision=revision) for m in marks]}
        answer = await client.call("/v3/kv/txn", body, "lost names")
        counts = [int(range_of(r).get("count", 0)) for r in answer.get("responses", [])]
        marked = [counts[i] + counts[i + 1] for i in range(0, len(counts) - 1, 2)]
        kept.extend(key for key, n in zip(chunk, marked, strict=False) if not n)
    return kept


async def _until(messages: Any, idle: float) -> Any:
    """``messages`` until none came for ``idle`` seconds."""
    iterator = messages.__aiter__()
    while True:
        try:
            yield await wait_within(iterator.__anext__(), idle)
        except (StopAsyncIteration, TimeoutError):
            return
