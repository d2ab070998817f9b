"""The job's health as the Redis script keeps it, read back into a
:class:`~aelastic.core.health.JobHealth`.

How it works: the rendezvous script folds the members' reports and the losses it sees into
one hash per run (layout in :mod:`._lua_health`): ``total``, ``incidents`` (JSON, each
root's time as the text the request gave), ``l:<host>``, ``q:<host>`` and two counts.
:func:`health_from_fields` takes that hash's fields and values (``HGETALL``, as the
``HEALTH`` script answers them) and makes the same document the Python machine holds: texts
decoded as they were sent (UTF-8, lone surrogates kept), times parsed from their exact
text, Lua's empty JSON object read as an empty list.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any

from ...core.health import FailureRecord, Incident, JobHealth, LostCount

__all__ = ["health_from_fields"]


def _text(value: bytes | str) -> str:
    return value if isinstance(value, str) else value.decode("utf-8", "surrogatepass")


def _incident(doc: Any) -> Incident:
    root = dict(doc["root"])
    root["time"] = float(root["time"])  # the exact text the report gave
    return Incident(
        int(doc["round"]), FailureRecord.from_json(root), int(doc["streak"]), int(doc["failed"])
    )


def health_from_fields(pairs: Sequence[bytes | str]) -> JobHealth:
    """The job's health from its hash's fields and values, alternating.

    Raises:
        ValueError: The hash is not one the script wrote.
    """
    fields = {_text(pairs[i]): _text(pairs[i + 1]) for i in range(0, len(pairs) - 1, 2)}
    try:
        incidents = json.loads(fields.get("incidents", "[]")) or []
        if not isinstance(incidents, list):
            raise ValueError("the incidents are not a list")
        lost: dict[str, LostCount] = {}
        quarantined: dict[str, str] = {}
        for name, value in fields.items():
            if name.startswith("l:"):
                count, round_ = value.split(" ")
                lost[name[2:]] = LostCount(int(count), int(round_))
            elif name.startswith("q:"):
                quarantined[name[2:]] = value
        return JobHealth(
            int(fields.get("total", "0")),
            tuple(_incident(i) for i in incidents),
            MappingProxyType(quarantined),
            MappingProxyType(lost),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"not a job health the rendezvous script wrote: {exc!r}") from None
