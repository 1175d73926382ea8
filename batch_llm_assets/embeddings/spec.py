"""LlmEmbeddingSpec: every setting of an embedding asset, checked once, for Python and YAML alike.

It is LlmBatchSpec (source, partitions, output, mode, batch, pools, reuse, ...: the same
machinery, the same errors naming the setting) whose prompt is the text embedded: one template
over the row's columns ("{{ headline }}", or "{{ title }}\\n{{ body }}"), plus the embedding's
own settings. What only a chat asset has (a system message, params, output_schema) is refused.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, StrictInt, model_validator

from ..assets.spec import LlmBatchConfigError, LlmBatchSpec, fail
from . import _constants as C

__all__ = ["LlmEmbeddingSpec"]


class LlmEmbeddingSpec(LlmBatchSpec):
    """Every setting of one embedding asset. Build it with `LlmEmbeddingSpec.parse(...)`, with
    `text` (the template of the text embedded) in place of `prompt`."""

    dimensions: StrictInt | None = Field(
        default=None,
        description="Length of the vectors, for models that shorten them (text-embedding-3-*); "
        "None: the model's own. Part of each row's request_hash.",
    )
    encoding_format: Literal["float", "base64"] | None = Field(
        default=None,
        description="How vectors travel: base64 (little-endian float32, a quarter of the JSON) "
        "or float; they are stored as floats either way. None: base64 for OpenAI, Azure OpenAI "
        "and vLLM, float for other servers.",
    )
    truncate: bool = Field(
        default=False,
        description="Cut a text over max_input_tokens to its first max_input_tokens tokens (the "
        "row records truncated = true) instead of failing it context_length.",
    )
    max_inputs_per_request: StrictInt = Field(
        default=C.MAX_INPUTS_PER_REQUEST,
        description="Rows packed into one request at most (OpenAI and Azure OpenAI: 2048).",
    )
    max_tokens_per_request: StrictInt = Field(
        default=C.MAX_TOKENS_PER_REQUEST,
        description="Tokens of the rows packed into one request at most (OpenAI: 300,000); "
        "never more than the LLM resource's tpm.",
    )
    max_input_tokens: StrictInt | None = Field(
        default=None,
        description="Tokens of one row's text at most (OpenAI: 8192). None: the context window "
        "of a self-hosted server (as it reports it, or the LLM resource's context_window), "
        "else 8192.",
    )

    @classmethod
    def parse(cls, **settings: Any) -> LlmEmbeddingSpec:
        """Validate settings (`text` is the template embedded); any problem raises
        LlmBatchConfigError naming its path."""
        if "text" in settings:
            if "prompt" in settings:
                raise LlmBatchConfigError(description="text: set text or prompt, not both")
            settings["prompt"] = settings.pop("text")
        try:
            return super().parse(**settings)  # type: ignore[return-value]
        except LlmBatchConfigError as exc:  # the chat spec's errors name its prompt: here `text`
            raise LlmBatchConfigError(
                description=re.sub(r"(?m)^prompt(\.template)?", "text", exc.description)
            ) from None

    @model_validator(mode="after")
    def _check_embedding(self) -> LlmEmbeddingSpec:
        if self.prompt.system is not None:
            fail("text", "an embedding has no system message; put everything in text")
        if self.params:
            fail(
                "params",
                "not used by an embedding asset (its request is model, input, "
                "dimensions and encoding_format)",
            )
        if self.output_schema is not None:
            fail("output_schema", "not used by an embedding asset")
        if self.dimensions is not None and not 1 <= self.dimensions <= C.MAX_DIMENSIONS:
            fail("dimensions", f"must be from 1 to {C.MAX_DIMENSIONS}, got {self.dimensions}")
        for name in ("max_inputs_per_request", "max_tokens_per_request", "max_input_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                fail(name, f"must be >= 1, got {value}")
        # Batch mode sends a row per line: a file's lines are its embedding inputs.
        lines = self.batch.max_file_requests if self.batch is not None else C.BATCH_MAX_INPUTS
        if self.mode == "batch" and lines > C.BATCH_MAX_INPUTS:
            fail("batch.max_file_requests", f"must be <= {C.BATCH_MAX_INPUTS} for embeddings")
        return self

    @property
    def text(self) -> str:
        return self.prompt.template

    @property
    def reuse(self) -> bool:
        """Stored vectors are reused (the same text, model and dimensions give the same vector)
        unless reuse_answers is false."""
        return self.reuse_answers is not False
