"""The shapes of etcd's range requests a run's reads use, and what their answers hold.

How it works: plain functions from keys to range requests (in the JSON API's shape, as
:mod:`._proto` carries them) and from answers to the port's values: the count-only ranges of
the lists, a member's seat at the cut (its rank and the profile marks, :mod:`._control`).
Nothing here does I/O.
"""

from __future__ import annotations

from typing import Any

from ...core.state import NodeDesc
from ._client import b64, unb64
from ._control import Seat
from ._layout import RunKeys, member_parts, prefix_end, profile_parts
from ._plan import Member

__all__ = ["count_ops", "members_of", "port_of", "range_of", "range_op", "seat_of", "seat_ops"]


def range_op(key: str | bytes, end: str | bytes | None = None, **options: Any) -> dict[str, Any]:
    """A range request of a transaction."""
    body: dict[str, Any] = {"key": b64(key)}
    if end is not None:
        body["range_end"] = b64(end)
    body.update(options)
    return {"request_range": body}


def members_of(kvs: list[dict[str, Any]]) -> list[Member]:
    return [
        Member(
            key=unb64(kv.get("key")).decode(errors="replace"),
            mod=int(kv.get("mod_revision", 0)),
            create=int(kv.get("create_revision", 0)),
            value=unb64(kv.get("value")),
            lease=int(kv.get("lease", 0)),
        )
        for kv in kvs
    ]


def range_of(response: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = response.get("response_range", {})
    return result


def count_ops(k: RunKeys) -> list[dict[str, Any]]:
    """Count-only ranges of the lists: participants, waiting, redundant, done or finished
    (``q/``), done (``pd/``)."""
    lists = (k.participants, k.waiting, k.redundant, k.finished, k.done)
    return [range_op(p, prefix_end(p), count_only=True) for p in lists]


def seat_ops(k: RunKeys, node: NodeDesc, cut: int, **options: Any) -> list[dict[str, Any]]:
    """The reads of ``node``'s seat at revision ``cut``: its rank, the profile marks."""
    at = {"revision": cut, **options}
    return [
        range_op(k.participants, k.member("p", node), count_only=True, **at),
        range_op(k.profiles, prefix_end(k.profiles), **at),
    ]


def seat_of(k: RunKeys, rank: dict[str, Any], marks: dict[str, Any]) -> Seat:
    """The seat that the answers of :func:`seat_ops` (or a write's same ranges) tell."""
    found = members_of(marks.get("kvs", []))
    return Seat(
        int(rank.get("count", 0)),
        tuple((m.key[len(k.profiles) :], profile_parts(m.value)) for m in found),
    )


def port_of(value: bytes) -> int:
    """The bootstrap port in a node's key's value."""
    return member_parts(value)[0]
