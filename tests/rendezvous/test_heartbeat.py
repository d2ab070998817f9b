"""The heartbeat task of a member, on a manual clock, with a backend that holds keep-alives."""

from __future__ import annotations

import asyncio
import logging

import pytest

from aelastic.core.clock import SYSTEM_CLOCK, ManualClock
from aelastic.core.errors import RendezvousError, RendezvousLostError
from aelastic.core.params import RendezvousSettings
from aelastic.core.state import Outcome, Reply, Status
from aelastic.rendezvous._heartbeat import Heartbeats

pytestmark = pytest.mark.anyio


class _Member:
    """A member whose backend holds each keep-alive as long as asked (nothing changes) and
    always reports an old heartbeat in the run (a slow member): the task keeps planning
    checks of its expiry."""

    def __init__(self, clock: ManualClock, oldest_age: float) -> None:
        self.clock = clock
        self.oldest_age = oldest_age
        self.holds: list[float] = []
        self._status = Status(token="ab.1", complete=True)

    @property
    def status(self) -> Status | None:
        return self._status

    async def keep_alive(self, hold: float) -> Reply:
        self.holds.append(hold)
        await self.clock.sleep(hold)  # held by the server: no news
        now_ms = round(self.clock.time() * 1000)
        status = Status(token="ab.1", complete=True, now_ms=now_ms)
        oldest = now_ms - round(self.oldest_age * 1000)
        return Reply(Outcome.FINISH, status, known=True, oldest_beat_ms=oldest)

    def lost_membership(self) -> None:
        raise AssertionError("never removed here")


async def test_a_planned_expiry_check_keeps_the_beat_held_so_watchers_stay_asleep() -> None:
    clock = ManualClock()
    settings = RendezvousSettings("run", 1, 2, keep_alive_interval=1.0)
    member = _Member(clock, oldest_age=2.5)  # expires 0.5 s after each answer: checks due
    beats = Heartbeats(member, settings, clock, holds=True, name="beats")
    beats.start()
    dropped = 0
    try:
        for _ in range(400):  # 20 s
            clock.advance(0.05)
            for _ in range(5):
                await asyncio.sleep(0)
            if member.holds and not beats.holding:
                dropped += 1
    finally:
        await beats.stop()
    assert len(member.holds) >= 15
    # Every beat is held (a check's beat too): a watcher relying on them never has to wake
    # and ask the backend itself.
    assert all(hold > 0 for hold in member.holds), member.holds
    assert dropped == 0


class _Silent:
    """A member whose keep-alives never get an answer, or fail as ``failure`` says."""

    def __init__(self, failure: BaseException | None = None) -> None:
        self.failure = failure
        self.calls = 0
        self.lost = False

    @property
    def status(self) -> Status | None:
        return None

    async def keep_alive(self, hold: float) -> Reply:
        self.calls += 1
        if self.failure is not None:
            raise self.failure
        await asyncio.Event().wait()
        raise AssertionError("never answered")

    def lost_membership(self) -> None:
        self.lost = True


async def test_a_beat_without_an_answer_says_why(caplog: pytest.LogCaptureFixture) -> None:
    settings = RendezvousSettings("run", 1, 2, keep_alive_interval=0.1, heartbeat_timeout=0.2)
    member = _Silent()
    beats = Heartbeats(member, settings, SYSTEM_CLOCK, holds=False, name="beats")
    with caplog.at_level(logging.WARNING, "aelastic.rendezvous"):
        beats.start()
        try:
            for _ in range(100):
                if "failed to send a heartbeat" in caplog.text:
                    break
                await asyncio.sleep(0.05)
        finally:
            await beats.stop()
    failed = [r.getMessage() for r in caplog.records if "heartbeat" in r.getMessage()]
    assert failed and failed[0] == "beats failed to send a heartbeat: no answer within 0.2 s"
    # An error without a text is named by its type, never an empty reason.
    caplog.clear()
    beats = Heartbeats(_Silent(RendezvousError()), settings, SYSTEM_CLOCK, False, "beats")
    with caplog.at_level(logging.WARNING, "aelastic.rendezvous"):
        beats.start()
        await asyncio.sleep(0.3)
        await beats.stop()
    assert "beats failed to send a heartbeat: RendezvousError" in caplog.text


async def test_a_lost_rendezvous_ends_the_beats_without_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = RendezvousSettings("run", 1, 2, keep_alive_interval=0.1)
    member = _Silent(RendezvousLostError("the host is gone"))
    beats = Heartbeats(member, settings, SYSTEM_CLOCK, holds=True, name="beats")
    with caplog.at_level(logging.WARNING, "aelastic.rendezvous"):
        beats.start()
        for _ in range(100):
            if not beats.running:
                break
            await asyncio.sleep(0.02)
        await beats.stop()
    assert member.calls == 1 and not beats.running and not beats.holding
    assert "heartbeat" not in caplog.text
