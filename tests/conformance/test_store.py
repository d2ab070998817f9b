"""The members' key-value store, on every backend (torch ``Store`` semantics)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import anyio
import pytest

from aelastic import StoreTimeoutError
from aelastic.backends import create_backend
from aelastic.store import Store

from .conftest import MakeParams

pytestmark = pytest.mark.anyio

PROMPT = 10.0


@pytest.fixture
async def store(make_params: MakeParams) -> AsyncIterator[Store]:
    backend = create_backend(make_params(1, 1))
    try:
        yield Store(backend, prefix="r0/", timeout=5.0)
    finally:
        await backend.aclose()


async def test_set_get_bytes_and_str(store: Store) -> None:
    await store.set("a", b"\x00\xffbinary")
    await store.set("b", "text")
    assert await store.get("a") == b"\x00\xffbinary"
    assert await store.get("b") == b"text"
    assert await store.try_get("missing") is None


async def test_get_waits_for_a_key_set_later(store: Store) -> None:
    getter = asyncio.ensure_future(store.get("later"))
    await asyncio.sleep(0.05)
    assert not getter.done()
    await store.set("later", b"value")
    with anyio.fail_after(PROMPT):
        assert await getter == b"value"


async def test_get_times_out_with_store_timeout_error(store: Store) -> None:
    with anyio.fail_after(PROMPT), pytest.raises(StoreTimeoutError, match="never"):
        await store.get("never", timeout=0.2)
    with anyio.fail_after(PROMPT), pytest.raises(TimeoutError):
        await store.wait(["never"], timeout=0.2)


async def test_add_is_atomic_under_concurrency(store: Store) -> None:
    assert await store.add("counter", 5) == 5
    results = await asyncio.gather(*(store.add("counter", 1) for _ in range(20)))
    assert sorted(results) == list(range(6, 26))
    assert await store.get("counter") == b"25"
    assert await store.add("counter", -25) == 0


async def test_add_on_a_non_integer_is_a_value_error(store: Store) -> None:
    await store.set("text", b"abc")
    with pytest.raises(ValueError, match="not an integer"):
        await store.add("text", 1)
    assert await store.get("text") == b"abc"


async def test_compare_set_follows_torch(store: Store) -> None:
    # Missing key and empty expectation: set.
    assert await store.compare_set("k", b"", b"first") == b"first"
    # Mismatch: unchanged, current value returned.
    assert await store.compare_set("k", b"other", b"second") == b"first"
    # Match: replaced.
    assert await store.compare_set("k", "first", "second") == b"second"
    # Missing key with a non-empty expectation: not set, expectation returned.
    assert await store.compare_set("absent", b"x", b"y") == b"x"
    assert await store.try_get("absent") is None


async def test_compare_set_has_one_winner(store: Store) -> None:
    results = await asyncio.gather(
        *(store.compare_set("leader", b"", f"node{i}".encode()) for i in range(10))
    )
    winner = await store.get("leader")
    assert all(r == winner for r in results)


async def test_multi_get_waits_for_all_keys(store: Store) -> None:
    await store.multi_set(["x", "y"], [b"1", b"2"])
    reader = asyncio.ensure_future(store.multi_get(["x", "y", "z"]))
    await asyncio.sleep(0.05)
    assert not reader.done()
    await store.set("z", b"3")
    with anyio.fail_after(PROMPT):
        assert await reader == [b"1", b"2", b"3"]


async def test_wait_and_check(store: Store) -> None:
    assert not await store.check(["p", "q"])
    waiter = asyncio.ensure_future(store.wait(["p", "q"]))
    await store.set("p", b"")
    await asyncio.sleep(0.05)
    assert not waiter.done()
    await store.set("q", b"")
    with anyio.fail_after(PROMPT):
        await waiter
    assert await store.check(["p", "q"])


async def test_delete_key(store: Store) -> None:
    await store.set("gone", b"1")
    assert await store.delete_key("gone") is True
    assert await store.delete_key("gone") is False
    assert await store.try_get("gone") is None


async def test_scopes_do_not_collide(store: Store) -> None:
    other = Store(store._backend, prefix="r1/")
    await store.set("key", b"round0")
    await other.set("key", b"round1")
    nested = store.scoped("agent/")
    await nested.set("key", b"nested")
    assert await store.get("key") == b"round0"
    assert await other.get("key") == b"round1"
    assert await nested.get("key") == b"nested"
    assert nested.prefix == "r0/agent/"


async def test_values_are_shared_between_backend_instances(make_params: MakeParams) -> None:
    writer_backend = create_backend(make_params(1, 1))
    reader_backend = create_backend(make_params(1, 1))
    try:
        writer, reader = Store(writer_backend, "s/"), Store(reader_backend, "s/")
        pending = asyncio.ensure_future(reader.get("shared", timeout=PROMPT))
        await writer.set("shared", b"hello")
        with anyio.fail_after(PROMPT):
            assert await pending == b"hello"
    finally:
        await writer_backend.aclose()
        await reader_backend.aclose()
