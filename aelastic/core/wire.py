"""JSON forms of requests, replies, statuses and snapshots (the HTTP API and Redis replies).

How it works: each value has one JSON object form; ``*_to_json`` builds it, ``*_from_json``
validates every field of a parsed document and raises :class:`WireError` (a ``ValueError``)
on anything else. Times are whole milliseconds of the backend's clock. A missing optional
field reads as ``null`` (Redis' Lua JSON encoder drops nil fields and writes an empty list as
``{}``; both are accepted).
"""

from __future__ import annotations

import re
from typing import Any

from .health import JobHealth, NodeReport
from .params import Rules
from .state import (
    MAX_LOCAL_WORLD_SIZE,
    MAX_LOST_SAMPLE,
    MAX_ROLE,
    MemberEntry,
    NodeDesc,
    Op,
    Outcome,
    Placement,
    Reply,
    Request,
    Snapshot,
    Status,
    Transition,
)
from .token import is_valid

__all__ = [
    "WireError",
    "health_from_json",
    "health_to_json",
    "reply_from_json",
    "reply_to_json",
    "request_from_json",
    "request_to_json",
    "rules_from_json",
    "rules_to_json",
    "snapshot_from_json",
    "snapshot_to_json",
    "status_from_json",
    "status_to_json",
]

_MAX_INT = (1 << 63) - 1
#: A node's secret: what ``secrets.token_hex`` or ``token_urlsafe`` make.
_SECRET = re.compile(r"^[0-9A-Za-z_-]{16,128}$")


class WireError(ValueError):
    """A document that is not the value it should be."""


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise WireError(what)


def _obj(doc: Any, what: str) -> dict[str, Any]:
    if type(doc) is not dict:
        raise WireError(f"{what} must be a JSON object")
    return doc


def _int(doc: dict[str, Any], key: str, *, optional: bool = False, low: int = 0) -> Any:
    value = doc.get(key)
    if value is None and optional:
        return None
    if type(value) is float and value.is_integer():  # Lua's JSON may write 3.0
        value = int(value)
    # (The message is made only when needed: these run for every field of every request.)
    if type(value) is not int or not low <= value <= _MAX_INT:
        raise WireError(f"'{key}' must be an integer")
    return value


def _bool(doc: dict[str, Any], key: str, default: bool | None = None) -> bool:
    value = doc.get(key, default)
    if type(value) is not bool:
        raise WireError(f"'{key}' must be a boolean")
    return bool(value)


def _str(doc: dict[str, Any], key: str, *, optional: bool = False) -> Any:
    value = doc.get(key)
    if value is None and optional:
        return None
    if type(value) is not str:
        raise WireError(f"'{key}' must be a string")
    return value


def _node(value: Any) -> NodeDesc:
    _require(type(value) is str and len(value) <= 1024, "a node must be a string")
    try:
        return NodeDesc.from_key(value)
    except ValueError as exc:
        raise WireError(str(exc)) from None


def _list(value: Any, what: str) -> list[Any]:
    if value is None or value == {}:
        return []
    _require(type(value) is list, f"'{what}' must be a list")
    return value  # type: ignore[no-any-return]


# -- status ---------------------------------------------------------------------------------


def status_to_json(status: Status) -> dict[str, Any]:
    """The JSON form of ``status``."""
    return {
        "token": status.token,
        "round": status.round,
        "complete": status.complete,
        "closed": status.closed,
        "deadline": status.deadline_ms,
        "now": status.now_ms,
        "participants": status.participants,
        "world": status.world,
        "waiting": status.waiting,
        "redundant": status.redundant,
        "lost": status.lost,
        "finished": status.finished,
        "lost_sample": list(status.lost_sample),
        "done": status.done,
    }


def status_from_json(doc: Any) -> Status:
    """The status that ``doc`` describes.

    Raises:
        WireError: ``doc`` is not a status.
    """
    d = _obj(doc, "a status")
    token = _str(d, "token")
    _require(is_valid(token), "'token' is not a version token")
    sample = _list(d.get("lost_sample"), "lost_sample")
    _require(len(sample) <= MAX_LOST_SAMPLE, "'lost_sample' is too long")
    return Status(
        token=token,
        round=_int(d, "round"),
        complete=_bool(d, "complete"),
        closed=_bool(d, "closed"),
        deadline_ms=_int(d, "deadline", optional=True),
        now_ms=_int(d, "now"),
        participants=_int(d, "participants"),
        world=_int(d, "world"),
        waiting=_int(d, "waiting"),
        redundant=_int(d, "redundant"),
        lost=_int(d, "lost"),
        finished=_int(d, "finished"),
        lost_sample=tuple(_node(k).key for k in sample),
        done=_int(d, "done") if "done" in d else 0,
    )


# -- rules ----------------------------------------------------------------------------------


def rules_to_json(rules: Rules) -> dict[str, Any]:
    """The JSON form of a run's ``rules``."""
    return {
        "min": rules.min_nodes,
        "max": rules.max_nodes,
        "last_call": rules.last_call_ms,
        "window": rules.window_ms,
    }


def _rules(d: dict[str, Any]) -> Rules:
    min_nodes, max_nodes = _int(d, "min", low=1), _int(d, "max", low=1)
    _require(min_nodes <= max_nodes, "'min' must not exceed 'max'")
    return Rules(min_nodes, max_nodes, _int(d, "last_call", low=1), _int(d, "window", low=1))


def rules_from_json(doc: Any) -> Rules | None:
    """The rules that ``doc`` describes (``None`` for ``null``).

    Raises:
        WireError: ``doc`` is neither rules nor ``null``.
    """
    if doc is None:
        return None
    return _rules(_obj(doc, "the rules"))


# -- requests and replies -------------------------------------------------------------------


def request_to_json(request: Request) -> dict[str, Any]:
    """The JSON form of ``request`` (``now_ms`` is never sent: servers use their clock; nor
    is ``operator``: only a backend makes an operator's request). A join's profile and a
    report travel with those requests only."""
    doc = {
        "op": request.op.value,
        "node": request.node.key,
        **rules_to_json(request.rules),
        "expired": request.expired,
        "finished": request.finished,
        "port": request.port,
        "secret": request.secret,
    }
    if request.op is Op.JOIN:
        doc["role"] = request.role
        doc["local_world_size"] = request.local_world_size
    if request.report is not None:
        doc["report"] = request.report.to_json()
    return doc


def request_from_json(doc: Any) -> Request:
    """The request that ``doc`` describes.

    Raises:
        WireError: ``doc`` is not a valid request.
    """
    d = _obj(doc, "a request")
    unknown = set(d) - _REQUEST_FIELDS
    if unknown:
        raise WireError(f"unknown field(s): {', '.join(sorted(map(repr, unknown)))}")
    try:
        op = Op(d.get("op"))
    except ValueError:
        op = Op.DEPART  # refused below with the list of the others
    if op is Op.DEPART:  # a backend's report, never a node's request
        ops = ", ".join(o.value for o in Op if o is not Op.DEPART)
        raise WireError(f"'op' must be one of {ops}")
    node, rules = _node(d.get("node")), _rules(d)
    port = _int(d, "port")
    _require(port <= 65535, "'port' must be a port number")
    expired, finished = _bool(d, "expired", False), _bool(d, "finished", False)
    _require(
        "secret" in d,
        "missing 'secret' (the node's secret of rendezvous state format 3): a node of an "
        "older aelastic? Run one aelastic version on the server and the nodes",
    )
    secret = d.get("secret")
    # Never echoed: a message naming a bad secret would show it.
    _require(
        type(secret) is str and _SECRET.match(secret) is not None,
        "'secret' must be the node's secret: 16 to 128 characters of [0-9A-Za-z_-]",
    )
    _require(
        op is not Op.JOIN or "local_world_size" in d,
        "missing 'local_world_size' (a join of rendezvous state format 4): a node of an older "
        "aelastic? Run one aelastic version on the server and the nodes",
    )
    role = d.get("role", "default")
    _require(
        type(role) is str and 0 < len(role) <= MAX_ROLE and role.isprintable(),
        f"'role' must be a name of 1 to {MAX_ROLE} printable characters",
    )
    local_world_size = _int(d, "local_world_size") if "local_world_size" in d else 1
    _require(
        1 <= local_world_size <= MAX_LOCAL_WORLD_SIZE,
        f"'local_world_size' must be 1 to {MAX_LOCAL_WORLD_SIZE}",
    )
    report = None
    if "report" in d:
        _require(op is Op.REPORT, "only a report carries 'report'")
        try:
            report = NodeReport.from_json(d["report"])
        except ValueError as exc:
            raise WireError(str(exc)) from None
    return Request(
        op=op,
        node=node,
        rules=rules,
        expired=expired,
        finished=finished,
        port=port,
        secret=str(secret),
        role=role,
        local_world_size=local_world_size,
        report=report,
    )


_REQUEST_FIELDS = frozenset(
    {
        "op",
        "node",
        "min",
        "max",
        "last_call",
        "window",
        "expired",
        "finished",
        "port",
        "secret",
        "role",
        "local_world_size",
        "report",
    }
)


def reply_to_json(reply: Reply) -> dict[str, Any]:
    """The JSON form of ``reply``."""
    return {
        "outcome": reply.outcome.value,
        "status": status_to_json(reply.status),
        "transition": reply.transition.value,
        "rank": reply.rank,
        "master_addr": reply.master_addr,
        "master_port": reply.master_port,
        "wake_at": reply.wake_at_ms,
        "restart": reply.restart_deadline,
        "known": reply.known,
        "oldest": reply.oldest_beat_ms,
        "pruned": reply.pruned,
        "rules": None if reply.run_rules is None else rules_to_json(reply.run_rules),
        "reopen_at": reply.reopen_at_ms,
        "placement": None if reply.placement is None else _placement_to_json(reply.placement),
    }


def _placement_to_json(placement: Placement) -> list[int]:
    return [placement.base, placement.world, placement.role_base, placement.role_world]


def _placement(value: Any) -> Placement | None:
    if value is None:
        return None
    _require(type(value) is list and len(value) == 4, "'placement' must be 4 integers")
    row = dict(zip(("base", "world", "role_base", "role_world"), value, strict=True))
    placement = Placement(*(_int(row, key) for key in row))
    _require(
        placement.base < placement.world and placement.role_base < placement.role_world,
        "'placement' must place the node within the world",
    )
    return placement


def reply_from_json(doc: Any) -> Reply:
    """The reply that ``doc`` describes.

    Raises:
        WireError: ``doc`` is not a valid reply.
    """
    d = _obj(doc, "a reply")
    try:
        outcome = Outcome(d.get("outcome"))
        transition = Transition(d.get("transition", "none"))
    except ValueError as exc:
        raise WireError(str(exc)) from None
    return Reply(
        outcome=outcome,
        status=status_from_json(d.get("status")),
        transition=transition,
        rank=_int(d, "rank", optional=True),
        master_addr=_str(d, "master_addr", optional=True),
        master_port=_int(d, "master_port", optional=True),
        wake_at_ms=_int(d, "wake_at", optional=True),
        restart_deadline=_bool(d, "restart", False),
        known=_bool(d, "known", False),
        oldest_beat_ms=_int(d, "oldest", optional=True),
        pruned=_int(d, "pruned"),
        run_rules=rules_from_json(d.get("rules")),
        reopen_at_ms=_int(d, "reopen_at", optional=True),
        placement=_placement(d.get("placement")),
    )


# -- snapshots ------------------------------------------------------------------------------


def snapshot_to_json(snapshot: Snapshot) -> dict[str, Any]:
    """The JSON form of ``snapshot``."""
    return {
        "status": status_to_json(snapshot.status),
        "participants": [[e.node.key, e.beat_ms, e.rank] for e in snapshot.participants],
        "wait_list": [[e.node.key, e.beat_ms] for e in snapshot.wait_list],
        "redundancy_list": [[e.node.key, e.beat_ms] for e in snapshot.redundancy_list],
        "master_addr": snapshot.master_addr,
        "master_port": snapshot.master_port,
        "rules": None if snapshot.rules is None else rules_to_json(snapshot.rules),
    }


def _entries(value: Any, what: str, ranked: bool) -> tuple[MemberEntry, ...]:
    entries = []
    for item in _list(value, what):
        _require(type(item) is list and len(item) in (2, 3), f"'{what}' entries are lists")
        rank = item[2] if ranked and len(item) == 3 else None
        row = {"beat": item[1], "rank": rank}
        entries.append(
            MemberEntry(_node(item[0]), _int(row, "beat"), _int(row, "rank", optional=True))
        )
    return tuple(entries)


def snapshot_from_json(doc: Any) -> Snapshot:
    """The snapshot that ``doc`` describes.

    Raises:
        WireError: ``doc`` is not a valid snapshot.
    """
    d = _obj(doc, "a snapshot")
    return Snapshot(
        status=status_from_json(d.get("status")),
        participants=_entries(d.get("participants"), "participants", True),
        wait_list=_entries(d.get("wait_list"), "wait_list", False),
        redundancy_list=_entries(d.get("redundancy_list"), "redundancy_list", False),
        master_addr=_str(d, "master_addr", optional=True),
        master_port=_int(d, "master_port", optional=True),
        rules=rules_from_json(d.get("rules")),
    )


# -- the job's health -----------------------------------------------------------------------


def health_to_json(health: JobHealth) -> dict[str, Any]:
    """The JSON form of the job's ``health``."""
    return health.to_json()


def health_from_json(doc: Any) -> JobHealth:
    """The job's health that ``doc`` describes.

    Raises:
        WireError: ``doc`` is not a health document of this version.
    """
    try:
        return JobHealth.from_json(doc)
    except ValueError as exc:
        raise WireError(str(exc)) from None
