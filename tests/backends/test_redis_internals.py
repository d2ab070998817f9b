"""What aelastic takes from redis-py beyond its public API, checked against the installed
release: these fail, naming the release, when redis-py moves what
``aelastic/backends/redis/_internals.py`` reaches into, or when its parser's table of error
codes says something the codec's own (``_codec.ERRORS``) does not."""

from __future__ import annotations

import importlib
import inspect

import pytest
import redis
from redis.asyncio.cluster import ClusterNode, RedisCluster

from aelastic.backends.redis import parse_endpoint
from aelastic.backends.redis._codec import error
from aelastic.backends.redis._internals import (
    SHARED_TABLE,
    AsyncCommandsParser,
    close_every_node,
    share_command_table,
)
from tests._redis_ha import RedisCluster as Servers

MOVED = f"redis-py {redis.__version__} moved what aelastic/backends/redis/_internals.py uses"


def test_redis_pys_cluster_parser_is_where_aelastic_reaches_for_it() -> None:
    assert AsyncCommandsParser is not None, f"{MOVED}: redis._parsers.AsyncCommandsParser"
    assert SHARED_TABLE, f"{MOVED}: AsyncCommandsParser.initialize(node) is not a coroutine"
    client = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", 1)])
    assert isinstance(getattr(client, "commands_parser", None), AsyncCommandsParser), (
        f"{MOVED}: RedisCluster.commands_parser"
    )
    manager = getattr(client, "nodes_manager", None)
    assert manager is not None, f"{MOVED}: RedisCluster.nodes_manager"
    assert len(inspect.signature(manager.aclose).parameters) == 1, (
        f"{MOVED}: NodesManager.aclose(attr)"
    )


@pytest.mark.anyio
async def test_a_clusters_clients_share_one_command_table() -> None:
    with Servers(primaries=3, replicas=0) as servers:
        hosts = parse_endpoint(servers.endpoint).hosts
        clients = [
            RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in hosts]) for _ in range(2)
        ]
        try:
            assert all(share_command_table(client, hosts) for client in clients)
            for client in clients:
                await client.initialize()
            one, two = (client.commands_parser.commands for client in clients)
            assert one is two and "set" in one
            assert await clients[0].set("{k}a", b"1") and await clients[1].get("{k}a") == b"1"
        finally:
            for client in clients:
                await client.aclose()
                await close_every_node(client)


def _redis_pys_parser() -> type:
    try:
        return importlib.import_module("redis._parsers.base").BaseParser  # type: ignore[no-any-return]
    except (ImportError, AttributeError):
        pytest.fail(
            f"redis-py {redis.__version__} moved redis._parsers.base.BaseParser: compare "
            "aelastic/backends/redis/_codec.py's ERRORS with its parser anew"
        )


def _texts() -> list[str]:
    table = _redis_pys_parser().EXCEPTION_CLASSES  # type: ignore[attr-defined]
    texts = ["ERR unknown command 'X'", "WRONGTYPE Operation against a key", "BUSY script"]
    for code, kind in table.items():
        messages = list(kind) if isinstance(kind, dict) else ["3999 127.0.0.1:7000"]
        texts += [f"{code} {message}" for message in messages]
    return texts


def test_the_codec_makes_the_errors_redis_pys_parser_makes() -> None:
    parser = _redis_pys_parser()
    for text in _texts():
        theirs, ours = parser.parse_error(text), error(text)  # type: ignore[attr-defined]
        assert type(ours) is type(theirs), (
            f"redis-py {redis.__version__} makes {type(theirs).__name__} of {text!r}, "
            f"aelastic's codec {type(ours).__name__}: update _codec.ERRORS"
        )
        assert str(ours) == str(theirs), text
