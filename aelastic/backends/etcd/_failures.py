"""What a failed call of the etcd client tells the user: one line each, naming the endpoint
and what to check (never a credential).

How it works: :mod:`._client` retries what a member may mend (it is gone, busy, without a
leader) and turns the rest into ``RendezvousConnectionError`` through these functions: a
server that does not answer etcd's API, TLS that cannot work (a certificate not trusted, a
client certificate refused, a port without TLS), a login or permission etcd refused, and
the retry budget spent.
"""

from __future__ import annotations

from ...core.errors import RendezvousConnectionError
from ._answers import (
    DEADLINE,
    PERMISSION,
    UNAUTHENTICATED,
    UNAVAILABLE,
    EtcdError,
    Misbehaved,
    TlsFailure,
    auth_error,
    retryable,
)
from ._endpoint import ENV_PASSWORD, ENV_USERNAME, EtcdEndpoint

__all__ = [
    "auth_failure",
    "misbehaved",
    "not_etcd",
    "refused_by_member",
    "tls_refused",
    "unreachable",
]


def not_etcd(
    endpoint: EtcdEndpoint, where: str, what: str, exc: Exception
) -> RendezvousConnectionError:
    """The server at ``where`` answers, or hangs up, as no etcd member does."""
    if endpoint.tls:
        hint = "is it an etcd member serving https there? Check the host, port and protocol."
    else:
        hint = (
            "is it an etcd member (3.4 or newer) serving http there (one serving https "
            "needs protocol=https)? Check the host and port."
        )
    return RendezvousConnectionError(
        f"The server at {where} does not answer etcd's v3 API ({what}: {exc}): {hint}"
    )


def misbehaved(url: str, what: str, exc: Misbehaved) -> RendezvousConnectionError:
    """The server at ``url`` broke HTTP/2 or gRPC, or sent more than the client takes."""
    return RendezvousConnectionError(
        f"The server at {url} broke etcd's protocol ({what}): {exc}; its connection was "
        "closed. Is it an etcd member, with nothing between it and this node that changes "
        "its answers?"
    )


def tls_refused(
    endpoint: EtcdEndpoint, url: str, what: str, exc: TlsFailure
) -> RendezvousConnectionError:
    """TLS with member ``url`` cannot work (see :class:`~._answers.TlsFailure`)."""
    if exc.client and not endpoint.cert:
        hint = "it requires a client certificate: set cert and key (signed by its CA)"
    elif exc.client:
        hint = f"check cert ({endpoint.cert}) and key: a certificate its CA signed"
    elif "not speak TLS" in str(exc):
        hint = "is protocol=https right?"
    elif endpoint.cacert:
        hint = (
            f"check cacert ({endpoint.cacert}): the CA that signed the members' "
            "certificates, which must name the host connected to"
        )
    else:
        hint = "set cacert to the CA that signed the members' certificates"
    return RendezvousConnectionError(f"TLS with etcd at {url} failed ({what}): {exc}; {hint}.")


def auth_failure(endpoint: EtcdEndpoint, what: str, exc: EtcdError) -> RendezvousConnectionError:
    """etcd refused the login, or the permission, for ``what``."""
    if endpoint.username:
        hint = f"check {ENV_USERNAME} and {ENV_PASSWORD}"
    else:
        hint = f"etcd has authentication enabled: set {ENV_USERNAME} and {ENV_PASSWORD}"
    return RendezvousConnectionError(f"etcd at {endpoint.display} refused {what}: {exc} ({hint}).")


def unreachable(
    endpoint: EtcdEndpoint, budget: float, what: str, error: Exception, url: str
) -> RendezvousConnectionError:
    """No member answered ``what`` within ``budget`` seconds."""
    return RendezvousConnectionError(
        f"etcd at {endpoint.display} could not be reached within {budget:g} s ({what}): "
        f"{error} (last tried {url})"
    )


def refused_by_member(exc: EtcdError) -> bool:
    """Whether etcd refused a request for the member's sake or the login's (not the
    request's own): the call tries again, logs in again or fails as a whole."""
    codes = (UNAUTHENTICATED, PERMISSION, UNAVAILABLE, DEADLINE)
    return exc.code in codes or auth_error(exc) or retryable(exc)
