"""Dagster resources, thin: LLMResource over the engine, and the two warehouses."""

from .duckdb_warehouse import DuckDBWarehouse
from .llm import LLMResource

__all__ = ["DuckDBWarehouse", "LLMResource"]
