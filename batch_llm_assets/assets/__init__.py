"""The partitioned LLM batch asset: its spec, factory, lineage, prompt templates, prices, metadata."""

from .checks import DEFAULT_WARN_FAILED_FRACTION
from .estimate import Estimate, EstimateInputError, estimate_cost, select_partitions
from .estimate_job import build_estimate_job
from .factory import SourceTable, build_asset_from_spec, build_llm_batch_asset
from .lineage import source_table_spec, with_limits_metadata
from .pricing import Price, cost_usd, price_for
from .prompt import Prompt, PromptError
from .spec import LlmBatchConfigError, LlmBatchSpec

__all__ = [
    "DEFAULT_WARN_FAILED_FRACTION",
    "Estimate",
    "EstimateInputError",
    "LlmBatchConfigError",
    "LlmBatchSpec",
    "Price",
    "Prompt",
    "PromptError",
    "SourceTable",
    "build_asset_from_spec",
    "build_estimate_job",
    "build_llm_batch_asset",
    "cost_usd",
    "estimate_cost",
    "price_for",
    "select_partitions",
    "source_table_spec",
    "with_limits_metadata",
]
