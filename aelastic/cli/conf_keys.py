"""The ``--rdzv-conf`` keys aelastic knows, and a warning for each one it does not.

How it works: the known keys are the rendezvous settings (``SETTINGS_KEYS`` of the backend
registry, read by every backend's handler) plus the backend's own: a built-in backend's row
in the registry lists them (nothing is imported); a third-party backend of the
``aelastic.backends`` entry-point group may declare a tuple ``CONFIG_KEYS`` in the module of
its factory; a backend that declares none is not checked (any key may be its own).
:func:`unknown_key_warnings` names every other key once, with the nearest known key
(``difflib``) as a hint: a misspelt key would otherwise be silently ignored.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Iterable

from ..backends.registry import ENTRY_POINT_GROUP, SETTINGS_KEYS, backend_info

__all__ = ["RENDEZVOUS_KEYS", "backend_config_keys", "known_keys", "unknown_key_warnings"]

#: The settings of the rendezvous itself (torch's names), whatever the backend.
RENDEZVOUS_KEYS = SETTINGS_KEYS


def _factory_module(backend: str) -> str | None:
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == backend:
            return ep.value.split(":")[0].strip()
    return None


def backend_config_keys(backend: str) -> tuple[str, ...] | None:
    """The keys ``backend`` declares (``None``: it declares none, or it cannot be imported;
    its own error comes when the launcher creates it)."""
    info = backend_info(backend)
    if info is not None:
        return info.config_keys
    module_name = _factory_module(backend)
    if module_name is None:
        return None
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None
    keys = getattr(module, "CONFIG_KEYS", None)
    if not isinstance(keys, (tuple, list, frozenset, set)):
        return None
    return tuple(str(k) for k in keys)


def known_keys(backend: str) -> frozenset[str] | None:
    """Every ``--rdzv-conf`` key ``backend`` reads (``None``: unknown, do not check)."""
    own = backend_config_keys(backend)
    return None if own is None else frozenset(RENDEZVOUS_KEYS) | frozenset(own)


def unknown_key_warnings(keys: Iterable[str], backend: str) -> list[str]:
    """One warning per key of ``keys`` that ``backend`` does not read, with a hint.

    Args:
        keys: The ``--rdzv-conf`` keys given.
        backend: The backend's name (``memory``, ``redis``, ``http`` or a registered one).

    Returns:
        Lines like ``unknown --rdzv-conf key 'join_timout' (did you mean 'join_timeout'?)``.
    """
    known = known_keys(backend)
    if known is None:
        return []
    warnings = []
    for key in dict.fromkeys(keys):
        if key in known:
            continue
        nearest = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
        hint = f"did you mean '{nearest[0]}'?" if nearest else "ignored"
        warnings.append(f"unknown --rdzv-conf key '{key}' ({hint})")
    return warnings
