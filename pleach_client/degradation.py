"""``runtime.degradation``: models that keep failing are routed around, through a fallback
registry the host fills.

A model call that fails for the model's own reasons (overloaded, a 5xx, a timeout, a rate
limit) counts against the model; ``threshold`` such failures within ``window_s`` mark it
degraded for ``cooldown_s``. While a model is degraded, a turn calls its registered fallback
instead (if that one is not degraded too), and the audit row names the model actually called.
A success of the model clears its failures; when the cool-down ends the model is tried again.
A failure for the caller's reasons (a bad request, a missing key) says nothing about the model
and is not counted.

The decisions are pure functions of the recorded failures and the clock (``clock``, seconds),
so they are tested without a provider.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Literal

import msgspec

__all__ = [
    "DegradationFacet",
    "DegradedModelRecord",
    "FailureKind",
    "failure_kind",
]

FailureKind = Literal["overloaded", "server_error", "timeout", "rate_limited"]


class DegradedModelRecord(msgspec.Struct, kw_only=True):
    """A receipt: why ``model`` is routed around, since when, until when, and to what."""

    model: str
    reason: FailureKind
    failures: int
    since: float
    until: float
    fallback: str | None


_CODES: dict[str, FailureKind] = {
    "overloaded": "overloaded",
    "rate_limited": "rate_limited",
    "timeout": "timeout",
    "connection_error": "timeout",
}


def failure_kind(exc: BaseException) -> FailureKind | None:
    """What a provider error says about the model: None when it says nothing (the caller's
    mistake, an abort). Reads a ``ProviderError``'s code, or the anthropic SDK's error
    classes by name and status, so this module does not import the SDK."""
    code = getattr(exc, "code", None)
    if isinstance(code, str):
        if code in _CODES:
            return _CODES[code]
        status = getattr(exc, "status", None)
        if code == "api_error" and (status is None or status >= 500):
            return "server_error"
        if code in ("truncated", "invalid_response"):
            return "server_error"
        return None
    names = {cls.__name__ for cls in type(exc).__mro__}
    status = getattr(exc, "status_code", None)
    if "APITimeoutError" in names or isinstance(exc, TimeoutError):
        return "timeout"
    if "OverloadedError" in names or status == 529:
        return "overloaded"
    if "RateLimitError" in names or status == 429:
        return "rate_limited"
    if "InternalServerError" in names or (isinstance(status, int) and status >= 500):
        return "server_error"
    if "APIConnectionError" in names:
        return "timeout"
    return None


class DegradationFacet:
    """``runtime.degradation``. ``fallbacks`` maps a model to the one to call instead."""

    def __init__(
        self,
        *,
        threshold: int = 3,
        window_s: float = 60.0,
        cooldown_s: float = 120.0,
        fallbacks: dict[str, str] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if threshold < 1 or window_s <= 0 or cooldown_s <= 0:
            raise ValueError("threshold must be >= 1, window_s and cooldown_s positive")
        self.threshold = threshold
        self.window_s = window_s
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._fallbacks: dict[str, str] = dict(fallbacks or {})
        self._failures: dict[str, deque[tuple[float, FailureKind]]] = {}
        self._degraded: dict[str, DegradedModelRecord] = {}

    # -- the fallback registry ---------------------------------------------------------------
    def register_fallback(self, model: str, fallback: str) -> None:
        if model == fallback:
            raise ValueError(f"a model cannot be its own fallback ({model})")
        self._fallbacks[model] = fallback

    def fallbacks(self) -> dict[str, str]:
        return dict(self._fallbacks)

    # -- what happened -----------------------------------------------------------------------
    def record_failure(self, model: str, kind: FailureKind) -> DegradedModelRecord | None:
        """Count a failure; returns the record when this one marks the model degraded."""
        now = self._clock()
        recent = self._failures.setdefault(model, deque())
        recent.append((now, kind))
        while recent and recent[0][0] < now - self.window_s:
            recent.popleft()
        if len(recent) < self.threshold or self.is_model_degraded(model):
            return None
        record = DegradedModelRecord(
            model=model,
            reason=kind,
            failures=len(recent),
            since=now,
            until=now + self.cooldown_s,
            fallback=self._fallbacks.get(model),
        )
        self._degraded[model] = record
        return record

    def record_success(self, model: str) -> None:
        """The model answered: its failures and any degradation are cleared."""
        self._failures.pop(model, None)
        self._degraded.pop(model, None)

    # -- reads (the reference's surface) -----------------------------------------------------
    def _expire(self) -> None:
        now = self._clock()
        for model in [m for m, r in self._degraded.items() if r.until <= now]:
            del self._degraded[model]
            self._failures.pop(model, None)

    def is_model_degraded(self, model: str) -> bool:
        self._expire()
        return model in self._degraded

    def get_degraded_models(self) -> list[str]:
        self._expire()
        return sorted(self._degraded)

    def get_degraded_model_record(self, model: str) -> DegradedModelRecord | None:
        self._expire()
        return self._degraded.get(model)

    def route(self, model: str) -> str:
        """The model to call for ``model``: itself, or while it is degraded its fallback
        (following the chain while fallbacks are degraded too; never in a circle). With no
        healthy fallback, the model itself (a degraded model beats no answer)."""
        seen = {model}
        current = model
        while self.is_model_degraded(current):
            nxt = self._fallbacks.get(current)
            if nxt is None or nxt in seen:
                return model
            seen.add(nxt)
            current = nxt
        return current
