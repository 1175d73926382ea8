"""Parts of engine v2 that need no server: usage in every shape, providers told apart by their
URL and their profiles' defaults, context windows in the shapes servers send, the limiter's
one-line-per-kind warnings, the client a cluster URL selects, and error signatures."""

from __future__ import annotations

import logging

import pytest
import redis.asyncio as aioredis

from batch_llm_assets import LLMResource
from batch_llm_assets.engine import errors as E


def test_usage_in_every_shape():
    from batch_llm_assets.engine.usage import parse_usage

    openai = {
        "prompt_tokens": 10,
        "completion_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 4},
        "completion_tokens_details": {"reasoning_tokens": 3},
    }
    u = parse_usage(openai)
    assert (u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.reasoning_tokens) == (
        10,
        5,
        4,
        3,
    )
    u = parse_usage({"input_tokens": 7, "output_tokens": 2, "cache_read_input_tokens": 1})
    assert (u.prompt_tokens, u.completion_tokens, u.cached_tokens) == (7, 2, 1)
    assert parse_usage({"prompt_tokens": 9, "total_tokens": 12}).completion_tokens == 3
    assert parse_usage(None) is None and parse_usage({}) is None


def test_providers_are_told_apart_by_their_url():
    from batch_llm_assets.engine.profiles import detect_provider, profile_for, token_param_for

    assert detect_provider("https://api.openai.com/v1") == "openai"
    assert detect_provider("https://x.openai.azure.com") == "azure"
    assert detect_provider("https://any", api_version="2024-10-21") == "azure"
    g = "https://generativelanguage.googleapis.com/v1beta/openai"
    assert detect_provider(g) == "gemini"
    # Any other server is asked what it is (test_server_detect.py): its port says nothing.
    for url in ("http://localhost:8000/v1", "http://localhost:8080/v1", "http://vllm:11434/v1"):
        assert detect_provider(url) == "generic"
    local = profile_for("llamacpp", "http://localhost:8000/v1")
    assert local.max_concurrency <= 8 and local.request_timeout_s >= 300
    with pytest.raises(ValueError, match="unknown provider 'bedrock'"):
        profile_for("bedrock", "")
    for model in ("gpt-5", "gpt-5-mini", "o1-preview", "o3", "o4-mini", "openai/gpt-5"):
        assert token_param_for(model) == "max_completion_tokens"
    assert token_param_for("gpt-4o-mini") == token_param_for("llama-3") == "max_tokens"


def test_a_resource_takes_its_profile_defaults():
    llm = LLMResource(base_url="http://localhost:11434/v1", model="llama3", provider="ollama")
    assert llm.profile.name == "llamacpp" and llm.concurrency == 4
    assert llm.engine_settings().request_timeout_s == 600
    assert LLMResource(provider="llama-cpp-python").profile.name == "llamacpp"
    # Not yet asked, a server that is not a hosted API has the generic profile.
    assert LLMResource(base_url="http://localhost:11434/v1").profile.name == "generic"
    with pytest.raises(Exception, match="unknown provider"):
        LLMResource(provider="nope")


@pytest.mark.parametrize(
    "payload",
    [
        {"data": [{"id": "m", "max_model_len": 8192}]},  # vLLM
        {"data": [{"id": "m", "meta": {"n_ctx_train": 1, "n_ctx": 8192}}]},  # llama.cpp
        {"data": [{"id": "m", "context_length": 8192}]},  # OpenRouter, LM Studio
    ],
)
def test_context_windows_in_the_shapes_servers_send(payload):
    from batch_llm_assets.engine.profiles import context_window_from_models

    assert context_window_from_models(payload, "m") == 8192
    assert context_window_from_models({"data": []}, "m") is None


def test_limiter_warnings_are_one_line_per_kind_per_period(caplog):
    from batch_llm_assets.engine.redis_client import Warnings

    warn = Warnings(every_s=10)
    with caplog.at_level(logging.WARNING):
        for _ in range(50):
            warn("ConnectionError", "Limiter Redis unavailable (%s); retrying.", "x")
        warn("ResponseError", "other kind")
    assert caplog.text.count("Limiter Redis unavailable") == 1
    assert caplog.text.count("other kind") == 1


def test_a_cluster_url_makes_a_cluster_client():
    # No Redis Cluster runs here (it needs 3+ nodes): only which client the URL selects.
    from batch_llm_assets.engine.limiter import connect_redis

    assert isinstance(connect_redis("redis+cluster://127.0.0.1:7000/0"), aioredis.RedisCluster)
    assert isinstance(connect_redis("redis://127.0.0.1:6379/0"), aioredis.Redis)


def test_error_signatures_ignore_ids_and_numbers():
    a = E.ProviderError("server_error", "HTTP 500: failed req_abc123 at 17:02", status=500)
    b = E.ProviderError("server_error", "HTTP 500: failed req_zzz999 at 18:44", status=500)
    c = E.ProviderError("server_error", "HTTP 500: other", status=500)
    assert a.signature == b.signature != c.signature
