"""Resume folds the session's log reading only the event types the fold uses.

``sessions.resume`` asks the store for the events of ``HYDRATED_EVENTS`` alone (the others are
not decoded). Generated logs, with every type the fold knows, types it does not and payloads
of every shape, fold to the same state from that selection as from the whole log, and a
stored log read back through each store gives the same selection.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pleach_client.hydration import (
    HYDRATED_EVENTS,
    HYDRATION_VERSION,
    TALLIED_EVENTS,
    LogFold,
    fold_log,
    hydrate,
    hydrated,
    load_hydration,
    next_step,
)
from pleach_client.store.base import KeptHydration, WriteBatch
from pleach_client.store.memory import MemoryAdapter
from pleach_client.store.sqlite import SQLiteAdapter
from shared.errors import StorageError
from shared.hashchain import chain_event
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


# -- the fold kept between resumes -----------------------------------------------------------


RICH_TYPES = [t for t in TYPES if t.split(".")[0] in ("interrupt", "job", "subagent")] + [
    "turn.complete",
    "sync.conflict",
    "tool.failed",
    "message.added",
]
"""The types ``rich_logs`` draws: each one the fold carries state for, and one it skips."""


@st.composite
def rich_logs(draw: st.DrawFn) -> list[Event]:
    """Logs whose interrupt, job and subagent events are well formed and refer to earlier
    ones (or to none), with the tallied types among them: each fold has state to carry."""
    events: list[Event] = []
    asked: list[str] = []
    jobs: list[str] = []
    subagents = ["sa-1", "sa-2"]

    def earlier(ids: list[str]) -> str:
        return draw(st.sampled_from([*ids, "unknown"]))

    for n in range(draw(st.integers(0, 30))):
        kind = draw(st.sampled_from(RICH_TYPES))
        decision = draw(
            st.sampled_from(
                [
                    {"kind": "approve"},
                    {"kind": "reject", "reason": "no"},
                    {"kind": "edit", "input": {"x": 1}},
                ]
            )
        )
        payload: dict[str, Any] = {}
        match kind:
            case "interrupt.requested":
                payload = {
                    "turn_id": "t",
                    "tool_call": {"id": f"call-{n}", "name": "tool", "input": {"n": n}},
                    "decisions": ["approve", "reject"],
                }
            case "interrupt.decided":
                payload = {"interrupt_id": earlier(asked), "decision": decision}
            case "interrupt.resolved":
                payload = {
                    "interrupt_id": earlier(asked),
                    "decision": decision,
                    "decided_by": "d2",
                    "source": draw(st.sampled_from(["user", "timeout"])),
                }
            case "job.queued":
                payload = {"name": "job", "input": {"n": n}}
            case "job.started":
                payload = {"job_id": earlier(jobs), "attempt": draw(st.integers(1, 3))}
            case "job.progress":
                payload = {"job_id": earlier(jobs), "progress": 0.5, "message": "half"}
            case "job.completed":
                payload = {"job_id": earlier(jobs), "result": {"ok": n}}
            case "job.failed":
                payload = {"job_id": earlier(jobs), "error": "boom"}
            case "job.cancel_requested" | "job.cancelled":
                payload = {"job_id": earlier(jobs), "reason": "enough"}
            case "subagent.started":
                payload = {"subagent_id": draw(st.sampled_from(subagents)), "title": "sub"}
            case "subagent.completed":
                payload = {
                    "subagent_id": draw(st.sampled_from(subagents)),
                    "turn_id": "t",
                    "outcome": "ok",
                    "cost_usd": 0.25,
                }
            case "turn.complete":
                payload = {"outcome": draw(st.sampled_from(["ok", "user-aborted"]))}
            case "sync.conflict":
                payload = {"conflict_id": f"conflict-{n}"}
        event = log_event(draw(st.sampled_from(["d1", "d2"])), kind, payload, n)
        if kind == "interrupt.requested":
            asked.append(event.id)
        elif kind == "job.queued":
            jobs.append(event.id)
        events.append(event)
    return events


_FOLDS = msgspec.msgpack.Decoder(LogFold)


@settings(max_examples=300, deadline=None)
@given(rich_logs(), st.data())
def test_a_log_folded_in_two_parts_through_its_kept_bytes_folds_as_whole(
    events: list[Event], data: st.DataObject
) -> None:
    at = data.draw(st.integers(0, len(events)))
    first = fold_log(events[:at])
    kept = _FOLDS.decode(msgspec.msgpack.encode(first))
    assert kept == first  # the kept bytes give the fold back
    assert hydrated(fold_log(events[at:], start=kept)) == hydrate(events)


def test_the_generated_logs_carry_state_across_a_split() -> None:
    """The property above is not empty: the generator makes interrupts, jobs and subagents
    that later events change."""
    whole = hydrate([])
    seen = {"interrupts": False, "jobs": False, "subagents": False}

    @settings(max_examples=200, deadline=None)
    @given(rich_logs())
    def look(events: list[Event]) -> None:
        state = hydrate(events)
        for name in seen:
            if any(
                item.get("status") not in (None, "pending", "queued", "running")
                for item in state[name]
            ):
                seen[name] = True

    look()
    assert whole["turns"] == 0 and all(seen.values()), seen


def test_the_next_step_of_a_kept_fold() -> None:
    log = (5, 9, "h9")
    assert next_step(None, log) == "whole"
    assert next_step((0, 0, ""), log) == "whole"  # nothing was folded
    assert next_step(log, log) == "kept"
    assert next_step((3, 7, "h7"), log) == "tail"  # a beginning of it, maybe: checked next
    assert next_step((5, 7, "h7"), log) == "whole"  # as many events: not a beginning
    assert next_step((3, 9, "x"), log) == "whole"  # ends at the same place: rebased
    assert next_step((6, 12, "h12"), log) == "whole"  # longer: another log
    assert next_step((0, 0, ""), (0, 0, "")) == "whole"


def _chained(events: list[Event], prev: str = "", first: int = 1) -> list[Event]:
    out = []
    for n, event in enumerate(events, start=first):
        out.append(chain_event(event, prev, n))
        prev = out[-1].row_hash
    return out


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_a_resume_folds_only_what_it_did_not_fold_before(tmp_path: Path, kind: str) -> None:
    """The first fold reads the whole log and keeps it; a resume of the same log reads the kept
    fold; after more events it folds those on; and each time the state is the whole log's."""
    store = MemoryAdapter() if kind == "memory" else SQLiteAdapter(tmp_path / "d.db")
    log = _log(3)[:120]
    log[79] = log_event("d1", "turn.complete", {"outcome": "ok"}, 79)  # the kept fold's last
    events = _chained(log)
    async with store:
        await store.commit(WriteBatch(records=events[:80]))
        assert await load_hydration(store, "s") == (hydrate(events[:80]), "whole")
        assert await load_hydration(store, "s") == (hydrate(events[:80]), "kept")
        await store.commit(WriteBatch(records=events[80:]))
        assert await load_hydration(store, "s") == (hydrate(events), "tail")
        assert await load_hydration(store, "s") == (hydrate(events), "kept")
        kept = await store.kept_hydration("s")
        assert kept is not None and kept.key == await store.hydration_key("s")
        assert kept.version == HYDRATION_VERSION


@settings(max_examples=150, deadline=None)
@given(rich_logs(), st.data())
def test_a_store_s_log_grown_after_its_fold_was_kept_resumes_as_whole(
    events: list[Event], data: st.DataObject
) -> None:
    """Any log, kept folded at any place, then grown: the next fold folds the rest on."""
    at = data.draw(st.integers(0, len(events)))
    events = _chained(events)

    async def run() -> None:
        async with MemoryAdapter() as store:
            await store.commit(WriteBatch(records=events[:at]))
            await load_hydration(store, "s")
            await store.commit(WriteBatch(records=events[at:]))
            state, step = await load_hydration(store, "s")
            assert state == hydrate(events)
            assert step == ("whole" if at == 0 else "kept" if at == len(events) else "tail")

    asyncio.run(run())


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_a_kept_fold_that_cannot_be_used_is_folded_again(tmp_path: Path, kind: str) -> None:
    store = MemoryAdapter() if kind == "memory" else SQLiteAdapter(tmp_path / "d.db")
    events = _chained(_log(4)[:60])
    want = hydrate(events)
    async with store:
        await store.commit(WriteBatch(records=events))
        await load_hydration(store, "s")
        kept = await store.kept_hydration("s")
        assert kept is not None
        key = kept.key
        for bad in (
            KeptHydration(key, kept.version, b"\xc1 not msgpack"),  # a corrupt row
            KeptHydration(key, kept.version, msgspec.msgpack.encode({"turns": "many"})),
            KeptHydration(key, HYDRATION_VERSION + 1, kept.body),  # another version's fold
            # A fold of a log that ended elsewhere at that place (a rebased tail): the key
            # of the log up to there does not match it.
            KeptHydration((key[0] - 5, key[1] - 5, "0" * 64), kept.version, kept.body),
        ):
            await store.keep_hydration("s", bad)
            assert await load_hydration(store, "s") == (want, "whole")
            assert await store.kept_hydration("s") == kept  # folded again, and kept


async def test_a_log_that_changes_while_it_is_read_is_read_again_and_not_kept(
    tmp_path: Path,
) -> None:
    events = _chained(_log(5)[:50])

    class Busy(SQLiteAdapter):
        """Another writer appends an event while the fold reads the log."""

        async def hydration_log(self, *args: Any, **kwargs: Any) -> Any:
            got = await super().hydration_log(*args, **kwargs)
            if len(await self.list_events("s")) < len(events):
                await self.commit(WriteBatch(records=events[-1:]))
            return got

    async with Busy(tmp_path / "d.db") as store:
        await store.commit(WriteBatch(records=events[:-1]))
        assert await load_hydration(store, "s") == (hydrate(events), "whole")
        assert await store.kept_hydration("s") is None


async def test_a_fold_not_kept_still_gives_the_state(tmp_path: Path) -> None:
    events = _chained(_log(6)[:30])

    class Full(SQLiteAdapter):
        async def keep_hydration(self, session_id: str, kept: KeptHydration) -> None:
            raise StorageError("keep hydration failed: database or disk is full")

    async with Full(tmp_path / "d.db") as store:
        await store.commit(WriteBatch(records=events))
        assert await load_hydration(store, "s") == (hydrate(events), "whole")
        assert await load_hydration(store, "s") == (hydrate(events), "whole")
