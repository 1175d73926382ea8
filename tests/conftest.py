"""Real servers for the tests: embedded Valkey (and REDIS_URL when set), the simulator process."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import duckdb
import pytest
import redis

_TIKTOKEN = Path(__file__).resolve().parents[2] / "shared" / "tiktoken"
if _TIKTOKEN.is_dir():
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(_TIKTOKEN))

from batch_llm_assets.engine import EmbeddedValkey  # noqa: E402
from batch_llm_assets.simulator import SimulatorProcess  # noqa: E402

SIM_KEY = "sk-sim-test-0123456789abcdef"


@pytest.fixture(autouse=True, scope="session")
def journal_dir(tmp_path_factory):
    """Result journals of killed runs stay inside this test session."""
    path = tmp_path_factory.mktemp("journal")
    os.environ["BATCH_LLM_JOURNAL_DIR"] = str(path)
    return path


@pytest.fixture(scope="session")
def valkey_url():
    with EmbeddedValkey() as server:
        yield server.url


def _worker_redis_url(url: str | None) -> str | None:
    """Under pytest-xdist each worker takes its own database of REDIS_URL's server (15, 14, ...):
    two workers' leases and limiter keys never meet, as two CI machines' would not."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not url or not worker.startswith("gw"):
        return url
    base, _, db = url.rpartition("/")
    first = int(db) if db.isdigit() else 15
    return f"{base}/{(first - int(worker[2:])) % 16}"


if os.environ.get("REDIS_URL"):
    os.environ["REDIS_URL"] = _worker_redis_url(os.environ["REDIS_URL"]) or ""

_REDIS_SERVERS = ["valkey"] + (["redis"] if os.environ.get("REDIS_URL") else [])


@pytest.fixture(scope="session", params=_REDIS_SERVERS)
def redis_url(request, valkey_url):
    """Every limiter test runs on the embedded Valkey, and on REDIS_URL's server when it is set."""
    return valkey_url if request.param == "valkey" else os.environ["REDIS_URL"]


@pytest.fixture
def fresh_limiter_state(valkey_url):
    """For modules whose tests all use the one simulator, so one limiter namespace: each test
    starts it empty (in xdist's order a test may follow one that reserved slots a minute ahead,
    paused the key or learned a lower rate)."""
    r = redis.Redis.from_url(valkey_url)
    try:
        for key in r.scan_iter("bla:*"):
            r.delete(key)
    finally:
        r.close()


@pytest.fixture
def first_grant(monkeypatch):
    """The first grant of any limiter in the test, once it has one (a list of at most one). A
    new state's epoch is the server's time in ms (limiter.lua): tests read epochs against it."""
    from batch_llm_assets.engine import RedisLimiter

    first: list = []
    acquire = RedisLimiter.acquire

    async def spied(self, *args, **kw):
        grant = await acquire(self, *args, **kw)
        first[:] = first or [grant]
        return grant

    monkeypatch.setattr(RedisLimiter, "acquire", spied)
    return first


@pytest.fixture
def namespace():
    """A fresh limiter namespace per test, so tests never see each other's state."""
    return f"test:{{{uuid.uuid4().hex[:12]}}}"


@pytest.fixture(scope="session")
def sim():
    """One simulator process for the session; tests set what they need and reset it."""
    with SimulatorProcess(api_key=SIM_KEY, latency_ms=5, latency_per_token_ms=0.05) as server:
        yield server


@pytest.fixture
def fresh_sim(sim):
    """The shared simulator with default settings and zeroed counters."""
    sim.configure(
        rpm=None,
        tpm=None,
        fail_500=0.0,
        fail_503=0.0,
        hang=0.0,
        malformed=0.0,
        drop=0.0,
        latency_ms=5.0,
        latency_per_token_ms=0.05,
        jitter=0.2,
        bucket_s=1.0,
        api_key=SIM_KEY,
        answer_null_content=0.0,
        answer_refusal=0.0,
        answer_content_filter=0.0,
        answer_length=0.0,
        answer_tool_calls=0.0,
        answer_empty_choices=0.0,
        key_echo=None,
        fail_400_key_echo=0.0,
        fail_marker=None,
        fail_429_every=0,
        surrogate_every=0,
        enforcement="bucket",
        window_s=10.0,
        quantum_s=1.0,
        counting="tiktoken",
        count_noise=0.0,
        usage_shape="openai",
        retry_after="both",
        limit_header="per_minute",
        rate_headers=True,
        reasoning=False,
        insufficient_quota=False,
        fail_param=None,
        typed_mode="obeys",
        models={"sim-1": 16_384, "gpt-4o-mini": 128_000},
        server_kind="simulator",
        served_model=None,
        decode_slots=0,
        decode_slowdown=0.0,
        flex_unavailable=0.0,
        embedding_max_inputs=2048,
        embedding_max_input_tokens=8192,
        embedding_max_request_tokens=300_000,
    )
    sim.reset()
    return sim


_SUBPROCESS_DEFS = """
import dagster as dg
from batch_llm_assets import DuckDBWarehouse, LLMResource, Prompt, SourceTable, build_llm_batch_asset

sentiment = build_llm_batch_asset(
    name="sentiment",
    source=SourceTable(table="news_headlines", partition_column="published_at", columns=["headline"]),
    prompt=Prompt(template="{{{{ headline }}}} Answer with one of: up, down"),
    output="news_sentiment",
    partitions_def=dg.DailyPartitionsDefinition(start_date="2026-11-01", end_date="2026-11-04"),
    chunk_rows={chunk_rows},
)
defs = dg.Definitions(assets=[sentiment], resources={{
    "llm": LLMResource(base_url="{url}", api_key="{key}", model="gpt-4o-mini",
                       max_concurrency={max_concurrency}),
    "warehouse": DuckDBWarehouse(database="{db}"),
}}, executor=dg.in_process_executor)  # the run in the CLI's process: one start-up, not two
"""


def materialize_command(tmp_path, sim, db, *, chunk_rows, max_concurrency):
    """A `dagster asset materialize` of partition 2026-11-01 of news_headlines -> news_sentiment,
    as a real subprocess would run it (its own code file and DAGSTER_HOME): (argv, env)."""
    defs = tmp_path / "defs.py"
    defs.write_text(
        _SUBPROCESS_DEFS.format(
            url=sim.url, key=SIM_KEY, db=db, chunk_rows=chunk_rows, max_concurrency=max_concurrency
        )
    )
    return materialize_argv(defs, tmp_path / "home", select="sentiment", partition="2026-11-01")


def materialize_argv(defs, home, *, select: str, partition: str):
    """`dagster asset materialize` of one partition of `select` from the code file `defs`, in a
    DAGSTER_HOME of its own (`home`, made here), as a real subprocess runs it: (argv, env)."""
    home.mkdir(exist_ok=True)
    argv = [sys.executable, "-m", "dagster", "asset", "materialize", "-f", str(defs)]
    argv += ["--select", select, "--partition", partition]
    return argv, {**os.environ, "DAGSTER_HOME": str(home)}


def duckdb_query(db: str, sql: str) -> list[tuple]:
    """Rows of a query on a DuckDB file, read-only, the connection closed again."""
    con = duckdb.connect(db, read_only=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def create_distinct_table(path: str, **kw) -> int:
    """The demo table (demo_data.create_demo_table) with every headline made distinct: each row
    is then a request of its own, where the demo's repeated headlines would be sent once
    (tests/test_sharing.py)."""
    from batch_llm_assets.demo_data import create_demo_table

    n = create_demo_table(path, **kw)
    con = duckdb.connect(path)
    try:
        con.execute(
            f"UPDATE \"{kw.get('table', 'news_headlines')}\" SET headline = headline || ' #' || id"
        )
    finally:
        con.close()
    return n
