"""Parameters, settings and the registry behave as torch's do (same errors)."""

from __future__ import annotations

import pytest
from torch.distributed.elastic.rendezvous import api as torch_api

from aelastic import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from aelastic.backends import backend_names, create_backend, register_backend
from aelastic.backends.memory import MemoryBackend
from aelastic.core.params import RendezvousSettings
from aelastic.rendezvous import create_handler

BAD_PARAMS = [
    ("", "ep", "run", 1, 1),
    ("memory", "ep", "run", 0, 1),
    ("memory", "ep", "run", -3, 1),
    ("memory", "ep", "run", 3, 2),
]


@pytest.mark.parametrize("args", BAD_PARAMS)
def test_invalid_parameters_raise_torchs_value_errors(args: tuple[str, str, str, int, int]) -> None:
    with pytest.raises(ValueError) as theirs:
        torch_api.RendezvousParameters(*args)
    with pytest.raises(ValueError) as ours:
        RendezvousParameters(*args)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize(
    "value", ["1", "true", "T", "yes", "Y", 1, True, "0", "false", "F", "no", "n", 0, False]
)
def test_get_as_bool_matches_torch(value: object) -> None:
    theirs = torch_api.RendezvousParameters("b", "e", "r", 1, 1, key=value)
    ours = RendezvousParameters("b", "e", "r", 1, 1, key=value)
    assert ours.get_as_bool("key") == theirs.get_as_bool("key")


@pytest.mark.parametrize("value", ["maybe", 2, "", 1.5])
def test_get_as_bool_rejects_like_torch(value: object) -> None:
    theirs = torch_api.RendezvousParameters("b", "e", "r", 1, 1, key=value)
    ours = RendezvousParameters("b", "e", "r", 1, 1, key=value)
    with pytest.raises(ValueError) as t:
        theirs.get_as_bool("key")
    with pytest.raises(ValueError) as o:
        ours.get_as_bool("key")
    assert str(o.value) == str(t.value)


def test_get_as_int_matches_torch() -> None:
    ours = RendezvousParameters("b", "e", "r", 1, 1, good="42", bad="x")
    theirs = torch_api.RendezvousParameters("b", "e", "r", 1, 1, good="42", bad="x")
    assert ours.get_as_int("good") == theirs.get_as_int("good") == 42
    assert ours.get_as_int("missing", 7) == 7
    with pytest.raises(ValueError) as o:
        ours.get_as_int("bad")
    with pytest.raises(ValueError) as t:
        theirs.get_as_int("bad")
    assert str(o.value) == str(t.value)


def test_exception_tree_matches_torch() -> None:
    for ours in (
        RendezvousClosedError,
        RendezvousTimeoutError,
        RendezvousConnectionError,
        RendezvousStateError,
        RendezvousGracefulExitError,
    ):
        assert issubclass(ours, RendezvousError)
        assert hasattr(torch_api, ours.__name__)


def test_settings_from_parameters_accept_fractions_and_defaults() -> None:
    params = RendezvousParameters("memory", "", "run", 1, 2, join_timeout="0.5")
    s = RendezvousSettings.from_parameters(params)
    assert s.join_timeout == 0.5
    assert (s.last_call_timeout, s.close_timeout, s.heartbeat_timeout) == (30, 30, 5)
    assert (s.keep_alive_interval, s.keep_alive_max_attempt, s.read_timeout) == (5, 3, 60)
    assert s.heartbeat_window == 15


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"join_timeout": "0"}, "join timeout"),
        ({"last_call_timeout": "-1"}, "last_call timeout"),
        ({"close_timeout": "nan"}, "finite"),
        ({"join_timeout": "soon"}, "valid number"),
        ({"keep_alive_interval": 0}, "keep-alive interval"),
        ({"keep_alive_max_attempt": 0}, "keep-alive max attempt"),
        ({"keep_alive_max_attempt": "x"}, "valid integer"),
    ],
)
def test_invalid_settings_are_reported(config: dict[str, object], message: str) -> None:
    params = RendezvousParameters("memory", "", "run", 1, 2, **config)
    with pytest.raises(ValueError, match=message):
        RendezvousSettings.from_parameters(params)


def test_none_keep_alive_is_a_type_error_as_in_torch() -> None:
    params = RendezvousParameters("memory", "", "run", 1, 2, keep_alive_interval=None)
    with pytest.raises(TypeError, match="keep_alive_interval=None"):
        RendezvousSettings.from_parameters(params)


def test_empty_run_id_is_rejected() -> None:
    with pytest.raises(ValueError, match="run id"):
        create_handler(RendezvousParameters("memory", "", "", 1, 1))


def test_registry_knows_the_builtins_and_lazily_imports_them() -> None:
    assert {"memory", "redis", "http"} <= backend_names()
    backend = create_backend(RendezvousParameters("memory", "x", "run", 1, 1))
    assert isinstance(backend, MemoryBackend)


def test_unknown_backend_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="'nope' is not registered"):
        create_handler(RendezvousParameters("nope", "", "run", 1, 1))


def test_register_backend_and_conflicts() -> None:
    def factory(params: RendezvousParameters) -> MemoryBackend:
        return MemoryBackend(params.run_id, "custom")

    register_backend("custom-test", factory)
    register_backend("custom-test", factory)  # same factory: fine
    handler = create_handler(RendezvousParameters("custom-test", "", "run", 1, 1))
    assert handler.get_backend() == "custom-test"
    with pytest.raises(ValueError, match="already registered"):
        register_backend("custom-test", lambda p: MemoryBackend(p.run_id))
    with pytest.raises(ValueError, match="non-empty"):
        register_backend("", factory)


def test_rendezvous_timeout_has_torchs_defaults_and_checks() -> None:
    from datetime import timedelta

    from aelastic import RendezvousTimeout

    t = RendezvousTimeout()
    assert (t.join, t.last_call, t.close, t.heartbeat) == tuple(
        timedelta(seconds=s) for s in (600, 30, 30, 5)
    )
    custom = RendezvousTimeout(join=timedelta(seconds=5), heartbeat=timedelta(seconds=1))
    assert (custom.join, custom.last_call, custom.heartbeat) == (
        timedelta(seconds=5),
        timedelta(seconds=30),
        timedelta(seconds=1),
    )
    with pytest.raises(ValueError, match=r"The close timeout \(0:00:00\) must be positive."):
        RendezvousTimeout(close=timedelta(0))
    with pytest.raises(ValueError, match="The join timeout"):
        RendezvousTimeout(join=timedelta(seconds=-1))


def test_torch_and_aelastic_timeouts_agree() -> None:
    torch_api = pytest.importorskip("torch.distributed.elastic.rendezvous.dynamic_rendezvous")
    from aelastic import RendezvousTimeout

    ours, theirs = RendezvousTimeout(), torch_api.RendezvousTimeout()
    for name in ("join", "last_call", "close", "heartbeat"):
        assert getattr(ours, name) == getattr(theirs, name)
