-- One job's spend in one UTC day (engine/budget.py): one atomic call per op, on Redis server
-- time. Amounts are integers of 1e-9 USD.
-- KEYS: 1 the day's hash (spent, held, h:<hold> = its amount, b:<tag> = a batch file's charge
--       until it is collected),
--       2 the day's holds zset (hold -> lease end ms).
-- ARGV: the op (reserve | settle | refund), then name/value pairs.
-- Reply: {done, spent, held}.
pcall(redis.replicate_commands)

local a = {}
for i = 2, #ARGV, 2 do a[ARGV[i]] = ARGV[i + 1] end
local function num(k) return tonumber(a[k]) or 0 end
local op, D, Z = ARGV[1], KEYS[1], KEYS[2]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- A hold whose lease ended belongs to a process that died between reserve and settle (SIGKILL):
-- it is given back, so the day's cap does not keep it.
local lapsed = redis.call('ZRANGEBYSCORE', Z, '-inf', now)
for _, id in ipairs(lapsed) do
  redis.call('HINCRBY', D, 'held', -(tonumber(redis.call('HGET', D, 'h:' .. id)) or 0))
  redis.call('HDEL', D, 'h:' .. id)
end
if #lapsed > 0 then redis.call('ZREMRANGEBYSCORE', Z, '-inf', now) end

local spent = tonumber(redis.call('HGET', D, 'spent')) or 0
local held = tonumber(redis.call('HGET', D, 'held')) or 0
local done = 1
if op == 'reserve' then
  local amount = num('amount')
  if spent + held + amount > num('cap') then
    done = 0
  else
    held = redis.call('HINCRBY', D, 'held', amount)
    redis.call('HSET', D, 'h:' .. a.hold, amount)
    redis.call('ZADD', Z, now + num('lease_ms'), a.hold)
  end
elseif op == 'settle' then
  -- The real cost replaces the hold (a lapsed hold is gone already; its cost still counts).
  local amount = tonumber(redis.call('HGET', D, 'h:' .. a.hold))
  if amount then
    held = redis.call('HINCRBY', D, 'held', -amount)
    redis.call('HDEL', D, 'h:' .. a.hold)
    redis.call('ZREM', Z, a.hold)
  end
  -- A batch file (`tag`) is charged once, whichever run charges it (a relaunch adopts it too).
  if not a.tag or redis.call('HSETNX', D, 'b:' .. a.tag, num('real')) == 1 then
    spent = redis.call('HINCRBY', D, 'spent', num('real'))
  end
elseif op == 'refund' then
  -- A batch file charged at its worst case, collected: its real cost replaces the charge, once.
  local charged = tonumber(redis.call('HGET', D, 'b:' .. a.tag))
  if not charged then return {0, spent, held} end
  spent = redis.call('HINCRBY', D, 'spent', num('real') - charged)
  redis.call('HDEL', D, 'b:' .. a.tag)
end
if done == 1 then
  redis.call('EXPIREAT', D, num('expire_at'))
  redis.call('EXPIREAT', Z, num('expire_at'))
end
return {done, spent, held}
