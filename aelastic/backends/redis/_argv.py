"""The arguments of the rendezvous script (:mod:`._lua`'s ``OP``) for one request.

How it works: one list of plain values, in the order the script reads them (``ARGV``):
the request's fields, then what only some requests carry, so that a heartbeat sends no more
than it needs: a keep-alive's beat key, a departure's moment, and from ``ARGV[20]`` on a
join's worker role and local world size, or a report (``failure`` and its fields, or
``quarantine`` and its reason). Texts a worker wrote (a role, a failure's message, a
reason) go as UTF-8 bytes with Python's ``surrogatepass`` (a message read from a worker's
stderr may hold lone surrogates): the script stores them as they are, and
:mod:`._health` reads them back the same way. A failure's time goes as ``repr`` of the float
(its shortest exact text): the script keeps that text, so it comes back exactly.
"""

from __future__ import annotations

from ...core.state import Op, Request

__all__ = ["op_args", "text"]


def text(value: str) -> bytes:
    """``value`` as the script stores it (UTF-8, lone surrogates kept)."""
    return value.encode("utf-8", "surrogatepass")


def op_args(
    request: Request,
    *,
    now_ms: int | None,
    epoch: str,
    ttl_ms: str,
    channel: str,
    follow_primary: bool,
    beat_key: str,
) -> list[str | int | bytes]:
    """``ARGV`` of the rendezvous script for ``request``.

    Args:
        now_ms: The time to decide at (``None``: the server's clock; tests pass their own).
        epoch: A new epoch, should the request make the run or find a failover.
        ttl_ms: How long the run's keys live after their last write.
        channel: The run's pub/sub channel.
        follow_primary: Move to a new epoch when the primary's replication id changed.
        beat_key: A keep-alive's beat key (``''``: the whole answer).
    """
    rules = request.rules
    args: list[str | int | bytes] = [
        request.op.value,
        request.node.key,
        rules.min_nodes,
        rules.max_nodes,
        rules.last_call_ms,
        rules.window_ms,
        "1" if request.expired else "0",
        "1" if request.finished else "0",
        request.port,
        "" if now_ms is None else now_ms,
        epoch,
        ttl_ms,
        channel,
        "1" if follow_primary else "0",
        request.secret,
        "1" if request.operator else "0",
    ]
    op, report = request.op, request.report
    if op is Op.JOIN:
        args += ["", "", "", text(request.role), request.local_world_size]
    elif op is Op.REPORT and report is not None:
        args += ["", "", ""]
        failure = report.failure
        if failure is None:
            args += ["quarantine", text(report.quarantine or "")]
        else:
            args += [
                "failure",
                repr(float(failure.time)),
                failure.rank,
                failure.local_rank,
                failure.exitcode,
                text(failure.message),
                "1" if failure.stalled else "0",
                "1" if failure.secondary else "0",
            ]
    elif request.since_ms is not None:
        args += [beat_key, request.since_ms, "1" if request.confirmed else "0"]
    elif beat_key:
        args.append(beat_key)
    return args
