"""Embedding assets: every row of a table embedded into a vector column, many rows per request,
under the shared limit (factory.py builds them; run.py, packing.py and sender.py run them)."""

from .factory import build_embedding_asset_from_spec, build_llm_embedding_asset
from .spec import LlmEmbeddingSpec

__all__ = ["LlmEmbeddingSpec", "build_embedding_asset_from_spec", "build_llm_embedding_asset"]
