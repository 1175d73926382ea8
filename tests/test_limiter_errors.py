"""What the limiter says when its script fails on a real server (the embedded Valkey, and
REDIS_URL's Redis when set): every error raised while the script runs carries "script: <sha>",
so the reply's code or class tells the script's own failure from a command the server refused."""

from __future__ import annotations

import pytest
import redis

from batch_llm_assets.engine import EmbeddedValkey, LimiterRefusedError, LimiterScriptError

from .test_limiter import _limiter, run


async def _acquire(url, namespace):
    client, lim = _limiter(url, namespace, rpm=600)
    try:
        return await lim.acquire(10)
    finally:
        await client.aclose()


def test_the_script_failing_on_the_server_is_a_script_error_with_luas_words(redis_url, namespace):
    # A minute-ledger entry without its ":amount" (written by anything but the script): the
    # acquire's trim reads it as nil and the Lua fails mid-call. Our script's failure, not an
    # outage: raised at once (an outage would be retried for LIMITER_OUTAGE_S, then be
    # LimiterUnavailableError), naming the op and the server's own words.
    r = redis.Redis.from_url(redis_url)
    r.zadd(f"{namespace}:ledger:r", {"no-amount": 0})
    r.pexpire(f"{namespace}:ledger:r", 60_000)
    with pytest.raises(LimiterScriptError) as info:
        run(_acquire(redis_url, namespace))
    message = str(info.value)
    assert "failed running the limiter's script while running acquire" in message
    assert "attempt to perform arithmetic on a nil value" in message


def test_a_command_the_server_refuses_inside_the_script_is_a_refusal(redis_url, namespace):
    # A key of the limiter's namespace holding another type (a name taken by something else):
    # the server refuses the script's HMGET with WRONGTYPE. No bug of the script, and no retry
    # fixes it: LimiterRefusedError, naming the code.
    redis.Redis.from_url(redis_url).set(f"{namespace}:state", "not a hash", px=60_000)
    with pytest.raises(LimiterRefusedError) as info:
        run(_acquire(redis_url, namespace))
    assert "refused the command while running acquire" in str(info.value)
    assert "WRONGTYPE" in str(info.value)


def test_a_server_out_of_memory_is_a_refusal_not_a_script_error(namespace):
    with EmbeddedValkey() as server:
        r = redis.Redis.from_url(server.url)
        r.config_set("maxmemory-policy", "noeviction")
        r.config_set("maxmemory", "1")
        with pytest.raises(LimiterRefusedError) as info:
            run(_acquire(server.url, namespace))
    assert "OutOfMemoryError" in str(info.value)
