"""A node's named connection to Redis, and a survivor's check for the members whose went.

How it works: a process whose nodes joined a run names a connection to the server that
holds the run, ``CLIENT SETNAME <prefix>:{run}:p:<host>_<pid>_<random>``
(:func:`connection_name`), and each of its nodes says in the run's ``named`` hash which
name it carries (nodes of one process share it, as they share the client: they die
together). On RESP3 (a standalone server or a Sentinel service) that is the client's one
connection, the listener's, which carries its commands too: named once, for every run of
the client, so a node holds one connection, not two (a second connection per node doubled
the connects of a forming job and the server's clients). On RESP2, or in a Cluster (the
primary of the run's slot), it is a connection of its own that sends nothing but a
``PING`` now and then. When the named connection is lost (the agent's process died: its
kernel closed the socket and Redis dropped the client at once; or the network cut it) a
live process opens it again at once (the listener does, for the shared one), names it
again, and then its nodes beat, so that a departure reported meanwhile finds them heard
from.

A survivor whose worker's collective broke asks :func:`absent_members`: one round trip,
``TIME`` then ``CLIENT LIST`` on that same server, gives the members (of a
snapshot) that said they carry a name and whose name is not listed. The backend reports
each as a departure at that ``TIME`` less a millisecond (:meth:`Request.departure
<aelastic.core.state.Request.departure>`): Redis runs commands one at a time, so a node
that names itself again after the list beats after that moment and stays; the machine
decides (its grace, then: lost if not heard from since). Not reported, so left to the
heartbeat window: members that never said they carry a name (an older aelastic, a user who
may not ``CLIENT SETNAME``), and everything when the survivor's own name is not listed or is
younger than a second (the server restarted or failed over, or the survivor's view is not
the server's: names come back within the grace).

Why this fact and not another: Redis tells nobody that a client went (no keyspace event, no
hook a script can read; ``CLIENT`` is not allowed in scripts), but it drops a client as soon
as its socket ends, and the client list says so at once. Listing costs O(clients) on the
server, so it is asked only when a worker's collective broke, never on a timer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from redis.exceptions import RedisError

from ...core.state import NodeDesc
from ._codec import pack

__all__ = ["Presence", "absent_members", "connection_name", "parse_client_list"]

log = logging.getLogger("aelastic.backends.redis")

#: Seconds between the ``PING``s of a named connection (and checks that it still reaches
#: the server the commands go to, after a Sentinel failover).
PING_INTERVAL = 5.0
#: Longest wait between two attempts to open a lost named connection again.
_MAX_BACKOFF = 0.5


def connection_name(base: str) -> str:
    """A new client name for this process's connection to the run whose keys start with
    ``base`` (characters ``CLIENT SETNAME`` refuses, spaces among them, become ``?``)."""
    name = f"{base}:p:{socket.gethostname()}_{os.getpid()}_{secrets.token_hex(4)}"
    return "".join(c if "!" <= c <= "~" else "?" for c in name)


def parse_client_list(text: str) -> dict[str, int]:
    """``CLIENT LIST``'s answer as name -> the age (seconds) of its youngest connection."""
    names: dict[str, int] = {}
    for line in text.splitlines():
        fields = dict(f.split("=", 1) for f in line.split(" ") if "=" in f)
        name = fields.get("name", "")
        if name:
            age = int(fields.get("age", "0") or 0)
            names[name] = min(age, names.get(name, age))
    return names


def absent_members(
    listed: dict[str, int], named: dict[str, str], members: Iterable[NodeDesc], me: NodeDesc
) -> list[NodeDesc]:
    """Of ``members``, those that said they carry a name (``named``: node key -> the name
    of its connection) and whose name is not ``listed``; none when ``me``'s own name is
    missing or younger than 1 s."""
    mine = named.get(me.key)
    if mine is None or listed.get(mine, 0) < 1:
        return []
    return [n for n in members if n != me and named.get(n.key, mine) not in listed]


class Presence:
    """The named connection of one process to one run's server, for the nodes of that
    process in the run (see the module docstring).

    Args:
        server: The client's server object (``dial``, ``presence_address``, ``address_now``).
        base: The run's key prefix (the name starts with it).
        marker: ``(hash, ttl ms)``: where each node says which name it carries.
        route: The run's state key (a Cluster's slot).
    """

    def __init__(self, server: Any, base: str, marker: tuple[str, str], route: str) -> None:
        self._server = server
        self.name = connection_name(base)
        self._marker = marker
        self._route = route
        #: The nodes whose connection this is -> their beat (sent when it is named again).
        self.nodes: dict[str, Callable[[], Awaitable[object]]] = {}
        self._task: asyncio.Task[None] | None = None
        self._conn: Any = None
        self._shared = False  # the connection is the client's (its listener's), not ours

    def add(self, node: NodeDesc, on_restored: Callable[[], Awaitable[object]]) -> None:
        """Carry ``node``'s name too (said at once if the connection is up)."""
        self.nodes[node.key] = on_restored
        conn = self._conn
        if conn is not None and not conn.closed:
            key, ttl = self._marker
            commands = [("HSET", key, node.key, self.name), ("PEXPIRE", key, ttl)]
            with contextlib.suppress(Exception):
                conn.call(b"".join(pack(c) for c in commands), 2, _ignored)
        self.start()

    def start(self) -> None:
        """Open and keep the named connection (a task on the running loop)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._keep(), name=f"aelastic-redis-presence-{self.name}"
            )

    async def _keep(self) -> None:
        delay, first = 0.0, True
        while True:
            await asyncio.sleep(delay)
            try:
                conn = await self._open()
            except _Refused as exc:
                log.warning(
                    "Redis refused to name this node's connection (%s): its peers learn of "
                    "its loss by the heartbeat window only; allow 'client|setname' and "
                    "'client|list' to its user (docs/production-store.md)",
                    exc,
                )
                return
            except (RedisError, OSError, asyncio.TimeoutError) as exc:
                if getattr(self._server, "_closed", False):
                    return  # the client is closed: nothing to name any more
                log.debug("opening the named connection %s: %s", self.name, exc)
                delay = min(max(delay * 2, 0.05), _MAX_BACKOFF)
                continue
            delay, self._conn = 0.0, conn
            if not first:  # the nodes beat now: after the name is back (see the docstring)
                beats = [beat() for beat in list(self.nodes.values())]
                await asyncio.gather(*beats, return_exceptions=True)
            first = False
            await self._hold(conn)
            self._conn = None
            log.info("the named connection %s was lost: opening it again", self.name)

    async def _open(self) -> Any:
        shared = await self._server.combined()
        if shared is not None:  # the client's one connection: named once, for every run
            conn = shared
            if conn.client_name is None:
                conn.client_name = self.name
            self.name = conn.client_name
        else:
            address = await self._server.presence_address(self._route)
            conn = await self._server.dial(address)
            conn.client_name = self.name
        key, ttl = self._marker
        commands: list[tuple[str, ...]] = [("CLIENT", "SETNAME", self.name)]
        if self.nodes:
            pairs = [x for k in self.nodes for x in (k, self.name)]
            commands += [("HSET", key, *pairs), ("PEXPIRE", key, ttl)]
        try:  # (no asyncio.wait_for: it may swallow a cancellation; the connection's own
            # watchdog closes it when an answer does not come)
            replies = await conn.request(b"".join(pack(c) for c in commands), len(commands))
        except BaseException:
            if shared is None:
                conn.close()
            raise
        for reply in replies:
            if isinstance(reply, Exception):
                if shared is None:
                    conn.close()
                if "NOPERM" in str(reply) or "permission" in str(reply).lower():
                    raise _Refused(str(reply))
                raise reply
        self._shared = shared is not None
        return conn

    async def _hold(self, conn: Any) -> None:
        """Until ``conn`` is lost (its own: a ``PING`` now and then, an unanswered one
        closes it; the client's shared one: its listener watches it and opens another)."""
        lost = asyncio.Event()
        conn.on_lost(lambda _: lost.set())
        if self._shared:
            await lost.wait()
            return
        loop = asyncio.get_running_loop()
        timer: asyncio.TimerHandle | None = None

        def tick() -> None:
            nonlocal timer
            if self._server.address_now(self._route) not in (None, conn.address):
                conn.close()  # a failover: the commands go to another server now
                return
            with contextlib.suppress(RedisError):
                conn.call(_PING, 1, _ignored)
            timer = loop.call_later(PING_INTERVAL, tick)

        timer = loop.call_later(PING_INTERVAL, tick)
        try:
            await lost.wait()
        finally:
            if timer is not None:
                timer.cancel()
            conn.close()

    async def aclose(self) -> None:
        """Close the named connection."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            conn, self._conn = self._conn, None
            if conn is not None and not self._shared:
                conn.close()
            await asyncio.wait({task}, timeout=2.0)


_PING = pack(("PING",))


def _ignored(replies: Any, error: BaseException | None) -> None:
    """A reply nobody waits for."""


class _Refused(Exception):
    """The server's ACL refuses a command of the named connection."""
