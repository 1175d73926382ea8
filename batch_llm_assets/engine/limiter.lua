-- The shared rate limiter: one atomic call per op, on Redis server time. docs/engine.md states
-- the algorithm; every number comes from engine/_constants.py with each call.
-- KEYS: 1 state hash, 2 leases zset (job|engine -> expiry), 3 jobs hash (w:, u:, t: per job),
--   4 this job's own schedule, 5 and 6 the minute ledgers of requests and tokens (score: grant
--   time less `lo`, member "n:amount").
-- ARGV: the op (acquire | settle | penalize | release), then name/value pairs. Reply: {granted
--   (1; 0 deferred for its share; 2 out of reach), wait_ms, slot_ms, factor_ppm, share_ppm,
--   jobs, epoch, burst_ms}.
pcall(redis.replicate_commands)
local a = {}
for i = 2, #ARGV, 2 do a[ARGV[i]] = ARGV[i + 1] end
local function num(k) return tonumber(a[k]) or 0 end
local op, job, t = ARGV[1], a.job or '', redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000

local S, F = KEYS[1], {'tr', 'tt', 'f', 'ft', 'fp', 'pause', 'ep', 'b', 'lt', 'lo', 'sr', 'st',
  'n', 'wer', 'wrr', 'wet', 'wrt', 'dp', 'ok'}
local v = redis.call('HMGET', S, unpack(F))
for i = 1, #F do v[i] = tonumber(v[i]) end
local base = num('burst_ms')
local tr, tt, f0, ft, fp = v[1], v[2], v[3] or 1, v[4] or now, v[5] or 1
-- A new state's epoch is the server's time in ms: the count goes on past a state lost (idle past
-- its TTL, a failover to an empty server), so an engine's older epochs never look newer.
-- Never below an epoch the caller has seen: a state lost on a server whose clock is behind.
local pause, ep, b, lo = v[6] or 0, v[7] or math.floor(now), math.max(base, v[8] or base), v[10] or 0
ep = math.max(ep, num('seen'))
local sr, stk, n = v[11] or 0, v[12] or 0, v[13] or 0
-- A window the provider enforces, per dimension: when it resets, and what it has left.
local win = {r = {v[14] or 0, v[15] or 0}, t = {v[16] or 0, v[17] or 0}}
-- The epoch the latest decrease started, and the latest epoch an answer succeeded in.
local dp, okep = v[18] or -1, v[19] or -1
-- No state: a first call, or a server that lost its data while this caller holds sends up to
-- `ahead` ms from now: then start after those with a spent burst, not with a full bucket.
if not tr then tr = num('ahead') > 0 and now + num('ahead') + base or 0; tt = tr end
if v[9] and now < v[9] then
  -- Redis TIME stepped back (a failover to a server with another clock): shift stored times.
  local step = v[9] - now
  tr, tt, ft, pause, lo = tr - step, tt - step, ft - step, pause - step, lo - step
  win.r[1], win.t[1] = win.r[1] - step, win.t[1] - step
end
ft = math.min(ft, now)

-- The factor recovers by `recovery`/s up to `knee` x fp, the factor the latest 429 came at, across
-- to fp `slowdown` x slower (the provider refused that rate), and at `recovery`/s beyond it.
local rec, slow, minf = num('recovery'), math.max(1, num('slowdown')), num('min_factor')
f0 = math.max(minf, math.min(1, f0))
local dt, kp = (now - ft) / 1000, num('knee') * fp
local t1 = math.max(0, (kp - f0) / rec)
local t2 = math.max(0, fp - math.max(f0, kp)) * slow / rec
local factor = f0 + rec * (math.min(dt, t1) + math.min(math.max(0, dt - t1), t2) / slow
  + math.max(0, dt - t1 - t2))
factor = math.max(minf, math.min(1, factor))
-- Interval (ms) per unit at the believed rate times the factor; 0: a dimension not limited.
local rpm, tpm, ur, ut = num('rpm'), num('tpm'), 0, 0
local function rates()
  ur, ut = rpm > 0 and 60000 / (rpm * factor) or 0, tpm > 0 and 60000 / (tpm * factor) or 0
end
rates()

-- The minute ledgers: what was granted in the last 60 s (and ahead), for the ceiling.
local function total(key, from, to)
  local sum, all = 0, redis.call('ZRANGEBYSCORE', key, from, to)
  for _, m in ipairs(all) do sum = sum + tonumber(string.match(m, ':(.+)$')) end
  return sum, #all
end
local function trim(key, sum)
  local old, count = total(key, '-inf', now - 60000 - lo)
  -- Only when there is something to drop: after a first write a script may write on past a
  -- server's maxmemory (an out-of-memory server must refuse the acquire).
  if count > 0 then redis.call('ZREMRANGEBYSCORE', key, '-inf', now - 60000 - lo) end
  return sum - old
end
sr, stk = trim(KEYS[5], sr), trim(KEYS[6], stk)
local function note(slot, dr, dtk)
  if slot <= now - 60000 then return end
  if dr ~= 0 and rpm > 0 then
    n, sr = n + 1, sr + dr
    redis.call('ZADD', KEYS[5], slot - lo, n .. ':' .. dr)
  end
  if dtk ~= 0 and tpm > 0 then
    n, stk = n + 1, stk + dtk
    redis.call('ZADD', KEYS[6], slot - lo, n .. ':' .. dtk)
  end
end

local function reply(granted, s, share, jobs)
  local vals = {tr, tt, f0, ft, fp, pause, ep, b, now, lo, sr, stk, n, win.r[1], win.r[2],
    win.t[1], win.t[2], dp, okep}
  local kv = {}
  for i = 1, #F do kv[2 * i - 1], kv[2 * i] = F[i], vals[i] end
  redis.call('HSET', S, unpack(kv))
  -- A new epoch is told to every engine on the key at once (limiter.py listens); pcall: an
  -- ACL user without channel rights (Redis 7's default) still gets its grants.
  if ep > (v[7] or 0) then redis.pcall('PUBLISH', S .. ':epoch', ep) end
  local ttl = math.ceil(math.max(tr, tt, pause, now) - now) + num('ttl_ms')
  for _, i in ipairs({1, 4, 5, 6}) do redis.call('PEXPIRE', KEYS[i], ttl) end
  return {granted, math.ceil(math.max(0, s - now)), math.floor(s), math.floor(factor * 1e6),
    math.floor(share * 1e6), jobs, ep, math.floor(b)}
end
-- Charge (> 0) or give back (< 0) a grant's request and tokens at its slot. The ledgers always
-- move; the schedules when `sched` (a charge from at least now, a give-back never before now),
-- and never to give back a reservation a restart dropped (a grant of an older epoch).
local function adjust(tat, d)
  if d >= 0 then return math.max(tat, now) + d end
  return tat <= now and tat or math.max(tat + d, now)
end
local function charge(slot, gep, dr, dtk, sched)
  if sched and (gep == ep or dr > 0 or dtk > 0) then
    tr, tt = adjust(tr, dr * ur), adjust(tt, dtk * ut)
  end
  note(slot, dr, dtk)
end
-- The schedule never promises more than the provider says remains; a restart (a new epoch)
-- sets it there (from `from` plus the default burst when nothing remains is known), dropping
-- the old epoch's grants.
local function hold(from, renew)
  if renew then ep = ep + 1 end
  local function at(d, u, tat)
    local x = renew and from + base or nil
    if a['rem_' .. d] then x = from + b - num('rem_' .. d) * u end
    if not x or u <= 0 then return tat end
    return renew and x or math.max(tat, x)
  end
  tr, tt = at('r', ur, tr), at('t', ut, tt)
end
local function forget(j) redis.call('HDEL', KEYS[3], 'w:' .. j, 'u:' .. j, 't:' .. j) end
local function job_of(lease) return string.match(lease, '^(.*)|[^|]*$') end

if op == 'release' then
  -- Only this engine's lease; its job's weight and use go when no engine of it is left.
  redis.call('ZREM', KEYS[2], job .. '|' .. (a.engine or ''))
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], now, '+inf')) do
    if job_of(m) == job then return reply(1, now, 1, 0) end
  end
  forget(job)
  return reply(1, now, 1, 0)
end

if op == 'settle' then
  -- An answer: its reservation reconciled with the usage; the burst is the bucket the
  -- provider's headers show (an answer of this epoch: older ones may predate a 429); a wider
  -- burst or a lower believed rate restarts the schedule.
  local gep, restart, wider = num('epoch'), num('restart') == 1, false
  charge(num('slot'), gep, num('requests'), num('tokens'), true)
  if num('ok') == 1 and gep == ep then okep = ep end
  if a.cap_ms and gep == ep then
    local cap = math.max(base, math.min(num('cap_ms'), num('max_burst_ms')))
    wider, b = cap >= math.max(num('wider') * b, b + num('step_ms')), cap
  end
  if a.rem_r or a.rem_t or restart then hold(now, wider or restart) end
  -- A window: what it has left holds every process's grants until its reset (acquire). Its
  -- remaining counts what it admitted, not the slots granted before its reset and not yet due.
  for d, w in pairs(win) do
    if a['reset_' .. d] then
      w[1] = now + num('reset_' .. d)
      local ledger = KEYS[d == 'r' and 5 or 6]
      w[2] = num('rem_' .. d) - total(ledger, '(' .. (now - lo), '(' .. (w[1] - lo))
    end
  end
  return reply(1, now, 1, 0)
end

if op == 'penalize' then
  -- A 429 for the rate. One overload event is one decrease: a 429 for a grant of an older epoch
  -- belongs to the event that restarted the schedule since, and so does one before an answer
  -- at the cut rate succeeded (`ok`): a window refuses until what it admitted leaves it (one
  -- cut per loss episode, as TCP: RFC 6582). The restart empties the burst: what comes next
  -- goes out paced from the pause's end.
  if num('pause_ms') > 0 then pause = math.max(pause, now + num('pause_ms')) end
  if num('epoch') >= ep and (ep ~= dp or okep == ep) then
    fp, f0, ft = factor, math.max(minf, factor * num('decrease')), now
    factor, b = f0, base
    rates()
    hold(math.max(now, pause), true)
    dp = ep
  end
  return reply(1, now, 1, 0)
end

-- acquire: one request of `tokens`; `back_*` is an older grant it replaces, which goes out of
-- the ledgers (the schedule keeps it: given back there, every fresh slot taken that way would
-- be the same instant).
local lease, tau = num('lease_ms'), num('share_tau_ms')
local ttl = lease * num('state_leases')
redis.call('ZADD', KEYS[2], now + lease, job .. '|' .. (a.engine or ''))
redis.call('HSET', KEYS[3], 'w:' .. job, num('weight'))
redis.call('PEXPIRE', KEYS[2], ttl)
redis.call('PEXPIRE', KEYS[3], ttl)
if a.back_slot then charge(num('back_slot'), num('back_epoch'), -1, -num('back_tokens'), false) end

-- Weighted max-min share of the jobs with a live lease, over their recent use (an EWMA); the
-- weight and use of a job whose every lease lapsed (its processes died) go.
local function use(u, at)
  return (tonumber(u) or 0) * math.exp(-(now - (tonumber(at) or now)) / tau)
end
local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local jobs, seen, total = {}, {}, 0
for _, m in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  local j = job_of(m)
  if j and not seen[j] then
    seen[j] = true
    local w = redis.call('HMGET', KEYS[3], 'w:' .. j, 'u:' .. j, 't:' .. j)
    local wt = tonumber(w[1]) or 0
    if wt > 0 then jobs[#jobs + 1], total = {j, wt, use(w[2], w[3])}, total + wt end
  end
end
for _, m in ipairs(gone) do
  local j = job_of(m)
  if j and not seen[j] then forget(j) end
end
local share = 1
if #jobs > 1 then
  -- A job using under `idle` of its weighted share lends the rest; sorted by use per weight,
  -- from the first one that does not, none does.
  table.sort(jobs, function(x, y) return x[3] / x[2] < y[3] / y[2] end)
  local left, wleft = 1, total
  for _, j in ipairs(jobs) do
    if j[3] >= num('idle') * j[2] / total or j[1] == job then break end
    left, wleft = left - j[3], wleft - j[2]
  end
  share = math.max(num('weight') / total, math.max(left, 0) * num('weight') / wleft)
end

-- End-based GCRA: the request must fit within the tolerance before its send time. The learned
-- burst only while the minute's ledgers leave room under the configured limits.
local tokens, reach, ticket = num('tokens'), num('reach_ms'), num('ticket')
local ir, it = ur, tokens * ut
local roomy = (rpm == 0 or sr + 1 <= num('ceil_rpm'))
  and (tpm == 0 or stk + tokens <= num('ceil_tpm'))
local tol = roomy and b or math.min(base, num('free_ms'))
local s = math.max(now, pause)
if ur > 0 then s = math.max(s, tr + ir - math.max(tol, ir)) end
if ut > 0 then s = math.max(s, tt + it - math.max(tol, it)) end
local saturated = s > now or (ur > 0 and tr > now) or (ut > 0 and tt > now)
-- A slot beyond the reach is not reserved: the caller asks again when it is within it.
if s > now + reach then return reply(2, s - reach, share, #jobs) end

local defer, js = false, now
if share < 1 and ticket == 0 then
  -- While saturated a job is held to its share: ahead of its own schedule, it waits with its
  -- slot there reserved (within the reach) and comes back with a ticket that skips this check.
  local jt = redis.call('HMGET', KEYS[4], 'tr', 'tt')
  local jtr, jtt = tonumber(jt[1]) or 0, tonumber(jt[2]) or 0
  js = math.max(now, ur > 0 and jtr - base or 0, ut > 0 and jtt - base or 0)
  defer = saturated and js > now
  if defer and js > now + reach then return reply(2, js - reach, share, #jobs) end
  local from = defer and js or now
  jtr, jtt = math.max(jtr, from) + ir / share, math.max(jtt, from) + it / share
  if not saturated then  -- slack used in a lull is forgiven beyond a second
    local cap = now + math.max(base, num('forgive_ms'))
    jtr, jtt = math.min(jtr, cap), math.min(jtt, cap)
  end
  redis.call('HSET', KEYS[4], 'tr', jtr, 'tt', jtt)
end
-- A job's use counts what it reserves when it asks (deferred too, not again with the ticket):
-- a job whose requests all wait on its own schedule is not idle, or it would lend its share.
if ticket == 0 then
  local u = redis.call('HMGET', KEYS[3], 'u:' .. job, 't:' .. job)
  local used = use(u[1], u[2]) + math.max(ir, it) / tau
  redis.call('HSET', KEYS[3], 'u:' .. job, used, 't:' .. job, now)
end
if defer then return reply(0, js, share, #jobs) end
-- A window's grants before its reset come out of what it has left; one that does not fit
-- goes at the reset, paced from there: the window was spent, so was the burst (a burst on top
-- of a window's pace overruns a short window).
local spent = false
for d, cost in pairs({r = 1, t = tokens}) do
  local w = win[d]
  if (d == 'r' and ur > 0 or d == 't' and ut > 0) and s < w[1] then
    if w[2] < cost then s, spent = w[1], true else w[2] = w[2] - cost end
  end
end
if ur > 0 then tr = math.max(tr, s, spent and s + tol - ir or s) + ir end
if ut > 0 then tt = math.max(tt, s, spent and s + tol - it or s) + it end
note(s, 1, tokens)
return reply(1, s, share, #jobs)
