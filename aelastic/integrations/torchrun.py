"""torchrun plugin: aelastic's rendezvous behind torch's own elastic agent.

How it works: torch loads the entry points of the ``torchrun.handlers`` group while
``torch.distributed.elastic.rendezvous`` is being imported, and calls each with no argument;
:func:`handler_entry` (and the older per-backend names) return :func:`create_handler`, which
torch later calls with its ``RendezvousParameters`` for ``--rdzv-backend aelastic-<name>``
(every row of the backend registry: ``aelastic-redis``, ``aelastic-etcd``...). Torch is
imported only then (never at module import: torch is half-imported when the entry points
load).

The handler drives aelastic's blocking facade (:mod:`aelastic.sync`), and answers with torch's
types: torch's ``RendezvousInfo`` whose ``store`` is a ``torch.distributed.Store`` subclass over
aelastic's store of the round (torch's agent assigns ranks and runs its exit barrier on it), and
whose ``bootstrap_store_info`` says where the workers' store is. As torch does by default, group
rank 0 hosts a multi-tenant ``TCPStore`` for the workers (a fresh one per round, so no key of an
earlier round survives) and workers connect to it (``TORCHELASTIC_USE_AGENT_STORE=True``); with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` rank 0 only picks a free port and worker rank 0 hosts it.

One improvement over torch's handler, behind the same method: ``num_nodes_waiting()`` also
answers 1 when a member of the round left or stopped sending heartbeats, so that torch's agent
(which polls it) stops its workers and re-rendezvous with the survivors instead of running on
with a stale world. Set ``--rdzv-conf rescale_on_member_loss=false`` for torch's behaviour.
Errors are raised as torch's exception types (``RendezvousClosedError``, ``DistStoreError``...).

torch's agent says nothing while the rendezvous waits: the handler's progress lines (those
``aelastic run`` prints: waiting for nodes, for the job id, for a store it cannot reach) are
logged as warnings of ``aelastic.torchrun``, which torch's logging defaults show on stderr.
An empty endpoint (torchrun's default) that the backend fills in (Redis: ``localhost:6379``)
is named in the first of them and in connection errors; a job on a store with torch's
default id, ``none``, is warned about (every job given no id shares it).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

from .. import rendezvous as aapi
from .. import sync
from ..backends.registry import BUILTINS, backend_info, external_names, secret_variables
from ..cli.progress import Progress, default_endpoint_note
from ..core.redact import exposed_secrets, redact
from ..core.view import MembershipView

__all__ = [
    "BACKENDS",
    "c10d_handler",
    "create_handler",
    "handler_entry",
    "http_handler",
    "memory_handler",
    "redis_handler",
    "static_handler",
]

log = logging.getLogger("aelastic.torchrun")

#: torchrun backend name -> aelastic backend name (from the backend registry's rows).
BACKENDS = {info.torchrun_alias: info.name for info in BUILTINS}

#: Keys (in the round's store) where group rank 0 publishes the workers' TCPStore.
_STORE_ADDR_KEY = "torchrun/tcp_store_addr"
_STORE_PORT_KEY = "torchrun/tcp_store_port"

Creator = Callable[[Any], Any]


def handler_entry() -> Creator:
    """The entry point of any backend's row (``aelastic-<name>``, e.g. ``aelastic-etcd``):
    a new backend needs no function of its own here."""
    return create_handler


def memory_handler() -> Creator:
    """Entry point ``aelastic-memory`` (one node per process only: the state lives in memory)."""
    return create_handler


def redis_handler() -> Creator:
    """Entry point ``aelastic-redis``: ``--rdzv-endpoint redis://host:port/db``."""
    return create_handler


def http_handler() -> Creator:
    """Entry point ``aelastic-http``: ``--rdzv-endpoint host:port`` of ``aelastic serve``."""
    return create_handler


def c10d_handler() -> Creator:
    """Entry point ``aelastic-c10d``: ``--rdzv-endpoint host[:port]``, hosted by a node."""
    return create_handler


def static_handler() -> Creator:
    """Entry point ``aelastic-static``: ``master_addr:master_port``, hosted by node rank 0."""
    return create_handler


def _share_tcp_store() -> bool:
    return os.getenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0") != "1"


@contextlib.contextmanager
def _torch_errors(note: str | None = None) -> Iterator[None]:
    """Re-raise aelastic's errors as torch's types of the same name; a connection error or
    a timeout ends with ``note`` (the endpoint taken by default), if any."""
    from torch.distributed import DistStoreError
    from torch.distributed.elastic.rendezvous import api as tapi

    try:
        yield
    except aapi.StoreTimeoutError as exc:
        raise DistStoreError(str(exc)) from exc
    except aapi.RendezvousError as exc:
        cls = getattr(tapi, type(exc).__name__, tapi.RendezvousError)
        said = str(exc)
        if note and isinstance(exc, aapi.RendezvousConnectionError | aapi.RendezvousTimeoutError):
            said = f"{said} ({note})"
        raise cls(said) from exc


def _default_endpoint_note(name: str, endpoint: str) -> str | None:
    """What to say when no endpoint was given and the backend took its default."""
    info = backend_info(BACKENDS[name])
    if endpoint.strip() or info is None or info.default_endpoint is None:
        return None
    return default_endpoint_note(info.default_endpoint, ["--rdzv-endpoint", "PET_RDZV_ENDPOINT"])


def _progress_line(text: str) -> None:
    """One progress line of the handler (the lines ``aelastic run`` prints), logged: with
    torch's logging defaults (no handler, warnings shown) it goes to stderr as it is."""
    log.warning("[aelastic] %s", redact(text))


def _seconds(timeout: timedelta | float | None) -> float | None:
    if timeout is None:
        return None
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


@functools.cache
def _classes() -> tuple[type[Any], type[Any]]:
    """Build the torch subclasses (torch is imported here, on first use)."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import api as tapi

    class AelasticStore(dist.Store):  # type: ignore[misc]
        """A ``torch.distributed.Store`` over aelastic's store of one rendezvous round."""

        def __init__(self, store: sync.SyncStore, timeout: timedelta | None = None) -> None:
            super().__init__()  # the pybind trampoline needs it
            self._store = store.async_store
            self.set_timeout(timeout or timedelta(seconds=self._store.timeout))

        def set_timeout(self, timeout: timedelta) -> None:
            super().set_timeout(timeout)
            self._store.timeout = timeout.total_seconds()

        def _limit(self, timeout: timedelta | float | None) -> float:
            seconds = _seconds(timeout)
            return self._store.timeout if seconds is None else seconds

        def set(self, key: str, value: bytes | str) -> None:
            with _torch_errors():
                sync.run(self._store.set(key, value))

        def get(self, key: str) -> bytes:
            with _torch_errors():
                return sync.run(self._store.get(key, self._limit(None)))

        def add(self, key: str, amount: int) -> int:
            with _torch_errors():
                return sync.run(self._store.add(key, int(amount)))

        def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
            with _torch_errors():
                return sync.run(self._store.compare_set(key, expected, desired))

        def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
            with _torch_errors():
                sync.run(self._store.wait(list(keys), self._limit(timeout)))

        def check(self, keys: Sequence[str]) -> bool:
            with _torch_errors():
                return sync.run(self._store.check(list(keys)))

        def multi_get(self, keys: Sequence[str]) -> list[bytes]:
            with _torch_errors():
                return sync.run(self._store.multi_get(list(keys), self._limit(None)))

        def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
            with _torch_errors():
                sync.run(self._store.multi_set(list(keys), list(values)))

        def delete_key(self, key: str) -> bool:
            with _torch_errors():
                return sync.run(self._store.delete_key(key))

        def num_keys(self) -> int:
            raise NotImplementedError("aelastic's store does not count its keys")

    class AelasticRendezvousHandler(tapi.RendezvousHandler):  # type: ignore[misc]
        """torch's ``RendezvousHandler`` over aelastic's rendezvous (see the module doc)."""

        def __init__(
            self,
            name: str,
            handler: sync.SyncRendezvousHandler,
            rescale_on_member_loss: bool,
            note: str | None = None,
        ) -> None:
            self._name = name
            self._handler = handler
            self._rescale_on_member_loss = rescale_on_member_loss
            self._note = note
            self._watch: Any = None  # asyncio.Task[MembershipView] on aelastic's loop
            self._tcp_store: Any = None

        def __repr__(self) -> str:
            return f"AelasticRendezvousHandler({self._name!r}, {self._handler!r})"

        @property
        def use_agent_store(self) -> bool:
            return _share_tcp_store()

        def get_backend(self) -> str:
            return self._name

        def get_run_id(self) -> str:
            return self._handler.get_run_id()

        def next_rendezvous(self) -> Any:
            self._stop_watch()
            self._tcp_store = None  # the workers of the last round are gone: drop their store
            with _torch_errors(self._note):
                info = self._handler.next_rendezvous()
                store = AelasticStore(info.store)
                bootstrap = info.bootstrap_store_info
                if _share_tcp_store():
                    addr, port = self._host_tcp_store(info.rank, info.store)
                elif bootstrap is not None:
                    addr, port = bootstrap.master_addr, bootstrap.master_port
                else:  # pragma: no cover - aelastic's handler always bootstraps
                    raise aapi.RendezvousStateError("the round has no bootstrap address")
            if self._rescale_on_member_loss:
                self._start_watch()
            return tapi.RendezvousInfo(
                store, info.rank, info.world_size, tapi.RendezvousStoreInfo(addr, port)
            )

        def _host_tcp_store(self, rank: int, store: sync.SyncStore) -> tuple[str, int]:
            if rank == 0:
                addr = self._handler.async_handler.node.addr
                self._tcp_store = dist.TCPStore(
                    host_name=addr,
                    port=0,
                    is_master=True,
                    multi_tenant=True,
                    wait_for_workers=False,
                )
                port = str(self._tcp_store.port)
                store.multi_set([_STORE_ADDR_KEY, _STORE_PORT_KEY], [addr, port])
            addr_b, port_b = sync.run(
                store.async_store.multi_get([_STORE_ADDR_KEY, _STORE_PORT_KEY])
            )
            return addr_b.decode(), int(port_b)

        def is_closed(self) -> bool:
            with _torch_errors(self._note):
                return self._handler.is_closed()

        def set_closed(self) -> None:
            with _torch_errors(self._note):
                self._handler.set_closed()

        def num_nodes_waiting(self) -> int:
            # torch's agent asks this every monitor interval. While the round's watch runs
            # (it returns on any change of the group) nothing changed: answer without
            # asking the backend.
            watch = self._watch
            if watch is not None and not watch.done():
                return 0
            if watch is not None and not watch.cancelled():
                view = watch.exception() or watch.result()
                if isinstance(view, MembershipView):
                    if view.lost or view.lost_count or view.removed:
                        return max(view.waiting, 1)
                    if view.waiting:
                        return view.waiting
            with _torch_errors(self._note):
                return self._handler.num_nodes_waiting()

        def shutdown(self) -> bool:
            self._stop_watch()
            self._tcp_store = None
            with _torch_errors(self._note):
                return self._handler.shutdown()

        def _start_watch(self) -> None:
            handler = self._handler.async_handler

            async def spawn() -> Any:
                import asyncio

                return asyncio.get_running_loop().create_task(handler.watch())

            self._watch = sync.run(spawn())

        def _stop_watch(self) -> None:
            watch, self._watch = self._watch, None
            if watch is None:
                return

            async def cancel() -> None:
                import asyncio

                watch.cancel()
                with contextlib.suppress(BaseException):
                    await asyncio.wait({watch})

            sync.run(cancel())

    return AelasticStore, AelasticRendezvousHandler


def create_handler(params: Any) -> Any:
    """Create torch's handler for torch's ``RendezvousParameters``.

    Args:
        params: torch's parameters; ``params.backend`` is ``aelastic-memory``,
            ``aelastic-redis`` or ``aelastic-http``; ``params.config`` holds the
            ``--rdzv-conf`` keys (``join_timeout``, ``last_call_timeout``, ...).

    Returns:
        A ``torch.distributed.elastic.rendezvous.RendezvousHandler`` whose
        ``get_backend()`` is ``params.backend``.

    Raises:
        ValueError: Unknown backend name or invalid parameters.
        ImportError: The backend's optional dependencies are missing.
    """
    name = params.backend
    if name not in BACKENDS:
        raise ValueError(f"aelastic has no torchrun backend '{name}' (known: {sorted(BACKENDS)})")
    info = backend_info(BACKENDS[name])
    if info is not None and not info.multi_node and params.min_nodes > 1:
        # `aelastic run` refuses this; here handlers of one process (torch's registry called
        # in process) can still meet, so it is said, not refused: a torchrun of its own would
        # otherwise wait alone, silently, until its join timeout.
        log.warning(
            "the %s rendezvous lives in this process: nodes of other processes cannot join "
            "it, and it waits for %d nodes (use %s)",
            name,
            params.min_nodes,
            external_names(also=("c10d",), torchrun=True),
        )
    config = dict(params.config)
    for line in exposed_secrets(params.endpoint, config, sys.orig_argv, secret_variables(name)):
        log.warning(line)
    rescale = aapi.RendezvousParameters(name, "", "-", 1, 1, **config).get_as_bool(
        "rescale_on_member_loss", True
    )
    for key in ("rescale_on_member_loss", "timeout"):  # ours, and torch's legacy key
        config.pop(key, None)
    aparams = aapi.RendezvousParameters(
        backend=BACKENDS[name],
        endpoint=params.endpoint,
        run_id=params.run_id,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        local_addr=params.local_addr,
        **config,
    )
    if info is not None and info.external and params.run_id == "none":
        log.warning(
            "[aelastic] the job id is 'none', torch's default: every job started on this "
            "store without an id of its own (--rdzv-id, PET_RDZV_ID) shares it, and one "
            "started right after another waits for it; give each job its own id"
        )
    note = _default_endpoint_note(name, params.endpoint or "")
    handler = sync.create_handler(aparams)
    # What `aelastic run` prints while the rendezvous waits (for nodes, the job id, the
    # store), logged: torch's agent says nothing while it waits.
    handler.async_handler.add_listener(Progress(_progress_line, note=note))
    _, handler_cls = _classes()
    return handler_cls(name, handler, bool(rescale), note)
