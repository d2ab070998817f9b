"""The ``http`` rendezvous backend: a client of the aelastic HTTP rendezvous server.

How it works: :class:`HttpBackend` implements the backend protocol over the server's API
(see :mod:`aelastic.backends.http.server`). On first use inside an event loop it takes a
reference on the loop's shared connection to the server (one aiohttp session, see
``_transport``) and on the shared channel of its run (ordered writes, shared reads and
long-polls, see ``_channel``); :meth:`HttpBackend.aclose` gives both back, and the last
backend to leave closes the session. Waiting for a change, or for keys, is a long-poll the
server answers as soon as it happens: no fixed poll. Failures that may be transient are
retried with backoff for ``read_timeout`` seconds (config key, default 60), then raise
``RendezvousConnectionError`` naming the server; a refused token (401) raises at once.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from typing import Any

from yarl import URL

from ...rendezvous.api import RendezvousParameters
from ..base import Token
from . import _transport
from ._channel import RunChannel, _segment
from .wire import TOKEN_ENV, b64encode

__all__ = ["CONFIG_KEYS", "DEFAULT_PORT", "HttpBackend", "create_backend", "parse_endpoint"]

#: The ``--rdzv-conf`` keys this backend reads, beyond the rendezvous settings (the CLI
#: warns about any other key).
CONFIG_KEYS = ("token", "share_connections")

#: Port used when the endpoint names none (torchrun's default rendezvous port).
DEFAULT_PORT = 29400


def parse_endpoint(endpoint: str) -> URL:
    """The server's base URL from ``http://host:port[/prefix]``, ``https://...`` or ``host:port``.

    Raises:
        ValueError: The endpoint is empty, has another scheme, or no valid host or port.
    """
    text = endpoint.strip()
    if not text:
        raise ValueError("The http rendezvous backend needs an endpoint (host:port or a URL).")
    bare = "://" not in text
    try:
        url = URL(f"http://{text}" if bare else text)
        port = url.port
    except ValueError as exc:
        raise ValueError(f"The rendezvous endpoint '{endpoint}' is not valid: {exc}") from None
    if url.scheme not in ("http", "https"):
        raise ValueError(
            f"The rendezvous endpoint '{endpoint}' must use http:// or https://, "
            f"not {url.scheme}://."
        )
    if not url.host or port is None:
        raise ValueError(f"The rendezvous endpoint '{endpoint}' names no host.")
    if url.query_string or url.fragment:
        raise ValueError(f"The rendezvous endpoint '{endpoint}' must not have a query.")
    if bare and not url.explicit_port:
        url = url.with_port(DEFAULT_PORT)
    return url.with_user(None).with_path(url.path.rstrip("/") or "/", encoded=True)


class HttpBackend:
    """State cell and key-value store of one run on an aelastic HTTP rendezvous server.

    Args:
        run_id: The run.
        endpoint: ``http://host:port[/prefix]``, ``https://...`` or ``host:port``.
        token: Bearer token (default: ``AELASTIC_HTTP_TOKEN`` from the environment).
        read_timeout: Seconds the server may keep failing before a call raises.

    Raises:
        ValueError: The endpoint or ``read_timeout`` is invalid.
    """

    name = "http"

    def __init__(
        self,
        run_id: str,
        endpoint: str,
        *,
        token: str | None = None,
        read_timeout: float = 60.0,
    ) -> None:
        if not read_timeout > 0:
            raise ValueError(f"The read timeout ({read_timeout}) must be positive.")
        self._base = parse_endpoint(endpoint)
        self._endpoint = str(self._base).rstrip("/")
        self._run_id = run_id
        self._token = token if token is not None else (os.environ.get(TOKEN_ENV) or None)
        self._read_timeout = float(read_timeout)
        self._channel: RunChannel | None = None
        self._closed = False

    def __repr__(self) -> str:
        return f"HttpBackend(run_id={self._run_id!r}, endpoint={self._endpoint!r})"

    @property
    def endpoint(self) -> str:
        """The server's URL (never with credentials)."""
        return self._endpoint

    @property
    def read_timeout(self) -> float:
        """Seconds the server may keep failing before a call raises."""
        return self._read_timeout

    def _open(self) -> RunChannel:
        channel = self._channel
        if channel is not None:
            if channel.conn.loop is not asyncio.get_running_loop():
                raise RuntimeError(f"{self!r} is used from another event loop than its first")
            return channel
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        conn = _transport.acquire(self._base, self._token, self._endpoint)
        channel = conn.runs.get(self._run_id)
        if channel is None:
            channel = conn.runs[self._run_id] = RunChannel(conn, self._run_id)
        channel.refs += 1
        self._channel = channel
        return channel

    # -- state cell -----------------------------------------------------------------------

    async def read(self) -> tuple[bytes | None, Token]:
        """The stored state and its token (``(None, NO_STATE)`` when there is none).

        Raises:
            RendezvousConnectionError: The server refused the request or was unreachable.
        """
        return await self._open().read(self._read_timeout)

    async def compare_and_set(self, state: bytes, token: Token) -> tuple[bool, bytes | None, Token]:
        """Store ``state`` if the stored token is ``token``.

        Returns:
            ``(written, current_state, current_token)``.

        Raises:
            RendezvousConnectionError: The server refused the request or was unreachable.
        """
        return await self._open().compare_and_set(bytes(state), token, self._read_timeout)

    async def wait_for_change(self, token: Token, timeout: float | None) -> None:
        """Return once the stored token differs from ``token``, or after ``timeout`` s.

        A long-poll (shared by the backends of this loop waiting on the same token); with
        ``timeout=None`` it waits as long as it takes.

        Raises:
            RendezvousConnectionError: The server was unreachable for ``read_timeout``.
        """
        await self._open().wait_for_change(token, timeout, self._read_timeout)

    # -- key-value store ------------------------------------------------------------------

    async def kv_set(self, key: str, value: bytes) -> None:
        """Set ``key`` to ``value``."""
        await self._kv("set", {"key": key, "value": b64encode(bytes(value))})

    async def kv_get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values of ``keys`` in order, ``None`` for each missing key."""
        return await self._open().kv_get(keys, self._read_timeout)

    async def kv_add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer at ``key`` (missing: 0); the new value.

        Raises:
            ValueError: The stored value is not an integer.
        """
        status, doc = await self._kv("add", {"key": key, "amount": int(amount)})
        if status == 409:
            raise ValueError(f"The value of key {key!r} is not an integer.")
        value = doc.get("value")
        if type(value) is not int:
            raise self._open().conn.protocol_error("a kv/add answer without an integer")
        return value

    async def kv_compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (``None``: if missing).

        Returns:
            The value stored afterwards (see the protocol).
        """
        body = {
            "key": key,
            "expected": None if expected is None else b64encode(bytes(expected)),
            "desired": b64encode(bytes(desired)),
        }
        _, doc = await self._kv("compare_set", body)
        return self._open().decode_value(doc.get("value"))

    async def kv_delete(self, key: str) -> bool:
        """Delete ``key``; whether it existed."""
        _, doc = await self._kv("delete", {"key": key})
        return doc.get("deleted") is True

    async def kv_wait(self, keys: Sequence[str], timeout: float) -> bool:
        """Wait until every key in ``keys`` exists; ``False`` if ``timeout`` passed first."""
        return await self._open().kv_wait(keys, timeout, self._read_timeout)

    async def _kv(self, op: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        status, doc = await self._open().kv_call(op, body, self._read_timeout)
        if status == 409 and op != "add":
            raise self._open().conn.protocol_error(f"409 to kv/{op}")
        return status, doc

    async def aclose(self) -> None:
        """Release this backend's share of the session and channel. Idempotent."""
        self._closed = True
        channel, self._channel = self._channel, None
        if channel is None:
            return
        channel.refs -= 1
        if channel.refs <= 0:
            if channel.conn.runs.get(self._run_id) is channel:
                del channel.conn.runs[self._run_id]
            await channel.aclose()
        await _transport.release(channel.conn)

    async def reset(self) -> bool:
        """Delete the run on the server (``DELETE /v1/runs/{run}``: state and store) so the
        id can be reused; waiting nodes are woken. Whether the run held anything.

        Raises:
            RendezvousConnectionError: The server refused the request or was unreachable.
        """
        channel = self._open()
        path = f"/v1/runs/{_segment(self._run_id)}"
        answer = await channel.conn.call("DELETE", path, self._read_timeout)
        assert answer is not None
        return answer[1].get("deleted") is True


def create_backend(params: RendezvousParameters) -> HttpBackend:
    """Create the HTTP backend for ``params.run_id`` at ``params.endpoint``.

    Config keys: ``token`` (default: ``AELASTIC_HTTP_TOKEN``), ``read_timeout`` (seconds,
    default 60).

    Raises:
        ValueError: The endpoint or a config value is invalid.
    """
    read_timeout = params.get_as_float("read_timeout", 60.0)
    assert read_timeout is not None
    token = params.get("token")
    return HttpBackend(
        params.run_id,
        params.endpoint,
        token=None if token is None else str(token),
        read_timeout=read_timeout,
    )
