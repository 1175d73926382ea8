"""The LLM embedding component: one embedding asset (+ checks, job, schedule) per defs.yaml."""

from .component import LlmEmbeddingComponent

__all__ = ["LlmEmbeddingComponent"]
