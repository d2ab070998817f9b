"""Rendezvous parameters and results with torch's names and validation rules.

These mirror ``torch.distributed.elastic.rendezvous.api``: ``RendezvousParameters`` (same
``ValueError`` messages), ``RendezvousStoreInfo`` (with torch's ``build``) and
``RendezvousInfo``; and ``dynamic_rendezvous.RendezvousTimeout`` (the last three live in
:mod:`.info`, re-exported here).
``RendezvousSettings`` is the validated, typed form of the parameters; :class:`Rules` is the
part of it that the pure state machine (:mod:`.machine`) decides with, in whole milliseconds.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from .info import (
    TIMEOUT_DEFAULTS,
    RendezvousInfo,
    RendezvousStoreInfo,
    RendezvousTimeout,
    free_port,
)
from .redact import redact_endpoint

__all__ = [
    "RendezvousInfo",
    "RendezvousParameters",
    "RendezvousSettings",
    "RendezvousStoreInfo",
    "RendezvousTimeout",
    "Rules",
    "free_port",
    "parse_rendezvous_endpoint",
]


_TRUE = ("1", "true", "t", "yes", "y")
_FALSE = ("0", "false", "f", "no", "n")


class RendezvousParameters:
    """Hold the parameters to construct a rendezvous handler.

    Args:
        backend: Name of the backend (``memory``, ``redis``, ``http`` or a registered one).
        endpoint: Where the backend lives, e.g. ``redis://host:6379/0`` or ``host:port``.
        run_id: Id of the rendezvous (one per job).
        min_nodes: Minimum number of nodes to admit.
        max_nodes: Maximum number of nodes to admit.
        local_addr: Address of the local node (defaults to the FQDN).
        **kwargs: Backend and timeout configuration (``join_timeout``, ...).

    Raises:
        ValueError: The backend name is empty or the node bounds are invalid.
    """

    def __init__(
        self,
        backend: str,
        endpoint: str,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        local_addr: str | None = None,
        **kwargs: Any,
    ) -> None:
        if not backend:
            raise ValueError("The rendezvous backend name must be a non-empty string.")
        if min_nodes < 1:
            raise ValueError(
                f"The minimum number of rendezvous nodes ({min_nodes}) must be greater than zero."
            )
        if max_nodes < min_nodes:
            raise ValueError(
                f"The maximum number of rendezvous nodes ({max_nodes}) must be greater than or "
                f"equal to the minimum number of rendezvous nodes ({min_nodes})."
            )
        self.backend = backend
        self.endpoint = endpoint
        self.run_id = run_id
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        self.config: dict[str, Any] = kwargs
        self.local_addr = local_addr

    def __repr__(self) -> str:
        return (
            f"RendezvousParameters(backend={self.backend!r}, "
            f"endpoint={redact_endpoint(self.endpoint)!r}, run_id={self.run_id!r}, "
            f"min_nodes={self.min_nodes}, max_nodes={self.max_nodes})"
        )

    def get(self, key: str, default: Any = None) -> Any:
        """Return the value for ``key`` if ``key`` exists, else ``default``."""
        return self.config.get(key, default)

    def get_as_bool(self, key: str, default: bool | None = None) -> bool | None:
        """Return the value for ``key`` as a ``bool`` (1/true/t/yes/y, 0/false/f/no/n).

        Raises:
            ValueError: The value does not represent a boolean.
        """
        value = self.get(key, default)
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, int):
            if value in (0, 1):
                return value == 1
        elif isinstance(value, str):
            if value.lower() in _TRUE:
                return True
            if value.lower() in _FALSE:
                return False
        raise ValueError(
            f"The rendezvous configuration option '{key}' does not represent a valid boolean value."
        )

    def get_as_int(self, key: str, default: int | None = None) -> int | None:
        """Return the value for ``key`` as an ``int``.

        Raises:
            ValueError: The value does not represent an integer.
        """
        value = self.get(key, default)
        if value is None:
            return None
        try:
            return int(value)
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"The rendezvous configuration option '{key}' does not represent a valid integer "
                "value."
            ) from e

    def get_as_float(self, key: str, default: float | None = None) -> float | None:
        """Return the value for ``key`` as a finite ``float`` (timeouts accept fractions).

        Raises:
            ValueError: The value does not represent a finite number.
        """
        value = self.get(key, default)
        if value is None:
            return None
        try:
            number = float(value)
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"The rendezvous configuration option '{key}' does not represent a valid number."
            ) from e
        if not math.isfinite(number):
            raise ValueError(
                f"The rendezvous configuration option '{key}' must be a finite number."
            )
        return number


@dataclass(frozen=True)
class RendezvousSettings:
    """The validated settings the pure core and the handler work with (seconds)."""

    run_id: str
    min_nodes: int
    max_nodes: int
    join_timeout: float = 600.0
    last_call_timeout: float = 30.0
    close_timeout: float = 30.0
    heartbeat_timeout: float = 5.0
    keep_alive_interval: float = 5.0
    keep_alive_max_attempt: int = 3
    read_timeout: float = 60.0

    def __post_init__(self) -> None:
        if not self.run_id:
            raise ValueError("The run id must be a non-empty string.")
        if self.min_nodes < 1:
            raise ValueError(
                f"The minimum number of nodes ({self.min_nodes}) must be greater than zero."
            )
        if self.max_nodes < self.min_nodes:
            raise ValueError(
                f"The maximum number of nodes ({self.max_nodes}) must be greater than or equal "
                f"to the minimum number of nodes ({self.min_nodes})."
            )
        for name in TIMEOUT_DEFAULTS:
            value = getattr(self, f"{name}_timeout")
            if not value > 0:
                raise ValueError(f"The {name} timeout ({value}) must be positive.")
        if not self.keep_alive_interval > 0:
            raise ValueError(
                f"The keep-alive interval ({self.keep_alive_interval}) must be positive."
            )
        if self.keep_alive_max_attempt < 1:
            raise ValueError(
                f"The keep-alive max attempt ({self.keep_alive_max_attempt}) must be at least 1."
            )
        if not self.read_timeout > 0:
            raise ValueError(f"The read timeout ({self.read_timeout}) must be positive.")

    @property
    def heartbeat_window(self) -> float:
        """Seconds of silence after which a node is considered dead."""
        return self.keep_alive_interval * self.keep_alive_max_attempt

    @property
    def rules(self) -> Rules:
        """What the state machine needs of these settings."""
        return Rules(
            self.min_nodes,
            self.max_nodes,
            _ms(self.last_call_timeout),
            _ms(self.heartbeat_window),
        )

    @classmethod
    def from_parameters(cls, params: RendezvousParameters) -> RendezvousSettings:
        """Build settings from torch-style parameters.

        Raises:
            ValueError: A value is missing, malformed or out of range.
            TypeError: ``keep_alive_interval`` or ``keep_alive_max_attempt`` was passed as None.
        """
        timeouts: dict[str, float] = {}
        for name, default in TIMEOUT_DEFAULTS.items():
            value = params.get_as_float(f"{name}_timeout")
            timeouts[f"{name}_timeout"] = default if value is None else value
        for key in ("keep_alive_interval", "keep_alive_max_attempt"):
            if key in params.config and params.config[key] is None:
                raise TypeError(f"You passed '{key}=None' as a rendezvous configuration option")
        interval = params.get_as_float("keep_alive_interval", 5.0)
        attempts = params.get_as_int("keep_alive_max_attempt", 3)
        read_timeout = params.get_as_float("read_timeout", 60.0)
        assert interval is not None and attempts is not None and read_timeout is not None
        return cls(
            run_id=params.run_id,
            min_nodes=params.min_nodes,
            max_nodes=params.max_nodes,
            keep_alive_interval=interval,
            keep_alive_max_attempt=attempts,
            read_timeout=read_timeout,
            **timeouts,
        )


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


@dataclass(frozen=True)
class Rules:
    """The settings the state machine decides with (times in whole milliseconds).

    Every request carries them, so a backend that applies the machine server-side needs no
    configuration of its own.
    """

    min_nodes: int
    max_nodes: int
    last_call_ms: int
    window_ms: int


_HOST = re.compile(r"^[\w.:-]+$")
_PORT = re.compile(r"^[0-9]{1,5}$")


def parse_rendezvous_endpoint(endpoint: str | None, default_port: int) -> tuple[str, int]:
    """Host and port of a ``host[:port]`` endpoint (``[v6]:port`` for IPv6), as torch reads it.

    An empty endpoint is ``localhost``; a missing port is ``default_port``.

    Raises:
        ValueError: The port is not a number below 65536, or the host is not a name, an
            IPv4 or an IPv6 address (torch's messages).
    """
    text = (endpoint or "").strip()
    if not text:
        return "localhost", default_port
    if text.startswith("[") and text.endswith("]"):
        host, port_text = text, None
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            host, port_text = text, None
    if len(host) > 1 and host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    port = default_port
    if port_text is not None:
        if not _PORT.match(port_text) or int(port_text) >= 1 << 16:
            raise ValueError(
                f"The port number of the rendezvous endpoint '{text}' must be an integer "
                "between 0 and 65536."
            )
        port = int(port_text)
    if not _HOST.match(host):
        raise ValueError(
            f"The hostname of the rendezvous endpoint '{text}' must be a dot-separated list of "
            "labels, an IPv4 address, or an IPv6 address."
        )
    return host, port
