"""torch's ``static`` and ``c10d`` rendezvous: one of the nodes hosts aelastic's HTTP server.

How it works: torch's two multi-node defaults keep the rendezvous on one of the job's own
nodes (a TCPStore in the agent). :class:`HostedBackend` does the same with aelastic's HTTP
server (:mod:`aelastic.backends.http.server`), run by one agent inside its own event loop (no
extra process), and talks to it through the ordinary HTTP backend, like every other node:

* ``static`` (``--nnodes N`` with ``--master-addr``, ``--master-port`` and ``--node-rank``;
  the endpoint is ``master_addr:master_port``, config ``rank`` is the node rank): node rank 0
  hosts; a node's rank in the round is its node rank, as torch's; every node given a node
  rank that another node has fails, saying so (:mod:`._node_rank`). The workers' own store
  (``MASTER_PORT``) gets another, free port.
* ``c10d`` (``--rdzv-endpoint host[:port]``, port 29400 by default): the agent that can bind
  the port on the endpoint's host hosts (config ``is_host`` forces it either way); elastic
  ``--nnodes MIN:MAX`` works as with every backend. Port 0 (``localhost:0``, TorchX's
  single-node jobs) binds a free port, which this node's client then uses: one node only.

A node starts asking at once and keeps asking while the host cannot be reached (nodes start
in any order) until the join timeout; then it fails naming the address. Once the host has
answered, it is the run's only copy: a host that answers nothing for ``read_timeout`` (it
died, or its machine is cut off) is gone for good, and every call from then on raises
:class:`~aelastic.core.errors.RendezvousLostError` at once (the agent then stops its workers
and fails instead of retrying for ever). The hosting agent keeps serving after it is done
until every member has left (a closed run too: the others still say goodbye), for at most
``close_timeout``. The host is a single point of failure, as in torch: for production, use
Redis (see ``docs/production-store.md``).
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import socket
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ..core.errors import RendezvousConnectionError, RendezvousError, RendezvousLostError
from ..core.health import JobHealth
from ..core.params import RendezvousParameters, parse_rendezvous_endpoint
from ..core.protocol import RendezvousBackend
from ..core.state import Op, Placement, Reply, Request, Snapshot, Status
from ..core.token import Token
from ._node_rank import NodeRanks
from .http.client import HttpBackend
from .http.wire import DEFAULT_PORT
from .registry import external_names

__all__ = ["HostedBackend", "create_c10d_backend", "create_static_backend"]

log = logging.getLogger(__name__)


class HostedBackend:
    """The HTTP backend of a run whose server one of the nodes hosts.

    Args:
        name: ``static`` or ``c10d``.
        run_id: The run.
        host, port: Where the server is (or is to be) reached.
        hosting: ``True``: host (fail if the port cannot be bound); ``False``: only connect;
            ``None``: host when the port can be bound on this machine's address for ``host``.
        rank: A static node rank: the node's rank in every round.
        join_timeout: How long to keep trying to reach the host before it first answers.
        linger: How long a hosting node keeps serving for the others once it is done.
        token: As for :class:`~aelastic.backends.http.client.HttpBackend`.
        read_timeout: Once the host has answered, how long it may answer nothing before
            it is taken for gone.
    """

    holds_keep_alive = True

    def __init__(
        self,
        name: str,
        run_id: str,
        host: str,
        port: int,
        *,
        hosting: bool | None,
        rank: int | None = None,
        join_timeout: float = 600.0,
        linger: float = 30.0,
        token: str | None = None,
        read_timeout: float = 60.0,
    ) -> None:
        self.name = name
        self._host, self._port = host, port
        self._hosting = hosting
        self._rank = rank
        self._join_timeout = join_timeout
        self._linger = linger
        self._token = token
        self._run_id = run_id
        self._read_timeout = read_timeout
        self._reached = False
        self._lost: str | None = None
        self._client = self._make_client()
        self._ranks = None if rank is None else NodeRanks(self, rank)
        self._runner: Any = None
        self._started = False
        self._lock: asyncio.Lock | None = None

    def _make_client(self) -> HttpBackend:
        return HttpBackend(
            self._run_id,
            f"http://{_bracket(self._host)}:{self._port}",
            token=self._token,
            # Until the host first answers (nodes start in any order); then read_timeout.
            read_timeout=self._read_timeout if self._reached else self._join_timeout,
            share_connections=False,
            label=self.name,
        )

    def __repr__(self) -> str:
        return f"HostedBackend({self.name!r}, {self._host}:{self._port}, hosting={self.hosts})"

    @property
    def endpoint(self) -> str:
        return f"{self._host}:{self._port}"

    @property
    def hosts(self) -> bool:
        """Whether this process serves the run."""
        return self._runner is not None

    # -- hosting --------------------------------------------------------------------------

    async def _start(self) -> None:
        if self._started:
            return
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._started:
                return
            if self._hosting is not False:
                await self._try_host()
            self._started = True

    async def _try_host(self) -> None:
        from aiohttp import web

        from .http.server import create_app

        if self._hosting is None and not _is_local(self._host):
            return
        try:
            # One listening socket, made here: agents of one machine racing for the port
            # either listen on it or fail whole (a site binding several sockets could be
            # left half-listening by a lost race, answering for an app it shut down).
            sock = _listen(self._port)
        except OSError as exc:
            if self._hosting is None and exc.errno == errno.EADDRINUSE:
                return  # another agent of this machine hosts it
            raise RendezvousConnectionError(
                f"cannot host the {self.name} rendezvous on port {self._port}: "
                f"{exc.strerror or exc}"
            ) from None
        if self._port == 0:  # the free port the system picked: this node's client uses it
            self._port = sock.getsockname()[1]
            unused, self._client = self._client, self._make_client()
            await unused.aclose()
        # The job's token: config key `token`, else AELASTIC_HTTP_TOKEN (as the clients).
        runner = web.AppRunner(create_app(token=self._token), access_log=None)
        await runner.setup()
        try:
            await web.SockSite(runner, sock).start()
        except BaseException:
            sock.close()
            await runner.cleanup()
            raise
        self._runner = runner
        log.info("hosting the %s rendezvous on port %d", self.name, self._port)

    async def _reach(self, method: str, *args: Any) -> Any:
        """The client's ``method(*args)``: the client retries for the join timeout until the
        host first answers, then for ``read_timeout`` of silence, after which the host is
        gone."""
        await self._start()  # may pick the port, and so make the client anew
        if self._lost is not None:
            raise RendezvousLostError(self._lost)
        client = self._client
        try:
            result = await getattr(client, method)(*args)
        except RendezvousConnectionError as exc:
            if not client.failing:
                raise  # the host answered: a refusal, not an outage
            if not self._reached:
                raise RendezvousConnectionError(
                    f"the {self.name} rendezvous host {self.endpoint} could not be reached "
                    f"within the join timeout ({self._join_timeout:g} s): {exc}"
                ) from None
            self._lost = (
                f"the {self.name} rendezvous host {self.endpoint} is gone: no answer for "
                f"{self._read_timeout:g} s (read_timeout), and the job's rendezvous lived "
                f"there. {exc}"
            )
            raise RendezvousLostError(self._lost) from None
        if not self._reached:
            self._reached = True
            client.read_timeout = self._read_timeout
        return result

    # -- the protocol ---------------------------------------------------------------------

    async def apply(self, request: Request, hold: float = 0.0, seen: Token | None = None) -> Reply:
        reply: Reply = await self._reach("apply", request, hold, seen)
        if self._ranks is None:
            return reply
        if request.op is Op.JOIN:
            await self._ranks.check(request, reply)  # duplicate node ranks fail, every one
        if reply.rank is None:
            return reply
        if request.op is Op.JOIN:
            addr, port = await self._master(request, reply)
            placement = self._placement(request, reply)
            return replace(
                reply, rank=self._rank, master_addr=addr, master_port=port, placement=placement
            )
        return replace(reply, rank=self._rank)

    def _placement(self, request: Request, reply: Reply) -> Placement | None:
        """Where this node's workers stand when its rank is its node rank (torch's static
        rendezvous): every node runs as many workers of one role, so node rank ``r``'s come
        after ``r`` nodes' worth.

        Raises:
            RendezvousError: The nodes run different numbers or roles of workers (the
                rendezvous's own placement, in its node order, would not follow the ranks).
        """
        placed, size = reply.placement, request.local_world_size
        if placed is None or self._rank is None:
            return placed
        if placed.world != size * reply.status.world or placed.role_world != placed.world:
            raise RendezvousError(
                "the static rendezvous needs the same --nproc-per-node and role on every node "
                f"(this node runs {size} worker(s); the round has {placed.world} in all)"
            )
        base = self._rank * size
        return Placement(base, placed.world, base, placed.role_world)

    async def _master(self, request: Request, reply: Reply) -> tuple[str, int]:
        """Where the workers bootstrap: node rank 0's address and port (not the first node
        of the round's order, whose rank the node rank replaced); node rank 0 says it."""
        key = f"static/master/{reply.status.round}"
        if self._rank == 0:
            mine = (request.node.addr, request.port)
            await self._reach("kv_set", key, json.dumps(mine).encode())
            return mine
        if not await self._reach("kv_wait", [key], self._join_timeout):
            raise RendezvousError(
                f"node rank 0 did not say where the workers bootstrap within the join "
                f"timeout ({self._join_timeout:g} s)"
            )
        (raw,) = await self._reach("kv_get", [key])
        addr, port = json.loads(raw or b"null")
        return str(addr), int(port)

    async def wait_for_change(self, token: Token, timeout: float | None) -> Status | None:
        result: Status | None = await self._reach("wait_for_change", token, timeout)
        return result

    async def snapshot(self) -> Snapshot | None:
        result: Snapshot | None = await self._reach("snapshot")
        return result

    async def health(self) -> JobHealth | None:
        result: JobHealth | None = await self._reach("health")
        return result

    async def close_run(self) -> bool:
        return bool(await self._reach("close_run"))

    async def reset(self) -> bool:
        return bool(await self._reach("reset"))

    async def list_runs(self, limit: int) -> list[tuple[str, Status]]:
        result: list[tuple[str, Status]] = await self._reach("list_runs", limit)
        return result

    async def kv_set(self, key: str, value: bytes) -> None:
        await self._reach("kv_set", key, value)

    async def kv_get(self, keys: Sequence[str]) -> list[bytes | None]:
        result: list[bytes | None] = await self._reach("kv_get", keys)
        return result

    async def kv_add(self, key: str, amount: int) -> int:
        return int(await self._reach("kv_add", key, amount))

    async def kv_compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes:
        result: bytes = await self._reach("kv_compare_set", key, expected, desired)
        return result

    async def kv_delete(self, key: str) -> bool:
        return bool(await self._reach("kv_delete", key))

    async def kv_wait(self, keys: Sequence[str], timeout: float) -> bool:
        return bool(await self._reach("kv_wait", keys, timeout))

    async def aclose(self) -> None:
        """Close; a hosting node first serves the others until they are done (bounded)."""
        runner, self._runner = self._runner, None
        if runner is not None:
            try:
                await self._serve_the_rest()
            finally:
                await self._client.aclose()
                await runner.cleanup()
        else:
            await self._client.aclose()

    async def _serve_the_rest(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._linger
        waited = False
        while loop.time() < deadline:
            try:
                snap = await self._client.snapshot()
            except RendezvousError:
                return
            if snap is None or not snap.participants:
                return
            if not waited:
                log.info("still hosting the rendezvous until the other nodes are done")
                waited = True
            await asyncio.sleep(0.2)


def _listen(port: int) -> socket.socket:
    """A socket listening on ``port`` of every address (both IP versions where possible)."""
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
    return socket.create_server(("", port))


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


#: Addresses that name no machine (bound, they mean every address): as in torch, a node at
#: one of these is not the host.
_UNSPECIFIED = frozenset({"0.0.0.0", "::", "0:0:0:0:0:0:0:0"})


def _is_local(host: str) -> bool:
    """Whether ``host`` names this machine (one of its addresses can be bound)."""
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    if host in _UNSPECIFIED:
        return False
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, address in infos:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address[0], 0))
            except OSError:
                continue
            return True
    return False


def _settings(params: RendezvousParameters) -> dict[str, Any]:
    token = params.get("token")
    read_timeout = params.get_as_float("read_timeout", 60.0)
    join_timeout = params.get_as_float("join_timeout", 600.0)
    linger = params.get_as_float("close_timeout", 30.0)
    return {
        "token": None if token is None else str(token),
        "read_timeout": 60.0 if read_timeout is None else read_timeout,
        "join_timeout": 600.0 if join_timeout is None else join_timeout,
        "linger": 30.0 if linger is None else linger,
    }


def create_static_backend(params: RendezvousParameters) -> RendezvousBackend:
    """torch's ``static``: endpoint ``master_addr:master_port``, config ``rank`` (node rank).

    Raises:
        ValueError: No endpoint, no or a bad node rank, or ``min_nodes != max_nodes``.
    """
    if not params.endpoint:
        raise ValueError("The static rendezvous needs the endpoint master_addr:master_port.")
    if params.min_nodes != params.max_nodes:
        raise ValueError(
            f"The static rendezvous needs a fixed number of nodes, not "
            f"{params.min_nodes}:{params.max_nodes} (use c10d or {external_names()} for "
            "elastic jobs)."
        )
    rank = params.get_as_int("rank")
    if rank is None or not 0 <= rank < params.max_nodes:
        raise ValueError(
            f"The static rendezvous needs a node rank in [0, {params.max_nodes}) "
            f"(--node-rank), got {rank}."
        )
    host, port = parse_rendezvous_endpoint(params.endpoint, -1)
    if port == -1:
        raise ValueError(
            f"Port is absent in endpoint: {params.endpoint}. Try launching with --master-port"
        )
    return HostedBackend(
        "static", params.run_id, host, port, hosting=rank == 0, rank=rank, **_settings(params)
    )


def create_c10d_backend(params: RendezvousParameters) -> RendezvousBackend:
    """torch's ``c10d``: endpoint ``host[:port]`` (29400), config ``is_host`` optional.

    Raises:
        ValueError: No endpoint or a bad one.
    """
    if not params.endpoint:
        raise ValueError("The c10d rendezvous needs an endpoint host[:port].")
    store_type = str(params.get("store_type", "tcp")).strip().lower()
    if store_type == "file":
        raise ValueError(
            "The c10d rendezvous's store_type=file (torch's FileStore) is not provided: "
            "aelastic's c10d is hosted by a node (store_type=tcp); for a rendezvous with no "
            "node hosting it, use aelastic serve (http), redis or etcd."
        )
    if store_type != "tcp":
        raise ValueError(
            f"Invalid store type given: {store_type!r}. Currently only supports file and tcp "
            "(aelastic: tcp)."
        )
    host, port = parse_rendezvous_endpoint(params.endpoint, DEFAULT_PORT)
    hosting = params.get_as_bool("is_host")
    if port == 0:
        # Port 0: the hosting node binds a free port, which no other node can learn.
        if params.max_nodes > 1:
            raise ValueError(
                f"The c10d rendezvous at {params.endpoint} (port 0: a free port picked by "
                f"the hosting node) is for one node; {params.min_nodes}:{params.max_nodes} "
                "nodes need a port every node knows (e.g. host:29400)."
            )
        if hosting is False:
            raise ValueError(
                f"The c10d rendezvous at {params.endpoint} (port 0) must be hosted by this "
                "node: is_host=false cannot reach it."
            )
        hosting = True
    return HostedBackend("c10d", params.run_id, host, port, hosting=hosting, **_settings(params))
