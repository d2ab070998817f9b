"""When a worker is hung: the bound (learned, fixed, start-up) and the verdict, pure."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aelastic.agent import WorkerSpec
from aelastic.agent.health.hang_rule import (
    CEILING,
    DEFAULT_STARTUP,
    FLOOR,
    HangRule,
    StallCheck,
    Watch,
    check_stalls,
    learned_bound,
    rule_of,
    stall_setting,
    startup_setting,
    watch_of,
)
from aelastic.launcher import LaunchConfig

from .helpers import make_handler

AUTO = HangRule(None, 1800.0)
FIXED = HangRule(3.0, 1800.0)


def test_the_learned_bound_is_five_times_the_slowest_gap_within_floor_and_ceiling() -> None:
    assert learned_bound([0.05, 0.04, 0.06]) == FLOOR  # 50 ms steps: watched at 10 s
    assert learned_bound([300.0, 240.0]) == 1500.0  # 5-minute steps: 25 minutes
    assert learned_bound([3.0, 12.0, 3.0]) == 60.0  # the slowest gap, not the mean
    assert learned_bound([2000.0]) == CEILING


@given(st.lists(st.floats(0.0, 1e6), min_size=1))
def test_the_learned_bound_stays_in_its_range_and_covers_five_slowest_gaps(
    gaps: list[float],
) -> None:
    bound = learned_bound(gaps)
    assert FLOOR <= bound <= CEILING
    assert bound >= min(5 * max(gaps), CEILING)


def test_settings_are_checked_with_clear_errors() -> None:
    assert stall_setting("auto") == "auto"
    assert stall_setting(None) is None and stall_setting(0) is None and stall_setting(0.0) is None
    assert stall_setting(30) == 30.0 and startup_setting(0) is None and startup_setting(5) == 5
    for bad in ("often", "30", -1, math.inf, math.nan, True):
        with pytest.raises(ValueError, match="stall_timeout must be"):
            stall_setting(bad)
    for bad in ("auto", -5, math.inf, False):
        with pytest.raises(ValueError, match="startup_timeout must be"):
            startup_setting(bad)
    assert rule_of("auto") == HangRule(None, DEFAULT_STARTUP)
    assert rule_of(7, 0) == HangRule(7.0, None) and rule_of(0) is None and rule_of(None) is None


def test_worker_specs_and_launch_configs_watch_by_default_and_refuse_bad_values() -> None:
    handler = make_handler("spec-hangs")
    spec = WorkerSpec("trainer", 1, handler, "python")
    assert (spec.stall_timeout, spec.startup_timeout) == ("auto", DEFAULT_STARTUP)
    assert spec.hang_rule() == HangRule(None, DEFAULT_STARTUP)
    assert WorkerSpec("t", 1, handler, "python", stall_timeout=0).hang_rule() is None
    assert WorkerSpec("t", 1, handler, "python", stall_timeout=4).hang_rule() == HangRule(
        4.0, DEFAULT_STARTUP
    )
    with pytest.raises(ValueError, match="stall_timeout must be 'auto', a number of seconds"):
        WorkerSpec("t", 1, handler, "python", stall_timeout="soon")
    with pytest.raises(ValueError, match="startup_timeout must be a finite number"):
        WorkerSpec("t", 1, handler, "python", startup_timeout=-1)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1)
    assert (config.stall_timeout, config.startup_timeout) == ("auto", DEFAULT_STARTUP)
    assert LaunchConfig(1, 1, 1, stall_timeout=0, startup_timeout=0).stall_timeout is None
    with pytest.raises(ValueError, match="stall_timeout must be"):
        LaunchConfig(1, 1, 1, stall_timeout=-3)


def _watch(rule: HangRule = AUTO, **kw: object) -> Watch | None:
    args: dict[str, object] = {
        "last_progress": None,
        "steps": 0,
        "torch": True,
        "began": 100.0,
        "renewed": None,
        "learned": None,
    }
    args.update(kw)
    return watch_of(rule, **args)  # type: ignore[arg-type]


def test_what_a_worker_is_watched_for() -> None:
    # Before its first step: the start-up bound from the watch's start, torch workers only.
    assert _watch() == Watch(100.0, 1800.0, "startup", True)
    assert _watch(torch=False) is None
    assert _watch(HangRule(None, None)) is None
    assert _watch(renewed=130.0) == Watch(130.0, 1800.0, "startup", True)
    # Steps, the bound not learned yet: the start-up bound from the last step.
    assert _watch(steps=2, last_progress=140.0) == Watch(140.0, 1800.0, "learning", True)
    # Learned: from the last sign of life (a step, or activity seen from outside).
    assert _watch(steps=9, last_progress=150.0, learned=10.0) == Watch(150.0, 10.0, "learned", True)
    assert _watch(steps=9, last_progress=150.0, learned=10.0, renewed=155.0).since == 155.0
    # Paused (or exiting): not watched, before the first step too.
    assert _watch(steps=9, last_progress=None, learned=10.0) is None
    assert _watch(paused=True) is None
    # A number: the page alone, from the last progress or the watch's start.
    assert _watch(FIXED, steps=4, last_progress=90.0) == Watch(100.0, 3.0, "fixed", False)
    assert _watch(FIXED, steps=4, last_progress=120.0, renewed=125.0).since == 120.0  # type: ignore[union-attr]
    assert _watch(FIXED) == Watch(100.0, 1800.0, "startup", True)  # start-up, whatever the rule
    patient = {p: Watch(0, 1, p, True).patient for p in ("startup", "learning", "learned")}
    assert patient == {"startup": False, "learning": True, "learned": True}


def test_the_verdict_needs_a_look_from_outside_and_half_a_bound_of_idleness() -> None:
    learned = Watch(100.0, 10.0, "learned", True)
    # Before half the bound: nothing to do until then.
    assert check_stalls({0: learned}, 103.0) == StallCheck((), (), 105.0)
    # Past it, not looked at yet: look now (never hung before a look, however late).
    assert check_stalls({0: learned}, 106.0).looks == (0,)
    assert check_stalls({0: learned}, 500.0) == StallCheck((), (0,), 505.0)
    # Looked at (idle) at 105: hung at 110; looked at late (at 108): hung at 113.
    looked = Watch(100.0, 10.0, "learned", True, quiet=105.0)
    assert check_stalls({0: looked}, 109.0) == StallCheck((), (), 110.0)
    assert check_stalls({0: looked}, 110.0).stalled == (0,)
    late = Watch(100.0, 10.0, "learned", True, quiet=108.0)
    assert check_stalls({0: late}, 110.0) == StallCheck((), (), 113.0)
    # A number: the page alone.
    fixed = Watch(100.0, 3.0, "fixed", False)
    assert check_stalls({0: fixed}, 102.0) == StallCheck((), (), 103.0)
    assert check_stalls({0: fixed}, 103.0).stalled == (0,)  # exactly the bound


def test_workers_not_watched_are_looked_at_again_soon() -> None:
    fixed = Watch(100.0, 3.0, "fixed", False)
    check = check_stalls({0: fixed, 1: None}, 100.5, FIXED.unarmed)
    assert check == StallCheck((), (), 102.0)  # T/2 for a number
    assert check_stalls({0: None}, 100.0, AUTO.unarmed).next_check == 105.0
    assert check_stalls({}, 100.0).next_check == 105.0


def test_the_start_line_says_the_rule() -> None:
    assert AUTO.describe() == (
        "hangs: the bound is learned from the step times (5x the slowest recent step, "
        "10 s to 1 h); start-up bound 30 min (--startup-timeout)"
    )
    assert HangRule(5.0, None).describe() == (
        "hangs: 5 s without a step after the first; no start-up bound (--startup-timeout 0)"
    )


def test_a_wait_left_to_the_peer_is_looked_at_again_later_and_later() -> None:
    """A worker waiting in a collective under a learned bound is never acted on: each look
    renews its watch, the next one a bound, then 2, 4... bounds later (a wait of hours costs
    a few dumps); once it steps again it is watched as before."""
    import time

    from aelastic.agent.health.progress import ProgressPages
    from aelastic.agent.health.seen import Seen
    from aelastic.agent.health.stall import Stall

    pages = ProgressPages(1)
    try:
        seen = Seen(pages, AUTO, time.monotonic())
        waiting = Stall(
            0, 1, 0, 12.0, "stacks", where="c10d.py:1 in all_reduce", in_collective=True
        )
        learned = {0: Watch(0.0, 10.0, "learned", True)}
        renewals = []
        for _ in range(4):
            before = time.monotonic()
            assert seen.leave_to_peers([waiting], learned) == []
            renewals.append(seen._renewed[0] - before)
        assert [round(r, -1) for r in renewals] == [0.0, 10.0, 30.0, 70.0]
        # Not left to the peer: a worker stuck outside a collective, or at start-up.
        stuck = Stall(0, 1, 4, 12.0, "stacks", where="train.py:9 in step")
        assert seen.leave_to_peers([stuck], learned) == [stuck]
        startup = {0: Watch(0.0, 10.0, "startup", True)}
        assert seen.leave_to_peers([waiting], startup) == [waiting]
    finally:
        pages.close()
