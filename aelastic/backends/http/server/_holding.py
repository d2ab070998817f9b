"""The nodes whose keep-alive the server holds right now, through whatever connection.

How it works: a held keep-alive (on a channel, :mod:`._held`, or over HTTP, :mod:`._answer`)
is counted for its run and node while it is held, and uncounted when it is answered or
dropped. A node with one held is alive: :mod:`._departures` keeps it when the end of an
older channel of its is read late (its client sent the beat again first).
"""

from __future__ import annotations

from collections import Counter

from ....core.state import NodeDesc

__all__ = ["Holding"]


class Holding:
    """How many keep-alives the server holds per (run id, node)."""

    def __init__(self) -> None:
        self._count: Counter[tuple[str, NodeDesc]] = Counter()

    def add(self, run_id: str, node: NodeDesc) -> None:
        self._count[(run_id, node)] += 1

    def remove(self, run_id: str, node: NodeDesc) -> None:
        key = (run_id, node)
        self._count[key] -= 1
        if self._count[key] <= 0:
            del self._count[key]

    def __contains__(self, key: tuple[str, NodeDesc]) -> bool:
        return key in self._count
