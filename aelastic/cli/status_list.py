"""``aelastic status --list``: the runs on a backend, one line each.

How it works: the backend (a :class:`~aelastic.core.protocol.RunLister`: Redis, an HTTP
server, or the in-memory runs of this very process) names its runs and their statuses;
each becomes one line (id, round, state, members, waiting, redundant), or, with
``--json``, one JSON document ``{"runs": [...], "more": bool}`` whose entries are the
pages' run summaries (:func:`aelastic.web.model.run_summary`).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from ..core.errors import RendezvousConnectionError
from ..core.protocol import RendezvousBackend, RunLister
from ..web.model import run_summary

__all__ = ["show_runs"]


def _members(summary: dict[str, object]) -> str:
    if summary["state"] == "forming" or not summary["world"]:
        return str(summary["participants"])
    return f"{summary['participants']} of {summary['world']}"


async def show_runs(
    backend: RendezvousBackend, limit: int, as_json: bool, say: Callable[[str], None]
) -> int:
    """Print the runs ``backend`` names (at most ``limit``); the exit code.

    Raises:
        RendezvousConnectionError: The backend cannot list its runs, or is unreachable.
    """
    if not isinstance(backend, RunLister):
        raise RendezvousConnectionError(f"the {backend.name} backend cannot list its runs")
    found = await backend.list_runs(limit + 1)
    more = len(found) > limit
    summaries = [run_summary(run_id, status) for run_id, status in found[:limit]]
    if as_json:
        say(json.dumps({"runs": summaries, "more": more}))
        return 0
    if not summaries:
        say(f"no runs at {backend.endpoint}")
        return 0
    width = max(len("RUN"), *(len(s["run_id"]) for s in summaries))
    say(f"{'RUN':<{width}}  ROUND  STATE     MEMBERS  WAITING  REDUNDANT")
    for s in summaries:
        say(
            f"{s['run_id']:<{width}}  {s['round']:>5}  {s['state']:<8}  {_members(s):>7}  "
            f"{s['waiting']:>7}  {s['redundant']:>9}"
        )
    if more:
        say(f"(more runs exist than the {limit} listed: --limit)")
    return 0
