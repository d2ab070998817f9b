"""The backend protocol: where a run's rendezvous state and the members' store live.

A backend serves one run (one ``run_id``) at one endpoint. It has two small surfaces:

* the **rendezvous**: ``apply`` carries out one node's :class:`~.state.Request` atomically
  with the state machine's semantics (:func:`.machine.step`; in-process backends call it,
  Redis runs its Lua port) and answers with a constant-size :class:`~.state.Reply`;
  ``wait_for_change`` returns the run's :class:`~.state.Status` as soon as its token differs
  from the one given (round transitions only, never heartbeats), without a fixed poll;
  ``snapshot`` reads the whole membership (for operators); ``close_run`` closes the run
  for its operator (a node closes it with a request carrying its secret); ``reset``
  deletes the run;
  a backend that can also name the other runs at its endpoint is a :class:`RunLister`
  (``aelastic status --list``, the dashboard);
* the **key-value store** the members share: ``kv_set``, ``kv_get`` (never blocks; ``None``
  for a missing key), ``kv_add``, ``kv_compare_set``, ``kv_delete``, ``kv_wait`` (until all
  keys exist). Keys are already scoped by the caller (see :class:`.store.Store`); the
  backend only namespaces them per run.

Errors: a backend that cannot be reached raises ``RendezvousConnectionError`` naming the
endpoint (never a credential); a stored value that is not what this version of aelastic
wrote raises ``RendezvousStateError`` and is left as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from .health import JobHealth
from .state import NodeDesc, Reply, Request, Snapshot, Status
from .token import NO_STATE, Token

__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "NO_STATE",
    "DepartureReporter",
    "KeyValueBackend",
    "RendezvousBackend",
    "RunLister",
    "Token",
]

#: Bounds of a store counter (torch's ``Store.add`` works on signed 64-bit integers).
INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1


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
            ValueError: The stored value is not an integer, or the sum leaves the signed
                64-bit range (the value is then unchanged).
        """

    async def kv_compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (``None``: if it is missing).

        Returns:
            The value stored afterwards (``desired`` on success, the current value otherwise;
            ``expected`` when the key is missing and was not set, as torch's).
        """

    async def kv_delete(self, key: str) -> bool:
        """Delete ``key``; whether it existed."""

    async def kv_wait(self, keys: Sequence[str], timeout: float) -> bool:
        """Wait until every key in ``keys`` exists; ``False`` if ``timeout`` passed first."""


@runtime_checkable
class RendezvousBackend(KeyValueBackend, Protocol):
    """The rendezvous state and key-value store of one run on one backend."""

    @property
    def name(self) -> str:
        """The backend's name (``memory``, ``redis``, ``http``)."""

    @property
    def endpoint(self) -> str:
        """Where the backend is, for messages (never with credentials)."""

    async def apply(self, request: Request, hold: float = 0.0, seen: Token | None = None) -> Reply:
        """Carry out ``request`` atomically and answer.

        A backend whose server can wait (HTTP) may, when the outcome is *wait*, hold the
        answer up to ``hold`` seconds until the status changes (or the reply's ``wake_at``)
        and carry out the request again before answering; one with a true class attribute
        ``holds_keep_alive`` also holds a keep-alive until the status changes, but answers
        it at once when the status is already past ``seen`` (the token the caller knows:
        the news is in this answer). Others answer at once.

        Raises:
            RendezvousConnectionError: The backend could not be reached.
            RendezvousStateError: The stored state is foreign, corrupt or of another version.
        """

    async def wait_for_change(self, token: Token, timeout: float | None) -> Status | None:
        """The run's status once its token differs from ``token``.

        Returns:
            The new status (it may be returned spuriously with the same token: callers
            compare), or ``None`` when ``timeout`` seconds passed first.
        """

    async def snapshot(self) -> Snapshot | None:
        """The whole membership, or ``None`` when the run has no state."""

    async def health(self) -> JobHealth | None:
        """The job's health as the run keeps it (:mod:`.health`), or ``None`` when the run
        has no state. Only the state machine changes it (a member's report of itself, a
        member dropped for its silence): it is never stored where a store client writes."""

    async def close_run(self) -> bool:
        """Close the run as its operator (``aelastic status --close``): later joins fail
        with ``RendezvousClosedError``. The backend applies
        :meth:`~.state.Request.operator_close` only for a caller it trusts as the operator
        (HTTP: the server's token, or its own machine when it has none; Redis: its
        credentials).

        Returns:
            Whether the run was open (a run with no state, or closed already: ``False``).

        Raises:
            RendezvousConnectionError: The backend could not be reached, or refused.
        """

    async def reset(self) -> bool:
        """Delete the run's state and store; whether there was anything."""

    async def aclose(self) -> None:
        """Release connections and background tasks. Idempotent."""


@runtime_checkable
class RunLister(Protocol):
    """A backend that can name the runs at its endpoint (``aelastic status --list``, pages)."""

    async def list_runs(self, limit: int) -> list[tuple[str, Status]]:
        """The runs with a rendezvous state at this backend's endpoint, and their statuses.

        Args:
            limit: Runs returned at most (ask one more to learn whether there are more).

        Returns:
            ``(run id, status)`` pairs sorted by run id.

        Raises:
            RendezvousConnectionError: The backend could not be reached.
        """


@runtime_checkable
class DepartureReporter(Protocol):
    """A backend that can act, when a member's workers' collective broke, on the members
    whose connections ended (Redis: their named connections are gone from the server's
    client list, reported as departures, :meth:`~.state.Request.departure`; HTTP: the
    server saw their channels end and is told to confirm them). The machine decides."""

    async def report_departures(self, me: NodeDesc) -> int:
        """Report the members (``me`` excepted) whose connection ended; once the machine's
        grace has passed, apply the reports again.

        Returns:
            How many members these reports made lost.

        Raises:
            RendezvousConnectionError: The backend could not be reached.
        """
