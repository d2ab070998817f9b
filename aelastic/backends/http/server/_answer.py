"""Answering one rendezvous request on the server: apply, hold, apply again, wait until durable.

How it works: :func:`answer` is what ``POST /v1/runs/<id>/rendezvous`` and the rendezvous
channel (:mod:`._channel`) both do with a request. It applies the request at once. A held
keep-alive then waits until the run's status token moves (a round transition) or the hold
ends, and answers with the fresh status (brought early by a change, the keep-alive is
applied again, as of its answer); it answers at once when the node has not seen the status
it carries (``seen``: a change came between two beats). A *wait* answer (a join
waiting for nodes or for the last call) is held the same way and the request applied again
after each change, as the node would; a join is then one request. Before answering it
waits until the change is durable (``--persist``). :func:`failure` says how an error raised
while answering is told to the client.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

from ....core.state import Op, Outcome, Reply, Request
from ..._engine import now_ms
from ..wire import SchemaError
from ._runs import PersistenceError, RunLimitError, RunStore
from ._tenancy import Refused

__all__ = ["answer", "failure"]


async def answer(
    store: RunStore,
    run_id: str,
    request: Request,
    hold: float,
    seen: str | None,
    gone: Callable[[], bool],
) -> Reply:
    """Apply ``request`` to ``run_id``, hold it as asked, and return the reply to send.

    Args:
        store: The server's runs.
        run_id: The run (validated).
        request: The rendezvous request.
        hold: Seconds the answer may be held (0: at once).
        seen: The status token the node has seen (held keep-alives), or ``None``.
        gone: Whether the client went away (a held join then stops applying itself).

    Raises:
        RunLimitError: The request would make a run past the server's limit.
        PersistenceError: The change could not be made durable.
    """
    store.admit(run_id)
    engine = store.engine
    reply = engine.apply(run_id, request, now_ms())
    loop = asyncio.get_running_loop()
    deadline = loop.time() + hold
    # Held: wait for the status to change (or the last call to end), then ask again, as
    # the node would; a join is then one request.
    held = request.op is Op.KEEP_ALIVE and reply.known and hold > 0 and not store.closing
    # A held heartbeat is also this node's notification channel: it answers when the
    # status's token moves (a round transition), or when the next beat is due; at once
    # when the node has not seen the status it carries (a change came between two beats).
    held = held and (seen is None or seen == reply.status.token)
    if held and await _held(store, run_id, request, reply.status.token, hold):
        if gone():
            reply = replace(reply, status=engine.status(run_id, now_ms()))
        else:
            # Brought early by news: applied again now, as the node, still holding its
            # request, would send it. The news answers every member at once, and their next
            # beats come in a burst a moment later; on a busy server a beat counted from
            # before the news could then expire (seen at 4,096 nodes on 2 cores).
            reply = engine.apply(run_id, request, now_ms())
    while reply.outcome is Outcome.WAIT and not store.closing:
        remaining = deadline - loop.time()
        if reply.wake_at_ms is not None:
            remaining = min(remaining, (reply.wake_at_ms - reply.status.now_ms) / 1000 + 0.002)
        if remaining <= 0:
            break
        await store.durable()
        changed = await engine.wait_status(run_id, reply.status.token, remaining)
        if not changed and (reply.wake_at_ms is None or loop.time() >= deadline):
            break
        if gone() or not engine.knows(run_id, request.node):
            break  # the node went away (a cancelled join that left): never join it again
        reply = engine.apply(run_id, request, now_ms())
    await store.durable()
    return reply


async def _held(store: RunStore, run_id: str, request: Request, token: str, hold: float) -> bool:
    """Hold a keep-alive until the status moves from ``token`` (``True``) or ``hold``
    seconds passed, its node counted in :attr:`RunStore.holding` meanwhile."""
    store.holding.add(run_id, request.node)
    try:
        return await store.engine.wait_status(run_id, token, hold)
    finally:
        store.holding.remove(run_id, request.node)


def failure(exc: Exception) -> tuple[int, str] | None:
    """The status and message telling the client about ``exc`` (``None``: a bug, 500)."""
    if isinstance(exc, SchemaError):
        return 400, str(exc)
    if isinstance(exc, PersistenceError | RunLimitError):
        return 503, str(exc)
    if isinstance(exc, Refused):
        return exc.status, str(exc)
    return None
