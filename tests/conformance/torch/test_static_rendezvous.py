"""torch's ``test/distributed/elastic/rendezvous/static_rendezvous_test.py``: the
``static`` rendezvous (``--node-rank`` nodes; aelastic: node rank 0 hosts its HTTP server,
docs/torch-api.md ``static_tcp_rendezvous``), through the async handler and torch's
blocking names.

Ported: all 6 scenarios. torch's four refusals (no port, an empty endpoint, an IPv6
address, IPv6 localhost) give parameters without a node rank (config ``rank``), the first
thing torch checks; they are ported as such, and the missing port once more with a rank.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from aelastic import RendezvousParameters
from aelastic.rendezvous import create_handler
from tests._ports import free_port

from .conftest import Node

pytestmark = pytest.mark.anyio


def _params(endpoint: str, **conf: Any) -> RendezvousParameters:
    return RendezvousParameters("static", endpoint, "test_id", 1, 1, **conf)


@pytest.mark.parametrize(
    "endpoint",
    [
        "localhost",
        "",
        "[2001:0db8:85a3:0000:0000:8a2e:0370:7334]:90",
        "[::1]:90",
    ],
    ids=["test_missing_port", "test_empty_endpoint", "test_ipv6_addr", "test_ipv6_addr_localhost"],
)
def test_parameters_without_a_node_rank_are_refused(endpoint: str) -> None:
    with pytest.raises(ValueError):
        create_handler(_params(endpoint))


def test_missing_port_with_a_node_rank_is_refused() -> None:
    with pytest.raises(ValueError, match=r"[Pp]ort"):
        create_handler(_params("localhost", rank=0))


async def test_get_backend() -> None:
    handler = create_handler(_params("localhost:123", timeout=60, rank=0))
    try:
        assert handler.get_backend() == "static"
    finally:
        await handler.aclose()


@pytest.fixture
async def static_node(facade: str) -> AsyncIterator[Node]:
    node = Node(_params(f"localhost:{free_port()}", rank=0, close_timeout=1), facade)
    yield node
    with anyio.CancelScope(shield=True), anyio.move_on_after(20):
        await node.shutdown()


async def test_static_rdzv_multiple_calls(static_node: Node) -> None:
    """Node rank 0 of a one-node job, twice: rank 0 of 1 with a store each time."""
    for _ in range(2):
        with anyio.fail_after(20):
            info = await static_node.next_rendezvous()
        assert info.store is not None
        assert (info.rank, info.world_size) == (0, 1)
