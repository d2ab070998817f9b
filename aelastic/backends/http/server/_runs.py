"""The HTTP server's data: every run (an in-process engine), kept across restarts if asked.

How it works: the runs live in an :class:`~aelastic.backends._engine.Engine` in the server's
event loop; each request is applied at once, atomically. With persistence, the file is a
journal: a header line, then one JSON line per run written whenever the run changed in a way
worth keeping (joins, leaves, round transitions, store writes; never heartbeats), the last
line of a run winning. Saving is a group commit: a change marks its run dirty; before the
server answers a request it awaits :meth:`RunStore.durable`, which returns once every run
dirty at the call is appended and fsynced (in a thread: the loop never blocks on the disk;
only the dirty runs are serialized). The journal is rewritten compactly at start and when it
grew past twice its live size (runs serialized in small batches between which the loop
serves requests). A temporary file left by a crash during a rewrite is removed at start.
After a write failed (the journal may end in a cut line, or be gone) the next commit
rewrites it whole instead of appending. Heartbeats are not saved: after a restart every
listed node gets a fresh heartbeat window. Each run's rules and its nodes' secrets are saved
with it (the journal is made readable by its owner only). A request that would add a run
past ``max_runs`` raises :class:`RunLimitError` (:meth:`RunStore.admit`), after the runs
that hold nothing and that nobody waits on were dropped (at most once a second). Each sweep
(:meth:`RunStore.expire`) drops these too, the runs nobody changed (or read the store of)
for the run TTL, and the abandoned ones: no live node in them (none ever joined, all left,
or all went silent for longer than the run's heartbeat window), nobody waiting on them,
nobody changed them or read their store for the empty-run TTL (their store goes too).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ....core.health import JobHealth
from ....core.state import MAX_ROLE, NodeDesc, Placement, RunState
from ....core.token import parse
from ....core.wire import WireError, rules_from_json, rules_to_json
from ..._engine import Engine, Run, now_ms
from ..wire import SchemaError, b64decode, b64encode, require_run_id
from ._holding import Holding

__all__ = ["PersistenceError", "RunLimitError", "RunStore"]

log = logging.getLogger("aelastic.backends.http.server")

_FILE_FORMAT = "aelastic.http.runs"
#: Version 3: runs keep their rules and their nodes' secrets (state format 3); version 4:
#: the job's control state too (the members' profiles and placements, who is done, who
#: failed, the job's health: state format 4).
_FILE_VERSION = 4
#: Runs serialized between two yields to the event loop while rewriting the journal.
_BATCH = 200
#: Seconds between two drops of the empty runs when the server is at its limit of runs.
_PURGE_EVERY = 1.0
#: The journal is rewritten once it is this much larger than its live content.
_GROWTH = 2.0
_MIN_REWRITE = 1 << 20


class PersistenceError(RuntimeError):
    """The persistence file cannot be read (corrupt, foreign) or written."""


class RunLimitError(RuntimeError):
    """A request would add a run past the server's limit of runs."""


def _state_doc(state: RunState) -> dict[str, Any]:
    assert state.rules is not None  # only a made run is kept
    return {
        "rules": rules_to_json(state.rules),
        "secrets": [[n.key, s] for n, s in state.secrets.items()],
        "epoch": state.epoch,
        "generation": state.generation,
        "round": state.round,
        "complete": state.complete,
        "closed": state.closed,
        "deadline": state.deadline_ms,
        "seq": state.seq,
        "world": state.world,
        "lost": state.lost,
        "finished": state.finished,
        "lost_sample": list(state.lost_sample),
        "vacated": state.vacated_ms,
        "master": None if state.master is None else list(state.master),
        "participants": [[n.key, v] for n, v in state.participants.items()],
        "ports": [[n.key, p] for n, p in state.ports.items()],
        "wait_list": [n.key for n in state.wait_list],
        "redundancy_list": [n.key for n in state.redundancy_list],
        "profiles": [[n.key, role, size] for n, (role, size) in state.profiles.items()],
        "placements": [
            [n.key, p.base, p.world, p.role_base, p.role_world] for n, p in state.placements.items()
        ],
        "done": [n.key for n in state.done],
        "failed": [n.key for n in state.failed],
        "health": state.health.to_json(),
    }


def _int(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise SchemaError(f"{what} must be a non-negative integer")
    return value


def _node(value: Any) -> NodeDesc:
    if not isinstance(value, str):
        raise SchemaError("a node must be a string")
    try:
        return NodeDesc.from_key(value)
    except ValueError as exc:
        raise SchemaError(str(exc)) from None


def _role(value: Any) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ROLE:
        raise SchemaError("a role must be a non-empty string")
    return value


def _state_from(doc: Any, beat: int) -> RunState:
    if not isinstance(doc, dict):
        raise SchemaError("a state must be an object")
    epoch, generation = doc.get("epoch"), doc.get("generation")
    if not isinstance(epoch, str) or parse(f"{epoch}.{_int(generation, 'generation')}") is None:
        raise SchemaError("a state has an invalid epoch or generation")
    deadline, master, vacated = doc.get("deadline"), doc.get("master"), doc.get("vacated")
    try:
        rules = rules_from_json(doc.get("rules"))
    except WireError as exc:
        raise SchemaError(f"a state's rules: {exc}") from None
    if rules is None:
        raise SchemaError("a state has no rules")
    secrets = {_node(k): v for k, v in doc.get("secrets") or []}
    if not all(isinstance(v, str) and v for v in secrets.values()):
        raise SchemaError("a state's secrets must be non-empty strings")
    state = RunState(
        epoch,
        rules=rules,
        secrets=secrets,
        generation=_int(generation, "generation"),
        round=_int(doc.get("round"), "round"),
        complete=doc.get("complete") is True,
        closed=doc.get("closed") is True,
        deadline_ms=None if deadline is None else _int(deadline, "deadline"),
        seq=_int(doc.get("seq"), "seq"),
        world=_int(doc.get("world"), "world"),
        lost=_int(doc.get("lost"), "lost"),
        finished=_int(doc.get("finished"), "finished"),
        lost_sample=[_node(k).key for k in doc.get("lost_sample") or []],
        vacated_ms=None if vacated is None else _int(vacated, "vacated"),
        master=None if master is None else (str(master[0]), _int(master[1], "master port")),
        participants={_node(k): _int(v, "rank") for k, v in doc.get("participants") or []},
        ports={_node(k): _int(v, "port") for k, v in doc.get("ports") or []},
        wait_list={_node(k) for k in doc.get("wait_list") or []},
        redundancy_list={_node(k) for k in doc.get("redundancy_list") or []},
    )
    try:
        state.profiles = {
            _node(k): (_role(role), _int(size, "local world size"))
            for k, role, size in doc.get("profiles") or []
        }
        state.placements = {
            _node(k): Placement(*(_int(v, "placement") for v in rest))
            for k, *rest in doc.get("placements") or []
        }
        state.health = JobHealth.from_json(doc.get("health"))
    except (TypeError, ValueError) as exc:
        raise SchemaError(f"a state's control state: {exc}") from None
    state.done = {_node(k) for k in doc.get("done") or []}
    state.failed = {_node(k) for k in doc.get("failed") or []}
    for node in (*state.participants, *state.wait_list, *state.redundancy_list):
        state.beats[node] = beat  # a fresh window after a restart
    if set(state.beats) != set(state.secrets):
        raise SchemaError("a state's secrets must name exactly its listed nodes")
    return state


class RunStore:
    """All runs of one server, and their journal.

    Args:
        persist_path: Journal keeping the runs across restarts (``None``: memory only). Its
            directory must exist.
        max_runs: Runs kept at most (``0``: no limit); those of the journal are all loaded.

    Raises:
        PersistenceError: ``persist_path`` is not a valid journal, or its directory is
            missing or not writable.
    """

    def __init__(
        self, persist_path: str | os.PathLike[str] | None = None, max_runs: int = 0
    ) -> None:
        self.max_runs = max_runs
        self._dirty: set[str] = set()
        self.engine = Engine(on_change=self._mark)
        self.closing = False
        #: The nodes with a keep-alive held right now (run id, node: how many), through
        #: whatever connection: such a node is alive (see :mod:`._departures`).
        self.holding = Holding()
        #: Called with the seconds each journal write took (the server's metrics).
        self.on_write: Callable[[float], None] | None = None
        self._path = None if persist_path is None else Path(persist_path)
        self._lock: asyncio.Lock | None = None
        self._written = 0  # bytes in the journal
        self._damaged = False  # a write failed: rewrite the journal whole before appending
        self._live = 0  # bytes of its last rewrite
        self._purged = -math.inf  # when the empty runs were last dropped at the limit
        if self._path is not None:
            self._open(self._path)

    # -- loading --------------------------------------------------------------------------

    def _open(self, path: Path) -> None:
        parent = path.parent if str(path.parent) else Path(".")
        if not parent.is_dir():
            raise PersistenceError(f"the directory of {path} does not exist: create it first")
        if not os.access(parent, os.W_OK):
            raise PersistenceError(f"the directory of {path} is not writable")
        for stale in parent.glob(f".{path.name}.*.tmp"):
            with contextlib.suppress(OSError):
                stale.unlink()
                log.warning("removed %s, left by a rewrite that did not finish", stale)
        if path.exists():
            try:
                self._load(path.read_bytes())
            except (OSError, ValueError, RecursionError, IndexError, TypeError) as exc:
                raise PersistenceError(
                    f"The persistence file {path} cannot be loaded ({exc}). It was left as it "
                    "is: fix it, move it away, or start the server with another --persist file."
                ) from None
            self.engine.recount_kv()
            log.info("loaded %d run(s) from %s", len(self.engine.runs), path)
        lines = [self._header()] + [self._line(r) for r in self.engine.runs]
        _rewrite(path, lines)
        self._written = self._live = sum(len(line) for line in lines)

    def _load(self, data: bytes) -> None:
        lines = data.splitlines()
        head = json.loads(lines[0]) if lines else None
        if not isinstance(head, dict) or head.get("format") != _FILE_FORMAT:
            raise SchemaError("it is not an aelastic HTTP rendezvous journal")
        if head.get("version") != _FILE_VERSION:
            raise SchemaError(
                f"it has version {head.get('version')!r}; this aelastic reads {_FILE_VERSION}"
            )
        beat = now_ms()
        for number, line in enumerate(lines[1:], start=2):
            try:
                record = json.loads(line)
            except ValueError:
                if number == len(lines):  # a last line cut short by a crash: never acked
                    log.warning("ignored the incomplete last line of the journal")
                    break
                raise
            self._apply_record(record, beat)

    def _apply_record(self, record: Any, beat: int) -> None:
        if not isinstance(record, dict):
            raise SchemaError("a journal line must be an object")
        run_id = require_run_id(record.get("run"))
        if record.get("deleted") is True:
            self.engine.runs.pop(run_id, None)
            return
        run = self.engine.run(run_id)
        state, kv = record.get("state"), record.get("kv")
        run.state = None if state is None else _state_from(state, beat)
        if not isinstance(kv, dict) or not all(isinstance(v, str) for v in kv.values()):
            raise SchemaError(f"the keys of run {run_id!r} must map to base64 text")
        run.kv = {k: b64decode(v, f"key {k!r} of run {run_id!r}") for k, v in kv.items()}

    # -- saving ---------------------------------------------------------------------------

    def _mark(self, run_id: str) -> None:
        self._dirty.add(run_id)

    def _header(self) -> bytes:
        return json.dumps({"format": _FILE_FORMAT, "version": _FILE_VERSION}).encode() + b"\n"

    def _line(self, run_id: str) -> bytes:
        run = self.engine.runs.get(run_id)
        if run is None or run.empty():
            doc: dict[str, Any] = {"run": run_id, "deleted": True}
        else:
            doc = {
                "run": run_id,
                "state": None if run.state is None else _state_doc(run.state),
                "kv": {k: b64encode(v) for k, v in run.kv.items()},
            }
        return json.dumps(doc, separators=(",", ":")).encode() + b"\n"

    @property
    def settled(self) -> bool:
        """Whether every change made so far is durable (:meth:`durable` would return at
        once): an answer may then go out without awaiting it."""
        return self._path is None or not (self._dirty or (self._lock and self._lock.locked()))

    async def durable(self) -> None:
        """Return once every change made so far is on disk (at once without a journal).

        Raises:
            PersistenceError: The journal could not be written.
        """
        if self._path is None:
            return
        if self._lock is None:
            self._lock = asyncio.Lock()
        if not self._dirty and not self._lock.locked():
            return
        async with self._lock:  # after a commit under way, which may hold our change
            if not self._dirty:
                return
            if self._damaged:
                await self._compact(strict=True)
                return
            batch, self._dirty = self._dirty, set()
            lines = [self._line(run_id) for run_id in batch]
            started = time.monotonic()
            try:
                await asyncio.to_thread(_append, self._path, lines)
            except OSError as exc:
                self._dirty |= batch
                self._damaged = True  # it may end in a cut line now, or be gone
                raise self._failed(exc) from exc
            if self.on_write is not None:
                self.on_write(time.monotonic() - started)
            self._written += sum(len(line) for line in lines)
            if self._written > max(_MIN_REWRITE, _GROWTH * self._live):
                await self._compact()

    def _failed(self, exc: OSError) -> PersistenceError:
        log.error("could not persist the rendezvous runs to %s: %s", self._path, exc)
        return PersistenceError(f"could not persist the runs to {self._path}: {exc}")

    async def _compact(self, strict: bool = False) -> None:
        """Rewrite the journal compactly; ``strict``: raise if that fails (else log)."""
        assert self._path is not None
        lines = [self._header()]
        run_ids = list(self.engine.runs)
        for start in range(0, len(run_ids), _BATCH):
            lines.extend(self._line(r) for r in run_ids[start : start + _BATCH] if r)
            await asyncio.sleep(0)  # let the loop serve requests between batches
        changed, self._dirty = self._dirty, set()
        lines.extend(self._line(r) for r in changed)  # changed meanwhile: newest last
        try:
            await asyncio.to_thread(_rewrite, self._path, lines)
        except OSError as exc:
            self._dirty |= changed  # not on disk: the next commit writes them
            if strict:
                raise self._failed(exc) from exc
            log.error("could not rewrite %s: %s", self._path, exc)
            return  # the journal as it was stays valid; try again after the next commit
        self._damaged = False
        self._written = self._live = sum(len(line) for line in lines)

    # -- runs -----------------------------------------------------------------------------

    def admit(self, run_id: str) -> None:
        """Check that a request may make ``run_id`` (a run it names may be new).

        Raises:
            RunLimitError: ``run_id`` would be a new run past ``max_runs``.
        """
        runs = self.engine.runs
        if not self.max_runs or len(runs) < self.max_runs or run_id in runs:
            return
        now = time.monotonic()
        if now - self._purged >= _PURGE_EVERY:
            self._purged = now
            for empty in [r for r, run in runs.items() if run.idle and run.empty()]:
                self.engine.delete(empty)
        if len(runs) >= self.max_runs:
            raise RunLimitError(
                f"this server keeps at most {self.max_runs} runs (--max-runs) and run "
                f"{run_id!r} would be a new one: finish or delete old runs "
                "(DELETE /v1/runs/{run}), or restart the server with a higher --max-runs"
            )

    def delete(self, run_id: str) -> bool:
        """Forget ``run_id`` (state and keys); whether it held anything."""
        return self.engine.delete(run_id)

    def expire(self, ttl: float, now: float, empty_ttl: float = math.inf) -> int:
        """Forget the runs nobody waits on that hold nothing (a wait on a run that never
        came), that nobody changed or read for ``ttl`` s (monotonic ``now``), or that no live node
        is in and nobody changed or read for ``empty_ttl`` s; how many."""
        wall = now_ms()
        old = [
            r
            for r, run in self.engine.runs.items()
            if run.idle
            and (run.empty() or run.touched < now - ttl or _abandoned(run, now, wall, empty_ttl))
        ]
        for run_id in old:
            self.engine.delete(run_id)
        return len(old)

    def close(self) -> None:
        """Wake every waiter: the server is shutting down."""
        self.closing = True
        self.engine.wake_everyone()


def _abandoned(run: Run, now: float, wall: int, ttl: float) -> bool:
    """Whether no live node is in ``run`` and it was quiet for ``ttl`` s (``now``: monotonic
    seconds, ``wall``: this machine's clock in ms)."""
    quiet = run.touched
    state = run.state
    if state is not None and state.beats:
        newest = max(state.beats.values())
        window = 0 if state.rules is None else state.rules.window_ms
        if wall - newest <= window:
            return False  # a node beat within the run's window: it is in the run
        quiet = max(quiet, now - (wall - newest) / 1000)
    return quiet < now - ttl


def _private(path: str | os.PathLike[str], flags: int) -> int:
    """Open ``path`` for writing, made readable by its owner only (it holds secrets)."""
    return os.open(path, flags, 0o600)


def _append(path: Path, lines: Iterable[bytes]) -> None:
    with open(path, "ab", opener=_private) as f:
        f.write(b"".join(lines))
        f.flush()
        os.fsync(f.fileno())


def _rewrite(path: Path, lines: Iterable[bytes]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb", opener=_private) as f:
            f.write(b"".join(lines))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):
        dir_fd = os.open(path.parent if str(path.parent) else ".", os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
