"""Materialisation metadata: the partition as it now stands, and, apart, what this run did.

`partition/*` entries are read from the output table, so an unchanged partition plots flat
however many reruns skip it; `run/*` entries describe this run alone. Every key says its unit
(`_s`, `_ms`, `_usd`, `rows_`, `_tokens`), because Dagster shows the key as the label. A cost
that cannot be known (no price for the model) is left out of the numbers and shown as "not
priced" in the text, never as 0. Floats are rounded for display; plotted figures keep enough
digits to plot.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

from ..engine import _constants as C
from ..engine.budget import SpendReport
from ..engine.engine import ChatResult
from ..warehouses.base import failed_rows_sql
from .checks import failed_fraction, failed_rows_table


@dataclass
class RunStats:
    rows_in: int = 0
    sent: int = 0  # rows that reached the provider (at least one attempt)
    ok: int = 0
    failed: int = 0
    skipped: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float | None = 0.0
    retries: int = 0
    http_429: int = 0
    rate_limit_wait_s: float = 0.0  # wall time while any request waited (engine.limiter_wait_s)
    requests_waited: int = 0  # sent rows that waited for the limiter at all
    request_wait_s: float = 0.0  # the sum of those waits, over rows
    latencies: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    wall_s: float = 0.0
    aborted: str | None = None
    deduplicated: int = 0  # rows that took the answer of another row of this run
    reused: int = 0  # rows that took an answer stored before this run
    cost_saved_usd: float | None = 0.0  # what the shared rows' sources paid for them
    budget: SpendReport | None = None  # the spend caps' figures, when any is set

    @property
    def budget_stop(self) -> str | None:
        """Why a spend cap stopped the sending, if one did."""
        return self.budget.exhausted if self.budget is not None else None

    @property
    def processed(self) -> int:
        return self.ok + self.failed + self.skipped

    def add_shared(self, error_class: str | None, reused: bool, cost: float | None) -> None:
        """A row that took another row's answer (assets/sharing.py): not sent, nothing paid;
        `error_class` None for an ok answer, `cost` what the source row paid."""
        if error_class is None:
            self.ok += 1
        else:
            self.failed += 1
            self.errors[error_class] += 1
        if reused:
            self.reused += 1
        else:
            self.deduplicated += 1
        if self.cost_saved_usd is not None and cost is not None:
            self.cost_saved_usd += cost

    def add(self, r: ChatResult, cost: float | None) -> None:
        if r.attempts:
            self.sent += 1
        if r.ok:
            self.ok += 1
        else:
            self.failed += 1
            self.errors[r.error_class or "unknown"] += 1
        self.prompt_tokens += r.prompt_tokens or 0
        self.completion_tokens += r.completion_tokens or 0
        if r.prompt_tokens is not None and self.cost_usd is not None:  # billed, even if failed
            self.cost_usd = None if cost is None else self.cost_usd + cost
        self.retries += max(0, r.attempts - 1)
        self.http_429 += r.http_429
        if r.attempts and r.rate_limit_wait_s > C.LIMITER_WAITED_S:
            self.requests_waited += 1
            self.request_wait_s += r.rate_limit_wait_s
        if r.latency_ms is not None:
            self.latencies.append(r.latency_ms)


def _percentile(sorted_values: list[float], q: float) -> float:
    idx = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[idx]


def _float(value: float, digits: int = 3) -> dg.MetadataValue:
    return dg.MetadataValue.float(round(float(value), digits))


def partition_metadata(summary: dict[str, Any], rows_in: int) -> dict[str, Any]:
    """The partition's figures from `partition_summary` (the output table's rows)."""
    md: dict[str, Any] = {
        "dagster/row_count": dg.MetadataValue.int(summary["rows_total"]),
        "partition/rows_input": dg.MetadataValue.int(rows_in),
        "partition/rows_ok": dg.MetadataValue.int(summary["rows_ok"]),
        "partition/rows_failed": dg.MetadataValue.int(summary["rows_failed"]),
        "partition/rows_total": dg.MetadataValue.int(summary["rows_total"]),
        "partition/failed_fraction": _float(failed_fraction(summary, rows_in), 4),
        "partition/prompt_tokens": dg.MetadataValue.int(summary["prompt_tokens"]),
        "partition/completion_tokens": dg.MetadataValue.int(summary["completion_tokens"]),
    }
    if summary["cost_usd"] is not None:
        md["partition/cost_usd"] = _float(summary["cost_usd"], 6)
    return md


@dataclass(frozen=True)
class Limits:
    """The LLM resource's configured limits, against which a run's use is stated."""

    rpm: int | None = None
    tpm: int | None = None


def _usage_metadata(stats: RunStats, limits: Limits | None) -> dict[str, Any]:
    """How close the run came to the configured limits, and how much it waited for them: the
    share of sent requests that waited and their mean wait (a wall time "while any request
    waited" reads as the run's waiting share, which it is not)."""
    wall = max(stats.wall_s, 1e-9)
    sent = stats.sent
    md: dict[str, Any] = {
        "run/requests_waited_fraction": _float(stats.requests_waited / sent if sent else 0.0, 4),
        "run/limiter_wait_mean_s": _float(
            stats.request_wait_s / stats.requests_waited if stats.requests_waited else 0.0
        ),
    }
    tokens_per_min = (stats.prompt_tokens + stats.completion_tokens) / wall * 60
    requests_per_min = (sent + stats.retries) / wall * 60
    if limits is not None and limits.tpm:
        md["run/tpm_used_fraction"] = _float(tokens_per_min / limits.tpm, 4)
    if limits is not None and limits.rpm:
        md["run/rpm_used_fraction"] = _float(requests_per_min / limits.rpm, 4)
    return md


def run_metadata(stats: RunStats, limits: Limits | None = None) -> dict[str, Any]:
    """What this run did: rows sent and skipped, its tokens and cost, time, waits, 429s."""
    wall = max(stats.wall_s, 1e-9)
    sent = stats.sent  # rows failed before sending (an empty prompt, a template) are not sent
    tokens = stats.prompt_tokens + stats.completion_tokens
    md: dict[str, Any] = {
        "run/rows_sent": dg.MetadataValue.int(sent),
        "run/rows_ok": dg.MetadataValue.int(stats.ok),
        "run/rows_failed": dg.MetadataValue.int(stats.failed),
        "run/rows_skipped": dg.MetadataValue.int(stats.skipped),
        "run/prompt_tokens": dg.MetadataValue.int(stats.prompt_tokens),
        "run/completion_tokens": dg.MetadataValue.int(stats.completion_tokens),
        "run/wall_s": _float(stats.wall_s),
        "run/rows_per_s": _float(sent / wall, 2),
        "run/tokens_per_min": _float(tokens / wall * 60, 1),
        **_usage_metadata(stats, limits),
        "run/http_429": dg.MetadataValue.int(stats.http_429),
        "run/retries": dg.MetadataValue.int(stats.retries),
        "run/requests_deduplicated": dg.MetadataValue.int(stats.deduplicated),
        "run/answers_reused": dg.MetadataValue.int(stats.reused),
    }
    if stats.cost_usd is not None:
        md["run/cost_usd"] = _float(stats.cost_usd, 6)
        md["run/cost_saved_usd"] = _float(stats.cost_saved_usd or 0.0, 6)
    lat = sorted(stats.latencies)
    if lat:  # a run that sent nothing has no latency (not a latency of 0)
        md["run/latency_p50_ms"] = _float(_percentile(lat, 0.50), 2)
        md["run/latency_p95_ms"] = _float(_percentile(lat, 0.95), 2)
        md["run/latency_max_ms"] = _float(lat[-1], 2)
    return md


def failed_rows_metadata(summary: dict[str, Any], output: str, partition_key: str) -> dict:
    """Up to FAILED_ROWS_SAMPLE failed rows of the partition, and the SQL that lists them all."""
    rows = summary.get("failed_rows") or []
    literal = "'" + partition_key.replace("'", "''") + "'"
    md: dict[str, Any] = {
        "failed_rows_sql": dg.MetadataValue.md(f"```sql\n{failed_rows_sql(output, literal)}\n```")
    }
    if rows:
        md["failed_rows"] = failed_rows_table(rows)
    return md


def build_metadata(
    stats: RunStats,
    *,
    summary: dict[str, Any],
    model: str,
    output: str,
    partition_key: str = "__all__",
    limits: Limits | None = None,
    pricing: str | None = None,
) -> dict[str, Any]:
    """Every entry of a materialisation (or of its failure): partition, run, model, summary,
    failed rows, pricing and the asset's cost to date."""
    rows_in = stats.rows_in
    md = {**partition_metadata(summary, rows_in), **run_metadata(stats, limits)}
    md["model"] = dg.MetadataValue.text(model)
    if pricing is not None:
        md["pricing"] = dg.MetadataValue.text(pricing)
    if summary.get("asset_cost_usd") is not None:
        md["cost_usd_to_date"] = _float(summary["asset_cost_usd"], 6)
    md["summary"] = dg.MetadataValue.md(_summary_text(stats, summary, rows_in, output))
    md.update(failed_rows_metadata(summary, output, partition_key))
    for name, value in (stats.budget.figures if stats.budget else {}).items():
        md[f"run/{name}"] = _float(value, 6)  # each cap, and what was spent against it
    return md


def progress_text(s: RunStats, elapsed: float) -> str:
    """The run's progress line: rows, rate, ETA, waits and cost so far."""
    answered = s.ok + s.failed
    rate = answered / elapsed if elapsed > 0 else 0.0
    left = s.rows_in - s.processed
    eta = f"{left / rate:.0f} s" if rate > 0 else "unknown"
    return (
        f"{s.processed}/{s.rows_in} rows ({s.ok} ok, {s.failed} failed, {s.skipped} skipped, "
        f"{s.deduplicated + s.reused} of them shared), {rate:.1f} rows/s, ETA {eta}; "
        f"{s.http_429} 429s, {s.retries} retries, {s.requests_waited} requests waited for the "
        f"limiter, cost so far {money(s.cost_usd)}"
    )


def money(cost: float | None) -> str:
    return f"${cost:.4f}" if cost is not None else "not priced"


def _summary_text(stats: RunStats, summary: dict[str, Any], rows_in: int, output: str) -> str:
    errors = ", ".join(f"`{k}` {n}" for k, n in summary["errors"].items()) or "none"
    lat = sorted(stats.latencies)
    latency = (
        f"{_percentile(lat, 0.5):.0f} / {_percentile(lat, 0.95):.0f} ms" if lat else "no request"
    )
    sent = stats.sent
    unsent = stats.ok + stats.failed - sent - stats.deduplicated - stats.reused
    return (
        f"**Partition** (`{output}`): **{summary['rows_ok']}** ok, **{summary['rows_failed']}** "
        f"failed of {rows_in} input rows; {summary['prompt_tokens']} / "
        f"{summary['completion_tokens']} tokens in / out, cost {money(summary['cost_usd'])} "
        f"to date. Errors: {errors}\n\n"
        f"**This run**: {sent} sent; {stats.ok} ok, {stats.failed} failed"
        + (f" ({unsent} of them before sending)" if unsent else "")
        + f", {stats.skipped} skipped as already done"
        + (
            f"; {stats.deduplicated} took the answer of an identical request of this run and "
            f"{stats.reused} a stored one (saved {money(stats.cost_saved_usd)})"
            if stats.deduplicated or stats.reused
            else ""
        )
        + "\n\n"
        "| tokens in / out | cost | wall | requests that waited | p50 / p95 latency | 429s "
        "| retries |\n|---|---|---|---|---|---|---|\n"
        f"| {stats.prompt_tokens} / {stats.completion_tokens} | {money(stats.cost_usd)} | "
        f"{stats.wall_s:.1f} s | {stats.requests_waited} of {sent} | {latency} | "
        f"{stats.http_429} | {stats.retries} |"
    )
