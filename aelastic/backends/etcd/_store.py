"""The members' key-value store on etcd (torch's ``EtcdStore``): one key per store key.

How it works: store key ``k`` of a run is the etcd key ``<prefix>/<run>/kv/k``. ``set`` is a
put, ``get`` one transaction of ranges, ``delete`` a delete. ``add`` reads the value and
writes the sum in a transaction compared against the read (retried when another add came
first), with a record of its result under ``op/<id>`` kept by a lease for ten minutes: an
add retried after its answer was lost finds the record and never counts twice.
``compare_set`` is one transaction on the value (or the key's absence). Waiters are woken by
the run's watch (every store write is an event of its ``kv/`` range), and re-check with etcd
every ``recheck_interval`` besides.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from typing import Any

from ...core.errors import RendezvousConnectionError
from .._engine import add_int64
from ._client import EtcdClient, LeaseNotFound, b64, unb64
from ._layout import RunKeys
from ._ranges import range_op

__all__ = ["KeyValue"]

#: How long the result of an add is kept (seconds).
_OP_TTL = 600


def _value(response: dict[str, Any]) -> tuple[bytes | None, int]:
    kvs = response.get("response_range", {}).get("kvs", [])
    if not kvs:
        return None, 0
    return unb64(kvs[0].get("value")), int(kvs[0].get("mod_revision", 0))


class KeyValue:
    """The store operations of one run (see the module docstring)."""

    def __init__(self, client: EtcdClient, keys: RunKeys) -> None:
        self._client = client
        self._keys = keys
        self._op_lease: tuple[int, float] | None = None

    async def set(self, key: str, value: bytes) -> None:
        body = {"key": b64(self._keys.kv(key)), "value": b64(value)}
        await self._client.call("/v3/kv/put", body, "store set")

    async def get(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        body = {"success": [range_op(self._keys.kv(k)) for k in keys]}
        answer = await self._client.call("/v3/kv/txn", body, "store get")
        return [_value(r)[0] for r in answer.get("responses", [])]

    async def count_present(self, keys: Sequence[str]) -> int:
        body = {"success": [range_op(self._keys.kv(k), count_only=True) for k in keys]}
        answer = await self._client.call("/v3/kv/txn", body, "store wait")
        return sum(
            int(r.get("response_range", {}).get("count", 0)) > 0
            for r in answer.get("responses", [])
        )

    async def _lease(self) -> int:
        lease = self._op_lease
        if lease is None or time.monotonic() - lease[1] > _OP_TTL / 2:
            answer = await self._client.call("/v3/lease/grant", {"TTL": _OP_TTL}, "lease grant")
            lease = self._op_lease = (int(answer.get("ID", 0)), time.monotonic())
        return lease[0]

    async def add(self, key: str, amount: int) -> int:
        full, op = self._keys.kv(key), self._keys.op(secrets.token_hex(12))
        current, mod = _value((await self._client.call(
            "/v3/kv/txn", {"success": [range_op(full)]}, "store add"
        )).get("responses", [{}])[0])  # fmt: skip
        for _ in range(1000):
            total = add_int64(current, amount, key)
            lease = await self._lease()
            body = {
                "compare": [{"key": b64(full), "target": "MOD", "result": "EQUAL",
                             "mod_revision": mod}],
                "success": [
                    {"request_put": {"key": b64(full), "value": b64(str(total))}},
                    {"request_put": {"key": b64(op), "value": b64(str(total)), "lease": lease}},
                ],
                "failure": [range_op(full), range_op(op)],
            }  # fmt: skip
            try:
                answer = await self._client.call("/v3/kv/txn", body, "store add")
            except LeaseNotFound:
                self._op_lease = None
                continue
            if answer.get("succeeded"):
                return total
            responses = answer.get("responses", [])
            done, _ = _value(responses[1])
            if done is not None:  # this add went through, its answer was lost
                return int(done)
            current, mod = _value(responses[0])
        raise RendezvousConnectionError(f"etcd at {self._client.display}: add of {key!r} starved")

    async def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes:
        full = b64(self._keys.kv(key))
        if expected is None:
            compare = {"key": full, "target": "CREATE", "result": "EQUAL", "create_revision": 0}
        else:
            compare = {"key": full, "target": "VALUE", "result": "EQUAL", "value": b64(expected)}
        body = {
            "compare": [compare],
            "success": [{"request_put": {"key": full, "value": b64(desired)}}],
            "failure": [{"request_range": {"key": full}}],
        }
        answer = await self._client.call("/v3/kv/txn", body, "store compare_set")
        if answer.get("succeeded"):
            return desired
        current, _ = _value(answer.get("responses", [{}])[0])
        if current is None:
            return expected if expected is not None else desired
        return current

    async def delete(self, key: str) -> bool:
        body = {"key": b64(self._keys.kv(key))}
        answer = await self._client.call("/v3/kv/deleterange", body, "store delete")
        return int(answer.get("deleted", 0)) > 0
