"""The agent's Prometheus metrics: listeners on its events, served over HTTP, one registry each.

Two agents in one process (a rescale: a late node scales the group up) each serve their own
``/metrics``; the scrape goes over real HTTP and is parsed with prometheus_client's parser.
"""

from __future__ import annotations

import asyncio
import urllib.request

import pytest

from aelastic.agent import ElasticAgent, WorkerState
from aelastic.agent.prometheus import AgentCollector, MetricsPortInUse, serve_metrics
from tests._http_server import free_port

from .helpers import WorkerHub, make_handler, running, worker_spec

parser = pytest.importorskip("prometheus_client.parser")

pytestmark = pytest.mark.anyio

Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


def _scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: Samples = {}
    for family in parser.text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def _collector(agent: ElasticAgent) -> AgentCollector:
    handler = agent.spec.rdzv_handler
    collector = AgentCollector(handler.get_run_id(), str(handler.node), "default", "memory")
    agent.add_listener(collector)
    return collector


async def test_two_agents_serve_their_own_metrics_through_a_rescale(run_id: str) -> None:
    async with WorkerHub() as hub:

        def agent() -> ElasticAgent:
            handler = make_handler(run_id, 1, 2, last_call_timeout=0.3)
            return ElasticAgent(worker_spec(handler, hub, nproc=1))

        early, late = agent(), agent()
        ports = [free_port(), free_port()]
        runners = [
            await serve_metrics(_collector(a), p) for a, p in zip((early, late), ports, strict=True)
        ]
        try:
            async with running(early) as first:
                alone = await hub.next()
                async with running(late) as second:
                    pair = []
                    while len(pair) < 2:
                        hello = await hub.next()
                        if hello["world_size"] == 2:
                            pair.append(hello)
                    early_seen, late_seen = await asyncio.gather(
                        asyncio.to_thread(_scrape, ports[0]), asyncio.to_thread(_scrape, ports[1])
                    )
                    for hello in pair:
                        hub.release(hello["pid"])
                    results = [await first, await second]
        finally:
            for runner in runners:
                await runner.cleanup()
    assert alone["world_size"] == 1
    assert all(r.state is WorkerState.SUCCEEDED for r in results)
    # The early node formed two rounds and re-formed because a node was waiting.
    assert early_seen["aelastic_rendezvous_duration_seconds_count"][()] == 2
    assert early_seen["aelastic_membership_changes_total"][(("reason", "node_waiting"),)] == 1
    assert early_seen["aelastic_restarts_total"][(("reason", "node_waiting"),)] == 1
    assert early_seen["aelastic_restarts_total"][(("reason", "worker_failed"),)] == 0
    assert early_seen["aelastic_world_size"][()] == 2
    # The late node: one round, nothing restarted; its own registry, its own values.
    assert late_seen["aelastic_rendezvous_duration_seconds_count"][()] == 1
    assert late_seen["aelastic_membership_changes_total"][(("reason", "node_waiting"),)] == 0
    assert late_seen["aelastic_nodes"][()] == 2 and late_seen["aelastic_local_workers"][()] == 1
    early_info = next(iter(early_seen["aelastic_agent_info"]))
    late_info = next(iter(late_seen["aelastic_agent_info"]))
    assert early_info != late_info  # each names its own node


async def test_a_taken_port_is_a_clear_error() -> None:
    port = free_port()
    first = await serve_metrics(AgentCollector("job", "n1", "default", "memory"), port)
    try:
        with pytest.raises(MetricsPortInUse, match=f"metrics port {port} is in use"):
            await serve_metrics(AgentCollector("job", "n2", "default", "memory"), port)
    finally:
        await first.cleanup()
