"""Forged requests from a client that is not a member, at random moments of a chaos run.

A :class:`Forger` thread reads the run's membership (as anyone who can reach the backend
can) and sends, every 0.05-0.5 s, one forged request through its own backend client: a
status or keep-alive of a stranger asking with a 1 ms window and a group of one; a leave, a
keep-alive, a join, a failure report, a quarantine or a "done" naming a member with a secret
that is not the member's; a stranger's failure report or "done"; a phantom join of a made-up
node asking for a 1 ms window or other node bounds; and writes to the members' store of the
keys an older aelastic read its control state from (a health record quarantining a member's
host with a made-up root cause, rank assignments and a master address for the next rounds,
the exit barrier's "all done"), which now decide nothing. (A close is a run-level act any
handler may do, as in torch: not a forgery.) It counts, by kind, what the replies said, and
every forged request that changed the run itself (a transition other than none or the run's
own prune): the chaos checks require none. A stranger joining with the run's own rules is a
new node like any other, so it is not one of these; nor is a forged join that finds the
member's name free (the run's window had dropped that member first: the join was then a new
node's, the name taken, and the member, if it comes back, joins under another name).
"""

from __future__ import annotations

import dataclasses
import json
import random
import secrets
import threading
from collections import Counter, defaultdict
from typing import Any

from aelastic import sync
from aelastic.backends.registry import create_backend
from aelastic.core.health import FailureReport, NodeReport
from aelastic.core.params import RendezvousParameters, Rules
from aelastic.core.protocol import RendezvousBackend
from aelastic.core.state import NodeDesc, Op, Request, Transition

from ._cluster import ChaosConfig

__all__ = ["FORGED_KINDS", "Forger"]

FORGED_KINDS = (
    "forged_window",
    "forged_leave",
    "forged_keep_alive",
    "forged_join",
    "forged_report",
    "forged_quarantine",
    "forged_done",
    "stranger_report",
    "stranger_done",
    "phantom_join",
    "store_control_keys",
)
#: A failure report that blames whoever it is sent for, in a round far ahead.
_FAILURE = NodeReport(
    failure=FailureReport(time=0.0, rank=0, local_rank=0, exitcode=1, message="forged")
)
#: What the forger asks with: a group of one, a 1 ms window.
TINY = Rules(1, 1, last_call_ms=1, window_ms=1)
#: Transitions a request makes without changing the run (the prune is the run's own).
_HARMLESS = frozenset({Transition.NONE, Transition.PRUNE})
#: A join that lists its node: the name was free when it was applied (else: forbidden).
_LISTED = frozenset(
    {
        Transition.ADD_TO_PARTICIPANTS,
        Transition.ADD_TO_WAIT_LIST,
        Transition.ADD_TO_REDUNDANCY_LIST,
        Transition.MARK_COMPLETE,
    }
)


class Forger:
    """Sends forged requests to ``config``'s run from a thread of its own (see the module
    docstring); :meth:`stop` ends it and :meth:`summary` says what happened."""

    def __init__(self, config: ChaosConfig, rng: random.Random) -> None:
        self._config = config
        self._rng = random.Random(rng.random())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.sent: Counter[str] = Counter()
        self.outcomes: dict[str, Counter[str]] = defaultdict(Counter)
        #: Forged requests that changed the run (each one a failure of the checks).
        self.changes: list[str] = []
        #: Nodes the run's own window pruned while a forged request was applied.
        self.pruned = 0
        #: Forged joins that found the name free (its member dropped by the run's window).
        self.names_taken = 0
        self.errors: list[str] = []
        params = RendezvousParameters(
            config.backend, config.endpoint, config.run_id, 1, config.max_nodes, read_timeout=10
        )

        async def make() -> RendezvousBackend:
            return create_backend(params)

        self._backend = sync.run(make())

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="chaos-forger", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        sync.run(self._backend.aclose(), 10)

    def _run(self) -> None:
        while not self._stop.wait(self._rng.uniform(0.05, 0.5)):
            try:
                self.forge()
            except Exception as exc:  # reported, and the forging goes on
                if len(self.errors) < 20:
                    self.errors.append(repr(exc))

    def forge(self, kind: str | None = None) -> None:
        """Send one forged request (``kind``, or a random one)."""
        snapshot = sync.run(self._backend.snapshot(), 30)
        members = [] if snapshot is None else [e.node for e in snapshot.members()]
        rules = snapshot.rules if snapshot is not None and snapshot.rules else TINY
        kind = kind or self._rng.choice(FORGED_KINDS)
        if snapshot is None or (not members and kind.startswith("forged_")):
            kind = "forged_window"  # (a join could make a run that is not there)
        secret = secrets.token_hex(16)
        stranger = NodeDesc("10.66.6.6", self._rng.randrange(1, 1 << 22), 0)
        member = self._rng.choice(members) if members else stranger
        other_bounds = dataclasses.replace(rules, max_nodes=rules.max_nodes + 1)
        if kind == "store_control_keys":
            self._store_forgery(member, snapshot.status.round if snapshot else 0)
            self.sent[kind] += 1
            return
        quarantine = NodeReport(quarantine="forged")
        request = {
            "forged_window": Request(
                self._rng.choice([Op.STATUS, Op.KEEP_ALIVE]), stranger, TINY, secret=secret
            ),
            "forged_leave": Request(Op.LEAVE, member, rules, secret=secret),
            "forged_keep_alive": Request(Op.KEEP_ALIVE, member, TINY, secret=secret),
            "forged_join": Request(Op.JOIN, member, rules, secret=secret),
            "forged_report": Request(Op.REPORT, member, rules, secret=secret, report=_FAILURE),
            "forged_quarantine": Request(
                Op.REPORT, member, rules, secret=secret, report=quarantine
            ),
            "forged_done": Request(Op.DONE, member, rules, secret=secret),
            "stranger_report": Request(Op.REPORT, stranger, TINY, secret=secret, report=_FAILURE),
            "stranger_done": Request(Op.DONE, stranger, TINY, secret=secret),
            "phantom_join": Request(
                Op.JOIN, stranger, self._rng.choice([TINY, other_bounds]), secret=secret
            ),
        }[kind]
        reply = sync.run(self._backend.apply(request), 30)
        self.sent[kind] += 1
        self.outcomes[kind][reply.outcome.value] += 1
        self.pruned += reply.pruned
        if request.op is Op.JOIN and reply.transition in _LISTED:
            self.names_taken += 1  # the name was free when the join was applied
        elif reply.transition not in _HARMLESS:
            self.changes.append(f"{kind} {request.op.value} for {request.node}: {reply}")

    def _store_forgery(self, member: NodeDesc, round_: int) -> None:
        """Write what an older aelastic read its control state from: none of it is read."""
        health = json.dumps(
            {"format": "aelastic.job.health/1", "incidents_total": 99, "incidents": [],
             "quarantined": {member.addr: "forged"}, "lost": {}}
        ).encode()  # fmt: skip
        assignment = json.dumps(
            {"format": "aelastic.agent.assignment/1", "ranks": [0, 2, 0], "role_world_size": 2,
             "local_world_size": 1, "master": ["10.66.6.6", 1]}
        ).encode()  # fmt: skip
        writes = [("job/health", health)]
        for ahead in range(round_, round_ + 3):
            writes += [(f"r{ahead}/agent/assignment/{rank}", assignment) for rank in range(4)]
            writes += [(f"r{ahead}/agent/all-done", b"1"), (f"r{ahead}/MASTER_ADDR", b"10.66.6.6")]
        for key, value in writes:
            sync.run(self._backend.kv_set(key, value), 30)

    def summary(self) -> dict[str, Any]:
        return {
            "sent": sum(self.sent.values()),
            "by_kind": {
                k: {"sent": self.sent[k], "outcomes": dict(self.outcomes[k])} for k in FORGED_KINDS
            },
            "changes": self.changes,
            "pruned_by_the_runs_window": self.pruned,
            "names_taken_after_the_run_dropped_them": self.names_taken,
            "errors": self.errors,
        }
