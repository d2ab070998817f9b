"""etcd's answers: base64 fields, errors by gRPC code, what is worth a retry.

How it works: etcd refuses a call with a gRPC status (its code and etcd's message);
:func:`etcd_error` turns it into an :class:`EtcdError` (or a subclass for the cases
callers handle). What the connection meets tells a member that cannot answer now
(:class:`Transient`: try another) from a server that is not an etcd member
(:class:`NotEtcd`: fail at once), and a server that broke HTTP/2 or gRPC, or went beyond
what this client takes (:class:`Misbehaved`: its connection is closed, the call fails at
once). :func:`tls_failure` tells a TLS error that retrying
cannot mend (:class:`TlsFailure`).
"""

from __future__ import annotations

import base64
import ssl

__all__ = [
    "DEADLINE",
    "PERMISSION",
    "UNAUTHENTICATED",
    "UNAVAILABLE",
    "Compacted",
    "EtcdError",
    "Hangup",
    "LeaseNotFound",
    "Misbehaved",
    "NotEtcd",
    "TlsFailure",
    "Transient",
    "auth_error",
    "b64",
    "etcd_error",
    "retryable",
    "said",
    "tls_failure",
    "unb64",
]

#: gRPC codes.
INVALID_ARGUMENT, DEADLINE, NOT_FOUND, PERMISSION = 3, 4, 5, 7
FAILED_PRECONDITION, OUT_OF_RANGE, UNAVAILABLE, UNAUTHENTICATED = 9, 11, 14, 16


def b64(data: bytes | str) -> str:
    """``data`` in base64 (a key or value in the shape of etcd's JSON API)."""
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode("ascii")


def unb64(text: str | None) -> bytes:
    """The bytes of a base64 field (``b""`` when absent)."""
    return base64.b64decode(text) if text else b""


class EtcdError(Exception):
    """etcd refused a request (the message is etcd's; ``code`` is the gRPC code)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class Compacted(EtcdError):
    """The revision asked for was compacted away."""


class LeaseNotFound(EtcdError):
    """The lease does not exist (it expired or was revoked)."""


class Transient(Exception):
    """This member cannot answer now (gone, no leader, timed out): try another."""


class NotEtcd(Exception):
    """The server answered, but not as an etcd member does."""


class Misbehaved(NotEtcd):
    """The server broke HTTP/2 or gRPC, or sent more than this client takes (a frame, a
    header block, a message, a flood of frames: :mod:`._limits`); its connection is closed
    (every call on it fails) and leaves the pool. The message says what the server did."""


class Hangup(Transient):
    """The member took the connection and closed it without an answer."""


class TlsFailure(Exception):
    """TLS failed in a way that retrying cannot mend: the member's certificate is not
    trusted or not for its host, or the member refused this client's certificate (or its
    lack of one). ``client`` tells the last case."""

    def __init__(self, message: str, client: bool = False) -> None:
        super().__init__(message)
        self.client = client


def tls_failure(exc: BaseException) -> TlsFailure | None:
    """What a TLS error says, when retrying cannot mend it (``None``: it may be transient)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        reason = str(exc.verify_message or exc.reason).rstrip(".")
        return TlsFailure(f"its certificate is not trusted: {reason}")
    if isinstance(exc, (ssl.SSLEOFError, ssl.SSLZeroReturnError)) or not isinstance(
        exc, ssl.SSLError
    ):
        return None
    reason = str(exc.reason or exc)
    if "ALERT" in reason:  # the member refused the handshake: this client's certificate
        return TlsFailure(f"it refused this client's certificate ({reason})", client=True)
    if "WRONG_VERSION_NUMBER" in reason or "RECORD_LAYER" in reason:
        return TlsFailure(f"it does not speak TLS on that port ({reason})")
    return TlsFailure(reason)


def said(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def retryable(exc: EtcdError) -> bool:
    text = str(exc)
    return any(
        s in text
        for s in (
            "no leader",
            "leader changed",
            "timed out",
            "too many requests",
            "not capable",
            "server stopped",
        )
    )


def auth_error(exc: EtcdError) -> bool:
    text = str(exc)
    return any(
        s in text
        for s in (
            "authentication failed",
            "user name is empty",
            "invalid auth token",
            "permission denied",
        )
    )


def etcd_error(message: str, code: int) -> EtcdError:
    if "compacted" in message:
        return Compacted(message, code)
    if "lease not found" in message:
        return LeaseNotFound(message, code)
    return EtcdError(message, code)
