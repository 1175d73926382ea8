"""The bill before launching: what a partition, a range or every missing partition of a batch
asset will cost, from its real rows, without sending anything to the provider.

    keys = select_partitions(asset, start="2026-11-01", end="2026-11-10")
    est = estimate_cost(asset, llm=llm, warehouse=warehouse, partitions=keys)
    print(est.table()); print(est.json_line())

Rows are read and rendered as their runs would (estimate_scan.py): distinct requests are those
left after identical requests are counted once per run and stored answers are reused. Prompt
tokens come from the engine's tokenizer over the messages sent; output tokens per request are
the mean of the answers the asset paid for so far, else `max_tokens` (then the figure is an
upper bound). Costs are at the live and the Batch API list prices (pricing.py), None when the
model is not priced. A range of more than SAMPLE_PARTITIONS partitions reads that many, evenly
spread, and scales up; so does a partition of more than SAMPLE_ROWS rows (its first rows). The
sample is stated. Prompt caching discounts are not counted: the estimate errs high.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import dagster as dg

from ..engine.errors import BatchLLMError
from ..engine.requests import EngineSettings
from ..engine.tokens import requested_max_tokens
from ..resources.llm import LLMResource
from ..warehouses.base import Warehouse
from ..warehouses.output_stats import stored_answer_stats
from .estimate_report import Estimate, Sample
from .estimate_scan import SAMPLE_ROWS, Counts, PartitionScanner
from .estimate_typed import bounded_answer_tokens
from .factory import run_spec_for, spec_of
from .pricing import cost_usd, price_for_resource, pricing_label
from .sharing import reuses_answers
from .structured import OutputSchema

__all__ = [
    "SAMPLE_PARTITIONS",
    "Estimate",
    "EstimateInputError",
    "estimate_cost",
    "select_partitions",
]

# Partitions read for one estimate; a longer range is sampled (evenly spread, ends included).
SAMPLE_PARTITIONS = 24
_SHOWN_CHARS = 80  # of a bad argument, in an error message


class EstimateInputError(BatchLLMError):
    """The estimate was asked something it cannot answer: an unknown asset or partition, an
    inverted range, a partition of an asset that has none. Nothing was read."""


def shown(value: object) -> str:
    """A user's value as an error quotes it: repr (escapes lone surrogates), shortened."""
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def batch_spec(asset: dg.AssetsDefinition):  # -> LlmBatchSpec
    """The asset's spec; an input error for an asset this package did not build."""
    spec = spec_of(asset)
    if spec is None:
        raise EstimateInputError(
            description=f"Asset {asset.key.to_user_string()!r} was not built by "
            "build_llm_batch_asset or LlmBatchComponent: there is nothing to estimate."
        )
    return spec


def select_partitions(
    asset: dg.AssetsDefinition,
    *,
    partition: str | None = None,
    start: str | None = None,
    end: str | None = None,
    missing: bool = False,
    instance: dg.DagsterInstance | None = None,
) -> list[str | None]:
    """The partitions an estimate covers: one, a range (`start` to `end`, both included), or
    every partition without a materialization in `instance` (default: an empty one, so all).
    An unpartitioned asset: [None], its whole table, and none of these may be given."""
    spec = batch_spec(asset)
    given = {"partition": partition, "start": start, "end": end}
    for name, value in given.items():
        if value is not None and (not isinstance(value, str) or not value):
            raise EstimateInputError(
                description=f"{name} must be a partition key (a non-empty string), got "
                f"{shown(value)}."
            )
    if type(missing) is not bool:
        raise EstimateInputError(
            description=f"missing must be True or False, got {shown(missing)}."
        )
    pdef = asset.partitions_def
    if pdef is None:
        if missing or any(v is not None for v in given.values()):
            raise EstimateInputError(
                description=f"Asset {spec.name!r} is not partitioned: estimate its whole table "
                "(no partition, range or missing)."
            )
        return [None]
    if (partition is not None) + (start is not None or end is not None) + missing != 1:
        raise EstimateInputError(
            description="Choose one: a partition, a range (start and end) or missing."
        )
    if (start is None) != (end is None):
        raise EstimateInputError(description="A range needs both its start and its end.")
    instance = instance or dg.DagsterInstance.ephemeral()
    keys = pdef.get_partition_keys(dynamic_partitions_store=instance)
    if missing:
        done = instance.get_materialized_partitions(asset.key)
        return [k for k in keys if k not in done]
    index = {k: i for i, k in enumerate(keys)}
    first, last = (_place(index, k, spec.name) for k in (partition or start, partition or end))
    if first > last:
        raise EstimateInputError(
            description=f"The range {shown(start)} to {shown(end)} is inverted: its start comes "
            "after its end."
        )
    return list(keys[first : last + 1])


def _place(index: dict[str, int], key: str | None, asset: str) -> int:
    if key not in index:
        some = ", ".join(list(index)[:3])
        raise EstimateInputError(
            description=f"Asset {asset!r} has no partition {shown(key)} ({len(index)} "
            f"partitions{': ' + some + ', ...' if some else ''})."
        )
    return index[key]


def estimate_cost(
    asset: dg.AssetsDefinition,
    *,
    llm: LLMResource,
    warehouse: Warehouse,
    partitions: Sequence[str | None],
    sample_partitions: int = SAMPLE_PARTITIONS,
    sample_rows: int = SAMPLE_ROWS,
) -> Estimate:
    """What running `partitions` of `asset` (from select_partitions; [None] for the whole table
    of an unpartitioned asset) would send and cost, on these resources. Sends nothing."""
    spec = batch_spec(asset)
    keys = _checked_keys(asset.partitions_def, partitions, spec.name)
    read = sampled_keys(keys, max(1, sample_partitions))
    run_spec = run_spec_for(spec)
    settings = llm.engine_settings(model=run_spec.model, params=run_spec.params)
    reuse = reuses_answers(run_spec.reuse_answers, settings.params)
    with warehouse.session() as session:
        observed = stored_answer_stats(session, run_spec.output.name)
        scanner = PartitionScanner(
            spec,
            run_spec,
            asset.partitions_def,
            llm,
            session,
            reuse=reuse,
            stored=observed is not None,
            sample_rows=sample_rows,
        )
        counts = asyncio.run(_scan(scanner, read))
    total = Counts()
    total.add(counts, len(keys) / len(read) if read else 0.0)
    per_request, basis = _output_per_request(observed, run_spec.output_schema, settings)
    prompt, requests = round(total.prompt_tokens), round(total.requests)
    output = round(total.requests * per_request)
    live = price_for_resource(llm, settings.model)
    batch = price_for_resource(llm, settings.model, batch=True)
    return Estimate(
        asset=asset.key.to_user_string(),
        partitions=keys,
        counts=total,
        distinct_requests=requests,
        prompt_tokens=prompt,
        output_tokens=output,
        output_per_request=per_request,
        output_basis=basis,
        cost_usd=_rounded(cost_usd(live, prompt, output)),
        cost_usd_batch=_rounded(cost_usd(batch, prompt, output)),
        pricing=pricing_label(live),
        sample=Sample(len(read), len(keys), scanner.rows_read, scanner.partitions_cut)
        if len(read) < len(keys) or scanner.partitions_cut
        else None,
    )


def _checked_keys(
    pdef: dg.PartitionsDefinition | None, partitions: Sequence[str | None], asset: str
) -> list[str | None]:
    """The keys as given, each a partition of the asset (a dynamic one's are checked by
    select_partitions, which has the instance): else an input error naming the first bad one."""
    keys = list(partitions)
    if pdef is None:
        if keys != [None]:
            raise EstimateInputError(
                description=f"Asset {asset!r} is not partitioned: its partitions are [None]."
            )
        return keys
    if isinstance(pdef, dg.DynamicPartitionsDefinition):
        known = None
    else:
        known = set(pdef.get_partition_keys())
    for key in keys:
        if not isinstance(key, str) or (known is not None and key not in known):
            raise EstimateInputError(description=f"Asset {asset!r} has no partition {shown(key)}.")
    return keys


async def _scan(scanner: PartitionScanner, keys: list[str | None]) -> Counts:
    counts = Counts()
    for key in keys:
        counts.add(await scanner.scan(key))
    return counts


def sampled_keys(keys: list[str | None], at_most: int) -> list[str | None]:
    """At most `at_most` of `keys`, evenly spread, the first and the last included."""
    if len(keys) <= at_most:
        return keys
    if at_most < 2:
        return keys[:1]
    step = (len(keys) - 1) / (at_most - 1)
    return [keys[round(i * step)] for i in range(at_most)]


def _rounded(usd: float | None) -> float | None:
    return None if usd is None else round(usd, 6)


def _output_per_request(
    observed: Any, schema: OutputSchema | None, settings: EngineSettings
) -> tuple[float, str]:
    """Output tokens per request, and what they rest on: the mean of the answers stored, else
    the size of a typed answer whose every field is bounded, else max_tokens (an upper bound)."""
    if observed is not None and observed.answers and observed.mean_completion_tokens is not None:
        return observed.mean_completion_tokens, f"mean of the {observed.answers} answers stored"
    cap = requested_max_tokens(settings.params, settings.default_max_tokens)
    typical = bounded_answer_tokens(schema, settings.model)
    if typical is not None and typical < cap:
        return float(typical), "the typed answer's size (every field bounded): no answer stored yet"
    return float(cap), "max_tokens: no answer stored yet, an upper bound"
