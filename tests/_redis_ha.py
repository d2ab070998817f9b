"""Redis with failover for tests: a primary, replicas and sentinels, or a small Redis Cluster.

Usage::

    from tests._redis_ha import RedisCluster, SentinelGroup

    with SentinelGroup() as ha:              # 1 primary, 1 replica, 3 sentinels, all ready
        ha.endpoint                          # "redis+sentinel://127.0.0.1:P1,...:P3/mymaster"
        old = ha.kill_primary()              # SIGKILL; returns once the sentinels switched
        ha.rejoin(old)                       # start it again: a replica of the new primary
    with SentinelGroup(password="pw", sentinel_password="spw") as ha: ...

    with RedisCluster() as cluster:          # 3 primaries with 1 replica each, slots covered
        cluster.endpoint                     # "redis+cluster://127.0.0.1:P1,..."
        cluster.fail_over("some-key")        # CLUSTER FAILOVER on the replica of its primary
        cluster.kill_primary_of("some-key")  # SIGKILL; returns once its replica took over

Every process listens on 127.0.0.1 only, keeps nothing on disk (``--save ""``), and is
killed at the end of the ``with``. Sentinels decide a primary is down after 1 s and run a
failover with a quorum of 2. Readiness is read from the processes' own logs or asked of the
servers (``ROLE``, ``CLUSTER INFO``), within generous bounds. Tests are skipped when
``redis-server`` (or ``redis-sentinel`` / ``redis-cli`` for what needs them) is missing.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from tests._redis_server import RedisServer, free_port

__all__ = ["RedisCluster", "SentinelGroup", "wait_until"]

SERVICE = "mymaster"
_READY = 30.0


def wait_until(check: Callable[[], bool], what: str, timeout: float = _READY) -> None:
    """Wait until ``check()`` holds (asked every 50 ms; errors count as "not yet")."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(redis.RedisError, OSError):
            if check():
                return
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout:g} s")


class Sentinel:
    """One ``redis-sentinel`` process on 127.0.0.1 (its config file in its own directory)."""

    def __init__(self, lines: list[str], password: str | None) -> None:
        binary = shutil.which("redis-sentinel")
        if binary is None:
            pytest.skip("redis-sentinel is not on PATH (apt-get install redis-sentinel)")
        self.binary = binary
        self.port = free_port()
        self.password = password
        self._dir = tempfile.TemporaryDirectory(prefix="aelastic-sentinel-")
        self.log_path = Path(self._dir.name) / "sentinel.log"
        self.conf = Path(self._dir.name) / "sentinel.conf"
        self._lines = lines
        self._started = False
        self._write_conf()
        self.process: subprocess.Popen[bytes] | None = None
        self._drainer: threading.Thread | None = None

    def _write_conf(self) -> None:
        head = [f"port {self.port}", "bind 127.0.0.1", f"dir {self._dir.name}"]
        self.conf.write_text("\n".join(head + self._lines) + "\n")

    def start(self) -> None:
        """Start it; returns once it monitors the primary. Another program that took its
        port meanwhile (another test run on the machine) makes it take another one."""
        for _ in range(5):
            try:
                self._start()
                self._started = True  # a restart keeps its port
                return
            except RuntimeError as exc:
                if self._started or "Address already in use" not in str(exc):
                    raise
                self.port = free_port()
                self._write_conf()
        raise RuntimeError(f"redis-sentinel did not start: {self.log()[-2000:]}")

    def _start(self) -> None:
        ready = threading.Event()
        self.process = subprocess.Popen(
            [self.binary, str(self.conf)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self._drainer = threading.Thread(target=self._drain, args=(ready,), daemon=True)
        self._drainer.start()
        if not ready.wait(_READY) or self.process.poll() is not None:
            self.kill()
            raise RuntimeError(f"redis-sentinel did not start: {self.log()[-2000:]}")

    def _drain(self, ready: threading.Event) -> None:
        assert self.process is not None and self.process.stdout is not None
        with self.process.stdout, self.log_path.open("ab") as log:
            for line in self.process.stdout:
                log.write(line)
                log.flush()
                if b"+monitor master" in line:
                    ready.set()
        ready.set()

    def log(self) -> str:
        """Its output so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def client(self) -> redis.Redis:
        """A synchronous client of this sentinel (close it after use)."""
        return redis.Redis(
            host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5.0
        )

    def kill(self) -> None:
        """SIGKILL it and wait for the exit."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if self._drainer is not None:
            self._drainer.join(5.0)
            self._drainer = None

    def close(self) -> None:
        self.kill()
        self._dir.cleanup()


class SentinelGroup:
    """A primary, ``replicas`` replicas and ``sentinels`` sentinels of one service.

    Args:
        replicas: Replicas of the primary.
        sentinels: Sentinels (the failover quorum is 2).
        password: ``requirepass`` of the data nodes (the sentinels are told it).
        sentinel_password: ``requirepass`` of the sentinels.
        extra_args: More ``redis-server`` arguments for the data nodes.
        down_after_ms: How long a primary is silent before the sentinels fail it over.
    """

    def __init__(
        self,
        replicas: int = 1,
        sentinels: int = 3,
        password: str | None = None,
        sentinel_password: str | None = None,
        extra_args: tuple[str, ...] = (),
        down_after_ms: int = 1000,
    ) -> None:
        self.password = password
        self.sentinel_password = sentinel_password
        auth = ("--masterauth", password) if password else ()
        self._args = (*auth, *extra_args)
        self.servers = [RedisServer(password=password, extra_args=self._args)]
        for _ in range(replicas):
            replica_of = ("--replicaof", "127.0.0.1", str(self.servers[0].port))
            self.servers.append(
                RedisServer(password=password, extra_args=(*self._args, *replica_of))
            )
        lines = [
            f"sentinel monitor {SERVICE} 127.0.0.1 {self.servers[0].port} 2",
            f"sentinel down-after-milliseconds {SERVICE} {down_after_ms}",
            f"sentinel failover-timeout {SERVICE} 3000",
            f"sentinel parallel-syncs {SERVICE} 1",
        ]
        if password:
            lines.append(f"sentinel auth-pass {SERVICE} {password}")
        if sentinel_password:
            lines += [
                f"requirepass {sentinel_password}",
                f"sentinel sentinel-pass {sentinel_password}",
            ]
        self.sentinels = [Sentinel(lines, sentinel_password) for _ in range(sentinels)]
        self._started = False

    @property
    def endpoint(self) -> str:
        """``redis+sentinel://127.0.0.1:P1,.../mymaster`` (no password in it)."""
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE}"

    def start(self) -> SentinelGroup:
        """Start everything; returns once the replicas are in sync and every sentinel
        knows the others and the replicas (so that a failover can happen)."""
        for server in self.servers:
            server.start()
        for replica in self.servers[1:]:
            self._wait_in_sync(replica)
        for sentinel in self.sentinels:
            sentinel.start()
        for sentinel in self.sentinels:
            self._wait_informed(sentinel)
        self._started = True
        return self

    def _wait_in_sync(self, replica: RedisServer) -> None:
        def synced() -> bool:
            with replica.client(socket_timeout=5.0) as client:
                info = client.info("replication")
            return info.get("role") == "slave" and info.get("master_link_status") == "up"

        wait_until(synced, f"replica {replica.port} in sync")

    def _wait_informed(self, sentinel: Sentinel) -> None:
        """Until ``sentinel`` knows the other sentinels, and every running replica as a
        healthy candidate for promotion."""
        primary = self.primary_port() if self._started else self.servers[0].port
        wanted = {s.port for s in self.servers if s.running and s.port != primary}

        def informed() -> bool:
            with sentinel.client() as client:
                state = client.sentinel_master(SERVICE)
                replicas = client.sentinel_slaves(SERVICE)
            healthy = {
                int(r["port"])
                for r in replicas
                if r.get("is_slave")
                and not r.get("is_sdown")
                and not r.get("is_disconnected")
                and r.get("master-link-status") == "ok"
            }
            others = int(state.get("num-other-sentinels", 0))
            return others == len(self.sentinels) - 1 and wanted <= healthy

        wait_until(informed, f"sentinel {sentinel.port} knows the others and the replicas")

    def primary_port(self) -> int:
        """The primary's port, as the first sentinel answering says."""
        for sentinel in self.sentinels:
            with contextlib.suppress(redis.RedisError), sentinel.client() as client:
                return int(client.sentinel_get_master_addr_by_name(SERVICE)[1])
        raise AssertionError("no sentinel answers")

    def primary(self) -> RedisServer:
        """The data node that is primary now."""
        port = self.primary_port()
        return next(s for s in self.servers if s.port == port)

    def kill_primary(self, timeout: float = 60.0) -> RedisServer:
        """SIGKILL the primary; returns it once a replica was promoted in its place."""
        old = self.primary()
        old.kill()

        def switched() -> bool:
            port = self.primary_port()
            if port == old.port:
                return False
            new = next(s for s in self.servers if s.port == port)
            with new.client(socket_timeout=5.0) as client:
                return bool(client.info("replication").get("role") == "master")

        wait_until(switched, "the sentinels promoted a replica", timeout)
        return old

    def rejoin(self, server: RedisServer) -> None:
        """Start ``server`` again as a replica of the primary (as a restart after the
        sentinels rewrote its configuration would); returns once it is in sync and the
        sentinels count it as a replica."""
        replica_of = ("--replicaof", "127.0.0.1", str(self.primary_port()))
        server.extra_args = (*self._args, *replica_of)
        server.start()
        self._wait_in_sync(server)
        for sentinel in self.sentinels:
            self._wait_informed(sentinel)

    def client(self) -> redis.Redis:
        """A synchronous client of the current primary (close it after use)."""
        return self.primary().client(socket_timeout=5.0)

    def close(self) -> None:
        """Kill every process and remove their directories."""
        for sentinel in self.sentinels:
            sentinel.close()
        for server in self.servers:
            server.close()

    def __enter__(self) -> SentinelGroup:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class RedisCluster:
    """A Redis Cluster of ``primaries`` primaries with ``replicas`` replicas each.

    Args:
        primaries: Primaries (the slots are spread over them).
        replicas: Replicas of each primary.
        extra_args: More ``redis-server`` arguments for every node.
    """

    def __init__(
        self, primaries: int = 3, replicas: int = 1, extra_args: tuple[str, ...] = ()
    ) -> None:
        cli = shutil.which("redis-cli")
        if cli is None:
            pytest.skip("redis-cli is not on PATH")
        self.cli = cli
        self.primaries, self.replicas = primaries, replicas
        self.servers = [self._node(extra_args) for _ in range(primaries * (1 + replicas))]

    @staticmethod
    def _node(extra_args: tuple[str, ...]) -> RedisServer:
        args = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")
        args += ("--cluster-node-timeout", "2000", "--cluster-port", str(free_port()))
        return RedisServer(extra_args=(*args, *extra_args))

    @property
    def endpoint(self) -> str:
        """``redis+cluster://`` with the first two nodes (the client finds the rest)."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.servers[:2])

    def start(self) -> RedisCluster:
        """Start the nodes and create the cluster; returns once every slot is served and
        every replica is in sync."""
        for server in self.servers:
            server.start()
        nodes = [f"127.0.0.1:{s.port}" for s in self.servers]
        replicas = ("--cluster-replicas", str(self.replicas), "--cluster-yes")
        subprocess.run(
            [self.cli, "--cluster", "create", *nodes, *replicas],
            check=True,
            capture_output=True,
            timeout=_READY,
        )
        wait_until(self._healthy, "the cluster is ok")
        return self

    def _healthy(self) -> bool:
        for server in self.servers:
            if not server.running:
                continue
            with server.client(socket_timeout=5.0) as client:
                if client.cluster("INFO").get("cluster_state") != "ok":
                    return False
                info = client.info("replication")
                if info["role"] == "slave" and info.get("master_link_status") != "up":
                    return False
        return True

    def node_of(self, key: str) -> RedisServer:
        """The primary serving ``key``'s slot (as a running node says)."""
        asked = next(s for s in self.servers if s.running)
        with asked.client(socket_timeout=5.0) as client:
            slot = client.cluster("KEYSLOT", key)
            for start, end, primary, *_ in client.cluster("SLOTS"):
                if start <= slot <= end:
                    port = int(primary[1])
                    return next(s for s in self.servers if s.port == port)
        raise AssertionError(f"no node serves {key!r}")

    def replica_of(self, primary: RedisServer) -> RedisServer:
        """A replica of ``primary``."""
        with primary.client(socket_timeout=5.0) as client:
            port = int(client.info("replication")["slave0"]["port"])
        return next(s for s in self.servers if s.port == port)

    def fail_over(self, key: str) -> tuple[RedisServer, RedisServer]:
        """``CLUSTER FAILOVER`` on the replica of ``key``'s primary; returns (old primary,
        new primary) once the cluster is ok with the new one."""
        old = self.node_of(key)
        new = self.replica_of(old)
        with new.client(socket_timeout=5.0) as client:
            client.execute_command("CLUSTER", "FAILOVER")
        wait_until(lambda: self.node_of(key) is new and self._healthy(), "the failover ended")
        return old, new

    def kill_primary_of(self, key: str, timeout: float = 60.0) -> RedisServer:
        """SIGKILL the primary of ``key``'s slot; returns it once its replica serves the
        slot and the cluster is ok again."""
        old = self.node_of(key)
        old.kill()
        wait_until(lambda: self.node_of(key) is not old and self._healthy(), "promoted", timeout)
        return old

    def close(self) -> None:
        """Kill every node and remove their directories."""
        for server in self.servers:
            server.close()

    def __enter__(self) -> RedisCluster:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
