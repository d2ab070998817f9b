"""In-place recovery inside a worker: survive a peer's loss without a process restart.

How it works: an aelastic agent gives each worker the path of a Unix socket
(``AELASTIC_INPLACE_SOCKET``). A worker that opts in (:class:`InPlace`) connects and says
hello (its pid and local rank): from then on its agent keeps it running when the group
changes. Each round, :meth:`InPlace.run` (re)creates the default process group from the
round's ranks, hands the state over from a survivor to the newcomers, and calls the user's
``train(round)``. When a collective breaks (a peer is gone) or the agent says the group is
changing (:meth:`InPlace.check`), the worker tells its agent ``broken``, destroys its
process group and waits: the agent re-rendezvouses and sends the next round's ranks, world
size and master (JSON lines), or ``fail`` when no peer was lost within the heartbeat window
(then the worker's own error is raised again, and it exits as it would have). The worker
says ``joined`` once its new group and the hand-over are done, so that its agent knows it
recovered in time. Standard library only at import; torch is imported when a group is made.
Outside an aelastic agent (torchrun, a plain ``python``), :meth:`InPlace.run` makes the
group once and calls ``train`` once: errors propagate as usual.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from ._collectives import broadcast_object, first_flagged

__all__ = ["ENV_SOCKET", "ROUND_KEYS", "GroupChanged", "InPlace", "Round"]

#: The variable naming the agent's socket (set by the agent for every worker).
ENV_SOCKET = "AELASTIC_INPLACE_SOCKET"
#: The worker's variables a new round changes (the agent sends their new values).
ROUND_KEYS = (
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
#: Messages that say a collective broke because a peer is gone.
_PEER_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator",
    "aborted",
    "timed out",
    "Timed out",
)
_TORCH_DIST = os.path.join("torch", "distributed", "")
#: torch's exceptions of a broken group (by name: this module does not import torch).
_DIST_ERRORS = frozenset({"DistError", "DistBackendError", "DistNetworkError", "DistStoreError"})

_T = TypeVar("_T")

#: Set (to anything but ``0``): each step of a recovery is written to stderr with the wall
#: time (``aelastic-inplace <time> <pid> <what>``), to see where a recovery's time goes.
ENV_TRACE = "AELASTIC_INPLACE_TRACE"
_TRACING = os.environ.get(ENV_TRACE, "0") not in ("", "0")


def _trace(what: str) -> None:
    if _TRACING:
        sys.stderr.write(f"aelastic-inplace {time.time():.3f} {os.getpid()} {what}\n")
        sys.stderr.flush()


class GroupChanged(Exception):
    """The agent said that the group is changing: leave the process group (raised by
    :meth:`InPlace.check`; :meth:`InPlace.run` recovers from it)."""


@dataclass(frozen=True)
class Round:
    """One process group of the job, as this worker sees it.

    Attributes:
        number: 0 for this worker's first group, then one more for each group change it
            survived in place.
        rank: This worker's global rank.
        world_size: The number of workers.
        local_rank: This worker's local rank.
        master_addr: Where the group's store is.
        master_port: Its port.
        recovered: This process was in an earlier group (it survived a change in place).
        source: The rank the state was handed over from (``None``: no hand-over: every
            worker is new, or every one survived).
    """

    number: int
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    recovered: bool = False
    source: int | None = None


def _env_round(number: int, recovered: bool) -> Round:
    env = os.environ
    return Round(
        number=number,
        rank=int(env.get("RANK", "0")),
        world_size=int(env.get("WORLD_SIZE", "1")),
        local_rank=int(env.get("LOCAL_RANK", "0")),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(env.get("MASTER_PORT", "0")),
        recovered=recovered,
    )


class _Channel:
    """This worker's connection to its agent, read by a daemon thread."""

    def __init__(self, path: str) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.connect(path)
        except OSError:
            self._sock.close()
            raise
        self._lock = threading.Lock()
        self.rounds: queue.Queue[dict[str, Any]] = queue.Queue()
        #: The newest generation the agent said is changing (-1: none).
        self.changing = -1
        threading.Thread(target=self._read, name="aelastic-inplace", daemon=True).start()

    def send(self, **message: Any) -> None:
        data = json.dumps(message).encode() + b"\n"
        with self._lock, contextlib.suppress(OSError):
            self._sock.sendall(data)

    def _read(self) -> None:
        buffer = b""
        with contextlib.suppress(OSError):
            while chunk := self._sock.recv(65536):
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    message = json.loads(line)
                    if message.get("op") == "changing":
                        self.changing = max(self.changing, int(message.get("gen", 0)))
                    else:
                        self.rounds.put(message)
        self.rounds.put({"op": "gone"})  # the agent is gone: the worker ends as it would


def recoverable(exc: BaseException) -> bool:
    """Whether ``exc`` says that the group broke (a collective failed, or the agent said
    the group changes) rather than a fault of this worker's own code."""
    if isinstance(exc, GroupChanged):
        return True
    if not isinstance(exc, Exception):
        return False
    if any(c.__name__ in _DIST_ERRORS for c in type(exc).__mro__):
        return True
    frames = traceback.extract_tb(exc.__traceback__)
    in_torch = bool(frames) and _TORCH_DIST in frames[-1].filename
    return isinstance(exc, RuntimeError) and (
        in_torch or any(marker in str(exc) for marker in _PEER_MARKERS)
    )


class InPlace:
    """Run a training function that survives a peer's loss in place (opt-in).

    ``state`` holds what a newcomer must receive from a survivor: values with
    ``state_dict()``/``load_state_dict()`` (modules, optimizers, schedulers) are handed over
    through them, any other value (a step counter, an RNG state) is replaced. Everything the
    training needs to go on must be in it: a worker that recovers in place goes on from it,
    a newcomer receives it::

        state = {"model": model, "optimizer": optimizer, "step": 0}

        def train(round):
            while state["step"] < total_steps:
                step(state)              # collectives in it may break: recovered from
                state["step"] += 1

        InPlace(state, backend="gloo").run(train)

    Args:
        state: What is handed over (``None``: nothing, or the ``handover`` hook does it).
        backend: The process group's backend (``None``: torch's default for the device).
        timeout: The process group's timeout: a collective whose peer vanished without
            closing its connections fails after it (``None``: torch's default).
        handover: ``handover(round)`` replaces the default hand-over (a broadcast of
            ``state`` from ``round.source``, pickled as ``broadcast_object_list`` does, with
            no need of numpy); called on every
            rank when ``round.source`` is not ``None``.
        init_kwargs: More keyword arguments of ``init_process_group`` (``device_id``...).
    """

    def __init__(
        self,
        state: MutableMapping[str, Any] | None = None,
        *,
        backend: str | None = None,
        timeout: float | None = None,
        handover: Callable[[Round], None] | None = None,
        init_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.state = state
        self._backend = backend
        self._timeout = timeout
        self._handover_hook = handover
        self._init_kwargs = dict(init_kwargs or {})
        self._channel: _Channel | None = None
        self._rounds = 0
        self._number = 0
        #: The current group (``None`` before :meth:`run` made one).
        self.round: Round | None = None
        path = os.environ.get(ENV_SOCKET)
        if path:
            try:
                self._channel = _Channel(path)
            except OSError:
                self._channel = None  # no agent to talk to: plain behaviour
            else:
                local_rank = _env_round(0, False).local_rank
                self._channel.send(op="hello", pid=os.getpid(), local_rank=local_rank)

    @property
    def available(self) -> bool:
        """Whether an aelastic agent recovers this worker in place."""
        return self._channel is not None

    def check(self) -> None:
        """Raise :class:`GroupChanged` if the agent said the group is changing (call it
        between steps: the worker then leaves its group at once rather than at its next
        collective)."""
        if self._channel is not None and self._channel.changing >= self._number:
            raise GroupChanged("the agent said the group is changing")

    def run(self, train: Callable[[Round], _T]) -> _T:
        """Make the process group, hand the state over, call ``train(round)``; when the
        group breaks, wait for the next round and do it again. Returns what ``train``
        returned.

        Raises:
            BaseException: What ``train`` raised, when it is not a broken group, or when the
                agent says no peer was lost (or is gone, or does not recover in place).
        """
        while True:
            try:
                self._make_group()
                return train(self.round)  # type: ignore[arg-type]
            except BaseException as exc:
                if not recoverable(exc):
                    raise
                if self._channel is None:  # a broken group and nobody to recover it:
                    _destroy_group()  # left alive, gloo's threads may abort the exit
                    raise
                with _unwatched():  # the agent re-forms the group meanwhile: no hang
                    self._leave(exc)
                    self._wait_round(exc)

    # -- one round ------------------------------------------------------------------------

    def _make_group(self) -> None:
        import torch.distributed as dist

        recovered = self._rounds > 0
        self._rounds += 1
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        kwargs = dict(self._init_kwargs)
        if self._timeout is not None:
            kwargs["timeout"] = timedelta(seconds=self._timeout)
        _trace(f"init_process_group rank {os.environ.get('RANK')} gen {self._number}")
        dist.init_process_group(self._backend, **kwargs)
        _trace("group made")
        self.round = _env_round(self._number, recovered)
        source = self._source(dist, recovered)
        self.round = Round(**{**self.round.__dict__, "source": source})
        if source is not None:
            if self._handover_hook is not None:
                self._handover_hook(self.round)
            elif self.state is not None:
                self._broadcast_state(dist, source)
        _trace(f"state handed over (source {source})")
        if self._channel is not None:
            self._channel.send(op="joined", gen=self._number, pid=os.getpid())

    @staticmethod
    def _source(dist: Any, recovered: bool) -> int | None:
        """The lowest rank that survived an earlier group (``None``: every rank is new). A
        survivor's state goes to every other rank whenever one survived: survivors too may
        differ (one may have stepped once more before the group broke)."""
        return first_flagged(dist, recovered)

    def _broadcast_state(self, dist: Any, source: int) -> None:
        assert self.state is not None
        mine = dist.get_rank() == source
        payload = (
            {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in self.state.items()}
            if mine
            else None
        )
        received = broadcast_object(dist, payload, source)
        if mine:
            return
        for key, value in (received or {}).items():
            current: Any = self.state.get(key)
            if hasattr(current, "load_state_dict"):
                current.load_state_dict(value)
            else:
                self.state[key] = value

    # -- between rounds -------------------------------------------------------------------

    def _leave(self, exc: BaseException) -> None:
        assert self._channel is not None
        _trace(f"group broken: {type(exc).__name__}")
        self._channel.send(op="broken", pid=os.getpid(), error=str(exc)[:500], gen=self._number)
        _destroy_group()

    def _wait_round(self, error: BaseException) -> None:
        """Block until the agent sends the next round; raise ``error`` if it says fail."""
        assert self._channel is not None
        rounds = self._channel.rounds
        message = rounds.get()
        while not rounds.empty() and message.get("op") == "round":
            message = rounds.get()  # a newer round came meanwhile: only the newest counts
        if message.get("op") != "round" or int(message["gen"]) <= self._number:
            raise error  # "fail" (no peer was lost) or "gone" (the agent ended)
        _trace(f"round {message['gen']} received")
        os.environ.update({k: str(v) for k, v in message["env"].items() if k in ROUND_KEYS})
        self._number = int(message["gen"])


@contextlib.contextmanager
def _unwatched() -> Iterator[None]:
    """A phase not watched for hangs (``aelastic.worker.paused``; the bootstrap's runtime,
    when the worker has one)."""
    runtime = sys.modules.get("_aelastic_worker")
    if runtime is not None:
        runtime.pause(1)
    try:
        yield
    finally:
        if runtime is not None:
            runtime.pause(-1)


def _destroy_group() -> None:
    """Destroy the default process group, if any (a broken one may fail to: ignored)."""
    import torch.distributed as dist

    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
