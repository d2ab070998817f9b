"""torch's ``test/distributed/elastic/rendezvous/dynamic_rendezvous_test.py``, part 3 of 3:
timeouts, node names, the handler's parameters, and the bounds a stalled store must keep.

Ported: 20 tests as 16 scenarios: ``RendezvousTimeoutTest`` (3), ``NodeDescTest`` (2),
``NodeDescGeneratorTest`` (1), ``DynamicRendezvousHandlerFromBackendTest`` (5),
``CreateHandlerTest`` (3), ``IntegrationTest``'s ``use_agent_store`` (2), and
``DynamicRendezvousHandlerTest``'s timeouts and failures (``test_next_rendezvous_respects_
the_requested_timeout``, ``test_set_closed_respects_the_requested_timeout``,
``test_shutdown_returns_false_if_rendezvous_cannot_be_closed``, ``test_keep_alive_swallows_
rendezvous_errors``: 4), on a store that accepts connections and never answers, or is gone.

Not ported from the file (torch's internals that aelastic does not reimplement):

* ``RendezvousStateTest`` (the pickled state's size), ``BackendRendezvousStateHolderTest``
  (the holder that reads and writes the pickled state, its cache, its dirty flag, its
  corrupt-pickle error) and ``FakeRendezvousBackend``: aelastic never pickles a state; each
  request is applied by the backend (docs/torch-api.md, ``dynamic_rendezvous.
  RendezvousBackend``). The holder's pruning of dead nodes is ported as behaviour (part 1).
* ``DistributedRendezvousOpExecutorTest`` and ``TestRendezvous{Exit,Join,Close,KeepAlive}Op``
  as unit tests of torch's private ``_Action`` values, its executor and its ``_delay``:
  their state changes are ported as behaviour of real nodes (parts 1 and 2).
* ``test_next_rendezvous_skews_the_first_join_attempt`` (torch's random first delay, which
  aelastic does not need: joins are applied atomically), the ``*_records_and_raises_
  exceptions`` tests (torch's ``events.record_rdzv_event``; aelastic's events are typed,
  docs/torch-api.md "Events"), the keep-alive thread's name and finalizer (aelastic's beats
  are a task of the handler's loop), ``test_share_store_*`` and ``test_share_tcp_store_*``
  (torch's TCPStore shared with the agent, mocked ``dist.PrefixStore``; aelastic's members
  never share a TCPStore: ``use_agent_store`` below), and the key prefix of the round's store
  (``torch.rendezvous.<run>.<round>/``: a name inside torch's store; that each round has a
  store of its own is tested by ``tests/conformance/test_rendezvous.py``), and
  ``test_keep_alive_respects_the_requested_timeout`` (a keep-alive longer than
  ``heartbeat_timeout`` is abandoned quietly: of that only "quietly" can be seen from
  outside, ``test_keep_alive_swallows_rendezvous_errors``).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import anyio
import pytest

from aelastic import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousParameters,
    RendezvousTimeout,
    RendezvousTimeoutError,
)
from aelastic.rendezvous import NodeDesc, RendezvousSettings, create_handler
from tests._rendezvous_helpers import PROMPT
from tests._tcp_proxy import TcpProxy

from ..conftest import MakeParams
from .conftest import ASYNC_ONLY, SERVED, SHORT_BEATS, Node, NodeFactory, Observer, join_all, until

pytestmark = pytest.mark.anyio


# -- RendezvousTimeoutTest ------------------------------------------------------------------


def test_init_initializes_timeout() -> None:
    timeout = RendezvousTimeout(
        timedelta(seconds=50), timedelta(seconds=60), timedelta(seconds=70), timedelta(seconds=80)
    )
    assert (timeout.join, timeout.last_call, timeout.close, timeout.heartbeat) == (
        timedelta(seconds=50),
        timedelta(seconds=60),
        timedelta(seconds=70),
        timedelta(seconds=80),
    )


def test_init_initializes_timeout_if_no_timeout_is_specified() -> None:
    timeout = RendezvousTimeout()
    assert (timeout.join, timeout.last_call, timeout.close, timeout.heartbeat) == (
        timedelta(seconds=600),
        timedelta(seconds=30),
        timedelta(seconds=30),
        timedelta(seconds=5),
    )


@pytest.mark.parametrize("join", [timedelta(seconds=0), timedelta(seconds=-1)])
def test_init_raises_error_if_timeout_is_not_positive(join: timedelta) -> None:
    with pytest.raises(ValueError, match=rf"^The join timeout \({join}\) must be positive.$"):
        RendezvousTimeout(join)


# -- NodeDescTest, NodeDescGeneratorTest ----------------------------------------------------


def test_node_desc_repr() -> None:
    """torch's ``repr`` of a node is aelastic's ``str``; both are ``fqdn_pid_localid``."""
    assert str(NodeDesc("dummy_fqdn", 3, 5)) == "dummy_fqdn_3_5"


def test_node_desc_hash() -> None:
    first, second = NodeDesc("dummy_fqdn", 2, 4), NodeDesc("dummy_fqdn", 3, 5)
    descs = {first, second}
    assert first in descs and second in descs


async def test_node_desc_generator_generates_fqdn_pid_and_a_counter() -> None:
    """Handlers of one process are named ``fqdn_pid_<n>``, ``<n>`` counting up."""
    params = RendezvousParameters("memory", "names", "node-names", 1, 1)
    handlers = [create_handler(params) for _ in range(4)]
    try:
        first = handlers[0].node.local_id
        for offset, handler in enumerate(handlers):
            expected = f"{socket.getfqdn()}_{os.getpid()}_{first + offset}"
            assert str(handler.node) == expected
    finally:
        for handler in handlers:
            await handler.aclose()


# -- DynamicRendezvousHandlerFromBackendTest, CreateHandlerTest -----------------------------


@pytest.mark.parametrize(("min_nodes", "max_nodes"), [(3, 6), (3, 3)])
async def test_init_initializes_handler(
    make_params: MakeParams, backend: str, min_nodes: int, max_nodes: int
) -> None:
    """Also ``test_init_initializes_handler_if_timeout_is_not_specified`` (the defaults)
    and ``..._if_min_and_max_nodes_are_equal``."""
    params = make_params(min_nodes, max_nodes)
    del params.config["join_timeout"], params.config["last_call_timeout"]
    handler = create_handler(params)
    try:
        assert handler.get_backend() == backend
        assert handler.get_run_id() == params.run_id
        settings = handler.settings
        assert (settings.run_id, settings.min_nodes, settings.max_nodes) == (
            params.run_id,
            min_nodes,
            max_nodes,
        )
        timeout = RendezvousTimeout()
        assert settings.join_timeout == timeout.join.total_seconds()
        assert settings.last_call_timeout == timeout.last_call.total_seconds()
    finally:
        await handler.aclose()


@pytest.mark.parametrize("min_nodes", [0, -10])
def test_init_raises_error_if_min_nodes_is_not_positive(min_nodes: int) -> None:
    with pytest.raises(
        ValueError,
        match=rf"^The minimum number of nodes \({min_nodes}\) must be greater than zero.$",
    ):
        RendezvousSettings("dummy_run_id", min_nodes, 6)


def test_init_raises_error_if_max_nodes_is_less_than_min() -> None:
    with pytest.raises(
        ValueError,
        match=r"^The maximum number of nodes \(2\) must be greater than or equal to the minimum "
        r"number of nodes \(3\).$",
    ):
        RendezvousSettings("dummy_run_id", 3, 2)


@pytest.mark.parametrize("given", [True, False])
async def test_create_handler_returns_handler(
    make_params: MakeParams, backend: str, given: bool
) -> None:
    """Also ``test_create_handler_returns_handler_if_timeout_is_not_specified``: timeouts
    given as text, as ``--rdzv-conf`` gives them."""
    params = make_params(3, 6)
    for key in ("join_timeout", "last_call_timeout", "close_timeout"):
        params.config.pop(key, None)
    if given:
        params.config.update(join_timeout="50", last_call_timeout="60", close_timeout="70")
    expected = RendezvousTimeout(*(timedelta(seconds=s) for s in (50, 60, 70)) if given else ())
    handler = create_handler(params)
    try:
        assert (handler.get_backend(), handler.get_run_id()) == (backend, params.run_id)
        settings = handler.settings
        assert (settings.min_nodes, settings.max_nodes) == (3, 6)
        assert settings.join_timeout == expected.join.total_seconds()
        assert settings.last_call_timeout == expected.last_call.total_seconds()
        assert settings.close_timeout == expected.close.total_seconds()
    finally:
        await handler.aclose()


async def test_create_handler_rdzv_local_addr(make_params: MakeParams, facade: str) -> None:
    """The rendezvous' ``local_addr`` is where rank 0's workers bootstrap."""
    given = make_params(1, 1)
    params = RendezvousParameters(
        given.backend, given.endpoint, given.run_id, 1, 1, local_addr="127.0.0.2", **given.config
    )
    node = Node(params, facade)
    try:
        (info,) = await join_all([node])
        assert info.bootstrap_store_info is not None
        assert info.bootstrap_store_info.master_addr == "127.0.0.2"
    finally:
        await node.release()


# -- IntegrationTest: use_agent_store -------------------------------------------------------


@pytest.mark.xfail(
    strict=True,
    reason="documented difference (docs/cli.md, TORCHELASTIC_USE_AGENT_STORE; README's "
    "RendezvousHandler row): workers bootstrap their own store at MASTER_ADDR:MASTER_PORT, "
    "use_agent_store is False",
)
async def test_use_agent_store_is_true_by_default(nodes: NodeFactory) -> None:
    (node,) = await nodes(1, 1, 2)
    assert node.use_agent_store


async def test_use_agent_store_is_disabled(
    nodes: NodeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    (node,) = await nodes(1, 1, 2)
    assert not node.use_agent_store


# -- DynamicRendezvousHandlerTest: timeouts and failures of the store -----------------------


@pytest.fixture
def stalled_endpoint(backend: str) -> Iterator[str]:
    """An endpoint of the backend under test whose server accepts connections and never
    answers (a hung store)."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    port = listener.getsockname()[1]
    schemes = {"redis": "redis://", "http": "http://"}
    try:
        yield f"{schemes.get(backend, '')}127.0.0.1:{port}"
    finally:
        listener.close()


def _node_at(params: RendezvousParameters, endpoint: str, facade: str, **conf: Any) -> Node:
    moved = RendezvousParameters(
        params.backend,
        endpoint,
        params.run_id,
        params.min_nodes,
        params.max_nodes,
        local_addr=params.local_addr,
        **{**params.config, **conf},
    )
    return Node(moved, facade)


#: A scenario of a store that hangs, dies or is cut off: not for the memory backend.
SERVED_ONLY = pytest.mark.backends(*SERVED)


#: Backends whose calls to a hung store outlast the store's read timeout (about 11 s).
@SERVED_ONLY
@pytest.mark.parametrize(
    ("call", "timeout_key"),
    [("next_rendezvous", "join_timeout"), ("set_closed", "close_timeout")],
    ids=["join", "close"],
)
async def test_a_call_to_a_hung_store_respects_the_requested_timeout(
    make_params: MakeParams,
    stalled_endpoint: str,
    backend: str,
    call: str,
    timeout_key: str,
) -> None:
    """``test_next_rendezvous_respects_the_requested_timeout`` and ``test_set_closed_
    respects_the_requested_timeout``: a store slower than the call's timeout (here one
    that never answers) ends the call with a rendezvous error, not a wait without end. torch
    checks its deadline between store calls, each bounded by the store's read timeout: a
    join (close) of 0.5 s with a read timeout of 1 s ends within about a second. The async
    handler only: the sync facade runs the same coroutine."""
    params = make_params(1, 1)
    conf = {timeout_key: 0.5, "read_timeout": 1, "heartbeat_timeout": 0.5}
    node = _node_at(params, stalled_endpoint, "async", **conf)
    try:
        started = anyio.current_time()
        with anyio.fail_after(3), pytest.raises(RendezvousError) as raised:
            await getattr(node, call)()
        assert isinstance(raised.value, RendezvousTimeoutError | RendezvousConnectionError)
        assert anyio.current_time() - started < 2.5
    finally:
        with anyio.CancelScope(shield=True):
            await node.release()


@SERVED_ONLY
async def test_shutdown_returns_false_if_rendezvous_cannot_be_closed(
    make_params: MakeParams, backend: str, facade: str
) -> None:
    """A store that is gone: ``shutdown()`` says it could not close (``False``), it does not
    raise."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]  # closed at once: nothing listens there
    schemes = {"redis": "redis://", "http": "http://"}
    node = _node_at(
        make_params(1, 1),
        f"{schemes.get(backend, '')}127.0.0.1:{port}",
        facade,
        read_timeout=1,
        join_timeout=1,
        close_timeout=1,
    )
    try:
        with anyio.fail_after(PROMPT):
            assert await node.shutdown() is False
    finally:
        await node.release()


def _port_of(endpoint: str) -> int:
    return int(endpoint.rstrip("/").rsplit(":", 1)[1].split("/")[0])


@SERVED_ONLY
@ASYNC_ONLY
async def test_keep_alive_swallows_rendezvous_errors(
    make_params: MakeParams,
    backend: str,
    endpoint: str,
    facade: str,
    nodes: NodeFactory,
    observer: Observer,
) -> None:
    """A member whose store becomes unreachable after its round: its failing keep-alives
    raise nothing into the program; the other member sees it lost after the heartbeat
    window, and the cut-off member's next call reports the failure as a rendezvous error."""
    proxy = TcpProxy(_port_of(endpoint))
    try:
        params = make_params(2, 2, **SHORT_BEATS, read_timeout=1, join_timeout=2)
        through_proxy = endpoint.replace(str(_port_of(endpoint)), str(proxy.port))
        cut_off = _node_at(params, through_proxy, facade)
        (stays,) = await nodes(1, 2, 2, **SHORT_BEATS, read_timeout=1, join_timeout=2)
        try:
            await join_all([cut_off, stays])
            proxy.cut()
            await anyio.sleep(1.0)  # failing keep-alives meanwhile: nothing surfaces

            async def lost() -> bool:
                return not (await observer()).knows(cut_off.node)

            await until(lost)
            with anyio.fail_after(PROMPT), pytest.raises(RendezvousError):
                await cut_off.num_nodes_waiting()
        finally:
            await cut_off.release()
    finally:
        proxy.close()
