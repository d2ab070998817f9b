"""An aiohttp service that starts and supervises training jobs while it keeps serving requests.

Run it, then talk to it::

    python examples/embed_in_service.py --port 8080
    curl -X POST localhost:8080/jobs -d '{"nproc": 2}'          # starts examples/ddp_train.py
    curl localhost:8080/jobs/1                                  # state, events, root cause
    curl -X DELETE localhost:8080/jobs/1                        # stops it (workers and all)

How it works: aelastic's agent is a coroutine. A job is ``asyncio.create_task(agent.run())`` on
the service's own event loop, next to aiohttp's request handlers: no thread, no subprocess
launcher, no polling. The agent's events (rendezvous, workers started, restarts...) are
collected through ``agent.add_listener`` and served as JSON. Stopping a job is cancelling its
task: the agent stops the workers (SIGTERM, grace, SIGKILL), leaves the rendezvous and
returns with no process left behind. Each job has its own in-memory rendezvous (one node);
give it a Redis or HTTP backend instead to spread a job over several machines.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from aiohttp import web

from aelastic import RendezvousParameters
from aelastic.agent import AgentEvent, ElasticAgent, RunResult, WorkerSpec
from aelastic.rendezvous import create_handler

DEFAULT_SCRIPT = str(Path(__file__).resolve().parent / "ddp_train.py")


@dataclass
class Job:
    """One supervised training job."""

    id: int
    run_id: str
    command: list[str]
    agent: ElasticAgent
    task: asyncio.Task[RunResult] | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    cancelled: bool = False

    def on_event(self, event: AgentEvent) -> None:
        """Agent listener: keep the event as JSON-able data."""
        self.events.append({"kind": event.kind.value, "at": event.at, **_jsonable(event.data)})

    def describe(self) -> dict[str, Any]:
        """The job as JSON: state, worker state, last events, root cause when it failed."""
        doc: dict[str, Any] = {
            "id": self.id,
            "run_id": self.run_id,
            "command": self.command,
            "workers": self.agent.get_worker_group().state.value,
            "events": self.events[-20:],
        }
        task = self.task
        if task is None or not task.done():
            doc["state"] = "running"
        elif task.cancelled():
            doc["state"] = "stopped"
        elif task.exception() is not None:
            doc["state"] = "error"
            doc["error"] = repr(task.exception())
        else:
            result = task.result()
            doc["state"] = "failed" if result.is_failed() else "succeeded"
            root = result.root_cause
            if root is not None:
                doc["root_cause"] = str(root)
        return doc


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict | MappingProxyType):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, int | float | str | bool):
        return value
    return str(value)


class Supervisor:
    """Starts, lists and stops jobs on the running event loop."""

    def __init__(self) -> None:
        self.jobs: dict[int, Job] = {}
        self._ids = itertools.count(1)

    def start(self, nproc: int, script: str, args: list[str], max_restarts: int) -> Job:
        """Start a job of ``nproc`` workers running ``python script args``.

        Raises:
            ValueError: Invalid settings.
        """
        run_id = f"job-{uuid.uuid4().hex[:8]}"
        params = RendezvousParameters("memory", "service", run_id, 1, 1, last_call_timeout=0.1)
        command = [sys.executable, "-u", script, *args]
        spec = WorkerSpec(
            role="trainer",
            local_world_size=nproc,
            rdzv_handler=create_handler(params),
            entrypoint=command[0],
            args=tuple(command[1:]),
            max_restarts=max_restarts,
            stop_grace_period=5.0,
        )
        job = Job(next(self._ids), run_id, command, ElasticAgent(spec))
        job.agent.add_listener(job.on_event)
        job.task = asyncio.get_running_loop().create_task(_supervise(job.agent), name=run_id)
        self.jobs[job.id] = job
        return job

    async def stop(self, job: Job) -> None:
        """Cancel the job and wait until its workers are gone."""
        if job.task is not None and not job.task.done():
            job.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await job.task

    async def close(self) -> None:
        """Stop every job (the service is shutting down)."""
        await asyncio.gather(*(self.stop(job) for job in self.jobs.values()))


async def _supervise(agent: ElasticAgent) -> RunResult:
    """Run the job to its end, then release its rendezvous handler."""
    try:
        return await agent.run()
    finally:
        await agent.spec.rdzv_handler.aclose()


SUPERVISOR = web.AppKey("supervisor", Supervisor)


def _job(request: web.Request) -> Job:
    try:
        return request.app[SUPERVISOR].jobs[int(request.match_info["id"])]
    except (KeyError, ValueError):
        raise web.HTTPNotFound(
            text='{"error": "no such job"}', content_type="application/json"
        ) from None


async def index(request: web.Request) -> web.Response:
    jobs = request.app[SUPERVISOR].jobs.values()
    return web.json_response({"service": "ok", "jobs": [j.describe()["state"] for j in jobs]})


async def start_job(request: web.Request) -> web.Response:
    body = await request.json() if request.can_read_body else {}
    try:
        job = request.app[SUPERVISOR].start(
            nproc=int(body.get("nproc", 1)),
            script=str(body.get("script", DEFAULT_SCRIPT)),
            args=[str(a) for a in body.get("args", [])],
            max_restarts=int(body.get("max_restarts", 0)),
        )
    except (ValueError, TypeError) as exc:
        return web.json_response({"error": str(exc)}, status=400)
    return web.json_response({"id": job.id, "run_id": job.run_id}, status=202)


async def get_job(request: web.Request) -> web.Response:
    return web.json_response(_job(request).describe())


async def stop_job(request: web.Request) -> web.Response:
    job = _job(request)
    await request.app[SUPERVISOR].stop(job)
    return web.json_response(job.describe())


def create_app() -> web.Application:
    """The service: ``GET /``, ``POST /jobs``, ``GET /jobs/{id}``, ``DELETE /jobs/{id}``."""
    app = web.Application()
    app[SUPERVISOR] = Supervisor()
    app.router.add_get("/", index)
    app.router.add_post("/jobs", start_job)
    app.router.add_get("/jobs/{id}", get_job)
    app.router.add_delete("/jobs/{id}", stop_job)

    async def stop_jobs(app: web.Application) -> None:
        await app[SUPERVISOR].close()

    app.on_shutdown.append(stop_jobs)
    return app


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    args = p.parse_args(argv)
    web.run_app(create_app(), host=args.host, port=args.port)


if __name__ == "__main__":
    main(sys.argv[1:])
