"""torch's ``static`` rendezvous hosted by node rank 0: where the workers bootstrap.

A node's rank is its node rank, not its place in the round's order, so the bootstrap
address is node rank 0's (the host's), and rank 0 publishes it in the round's store, even
when another node's descriptor sorts first.
"""

from __future__ import annotations

import asyncio

import anyio
import pytest

from aelastic import RendezvousParameters, RendezvousStoreInfo
from aelastic.rendezvous import create_handler
from tests._ports import free_port
from tests._rendezvous_helpers import PROMPT

pytestmark = pytest.mark.anyio


async def test_static_ranks_and_bootstrap_are_node_rank_0s(run_id: str) -> None:
    endpoint = f"127.0.0.1:{free_port()}"

    def handler(rank: int, addr: str):  # type: ignore[no-untyped-def]
        params = RendezvousParameters(
            "static", endpoint, run_id, 2, 2, local_addr=addr, rank=rank, last_call_timeout=0.1
        )
        return create_handler(params)

    # Node rank 1's descriptor (127.0.0.1) sorts before node rank 0's (127.0.0.2).
    zero, one = handler(0, "127.0.0.2"), handler(1, "127.0.0.1")
    try:
        with anyio.fail_after(3 * PROMPT):
            infos = await asyncio.gather(zero.next_rendezvous(), one.next_rendezvous())
        assert [i.rank for i in infos] == [0, 1]
        boots = {(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port)
                 for i in infos if i.bootstrap_store_info}  # fmt: skip
        assert len(boots) == 1 and next(iter(boots))[0] == "127.0.0.2"
        with anyio.fail_after(PROMPT):
            addr = await infos[1].store.get(RendezvousStoreInfo.MASTER_ADDR_KEY)
            port = await infos[1].store.get(RendezvousStoreInfo.MASTER_PORT_KEY)
        assert (addr.decode(), int(port)) == next(iter(boots))
        await one.leave(finished=True)
        await zero.leave(finished=True)
    finally:
        await one.aclose()
        await zero.aclose()
