"""The failed-token-check buckets of the HTTP server, on a clock the test moves."""

from __future__ import annotations

import logging

import pytest

from aelastic.backends.http.server._throttle import LOG_EVERY, AuthThrottle


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_client_waits_once_its_failures_pass_the_burst_and_a_refill_lets_one_more() -> None:
    clock = Clock()
    throttle = AuthThrottle(burst=3, refill=2.0, clock=clock)
    assert not throttle.tracking and throttle.wait("a", "bearer") == 0
    for _ in range(3):
        assert throttle.wait("a", "bearer") == 0
        throttle.failed("a", "bearer")
    assert throttle.wait("a", "bearer") == pytest.approx(2.0)  # one refill away
    assert throttle.wait("b", "bearer") == 0  # another client never waits for it
    clock.now += 1.5
    assert throttle.wait("a", "login") == pytest.approx(0.5)
    clock.now += 0.5
    assert throttle.wait("a", "bearer") == 0  # one more check...
    throttle.failed("a", "bearer")
    assert throttle.wait("a", "bearer") > 0  # ... and no more
    clock.now += 60
    for _ in range(3):  # refilled to the burst, never beyond
        assert throttle.wait("a", "bearer") == 0
        throttle.failed("a", "bearer")
    assert throttle.wait("a", "bearer") > 0
    assert throttle.failures == {"bearer": 7}
    assert throttle.refusals == {"bearer": 3, "login": 1}


def test_a_connection_that_showed_the_token_is_vouched_for_until_it_fails() -> None:
    throttle = AuthThrottle(burst=1, clock=Clock())

    class Connection:  # (a transport, for the throttle: anything weakly referenced)
        pass

    node = Connection()
    throttle.vouch(node)
    assert throttle.vouched(node) and not throttle.vouched(Connection())
    throttle.failed("a", "bearer", node)
    assert not throttle.vouched(node)


def test_each_client_is_logged_at_most_once_a_minute_with_its_counts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "aelastic.backends.http.server")
    clock = Clock()
    throttle = AuthThrottle(burst=2, refill=10.0, clock=clock)
    for _ in range(5):
        throttle.failed("10.0.0.1", "bearer")
        throttle.wait("10.0.0.1", "bearer")
    throttle.failed("10.0.0.1", "login")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["client 10.0.0.1: 1 failed token check(s) (bearer 1)"]
    clock.now += LOG_EVERY
    throttle.flush()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[1:] == [
        "client 10.0.0.1: 5 failed token check(s) (bearer 4, login 1), "
        "4 request(s) refused (429: too many failures, wait)"
    ]
    throttle.flush()  # nothing new: no line
    assert len(caplog.records) == 2


def test_the_clients_remembered_are_bounded_and_the_forgotten_are_summed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "aelastic.backends.http.server")
    clock = Clock()
    throttle = AuthThrottle(burst=5, max_clients=100, clock=clock)
    for i in range(1000):
        throttle.failed(f"10.0.{i // 256}.{i % 256}", "bearer")
        throttle.failed(f"10.0.{i // 256}.{i % 256}", "bearer")  # (counted, logged later)
    assert len(throttle._clients) == 100
    clock.now += LOG_EVERY
    caplog.clear()
    throttle.flush()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 21  # twenty clients, then one line for the rest
    assert lines[-1] == "980 other client(s): 980 failed token check(s) (bearer 980)"
