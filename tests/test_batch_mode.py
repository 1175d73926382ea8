"""Batch mode (issue 13): the Batch API path against the simulator's /v1/files and /v1/batches
with DuckDB files, counted at the simulator: a partition written at half price, the lease, typed
outputs, the per-file and enqueued-token limits, the Azure URL form, a wrong key, the YAML
component, and the import boundary. Its fixtures and helpers (bsim, batch_config, a kill while
polling in a real `dagster asset materialize` subprocess) serve the other batch modules too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request

import dagster as dg
import pytest

from batch_llm_assets import (
    DuckDBWarehouse,
    LLMResource,
    Prompt,
    SourceTable,
    build_llm_batch_asset,
)
from batch_llm_assets.assets.batch_mode import BatchSettings, state_table_for
from batch_llm_assets.demo_data import create_demo_table
from batch_llm_assets.engine.identity import legacy_scope

from .conftest import SIM_KEY
from .conftest import duckdb_query as query
from .test_component import load_attributes  # noqa: F401  (fixture)

DAYS = dg.DailyPartitionsDefinition(start_date="2026-11-01", end_date="2026-11-04")
PROMPT = Prompt(
    template="Headline: {{ headline }}\nAnswer with one of: positive, negative, neutral"
)
PER_DAY = 30
STATE = state_table_for("news_sentiment")


def asset(**settings):
    return build_llm_batch_asset(
        name="sentiment",
        source=SourceTable(
            table="news_headlines", partition_column="published_at", columns=["headline"]
        ),
        prompt=PROMPT,
        output="news_sentiment",
        params={"max_tokens": 5},
        partitions_def=DAYS,
        mode="batch",
        batch=BatchSettings(**({"poll_first_s": 0.2, "poll_max_s": 0.5} | settings)),
    )


@pytest.fixture
def db(tmp_path):
    path = str(tmp_path / "w.duckdb")
    create_demo_table(path, days=3, per_day=PER_DAY)
    return path


@pytest.fixture
def bsim(fresh_sim):
    """The shared simulator with default batch settings (a batch takes 0.5 s)."""
    batch_config(
        fresh_sim,
        completion_s=0.5,
        line_fail=0.0,
        expire_fraction=None,
        enqueued_token_limit=None,
        max_file_requests=50_000,
    )
    return fresh_sim


def batch_config(sim, **settings):
    req = urllib.request.Request(
        sim.root + "/admin/batch_config", data=json.dumps(settings).encode(), method="POST"
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert json.loads(resp.read())["ok"]


def resources(sim, db):
    return {
        # Priced at gpt-4o-mini's live list price: the simulator is local, which costs 0.
        "llm": LLMResource(
            base_url=sim.url,
            api_key=SIM_KEY,
            model="gpt-4o-mini",
            price_input_per_1m=0.15,
            price_output_per_1m=0.6,
        ),
        "warehouse": DuckDBWarehouse(database=db),
    }


def materialize(a, sim, db, key="2026-11-01"):
    return dg.materialize(
        [a], resources=resources(sim, db), partition_key=key, raise_on_error=False
    )


def metadata(result):
    mats = result.asset_materializations_for_node("sentiment")
    return {k: v.value for k, v in mats[-1].metadata.items()}


def statuses(db, key="2026-11-01"):
    return dict(
        query(
            db,
            "SELECT status, count(*) FROM news_sentiment "
            f"WHERE partition_key = '{key}' GROUP BY status",
        )
    )


def test_batch_partition_is_written_at_half_price_and_rerun_sends_nothing(bsim, db):
    result = materialize(asset(), bsim, db)
    assert result.success
    md = metadata(result)
    assert statuses(db) == {"ok": PER_DAY}
    stats = bsim.stats()
    assert stats["batches_created"] == 1 and stats["batch_lines_submitted"] == PER_DAY
    assert stats.get("received", 0) == 0  # nothing went through the live route
    assert md["mode"] == "batch" and len(md["batch_ids"]) == 1
    # Batch price: half of the live price for the same tokens (gpt-4o-mini: 0.15 / 0.60 per 1M).
    [(cost, pt, ct)] = query(
        db, "SELECT sum(cost_usd), sum(prompt_tokens), sum(completion_tokens) FROM news_sentiment"
    )
    assert cost == pytest.approx((pt * 0.15 + ct * 0.60) / 1e6 * 0.5)
    again = materialize(asset(), bsim, db)
    assert again.success and metadata(again)["run/rows_skipped"] == PER_DAY
    assert bsim.stats()["batches_created"] == 1


def test_a_first_run_looks_up_no_done_rows_and_a_rerun_does(bsim, db, monkeypatch):
    """Each skip-done lookup is a query (a BigQuery job): a partition without output rows has
    nothing to skip, so its first run makes none. Counted on the real DuckDB session."""
    from batch_llm_assets.warehouses.duckdb_session import DuckDBSession

    lookups = []
    real = DuckDBSession.done_hashes

    def counted(self, *args, **kwargs):
        lookups.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(DuckDBSession, "done_hashes", counted)
    assert materialize(asset(), bsim, db).success
    assert lookups == []
    assert materialize(asset(), bsim, db, key="2026-11-02").success  # another partition
    assert lookups == []
    again = materialize(asset(), bsim, db)
    assert again.success and metadata(again)["run/rows_skipped"] == PER_DAY
    assert lookups  # rows exist now: the rerun looks them up and skips them


def test_a_second_run_of_a_batch_partition_is_refused_before_submitting(bsim, db):
    """Batch mode takes the live mode's partition lease: while another run holds the partition,
    a run fails at once naming it, and submits nothing (counted at the simulator)."""
    from batch_llm_assets.assets.journal import default_journal_dir, journal_key
    from batch_llm_assets.assets.lease import partition_lease

    name = journal_key(f"duckdb:{os.path.abspath(db)}|news_sentiment", "2026-11-01")
    with partition_lease(
        name=name,
        label="partition 2026-11-01 (held by the test)",
        run_id="the-first-run",
        lock_dir=default_journal_dir(),
        redis_url=None,
    ):
        result = materialize(asset(), bsim, db)
    assert not result.success
    [failure] = result.get_step_failure_events()
    assert "the-first-run" in str(failure.event_specific_data.error)
    stats = bsim.stats()
    assert stats.get("batches_created", 0) == 0 and stats.get("files_uploaded", 0) == 0
    assert materialize(asset(), bsim, db).success  # once the holder is gone


def test_typed_outputs_in_batch_mode_fill_typed_columns(bsim, db):
    """Structured outputs apply unchanged in batch mode: the JSONL bodies ask for the schema, each
    output line is validated, each field gets its typed column; an invalid line fails
    invalid_output (a batch has no repair turn)."""
    schema = {"label": {"type": "enum", "values": ["up", "down"]}, "score": "number"}
    typed = build_llm_batch_asset(
        name="sentiment",
        source=SourceTable(
            table="news_headlines", partition_column="published_at", columns=["headline"]
        ),
        prompt=PROMPT,
        output="news_sentiment",
        params={"max_tokens": 64},
        output_schema=schema,
        max_failed_fraction=1.0,
        partitions_def=DAYS,
        mode="batch",
        batch=BatchSettings(poll_first_s=0.2, poll_max_s=0.5),
    )
    bsim.configure(invalid_json=0.2)
    assert materialize(typed, bsim, db).success
    bsim.configure(invalid_json=0.0)
    rows = query(db, "SELECT status, error_class, label, score FROM news_sentiment")
    assert len(rows) == PER_DAY and bsim.stats()["batches_created"] == 1
    ok = [r for r in rows if r[0] == "ok"]
    bad = [r for r in rows if r[0] != "ok"]
    assert ok and all(r[2] in ("up", "down") and isinstance(r[3], float) for r in ok)
    assert bad and {(r[1], r[2], r[3]) for r in bad} == {("invalid_output", None, None)}


def kill_while_polling_then_rerun(sim, cmd, env) -> None:
    """Run `cmd` until its batch is submitted and polled, SIGKILL it, let the provider finish
    the batch, run `cmd` again to its end."""
    batch_config(sim, completion_s=120.0)  # the batch stays in progress while the run polls
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.time() + 120
    while sim.stats().get("batches_retrieved", 0) < 2:  # submitted, and polling
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert sim.stats()["batches_created"] == 1
    batch_config(sim, completion_s=0.5)  # the provider finishes the batch meanwhile
    final = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert final.returncode == 0, final.stderr[-2000:]


def test_a_template_that_fails_every_row_submits_nothing(bsim, db):
    a = build_llm_batch_asset(
        name="sentiment",
        source=SourceTable(
            table="news_headlines", partition_column="published_at", columns=["headline"]
        ),
        prompt=Prompt(template="{{ headline * 20000000 }}"),
        output="news_sentiment",
        partitions_def=DAYS,
        mode="batch",
        batch=BatchSettings(poll_first_s=0.2, poll_max_s=0.5),
    )
    result = materialize(a, bsim, db)
    assert not result.success
    text = result.get_step_failure_events()[0].step_failure_data.error.message
    assert "template failed on 10 consecutive rows with prompt_too_large" in text
    assert bsim.stats().get("files_uploaded", 0) == 0
    assert query(db, "SELECT count(*), min(error_class) FROM news_sentiment") == [
        (10, "prompt_too_large")
    ]


def test_rows_stored_under_the_earlier_identity_are_not_submitted_again(bsim, db, monkeypatch):
    import batch_llm_assets.assets.pipeline as pipeline

    def earlier(base_url, api_version=None, **_):
        return legacy_scope(base_url, api_version), legacy_scope(base_url, api_version)

    with monkeypatch.context() as m:
        m.setattr(pipeline, "identity_scopes", earlier)
        assert materialize(asset(), bsim, db).success
    md = metadata(materialize(asset(), bsim, db))
    assert (md["run/rows_sent"], md["run/rows_skipped"]) == (0, PER_DAY)
    assert bsim.stats()["batch_lines_submitted"] == PER_DAY


def test_rows_are_split_into_files_within_the_per_file_limit(bsim, db):
    result = materialize(asset(max_file_requests=8), bsim, db)
    assert result.success
    stats = bsim.stats()
    assert stats["files_uploaded"] == stats["batches_created"] == 4  # 8 + 8 + 8 + 6
    assert len(metadata(result)["batch_ids"]) == 4
    assert statuses(db) == {"ok": PER_DAY}


def test_enqueued_token_limit_queues_submissions_instead_of_being_refused(bsim, db):
    limit = 500
    batch_config(bsim, enqueued_token_limit=limit)  # the provider refuses anything over it
    result = materialize(asset(enqueued_token_limit=limit), bsim, db)
    assert result.success
    stats = bsim.stats()
    assert stats["batches_created"] >= 2 and stats.get("batches_rejected", 0) == 0
    assert statuses(db) == {"ok": PER_DAY}
    tokens = query(db, f"SELECT max(tokens) FROM {STATE}")[0][0]
    assert tokens <= limit


def test_yaml_component_declares_batch_mode_and_its_completion_sensor(load_attributes):  # noqa: F811
    from .test_component import GOOD, error_text

    defs = load_attributes(GOOD | {"mode": "batch", "batch": {"wait": False}})
    [a] = [x for x in defs.assets or [] if isinstance(x, dg.AssetsDefinition)]
    assert a.metadata_by_key[a.key]["batch_llm/mode"] == "batch"
    assert [s.name for s in defs.sensors or []] == ["headline_sentiment_batch_completion"]
    waiting = load_attributes(GOOD | {"mode": "batch"})
    assert not waiting.sensors  # the run itself waits: no sensor needed
    bad = _config_error(load_attributes, {"batch": {"max_file_requests": 0}})
    assert bad.startswith("batch: batch max_file_requests must be > 0"), bad
    # A wrong shape is refused by Dagster's own schema check, which names the attribute.
    with pytest.raises(Exception) as info:
        load_attributes(GOOD | {"mode": "offline"})
    text = error_text(info.value)
    assert "mode" in text and "Input should be" in text, text


def _config_error(load, change):
    from batch_llm_assets.components import LlmBatchConfigError

    from .test_component import GOOD

    with pytest.raises(Exception) as info:
        load(GOOD | {"mode": "batch"} | change)
    exc: BaseException | None = info.value
    while exc is not None and not isinstance(exc, LlmBatchConfigError):
        exc = exc.__cause__ or exc.__context__
    assert exc is not None, f"no LlmBatchConfigError behind {info.value!r}"
    return exc.description


def test_split_files_keeps_each_file_within_requests_bytes_and_tokens():
    from batch_llm_assets.engine.batch_api import BatchAPIError, BatchLine, split_files

    lines = [BatchLine(f"r{i}", {"messages": [{"content": "x" * (10 * i)}]}, 10) for i in range(40)]
    sizes = [len(line.encode()) for line in lines]
    for limits in ({"max_requests": 7}, {"max_bytes": 4 * max(sizes)}, {"max_tokens": 55}):
        files = list(split_files(lines, **({"max_requests": 1000, "max_bytes": 10**9} | limits)))
        assert [line for f in files for line, _ in f] == lines  # all of them, in order, once
        assert len(files) > 1
        for f in files:
            assert len(f) <= limits.get("max_requests", 1000)
            assert sum(len(data) for _, data in f) <= limits.get("max_bytes", 10**9)
            assert sum(line.tokens for line, _ in f) <= limits.get("max_tokens", 10**9)
    with pytest.raises(BatchAPIError, match="over the per-file limit"):
        list(split_files(lines, max_bytes=min(sizes) - 1))


def test_azure_url_form_reaches_the_batch_routes(bsim, db):
    res = resources(bsim, db)
    res["llm"] = LLMResource(
        base_url=bsim.root, api_key=SIM_KEY, model="gpt-4o-mini", api_version="2024-10-21"
    )
    assert dg.materialize([asset()], resources=res, partition_key="2026-11-01").success
    assert statuses(db) == {"ok": PER_DAY}
    assert bsim.stats()["batches_created"] == 1


def test_a_wrong_key_fails_the_run_without_the_key_in_the_message(bsim, db):
    res = resources(bsim, db)
    res["llm"] = LLMResource(base_url=bsim.url, api_key="sk-wrong-0123456789", model="gpt-4o-mini")
    result = dg.materialize(
        [asset()], resources=res, partition_key="2026-11-01", raise_on_error=False
    )
    assert not result.success
    [failure] = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    text = str(failure.event_specific_data.error.message)
    assert "Incorrect API key" in text and "0123456789" not in text
    assert bsim.stats().get("batches_created", 0) == 0


def test_the_batch_client_and_the_simulator_batch_routes_import_no_dagster():
    """ARCHITECTURE.md: engine/ is a plain async library; simulator/ imports only token counting."""
    import ast
    from pathlib import Path

    import batch_llm_assets

    root = Path(batch_llm_assets.__file__).parent
    allowed = {
        "engine/batch_api.py": {"errors", "transport", "requests"},
        "simulator/batch.py": {"engine.tokens", "server", "structured", "content", "embeddings"},
    }
    for rel, ours in allowed.items():
        for node in ast.walk(ast.parse((root / rel).read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.module in ours, f"{rel} imports {'.' * node.level}{node.module}"
            if isinstance(node, ast.Import | ast.ImportFrom) and not getattr(node, "level", 0):
                names = [getattr(node, "module", None) or "", *(a.name for a in node.names)]
                assert not any(n.startswith("dagster") for n in names), rel
