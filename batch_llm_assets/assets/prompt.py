"""Prompt templates over row columns, rendered in Jinja's sandbox (no Python objects reachable)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2 import meta, nodes
from jinja2.sandbox import SandboxedEnvironment

from ..engine.errors import EMPTY_PROMPT, PROMPT_RENDER, BatchLLMError

_ENV = SandboxedEnvironment(undefined=jinja2.StrictUndefined, autoescape=False)


class PromptError(BatchLLMError):
    """A prompt template that cannot work: malformed, or naming an unknown column."""


@dataclass(frozen=True)
class Prompt:
    """`template` (user message) and optional `system`, both Jinja over the row's columns."""

    template: str
    system: str | None = None

    def variables(self) -> set[str]:
        names: set[str] = set()
        for label, text in (("template", self.template), ("system", self.system)):
            if text is None:
                continue
            if not isinstance(text, str) or (label == "template" and not text.strip()):
                raise PromptError(description=f"Prompt {label} must be a non-empty string.")
            try:
                ast = _ENV.parse(text)
            except jinja2.TemplateSyntaxError as exc:
                raise PromptError(
                    description=f"Malformed prompt {label} (line {exc.lineno}): {exc.message}"
                ) from None
            if any(ast.find_all((nodes.Include, nodes.Import, nodes.FromImport, nodes.Extends))):
                raise PromptError(
                    description=f"Prompt {label} may not include, import or extend other "
                    "templates: a prompt sees only its row's columns."
                )
            names |= meta.find_undeclared_variables(ast)
        return names


class CompiledPrompt:
    """A checked prompt, ready to render rows into chat messages."""

    def __init__(self, prompt: Prompt, columns: tuple[str, ...]) -> None:
        used = prompt.variables()
        unknown = sorted(used - set(columns))
        if unknown:
            raise PromptError(
                description=f"Prompt uses unknown column(s) {unknown}; the source provides "
                f"{sorted(columns)}."
            )
        self.prompt = prompt
        self.used = tuple(sorted(used))
        self._user = _ENV.from_string(prompt.template)
        self._system = _ENV.from_string(prompt.system) if prompt.system else None

    def render(
        self, row: dict[str, Any]
    ) -> tuple[list[dict[str, str]] | None, tuple[str, str] | None]:
        """(messages, None), or (None, (error class, reason)) for a row that must not be sent."""
        nulls = [c for c in self.used if row.get(c) is None]
        if nulls:
            return None, (EMPTY_PROMPT, f"column(s) {nulls} are NULL")
        blanks = [c for c in self.used if isinstance(row[c], str) and not row[c].strip()]
        if blanks:
            return None, (EMPTY_PROMPT, f"column(s) {blanks} are empty")
        # Bytes (a BLOB column, a mis-declared encoding) are text with bad bytes replaced.
        row = {
            k: v.decode("utf-8", "replace") if isinstance(v, bytes) else v for k, v in row.items()
        }
        try:
            user = self._user.render(row)
            messages = []
            if self._system is not None:
                messages.append({"role": "system", "content": self._system.render(row)})
        except Exception as exc:  # the sandbox's SecurityError, undefined names, bad filters
            return None, (PROMPT_RENDER, f"prompt could not be rendered: {exc}")
        if not user.strip():
            return None, (EMPTY_PROMPT, "rendered prompt is empty")
        messages.append({"role": "user", "content": user})
        return messages, None
