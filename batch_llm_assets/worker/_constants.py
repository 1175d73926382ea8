"""The queue worker's tuning constants (the engine's own are in engine/_constants.py)."""

# A message whose handling raised, or whose worker died holding it, this many times is answered
# with an error result and moved to the dead-letter list instead of being delivered again.
DEFAULT_MAX_DELIVERIES = 3

# A breaker scope that opened stays open this long before one message probes it; each failed
# probe doubles the wait, up to the maximum.
DEFAULT_BREAKER_COOLDOWN_S = 30.0
MAX_BREAKER_COOLDOWN_S = 600.0
# Streaks kept for this many scopes (producers) at most; beyond, closed ones are forgotten.
MAX_BREAKER_SCOPES = 10_000

# A message held for a cause that ends soon (another message with its id in flight, a breaker
# probe out) looks again after this long.
RECHECK_S = 1.0

# Deadlines are Unix seconds: before 2001-09-09 it is not Unix time (a relative number of
# seconds?), more than a year ahead it is most likely milliseconds (1.7e12 is the year 55,000).
EARLIEST_DEADLINE_S = 1e9
MAX_DEADLINE_AHEAD_S = 366 * 86_400.0

# Ids longer than this are digested in the Redis keys that carry them (done, answer, in flight).
MAX_ID_IN_KEY = 200

# Request queues one worker serves at most (each has its own engine and connection pool), and
# the longest queue name, id, job key or inference objective a queue config may give.
MAX_REQUEST_QUEUES = 64
MAX_CONFIG_TEXT = 1000
