"""torch's ``test/distributed/elastic/rendezvous/api_test.py``: ``RendezvousParameters``
and the registry that makes a handler from them.

Ported (23 test functions): all 17 tests of ``RendezvousParametersTest`` (values given to
each test as torch's ``subTest`` gives them) and the 5 of ``RendezvousHandlerRegistryTest``,
against aelastic's registry (:func:`aelastic.backends.register_backend` and ``create_handler``: a
backend is registered, not a handler, docs/torch-api.md ``RendezvousHandlerRegistry``), plus
one scenario for torch's own registry, which makes aelastic's handlers through the
``torchrun.handlers`` entry points. Nothing of the file is skipped; torch's
``test_create_handler_raises_error_if_backend_names_do_not_match`` (a handler whose
``get_backend()`` is not the name it was registered under) becomes: the handler answers the
registered name, since aelastic makes the handler itself.
"""

from __future__ import annotations

from typing import Any

import pytest

from aelastic import RendezvousParameters
from aelastic.backends import register_backend
from aelastic.backends.memory import MemoryBackend
from aelastic.rendezvous import create_handler

pytestmark = pytest.mark.anyio


def _params(min_nodes: int = 3, max_nodes: int = 6, **kwargs: Any) -> RendezvousParameters:
    return RendezvousParameters(
        backend="dummy_backend",
        endpoint="dummy_endpoint",
        run_id="dummy_run_id",
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        **kwargs,
    )


# -- RendezvousParametersTest ---------------------------------------------------------------


def test_init_initializes_params() -> None:
    params = _params(dummy_param="x")
    assert (params.backend, params.endpoint, params.run_id) == (
        "dummy_backend",
        "dummy_endpoint",
        "dummy_run_id",
    )
    assert (params.min_nodes, params.max_nodes) == (3, 6)
    assert params.get("dummy_param") == "x"


def test_init_initializes_params_if_min_nodes_equals_to_1() -> None:
    params = _params(min_nodes=1)
    assert (params.min_nodes, params.max_nodes) == (1, 6)


def test_init_initializes_params_if_min_and_max_nodes_are_equal() -> None:
    params = _params(max_nodes=3)
    assert (params.min_nodes, params.max_nodes) == (3, 3)


@pytest.mark.parametrize("backend", [None, ""])
def test_init_raises_error_if_backend_is_none_or_empty(backend: Any) -> None:
    with pytest.raises(
        ValueError, match=r"^The rendezvous backend name must be a non-empty string.$"
    ):
        RendezvousParameters(backend, "dummy_endpoint", "dummy_run_id", 3, 6)


@pytest.mark.parametrize("min_nodes", [0, -1, -5])
def test_init_raises_error_if_min_nodes_is_less_than_1(min_nodes: int) -> None:
    with pytest.raises(
        ValueError,
        match=rf"^The minimum number of rendezvous nodes \({min_nodes}\) must be greater "
        r"than zero.$",
    ):
        _params(min_nodes=min_nodes)


@pytest.mark.parametrize("max_nodes", [2, 1, -2])
def test_init_raises_error_if_max_nodes_is_less_than_min_nodes(max_nodes: int) -> None:
    with pytest.raises(
        ValueError,
        match=rf"^The maximum number of rendezvous nodes \({max_nodes}\) must be greater "
        r"than or equal to the minimum number of rendezvous nodes \(3\).$",
    ):
        _params(max_nodes=max_nodes)


def test_get_returns_none_if_key_does_not_exist() -> None:
    assert _params().get("dummy_param") is None


def test_get_returns_default_if_key_does_not_exist() -> None:
    assert _params().get("dummy_param", default="x") == "x"


def test_get_as_bool_returns_none_if_key_does_not_exist() -> None:
    assert _params().get_as_bool("dummy_param") is None


def test_get_as_bool_returns_default_if_key_does_not_exist() -> None:
    assert _params().get_as_bool("dummy_param", default=True) is True


@pytest.mark.parametrize("value", ["1", "True", "tRue", "T", "t", "yEs", "Y", 1, True])
def test_get_as_bool_returns_true_if_value_represents_true(value: Any) -> None:
    assert _params(dummy_param=value).get_as_bool("dummy_param") is True


@pytest.mark.parametrize("value", ["0", "False", "faLse", "F", "f", "nO", "N", 0, False])
def test_get_as_bool_returns_false_if_value_represents_false(value: Any) -> None:
    assert _params(dummy_param=value).get_as_bool("dummy_param") is False


@pytest.mark.parametrize("value", ["01", "Flse", "Ture", "g", "4", "_", "truefalse", 2, -1])
def test_get_as_bool_raises_error_if_value_is_invalid(value: Any) -> None:
    with pytest.raises(
        ValueError,
        match=r"^The rendezvous configuration option 'dummy_param' does not represent a "
        r"valid boolean value.$",
    ):
        _params(dummy_param=value).get_as_bool("dummy_param")


def test_get_as_int_returns_none_if_key_does_not_exist() -> None:
    assert _params().get_as_int("dummy_param") is None


def test_get_as_int_returns_default_if_key_does_not_exist() -> None:
    assert _params().get_as_int("dummy_param", default=5) == 5


@pytest.mark.parametrize("value", ["0", "-10", "5", "  4", "4  ", " 4 ", 0, -4, 3])
def test_get_as_int_returns_integer_if_value_represents_integer(value: Any) -> None:
    assert _params(dummy_param=value).get_as_int("dummy_param") == int(value)


@pytest.mark.parametrize("value", ["a", "0a", "3b", "abc"])
def test_get_as_int_raises_error_if_value_is_invalid(value: Any) -> None:
    with pytest.raises(
        ValueError,
        match=r"^The rendezvous configuration option 'dummy_param' does not represent a "
        r"valid integer value.$",
    ):
        _params(dummy_param=value).get_as_int("dummy_param")


# -- RendezvousHandlerRegistryTest ----------------------------------------------------------


def _dummy_backend(params: RendezvousParameters) -> MemoryBackend:
    return MemoryBackend(params.run_id, "registry-tests")


def test_register_registers_once_if_called_twice_with_same_creator() -> None:
    register_backend("torch-registry-once", _dummy_backend)
    register_backend("torch-registry-once", _dummy_backend)


def test_register_raises_error_if_called_twice_with_different_creators() -> None:
    register_backend("torch-registry-twice", _dummy_backend)

    def other(params: RendezvousParameters) -> MemoryBackend:
        return MemoryBackend(params.run_id)

    with pytest.raises(
        ValueError,
        match=r"^The rendezvous backend 'torch-registry-twice' cannot be registered with "
        rf"'{other}' as it is already registered with '{_dummy_backend}'.$",
    ):
        register_backend("torch-registry-twice", other)


async def test_create_handler_returns_handler() -> None:
    register_backend("torch-registry-create", _dummy_backend)
    params = RendezvousParameters("torch-registry-create", "dummy_endpoint", "dummy_run_id", 1, 1)
    handler = create_handler(params)
    try:
        assert isinstance(handler.backend, MemoryBackend)
        assert handler.get_run_id() == "dummy_run_id"
        assert (handler.settings.min_nodes, handler.settings.max_nodes) == (1, 1)
    finally:
        await handler.aclose()


def test_create_handler_raises_error_if_backend_is_not_registered() -> None:
    params = RendezvousParameters("dummy_backend", "dummy_endpoint", "dummy_run_id", 1, 1)
    with pytest.raises(
        ValueError,
        match=r"^The rendezvous backend 'dummy_backend' is not registered.* Did you forget to "
        r"call `register",
    ):
        create_handler(params)


async def test_the_handler_answers_the_name_its_backend_was_registered_under() -> None:
    """torch: ``test_create_handler_raises_error_if_backend_names_do_not_match``."""
    register_backend("torch-registry-name", _dummy_backend)
    params = RendezvousParameters("torch-registry-name", "dummy_endpoint", "dummy_run_id", 1, 1)
    handler = create_handler(params)
    try:
        assert handler.get_backend() == "torch-registry-name"
    finally:
        await handler.aclose()


def test_torchs_registry_makes_aelastics_handler() -> None:
    """torch's ``get_rendezvous_handler`` finds aelastic's backends through the
    ``torchrun.handlers`` entry points and makes a handler with torch's methods."""
    registry = pytest.importorskip("torch.distributed.elastic.rendezvous.registry")
    params = registry.RendezvousParameters(
        backend="aelastic-memory",
        endpoint="torch-registry",
        run_id="torch-registry-run",
        min_nodes=1,
        max_nodes=1,
        last_call_timeout="0.1",
    )
    handler = registry.get_rendezvous_handler(params)
    try:
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        assert handler.get_run_id() == "torch-registry-run"
        assert handler.shutdown() is True
        assert handler.is_closed()
    finally:
        close = getattr(handler, "close", None)
        if close is not None:
            close()
