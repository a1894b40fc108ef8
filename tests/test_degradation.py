"""``runtime.degradation``: failing models are marked degraded and routed around (pure parts)."""

from __future__ import annotations

import random

import pytest

from pleach_client.degradation import DegradationFacet, failure_kind


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_threshold_failures_within_the_window_degrade_a_model() -> None:
    clock = Clock()
    d = DegradationFacet(threshold=3, window_s=60, cooldown_s=120, clock=clock)
    d.register_fallback("big", "small")
    assert d.record_failure("big", "overloaded") is None
    clock.now += 61  # the first failure falls out of the window
    assert d.record_failure("big", "overloaded") is None
    assert d.record_failure("big", "server_error") is None
    assert not d.is_model_degraded("big") and d.route("big") == "big"
    record = d.record_failure("big", "timeout")
    assert record is not None and record.failures == 3 and record.reason == "timeout"
    assert record.fallback == "small" and record.until == clock.now + 120
    assert d.is_model_degraded("big") and d.get_degraded_models() == ["big"]
    assert d.get_degraded_model_record("big") == record
    assert d.route("big") == "small"
    assert d.get_degraded_model_record("small") is None
    clock.now += 120  # cool-down over: tried again
    assert not d.is_model_degraded("big") and d.route("big") == "big"
    assert d.get_degraded_model_record("big") is None


def test_a_success_clears_the_failures() -> None:
    d = DegradationFacet(threshold=2, clock=Clock())
    d.record_failure("m", "overloaded")
    d.record_success("m")
    assert d.record_failure("m", "overloaded") is None
    assert d.record_failure("m", "overloaded") is not None
    d.record_success("m")
    assert not d.is_model_degraded("m")


def test_routing_never_loops_and_prefers_a_healthy_fallback() -> None:
    d = DegradationFacet(threshold=1, clock=Clock())
    d.register_fallback("a", "b")
    d.register_fallback("b", "c")
    d.register_fallback("c", "a")
    d.record_failure("a", "overloaded")
    d.record_failure("b", "overloaded")
    assert d.route("a") == "c"
    d.record_failure("c", "overloaded")
    assert d.route("a") == "a"  # everyone degraded: the model itself, not a circle
    with pytest.raises(ValueError):
        d.register_fallback("x", "x")


@pytest.mark.parametrize("seed", range(20))
def test_route_is_healthy_when_a_healthy_model_is_reachable(seed: int) -> None:
    """Generated registries and failure sets: ``route`` returns the first healthy model on
    the fallback chain, else the model itself."""
    rng = random.Random(seed)
    models = [f"m{i}" for i in range(6)]
    d = DegradationFacet(threshold=1, clock=Clock())
    for model in models:
        if rng.random() < 0.7:
            d.register_fallback(model, rng.choice([m for m in models if m != model]))
    for model in models:
        if rng.random() < 0.5:
            d.record_failure(model, "server_error")
    fallbacks = d.fallbacks()
    for model in models:
        chain, current = [model], model
        while current in fallbacks and fallbacks[current] not in chain:
            current = fallbacks[current]
            chain.append(current)
        healthy = [m for m in chain if not d.is_model_degraded(m)]
        assert d.route(model) == (healthy[0] if healthy else model)


def test_failure_kinds_of_provider_errors() -> None:
    class OverloadedError(Exception):
        status_code = 529

    class BadRequestError(Exception):
        status_code = 400

    class Status503(Exception):
        status_code = 503

    assert failure_kind(OverloadedError()) == "overloaded"
    assert failure_kind(Status503()) == "server_error"
    assert failure_kind(TimeoutError()) == "timeout"
    assert failure_kind(BadRequestError()) is None
    assert failure_kind(ValueError()) is None
