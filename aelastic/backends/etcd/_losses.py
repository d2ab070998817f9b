"""The members etcd dropped from a complete round, by name, from the history of the deletions.

How it works: when a node's lease expires etcd deletes its keys and tells nobody why; the
counts show how many members a round lost, not who. :func:`lost_names` reads the history of
the node lists (``p/`` to ``q/``: one watch from the revision the run's header accounted
for, up to the revision a request read) and names each participant whose key was deleted
there, but those of the header's own write (accounted already), the members that left having
finished (their ``q/`` key written at that revision) and those that were done (their
``pd/`` key deleted with it). Events are taken a revision at a time (etcd sends a revision's
events together): a lease's keys are deleted in key order, ``p/`` before ``pd/``. Best
effort: history compacted away, or a member that does not answer, leaves names out (the
lost sample and the hosts counted in the job's health miss them; the counts stay exact).
"""

from __future__ import annotations

from typing import Any

from ...core.errors import RendezvousConnectionError
from ...core.race import wait_within
from ._client import EtcdClient, EtcdError, b64, unb64
from ._layout import RunKeys, prefix_end
from ._plan import View

__all__ = ["lost_names"]


async def lost_names(
    client: EtcdClient, keys: RunKeys, view: View, count: int, name_of: Any
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
        }
    }
    names: list[str] = []
    batch: list[tuple[str, bool]] = []  # the events of one revision: key, deleted

    def settle() -> bool:
        """Take the losses of the revision in ``batch``; whether ``count`` are found."""
        spared = {key[len(k.finished) :] for key, deleted in batch
                  if not deleted and key.startswith(k.finished)}  # fmt: skip
        spared.update(key[len(k.done) :] for key, deleted in batch
                      if deleted and key.startswith(k.done))  # fmt: skip
        for key, deleted in batch:
            member = deleted and key.startswith(k.participants)
            if member and key[len(k.participants) :] not in spared:
                names.append(name_of(key))
        batch.clear()
        return len(names) >= count

    at = 0
    try:
        async with client.stream("/v3/watch", body, timeout=5.0) as messages:
            async for message in _until(messages, 2.0):
                if message.get("compact_revision") or message.get("canceled"):
                    break
                for event in message.get("events", []):
                    kv = event.get("kv", {})
                    revision = int(kv.get("mod_revision", 0))
                    if revision != at and (settle() or revision > view.revision):
                        return names[:count]
                    at = revision
                    if revision != view.header_mod:
                        key = unb64(kv.get("key")).decode(errors="replace")
                        batch.append((key, event.get("type") == "DELETE"))
                if settle():  # a revision's events come in one message
                    return names[:count]
    except (ConnectionError, EtcdError, RendezvousConnectionError, TimeoutError):
        pass  # the names are for the sample and the health only: the counts stay exact
    settle()
    return names[:count]


async def _until(messages: Any, idle: float) -> Any:
    """``messages`` until none came for ``idle`` seconds."""
    iterator = messages.__aiter__()
    while True:
        try:
            yield await wait_within(iterator.__anext__(), idle)
        except (StopAsyncIteration, TimeoutError):
            return
