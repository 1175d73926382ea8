"""The partitioned LLM batch asset factory, its prompt templates, prices and metadata."""

from .checks import build_llm_batch_checks
from .factory import SourceTable, build_llm_batch_asset
from .pricing import PRICES_PER_1M, price_for
from .prompt import Prompt, PromptError

__all__ = [
    "PRICES_PER_1M",
    "Prompt",
    "PromptError",
    "SourceTable",
    "build_llm_batch_asset",
    "build_llm_batch_checks",
    "price_for",
]
