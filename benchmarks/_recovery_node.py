"""One process of ``rdzv_recovery.py``: its share of the simulated nodes, each an agent's
rendezvous side with a stand-in worker whose "collective" is a socket to a peer.

Run by the benchmark as ``python -m benchmarks._recovery_node SPEC`` (SPEC is JSON: backend,
endpoint, run_id, min_nodes, max_nodes, count (nodes in this process), local_addr, loop
(``asyncio`` or ``uvloop``), config). Every node is a handler of its own
(``share_connections=0``), all of the process's nodes tasks of one event loop.

Each node does what aelastic's agent does for its rendezvous (``agent/agent.py``), minus
the worker processes:

* before each join it offers its stand-in worker's port for the workers' bootstrap
  (``prepare_join``: the master port, should it be rank 0), then ``next_rendezvous()``;
* it races the round's group changes (``RoundGroup.next_change``, the policy's ``decide``:
  ``agent/_supervise.py``) against its stand-in worker's collective breaking: a broken
  collective is explained as the agent's :class:`~aelastic.agent.loop.recover.PeerLoss` does,
  ``RoundGroup.loss_within`` (the survivor has the backend report the departures, and waits
  for the change that says a member was lost);
* on a rescale it stops its stand-in worker (its sockets close, as a stopped worker's do: the
  collectives of its peers break in turn) and joins the next round.

The stand-in worker listens on a loopback port and, once told its peers, connects to the
next rank's (a ring) and, with ``breaks=all``, to the victim's too: its collective breaks
when a socket to a peer ends (the peer's process died, or its agent stopped it).

Protocol, one JSON object a line. On stdin: ``{"cmd": "form", "at": T}`` (join at
wall-clock time T), ``{"cmd": "wire", "round": R, "ports": [...], "victim": P}`` (the
stand-in workers of round R connect: ``ports[rank]`` is rank's worker; ``victim``, a port
or null), ``{"cmd": "exit"}`` (or end of input). On stdout: ``ready``; per node ``formed``
(every ``next_rendezvous`` return: round, rank, world, master, port), ``failed``, ``wired``,
``broke`` (its collective broke), ``reacting`` (the agent's decision and what told it);
``bye``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import threading
import time
from typing import Any

from aelastic import RendezvousParameters
from aelastic.agent.loop.membership import RoundGroup
from aelastic.agent.loop.policy import Action, Observation, Trigger, decide
from aelastic.core.race import first_of
from aelastic.core.view import MembershipView
from aelastic.rendezvous import create_handler
from benchmarks._scale_node import Emitter, raise_fd_limit

_EXIT_GRACE = 20.0  # seconds the nodes get to release their connections at exit
_LOOPBACK = "127.0.0.1"
#: Restarts each simulated agent may spend (a peer's loss spends none).
_RESTARTS = 3


class StandIn:
    """A stand-in worker: a listening socket, and sockets to peers that end when they die."""

    def __init__(self) -> None:
        self.port = 0
        self.broken = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._readers: set[asyncio.Task[None]] = set()
        self._stopped = False

    async def listen(self) -> None:
        self._server = await asyncio.start_server(self._accepted, _LOOPBACK, 0, backlog=4096)
        self.port = self._server.sockets[0].getsockname()[1]

    def start(self) -> None:
        """A new worker of the next attempt: nothing broken, no peers yet."""
        self.broken = asyncio.Event()
        self._stopped = False

    async def connect(self, port: int) -> None:
        reader, writer = await asyncio.open_connection(_LOOPBACK, port)
        self._watch(reader, writer)

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._stopped:
            writer.transport.abort()
            return
        self._watch(reader, writer)

    def _watch(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        broken = self.broken
        task = asyncio.ensure_future(self._read(reader, broken))
        self._readers.add(task)
        task.add_done_callback(self._readers.discard)

    async def _read(self, reader: asyncio.StreamReader, broken: asyncio.Event) -> None:
        with contextlib.suppress(OSError):
            await reader.read(1)  # nothing is ever sent: this returns when the peer ends
        if not self._stopped:
            broken.set()

    def stop(self) -> None:
        """The worker is stopped: its sockets close (its peers' collectives break)."""
        self._stopped = True
        for writer in self._writers:
            writer.transport.abort()
        self._writers.clear()
        for task in self._readers:
            task.cancel()


class Node:
    """One simulated node: the rendezvous side of one agent, and its stand-in worker."""

    def __init__(self, index: int, spec: dict[str, Any], emit: Emitter) -> None:
        self.index = index
        self._spec = spec
        self._emit = emit
        self.worker = StandIn()
        self.handler: Any = None
        self.rank: int | None = None
        self.round: int | None = None
        self._go = asyncio.Event()
        self._at = 0.0

    def _event(self, ev: str, **fields: Any) -> None:
        self._emit(ev=ev, i=self.index, t=time.time(), **fields)

    async def prepare(self) -> bool:
        spec = self._spec
        try:
            params = RendezvousParameters(
                spec["backend"],
                spec["endpoint"],
                spec["run_id"],
                spec["min_nodes"],
                spec["max_nodes"],
                local_addr=spec["local_addr"],
                **spec["config"],
            )
            self.handler = create_handler(params)
            await self.worker.listen()
        except Exception as exc:
            self._event("failed", error=repr(exc))
            return False
        return True

    def start(self, at: float) -> None:
        self._at = at
        self._go.set()

    async def wire(self, command: dict[str, Any]) -> None:
        """Connect the stand-in worker to its peers of round ``command["round"]``."""
        if self.round != command["round"] or self.rank is None:
            return
        ports, victim = command["ports"], command.get("victim")
        targets = [ports[(self.rank + 1) % len(ports)]]
        if victim is not None and victim != self.worker.port:
            targets.append(victim)
        try:
            for port in dict.fromkeys(targets):
                await self.worker.connect(port)
        except OSError as exc:
            self._event("failed", error=f"wiring: {exc!r}")
            return
        self._event("wired")

    async def life(self) -> None:
        await self._go.wait()
        await asyncio.sleep(max(self._at - time.time(), 0.0))
        handler = self.handler
        while True:
            self.worker.start()
            handler.set_profile("default", 1, self.worker.port)  # agent/_round.py: prepare_join
            try:
                info = await handler.next_rendezvous()
            except Exception as exc:
                self._event("failed", error=repr(exc))
                return
            bootstrap = info.bootstrap_store_info
            self.rank, self.round = info.rank, handler.round
            self._event(
                "formed",
                round=handler.round,
                rank=info.rank,
                world=info.world_size,
                master=[bootstrap.master_addr, bootstrap.master_port],
                port=self.worker.port,
                addr=handler.node.addr,
            )
            round_group = RoundGroup(handler, info.store)
            observation, via = await self._supervise(round_group)
            decision = decide(observation, _RESTARTS)
            self._event(
                "reacting",
                round=self.round,
                via=via,
                action=decision.action.value,
                reason=decision.reason,
            )
            self.worker.stop()  # agent.py: _stop_workers (in place: told to leave the group)
            if decision.action not in (Action.RESCALE, Action.RESTART):
                return

    async def _supervise(self, round_group: RoundGroup) -> tuple[Observation, str]:
        """The first thing that calls for action: a group change, or the collective broke."""
        handler = self.handler

        async def group_change() -> tuple[Observation, str]:  # agent/_supervise.py
            since: MembershipView | None = None
            while True:
                since = await round_group.next_change(since)
                observation = await round_group.observe(since)
                if decide(observation, _RESTARTS).action is not Action.CONTINUE:
                    return observation, "watch"

        async def collective() -> tuple[Observation, str]:  # agent/_recover.py: PeerLoss
            await self.worker.broken.wait()
            self._event("broke")
            settings = handler.settings
            grace = settings.heartbeat_window + settings.keep_alive_interval + 1.0
            explained = await round_group.loss_within(grace)
            if explained is None:
                return Observation(Trigger.WORKER_FAILED), "collective, unexplained"
            return explained, "collective"

        _, outcome = await first_of(group_change, collective)
        result: tuple[Observation, str] = outcome
        return result

    async def close(self) -> None:
        self.worker.stop()
        if self.handler is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.handler.aclose(), _EXIT_GRACE / 2)


async def _main(spec: dict[str, Any], emit: Emitter) -> None:
    loop = asyncio.get_running_loop()
    nodes = [Node(i, spec, emit) for i in range(spec["count"])]
    prepared = await asyncio.gather(*(node.prepare() for node in nodes))
    live = [node for node, ok in zip(nodes, prepared, strict=True) if ok]
    lives = [asyncio.ensure_future(node.life()) for node in live]
    commands: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    def read_stdin() -> None:
        with contextlib.suppress(RuntimeError):  # the loop ended first (an "exit")
            for line in sys.stdin:
                loop.call_soon_threadsafe(commands.put_nowait, json.loads(line))
            loop.call_soon_threadsafe(commands.put_nowait, None)

    threading.Thread(target=read_stdin, daemon=True).start()
    emit(ev="ready", pid=os.getpid(), count=len(nodes))
    while (command := await commands.get()) is not None:
        if command["cmd"] == "form":
            for node in live:
                node.start(command["at"])
        elif command["cmd"] == "wire":
            await asyncio.gather(*(node.wire(command) for node in live))
        elif command["cmd"] == "exit":
            break
    for task in lives:
        task.cancel()
    await asyncio.gather(*lives, return_exceptions=True)
    await asyncio.gather(*(node.close() for node in live))


def main() -> int:
    # Warnings of aelastic's loggers reach the process's log with their level and time,
    # where the harness counts them.
    spec = json.loads(sys.argv[1])
    logging.basicConfig(
        level=spec.get("log_level", "WARNING"),
        format="%(created).3f %(levelname)s %(name)s: %(message)s",
    )
    raise_fd_limit()
    emit = Emitter()
    if spec.get("loop") == "uvloop":
        import uvloop

        uvloop.run(_main(spec, emit))
    else:
        asyncio.run(_main(spec, emit))
    emit(ev="bye", clean=True)
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
