"""The worker's breaker: scoped to what shares a failure's cause, and closing again.

The partition pipeline's breaker (engine/breaker.py) stops a run for good; a worker serves
many producers for weeks, so it keeps one breaker per scope instead:

- the endpoint of a request queue (the model and the base URL its messages go to): out of
  credit at once, or authentication / permission / not-found errors `fatal_threshold` times in
  a row. Every message of that queue waits, since every one would fail alike.
- a producer (`metadata.producer`, or every unnamed producer together): the same 400 or 422 on
  `threshold` consecutive messages of that producer. Only its messages wait.

An open scope holds its messages (to the retry set, never failed for it) for a cool-down; then
one message probes it (half-open): an answer closes it, the same failure opens it again for
twice as long (up to MAX_BREAKER_COOLDOWN_S). An answer in a scope resets its streak.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass

from ..engine import ChatResult
from ..engine import _constants as C
from ..engine import errors as E
from . import _constants as K
from .messages import answered

log = logging.getLogger(__name__)

# Failures of the endpoint, not of the message: it waits for the endpoint to recover. ABORTED:
# the engine's own breaker stopped it unsent (the key ran out of credit meanwhile).
ENDPOINT_CLASSES = E.FATAL_CLASSES | {E.ABORTED}
_PRODUCER_CLASSES = frozenset({E.BAD_REQUEST, E.UNPROCESSABLE})
_NUMBERS = re.compile(r"[0-9a-f]{8,}|\d+(\.\d+)?")


def producer_scope(producer: str) -> str:
    return f"producer:{producer}"


@dataclass(slots=True)
class _Scope:
    streak: int = 0
    signature: str | None = None
    reason: str | None = None  # set while open or half-open
    open_until: float = 0.0  # time.monotonic()
    cooldown_s: float = 0.0
    probing: bool = False


@dataclass(frozen=True, slots=True)
class Admission:
    """`wait_s` > 0: hold the message that long (`reason` says why); else send it, and if
    `probes` is not empty it is the probe of those scopes."""

    wait_s: float = 0.0
    reason: str = ""
    probes: tuple[str, ...] = ()


class ScopedBreaker:
    def __init__(
        self,
        *,
        cooldown_s: float = K.DEFAULT_BREAKER_COOLDOWN_S,
        threshold: int = C.BREAKER_THRESHOLD,
        fatal_threshold: int = C.FATAL_ERROR_THRESHOLD,
    ) -> None:
        self.cooldown_s = cooldown_s
        self.threshold = threshold
        self.fatal_threshold = fatal_threshold
        self._scopes: dict[str, _Scope] = {}

    def is_open(self, scope: str) -> bool:
        s = self._scopes.get(scope)
        return s is not None and s.reason is not None

    def open_scopes(self) -> int:
        return sum(1 for s in self._scopes.values() if s.reason is not None)

    def admit(self, scopes: tuple[str, ...]) -> Admission:
        """Whether a message of these scopes may be sent now."""
        now = time.monotonic()
        wait, reason = 0.0, ""
        for key in scopes:
            s = self._scopes.get(key)
            if s is None or s.reason is None:
                continue
            left = K.RECHECK_S if s.probing else s.open_until - now
            if left > wait:
                wait, reason = left, s.reason
        if wait > 0:
            return Admission(wait, reason)
        probes = tuple(k for k in scopes if self.is_open(k))
        for key in probes:
            self._scopes[key].probing = True
        return Admission(probes=probes)

    def record(self, scopes: tuple[str, ...], admission: Admission, result: ChatResult | None):
        """What became of a message admitted; None: its handling did not end in a result."""
        for key in admission.probes:
            self._scopes[key].probing = False
        if result is None:
            return
        endpoint, producer = scopes
        if answered(result):
            for key in scopes:
                self._close(key)
            return
        cls = result.error_class
        if cls in E.FATAL_CLASSES:
            s = self._scope(endpoint)
            s.streak += 1
            if (
                cls in E.IMMEDIATELY_FATAL
                or s.streak >= self.fatal_threshold
                or endpoint in admission.probes
            ):
                self._open(endpoint, f"{s.streak} in a row: {cls}: {result.error_message}")
        elif cls in _PRODUCER_CLASSES:
            s = self._scope(producer)
            sig = f"{cls}|{_NUMBERS.sub('#', result.error_message or '')[:200]}"
            s.streak = s.streak + 1 if sig == s.signature else 1
            s.signature = sig
            if s.streak >= self.threshold or producer in admission.probes:
                why = f"{s.streak} consecutive messages failed with {cls}: {result.error_message}"
                self._open(producer, why)

    def open_endpoint(self, scope: str, reason: str) -> None:
        """The engine's own breaker stopped sending (the key is out of credit)."""
        if not self.is_open(scope):
            self._open(scope, reason)

    def _scope(self, key: str) -> _Scope:
        if key not in self._scopes and len(self._scopes) >= K.MAX_BREAKER_SCOPES:
            # Many producers named once each: forget the streaks of closed scopes.
            self._scopes = {k: s for k, s in self._scopes.items() if s.reason is not None}
        return self._scopes.setdefault(key, _Scope())

    def _open(self, key: str, why: str) -> None:
        s = self._scope(key)
        reopened = s.reason is not None
        s.cooldown_s = min(2 * s.cooldown_s, K.MAX_BREAKER_COOLDOWN_S) if reopened else 0.0
        s.cooldown_s = s.cooldown_s or self.cooldown_s
        s.open_until = time.monotonic() + s.cooldown_s
        s.reason = f"breaker open for {key}: {why}"
        log.error(
            "Breaker open for %s for %.0f s (%s); its messages wait, not sent.",
            key,
            s.cooldown_s,
            why,
        )

    def _close(self, key: str) -> None:
        s = self._scopes.get(key)
        if s is None:
            return
        if s.reason is not None:
            log.info("Breaker closed for %s: a probe was answered.", key)
        self._scopes.pop(key)
