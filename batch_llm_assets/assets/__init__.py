"""The partitioned LLM batch asset: its spec, factory, lineage, prompt templates, prices, metadata."""

from .checks import build_llm_batch_checks
from .factory import SourceTable, build_asset_from_spec, build_llm_batch_asset
from .lineage import source_table_spec
from .pricing import Price, cost_usd, price_for
from .prompt import Prompt, PromptError
from .spec import LlmBatchConfigError, LlmBatchSpec

__all__ = [
    "LlmBatchConfigError",
    "LlmBatchSpec",
    "Price",
    "Prompt",
    "PromptError",
    "SourceTable",
    "build_asset_from_spec",
    "build_llm_batch_asset",
    "build_llm_batch_checks",
    "cost_usd",
    "price_for",
    "source_table_spec",
]
