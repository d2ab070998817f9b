"""Where the HTTP rendezvous server is, and the token to show it (endpoint forms, checks)."""

from __future__ import annotations

import os

from yarl import URL

from ....core.params import parse_rendezvous_endpoint
from ..wire import DEFAULT_PORT, TOKEN_ENV

__all__ = ["parse_endpoint", "resolve_token"]


def parse_endpoint(endpoint: str) -> URL:
    """The server's base URL from ``host[:port]``, ``http://host:port[/prefix]`` or ``https://...``.

    Raises:
        ValueError: The endpoint is empty, has another scheme, or no valid host or port
            (a bare ``host:port`` is checked with torch's rules and messages).
    """
    text = endpoint.strip()
    if not text:
        raise ValueError("The http rendezvous backend needs an endpoint (host:port or a URL).")
    if "://" not in text:
        host, port = parse_rendezvous_endpoint(text, DEFAULT_PORT)
        return URL.build(scheme="http", host=host, port=port, path="/")
    try:
        url = URL(text)
        url_port = url.port
    except ValueError as exc:
        raise ValueError(f"The rendezvous endpoint '{endpoint}' is not valid: {exc}") from None
    if url.scheme not in ("http", "https"):
        raise ValueError(
            f"The rendezvous endpoint '{endpoint}' must use http:// or https://, "
            f"not {url.scheme}://."
        )
    if not url.host or url_port is None:
        raise ValueError(f"The rendezvous endpoint '{endpoint}' names no host.")
    if url.query_string or url.fragment:
        raise ValueError(f"The rendezvous endpoint '{endpoint}' must not have a query.")
    return url.with_user(None).with_path(url.path.rstrip("/") or "/", encoded=True)


def resolve_token(token: str | None) -> str | None:
    """``token``, or ``AELASTIC_HTTP_TOKEN`` when ``None`` (empty: none).

    Raises:
        ValueError: It has leading or trailing whitespace.
    """
    value = token if token is not None else (os.environ.get(TOKEN_ENV) or None)
    if value and value != value.strip():
        raise ValueError(
            f"The HTTP rendezvous token ({TOKEN_ENV} or the 'token' key) has leading or "
            "trailing whitespace; remove it."
        )
    return value or None
