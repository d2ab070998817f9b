"""Failed token checks, counted per client: past a few, the client waits.

How it works: each client (:meth:`._clients.Clients.key`) has a bucket of :data:`BURST`
failures that refills by one every :data:`REFILL` seconds. A failed check (a wrong bearer
token on the API, the channel's upgrade or ``/metrics``; a wrong token on the pages' login
form or in their bearer header) takes one; a request with no token at all guesses nothing
(its ``401`` is not counted: a browser's stray request, a scraper not set up yet). While a
client's bucket is empty, each of its requests that needs the token is answered ``429``
with ``Retry-After`` before its token is compared, a right one included: otherwise a guess
that hit would stand out from the refused ones, and guessing would go on at full speed. A
client whose token is right never takes from its bucket, so the nodes of a job behind one
address are never slowed by their own requests. Nor are they when another program at their
address fails: a connection that showed the right token once is
:meth:`~AuthThrottle.vouch`-ed for and never made to wait, and what was let in already (an
open channel, a page's session cookie) is not checked again; only new connections from that
address wait.

The counts are kept for ``/metrics`` (by kind: ``bearer``, ``login``); each client is
logged at most once every :data:`LOG_EVERY` seconds with its counts (at most
:data:`_LINES` clients a minute, the rest summed in one line). The table of clients is
bounded (:data:`MAX_CLIENTS`, the least recently seen forgotten first).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable

from aiohttp import web

__all__ = ["BURST", "LOG_EVERY", "MAX_CLIENTS", "REFILL", "THROTTLE", "AuthThrottle"]

log = logging.getLogger("aelastic.backends.http.server")

#: Failed checks a client may make at once.
BURST = 20
#: Seconds for one more failed check to be allowed (guesses a day per address: 43,200).
REFILL = 2.0
#: Seconds between two log lines about the same client.
LOG_EVERY = 60.0
#: Clients remembered at most.
MAX_CLIENTS = 16_384
#: Clients logged at most per flush (the others summed in one line).
_LINES = 20


class _Bucket:
    __slots__ = ("at", "failed", "level", "logged", "refused")

    def __init__(self, burst: int, now: float) -> None:
        self.level = float(burst)  # failures the client may still make
        self.at = now  # when ``level`` was computed
        self.failed: Counter[str] = Counter()  # not logged yet, by kind
        self.refused = 0  # not logged yet
        self.logged = -math.inf

    def pending(self) -> bool:
        return bool(self.failed) or self.refused > 0


class AuthThrottle:
    """Failed token checks per client (see the module docstring).

    Args:
        burst: Failed checks a client may make at once (default :data:`BURST`).
        refill: Seconds for one more to be allowed (default :data:`REFILL`).
        max_clients: Clients remembered at most.
        clock: Monotonic seconds (tests pass their own).
    """

    def __init__(
        self,
        burst: int | None = None,
        refill: float | None = None,
        *,
        max_clients: int = MAX_CLIENTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.burst = BURST if burst is None else burst
        self.refill = REFILL if refill is None else refill
        self.max_clients = max_clients
        self._clock = clock
        self._clients: OrderedDict[str, _Bucket] = OrderedDict()
        #: Failed checks since the start, by kind (``bearer``, ``login``).
        self.failures: Counter[str] = Counter()
        #: Requests refused (429) since the start, by kind.
        self.refusals: Counter[str] = Counter()
        self._forgotten: Counter[str] = Counter()  # counts of clients dropped unlogged
        self._timer: asyncio.TimerHandle | None = None
        self._vouched: weakref.WeakSet[object] = weakref.WeakSet()

    def vouch(self, connection: object) -> None:
        """``connection`` (a transport) showed the right token: it never waits."""
        if connection is not None and connection not in self._vouched:
            self._vouched.add(connection)

    def vouched(self, connection: object) -> bool:
        """Whether ``connection`` showed the right token before."""
        return connection is not None and connection in self._vouched

    @property
    def tracking(self) -> bool:
        """Whether any client failed a check (else nobody has to wait)."""
        return bool(self._clients)

    def _bucket(self, client: str, now: float) -> _Bucket | None:
        bucket = self._clients.get(client)
        if bucket is not None:
            bucket.level = min(self.burst, bucket.level + (now - bucket.at) / self.refill)
            bucket.at = now
            self._clients.move_to_end(client)
        return bucket

    def wait(self, client: str, kind: str) -> float:
        """Seconds ``client`` must wait before its token is checked again; ``0``: check it.

        A positive answer counts a refusal (the caller answers ``429``)."""
        now = self._clock()
        bucket = self._bucket(client, now)
        if bucket is None or bucket.level >= 1.0:
            return 0.0
        self.refusals[kind] += 1
        bucket.refused += 1
        self._note(client, bucket, now)
        return (1.0 - bucket.level) * self.refill

    def failed(self, client: str, kind: str, connection: object = None) -> None:
        """Count a failed check of ``client`` (``kind``: ``bearer`` or ``login``) on
        ``connection`` (no longer vouched for)."""
        if connection is not None:
            self._vouched.discard(connection)
        now = self._clock()
        bucket = self._bucket(client, now)
        if bucket is None:
            bucket = self._clients[client] = _Bucket(self.burst, now)
            self._forget_oldest()
        bucket.level = max(bucket.level - 1.0, 0.0)
        self.failures[kind] += 1
        bucket.failed[kind] += 1
        self._note(client, bucket, now)

    def _forget_oldest(self) -> None:
        while len(self._clients) > self.max_clients:
            _, old = self._clients.popitem(last=False)
            if old.pending():
                self._forgotten.update(old.failed)
                self._forgotten["refused"] += old.refused
                self._forgotten["clients"] += 1

    # -- the log --------------------------------------------------------------------------

    def _note(self, client: str, bucket: _Bucket, now: float) -> None:
        if now >= bucket.logged + LOG_EVERY:
            self._log(client, bucket, now)
        elif self._timer is None:
            self._schedule()

    def _log(self, client: str, bucket: _Bucket, now: float) -> None:
        log.warning("client %s: %s", client, _counts(bucket.failed, bucket.refused))
        bucket.failed.clear()
        bucket.refused = 0
        bucket.logged = now

    def _schedule(self) -> None:
        due = [b.logged + LOG_EVERY for b in self._clients.values() if b.pending()]
        if self._forgotten:
            due.append(self._clock() + LOG_EVERY)
        if not due:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a test driving the clock): lines come on notes
            return
        delay = max(min(due) - self._clock(), 0.0)
        self._timer = loop.call_later(delay, self.flush)

    def flush(self) -> None:
        """Log every client whose line is due (and those forgotten meanwhile)."""
        self._timer = None
        now = self._clock()
        lines = 0
        others: Counter[str] = Counter()
        clients = 0
        for client, bucket in self._clients.items():
            if not bucket.pending() or now < bucket.logged + LOG_EVERY:
                continue
            if lines < _LINES:
                self._log(client, bucket, now)
                lines += 1
            else:
                others.update(bucket.failed)
                others["refused"] += bucket.refused
                clients += 1
                bucket.failed.clear()
                bucket.refused = 0
                bucket.logged = now
        if self._forgotten:
            others.update(self._forgotten)
            self._forgotten.clear()
        if others:
            clients += others.pop("clients", 0)
            refused = others.pop("refused", 0)
            log.warning("%d other client(s): %s", clients, _counts(others, refused))
        self._schedule()

    def close(self) -> None:
        """Log what was counted and not logged yet."""
        if self._timer is not None:
            self._timer.cancel()
        for bucket in self._clients.values():
            bucket.logged = -math.inf if bucket.pending() else bucket.logged
        self.flush()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _counts(failed: Counter[str], refused: int) -> str:
    total = sum(failed.values())
    kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(failed.items()))
    text = f"{total} failed token check(s)" + (f" ({kinds})" if kinds else "")
    if refused:
        text += f", {refused} request(s) refused (429: too many failures, wait)"
    return text


#: The server's :class:`AuthThrottle` (the API's check and the pages' share it).
THROTTLE = web.AppKey("aelastic_auth_throttle", AuthThrottle)
