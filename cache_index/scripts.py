"""The Lua scripts of the index: each one is a step that must be atomic or must stay one round trip.

Every script touches only keys of one namespace (one Redis Cluster slot thanks to the hash tag),
and every key it touches is passed in KEYS. Timestamps come from the server's clock (`TIME`), so
control-plane replicas with skewed clocks agree on heartbeat ages.
"""

from __future__ import annotations

from redis import Redis
from redis.commands.core import Script

_NOW_MS = """
local t = redis.call('TIME')
local now = string.format('%d', t[1] * 1000 + math.floor(t[2] / 1000))
"""

# KEYS: epochs, live, worker record, fenced.  ARGV: worker id, info json ('' keeps it),
# mode ('register' always succeeds; 'bump' only for the writer that holds `expected`), expected.
# Returns the new epoch, -1 if another epoch is live (superseded), -2 if the worker is dead.
NEW_EPOCH = (
    _NOW_MS
    + """
local wid, info, mode, expected = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local cur = redis.call('HGET', KEYS[2], wid)
if mode == 'bump' then
  if cur then
    if cur ~= expected then return -1 end
  elseif redis.call('HGET', KEYS[3], 'state') == 'dead' then
    return -2
  end
end
if cur then redis.call('SADD', KEYS[4], wid .. '@' .. cur) end
local epoch = redis.call('HINCRBY', KEYS[1], wid, 1)
local floor = tonumber(expected)
if floor and epoch <= floor then
  epoch = floor + 1
  redis.call('HSET', KEYS[1], wid, epoch)
end
redis.call('HSET', KEYS[2], wid, epoch)
redis.call('HSET', KEYS[3], 'epoch', epoch, 'state', 'live', 'heartbeat_ms', now)
redis.call('HDEL', KEYS[3], 'dead_ms')
if mode == 'register' or redis.call('HEXISTS', KEYS[3], 'registered_ms') == 0 then
  redis.call('HSET', KEYS[3], 'registered_ms', now)
end
if info ~= '' then redis.call('HSET', KEYS[3], 'info', info) end
return epoch
"""
)

# KEYS: live, worker record, fenced.  ARGV: worker id, max heartbeat age in ms ('' = any),
# expected epoch ('' = any).  Returns the fenced epoch, or nil if nothing was fenced.
MARK_DEAD = (
    _NOW_MS
    + """
local wid = ARGV[1]
local cur = redis.call('HGET', KEYS[1], wid)
if not cur then return nil end
if ARGV[3] ~= '' and ARGV[3] ~= cur then return nil end
if ARGV[2] ~= '' then
  local hb = tonumber(redis.call('HGET', KEYS[2], 'heartbeat_ms') or '0')
  if tonumber(now) - hb <= tonumber(ARGV[2]) then return nil end
end
redis.call('HDEL', KEYS[1], wid)
redis.call('HSET', KEYS[2], 'state', 'dead', 'dead_ms', now)
redis.call('SADD', KEYS[3], wid .. '@' .. cur)
return tonumber(cur)
"""
)

# KEYS: live, worker record.  ARGV: worker id, epoch.  Returns 1, or 0 if that epoch is fenced.
HEARTBEAT = (
    _NOW_MS
    + """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[2], 'heartbeat_ms', now)
return 1
"""
)

# KEYS: reverse set, fenced set, live, block keys...  ARGV: worker id, epoch, fenced member,
# reverse members (one per block key, same order).  Deletes a block's field only if it still
# carries this epoch (a newer epoch may have rewritten it). Returns {removed, left}, or {-1, 0}
# when the epoch is live (never sweep a live epoch).
SWEEP = """
local wid, epoch = ARGV[1], ARGV[2]
if redis.call('HGET', KEYS[3], wid) == epoch then return {-1, 0} end
local removed = 0
for i = 4, #KEYS do
  if redis.call('HGET', KEYS[i], wid) == epoch then
    redis.call('HDEL', KEYS[i], wid)
    removed = removed + 1
  end
end
if #ARGV > 3 then redis.call('SREM', KEYS[1], unpack(ARGV, 4)) end
local left = redis.call('SCARD', KEYS[1])
if left == 0 then redis.call('SREM', KEYS[2], ARGV[3]) end
return {removed, left}
"""

# KEYS: live, then the block keys of every group, concatenated.  ARGV: number of groups, then
# the number of block keys of each group.  A worker's entry counts only if it carries the
# worker's live epoch; the workers that hold block 0 are the candidates. A worker's holdings of a
# chain are prefix-closed (reader.py says why), so each candidate's length is
# found by bisection: the workers whose search interval is the same share one HMGET of its middle
# block, so a prompt of n blocks costs about log2(n) reads when the workers agree, and never
# more reads than blocks. Returns, per group: the number of matching workers m, then m pairs
# (worker id, blocks).
LONGEST_PREFIX = """
local call, unpack, floor = redis.call, unpack, math.floor
local flat = call('HGETALL', KEYS[1])
local live = {}
for i = 1, #flat, 2 do live[flat[i]] = flat[i + 1] end
local out = {}
local k = 2
for g = 1, tonumber(ARGV[1]) do
  local n = tonumber(ARGV[g + 1])
  local cand, found = {}, 0
  if n > 0 then
    local first = call('HGETALL', KEYS[k])
    for i = 1, #first, 2 do
      local w = first[i]
      if live[w] == first[i + 1] then
        found = found + 1
        cand[found] = w
      end
    end
  end
  out[#out + 1] = found
  -- Searches: {lo, hi, workers}: each worker holds block lo (1-based) and not block hi.
  local searches = {}
  if found > 0 then searches[1] = {1, n + 1, cand} end
  while #searches > 0 do
    local next_searches = {}
    for _, s in ipairs(searches) do
      local lo, hi, ws = s[1], s[2], s[3]
      if hi - lo <= 1 then
        for i = 1, #ws do
          out[#out + 1] = ws[i]
          out[#out + 1] = lo
        end
      else
        local mid = floor((lo + hi) / 2)
        local vals = call('HMGET', KEYS[k + mid - 1], unpack(ws))
        local yes, no = {}, {}
        for i = 1, #ws do
          local w = ws[i]
          if vals[i] == live[w] then yes[#yes + 1] = w else no[#no + 1] = w end
        end
        if #yes > 0 then next_searches[#next_searches + 1] = {mid, hi, yes} end
        if #no > 0 then next_searches[#next_searches + 1] = {lo, mid, no} end
      end
    end
    searches = next_searches
  end
  k = k + n
end
return out
"""


class Scripts:
    """The index's scripts bound to one client (EVALSHA, loaded on first use per server)."""

    def __init__(self, client: Redis) -> None:
        self.new_epoch: Script = client.register_script(NEW_EPOCH)
        self.mark_dead: Script = client.register_script(MARK_DEAD)
        self.heartbeat: Script = client.register_script(HEARTBEAT)
        self.sweep: Script = client.register_script(SWEEP)
        self.longest_prefix: Script = client.register_script(LONGEST_PREFIX)
