"""The brief answer to a heartbeat: ``[now, oldest]`` when nothing but time moved.

How it works: a heartbeat is the only request every member sends every interval, and
almost always nothing has changed since the member's last answer. The member (its backend)
sends with its keep-alive the :func:`beat_key` of the last status it received. When the
run's status has that key, and the keep-alive is a plain one (the node is listed under its
secret, nobody is silent past the window, so nothing is pruned), the backend may answer
:func:`brief_to_json` instead of the whole reply: the backend's time and the oldest
heartbeat (from which the member plans its check for a silent peer). The member makes
the whole reply again with :func:`brief_reply`, exactly the reply
:func:`~.machine.step` gives (the key holds every status field that can move without the
token: the counts of lost, finished, waiting, redundant and done nodes; the participants of
a complete round are its world minus the lost and finished). Any other case gets the whole
reply, so the brief form is an encoding, not another rule.

:func:`short_beat` is that case for an in-process backend (the HTTP server), as the Redis
script's short path is for Redis: it records the beat and makes the brief answer straight
from the state, without the whole step (no prune scan, no status, no reply object); it
declines, changing nothing, whenever :func:`~.machine.step` could answer otherwise. The
property tests hold it to ``step``.
"""

from __future__ import annotations

import dataclasses
import hmac
from typing import Any

from .state import NodeDesc, Outcome, Reply, RunState, Status, Transition
from .token import make

__all__ = ["beat_key", "brief_reply", "brief_to_json", "is_brief", "short_beat"]


def beat_key(status: Status | None) -> str:
    """What a keep-alive sends to allow a brief answer: ``''`` (never brief) unless
    ``status`` is of a complete round."""
    if status is None or not status.complete or not status.token:
        return ""
    return (
        f"{status.token}|{status.lost}|{status.finished}|{status.waiting}|{status.redundant}|"
        f"{status.done}"
    )


def is_brief(reply: Reply, key: str) -> bool:
    """Whether ``reply`` (to a keep-alive sent with ``key``) may be answered briefly."""
    return (
        bool(key)
        and reply.outcome is Outcome.FINISH
        and reply.transition is Transition.KEEP_ALIVE
        and reply.known
        and not reply.pruned
        and reply.oldest_beat_ms is not None
        and beat_key(reply.status) == key
    )


def brief_to_json(reply: Reply) -> list[int]:
    """The brief form of ``reply`` (one for which :func:`is_brief` holds)."""
    assert reply.oldest_beat_ms is not None
    return [reply.status.now_ms, reply.oldest_beat_ms]


def short_beat(
    state: RunState, node: NodeDesc, secret: str, key: str, now_ms: int
) -> tuple[int, int] | None:
    """A plain keep-alive of ``node`` (sent with beat key ``key``) applied to ``state`` at
    ``now_ms``: its brief answer ``(now, oldest)``, exactly as :func:`~.machine.step`
    followed by :func:`is_brief` and :func:`brief_to_json` would give it; ``None`` (the
    state untouched) when the answer would not be brief: then ``step`` answers it."""
    rules = state.rules
    if not key or rules is None or not state.complete:
        return None
    stored = state.secrets.get(node)
    if stored is None or not hmac.compare_digest(stored.encode(), secret.encode()):
        return None  # not listed under this secret (every listed node has a beat)
    beats = state.beats
    if next(iter(beats.values())) < now_ms - rules.window_ms:
        return None  # someone is silent past the window: step prunes
    mine = (
        f"{make(state.epoch, state.generation)}|{state.lost}|{state.finished}|"
        f"{len(state.wait_list)}|{len(state.redundancy_list)}|{len(state.done)}"
    )
    if mine != key:
        return None  # the node has not seen this status: the whole answer
    del beats[node]
    beats[node] = now_ms  # last in order: the newest beat (as machine._beat)
    return now_ms, next(iter(beats.values()))


def brief_reply(doc: Any, base: Status) -> Reply:
    """The whole reply a brief answer ``doc`` stands for, ``base`` being the status whose
    :func:`beat_key` the keep-alive sent.

    Raises:
        ValueError: ``doc`` is not a brief answer.
    """
    if type(doc) is not list or len(doc) != 2 or not all(type(v) is int and v >= 0 for v in doc):
        raise ValueError("a brief heartbeat answer must be [now, oldest] in milliseconds")
    now, oldest = doc
    return Reply(
        outcome=Outcome.FINISH,
        status=dataclasses.replace(base, now_ms=now),
        transition=Transition.KEEP_ALIVE,
        known=True,
        oldest_beat_ms=oldest,
    )
