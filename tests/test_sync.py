"""The sync facade: torch's blocking names from threads, scripts and beside a running loop."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest

from aelastic import (
    RendezvousClosedError,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
    StoreTimeoutError,
)
from aelastic import sync as aelastic_sync
from aelastic.sync import SyncRendezvousHandler, SyncStore


def params(run_id: str, min_nodes: int, max_nodes: int, **conf: object) -> RendezvousParameters:
    conf.setdefault("last_call_timeout", 0.1)
    return RendezvousParameters("memory", "sync", run_id, min_nodes, max_nodes, **conf)


def join_in_threads(handlers: list[SyncRendezvousHandler]) -> list[RendezvousInfo[SyncStore]]:
    with ThreadPoolExecutor(len(handlers)) as pool:
        return list(pool.map(lambda h: h.next_rendezvous(), handlers, timeout=30))


def test_threads_form_a_group_with_torch_names(run_id: str) -> None:
    handlers = [aelastic_sync.create_handler(params(run_id, 3, 3)) for _ in range(3)]
    try:
        infos = join_in_threads(handlers)
        assert sorted(i.rank for i in infos) == [0, 1, 2]
        assert {i.world_size for i in infos} == {3}
        h = handlers[0]
        assert h.get_backend() == "memory" and h.get_run_id() == run_id
        assert h.num_nodes_waiting() == 0 and not h.is_closed()
        assert h.use_agent_store is False
        store = infos[0].store
        assert isinstance(store, SyncStore)
        store.set("k", b"v")
        assert infos[2].store.get("k") == b"v"
        assert store.add("n", 2) == 2
        assert store.compare_set("c", "", "x") == b"x"
        store.multi_set(["a", "b"], ["1", "2"])
        assert store.multi_get(["a", "b"]) == [b"1", b"2"]
        store.wait(["a"], timedelta(seconds=1))
        assert store.check(["a", "b"]) and store.delete_key("a")
        store.set_timeout(timedelta(seconds=0.2))
        assert store.timeout == timedelta(seconds=0.2)
        with pytest.raises(StoreTimeoutError):
            store.get("never")
        assert h.shutdown() is True
        assert handlers[1].is_closed()
        with pytest.raises(RendezvousClosedError):
            handlers[1].next_rendezvous()
    finally:
        for handler in handlers:
            handler.close()


def test_works_from_a_thread_while_another_loop_runs(run_id: str) -> None:
    async def service() -> list[int]:
        # A running loop in this thread; the facade is used from worker threads.
        handlers = [aelastic_sync.create_handler(params(run_id, 2, 2)) for _ in range(2)]
        ticks = 0

        async def heartbeat() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        beat = asyncio.ensure_future(heartbeat())
        infos = await asyncio.gather(*(asyncio.to_thread(h.next_rendezvous) for h in handlers))
        beat.cancel()
        for handler in handlers:
            handler.close()
        assert ticks > 0  # the service's loop was never blocked
        return sorted(i.rank for i in infos)

    assert asyncio.run(service()) == [0, 1]


def test_called_directly_inside_a_running_loop_does_not_deadlock(run_id: str) -> None:
    async def main() -> int:
        handler = aelastic_sync.create_handler(params(run_id, 1, 1))
        info = handler.next_rendezvous()  # blocks this loop, but runs on the private one
        handler.close()
        return info.world_size

    assert asyncio.run(main()) == 1


def test_timeout_and_interrupt_leave_the_state_clean(run_id: str) -> None:
    lonely = aelastic_sync.create_handler(params(run_id, 2, 2, join_timeout=0.3))
    with pytest.raises(RendezvousTimeoutError):
        lonely.next_rendezvous()
    state = aelastic_sync.run(lonely.async_handler.backend.snapshot())
    assert state is not None and not state.knows(lonely.async_handler.node)
    lonely.close()


def test_interrupting_a_blocked_call_cancels_it(run_id: str) -> None:
    handler = aelastic_sync.create_handler(params(run_id, 2, 2))
    interrupted = threading.Event()

    def blocked() -> None:
        try:
            aelastic_sync.run(handler.async_handler.next_rendezvous(), timeout=0.3)
        except TimeoutError:
            interrupted.set()

    thread = threading.Thread(target=blocked)
    thread.start()
    thread.join(30)
    assert interrupted.is_set()
    backend = handler.async_handler.backend

    async def gone() -> bool:
        for _ in range(100):
            state = await backend.snapshot()
            if state is None or not state.knows(handler.async_handler.node):
                return True
            await asyncio.sleep(0.1)
        return False

    assert aelastic_sync.run(gone())
    handler.close()


def test_a_second_job_with_the_same_id_runs_at_once_in_one_process(run_id: str) -> None:
    """The in-memory backend, torch's default heartbeats (a 15 s window): a job ends (every
    node shuts the rendezvous down, as torch's launcher does), and the next job of the
    process with the same id runs at once; a node of the first job that is still open when
    it comes learns that the run closed."""
    for job in range(2):
        handlers = [aelastic_sync.create_handler(params(run_id, 2, 2)) for _ in range(3)]
        try:
            infos = join_in_threads(handlers[:2])
            assert sorted(i.rank for i in infos) == [0, 1], job
            build = RendezvousStoreInfo.build(infos[1].rank, infos[1].store, None)
            boot = infos[1].bootstrap_store_info
            assert boot is not None and (build.master_addr, build.master_port) == (
                boot.master_addr,
                boot.master_port,
            )
            for handler in handlers[:2]:
                assert handler.shutdown() is True
            with pytest.raises(RendezvousClosedError, match="is closed: the job"):
                handlers[2].next_rendezvous()  # late, while the run is still known
        finally:
            for handler in handlers:
                handler.close()


def test_rendezvous_store_info_build_is_torchs(run_id: str) -> None:
    """Rank 0 publishes its address and a port; the others read them (torch's ``build``)."""
    handlers = [aelastic_sync.create_handler(params(run_id, 2, 2)) for _ in range(2)]
    try:
        infos = join_in_threads(handlers)
        store = infos[0].store.async_store.scoped("build/")
        sync_store = SyncStore(store)
        zero = RendezvousStoreInfo.build(0, sync_store, "10.1.2.3", server_port=4567)
        one = RendezvousStoreInfo.build(1, sync_store, None)
        assert zero == one == RendezvousStoreInfo("10.1.2.3", 4567)
        free = RendezvousStoreInfo.build(0, SyncStore(store.scoped("free/")), None)
        assert free.master_port > 0 and free.master_addr
    finally:
        for handler in handlers:
            handler.close()
