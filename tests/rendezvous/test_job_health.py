"""The job's health document (core/health.py): pure transitions, bounds, escaping."""

from __future__ import annotations

import json

import pytest

from aelastic.core.health import (
    MAX_INCIDENTS,
    MAX_MESSAGE,
    FailureRecord,
    JobHealth,
    bounded_message,
    shown,
    with_failure,
    with_lost,
    with_quarantined,
)


def record(host: str = "a", round_: int = 1, time: float = 10.0, **kw: object) -> FailureRecord:
    fields: dict[str, object] = {
        "time": time,
        "host": host,
        "node": f"{host}_1_0",
        "node_rank": 0,
        "rank": 0,
        "local_rank": 0,
        "exitcode": 1,
        "message": "Traceback...\nValueError: boom",
        "round": round_,
    }
    fields.update(kw)
    return FailureRecord(**fields)  # type: ignore[arg-type]


def test_the_first_report_of_a_round_opens_an_incident() -> None:
    health = with_failure(JobHealth(), record("b", 1))
    assert health is not None and health.incidents_total == 1
    assert health.latest is not None and health.latest.root.host == "b"
    assert "failed with exit code 1: ValueError: boom" in health.latest.root.summary()


def test_a_peer_that_broke_in_a_collective_never_beats_the_failure_itself() -> None:
    culprit = record("b", 1, time=20.0)
    victim = record("a", 1, time=10.0, secondary=True, message="Connection closed by peer")
    health = with_failure(JobHealth(), victim)
    assert health is not None
    health = with_failure(health, culprit)  # later, but the worker's own failure
    assert health is not None and health.latest is not None
    assert health.latest.root.host == "b" and health.incidents_total == 1
    assert with_failure(health, victim) is None  # no change


def test_the_earliest_wins_among_equals_and_a_late_report_of_an_old_round_is_ignored() -> None:
    health = with_failure(JobHealth(), record("a", 2, time=5.0))
    assert health is not None
    assert with_failure(health, record("b", 2, time=6.0)) is None
    earlier = with_failure(health, record("b", 2, time=4.0))
    assert earlier is not None and earlier.latest is not None
    assert earlier.latest.root.host == "b" and earlier.incidents_total == 1
    assert with_failure(earlier, record("c", 1, time=1.0)) is None


def test_streaks_count_incidents_in_a_row_with_the_same_root_host() -> None:
    health = JobHealth()
    for round_, host in enumerate(["b", "b", "a", "b", "b", "b"]):
        changed = with_failure(health, record(host, round_))
        assert changed is not None
        health = changed
    assert health.incidents_total == 6
    assert [i.streak for i in health.incidents] == [1, 2, 1, 1, 2, 3]
    # The root of the newest incident replaced by a better one: its streak is recomputed.
    replaced = with_failure(health, record("a", 5, time=1.0))
    assert replaced is not None and replaced.latest is not None
    assert replaced.latest.root.host == "a" and replaced.latest.streak == 1


def test_incidents_and_hosts_are_bounded() -> None:
    health = JobHealth()
    for round_ in range(MAX_INCIDENTS + 5):
        changed = with_failure(health, record("a", round_))
        assert changed is not None
        health = changed
    assert len(health.incidents) == MAX_INCIDENTS
    assert health.incidents_total == MAX_INCIDENTS + 5
    assert health.latest is not None and health.latest.streak == MAX_INCIDENTS + 5


def test_a_huge_message_keeps_its_end_only() -> None:
    huge = "x" * (50 * 1024 * 1024) + "\nValueError: the end"
    kept = record(message=huge)
    assert len(kept.message) <= MAX_MESSAGE
    assert kept.message.endswith("ValueError: the end")
    many_lines = "\n".join(f"line {i}" for i in range(1000))
    assert bounded_message(many_lines).splitlines() == [f"line {i}" for i in range(980, 1000)]
    assert len(JobHealth(1, ()).encode()) < 200
    assert len(record(host="h" * 10_000).host) <= 300


def test_control_characters_are_escaped_when_shown() -> None:
    evil = record(message="ok\nValueError: \x1b[2J\x1b[31mred\x07 done", host="h\x1bost")
    summary = evil.summary()
    assert "\x1b" not in summary and "\x07" not in summary
    assert "\\x1b[2J\\x1b[31mred\\x07 done" in summary and "h\\x1bost" in summary
    assert shown("tab\tand\nnewline") == "tab\tand\nnewline"
    assert shown("\u202e") == "\\u202e"


def test_the_document_round_trips_and_a_foreign_one_is_refused() -> None:
    health = with_failure(JobHealth(), record("b", 3, stalled=True, secondary=False))
    assert health is not None
    health = with_quarantined(health, "b", "the job's root cause 2 times in a row")
    assert health is not None
    health = with_lost(health, "c", 3, None)
    assert health is not None
    assert JobHealth.decode(health.encode()) == health
    assert JobHealth.decode(None) == JobHealth()
    for bad in (b"not json", b"[]", json.dumps({"format": "other"}).encode(), b'{"format":'):
        with pytest.raises(ValueError):
            JobHealth.decode(bad)
    broken = json.loads(health.encode())
    broken["incidents"][0]["root"]["time"] = "soon"
    with pytest.raises(ValueError):
        JobHealth.decode(json.dumps(broken).encode())


def test_a_host_is_counted_lost_once_per_round_and_quarantined_at_the_limit() -> None:
    health = with_lost(JobHealth(), "c", 1, 2)
    assert health is not None and health.lost["c"].count == 1 and not health.quarantined
    assert with_lost(health, "c", 1, 2) is None  # another survivor saw the same loss
    health = with_lost(health, "c", 2, 2)
    assert health is not None and health.lost["c"].count == 2
    assert health.quarantined == {"c": "lost 2 times"}
    assert with_quarantined(health, "c", "again") is None
