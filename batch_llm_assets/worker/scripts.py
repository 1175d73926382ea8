"""The queue's Lua scripts: each move of a message is one of them, so it is always in exactly
one place. A script that fails half-way keeps what it wrote (Redis does not roll back), so each
writes where a message goes before it removes it from where it was, and a bad field (a NaN
deadline) only changes where it sorts, never whether it is kept.

Per member, `<processing>:deliveries` holds how many times it was claimed without an outcome
(field: SHA-1 of the member) and why its handling last failed (field: that SHA-1 + ":cause").
"""

_PRELUDE = """
local function deadline_of(m)
  local ok, d = pcall(cjson.decode, m)
  if ok and type(d) == 'table' then
    if type(d.data) == 'table' then d = d.data end
    local x = d.deadline
    if type(x) == 'number' and x == x and x > -math.huge and x < math.huge then return x end
  end
  return 0
end
local function forget(processing, deliveries, m)
  redis.call('ZREM', processing, m)
  local h = redis.sha1hex(m)
  redis.call('HDEL', deliveries, h, h .. ':cause')
end
local function unlock(key, token)
  if key ~= '' and token ~= '' and redis.pcall('GET', key) == token then
    redis.call('DEL', key)
  end
end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# The deadline of a member (bare or in llm-d's envelope) is its score in the queue; an unreadable
# or non-finite one is 0, so the member sorts first and is answered INVALID_REQUEST at once.
# KEYS: queue zset, processing zset, retry zset, list, deliveries. ARGV: visibility ms, n,
# use list, reclaim limit. Returns {reclaimed, member, deliveries, member, deliveries, ...}.
_REQUEUE = """
local function requeue(src, upto, limit)
  local moved = redis.call('ZRANGEBYSCORE', src, '-inf', upto, 'LIMIT', 0, limit)
  for _, m in ipairs(moved) do
    redis.call('ZADD', KEYS[1], deadline_of(m), m)
    redis.call('ZREM', src, m)
  end
  return #moved
end
"""

CLAIM = (
    _PRELUDE
    + _REQUEUE
    + """
local vis, n, limit = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[4])
local reclaimed = requeue(KEYS[2], now_ms, limit)
requeue(KEYS[3], now_ms / 1000, limit)
local out = {reclaimed}
local function take(m)
  redis.call('ZADD', KEYS[2], now_ms + vis, m)
  out[#out + 1] = m
  out[#out + 1] = redis.call('HINCRBY', KEYS[5], redis.sha1hex(m), 1)
end
if n > 0 then
  local popped = redis.call('ZPOPMIN', KEYS[1], n)
  for i = 1, #popped, 2 do take(popped[i]) end
  if ARGV[3] == '1' then
    while (#out - 1) / 2 < n do
      local m = redis.call('RPOP', KEYS[4])
      if not m then break end
      take(m)
    end
  end
end
return out
"""
)

# The deadlines of the next n members (the sorted set's, then the list's from its popping end),
# after the same requeue as CLAIM: a queue whose messages wait in processing or in the retry set
# shows them. KEYS: queue zset, processing zset, retry zset, list. ARGV: n, use list, reclaim
# limit. Returns {reclaimed, deadline, deadline, ...}.
PEEK = (
    _PRELUDE
    + _REQUEUE
    + """
local n, limit = tonumber(ARGV[1]), tonumber(ARGV[3])
local out = {requeue(KEYS[2], now_ms, limit)}
requeue(KEYS[3], now_ms / 1000, limit)
local heads = redis.call('ZRANGE', KEYS[1], 0, n - 1, 'WITHSCORES')
for i = 2, #heads, 2 do out[#out + 1] = heads[i] end
if ARGV[2] == '1' and #out - 1 < n then
  local listed = redis.call('LRANGE', KEYS[4], -n, -1)
  for i = #listed, 1, -1 do out[#out + 1] = tostring(deadline_of(listed[i])) end
end
return out
"""
)

# What is known of an id before it is sent; takes its in-flight lock when nothing is.
# KEYS: done, cancel marker, recorded answer, in-flight lock. ARGV: token, lock ttl ms.
BEGIN = """
if redis.call('EXISTS', KEYS[1]) == 1 then return {'done'} end
if redis.call('EXISTS', KEYS[2]) == 1 then return {'cancelled'} end
local answer = redis.call('GET', KEYS[3])
if answer then return {'answer', answer} end
if redis.call('SET', KEYS[4], ARGV[1], 'NX', 'PX', ARGV[2]) then return {'go'} end
return {'busy'}
"""

_WRITE_RESULT = """
local function write_result(list, done, stream, result, ttl, use_stream, maxlen)
  local ok = redis.pcall('LPUSH', list, result)
  if type(ok) == 'table' and ok.err then return ok.err end
  redis.call('SET', done, '1', 'EX', ttl)
  if use_stream == '1' then
    redis.pcall('XADD', stream, 'MAXLEN', '~', maxlen, '*', 'result', result)
  end
  return nil
end
"""

# The result, unless one for its id exists; then the member is forgotten. A result that cannot
# be pushed (the list is another type) fails the script before anything is removed.
# KEYS: processing, result list, done, stream, deliveries, answer, lock.
# ARGV: member, result, ttl s, use stream, stream maxlen, token. Returns 1 written, 0 duplicate.
ACK = (
    _PRELUDE
    + _WRITE_RESULT
    + """
local written = 0
if redis.call('EXISTS', KEYS[3]) == 0 then
  local err = write_result(KEYS[2], KEYS[3], KEYS[4], ARGV[2], ARGV[3], ARGV[4], ARGV[5])
  if err then return redis.error_reply(err) end
  written = 1
end
redis.call('DEL', KEYS[6])
unlock(KEYS[7], ARGV[6])
forget(KEYS[1], KEYS[5], ARGV[1])
return written
"""
)

# The member (or its retry) to the retry set, due after a delay, if it is still held. With a
# cause, a failed delivery: its count is kept and the cause recorded; else a retry or a hold.
# KEYS: processing, retry zset, deliveries, lock. ARGV: member, member to re-enqueue, delay s,
# cause, token.
MOVE = (
    _PRELUDE
    + """
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[2], tonumber(t[1]) + tonumber(t[2]) / 1e6 + tonumber(ARGV[3]), ARGV[2])
unlock(KEYS[4], ARGV[5])
if ARGV[4] ~= '' then
  redis.call('HSET', KEYS[3], redis.sha1hex(ARGV[1]) .. ':cause', ARGV[4])
  redis.call('ZREM', KEYS[1], ARGV[1])
else
  forget(KEYS[1], KEYS[3], ARGV[1])
end
return 1
"""
)

# A message delivered too often: its entry to the dead-letter list, its error result to the
# result list (unless one exists), and it leaves processing even when either write fails, so
# it is never delivered again.
# KEYS: processing, result list, done, stream, deliveries, answer, lock, dead-letter list.
# ARGV: member, result, ttl s, use stream, maxlen, token, entry.
# Returns {dead-lettered 1/0, result 1 written / 0 had one / the error}.
DEAD_LETTER = (
    _PRELUDE
    + _WRITE_RESULT
    + """
local kept = redis.pcall('LPUSH', KEYS[8], ARGV[7])
local dl = 1
if type(kept) == 'table' and kept.err then dl = 0 end
local res = 0
if redis.call('EXISTS', KEYS[3]) == 0 then
  res = write_result(KEYS[2], KEYS[3], KEYS[4], ARGV[2], ARGV[3], ARGV[4], ARGV[5]) or 1
end
redis.call('DEL', KEYS[6])
unlock(KEYS[7], ARGV[6])
forget(KEYS[1], KEYS[5], ARGV[1])
return {dl, res}
"""
)

# Graceful shutdown: members back to the request sorted set at once (no visibility wait).
# KEYS: processing, queue zset, deliveries, then one in-flight lock per member ('' if none).
# ARGV: member, token, member, token, ...
RELEASE = (
    _PRELUDE
    + """
local n = 0
for i = 1, #ARGV, 2 do
  local m = ARGV[i]
  if redis.call('ZSCORE', KEYS[1], m) then
    redis.call('ZADD', KEYS[2], deadline_of(m), m)
    unlock(KEYS[3 + (i + 1) / 2], ARGV[i + 1])
    forget(KEYS[1], KEYS[3], m)
    n = n + 1
  end
end
return n
"""
)

# Heartbeat: members still in flight here stay invisible, and their in-flight locks alive.
# KEYS: processing, then the locks held here. ARGV: visibility ms, the members held here.
EXTEND = (
    _PRELUDE
    + """
local until_ms = now_ms + tonumber(ARGV[1])
local n = 0
for i = 2, #ARGV do
  n = n + redis.call('ZADD', KEYS[1], 'XX', 'CH', until_ms, ARGV[i])
end
for i = 2, #KEYS do
  if KEYS[i] ~= '' then redis.call('PEXPIRE', KEYS[i], ARGV[1]) end
end
return n
"""
)

# A member whose id has a result already (a duplicate delivery): forgotten.
# KEYS: processing, deliveries. ARGV: member.
DROP = (
    _PRELUDE
    + """
forget(KEYS[1], KEYS[2], ARGV[1])
return 1
"""
)
