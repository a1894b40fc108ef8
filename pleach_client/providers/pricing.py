"""What a Claude call costs: a price table keyed by model-name prefix, and ``cost_usd``.

Prices are USD per million tokens, as published by Anthropic (standard tier, prompts up to
200k tokens). ``cache_write`` is the 5-minute cache write price (1.25x input); ``cache_read``
is the cache hit price (0.1x input). A model is matched by the longest prefix in ``PRICES``, so
dated ids (``claude-sonnet-4-5-20250929``) and aliases (``claude-sonnet-4-5``) both resolve.
An unknown model has no price: ``cost_usd`` returns ``None`` and the caller records no cost.
"""

from __future__ import annotations

import msgspec

__all__ = ["PRICES", "ModelPrice", "cost_usd", "price_for"]


class ModelPrice(msgspec.Struct, frozen=True, kw_only=True):
    """USD per million tokens for each kind of token a call is billed for."""

    input: float
    output: float
    cache_write: float
    cache_read: float


_OPUS_LEGACY = ModelPrice(input=15.0, output=75.0, cache_write=18.75, cache_read=1.50)
_OPUS = ModelPrice(input=5.0, output=25.0, cache_write=6.25, cache_read=0.50)
_SONNET = ModelPrice(input=3.0, output=15.0, cache_write=3.75, cache_read=0.30)
_HAIKU_4 = ModelPrice(input=1.0, output=5.0, cache_write=1.25, cache_read=0.10)
_HAIKU_3_5 = ModelPrice(input=0.80, output=4.0, cache_write=1.0, cache_read=0.08)
_HAIKU_3 = ModelPrice(input=0.25, output=1.25, cache_write=0.30, cache_read=0.03)

PRICES: dict[str, ModelPrice] = {
    # Opus 4 and 4.1 kept the Claude 3 Opus price; Opus 4.5 cut it to a third, and the later
    # 4.x releases kept that, so the bare "claude-opus-4" prefix (4.5 onwards) gets the new one.
    "claude-opus-4-0": _OPUS_LEGACY,
    "claude-opus-4-2025": _OPUS_LEGACY,  # claude-opus-4-20250514
    "claude-opus-4-1": _OPUS_LEGACY,
    "claude-opus-4": _OPUS,
    "claude-sonnet-4": _SONNET,
    "claude-3-7-sonnet": _SONNET,
    "claude-3-5-sonnet": _SONNET,
    "claude-haiku-4": _HAIKU_4,
    "claude-3-5-haiku": _HAIKU_3_5,
    "claude-3-opus": _OPUS_LEGACY,
    "claude-3-haiku": _HAIKU_3,
}

_BY_LONGEST_PREFIX = sorted(PRICES.items(), key=lambda item: len(item[0]), reverse=True)


def price_for(model: str) -> ModelPrice | None:
    """The price of ``model`` (longest matching prefix), or ``None`` if it is not in the table."""
    for prefix, price in _BY_LONGEST_PREFIX:
        if model.startswith(prefix):
            return price
    return None


def cost_usd(
    model: str,
    *,
    input_tokens: int = 0,
    output_tokens: int = 0,
    cache_creation_input_tokens: int = 0,
    cache_read_input_tokens: int = 0,
) -> float | None:
    """The USD cost of one call's usage, or ``None`` for a model with no known price.

    Pass the usage fields as the API reports them: ``input_tokens`` excludes cached tokens,
    which are billed separately. For an aborted call, pass what was already spent (the prefill
    input tokens from ``MessageStart`` and the output tokens seen so far).
    """
    price = price_for(model)
    if price is None:
        return None
    total = (
        input_tokens * price.input
        + output_tokens * price.output
        + cache_creation_input_tokens * price.cache_write
        + cache_read_input_tokens * price.cache_read
    )
    return total / 1_000_000
