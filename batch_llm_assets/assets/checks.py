"""Asset checks on a batch asset's latest materialisation: failures and completeness."""

import dagster as dg


def _latest_metadata(context: dg.AssetCheckExecutionContext, key: dg.AssetKey) -> dict:
    event = context.instance.get_latest_materialization_event(key)
    mat = event.asset_materialization if event else None
    return {k: v.value for k, v in mat.metadata.items()} if mat else {}


def build_llm_batch_checks(
    asset: dg.AssetsDefinition, *, max_failed_fraction: float = 0.05
) -> list[dg.AssetChecksDefinition]:
    """Two checks, run after each materialisation: failed fraction under its threshold, and
    one output row for every input row of the partition."""
    key = asset.key

    @dg.asset_check(
        asset=key,
        name="failed_fraction",
        description=(
            f"Rows that failed, out of those sent, are at most {max_failed_fraction:.0%}."
        ),
    )
    def failed_fraction(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        md = _latest_metadata(context, key)
        ok, failed = int(md.get("rows_ok", 0)), int(md.get("rows_failed", 0))
        fraction = failed / (ok + failed) if ok + failed else 0.0
        return dg.AssetCheckResult(
            passed=bool(md) and fraction <= max_failed_fraction,
            metadata={"failed_fraction": fraction, "rows_failed": failed, "rows_ok": ok},
        )

    @dg.asset_check(
        asset=key,
        name="row_count_matches_input",
        description=("The output has exactly one row per input row of the partition."),
    )
    def row_count(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        md = _latest_metadata(context, key)
        rows_in, rows_out = md.get("rows_in"), md.get("dagster/row_count")
        return dg.AssetCheckResult(
            passed=rows_in is not None and rows_in == rows_out,
            metadata={"rows_in": rows_in or 0, "rows_out": rows_out or 0},
        )

    return [failed_fraction, row_count]
