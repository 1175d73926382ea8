"""The simulator's POST /v1/embeddings over HTTP: deterministic unit vectors, usage, OpenAI's
packed-input limits as 400s, base64, and the chat route's limits and key."""

from __future__ import annotations

import array
import base64
import json
import math
import urllib.error
import urllib.request

import pytest

from .conftest import SIM_KEY

MODEL = "text-embedding-3-small"


def post(sim, body, key=SIM_KEY):
    req = urllib.request.Request(
        sim.url + "/embeddings",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_vectors_are_deterministic_unit_vectors_and_similar_texts_are_close(fresh_sim):
    texts = ["bank shares rise", "bank shares fall", "bank shares rise", "weather is mild"]
    status, body = post(fresh_sim, {"model": MODEL, "input": texts, "dimensions": 64})
    assert status == 200
    vecs = [d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])]
    assert [len(v) for v in vecs] == [64] * 4
    assert all(math.isclose(sum(x * x for x in v), 1.0, rel_tol=1e-5) for v in vecs)
    assert vecs[0] == vecs[2]  # the same text, the same vector

    def cos(a, b):
        return sum(x * y for x, y in zip(a, b, strict=True))

    assert cos(vecs[0], vecs[1]) > cos(vecs[0], vecs[3])  # shared words: closer
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    assert fresh_sim.stats()["admitted_tokens"] == body["usage"]["prompt_tokens"]


def test_base64_is_little_endian_float32_of_the_same_vector(fresh_sim):
    _, floats = post(fresh_sim, {"model": MODEL, "input": "rates held", "dimensions": 16})
    _, packed = post(
        fresh_sim,
        {"model": MODEL, "input": "rates held", "dimensions": 16, "encoding_format": "base64"},
    )
    decoded = array.array("f", base64.b64decode(packed["data"][0]["embedding"])).tolist()
    assert decoded == pytest.approx(floats["data"][0]["embedding"], abs=1e-7)


@pytest.mark.parametrize(
    ("settings", "body", "needle"),
    [
        ({}, {"input": ""}, "'$.input' is invalid"),
        ({}, {"input": ["a", ""]}, "'$.input' is invalid"),
        ({"embedding_max_inputs": 3}, {"input": ["a"] * 4}, "max number of inputs is 3"),
        ({"embedding_max_input_tokens": 5}, {"input": ["a", "b " * 20]}, "maximum context length"),
        (
            {"embedding_max_request_tokens": 10},
            {"input": ["one two three four"] * 4},
            "max 10 tokens per request",
        ),
        ({}, {"input": "a", "dimensions": 0}, "'dimensions'"),
        ({}, {"input": "a", "dimensions": 5000}, "'dimensions'"),
        (
            {},
            {"input": "a", "model": "text-embedding-ada-002", "dimensions": 8},
            "does not support",
        ),
        ({}, {"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ],
)
def test_limits_and_bad_values_answer_400_for_the_whole_request(fresh_sim, settings, body, needle):
    fresh_sim.configure(**settings)
    status, answer = post(fresh_sim, {"model": MODEL} | body)
    assert status == 400 and needle in answer["error"]["message"]
    assert fresh_sim.stats().get("admitted_requests", 0) == 0  # refused before the limits


def test_tpm_counts_the_sum_of_the_inputs_and_a_wrong_key_gets_401(fresh_sim):
    fresh_sim.configure(tpm=60, rpm=None)  # a bucket of 1 token/s
    status, _ = post(fresh_sim, {"model": MODEL, "input": ["alpha beta"] * 3})
    assert status == 200
    status, body = post(fresh_sim, {"model": MODEL, "input": ["alpha beta"] * 3})
    assert status == 429 and body["error"]["code"] == "rate_limit_exceeded"
    assert post(fresh_sim, {"model": MODEL, "input": "x"}, key="sk-wrong-key-000000")[0] == 401
