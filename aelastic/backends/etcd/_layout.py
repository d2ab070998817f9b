"""The etcd layout of one run: its keys, a node's name in them, the header's JSON form.

How it works: every key of a run starts with ``<etcd_prefix>/<run id>/`` (the run id is
percent-encoded, so a ``/`` in it stays inside the run's folder):

* ``h``: the **header**, one JSON value: format and version, the epoch and generation (the
  status token is ``"<epoch>.<generation>"``), round, complete, closed, the last call, the
  size of the complete round (``world``), the first lost members' names, the bootstrap
  address, the run's rules, and the counts and flags as of its last write (what a watcher
  is told). It changes only on round transitions, never on a join to a forming round or a
  heartbeat;
* ``p/<node>``, ``w/<node>``, ``r/<node>``: one key per participant, waiting node and
  redundant node, attached to the node's **lease** (its heartbeat: when the node is silent
  for the heartbeat window, etcd deletes them); a participant's value holds its bootstrap
  port;
* ``pm/<node>``: a participant whose profile (its join's worker role and local world size)
  is not the run's (the header's ``profile``, its creator's), on its lease, the profile in
  its value: a uniform job has none, and a member's workers are placed by arithmetic
  (:mod:`._control`);
* ``pd/<node>``: a member of the complete round that said its workers succeeded (``DONE``),
  on its lease: gone with the member;
* ``q/<node>``: the members of the complete round that said they were done or left after
  their workers succeeded (no lease: a done member dropped by etcd stays counted as
  finished; cleared when the next round opens). So ``done`` is the count of ``pd/``,
  ``finished`` that of ``q/`` less ``pd/``;
* ``l/<node>``: the members of the complete round that left it unfinished (lost, and never
  counted lost in the job's health: they said they were going), no lease, cleared when the
  next round opens; the members etcd dropped (silent) are those lost less these. A leave
  writes its own mark, not the header (a thousand members leaving at once do not all
  rewrite one key); outside every watched range;
* ``a``: the job's health (:class:`~aelastic.core.health.JobHealth`'s stored form), outside
  every watched range (a report wakes nobody); ``x/<round>/<node>``: the members that
  reported a failure in ``round`` (no lease; only the newest incident's round has them: the
  incident's ``failed`` is their count);
* ``c``: written once when a round completes: its revision is the round's **cut**, the
  revision at which ``p/`` holds exactly the round's members (ranks are read there);
* ``b``: written with a header created by a first join, deleted by the header's next write,
  and written again by every join to the run until then (outside every watched range:
  nobody hears of it), on that joiner's lease: while it is there, the run is round 0
  forming, with no last call, and not empty (the node whose lease holds it joined last,
  and a node that left has its lease gone long before an empty run is free again), and a
  first join needs no read (:meth:`._apply.RunPort.first_join`); its value is the run's
  rules and profile (:func:`fresh_tag`), so a first join with other rules or another
  profile falls back to a full request (refused there, naming both; or joining with its
  profile's mark);
* ``kv/<key>``: the members' key-value store; ``op/<id>``: the result of an ``add``, kept a
  while so that a retried add never counts twice.

``<node>`` is the node's descriptor written so that byte order is the order of sorted
``NodeDesc`` tuples (address, then process id, then local id): a node's rank in a complete
round is the number of ``p/`` keys before its own at the cut, one count-only range, and rank
0 (the bootstrap host) is the first key; ``pm/`` keys sort the same way. The node lists
(``p/``, ``pd/``, ``pm/``, ``q/``) are next to each other: one watch of deletions covers them.
Nothing here does I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import quote, unquote

from ...core.errors import RendezvousStateError
from ...core.params import Rules
from ...core.state import FORMAT, FORMAT_VERSION, NodeDesc

__all__ = [
    "DEFAULT_PROFILE",
    "LAYOUT",
    "Header",
    "Profile",
    "RunKeys",
    "decode_header",
    "encode_header",
    "fresh_tag",
    "member_parts",
    "member_value",
    "node_of",
    "prefix_end",
    "profile_parts",
    "profile_value",
    "rules_tag",
    "sort_key",
]

#: Version of the etcd layout (inside the state's format version). Layout 1 had no node
#: secrets and no vacancy time; layout 2 (state format 3) no profiles, done marks or health;
#: layout 3 counted every lost member in the header (no ``l/`` marks).
LAYOUT = 4
#: A profile: a join's worker role and local world size.
Profile = tuple[str, int]
DEFAULT_PROFILE: Profile = ("default", 1)
_SEP = "\x00"  # below every printable character: "a" sorts before "a-b" as it should


def sort_key(node: NodeDesc) -> str:
    """``node`` as a key suffix whose byte order is sorted ``NodeDesc`` order."""
    return f"{node.addr}{_SEP}{node.pid:020d}{_SEP}{node.local_id:020d}"


def node_of(suffix: str) -> NodeDesc:
    """The node a key suffix names (the inverse of :func:`sort_key`).

    Raises:
        ValueError: ``suffix`` is not a node's key suffix.
    """
    addr, pid, local_id = suffix.split(_SEP)
    if not addr or not pid.isdigit() or not local_id.isdigit():
        raise ValueError(f"{suffix!r} is not a node's key")
    return NodeDesc(addr, int(pid), int(local_id))


def member_value(port: int, secret: str) -> bytes:
    """The value of a node's key: its bootstrap port (participants; 0 elsewhere) and its
    secret."""
    return f"{port}:{secret}".encode()


def member_parts(value: bytes) -> tuple[int, bytes]:
    """The port and the secret in a node's key's value (a value aelastic did not write
    gives port 0 and a secret no request matches)."""
    port, sep, secret = value.partition(b":")
    if not sep or not port.isdigit():
        return 0, b"\x00"
    return int(port), secret


def rules_tag(rules: Rules) -> str:
    """The run's rules as text."""
    return f"{rules.min_nodes},{rules.max_nodes},{rules.last_call_ms},{rules.window_ms}"


def fresh_tag(rules: Rules, profile: Profile) -> str:
    """The ``b`` key's value: the run's rules and profile (compared by a first join)."""
    return f"{rules_tag(rules)};{profile[1]}:{profile[0]}"


def profile_value(profile: Profile) -> bytes:
    """The value of a ``pm/`` key: the node's local world size and role."""
    return f"{profile[1]}:{profile[0]}".encode()


def profile_parts(value: bytes) -> Profile:
    """The profile in a ``pm/`` key's value (a value aelastic did not write: the default)."""
    size, sep, role = value.decode(errors="replace").partition(":")
    if not sep or not size.isdigit() or not role:
        return DEFAULT_PROFILE
    return role, int(size)


def prefix_end(prefix: str | bytes) -> bytes:
    """The end of the key range of everything that starts with ``prefix``."""
    raw = bytearray(prefix.encode() if isinstance(prefix, str) else prefix)
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        return b"\x00"
    raw[-1] += 1
    return bytes(raw)


class RunKeys:
    """The names of one run's keys.

    Args:
        prefix: Where aelastic's keys live (``etcd_prefix``), without a trailing slash.
        run_id: The run.
    """

    def __init__(self, prefix: str, run_id: str) -> None:
        self.prefix = prefix
        self.run_id = run_id
        #: Every key of the run starts with this.
        self.base = f"{prefix}/{quote(run_id, safe='')}/"
        self.header = self.base + "h"
        self.cut = self.base + "c"
        self.fresh = self.base + "b"
        self.participants = self.base + "p/"
        self.done = self.base + "pd/"
        self.profiles = self.base + "pm/"
        self.finished = self.base + "q/"
        self.left = self.base + "l/"
        self.health = self.base + "a"
        self.failures = self.base + "x/"
        self.redundant = self.base + "r/"
        self.waiting = self.base + "w/"
        self.store = self.base + "kv/"
        self.ops = self.base + "op/"

    def __repr__(self) -> str:
        return f"RunKeys({self.base!r})"

    def kv(self, key: str) -> str:
        """The key holding ``key`` of the members' store."""
        return self.store + key

    def op(self, op_id: str) -> str:
        """Where the result of an add with id ``op_id`` is kept."""
        return self.ops + op_id

    def member(self, where: str, node: NodeDesc) -> str:
        """``node``'s key in list ``where`` (``p``, ``w``, ``r``, ``q``, ``l``, ``pd`` or
        ``pm``)."""
        return f"{self.base}{where}/{sort_key(node)}"

    def failed(self, round_: int) -> str:
        """The prefix of the failure marks of round ``round_``."""
        return f"{self.failures}{round_:020d}/"

    def failure(self, round_: int, node: NodeDesc) -> str:
        """``node``'s failure mark in round ``round_``."""
        return self.failed(round_) + sort_key(node)

    @staticmethod
    def run_of_header(key: str, prefix: str) -> str | None:
        """The run id whose header is ``key`` (``None`` for any other key)."""
        head = prefix + "/"
        if not (key.startswith(head) and key.endswith("/h")):
            return None
        encoded = key[len(head) : -2]
        return unquote(encoded) if encoded and "/" not in encoded else None


@dataclass(frozen=True)
class Header:
    """The run's header (see the module docstring). Counts are those of its last write.

    Attributes:
        deadline: ``(id, setter's time)`` of the last call, or ``None``. Its id is the
            generation that set it; readers time the last call from when they first saw
            that id, never from another machine's clock (:mod:`._port`).
        vacated: When the run's last node left (the writer's clock), or ``None``.
        entered: Whether a node entered the run since a request made it (a run that no
            node entered has no vacancy to date: :func:`._port.reconcile`).
        profile: The run's profile (its creator's): a participant of another has a ``pm/``
            key.
        sample: The first lost members' names (at most ``MAX_LOST_SAMPLE``), in the order
            they were lost.
        dropped: How many members of the complete round etcd dropped (silent: their lease
            expired) are accounted for (named in ``sample`` while it had room, their hosts
            counted lost in the job's health): the members lost less those that left (``l/``)
            less these are still to account for.
        accounted: The revision this header was written after (the history of deletions
            after it holds the drops not yet accounted for).
        counts: Participants, waiting, redundant, lost, finished, done.
        flags: Whether nodes wait, members were lost, members finished, all are done.
    """

    epoch: str
    gen: int = 0
    round: int = 0
    complete: bool = False
    closed: bool = False
    deadline: tuple[int, int] | None = None
    world: int = 0
    sample: tuple[str, ...] = ()
    dropped: int = 0
    accounted: int = 0
    master: tuple[str, int] | None = None
    rules: Rules | None = None
    vacated: int | None = None
    entered: bool = True
    profile: Profile = DEFAULT_PROFILE
    counts: tuple[int, ...] = (0, 0, 0, 0, 0, 0)
    flags: tuple[bool, ...] = (False, False, False, False)
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def evolve(self, **changes: Any) -> Header:
        """A copy with ``changes``."""
        return replace(self, **changes)


def encode_header(header: Header) -> str:
    """The JSON text of ``header``."""
    rules = header.rules
    doc: dict[str, Any] = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "layout": LAYOUT,
        "epoch": header.epoch,
        "gen": header.gen,
        "round": header.round,
        "complete": header.complete,
        "closed": header.closed,
        "deadline": list(header.deadline) if header.deadline else None,
        "world": header.world,
        "sample": list(header.sample),
        "dropped": header.dropped,
        "accounted": header.accounted,
        "master": list(header.master) if header.master else None,
        "rules": None
        if rules is None
        else [rules.min_nodes, rules.max_nodes, rules.last_call_ms, rules.window_ms],
        "vacated": header.vacated,
        "entered": header.entered,
        "profile": [header.profile[0], header.profile[1]],
        "counts": list(header.counts),
        "flags": list(header.flags),
    }
    doc.update(header.extra)
    return json.dumps(doc, separators=(",", ":"))


def _fail(where: str, why: str) -> RendezvousStateError:
    return RendezvousStateError(f"{where} {why}; it was left as it is.")


def decode_header(raw: bytes, where: str) -> Header:
    """The header in ``raw``.

    Args:
        raw: The value of the header key.
        where: What to name in an error (the run and endpoint).

    Raises:
        RendezvousStateError: The value is not a header of this aelastic (foreign, corrupt
            or another format version).
    """
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise _fail(where, "holds a value that aelastic did not write (not JSON)") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise _fail(where, "holds a value that aelastic did not write")
    if doc.get("version") != FORMAT_VERSION or doc.get("layout") != LAYOUT:
        raise _fail(
            where,
            f"has format version {doc.get('version')!r} (etcd layout {doc.get('layout')!r}); "
            f"this aelastic uses version {FORMAT_VERSION} (layout {LAYOUT}). Nodes of both "
            "versions cannot share a run: use one aelastic version for the job, or another "
            "run id",
        )
    try:
        deadline = doc["deadline"]
        master = doc["master"]
        rules = doc["rules"]
        vacated = doc["vacated"]
        c, f, profile = doc["counts"], doc["flags"], doc["profile"]
        if len(c) != 6 or len(f) != 4 or len(profile) != 2:
            raise ValueError("counts")
        counts = tuple(int(n) for n in c)
        flags = tuple(bool(b) for b in f)
        return Header(
            epoch=str(doc["epoch"]),
            gen=int(doc["gen"]),
            round=int(doc["round"]),
            complete=bool(doc["complete"]),
            closed=bool(doc["closed"]),
            deadline=None if deadline is None else (int(deadline[0]), int(deadline[1])),
            world=int(doc["world"]),
            sample=tuple(str(s) for s in doc["sample"]),
            dropped=int(doc["dropped"]),
            accounted=int(doc["accounted"]),
            master=None if master is None else (str(master[0]), int(master[1])),
            rules=None if rules is None else Rules(*(int(r) for r in rules)),
            vacated=None if vacated is None else int(vacated),
            entered=bool(doc["entered"]),
            profile=(str(profile[0]), int(profile[1])),
            counts=counts,
            flags=flags,
        )
    except (KeyError, TypeError, ValueError, IndexError):
        raise _fail(where, "holds a corrupt rendezvous header") from None
