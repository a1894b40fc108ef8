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
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pleach_client.runtime import HYDRATED_EVENTS, TALLIED_EVENTS, hydrate
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


@settings(max_examples=300, deadline=None)
@given(logs())
def test_the_tallies_and_the_rest_fold_like_the_whole_log(events: list[Event]) -> None:
    """As resume reads the log: the counted types by type and payload alone, the others
    whole."""
    tallies = [(e.type, e.payload) for e in events if e.type in TALLIED_EVENTS]
    rest = [e for e in events if e.type in HYDRATED_EVENTS - TALLIED_EVENTS]
    assert hydrate(rest, tallies) == hydrate(events)


async def test_each_store_returns_the_tallies(tmp_path: Path) -> None:
    """``event_payloads`` gives each store's events of the types asked, type and payload, in
    chain order; also for a body in the map form (a file older versions wrote)."""
    for seed in range(5):
        numbered = [
            msgspec.structs.replace(e, sequence_number=n) for n, e in enumerate(_log(seed), start=1)
        ]
        wanted = [(e.type, e.payload) for e in numbered if e.type in TALLIED_EVENTS]
        stores = (MemoryAdapter(), SQLiteAdapter(tmp_path / f"{seed}.db"))
        for store in stores:
            async with store:
                await store.commit(WriteBatch(records=list(numbered)))
                assert await store.event_payloads("s", TALLIED_EVENTS) == wanted
                assert await store.event_payloads("s", {"custom.note"}) == [
                    (e.type, e.payload) for e in numbered if e.type == "custom.note"
                ]
                assert await store.event_payloads("s", set()) == []


async def test_each_store_reads_what_resume_folds_in_one_read(tmp_path: Path) -> None:
    """``hydration_log`` gives what ``event_payloads`` and ``list_events(types=...)`` give
    apart, for any split of the types (disjoint, overlapping, empty), in each store."""
    rng = random.Random(11)
    for seed in range(4):
        numbered = [
            msgspec.structs.replace(e, sequence_number=n) for n, e in enumerate(_log(seed), start=1)
        ]
        async with (
            MemoryAdapter() as memory,
            SQLiteAdapter(tmp_path / f"log-{seed}.db") as sqlite,
        ):
            for store in (memory, sqlite):
                await store.commit(WriteBatch(records=list(numbered)))
            splits = [(TALLIED_EVENTS, HYDRATED_EVENTS - TALLIED_EVENTS), (set(), set())]
            splits += [
                (
                    set(rng.sample(TYPES, rng.randint(0, 8))),
                    set(rng.sample(TYPES, rng.randint(0, 8))),
                )
                for _ in range(6)
            ]
            for tallied, whole in splits:
                for store in (memory, sqlite):
                    tallies, events = await store.hydration_log("s", tallied, whole)
                    assert tallies == await store.event_payloads("s", tallied)
                    assert events == await store.list_events("s", types=whole)
                    assert events == [e for e in numbered if e.type in whole]


def test_a_map_form_body_reads_as_its_type_and_payload() -> None:
    from pleach_client.store.base import decode_log
    from shared import compact
    from shared.records import encode_record

    events = _log(7)[:40]
    rows = [(e.id, encode_record(e) if i % 2 else compact.encode(e)) for i, e in enumerate(events)]

    def decode(_: Any, body: bytes) -> Event:
        record = compact.decode(body)  # either form
        assert isinstance(record, Event)
        return record

    got, _ = decode_log(rows, TALLIED_EVENTS, (), decode)
    assert got == [(e.type, e.payload) for e in events if e.type in TALLIED_EVENTS]


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


def test_event_payload_refuses_what_decode_refuses() -> None:
    """A compact body whose payload is no object (a list), or that is not an Event, reads as
    None, so the caller decodes it whole and reports the corrupt row."""
    from shared import compact

    event = _log(3)[0]
    good = compact.encode(event)
    assert compact.event_payload(good) == (event.type, event.payload)
    bad = compact.encode(msgspec.structs.replace(event, payload={"x": "y"})).replace(
        b"\x81\xa1x\xa1y",
        b"\x92\xa1x\xa1y",  # the payload {"x": "y"} as ["x", "y"]
    )
    with pytest.raises(msgspec.ValidationError):
        compact.decode(bad)
    assert compact.event_payload(bad) is None
    assert compact.event_payload(b"\x92\x01\x02") is None  # another kind
    assert compact.event_payload(b"\x81\xa1a\x01") is None  # the map form
    assert compact.event_payload(b"") is None
