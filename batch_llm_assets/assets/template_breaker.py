"""The template breaker: a run whose prompt template fails row after row stops, naming it."""

from __future__ import annotations

from ..engine import _constants as C
from ..engine.errors import PROMPT_RENDER
from .prompt import PROMPT_TOO_LARGE, PromptError


class TemplateBreaker:
    """Stops a run whose template fails row after row: `threshold` consecutive rows failing to
    render with the same error class (prompt_render, prompt_too_large) are the template's
    fault, so the run ends with that problem instead of failing every row, one render time
    limit at a time. Anything else (a rendered row, a NULL column) starts the count again."""

    def __init__(self, threshold: int = C.TEMPLATE_BREAKER_THRESHOLD) -> None:
        self.threshold = threshold
        self._class: str | None = None
        self._rows = 0
        self.error: PromptError | None = None  # set when it trips: the run's failure

    def observe(self, error_class: str | None, reason: str | None) -> bool:
        """One row's outcome, in row order; True when the breaker trips (then the caller keeps
        that row's failure and raises `error`)."""
        if error_class not in (PROMPT_RENDER, PROMPT_TOO_LARGE):
            self._class, self._rows = None, 0
            return False
        self._rows = self._rows + 1 if error_class == self._class else 1
        self._class = error_class
        if self._rows >= self.threshold and self.error is None:
            self.error = PromptError(
                description=f"The prompt template failed on {self._rows} consecutive rows "
                f"with {error_class} ({reason}), so the run stopped: the template, not the "
                "data, is at fault. Fix the template (or raise render_timeout_s / "
                "max_prompt_chars if these rows need it) and rerun; rows already answered "
                "are kept.",
                metadata={"error_class": error_class},
            )
        return self.error is not None
