"""Resume folds the session's log reading only the event types the fold uses.

``sessions.resume`` asks the store for the events of ``HYDRATED_EVENTS`` alone (the others are
not decoded). Generated logs, with every type the fold knows, types it does not and payloads
of every shape, fold to the same state from that selection as from the whole log, and a
stored log read back through each store gives the same selection.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from pleach_client.runtime import HYDRATED_EVENTS, hydrate
from pleach_client.store.base import WriteBatch
from pleach_client.store.memory import MemoryAdapter
from pleach_client.store.sqlite import SQLiteAdapter
from shared.records import Event
from tests.factories import log_event

# Every type the runtime writes, named here rather than taken from HYDRATED_EVENTS, so a type
# the fold reads but the selection leaves out makes the folds differ.
TYPES = [
    "session.created",
    "session.saved",
    "session.tools",
    "session.deleted",
    "message.added",
    "message.complete",
    "checkpoint.created",
    "checkpoint.rollback",
    "artifact.created",
    "turn.started",
    "turn.stopped",
    "turn.complete",
    "error",
    "tool.completed",
    "tool.failed",
    "sync.conflict",
    "interrupt.requested",
    "interrupt.decided",
    "interrupt.resolved",
    "job.queued",
    "job.started",
    "job.progress",
    "job.completed",
    "job.failed",
    "job.cancelled",
    "job.cancel_requested",
    "subagent.started",
    "subagent.completed",
    "custom.note",
]
IDS = ["a", "b", "c"]
PAYLOADS = st.one_of(
    st.fixed_dictionaries({"outcome": st.sampled_from(["ok", "user-aborted", "error"])}),
    st.fixed_dictionaries({"conflict_id": st.sampled_from(IDS)}),
    st.fixed_dictionaries(
        {"job_id": st.sampled_from(IDS), "name": st.just("j"), "progress": st.floats(0, 1)}
    ),
    st.fixed_dictionaries(
        {
            "interrupt_id": st.sampled_from(IDS),
            "tool_call_id": st.sampled_from(IDS),
            "decision": st.sampled_from(["approve", "reject"]),
        }
    ),
    st.fixed_dictionaries({"subagent_id": st.sampled_from(IDS), "status": st.just("ok")}),
    st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5), max_size=3),
)


@st.composite
def logs(draw: st.DrawFn) -> list[Event]:
    types = st.sampled_from(TYPES)
    return [
        log_event(draw(st.sampled_from(["d1", "d2"])), draw(types), draw(PAYLOADS), n)
        for n in range(draw(st.integers(0, 40)))
    ]


@settings(max_examples=300, deadline=None)
@given(logs())
def test_the_selected_types_fold_like_the_whole_log(events: list[Event]) -> None:
    selected = [e for e in events if e.type in HYDRATED_EVENTS]
    assert hydrate(selected) == hydrate(events)


async def test_each_store_returns_the_selection(tmp_path: Path) -> None:
    for seed in range(5):
        numbered = [
            msgspec.structs.replace(e, sequence_number=n) for n, e in enumerate(_log(seed), start=1)
        ]
        stores = (MemoryAdapter(), SQLiteAdapter(tmp_path / f"{seed}.db"))
        for store in stores:
            async with store:
                await store.commit(WriteBatch(records=list(numbered)))
                got = await store.list_events("s", types=HYDRATED_EVENTS)
                assert got == [e for e in numbered if e.type in HYDRATED_EVENTS]
                assert hydrate(got) == hydrate(await store.list_events("s"))


def _log(seed: int) -> list[Event]:
    """A log of 200 events drawn from every type, seeded."""
    rng = random.Random(seed)
    types = TYPES
    payloads: list[dict[str, Any]] = [
        {"outcome": "user-aborted"},
        {"conflict_id": "a"},
        {"job_id": "a", "name": "j"},
        {"interrupt_id": "b", "tool_call_id": "c"},
        {"subagent_id": "c"},
        {},
    ]
    return [
        log_event(rng.choice(["d1", "d2"]), rng.choice(types), rng.choice(payloads), n)
        for n in range(200)
    ]
