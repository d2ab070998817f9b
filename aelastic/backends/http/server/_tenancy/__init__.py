"""Runs kept apart on a shared server: scoped tokens, quotas of runs and of store bytes.

How it works: :mod:`.scopes` names the runs a token may use (the server's own token: all of
them; a minted or listed token: those of one run-id prefix); :mod:`.creations` counts the
runs each client and each scoped token makes; :mod:`.sizes` bounds the members' stores;
:mod:`.limits` holds the numbers and the :class:`~.limits.Refused` error every refusal
raises. The server's bearer middleware, routes and channel call them before they apply a
request (:mod:`.._app`, :mod:`.._routes`, :mod:`.._channel`).
"""

from __future__ import annotations

from .creations import RUN_QUOTA, RunQuota
from .limits import Quotas, Refused
from .scopes import (
    EVERY_RUN,
    SCOPE,
    Scope,
    Scopes,
    check_route,
    check_run,
    load_scoped_tokens,
    mint,
    read_token_file,
    scope_of,
)
from .sizes import STORE_QUOTA, StoreQuota

__all__ = [
    "EVERY_RUN",
    "RUN_QUOTA",
    "SCOPE",
    "STORE_QUOTA",
    "Quotas",
    "Refused",
    "RunQuota",
    "Scope",
    "Scopes",
    "StoreQuota",
    "check_route",
    "check_run",
    "load_scoped_tokens",
    "mint",
    "read_token_file",
    "scope_of",
]
