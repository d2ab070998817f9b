"""What the pages show, as JSON: one function per view, fed by any backend's snapshots.

How it works: :func:`run_view` turns a run's :class:`~aelastic.core.state.Snapshot` (read
from the HTTP server's in-process engine, Redis, or any backend) into the JSON the run page
draws: round, state, participants with ranks and heartbeat times, waiting and redundant
nodes, the last-call deadline, and what a :class:`History` saw change. :func:`run_summary`
is one run of the list (``/``, ``aelastic status --list``). Times are the backend's clock in
milliseconds (``now_ms`` says what that clock read), so the page computes ages and
countdowns against that clock, never its own. Pure: no I/O, no clock reads.

:func:`health_view` is the job's health (:mod:`aelastic.core.health`: the root cause of its
newest failure, how many nodes failed, quarantined and lost hosts) as the page shows it.

A :class:`History` compares each snapshot with the one before and keeps the recent changes
(a round began or completed, the run closed, a node joined, waited, left or was lost) and
a short timeline of rounds and membership sizes, for the picture.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from ..core.health import JobHealth, shown
from ..core.state import MemberEntry, Snapshot, Status

__all__ = [
    "MAX_LISTED",
    "History",
    "health_view",
    "run_summary",
    "run_view",
    "runs_view",
    "state_name",
]

#: Nodes listed per table at most (the counts stay exact).
MAX_LISTED = 1000
#: Changes and timeline points a history keeps.
MAX_EVENTS = 200
MAX_POINTS = 600
#: A node removed after this long without a heartbeat (and three times as long as most
#: nodes' silence) is shown as lost rather than as having left.
_SILENT_MS = 1000


def state_name(status: Status) -> str:
    """``closed``, ``complete`` or ``forming``."""
    return "closed" if status.closed else ("complete" if status.complete else "forming")


def run_summary(run_id: str, status: Status) -> dict[str, Any]:
    """One run of a list: id, round, state and how many nodes are where."""
    return {
        "run_id": run_id,
        "round": status.round,
        "state": state_name(status),
        "participants": status.participants,
        "world": status.world,
        "waiting": status.waiting,
        "redundant": status.redundant,
        "lost": status.lost,
        "finished": status.finished,
    }


def runs_view(
    runs: Sequence[tuple[str, Status]], *, more: bool = False, error: str | None = None
) -> dict[str, Any]:
    """The list page's JSON: every run's summary; ``more`` when some were left out."""
    return {
        "runs": [run_summary(run_id, status) for run_id, status in runs],
        "more": more,
        "error": error,
    }


def _member(entry: MemberEntry) -> dict[str, Any]:
    node = entry.node
    return {"node": node.key, "addr": node.addr, "pid": node.pid, "beat_ms": entry.beat_ms}


def _ranked(snapshot: Snapshot) -> list[dict[str, Any]]:
    order = sorted(
        range(len(snapshot.participants)),
        key=lambda i: (snapshot.participants[i].rank is None, snapshot.participants[i].rank, i),
    )
    return [
        {**_member(snapshot.participants[i]), "rank": snapshot.participants[i].rank}
        for i in order[:MAX_LISTED]
    ]


def run_view(
    run_id: str,
    snapshot: Snapshot | None,
    history: History | None = None,
    *,
    error: str | None = None,
    health: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The run page's JSON for ``snapshot`` (``None``: the run has no rendezvous state).

    Args:
        run_id: The run.
        snapshot: Its whole membership, as a backend read it.
        history: What changed since the page's server began watching the run.
        error: Why the newest snapshot could not be read (the view then shows ``snapshot``,
            the last one read).
        health: The job's health (:func:`health_view`), ``None`` when nothing failed.
    """
    changes = {"events": [], "timeline": []} if history is None else history.to_json()
    view: dict[str, Any] = {"run_id": run_id, "exists": snapshot is not None, "error": error}
    view["health"] = health
    view.update(changes)
    if snapshot is None:
        return view
    status = snapshot.status
    master = None
    if snapshot.master_addr is not None:
        master = f"{snapshot.master_addr}:{snapshot.master_port}"
    view.update(run_summary(run_id, status))
    view.update(
        {
            "now_ms": status.now_ms,
            "deadline_ms": status.deadline_ms,
            "lost_sample": list(status.lost_sample),
            "master": master,
            "participant_list": _ranked(snapshot),
            "waiting_list": [_member(e) for e in snapshot.wait_list[:MAX_LISTED]],
            "redundant_list": [_member(e) for e in snapshot.redundancy_list[:MAX_LISTED]],
        }
    )
    return view


def health_view(health: JobHealth | None, failed_nodes: int = 0) -> dict[str, Any] | None:
    """The job's health as the page shows it (texts escaped); ``None`` when it is empty."""
    if health is None or not (health.incidents or health.quarantined or health.lost):
        return None
    latest = health.latest
    root = None
    if latest is not None:
        record = latest.root
        root = {
            "summary": record.summary(),
            "round": latest.round,
            "time": record.time,
            "host": shown(record.host),
            "rank": record.rank,
            "node_rank": record.node_rank,
            "message": shown(record.message),
            "stalled": record.stalled,
            "streak": latest.streak,
        }
    return {
        "failures": health.incidents_total,
        "failed_nodes": failed_nodes,
        "root": root,
        "quarantined": [
            {"host": shown(h), "reason": shown(r)} for h, r in sorted(health.quarantined.items())
        ],
        "lost": [{"host": shown(h), "count": c.count} for h, c in sorted(health.lost.items())],
    }


class History:
    """The recent changes of one run, found by comparing its successive snapshots."""

    def __init__(self) -> None:
        self.events: deque[dict[str, Any]] = deque(maxlen=MAX_EVENTS)
        self.points: deque[dict[str, Any]] = deque(maxlen=MAX_POINTS)
        self._last: Snapshot | None = None

    def to_json(self) -> dict[str, Any]:
        """``events`` (oldest first) and ``timeline`` points."""
        return {"events": list(self.events), "timeline": list(self.points)}

    def _event(self, time_ms: int, kind: str, text: str, round_: int, node: str = "") -> None:
        self.events.append(
            {"time_ms": time_ms, "kind": kind, "text": text, "round": round_, "node": node}
        )

    def observe(self, snapshot: Snapshot | None, now_ms: int) -> bool:
        """Take in the newest snapshot (read at ``now_ms`` when ``None``); whether anything
        but heartbeats changed."""
        before, self._last = self._last, snapshot
        if snapshot is None:
            if before is not None:
                self._event(now_ms, "gone", "the run has no rendezvous state any more", 0)
                self.points.append({"time_ms": now_ms, "state": "gone", "round": 0})
            return before is not None
        status = snapshot.status
        time_ms, round_ = status.now_ms, status.round
        if before is None:
            self._event(time_ms, "seen", f"round {round_}, {state_name(status)}", round_)
        else:
            self._compare(before, snapshot)
        point = {
            "time_ms": time_ms,
            "state": state_name(status),
            "round": round_,
            "participants": status.participants,
            "waiting": status.waiting + status.redundant,
        }
        last = self.points[-1] if self.points else None
        if last is not None and {**last, "time_ms": 0} == {**point, "time_ms": 0}:
            return False
        self.points.append(point)
        return True

    def _compare(self, before: Snapshot, after: Snapshot) -> None:
        old, new = before.status, after.status
        time_ms, round_ = new.now_ms, new.round
        if new.round != old.round:
            self._event(time_ms, "round", f"round {round_} began", round_)
        if new.complete and (not old.complete or new.round != old.round):
            text = f"round {round_} complete: {new.world} node(s)"
            self._event(time_ms, "complete", text, round_)
        if new.closed and not old.closed:
            self._event(time_ms, "closed", "the run was closed", round_)
        where_before = _places(before)
        where_after = _places(after)
        for node, place in where_after.items():
            if where_before.get(node) == place:
                continue
            kind, text = {
                "participant": ("joined", "joined the round"),
                "waiting": ("waiting", "waits for the next round"),
                "redundant": ("redundant", "is redundant (the round is full)"),
            }[place]
            self._event(time_ms, kind, f"{node} {text}", round_, node)
        beats = {e.node.key: e.beat_ms for e in before.members()}
        ages = sorted(old.now_ms - beat for beat in beats.values())
        typical = max(ages[len(ages) // 2], 1) if ages else 1
        for node in where_before.keys() - where_after.keys():
            silent = time_ms - beats[node]
            if new.finished > old.finished and node not in new.lost_sample:
                kind, text = "left", "left (its workers finished)"
            elif silent >= max(_SILENT_MS, 3 * typical):
                kind, text = "lost", f"was lost (silent for {silent / 1000:.1f} s)"
            else:
                kind, text = "left", "left"
            self._event(time_ms, kind, f"{node} {text}", round_, node)


def _places(snapshot: Snapshot) -> dict[str, str]:
    places = {e.node.key: "participant" for e in snapshot.participants}
    places.update((e.node.key, "waiting") for e in snapshot.wait_list)
    places.update((e.node.key, "redundant") for e in snapshot.redundancy_list)
    return places
