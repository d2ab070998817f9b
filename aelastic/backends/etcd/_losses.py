"""The members etcd dropped from a complete round, by name, from the history of the deletions.

How it works: when a node's lease expires etcd deletes its keys and tells nobody why; the
counts show how many members a round lost, not who. :func:`lost_names` reads the history of
the deletions of the node lists (``p/`` to ``q/``: one watch without puts, from the revision
the run's header accounted for, up to the revision a request read) and names each
participant whose key was deleted there, but those of the header's own write (accounted
already), those that were done (their ``pd/`` key deleted at the same revision: etcd sends a
revision's events together) and those that left (their ``q/`` key, finished, or ``l/`` key,
unfinished, there at the read revision: a leave writes its mark with its delete; one small
read of those keys, only for the deletions since the header's last write). Without puts,
the history holds no join: a round whose joins churned costs what its losses do. Best
effort: history compacted away, or a member that does not answer, leaves names out (the
lost sample and the hosts counted in the job's health miss them; the counts stay exact).
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
from ._ranges import range_of, range_op

__all__ = ["lost_names"]

_MISSED = (ConnectionError, EtcdError, RendezvousConnectionError, TimeoutError)
#: Keys checked in one read, two ranges each (etcd refuses a transaction of more than 128
#: operations).
_CHECKED = 32


async def lost_names(
    client: EtcdClient, keys: RunKeys, view: View, count: int, name_of: Callable[[str], str]
) -> list[str]:
    """Up to ``count`` members etcd removed from the complete round of ``view`` since its
    header's last write, in order (see the module docstring); ``name_of(key)`` is the node's
    name in a ``p/`` key."""
    header = view.header
    assert header is not None
    k = keys
    body = {
        "create_request": {
            "key": b64(k.participants),
            "range_end": b64(prefix_end(k.finished)),
            "start_revision": header.accounted + 1,
            "filters": ["NOPUT"],
        }
    }
    names: list[str] = []
    found: list[str] = []  # p/ keys deleted, not yet checked for a finished leave
    batch: list[str] = []  # the keys deleted at one revision

    def settle() -> None:
        done = {key[len(k.done) :] for key in batch if key.startswith(k.done)}
        for key in batch:
            if key.startswith(k.participants) and key[len(k.participants) :] not in done:
                found.append(key)
        batch.clear()

    async def enough() -> bool:
        """Whether ``count`` names are found, once those found are checked."""
        settle()
        if len(names) + len(found) >= count:
            names.extend(await _not_left(client, k, found, view.revision))
            found.clear()
        return len(names) >= count

    at = 0
    try:
        async with client.stream("/v3/watch", body, timeout=5.0) as messages:
            async for message in _until(messages, 2.0):
                if message.get("compact_revision") or message.get("canceled"):
                    break
                for event in message.get("events", []):
                    revision = int(event.get("kv", {}).get("mod_revision", 0))
                    if revision > view.revision:
                        await enough()
                        return [name_of(key) for key in names[:count]]
                    if revision != at:
                        settle()
                        at = revision
                    if revision != view.header_mod:
                        batch.append(unb64(event.get("kv", {}).get("key")).decode(errors="replace"))
                if await enough():  # a revision's events come in one message
                    return [name_of(key) for key in names[:count]]
    except _MISSED:
        pass  # the names are for the sample and the health only: the counts stay exact
    settle()
    with contextlib.suppress(*_MISSED):
        names.extend(await _not_left(client, k, found, view.revision))
    return [name_of(key) for key in names[:count]]


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
