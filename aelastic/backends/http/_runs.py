"""The HTTP server's data: every run's state cell and key-value pairs, and their persistence.

How it works: all data lives in the server's event loop, so each operation is applied at
once, atomically, with no lock. A run holds its encoded state, the token parts (a random
epoch drawn when the state is created, a version counting writes) and its key-value pairs.
Long-polls wait on a per-run future that the next change resolves (one for the state, one
for the keys), so waking N waiters costs O(N) and nothing polls.

Persistence (optional) is a group commit: a change bumps a sequence number; before the
server answers a request it awaits :meth:`RunStore.durable`, which returns once a snapshot
holding every change so far is on disk (JSON written to a temporary file, fsynced, renamed
over the old one). Changes that arrive while a snapshot is being written go into the next,
so an acknowledged write is never lost and a burst of writes costs a few file writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .wire import SchemaError, b64decode, b64encode, parse_token, require_run_id

__all__ = ["PersistenceError", "Run", "RunStore"]

log = logging.getLogger("aelastic.backends.http.server")

_FILE_FORMAT = "aelastic.http.runs"
_FILE_VERSION = 1


class PersistenceError(RuntimeError):
    """The persistence file cannot be read (corrupt, foreign) or written."""


class Run:
    """One run: its state cell, its key-value pairs and the futures of its waiters."""

    __slots__ = ("epoch", "kv", "kv_changed", "state", "state_changed", "touched", "version")

    def __init__(self) -> None:
        self.state: bytes | None = None
        self.epoch = ""
        self.version = 0
        self.kv: dict[str, bytes] = {}
        self.touched = time.monotonic()
        self.state_changed: asyncio.Future[None] | None = None
        self.kv_changed: asyncio.Future[None] | None = None

    @property
    def token(self) -> str:
        """The token of the stored state (``""`` when there is none)."""
        return "" if self.state is None else f"{self.epoch}.{self.version}"

    @property
    def idle(self) -> bool:
        """Whether nobody waits on this run."""
        return self.state_changed is None and self.kv_changed is None


def _wake(future: asyncio.Future[None] | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)


class RunStore:
    """All runs of one server.

    Args:
        persist_path: File to keep the runs in across restarts (``None``: memory only).

    Raises:
        PersistenceError: ``persist_path`` exists but is not a valid runs file.
    """

    def __init__(self, persist_path: str | os.PathLike[str] | None = None) -> None:
        self.runs: dict[str, Run] = {}
        self.closing = False
        self._path = None if persist_path is None else Path(persist_path)
        self._seq = 0
        self._durable_seq = 0
        self._flusher: asyncio.Task[None] | None = None
        self._flushed: asyncio.Future[None] | None = None
        if self._path is not None and self._path.exists():
            self._load(self._path)

    # -- changes --------------------------------------------------------------------------

    def run(self, run_id: str) -> Run:
        """The run ``run_id``, created empty if needed."""
        run = self.runs.get(run_id)
        if run is None:
            run = self.runs[run_id] = Run()
        return run

    def state_written(self, run: Run, state: bytes) -> None:
        """Record a new state of ``run`` (new epoch if it had none) and wake its waiters."""
        if run.state is None:
            run.epoch = secrets.token_hex(8)
            run.version = 0
        run.state = state
        run.version += 1
        self._changed(run)
        _wake(run.state_changed)
        run.state_changed = None

    def kv_changed(self, run: Run) -> None:
        """Record that ``run``'s key-value pairs changed and wake their waiters."""
        self._changed(run)
        _wake(run.kv_changed)
        run.kv_changed = None

    def delete(self, run_id: str) -> bool:
        """Forget ``run_id`` (state and keys); whether it held anything."""
        run = self.runs.pop(run_id, None)
        if run is None:
            return False
        held = run.state is not None or bool(run.kv)
        self._seq += 1
        _wake(run.state_changed)
        _wake(run.kv_changed)
        return held

    def _changed(self, run: Run) -> None:
        run.touched = time.monotonic()
        self._seq += 1

    def expire(self, ttl: float) -> int:
        """Forget runs nobody changed for ``ttl`` seconds and nobody waits on."""
        limit = time.monotonic() - ttl
        old = [rid for rid, run in self.runs.items() if run.touched < limit and run.idle]
        for run_id in old:
            self.delete(run_id)
        return len(old)

    # -- waiting --------------------------------------------------------------------------

    async def wait_state(self, run: Run, timeout: float) -> None:
        """Wait until ``run``'s state changes, the server closes, or ``timeout`` passes."""
        if run.state_changed is None:
            run.state_changed = asyncio.get_running_loop().create_future()
        await _wait(run.state_changed, timeout)

    async def wait_kv(self, run: Run, timeout: float) -> None:
        """Wait until ``run``'s keys change, the server closes, or ``timeout`` passes."""
        if run.kv_changed is None:
            run.kv_changed = asyncio.get_running_loop().create_future()
        await _wait(run.kv_changed, timeout)

    def close(self) -> None:
        """Wake every waiter: the server is shutting down."""
        self.closing = True
        for run in self.runs.values():
            _wake(run.state_changed)
            _wake(run.kv_changed)
            run.state_changed = run.kv_changed = None

    # -- persistence ----------------------------------------------------------------------

    async def durable(self) -> None:
        """Return once every change made so far is on disk (at once without a file).

        Raises:
            PersistenceError: The snapshot could not be written.
        """
        if self._path is None:
            return
        target = self._seq
        while self._durable_seq < target:
            if self._flusher is None or self._flusher.done():
                loop = asyncio.get_running_loop()
                self._flushed = loop.create_future()
                self._flusher = loop.create_task(self._flush(self._flushed))
            assert self._flushed is not None
            await asyncio.shield(self._flushed)

    async def _flush(self, done: asyncio.Future[None]) -> None:
        assert self._path is not None
        try:
            seq = self._seq
            data = self.snapshot()
            await asyncio.to_thread(_atomic_write, self._path, data)
            self._durable_seq = seq
            done.set_result(None)
        except Exception as exc:
            log.error("could not persist the rendezvous runs to %s: %s", self._path, exc)
            done.set_exception(
                PersistenceError(f"could not persist the runs to {self._path}: {exc}")
            )
            done.exception()  # retrieved: waiters get their own copy through the shield

    def snapshot(self) -> bytes:
        """Every run with state or keys, as the persistence file's JSON."""
        runs = {
            run_id: {
                "epoch": run.epoch,
                "version": run.version,
                "state": None if run.state is None else b64encode(run.state),
                "kv": {k: b64encode(v) for k, v in run.kv.items()},
            }
            for run_id, run in self.runs.items()
            if run.state is not None or run.kv
        }
        doc = {"format": _FILE_FORMAT, "version": _FILE_VERSION, "runs": runs}
        return json.dumps(doc, separators=(",", ":")).encode()

    def _load(self, path: Path) -> None:
        try:
            doc = json.loads(path.read_bytes())
            self.runs = dict(_parse_runs(doc))
        except (OSError, ValueError, RecursionError) as exc:
            raise PersistenceError(
                f"The persistence file {path} cannot be loaded ({exc}). It was left as it is: "
                "fix it, move it away, or start the server with another --persist file."
            ) from None
        log.info("loaded %d run(s) from %s", len(self.runs), path)


async def _wait(future: asyncio.Future[None], timeout: float) -> None:
    await asyncio.wait({future}, timeout=timeout)


def _parse_runs(doc: Any) -> Iterable[tuple[str, Run]]:
    if not isinstance(doc, dict) or doc.get("format") != _FILE_FORMAT:
        raise SchemaError("it is not an aelastic HTTP rendezvous runs file")
    if doc.get("version") != _FILE_VERSION:
        raise SchemaError(f"unsupported runs file version {doc.get('version')!r}")
    runs = doc.get("runs")
    if not isinstance(runs, dict):
        raise SchemaError("'runs' must be an object")
    for run_id, item in runs.items():
        require_run_id(run_id)
        if not isinstance(item, dict):
            raise SchemaError(f"run {run_id!r} must be an object")
        run = Run()
        state, kv = item.get("state"), item.get("kv")
        epoch, version = item.get("epoch"), item.get("version")
        if state is not None:
            if not isinstance(state, str):
                raise SchemaError(f"the state of run {run_id!r} must be base64 text or null")
            run.state = b64decode(state, f"state of run {run_id!r}")
            valid = type(version) is int and parse_token(f"{epoch}.{version}") is not None
            if not (isinstance(epoch, str) and isinstance(version, int) and valid):
                raise SchemaError(f"run {run_id!r} has an invalid epoch or version")
            run.epoch, run.version = epoch, version
        if not isinstance(kv, dict) or not all(isinstance(v, str) for v in kv.values()):
            raise SchemaError(f"the keys of run {run_id!r} must map to base64 text")
        run.kv = {k: b64decode(v, f"key {k!r} of run {run_id!r}") for k, v in kv.items()}
        yield run_id, run


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
