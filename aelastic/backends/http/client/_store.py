"""The members' key-value store on the HTTP server: the ``kv_*`` methods of the backend.

How it works: :class:`HttpStore` is a base of
:class:`~aelastic.backends.http.client.HttpBackend` and uses its connection (``_open``), run
path and ``read_timeout``. Each operation is one ``POST <run>/kv/<op>`` with the server's
retries (:meth:`~._transport.Connection.call`; the writes carry an ``Idempotency-Key``, so a
retried write counts once); values travel as base64 text. An ``add`` to a value that is not
an integer is answered 409 with the server's message (``ValueError``). ``kv_wait`` holds
``kv/wait`` up to :data:`~._feed.LONG_POLL` at a time, until every key exists or the timeout
passed. An answer that does not fit the API raises ``RendezvousConnectionError``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..wire import SchemaError, b64decode, b64encode
from ._feed import LONG_POLL

if TYPE_CHECKING:
    from ._feed import RunFeed
    from ._transport import Connection

__all__ = ["HttpStore"]


class HttpStore:
    """The key-value store of one run on the server (see the module docstring)."""

    _path: str
    _read_timeout: float

    if TYPE_CHECKING:

        def _open(self) -> tuple[Connection, RunFeed]: ...

    async def _kv(self, op: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        conn, _ = self._open()
        answer = await conn.call(
            "POST", f"{self._path}/kv/{op}", self._read_timeout, body=body,
            accept=frozenset({200, 409}), idempotent=op in ("get", "wait"),
        )  # fmt: skip
        assert answer is not None
        if answer[0] == 409 and op != "add":
            raise conn.protocol_error(f"409 to kv/{op}")
        return answer

    def _value(self, value: Any) -> bytes:
        if not isinstance(value, str):
            raise self._open()[0].protocol_error("a value that is not base64 text")
        try:
            return b64decode(value, "value")
        except SchemaError as exc:
            raise self._open()[0].protocol_error(str(exc)) from None

    async def kv_set(self, key: str, value: bytes) -> None:
        """Set ``key`` to ``value``."""
        await self._kv("set", {"key": key, "value": b64encode(bytes(value))})

    async def kv_get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values of ``keys`` in order, ``None`` for each missing key."""
        wanted = list(keys)
        if not wanted:
            return []
        _, doc = await self._kv("get", {"keys": wanted})
        values = doc.get("values")
        if not isinstance(values, list) or len(values) != len(wanted):
            raise self._open()[0].protocol_error("a kv/get answer without one value per key")
        return [None if v is None else self._value(v) for v in values]

    async def kv_add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer at ``key`` (missing: 0); the new value.

        Raises:
            ValueError: The stored value is not an integer, or the sum leaves the signed
                64-bit range.
        """
        status, doc = await self._kv("add", {"key": key, "amount": int(amount)})
        if status == 409:
            raise ValueError(
                str(doc.get("error") or f"The value of key {key!r} is not an integer.")
            )
        value = doc.get("value")
        if type(value) is not int:
            raise self._open()[0].protocol_error("a kv/add answer without an integer")
        return value

    async def kv_compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (``None``: if missing)."""
        body = {
            "key": key,
            "expected": None if expected is None else b64encode(bytes(expected)),
            "desired": b64encode(bytes(desired)),
        }
        _, doc = await self._kv("compare_set", body)
        return self._value(doc.get("value"))

    async def kv_delete(self, key: str) -> bool:
        """Delete ``key``; whether it existed."""
        _, doc = await self._kv("delete", {"key": key})
        return doc.get("deleted") is True

    async def kv_wait(self, keys: Sequence[str], timeout: float) -> bool:
        """Wait until every key in ``keys`` exists; ``False`` if ``timeout`` passed first."""
        wanted = list(keys)
        if not wanted:
            return True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(timeout, 0.0)
        while True:
            hold = min(max(deadline - loop.time(), 0.0), LONG_POLL)
            conn, _ = self._open()
            answer = await conn.call(
                "POST", f"{self._path}/kv/wait", self._read_timeout,
                body={"keys": wanted, "timeout": round(hold, 3)}, hold=hold,
            )  # fmt: skip
            assert answer is not None
            if answer[1].get("ready") is True:
                return True
            if loop.time() >= deadline:
                return False
