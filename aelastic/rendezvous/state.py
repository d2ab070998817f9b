"""The shared rendezvous state and its wire format.

How it works: the state of one run is a frozen value (``RendezvousState``). It travels
between nodes as versioned JSON (``encode_state`` / ``decode_state``), never pickle.
Decoding validates every field and raises ``RendezvousStateError`` on anything that is
not a state this version wrote, so a foreign or corrupt value is reported, never
overwritten. Decoding is cached per payload: nodes that read the same bytes share one
decoded value (states are immutable, so sharing is safe).
"""

from __future__ import annotations

import functools
import json
import math
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

from .api import RendezvousStateError

__all__ = [
    "FORMAT",
    "NodeDesc",
    "RendezvousState",
    "decode_state",
    "encode_state",
    "millis",
]

#: Format tag written into every state; a payload without it is foreign.
FORMAT = "aelastic.rendezvous.state"
#: Version of the wire format; a newer or older one is refused.
FORMAT_VERSION = 1

_EMPTY_RANKS: Mapping[NodeDesc, int] = MappingProxyType({})
_EMPTY_BEATS: Mapping[NodeDesc, float] = MappingProxyType({})


class NodeDesc(NamedTuple):
    """A node of the rendezvous: its address, its process id and a process-wide counter.

    A tuple, so that hashing and ordering (ranks follow the sorted order) run at C speed.
    """

    addr: str
    pid: int
    local_id: int

    def __str__(self) -> str:
        return f"{self.addr}_{self.pid}_{self.local_id}"


@dataclass(frozen=True)
class RendezvousState:
    """The state shared by the nodes of one run (torch's ``_RendezvousState``).

    ``deadline`` and heartbeats are wall-clock seconds (``time.time()`` of the writer).
    ``participants`` maps a node to its rank; ranks are 0 until the round completes.
    """

    round: int = 0
    complete: bool = False
    deadline: float | None = None
    closed: bool = False
    participants: Mapping[NodeDesc, int] = field(default_factory=lambda: _EMPTY_RANKS)
    wait_list: frozenset[NodeDesc] = frozenset()
    redundancy_list: frozenset[NodeDesc] = frozenset()
    last_heartbeats: Mapping[NodeDesc, float] = field(default_factory=lambda: _EMPTY_BEATS)

    def __repr__(self) -> str:
        ranks = ", ".join(f"{n}:{r}" for n, r in sorted(self.participants.items()))
        return (
            f"<RendezvousState round={self.round} complete={self.complete} "
            f"closed={self.closed} deadline={self.deadline} participants=[{ranks}] "
            f"waiting={len(self.wait_list)} redundant={len(self.redundancy_list)}>"
        )

    def knows(self, node: NodeDesc) -> bool:
        """Whether ``node`` is anywhere in the state (participant, waiting, redundant)."""
        return node in self.participants or node in self.wait_list or node in self.redundancy_list


def millis(seconds: float) -> float:
    """``seconds`` at the wire's precision (whole milliseconds), exactly as decoding gives it."""
    return round(seconds * 1000) / 1000


@functools.lru_cache(maxsize=1 << 16)
def _node_head(node: NodeDesc) -> str:
    """JSON of ``[addr, pid, local_id`` without the closing bracket (cached per node)."""
    return json.dumps(list(node), separators=(",", ":"))[:-1]


def _ms(value: float) -> int:
    if not math.isfinite(value):
        raise ValueError(f"cannot encode a non-finite time {value!r}")
    return round(value * 1000)


def encode_state(state: RendezvousState) -> bytes:
    """Serialize ``state`` to its versioned JSON wire form.

    One entry per node, carrying its heartbeat in whole milliseconds; built from cached
    per-node fragments, so a state of N nodes encodes in O(N) string joins.

    Raises:
        ValueError: A listed node has no heartbeat, or a heartbeat belongs to no listed node.
    """
    head = _node_head
    beats = state.last_heartbeats
    listed = len(state.participants) + len(state.wait_list) + len(state.redundancy_list)
    if len(beats) != listed:
        raise ValueError("every listed node, and only those, must have a heartbeat")
    try:
        participants = ",".join(
            [f"{head(n)},{r},{round(beats[n] * 1000)}]" for n, r in state.participants.items()]
        )
        waiting = ",".join([f"{head(n)},{round(beats[n] * 1000)}]" for n in state.wait_list])
        redundant = ",".join(
            [f"{head(n)},{round(beats[n] * 1000)}]" for n in state.redundancy_list]
        )
    except KeyError as exc:
        raise ValueError(f"node {exc.args[0]} has no heartbeat") from None
    deadline = "null" if state.deadline is None else str(_ms(state.deadline))
    data = (
        f'{{"format":"{FORMAT}","version":{FORMAT_VERSION},"round":{int(state.round)},'
        f'"complete":{"true" if state.complete else "false"},'
        f'"closed":{"true" if state.closed else "false"},"deadline_ms":{deadline},'
        f'"participants":[{participants}],"wait_list":[{waiting}],'
        f'"redundancy_list":[{redundant}]}}'
    ).encode()
    _remember(data, state)
    return data


class _Invalid(Exception):
    pass


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise _Invalid(what)


def _int(value: Any, what: str) -> int:
    _expect(type(value) is int and value >= 0, f"{what} must be a non-negative integer")
    return int(value)


def _entries(
    value: Any, what: str, fields: int, beats: dict[NodeDesc, float]
) -> list[tuple[NodeDesc, list[Any]]]:
    """Parse ``[addr, pid, local_id, ..., beat_ms]`` entries; record each node's heartbeat."""
    _expect(type(value) is list, f"{what} must be a list")
    parsed = []
    for item in value:
        _expect(type(item) is list and len(item) == fields, f"{what} entries have {fields} fields")
        addr, pid, local_id = item[0], item[1], item[2]
        _expect(type(addr) is str and addr != "", f"{what}: addr must be a non-empty string")
        node = NodeDesc(addr, _int(pid, f"{what}: pid"), _int(local_id, f"{what}: local_id"))
        _expect(node not in beats, f"node {node} is listed twice")
        beats[node] = _int(item[-1], f"{what}: heartbeat") / 1000
        parsed.append((node, item))
    return parsed


def _parse(doc: Any) -> RendezvousState:
    _expect(type(doc) is dict, "the state must be a JSON object")
    _expect(doc.get("format") == FORMAT, "it is not an aelastic rendezvous state")
    _expect(
        doc.get("version") == FORMAT_VERSION,
        f"unsupported state version {doc.get('version')!r} (this aelastic reads {FORMAT_VERSION})",
    )
    _expect(type(doc.get("complete")) is bool, "complete must be a boolean")
    _expect(type(doc.get("closed")) is bool, "closed must be a boolean")
    deadline = doc.get("deadline_ms")
    beats: dict[NodeDesc, float] = {}
    participants = {
        node: _int(item[3], "participants: rank")
        for node, item in _entries(doc.get("participants"), "participants", 5, beats)
    }
    wait_list = frozenset(n for n, _ in _entries(doc.get("wait_list"), "wait_list", 4, beats))
    redundancy_list = frozenset(
        n for n, _ in _entries(doc.get("redundancy_list"), "redundancy_list", 4, beats)
    )
    if doc["complete"]:
        # Members may have left since completion, so ranks can have gaps, never duplicates.
        ranks = list(participants.values())
        _expect(len(set(ranks)) == len(ranks), "ranks of a complete round must be distinct")
    return RendezvousState(
        round=_int(doc.get("round"), "round"),
        complete=doc["complete"],
        deadline=None if deadline is None else _int(deadline, "deadline_ms") / 1000,
        closed=doc["closed"],
        participants=MappingProxyType(participants),
        wait_list=wait_list,
        redundancy_list=redundancy_list,
        last_heartbeats=MappingProxyType(beats),
    )


_CACHE: OrderedDict[bytes, RendezvousState] = OrderedDict()
_CACHE_SIZE = 16
_CACHE_LOCK = threading.Lock()


def decode_state(data: bytes) -> RendezvousState:
    """Parse and validate a wire state.

    Raises:
        RendezvousStateError: The payload is not JSON, not an aelastic state, of another
            format version, or fails validation.
    """
    with _CACHE_LOCK:
        cached = _CACHE.get(data)
    if cached is not None:
        return cached
    try:
        doc = json.loads(data)
        state = _parse(doc)
    except (ValueError, UnicodeDecodeError, RecursionError, _Invalid) as exc:
        preview = bytes(data[:40])
        raise RendezvousStateError(
            f"The rendezvous state is corrupt or foreign ({exc}); first bytes: {preview!r}. "
            "It was left as it is; delete the run's state or use another run id."
        ) from None
    _remember(data, state)
    return state


def _remember(data: bytes, state: RendezvousState) -> None:
    with _CACHE_LOCK:
        _CACHE[data] = state
        if len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
