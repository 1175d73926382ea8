"""`make demo` twice: the second run finds every row done and pays nothing.

The demo starts its simulator on a free port each time, which is what a self-hosted server that
moves looks like to a rerun (a new pod address, a restarted server on another port): the
request identity must not depend on the endpoint's address."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEP_TIMEOUT_S = 300  # one `demo run` of one partition: dg launch, 300 rows


def _demo_run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "batch_llm_assets.demo", "run", "--partitions", "1"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT_S,
    )


def test_a_rerun_of_the_demo_sends_no_request_and_says_so(tmp_path):
    demo = tmp_path / "demo"
    env = {
        **os.environ,
        "BATCH_LLM_DEMO_DIR": str(demo),
        "BATCH_LLM_JOURNAL_DIR": str(tmp_path / "journal"),
    }
    first = _demo_run(env)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    [one] = json.loads((demo / "summary.json").read_text())
    # The demo embeds the first partition too, many headlines per request.
    embedded = json.loads((demo / "embeddings.json").read_text())
    assert embedded["rows_ok"] == one["rows_in"] and 0 < 50 * embedded["requests"] <= one["rows_in"]
    assert "closest headlines (cosine" in first.stdout
    # The demo's headlines repeat: identical requests are sent once (the others share them).
    assert one["rows_in"] > 0 and 0 < one["requests"] <= one["rows_in"] == one["rows_ok"]
    second = _demo_run(env)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    [two] = json.loads((demo / "summary.json").read_text())
    assert (two["requests"], two["rows_skipped"]) == (0, one["rows_in"])  # counted at the provider
    assert two["rows_ok"] == one["rows_in"]
    assert "requests sent to the provider: 0 (every row was already done" in second.stdout
    again = json.loads((demo / "embeddings.json").read_text())
    assert (again["requests"], again["rows_skipped"]) == (0, one["rows_in"])
