"""A failure as the job's health keeps it: a record, a member's report of itself, bounded text.

How it works: a member reports *for itself* (:class:`NodeReport`: its workers' first failure
in its round, a :class:`FailureReport`, or its own host set aside); the state machine fills
in who and where and keeps a :class:`FailureRecord` (:mod:`.health` folds them into the
job's health). Everything from the wire is checked and bounded here (message length and
lines, names, integers): a worker's 50 MB traceback never reaches the rendezvous.
:func:`shown` escapes control characters for display. :func:`root_order` is the order of
root causes: a failure of the worker itself before one that broke in a collective because
of a peer (``secondary``), then the earliest. Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MAX_MESSAGE",
    "MAX_REPORTED",
    "FailureRecord",
    "FailureReport",
    "NodeReport",
    "bounded_message",
    "plain_text",
    "root_order",
    "short_text",
    "shown",
]

#: Characters of a failure message kept (its end: where the exception is).
MAX_MESSAGE = 2000
#: Lines of a failure message kept (its last ones).
MAX_LINES = 20
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


def short_text(text: str) -> str:
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
        object.__setattr__(self, "host", short_text(self.host))
        object.__setattr__(self, "node", short_text(self.node))

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
                host=plain_text(doc["host"]),
                node=plain_text(doc["node"]),
                node_rank=int(doc["node_rank"]),
                rank=int(doc["rank"]),
                local_rank=int(doc["local_rank"]),
                exitcode=int(doc["exitcode"]),
                message=plain_text(doc["message"]),
                round=int(doc["round"]),
                stalled=bool(doc.get("stalled", False)),
                secondary=bool(doc.get("secondary", False)),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"invalid failure record: {exc!r}") from None


def plain_text(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected text, got {type(value).__name__}")
    return value


def root_order(record: FailureRecord) -> tuple[bool, float, int, int]:
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
            message = plain_text(doc["message"])
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
            object.__setattr__(self, "quarantine", short_text(self.quarantine))

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
