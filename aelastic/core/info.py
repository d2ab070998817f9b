"""torch's rendezvous result types: ``RendezvousStoreInfo``, ``RendezvousInfo``, and
``RendezvousTimeout`` (re-exported by :mod:`.params`, where torch's users find them).

``RendezvousStoreInfo.build`` is torch's factory: rank 0 publishes its address and a free
port in the round's store, the other ranks read them back. It talks to a store with blocking
``set`` and ``get``; the async handler publishes the same two keys itself.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar, Generic, Protocol, TypeVar

__all__ = [
    "TIMEOUT_DEFAULTS",
    "RendezvousInfo",
    "RendezvousStoreInfo",
    "RendezvousTimeout",
    "free_port",
]

#: torch's default timeouts (seconds).
TIMEOUT_DEFAULTS = {
    "join": 600.0,
    "last_call": 30.0,
    "close": 30.0,
    "heartbeat": 5.0,
}


def _positive(name: str, timeout: timedelta | None) -> timedelta:
    value = timedelta(seconds=TIMEOUT_DEFAULTS[name]) if timeout is None else timeout
    if value <= timedelta(0):
        raise ValueError(f"The {name} timeout ({value}) must be positive.")
    return value


class RendezvousTimeout:
    """torch's timeouts of a rendezvous, as ``timedelta`` (``join`` 600 s, ``last_call``
    30 s, ``close`` 30 s, ``heartbeat`` 5 s when not given).

    Raises:
        ValueError: A timeout is not positive (torch's message).
    """

    def __init__(
        self,
        join: timedelta | None = None,
        last_call: timedelta | None = None,
        close: timedelta | None = None,
        heartbeat: timedelta | None = None,
    ) -> None:
        self._join = _positive("join", join)
        self._last_call = _positive("last_call", last_call)
        self._close = _positive("close", close)
        self._heartbeat = _positive("heartbeat", heartbeat)

    def __repr__(self) -> str:
        return (
            f"RendezvousTimeout(join={self._join!r}, last_call={self._last_call!r}, "
            f"close={self._close!r}, heartbeat={self._heartbeat!r})"
        )

    @property
    def join(self) -> timedelta:
        """The time within which the rendezvous is expected to complete."""
        return self._join

    @property
    def last_call(self) -> timedelta:
        """How long to wait for more nodes once the minimum is there."""
        return self._last_call

    @property
    def close(self) -> timedelta:
        """The time within which the rendezvous is expected to close."""
        return self._close

    @property
    def heartbeat(self) -> timedelta:
        """The time within which a keep-alive heartbeat is expected to complete."""
        return self._heartbeat


class _BlockingStore(Protocol):
    def set(self, key: str, value: bytes) -> Any: ...

    def get(self, key: str) -> bytes: ...


@dataclass
class RendezvousStoreInfo:
    """Address and port that workers use to bootstrap their own communication."""

    MASTER_ADDR_KEY: ClassVar[str] = "MASTER_ADDR"
    MASTER_PORT_KEY: ClassVar[str] = "MASTER_PORT"

    master_addr: str
    master_port: int

    @classmethod
    def build(
        cls,
        rank: int,
        store: _BlockingStore,
        local_addr: str | None,
        server_port: int | None = None,
    ) -> RendezvousStoreInfo:
        """torch's factory: rank 0 publishes its address and a port in ``store``
        (``MASTER_ADDR``, ``MASTER_PORT``); every rank reads them back.

        Args:
            rank: This node's rank.
            store: A store with blocking ``set`` and ``get`` (torch's ``Store``,
                :class:`aelastic.sync.SyncStore`); the async handler publishes the two keys
                itself in the round's store.
            local_addr: Rank 0's address (default: this host's FQDN).
            server_port: The port to publish (default: a free one on this host).
        """
        if rank == 0:
            addr = local_addr or socket.getfqdn()
            port = server_port or free_port()
            store.set(cls.MASTER_ADDR_KEY, addr.encode())
            store.set(cls.MASTER_PORT_KEY, str(port).encode())
        addr = store.get(cls.MASTER_ADDR_KEY).decode()
        port = int(store.get(cls.MASTER_PORT_KEY).decode())
        return cls(addr, port)


def free_port() -> int:
    """A port free on this host now (not reserved: bind it soon)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        port: int = sock.getsockname()[1]
        return port


StoreT = TypeVar("StoreT")


class RendezvousInfo(Generic[StoreT]):
    """What a completed rendezvous gives a node: store, rank, world size, bootstrap info.

    ``store`` is the async :class:`aelastic.store.Store` from the async handler, a
    :class:`aelastic.sync.SyncStore` from the sync facade, and a ``torch.distributed.Store``
    from the torchrun plugin.
    """

    def __init__(
        self,
        store: StoreT,
        rank: int,
        world_size: int,
        bootstrap_store_info: RendezvousStoreInfo | None,
    ) -> None:
        self._store = store
        self._rank = rank
        self._world_size = world_size
        self._bootstrap_store_info = bootstrap_store_info

    @property
    def store(self) -> StoreT:
        """Store shared by the members of this round."""
        return self._store

    @property
    def rank(self) -> int:
        """Rank of this node within the group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of nodes in the group."""
        return self._world_size

    @property
    def bootstrap_store_info(self) -> RendezvousStoreInfo | None:
        """Where the workers can bootstrap their communication."""
        return self._bootstrap_store_info

    def __repr__(self) -> str:
        return (
            f"RendezvousInfo(rank={self._rank}, world_size={self._world_size}, "
            f"bootstrap_store_info={self._bootstrap_store_info!r})"
        )
