"""Keeping secrets out of what aelastic shows: endpoints, settings, messages, environments.

How it works: :func:`redact` rewrites free text. In every URL (``redis://``, ``rediss://``,
``redis+sentinel://user:pw@h1:p1,h2:p2/svc``, ``http(s)://``...) the password of the user
information becomes ``***``; the user information ends at the *last* ``@`` before white space
or a quote, so a password with an unescaped ``@`` or ``/`` is masked whole (masking too much
is the safe mistake). ``password=...``, ``token=...`` (any key ending in password, passwd,
token or secret; also quoted ``'password': '...'`` as in a dict's repr) and ``Bearer ...``
values become ``***`` too. Values known to be secret (a password given in the environment)
can be passed as ``known``: they are masked wherever they appear. :func:`redact_endpoint`
also handles a bare ``user:pw@host:port``. :data:`SECRET_ENV` lists the variables that
carry credentials, which workers never inherit. :func:`exposed_secrets` finds the secrets of
a launcher's rendezvous options that its own command line shows (every user of the machine
can read a command line: ``ps``, ``/proc/<pid>/cmdline``; an environment only its owner),
and says which variable to use instead. Pure functions, no aelastic imports.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "MASK",
    "SECRET_ENV",
    "exposed_secrets",
    "is_secret_key",
    "known_secrets",
    "redact",
    "redact_config",
    "redact_endpoint",
]

#: What a secret is replaced with.
MASK = "***"

#: Environment variables holding credentials: shown never, inherited by workers never.
SECRET_ENV = frozenset(
    {
        "AELASTIC_REDIS_PASSWORD",
        "AELASTIC_REDIS_SENTINEL_PASSWORD",
        "AELASTIC_HTTP_TOKEN",
        "AELASTIC_ETCD_PASSWORD",
    }
)

_SECRET_SUFFIXES = ("password", "passwd", "token", "secret")

#: A URL: its scheme, then everything up to white space, a quote or a bracket.
_URL = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://)([^\s'\"<>`]*)")
_SECRET_WORD = r"[A-Za-z0-9_\-]*(?:password|passwd|token|secret)"
#: ``password=value`` (up to a separator of a setting list, query or sentence).
_KEY_VALUE = re.compile(rf"(?i)\b({_SECRET_WORD})=([^\s,&;'\")\]]*)")
#: ``'password': 'value'`` / ``"token": "value"`` (a dict's repr, JSON).
_QUOTED = re.compile(rf"(?i)(['\"]{_SECRET_WORD}['\"]\s*:\s*)(['\"])((?:\\.|(?!\2).)*)\2")
_BEARER = re.compile(r"(?i)\b(bearer\s+)[^\s,'\"]+")

#: Known secrets shorter than this are not masked as plain text (they would mangle words).
_SHORTEST_KNOWN = 3


def is_secret_key(key: str) -> bool:
    """Whether a setting or variable named ``key`` holds a secret (``password``, ``token``...)."""
    return key.lower().endswith(_SECRET_SUFFIXES)


def _mask_userinfo(rest: str) -> str:
    """``user:pw@host...`` -> ``user:***@host...`` (unchanged without a password)."""
    at = rest.rfind("@")
    if at < 0:
        return rest
    userinfo = rest[:at]
    user, colon, password = userinfo.partition(":")
    if not colon or password == MASK:
        return rest
    return f"{user}:{MASK}{rest[at:]}"


def _mask_url(match: re.Match[str]) -> str:
    return match.group(1) + _mask_userinfo(match.group(2))


def redact(text: str, known: Iterable[str] = ()) -> str:
    """``text`` with every password of a URL and every secret setting masked.

    Args:
        text: Any message, endpoint or line of output.
        known: Secret values to mask wherever they appear (values shorter than 3
            characters are left alone).

    Returns:
        The text with the secrets replaced by ``***``; idempotent.
    """
    text = _URL.sub(_mask_url, text)
    text = _KEY_VALUE.sub(lambda m: f"{m.group(1)}={MASK}", text)
    text = _QUOTED.sub(lambda m: f"{m.group(1)}{m.group(2)}{MASK}{m.group(2)}", text)
    text = _BEARER.sub(lambda m: f"{m.group(1)}{MASK}", text)
    for secret in sorted(set(known), key=len, reverse=True):
        if len(secret) >= _SHORTEST_KNOWN and secret != MASK:
            text = text.replace(secret, MASK)
    return text


def redact_endpoint(endpoint: str) -> str:
    """An endpoint (URL or bare ``[user:pw@]host:port``) without its password."""
    if "://" not in endpoint:
        endpoint = _mask_userinfo(endpoint)
    return redact(endpoint)


def redact_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with the value of every secret key (``password``, ``token``...) masked."""
    return {k: MASK if is_secret_key(str(k)) and v else v for k, v in config.items()}


def _userinfo_password(endpoint: str) -> str | None:
    rest = endpoint.partition("://")[2] if "://" in endpoint else endpoint
    rest = re.split(r"[\s'\"<>`]", rest, maxsplit=1)[0]
    at = rest.rfind("@")
    if at < 0:
        return None
    _, colon, password = rest[:at].partition(":")
    return password if colon and password else None


def known_secrets(
    endpoint: str = "",
    config: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> frozenset[str]:
    """The secret values a launcher holds: the endpoint's password, secret settings, variables.

    Args:
        endpoint: The rendezvous endpoint (its password, also percent-decoded).
        config: Rendezvous settings (the values of ``password``, ``token``... keys).
        environ: Environment (the values of :data:`SECRET_ENV`); nothing when ``None``.

    Returns:
        The non-empty secret values.
    """
    from urllib.parse import unquote

    found: set[str] = set()
    password = _userinfo_password(endpoint)
    if password:
        found.update({password, unquote(password)})
    for key, value in (config or {}).items():
        if is_secret_key(str(key)) and value:
            found.add(str(value))
    for name in SECRET_ENV:
        value = (environ or {}).get(name)
        if value:
            found.add(value)
    return frozenset(found)


#: How the rendezvous options are given in the environment instead (torchrun's variables).
_OPTION_ENV = {"endpoint": "PET_RDZV_ENDPOINT", "conf": "PET_RDZV_CONF"}
_READABLE = "which every user of this machine can read (ps, /proc/<pid>/cmdline)"


def exposed_secrets(
    endpoint: str,
    config: Mapping[str, Any],
    argv: Sequence[str],
    variables: Mapping[str, str] | None = None,
) -> list[str]:
    """Warnings for the secrets among the rendezvous options that ``argv`` shows.

    Args:
        endpoint: The rendezvous endpoint (a password in it counts).
        config: The rendezvous settings (the keys named like a secret count).
        argv: The process's command line (``sys.orig_argv``): an option given in the
            environment (``PET_RDZV_ENDPOINT``, ``PET_RDZV_CONF``) is not in it.
        variables: The backend's variable for each secret (``"password"`` ->
            ``AELASTIC_REDIS_PASSWORD``; ``"endpoint"``: the endpoint's password).

    Returns:
        One line per exposed secret, naming the variable to use instead (no secret in it).
    """
    variables = variables or {}
    found: list[str] = []
    shown = " ".join(argv)
    if _userinfo_password(endpoint) and endpoint in shown:
        what = "the password in --rdzv-endpoint"
        found.append(_exposed(what, variables.get("endpoint"), "endpoint"))
    for key, value in config.items():
        if is_secret_key(str(key)) and value and f"{key}={value}" in shown:
            found.append(_exposed(f"the {key} in --rdzv-conf", variables.get(str(key)), "conf"))
    return found


def _exposed(what: str, variable: str | None, option: str) -> str:
    whole = _OPTION_ENV[option]
    if variable is None:
        how = f"give the option in the environment instead ({whole})"
    else:
        how = f"set {variable} in the environment instead"
        if option == "endpoint":
            how += " and leave the password out of the endpoint"
        how += f" (or give the whole option in {whole})"
    return f"{what} is on the command line, {_READABLE}: {how}"
