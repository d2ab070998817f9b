"""The Lua that reads a run: the header every rendezvous script starts with, and the
scripts reading a run's status, snapshot and job health.

How it works: every rendezvous script (these and :mod:`._lua`'s ``OP``) starts with
:data:`HEADER`. It names the run's keys, checks their Redis types, reads the header hash
into a table ``h`` (the run's rules in ``h.rules``; ``false`` while no join made the run),
writes it back (``OP`` only), and makes the status of ``h``, as
:func:`aelastic.core.state.status_of` does.
:data:`HEALTH` answers the job's health hash as it is (:mod:`._health` reads it).
"""

from __future__ import annotations

__all__ = ["HEADER", "HEALTH", "SNAPSHOT", "STATUS"]

#: KEYS: header, participants, ports, wait list, redundancy list, beats, secrets, a sorted
#: set used (and deleted) while a round's ranks are fixed, the participants' profiles, the
#: members' placements, the members done, the members failed, the job's health
#: (:class:`._scripts.RunKeys`). Defines check_types, load_header, store_header, status_of,
#: server_now.
HEADER = r"""
local HS, P, PORTS, W, R, B, S, ORDER = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5],
  KEYS[6], KEYS[7], KEYS[8]
local PROF, PLACE, D, F, H = KEYS[9], KEYS[10], KEYS[11], KEYS[12], KEYS[13]
local TYPES = {[HS] = 'hash', [P] = 'zset', [PORTS] = 'hash', [W] = 'set', [R] = 'set',
               [B] = 'zset', [S] = 'hash', [ORDER] = 'zset', [PROF] = 'hash',
               [PLACE] = 'hash', [D] = 'set', [F] = 'set', [H] = 'hash'}

-- Checks the Redis type of the given keys (all of them by default); returns an error
-- object and whether the header exists.
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
    'master_port', 'data', 'replid', 'min', 'max', 'last_call', 'window', 'vacated')
  if not f[1] and not f[2] and not f[15] then
    if exists then return nil, {error = 'foreign'} end
    return {fresh = true, epoch = epoch, gen = 0, round = 0, complete = false,
            closed = false, deadline = false, seq = 0, world = 0, lost = 0, finished = 0,
            sample = {}, master_addr = false, master_port = false, replid = false,
            rules = false, vacated = false}
  end
  if f[1] ~= '4' then
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
          replid = (f[16] and f[16] ~= '' and f[16]) or false,
          rules = {min = tonumber(f[17]), max = tonumber(f[18]),
                   last_call = tonumber(f[19]), window = tonumber(f[20])},
          vacated = (f[21] and f[21] ~= '' and tonumber(f[21])) or false}
end

-- Writes h back (when `write`: it changed, or the state is new) and refreshes the expiry
-- of every key (`all`) or of the heartbeats' and secrets' only.
local function store_header(h, write, all, ttl)
  local r = h.rules
  local fields = {'format', '4', 'epoch', h.epoch, 'version', string.format('%d', h.gen),
    'round', string.format('%d', h.round), 'complete', h.complete and '1' or '0',
    'closed', h.closed and '1' or '0',
    'deadline', h.deadline and string.format('%d', h.deadline) or '',
    'seq', string.format('%d', h.seq), 'world', string.format('%d', h.world),
    'lost', string.format('%d', h.lost), 'finished', string.format('%d', h.finished),
    'sample', table.concat(h.sample, '\n'), 'master_addr', h.master_addr or '',
    'master_port', h.master_port and string.format('%d', h.master_port) or '',
    'replid', h.replid or '', 'min', string.format('%d', r.min),
    'max', string.format('%d', r.max), 'last_call', string.format('%d', r.last_call),
    'window', string.format('%d', r.window),
    'vacated', h.vacated and string.format('%d', h.vacated) or ''}
  if h.fresh then
    table.insert(fields, 'data')
    table.insert(fields, '{"format":"aelastic.rendezvous.state","version":4}')
  end
  if write then redis.call('HSET', HS, unpack(fields)) end
  if all then
    for _, key in ipairs(KEYS) do redis.call('PEXPIRE', key, ttl) end
  else
    redis.call('PEXPIRE', B, ttl)
    redis.call('PEXPIRE', S, ttl)
  end
end

-- The status of h; an empty one (token '') while no join made the run.
local function status_of(h, now)
  if not h.rules then
    return {token = '', round = 0, complete = false, closed = false, now = now,
            participants = 0, world = 0, waiting = 0, redundant = 0, lost = 0,
            finished = 0, lost_sample = {}, done = 0}
  end
  local st = {token = h.epoch .. '.' .. string.format('%d', h.gen), round = h.round,
              complete = h.complete, closed = h.closed, now = now,
              participants = redis.call('ZCARD', P), world = h.world,
              waiting = redis.call('SCARD', W), redundant = redis.call('SCARD', R),
              lost = h.lost, finished = h.finished, lost_sample = h.sample,
              done = redis.call('SCARD', D)}
  if h.deadline then st.deadline = h.deadline end
  return st
end

local function server_now(given)
  if given and given ~= '' then return tonumber(given) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

#: KEYS: as OP. ARGV: now ms or ''. -> status JSON | {"absent": true} | error JSON.
STATUS = (
    HEADER
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
    HEADER
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
              wait_list = entries(wait, false), redundancy_list = entries(redundant, false),
              rules = h.rules}
if h.master_addr then
  snap.master_addr = h.master_addr
  snap.master_port = h.master_port
end
return cjson.encode(snap)
"""
)

#: KEYS: as OP. ARGV: none. -> the health hash's fields and values (HGETALL) |
#: {"absent": true} | error JSON.
HEALTH = (
    HEADER
    + r"""
local bad, exists = check_types({HS, H})
if bad then return cjson.encode(bad) end
local h, err = load_header('', exists)
if not h then return cjson.encode(err) end
if h.fresh then return cjson.encode({absent = true}) end
return redis.call('HGETALL', H)
"""
)
