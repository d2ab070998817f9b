"""Version tokens of a run's state: ``"<epoch>.<generation>"``, made and read here only.

How it works: a backend draws a random ``epoch`` when it creates a run's state and counts
its transitions (``generation``). A token names one version; waiters hold the token of what
they last saw and are woken when the stored one differs. The epoch makes a state created
again (after a restart, a flush or an expiry) never repeat an old token (no ABA).
Tokens of one epoch are ordered by generation, so a waiter that already knows a newer
token can tell "changed" without asking the server. :data:`NO_STATE` is the token of a run
with no state.
"""

from __future__ import annotations

import enum
import re
import secrets

__all__ = ["NO_STATE", "Order", "Token", "compare", "make", "new_epoch", "parse"]

#: An opaque version; compare with :func:`compare` or ``==``.
Token = str

#: The token of "no state stored yet".
NO_STATE: Token = ""

_TOKEN = re.compile(r"^([0-9A-Za-z]{1,64})\.([0-9]{1,19})$")


class Order(enum.Enum):
    """How a token relates to a newer piece of knowledge about the run."""

    SAME = "same"  #: equal, or known to be newer: nothing to report yet
    CHANGED = "changed"  #: known to be older: the stored state has moved on
    UNKNOWN = "unknown"  #: cannot tell (another epoch, or no knowledge): ask the server


def new_epoch() -> str:
    """A fresh random epoch."""
    return secrets.token_hex(8)


def make(epoch: str, generation: int) -> Token:
    """The token of ``generation`` in ``epoch``."""
    return f"{epoch}.{generation}"


def parse(token: str) -> tuple[str, int] | None:
    """``(epoch, generation)`` of ``token``, or ``None`` when it is not a token."""
    match = _TOKEN.match(token)
    if match is None:
        return None
    return match.group(1), int(match.group(2))


def is_valid(token: str) -> bool:
    """Whether ``token`` is a token or :data:`NO_STATE`."""
    return token == NO_STATE or parse(token) is not None


def compare(token: Token, known: Token | None) -> Order:
    """Relate ``token`` (what a caller holds) to ``known`` (a token the server had later)."""
    if known is None:
        return Order.UNKNOWN
    if token == known:
        return Order.SAME
    mine, theirs = parse(token), parse(known)
    if theirs is not None and token == NO_STATE:
        return Order.CHANGED
    if mine is None or theirs is None or mine[0] != theirs[0]:
        return Order.UNKNOWN
    return Order.CHANGED if mine[1] < theirs[1] else Order.SAME


def is_older(token: Token, than: Token) -> bool:
    """Whether ``token`` is certainly older than ``than`` (same epoch, lower generation)."""
    return compare(token, than) is Order.CHANGED
