"""The rendezvous state machine in Lua: one script applies one node's request atomically.

How it works: this is a line-by-line port of :func:`aelastic.core.machine.step` onto the
Redis layout of a run (see :mod:`._scripts`): a header hash (with the run's rules), the
participants as a sorted set (score: join order, then rank), the wait and redundancy lists
as sets, the heartbeats as a sorted set (score: time), the participants' bootstrap ports and
the nodes' secrets as hashes (a secret is compared with Lua's byte equality), the
participants' profiles (role, local world size) and the members' placements as hashes, the
members done and failed as sets, the job's health as a hash (:mod:`._lua_health`). Every
request costs O(1) commands plus O(pruned), and O(N) once per round: at completion
(:mod:`._lua_round`: ranks, placements) and when the next round opens (the round's
profiles, placements and sets deleted). Property tests run the same random interleavings
through this script and through the Python machine and require the same replies and states
(``tests/backends/test_redis_machine.py``): change one, change both.

A plain heartbeat is answered before all this, by the short path of :mod:`._lua_beat` (a few
commands, the brief answer of :mod:`aelastic.core.brief`); whatever it cannot answer falls
through, unchanged, to the port. The script answers with the reply's JSON
(:mod:`aelastic.core.wire`), writes the header
back, refreshes the keys' expiry, and publishes ``s<status JSON>`` on the run's channel when
the status's token changed. Time is the server's (``TIME``) unless a test passes its own.
Beyond the Python machine, the script keeps the primary's replication id in the header:
a request that finds another id (a replica was promoted, and may have missed the latest
writes) moves the state to a new epoch and publishes it, so a version lost in a failover
never shares a token with a later one, and every waiter re-reads the state; and it takes
every listed node's heartbeat as now, so that the beats lost with the old primary (and
those sent while the sentinels chose another) are not counted against the members.
A header of another format version, or keys of the wrong Redis type, are answered with an
error object and left untouched.
"""

from __future__ import annotations

from ._lua_beat import SHORT_BEAT
from ._lua_health import HEALTH_FOLDS
from ._lua_read import HEADER as _HEADER
from ._lua_read import HEALTH, SNAPSHOT, STATUS
from ._lua_round import COMPLETE

__all__ = ["HEALTH", "OP", "SNAPSHOT", "STATUS"]

#: KEYS: the run's (:class:`._scripts.RunKeys`, ``rendezvous``).
#: ARGV (laid out by :func:`._argv.op_args`): op, node, min, max, last call ms, window ms,
#: expired, finished, port, now ms or '', new epoch, ttl ms, channel, '1' to follow the
#: primary's replication id, the node's secret, '1' for an operator's close or departure,
#: the beat key of a keep-alive ('' or absent: none; see :mod:`._lua_beat`), a departure's
#: moment (ms), '1' for a confirmed departure (no grace); from 20 on, what a join or a report
#: says (:mod:`._lua_health`). -> reply JSON | brief answer JSON | error JSON.
OP = (
    _HEADER
    + SHORT_BEAT
    + HEALTH_FOLDS
    + COMPLETE
    + r"""
local op, node = ARGV[1], ARGV[2]
local asked = {min = tonumber(ARGV[3]), max = tonumber(ARGV[4]),
               last_call = tonumber(ARGV[5]), window = tonumber(ARGV[6])}
local expired, finished = ARGV[7] == '1', ARGV[8] == '1'
local port = tonumber(ARGV[9])
local ttl, channel = ARGV[12], ARGV[13]
local secret, operator = ARGV[15] or '', ARGV[16] == '1'

-- What a join or a report says beyond its node, checked before anything is read or written.
local profile, report, refused
if op == 'join' then profile, refused = read_profile() end
if op == 'report' then report, refused = read_report() end
if refused then return cjson.encode({error = 'request', why = refused}) end

-- A heartbeat or a status touches the header, the heartbeats and the secrets (and,
-- rarely, prunes): the other keys are checked by the requests that change membership.
local light = op == 'keep_alive' or op == 'status'
local bad, exists = check_types(light and {HS, B, S} or nil)
if bad then return cjson.encode(bad) end
local h, err = load_header(ARGV[11], exists)
if not h then return cjson.encode(err) end
local now = server_now(ARGV[10])

-- A replica promoted to primary has a new replication id. A state written under another
-- id may have lost its latest versions in the failover (replication is asynchronous): it
-- moves to a new epoch, so that no token of a lost version ever names another state.
local moved = false
if ARGV[14] == '1' then
  local info = redis.pcall('INFO', 'replication')
  local replid = type(info) == 'string' and string.match(info, 'master_replid:(%w+)')
  if replid and h.replid ~= replid then
    if not h.fresh then h.epoch, moved = ARGV[11], true end
    h.replid = replid
  end
end
-- The beats sent while the old primary failed and the sentinels chose another (longer than
-- a short window) are lost, as are those it had not replicated: they are not counted
-- against the members. Every listed node's beat is taken as now (O(N), once a failover).
if moved then
  local listed = redis.call('ZRANGE', B, 0, -1)
  for i = 1, #listed, 500 do
    local args = {}
    for j = i, math.min(i + 499, #listed) do
      table.insert(args, now)
      table.insert(args, listed[j])
    end
    redis.call('ZADD', B, unpack(args))
  end
end

local function all_done()
  return h.complete and h.world > 0 and redis.call('SCARD', D) + h.finished >= h.world
end

local function signature()
  return table.concat({h.round, tostring(h.complete), tostring(h.closed),
    tostring(h.deadline), tostring(redis.call('SCARD', W) > 0), tostring(h.lost > 0),
    tostring(h.finished > 0), tostring(all_done())}, '|')
end

local function knows(n) return redis.call('ZSCORE', B, n) ~= false end
local function owns(n) return redis.call('HGET', S, n) == secret end
local function beat(n) redis.call('ZADD', B, now, n) end
local function participant(n) return redis.call('ZSCORE', P, n) ~= false end
-- A node not yet listed is listed: its heartbeat and its secret.
local function enter(n)
  redis.call('HSETNX', S, n, secret)
  h.vacated = false
  beat(n)
end

local function open_next_round()
  h.round = h.round + 1
  h.complete = false
  h.deadline = false
  h.world, h.lost, h.finished = 0, 0, 0
  h.sample = {}
  h.master_addr, h.master_port = false, false
  redis.call('DEL', PROF, PLACE, D, F)
end

-- Removes n, gone at time `at` (a run empty since then may be reused). A member of a
-- complete round that said it was done, or leaves finished (`fin`), counts as finished;
-- else it is lost, and its host counted lost when it went silent (dropped, not a leave).
local function remove(n, at, fin, silent)
  redis.call('ZREM', B, n)
  redis.call('HDEL', S, n)
  if redis.call('ZCARD', B) == 0 then h.vacated = at end
  if not participant(n) then
    redis.call('SREM', W, n)
    redis.call('SREM', R, n)
    return
  end
  redis.call('ZREM', P, n)
  redis.call('HDEL', PORTS, n)
  redis.call('HDEL', PROF, n)
  local count = redis.call('ZCARD', P)
  if not h.complete then
    if count < h.rules.min then h.deadline = false end
    return
  end
  local was_done = redis.call('SREM', D, n) == 1
  if fin or was_done then
    h.finished = h.finished + 1
  else
    h.lost = h.lost + 1
    if #h.sample < 4 then table.insert(h.sample, n) end
    if silent then with_lost(string.match(n, '^(.*)_%d+_%d+$'), h.round) end
  end
  if count == 0 then open_next_round() end
end

local function prune()
  if not h.rules then return 0 end
  local dead = redis.call('ZRANGEBYSCORE', B, '-inf',
    '(' .. string.format('%d', now - h.rules.window), 'WITHSCORES')
  for i = 1, #dead, 2 do
    remove(dead[i], tonumber(dead[i + 1]) + h.rules.window, false, true)
  end
  return #dead / 2
end

local function same_rules(a, b)
  return a.min == b.min and a.max == b.max and a.last_call == b.last_call
    and a.window == b.window
end

-- When the empty run can be made a new one (two heartbeat windows after its last node
-- left); false while nodes are still in it.
local function reopen_at()
  if not h.vacated or not h.rules or redis.call('ZCARD', B) > 0 then return false end
  return h.vacated + 2 * h.rules.window
end

-- A join to a closed run ends this node's part in it.
local function join_closed()
  local outcome = 'error_closed'
  if redis.call('SISMEMBER', R, node) == 1 then outcome = 'graceful_exit' end
  if knows(node) then
    remove(node, now, false, false)
    return outcome, 'remove'
  end
  return outcome, 'none'
end

-- returns outcome, transition, wake_at, restart
local function join()
  if knows(node) and not owns(node) then return 'error_forbidden', 'none' end
  local reopen = reopen_at()
  if reopen and reopen <= now then
    -- empty for its grace: a new job may take the id (the next round, its rules, no history)
    h.closed, h.rules, h.vacated = false, asked, false
    redis.call('DEL', H)
    open_next_round()
  elseif h.closed then
    return join_closed()
  end
  if not h.rules then
    h.rules = asked  -- this join makes the run: its rules are the run's
  elseif not same_rules(h.rules, asked) then
    return 'error_rules', 'none'
  end
  local min_n, max_n = h.rules.min, h.rules.max
  local exp, restart, transition = expired, false, 'none'
  if redis.call('SISMEMBER', R, node) == 1 then
    if redis.call('ZCARD', P) >= max_n then
      beat(node)
      return 'wait', 'keep_alive'
    end
    remove(node, now, false, false)
    exp, restart, transition = false, true, 'remove_from_redundancy_list'
  end
  local is_participant = participant(node)
  if h.complete and is_participant then
    beat(node)
    return 'finish', transition, false, restart
  end
  if exp then
    if knows(node) then
      remove(node, now, false, false)
      transition = 'remove'
    end
    return 'error_timeout', transition
  end
  if h.complete then
    if redis.call('SISMEMBER', W, node) == 0 then
      if redis.call('ZCARD', P) < max_n then
        redis.call('SADD', W, node)
        transition = 'add_to_wait_list'
      else
        redis.call('SADD', R, node)
        transition = 'add_to_redundancy_list'
      end
    end
    enter(node)
    return 'wait', transition, false, restart
  end
  if is_participant then
    local count = redis.call('ZCARD', P)
    if min_n <= count and count <= max_n and h.deadline and h.deadline <= now then
      complete(h)
      beat(node)
      return 'finish', 'mark_complete', false, restart
    end
    beat(node)
    return 'wait', 'keep_alive', h.deadline, restart
  end
  redis.call('SREM', W, node)
  h.seq = h.seq + 1
  redis.call('ZADD', P, h.seq, node)
  redis.call('HSET', PORTS, node, port)
  redis.call('HSET', PROF, node, string.format('%d ', profile.size) .. profile.role)
  enter(node)
  local count = redis.call('ZCARD', P)
  if count == min_n then h.deadline = now + h.rules.last_call end
  if count == max_n then
    complete(h)
    return 'finish', 'mark_complete', false, restart
  end
  return 'wait', 'add_to_participants', h.deadline, restart
end

-- A run-level act, whoever asks; a close of a run no join made makes it (closed), but the
-- operator's close of an unknown run.
local function close()
  if h.closed then return 'finish', 'none' end
  if not h.rules then
    if operator then return 'finish', 'none' end  -- nothing to close, nothing stored
    h.rules = asked
  end
  h.closed = true
  if redis.call('ZCARD', B) == 0 then h.vacated = now end
  return 'finish', 'mark_closed'
end

-- A member's report of itself (core.machine's _report): its failure in its complete round
-- (who and where filled in here), or its own host set aside.
local function report_of()
  if not report then return 'finish', 'none' end
  beat(node)
  local addr = string.match(node, '^(.*)_%d+_%d+$')
  if report.quarantine then
    if not with_quarantined(addr, report.quarantine) then return 'finish', 'none' end
    return 'finish', 'report'
  end
  local rank = redis.call('ZSCORE', P, node)
  if not h.complete or not rank then return 'finish', 'none' end
  redis.call('SADD', F, node)
  local failure = report.failure
  local record = {time = failure.time, host = short(addr), node = short(node),
                  node_rank = tonumber(rank), rank = failure.rank,
                  local_rank = failure.local_rank, exitcode = failure.exitcode,
                  message = failure.message, round = h.round, stalled = failure.stalled,
                  secondary = failure.secondary}
  reported(record, redis.call('SCARD', F))
  return 'finish', 'report'
end

-- A member says its workers succeeded in its complete round (the exit barrier).
local function done()
  beat(node)
  if not h.complete or not participant(node) or redis.call('SISMEMBER', D, node) == 1 then
    return 'finish', 'none'
  end
  redis.call('SADD', D, node)
  return 'finish', 'mark_done'
end

-- A backend's report that node's connection ended at `since` (core.machine's _depart).
local function depart()
  local since = tonumber(ARGV[18] or '')
  if not since then return 'finish', 'none' end
  local due = since
  if ARGV[19] ~= '1' then due = since + math.min(math.floor(h.rules.window / 2), 1000) end
  if now < due then return 'wait', 'none', due end
  if tonumber(redis.call('ZSCORE', B, node)) > since then return 'finish', 'none' end
  remove(node, now, false, true)
  return 'finish', 'remove'
end

local function apply()
  if op == 'join' then return join() end
  if op == 'close' then return close() end
  if op == 'status' or not knows(node) then return 'finish', 'none' end
  if op == 'depart' and operator then return depart() end
  -- a leave, a heartbeat, a report or a departure for another node
  if not owns(node) then return 'error_forbidden', 'none' end
  if op == 'depart' then return depart() end
  if op == 'leave' then
    remove(node, now, finished, false)
    return 'finish', 'remove'
  end
  if op == 'report' then return report_of() end
  if op == 'done' then return done() end
  beat(node)
  return 'finish', 'keep_alive'
end

local before = signature()
local header_before = cjson.encode(h)
local pruned = prune()
local outcome, transition, wake_at, restart = apply()
if signature() ~= before then h.gen = h.gen + 1 end
if transition == 'none' and pruned > 0 then transition = 'prune' end

-- A state that no join or close made is answered and not stored. Every key's expiry is
-- refreshed when membership changes, and otherwise once half of it is used up (a heartbeat
-- then costs one PTTL).
if h.rules then
  local write = h.fresh or moved or cjson.encode(h) ~= header_before
  local all = not light or pruned > 0 or redis.call('PTTL', HS) < tonumber(ttl) / 2
  store_header(h, write, all, ttl)
end

local status = status_of(h, now)
if h.rules and (h.fresh or moved or signature() ~= before) then
  redis.pcall('PUBLISH', channel, 's' .. cjson.encode(status))
end
local reply = {outcome = outcome, status = status, transition = transition,
               restart = restart or false, known = owns(node), pruned = pruned}
if wake_at then reply.wake_at = wake_at end
-- A join refused for other rules, or because the run closed: the run's rules and when it
-- is free again (from which a node tells an ended job from its own, not yet started).
if outcome == 'error_closed' or outcome == 'error_rules' then
  reply.rules = h.rules
  reply.reopen_at = reopen_at() or nil
end
if op == 'join' and outcome == 'finish' then
  reply.rank = tonumber(redis.call('ZSCORE', P, node))
  reply.master_addr = h.master_addr
  reply.master_port = h.master_port
  local place = redis.call('HGET', PLACE, node)
  if place then
    local b, w, rb, rw = string.match(place, '^(%d+) (%d+) (%d+) (%d+)$')
    reply.placement = {tonumber(b), tonumber(w), tonumber(rb), tonumber(rw)}
  end
end
if op == 'keep_alive' then
  local oldest = redis.call('ZRANGE', B, 0, 0, 'WITHSCORES')
  if oldest[2] then reply.oldest = tonumber(oldest[2]) end
end
return cjson.encode(reply)
"""
)
