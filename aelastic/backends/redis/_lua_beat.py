"""The heartbeat's short path in Lua: a beat at the cost of a few plain commands.

How it works: this block runs at the top of the rendezvous script (:mod:`._lua`'s ``OP``),
after the header's definitions. A keep-alive that carries a beat key
(:func:`aelastic.core.brief.beat_key` of the last status its node received) is answered here
when nothing but time moved: the run's header has format 4 and a complete round, the node is
listed under the request's secret, the status has that key (token, lost, finished, waiting,
redundant and done counts), nobody's beat is older than the window (nothing to prune) and the
keys' expiry is more than half left. Then the beat is recorded (``ZADD``) and the answer is
``[now, oldest]`` (:func:`aelastic.core.brief.brief_to_json`): with HMGET, HGET, three
SCARD, TIME, ZRANGE and PTTL, nine commands, no JSON encoding, no header write. Anything else (an
error, a type, a prune, news, an expiry to refresh) falls through, before any write, to the
whole port of the machine below, which answers it in full. The property tests run both
(``tests/backends/test_redis_machine.py``): the short answer, made whole, equals the Python
machine's reply.

Failover: the short path does not read the primary's replication id (``INFO`` costs more
than the beat). It writes no header field, so no token can be reused for another state:
every request that changes the header takes the whole path, which checks the id first and
moves the epoch; and a beat lost with the old primary makes the oldest beat look expired,
which sends that request down the whole path too (where every beat is taken as now).
"""

from __future__ import annotations

__all__ = ["SHORT_BEAT"]

#: ARGV[17]: the beat key, or '' (or absent) for the whole path. Needs HEADER's names.
SHORT_BEAT = r"""
if ARGV[1] == 'keep_alive' and ARGV[17] and ARGV[17] ~= '' then
  local short = (function()
    local f = redis.pcall('HMGET', HS, 'format', 'epoch', 'version', 'complete', 'lost',
      'finished', 'window')
    if type(f) ~= 'table' or f.err or f[1] ~= '4' or f[4] ~= '1' then return nil end
    if not (f[2] and f[3] and f[5] and f[6] and f[7]) then return nil end
    local stored = redis.pcall('HGET', S, ARGV[2])
    if type(stored) ~= 'string' or stored ~= (ARGV[15] or '') then return nil end
    local waiting, redundant = redis.pcall('SCARD', W), redis.pcall('SCARD', R)
    local done = redis.pcall('SCARD', D)
    if type(waiting) ~= 'number' or type(redundant) ~= 'number' or type(done) ~= 'number' then
      return nil
    end
    local key = f[2] .. '.' .. f[3] .. '|' .. f[5] .. '|' .. f[6] .. '|'
      .. string.format('%d|%d|%d', waiting, redundant, done)
    if key ~= ARGV[17] then return nil end
    local now = server_now(ARGV[10])
    local first = redis.pcall('ZRANGE', B, 0, 1, 'WITHSCORES')
    if type(first) ~= 'table' or first.err or not first[2] then return nil end
    if tonumber(first[2]) < now - tonumber(f[7]) then return nil end
    if redis.call('PTTL', HS) < tonumber(ARGV[12]) / 2 then return nil end
    redis.call('ZADD', B, now, ARGV[2])
    local other = first[2]
    if first[1] == ARGV[2] then other = first[4] end
    local oldest = now
    if other and tonumber(other) < now then oldest = tonumber(other) end
    return string.format('[%d,%d]', now, oldest)
  end)()
  if short then return short end
end
"""
