-- The shared in-flight limit of one self-hosted server (engine/gate.py): one atomic call per op,
-- on Redis server time; every number comes from engine/_constants.py with each call.
-- KEYS: 1 state hash (l: the limit, b: the base latency in us, g: 1 while in slow start),
--       2 held hash (engine -> its requests in flight), 3 alive zset (engine -> lease expiry ms),
--       4 want zset (engine -> when it was last refused, ms).
-- ARGV: the op (acquire | release | adjust | renew | leave), then name/value pairs.
-- Reply: {granted, limit x 1000, base us, growing, engines sharing}.
pcall(redis.replicate_commands)

local a = {}
for i = 2, #ARGV, 2 do a[ARGV[i]] = ARGV[i + 1] end
local function num(k) return tonumber(a[k]) or 0 end
local op, me = ARGV[1], a.engine or ''
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local S, H, A, W = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local lease = num('lease_ms')

-- An engine whose lease lapsed (its process died, SIGKILL) holds nothing and wants nothing.
local dead = redis.call('ZRANGEBYSCORE', A, '-inf', now)
for _, e in ipairs(dead) do
  redis.call('HDEL', H, e)
  redis.call('ZREM', W, e)
end
if #dead > 0 then redis.call('ZREMRANGEBYSCORE', A, '-inf', now) end
redis.call('ZREMRANGEBYSCORE', W, '-inf', now - num('want_ms'))

if op == 'leave' then
  redis.call('HDEL', H, me)
  redis.call('ZREM', A, me)
  redis.call('ZREM', W, me)
  return {0, 0, 0, 0, 0}
end
redis.call('ZADD', A, now + lease, me)

local st = redis.call('HMGET', S, 'l', 'b', 'g')
local limit = tonumber(st[1]) or num('start')
local base = tonumber(st[2]) or 0
local growing = tonumber(st[3]) or 1
local mine = tonumber(redis.call('HGET', H, me)) or 0

-- In flight over all engines, and the engines sharing the limit: this one, those holding
-- slots, those refused lately (an idle engine's share goes to the others).
local total, engines, seen = 0, 1, {[me] = true}
local held = redis.call('HGETALL', H)
for i = 1, #held, 2 do
  local n = tonumber(held[i + 1])
  total = total + n
  if n > 0 and not seen[held[i]] then seen[held[i]], engines = true, engines + 1 end
end
for _, e in ipairs(redis.call('ZRANGE', W, 0, -1)) do
  if not seen[e] then seen[e], engines = true, engines + 1 end
end

local granted = 0
if op == 'acquire' then
  local cap = math.max(1, math.floor(limit))
  if total < cap and mine < math.ceil(cap / engines) then
    redis.call('HINCRBY', H, me, 1)
    redis.call('ZREM', W, me)
    granted = 1
  else
    redis.call('ZADD', W, now, me)
  end
elseif op == 'release' then
  if mine > 1 then redis.call('HINCRBY', H, me, -1) else redis.call('HDEL', H, me) end
elseif op == 'adjust' then
  -- The engine decided on the limit `from`: applied only if nobody changed it since (a decision
  -- on a stale limit is dropped; the next window decides again). The base only falls, unless
  -- the engine saw the rows get slower (rebase).
  local rtt = num('base_us')
  if rtt > 0 and (base <= 0 or rtt < base or a.rebase == '1') then base = rtt end
  if math.abs(limit - num('from')) < 1e-6 then
    limit, growing = math.floor(num('to') * 1000 + 0.5) / 1000, num('growing')
  end
  redis.call('HSET', S, 'l', limit, 'b', base, 'g', growing)
end
for _, k in ipairs({S, H, A, W}) do redis.call('PEXPIRE', k, lease * 4) end
return {granted, math.floor(limit * 1000), math.floor(base), growing, engines}
