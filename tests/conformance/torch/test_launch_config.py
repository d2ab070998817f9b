"""torch's ``test/distributed/elastic/agent/server/test/shutdown_timeout_test.py`` and
``exit_barrier_timeout_test.py``: the launch's timeouts, against
:class:`aelastic.launcher.LaunchConfig`.

Ported from ``shutdown_timeout_test.py`` (7 scenarios): ``LaunchConfig``'s default, given,
environment (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``), given-over-environment, negative and zero
``shutdown_timeout``, and what torch's agent tests with mocks (``test_*_receives_shutdown_
timeout``, ``test_shutdown_method_receives_correct_timeout``, ``test_pcontext_close_receives_
timeout``) as one observable scenario: a worker that ignores SIGTERM is killed once the
launch's ``shutdown_timeout`` has passed.
``exit_barrier_timeout_test.py`` is newer than torch 2.13 (whose ``LaunchConfig`` has no
``exit_barrier_timeout``; aelastic's has, as its own field): ported are the default (300 s),
a given value, zero, and a negative value refused (4 scenarios); not its environment variable
``TORCH_ELASTIC_EXIT_BARRIER_TIMEOUT`` (not in torch 2.13) nor its checks of the private
``_exit_barrier_timeout`` of torch's agents (the field reaches aelastic's agent as
``WorkerSpec.exit_barrier_timeout``, whose waiting ``test_local_elastic_agent.py`` tests).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from aelastic.launcher import LaunchConfig, elastic_launch

from ._agents import WORKER


def _config(**kwargs: object) -> LaunchConfig:
    return LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def _no_timeout_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    monkeypatch.delenv("TORCH_ELASTIC_EXIT_BARRIER_TIMEOUT", raising=False)


def test_launch_config_default_shutdown_timeout() -> None:
    assert _config().shutdown_timeout == 30


def test_launch_config_custom_shutdown_timeout() -> None:
    assert _config(shutdown_timeout=120).shutdown_timeout == 120


def test_launch_config_env_var_shutdown_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "600")
    assert _config().shutdown_timeout == 600


def test_launch_config_explicit_overrides_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "600")
    assert _config(shutdown_timeout=120).shutdown_timeout == 120


def test_shutdown_timeout_validation_negative() -> None:
    with pytest.raises(ValueError, match="shutdown_timeout must be non-negative"):
        _config(shutdown_timeout=-5)


def test_shutdown_timeout_zero() -> None:
    assert _config(shutdown_timeout=0).shutdown_timeout == 0


def test_the_shutdown_timeout_is_the_workers_grace(run_id: str, tmp_path: Path) -> None:
    """Rank 1 fails; rank 0 ignores SIGTERM: it is killed ``shutdown_timeout`` (1 s) after
    the SIGTERM, and the launch ends then (not after torch's default 30 s)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    config = _config(
        run_id=run_id, max_restarts=0, warm_standby=False, shutdown_timeout=1, rdzv_backend="memory"
    )
    started = time.monotonic()
    with pytest.raises(ChildFailedError) as raised:
        elastic_launch(config, sys.executable)(WORKER, str(tmp_path), "term_ignored")
    assert time.monotonic() - started < 15
    assert set(raised.value.failures) == {1}


def test_launch_config_default_exit_barrier_timeout() -> None:
    assert _config().exit_barrier_timeout == 300.0


def test_launch_config_custom_exit_barrier_timeout() -> None:
    assert _config(exit_barrier_timeout=600).exit_barrier_timeout == 600.0


def test_exit_barrier_timeout_zero() -> None:
    assert _config(exit_barrier_timeout=0).exit_barrier_timeout == 0.0


def test_exit_barrier_timeout_validation_negative(run_id: str, tmp_path: Path) -> None:
    """A negative exit barrier timeout is refused (torch, newer than 2.13: when the config
    is made; aelastic: when it is launched, before anything runs)."""
    config = _config(run_id=run_id, exit_barrier_timeout=-1, warm_standby=False)
    with pytest.raises(ValueError, match="exit_barrier_timeout"):
        elastic_launch(config, sys.executable)(WORKER, str(tmp_path), "ok")
    assert not list(tmp_path.glob("*.json"))
