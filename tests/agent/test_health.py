"""TORCHELASTIC_HEALTH_CHECK_PORT: the agent answers probes on its own loop, from before the
first rendezvous until it ends."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import pytest

from aelastic.agent import ElasticAgent
from aelastic.agent.health.check import PORT_VAR, HealthServer, health_port
from tests._ports import free_port

from .helpers import WorkerHub, make_handler, running, worker_spec

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


async def probe(port: int, request: bytes = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n") -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    await writer.wait_closed()
    return answer


def document(answer: bytes) -> dict[str, Any]:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK"), answer
    assert b"Content-Type: application/json" in head
    data: dict[str, Any] = json.loads(body)
    return data


async def test_every_request_gets_the_answer_a_tcp_probe_just_connects() -> None:
    server = HealthServer(0, lambda: {"state": "HEALTHY"}, host="127.0.0.1")
    await server.start()
    try:
        data = document(await probe(server.port))
        assert data["alive"] is True and data["timeout"] == 60 and data["state"] == "HEALTHY"
        assert isinstance(data["last_progress_time"], int)
        head = await probe(server.port, b"HEAD / HTTP/1.0\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK") and head.endswith(b"\r\n\r\n")
        _, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.close()  # a kubelet tcpSocket probe: connect, close
        await writer.wait_closed()
        assert document(await probe(server.port))["alive"] is True  # still serving
    finally:
        await server.aclose()
    with pytest.raises(OSError):
        await probe(server.port)


def test_the_port_variable_is_checked() -> None:
    assert health_port({}) is None
    assert health_port({PORT_VAR: "8080"}) == 8080
    for bad in ("http", "-1", "70000"):
        with pytest.raises(ValueError, match=f"{PORT_VAR}='{bad}' is not a port number"):
            health_port({PORT_VAR: bad})


async def test_the_agent_answers_while_it_runs(
    run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    monkeypatch.setenv(PORT_VAR, str(port))
    async with WorkerHub() as hub:
        agent = ElasticAgent(worker_spec(make_handler(run_id), hub, "report", 1))
        async with running(agent) as task:
            hello = await hub.next()
            data = document(await probe(port))
            assert (data["state"], data["restart_count"], data["run_id"]) == ("HEALTHY", 0, run_id)
            hub.release(hello["pid"])
            assert not (await task).is_failed()
    with pytest.raises(OSError):
        await probe(port)  # gone with the agent


async def test_a_port_in_use_does_not_stop_the_run(
    run_id: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        monkeypatch.setenv(PORT_VAR, str(taken.getsockname()[1]))
        async with WorkerHub() as hub:
            agent = ElasticAgent(worker_spec(make_handler(run_id), hub, "report", 1))
            async with running(agent) as task:
                hub.release((await hub.next())["pid"])
                assert not (await task).is_failed()
    assert "cannot serve the health check" in caplog.text
