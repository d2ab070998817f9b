"""The key-value store that the members of a rendezvous round share.

A thin layer over a backend's primitive key-value operations (see
:class:`aelastic.backends.base.KeyValueBackend`) that adds what torch's ``Store`` users
expect: a key prefix per run and round, blocking ``get``/``wait``/``multi_get`` with a
timeout, ``str`` or ``bytes`` values. Waiting is done by the backend (woken by the change),
never by polling here.
"""

from __future__ import annotations

from collections.abc import Sequence

from .errors import StoreTimeoutError
from .protocol import KeyValueBackend

__all__ = ["DEFAULT_STORE_TIMEOUT", "Store"]

#: Default seconds a blocking store call waits for its keys (torch's default is 300).
DEFAULT_STORE_TIMEOUT = 300.0


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class Store:
    """An async key-value store scoped by ``prefix``.

    Args:
        backend: Where the keys live.
        prefix: Prepended to every key (``"r3/"`` for round 3 of a run, say).
        timeout: Default seconds for blocking calls.
    """

    def __init__(
        self, backend: KeyValueBackend, prefix: str = "", timeout: float = DEFAULT_STORE_TIMEOUT
    ) -> None:
        self._backend = backend
        self._prefix = prefix
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"Store(prefix={self._prefix!r}, backend={self._backend!r})"

    @property
    def prefix(self) -> str:
        """The prefix of every key of this store."""
        return self._prefix

    def scoped(self, prefix: str) -> Store:
        """A store whose keys live under ``prefix`` inside this one."""
        return Store(self._backend, self._prefix + prefix, self.timeout)

    def _key(self, key: str) -> str:
        return self._prefix + key

    async def set(self, key: str, value: bytes | str) -> None:
        """Set ``key`` to ``value``."""
        await self._backend.kv_set(self._key(key), _bytes(value))

    async def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
        """Set each of ``keys`` to the matching value."""
        if len(keys) != len(values):
            raise ValueError("multi_set needs as many values as keys")
        for key, value in zip(keys, values, strict=False):
            await self.set(key, value)

    async def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting until it exists.

        Raises:
            StoreTimeoutError: ``key`` did not appear within the timeout.
        """
        return (await self.multi_get([key], timeout))[0]

    async def try_get(self, key: str) -> bytes | None:
        """The value of ``key``, or ``None`` at once when it is missing."""
        return (await self._backend.kv_get([self._key(key)]))[0]

    async def multi_get(self, keys: Sequence[str], timeout: float | None = None) -> list[bytes]:
        """The values of ``keys``, waiting until all exist.

        Raises:
            StoreTimeoutError: Not every key appeared within the timeout.
        """
        full = [self._key(k) for k in keys]
        values = await self._backend.kv_get(full)
        if any(v is None for v in values):
            await self._wait_full(full, timeout)
            values = await self._backend.kv_get(full)
        if any(v is None for v in values):  # deleted in between
            missing = [k for k, v in zip(keys, values, strict=False) if v is None]
            raise StoreTimeoutError(f"keys {missing} vanished while being read")
        return [v for v in values if v is not None]

    async def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer at ``key`` (missing: 0); the new value."""
        return await self._backend.kv_add(self._key(key), amount)

    async def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (torch's semantics).

        An empty ``expected`` matches a missing key. Returns the value stored afterwards
        (or ``expected`` when the key is missing and was not set).
        """
        want = _bytes(expected)
        return await self._backend.kv_compare_set(
            self._key(key), want if want else None, _bytes(desired)
        )

    async def delete_key(self, key: str) -> bool:
        """Delete ``key``; whether it existed."""
        return await self._backend.kv_delete(self._key(key))

    async def check(self, keys: Sequence[str]) -> bool:
        """Whether every key in ``keys`` exists (does not wait)."""
        values = await self._backend.kv_get([self._key(k) for k in keys])
        return all(v is not None for v in values)

    async def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        """Wait until every key in ``keys`` exists.

        Raises:
            StoreTimeoutError: Not every key appeared within the timeout.
        """
        await self._wait_full([self._key(k) for k in keys], timeout)

    async def _wait_full(self, full_keys: Sequence[str], timeout: float | None) -> None:
        limit = self.timeout if timeout is None else timeout
        if not await self._backend.kv_wait(full_keys, limit):
            shown = [k[len(self._prefix) :] for k in full_keys]
            raise StoreTimeoutError(f"timed out after {limit:g} s waiting for keys {shown}")
