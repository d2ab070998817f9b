"""The pages' data model: views of snapshots, and what a history sees change."""

from __future__ import annotations

from aelastic.core.health import FailureRecord, JobHealth, with_failure, with_quarantined
from aelastic.core.state import MemberEntry, NodeDesc, Snapshot, Status
from aelastic.web.model import History, health_view, run_summary, run_view, runs_view

A, B, C = (NodeDesc("10.0.0.1", 100 + i, 0) for i in range(3))


def _snapshot(
    now: int,
    participants: list[tuple[NodeDesc, int | None, int]],
    waiters: tuple[tuple[NodeDesc, int], ...] = (),
    **status: object,
) -> Snapshot:
    fields = {"token": f"e.{now}", "now_ms": now, "participants": len(participants)}
    fields.update(status)
    return Snapshot(
        status=Status(**fields),  # type: ignore[arg-type]
        participants=tuple(MemberEntry(n, beat, rank) for n, rank, beat in participants),
        wait_list=tuple(MemberEntry(n, beat) for n, beat in waiters),
        master_addr="10.0.0.1",
        master_port=29500,
    )


def test_run_view_lists_participants_by_rank_with_their_heartbeats() -> None:
    snapshot = _snapshot(
        10_000,
        [(B, 1, 9_000), (A, 0, 9_500)],
        waiters=((C, 9_900),),
        round=3,
        complete=True,
        world=2,
        waiting=1,
    )
    view = run_view("job", snapshot)
    assert view["exists"] and view["state"] == "complete" and view["round"] == 3
    assert [(m["node"], m["rank"]) for m in view["participant_list"]] == [
        (A.key, 0),
        (B.key, 1),
    ]
    assert view["participant_list"][1]["beat_ms"] == 9_000 and view["now_ms"] == 10_000
    assert [m["node"] for m in view["waiting_list"]] == [C.key]
    assert view["master"] == "10.0.0.1:29500"
    assert run_view("gone", None) == {
        "run_id": "gone",
        "exists": False,
        "error": None,
        "health": None,
        "events": [],
        "timeline": [],
    }


def test_the_health_view_shows_the_root_cause_escaped_and_the_quarantined_hosts() -> None:
    assert health_view(None) is None and health_view(JobHealth()) is None
    record = FailureRecord(
        time=1.0,
        host="10.0.0.2",
        node="10.0.0.2_7_0",
        node_rank=1,
        rank=3,
        local_rank=1,
        exitcode=1,
        message="Traceback\nValueError: \x1b[31mbad\x1b[0m",
        round=4,
    )
    health = with_failure(JobHealth(), record)
    assert health is not None
    health = with_quarantined(health, "10.0.0.2", "the job's root cause 2 times in a row")
    assert health is not None
    view = health_view(health, failed_nodes=2)
    assert view is not None and view["failures"] == 1 and view["failed_nodes"] == 2
    root = view["root"]
    assert root["summary"] == (
        "rank 3 (local rank 1) on host 10.0.0.2 (node rank 1) failed with exit code 1: "
        "ValueError: \\x1b[31mbad\\x1b[0m"
    )
    assert "\x1b" not in root["message"] and root["round"] == 4
    assert view["quarantined"] == [
        {"host": "10.0.0.2", "reason": "the job's root cause 2 times in a row"}
    ]
    assert run_view("r", None, health=view)["health"] is view


def test_run_summaries_say_round_state_and_members() -> None:
    status = Status(round=2, complete=True, closed=True, participants=3, world=4, lost=1)
    summary = run_summary("job", status)
    assert summary["state"] == "closed" and summary["participants"] == 3
    assert summary["world"] == 4 and summary["lost"] == 1
    assert runs_view([("job", status)], more=True)["more"] is True


def test_history_names_joins_rounds_and_a_silent_member_as_lost() -> None:
    history = History()
    assert history.observe(_snapshot(1_000, [(A, None, 1_000)]), 1_000)
    assert [e["kind"] for e in history.events] == ["seen"]
    # A heartbeat alone changes nothing worth a point or an event.
    assert not history.observe(_snapshot(1_500, [(A, None, 1_500)]), 1_500)
    both = [(A, 0, 2_000), (B, 1, 2_000)]
    assert history.observe(_snapshot(2_000, both, complete=True, world=2), 2_000)
    kinds = [e["kind"] for e in history.events]
    assert kinds[1:] == ["complete", "joined"] and B.key in history.events[-1]["text"]
    # B stopped beating at 2.0 s and was pruned at 9.0 s: lost; A beat recently.
    after = _snapshot(9_000, [(A, 0, 8_800)], complete=True, world=2, lost=1)
    history.observe(after, 9_000)
    lost = history.events[-1]
    assert lost["kind"] == "lost" and lost["node"] == B.key and "silent for 7.0 s" in lost["text"]
    history.observe(_snapshot(9_500, [(A, None, 9_500)], round=1), 9_500)
    assert history.events[-1]["kind"] == "round"
    history.observe(None, 12_000)
    assert history.events[-1]["kind"] == "gone"
    points = history.to_json()["timeline"]
    assert [p["state"] for p in points] == ["forming", "complete", "complete", "forming", "gone"]
    assert [p.get("participants") for p in points] == [1, 2, 1, 1, None]


def test_a_member_that_leaves_while_others_beat_alike_has_left() -> None:
    history = History()
    history.observe(_snapshot(1_000, [(A, 0, 900), (B, 1, 950)], complete=True, world=2), 0)
    history.observe(_snapshot(1_200, [(A, 0, 1_100)], complete=True, world=2, finished=1), 0)
    assert history.events[-1]["kind"] == "left" and "finished" in history.events[-1]["text"]
