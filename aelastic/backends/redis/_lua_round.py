"""A round's completion in Lua: the members' ranks in torch's order, and where each member's
workers stand.

How it works: this block runs inside the rendezvous script (:mod:`._lua`'s ``OP``), after
the header's names; ``complete(h)`` is :func:`aelastic.core.machine._complete`. Ranks are
Python's ``NodeDesc`` order (address, then pid, then local id), sorted by Redis: each name
goes into a temporary sorted set as a member whose bytes order as that tuple (equal scores
order by memcmp, which is Python's ``str`` order on UTF-8; a NUL ends the address, so a
prefix comes first). Not Lua's ``<`` on strings: that is ``strcoll``, the server's locale,
which may ignore ``.`` and ``-``. (Measured, Redis CPU per completion of 4,096 nodes: 32 ms;
a ``table.sort`` with a byte-comparing function, 70 ms; join order, 10 ms.) The
placements are :func:`aelastic.core.machine._placements`: prefix sums of the members' local
world sizes in rank order, and the same within each role, from the profiles their joins
stored (``...:prof``, ``"<size> <role>"``), written to ``...:place``
(``"<base> <world> <role base> <role world>"``). O(N), once per round.
"""

from __future__ import annotations

__all__ = ["COMPLETE"]

#: Defines complete(h). Needs HEADER's names.
COMPLETE = r"""
-- A decimal number as bytes that order as the number: its length (2 bytes), its digits.
local function ordered(digits)
  return string.char(math.floor(#digits / 256), #digits % 256) .. digits
end

-- Runs f(first, last) over 1..n in slices of 500 (a command's arguments stay few).
local function slices(n, f)
  for i = 1, n, 500 do f(i, math.min(i + 499, n)) end
end

local function sorted_members()
  local names, by_key = redis.call('ZRANGE', P, 0, -1), {}
  slices(#names, function(first, last)
    local args = {}
    for j = first, last do
      local addr, pid, id = string.match(names[j], '^(.*)_(%d+)_(%d+)$')
      local key = addr .. '\0' .. ordered(pid) .. ordered(id)
      by_key[key] = names[j]
      args[#args + 1] = 0
      args[#args + 1] = key
    end
    redis.call('ZADD', ORDER, unpack(args))
  end)
  local order = redis.call('ZRANGE', ORDER, 0, -1)
  redis.call('DEL', ORDER)
  for j = 1, #order do order[j] = by_key[order[j]] end
  return order
end

-- Where each member's workers stand (torch's rank assignment), members in rank order.
local function place(order)
  local roles, sizes, world = {}, {}, 0
  slices(#order, function(first, last)
    local got = redis.call('HMGET', PROF, unpack(order, first, last))
    for j = first, last do
      local size, role = string.match(got[j - first + 1] or '', '^(%d+) (.*)$')
      size, role = tonumber(size) or 1, role or 'default'
      roles[j], sizes[j] = role, size
      world = world + size
    end
  end)
  local in_role, role_bases = {}, {}
  for j = 1, #order do in_role[roles[j]] = (in_role[roles[j]] or 0) + sizes[j] end
  redis.call('DEL', PLACE)
  local base = 0
  slices(#order, function(first, last)
    local args = {}
    for j = first, last do
      local role = roles[j]
      local role_base = role_bases[role] or 0
      args[#args + 1] = order[j]
      args[#args + 1] = string.format('%d %d %d %d', base, world, role_base, in_role[role])
      base = base + sizes[j]
      role_bases[role] = role_base + sizes[j]
    end
    redis.call('HSET', PLACE, unpack(args))
  end)
end

local function complete(h)
  local order = sorted_members()
  slices(#order, function(first, last)
    local args = {}
    for j = first, last do
      args[#args + 1] = j - 1
      args[#args + 1] = order[j]
    end
    redis.call('ZADD', P, unpack(args))
  end)
  local first = order[1]
  h.master_addr = string.match(first, '^(.*)_%d+_%d+$')
  h.master_port = tonumber(redis.call('HGET', PORTS, first) or '0')
  redis.call('DEL', PORTS)
  h.complete = true
  h.deadline = false
  h.world = #order
  h.lost, h.finished = 0, 0
  h.sample = {}
  place(order)
  redis.call('DEL', D, F)
end
"""
