"""A node's named connection to Redis, and a survivor's check for the members whose went.

How it works: a node that joined a run keeps one connection of its own to the server that
holds the run (the primary of a standalone server or a Sentinel service; the primary of the
run's slot in a Cluster), named ``CLIENT SETNAME <prefix>:{run}:n:<node key>``
(:func:`connection_name`), and says in the run's ``named`` hash that it carries one. The
connection sends nothing but a ``PING`` now and then; when it is lost (the agent's process
died: its kernel closed the socket and Redis dropped the client at once; or the network cut
it) a live node opens it again at once, names it again, and then beats (the ``on_restored``
hook), so that a departure reported meanwhile finds it heard from.

A survivor whose worker's collective broke asks :func:`absent_members`: one round trip,
``TIME`` then ``CLIENT LIST TYPE normal`` on that same server, gives the members (of a
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


def connection_name(base: str, node: NodeDesc) -> str:
    """The client name of ``node``'s connection in the run whose keys start with ``base``
    (characters ``CLIENT SETNAME`` refuses, spaces among them, become ``?``)."""
    name = f"{base}:n:{node.key}"
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
    listed: dict[str, int],
    named: Iterable[str],
    members: Iterable[NodeDesc],
    me: NodeDesc,
    base: str,
) -> list[NodeDesc]:
    """Of ``members``, those that said they carry a name (``named``: their keys) and whose
    name is not ``listed``; none when ``me``'s own name is missing or younger than 1 s."""
    if listed.get(connection_name(base, me), 0) < 1:
        return []
    said = set(named)
    return [
        n for n in members if n != me and n.key in said and connection_name(base, n) not in listed
    ]


class Presence:
    """One node's named connection (see the module docstring).

    Args:
        server: The client's server object (``dial``, ``presence_address``, ``address_now``).
        name: The connection's name.
        marker: ``(hash, field, ttl ms)``: where the node says it carries a name.
        route: The run's state key (a Cluster's slot).
        on_restored: Called after the connection was opened again and named (a beat).
    """

    def __init__(
        self,
        server: Any,
        name: str,
        marker: tuple[str, str, str],
        route: str,
        on_restored: Callable[[], Awaitable[object]],
    ) -> None:
        self._server = server
        self._name = name
        self._marker = marker
        self._route = route
        self._on_restored = on_restored
        self._task: asyncio.Task[None] | None = None
        #: The connection is named (set) or being (re)opened (clear).
        self.named = asyncio.Event()

    def start(self) -> None:
        """Open and keep the named connection (a task on the running loop)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._keep(), name=f"aelastic-redis-presence-{self._name}"
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
                log.debug("opening the named connection %s: %s", self._name, exc)
                delay = min(max(delay * 2, 0.05), _MAX_BACKOFF)
                continue
            delay = 0.0
            self.named.set()
            if not first:
                with contextlib.suppress(Exception):  # a beat is sent again later anyway
                    await self._on_restored()
            first = False
            await self._hold(conn)
            self.named.clear()
            log.info("the named connection %s was lost: opening it again", self._name)

    async def _open(self) -> Any:
        address = await self._server.presence_address(self._route)
        conn = await self._server.dial(address)
        key, field, ttl = self._marker
        commands = [("CLIENT", "SETNAME", self._name), ("HSET", key, field, "1")]
        commands.append(("PEXPIRE", key, ttl))
        try:
            replies = await asyncio.wait_for(
                conn.request(b"".join(pack(c) for c in commands), len(commands)), 10.0
            )
        except BaseException:
            conn.close()
            raise
        for reply in replies:
            if isinstance(reply, Exception):
                conn.close()
                if "NOPERM" in str(reply) or "permission" in str(reply).lower():
                    raise _Refused(str(reply))
                raise reply
        return conn

    async def _hold(self, conn: Any) -> None:
        lost = asyncio.Event()
        conn.on_lost(lambda _: lost.set())
        try:
            while not lost.is_set():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(lost.wait(), PING_INTERVAL)
                if lost.is_set():
                    break
                if self._server.address_now(self._route) not in (None, conn.address):
                    break  # a failover: the commands go to another server now
                conn.ping()
        finally:
            conn.close()

    async def aclose(self) -> None:
        """Close the named connection."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


class _Refused(Exception):
    """The server's ACL refuses a command of the named connection."""
