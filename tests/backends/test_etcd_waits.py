"""Which joins the run's watch answers (:mod:`aelastic.backends.etcd._waits`): the rule, and
the last call's end on a real etcd (completed by the participant that started it)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from aelastic import RendezvousParameters
from aelastic.backends.etcd import EtcdBackend, create_backend
from aelastic.backends.etcd._layout import Header
from aelastic.backends.etcd._waits import GRACE_MS, Known, join_waits
from aelastic.core.params import Rules
from aelastic.core.state import NodeDesc, Op, Outcome, Request, Status
from aelastic.core.token import make
from tests._etcd_server import EtcdServer
from tests._rendezvous_helpers import PROMPT

pytestmark = pytest.mark.anyio

RULES = Rules(2, 4, last_call_ms=300, window_ms=30_000)
NODE = NodeDesc("10.0.3.1", 1, 0)


@pytest.fixture(scope="module")
def server() -> Iterator[EtcdServer]:
    with EtcdServer() as etcd:
        yield etcd


def _join(expired: bool = False) -> Request:
    return Request(Op.JOIN, NODE, RULES, port=1, secret="s" * 32, expired=expired)


def test_the_rule() -> None:
    """A waiting node waits while its round stays complete, whatever else the watch brings
    (a lost member, its wait list); a participant of a forming round until the last call
    ends, and a grace past it unless its own request started it; a new round, a closed run,
    an expired join, or news the watched header did not make, are carried out in full."""
    header = Header(epoch="e", round=3, complete=True, gen=7)
    known = Known("w", make("e", 6), 3, "s" * 32)
    status = Status(token=make("e", 7), round=3, complete=True)
    assert join_waits(_join(), known, status, header, 0, True) == (True, None)
    assert join_waits(_join(expired=True), known, status, header, 0, True)[0] is False
    for changed in (Status(token=make("e", 7), round=4), Status(token=make("e", 7), closed=True)):
        assert join_waits(_join(), known, changed, header, 0, True)[0] is False
    foreign = Status(token=make("e", 9), round=3, complete=True)  # a reply's, not the header's
    assert join_waits(_join(), known, foreign, header, 0, True)[0] is False
    forming = Header(epoch="e", round=3, gen=7)
    member = Known("p", make("e", 7), 3, "s" * 32)
    last_call = Status(token=make("e", 7), round=3, deadline_ms=1_000)
    assert join_waits(_join(), member, last_call, forming, 900, False) == (True, 1_000)
    assert join_waits(_join(), member, last_call, forming, 1_000, True) == (False, None)
    waits, until = join_waits(_join(), member, last_call, forming, 1_000, False)
    assert waits and until is not None and 1_000 + GRACE_MS <= until < 1_000 + 2 * GRACE_MS
    assert join_waits(_join(), member, last_call, forming, until, False) == (False, None)
    assert join_waits(_join(), member, Status(token=make("e", 7), round=3), forming, 0, False) == (
        True,
        None,
    )


def _backend(server: EtcdServer, run: str) -> EtcdBackend:
    params = RendezvousParameters("etcd", server.endpoint, run, 2, 4, share_connections=0)
    backend = create_backend(params)
    assert isinstance(backend, EtcdBackend)
    return backend


def _request(i: int) -> Request:
    return Request(Op.JOIN, NodeDesc(f"10.0.3.{i}", 1, 0), RULES, port=1, secret=f"{i:032d}")


@pytest.mark.parametrize("setter_asks", [True, False])
async def test_the_last_call_is_ended_by_the_participant_that_started_it(
    server: EtcdServer, setter_asks: bool
) -> None:
    """At the last call's end, the participant whose join started it completes the round;
    another asks only a grace later (its join meanwhile is answered from the watch, without
    a read of the run), and completes it itself when the setter never asks (its process
    died)."""
    a, b = _backend(server, f"setter-{setter_asks}"), _backend(server, f"setter-{setter_asks}")
    try:
        first = await a.apply(_request(0))
        assert first.outcome is Outcome.WAIT
        started = await b.apply(_request(1))  # min_nodes: b's join starts the last call
        assert started.outcome is Outcome.WAIT and started.status.deadline_ms is not None
        seen = await a.wait_for_change(first.status.token, PROMPT)  # a's watch tells it
        assert seen is not None and seen.deadline_ms is not None
        await asyncio.sleep((seen.deadline_ms - seen.now_ms) / 1000 + 0.05)
        assert a._shared is not None
        sent = a._shared.client.requests
        early = await a.apply(_request(0))  # past the end, but not a's to complete
        assert early.outcome is Outcome.WAIT and not early.status.complete
        assert early.wake_at_ms is not None and early.wake_at_ms > seen.deadline_ms + GRACE_MS - 1
        await asyncio.sleep(0.1)  # (its lease renewal goes in the background)
        assert a._shared.client.requests - sent <= 1  # no read of the run: the renewal
        if setter_asks:
            done = await b.apply(_request(1))
            assert done.outcome is Outcome.FINISH and done.rank == 1
            news = await a.wait_for_change(early.status.token, PROMPT)
            assert news is not None and news.complete
        else:
            await asyncio.sleep((early.wake_at_ms - early.status.now_ms) / 1000 + 0.05)
        joined = await a.apply(_request(0))
        assert joined.outcome is Outcome.FINISH and joined.rank == 0
    finally:
        await a.aclose()
        await b.aclose()
