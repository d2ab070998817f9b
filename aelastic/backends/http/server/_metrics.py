"""The server's Prometheus metrics: ``GET /metrics`` (with the ``metrics`` extra).

How it works: :func:`install` adds a middleware that counts every answered request by route
pattern (never the raw path: run ids would make the series unbounded), method and status,
a gauge of the requests being answered (held long-polls included; an open channel is one
request), and the requests answered on channels (:mod:`._channel`) by status; a
collector reads the runs and their nodes per state (participants, waiting, redundant) from
the store at each scrape, and the counts of the clients' limits: failed token checks and
the requests refused for them (:mod:`._throttle`, by kind), joins refused for a client's
quota of nodes (:mod:`._quota`), requests refused by the quotas of runs and of store bytes
(:mod:`._tenancy`, by limit) and the bytes the stores hold; the store reports each
persistence write's duration. Everything
lives in a registry of this application's own (several servers in one process never clash).
The route sits behind the same token check as the API (Prometheus sends it as a bearer
token). Without ``prometheus_client`` the route answers 501 naming the extra, and the server
runs on.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from aiohttp import web

from ....core.machine import snapshot_of
from ..._engine import now_ms
from ._channel import TAPS
from ._quota import QUOTA, NodeQuota
from ._runs import RunStore
from ._tenancy import RUN_QUOTA, STORE_QUOTA, RunQuota, StoreQuota
from ._throttle import THROTTLE, AuthThrottle

__all__ = ["install"]

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_MISSING = "metrics need prometheus_client: pip install 'aelastic[metrics]'"


def install(app: web.Application, store: RunStore) -> None:
    """Serve ``GET /metrics`` on ``app`` and count its requests."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:

        async def missing(request: web.Request) -> web.Response:
            return web.json_response({"error": _MISSING}, status=501)

        app.router.add_get("/metrics", missing)
        return
    metrics = _Metrics(store)
    limits = _LimitsCollector(app[THROTTLE], app[QUOTA], app[RUN_QUOTA], app[STORE_QUOTA])
    metrics.registry.register(limits)
    app.middlewares.insert(0, metrics.middleware)  # outermost: sees every final status
    app[TAPS].append(metrics.channel_answer)
    app.router.add_get("/metrics", metrics.scrape)


class _Metrics:
    def __init__(self, store: RunStore) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "aelastic_server_requests",
            "Requests answered, by route pattern, method and status.",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.in_progress = Gauge(
            "aelastic_server_requests_in_progress",
            "Requests being answered, held long-polls and heartbeats included.",
            registry=self.registry,
        )
        # Counted in a plain dict, read at each scrape: a labelled Counter's ``labels().inc()``
        # per answer (a lock, a label lookup) was a twentieth of the server's CPU per held
        # heartbeat (measured, benchmarks/beat_cost_http.py).
        self.channel_answers: dict[int, int] = {}
        self.registry.register(_ChannelCollector(self.channel_answers))
        self.persist = Histogram(
            "aelastic_server_persist_seconds",
            "Duration of a write of the runs to the --persist journal.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=self.registry,
        )
        store.on_write = self.persist.observe
        self.registry.register(_RunsCollector(store))

    @web.middleware
    async def middleware(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        if request.path == "/metrics":
            return await handler(request)
        status = 500
        self.in_progress.inc()
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            self.in_progress.dec()
            self.requests.labels(_route(request), request.method, str(status)).inc()

    def channel_answer(self, status: int, size: int) -> None:
        answers = self.channel_answers
        answers[status] = answers.get(status, 0) + 1

    async def scrape(self, request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        body = generate_latest(self.registry)
        response = web.Response(body=body)
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response


def _route(request: web.Request) -> str:
    info = request.match_info
    route = getattr(info, "route", None)
    resource = getattr(route, "resource", None)
    canonical = getattr(resource, "canonical", None)
    return canonical if isinstance(canonical, str) else "unmatched"


class _ChannelCollector:
    """The answers on channels, by status, read at each scrape."""

    def __init__(self, answers: dict[int, int]) -> None:
        self._answers = answers

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        family = CounterMetricFamily(
            "aelastic_server_channel_answers",
            "Rendezvous requests answered on channels (WebSockets), by status.",
            labels=["status"],
        )
        for status, count in sorted(self._answers.items()):
            family.add_metric([str(status)], count)
        yield family


class _RunsCollector:
    """Runs and nodes per state, read from the store at each scrape."""

    def __init__(self, store: RunStore) -> None:
        self._store = store

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        runs = GaugeMetricFamily("aelastic_server_runs", "Runs this server holds.")
        nodes = GaugeMetricFamily(
            "aelastic_server_nodes", "Nodes of every run, by state.", labels=["state"]
        )
        count, participants, waiting, redundant = 0, 0, 0, 0
        now = now_ms()
        engine = self._store.engine
        with engine.lock:
            for run in engine.runs.values():
                if run.state is None:
                    continue
                count += 1
                snap = snapshot_of(run.state, now)
                participants += len(snap.participants)
                waiting += len(snap.wait_list)
                redundant += len(snap.redundancy_list)
        runs.add_metric([], count)
        nodes.add_metric(["participant"], participants)
        nodes.add_metric(["waiting"], waiting)
        nodes.add_metric(["redundant"], redundant)
        yield runs
        yield nodes


class _LimitsCollector:
    """What the limits per client counted, read at each scrape."""

    def __init__(
        self, throttle: AuthThrottle, quota: NodeQuota, runs: RunQuota, sizes: StoreQuota
    ) -> None:
        self._throttle = throttle
        self._quota = quota
        self._runs = runs
        self._sizes = sizes

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        failures = CounterMetricFamily(
            "aelastic_server_auth_failures",
            "Failed token checks (bearer: the API, the channel, /metrics, the pages' header; "
            "login: the pages' form).",
            labels=["kind"],
        )
        refused = CounterMetricFamily(
            "aelastic_server_auth_refused",
            "Requests answered 429 because their client failed too many token checks.",
            labels=["kind"],
        )
        for kind in ("bearer", "login"):
            failures.add_metric([kind], self._throttle.failures[kind])
            refused.add_metric([kind], self._throttle.refusals[kind])
        quota = CounterMetricFamily(
            "aelastic_server_node_quota_refused",
            "Joins refused (429) because their client has its limit of nodes in the runs.",
        )
        quota.add_metric([], self._quota.refused)
        quotas = CounterMetricFamily(
            "aelastic_server_quota_refused",
            "Requests refused by a quota of runs (429: new_runs, live_runs) or of store bytes "
            "(413: value, run_store, client_store, total_store).",
            labels=["limit"],
        )
        for limit in ("new_runs", "live_runs"):
            quotas.add_metric([limit], self._runs.refused[limit])
        for limit in ("value", "run", "client", "total"):
            name = limit if limit == "value" else f"{limit}_store"
            quotas.add_metric([name], self._sizes.refused[limit])
        stored = GaugeMetricFamily(
            "aelastic_server_store_bytes",
            "Bytes the members' stores of every run hold (keys, values, 64 a key).",
        )
        stored.add_metric([], self._sizes.engine.kv_bytes)
        yield failures
        yield refused
        yield quota
        yield quotas
        yield stored
