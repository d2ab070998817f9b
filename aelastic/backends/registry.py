"""Backends by name: built-ins imported lazily, third parties through entry points.

A backend factory takes :class:`~aelastic.RendezvousParameters` and returns a
:class:`~aelastic.backends.base.RendezvousBackend`. Third-party packages register one
under the entry-point group ``aelastic.backends``; ``register_backend`` does the same at
run time. A built-in whose extra is not installed says which extra to install.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..rendezvous.api import RendezvousParameters
from .base import RendezvousBackend

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

__all__ = ["BackendFactory", "backend_names", "create_backend", "register_backend"]

BackendFactory = Callable[[RendezvousParameters], RendezvousBackend]

#: name -> (module, attribute, extra that provides its dependencies)
_BUILTINS: dict[str, tuple[str, str, str | None]] = {
    "memory": ("aelastic.backends.memory", "create_backend", None),
    "redis": ("aelastic.backends.redis", "create_backend", "redis"),
    "http": ("aelastic.backends.http.client", "create_backend", "http"),
}

ENTRY_POINT_GROUP = "aelastic.backends"

_registry: dict[str, BackendFactory] = {}
_lock = threading.Lock()


def register_backend(name: str, factory: BackendFactory) -> None:
    """Register ``factory`` under ``name``.

    Raises:
        ValueError: ``name`` is empty or already registered with another factory.
    """
    if not name:
        raise ValueError("The rendezvous backend name must be a non-empty string.")
    with _lock:
        current = _registry.get(name)
        if current is not None and current is not factory:
            raise ValueError(
                f"The rendezvous backend '{name}' cannot be registered with '{factory}' as it "
                f"is already registered with '{current}'."
            )
        _registry[name] = factory


def _load_builtin(name: str) -> BackendFactory | None:
    spec = _BUILTINS.get(name)
    if spec is None:
        return None
    module_name, attr, extra = spec
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = f" Install it with: pip install 'aelastic[{extra}]'" if extra else ""
        raise ImportError(
            f"The '{name}' rendezvous backend needs a package that is missing ({exc.name}).{hint}"
        ) from exc
    factory: BackendFactory = getattr(module, attr)
    return factory


def _entry_points() -> list[EntryPoint]:
    # Imported here: importlib.metadata costs ~20 ms, and built-ins never need it.
    from importlib.metadata import entry_points

    return list(entry_points(group=ENTRY_POINT_GROUP))


def _load_entry_point(name: str) -> BackendFactory | None:
    for ep in _entry_points():
        if ep.name == name and ep.value.split(":")[0] not in {m for m, _, _ in _BUILTINS.values()}:
            factory: BackendFactory = ep.load()
            return factory
    return None


def _factory(name: str) -> BackendFactory:
    with _lock:
        factory = _registry.get(name)
    if factory is None:
        factory = _load_builtin(name) or _load_entry_point(name)
        if factory is None:
            known = ", ".join(sorted(backend_names()))
            raise ValueError(
                f"The rendezvous backend '{name}' is not registered (known: {known}). "
                "Did you forget to call `register_backend` or to install its package?"
            )
        register_backend(name, factory)
    return factory


def backend_names() -> set[str]:
    """Names of the built-in, registered and entry-point backends."""
    names = set(_BUILTINS) | set(_registry)
    names.update(ep.name for ep in _entry_points())
    return names


def create_backend(params: RendezvousParameters) -> RendezvousBackend:
    """Create the backend that ``params.backend`` names.

    Raises:
        ValueError: No backend has that name, or its parameters are invalid.
        ImportError: The backend's optional dependencies are not installed.
    """
    return _factory(params.backend)(params)
