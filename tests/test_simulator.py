"""The provider simulator over real HTTP: exact limits, OpenAI's 429s, usage, faults, stats."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
import urllib.error

import aiohttp
import pytest
import tiktoken

from batch_llm_assets.engine import count_prompt_tokens
from batch_llm_assets.simulator.limits import make_limit
from batch_llm_assets.simulator.server import openai_duration

from .conftest import SIM_KEY

DURATION = re.compile(r"^(\d+ms|(\d+m)?\d+(\.\d+)?s)$")
AUTH = {"Authorization": f"Bearer {SIM_KEY}"}


async def _post(url, body, headers=AUTH, timeout=10):
    async with aiohttp.ClientSession() as s:
        async with s.post(
            f"{url}/chat/completions",
            json=body,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, await r.text()


def post(url, body, **kw):
    return asyncio.run(_post(url, body, **kw))


def body(text="Hello", max_tokens=20, **extra):
    return {
        "model": "sim-1",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        **extra,
    }


def test_duration_format_is_openais():
    assert openai_duration(0.012) == "12ms"
    assert openai_duration(1.5) == "1.5s"
    assert openai_duration(360) == "6m0s"
    assert openai_duration(61.25) == "1m1.25s"


def test_answer_has_a_correct_usage_block_and_is_deterministic(fresh_sim):
    messages = [
        {"role": "system", "content": "You label headlines."},
        {"role": "user", "content": "Stocks soar on rate cut hopes"},
    ]
    req = {"model": "sim-1", "messages": messages, "max_tokens": 40}
    status, _, text = post(fresh_sim.url, req)
    assert status == 200
    first = json.loads(text)
    usage = first["usage"]
    assert usage["prompt_tokens"] == count_prompt_tokens(messages, "sim-1")
    content = first["choices"][0]["message"]["content"]
    enc = tiktoken.get_encoding("o200k_base")
    assert usage["completion_tokens"] == len(enc.encode(content)) <= 40
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    again = json.loads(post(fresh_sim.url, req)[2])
    assert again["choices"][0]["message"]["content"] == content


def test_label_prompts_get_one_of_the_labels(fresh_sim):
    status, _, text = post(fresh_sim.url, body("Fed hikes. Answer with one of: up, down, flat"))
    assert status == 200
    assert json.loads(text)["choices"][0]["message"]["content"] in {"up", "down", "flat"}


def test_requests_per_minute_are_enforced_exactly(fresh_sim):
    fresh_sim.configure(rpm=120, bucket_s=1.0)  # 2 per second, a bucket of 2

    async def burst():
        return await asyncio.gather(*(_post(fresh_sim.url, body(f"r{i}")) for i in range(8)))

    results = asyncio.run(burst())
    statuses = [r[0] for r in results]
    assert statuses.count(200) == 2 and statuses.count(429) == 6
    _, headers, text = next(r for r in results if r[0] == 429)
    err = json.loads(text)["error"]
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "requests"
    assert int(headers["retry-after-ms"]) > 0
    assert headers["x-ratelimit-limit-requests"] == "120"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert DURATION.match(headers["x-ratelimit-reset-requests"]), headers
    stats = fresh_sim.stats()
    assert stats["admitted_requests"] == 2 and stats["rate_limited"] == 6


def test_tokens_count_prompt_plus_max_tokens_at_admission(fresh_sim):
    fresh_sim.configure(tpm=6000, bucket_s=1.0)  # a bucket of 100 tokens
    first = body("x", max_tokens=80)
    cost = count_prompt_tokens(first["messages"], "sim-1") + 80
    status, headers, _ = post(fresh_sim.url, first)
    assert status == 200
    assert int(headers["x-ratelimit-remaining-tokens"]) == 100 - cost
    assert DURATION.match(headers["x-ratelimit-reset-tokens"])
    # The answer is short, but max_tokens was counted: a second such request does not fit.
    status, headers, text = post(fresh_sim.url, body("y", max_tokens=80))
    assert status == 429 and json.loads(text)["error"]["type"] == "tokens"
    assert fresh_sim.stats()["admitted_tokens"] == cost


def test_errors_look_like_openais(fresh_sim):
    status, _, text = post(fresh_sim.url, body(), headers={"Authorization": "Bearer sk-wrong-123"})
    assert status == 401 and json.loads(text)["error"]["code"] == "invalid_api_key"
    status, _, text = post(fresh_sim.url, {**body(), "model": "nope"})
    assert status == 404 and json.loads(text)["error"]["code"] == "model_not_found"
    status, _, text = post(fresh_sim.url, body("word " * 20_000, max_tokens=10))
    assert status == 400 and json.loads(text)["error"]["code"] == "context_length_exceeded"
    status, _, text = post(fresh_sim.url, body(temperature=7))
    assert status == 400 and json.loads(text)["error"]["code"] == "invalid_value"


@pytest.mark.parametrize("fault,status", [("fail_500", 500), ("fail_503", 503)])
def test_injected_server_errors(fresh_sim, fault, status):
    fresh_sim.configure(**{fault: 1.0})
    assert post(fresh_sim.url, body())[0] == status


def test_injected_malformed_body(fresh_sim):
    fresh_sim.configure(malformed=1.0)
    status, _, text = post(fresh_sim.url, body())
    assert status == 200
    with pytest.raises(ValueError):
        json.loads(text)


def test_injected_drop_and_hang(fresh_sim):
    fresh_sim.configure(drop=1.0)
    with pytest.raises(aiohttp.ClientError):
        post(fresh_sim.url, body())
    fresh_sim.configure(drop=0.0, hang=1.0, hang_s=30.0)
    with pytest.raises(asyncio.TimeoutError):
        post(fresh_sim.url, body(), timeout=0.5)
    assert fresh_sim.stats()["fault_hang"] == 1


def test_models_and_stats(fresh_sim):
    async def get(path):
        async with aiohttp.ClientSession() as s, s.get(fresh_sim.root + path) as r:
            return await r.json()

    models = asyncio.run(get("/v1/models"))
    assert {"sim-1", "gpt-4o-mini"} <= {m["id"] for m in models["data"]}
    post(fresh_sim.url, body())
    stats = fresh_sim.stats()
    assert stats["answered"] == 1 and stats["series"][0]["requests"] == 1
    assert stats["config"]["api_key"] is None  # the stats never show the key


# -- modes that model real providers (simulator/limits.py) ------------------------------------


def _admit_all(limit, costs, start, step):
    """Offer `costs` every `step` s from `start`; the times admitted."""
    admitted = []
    for i, cost in enumerate(costs):
        now = start + i * step
        if limit.wait_for(cost, now) == 0:
            limit.take(cost, now)
            admitted.append(now)
    return admitted


@pytest.mark.parametrize("bucket_s", [0.1, 1.0, 10.0, 60.0])
def test_a_token_bucket_of_any_capacity(bucket_s):
    limit = make_limit(600, enforcement="bucket", bucket_s=bucket_s, now=0.0)  # 10/s
    assert limit.capacity == pytest.approx(max(1.0, 10 * bucket_s))
    admitted = _admit_all(limit, [1] * 4000, 0.0, 0.001)  # 1000/s offered for 4 s
    assert len(admitted) == pytest.approx(limit.capacity + 10 * 4, abs=1.5)


def test_a_fixed_window_resets_at_its_edge():
    limit = make_limit(600, enforcement="fixed_window", window_s=10.0, now=0.0)  # 100 per 10 s
    admitted = _admit_all(limit, [1] * 2000, 0.0, 0.01)  # 20 s
    assert len(admitted) == 200
    # Everything in the first instants of each window: the burst real fixed windows allow.
    assert max(t for t in admitted if t < 10) < 1.01
    assert limit.wait_for(1, 19.5) == pytest.approx(0.5)


def test_a_sliding_window_never_holds_more_than_its_limit():
    limit = make_limit(600, enforcement="sliding_window", window_s=10.0, now=0.0)
    admitted = _admit_all(limit, [1] * 3000, 0.0, 0.01)  # 30 s
    for t in admitted:
        assert sum(1 for u in admitted if t - 10 < u <= t) <= 100
    assert len(admitted) == 300


def test_quantized_per_second_enforcement_of_a_per_minute_limit():
    limit = make_limit(600, enforcement="quantized", now=0.0)  # 10 per 1 s
    admitted = _admit_all(limit, [1] * 500, 0.0, 0.01)  # 5 s
    assert len(admitted) == 50
    assert all(sum(1 for t in admitted if s <= t < s + 1) == 10 for s in range(5))


def test_windows_report_remaining_and_reset():
    limit = make_limit(600, enforcement="fixed_window", window_s=10.0, now=0.0)
    limit.take(30, 1.0)
    assert limit.remaining(2.0) == 70 and limit.reset_s(2.0) == pytest.approx(8.0)


def test_chars4_counting_and_other_usage_shapes(fresh_sim):
    fresh_sim.configure(counting="chars4", usage_shape="input_output")
    req = body("Stocks soar on rate cut hopes " * 10)
    status, _, text = post(fresh_sim.url, req)
    usage = json.loads(text)["usage"]
    assert status == 200 and set(usage) == {"input_tokens", "output_tokens"}
    assert usage["input_tokens"] == math.ceil(len(json.dumps(req["messages"])) / 4)
    assert usage["input_tokens"] != count_prompt_tokens(req["messages"], "sim-1")
    fresh_sim.configure(usage_shape="none")
    assert "usage" not in json.loads(post(fresh_sim.url, body())[2])


@pytest.mark.parametrize(
    "style,present,absent",
    [("seconds", "retry-after", "retry-after-ms"), ("ms", "retry-after-ms", "retry-after")],
)
def test_retry_after_styles(fresh_sim, style, present, absent):
    fresh_sim.configure(rpm=60, bucket_s=1.0, retry_after=style)
    post(fresh_sim.url, body("a"))
    status, headers, _ = post(fresh_sim.url, body("b"))
    assert status == 429 and present in headers and absent not in headers
    if style == "seconds":  # rounded up: about 1 s to wait, said as "1"
        assert headers["retry-after"] == "1"


def test_limit_headers_as_capacity_or_none(fresh_sim):
    fresh_sim.configure(rpm=1200, bucket_s=1.0, limit_header="capacity")
    _, headers, _ = post(fresh_sim.url, body())
    assert headers["x-ratelimit-limit-requests"] == "20"  # the bucket, not 1200/min
    fresh_sim.configure(limit_header="none", rate_headers=False)
    _, headers, _ = post(fresh_sim.url, body())
    assert not [h for h in headers if h.startswith("x-ratelimit-")]


def test_provider_error_modes(fresh_sim):
    fresh_sim.configure(reasoning=True)
    status, _, text = post(fresh_sim.url, body())
    err = json.loads(text)["error"]
    assert status == 400 and err["code"] == "unsupported_parameter" and err["param"] == "max_tokens"
    req = body()
    req["max_completion_tokens"] = req.pop("max_tokens")
    assert post(fresh_sim.url, req)[0] == 200
    fresh_sim.configure(reasoning=False, fail_param="response_format")
    assert post(fresh_sim.url, body(response_format={"type": "json_object"}))[0] == 500
    assert post(fresh_sim.url, body())[0] == 200
    fresh_sim.configure(fail_param=None, insufficient_quota=True)
    status, _, text = post(fresh_sim.url, body())
    assert status == 429 and json.loads(text)["error"]["code"] == "insufficient_quota"
    fresh_sim.configure(insufficient_quota=False, tpm=1000)
    status, _, text = post(fresh_sim.url, body("word " * 1200))
    assert status == 429 and "Request too large" in json.loads(text)["error"]["message"]


# -- enforcement over real HTTP, counting noise, the admission log (issue 26) -----------------


async def _burst(url, n, text="burst"):
    return await asyncio.gather(*(_post(url, body(f"{text} {i}")) for i in range(n)))


@pytest.mark.parametrize(
    "settings",
    [
        {"enforcement": "bucket", "rpm": 6, "bucket_s": 100.0},  # 10 held, 0.1/s refill
        {"enforcement": "fixed_window", "rpm": 6, "window_s": 100.0},
        {"enforcement": "sliding_window", "rpm": 6, "window_s": 100.0},
        {"enforcement": "quantized", "rpm": 120, "quantum_s": 5.0},  # 10 per 5 s
    ],
    ids=lambda s: s["enforcement"],
)
def test_each_enforcement_admits_its_allowance_at_once_and_logs_each_admission(fresh_sim, settings):
    fresh_sim.configure(**settings)
    before = time.time()
    statuses = [r[0] for r in asyncio.run(_burst(fresh_sim.url, 25))]
    after = time.time()
    assert statuses.count(200) == 10 and statuses.count(429) == 15
    stats = fresh_sim.stats(log=True)
    log = stats["admissions"]
    assert len(log) == stats["admitted_requests"] == 10 and stats["log_dropped"] == 0
    assert sum(n for _, n in log) == stats["admitted_tokens"]
    assert all(before <= t <= after for t, _ in log) and log == sorted(log)
    assert before <= stats["first_received_at"] <= log[0][0]
    assert "admissions" not in fresh_sim.stats()  # only when asked: it can be long


def test_azure_enforces_a_per_minute_quota_over_1_s_and_10_s_at_once(fresh_sim):
    # 12 requests/min: a second's share is under one request (so one a second gets in), and
    # 10 s hold 2. A client that sends every second gets 2 in, then waits for the 10 s period.
    fresh_sim.configure(enforcement="azure", rpm=12, limit_header="capacity")
    admitted, started = 0, time.monotonic()
    while time.monotonic() - started < 5:
        results = asyncio.run(_burst(fresh_sim.url, 3))
        admitted += sum(r[0] == 200 for r in results)
        waits = [int(r[1]["retry-after-ms"]) for r in results if r[0] == 429]
        if max(waits) > 2000:  # the 10 s period: not this second's end
            break
        time.sleep(max(waits) / 1000)  # until the second the provider says frees a request
    assert admitted == 2
    elapsed_ms = (time.monotonic() - started) * 1000
    assert 10_000 - elapsed_ms - 500 <= max(waits) <= 10_000 - elapsed_ms + 500
    headers = next(r[1] for r in results if r[0] == 429)
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-limit-requests"] == "1"  # the binding period's capacity, 1 s


def test_azure_holds_tokens_over_10_s_where_one_second_admits_any_request():
    limit = make_limit(600, enforcement="azure", now=0.0)  # 10 tokens/s, 100 per 10 s
    admitted = _admit_all(limit, [30] * 200, 0.0, 0.1)  # a 30-token request every 0.1 s
    # quantized 1 s alone would take one a second (20); 10 s hold 3 of 30 tokens each.
    assert [int(t) for t in admitted] == [0, 1, 2, 10, 11, 12]
    alone = _admit_all(make_limit(600, enforcement="quantized", now=0.0), [30] * 200, 0.0, 0.1)
    assert len(alone) == 20


def test_counting_noise_is_within_its_bound_fixed_per_prompt_and_counted_alike_in_process(
    fresh_sim,
):
    from batch_llm_assets.simulator.counting import prompt_tokens

    fresh_sim.configure(count_noise=0.1, seed=5)
    prompts = [
        body(f"Shares of company {i} rose " + "sharply " * (i * 7))["messages"] for i in range(12)
    ]
    counted = []
    for msgs in prompts:
        req = {"model": "sim-1", "messages": msgs, "max_tokens": 20}
        usage = json.loads(post(fresh_sim.url, req)[2])["usage"]
        assert usage == json.loads(post(fresh_sim.url, req)[2])["usage"]  # same on every attempt
        base = count_prompt_tokens(msgs, "sim-1")
        assert abs(usage["prompt_tokens"] - base) <= 0.1 * base + 0.5
        counted.append(usage["prompt_tokens"])
    # A benchmark counts in-process what the simulator counted; another seed counts otherwise.
    assert counted == [prompt_tokens(m, "sim-1", noise=0.1, seed=5) for m in prompts]
    assert counted != [prompt_tokens(m, "sim-1", noise=0.1, seed=6) for m in prompts]
    offsets = [c - count_prompt_tokens(m, "sim-1") for c, m in zip(counted, prompts, strict=True)]
    assert len(set(offsets)) > 3  # noise, not one constant offset


@pytest.mark.parametrize(
    "settings,named",
    [
        ({"enforcement": "leaky"}, "enforcement"),
        ({"window_s": float("nan")}, "window_s"),
        ({"bucket_s": float("inf")}, "bucket_s"),
        ({"quantum_s": -1}, "quantum_s"),
        ({"count_noise": 2.0}, "count_noise"),
        ({"counting": "words"}, "counting"),
        ({"rpm": "600"}, "rpm"),
        ({"no_such_setting": 1}, "no_such_setting"),
    ],
)
def test_settings_no_provider_could_have_are_refused_by_name(fresh_sim, settings, named):
    with pytest.raises(urllib.error.HTTPError) as err:
        fresh_sim.configure(**settings)
    assert err.value.code == 400 and named in err.value.read().decode()
    assert post(fresh_sim.url, body())[0] == 200  # the config before is still in force
