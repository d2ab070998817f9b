"""The rendezvous state machine in Lua: one script applies one node's request atomically.

How it works: this is a line-by-line port of :func:`aelastic.core.machine.step` onto the
Redis layout of a run (see :mod:`._layout`): a header hash, the participants as a sorted set
(score: join order, then rank), the wait and redundancy lists as sets, the heartbeats as a
sorted set (score: time), the participants' bootstrap ports as a hash. Every request costs
O(1) commands plus O(pruned), and O(N) once per round at completion. Property tests run the
same random interleavings through this script and through the Python machine and require
the same replies and states (``tests/backends/test_redis_machine.py``): change one, change
both.

The script answers with the reply's JSON (:mod:`aelastic.core.wire`), writes the header
back, refreshes the keys' expiry, and publishes ``s<status JSON>`` on the run's channel when
the status's token changed. Time is the server's (``TIME``) unless a test passes its own.
Beyond the Python machine, the script keeps the primary's replication id in the header:
a request that finds another id (a replica was promoted, and may have missed the latest
writes) moves the state to a new epoch and publishes it, so a version lost in a failover
never shares a token with a later one, and every waiter re-reads the state.
A header of another format version, or keys of the wrong Redis type, are answered with an
error object and left untouched.
"""

from __future__ import annotations

__all__ = ["OP", "SNAPSHOT", "STATUS"]

# Shared: reading and checking the header. KEYS: header, participants, ports, wait list,
# redundancy list, beats. Returns h (a table) or nil plus an error object.
_HEADER = r"""
local HS, P, PORTS, W, R, B = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local TYPES = {[HS] = 'hash', [P] = 'zset', [PORTS] = 'hash', [W] = 'set', [R] = 'set',
               [B] = 'zset'}

-- Checks the Redis type of the given keys (all six by default); returns an error object
-- and whether the header exists.
local function check_types(keys)
  local exists = false
  for _, key in ipairs(keys or KEYS) do
    local kind = redis.call('TYPE', key)['ok']
    if kind ~= 'none' and kind ~= TYPES[key] then
      return {error = 'type', key = key, kind = kind}, false
    end
    if key == HS and kind ~= 'none' then exists = true end
  end
  return nil, exists
end

local function load_header(epoch, exists)
  local f = redis.call('HMGET', HS, 'format', 'epoch', 'version', 'round', 'complete',
    'closed', 'deadline', 'seq', 'world', 'lost', 'finished', 'sample', 'master_addr',
    'master_port', 'data', 'replid')
  if not f[1] and not f[2] and not f[15] then
    if exists then return nil, {error = 'foreign'} end
    return {fresh = true, epoch = epoch, gen = 0, round = 0, complete = false,
            closed = false, deadline = false, seq = 0, world = 0, lost = 0, finished = 0,
            sample = {}, master_addr = false, master_port = false, replid = false}
  end
  if f[1] ~= '2' then
    local ok, doc = pcall(cjson.decode, f[15] or '')
    if ok and type(doc) == 'table' and doc['format'] == 'aelastic.rendezvous.state' then
      return nil, {error = 'version', version = doc['version']}
    end
    return nil, {error = 'foreign'}
  end
  local sample = {}
  if f[12] and f[12] ~= '' then
    for name in string.gmatch(f[12], '[^\n]+') do table.insert(sample, name) end
  end
  return {fresh = false, epoch = f[2], gen = tonumber(f[3]), round = tonumber(f[4]),
          complete = f[5] == '1', closed = f[6] == '1',
          deadline = (f[7] ~= '' and tonumber(f[7])) or false, seq = tonumber(f[8]),
          world = tonumber(f[9]), lost = tonumber(f[10]), finished = tonumber(f[11]),
          sample = sample, master_addr = (f[13] ~= '' and f[13]) or false,
          master_port = (f[14] ~= '' and tonumber(f[14])) or false,
          replid = (f[16] and f[16] ~= '' and f[16]) or false}
end

local function status_of(h, now)
  local st = {token = h.epoch .. '.' .. string.format('%d', h.gen), round = h.round,
              complete = h.complete, closed = h.closed, now = now,
              participants = redis.call('ZCARD', P), world = h.world,
              waiting = redis.call('SCARD', W), redundant = redis.call('SCARD', R),
              lost = h.lost, finished = h.finished, lost_sample = h.sample}
  if h.deadline then st.deadline = h.deadline end
  return st
end

local function server_now(given)
  if given and given ~= '' then return tonumber(given) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

#: KEYS: header, participants, ports, wait list, redundancy list, beats.
#: ARGV: op, node, min, max, last call ms, window ms, expired, finished, port, now ms or '',
#: new epoch, ttl ms, channel, '1' to follow the primary's replication id (optional).
#: -> reply JSON | error JSON.
OP = (
    _HEADER
    + r"""
local op, node = ARGV[1], ARGV[2]
local min_n, max_n = tonumber(ARGV[3]), tonumber(ARGV[4])
local last_call, window = tonumber(ARGV[5]), tonumber(ARGV[6])
local expired, finished = ARGV[7] == '1', ARGV[8] == '1'
local port = tonumber(ARGV[9])
local ttl, channel = ARGV[12], ARGV[13]

-- A heartbeat or a status touches the header and the heartbeats (and, rarely, prunes):
-- the other keys are checked by the requests that change membership.
local light = op == 'keep_alive' or op == 'status'
local bad, exists = check_types(light and {HS, B} or nil)
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

local function signature()
  return table.concat({h.round, tostring(h.complete), tostring(h.closed),
    tostring(h.deadline), tostring(redis.call('SCARD', W) > 0), tostring(h.lost > 0),
    tostring(h.finished > 0)}, '|')
end

local function knows(n) return redis.call('ZSCORE', B, n) ~= false end
local function beat(n) redis.call('ZADD', B, now, n) end

local function open_next_round()
  h.round = h.round + 1
  h.complete = false
  h.deadline = false
  h.world, h.lost, h.finished = 0, 0, 0
  h.sample = {}
  h.master_addr, h.master_port = false, false
end

local function remove(n, fin)
  redis.call('ZREM', B, n)
  if redis.call('ZSCORE', P, n) == false then
    redis.call('SREM', W, n)
    redis.call('SREM', R, n)
    return
  end
  redis.call('ZREM', P, n)
  redis.call('HDEL', PORTS, n)
  local count = redis.call('ZCARD', P)
  if not h.complete then
    if count < min_n then h.deadline = false end
  elseif count == 0 then
    open_next_round()
  elseif fin then
    h.finished = h.finished + 1
  else
    h.lost = h.lost + 1
    if #h.sample < 4 then table.insert(h.sample, n) end
  end
end

local function prune()
  local dead = redis.call('ZRANGEBYSCORE', B, '-inf', '(' .. string.format('%d', now - window))
  for _, n in ipairs(dead) do remove(n, false) end
  return #dead
end

local function complete()
  local order = redis.call('ZRANGE', P, 0, -1)
  for i, n in ipairs(order) do redis.call('ZADD', P, i - 1, n) end
  local first = order[1]
  h.master_addr = string.match(first, '^(.*)_%d+_%d+$')
  h.master_port = tonumber(redis.call('HGET', PORTS, first) or '0')
  redis.call('DEL', PORTS)
  h.complete = true
  h.deadline = false
  h.world = #order
  h.lost, h.finished = 0, 0
  h.sample = {}
end

-- returns outcome, transition, wake_at, restart
local function join()
  if h.closed then
    if redis.call('SISMEMBER', R, node) == 1 then return 'graceful_exit', 'none' end
    return 'error_closed', 'none'
  end
  local exp, restart, transition = expired, false, 'none'
  if redis.call('SISMEMBER', R, node) == 1 then
    if redis.call('ZCARD', P) >= max_n then
      beat(node)
      return 'wait', 'keep_alive'
    end
    remove(node, false)
    exp, restart, transition = false, true, 'remove_from_redundancy_list'
  end
  local is_participant = redis.call('ZSCORE', P, node) ~= false
  if h.complete and is_participant then
    beat(node)
    return 'finish', transition, false, restart
  end
  if exp then
    if knows(node) then
      remove(node, false)
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
    beat(node)
    return 'wait', transition, false, restart
  end
  if is_participant then
    local count = redis.call('ZCARD', P)
    if min_n <= count and count <= max_n and h.deadline and h.deadline <= now then
      complete()
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
  beat(node)
  local count = redis.call('ZCARD', P)
  if count == min_n then h.deadline = now + last_call end
  if count == max_n then
    complete()
    return 'finish', 'mark_complete', false, restart
  end
  return 'wait', 'add_to_participants', h.deadline, restart
end

local function apply()
  if op == 'join' then return join() end
  if op == 'leave' then
    if not knows(node) then return 'finish', 'none' end
    remove(node, finished)
    return 'finish', 'remove'
  end
  if op == 'close' then
    if h.closed then return 'finish', 'none' end
    h.closed = true
    return 'finish', 'mark_closed'
  end
  if op == 'keep_alive' and knows(node) then
    beat(node)
    return 'finish', 'keep_alive'
  end
  return 'finish', 'none'
end

local before = signature()
local header_before = cjson.encode(h)
local pruned = prune()
local outcome, transition, wake_at, restart = apply()
if signature() ~= before then h.gen = h.gen + 1 end
if transition == 'none' and pruned > 0 then transition = 'prune' end

local fields = {'format', '2', 'epoch', h.epoch, 'version', string.format('%d', h.gen),
  'round', string.format('%d', h.round), 'complete', h.complete and '1' or '0',
  'closed', h.closed and '1' or '0',
  'deadline', h.deadline and string.format('%d', h.deadline) or '',
  'seq', string.format('%d', h.seq), 'world', string.format('%d', h.world),
  'lost', string.format('%d', h.lost), 'finished', string.format('%d', h.finished),
  'sample', table.concat(h.sample, '\n'), 'master_addr', h.master_addr or '',
  'master_port', h.master_port and string.format('%d', h.master_port) or '',
  'replid', h.replid or ''}
if h.fresh then
  table.insert(fields, 'data')
  table.insert(fields, '{"format":"aelastic.rendezvous.state","version":2}')
end
if h.fresh or moved or cjson.encode(h) ~= header_before then
  redis.call('HSET', HS, unpack(fields))
end
-- Every key's expiry is refreshed when membership changes, and otherwise once half of it
-- is used up (a heartbeat then costs one PTTL).
if not light or pruned > 0 or redis.call('PTTL', HS) < tonumber(ttl) / 2 then
  for _, key in ipairs(KEYS) do redis.call('PEXPIRE', key, ttl) end
else
  redis.call('PEXPIRE', B, ttl)
end

local status = status_of(h, now)
if h.fresh or moved or signature() ~= before then
  redis.pcall('PUBLISH', channel, 's' .. cjson.encode(status))
end
local reply = {outcome = outcome, status = status, transition = transition,
               restart = restart or false, known = knows(node), pruned = pruned}
if wake_at then reply.wake_at = wake_at end
if op == 'join' and outcome == 'finish' then
  reply.rank = tonumber(redis.call('ZSCORE', P, node))
  reply.master_addr = h.master_addr
  reply.master_port = h.master_port
end
if op == 'keep_alive' then
  local oldest = redis.call('ZRANGE', B, 0, 0, 'WITHSCORES')
  if oldest[2] then reply.oldest = tonumber(oldest[2]) end
end
return cjson.encode(reply)
"""
)

#: KEYS: as OP. ARGV: now ms or ''. -> status JSON | {"absent": true} | error JSON.
STATUS = (
    _HEADER
    + r"""
local bad, exists = check_types()
if bad then return cjson.encode(bad) end
local h, err = load_header('', exists)
if not h then return cjson.encode(err) end
if h.fresh then return cjson.encode({absent = true}) end
return cjson.encode(status_of(h, server_now(ARGV[1])))
"""
)

#: KEYS: as OP. ARGV: now ms or ''. -> snapshot JSON | {"absent": true} | error JSON.
SNAPSHOT = (
    _HEADER
    + r"""
local bad, exists = check_types()
if bad then return cjson.encode(bad) end
local h, err = load_header('', exists)
if not h then return cjson.encode(err) end
if h.fresh then return cjson.encode({absent = true}) end
local beats = {}
local raw = redis.call('ZRANGE', B, 0, -1, 'WITHSCORES')
for i = 1, #raw, 2 do beats[raw[i]] = tonumber(raw[i + 1]) end
local function entries(list, ranked)
  local out = {}
  for i = 1, #list, ranked and 2 or 1 do
    local n = list[i]
    local row = {n, beats[n] or 0}
    if ranked and h.complete then row[3] = tonumber(list[i + 1]) end
    table.insert(out, row)
  end
  return out
end
local wait, redundant = redis.call('SMEMBERS', W), redis.call('SMEMBERS', R)
local snap = {status = status_of(h, server_now(ARGV[1])),
              participants = entries(redis.call('ZRANGE', P, 0, -1, 'WITHSCORES'), true),
              wait_list = entries(wait, false), redundancy_list = entries(redundant, false)}
if h.master_addr then
  snap.master_addr = h.master_addr
  snap.master_port = h.master_port
end
return cjson.encode(snap)
"""
)
