"""Self-hosted servers are asked what they are, once, when the engine opens.

The simulator answers as llama.cpp, vLLM, Ollama or llama-cpp-python (simulator/kinds.py) on the
free port it picks, never the server's default one, and reads only that server's form of
structured output: with no setting, the kind is told apart, typed outputs go in its form and
every typed row is valid. Pricing follows what the server is, not its host; a served model
other than the configured one is warned about once; the README's settings for each server work
against the simulator answering as it. The probe itself, against hostile answers:
test_server_probe.py.
"""

from __future__ import annotations

import ast
import asyncio
import logging
import re
import socket
from pathlib import Path

import dagster as dg
import pytest

from batch_llm_assets import DuckDBWarehouse, LLMResource, Prompt, SourceTable
from batch_llm_assets import build_llm_batch_asset as build
from batch_llm_assets.assets.pricing import price_for, served_model
from batch_llm_assets.assets.structured import parse_output_schema
from batch_llm_assets.demo_data import create_demo_table
from batch_llm_assets.engine.engine import ChatRequest
from batch_llm_assets.engine.structured import shape_request, validator
from batch_llm_assets.simulator import SimulatorProcess

from .conftest import SIM_KEY, duckdb_query
from .test_server_probe import PROBE_LOG, open_engine, probe_warnings

MODELS = {"sim-1": 16_384, "gpt-4o-mini": 128_000}
# simulator kind -> (the form it reads, as the simulator counts it; the profile it gets)
KINDS = {
    "llamacpp": ("json_object_schema", "llamacpp"),
    "vllm": ("structured_outputs", "vllm"),
    "ollama": ("json_schema", "llamacpp"),
    "llama-cpp-python": ("json_object_schema", "llamacpp"),
}
DAYS = dg.DailyPartitionsDefinition(start_date="2026-11-01", end_date="2026-11-04")
DAY = "2026-11-02"
PER_DAY = 12
SENTIMENT = {
    "label": {"type": "enum", "values": ["positive", "negative", "neutral"]},
    "confidence": {"type": "number", "minimum": 0, "maximum": 1, "description": "0 to 1"},
}


@pytest.fixture(scope="module")
def ksim():
    with SimulatorProcess(api_key=SIM_KEY, latency_ms=2, latency_per_token_ms=0.01) as server:
        yield server


@pytest.fixture
def as_server(ksim):
    """The module's simulator answering as one kind of server, its counters zeroed."""

    def configure(kind, *, models=MODELS, served_model=None):
        ksim.configure(server_kind=kind, models=models, served_model=served_model)
        ksim.reset()
        return ksim

    yield configure
    ksim.configure(server_kind="simulator", models=MODELS, served_model=None)


@pytest.fixture
def db(tmp_path):
    path = str(tmp_path / "w.duckdb")
    create_demo_table(path, days=3, per_day=PER_DAY)
    return path


def materialize(llm, db):
    a = build(
        name="sentiment",
        source=SourceTable(
            table="news_headlines", partition_column="published_at", columns=["headline"]
        ),
        prompt=Prompt(system="You are a financial analyst.", template="Headline: {{ headline }}"),
        output="news_sentiment",
        params={"max_tokens": 80},
        partitions_def=DAYS,
        output_schema=SENTIMENT,
    )
    result = dg.materialize(
        [a],
        resources={"llm": llm, "warehouse": DuckDBWarehouse(database=db)},
        partition_key=DAY,
        raise_on_error=False,
    )
    mats = result.asset_materializations_for_node("sentiment")
    return result, ({k: v.value for k, v in mats[-1].metadata.items()} if mats else {})


# -- each kind, told apart with no setting ------------------------------------------------------
@pytest.mark.parametrize("kind", list(KINDS))
def test_each_server_is_told_apart_and_typed_rows_use_its_form(as_server, db, kind, caplog):
    sim = as_server(kind)
    assert not sim.url.endswith((":8000/v1", ":8080/v1", ":11434/v1"))
    llm = LLMResource(base_url=sim.url, api_key=SIM_KEY, model="gpt-4o-mini")
    with caplog.at_level(logging.INFO, logger=PROBE_LOG):
        result, md = materialize(llm, db)
    assert result.success and md["run/rows_ok"] == PER_DAY
    form, profile = KINDS[kind]
    stats = sim.stats()
    assert stats[f"form_{form}"] == PER_DAY and stats.get("form_ignored", 0) == 0
    rows = duckdb_query(db, "SELECT status, label, confidence FROM news_sentiment")
    assert len(rows) == PER_DAY
    assert all(s == "ok" and label in SENTIMENT["label"]["values"] for s, label, _ in rows)
    assert all(0 <= c <= 1 for _, _, c in rows)
    chosen = [r.getMessage() for r in caplog.records if r.name == PROBE_LOG]
    assert len(chosen) == 1 and f"is {kind} (" in chosen[0] and f"{profile} profile" in chosen[0]
    # Probed once, each route once, for the run.
    assert stats["probe_/v1/models"] == stats["probe_/props"] == stats["probe_/version"] == 1


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_profile_follows_what_the_server_is(as_server, kind):
    sim = as_server(kind)
    llm = LLMResource(base_url=sim.url, api_key=SIM_KEY, model="gpt-4o-mini")
    settings, structured = open_engine(llm)
    _, profile = KINDS[kind]
    assert llm.server_kind == kind and llm.profile.name == profile
    assert structured == {"vllm": "vllm", "ollama": "ollama"}.get(kind, "llamacpp")
    assert settings.max_concurrency == llm.profile.max_concurrency
    assert settings.request_timeout_s == llm.profile.request_timeout_s
    if kind == "vllm":  # its /v1/models says max_model_len
        assert settings.context_window == MODELS["gpt-4o-mini"]
    # The server's own window beats the table's for the name it was given.
    if kind == "llamacpp":  # /props says n_ctx
        sim = as_server(kind, models={"SmolLM2": 2048}, served_model="SmolLM2")
        settings, _ = open_engine(LLMResource(base_url=sim.url, model="gpt-4o-mini"))
        assert settings.context_window == 2048


def test_an_explicit_provider_skips_the_probe(as_server):
    sim = as_server("llamacpp")
    llm = LLMResource(base_url=sim.url, api_key=SIM_KEY, model="gpt-4o-mini", provider="vllm")
    settings, structured = open_engine(llm)
    stats = sim.stats()
    assert stats.get("probe_/props", 0) == stats.get("probe_/version", 0) == 0
    assert stats.get("probe_/api/version", 0) == 0
    assert llm.server_kind is None and structured == "vllm" and settings.max_concurrency == 64
    # Unset, the same server is asked, once per resource.
    llm = LLMResource(base_url=sim.url, api_key=SIM_KEY, model="gpt-4o-mini")
    open_engine(llm)
    open_engine(llm)
    stats = sim.stats()
    assert stats["probe_/props"] == stats["probe_/api/version"] == stats["probe_/version"] == 1
    assert llm.server_kind == "llamacpp"


# -- pricing follows what the server is, not its host -------------------------------------------
def test_a_self_hosted_profile_is_not_priced_whatever_its_host():
    for provider in ("llamacpp", "vllm", "ollama", "llama-cpp-python"):
        assert price_for("gpt-4o-mini", base_url="http://gpu-box:8080/v1", provider=provider) is (
            None
        )
    # A generic server elsewhere is still priced by the model it names.
    assert price_for("gpt-4o-mini", base_url="http://gpu-box:8080/v1", provider="generic")


def test_a_detected_server_on_another_host_is_not_priced(as_server, db):
    host = socket.gethostname()
    try:
        reachable = socket.gethostbyname(host) == "127.0.0.1"
    except OSError:
        reachable = False
    if not reachable or host in ("localhost",) or host.endswith(".localhost"):
        pytest.skip("needs a host name other than localhost that reaches 127.0.0.1")
    sim = as_server("llamacpp")
    url = sim.url.replace("127.0.0.1", host)
    result, md = materialize(LLMResource(base_url=url, api_key=SIM_KEY, model="gpt-4o-mini"), db)
    assert result.success and md["run/rows_ok"] == PER_DAY
    assert md["pricing"] == "pricing: not priced" and "run/cost_usd" not in md
    assert {c for (c,) in duckdb_query(db, "SELECT cost_usd FROM news_sentiment")} == {None}


# -- the served model -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama-cpp-python", "llamacpp", "vllm"])
def test_a_served_model_other_than_the_configured_one_is_warned_once(as_server, db, kind, caplog):
    # llama.cpp and llama-cpp-python answer under any name and echo it back; vLLM here holds
    # one model and names it in its answers.
    sim = as_server(
        kind, models={"SmolLM2-135M-Instruct": 2048}, served_model="SmolLM2-135M-Instruct"
    )
    llm = LLMResource(base_url=sim.url, api_key=SIM_KEY, model="gpt-4o-mini")
    with caplog.at_level(logging.WARNING):
        result, md = materialize(llm, db)
    assert result.success and md["run/rows_ok"] == PER_DAY
    said = [r.getMessage() for r in caplog.records if "SmolLM2-135M-Instruct" in r.getMessage()]
    assert len(said) == 1 and "'gpt-4o-mini'" in said[0]


def test_answers_naming_other_models_warn_once(caplog):
    logger = logging.getLogger("test_server_detect.served")
    seen = None
    with caplog.at_level(logging.WARNING, logger=logger.name):
        for answered in ("llama-3-8b", "qwen-2", "llama-3-8b", "qwen-2"):
            seen = served_model("gpt-4o-mini", answered, seen, logger)
    assert len(caplog.records) == 1 and "'llama-3-8b'" in caplog.records[0].getMessage()


# -- the README's self-hosted settings, against the simulator in each mode ------------------------
README = Path(__file__).resolve().parents[1] / "README.md"
README_KINDS = {
    "vLLM": "vllm",
    "llm-d": "vllm",
    "Ollama": "ollama",
    "llama.cpp": "llamacpp",
    "llama-cpp-python": "llama-cpp-python",
}


def readme_settings():
    """(server, kind, LLMResource keyword arguments) of each row of the README's table."""
    text = README.read_text()
    section = text.split("### Self-hosted servers", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or cells[0] not in README_KINDS:
            continue
        call = ast.parse("f(" + cells[1].strip("`").replace("`, `", ", ") + ")").body[0].value
        kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
        rows.append((cells[0], README_KINDS[cells[0]], kwargs))
    return rows


def test_the_readme_names_every_self_hosted_server():
    assert {server for server, _, _ in readme_settings()} == set(README_KINDS)


@pytest.mark.parametrize(
    "server, kind, kwargs", [pytest.param(*row, id=row[0]) for row in readme_settings()]
)
def test_the_readme_settings_work_against_each_server(as_server, server, kind, kwargs, caplog):
    model = kwargs["model"]
    served = f"{model}:latest" if kind == "ollama" else model  # Ollama lists name:tag
    sim = as_server(kind, models={served: 8192}, served_model=served)
    url = re.sub(r"^http://[^/]+", sim.root, kwargs["base_url"])
    llm = LLMResource(**(kwargs | {"base_url": url, "api_key": SIM_KEY}))
    spec = parse_output_schema(SENTIMENT)
    messages = [{"role": "user", "content": "Headline: rates rise"}]

    async def one():
        async with llm.engine() as engine:
            params, shaped = shape_request(
                llm.structured_kind, spec.json_schema(), messages, {"max_tokens": 80}
            )
            req = ChatRequest(1, shaped, params=params, validate=validator(spec.parse))
            return await engine.run_one(req)

    with caplog.at_level(logging.INFO, logger=PROBE_LOG):
        result = asyncio.run(one())
    assert result.ok, result.error_message
    assert llm.server_kind == kind and not probe_warnings(caplog)
    assert sim.stats().get("form_ignored", 0) == 0
