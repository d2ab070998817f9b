"""How much the members' stores may hold: per value, per run, per client, on the server.

How it works: the engine counts the bytes each run's store holds (each entry its key's
characters, its value's bytes and 64 bytes of bookkeeping: :func:`~aelastic.backends._engine.
kv_entry_size`) and their sum over the runs. A store write is checked before it is applied,
in the same step of the event loop (nothing can come between): a value over ``max_value``
bytes, or a write that would grow the run's store past ``max_run_store``, the stores of the
runs its run's client or scoped token made past ``max_client_store`` (:meth:`.creations.
RunQuota.makers`: one client cannot take every store's room from the others), or every
store together past ``max_total_store``, is refused ``413`` naming the limit and its flag,
and changes nothing. A write that does not grow the store (a value replaced by one no larger, a
counter that keeps its width) always passes, so a full store can still be used; deleting
keys frees room. The server's memory for the stores is then bounded by ``max_total_store``
(plus what the requests being read hold: ``--max-body`` each).
"""

from __future__ import annotations

from collections import Counter

from aiohttp import web

from ...._engine import Engine, kv_entry_size
from .creations import RunQuota
from .limits import Quotas, Refused

__all__ = ["STORE_QUOTA", "StoreQuota"]


def _size(count: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if count >= 1 << shift:
            return f"{count / (1 << shift):.3g} {unit}"
    return f"{count} bytes"


class StoreQuota:
    """The stores' limits of one server (see the module docstring).

    Args:
        engine: The server's runs.
        quotas: The limits (``max_value``, ``max_run_store``, ``max_client_store``,
            ``max_total_store``).
        runs: Who made each run.
    """

    def __init__(self, engine: Engine, quotas: Quotas, runs: RunQuota) -> None:
        self.engine = engine
        self.quotas = quotas
        self.runs = runs
        #: Writes refused since the start, by limit (``value``, ``run``, ``client``,
        #: ``total``).
        self.refused: Counter[str] = Counter()

    def check_value(self, value: bytes) -> None:
        """Refuse a value over the limit per value.

        Raises:
            Refused: ``413``, naming the limit and ``--max-value-bytes``.
        """
        limit = self.quotas.max_value
        if limit and len(value) > limit:
            self.refused["value"] += 1
            raise Refused(
                413,
                f"a store value of {_size(len(value))} is over this server's limit of "
                f"{_size(limit)} a value (aelastic serve --max-value-bytes)",
            )

    def check_write(self, run_id: str, key: str, size: int) -> None:
        """Refuse setting ``key`` of run ``run_id``'s store to ``size`` bytes if the store
        would grow past its limit or the server's.

        Raises:
            Refused: ``413``, naming the limit and ``--max-store-bytes``,
                ``--max-client-store-bytes`` or ``--max-total-store-bytes``.
        """
        entry, run_bytes, total = self.engine.kv_usage(run_id, key)
        grown = kv_entry_size(key, size) - entry
        if grown <= 0:
            return
        quotas = self.quotas
        if quotas.max_run_store and run_bytes + grown > quotas.max_run_store:
            self.refused["run"] += 1
            raise Refused(
                413,
                f"the store of run {run_id!r} holds {_size(run_bytes)}; this write would take "
                f"it past its limit of {_size(quotas.max_run_store)} (aelastic serve "
                "--max-store-bytes): delete keys it no longer needs",
            )
        if quotas.max_client_store:
            for who, held in self.runs.makers(run_id):
                if held + grown > quotas.max_client_store:
                    self.refused["client"] += 1
                    raise Refused(
                        413,
                        f"the stores of the runs {who} made hold {_size(held)}; this write "
                        f"to run {run_id!r} would take them past the limit of "
                        f"{_size(quotas.max_client_store)} (aelastic serve "
                        "--max-client-store-bytes): delete keys or runs it no longer needs",
                    )
        if quotas.max_total_store and total + grown > quotas.max_total_store:
            self.refused["total"] += 1
            raise Refused(
                413,
                f"the stores of this server's runs hold {_size(total)}; this write would "
                f"take them past the server's limit of {_size(quotas.max_total_store)} "
                "(aelastic serve --max-total-store-bytes)",
            )


#: The server's :class:`StoreQuota`.
STORE_QUOTA = web.AppKey("aelastic_store_quota", StoreQuota)
