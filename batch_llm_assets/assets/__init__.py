"""The partitioned LLM batch asset factory, its prompt templates, prices and metadata."""

from .checks import DEFAULT_WARN_FAILED_FRACTION
from .factory import SourceTable, build_llm_batch_asset
from .pricing import PRICES_PER_1M, price_for
from .prompt import Prompt, PromptError

__all__ = [
    "DEFAULT_WARN_FAILED_FRACTION",
    "PRICES_PER_1M",
    "Prompt",
    "PromptError",
    "SourceTable",
    "build_llm_batch_asset",
    "price_for",
]
