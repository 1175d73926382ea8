"""The run's breaker and retry budget: stop sending when every further request would fail.

Three ways to trip: an error that says the key can do nothing more (out of credit) at once;
authentication / permission / not-found errors `fatal_threshold` times in a row; and the same
non-transient error (400, 422, or a 5xx that repeats on a retry of the same row) on `threshold`
consecutive distinct rows. A success in between resets the streaks. And for typed outputs,
answers that break the same rule of the schema (the same field, the same kind of bound) after
their repair on `threshold` consecutive rows: a valid answer in between resets that streak.
"""

from __future__ import annotations

import logging

from . import _constants as C
from . import errors as E
from .constraints import Violation

log = logging.getLogger(__name__)

_DETERMINISTIC_STATUSES = (400, 422)


class Breaker:
    def __init__(
        self,
        *,
        threshold: int = C.BREAKER_THRESHOLD,
        fatal_threshold: int = C.FATAL_ERROR_THRESHOLD,
        retry_budget_base: int = C.RETRY_BUDGET_BASE,
        retry_budget_ratio: float = C.RETRY_BUDGET_RATIO,
    ) -> None:
        self.threshold = threshold
        self.fatal_threshold = fatal_threshold
        self.budget_base = retry_budget_base
        self.budget_ratio = retry_budget_ratio
        self.reason: str | None = None
        self._fatal_streak = 0
        self._signature: str | None = None
        self._rows = 0
        self._invalid_key: str | None = None
        self._invalid_rows = 0
        self.rows_started = 0
        self.retries = 0

    def reset(self) -> None:
        """Close again: a long-running caller (the queue worker) probes after a cool-down."""
        self.reason = None
        self._fatal_streak = 0
        self._signature = None
        self._rows = 0
        self.answer_valid()

    def row_started(self) -> None:
        self.rows_started += 1

    def success(self) -> None:
        self._fatal_streak = 0
        self._signature = None
        self._rows = 0

    def take_retry(self) -> bool:
        """Spend one retry of the run's budget; False when it is spent."""
        if self.retries >= self.budget_base + self.budget_ratio * self.rows_started:
            return False
        self.retries += 1
        return True

    def fatal_error(self, exc: E.ProviderError) -> None:
        """An error every further row would get alike (a rejected request form)."""
        self._fatal_streak += 1
        if self._fatal_streak >= self.fatal_threshold:
            self._trip(
                f"the provider rejected {self._fatal_streak} requests in a row with "
                f"{exc.error_class} ({exc.message}); the remaining requests were not sent"
            )

    def error(self, exc: E.ProviderError, row_signatures: set[str]) -> None:
        """Count a failed attempt of one row; `row_signatures` holds that row's earlier ones."""
        if exc.error_class in E.IMMEDIATELY_FATAL:
            self._trip(
                f"the provider says the API key is out of credit ({exc.error_class}: "
                f"{exc.message}); add credit or use another key. The remaining requests were "
                "not sent"
            )
            return
        if exc.error_class in E.FATAL_CLASSES:
            self._fatal_streak += 1
            if self._fatal_streak >= self.fatal_threshold:
                self._trip(
                    f"the provider rejected {self._fatal_streak} requests in a row with "
                    f"{exc.error_class} ({exc.message}); the remaining requests were not sent"
                )
            return
        sig = exc.signature
        # A 5xx is deterministic when it repeats on a retry of the same row (a transient one
        # at 15 % repeats on 2 % of rows, and five such rows in a row without a success between
        # them do not happen).
        deterministic = (
            exc.status in _DETERMINISTIC_STATUSES and exc.error_class != E.CONTEXT_LENGTH
        ) or (exc.status is not None and exc.status >= 500 and sig in row_signatures)
        first_of_row = not any(s.startswith("counted:") for s in row_signatures)
        row_signatures.add(sig)
        if not deterministic or not first_of_row:
            return
        row_signatures.add("counted:")
        if sig == self._signature:
            self._rows += 1
        else:
            self._signature, self._rows = sig, 1
        if self._rows >= self.threshold:
            self._trip(
                f"{self._rows} consecutive rows failed with the same error ({exc.error_class}: "
                f"{exc.message}); the remaining requests were not sent"
            )

    def answer_valid(self) -> None:
        self._invalid_key, self._invalid_rows = None, 0

    def answer_invalid(self, rule: Violation) -> None:
        """A row's last answer broke `rule` (its repair too): the same rule on `threshold` rows
        in a row is the model's or the form's fault, not the rows'."""
        if rule.key == self._invalid_key:
            self._invalid_rows += 1
        else:
            self._invalid_key, self._invalid_rows = rule.key, 1
        if self._invalid_rows >= self.threshold:
            self._trip(
                f"{self._invalid_rows} consecutive rows failed validation {rule.summary}; the "
                f"last: {rule}. The remaining requests were not sent"
            )

    def stop(self, reason: str) -> None:
        """Stop sending for a cause outside the engine (the caller cannot keep the answers): a
        request on the wire still returns its answer; the others fail `aborted`."""
        self._trip(reason)

    def _trip(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
            log.error("Aborting the batch: %s", reason)
