"""Real ``etcd`` servers for tests, on free loopback ports: one member, or a 3-member cluster.

Usage::

    from tests._etcd_server import EtcdServer, EtcdCluster

    with EtcdServer() as server:             # started, answering /v3/maintenance/status
        server.endpoint                      # "127.0.0.1:PORT" (torch's form)
        server.url                           # "http://127.0.0.1:PORT"
        server.call("/v3/kv/range", {...})   # a JSON call of etcd's v3 API (sync)
        server.kill()                        # SIGKILL, waits for the exit
        server.start()                       # again, same ports, same data directory

    with EtcdCluster(3) as cluster:          # three members, a leader elected
        cluster.endpoint                     # "127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3"
        cluster.leader()                     # the member that leads now
        cluster.leader().kill()              # SIGKILL the leader; the others elect another

Members run with short election timings (heartbeat 50 ms, election 500 ms: a lease can be
as short as 1 s, and a failover takes about a second) and their data in a temporary
directory (tmpfs when /dev/shm is there: no disk syncs on a shared machine). ``start``
returns once the member answers. ``EtcdServer(auth=("root", "pw"))`` enables etcd's
authentication with that root user (``token_ttl``: its simple tokens' time to live, s).
``EtcdServer(tls=True)`` serves https only, with a fresh CA (:attr:`EtcdServer.ca_file`) and a
server certificate for 127.0.0.1 (an IP SAN) it signed; ``client_auth=True`` also asks for a
client certificate signed by that CA (:meth:`EtcdServer.client_cert` makes one).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests._ports import free_port

__all__ = ["EtcdCluster", "EtcdServer", "b64"]

_START_TIMEOUT = 30.0


def b64(text: str | bytes) -> str:
    raw = text.encode() if isinstance(text, str) else text
    return base64.b64encode(raw).decode()


def _openssl(args: list[str]) -> None:
    binary = shutil.which("openssl")
    if binary is None:
        pytest.skip("openssl is not on PATH")
    subprocess.run([binary, *args], check=True, capture_output=True)


def _post(
    url: str,
    body: dict[str, Any],
    timeout: float = 5.0,
    token: str | None = None,
    context: ssl.SSLContext | None = None,
) -> Any:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="POST")
    request.add_header("Content-Type", "application/json")
    if token:
        request.add_header("Authorization", token)
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            return json.loads(response.read().splitlines()[0])
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read() or b"{}")


class EtcdServer:
    """One ``etcd`` member on 127.0.0.1 (alone, or one of an :class:`EtcdCluster`).

    Args:
        name: The member's name.
        client_port, peer_port: Its ports (default: free ones, kept across restarts).
        cluster: ``name=peer-url,...`` of every member (default: this one alone).
        auth: ``(user, password)``: enable authentication with this root user.
        token_ttl: Seconds etcd's simple auth tokens live (etcd's default: 300).
        tls: Serve https only (a fresh CA and a certificate for 127.0.0.1).
        client_auth: With ``tls``, require a client certificate signed by that CA.
    """

    def __init__(
        self,
        name: str = "m0",
        client_port: int | None = None,
        peer_port: int | None = None,
        cluster: str | None = None,
        auth: tuple[str, str] | None = None,
        root: Path | None = None,
        token_ttl: int | None = None,
        tls: bool = False,
        client_auth: bool = False,
    ) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            pytest.skip("etcd is not on PATH")
        self.binary = binary
        self.name = name
        self.client_port = client_port or free_port()
        self.peer_port = peer_port or free_port()
        self.cluster = cluster or f"{name}={self.peer_url}"
        self.auth = auth
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self._dir = None if root else tempfile.TemporaryDirectory(prefix="aelastic-etcd-", dir=base)
        self.dir = root if root else Path(self._dir.name)  # type: ignore[union-attr]
        self.log_path = self.dir / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self._started_once = False
        self.token_ttl = token_ttl
        self._admin: ssl.SSLContext | None = None
        self.tls = tls
        self.client_auth = client_auth
        self.ca_file = self.dir / f"{name}-ca.pem"
        self._ca_key = self.dir / f"{name}-ca.key"
        self.cert_file = self.dir / f"{name}-server.pem"
        self._key_file = self.dir / f"{name}-server.key"
        if tls:
            self._make_certificates()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"EtcdServer({self.name}, port={self.client_port}, {state})"

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.client_port}"

    def _post(self, path: str, body: dict[str, Any], **kw: Any) -> Any:
        """A JSON call to this member (over TLS as a trusted client when it serves TLS)."""
        return _post(self.url + path, body, context=self._context(), **kw)

    def _context(self) -> ssl.SSLContext | None:
        if not self.tls:
            return None
        if self._admin is None:
            context = ssl.create_default_context(cafile=str(self.ca_file))
            if self.client_auth:
                context.load_cert_chain(*map(str, self.client_cert("admin")))
            self._admin = context
        return self._admin

    def _make_certificates(self) -> None:
        """A CA and a server certificate for 127.0.0.1 (IP SAN) that it signed."""
        self._ca(self.ca_file, self._ca_key, "aelastic test CA")
        self._sign(self.cert_file, self._key_file, "127.0.0.1", "subjectAltName=IP:127.0.0.1")

    def client_cert(self, name: str = "client", trusted: bool = True) -> tuple[Path, Path]:
        """``(cert, key)`` of a client certificate signed by this server's CA (``trusted``)
        or by a CA of its own that the server does not know."""
        cert, key = self.dir / f"{name}.pem", self.dir / f"{name}.key"
        if trusted:
            self._sign(cert, key, name, "extendedKeyUsage=clientAuth")
        else:
            self._ca(cert, key, name)
        return cert, key

    def _ca(self, cert: Path, key: Path, subject: str) -> None:
        args = ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
        args += ["-keyout", str(key), "-out", str(cert), "-subj", f"/CN={subject}"]
        args += ["-addext", "basicConstraints=critical,CA:TRUE"]
        args += ["-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature"]
        _openssl(args)

    def _sign(self, cert: Path, key: Path, subject: str, extension: str) -> None:
        request = cert.with_suffix(".csr")
        _openssl(["req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                  "-out", str(request), "-subj", f"/CN={subject}"])  # fmt: skip
        extensions = cert.with_suffix(".ext")
        extensions.write_text(extension.replace("=", " = ", 1) + "\n")
        _openssl(["x509", "-req", "-in", str(request), "-CA", str(self.ca_file),
                  "-CAkey", str(self._ca_key), "-CAcreateserial", "-days", "1",
                  "-out", str(cert), "-extfile", str(extensions)])  # fmt: skip

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def endpoint(self) -> str:
        """``127.0.0.1:PORT``: torch's endpoint form."""
        return f"127.0.0.1:{self.client_port}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def launch(self, state: str = "new") -> None:
        """Start the process without waiting for it to answer (a cluster starts all first)."""
        if self.running:
            return
        args = [
            self.binary,
            "--name", self.name,
            "--data-dir", str(self.dir / f"{self.name}.data"),
            "--listen-client-urls", self.url,
            "--advertise-client-urls", self.url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", self.cluster,
            "--initial-cluster-state", state if not self._started_once else "existing",
            "--initial-cluster-token", f"aelastic-{self.dir.name}",
            "--heartbeat-interval", "50",
            "--election-timeout", "500",
            "--snapshot-count", "100000",
        ]  # fmt: skip
        if self.token_ttl is not None:
            args += ["--auth-token-ttl", str(self.token_ttl)]
        if self.tls:
            args += ["--cert-file", str(self.cert_file), "--key-file", str(self._key_file)]
            if self.client_auth:
                args += ["--trusted-ca-file", str(self.ca_file), "--client-cert-auth"]
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()
        self._started_once = True

    def wait_ready(self, timeout: float = _START_TIMEOUT) -> None:
        """Until the member answers (and, in a cluster, knows a leader)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"etcd {self.name} exited: {self._log_tail()}")
            try:
                status = self._post("/v3/maintenance/status", {}, timeout=1.0)
                if int(status.get("leader", 0)):
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"etcd {self.name} did not start: {self._log_tail()}")

    def start(self) -> EtcdServer:
        """Start (on the same ports, with the same data) and wait until it answers."""
        self.launch()
        self.wait_ready()
        if self.auth is not None and not getattr(self, "_auth_on", False):
            self._enable_auth()
        return self

    def _enable_auth(self) -> None:
        assert self.auth is not None
        user, password = self.auth
        self._post("/v3/auth/user/add", {"name": user, "password": password})
        self._post("/v3/auth/role/add", {"name": "root"})
        self._post("/v3/auth/user/grant", {"user": user, "role": "root"})
        answer = self._post("/v3/auth/enable", {})
        assert "error" not in answer, answer
        self._auth_on = True

    def call(self, path: str, body: dict[str, Any]) -> Any:
        """A JSON call of etcd's v3 API (as root when authentication is on)."""
        token = None
        if self.auth is not None and getattr(self, "_auth_on", False):
            user, password = self.auth
            login = self._post("/v3/auth/authenticate", {"name": user, "password": password})
            token = login.get("token")
        return self._post(path, body, token=token)

    def put(self, key: str, value: str | bytes) -> None:
        self.call("/v3/kv/put", {"key": b64(key), "value": b64(value)})

    def get(self, key: str) -> bytes | None:
        kvs = self.call("/v3/kv/range", {"key": b64(key)}).get("kvs", [])
        return base64.b64decode(kvs[0].get("value", "")) if kvs else None

    def keys(self, prefix: str) -> list[str]:
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        body = {"key": b64(prefix), "range_end": b64(end), "keys_only": True}
        kvs = self.call("/v3/kv/range", body).get("kvs", [])
        return [base64.b64decode(kv["key"]).decode(errors="replace") for kv in kvs]

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL and wait for the exit."""
        process = self.process
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def stop(self) -> None:
        """SIGTERM (SIGKILL after 10 s) and wait for the exit."""
        process = self.process
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def close(self) -> None:
        self.kill()
        if self._dir is not None:
            self._dir.cleanup()

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class EtcdCluster:
    """``size`` etcd members on 127.0.0.1 forming one cluster."""

    def __init__(self, size: int = 3) -> None:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self._dir = tempfile.TemporaryDirectory(prefix="aelastic-etcd-cluster-", dir=base)
        root = Path(self._dir.name)
        ports = [(free_port(), free_port()) for _ in range(size)]
        cluster = ",".join(f"m{i}=http://127.0.0.1:{peer}" for i, (_, peer) in enumerate(ports))
        self.members = [
            EtcdServer(f"m{i}", client, peer, cluster, root=root)
            for i, (client, peer) in enumerate(ports)
        ]

    @property
    def endpoint(self) -> str:
        """Every member, comma-separated (torch's form)."""
        return ",".join(m.endpoint for m in self.members)

    def start(self) -> EtcdCluster:
        threads = [threading.Thread(target=m.launch) for m in self.members]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for member in self.members:
            member.wait_ready()
        return self

    def leader(self, timeout: float = 20.0) -> EtcdServer:
        """The member that leads now (waits for an election)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for member in self.members:
                if not member.running:
                    continue
                try:
                    status = _post(member.url + "/v3/maintenance/status", {}, timeout=1.0)
                except (OSError, ValueError):
                    continue
                if status.get("leader") and status.get("leader") == status["header"]["member_id"]:
                    return member
            time.sleep(0.05)
        raise RuntimeError("the etcd cluster elected no leader")

    def running(self) -> list[EtcdServer]:
        return [m for m in self.members if m.running]

    def close(self) -> None:
        for member in self.members:
            member.kill()
        self._dir.cleanup()

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()
