"""build_llm_embedding_asset: a partitioned asset that embeds the text of every row of a table slice
into a vector column, many rows per request, under the shared limit.

The asset is the chat asset's (assets/factory.py: partitions, checks, leases, journal, metadata,
source lineage, pools) with an EmbeddingPartitionRun (run.py) per partition.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import dagster as dg

from ..assets.batch_mode import BatchSettings
from ..assets.factory import SourceTable, Task, build_asset_from_spec, run_spec_for
from ..assets.lineage import WAREHOUSE_TYPES, definition_metadata
from . import _constants as C
from .batch import EmbeddingBatchRun
from .run import (
    DESCRIPTIONS,
    EMBEDDING_COLUMNS,
    EmbeddingPartitionRun,
    EmbeddingRunSpec,
    embedding_table,
)
from .spec import LlmEmbeddingSpec

__all__ = ["build_embedding_asset_from_spec", "build_llm_embedding_asset"]


def build_llm_embedding_asset(
    *,
    name: str,
    source: SourceTable,
    text: str,
    output: str,
    model: str | None = None,
    dimensions: int | None = None,
    encoding_format: str | None = None,
    truncate: bool = False,
    max_inputs_per_request: int = C.MAX_INPUTS_PER_REQUEST,
    max_tokens_per_request: int = C.MAX_TOKENS_PER_REQUEST,
    max_input_tokens: int | None = None,
    partitions_def: dg.PartitionsDefinition | None = None,
    mode: str = "live",
    batch: BatchSettings | Mapping[str, Any] | None = None,
    deps: Sequence[dg.AssetKey | str] | None = None,
    **settings: Any,
) -> dg.AssetsDefinition:
    """An asset whose partitions embed `text` (a template over the row's columns, e.g.
    "{{ headline }}") of every source row into the `embedding` column of `output`.

    Rows are packed many per request, up to `max_inputs_per_request` rows and
    `max_tokens_per_request` tokens (OpenAI's limits by default; never more than the LLM
    resource's tpm), each request taking its tokens from the shared limit. A text over
    `max_input_tokens` fails context_length, or is cut to it with `truncate`. `dimensions`
    shortens the vectors (text-embedding-3-*). A row whose text, model and dimensions already
    have a stored ok vector in the output table is not sent again (reuse_answers=False: only
    within its own partition). `mode="batch"`: the Batch API at its price (`batch` says how).
    `settings`: any other setting of build_llm_batch_asset (max_failed_fraction, checks,
    chunk_rows, warehouse_kind, provider, pool, reuse_answers, key_prefix, group_name, tags,
    owners, ...), checked the same way.
    """
    if isinstance(batch, BatchSettings):
        batch = dataclasses.asdict(batch)
    spec = LlmEmbeddingSpec.parse(
        **{k: (list(v) if isinstance(v, tuple) else v) for k, v in settings.items()},
        name=name,
        source=dataclasses.asdict(source),
        text=text,
        output=output,
        model=model,
        dimensions=dimensions,
        encoding_format=encoding_format,
        truncate=truncate,
        max_inputs_per_request=max_inputs_per_request,
        max_tokens_per_request=max_tokens_per_request,
        max_input_tokens=max_input_tokens,
        mode=mode,
        batch=dict(batch) if batch is not None else None,
    )
    extra = [dg.AssetKey.from_user_string(d) if isinstance(d, str) else d for d in deps or []]
    return build_embedding_asset_from_spec(spec, partitions_def=partitions_def, extra_deps=extra)


def build_embedding_asset_from_spec(
    spec: LlmEmbeddingSpec,
    *,
    partitions_def: dg.PartitionsDefinition | None = None,
    extra_deps: Sequence[dg.AssetKey] = (),
) -> dg.AssetsDefinition:
    """The asset of a validated spec (the Python builder and the YAML component end here)."""
    chat = run_spec_for(spec)  # the source and the text template, as a chat asset reads them
    run_spec = EmbeddingRunSpec(
        **{f.name: getattr(chat, f.name) for f in dataclasses.fields(chat)}
        | {"output": embedding_table(spec.output), "params": {}},
        dimensions=spec.dimensions,
        encoding_format=spec.encoding_format,
        truncate=spec.truncate,
        max_inputs=spec.max_inputs_per_request,
        max_request_tokens=spec.max_tokens_per_request,
        max_input_tokens=spec.max_input_tokens,
    )
    if spec.description is None:
        what = f"Embeddings ({spec.model})" if spec.model else "Embeddings"
        spec = spec.model_copy(
            update={"description": f"{what} of every row of {spec.source.table}, in {spec.output}."}
        )
    task = Task(run_spec, EmbeddingPartitionRun, EmbeddingBatchRun, embedding_metadata(spec))
    return build_asset_from_spec(
        spec, partitions_def=partitions_def, extra_deps=extra_deps, task=task
    )


def embedding_metadata(spec: LlmEmbeddingSpec) -> dict[str, Any]:
    """The chat asset's definition metadata, with the embedding table's columns and settings."""
    md = definition_metadata(spec)
    md["batch_llm/text_template"] = md.pop("batch_llm/prompt_template")
    md["batch_llm/task"] = "embed"
    if spec.dimensions is not None:
        md["batch_llm/dimensions"] = spec.dimensions
    types = WAREHOUSE_TYPES[spec.warehouse_kind]
    src = spec.source
    declared = {k.lower(): v for k, v in src.column_types.items()}
    id_type = declared.get(src.id_column.lower(), f"type of {src.table}.{src.id_column}")
    md["dagster/column_schema"] = dg.TableSchema(
        columns=[
            dg.TableColumn("id", id_type, description="the source row's id"),
            *(
                dg.TableColumn(c, types[t], description=DESCRIPTIONS.get(c))
                for c, t in EMBEDDING_COLUMNS
            ),
        ]
    )
    return md
