"""Materialisation metadata: numbers Dagster can plot across partitions, a schema, a summary."""

from __future__ import annotations

from typing import Any

import dagster as dg

from .pipeline import RunStats


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    idx = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[idx]


def build_metadata(stats: RunStats, *, row_count: int, model: str, output: str) -> dict[str, Any]:
    lat = sorted(stats.latencies)
    wall = max(stats.wall_s, 1e-9)
    sent = stats.ok + stats.failed
    tokens = stats.prompt_tokens + stats.completion_tokens
    cost = stats.cost_usd
    md: dict[str, Any] = {
        "dagster/row_count": dg.MetadataValue.int(row_count),
        "rows_in": dg.MetadataValue.int(stats.rows_in),
        "rows_ok": dg.MetadataValue.int(stats.ok),
        "rows_failed": dg.MetadataValue.int(stats.failed),
        "rows_skipped": dg.MetadataValue.int(stats.skipped),
        "prompt_tokens": dg.MetadataValue.int(stats.prompt_tokens),
        "completion_tokens": dg.MetadataValue.int(stats.completion_tokens),
        "cost_usd": dg.MetadataValue.float(round(cost, 6))
        if cost is not None
        else dg.MetadataValue.text("unknown"),
        "latency_p50_ms": dg.MetadataValue.float(round(_percentile(lat, 0.50), 2)),
        "latency_p95_ms": dg.MetadataValue.float(round(_percentile(lat, 0.95), 2)),
        "latency_max_ms": dg.MetadataValue.float(round(lat[-1], 2) if lat else 0.0),
        "wall_s": dg.MetadataValue.float(round(stats.wall_s, 3)),
        "rows_per_s": dg.MetadataValue.float(round(sent / wall, 2)),
        "tokens_per_min": dg.MetadataValue.float(round(tokens / wall * 60, 1)),
        "rate_limit_wait_s": dg.MetadataValue.float(round(stats.rate_limit_wait_s, 3)),
        "retries": dg.MetadataValue.int(stats.retries),
        "http_429": dg.MetadataValue.int(stats.http_429),
        "model": dg.MetadataValue.text(model),
    }
    errors = ", ".join(f"`{k}` {n}" for k, n in stats.errors.most_common(5)) or "none"
    cost_text = f"${cost:.4f}" if cost is not None else "unknown (no price for this model)"
    md["summary"] = dg.MetadataValue.md(
        f"**{stats.ok}** ok, **{stats.failed}** failed, **{stats.skipped}** skipped of "
        f"{stats.rows_in} rows → `{output}`\n\n"
        f"| tokens in / out | cost | wall | rows/s | p50 / p95 latency | 429s | retries |\n"
        f"|---|---|---|---|---|---|---|\n"
        f"| {stats.prompt_tokens} / {stats.completion_tokens} | {cost_text} | "
        f"{stats.wall_s:.1f} s | {sent / wall:.1f} | {_percentile(lat, 0.5):.0f} / "
        f"{_percentile(lat, 0.95):.0f} ms | {stats.http_429} | {stats.retries} |\n\n"
        f"Errors: {errors}"
    )
    return md
