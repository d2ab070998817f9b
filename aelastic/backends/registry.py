"""Backends by name: one row per built-in backend, third parties through entry points.

How it works: :data:`BUILTINS` holds one :class:`BackendInfo` per built-in backend (its
module, the extra that installs its dependencies, its endpoint form, whether nodes on
several machines can share it, its name under torchrun, its own config keys). The command
line, ``aelastic status``, the torchrun plugin, the benchmarks and the conformance suite
read these rows instead of listing backend names again. A backend factory takes
:class:`~aelastic.core.params.RendezvousParameters` and returns a
:class:`~aelastic.core.protocol.RendezvousBackend`; modules are imported on first use, and
a missing extra says what to install. Third-party packages register one under the entry
point group ``aelastic.backends``; :func:`register_backend` does the same at run time.

To add a built-in backend: a module (or folder) with ``create_backend(params)``, one row
here, one entry point line in ``pyproject.toml``.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.params import RendezvousParameters
from ..core.protocol import RendezvousBackend

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

__all__ = [
    "BUILTINS",
    "SETTINGS_KEYS",
    "BackendFactory",
    "BackendInfo",
    "backend_info",
    "backend_names",
    "create_backend",
    "external_names",
    "known_config_keys",
    "register_backend",
    "secret_variables",
]

BackendFactory = Callable[[RendezvousParameters], RendezvousBackend]


@dataclass(frozen=True)
class BackendInfo:
    """What the rest of aelastic knows about a built-in backend.

    Attributes:
        name: ``--rdzv-backend`` name.
        module: Module with ``create_backend(params)``.
        extra: The ``pip install 'aelastic[extra]'`` that brings its dependencies.
        endpoint_form: How its ``--rdzv-endpoint`` is written.
        multi_node: Whether nodes on several machines (processes) can share a run.
        torchrun_alias: Its name under torch's own launcher (``torchrun.handlers``).
        config_keys: Its own ``--rdzv-conf`` keys.
        aliases: Other names it answers to on aelastic's command line (torch's names).
        read_as: For a backend that a node of the job serves (torch's ``c10d`` and
            ``static``), the backend that reads its runs from another process.
        secret_env: The environment variable that gives each of its secrets instead of the
            command line (``"endpoint"``: a password in the endpoint; else a config key).
        default_endpoint: Where an empty endpoint points (``None``: an empty endpoint is
            refused). The torchrun plugin, which cannot refuse one (torchrun's default is
            empty), names it in its first progress line and in its errors.
    """

    name: str
    module: str
    extra: str | None
    endpoint_form: str
    multi_node: bool
    torchrun_alias: str
    config_keys: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    read_as: str | None = None
    secret_env: tuple[tuple[str, str], ...] = ()
    default_endpoint: str | None = None

    @property
    def external(self) -> bool:
        """Whether its store runs apart from the job's nodes (other processes can read it
        and it outlives the job): Redis, aelastic's HTTP server, etcd."""
        return self.multi_node and self.read_as is None


#: ``--rdzv-conf`` keys every backend understands (the rendezvous settings).
SETTINGS_KEYS = (
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "heartbeat_timeout",
    "keep_alive_interval",
    "keep_alive_max_attempt",
    "read_timeout",
    "is_host",
    "share_connections",
)

BUILTINS: tuple[BackendInfo, ...] = (
    BackendInfo(
        "memory",
        "aelastic.backends.memory",
        None,
        "any name (handlers of one process naming it share a run)",
        multi_node=False,
        torchrun_alias="aelastic-memory",
    ),
    BackendInfo(
        "redis",
        "aelastic.backends.redis",
        "redis",
        "redis://[user[:password]@]host[:port][/db], rediss://..., host[:port], "
        "redis+sentinel://[user[:password]@]host:port[,host:port...]/service[/db] or "
        "redis+cluster://[user[:password]@]host:port[,host:port...] (rediss+... for TLS)",
        multi_node=True,
        torchrun_alias="aelastic-redis",
        config_keys=(
            "username",
            "password",
            "sentinel_username",
            "sentinel_password",
            "wait_replicas",
            "key_ttl",
            "recheck_interval",
            "max_connections",
            "key_prefix",
            "tls",
            "ssl_ca_certs",
            "ssl_certfile",
            "ssl_keyfile",
            "ssl_cert_reqs",
        ),
        secret_env=(
            ("endpoint", "AELASTIC_REDIS_PASSWORD"),
            ("password", "AELASTIC_REDIS_PASSWORD"),
            ("sentinel_password", "AELASTIC_REDIS_SENTINEL_PASSWORD"),
        ),
        default_endpoint="localhost:6379",
    ),
    BackendInfo(
        "http",
        "aelastic.backends.http.client",
        "http",
        "host:port, http://host:port[/prefix] or https://...",
        multi_node=True,
        torchrun_alias="aelastic-http",
        config_keys=("token", "channel"),
        secret_env=(("endpoint", "AELASTIC_HTTP_TOKEN"), ("token", "AELASTIC_HTTP_TOKEN")),
    ),
    BackendInfo(
        "c10d",
        "aelastic.backends.c10d",
        "http",
        "host[:port] (port 29400): the agent on that host serves it, as torch's c10d",
        multi_node=True,
        torchrun_alias="aelastic-c10d",
        config_keys=("token", "store_type"),
        read_as="http",
        secret_env=(("endpoint", "AELASTIC_HTTP_TOKEN"), ("token", "AELASTIC_HTTP_TOKEN")),
    ),
    BackendInfo(
        "static",
        "aelastic.backends.static",
        "http",
        "master_addr:master_port: node rank 0 serves it, as torch's static",
        multi_node=True,
        torchrun_alias="aelastic-static",
        config_keys=("token", "rank"),
        read_as="http",
        secret_env=(("endpoint", "AELASTIC_HTTP_TOKEN"), ("token", "AELASTIC_HTTP_TOKEN")),
    ),
    BackendInfo(
        "etcd",
        "aelastic.backends.etcd",
        None,  # its gRPC client is its own (backends/etcd/_h2.py): no extra
        "host[:port][,host[:port]...] (port 2379; http://... or https://... members too)",
        multi_node=True,
        torchrun_alias="aelastic-etcd",
        config_keys=(
            "protocol",
            "cacert",
            "cert",
            "key",
            "etcd_prefix",
            "recheck_interval",
        ),
        aliases=("etcd-v2",),
        secret_env=(
            ("endpoint", "AELASTIC_ETCD_PASSWORD"),
            ("password", "AELASTIC_ETCD_PASSWORD"),
            ("etcd_password", "AELASTIC_ETCD_PASSWORD"),
        ),
        default_endpoint="localhost:2379",
    ),
)

_BY_NAME = {info.name: info for info in BUILTINS}

ENTRY_POINT_GROUP = "aelastic.backends"

_registry: dict[str, BackendFactory] = {}
_lock = threading.Lock()


def backend_info(name: str) -> BackendInfo | None:
    """The row of built-in backend ``name`` (or of its torchrun alias or another of its
    names), if there is one."""
    info = _BY_NAME.get(name)
    if info is None:
        info = next((i for i in BUILTINS if name == i.torchrun_alias or name in i.aliases), None)
    return info


def external_names(
    conjunction: str = "or", also: tuple[str, ...] = (), torchrun: bool = False
) -> str:
    """The built-in backends with a store of their own, for messages: ``redis, http or
    etcd``; then those named in ``also`` (``c10d``); under their torchrun names with
    ``torchrun`` (``aelastic-redis``)."""
    rows = [info for info in BUILTINS if info.external]
    rows += [info for name in also if (info := backend_info(name)) is not None]
    names = [info.torchrun_alias if torchrun else info.name for info in rows]
    return ", ".join(names[:-1]) + f" {conjunction} " + names[-1] if len(names) > 1 else names[0]


def secret_variables(name: str) -> dict[str, str]:
    """Backend ``name``'s variable for each secret (see :attr:`BackendInfo.secret_env`)."""
    info = backend_info(name)
    return dict(info.secret_env) if info is not None else {}


def known_config_keys(name: str) -> tuple[str, ...]:
    """The ``--rdzv-conf`` keys backend ``name`` understands."""
    info = backend_info(name)
    return SETTINGS_KEYS + (info.config_keys if info is not None else ())


def register_backend(name: str, factory: BackendFactory) -> None:
    """Register ``factory`` under ``name``.

    Raises:
        ValueError: ``name`` is empty or already registered with another factory.
    """
    if not name:
        raise ValueError("The rendezvous backend name must be a non-empty string.")
    with _lock:
        current = _registry.get(name)
        if current is not None and current is not factory:
            raise ValueError(
                f"The rendezvous backend '{name}' cannot be registered with '{factory}' as it "
                f"is already registered with '{current}'."
            )
        _registry[name] = factory


def _load_builtin(name: str) -> BackendFactory | None:
    info = backend_info(name)
    if info is None:
        return None
    try:
        module = importlib.import_module(info.module)
    except ImportError as exc:
        hint = f" Install it with: pip install 'aelastic[{info.extra}]'" if info.extra else ""
        raise ImportError(
            f"The '{name}' rendezvous backend needs a package that is missing ({exc.name}).{hint}"
        ) from exc
    factory: BackendFactory = module.create_backend
    return factory


def _entry_points() -> list[EntryPoint]:
    # Imported here: importlib.metadata costs ~20 ms, and built-ins never need it.
    from importlib.metadata import entry_points

    return list(entry_points(group=ENTRY_POINT_GROUP))


def _load_entry_point(name: str) -> BackendFactory | None:
    builtin_modules = {info.module for info in BUILTINS}
    for ep in _entry_points():
        if ep.name == name and ep.value.split(":")[0] not in builtin_modules:
            factory: BackendFactory = ep.load()
            return factory
    return None


def _factory(name: str) -> BackendFactory:
    with _lock:
        factory = _registry.get(name)
    if factory is None:
        factory = _load_builtin(name) or _load_entry_point(name)
        if factory is None:
            known = ", ".join(sorted(backend_names()))
            raise ValueError(
                f"The rendezvous backend '{name}' is not registered (known: {known}). "
                "Did you forget to call `register_backend` or to install its package?"
            )
        register_backend(name, factory)
    return factory


def backend_names() -> set[str]:
    """Names of the built-in, registered and entry-point backends."""
    names = set(_BY_NAME) | set(_registry)
    names.update(ep.name for ep in _entry_points())
    return names


def create_backend(params: RendezvousParameters) -> RendezvousBackend:
    """Create the backend that ``params.backend`` names.

    Raises:
        ValueError: No backend has that name, or its parameters are invalid.
        ImportError: The backend's optional dependencies are not installed.
    """
    return _factory(params.backend)(params)
