"""``GET /metrics`` of a real ``aelastic serve``: Prometheus' format, following the runs."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

import pytest

from aelastic import RendezvousParameters
from aelastic.rendezvous import create_handler
from tests._http_server import HttpServer
from tests._rendezvous_helpers import PROMPT

parser = pytest.importorskip("prometheus_client.parser")

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _scrape(url: str, token: str | None = None) -> Samples:
    request = urllib.request.Request(url + "/metrics")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=PROMPT) as answer:
        assert answer.headers["Content-Type"].startswith("text/plain")
        text = answer.read().decode()
    samples: Samples = {}
    for family in parser.text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


@pytest.mark.anyio
async def test_metrics_follow_runs_nodes_and_requests(run_id: str, tmp_path: Path) -> None:
    with HttpServer(persist=str(tmp_path / "runs.json")) as server:
        before = _scrape(server.url)
        assert before[("aelastic_server_runs", ())] == 0
        params = [
            RendezvousParameters("http", server.endpoint, run_id, 2, 2, last_call_timeout=0.1)
            for _ in range(2)
        ]
        handlers = [create_handler(p) for p in params]
        try:
            import asyncio

            infos = await asyncio.wait_for(
                asyncio.gather(*(h.next_rendezvous() for h in handlers)), 3 * PROMPT
            )
            assert sorted(i.rank for i in infos) == [0, 1]
            after = _scrape(server.url)
        finally:
            for handler in handlers:
                await handler.aclose()
    assert after[("aelastic_server_runs", ())] == 1
    assert after[("aelastic_server_nodes", (("state", "participant"),))] == 2
    assert after[("aelastic_server_nodes", (("state", "waiting"),))] == 0
    # The joins went as messages on the channel (one WebSocket: one request) of the
    # handlers' connection (shared: one event loop).
    assert after[("aelastic_server_channel_answers_total", (("status", "200"),))] >= 2
    channels = [
        value
        for (name, labels), value in after.items()
        if name == "aelastic_server_requests_total" and ("route", "/v1/channel") in labels
    ]
    assert not channels or sum(channels) <= 2  # counted once a channel closes
    assert after[("aelastic_server_requests_in_progress", ())] >= 1  # the open channel
    assert not any(run_id in str(labels) for (_, labels) in after)
    assert after[("aelastic_server_persist_seconds_count", ())] >= 1


def test_metrics_need_the_token() -> None:
    with HttpServer(token="s3cret") as server:
        with pytest.raises(urllib.error.HTTPError) as refused:
            _scrape(server.url)
        assert refused.value.code == 401
        refused.value.close()
        assert ("aelastic_server_runs", ()) in _scrape(server.url, "s3cret")
