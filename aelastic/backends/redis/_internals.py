"""The one module that reaches into redis-py's internals (the Cluster client's).

How it works: :class:`_CommandTable` replaces a ``RedisCluster``'s command parser so that the
server's command table (``COMMAND``, some hundred kilobytes to parse) is read once per
process and cluster instead of at each client's initialization (the measured reason is in
:mod:`._cluster`'s docstring). That takes redis-py's private ``redis._parsers`` module and
the parser's ``initialize(node)``, ``node`` and ``commands``; closing every node's
connections takes the client's ``nodes_manager.aclose(attr)``. Nothing else in aelastic
imports a private name of redis-py (the protocol codec has its own error table,
:data:`._codec.ERRORS`). When a redis-py release moves these, :data:`SHARED_TABLE` is
``False`` and each cluster client reads the table itself (slower, still correct), and
``tests/backends/test_redis_internals.py`` fails, naming the redis-py version.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import weakref
from typing import Any


def _private(module: str, name: str) -> Any:
    """redis-py's ``module.name``, or ``None`` where a release moved it (imported by name:
    typed ``Any`` whatever the release's own annotations)."""
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


#: redis-py's cluster command parser (``None``: moved, see the module docstring).
AsyncCommandsParser: Any = _private("redis._parsers", "AsyncCommandsParser")

__all__ = ["SHARED_TABLE", "AsyncCommandsParser", "close_every_node", "share_command_table"]

#: Command tables read from each cluster (by its startup nodes), shared by its clients.
_TABLES: dict[Any, dict[str, Any]] = {}
#: Per event loop, a lock per cluster: one client of the loop reads, the others wait.
_LOCKS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Any, asyncio.Lock]] = (
    weakref.WeakKeyDictionary()
)


def _parser_fits() -> bool:
    if AsyncCommandsParser is None:
        return False
    initialize = getattr(AsyncCommandsParser, "initialize", None)
    if initialize is None or not inspect.iscoroutinefunction(initialize):
        return False
    return "node" in inspect.signature(initialize).parameters


#: Whether redis-py's cluster parser is where and what :class:`_CommandTable` expects.
SHARED_TABLE = _parser_fits()

if SHARED_TABLE:

    class _CommandTable(AsyncCommandsParser):  # type: ignore[misc]
        """redis-py's command parser, with the command table read once per process and
        cluster (see the module docstring)."""

        def __init__(self, hosts: Any) -> None:
            super().__init__()
            self._hosts = hosts

        async def initialize(self, node: Any = None) -> None:
            if node:
                self.node = node
            table = _TABLES.get(self._hosts)
            if table is None:
                locks = _LOCKS.setdefault(asyncio.get_running_loop(), {})
                async with locks.setdefault(self._hosts, asyncio.Lock()):
                    table = _TABLES.get(self._hosts)
                    if table is None:
                        commands = await self.node.execute_command("COMMAND")
                        table = {name.lower(): info for name, info in commands.items()}
                        _TABLES[self._hosts] = table
            self.commands = table


def share_command_table(cluster: Any, hosts: Any) -> bool:
    """Give ``cluster`` (a new ``RedisCluster``) the command table shared by the clients of
    the cluster at ``hosts``; whether it could (see the module docstring)."""
    if not SHARED_TABLE or not hasattr(cluster, "commands_parser"):
        return False
    cluster.commands_parser = _CommandTable(hosts)
    return True


async def close_every_node(cluster: Any) -> None:
    """Close the connections to every node ``cluster`` knows, the startup nodes included
    (redis-py's ``aclose()`` closes nothing once an error has marked the client for
    re-initialization)."""
    manager = cluster.nodes_manager
    await manager.aclose()
    await manager.aclose("startup_nodes")
