"""The LLM batch component: one asset (+ checks, schedule, sensors) per defs.yaml."""

from .component import LlmBatchComponent, LlmBatchConfigError

__all__ = ["LlmBatchComponent", "LlmBatchConfigError"]
