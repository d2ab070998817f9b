"""The Redis layout of one run, and the Lua scripts of the members' store.

How it works: every key of a run starts with ``<prefix>:{<run id>}:`` (the braces are a
Redis Cluster hash tag, so a run lives on one slot and multi-key scripts stay legal):

* ``...:state``: the header hash (round, complete, closed, last-call deadline, counters,
  the run's rules ``min``, ``max``, ``last_call``, ``window``, fixed by the join that made
  it, ``epoch`` and ``version``: the status token is ``"<epoch>.<version>"``; the epoch is
  drawn when the state is created, so a state made again never repeats an old token, and
  drawn again when the primary's replication id, ``replid``, changed: after a failover);
* ``...:p`` participants (sorted set: join order, then rank), ``...:ports`` their bootstrap
  ports, ``...:w`` wait list and ``...:r`` redundancy list (sets), ``...:b`` heartbeats
  (sorted set by time), ``...:s`` the nodes' secrets (hash), ``...:order`` (a sorted set
  that lives only while a completing round's ranks are sorted), ``...:prof`` the
  participants' worker roles and local world sizes (hash), ``...:place`` where each member's
  workers stand once the round is complete (hash), ``...:done`` and ``...:failed`` the
  members that said their workers succeeded, or reported a failure, in this round (sets):
  see :mod:`._lua` for the scripts that change them;
* ``...:health``: the job's health (hash; :mod:`._lua_health`), written only by the
  rendezvous script from the members' reports of themselves and the losses it sees, never
  by a store write (outside ``...:kv:``), read by :data:`HEALTH`;
* ``...:kv:<key>``: one string per key of the members' store;
* ``...:op:<id>``: the result of a ``kv_add``, kept a while so a retried add never counts twice;
* ``...:changes``: the pub/sub channel. A status change publishes ``s<status JSON>`` (round
  transitions only, never heartbeats); a store write publishes ``k<key>``, from inside its
  script, so a waiter never misses a change made after it subscribed.

Notifications are published with ``redis.pcall``: a user whose ACL denies the channel still
changes the run (its waiters then re-check by themselves), and a script never stops half-way
over a refused notification. Every write (and every read of a store key) refreshes the
expiry of what it touched
(``key_ttl``), so finished runs vanish while a long round keeps its keys. The store scripts
answer with a status instead of touching a value that aelastic did not write: ``-1``
(wrong Redis type), ``-3`` (not an integer).
"""

from __future__ import annotations

import hashlib

from ._lua import HEALTH, OP, SNAPSHOT, STATUS

__all__ = [
    "HEALTH",
    "KV_ADD",
    "KV_COMPARE_SET",
    "KV_DELETE",
    "KV_GET",
    "KV_SET",
    "NOT_INTEGER",
    "OP",
    "RUN_TAG",
    "SCRIPTS",
    "SNAPSHOT",
    "STATUS",
    "WRONG_TYPE",
    "RunKeys",
    "glob_escape",
]

WRONG_TYPE = -1
NOT_INTEGER = -3


#: The prefix of a run id that braces would have broken: the tag is this plus its SHA-1.
RUN_TAG = "sha1-"


def glob_escape(text: str) -> str:
    """``text`` as a literal part of a ``SCAN MATCH`` pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class RunKeys:
    """The names of one run's keys and channel.

    Args:
        prefix: Namespace of every aelastic key (config key ``key_prefix``).
        run_id: The run; an id with braces would break the hash tag, so it is hashed.

    Attributes:
        base: The common prefix of the run's keys, hash tag included.
        state: The header hash of the rendezvous state.
        channel: The pub/sub channel every write of the run publishes to.
    """

    def __init__(self, prefix: str, run_id: str) -> None:
        tag = run_id
        if not tag or "{" in tag or "}" in tag:
            tag = RUN_TAG + hashlib.sha1(run_id.encode()).hexdigest()
        self.prefix = prefix
        #: How the run is named in its keys (its id, unless braces made it a hash).
        self.tag = tag
        self.base = f"{prefix}:{{{tag}}}"
        self.state = f"{self.base}:state"
        self.channel = f"{self.base}:changes"
        #: The keys of the rendezvous state, in the order the scripts of :mod:`._lua` take.
        self.rendezvous = (
            self.state,
            f"{self.base}:p",
            f"{self.base}:ports",
            f"{self.base}:w",
            f"{self.base}:r",
            f"{self.base}:b",
            f"{self.base}:s",
            f"{self.base}:order",
            f"{self.base}:prof",
            f"{self.base}:place",
            f"{self.base}:done",
            f"{self.base}:failed",
            f"{self.base}:health",
        )

    def __repr__(self) -> str:
        return f"RunKeys({self.base!r})"

    @staticmethod
    def state_pattern(prefix: str) -> str:
        """A ``SCAN MATCH`` pattern matching the state key of every run under ``prefix``
        (and possibly other keys: :meth:`tag_of_state` tells them apart)."""
        return glob_escape(prefix) + ":{*}:state"

    @staticmethod
    def tag_of_state(key: str, prefix: str) -> str | None:
        """The tag of the run whose state key is ``key``; ``None`` for any other key."""
        head, tail = prefix + ":{", "}:state"
        if not (key.startswith(head) and key.endswith(tail)):
            return None
        tag = key[len(head) : -len(tail)]
        return tag if tag and "{" not in tag and "}" not in tag else None

    def kv(self, key: str) -> str:
        """The string holding ``key`` of the members' store."""
        return f"{self.base}:kv:{key}"

    def op(self, op_id: str) -> str:
        """Where the result of a ``kv_add`` with id ``op_id`` is remembered."""
        return f"{self.base}:op:{op_id}"


_STRING_ONLY = """
local function foreign(key)
  local kind = redis.call('TYPE', key)['ok']
  if kind ~= 'none' and kind ~= 'string' then return kind end
  return false
end
"""

#: KEYS: the keys. ARGV: ttl ms. -> their values (nil when missing); a foreign type raises
#: WRONGTYPE. Reading a key refreshes its expiry: a long round keeps its store.
KV_GET = """
local out = {}
for i, key in ipairs(KEYS) do
  out[i] = redis.call('GET', key)
  if out[i] then redis.call('PEXPIRE', key, ARGV[1]) end
end
return out
"""

#: KEYS: key. ARGV: value, ttl ms, channel, message. -> {1} | {-1, type}
KV_SET = (
    _STRING_ONLY
    + """
local kind = foreign(KEYS[1])
if kind then return {-1, kind} end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.pcall('PUBLISH', ARGV[3], ARGV[4])
return {1}
"""
)

#: KEYS: key, op record. ARGV: amount, ttl ms, channel, message, op record ttl ms.
#: -> {1, new value as text} | {-1, type} | {-3}
KV_ADD = (
    _STRING_ONLY
    + """
local done = redis.call('GET', KEYS[2])
if done then return {1, done} end
local kind = foreign(KEYS[1])
if kind then return {-1, kind} end
local value = redis.call('GET', KEYS[1])
if value and not string.match(value, '^%-?%d+$') then return {-3} end
redis.call('INCRBY', KEYS[1], ARGV[1])
-- Read back as text: a Lua number (a double) cannot hold every 64-bit integer.
local new = redis.call('GET', KEYS[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('SET', KEYS[2], new, 'PX', ARGV[5])
redis.pcall('PUBLISH', ARGV[3], ARGV[4])
return {1, new}
"""
)

#: KEYS: key. ARGV: has expected ('1'/'0'), expected, desired, ttl ms, channel, message.
#: -> {1, value stored afterwards (or expected)} | {-1, type}
KV_COMPARE_SET = (
    _STRING_ONLY
    + """
local kind = foreign(KEYS[1])
if kind then return {-1, kind} end
local value = redis.call('GET', KEYS[1])
if not value then
  if ARGV[1] == '1' then return {1, ARGV[2]} end
elseif ARGV[1] ~= '1' or value ~= ARGV[2] then
  return {1, value}
end
redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[4])
redis.pcall('PUBLISH', ARGV[5], ARGV[6])
return {1, ARGV[3]}
"""
)

#: KEYS: key. ARGV: channel, message. -> {1, existed (0/1)} | {-1, type}
KV_DELETE = (
    _STRING_ONLY
    + """
local kind = foreign(KEYS[1])
if kind then return {-1, kind} end
local n = redis.call('DEL', KEYS[1])
if n > 0 then redis.pcall('PUBLISH', ARGV[1], ARGV[2]) end
return {1, n}
"""
)

#: Every script, by its SHA1 (what EVALSHA names it by).
SCRIPTS = {
    hashlib.sha1(src.encode()).hexdigest(): src
    for src in (OP, STATUS, SNAPSHOT, HEALTH, KV_GET, KV_SET, KV_ADD, KV_COMPARE_SET, KV_DELETE)
}
