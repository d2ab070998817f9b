"""etcd's v3 messages on the wire (protocol buffers), kept in the JSON API's shape.

How it works: the backend's modules build requests and read answers as etcd's JSON API
has them (grpc-gateway's mapping: field names as in etcd's ``rpc.proto``, bytes in
base64, 64-bit integers as strings, enums by name, zero values left out); this module
carries them to and from the protocol buffers etcd's gRPC API takes. A message's schema
is a dict of its fields (name: number, kind, nested schema); :func:`encode` writes a
JSON-shaped dict as protobuf, :func:`decode` reads protobuf into one. :data:`METHODS`
maps a JSON API path to its gRPC method and its request and answer schemas. Unknown
fields of an answer are skipped (a newer etcd); a request field the schema lacks is a
programming error (``KeyError``).

Only the messages and fields the backend uses are here (etcd 3.4's ``rpc.proto`` and
``kv.proto``); adding one is a line of its schema.
"""

from __future__ import annotations

import base64
from typing import Any, NamedTuple

__all__ = ["METHODS", "Method", "ProtoError", "decode", "encode"]


class ProtoError(ValueError):
    """Bytes that are not a valid protobuf message."""


# Field kinds.
BYTES, I64, U64, I32, BOOL, STR, ENUM, MSG = range(8)


def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64
    if value < 128:
        return bytes((value,))
    out = bytearray()
    while value >= 128:
        out.append(value & 127 | 128)
        value >>= 7
    out.append(value)
    return bytes(out)


class Field(NamedTuple):
    name: str
    number: int
    kind: int
    sub: Any = None  # a message's schema, or an enum's names
    repeated: bool = False
    key: bytes = b""  # the field's key on the wire (set by _schema)


Schema = dict[int, Field]


def _schema(*fields: Field) -> Schema:
    # A number's key says varint (a repeated one is written unpacked, one key each), bytes'
    # and messages' length-delimited.
    return {f.number: f._replace(key=_varint(f.number << 3 | (2 * (f.kind in (BYTES, STR, MSG)))))
            for f in fields}  # fmt: skip


HEADER = _schema(
    Field("cluster_id", 1, U64), Field("member_id", 2, U64),
    Field("revision", 3, I64), Field("raft_term", 4, U64),
)  # fmt: skip
KV = _schema(
    Field("key", 1, BYTES), Field("create_revision", 2, I64), Field("mod_revision", 3, I64),
    Field("version", 4, I64), Field("value", 5, BYTES), Field("lease", 6, I64),
)  # fmt: skip
RANGE = _schema(
    Field("key", 1, BYTES), Field("range_end", 2, BYTES), Field("limit", 3, I64),
    Field("revision", 4, I64),
    Field("sort_order", 5, ENUM, ("NONE", "ASCEND", "DESCEND")),
    Field("sort_target", 6, ENUM, ("KEY", "VERSION", "CREATE", "MOD", "VALUE")),
    Field("serializable", 7, BOOL), Field("keys_only", 8, BOOL), Field("count_only", 9, BOOL),
    Field("min_mod_revision", 10, I64), Field("max_mod_revision", 11, I64),
    Field("min_create_revision", 12, I64), Field("max_create_revision", 13, I64),
)  # fmt: skip
RANGE_ANSWER = _schema(
    Field("header", 1, MSG, HEADER), Field("kvs", 2, MSG, KV, True),
    Field("more", 3, BOOL), Field("count", 4, I64),
)  # fmt: skip
PUT = _schema(
    Field("key", 1, BYTES), Field("value", 2, BYTES), Field("lease", 3, I64),
    Field("prev_kv", 4, BOOL), Field("ignore_value", 5, BOOL), Field("ignore_lease", 6, BOOL),
)  # fmt: skip
PUT_ANSWER = _schema(Field("header", 1, MSG, HEADER), Field("prev_kv", 2, MSG, KV))
DELETE = _schema(Field("key", 1, BYTES), Field("range_end", 2, BYTES), Field("prev_kv", 3, BOOL))
DELETE_ANSWER = _schema(
    Field("header", 1, MSG, HEADER), Field("deleted", 2, I64),
    Field("prev_kvs", 3, MSG, KV, True),
)  # fmt: skip
COMPARE = _schema(
    Field("result", 1, ENUM, ("EQUAL", "GREATER", "LESS", "NOT_EQUAL")),
    Field("target", 2, ENUM, ("VERSION", "CREATE", "MOD", "VALUE", "LEASE")),
    Field("key", 3, BYTES), Field("version", 4, I64), Field("create_revision", 5, I64),
    Field("mod_revision", 6, I64), Field("value", 7, BYTES), Field("lease", 8, I64),
    Field("range_end", 64, BYTES),
)  # fmt: skip
# A oneof field is written even when zero (mod_revision 0: "the key does not exist").
ONEOF_COMPARE = frozenset(("version", "create_revision", "mod_revision", "value", "lease"))
REQUEST_OP: Schema = {}
RESPONSE_OP: Schema = {}
TXN = _schema(
    Field("compare", 1, MSG, COMPARE, True), Field("success", 2, MSG, REQUEST_OP, True),
    Field("failure", 3, MSG, REQUEST_OP, True),
)  # fmt: skip
TXN_ANSWER = _schema(
    Field("header", 1, MSG, HEADER), Field("succeeded", 2, BOOL),
    Field("responses", 3, MSG, RESPONSE_OP, True),
)  # fmt: skip
REQUEST_OP.update(
    _schema(
        Field("request_range", 1, MSG, RANGE),
        Field("request_put", 2, MSG, PUT),
        Field("request_delete_range", 3, MSG, DELETE),
        Field("request_txn", 4, MSG, TXN),
    )
)
RESPONSE_OP.update(
    _schema(
        Field("response_range", 1, MSG, RANGE_ANSWER),
        Field("response_put", 2, MSG, PUT_ANSWER),
        Field("response_delete_range", 3, MSG, DELETE_ANSWER),
        Field("response_txn", 4, MSG, TXN_ANSWER),
    )
)
LEASE_ID = _schema(Field("ID", 1, I64))
GRANT = _schema(Field("TTL", 1, I64), Field("ID", 2, I64))
GRANT_ANSWER = _schema(
    Field("header", 1, MSG, HEADER), Field("ID", 2, I64), Field("TTL", 3, I64),
    Field("error", 4, STR),
)  # fmt: skip
HEADER_ONLY = _schema(Field("header", 1, MSG, HEADER))
KEEP_ALIVE_ANSWER = _schema(
    Field("header", 1, MSG, HEADER), Field("ID", 2, I64), Field("TTL", 3, I64)
)
TIME_TO_LIVE = _schema(Field("ID", 1, I64), Field("keys", 2, BOOL))
TIME_TO_LIVE_ANSWER = _schema(
    Field("header", 1, MSG, HEADER), Field("ID", 2, I64), Field("TTL", 3, I64),
    Field("grantedTTL", 4, I64), Field("keys", 5, BYTES, None, True),
)  # fmt: skip
WATCH_CREATE = _schema(
    Field("key", 1, BYTES), Field("range_end", 2, BYTES), Field("start_revision", 3, I64),
    Field("progress_notify", 4, BOOL), Field("filters", 5, ENUM, ("NOPUT", "NODELETE"), True),
    Field("prev_kv", 6, BOOL), Field("watch_id", 7, I64), Field("fragment", 8, BOOL),
)  # fmt: skip
WATCH = _schema(
    Field("create_request", 1, MSG, WATCH_CREATE),
    Field("cancel_request", 2, MSG, _schema(Field("watch_id", 1, I64))),
    Field("progress_request", 3, MSG, {}),
)  # fmt: skip
EVENT = _schema(
    Field("type", 1, ENUM, ("PUT", "DELETE")), Field("kv", 2, MSG, KV),
    Field("prev_kv", 3, MSG, KV),
)  # fmt: skip
WATCH_ANSWER = _schema(
    Field("header", 1, MSG, HEADER), Field("watch_id", 2, I64), Field("created", 3, BOOL),
    Field("canceled", 4, BOOL), Field("compact_revision", 5, I64),
    Field("cancel_reason", 6, STR), Field("fragment", 7, BOOL),
    Field("events", 11, MSG, EVENT, True),
)  # fmt: skip
STATUS_ANSWER = _schema(
    Field("header", 1, MSG, HEADER), Field("version", 2, STR), Field("dbSize", 3, I64),
    Field("leader", 4, U64), Field("raftIndex", 5, U64), Field("raftTerm", 6, U64),
    Field("raftAppliedIndex", 7, U64), Field("errors", 8, STR, None, True),
    Field("dbSizeInUse", 9, I64), Field("isLearner", 10, BOOL),
)  # fmt: skip
AUTHENTICATE = _schema(Field("name", 1, STR), Field("password", 2, STR))
AUTHENTICATE_ANSWER = _schema(Field("header", 1, MSG, HEADER), Field("token", 2, STR))


class Method(NamedTuple):
    """A gRPC method: its path, request and answer schemas, whether it is a stream."""

    path: str
    request: Schema
    answer: Schema
    stream: bool = False


#: JSON API path: gRPC method.
METHODS: dict[str, Method] = {
    "/v3/kv/range": Method("/etcdserverpb.KV/Range", RANGE, RANGE_ANSWER),
    "/v3/kv/put": Method("/etcdserverpb.KV/Put", PUT, PUT_ANSWER),
    "/v3/kv/deleterange": Method("/etcdserverpb.KV/DeleteRange", DELETE, DELETE_ANSWER),
    "/v3/kv/txn": Method("/etcdserverpb.KV/Txn", TXN, TXN_ANSWER),
    "/v3/lease/grant": Method("/etcdserverpb.Lease/LeaseGrant", GRANT, GRANT_ANSWER),
    "/v3/lease/revoke": Method("/etcdserverpb.Lease/LeaseRevoke", LEASE_ID, HEADER_ONLY),
    "/v3/lease/keepalive": Method(
        "/etcdserverpb.Lease/LeaseKeepAlive", LEASE_ID, KEEP_ALIVE_ANSWER, True
    ),
    "/v3/lease/timetolive": Method(
        "/etcdserverpb.Lease/LeaseTimeToLive", TIME_TO_LIVE, TIME_TO_LIVE_ANSWER
    ),
    "/v3/watch": Method("/etcdserverpb.Watch/Watch", WATCH, WATCH_ANSWER, True),
    "/v3/maintenance/status": Method("/etcdserverpb.Maintenance/Status", {}, STATUS_ANSWER),
    "/v3/auth/authenticate": Method(
        "/etcdserverpb.Auth/Authenticate", AUTHENTICATE, AUTHENTICATE_ANSWER
    ),
}

_BY_NAME: dict[int, dict[str, Field]] = {}


def _names(schema: Schema) -> dict[str, Field]:
    found = _BY_NAME.get(id(schema))
    if found is None:
        found = _BY_NAME[id(schema)] = {f.name: f for f in schema.values()}
    return found


def _scalar(field: Field, value: Any) -> int | bytes:
    """A field's value on the wire: an int (varint) or bytes (length-delimited)."""
    kind = field.kind
    if kind == BYTES:
        return base64.b64decode(value) if isinstance(value, str) else bytes(value)
    if kind == STR:
        return str(value).encode()
    if kind == BOOL:
        return int(bool(value))
    if kind == ENUM:
        return value if isinstance(value, int) else field.sub.index(value)
    return int(value)


def encode(schema: Schema, doc: dict[str, Any]) -> bytes:
    """``doc`` (JSON-shaped, see the module docstring) as a protobuf message."""
    names = _names(schema)
    out = bytearray()
    for name, value in doc.items():
        if value is None:
            continue
        field = names[name]
        for item in value if field.repeated else (value,):
            if field.kind == MSG:
                data: int | bytes = encode(field.sub, item)
            else:
                data = _scalar(field, item)
                if (
                    not data
                    and not field.repeated
                    and not (schema is COMPARE and name in ONEOF_COMPARE)
                ):
                    continue  # proto3 leaves zero values out
            if isinstance(data, int):
                out += field.key
                out += bytes((data,)) if 0 <= data < 128 else _varint(data)
            else:
                out += field.key
                out += _varint(len(data))
                out += data
    return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ProtoError("a truncated or oversized varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 127) << shift
        shift += 7
        if not byte & 128:
            return value, pos


def decode(schema: Schema, data: bytes) -> dict[str, Any]:
    """A protobuf message as a JSON-shaped dict (see the module docstring).

    Raises:
        ProtoError: ``data`` is not a valid message.
    """
    doc: dict[str, Any] = {}
    pos, end = 0, len(data)
    while pos < end:
        tag = data[pos]  # one byte, but for field numbers over 15
        if tag < 128:
            pos += 1
        else:
            tag, pos = _read_varint(data, pos)
        number, wire = tag >> 3, tag & 7
        raw: int | bytes
        if wire == 0:
            if pos < end and data[pos] < 128:  # the common case: a small number
                raw, pos = data[pos], pos + 1
            else:
                raw, pos = _read_varint(data, pos)
        elif wire == 2:
            if pos < end and data[pos] < 128:
                size, pos = data[pos], pos + 1
            else:
                size, pos = _read_varint(data, pos)
            if pos + size > end:
                raise ProtoError("a truncated field")
            raw, pos = data[pos : pos + size], pos + size
        elif wire == 1 or wire == 5:
            pos += 8 if wire == 1 else 4
            continue  # no fixed-size field in etcd's messages: skipped
        else:
            raise ProtoError(f"wire type {wire}")
        field = schema.get(number)
        if field is None:
            continue  # a field this client does not know
        if field.repeated and isinstance(raw, bytes) and field.kind not in (MSG, BYTES, STR):
            values: list[Any] = []  # a packed repeated scalar
            p = 0
            while p < len(raw):
                item, p = _read_varint(raw, p)
                values.append(_value(field, item))
            doc.setdefault(field.name, []).extend(values)
            continue
        value = _value(field, raw)
        if field.repeated:
            doc.setdefault(field.name, []).append(value)
        else:
            doc[field.name] = value
    return doc


def _value(field: Field, raw: int | bytes) -> Any:
    kind = field.kind
    if kind == MSG:
        if not isinstance(raw, bytes):
            raise ProtoError(f"field {field.name}: a number where a message belongs")
        return decode(field.sub, raw)
    if isinstance(raw, bytes):
        if kind == BYTES:
            return base64.b64encode(raw).decode("ascii")
        if kind == STR:
            return raw.decode("utf-8", "replace")
        raise ProtoError(f"field {field.name}: bytes where a number belongs")
    if kind == BOOL:
        return bool(raw)
    if kind == ENUM:
        names = field.sub
        return names[raw] if raw < len(names) else raw
    if kind == I64:
        return str(raw - (1 << 64) if raw >= 1 << 63 else raw)
    if kind == U64:
        return str(raw)
    return raw - (1 << 64) if raw >= 1 << 63 else raw  # I32 (negative: 10-byte varint)
