"""The probe of a self-hosted server: what it reads from each server's answers, that a port
decides nothing, that a hosted API is never asked, and that a server answering badly (an error,
a timeout, garbage, NaN, wrong types, deep nesting, a huge body) ends generic with one warning,
never an error or a hang. The bad answers come from a small aiohttp server in the test (a real
server on loopback that answers as it is told)."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading

import pytest
from aiohttp import web

from batch_llm_assets import LLMResource
from batch_llm_assets.engine import server_probe
from batch_llm_assets.engine.profiles import detect_provider
from batch_llm_assets.engine.server_probe import identify
from batch_llm_assets.engine.structured import provider_kind

PROBE_LOG = "batch_llm_assets.engine.server_probe"


def open_engine(llm):
    """Open (and close) an engine: the settings it got, the form typed outputs take."""

    async def main():
        async with llm.engine() as engine:
            return engine.s, llm.structured_kind

    return asyncio.run(main())


def probe_warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == PROBE_LOG and r.levelno >= 30]


def test_the_port_does_not_decide_the_form():
    # A llama.cpp server on vLLM's default port is llama.cpp; nothing is read from a port.
    assert provider_kind("http://127.0.0.1:8000/v1", detected="llamacpp") == "llamacpp"
    assert provider_kind("http://127.0.0.1:8080/v1", detected="vllm") == "vllm"
    assert provider_kind("http://127.0.0.1:11434/v1") == "generic"  # not asked yet
    for url in ("http://localhost:8000/v1", "http://localhost:8080/v1", "http://h:11434/v1"):
        assert detect_provider(url) == "generic"
    # A hosted API's URL still decides (it is never asked); an explicit provider wins.
    assert provider_kind("https://api.openai.com/v1", detected="llamacpp") == "openai"
    assert provider_kind("http://127.0.0.1:8000/v1", provider="ollama", detected="vllm") == (
        "ollama"
    )


@pytest.mark.parametrize(
    "base_url, api_version",
    [
        ("https://api.openai.com/v1", None),
        ("https://acme.openai.azure.com", "2024-10-21"),
        ("https://generativelanguage.googleapis.com/v1beta/openai", None),
    ],
)
def test_a_hosted_api_is_never_asked(monkeypatch, base_url, api_version):
    calls = []

    def spy(real):  # records the call, then does what the real one does
        async def wrapper(**kw):
            calls.append(kw)
            return await real(**kw)

        return wrapper

    for name in ("probe_server", "discover_context_window"):
        real = getattr(server_probe, name)
        monkeypatch.setattr(f"batch_llm_assets.resources.llm_engine.{name}", spy(real))
    llm = LLMResource(base_url=base_url, api_version=api_version, model="gpt-4o-mini")
    open_engine(llm)
    assert calls == [] and llm.server_kind is None


# -- nothing answers, or answers badly: generic, one warning, never an error or a hang ----------
_NAN = b'{"object": "list", "data": [{"id": NaN, "owned_by": NaN, "max_model_len": NaN}], '
_NAN += b'"version": NaN, "default_generation_settings": NaN}'
_WRONG = b'{"data": [{"owned_by": ["vllm"], "id": 5, "max_model_len": 1e400}, "x", 3], '
_WRONG += b'"version": 7, "default_generation_settings": [], "object": {"\\ud800": 1}}'
HOSTILE = {
    "404": (404, b'{"error": "not found"}'),
    "500": (500, b'{"data": [{"id": "m", "owned_by": "vllm"}]}'),
    "garbage": (200, b'{"data": [{"id": "m", "owned_by": "vl'),
    "nan": (200, _NAN),
    "wrong_types": (200, _WRONG),
    "nested": (200, b"[" * 100_000 + b"]" * 100_000),
    # Over the size limit, though what it holds would identify vLLM.
    "huge": (
        200,
        b'{"data": [{"id": "m", "owned_by": "vllm"}], "pad": "' + b"a" * 1_100_000 + b'"}',
    ),
    "hang": (200, None),
}


@pytest.fixture
def hostile():
    """A loopback HTTP server (its own loop, in a thread) answering every GET as `mode` says."""
    state = {"mode": "404", "hits": 0}

    async def handler(request):
        state["hits"] += 1
        status, body = HOSTILE[state["mode"]]
        if body is None:
            await asyncio.Event().wait()  # never answers
        return web.Response(status=status, body=body, content_type="application/json")

    app = web.Application()
    app.router.add_route("GET", "/{tail:.*}", handler)
    runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]  # aiohttp has no public accessor
    state["url"] = f"http://127.0.0.1:{port}/v1"
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield state
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)


@pytest.mark.parametrize("mode", list(HOSTILE))
def test_a_server_that_answers_no_probe_well_is_generic_with_one_warning(hostile, mode, caplog):
    hostile["mode"] = mode
    llm = LLMResource(base_url=hostile["url"], model="gpt-4o-mini")
    with caplog.at_level(logging.INFO, logger=PROBE_LOG):
        settings, structured = open_engine(llm)
    assert llm.server_kind == "generic" and structured == "generic"
    assert settings.max_concurrency == 64 and hostile["hits"] == 4  # each probe once
    warnings = probe_warnings(caplog)
    assert len(warnings) == 1 and "Could not tell which server" in warnings[0]
    assert "LLMResource.provider" in warnings[0]


def test_no_server_at_all_is_generic_with_one_warning(caplog):
    with socket.socket() as sock:  # a port nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    llm = LLMResource(base_url=f"http://user:secret@127.0.0.1:{port}/v1?k=1", api_key="sk-x")
    with caplog.at_level(logging.INFO, logger=PROBE_LOG):
        open_engine(llm)
    warnings = probe_warnings(caplog)
    assert llm.server_kind == "generic" and len(warnings) == 1
    assert f"http://127.0.0.1:{port}/v1 " in warnings[0]  # no credentials, no query
    assert "secret" not in caplog.text and "sk-x" not in caplog.text


def test_identify_reads_only_what_each_server_says():
    # Straight from each server's docs (engine/server_probe.py cites them).
    vllm = {"data": [{"id": "m", "object": "model", "owned_by": "vllm", "max_model_len": 4096}]}
    assert identify({"models": vllm}, "m").kind == "vllm"
    assert identify({"models": vllm}, "m").context_window == 4096
    llama = {"data": [{"id": "a.gguf", "owned_by": "llamacpp", "meta": {"n_ctx_train": 131072}}]}
    props = {"default_generation_settings": {"n_ctx": 8192}, "total_slots": 1}
    got = identify({"models": llama, "props": props}, "gpt-4o-mini")
    assert (got.kind, got.context_window, got.models) == ("llamacpp", 8192, ("a.gguf",))
    assert not got.serves("gpt-4o-mini")
    ollama = {"data": [{"id": "llama3.2:latest", "owned_by": "library"}]}
    got = identify({"models": ollama, "ollama": {"version": "0.12.6"}}, "llama3.2")
    assert got.kind == "ollama" and got.serves("llama3.2")
    lcp = {"data": [{"id": "m", "object": "model", "owned_by": "me", "permissions": []}]}
    assert identify({"models": lcp}, "m").kind == "llama-cpp-python"
    assert identify({"version": {"version": "0.10.1"}}, "m").kind == "vllm"
    openai = {"data": [{"id": "gpt-4o-mini", "owned_by": "system"}]}
    assert not identify({"models": openai}, "gpt-4o-mini").known  # generic, warned about
    simulator = {"data": [{"id": "sim-1", "owned_by": "simulator"}]}
    assert identify({"models": simulator}, "sim-1").known  # the demo's: generic, no warning
    # A window beyond reason, or not a whole number, is not believed.
    huge = {"data": [{"id": "m", "owned_by": "vllm", "max_model_len": 10**12}]}
    assert identify({"models": huge}, "m").context_window is None
    assert identify({"props": {"default_generation_settings": {"n_ctx": True}}}, "m").kind == (
        "llamacpp"
    )
