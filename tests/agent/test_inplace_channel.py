"""The agent's in-place channel keeps only workers that made their current group: one still
making it is blocked in torch's store connection (up to its timeout) and cannot follow a
newer round, so it is started again. (Seen under heavy load: a spurious prune while the
workers were still making their first group kept them, and each round after waited 60 s for
a master that had moved on.)

Real parts: the agent's Unix socket; the workers' side is the channel's JSON lines, sent
from the test as a worker's ``aelastic.worker.InPlace`` sends them."""

from __future__ import annotations

import asyncio
import json
import stat
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from aelastic.agent.loop.policy import Action, Decision
from aelastic.agent.loop.recover import PeerLoss
from aelastic.agent.processes.inplace import InPlaceChannel
from aelastic.worker._inplace import ENV_SOCKET

pytestmark = pytest.mark.anyio

RESCALE = Decision(Action.RESCALE, "1 member(s) of the round lost")


class FakeWorker:
    """A worker's end of the channel (its process is the stand-in's pid)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.process = SimpleNamespace(pid=pid, returncode=None, local_rank=pid % 10)
        self._writer: asyncio.StreamWriter | None = None

    async def connect(self, path: str) -> None:
        _, self._writer = await asyncio.open_unix_connection(path)
        await self.say(op="hello")

    async def say(self, **message: Any) -> None:
        assert self._writer is not None
        self._writer.write((json.dumps({**message, "pid": self.pid}) + "\n").encode())
        await self._writer.drain()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


async def until(check: Any) -> None:
    for _ in range(500):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("never")


def _made(socket: Path) -> tuple[bool, int]:
    """Whether ``socket`` is one, and its directory's mode (0: none)."""
    if not socket.parent.exists():
        return False, 0
    return socket.is_socket(), stat.S_IMODE(socket.parent.stat().st_mode)


async def test_the_socket_is_made_where_its_path_fits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    long = tmp_path / ("t" * 100)  # a TMPDIR a scheduler may set: too long for a socket
    long.mkdir()
    monkeypatch.setenv("TMPDIR", str(long))
    monkeypatch.setattr(tempfile, "tempdir", None)
    channel = InPlaceChannel()
    await channel.start()
    try:
        path = Path(channel.env()[ENV_SOCKET])
        assert len(str(path)) <= 107
        assert _made(path) == (True, 0o700)  # a socket, in a directory of the agent's own
    finally:
        await channel.aclose()
    assert _made(path) == (False, 0)


async def test_only_workers_that_made_their_current_group_are_kept() -> None:
    channel = InPlaceChannel()
    await channel.start()
    workers = [FakeWorker(101), FakeWorker(102)]
    processes: Any = [w.process for w in workers]
    recovery = PeerLoss(handler=None)  # type: ignore[arg-type]
    recovery.channel = channel
    try:
        for w in workers:
            await w.connect(channel.env()[ENV_SOCKET])
        await until(lambda: channel.opted_in(processes))
        assert not channel.settled(processes)  # both still making their first group
        assert not recovery.hold(RESCALE, SimpleNamespace(processes=processes))  # type: ignore[arg-type]
        await workers[0].say(op="joined", gen=0)
        await until(lambda: channel._workers[101].joined == 0)
        assert not channel.settled(processes)  # one is
        await workers[1].say(op="joined", gen=0)
        await until(lambda: channel.settled(processes))
        assert recovery.hold(RESCALE, SimpleNamespace(processes=processes))  # type: ignore[arg-type]
        channel.resume({101: {}, 102: {}})  # the next round: generation 1
        assert not channel.settled(processes)  # making the new group: not kept again yet
        for w in workers:
            await w.say(op="joined", gen=1)
        await until(lambda: channel.settled(processes))
    finally:
        for w in workers:
            w.close()
        await channel.aclose()
