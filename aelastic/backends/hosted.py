"""torch's ``static`` and ``c10d`` rendezvous: one of the nodes hosts aelastic's HTTP server.

How it works: torch's two multi-node defaults keep the rendezvous on one of the job's own
nodes (a TCPStore in the agent). :class:`HostedBackend` does the same with aelastic's HTTP
server (:mod:`aelastic.backends.http.server`), run by one agent inside its own event loop (no
extra process), and talks to it through the ordinary HTTP backend, like every other node:

* ``static`` (``--nnodes N`` with ``--master-addr``, ``--master-port`` and ``--node-rank``;
  the endpoint is ``master_addr:master_port``, config ``rank`` is the node rank): node rank 0
  hosts; a node's rank in the round is its node rank, as torch's; two nodes giving the same
  node rank are told so. The workers' own store (``MASTER_PORT``) gets another, free port.
* ``c10d`` (``--rdzv-endpoint host[:port]``, port 29400 by default): the agent that can bind
  the port on the endpoint's host hosts (config ``is_host`` forces it either way); elastic
  ``--nnodes MIN:MAX`` works as with every backend.

A node starts asking at once and keeps asking while the host cannot be reached (nodes start
in any order) until the join timeout; then it fails naming the address. The hosting agent
keeps serving after it is done until every member has left (a closed run too: the others
still say goodbye), for at most ``close_timeout``. The host is a single point of failure, as
in torch: for production, use Redis (see ``docs/production-store.md``).
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

from ..core.errors import RendezvousConnectionError, RendezvousError
from ..core.params import RendezvousParameters, parse_rendezvous_endpoint
from ..core.protocol import RendezvousBackend
from ..core.state import Op, Reply, Request, Snapshot, Status
from ..core.token import Token
from .http.client import HttpBackend
from .http.wire import DEFAULT_PORT

__all__ = ["HostedBackend", "create_c10d_backend", "create_static_backend"]

log = logging.getLogger(__name__)

#: Seconds between two attempts to reach a host that is not there yet.
_RETRY = 0.5


class HostedBackend:
    """The HTTP backend of a run whose server one of the nodes hosts.

    Args:
        name: ``static`` or ``c10d``.
        run_id: The run.
        host, port: Where the server is (or is to be) reached.
        hosting: ``True``: host (fail if the port cannot be bound); ``False``: only connect;
            ``None``: host when the port can be bound on this machine's address for ``host``.
        rank: A static node rank: the node's rank in every round.
        join_timeout: How long to keep trying to reach the host.
        linger: How long a hosting node keeps serving for the others once it is done.
        token, read_timeout: As for :class:`~aelastic.backends.http.client.HttpBackend`.
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
        self._client = HttpBackend(
            run_id,
            f"http://{_bracket(host)}:{port}",
            token=token,
            # A call gives up within the join timeout: the retries are this class's.
            read_timeout=min(read_timeout, join_timeout),
            share_connections=False,
        )
        self._runner: Any = None
        self._started = False
        self._lock: asyncio.Lock | None = None

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
        runner = web.AppRunner(create_app(token=self._token or ""), access_log=None)
        await runner.setup()
        try:
            await web.SockSite(runner, sock).start()
        except BaseException:
            sock.close()
            await runner.cleanup()
            raise
        self._runner = runner
        log.info("hosting the %s rendezvous on port %d", self.name, self._port)

    async def _reach(self, call: Any, *args: Any) -> Any:
        """``call(*args)``, trying again while the host cannot be reached (join timeout)."""
        await self._start()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._join_timeout
        while True:
            try:
                return await call(*args)
            except RendezvousConnectionError as exc:
                if loop.time() + _RETRY >= deadline:
                    raise RendezvousConnectionError(
                        f"the {self.name} rendezvous host {self.endpoint} could not be reached "
                        f"within the join timeout ({self._join_timeout:g} s): {exc}"
                    ) from None
                await asyncio.sleep(_RETRY)

    # -- the protocol ---------------------------------------------------------------------

    async def apply(self, request: Request, hold: float = 0.0, seen: Token | None = None) -> Reply:
        reply: Reply = await self._reach(self._client.apply, request, hold, seen)
        if self._rank is None or reply.rank is None:
            return reply
        if request.op is Op.JOIN:
            await self._claim(request, reply)
            addr, port = await self._master(request, reply)
            return replace(reply, rank=self._rank, master_addr=addr, master_port=port)
        return replace(reply, rank=self._rank)

    async def _master(self, request: Request, reply: Reply) -> tuple[str, int]:
        """Where the workers bootstrap: node rank 0's address and port (not the first node
        of the round's order, whose rank the node rank replaced); node rank 0 says it."""
        key = f"static/master/{reply.status.round}"
        if self._rank == 0:
            mine = (request.node.addr, request.port)
            await self._client.kv_set(key, json.dumps(mine).encode())
            return mine
        if not await self._reach(self._client.kv_wait, [key], self._join_timeout):
            raise RendezvousError(
                f"node rank 0 did not say where the workers bootstrap within the join "
                f"timeout ({self._join_timeout:g} s)"
            )
        (raw,) = await self._client.kv_get([key])
        addr, port = json.loads(raw or b"null")
        return str(addr), int(port)

    async def _claim(self, request: Request, reply: Reply) -> None:
        """Take this node rank in the round; two nodes with one node rank are an error."""
        key = f"static/node-rank/{reply.status.round}/{self._rank}"
        mine = request.node.key.encode()
        held = await self._client.kv_compare_set(key, None, mine)
        if held != mine:
            raise RendezvousError(
                f"two nodes were started with node rank {self._rank} "
                f"({held.decode(errors='replace')} and {request.node.key}): "
                "give each node its own --node-rank"
            )

    async def wait_for_change(self, token: Token, timeout: float | None) -> Status | None:
        result: Status | None = await self._reach(self._client.wait_for_change, token, timeout)
        return result

    async def snapshot(self) -> Snapshot | None:
        result: Snapshot | None = await self._reach(self._client.snapshot)
        return result

    async def close_run(self) -> bool:
        return bool(await self._reach(self._client.close_run))

    async def reset(self) -> bool:
        return bool(await self._reach(self._client.reset))

    async def list_runs(self, limit: int) -> list[tuple[str, Status]]:
        result: list[tuple[str, Status]] = await self._reach(self._client.list_runs, limit)
        return result

    async def kv_set(self, key: str, value: bytes) -> None:
        await self._reach(self._client.kv_set, key, value)

    async def kv_get(self, keys: Sequence[str]) -> list[bytes | None]:
        result: list[bytes | None] = await self._reach(self._client.kv_get, keys)
        return result

    async def kv_add(self, key: str, amount: int) -> int:
        return int(await self._reach(self._client.kv_add, key, amount))

    async def kv_compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes:
        result: bytes = await self._reach(self._client.kv_compare_set, key, expected, desired)
        return result

    async def kv_delete(self, key: str) -> bool:
        return bool(await self._reach(self._client.kv_delete, key))

    async def kv_wait(self, keys: Sequence[str], timeout: float) -> bool:
        return bool(await self._reach(self._client.kv_wait, keys, timeout))

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


def _is_local(host: str) -> bool:
    """Whether ``host`` names this machine (one of its addresses can be bound)."""
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
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
            f"{params.min_nodes}:{params.max_nodes} (use c10d, redis or http for elastic jobs)."
        )
    rank = params.get_as_int("rank")
    if rank is None or not 0 <= rank < params.max_nodes:
        raise ValueError(
            f"The static rendezvous needs a node rank in [0, {params.max_nodes}) "
            f"(--node-rank), got {rank}."
        )
    host, port = parse_rendezvous_endpoint(params.endpoint, DEFAULT_PORT)
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
    host, port = parse_rendezvous_endpoint(params.endpoint, DEFAULT_PORT)
    hosting = params.get_as_bool("is_host")
    return HostedBackend("c10d", params.run_id, host, port, hosting=hosting, **_settings(params))
