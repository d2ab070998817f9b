"""The backend protocol: where the shared rendezvous state and the members' store live.

A backend serves one run (one ``run_id``) at one endpoint. It has two small surfaces:

* the **state cell**: ``read`` gives the encoded state with an opaque version token,
  ``compare_and_set`` writes it only if the token still matches (and answers with what is
  stored now, so a loser need not read again), ``wait_for_change`` returns as soon as the
  stored token differs from the one given (or the timeout passes), without a fixed poll;
* the **key-value store** the members share: ``kv_set``, ``kv_get`` (never blocks; ``None``
  for a missing key), ``kv_add``, ``kv_compare_set``, ``kv_delete``, ``kv_wait`` (until all
  keys exist). Keys are already scoped by the caller (see :class:`aelastic.store.Store`);
  the backend only namespaces them per run.

Errors: a backend that cannot be reached raises ``RendezvousConnectionError`` naming the
endpoint; a stored value that is not what the backend wrote raises ``RendezvousStateError``.
Bytes in, bytes out: the backend never interprets the state (that is the codec's job).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

__all__ = ["NO_STATE", "KeyValueBackend", "RendezvousBackend", "Token"]

#: An opaque version of the stored state; tokens compare with ``==`` only.
Token = str

#: The token of "no state stored yet"; ``compare_and_set(data, NO_STATE)`` creates the state.
NO_STATE: Token = ""


@runtime_checkable
class KeyValueBackend(Protocol):
    """Primitive key-value operations of a backend (non-blocking except ``kv_wait``)."""

    async def kv_set(self, key: str, value: bytes) -> None:
        """Set ``key`` to ``value``."""

    async def kv_get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values of ``keys`` in order, ``None`` for each missing key."""

    async def kv_add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer at ``key`` (missing: 0) and return the new value.

        Raises:
            ValueError: The stored value is not an integer.
        """

    async def kv_compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (``None``: if it is missing).

        Returns:
            The value stored afterwards (``desired`` on success, the current value otherwise;
            ``expected`` or ``b""`` when the key is missing and was not set, as torch's).
        """

    async def kv_delete(self, key: str) -> bool:
        """Delete ``key``; whether it existed."""

    async def kv_wait(self, keys: Sequence[str], timeout: float) -> bool:
        """Wait until every key in ``keys`` exists; ``False`` if ``timeout`` passed first."""


@runtime_checkable
class RendezvousBackend(KeyValueBackend, Protocol):
    """The state cell and key-value store of one run on one backend."""

    @property
    def name(self) -> str:
        """The backend's name (``memory``, ``redis``, ``http``)."""

    @property
    def endpoint(self) -> str:
        """Where the backend is, for error messages (no credentials)."""

    async def read(self) -> tuple[bytes | None, Token]:
        """The stored state and its token (``(None, NO_STATE)`` when there is none)."""

    async def compare_and_set(self, state: bytes, token: Token) -> tuple[bool, bytes | None, Token]:
        """Store ``state`` if the stored token is ``token``.

        Returns:
            ``(written, current_state, current_token)``: on success the state just written
            and its new token; otherwise what is stored now.
        """

    async def wait_for_change(self, token: Token, timeout: float) -> None:
        """Return once the stored token differs from ``token``, or after ``timeout`` seconds.

        May return early (spuriously); callers re-read. Never polls on a fixed period
        shorter than a safety-net re-read.
        """

    async def aclose(self) -> None:
        """Release connections and background tasks. Idempotent."""
