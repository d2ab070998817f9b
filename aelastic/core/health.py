"""The job's health, kept by the rendezvous itself: first failures, restarts spent, quarantine.

How it works: one :class:`JobHealth` per run, held in the run's rendezvous state next to its
participants and heartbeats (never in the members' key-value store, which every store client
can write), and changed only by the state machine (:mod:`.machine`): from what a member
reports *for itself* (``Op.REPORT``: a :class:`NodeReport`, its workers' first failure in
its round, or its own host set aside) and from what the machine sees (a member of a complete
round dropped for its silence is a *lost* host). The machine fills in who and where (the
host, the node, its rank, the round): a report names none of them, so nobody can report
for another node, for a round that is over, or from outside the run. Every agent,
``aelastic status`` and the run page read the same document (the backend's ``health()``).

It holds the job's recent *incidents* (a round whose workers failed somewhere): the
incident's root cause (one :class:`FailureRecord`), how many nodes failed in it, and how
many incidents in a row that host was the root cause; the number of incidents so far (the
job-wide restart budget counts them); the hosts lost, and the hosts set aside (quarantined).
Concurrent reports of one incident converge on the best root cause: a failure of the worker
itself beats one that broke in a collective because of a peer (``secondary``), then the
earliest. Everything is bounded (messages, lists, hosts): a worker's 50 MB traceback never
reaches the rendezvous. :func:`shown` escapes control characters for display. Pure: no I/O,
no clock.
"""

from __future__ import annotations

import json
import math
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

__all__ = [
    "MAX_INCIDENTS",
    "MAX_MESSAGE",
    "FailureRecord",
    "FailureReport",
    "Incident",
    "JobHealth",
    "LostCount",
    "NodeReport",
    "bounded_message",
    "reported",
    "shown",
    "with_failure",
    "with_lost",
    "with_quarantined",
]

_FORMAT = "aelastic.job.health/2"
#: Incidents the document keeps (the newest).
MAX_INCIDENTS = 16
#: Characters of a failure message kept (its end: where the exception is).
MAX_MESSAGE = 2000
#: Lines of a failure message kept (its last ones).
MAX_LINES = 20
#: Hosts listed (quarantined, lost) at most.
MAX_HOSTS = 256
_MAX_SHORT = 300
#: Characters of a report's message taken from the wire at most (it is bounded further).
MAX_REPORTED = 64 * 1024


def shown(text: str) -> str:
    """``text`` safe to print: control characters (terminal escapes...) as ``\\x1b``,
    newlines and tabs kept."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in "\n\t" else _escape(c) for c in text)


def _escape(char: str) -> str:
    code = ord(char)
    return (
        f"\\x{code:02x}"
        if code < 0x100
        else f"\\u{code:04x}"
        if code < 0x10000
        else f"\\U{code:08x}"
    )


def bounded_message(text: str) -> str:
    """The last :data:`MAX_LINES` lines of ``text``, at most :data:`MAX_MESSAGE` characters."""
    lines = text.rstrip().splitlines()[-MAX_LINES:]
    kept = "\n".join(lines)
    return kept if len(kept) <= MAX_MESSAGE else "..." + kept[-(MAX_MESSAGE - 3) :]


def _short(text: str) -> str:
    return text if len(text) <= _MAX_SHORT else text[: _MAX_SHORT - 3] + "..."


@dataclass(frozen=True)
class FailureRecord:
    """One node's first failure in a round, as the job's store keeps it.

    Attributes:
        time: When the agent saw it (wall-clock seconds of the failing node's host).
        host: The node's address (its rendezvous address: the host quarantine is about).
        node: The node's key (``addr_pid_n``).
        node_rank: Its group rank in the round.
        rank: The worker's global rank; ``local_rank`` its local rank.
        exitcode: The worker's exit code (negative: the signal that ended it).
        message: What it said: the error file's message, its last stderr lines, or the
            stall's description and stuck line (bounded).
        round: The rendezvous round the workers ran in.
        stalled: The worker was hung (no progress) and was stopped.
        secondary: It broke inside a collective (a peer's failure, most likely).
    """

    time: float
    host: str
    node: str
    node_rank: int
    rank: int
    local_rank: int
    exitcode: int
    message: str
    round: int
    stalled: bool = False
    secondary: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "message", bounded_message(self.message))
        object.__setattr__(self, "host", _short(self.host))
        object.__setattr__(self, "node", _short(self.node))

    def how(self) -> str:
        """``"stalled"``, ``"exit code 1"`` or ``"signal SIGKILL"``."""
        if self.stalled:
            return "stalled"
        if self.exitcode >= 0:
            return f"exit code {self.exitcode}"
        try:
            return f"signal {signal.Signals(-self.exitcode).name}"
        except ValueError:
            return f"signal {-self.exitcode}"

    def headline(self) -> str:
        """The message's last non-empty line, safe to print."""
        lines = [line for line in self.message.splitlines() if line.strip()]
        return shown(lines[-1].strip()) if lines else ""

    def summary(self) -> str:
        """One line: who, where, how, and the headline."""
        text = (
            f"rank {self.rank} (local rank {self.local_rank}) on host {shown(self.host)} "
            f"(node rank {self.node_rank}) "
        )
        headline = self.headline()
        if self.stalled and headline:
            return text + headline  # "hung: no progress for ..."
        text += "hung" if self.stalled else f"failed with {self.how()}"
        return f"{text}: {headline}" if headline else text

    def to_json(self) -> dict[str, Any]:
        """The JSON form."""
        return {
            "time": self.time,
            "host": self.host,
            "node": self.node,
            "node_rank": self.node_rank,
            "rank": self.rank,
            "local_rank": self.local_rank,
            "exitcode": self.exitcode,
            "message": self.message,
            "round": self.round,
            "stalled": self.stalled,
            "secondary": self.secondary,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> FailureRecord:
        """Parse the JSON form.

        Raises:
            ValueError: A field is missing or of the wrong type.
        """
        try:
            time = float(doc["time"])
            if not math.isfinite(time):
                raise ValueError("time")
            return cls(
                time=time,
                host=_text(doc["host"]),
                node=_text(doc["node"]),
                node_rank=int(doc["node_rank"]),
                rank=int(doc["rank"]),
                local_rank=int(doc["local_rank"]),
                exitcode=int(doc["exitcode"]),
                message=_text(doc["message"]),
                round=int(doc["round"]),
                stalled=bool(doc.get("stalled", False)),
                secondary=bool(doc.get("secondary", False)),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"invalid failure record: {exc!r}") from None


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected text, got {type(value).__name__}")
    return value


def _rank_key(record: FailureRecord) -> tuple[bool, float, int, int]:
    return (record.secondary, record.time, record.node_rank, record.rank)


_INT32 = (1 << 31) - 1


def _bounded_int(doc: Mapping[str, Any], key: str, low: int = -_INT32) -> int:
    value = doc[key]
    if type(value) is not int or not low <= value <= _INT32:
        raise ValueError(f"'{key}' must be an integer in [{low}, {_INT32}]")
    return value


@dataclass(frozen=True)
class FailureReport:
    """A member's own first failure in its round, as it reports it (``Op.REPORT``): what
    failed and how, never who or where (the rendezvous fills in the host, the node, its
    rank and the round: :meth:`record`).

    Attributes:
        time: When the agent saw it (wall-clock seconds of the failing node's host).
        rank: The worker's global rank; ``local_rank`` its local rank.
        exitcode: The worker's exit code (negative: the signal that ended it).
        message: What it said (bounded to :data:`MAX_MESSAGE` characters).
        stalled: The worker was hung (no progress) and was stopped.
        secondary: It broke inside a collective (a peer's failure, most likely).
    """

    time: float
    rank: int
    local_rank: int
    exitcode: int
    message: str
    stalled: bool = False
    secondary: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "message", bounded_message(self.message[-MAX_REPORTED:]))

    def record(self, host: str, node: str, node_rank: int, round_: int) -> FailureRecord:
        """The failure record of this report by ``node`` (on ``host``, of rank
        ``node_rank``) in round ``round_``."""
        return FailureRecord(
            time=self.time,
            host=host,
            node=node,
            node_rank=node_rank,
            rank=self.rank,
            local_rank=self.local_rank,
            exitcode=self.exitcode,
            message=self.message,
            round=round_,
            stalled=self.stalled,
            secondary=self.secondary,
        )

    def to_json(self) -> dict[str, Any]:
        """The JSON form."""
        return {
            "time": self.time,
            "rank": self.rank,
            "local_rank": self.local_rank,
            "exitcode": self.exitcode,
            "message": self.message,
            "stalled": self.stalled,
            "secondary": self.secondary,
        }

    @classmethod
    def from_json(cls, doc: Any) -> FailureReport:
        """Parse the JSON form (every field checked, sizes bounded).

        Raises:
            ValueError: ``doc`` is not a failure report.
        """
        if type(doc) is not dict:
            raise ValueError("a failure report must be a JSON object")
        unknown = set(doc) - _REPORT_FIELDS
        if unknown:
            raise ValueError(f"unknown field(s) in a failure report: {sorted(unknown)}")
        try:
            time = doc["time"]
            if type(time) not in (int, float) or not math.isfinite(time):
                raise ValueError("'time' must be a finite number")
            message = _text(doc["message"])
            if len(message) > MAX_REPORTED:
                raise ValueError(f"'message' is longer than {MAX_REPORTED} characters")
            flags = [doc.get("stalled", False), doc.get("secondary", False)]
            if any(type(flag) is not bool for flag in flags):
                raise ValueError("'stalled' and 'secondary' must be booleans")
            return cls(
                time=float(time),
                rank=_bounded_int(doc, "rank", 0),
                local_rank=_bounded_int(doc, "local_rank", 0),
                exitcode=_bounded_int(doc, "exitcode"),
                message=message,
                stalled=flags[0],
                secondary=flags[1],
            )
        except KeyError as exc:
            raise ValueError(f"a failure report needs {exc}") from None


_REPORT_FIELDS = frozenset(
    {"time", "rank", "local_rank", "exitcode", "message", "stalled", "secondary"}
)


@dataclass(frozen=True)
class NodeReport:
    """What a member reports of itself (``Op.REPORT``): its workers' failure, or that its
    own host is set aside (``quarantine``: why). Exactly one of the two."""

    failure: FailureReport | None = None
    quarantine: str | None = None

    def __post_init__(self) -> None:
        if (self.failure is None) == (self.quarantine is None):
            raise ValueError("a report is a failure or a quarantine, not both or neither")
        if self.quarantine is not None:
            object.__setattr__(self, "quarantine", _short(self.quarantine))

    def to_json(self) -> dict[str, Any]:
        """The JSON form."""
        if self.failure is not None:
            return {"failure": self.failure.to_json()}
        return {"quarantine": self.quarantine}

    @classmethod
    def from_json(cls, doc: Any) -> NodeReport:
        """Parse the JSON form.

        Raises:
            ValueError: ``doc`` is not a report.
        """
        if type(doc) is not dict or len(doc) != 1 or not set(doc) <= {"failure", "quarantine"}:
            raise ValueError("a report must be {'failure': {...}} or {'quarantine': reason}")
        if "failure" in doc:
            return cls(failure=FailureReport.from_json(doc["failure"]))
        reason = doc["quarantine"]
        if type(reason) is not str or len(reason) > MAX_REPORTED:
            raise ValueError("'quarantine' must be a reason (text)")
        return cls(quarantine=reason)


@dataclass(frozen=True)
class Incident:
    """A round whose workers failed: its root cause, how many incidents in a row (this one
    included) had their root cause on that host, and how many nodes reported a failure."""

    round: int
    root: FailureRecord
    streak: int = 1
    failed: int = 1


@dataclass(frozen=True)
class LostCount:
    """How often a host was lost, and the round it was last counted in."""

    count: int
    round: int


def _frozen(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class JobHealth:
    """The job's health document (see the module docstring).

    Attributes:
        incidents_total: Incidents so far (each spent a job-wide restart, but maybe the last).
        incidents: The newest incidents, oldest first (at most :data:`MAX_INCIDENTS`).
        quarantined: Hosts set aside, with why.
        lost: Hosts lost, with how often.
    """

    incidents_total: int = 0
    incidents: tuple[Incident, ...] = ()
    quarantined: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    lost: Mapping[str, LostCount] = field(default_factory=lambda: MappingProxyType({}))

    def __deepcopy__(self, memo: dict[int, Any]) -> JobHealth:
        return self  # immutable (a copied run state shares it)

    @property
    def latest(self) -> Incident | None:
        """The newest incident."""
        return self.incidents[-1] if self.incidents else None

    def to_json(self) -> dict[str, Any]:
        """The JSON form."""
        return {
            "format": _FORMAT,
            "incidents_total": self.incidents_total,
            "incidents": [
                {"round": i.round, "streak": i.streak, "failed": i.failed, "root": i.root.to_json()}
                for i in self.incidents
            ],
            "quarantined": dict(self.quarantined),
            "lost": {h: [c.count, c.round] for h, c in self.lost.items()},
        }

    def encode(self) -> bytes:
        """The stored form (compact JSON)."""
        return json.dumps(self.to_json(), separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes | None) -> JobHealth:
        """Parse the stored form (``None``: an empty document).

        Raises:
            ValueError: ``data`` is not a document this version wrote.
        """
        if data is None:
            return cls()
        try:
            return cls.from_json(json.loads(data))
        except ValueError as exc:
            raise ValueError(f"invalid job health document {data[:200]!r}: {exc}") from None

    @classmethod
    def from_json(cls, doc: Any) -> JobHealth:
        """Parse the JSON form.

        Raises:
            ValueError: ``doc`` is not a document this version wrote.
        """
        try:
            if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
                raise ValueError("not a job health document of this version")
            incidents = tuple(
                Incident(
                    int(i["round"]),
                    FailureRecord.from_json(i["root"]),
                    int(i["streak"]),
                    int(i.get("failed", 1)),
                )
                for i in doc["incidents"]
            )
            lost = {_text(h): LostCount(int(c[0]), int(c[1])) for h, c in doc["lost"].items()}
            quarantined = {_text(h): _text(r) for h, r in doc["quarantined"].items()}
            return cls(
                int(doc["incidents_total"]),
                incidents[-MAX_INCIDENTS:],
                _frozen(quarantined),
                _frozen(lost),
            )
        except (KeyError, TypeError, IndexError, AttributeError) as exc:
            raise ValueError(f"invalid job health document: {exc!r}") from None


def with_failure(health: JobHealth, record: FailureRecord) -> JobHealth | None:
    """``health`` after a node reported ``record``; ``None`` when it changes nothing (the
    round's root cause is better already, or the round is older than the newest incident)."""
    latest = health.latest
    if latest is not None and latest.round > record.round:
        return None
    if latest is not None and latest.round == record.round:
        if _rank_key(record) >= _rank_key(latest.root):
            return None
        before = health.incidents[-2] if len(health.incidents) > 1 else None
        incident = Incident(record.round, record, _streak(before, record), latest.failed)
        return replace(health, incidents=(*health.incidents[:-1], incident))
    incident = Incident(record.round, record, _streak(latest, record))
    return replace(
        health,
        incidents_total=health.incidents_total + 1,
        incidents=(*health.incidents, incident)[-MAX_INCIDENTS:],
    )


def reported(health: JobHealth, record: FailureRecord, failed: int) -> JobHealth:
    """``health`` after a node reported ``record``, ``failed`` nodes having reported a
    failure in its round so far (the machine counts them); ``health`` itself when the
    report is of a round older than the newest incident."""
    changed = with_failure(health, record) or health
    latest = changed.latest
    if latest is None or latest.round != record.round or latest.failed == failed:
        return changed
    incident = replace(latest, failed=failed)
    return replace(changed, incidents=(*changed.incidents[:-1], incident))


def _streak(before: Incident | None, record: FailureRecord) -> int:
    return before.streak + 1 if before is not None and before.root.host == record.host else 1


def with_lost(
    health: JobHealth, host: str, round_: int, quarantine_after: int | None
) -> JobHealth | None:
    """``health`` after ``host`` was lost in round ``round_`` (counted once per round),
    quarantined when it was lost ``quarantine_after`` times; ``None``: nothing changes."""
    host = _short(host)
    counted = health.lost.get(host)
    if counted is not None and counted.round >= round_:
        return None
    if counted is None and len(health.lost) >= MAX_HOSTS:
        return None
    count = LostCount((counted.count if counted else 0) + 1, round_)
    changed = replace(health, lost=_frozen({**health.lost, host: count}))
    if quarantine_after is not None and count.count >= quarantine_after:
        reason = f"lost {count.count} times"
        return with_quarantined(changed, host, reason) or changed
    return changed


def with_quarantined(health: JobHealth, host: str, reason: str) -> JobHealth | None:
    """``health`` with ``host`` set aside for ``reason``; ``None`` when it already is."""
    host = _short(host)
    if host in health.quarantined or len(health.quarantined) >= MAX_HOSTS:
        return None
    return replace(health, quarantined=_frozen({**health.quarantined, host: _short(reason)}))
