"""Chaos: random faults on 5-7 real ``aelastic run`` agents over Redis, HTTP and etcd.

Faults come every 0.2-1 s (see :mod:`tests.chaos._faults`: SIGKILL, SIGSTOP then SIGCONT or
SIGKILL, SIGTERM of agents, SIGKILL of workers, two kills at once, new agents). After the
last one, every live agent must be in one complete round within the heartbeat window + the
last call + 2 s, with ranks ``0..n-1``; at no sample of the rendezvous state, and in no
round any agent completed, may two agents or two workers have the same rank; no agent may
end by itself; and once the agents are stopped (and the guardians of the killed ones are
done) no process they started may be left. Meanwhile a client that is not a member sends
forged requests at random moments (:mod:`tests.chaos._forgery`): none may change the run.

CI runs 10 faults per backend; ``AELASTIC_CHAOS_FAULTS=30`` runs the full scenario, and
``AELASTIC_CHAOS_SEED`` replays a run's choices (the seed is printed, and in every failure).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from aelastic.backends import BUILTINS

from ._cluster import ChaosConfig, Cluster
from ._faults import Chaos, Fault, wait_formed
from ._forgery import Forger

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]

FAULTS = int(os.environ.get("AELASTIC_CHAOS_FAULTS", "10"))
#: Generous: the first round waits for five interpreters to start on a loaded machine.
FIRST_ROUND = 90.0


#: The backends whose store lives outside the agents (the registry's rows): any agent may
#: be killed. A new one fails here until its server is started below.
EXTERNAL = [info.name for info in BUILTINS if info.external]


@pytest.fixture(params=EXTERNAL)
def endpoint(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    if request.param == "redis":
        from tests._redis_server import RedisServer

        with RedisServer() as redis:
            yield "redis", redis.url
    elif request.param == "http":
        from tests._http_server import HttpServer

        with HttpServer() as http:
            yield "http", http.endpoint
    elif request.param == "etcd":
        from tests._etcd_server import EtcdServer

        with EtcdServer() as etcd:
            yield "etcd", etcd.endpoint
    else:
        raise AssertionError(f"no server for backend {request.param!r} in the chaos test")


def test_live_agents_reform_after_random_faults(
    endpoint: tuple[str, str], run_id: str, tmp_path: Path
) -> None:
    seed = int(os.environ.get("AELASTIC_CHAOS_SEED") or random.randrange(2**32))
    print(f"chaos seed {seed} ({FAULTS} faults; AELASTIC_CHAOS_SEED={seed} replays it)")
    config = ChaosConfig(*endpoint, run_id, agents=5)
    cluster = Cluster(config, tmp_path)
    faults: list[Fault] = []
    try:
        started = time.monotonic()
        for _ in range(config.agents):
            cluster.start_agent()
        cluster.start_sampling()
        assert wait_formed(cluster, started, FIRST_ROUND).workers is not None, "no first round"
        rng = random.Random(seed)
        chaos = Chaos(cluster, rng)
        forger = Forger(config, rng)
        forger.start()
        for _ in range(FAULTS):
            time.sleep(rng.uniform(0.2, 1.0))
            faults.append(chaos.inject())
        reform = wait_formed(cluster, faults[-1].at, config.reform_bound)
        forger.stop()
        cluster.stop_all()
        left = cluster.wait_no_leftovers(config.grace + 15)
        what = f"seed {seed}, faults:\n" + "\n".join(f"  {f.kind}: {f.detail}" for f in faults)
        assert reform.state is not None, (
            f"no complete round of the live agents {config.reform_bound:.1f} s after the "
            f"last fault ({what})\n{_state(cluster)}"
        )
        print(f"re-formed {reform.state:.2f} s after the last fault ({what})")
        assert not cluster.violations, f"{cluster.violations} ({what})"
        assert not cluster.history_violations(), f"{cluster.history_violations()} ({what})"
        assert not cluster.unexpected_exits(), f"{cluster.unexpected_exits()} ({what})"
        assert not left, f"processes left after the agents: {left} ({what})"
        assert cluster.samples > 0
        forged = forger.summary()
        assert forged["sent"] > 0 and not forged["errors"], forged
        assert not forged["changes"], f"forged requests changed the run: {forged['changes']}"
    finally:
        cluster.close()


def _state(cluster: Cluster) -> str:
    """What the live agents and the backend show (for a failure's message)."""
    lines = [f"live agents: {cluster.live()}"]
    try:
        snap = cluster.snapshot()
    except Exception as exc:
        return f"{lines[0]}; state unreadable: {exc!r}"
    if snap is not None:
        status = snap.status
        lines.append(
            f"round {status.round} complete={status.complete} lost={status.lost} "
            f"participants={[(e.node.pid, e.rank) for e in snap.participants]} "
            f"waiting={[e.node.pid for e in snap.wait_list]} "
            f"redundant={[e.node.pid for e in snap.redundancy_list]}"
        )
    for agent in cluster.live():
        lines.append(f"{agent}:\n{agent.log_tail(8)}")
    return "\n".join(lines)
