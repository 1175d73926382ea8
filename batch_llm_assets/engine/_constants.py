"""Every retry, timeout and limiter default in one place (as openai-python's _constants.py)."""

DEFAULT_BASE_URL = "https://api.openai.com/v1"
DEFAULT_MODEL = "gpt-4o-mini"

DEFAULT_MAX_CONCURRENCY = 64
DEFAULT_REQUEST_TIMEOUT_S = 60.0
DEFAULT_MAX_ATTEMPTS = 6
# Reserved for the answer when a request sets neither max_tokens nor max_completion_tokens.
DEFAULT_MAX_TOKENS = 256

# Backoff between attempts, as openai-python: 0.5 s doubling to 8 s, up to 25 % jitter.
INITIAL_RETRY_DELAY_S = 0.5
MAX_RETRY_DELAY_S = 8.0
RETRY_JITTER = 0.25
# Server hints, capped here and only here. A hint (retry-after-ms / retry-after) pauses every
# job on the key for at most MAX_SHARED_PAUSE_S; the row that got a longer one waits it alone,
# up to MAX_SERVER_HINT_S (beyond that the hint is not believed: normal backoff).
MAX_SHARED_PAUSE_S = 60.0
MAX_SERVER_HINT_S = 600.0

# Flex processing (engine/flex.py; https://developers.openai.com/api/docs/guides/flex-processing):
# "increase default timeout to 15 minutes" (flex answers more slowly), and a capacity shortage
# (429 Resource Unavailable) retried with exponential backoff from FLEX_RETRY_DELAY_S doubling to
# FLEX_MAX_RETRY_DELAY_S: capacity comes back over minutes, not within a rate limit's second.
FLEX_REQUEST_TIMEOUT_S = 900.0
FLEX_RETRY_DELAY_S = 1.0
FLEX_MAX_RETRY_DELAY_S = 60.0

# Breaker: the same non-transient error (same status, code and message shape) on this many
# consecutive distinct rows stops sending; so do typed answers that break the same rule of the
# schema (same field, same kind of bound) after their repair on this many consecutive rows (a
# model that cannot meet the schema fails every row alike, each paid twice). Retries per run: a base plus a fraction of the rows
# started (like gRPC's retry throttling), so a sick provider is sent at most ~3x the rows, not
# rows x max_attempts. Retries after a 429 are paced by the limiter and do not count.
BREAKER_THRESHOLD = 5
RETRY_BUDGET_BASE = 100
# Template breaker (assets/prompt.py): this many consecutive rows failing to render the same
# way (prompt_render, prompt_too_large) is the template's fault, not the data's: the run stops.
# Higher than BREAKER_THRESHOLD: a few large documents side by side are ordinary data.
TEMPLATE_BREAKER_THRESHOLD = 10
RETRY_BUDGET_RATIO = 2.0
# Typed outputs (engine/constraints.py). A server that constrains decoding to the schema never
# shows it to the model (llama.cpp's grammars/README.md: "The model has no visibility into the
# schema"), so its descriptions, enums and bounds are also stated in the system prompt, one line
# per constrained field, within these bounds: a schema of 1,000 fields or of megabyte
# descriptions makes a note of at most SCHEMA_NOTE_MAX_CHARS, not a megabyte prompt.
SCHEMA_NOTE_MAX_CHARS = 4_000
SCHEMA_NOTE_MAX_LINES = 60
SCHEMA_NOTE_MAX_DEPTH = 6  # nesting levels of objects and arrays read
SCHEMA_NOTE_MAX_NODES = 2_000  # schema nodes read ($refs followed) before the note stops
SCHEMA_NOTE_TEXT_CHARS = 200  # a description, pattern or list of enum values, at most
# The repair turn quotes the failing value (at most REPAIR_VALUE_MAX_CHARS of its JSON) and the
# bound it broke, says what was wrong in at most REPAIR_PROBLEM_MAX_CHARS (the row's error too),
# and hands back at most REPAIR_ANSWER_MAX_CHARS of the bad answer.
REPAIR_VALUE_MAX_CHARS = 80
REPAIR_PROBLEM_MAX_CHARS = 1_000
REPAIR_ANSWER_MAX_CHARS = 4_000
# Tokens estimated with a fallback encoding (a model tiktoken does not know) are scaled up by
# this margin, so the TPM reservation and the context check are not too low.
FALLBACK_ESTIMATE_MARGIN = 0.25
# One log line per kind of limiter warning per this many seconds.
WARN_EVERY_S = 10.0

# A job_key names Redis keys (the limiter's leases and shares, the daily budget): this long at
# most, and printable (no C0/C1 control character: a line break would split a lease member or a
# log line). LLMResource and the worker (its --job-key and each queue's job_key) hold it to both.
MAX_JOB_KEY_CHARS = 200
JOB_KEY_PATTERN = r"^[^\x00-\x1f\x7f-\x9f]+$"

# -- The rate controller (docs/engine.md states it; limiter.lua receives these as arguments) --
# Burst after idle time, in seconds of the rate: none until the provider's headers show a bucket.
# OpenAI: "Rate limits can be quantized, meaning they are enforced over shorter periods of time
# (e.g. 60,000 requests/minute may be enforced as 1,000 requests/second). Sending short bursts
# ... can lead to rate limit errors" (help.openai.com, article 6891753); Azure OpenAI: a 600-RPM
# deployment is limited "if more than 10 requests are received during each 1-second period".
# A pace at the rate with a burst of b admits (1 + b) x a second's share in a second.
DEFAULT_BURST_S = 0.0
# A burst up to this keeps any 60 s window within 1 + 1/60 of the configured per-minute limit
# whatever happens; a wider one (learned from the provider's bucket) is granted only while the
# minute's ledger has room under the configured limit.
CEILING_FREE_BURST_S = 1.0
# The provider's bucket, as remaining / rate + reset show it, less this much (a send's jitter),
# is the widest burst; and never more than MAX_LEARNED_BURST_S. What remains (the clamp) bounds
# what the burst may take at any moment.
LEARNED_BURST_MARGIN_S = 0.1
MAX_LEARNED_BURST_S = 60.0
# AIMD on 429s: x0.7 per overload event; back up at 0.1 per second to ADAPT_KNEE times the factor
# the 429 came at, across to that factor ADAPT_PROBE_SLOWDOWN times slower (the provider refused
# that rate: probed again at once, a limit under the configured one that no header states refuses
# it again once per cycle), and at 0.1 per second beyond it (a rate never refused); CUBIC's
# concave and convex regions around the window of its last loss (RFC 8312, section 4). Never
# below ADAPT_MIN_FACTOR.
ADAPT_DECREASE = 0.7
ADAPT_RECOVERY_PER_S = 0.1
ADAPT_KNEE = 0.95
ADAPT_PROBE_SLOWDOWN = 40.0
ADAPT_MIN_FACTOR = 0.1
# The script's remaining numbers. A settle whose burst (the bucket the provider's headers show)
# is BURST_WIDER_RATIO times the one in use and wider by BURST_WIDER_STEP_S (or by the configured
# burst, if more) restarts the schedule so the new headroom is used at once. A restart cannot see
# the grants in flight, so a small bucket whose headers swing by tens of ms must not make one
# each answer.
BURST_WIDER_RATIO = 1.5
BURST_WIDER_STEP_S = 0.5
# Under no saturation, a job's own schedule runs at most this far ahead of now: slack it used in
# a lull is forgiven, so a job back from idle is not held to its old share.
LULL_FORGIVE_MS = 1000
# The limiter's keys outlive the schedule by the minute ledgers' span and a second.
STATE_TTL_MARGIN_MS = 61_000
# Fair shares: a job's lease lives this long without an acquire; its recent use is an EWMA over
# SHARE_TAU_MS; a job using under SHARE_IDLE of its weighted share lends the rest.
JOB_LEASE_TTL_MS = 15_000
SHARE_TAU_MS = 1_000
SHARE_IDLE = 0.5
# The set of leases and the jobs' weights and use outlive the latest acquire by this many lease
# TTLs: a lapsed lease is still there for the next acquire to clear its job's entries, and the
# state of a key nobody uses any more goes by itself.
JOB_STATE_TTL_LEASES = 4
# No slot is granted further ahead than this: a request whose slot would be later comes back
# then, one per engine at a time, without a reservation. So the rate in force when it is sent
# (the factor recovering after a 429, a wider burst) applies within this long, not after the
# whole queue of requests in flight (64 x the interval: tens of seconds at a few per second).
GRANT_REACH_S = 1.0
# A request takes a fresh slot, at most this many times, when it woke later than its burst after
# its slot, or after an overload event or a widened burst made its slot stale.
MAX_FRESH_SLOTS = 2
# Bucket or window (controller.py), over a draw of WINDOW_EVIDENCE_S of the rate between two
# answers: a reset that grew by half the draw or more shows a bucket (its capacity may then widen
# the burst); one that fell by half the draw shows a window.
WINDOW_EVIDENCE_S = 0.25
# A spent window's grants wait until this long after its reset (the send's way there, and the
# reset read against our clock from the send's time).
WINDOW_RESET_MARGIN_S = 0.02
# A gateway's generic reset header (RateLimit-Reset, X-RateLimit-Reset) is read up to a minute:
# delta-seconds in the IETF drafts and at Kong and Envoy. Over it, it may be a Unix time (GitHub,
# IBM), milliseconds, or an hour's window: none worth holding every grant on (429s still pause).
MAX_GENERIC_RESET_S = 60.0
# A x-ratelimit-limit-* below the configured limit is a per-minute limit (and lowers the rate)
# when it is at least this fraction of it; a smaller one is taken for a bucket's capacity.
PER_MINUTE_LIMIT_FRACTION = 0.5
# x-ratelimit-limit is a capacity, not per minute, where a window has more left than the limit
# per minute allows over its longest reset seen, by this factor (a window's remaining at its
# start is exactly that much under a per-minute limit: the margin is for rounding and latency).
CAPACITY_READING_MARGIN = 1.25
# The reservation's scale-up (or down) to the provider's own prompt count, learned from usage:
# the ratio of the sums over about CALIBRATION_ANSWERS latest answers, within these bounds.
CALIBRATION_MIN = 0.5
CALIBRATION_MAX = 4.0
CALIBRATION_ANSWERS = 64
# How long a limiter call waits out an unreachable Redis before the request fails, asking again
# after a jittered delay from LIMITER_RETRY_DELAY_S doubling to LIMITER_MAX_RETRY_DELAY_S.
LIMITER_OUTAGE_S = 60.0
LIMITER_RETRY_DELAY_S = 0.1
LIMITER_MAX_RETRY_DELAY_S = 5.0
# How long one wait for another process's restart lasts before it waits again (under the Redis
# client's socket timeout, REDIS_CONNECT_TIMEOUT_S, which would end the subscription).
EPOCH_LISTEN_S = 1.0
# No epoch heard on the key's channel is believed at or past this: the script's epochs are a
# server time in ms plus the overload events since, exact in a Lua number below 2^53.
MAX_EPOCH = 2**53

# Requests rejected with these errors, this many times in a row, abort the batch.
FATAL_ERROR_THRESHOLD = 3
# How long opening the engine may take to reach and authenticate to Redis.
REDIS_CONNECT_TIMEOUT_S = 5.0
# Connections one engine holds to the limiter's Redis. Its scripts run one at a time on the server
# anyway; a pool as large as the concurrency opens 64 connections on the first wave of acquires
# (40-80 ms before the first send), and a server with maxclients is spared.
REDIS_MAX_CONNECTIONS = 16

# Asking a self-hosted server what it is (engine/server_probe.py): each GET of the probe (they run
# at once) may take this long, and an answer over PROBE_MAX_BYTES is not read (a server answers
# these in a few hundred bytes; a gateway's model list in tens of kB). A context window a server
# reports above PROBE_MAX_CONTEXT_WINDOW is not believed.
PROBE_TIMEOUT_S = 2.0
PROBE_MAX_BYTES = 1_048_576
PROBE_MAX_CONTEXT_WINDOW = 100_000_000

# Context windows (tokens) of well-known models; override with LLMResource.context_window.
CONTEXT_WINDOWS = {
    "gpt-5": 400_000,
    "gpt-4.1": 1_047_576,
    "gpt-4o": 128_000,
    "gpt-4-turbo": 128_000,
    "gpt-4": 8_192,
    "gpt-3.5-turbo": 16_385,
    "o1": 200_000,
    "o3": 200_000,
    "o4-mini": 200_000,
    "gemini-2.5": 1_048_576,
    "gemini-2.0": 1_048_576,
    "gemini-1.5": 1_048_576,
}


def context_window_for(model: str) -> int | None:
    """Longest known prefix match, so that dated snapshots (gpt-4o-2024-08-06) resolve."""
    best = None
    for prefix in CONTEXT_WINDOWS:
        if model.startswith(prefix) and (best is None or len(prefix) > len(best)):
            best = prefix
    return CONTEXT_WINDOWS[best] if best else None


# Partition leases (assets/lease.py): one run per asset partition at a time. A lease lives
# LEASE_TTL_S past its holder's last renewal (renewed LEASE_RENEWALS_PER_TTL times a TTL), so a
# holder that died on another host is taken over that long after its death, one that died on
# this machine at once. Without a shared Redis, on BigQuery, the lease is a row of a table and
# each renewal a DML statement (BigQuery runs two on a table at a time): renewed less often.
LEASE_TTL_S = 5.0
LEASE_WAREHOUSE_TTL_S = 60.0
LEASE_RENEWALS_PER_TTL = 5
# How long taking a lease waits out an unreachable lease store before the run fails.
LEASE_TAKE_OUTAGE_S = 30.0

# A limiter wait shorter than this is the acquire's own round trip, not waiting for the limit:
# a request that waited at least this long counts in run/requests_waited_fraction.
LIMITER_WAITED_S = 0.01

# -- Adaptive concurrency of a self-hosted server (engine/adaptive.py states it; gate.py) --
# The limit starts at one request (the latency of a request alone is the no-load base), decides
# once per window of at least ADAPTIVE_WINDOW_MIN answers (and as many as the limit), holds while
# a window's mean latency is within ADAPTIVE_LATENCY_TOLERANCE x the base, shrinks by the
# gradient tolerance x base / latency (never below ADAPTIVE_MIN_GRADIENT), and takes the latency
# as the new base after ADAPTIVE_REBASE_WINDOWS windows at one request still over the tolerance
# (the rows got slower, not the queue longer).
ADAPTIVE_START_LIMIT = 1
ADAPTIVE_WINDOW_MIN = 2
ADAPTIVE_LATENCY_TOLERANCE = 2.0
ADAPTIVE_MIN_GRADIENT = 0.5
ADAPTIVE_REBASE_WINDOWS = 3
# An attempt's timeout against such a server: at least this many times the slowest of the latest
# ADAPTIVE_TIMEOUT_SAMPLES answers (at most ADAPTIVE_MAX_TIMEOUT_S).
ADAPTIVE_TIMEOUT_FACTOR = 4.0
ADAPTIVE_TIMEOUT_SAMPLES = 32
ADAPTIVE_MAX_TIMEOUT_S = 3600.0
# Shared through Redis (engine/concurrency.lua): an engine's slots live this long past its last
# call or heartbeat (renewed three times a lease); a refused acquire asks again after this long
# (or when one of the engine's own requests ends); an engine refused this recently, or holding
# slots, has a share of the limit. The shared state outlives the last engine by four leases.
CONCURRENCY_LEASE_TTL_MS = 10_000
CONCURRENCY_POLL_S = 0.05
CONCURRENCY_WANT_MS = 1_000

# -- Spend caps (engine/budget.py; budget.lua receives these as arguments) --
# A cap above this is refused as a mistake (amounts are kept in 1e-9 USD, exact in Redis's and
# Lua's numbers up to about $9M); leave it unset for no cap.
MAX_BUDGET_USD = 1_000_000
# A request's hold on the day's cap lives its attempt's timeout plus this margin: a process
# killed mid-request keeps that much of the cap no longer than this after the timeout.
BUDGET_HOLD_MARGIN_S = 30.0
# A batch file's hold lives this long: the upload and the batch's creation, after which it is
# charged (the state table then records the file).
BUDGET_FILE_LEASE_S = 900.0
# A batch file is held whole or cut to what fits, trying again with the figures a refusal
# brings back (other runs hold and spend meanwhile) this many times.
BUDGET_FIT_TRIES = 3
# A day's spend is kept this many days after its end (a batch collected later is refunded to the
# day it was charged on); then its keys expire.
BUDGET_KEEP_DAYS = 2
