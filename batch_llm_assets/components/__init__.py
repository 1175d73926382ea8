"""Dagster Components of batch_llm_assets (the `dagster_dg_cli.registry_modules` entry point).

type: batch_llm_assets.components.LlmBatchComponent
type: batch_llm_assets.components.LlmEmbeddingComponent
"""

from .llm_batch import LlmBatchComponent, LlmBatchConfigError
from .llm_embedding import LlmEmbeddingComponent
from .loader import load_defs_folder

__all__ = ["LlmBatchComponent", "LlmBatchConfigError", "LlmEmbeddingComponent", "load_defs_folder"]
