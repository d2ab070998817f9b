"""The write transactions of a request on etcd, in the shape of etcd's JSON API (keys and
values in base64; :mod:`._proto` puts them on the wire).

How it works: :func:`write_txn` turns a decided :class:`~._port.Plan` into one transaction
compared against the read it was decided on (the header's mod revision, but for a member
leaving its complete round without rewriting it; the node's own keys, the health key's when
it writes it, and when the plan used the participants' count, that no participant joined
since);
:func:`first_join_txn` is a node's first join, one transaction and no read, which creates
the run or joins its round 0. Pure: :class:`~._apply.RunPort` sends them and reads the
answers.
"""

from __future__ import annotations

from typing import Any

from ...core.state import NodeDesc, Request
from ._answers import b64
from ._layout import Header, RunKeys, encode_header, fresh_tag, member_value, prefix_end
from ._plan import LISTS, Plan, View
from ._ranges import range_op

__all__ = ["first_join_txn", "write_txn"]


def write_txn(
    k: RunKeys, view: View, plan: Plan, node: NodeDesc, lease: int | None, count: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The compare and the writes of ``plan``, decided for ``node`` on ``view``: the header
    (but for a plan on the node's own keys alone, ``own_only``), the node's three keys and,
    when the plan used the participants' count (``guard``), that no participant joined since
    the read; ``count`` adds a blind join's count of the
    participants, and a plan that fixes the cut and wants a rank, the node's rank and the
    profile marks (:mod:`._control`)."""
    compare: list[dict[str, Any]] = []
    if not plan.own_only:
        compare.append(
            {"key": b64(k.header), "target": "MOD", "result": "EQUAL",
             "mod_revision": view.header_mod}
        )  # fmt: skip
    for where in LISTS:
        member = view.own.get(where)
        compare.append(
            {
                "key": b64(k.member(where, node)),
                "target": "MOD",
                "result": "EQUAL",
                "mod_revision": 0 if member is None else member.mod,
            }
        )
    if plan.health is not None and not plan.reset_health:
        compare.append(
            {"key": b64(k.health), "target": "MOD", "result": "EQUAL",
             "mod_revision": plan.health_mod}
        )  # fmt: skip
    if plan.guard:
        compare.append(
            {"key": b64(k.participants), "range_end": b64(prefix_end(k.participants)),
             "target": "CREATE", "result": "LESS", "create_revision": view.revision + 1}
        )  # fmt: skip
    ops: list[dict[str, Any]] = []
    for mark in ("q", "l"):  # before the participant's delete: a leave's mark (no lease)
        if mark in plan.put:
            ops.append({"request_put": {"key": b64(k.member(mark, node)), "value": ""}})
    for where in plan.delete:
        ops.append({"request_delete_range": {"key": b64(k.member(where, node))}})
    for key in plan.extras:
        ops.append({"request_delete_range": {"key": b64(key)}})
        mark = k.profiles + key[len(k.participants) :]
        ops.append({"request_delete_range": {"key": b64(mark)}})
    for where, value in plan.put.items():
        if where not in ("q", "l"):
            put = {"key": b64(k.member(where, node)), "value": b64(value), "lease": lease}
            ops.append({"request_put": put})
    h = view.header
    untouched = h is not None and view.header_mod == view.header_create  # round 0 forming
    if "p" in plan.put and plan.header is None and untouched and h and h.rules:
        # The run's "begun" key on this joiner's lease (see first_join_txn): a join through
        # a read keeps the first joins' fast path open.
        tag = b64(fresh_tag(h.rules, h.profile))
        ops.append({"request_put": {"key": b64(k.fresh), "value": tag, "lease": lease}})
    if plan.header is not None:
        header = plan.header.evolve(accounted=view.revision)
        ops.append({"request_put": {"key": b64(k.header), "value": b64(encode_header(header))}})
        ops.append({"request_delete_range": {"key": b64(k.fresh)}})
    if plan.mark_cut:
        round_ = b"" if plan.header is None else str(plan.header.round).encode()
        ops.append({"request_put": {"key": b64(k.cut), "value": b64(round_)}})
    if plan.clear_marks:
        ops.extend(
            {"request_delete_range": {"key": b64(marks), "range_end": b64(prefix_end(marks))}}
            for marks in (k.finished, k.left)
        )
    ops.extend(_health_ops(k, plan, node))
    if count:  # a blind join's count (see _apply's _follow_up): O(N), in etcd's apply loop
        ops.append(range_op(k.participants, prefix_end(k.participants), count_only=True))
    if plan.rank and plan.mark_cut:
        ops.append(range_op(k.participants, k.member("p", node), count_only=True))
        ops.append(range_op(k.profiles, prefix_end(k.profiles)))
    return compare, ops


def _health_ops(k: RunKeys, plan: Plan, node: NodeDesc) -> list[dict[str, Any]]:
    """The writes of the job's health: the node's failure mark, the document, the marks of
    an older incident; or, for a new run, none of them."""
    if plan.reset_health:
        return [
            {"request_delete_range": {"key": b64(k.health)}},
            {"request_delete_range": {"key": b64(k.failures),
                                      "range_end": b64(prefix_end(k.failures))}},
        ]  # fmt: skip
    ops: list[dict[str, Any]] = []
    if plan.fail_mark is not None:
        ops.append({"request_put": {"key": b64(k.failure(plan.fail_mark, node)), "value": ""}})
    if plan.drop_failed is not None:
        old = k.failed(plan.drop_failed)
        ops.append({"request_delete_range": {"key": b64(old), "range_end": b64(prefix_end(old))}})
    if plan.health is not None:
        ops.append({"request_put": {"key": b64(k.health), "value": b64(plan.health.encode())}})
    return ops


def first_join_txn(k: RunKeys, request: Request, fresh: Header, lease: str) -> dict[str, Any]:
    """The transaction of ``request``, a node's first join, on ``lease``: it creates the run
    (the header ``fresh`` and ``b``) if there is none, or else joins round 0 while the run
    is as its creator left it (see :meth:`~._apply.RunPort.first_join`); its ranges read
    the header and count the lists (the participants only when it creates the run)."""
    node, rules = request.node, request.rules
    tag = fresh_tag(rules, fresh.profile)
    absent = [
        {
            "key": b64(k.member(w, node)),
            "target": "MOD",
            "result": "EQUAL",
            "mod_revision": 0,
        }
        for w in LISTS
    ]
    value = member_value(request.port, request.secret)
    mine = {"key": b64(k.member("p", node)), "value": b64(value)}
    me = {"request_put": {**mine, "lease": lease}}
    # The run's "begun" key, on this joiner's lease: the run is not empty while it lives.
    begun = {"request_put": {"key": b64(k.fresh), "value": b64(tag), "lease": lease}}
    counts = [
        range_op(p, prefix_end(p), count_only=True)
        for p in (k.participants, k.waiting, k.redundant, k.finished)
    ]  # a run's creator counts its participants in the write (it is the one)
    body = {
        "compare": [
            {"key": b64(k.header), "target": "CREATE", "result": "EQUAL",
             "create_revision": 0}, *absent,
        ],
        "success": [
            {"request_put": {"key": b64(k.header), "value": b64(encode_header(fresh))}},
            begun, me, range_op(k.header), *counts,
        ],
        "failure": [{"request_txn": {
            "compare": [
                {"key": b64(k.fresh), "target": "VALUE", "result": "EQUAL",
                 "value": b64(tag)},
                {"key": b64(k.header), "target": "VERSION", "result": "EQUAL",
                 "version": 1},
                *absent,
            ],
            "success": [me, begun, range_op(k.header), *counts[1:]],
        }}],
    }  # fmt: skip
    return body
