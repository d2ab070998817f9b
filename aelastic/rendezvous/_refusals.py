"""What a node is told when the run refuses its request: the errors and their messages.

How it works: the state machine answers a refused request with an outcome (closed, timed
out, rules that differ from the run's, a node listed under another secret); these
functions turn it into the exception the node raises (and a join the backend left
unanswered past the join timeout into a connection error naming it), with a message that says what
happened and what to do (a closed run: when its id is free again). They never name a
secret.
"""

from __future__ import annotations

import math

from ..core.errors import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
)
from ..core.params import RendezvousSettings, Rules
from ..core.state import NodeDesc, Outcome, Reply

__all__ = ["join_refused", "join_unanswered"]


def _seconds(ms: int) -> str:
    return f"{ms / 1000:g} s"


def _rules_differ(settings: RendezvousSettings, run: Rules) -> RendezvousError:
    mine, run_id = settings.rules, settings.run_id
    created = f"run '{run_id}' was created with"
    differences = []
    if (mine.min_nodes, mine.max_nodes) != (run.min_nodes, run.max_nodes):
        differences.append(
            f"this node asks for {mine.min_nodes}:{mine.max_nodes} nodes (--nnodes) but "
            f"{created} {run.min_nodes}:{run.max_nodes}"
        )
    if mine.window_ms != run.window_ms:
        differences.append(
            f"this node's heartbeat window is {_seconds(mine.window_ms)} (keep_alive_interval "
            f"{settings.keep_alive_interval:g} x keep_alive_max_attempt "
            f"{settings.keep_alive_max_attempt}) but {created} {_seconds(run.window_ms)}"
        )
    if mine.last_call_ms != run.last_call_ms:
        differences.append(
            f"this node's last_call_timeout is {_seconds(mine.last_call_ms)} but {created} "
            f"{_seconds(run.last_call_ms)}"
        )
    return RendezvousError(
        "; ".join(differences) + ". A run has one set of rules, fixed by the node that "
        "created it: start every node with the same --nnodes and --rdzv-conf, or use another "
        "--rdzv-id (`aelastic status --reset` deletes the run)."
    )


def _closed(run_id: str, reply: Reply) -> RendezvousClosedError:
    reset = f"`aelastic status --rdzv-id {run_id} --reset`"
    if reply.reopen_at_ms is None:
        when = "two heartbeat windows after they have left (some of its nodes are still in it)"
        reopens_in = None
    else:
        reopens_in = max(reply.reopen_at_ms - reply.status.now_ms, 0) / 1000
        when = (
            f"in {math.ceil(reopens_in)} s (two heartbeat windows after its last node left, "
            "so that a late node of that job still learns that it closed)"
        )
    error = RendezvousClosedError(
        f"The rendezvous '{run_id}' is closed: the job that used this id is over. A new job "
        f"can use the id {when}, at once after {reset}, or with another --rdzv-id."
    )
    error.reopens_in = reopens_in
    return error


def join_refused(settings: RendezvousSettings, node: NodeDesc, reply: Reply) -> RendezvousError:
    """The error a join answered ``reply`` (any outcome but finish or wait) raises."""
    run_id, outcome = settings.run_id, reply.outcome
    if outcome is Outcome.ERROR_CLOSED:
        return _closed(run_id, reply)
    if outcome is Outcome.GRACEFUL_EXIT:
        return RendezvousGracefulExitError(
            f"The rendezvous '{run_id}' is closed, terminating pending rendezvous."
        )
    if outcome is Outcome.ERROR_RULES and reply.run_rules is not None:
        return _rules_differ(settings, reply.run_rules)
    if outcome is Outcome.ERROR_FORBIDDEN:
        return RendezvousError(
            f"Node {node} is already in run '{run_id}' under another secret: another process "
            f"uses this node's name (address '{node.addr}' and process id {node.pid}; "
            "containers sharing a host name and process ids?). Give each node its own "
            "--local-addr. Nothing was changed."
        )
    return RendezvousTimeoutError(
        f"The rendezvous '{run_id}' did not complete on time for node {node}."
    )


def join_unanswered(
    settings: RendezvousSettings, node: NodeDesc, backend: str, endpoint: str
) -> RendezvousConnectionError:
    """The error of a join the backend did not answer before the join timeout ran out."""
    return RendezvousConnectionError(
        f"{backend} at {endpoint} did not answer node {node}'s join to run "
        f"'{settings.run_id}' within its join timeout ({settings.join_timeout:g} s)."
    )
