"""Reading a peer's event payload: every event in a session's log may come from another
device, so a payload is checked against its expected shape and a malformed one is refused
alone (logged, skipped), never raised: one bad record never stops a fold."""

from __future__ import annotations

import logging
from typing import TypeVar

import msgspec

from shared.records import Event

__all__ = ["read_payload"]

log = logging.getLogger("pleach.events")
T = TypeVar("T")


def read_payload(event: Event, kind: type[T]) -> T | None:
    """``event.payload`` as ``kind``, or None (and a warning) when it does not fit."""
    try:
        return msgspec.convert(event.payload, kind)
    except msgspec.ValidationError as exc:
        log.warning("%s event %s refused: malformed payload: %s", event.type, event.id, exc)
        return None
