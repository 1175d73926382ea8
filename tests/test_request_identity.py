"""Request identity, exact: it covers the exact body, the provider kind and Azure's api_version,
never the key or the endpoint's host and port (unless pinned); the per-row and text-only fast
paths give the whole body's digest; changing what is sent resends and changing nothing resends
nothing; rows stored under the earlier identity are not sent again. Against the simulator over
HTTP and DuckDB files, with the asset, run and fixture of test_outcomes.py."""

from __future__ import annotations

import pytest

from batch_llm_assets.engine.engine import Engine, EngineSettings
from batch_llm_assets.engine.identity import endpoint_scope, legacy_scope, request_identity
from batch_llm_assets.engine.transport import AiohttpTransport

from .conftest import duckdb_query
from .test_outcomes import asset, db, metadata, run  # noqa: F401  (db: a fixture)

# The tests below request the `db` fixture by name: not a redefinition of the import.
# ruff: noqa: F811


def test_request_identity_covers_the_exact_body_and_provider_never_the_key_or_host():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}

    def identity(b, url, version=None, **kw):
        return request_identity(b, endpoint_scope(url, version, **kw))

    base = identity(body | {"temperature": 1}, "http://a/v1")
    assert identity(body | {"temperature": 1.0}, "http://a/v1/") == base
    assert identity(body | {"temperature": 0.7}, "http://a/v1") != base
    assert identity(body | {"temperature": 1, "max_tokens": 17}, "http://a/v1") != base
    # The transport is not the answer: another host, port, scheme or path of a self-hosted
    # server gives the same identity; the provider kind and Azure's api_version do not.
    for moved in ("http://b/v1", "https://a:8443/v1", "http://10.0.0.7:9000/proxy/v1"):
        assert identity(body | {"temperature": 1}, moved) == base
    assert identity(body | {"temperature": 1}, "https://api.openai.com/v1") != base
    assert identity(body | {"temperature": 1}, "http://a/v1", "2024-10-21") != base
    assert identity(body | {"temperature": 1}, "http://a/v1", provider="gemini") != base
    # Pinned, the endpoint is part of it again.
    pinned = identity(body | {"temperature": 1}, "http://a/v1", pin_endpoint=True)
    assert pinned != base
    assert identity(body | {"temperature": 1}, "http://b/v1", pin_endpoint=True) != pinned
    # The earlier definition's digest (body + endpoint URL) is kept, so stored rows still match.
    legacy = request_identity(body | {"temperature": 1}, legacy_scope("http://a/v1/"))
    assert legacy == "13e1134f61fe099d3bf010f1d7251de5b0b7660e6a67bee32d3c2ae2feb26e73"
    engine = Engine(
        EngineSettings(model="m", default_max_tokens=16, secret="sk-x"),
        AiohttpTransport(base_url="http://a/v1", api_key="sk-x", model="m"),
    )
    sent = engine.request_body(body["messages"], {"temperature": 1})
    assert sent == body | {"temperature": 1}  # the default max_tokens is part of what is sent


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": 'é "q" \\ \u2028'}, {"role": "user", "content": "1.0"}],
        [{"role": "user", "content": [{"type": "text", "text": "x", "w": 2.0}]}],
    ],
)
def test_the_per_row_identity_is_the_whole_body_identity(messages):
    """A partition run hashes every row with MessagesIdentity (the body minus its messages
    encoded once): it must give exactly request_identity's digest, or reruns would re-pay."""
    from batch_llm_assets.engine.identity import MessagesIdentity

    rest = {"model": "m", "max_tokens": 16, "temperature": 1.0, "stop": ["\n"], "seed": None}
    for url, version in (("http://a/v1/", None), ("https://b", "2024-10-21")):
        for scope in (endpoint_scope(url, version), legacy_scope(url, version)):
            fast = MessagesIdentity(rest, scope)
            assert fast(messages) == request_identity(rest | {"messages": messages}, scope)


def test_the_text_only_identity_is_the_whole_body_identity_for_any_text():
    """Rendered prompts are hashed with orjson (text_only): its bytes must be the standard
    encoder's for every character (controls, quotes, U+2028, astral, lone surrogates)."""
    import random

    from batch_llm_assets.engine.identity import MessagesIdentity

    rng = random.Random(7)
    alphabet = [chr(i) for i in range(0x300)] + list("\u2028\u2029\ud800\udfff\ue000\uffff😀\x7f")
    rest = {"model": "m", "max_tokens": 16}
    scope = endpoint_scope("http://a/v1")
    fast = MessagesIdentity(rest, scope)
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        messages = [{"role": "system", "content": text[:5]}, {"role": "user", "content": text}]
        whole = request_identity(rest | {"messages": messages}, scope)
        assert fast(messages, text_only=True) == whole, repr(text)


def test_changing_what_is_sent_resends_and_changing_nothing_resends_nothing(fresh_sim, db):
    def sent(a, **llm):
        result = run(a, fresh_sim, db, **llm)
        assert result.success
        return metadata(result)["run/rows_sent"]

    assert sent(asset(params={"temperature": 1})) == 12
    assert sent(asset(params={"temperature": 1.0})) == 0  # the same number
    assert sent(asset(params={"temperature": 1.0}), default_max_tokens=100) == 12
    # Another address of the same server is not another answer; pinned, the endpoint counts.
    other_host = fresh_sim.url.replace("127.0.0.1", "localhost")
    assert sent(asset(params={"temperature": 1}), default_max_tokens=100, base_url=other_host) == 0
    pinned = asset(params={"temperature": 1}, identity_endpoint=True)
    assert sent(pinned, default_max_tokens=100, base_url=other_host) == 12
    assert sent(pinned, default_max_tokens=100, base_url=other_host) == 0
    assert (
        sent(asset(params={"temperature": 1}), default_max_tokens=100, identity_endpoint=True) == 12
    )
    stored = {r[0] for r in duckdb_query(db, "SELECT request_hash FROM news_sentiment")}
    assert len(stored) == 12 and all(len(h) == 64 for h in stored)


def test_rows_stored_under_the_earlier_identity_are_not_sent_again(fresh_sim, db, monkeypatch):
    """An upgrade: rows written by the earlier definition (body + endpoint URL) are done."""
    import batch_llm_assets.assets.pipeline as pipeline

    def earlier(base_url, api_version=None, **_):
        return legacy_scope(base_url, api_version), legacy_scope(base_url, api_version)

    with monkeypatch.context() as m:
        m.setattr(pipeline, "identity_scopes", earlier)
        assert metadata(run(asset(), fresh_sim, db))["run/rows_sent"] == 12
    again = metadata(run(asset(), fresh_sim, db))
    assert (again["run/rows_sent"], again["run/rows_skipped"]) == (0, 12)
    assert fresh_sim.stats()["answered"] == 12
