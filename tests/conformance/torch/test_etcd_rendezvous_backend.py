"""torch's ``test/distributed/elastic/rendezvous/etcd_rendezvous_backend_test.py`` and
``etcd_rendezvous_test.py``: creating the ``etcd`` rendezvous and using its store, on a real
etcd (aelastic's backend speaks etcd's v3 API; torch's ``etcd``/``etcd-v2`` backends speak v2).

Ported: ``CreateBackendTest``'s 7 scenarios (the backend's name, ``protocol`` in any case or
unset, ``read_timeout`` unset or invalid, an unreachable etcd, an invalid protocol, a store
``get`` that waits for its key) and ``EtcdRendezvousTest``'s 3 (a handler from the least
parameters, from more, its backend's name), each through the async handler and torch's
blocking names. Not ported: ``EtcdRendezvousBackendTest`` (torch's
``RendezvousBackendTestMixin`` over a pickled, base64 state under a token; aelastic applies
requests in etcd transactions instead: docs/torch-api.md ``dynamic_rendezvous.
RendezvousBackend``), the TTL and key layout of torch's v2 state (``/torch/elastic/...``),
``etcd_server_test.py`` and ``etcd_find_free_port_test.py`` (torch's ``EtcdServer`` helper:
docs/torch-api.md, ``etcd_server.EtcdServer`` not provided).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import pytest

from aelastic import RendezvousConnectionError, RendezvousParameters
from aelastic.rendezvous import create_handler
from tests._ports import free_port
from tests._rendezvous_helpers import PROMPT

from .conftest import Node, join_all

pytestmark = pytest.mark.anyio

MakeNode = Callable[..., Node]


@pytest.fixture
async def etcd_node(etcd_url: str, facade: str, run_id: str) -> AsyncIterator[MakeNode]:
    """``etcd_node(nodes=1, backend="etcd", endpoint=<the session's etcd>, **conf)``."""
    made: list[Node] = []

    def make(nodes: int = 1, backend: str = "etcd", endpoint: str = etcd_url, **conf: Any) -> Node:
        conf.setdefault("last_call_timeout", 0.1)
        params = RendezvousParameters(
            backend, endpoint, run_id, nodes, nodes, local_addr="127.0.0.1", **conf
        )
        node = Node(params, facade)
        made.append(node)
        return node

    yield make
    with anyio.CancelScope(shield=True), anyio.move_on_after(PROMPT):
        for node in made:
            await node.release()


@pytest.mark.parametrize("backend", ["etcd", "etcd-v2"])
async def test_create_backend_returns_backend(etcd_node: MakeNode, backend: str) -> None:
    """Its name, its read timeout, and a store the round's members share."""
    first = etcd_node(2, backend, protocol="hTTp", read_timeout="10")
    second = etcd_node(2, backend, protocol="hTTp", read_timeout="10")
    assert first.get_backend() == backend
    assert first.handler.settings.read_timeout == 10
    one, two = await join_all([first, second])
    await one.store.set("dummy_key", "dummy_value")
    assert await two.store.get("dummy_key") == b"dummy_value"


async def test_create_backend_returns_backend_if_protocol_is_not_specified(
    etcd_node: MakeNode,
) -> None:
    (info,) = await join_all([etcd_node()])
    assert info.world_size == 1


async def test_create_backend_returns_backend_if_read_timeout_is_not_specified(
    etcd_node: MakeNode,
) -> None:
    node = etcd_node()
    assert node.handler.settings.read_timeout == 60
    (info,) = await join_all([node])
    assert info.world_size == 1


async def test_create_backend_raises_error_if_etcd_is_unreachable(etcd_node: MakeNode) -> None:
    """Nothing at the endpoint: ``RendezvousConnectionError`` (at the first call)."""
    node = etcd_node(endpoint=f"127.0.0.1:{free_port()}", read_timeout="1", join_timeout=1)
    with anyio.fail_after(PROMPT), pytest.raises(RendezvousConnectionError):
        await node.next_rendezvous()


def test_create_backend_raises_error_if_protocol_is_invalid(etcd_url: str) -> None:
    params = RendezvousParameters("etcd", etcd_url, "dummy_run_id", 1, 1, protocol="dummy")
    with pytest.raises(ValueError, match=r"(?i)protocol.* must be http or https"):
        create_handler(params)


@pytest.mark.parametrize("read_timeout", ["0", "-10"])
def test_create_backend_raises_error_if_read_timeout_is_invalid(
    etcd_url: str, read_timeout: str
) -> None:
    params = RendezvousParameters("etcd", etcd_url, "dummy_run_id", 1, 1, read_timeout=read_timeout)
    with pytest.raises(ValueError, match="read timeout"):
        create_handler(params)


async def test_get_waits_for_store_prefix_key(etcd_node: MakeNode) -> None:
    """A store ``get`` of a key not set yet waits until another member sets it."""
    first, second = etcd_node(2), etcd_node(2)
    one, two = await join_all([first, second])
    got: list[bytes] = []
    started = anyio.current_time()

    async def read() -> None:
        got.append(await one.store.get("dummy_master_addr"))

    with anyio.fail_after(PROMPT):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(read)
            await anyio.sleep(0.5)
            assert not got
            await two.store.set("dummy_master_addr", b"foo")
    assert got == [b"foo"]
    assert anyio.current_time() - started >= 0.5


async def test_etcd_rdzv_basic_params(etcd_node: MakeNode) -> None:
    """``EtcdRendezvousTest.test_etcd_rdzv_basic_params``: a handler from the least
    parameters."""
    assert etcd_node() is not None


async def test_etcd_rdzv_additional_params(etcd_node: MakeNode, run_id: str) -> None:
    node = etcd_node(timeout=60, last_call_timeout=30, protocol="http")
    assert node.get_run_id() == run_id


async def test_get_backend(etcd_node: MakeNode) -> None:
    node = etcd_node(timeout=60, last_call_timeout=30, protocol="http")
    assert node.get_backend() == "etcd"
