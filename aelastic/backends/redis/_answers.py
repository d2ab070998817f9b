"""What the run's scripts answer, read: the JSON document of a request's reply, a status or a
snapshot, or the error a script found in the run's keys, as one clear line.

How it works: a script that finds the run's keys unlike what this aelastic writes changes
nothing and answers ``{"error": ...}`` instead: ``version`` (a state of another format
version), ``type`` (a key of another Redis type) or anything else (a foreign or corrupt
state). :func:`decode_answer` gives the document, or raises ``RendezvousStateError`` naming
the run, the endpoint and what to do; an answer that is not JSON is a
``RendezvousConnectionError``. A request the script refused for what it says (``request``:
a join's profile or a report out of bounds, ``why`` says which) changed nothing either: a
``RendezvousError`` naming it.
"""

from __future__ import annotations

import json
from typing import Any

from ...core.errors import RendezvousConnectionError, RendezvousError, RendezvousStateError
from ...core.state import FORMAT_VERSION

__all__ = ["decode_answer"]


def decode_answer(raw: Any, what: str, endpoint: str, run_id: str) -> dict[str, Any]:
    """The document a script answered to ``what`` for run ``run_id`` at ``endpoint``.

    Raises:
        RendezvousConnectionError: The answer is not JSON.
        RendezvousStateError: The script found the run's keys holding what this aelastic
            did not write (another format version, another type, foreign or corrupt).
        RendezvousError: The script refused the request for what it says (nothing changed).
    """
    try:
        doc = json.loads(raw)
    except (TypeError, ValueError):
        raise RendezvousConnectionError(
            f"Redis at {endpoint} answered {what} with something that is not JSON."
        ) from None
    if not isinstance(doc, dict):
        doc = {"error": "foreign"}
    error = doc.get("error")
    if error is None:
        return doc
    if error == "request":
        raise RendezvousError(
            f"Redis at {endpoint} refused {what} for run '{run_id}': {doc.get('why')}; "
            "nothing was changed."
        )
    where = f"The rendezvous state of run '{run_id}' at {endpoint}"
    if error == "version":
        raise RendezvousStateError(
            f"{where} has format version {doc.get('version')!r}; this aelastic uses "
            f"version {FORMAT_VERSION}. Nodes of both versions cannot share a run: use "
            "one aelastic version for the job, or another run id. It was left as it is."
        )
    if error == "type":
        raise RendezvousStateError(
            f"{where}: the key '{doc.get('key')}' is a Redis {doc.get('kind')}, not what "
            "aelastic writes; it was left as it is."
        )
    raise RendezvousStateError(
        f"{where} is foreign or corrupt (not written by aelastic); it was left as it is."
    )
