"""The words of a request and its reply: what a node asks (:class:`Op`), what it does next
(:class:`Outcome`) and the main change the request made (:class:`Transition`).

How it works: plain enums whose values are the names that travel (the wire's JSON,
:mod:`.wire`; the Redis scripts' arguments and replies); :mod:`.state` re-exports them
beside the values that carry them (import them from there, or from :mod:`aelastic.core`).
"""

from __future__ import annotations

import enum

__all__ = ["Op", "Outcome", "Transition"]


class Op(enum.Enum):
    """What a node asks of the rendezvous."""

    JOIN = "join"
    LEAVE = "leave"
    CLOSE = "close"
    KEEP_ALIVE = "keep_alive"
    STATUS = "status"
    #: A backend's report that the node's connection ended (never sent by a node): the
    #: node is lost unless heard from since (:func:`~.machine.departure_grace_ms`).
    DEPART = "depart"
    #: A member reports its own workers' failure in its round, or sets its own host aside
    #: (the job's health: :mod:`.health`).
    REPORT = "report"
    #: A member says its workers succeeded in its round (the exit barrier).
    DONE = "done"


class Outcome(enum.Enum):
    """What the node does after a request."""

    FINISH = "finish"  #: done (a join: the round is complete and the reply has the rank)
    WAIT = "wait"  #: wait for a status change or until ``wake_at``, then ask again
    ERROR_CLOSED = "error_closed"
    ERROR_TIMEOUT = "error_timeout"
    GRACEFUL_EXIT = "graceful_exit"
    #: a join whose rules differ from the run's (the reply carries the run's)
    ERROR_RULES = "error_rules"
    #: a request for a node that is in the run under another secret: nothing changed
    ERROR_FORBIDDEN = "error_forbidden"


class Transition(enum.Enum):
    """The main change a request made (for logs, events and tests)."""

    NONE = "none"
    PRUNE = "prune"
    KEEP_ALIVE = "keep_alive"
    ADD_TO_PARTICIPANTS = "add_to_participants"
    ADD_TO_WAIT_LIST = "add_to_wait_list"
    ADD_TO_REDUNDANCY_LIST = "add_to_redundancy_list"
    REMOVE_FROM_REDUNDANCY_LIST = "remove_from_redundancy_list"
    REMOVE = "remove"
    MARK_COMPLETE = "mark_complete"
    MARK_CLOSED = "mark_closed"
    REPORT = "report"
    MARK_DONE = "mark_done"
