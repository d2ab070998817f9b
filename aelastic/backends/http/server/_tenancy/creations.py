"""How many runs a client or a scoped token may make: so many a minute, so many at once.

How it works: a request that may make a run (a rendezvous request, a store write, a long
poll) is admitted here before it is applied: first by the server's limit of runs
(:meth:`~.._runs.RunStore.admit`, ``503``); then, if its run does not exist yet, it would
make one, and it is counted for its client (:meth:`~.._clients.Clients.key`; clients on the
server's own machine are not counted, as for nodes: tests and the scale benchmark make their
runs from 127.0.0.1) and for its scoped token (:mod:`.scopes`; the server's own token is the
operator's and is not counted). Each of them keeps a tally: when it made its runs in the
last ``new_runs_window`` seconds, and the ids of the runs it made. Past ``max_new_runs``
in the window the request is refused ``429`` with ``Retry-After`` (when its oldest leaves
the window); past ``max_live_runs`` of its runs that the server still keeps (recounted when
at the limit: a run closed and gone, deleted or reclaimed as abandoned frees its place),
``429`` without: waiting alone does not help. A refused request changes nothing. The
runs each made are also what its stores count against (:meth:`RunQuota.makers`,
:mod:`.sizes`). :meth:`RunQuota.sweep` (with the server's sweep of runs) drops the tallies
left empty.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable

from aiohttp import web

from .._clients import Clients
from .._runs import RunStore
from .limits import Quotas, Refused
from .scopes import scope_of

__all__ = ["RUN_QUOTA", "RunQuota"]


class _Tally:
    __slots__ = ("made", "runs")

    def __init__(self) -> None:
        self.made: deque[float] = deque()  # when it made its runs, oldest first
        self.runs: dict[str, None] = {}  # the runs it made (some may be gone)


class RunQuota:
    """Runs made per client and per scoped token (see the module docstring).

    Args:
        store: The server's runs.
        quotas: The limits (``max_new_runs``, ``new_runs_window``, ``max_live_runs``).
        clients: How the server names its clients.
        clock: Monotonic seconds.
    """

    def __init__(
        self,
        store: RunStore,
        quotas: Quotas,
        clients: Clients,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.quotas = quotas
        self.clients = clients
        self._clock = clock
        self._tallies: dict[str, _Tally] = {}
        self._made_by: dict[str, list[str]] = {}  # run id -> the tallies that made it
        #: Requests refused since the start, by limit (``new_runs``, ``live_runs``).
        self.refused: Counter[str] = Counter()

    def admit(self, request: web.Request, run_id: str) -> None:
        """Let a request that may make run ``run_id`` through, counting the run if it is new.

        Args:
            request: The HTTP request (the request itself, or its channel's upgrade).
            run_id: The run it names.

        Raises:
            RunLimitError: The server keeps its limit of runs (``503``).
            Refused: ``429``: its client or its token made its limit of runs.
        """
        self.store.admit(run_id)
        if run_id in self.store.engine.runs:
            return
        counted: list[tuple[str, _Tally]] = []
        scope = scope_of(request)
        if not scope.everything:
            counted.append(self._tally(scope.name))
        if not self.clients.is_loopback(request):
            counted.append(self._tally(f"client {self.clients.key(request)}"))
        now = self._clock()
        for who, tally in counted:
            self._check(who, tally, run_id, now)
        makers = [who for who, _ in counted]
        for who in self._made_by.pop(run_id, ()):  # who made a run of that id before
            before = self._tallies.get(who)
            if before is not None and who not in makers:
                before.runs.pop(run_id, None)
        for _, tally in counted:
            if run_id not in tally.runs:  # (else being made, or made again by the same)
                tally.made.append(now)
                tally.runs[run_id] = None
        if makers:
            self._made_by[run_id] = makers

    def _tally(self, who: str) -> tuple[str, _Tally]:
        tally = self._tallies.get(who)
        if tally is None:
            tally = self._tallies[who] = _Tally()
        return who, tally

    def _check(self, who: str, tally: _Tally, run_id: str, now: float) -> None:
        if run_id in tally.runs:
            return  # made by it a moment ago, and being made (a channel's join)
        quotas = self.quotas
        window = quotas.new_runs_window
        self._slide(tally, now)
        if quotas.max_new_runs and len(tally.made) >= quotas.max_new_runs:
            self.refused["new_runs"] += 1
            wait = tally.made[0] + window - now
            raise Refused(
                429,
                f"{who} made {len(tally.made)} runs in the last {window:g} s, its limit "
                f"(aelastic serve --max-new-runs, --new-runs-window): run {run_id!r} would be "
                f"one more; retry in {max(wait, 1):.0f} s",
                retry_after=wait,
            )
        if quotas.max_live_runs and len(tally.runs) >= quotas.max_live_runs:
            self._recount(tally)
            if len(tally.runs) >= quotas.max_live_runs:
                self.refused["live_runs"] += 1
                raise Refused(
                    429,
                    f"{who} made {len(tally.runs)} runs that this server still keeps, its "
                    f"limit (aelastic serve --max-live-runs): run {run_id!r} would be one "
                    "more; close or delete runs that are over (a run no node is in is "
                    "forgotten after --empty-run-ttl)",
                )

    def _slide(self, tally: _Tally, now: float) -> None:
        start = now - self.quotas.new_runs_window
        made = tally.made
        while made and made[0] <= start:
            made.popleft()

    def _recount(self, tally: _Tally) -> None:
        runs = self.store.engine.runs
        tally.runs = {r: None for r in tally.runs if r in runs}

    def makers(self, run_id: str) -> list[tuple[str, int]]:
        """Who made run ``run_id`` (its client, its scoped token; none for a run made from
        loopback with the server's token), each with the bytes the stores of the runs it
        made hold together."""
        engine = self.store.engine
        makers = []
        for who in self._made_by.get(run_id, ()):
            tally = self._tallies.get(who)
            if tally is not None:
                with engine.lock:
                    held = sum(run.kv_bytes for r in tally.runs if (run := engine.runs.get(r)))
                makers.append((who, held))
        return makers

    def sweep(self) -> None:
        """Forget the runs that went, and the tallies left with nothing."""
        now = self._clock()
        for who, tally in list(self._tallies.items()):
            self._slide(tally, now)
            self._recount(tally)
            if not tally.made and not tally.runs:
                del self._tallies[who]
        runs = self.store.engine.runs
        for run_id in [r for r in self._made_by if r not in runs]:
            del self._made_by[run_id]

    def count(self, who: str) -> tuple[int, int]:
        """Runs made in the window and runs kept, for ``who`` (``client <key>``, or a scoped
        token's name; some may have gone since the last recount)."""
        tally = self._tallies.get(who)
        return (0, 0) if tally is None else (len(tally.made), len(tally.runs))


#: The server's :class:`RunQuota`.
RUN_QUOTA = web.AppKey("aelastic_run_quota", RunQuota)
