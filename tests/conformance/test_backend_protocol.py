"""The backend protocol's key-value primitives, on every backend (the memory backend's
semantics are the reference)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import anyio
import pytest

from aelastic import RendezvousParameters
from aelastic.backends import RendezvousBackend, create_backend
from tests._rendezvous_helpers import PROMPT, SECRET

from .conftest import MakeParams

pytestmark = pytest.mark.anyio


@pytest.fixture
async def made(make_params: MakeParams) -> AsyncIterator[RendezvousBackend]:
    backend = create_backend(make_params(1, 1))
    try:
        yield backend
    finally:
        await backend.aclose()


async def test_key_value_primitives(made: RendezvousBackend) -> None:
    b = made
    await b.kv_set("a", b"1")
    assert await b.kv_get(["a", "missing", ""]) == [b"1", None, None]
    assert await b.kv_get([]) == []
    assert await b.kv_add("n", 5) == 5
    assert await b.kv_add("n", -7) == -2
    assert await b.kv_add("a", 0) == 1
    await b.kv_set("text", b"abc")
    with pytest.raises(ValueError, match="not an integer"):
        await b.kv_add("text", 1)
    assert await b.kv_compare_set("c", None, b"v") == b"v"
    assert await b.kv_compare_set("c", None, b"w") == b"v"
    assert await b.kv_compare_set("c", b"x", b"w") == b"v"
    assert await b.kv_compare_set("c", b"v", b"w") == b"w"
    assert await b.kv_compare_set("absent", b"e", b"d") == b"e"
    assert await b.kv_get(["absent"]) == [None]
    assert await b.kv_delete("c") is True
    assert await b.kv_delete("c") is False
    assert await b.kv_wait(["a"], 0) is True
    assert await b.kv_wait(["a", "zz"], 0) is False
    assert await b.kv_wait(["zz"], 0.2) is False
    assert await b.kv_wait([], 0) is True
    binary = bytes(range(256))
    await b.kv_set("bin", binary)
    await b.kv_set("ünï{}:*", b"")
    assert await b.kv_get(["bin", "ünï{}:*"]) == [binary, b""]


async def test_kv_wait_wakes_when_the_keys_appear(make_params: MakeParams) -> None:
    # recheck_interval: Redis's safety-net re-read is pushed out, so only a notification wakes.
    params = make_params(1, 1, recheck_interval=60)
    waiting_backend, writer = create_backend(params), create_backend(params)
    try:
        waiter = asyncio.ensure_future(waiting_backend.kv_wait(["k1", "k2"], 60))
        await writer.kv_set("k1", b"1")
        await asyncio.sleep(0.1)
        assert not waiter.done()  # still waiting for k2
        start = time.monotonic()
        await writer.kv_set("k2", b"2")
        with anyio.fail_after(PROMPT):
            assert await waiter is True
        assert time.monotonic() - start < 2.0
    finally:
        await waiting_backend.aclose()
        await writer.aclose()


async def test_counters_are_signed_64_bit_on_every_backend(made: RendezvousBackend) -> None:
    """torch's stores add signed 64-bit integers: leaving that range is a ValueError, and
    the stored value stays as it was (the same on every backend)."""
    top, bottom = 2**63 - 1, -(2**63)
    assert await made.kv_add("c", top) == top
    with pytest.raises(ValueError):
        await made.kv_add("c", 1)
    assert await made.kv_get(["c"]) == [str(top).encode()]
    assert await made.kv_add("d", bottom) == bottom
    with pytest.raises(ValueError):
        await made.kv_add("d", -1)
    await made.kv_set("big", str(2**64).encode())  # set by someone else: past 64 bits
    with pytest.raises(ValueError):
        await made.kv_add("big", 0)
    assert await made.kv_get(["big"]) == [str(2**64).encode()]


async def test_list_runs_names_the_runs_with_a_state(
    backend: str, endpoint: str, run_id: str
) -> None:
    """``list_runs`` (``aelastic status --list``, the dashboard) names every run that has a
    rendezvous state, with its status; a run with only store keys is not one. An id with
    braces is named on Redis by its tag, which reads the same run."""
    from aelastic.core.protocol import RunLister
    from aelastic.core.state import NodeDesc, Op, Request
    from aelastic.rendezvous import RendezvousSettings

    ids = [f"{run_id}-a", f"{run_id}-b", f"{run_id}-{{braces}}"]
    made = [
        create_backend(RendezvousParameters(backend, endpoint, r, 1, 1, read_timeout=10))
        for r in [*ids, f"{run_id}-kv-only"]
    ]
    try:
        for number, made_backend in enumerate(made[:3]):
            settings = RendezvousSettings.from_parameters(
                RendezvousParameters(backend, endpoint, ids[number], 1, 1)
            )
            node = NodeDesc("127.0.0.1", 1000 + number, 0)
            await made_backend.apply(Request(Op.JOIN, node, settings.rules, secret=SECRET))
        await made[3].kv_set("k", b"v")
        lister = made[0]
        assert isinstance(lister, RunLister)
        listed = dict(await lister.list_runs(10_000))
        assert {ids[0], ids[1]} <= set(listed)
        assert f"{run_id}-kv-only" not in listed
        braced = [r for r in listed if r == ids[2] or r.startswith("sha1-")]
        assert braced, listed
        for run in ids[:2]:
            status = listed[run]
            assert status.participants == 1 and status.complete and status.world == 1
        assert len(await lister.list_runs(1)) == 1
        if backend == "redis":
            tag = next(r for r in braced if r.startswith("sha1-"))
            same = create_backend(RendezvousParameters(backend, endpoint, tag, 1, 1))
            try:
                snapshot = await same.snapshot()
                assert snapshot is not None and snapshot.status.participants == 1
            finally:
                await same.aclose()
    finally:
        for made_backend in made:
            await made_backend.reset()
            await made_backend.aclose()
