"""A real ``redis-server`` for tests, on a free loopback port.

Usage::

    from tests._redis_server import RedisServer, redis_server_fixture

    with RedisServer() as server:            # started, answering PING
        server.url                           # "redis://127.0.0.1:PORT/0" (no password in it)
        server.stop()                        # SIGTERM, waits for the exit
        server.start()                       # again, same port, empty (no persistence)
        server.kill()                        # SIGKILL, waits for the exit
        server.start()
        server.client()                      # a sync redis.Redis for poking at keys (close it)
    # stopped here

    RedisServer(password="s3cret")           # --requirepass; url stays without the password
    RedisServer(tls=True)                    # rediss:// only; server.ca_file is its certificate
    RedisServer(host="127.0.0.2")            # another loopback address (as another machine's)

    # in a test module or conftest: a fixture (scope "module" by default) yielding a started
    # server, killed at the end of the scope; a test that stops it must start it again
    # (fault tests are simpler with their own ``with RedisServer() as server:``).
    redis_server = redis_server_fixture()
    redis_server_with_password = redis_server_fixture(password="s3cret")

The server runs with ``--save "" --appendonly no`` (nothing on disk: a restart is empty) and
``--bind 127.0.0.1`` (or ``host``); its log goes to a file in a temporary directory that
``start`` errors quote. ``start`` returns once the server logs that it is ready and answers
PING (no polling). Tests are skipped (not failed) when ``redis-server`` is not on PATH.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests._ports import free_port

__all__ = ["RedisServer", "free_port", "redis_server_fixture"]

#: Ports tried by a first start whose port another program took meanwhile.
_PORT_TRIES = 5
_START_TIMEOUT = 20.0


class RedisServer:
    """A ``redis-server`` process on 127.0.0.1 (or ``host``).

    Args:
        password: Start with ``--requirepass`` (clients must authenticate).
        port: Port to use (default: a free one, kept across restarts).
        extra_args: More ``redis-server`` arguments.
        tls: Serve TLS only, with a fresh self-signed certificate for 127.0.0.1
            (:attr:`ca_file`); the url is then ``rediss://``.
        host: The loopback address it listens on (``127.0.0.2``: not ``localhost``, as a
            server on another machine).
    """

    def __init__(
        self,
        password: str | None = None,
        port: int | None = None,
        extra_args: tuple[str, ...] = (),
        tls: bool = False,
        host: str = "127.0.0.1",
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not on PATH")
        self.binary = binary
        self.password = password
        self.host = host
        self.port = port or free_port()
        #: Whether another port may be taken when this one turns out to be in use.
        self._may_move = port is None
        self.extra_args = extra_args
        self.process: subprocess.Popen[bytes] | None = None
        self._drainer: threading.Thread | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="aelastic-redis-")
        self.log_path = Path(self._dir.name) / "redis.log"
        self.tls = tls
        self.ca_file = Path(self._dir.name) / "cert.pem"
        self._key_file = Path(self._dir.name) / "key.pem"
        if tls:
            self._make_certificate()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"RedisServer(port={self.port}, {state})"

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0`` (``rediss://`` with TLS; never the password)."""
        return f"{'rediss' if self.tls else 'redis'}://{self.host}:{self.port}/0"

    def _make_certificate(self) -> None:
        openssl = shutil.which("openssl")
        if openssl is None:
            pytest.skip("openssl is not on PATH")
        args = [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
        args += ["-keyout", str(self._key_file), "-out", str(self.ca_file)]
        args += ["-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"]
        subprocess.run(args, check=True, capture_output=True)

    @property
    def running(self) -> bool:
        """Whether the process is alive."""
        return self.process is not None and self.process.poll() is None

    def start(self) -> RedisServer:
        """Start the server (on the same port as before) and wait until it answers.

        Raises:
            RuntimeError: It exited or did not answer within 20 s (the log is quoted).
        """
        if self.running:
            return self
        for _ in range(_PORT_TRIES):
            if self._spawn():
                break
            # Another program took the port between its pick and the bind (another test
            # run on the machine): the first start takes another one.
            self.port = free_port()
        else:
            raise RuntimeError(f"redis-server did not start: {self._log_tail()}")
        self._may_move = False  # started: a restart keeps its port
        # (RESP2: a server may be started without HELLO, as before Redis 6)
        client = self.client(socket_timeout=5.0, socket_connect_timeout=5.0, protocol=2)
        try:
            client.ping()
        finally:
            client.close()
        return self

    def _spawn(self) -> bool:
        """Start the process; ``False`` if its port was in use and another may be taken."""
        args = [self.binary, "--bind", self.host]
        if self.tls:
            args += ["--port", "0", "--tls-port", str(self.port), "--tls-auth-clients", "no"]
            args += ["--tls-cert-file", str(self.ca_file), "--tls-key-file", str(self._key_file)]
            args += ["--tls-ca-cert-file", str(self.ca_file)]
        else:
            args += ["--port", str(self.port)]
        args += ["--save", "", "--appendonly", "no", "--dir", self._dir.name]
        if self.password:
            args += ["--requirepass", self.password]
        args += list(self.extra_args)
        ready = threading.Event()
        process = self.process = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        self._drainer = threading.Thread(
            target=self._drain, args=(process, ready), name="redis-server-log", daemon=True
        )
        self._drainer.start()
        if not ready.wait(_START_TIMEOUT) or process.poll() is not None:
            self.kill()
            if self._may_move and "Address already in use" in self._log_tail():
                return False
            raise RuntimeError(f"redis-server did not start: {self._log_tail()}")
        return True

    def _drain(self, process: subprocess.Popen[bytes], ready: threading.Event) -> None:
        """Copy the server's output to the log file; flag the "ready" line (or the exit)."""
        assert process.stdout is not None
        with process.stdout, self.log_path.open("ab") as log:
            for line in process.stdout:
                log.write(line)
                log.flush()
                if b"Ready to accept connections" in line:
                    ready.set()
        ready.set()

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text()[-2000:]
        except OSError:
            return "(no log)"

    def client(self, **kwargs: Any) -> redis.Redis:
        """A synchronous client of this server (with the password); close it after use."""
        if self.tls:
            kwargs.update(ssl=True, ssl_ca_certs=str(self.ca_file))
        return redis.Redis(host=self.host, port=self.port, password=self.password, **kwargs)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the server and wait for it to exit (SIGKILL after ``timeout``)."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        self._join_drainer()

    def _join_drainer(self) -> None:
        if self._drainer is not None:
            self._drainer.join(5.0)
            self._drainer = None

    def kill(self) -> None:
        """SIGKILL the server and wait for it to exit."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.kill()
        process.wait()
        self._join_drainer()

    def restart(self) -> RedisServer:
        """Stop and start again (on the same port; the data is gone)."""
        self.stop()
        return self.start()

    def close(self) -> None:
        """Stop the server and remove its directory."""
        self.kill()
        self._dir.cleanup()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def redis_server_fixture(
    scope: Any = "module", password: str | None = None
) -> Callable[..., Iterator[RedisServer]]:
    """A pytest fixture yielding a started :class:`RedisServer`, closed at the end of ``scope``.

    Args:
        scope: The fixture scope (``"module"`` by default, ``"session"`` works too).
        password: Start the server with ``--requirepass``.
    """

    @pytest.fixture(scope=scope)
    def fixture() -> Iterator[RedisServer]:
        with RedisServer(password=password) as server:
            yield server

    return fixture
