-- Shared rate limiter: requests/min and tokens/min in one atomic call, on Redis server time.
--
-- GCRA in "schedule ahead" form: each dimension keeps a theoretical arrival time (TAT, ms).
-- An acquire is granted a send time s = max(now, TAT - burst) over both dimensions, the TATs
-- advance by the request's emission interval, and the caller sleeps (s - now) once.
-- Over any window W the sends sum to at most rate * (W + burst) + one request.
--
-- Fair share: every job holds a lease (weight, expiry). While the shared bucket is saturated,
-- a job also runs its own GCRA at rate * weight / sum(active weights); a job ahead of its share
-- is deferred: it gets a ticket (its own slot is reserved) and a wait, and then acquires again
-- with the ticket, taking the next shared slot. When not saturated any job may use the slack.
-- Jobs' own schedules run on a virtual clock that advances with the rate factor (see `v`).
-- A job's use (for lending what idle jobs leave) counts its reservations, deferred ones too,
-- so a job whose requests all wait on its own schedule is not taken for idle. A refunded
-- request keeps its reservation in its job's schedule as a credit, spent by the job's next
-- acquire (which then skips its own schedule like a ticket): pulling the job's schedule back
-- instead hands the same time to every request that refunds and acquires again, and they all
-- go at once.
--
-- Adaptive: a 429 that got through multiplies the rate by `decrease` once per overload event
-- (a 429 on a slot granted before the last decrease is the same event) and empties the burst,
-- so held and new requests go out paced. The rate recovers additively up to just below the
-- rate at which the 429s began, and probes above it slowly. A server hint pauses everyone
-- until it has passed (capped by the caller).
--
-- Provider state (observe): what a response says remains caps what the schedule promises now,
-- and the bucket its remaining + reset show widens the burst (up to the cap the caller sends);
-- a 429 shrinks it back.
--
-- Clock steps: Redis TIME can step back (a failover to a replica with another clock). Every
-- stored time is shifted by the step, so the schedule neither stops nor runs ahead.
--
-- KEYS: 1 state hash, 2 leases zset, 3 weights hash, 4 this job's hash, 5 engines zset
-- ARGV: 1 op (acquire | reconcile | penalize | observe | reslot | release), 2 job, 3 rpm,
--       4 tpm, 5 burst_ms,
--       6 lease_ms, 7 weight, 8 decrease, 9 recovery_per_s, 10 min_factor, 11 cooldown_ms,
--       12 tokens, 13 ticket (acquire: 0 none, 1 take a slot, else the deferral's reserved
--       virtual time) | requests delta (reconcile) | retry_after_ms (penalize),
--       14 how far ahead (ms) this caller's latest granted send is (restores a lost state),
--       15 slot (penalize: the send time granted to the rejected request, Redis ms; 0 unknown)
--          | the first request's slot plus the burst it was granted under (reslot; Redis ms)
--          | remaining requests (observe; '' unknown), 16 reset tokens ms (observe; -1),
--       17 reset requests ms (observe; -1), 18 probe slowdown, 19 learned burst cap ms,
--       20 the provider's window ms when it enforces windows (observe; 0: a bucket),
--       21 this engine's id (one per process and run), 22 its token counts have settled (0|1),
--       23 when the provider took the answer's snapshot, in Redis ms (observe; 0 unknown),
--       24 reslot: the requests' token costs, comma-separated, in the order of their slots,
--       25 penalize: the decrease for an isolated 429 at a rate the provider states (0: none)
-- observe: ARGV 12 is the remaining tokens ('' unknown). A remaining below zero is a debt: the
-- engine has more in flight than the provider showed left.
-- Returns (observe): {1, 0, factor_ppm, 0, 0, burst ms, Redis now in us, engines, 1 if the
-- tokens' schedule was raised to the provider's remaining (its count replaced the engine's)}
-- Returns (acquire): {granted 0|1, wait_us, factor_ppm, share_ppm, active_jobs, slot_ms when
-- granted | the ticket to come back with when deferred, and when granted Redis now in us and
-- the burst in force, ms}
-- Returns (reslot): {factor_ppm, Redis now in us, then wait_ms and slot_ms for each request}

pcall(redis.replicate_commands)

-- What an engine alone on the key (settled token counts) leaves of the provider's bucket, ms.
local ALONE_MARGIN = 50
-- A 429 this long after the last decrease is an isolated one (penalize), ms.
local ISOLATED_MS = 10000

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000

local op = ARGV[1]
local job = ARGV[2]
local rpm = tonumber(ARGV[3])
local tpm = tonumber(ARGV[4])
local burst = tonumber(ARGV[5])
local lease_ms = tonumber(ARGV[6])
local weight = tonumber(ARGV[7])
local decrease = tonumber(ARGV[8])
local recovery = tonumber(ARGV[9])
local min_factor = tonumber(ARGV[10])
local cooldown = tonumber(ARGV[11])
local tokens = tonumber(ARGV[12])
local extra = tonumber(ARGV[13])

local ahead = tonumber(ARGV[14]) or 0
local mild = tonumber(ARGV[25]) or 0
local arg15 = tonumber(ARGV[15]) or 0
local slowdown = math.max(1, tonumber(ARGV[18]) or 1)
local burst_cap = tonumber(ARGV[19]) or burst
local window_ms = tonumber(ARGV[20]) or 0
local engine_id = ARGV[21] or ''
local settled = tonumber(ARGV[22]) or 0
-- observe: how long ago the provider took its snapshot (0 when unknown).
local snapshot = tonumber(ARGV[23]) or 0
local age = snapshot > 0 and math.max(0, now - snapshot) or 0

local st = redis.call('HMGET', KEYS[1], 'tr', 'tt', 'f', 'ft', 'pause', 'dec', 'ts', 'fr', 'lb', 'fl',
  'la', 'se')
local vst = redis.call('HMGET', KEYS[1], 'v', 'vt')
local tr = tonumber(st[1]) or 0
local tt = tonumber(st[2]) or 0
if not st[1] and not st[2] and ahead > 0 then
  -- No state, yet this caller holds sends scheduled `ahead` ms from now: the server lost its
  -- data (a restart). Start with those sends and a spent burst, not a fresh full bucket.
  tr = now + ahead + burst
  tt = tr
end
local f0 = tonumber(st[3]) or 1
local ft = tonumber(st[4]) or now
local pause = tonumber(st[5]) or 0
local dec = tonumber(st[6]) or 0
local fr = tonumber(st[8]) or 1
local lb = tonumber(st[9]) or 0
-- A burst learnt with an engine alone's margin (`la`) is that engine's (`se`): another engine
-- (the next partition's run on the key, its gate not calibrated yet) starts from the margin of
-- an engine not settled. Inherited whole, the first burst of the runs that followed one on the
-- key met the provider's bucket edge: a 429 in 5 of 10 such partitions of `make demo`.
local la = tonumber(st[11]) or 0
local se = st[12]  -- the engine that settled on the key last (`observe`)
if la == 1 and se ~= engine_id then
  local held = lb + ALONE_MARGIN
  lb = held - math.max(burst, 0.1 * held)
  la = 0
end
-- Floor for refunds (Redis ms): the end of the last 429's pause plus the burst. A refund never
-- pulls a TAT below it, so slots given back while paused cannot refill the emptied burst.
local fl = tonumber(st[10]) or 0
local ts = tonumber(st[7])
local vt = tonumber(vst[2]) or now
if ts and now < ts then
  -- Redis TIME stepped back: shift every stored time by the step.
  local step = ts - now
  tr, tt, pause, dec, fl = tr - step, tt - step, pause - step, dec - step, fl - step
  ft = math.min(ft - step, now)
  vt = vt - step
end
ft = math.min(ft, now)
f0 = math.max(min_factor, math.min(1, f0))

-- Recover at `recovery`/s up to the knee below the rate at which 429s began, then slowly.
local knee = math.max(min_factor, fr * 0.95)
local dt = math.max(0, now - ft) / 1000
local factor
if f0 >= knee then
  factor = f0 + recovery / slowdown * dt
else
  local t_knee = (knee - f0) / recovery
  if dt <= t_knee then factor = f0 + recovery * dt
  else factor = knee + recovery / slowdown * (dt - t_knee) end
end
factor = math.max(min_factor, math.min(1, factor))
local burst_ms = math.max(burst, math.min(lb, burst_cap))
-- Virtual time (ms at the full rate): advances at `factor` per ms, and not while paused. Jobs'
-- own schedules run on it, so a reservation made seconds ahead comes due after the same share
-- of the bucket's capacity whatever the rate does meanwhile (recovery or a 429's decrease).
-- On wall time, the job with the longer queue of its own (the lighter weight) would keep the
-- rate of when it reserved: under its share while the rate recovers, over it after a decrease.
local v = (tonumber(vst[1]) or now) + math.max(0, now - math.max(vt, math.min(pause, now))) * factor
-- Emission rates per ms; 0 means the dimension is not limited.
local rr = rpm * factor / 60000
local rt = tpm * factor / 60000

local function keep(key, horizon)
  redis.call('PEXPIRE', key, math.ceil(math.max(horizon - now, 0) + 60000 + lease_ms))
end

local function save_state()
  redis.call('HSET', KEYS[1], 'tr', tr, 'tt', tt, 'f', f0, 'ft', ft, 'pause', pause, 'dec', dec,
    'ts', now, 'fr', fr, 'lb', lb, 'fl', fl, 'la', la)
  redis.call('HSET', KEYS[1], 'v', v, 'vt', now)
  keep(KEYS[1], math.max(tr, tt, pause))
end

-- Recent use of a job, as a fraction of the bucket's capacity (EWMA over `tau` ms).
local tau = 1000
local memory = 1000
local function usage_now(u, ut)
  if not u then return 0 end
  return u * math.exp(-math.max(0, now - ut) / tau)
end

-- This job's share of the bucket while it is saturated: its weight's part, plus its weight's
-- part of what the nearly idle jobs leave unused (weighted max-min over recent use).
local function share_of()
  local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
  for i = 1, #expired do
    redis.call('HDEL', KEYS[3], 'w:' .. expired[i], 'u:' .. expired[i], 't:' .. expired[i])
  end
  if #expired > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now) end
  local members = redis.call('ZRANGE', KEYS[2], 0, -1)
  local jobs, total = {}, 0
  for i = 1, #members do
    local m = members[i]
    local v = redis.call('HMGET', KEYS[3], 'w:' .. m, 'u:' .. m, 't:' .. m)
    local w = tonumber(v[1]) or 0
    if w > 0 then
      jobs[#jobs + 1] = {m, w, usage_now(tonumber(v[2]), tonumber(v[3]))}
      total = total + w
    end
  end
  if #jobs <= 1 or total <= 0 then return 1, #members end
  table.sort(jobs, function(a, b) return a[3] / a[2] < b[3] / b[2] end)
  local remaining, wleft = 1, total
  for i = 1, #jobs do
    local m, w, u = jobs[i][1], jobs[i][2], jobs[i][3]
    -- A job using under half its weighted share is idle enough to lend the rest. Sorted by
    -- use per weight, so from the first job that is not, none is.
    if u >= 0.5 * w / total or m == job then break end
    remaining = remaining - u
    wleft = wleft - w
  end
  return math.max(weight / total, math.max(remaining, 0) * weight / wleft), #members
end

-- Count a reservation (granted or deferred) in this job's recent use.
local function note_usage(cost_ms)
  local v = redis.call('HMGET', KEYS[3], 'u:' .. job, 't:' .. job)
  local u = usage_now(tonumber(v[1]), tonumber(v[2])) + cost_ms / tau
  redis.call('HSET', KEYS[3], 'u:' .. job, u, 't:' .. job, now)
end

-- Move a TAT by a signed amount of ms: a charge pushes it on, a refund never pulls it before now
-- (nor before the floor a 429 set: see `fl`).
local function adjust(tat, delta)
  if delta >= 0 then return math.max(tat, now) + delta end
  local low = math.max(now, fl)
  if tat <= low then return tat end
  return math.max(tat + delta, low)
end

-- The same on the virtual clock (jobs' own schedules).
local function adjust_v(tat, delta)
  if delta >= 0 then return math.max(tat, v) + delta end
  if tat <= v then return tat end
  return math.max(tat + delta, v)
end

-- Wall ms until virtual time `tv` (a deferral longer than `recheck` while the rate is not
-- full is cut to it: the rate may recover meanwhile, and the tag is then due sooner).
local recheck = 1000
local function wall_until(tv)
  local w = math.max(0, tv - v) / factor
  if factor < 1 then w = math.min(w, recheck) end
  return math.max(w, math.max(pause, now) - now)
end

-- Engines (processes) sending on this key now: one alone may burst closer to the provider's
-- bucket, since its own provider gate sees every send the headers do not show yet.
local function engines_now()
  if engine_id == '' then return 0 end
  redis.call('ZADD', KEYS[5], now + lease_ms, engine_id)
  redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now)
  redis.call('PEXPIRE', KEYS[5], lease_ms * 4)
  return redis.call('ZCARD', KEYS[5])
end

if op == 'release' then
  if engine_id ~= '' then redis.call('ZREM', KEYS[5], engine_id) end
  redis.call('ZREM', KEYS[2], job)
  redis.call('HDEL', KEYS[3], 'w:' .. job, 'u:' .. job, 't:' .. job)
  return {1, 0, 0, 0, 0}
end

if op == 'reconcile' then
  local share = tonumber(redis.call('HGET', KEYS[4], 'share')) or 1
  local jt = redis.call('HMGET', KEYS[4], 'vr', 'vk')
  local jtr = tonumber(jt[1]) or 0
  local jtt = tonumber(jt[2]) or 0
  -- A refund (requests delta < 0) gives back the shared slot only; its job keeps the
  -- reservation as a credit (see the header).
  local refund = extra < 0
  if rt > 0 and tokens ~= 0 then
    tt = adjust(tt, tokens / rt)
    if not refund then jtt = adjust_v(jtt, tokens * factor / (rt * share)) end
  end
  if rr > 0 and extra ~= 0 then
    tr = adjust(tr, extra / rr)
    if not refund then jtr = adjust_v(jtr, extra * factor / (rr * share)) end
  end
  save_state()
  if redis.call('EXISTS', KEYS[4]) == 1 then
    redis.call('HSET', KEYS[4], 'vr', jtr, 'vk', jtt)
    if refund then redis.call('HINCRBY', KEYS[4], 'credit', -extra) end
  end
  return {1, 0, math.floor(factor * 1e6), math.floor(share * 1e6), 0}
end

if op == 'reslot' then
  -- The burst has widened: requests sleeping on slots granted under the narrower one give them
  -- back and are granted again, in their order, in this one call. One at a time, each took the
  -- same slot (the schedule's end less the burst) and the bucket idled until then; a refund
  -- first and an acquire after let an observe clamp the schedule between the two. For a job
  -- alone on the key (the caller checks), so its own schedule and credit are left as they are.
  local costs = {}
  for c in string.gmatch(ARGV[24] or '', '[^,]+') do costs[#costs + 1] = tonumber(c) end
  -- Given back at the rate now in force, they would free more than they took when it was
  -- higher (the provider's x-ratelimit-limit lowered it): not below the schedule's end before
  -- the first of them (its slot plus the burst it was granted under, ARGV 15).
  if rt > 0 and tokens > 0 then
    tt = math.max(adjust(tt, -tokens / rt), math.min(tt, arg15))
  end
  if rr > 0 and #costs > 0 then tr = math.max(adjust(tr, -#costs / rr), math.min(tr, arg15)) end
  local out = {math.floor(factor * 1e6), math.floor(now * 1000)}
  for i = 1, #costs do
    local s = math.max(now, pause)
    if rr > 0 then s = math.max(s, tr - burst_ms) end
    if rt > 0 then s = math.max(s, tt - burst_ms) end
    if rr > 0 then tr = math.max(tr, s) + 1 / rr end
    if rt > 0 then tt = math.max(tt, s) + costs[i] / rt end
    out[#out + 1] = math.ceil(s - now)
    out[#out + 1] = math.floor(s)
  end
  save_state()
  return out
end

if op == 'penalize' then
  -- One overload event, one decrease: a 429 on a slot granted before the last decrease (or
  -- within the cooldown) belongs to the event already counted.
  local same_event = (arg15 > 0 and arg15 <= dec) or now - dec < cooldown
  if not same_event then
    -- At a rate the provider states (ARGV 25 > 0), a 429 long after the last decrease came at
    -- its bucket's edge, not from a rate too high: the milder cut. One within ISOLATED_MS of
    -- the last decrease is a pattern (a window the engine misjudges): the full one.
    local cut = decrease
    if mild > 0 and (dec <= 0 or now - dec > ISOLATED_MS) then cut = mild end
    fr = factor
    f0 = math.max(min_factor, factor * cut)
    ft = now
    dec = now
  else
    f0 = factor
    ft = now
  end
  -- A burst grown to the provider's bucket has spent it: the schedule ran up to a bucket
  -- ahead. The bucket is empty now, so the schedule restarts from here, paced.
  local shrink = lb > burst
  lb, la = 0, 0
  if extra > 0 then pause = math.max(pause, now + extra) end
  -- The provider's bucket is empty: no burst until it has refilled, so what was held (and what
  -- comes after the pause) goes out at the paced rate, never all at once.
  local from = math.max(now, pause) + burst
  fl = math.max(fl, from)
  if rpm > 0 then tr = shrink and from or math.max(tr, from) end
  if tpm > 0 then tt = shrink and from or math.max(tt, from) end
  -- The rejected request's slot is not given back: the provider is over its limit already.
  save_state()
  return {1, 0, math.floor(f0 * 1e6), 0, 0}
end

if op == 'observe' then
  -- Remaining tokens and requests (nil unknown; below zero, a debt), resets in ms (-1 unknown).
  local rem_t = ARGV[12] ~= '' and tokens or nil
  local rem_r = ARGV[15] ~= '' and arg15 or nil
  local reset_t = tonumber(ARGV[16]) or -1
  local reset_r = tonumber(ARGV[17]) or -1
  local cap = 0
  -- Never promise more now than the provider says remains, refilled at the rate after. Not for
  -- a window: it does not refill until its reset, then all at once (the engine holds what the
  -- window cannot take; a shared schedule that refilled would only pace the rest at the rate).
  local refills = window_ms <= 0
  if rt > 0 and rem_t and reset_t >= 0 then cap = math.max(cap, rem_t / rt + reset_t) end
  if rr > 0 and rem_r and reset_r >= 0 then cap = math.max(cap, rem_r / rr + reset_r) end
  -- An engine alone on the key whose token counts have settled holds its own sends against
  -- the provider's headers (its provider gate, which allows for the snapshot's lag and the
  -- counting error). Settled is for good: an observe sent before the flag was (queued for a
  -- connection) must not take the margin back, or the burst flips and wakes every sleeper.
  if settled == 1 then
    redis.call('HSET', KEYS[1], 'se', engine_id)
  elseif engine_id ~= '' and se == engine_id then
    settled = 1
  end
  local engines = engines_now()
  local alone = settled == 1 and engines == 1
  -- The remaining the caller sends is the answer's less its own sends since; answers overtaken
  -- in flight make it a little low at times, and a clamp only ever ratchets up. For an engine
  -- alone, a fiftieth of a bucket of seconds is let go (its gate holds the exact remaining).
  local slack = (alone and cap >= 2000) and 0.02 * cap or 0
  -- The provider's bucket holds `cap` ms of our rate (a window its whole length of our rate at
  -- its start, whatever remains now: the engine holds what the window cannot take until its
  -- reset): let the burst grow towards it. Less a margin (a tenth of it, at least the
  -- configured burst) for what is in flight and the headers' lag: a 1 s bucket gives no more
  -- than the default half second. For an engine alone (above), a margin of 50 ms will do, on
  -- a 1 s bucket too.
  local held = math.max(cap, window_ms)
  local margin = alone and ALONE_MARGIN or math.max(burst, 0.1 * held)
  if held > 0 and now - dec >= cooldown then
    lb = held - margin
    la = alone and 1 or 0
  end
  -- The promise is for the burst the next acquires are granted under: the one this call sets.
  -- With the burst before it, a burst widened here let the schedule run the remaining's worth
  -- of sends past the widening (in a job's first burst, the bucket's last requests and a 429).
  -- For an engine alone the provider's last ALONE_MARGIN ms stay unpromised, as below its
  -- bucket: a clamp to all that remains ran the bucket down to under one request, and a send's
  -- jitter of a few ms then met it empty.
  -- The bucket has refilled since the snapshot (the answer's time on its way back, and this
  -- call's wait for a connection): for an engine alone on the key the promise runs from the
  -- snapshot, not from now. Other engines' sends since are not in the remaining it reports,
  -- and at their rate they about take the refill: for engines that share the key, from now.
  local bursts = math.max(burst, math.min(lb, burst_cap))
  local keep = alone and ALONE_MARGIN or 0
  local promise = (engines == 1 and now - age or now) + bursts - slack + keep
  local tt_before = tt
  if refills and rt > 0 and rem_t then tt = math.max(tt, promise - rem_t / rt) end
  if refills and rr > 0 and rem_r then tr = math.max(tr, promise - rem_r / rr) end
  save_state()
  return {1, 0, math.floor(factor * 1e6), 0, 0, math.floor(bursts), math.floor(now * 1000),
          engines, tt > tt_before and 1 or 0}
end

-- acquire
engines_now()
redis.call('ZADD', KEYS[2], now + lease_ms, job)
redis.call('HSET', KEYS[3], 'w:' .. job, weight)
redis.call('PEXPIRE', KEYS[2], lease_ms * 4)
redis.call('PEXPIRE', KEYS[3], lease_ms * 4)
local share, active = share_of()
-- A request refunded earlier left its job's reservation as a credit: this acquire spends it
-- and takes the next shared slot, as a ticket does.
if extra == 0 and share < 1 then
  local credit = tonumber(redis.call('HGET', KEYS[4], 'credit')) or 0
  if credit > 0 then
    redis.call('HINCRBY', KEYS[4], 'credit', -1)
    extra = 1
  end
end

local s = math.max(now, pause)
local cr, ct = 0, 0
if rr > 0 then
  cr = 1 / rr
  s = math.max(s, tr - burst_ms)
end
if rt > 0 then
  ct = tokens / rt
  s = math.max(s, tt - burst_ms)
end

-- Saturated: the bucket is not full again since its last use (demand at or above the rate).
local saturated = s > now or (rr > 0 and tr > now) or (rt > 0 and tt > now)

-- A ticket carries its job's reserved time on the virtual clock (1: no time, take a slot now).
-- Not yet due (the rate fell since, or the wait was cut short): wait again, nothing charged.
if extra > 1 and extra > v + 1 and share < 1 and saturated then
  redis.call('HSET', KEYS[1], 'v', v, 'vt', now)
  return {0, math.ceil(wall_until(extra) * 1000), math.floor(factor * 1e6),
          math.floor(share * 1e6), active, math.floor(extra)}
end

if share < 1 and extra == 0 then
  local jt = redis.call('HMGET', KEYS[4], 'vr', 'vk')
  local jtr = tonumber(jt[1]) or 0
  local jtt = tonumber(jt[2]) or 0
  -- Costs on the virtual clock: the wall cost at the current rate, times the rate's factor.
  local jcr, jct = cr * factor / share, ct * factor / share
  if saturated then
    -- Hold the job to its weighted share.
    local js = v
    if rr > 0 then js = math.max(js, jtr - burst) end
    if rt > 0 then js = math.max(js, jtt - burst) end
    if js > v then
      jtr = math.max(jtr, js) + jcr
      jtt = math.max(jtt, js) + jct
      redis.call('HSET', KEYS[4], 'vr', jtr, 'vk', jtt, 'share', share)
      keep(KEYS[4], now + (math.max(jtr, jtt) - v) / factor)
      redis.call('HSET', KEYS[1], 'v', v, 'vt', now)
      note_usage(math.max(cr, ct))
      return {0, math.ceil(wall_until(js) * 1000), math.floor(factor * 1e6),
              math.floor(share * 1e6), active, math.max(2, math.floor(js))}
    end
  end
  jtr = math.max(jtr, v) + jcr
  jtt = math.max(jtt, v) + jct
  if not saturated then
    -- Slack used while the bucket was not saturated is forgiven beyond `memory` ms: enough to
    -- keep shares fair across brief lulls, not so much that lent capacity is paid back later.
    jtr = math.min(jtr, v + math.max(burst, memory))
    jtt = math.min(jtt, v + math.max(burst, memory))
  end
  redis.call('HSET', KEYS[4], 'vr', jtr, 'vk', jtt, 'share', share)
  keep(KEYS[4], now + (math.max(jtr, jtt) - v) / factor)
end

if rr > 0 then tr = math.max(tr, s) + cr end
if rt > 0 then tt = math.max(tt, s) + ct end
if extra == 0 then note_usage(math.max(cr, ct)) end
save_state()
return {1, math.ceil((s - now) * 1000), math.floor(factor * 1e6), math.floor(share * 1e6), active,
        math.floor(s), math.floor(now * 1000), math.floor(burst_ms)}
