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
earliest (:func:`~.failure.root_order`). Everything is bounded (lists and hosts here;
messages and names in :mod:`.failure`, where the records and reports are checked, and
re-exported from here). Pure: no I/O, no clock.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from .failure import (
    MAX_MESSAGE,
    FailureRecord,
    FailureReport,
    NodeReport,
    bounded_message,
    plain_text,
    root_order,
    short_text,
    shown,
)

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
#: Hosts listed (quarantined, lost) at most.
MAX_HOSTS = 256


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
            lost = {plain_text(h): LostCount(int(c[0]), int(c[1])) for h, c in doc["lost"].items()}
            quarantined = {plain_text(h): plain_text(r) for h, r in doc["quarantined"].items()}
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
        if root_order(record) >= root_order(latest.root):
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
    host = short_text(host)
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
    host = short_text(host)
    if host in health.quarantined or len(health.quarantined) >= MAX_HOSTS:
        return None
    return replace(health, quarantined=_frozen({**health.quarantined, host: short_text(reason)}))
