"""`make demo` and `make dev`: the demo asset on embedded defaults, end to end.

python -m batch_llm_assets.demo run [--partitions 3]   # materialise each partition with `dg launch`
python -m batch_llm_assets.demo dev                    # the same code location in `dg dev`

The Dagster instance lives under .demo/dagster_home (BATCH_LLM_DEMO_DIR moves .demo); its
dagster.yaml queues runs on concurrency pools (limit 1 each), so a backfill from the UI waits
for the DuckDB file instead of failing on its lock.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from datetime import date, timedelta
from pathlib import Path

from .demo_data import DEMO_START, create_demo_table
from .engine.valkey import EmbeddedValkey
from .simulator import SimulatorProcess

DEMO_DIR = Path(os.environ.get("BATCH_LLM_DEMO_DIR", ".demo"))
PROJECT_DIR = Path(__file__).resolve().parent.parent  # where pyproject.toml's [tool.dg] is
# Pools enforced per run: a queued run starts only when its pool has a free slot.
INSTANCE_YAML = """\
concurrency:
  pools:
    granularity: run
    default_limit: 1
telemetry:
  enabled: false
"""
STOP_GRACE_S = 10.0
DEMO_POOL = "duckdb/demo"  # the demo asset's pool (defs/headline_sentiment/defs.yaml)
ASSET = "headline_sentiment"
EMBED_ASSET = "headline_embeddings"  # defs/headline_embeddings: `make demo` embeds one partition
# The README's similarity query: the two closest distinct headlines of a partition.
CLOSEST_SQL = """
SELECT ha.headline, hb.headline, list_cosine_similarity(a.embedding, b.embedding) AS cosine
FROM news_embeddings a JOIN news_embeddings b
  ON a.partition_key = b.partition_key AND a.id < b.id
JOIN news_headlines ha ON ha.id = a.id JOIN news_headlines hb ON hb.id = b.id
WHERE a.partition_key = ? AND ha.headline <> hb.headline
ORDER BY cosine DESC LIMIT 1
"""
# The simulator plays a provider key with these limits; the resource is told the same.
DEMO_RPM = 3000
DEMO_TPM = 120_000


def _env(sim: SimulatorProcess, valkey: EmbeddedValkey) -> dict[str, str]:
    home = DEMO_DIR / "dagster_home"
    home.mkdir(parents=True, exist_ok=True)
    (home / "dagster.yaml").write_text(INSTANCE_YAML)  # local storage under .demo/
    return {
        **os.environ,
        "DAGSTER_HOME": str(home.resolve()),
        "BATCH_LLM_BASE_URL": sim.url,
        "BATCH_LLM_RPM": str(DEMO_RPM),
        "BATCH_LLM_TPM": str(DEMO_TPM),
        # The simulator stands in for the model the demo names: show what the run would cost.
        "BATCH_LLM_PRICE_AS_MODEL": os.environ.get("BATCH_LLM_PRICE_AS_MODEL") or "gpt-4o-mini",
        "BATCH_LLM_DUCKDB": str((DEMO_DIR / "warehouse.duckdb").resolve()),
        "REDIS_URL": valkey.url,
        **_venv_env(),
    }


def _venv_env() -> dict[str, str]:
    """`make dev` runs the venv's Python without activating the venv; dg then warns on every
    command that the active venv (none) is not the project's. Name the one we run in."""
    if sys.prefix == sys.base_prefix:
        return {}
    bin_dir = str(Path(sys.executable).parent)
    return {"VIRTUAL_ENV": sys.prefix, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}


def _prepare() -> None:
    DEMO_DIR.mkdir(exist_ok=True)
    rows = create_demo_table(str(DEMO_DIR / "warehouse.duckdb"))
    print(f"dataset: {rows} synthetic headlines in {DEMO_DIR / 'warehouse.duckdb'}", flush=True)


def _latest_metadata(partition: str, asset: str = ASSET) -> dict[str, float | int | str]:
    import dagster as dg

    instance = dg.DagsterInstance.get()
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), asset_partitions=[partition]), limit=1
    ).records
    if not records:
        return {}
    md = records[0].asset_materialization.metadata  # type: ignore[union-attr]
    return {k: v.value for k, v in md.items() if isinstance(v.value, int | float | str)}


def run(partitions: int) -> int:
    _prepare()
    keys = [
        (date.fromisoformat(DEMO_START) + timedelta(days=i)).isoformat() for i in range(partitions)
    ]
    summary = []
    with (
        SimulatorProcess(rpm=DEMO_RPM, tpm=DEMO_TPM, latency_ms=40) as sim,
        EmbeddedValkey() as valkey,
    ):
        env = _env(sim, valkey)
        for key in keys:
            before = sim.stats()
            started = time.monotonic()
            if code := _launch(ASSET, key, env):
                return code
            elapsed = time.monotonic() - started
            after = sim.stats()
            os.environ["DAGSTER_HOME"] = env["DAGSTER_HOME"]
            md = _latest_metadata(key)
            wall = float(md.get("run/wall_s", elapsed))
            tokens = after.get("admitted_tokens", 0) - before.get("admitted_tokens", 0)
            summary.append(
                {
                    "partition": key,
                    "rows_in": md.get("partition/rows_input"),
                    "rows_ok": md.get("partition/rows_ok"),
                    "rows_failed": md.get("partition/rows_failed"),
                    "rows_skipped": md.get("run/rows_skipped"),
                    # Counted at the provider: a rerun of done partitions sends nothing.
                    "requests": after.get("received", 0) - before.get("received", 0),
                    "prompt_tokens": md.get("run/prompt_tokens"),
                    "completion_tokens": md.get("run/completion_tokens"),
                    "cost_usd": md.get("run/cost_usd"),
                    "wall_s": round(wall, 2),
                    "http_429": md.get("run/http_429"),
                    "limit_share": round(tokens / (DEMO_TPM / 60 * wall), 3)
                    if wall > 0.5
                    else None,
                }
            )
        if code := _embed(sim, env, keys[0]):
            return code
    (DEMO_DIR / "summary.json").write_text(json.dumps(summary, indent=2))
    _print_table(summary)
    print(_requests_line(summary))
    print(
        f"\nwritten: {DEMO_DIR / 'summary.json'}; results in table news_sentiment of "
        f"{DEMO_DIR / 'warehouse.duckdb'}"
    )
    return 0


def _launch(asset: str, key: str, env: dict[str, str]) -> int:
    """`dg launch` of one partition of `asset`; its exit code (its output shown if it failed)."""
    cmd = [_dg(), "launch", "--assets", asset, "--partition", key]
    print(f"$ dg launch --assets {asset} --partition {key}", flush=True)
    proc = subprocess.run(cmd, env=env, cwd=PROJECT_DIR, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        print(f"partition {key} of {asset} failed (exit {proc.returncode})", file=sys.stderr)
    return proc.returncode


def _embed(sim: SimulatorProcess, env: dict[str, str], key: str) -> int:
    """Embed one partition's headlines (defs/headline_embeddings), print its figures, counted
    at the provider, and the two closest distinct headlines; write them to embeddings.json."""
    before = sim.stats()
    if code := _launch(EMBED_ASSET, key, env):
        return code
    after = sim.stats()
    md = _latest_metadata(key, EMBED_ASSET)
    figures = {
        "partition": key,
        "rows_ok": md.get("partition/rows_ok"),
        "rows_skipped": md.get("run/rows_skipped"),
        "requests": after.get("received", 0) - before.get("received", 0),
        "texts_sent": after.get("embedding_inputs", 0) - before.get("embedding_inputs", 0),
        "prompt_tokens": md.get("run/prompt_tokens"),
        "cost_usd": md.get("run/cost_usd"),
        "wall_s": md.get("run/wall_s"),
    }
    (DEMO_DIR / "embeddings.json").write_text(json.dumps(figures, indent=2))
    cost = figures["cost_usd"]
    print(
        f"\nembeddings of {key}: {figures['rows_ok']} rows in news_embeddings, "
        f"{figures['rows_skipped']} skipped as done; {figures['texts_sent']} distinct texts sent "
        f"in {figures['requests']} request(s), {figures['prompt_tokens']} tokens, cost "
        + (f"${cost:.6f}" if isinstance(cost, int | float) else "not priced")
    )
    import duckdb

    con = duckdb.connect(env["BATCH_LLM_DUCKDB"], read_only=True)
    try:
        pair = con.execute(CLOSEST_SQL, [key]).fetchone()
    finally:
        con.close()
    if pair:
        print(f"closest headlines (cosine {pair[2]:.3f}): {pair[0]!r} ~ {pair[1]!r}")
    return 0


def _requests_line(rows: list[dict]) -> str:
    """What this run paid for, counted at the provider; a rerun says that it sent nothing."""
    sent = sum(r["requests"] for r in rows)
    skipped = sum(r["rows_skipped"] or 0 for r in rows)
    if sent == 0:
        return (
            f"\nrequests sent to the provider: 0 (every row was already done: {skipped} "
            "skipped, nothing paid again)"
        )
    return f"\nrequests sent to the provider: {sent} ({skipped} rows skipped as already done)"


def _print_table(rows: list[dict]) -> None:
    cols = [
        "partition",
        "rows_in",
        "rows_ok",
        "rows_failed",
        "rows_skipped",
        "requests",
        "prompt_tokens",
        "completion_tokens",
        "cost_usd",
        "wall_s",
        "http_429",
        "limit_share",
    ]
    heads = [
        "partition",
        "rows",
        "ok",
        "failed",
        "skipped",
        "sent",
        "tok in",
        "tok out",
        "cost $",
        "wall s",
        "429s",
        "TPM used",
    ]
    cells = [
        [
            (
                "-"
                if r[c] is None
                else f"{r[c]:.5f}"
                if c == "cost_usd" and isinstance(r[c], float)
                else f"{r[c]:.0%}"
                if c == "limit_share"
                else str(r[c])
            )
            for c in cols
        ]
        for r in rows
    ]
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, h in enumerate(heads)]
    print()
    print("  ".join(h.rjust(w) for h, w in zip(heads, widths, strict=True)))
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
    print(
        f"(simulated provider limits: {DEMO_RPM} requests/min, {DEMO_TPM} tokens/min; "
        "'TPM used' = tokens the provider admitted / its limit over the run)"
    )


def _dg() -> str:
    """The `dg` installed beside this Python (the venv's), else the one on PATH."""
    local = Path(sys.executable).with_name("dg")
    return str(local) if local.exists() else "dg"


def dev(port: int = 3000) -> int:
    _prepare()
    with (
        SimulatorProcess(rpm=DEMO_RPM, tpm=DEMO_TPM, latency_ms=40) as sim,
        EmbeddedValkey() as valkey,
    ):
        env = _env(sim, valkey)
        # Set the pool's limit before any run queues: Dagster applies `default_limit` to a new
        # pool only after the queue's first pass, which could start a backfill's first runs
        # together on the DuckDB file.
        dagster = str(Path(sys.executable).with_name("dagster"))
        subprocess.run(
            [dagster, "instance", "concurrency", "set", DEMO_POOL, "1"],
            env=env,
            check=True,
            capture_output=True,
        )
        print(f"simulator at {sim.url}, valkey at {valkey.url}; starting dg dev", flush=True)
        # Its own process group: on the way out the webserver, the daemon and the code servers
        # are all stopped together, whatever `dg dev` itself does with the signal.
        proc = subprocess.Popen(
            [_dg(), "dev", "--port", str(port)], env=env, cwd=PROJECT_DIR, start_new_session=True
        )
        parent = os.getppid()
        try:
            while True:  # also stop when our parent (make) is killed and we are orphaned
                try:
                    return proc.wait(timeout=1)
                except subprocess.TimeoutExpired:
                    if os.getppid() != parent:
                        return 0
        except KeyboardInterrupt:
            return 0
        finally:
            _stop_group(proc)


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the whole group, then SIGKILL to whatever is left after the grace period."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)  # anyone left in the group?
            except ProcessLookupError:
                proc.poll()
                return
            proc.poll()
            time.sleep(0.2)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM too stops dg dev, the simulator and Valkey on the way out


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    ap = argparse.ArgumentParser(prog="python -m batch_llm_assets.demo")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--partitions", type=int, default=3)
    d = sub.add_parser("dev")
    d.add_argument("--port", type=int, default=3000)
    args = ap.parse_args(argv)
    return run(args.partitions) if args.cmd == "run" else dev(args.port)


if __name__ == "__main__":
    sys.exit(main())
