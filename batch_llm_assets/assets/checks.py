"""Checks and the run's verdict, judged on the partition as the output table holds it.

Both are computed inside the materialisation from that partition's rows (`partition_summary`),
never from "the latest materialisation" (in a backfill that is another partition's) nor from the
rows this run happened to send (a rerun that sends only the 10 permanently failing rows of 300
is not "100 % failed").
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

FAILED_FRACTION = "failed_fraction"
ROW_COUNT = "row_count_matches_input"
# Warn well before the run's own failure threshold (DEFAULT_MAX_FAILED_FRACTION, 5 %): a partition
# can pass the run and still deserve a look.
DEFAULT_WARN_FAILED_FRACTION = 0.01


def failed_fraction(summary: dict[str, Any], rows_in: int) -> float:
    """Failed rows of the partition in the output table / the partition's input rows."""
    return summary["rows_failed"] / rows_in if rows_in else 0.0


def failed_rows_table(rows: list[dict[str, Any]]) -> dg.TableMetadataValue:
    """A sample of failed rows (id, error_class, error, attempts) as the UI shows a table."""
    return dg.MetadataValue.table(
        records=[dg.TableRecord(dict(r)) for r in rows],
        schema=dg.TableSchema(
            columns=[
                dg.TableColumn("id", "string"),
                dg.TableColumn("error_class", "string"),
                dg.TableColumn("error", "string"),
                dg.TableColumn("attempts", "int"),
            ]
        ),
    )


def check_specs(
    asset_key: dg.AssetKey,
    *,
    warn_failed_fraction: float = DEFAULT_WARN_FAILED_FRACTION,
    severity: dg.AssetCheckSeverity = dg.AssetCheckSeverity.WARN,
    partitions_def: dg.PartitionsDefinition | None = None,
) -> list[dg.AssetCheckSpec]:
    """The two checks every partition's run reports for that partition (partitioned like the
    asset: one evaluation per partition, a preview feature of Dagster)."""
    return [
        dg.AssetCheckSpec(
            FAILED_FRACTION,
            asset=asset_key,
            partitions_def=partitions_def,
            description=f"Failed rows of the partition (in the output table) are at most "
            f"{warn_failed_fraction:.1%} of its input rows ({severity.value} otherwise).",
        ),
        dg.AssetCheckSpec(
            ROW_COUNT,
            asset=asset_key,
            partitions_def=partitions_def,
            description="The output table holds exactly one row per input row of the partition.",
        ),
    ]


def check_results(
    summary: dict[str, Any],
    rows_in: int,
    *,
    warn_failed_fraction: float = DEFAULT_WARN_FAILED_FRACTION,
    severity: dg.AssetCheckSeverity = dg.AssetCheckSeverity.WARN,
) -> list[dg.AssetCheckResult]:
    """Results of `check_specs` for one partition, from its `partition_summary`."""
    fraction = failed_fraction(summary, rows_in)
    rows_out = summary["rows_total"]
    failed_md = {
        "failed_fraction": dg.MetadataValue.float(round(fraction, 6)),
        "threshold": dg.MetadataValue.float(warn_failed_fraction),
        "rows_failed": dg.MetadataValue.int(summary["rows_failed"]),
        "rows_input": dg.MetadataValue.int(rows_in),
    }
    if summary.get("failed_rows"):  # a failed partition has no materialization: list them here
        failed_md["failed_rows"] = failed_rows_table(summary["failed_rows"])
    return [
        dg.AssetCheckResult(
            check_name=FAILED_FRACTION,
            passed=fraction <= warn_failed_fraction,
            severity=severity,
            metadata=failed_md,
        ),
        dg.AssetCheckResult(
            check_name=ROW_COUNT,
            passed=rows_out == rows_in,
            metadata={
                "rows_input": dg.MetadataValue.int(rows_in),
                "rows_output": dg.MetadataValue.int(rows_out),
            },
        ),
    ]


def failure_reason(
    summary: dict[str, Any],
    rows_in: int,
    *,
    max_failed_fraction: float,
    aborted: str | None,
    budget: str | None = None,
) -> str | None:
    """Why the run fails, or None: too much of the partition (as the output table holds it) has
    failed, or a spend cap stopped the sending (`budget`: always a failure, so that nobody
    takes a capped partition for a finished one). A breaker trip (`aborted`) is named first; on
    its own it does not fail a partition that stays under the threshold, e.g. a rerun of its few
    failing rows that trip the breaker by failing alike again."""
    fraction = failed_fraction(summary, rows_in)
    stopped = f"sending stopped: {budget}" if budget else None
    if fraction > max_failed_fraction:
        why = (
            f"{summary['rows_failed']} of the partition's {rows_in} rows have failed "
            f"({fraction:.1%} > {max_failed_fraction:.1%})"
        )
        return "; ".join(x for x in (stopped or aborted, why) if x)
    return stopped


def judge_partition(
    summary: dict[str, Any],
    rows_in: int,
    *,
    max_failed_fraction: float,
    aborted: str | None,
    metadata: dict[str, Any],
    budget: str | None = None,
) -> None:
    """Fail the materialisation (after every row was written) when the partition is not good."""
    why = failure_reason(
        summary, rows_in, max_failed_fraction=max_failed_fraction, aborted=aborted, budget=budget
    )
    if why is None:
        return
    top = ", ".join(f"{k} ({n})" for k, n in summary["errors"].items()) or "none"
    raise dg.Failure(
        description=f"{why}. Top errors in the partition: {top}. Every row was written; rerun "
        "the partition to retry only the failed rows.",
        metadata=metadata,
    )


@dataclass
class PartitionOutcome:
    """What one partition's run recorded: metadata, check results and, if it failed, why."""

    key: str | None
    metadata: dict[str, Any]
    checks: list[dg.AssetCheckResult] = field(default_factory=list)
    failure: str | None = None

    def events(self, asset_key: dg.AssetKey) -> Iterator[Any]:
        """The materialization (a good partition only), then one evaluation per check, each
        naming the partition."""
        if self.failure is None:
            yield dg.AssetMaterialization(asset_key, partition=self.key, metadata=self.metadata)
        for r in self.checks:
            yield dg.AssetCheckEvaluation(
                asset_key=r.asset_key or asset_key,
                check_name=str(r.check_name),
                passed=r.passed,
                metadata=r.metadata,
                severity=r.severity,
                description=r.description,
                partition=self.key,
            )
