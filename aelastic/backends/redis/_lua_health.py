"""The job's health in Lua: what a request says of its node, checked, and the folds of
:mod:`aelastic.core.health` onto the run's health hash.

How it works: this block runs inside the rendezvous script (:mod:`._lua`'s ``OP``), after
the header's names. A join says its node's worker role and local world size, a report its
node's failure or its host set aside (:mod:`._argv` lays them out in ``ARGV[20]`` on). The
script trusts none of it (another client with the run's keys may have sent it): a role of 1
to 256 characters without control characters, a local world size of 1 to 65,536, a failure
whose numbers are what :class:`~aelastic.core.health.FailureReport` admits (a finite time,
32-bit ranks and exit code) and whose message is within the bounds the Python side gives it
(:func:`~aelastic.core.health.bounded_message`: at most 2,000 characters, 20 lines), a
reason of at most 300 characters; every text UTF-8 (Python's ``surrogatepass`` form,
characters counted as Python does). Anything else is refused before any write.

The health lives in one hash per run (``...:health``, written only by the script):
``total`` (incidents so far), ``incidents`` (the newest 16, oldest first, as JSON; each
root's ``time`` is the request's text, so a float comes back exactly: Lua's JSON writes 14
digits), ``l:<host>`` (``"<count> <round>"``) and ``q:<host>`` (why it was set aside), and
``lost`` and ``quarantined`` counting those hosts (256 at most each). A loss or a
quarantine touches two fields; a failure report reads and writes the incidents (at most 16).
The folds are :func:`~aelastic.core.health.with_lost`, ``with_quarantined`` and
``reported`` line by line; the parity tests compare the hash, read back by
:mod:`._health`, with the Python machine's ``JobHealth``.
"""

from __future__ import annotations

__all__ = ["HEALTH_FOLDS"]

#: Defines utf8_length, short, read_profile, read_report, with_lost, with_quarantined,
#: reported. Needs HEADER's names.
HEALTH_FOLDS = r"""
local INT32, MAX_HOSTS, MAX_INCIDENTS = 2147483647, 256, 16

-- The characters (code points) of s, or nil when s is not UTF-8 (a lone surrogate, as
-- Python's 'surrogatepass' writes it, is a character).
local function utf8_length(s)
  if not string.find(s, '[\128-\255]') then return #s end
  local n, i, size = 0, 1, #s
  while i <= size do
    local c, width = string.byte(s, i), 1
    if c >= 245 or (c >= 128 and c < 194) then return nil end
    if c >= 240 then width = 4 elseif c >= 224 then width = 3 elseif c >= 194 then width = 2 end
    if i + width - 1 > size then return nil end
    for j = i + 1, i + width - 1 do
      local b = string.byte(s, j)
      if b < 128 or b > 191 then return nil end
    end
    local second = string.byte(s, i + 1)
    if (c == 224 and second < 160) or (c == 240 and second < 144) or (c == 244 and second > 143)
    then
      return nil  -- an overlong form, or past U+10FFFF
    end
    n, i = n + 1, i + width
  end
  return n
end

-- core.health._short: at most 300 characters ('...' ends a longer text).
local function short(text)
  if #text <= 300 then return text end
  local _, count = string.gsub(text, '[^\128-\191]', '')
  if count <= 300 then return text end
  local n = 0
  for pos in string.gmatch(text, '()[^\128-\191]') do
    n = n + 1
    if n == 298 then return string.sub(text, 1, pos - 1) .. '...' end
  end
  return text
end

local function integer(text, low)
  if type(text) ~= 'string' or not string.match(text, '^%-?%d+$') then return nil end
  local value = tonumber(text)
  if value < low or value > INT32 then return nil end
  return value
end

-- A join's profile: its role and local world size (absent: the defaults); nil and why
-- when it is not one.
local function read_profile()
  local role, size = ARGV[20] or 'default', integer(ARGV[21] or '1', 1)
  local length = utf8_length(role)
  if not length or length < 1 or length > 256 or string.find(role, '[%z\1-\31\127]') then
    return nil, "'role' must be a name of 1 to 256 printable characters"
  end
  if not size or size > 65536 then
    return nil, "'local_world_size' must be 1 to 65536"
  end
  return {role = role, size = size}
end

local function is_time(text)
  if type(text) ~= 'string' then return nil end
  if not (string.match(text, '^%-?%d+%.?%d*$') or string.match(text, '^%-?%d+%.?%d*e[%-+]?%d+$'))
  then
    return nil
  end
  local t = tonumber(text)
  return t and t == t and t ~= math.huge and t ~= -math.huge
end

-- A report: {quarantine = reason} or {failure = {...}}; false when there is none; nil and
-- why when it is not one.
local function read_report()
  local kind = ARGV[20]
  if not kind or kind == '' then return false end
  if kind == 'quarantine' then
    local length = utf8_length(ARGV[21] or '')
    if not length or length > 300 then
      return nil, "'quarantine' must be a reason of at most 300 characters"
    end
    return {quarantine = ARGV[21]}
  end
  if kind ~= 'failure' then return nil, 'a report is a failure or a quarantine' end
  if not is_time(ARGV[21]) then return nil, "'time' must be a finite number" end
  local rank, local_rank = integer(ARGV[22], 0), integer(ARGV[23], 0)
  local exitcode = integer(ARGV[24], -INT32)
  if not (rank and local_rank and exitcode) then
    return nil, "'rank', 'local_rank' and 'exitcode' must be 32-bit integers"
  end
  local message = ARGV[25] or ''
  local length = utf8_length(message)
  if not length or length > 2000 then
    return nil, "'message' must be UTF-8 text of at most 2000 characters"
  end
  local _, breaks = string.gsub(message, '\n', '')
  if breaks > 19 or string.find(message, '[\r\11\12\28\29\30]')
    or string.find(message, '\194\133', 1, true) or string.find(message, '\226\128[\168\169]')
  then
    return nil, "'message' must be at most 20 lines (as bounded_message leaves it)"
  end
  for _, flag in ipairs({ARGV[26] or '0', ARGV[27] or '0'}) do
    if flag ~= '0' and flag ~= '1' then
      return nil, "'stalled' and 'secondary' must be booleans"
    end
  end
  return {failure = {time = ARGV[21], rank = rank, local_rank = local_rank,
                     exitcode = exitcode, message = message, stalled = ARGV[26] == '1',
                     secondary = ARGV[27] == '1'}}
end

-- core.health.with_lost (no quarantine after losses): whether the health changed.
local function with_lost(addr, round)
  local host = short(addr)
  local counted, count = redis.call('HGET', H, 'l:' .. host), 1
  if counted then
    local c, r = string.match(counted, '^(%d+) (%d+)$')
    if tonumber(r) >= round then return false end
    count = tonumber(c) + 1
  else
    local hosts = tonumber(redis.call('HGET', H, 'lost') or '0')
    if hosts >= MAX_HOSTS then return false end
    redis.call('HSET', H, 'lost', string.format('%d', hosts + 1))
  end
  redis.call('HSET', H, 'l:' .. host, string.format('%d %d', count, round))
  return true
end

-- core.health.with_quarantined: whether the health changed.
local function with_quarantined(addr, reason)
  local host = short(addr)
  if redis.call('HGET', H, 'q:' .. host) then return false end
  local hosts = tonumber(redis.call('HGET', H, 'quarantined') or '0')
  if hosts >= MAX_HOSTS then return false end
  redis.call('HSET', H, 'q:' .. host, short(reason), 'quarantined',
    string.format('%d', hosts + 1))
  return true
end

-- Whether record a ranks before record b as a root cause: (secondary, time, node rank,
-- rank), as core.health._rank_key orders them.
local function before(a, b)
  if a.secondary ~= b.secondary then return b.secondary end
  local ta, tb = tonumber(a.time), tonumber(b.time)
  if ta ~= tb then return ta < tb end
  if a.node_rank ~= b.node_rank then return a.node_rank < b.node_rank end
  return a.rank < b.rank
end

local function streak(previous, record)
  if previous and previous.root.host == record.host then return previous.streak + 1 end
  return 1
end

-- core.health.reported: the health after a node reported record, `failed` nodes having
-- reported a failure in its round so far.
local function reported(record, failed)
  local raw = redis.call('HGET', H, 'incidents')
  local incidents = raw and cjson.decode(raw) or {}
  local total = tonumber(redis.call('HGET', H, 'total') or '0')
  local latest = incidents[#incidents]
  if latest and latest.round > record.round then return end  -- an older round
  if latest and latest.round == record.round then
    if before(record, latest.root) then
      incidents[#incidents] = {round = record.round, root = record,
                               streak = streak(incidents[#incidents - 1], record),
                               failed = latest.failed}
    end
  else
    total = total + 1
    table.insert(incidents, {round = record.round, root = record,
                             streak = streak(latest, record), failed = 1})
    if #incidents > MAX_INCIDENTS then table.remove(incidents, 1) end
  end
  incidents[#incidents].failed = failed
  redis.call('HSET', H, 'incidents', cjson.encode(incidents), 'total',
    string.format('%d', total))
end
"""
