"""The etcd backend over TLS against a real etcd serving https only: torch's ``protocol``,
``cacert``, ``cert`` and ``key`` keys; every TLS mistake is one clear line, at once."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

from aelastic import RendezvousConnectionError, RendezvousParameters
from aelastic.backends.etcd import create_backend
from tests._etcd_server import EtcdServer
from tests._rendezvous_helpers import assert_one_group, handler_group, join_all

pytestmark = pytest.mark.anyio

#: A TLS mistake fails at once, not after retrying for read_timeout (30 s here).
AT_ONCE = 10.0


@pytest.fixture(scope="module")
def tls_server() -> Iterator[EtcdServer]:
    with EtcdServer(tls=True) as etcd:
        yield etcd


@pytest.fixture(scope="module")
def mtls_server() -> Iterator[EtcdServer]:
    with EtcdServer(tls=True, client_auth=True) as etcd:
        yield etcd


async def _refused(endpoint: str, **conf: Any) -> str:
    """The one line a store write through a fresh backend fails with."""
    params = RendezvousParameters("etcd", endpoint, "tls", 1, 1, read_timeout=30, **conf)
    backend = create_backend(params)
    started = time.monotonic()
    try:
        with pytest.raises(RendezvousConnectionError) as info:
            await backend.kv_set("k", b"v")
    finally:
        await backend.aclose()
    assert time.monotonic() - started < AT_ONCE
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    return message


async def test_a_round_forms_and_its_store_works_over_https(tls_server: EtcdServer) -> None:
    """The server's certificate names 127.0.0.1 in an IP SAN; the CA is given as cacert."""
    conf = {"protocol": "https", "cacert": str(tls_server.ca_file)}
    async with handler_group("etcd", tls_server.endpoint, "tls-round", 2, 2, 2, **conf) as hs:
        infos = await join_all(hs)
        assert_one_group(infos, 2)
        await infos[0].store.set("greeting", "hello")
        assert await infos[1].store.get("greeting") == b"hello"


async def test_a_member_url_says_https_too(tls_server: EtcdServer) -> None:
    conf = {"cacert": str(tls_server.ca_file)}
    url = f"https://{tls_server.endpoint}"
    async with handler_group("etcd", url, "tls-url", 1, 1, 1, **conf) as handlers:
        assert_one_group(await join_all(handlers), 1)


async def test_a_certificate_not_for_the_host_is_refused(tls_server: EtcdServer) -> None:
    """Hostname checks are on: the certificate names 127.0.0.1, not localhost."""
    message = await _refused(
        f"localhost:{tls_server.client_port}", protocol="https", cacert=str(tls_server.ca_file)
    )
    assert "not trusted" in message and "localhost" in message and "cacert" in message


async def test_a_server_certificate_of_another_ca_is_one_line(tls_server: EtcdServer) -> None:
    with EtcdServer(tls=True) as other:  # its CA did not sign tls_server's certificate
        message = await _refused(tls_server.endpoint, protocol="https", cacert=str(other.ca_file))
    assert "not trusted" in message and "certificate" in message and str(other.ca_file) in message
    message = await _refused(tls_server.endpoint, protocol="https")  # the system's CAs
    assert "not trusted" in message and "set cacert" in message


async def test_http_to_an_https_only_etcd_is_one_line(tls_server: EtcdServer) -> None:
    message = await _refused(tls_server.endpoint)
    assert "protocol=https" in message and tls_server.endpoint in message


async def test_https_to_a_plain_etcd_is_one_line(tls_server: EtcdServer) -> None:
    with EtcdServer() as plain:
        message = await _refused(plain.endpoint, protocol="https", cacert=str(tls_server.ca_file))
    assert "TLS handshake" in message and "protocol" in message and plain.endpoint in message


async def test_a_client_certificate_is_used_when_etcd_requires_one(
    mtls_server: EtcdServer,
) -> None:
    cert, key = mtls_server.client_cert("node")
    conf = {"protocol": "https", "cacert": str(mtls_server.ca_file)}
    conf |= {"cert": str(cert), "key": str(key)}
    async with handler_group("etcd", mtls_server.endpoint, "mtls", 2, 2, 2, **conf) as hs:
        infos = await join_all(hs)
        assert_one_group(infos, 2)
        await infos[1].store.set("k", "v")
        assert await infos[0].store.get("k") == b"v"


async def test_a_missing_or_untrusted_client_certificate_is_one_line(
    mtls_server: EtcdServer,
) -> None:
    conf = {"protocol": "https", "cacert": str(mtls_server.ca_file)}
    message = await _refused(mtls_server.endpoint, **conf)
    assert "client certificate" in message and "set cert and key" in message
    cert, key = mtls_server.client_cert("stranger", trusted=False)
    message = await _refused(mtls_server.endpoint, **conf, cert=str(cert), key=str(key))
    assert "refused this client's certificate" in message and str(cert) in message


def test_a_tls_file_that_cannot_be_read_is_named_at_creation(tmp_path: Any) -> None:
    missing = tmp_path / "nope.pem"
    with pytest.raises(ValueError, match=re.escape(f"cert={missing} cannot be read")):
        create_backend(
            RendezvousParameters(
                "etcd", "127.0.0.1:1", "r", 1, 1, protocol="https", cert=str(missing)
            )
        )
    garbage = tmp_path / "ca.pem"
    garbage.write_text("not a certificate")
    with pytest.raises(ValueError, match=r"cacert=.*cannot be used") as info:
        create_backend(
            RendezvousParameters(
                "etcd", "127.0.0.1:1", "r", 1, 1, protocol="https", cacert=str(garbage)
            )
        )
    assert "\n" not in str(info.value)


async def test_closed_tls_clients_leave_no_socket_open(
    mtls_server: EtcdServer, tls_server: EtcdServer
) -> None:
    """A round over TLS, then clients refused (no client certificate, a member not
    trusted, plain HTTP to TLS): once closed, none of their sockets is left open (the
    connections are aborted: a TLS close waits up to 30 s for the member's close_notify,
    and a loop that ends meanwhile leaks the socket)."""
    import asyncio
    import contextlib
    import os

    def sockets() -> int:
        count = 0
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # the listing's own fd is gone by now
                count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        return count

    before = sockets()
    conf = {"protocol": "https", "cacert": str(tls_server.ca_file)}
    async with handler_group("etcd", tls_server.endpoint, "tls-closed", 2, 2, 2, **conf) as hs:
        await join_all(hs)
    await _refused(mtls_server.endpoint, protocol="https", cacert=str(mtls_server.ca_file))
    await _refused(tls_server.endpoint, protocol="https")  # not trusted
    await _refused(tls_server.endpoint)  # http to https
    await asyncio.sleep(0.2)
    assert sockets() == before
