"""The project as Dagster's `dg` CLI sees it: definitions, lineage, kinds, pools, `make dev`.

`dg` runs as a subprocess in the project directory (and in tests/fixtures/dg_project, a dg
project over the component fixtures), exactly as a user runs it. Model prices are in
test_prices.py.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import dagster as dg
import psutil
import pytest
import yaml

from batch_llm_assets import DuckDBWarehouse, LLMResource
from batch_llm_assets.assets import (
    LlmBatchConfigError,
    Prompt,
    SourceTable,
    build_llm_batch_asset,
    source_table_spec,
)
from batch_llm_assets.demo import DEMO_POOL, INSTANCE_YAML
from batch_llm_assets.demo_data import create_demo_table

from .conftest import SIM_KEY

ROOT = Path(__file__).resolve().parent.parent
FIXTURE_PROJECT = ROOT / "tests" / "fixtures" / "dg_project"
DG = str(Path(sys.executable).with_name("dg"))


def run_dg(cwd: Path, *args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    home = tmp_path / "dagster_home"
    home.mkdir(exist_ok=True)
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "PYTHONPATH": os.pathsep.join([str(FIXTURE_PROJECT), str(ROOT)]),
        "BATCH_LLM_TEST_WEBHOOK": "https://hooks.example.invalid/services/T0/B0/secret",
        "BATCH_LLM_TEST_GROUP": "research",
    }
    proc = subprocess.run(
        [DG, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def assets_by_key(listing: str) -> dict[str, dict]:
    return {a["asset_key"]: a for a in json.loads(listing)["assets"]}


@pytest.mark.parametrize("project", [ROOT, FIXTURE_PROJECT], ids=["demo", "fixtures"])
def test_dg_check_defs_loads_the_project(project, tmp_path):
    out = run_dg(project, "check", "defs", tmp_path=tmp_path)
    assert "All definitions loaded successfully" in out.stdout + out.stderr


def test_one_code_location_name_everywhere():
    import tomllib

    from batch_llm_assets.definitions import CODE_LOCATION

    dg_name = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["dg"]["project"]
    cloud = yaml.safe_load((ROOT / "dagster_cloud.yaml").read_text())["locations"]
    assert dg_name["code_location_name"] == CODE_LOCATION == cloud[0]["location_name"]
    assert cloud[0]["code_source"]["module_name"] == dg_name["code_location_target_module"]


def test_dg_list_defs_shows_the_demo_lineage_and_kinds(tmp_path):
    listing = run_dg(ROOT, "list", "defs", "--json", tmp_path=tmp_path).stdout
    assets = assets_by_key(listing)
    llm, source = assets["headline_sentiment"], assets["news_headlines"]
    assert llm["dependency_keys"] == ["news_headlines"]  # the source table, upstream
    assert set(llm["kinds"]) == {"duckdb", "openai", "python"}
    assert source["kinds"] == ["duckdb"] and source["is_executable"] is False
    jobs = {j["name"] for j in json.loads(listing)["jobs"]}
    assert "headline_sentiment_job" in jobs


def test_dg_list_defs_of_the_fixtures(tmp_path):
    assets = assets_by_key(
        run_dg(FIXTURE_PROJECT, "list", "defs", "--json", tmp_path=tmp_path).stdout
    )
    assert assets["headline_sentiment"]["dependency_keys"] == ["news_headlines"]
    # A table per partition ("incoming.{partition_key}"): the dataset is the partitioned source.
    assert assets["research/incoming_sentiment"]["dependency_keys"] == ["incoming"]
    assert assets["incoming"]["kinds"] == ["duckdb"]


def test_the_asset_definition_records_what_is_known():
    from batch_llm_assets import definitions

    asset = definitions.headline_sentiment
    spec = asset.specs_by_key[asset.key]
    md = spec.metadata
    assert md["dagster/table_name"] == "news_sentiment"
    assert md["batch_llm/system_prompt"].startswith("You are a financial news analyst")
    assert md["batch_llm/params"].data == {"temperature": 0, "max_tokens": 24}
    assert "batch_llm/model" not in md  # the resource's: recorded per materialization
    types = {c.name: c.type for c in md["dagster/column_schema"].columns}
    assert types["cost_usd"] == "DOUBLE" and types["completed_at"] == "TIMESTAMPTZ"
    (source,) = [s for s in definitions.defs.assets or [] if isinstance(s, dg.AssetSpec)]
    assert source.metadata["dagster/table_name"] == "news_headlines"
    # Why (issue 28): no column schema on the source, an empty type icon on the output's id.
    source_types = {c.name: c.type for c in source.metadata["dagster/column_schema"].columns}
    assert source_types == {"id": "BIGINT", "published_at": "TIMESTAMPTZ", "headline": "VARCHAR"}
    assert types["id"] == "BIGINT"
    # One run per partition: a UI backfill of 4 partitions makes 4 runs, each green or red.
    assert asset.backfill_policy == dg.BackfillPolicy.multi_run(1)
    assert md["batch_llm/pool"] == "duckdb/demo" and md["batch_llm/resource_model"]
    assert {"batch_llm/rpm", "batch_llm/tpm"} <= set(md)


def test_pools_per_duckdb_file_and_provider_key_and_the_demo_instance_queues_runs():
    def build(**kw):
        return build_llm_batch_asset(
            name="s",
            source=SourceTable(table="news", partition_column="day", columns=["headline"]),
            prompt="{{ headline }}",
            output="out",
            **kw,
        )

    from batch_llm_assets import definitions

    assert definitions.headline_sentiment.op.pool == DEMO_POOL  # the limit make dev sets
    assert build().op.pool == "duckdb"
    bq = build(warehouse_kind="bigquery", provider="vllm")
    assert bq.op.pool == "llm/vllm" and "bigquery" in bq.specs_by_key[bq.key].kinds
    assert build(warehouse_kind="bigquery", pool="openai/team-key").op.pool == "openai/team-key"
    assert build().backfill_policy == dg.BackfillPolicy.multi_run(1)  # one run per partition
    assert build(partitions_per_run=None).backfill_policy == dg.BackfillPolicy.single_run()
    # The demo instance enforces pools per run: a queued run starts when its pool has a slot.
    with dg.instance_for_test(overrides=yaml.safe_load(INSTANCE_YAML)) as instance:
        config = instance.get_concurrency_config().pool_config
        assert config.pool_granularity.value == "run" and config.default_pool_limit == 1


def test_source_table_spec_for_a_python_built_asset():
    asset = build_llm_batch_asset(
        name="s",
        source=SourceTable(table="research.news", partition_column="day", columns=["headline"]),
        prompt=Prompt(template="{{ headline }}"),
        output="research.out",
        warehouse_kind="bigquery",
    )
    source = source_table_spec(asset)
    assert source.key in asset.dependency_keys
    assert source.key == dg.AssetKey(["research", "news"]) and source.kinds == {"bigquery"}
    defs = dg.Definitions(
        assets=[source, asset],
        resources={"llm": LLMResource(), "warehouse": DuckDBWarehouse(database=":memory:")},
    )
    assert defs.get_repository_def().asset_graph.get(asset.key).parent_keys == {source.key}


def test_the_builder_names_the_setting_like_the_component():
    with pytest.raises(LlmBatchConfigError, match=r"^prompt\.template: unknown column 'body'"):
        build_llm_batch_asset(
            name="s",
            source=SourceTable(table="news", partition_column="day", columns=["headline"]),
            prompt="{{ body }}",
            output="out",
        )
    with pytest.raises(LlmBatchConfigError, match=r"^params\.temperature: must be within"):
        build_llm_batch_asset(
            name="s",
            source=SourceTable(table="news", partition_column="day", columns=["headline"]),
            prompt="{{ headline }}",
            output="out",
            params={"temperature": 9},
        )


# --- make dev ----------------------------------------------------------------------------------


@pytest.mark.reliability
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_make_dev_stops_every_child_on_a_signal(signum, tmp_path):
    """`make dev` (demo.py dev): the webserver, the daemon, code servers, the simulator and
    Valkey all end when the demo is stopped."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "BATCH_LLM_DEMO_DIR": str(tmp_path / "demo")}
    demo = psutil.Popen(
        [sys.executable, "-m", "batch_llm_assets.demo", "dev", "--port", str(port)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        # SIGINT as a terminal's foreground job has it: a suite started in the background by a
        # non-interactive shell inherits SIGINT ignored, and Python then leaves it ignored.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:  # up when the webserver answers
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=2):
                    break
            except OSError:
                assert demo.poll() is None, "the demo exited while starting"
                time.sleep(1)
        else:
            pytest.fail("dg dev did not start")
        children = demo.children(recursive=True)
        names = " ".join(" ".join(c.cmdline()) for c in children)
        assert "/dg dev" in names and "cli sim" in names  # what must be stopped
        assert "--location-name batch-llm-assets" in names
        demo.send_signal(signum)
        # A guard against a hang, not a timing: on a busy host dg dev's children (webserver,
        # daemon, code server) took over 60 s to shut down.
        assert demo.wait(180) == 0
        _, alive = psutil.wait_procs(children, timeout=15)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        for p in [demo, *demo.children(recursive=True)] if demo.is_running() else []:
            p.kill()


@pytest.mark.reliability
def test_a_backfill_queues_on_the_duckdb_pool(fresh_sim, tmp_path):
    """Three partitions through the daemon's run queue, with the demo's instance config and the
    pool's limit set by the operator step: the runs never overlap and all succeed."""
    sim = fresh_sim  # the shared simulator reset: an earlier test may have left a fault set
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text(INSTANCE_YAML)
    db = str(tmp_path / "w.duckdb")
    create_demo_table(db, days=3, per_day=20)
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "PYTHONPATH": str(ROOT),
        "BATCH_LLM_BASE_URL": sim.url,
        "OPENAI_API_KEY": SIM_KEY,
        "BATCH_LLM_DUCKDB": db,
    }
    bin_dir = Path(sys.executable).parent
    target = ["-m", "tests.fixtures.pool_defs"]

    def cli(*args: str) -> None:
        proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]

    cli(str(bin_dir / "dagster"), "instance", "concurrency", "set", "duckdb/pool-test", "1")
    cli(
        str(bin_dir / "dagster"),
        "job",
        "backfill",
        *target,
        "-j",
        "pooled_sentiment_job",
        "--from",
        "2026-11-01",
        "--to",
        "2026-11-03",
        "--noprompt",
    )
    daemon = subprocess.Popen(
        [str(bin_dir / "dagster-daemon"), "run", *target],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        with dg.DagsterInstance.from_config(str(home)) as instance:
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                records = instance.get_run_records()
                done = [r for r in records if r.dagster_run.status.value in ("SUCCESS", "FAILURE")]
                if len(records) == 3 and len(done) == 3:
                    break
                time.sleep(2)
            records = sorted(instance.get_run_records(), key=lambda r: r.start_time or 0)
    finally:
        os.killpg(daemon.pid, signal.SIGTERM)
        daemon.wait(30)
    assert [r.dagster_run.status.value for r in records] == ["SUCCESS"] * 3
    for earlier, later in itertools.pairwise(records):
        assert later.start_time >= earlier.end_time  # queued until the pool's slot was free


def test_dg_launch_of_a_demo_partition_records_its_limits_and_simulated_cost(fresh_sim, tmp_path):
    """The demo asset, one run per partition: its own figures, the configured limits and the
    fractions used, and a cost priced as the model the simulator stands in for. The dg output
    has no "virtual environment does not match" warning when the venv is named (make dev)."""
    from batch_llm_assets.demo import _venv_env

    sim = fresh_sim  # the shared simulator reset: an earlier test may have left a fault set
    db = str(tmp_path / "w.duckdb")
    create_demo_table(db, days=2, per_day=10)
    extra = {
        "BATCH_LLM_BASE_URL": sim.url,
        "OPENAI_API_KEY": SIM_KEY,
        "BATCH_LLM_DUCKDB": db,
        "BATCH_LLM_PRICE_AS_MODEL": "gpt-4o-mini",
        "BATCH_LLM_TPM": "1000000",
        **_venv_env(),
    }
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)  # run_dg passes os.environ on
    try:
        args = ("launch", "--assets", "headline_sentiment", "--partition", "2026-11-02")
        proc = run_dg(ROOT, *args, tmp_path=tmp_path)
    finally:
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
    assert "does not match" not in proc.stderr + proc.stdout
    with dg.DagsterInstance.from_config(str(tmp_path / "dagster_home")) as instance:
        key = dg.AssetKey("headline_sentiment")
        (record,) = instance.fetch_materializations(key, limit=10).records
        md = {k: v.value for k, v in record.asset_materialization.metadata.items()}
    assert record.partition_key == "2026-11-02"
    assert md["partition/rows_input"] == md["run/rows_ok"] == 10
    assert md["pricing"] == "pricing: simulated at gpt-4o-mini list prices"
    assert md["run/cost_usd"] > 0 and md["cost_usd_to_date"] == md["partition/cost_usd"]
    assert 0 < md["run/tpm_used_fraction"] < 1


def test_the_demo_takes_every_llm_setting_from_the_environment():
    from batch_llm_assets.definitions import LLM_ENV, llm_settings

    env = {
        "BATCH_LLM_CONTEXT_WINDOW": "8192",
        "BATCH_LLM_MAX_CONCURRENCY": "4",
        "BATCH_LLM_REQUEST_TIMEOUT_S": "12.5",
        "BATCH_LLM_PRICE_INPUT_PER_1M": "0.1",
        "BATCH_LLM_PRICE_OUTPUT_PER_1M": "0.2",
        "BATCH_LLM_PRICE_CACHED_INPUT_PER_1M": "0.05",
    }
    settings = llm_settings(env)
    assert (settings["context_window"], settings["max_concurrency"]) == (8192, 4)
    assert settings["request_timeout_s"] == 12.5 and settings["price_cached_input_per_1m"] == 0.05
    assert settings["api_key"] == "" and "redis_url" not in settings  # a local server: none
    LLMResource(**settings)  # all of them are LLMResource fields
    assert {"BATCH_LLM_PROVIDER", "BATCH_LLM_CONTEXT_WINDOW"} <= set(LLM_ENV)
    with pytest.raises(ValueError, match="BATCH_LLM_TPM must be an integer"):
        llm_settings({"BATCH_LLM_TPM": "lots"})
