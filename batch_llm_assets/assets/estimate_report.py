"""A cost estimate as the user reads it: a table, one JSON line, Dagster metadata."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import dagster as dg

from .estimate_scan import Counts


@dataclass(frozen=True)
class Sample:
    """What a sampled estimate read: partitions of how many, rows, partitions read in part."""

    partitions_read: int
    partitions: int
    rows_read: int
    partitions_cut: int

    def text(self) -> str:
        cut = f", the first rows of {self.partitions_cut}" if self.partitions_cut else ""
        return (
            f"sampled: {self.partitions_read} of {self.partitions} partitions read "
            f"({self.rows_read} rows{cut}); the figures are scaled up"
        )


@dataclass(frozen=True)
class Estimate:
    """What a run of the partitions would send and cost (estimate.py)."""

    asset: str
    partitions: list[str | None]
    counts: Counts
    distinct_requests: int
    prompt_tokens: int
    output_tokens: int
    output_per_request: float
    output_basis: str
    cost_usd: float | None
    cost_usd_batch: float | None
    pricing: str
    sample: Sample | None

    @property
    def rows(self) -> int:
        return round(self.counts.rows)

    def summary(self) -> dict[str, Any]:
        """The JSON line's figures; `sampled` is null when every row was read."""
        values = {
            "rows": self.rows,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "distinct_requests": self.distinct_requests,
            "cost_usd": self.cost_usd,
            "cost_usd_batch": self.cost_usd_batch,
        }
        sample = self.sample
        values["sampled"] = (
            None
            if sample is None
            else {
                "partitions_read": sample.partitions_read,
                "partitions": sample.partitions,
                "rows_read": sample.rows_read,
            }
        )
        return values

    def json_line(self) -> str:
        return json.dumps(self.summary())

    def scope(self) -> str:
        keys = self.partitions
        if keys == [None]:
            return "the whole table"
        if len(keys) == 1:
            return f"partition {keys[0]}"
        if not keys:
            return "no partition (none is missing)"
        return f"{len(keys)} partitions, {keys[0]} to {keys[-1]}"

    def lines(self) -> list[tuple[str, str, str]]:
        """(what, figure, note) rows of the table."""
        c = self.counts
        return [
            ("rows", _n(c.rows), ""),
            ("already done", _n(c.done), "ok with the same request: skipped"),
            ("shared in a run", _n(c.shared), "identical requests are sent once"),
            ("answers reused", _n(c.reused), "answers already stored"),
            ("not sendable", _n(c.unsendable), "prompt over its limits: fails unsent"),
            ("distinct requests", _n(self.distinct_requests), "to send"),
            ("prompt tokens", _n(self.prompt_tokens), "tokenizer over the rendered requests"),
            (
                "output tokens",
                _n(self.output_tokens),
                f"{self.output_per_request:.1f} a request: {self.output_basis}",
            ),
            ("cost, live", _usd(self.cost_usd), self.pricing),
            ("cost, Batch API", _usd(self.cost_usd_batch), "Batch API prices: results within 24 h"),
        ]

    def table(self) -> str:
        rows = self.lines()
        wide = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
        out = [f"estimate for {self.asset}, {self.scope()} (nothing sent)"]
        out += [f"  {a:<{wide[0]}}  {b:>{wide[1]}}  {c}".rstrip() for a, b, c in rows]
        if self.sample is not None:
            out.append(f"  {self.sample.text()}")
        return "\n".join(out)

    def metadata(self) -> dict[str, Any]:
        """The figures as metadata of an AssetObservation (estimate_job.py)."""
        md: dict[str, Any] = {"estimate/scope": dg.MetadataValue.text(self.scope())}
        for key, value in self.summary().items():
            if key == "sampled":
                md["estimate/sampled"] = dg.MetadataValue.json(value) if value else "no"
            elif value is None:
                md[f"estimate/{key}"] = dg.MetadataValue.text("not priced")
            else:
                md[f"estimate/{key}"] = value
        md["estimate/answers_reused"] = round(self.counts.reused)
        md["estimate/output_basis"] = dg.MetadataValue.text(self.output_basis)
        md["estimate/pricing"] = dg.MetadataValue.text(self.pricing)
        return md


def _n(value: float) -> str:
    return f"{round(value):,}"


def _usd(value: float | None) -> str:
    return "not priced" if value is None else f"${value:,.6f}"
