"""Live pages of the runs: what ``aelastic serve`` shows at ``/`` and ``aelastic dashboard``
serves for any backend.

How it works: :mod:`.model` makes the JSON a page draws from a run's snapshot (pure, shared
with ``aelastic status --list``); :mod:`.sources` reads runs from the HTTP server's engine or
any backend of the registry; :mod:`.feeds` keeps one fresh view per watched run (woken when
the run's status token moves, and on a slow tick for heartbeat times); :mod:`.pages` serves
the pages, their event streams and the login (aiohttp, ``aelastic[http]``), :mod:`._gate`
decides who may read them (the token, sessions);
:mod:`.dashboard` is the stand-alone server. The browser side is plain HTML, CSS and a
little JavaScript in ``static/``, shipped with the package (no build step).

Importing this package imports only the model; the page modules need aiohttp.
"""

from __future__ import annotations

from .model import History, run_summary, run_view, runs_view, state_name

__all__ = ["DEFAULT_PORT", "History", "run_summary", "run_view", "runs_view", "state_name"]

#: ``aelastic dashboard``'s default port.
DEFAULT_PORT = 29410
