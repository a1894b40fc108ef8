"""``DeviceCore``: one owner of the device's state, and a write path that never overwrites.

Two runtimes on one SQLite file (two connections, as two processes would have), a turn that
commits after its session changed underneath it, and a runtime whose caches are stale: in each
case every message stays in the transcript and both chains verify.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import msgspec
import pytest

from pleach_client.core import SessionChange, existing
from pleach_client.providers.scripted import ScriptedProvider, ScriptedReply
from pleach_client.runtime import SessionConfigError, SessionRuntime
from pleach_client.store.base import WriteBatch
from pleach_client.store.memory import MemoryAdapter
from pleach_client.store.sqlite import SQLiteAdapter
from pleach_client.tools import Tool
from shared.errors import NotFound, PleachError


async def turn(rt: SessionRuntime, session_id: str, text: str) -> None:
    async for _ in rt.execute_message(session_id, text):
        pass


async def user_texts(rt: SessionRuntime, session_id: str) -> list[str]:
    return [
        block["text"]
        for m in await rt.sessions.messages(session_id)
        if m.role == "user"
        for block in m.content
        if block.get("type") == "text"
    ]


async def chains_ok(rt: SessionRuntime, session_id: str) -> None:
    report = await rt.events.verify_chain(session_id)
    assert report.ok, report
    audit = await rt.audit.verify_chain()
    assert audit.ok, audit


async def test_two_runtimes_on_one_file_interleave_without_losing_or_breaking(
    tmp_path: Path,
) -> None:
    path = tmp_path / "device.db"
    async with (
        SessionRuntime(SQLiteAdapter(path), ScriptedProvider()) as a,
        SessionRuntime(SQLiteAdapter(path), ScriptedProvider()) as b,
    ):
        assert a.client_id == b.client_id  # one device file, one device
        shared = await a.create_session(title="shared")
        other = await b.create_session(title="other")
        # Each runtime's caches go stale as soon as the other writes; run them at once.
        await asyncio.gather(
            *(turn(a, shared.id, f"a{i}") for i in range(6)),
            *(turn(b, shared.id, f"b{i}") for i in range(6)),
            *(turn(a, other.id, f"c{i}") for i in range(4)),
            *(turn(b, other.id, f"d{i}") for i in range(4)),
        )
        texts = await user_texts(a, shared.id)
        assert sorted(texts) == sorted([f"a{i}" for i in range(6)] + [f"b{i}" for i in range(6)])
        assert sorted(await user_texts(b, other.id)) == sorted(
            [f"c{i}" for i in range(4)] + [f"d{i}" for i in range(4)]
        )
        for rt in (a, b):
            await chains_ok(rt, shared.id)
            await chains_ok(rt, other.id)
        # The outbox holds one row per record written, by either runtime.
        assert (await a.sync.status()).pending == (await b.sync.status()).pending > 0


async def test_a_turn_commits_onto_the_row_as_it_is_at_commit_time(tmp_path: Path) -> None:
    gate = asyncio.Event()
    entered = asyncio.Event()

    async def wait_for_gate(_: dict[str, Any]) -> str:
        entered.set()
        await gate.wait()
        return "opened"

    provider = ScriptedProvider(
        [
            ScriptedReply(text="let me wait", tool_calls=[("gate", {})]),
            ScriptedReply(text="done"),
        ]
    )
    tool = Tool("gate", "waits", {"type": "object", "properties": {}}, wait_for_gate)
    async with SessionRuntime(SQLiteAdapter(tmp_path / "d.db"), provider, tools=[tool]) as rt:
        handle = await rt.create_session()
        running = asyncio.create_task(turn(rt, handle.id, "slow turn"))
        await entered.wait()
        # While the turn is in flight, the row changes (a rename here; a remote page, a
        # resolve or another process's turn alike).
        renamed = await rt.sessions.rename(handle.id, "renamed meanwhile")
        gate.set()
        await running
        row = await rt.store.get_session(handle.id)
        assert row is not None
        assert row.title == "renamed meanwhile"  # the rename was not overwritten
        assert await user_texts(rt, handle.id) == ["slow turn"]
        assert row.vv[rt.client_id] == renamed.vv[rt.client_id] + 1
        await chains_ok(rt, handle.id)


async def test_stale_caches_are_dropped_when_another_process_wrote(tmp_path: Path) -> None:
    path = tmp_path / "device.db"
    async with SessionRuntime(SQLiteAdapter(path), ScriptedProvider()) as a:
        handle = await a.create_session()
        await turn(a, handle.id, "one")
        async with SessionRuntime(SQLiteAdapter(path), ScriptedProvider()) as b:
            await turn(b, handle.id, "two")
            await b.sessions.rename(handle.id, "from b")
        # ``a`` still holds the session and both chain heads from before b wrote.
        await turn(a, handle.id, "three")
        assert await user_texts(a, handle.id) == ["one", "two", "three"]
        row = await a.store.get_session(handle.id)
        assert row is not None and row.title == "from b"
        await chains_ok(a, handle.id)


async def test_a_failed_edit_writes_nothing_and_keeps_the_core_usable() -> None:
    async with SessionRuntime(MemoryAdapter(), ScriptedProvider()) as rt:
        handle = await rt.create_session()
        before = await rt.sync.status()

        def boom(current: Any) -> SessionChange:
            raise RuntimeError("edit failed")

        with pytest.raises(RuntimeError):
            await rt.core.write([(handle.id, existing(boom))])
        assert (await rt.sync.status()).pending == before.pending
        await turn(rt, handle.id, "still works")
        await chains_ok(rt, handle.id)
        with pytest.raises(NotFound):
            await rt.core.write([("no-such-session", existing(boom))])


async def test_delete_in_a_fresh_runtime_chains_on_and_cascades(tmp_path: Path) -> None:
    path = tmp_path / "device.db"
    async with SessionRuntime(SQLiteAdapter(path), ScriptedProvider()) as rt:
        handle = await rt.create_session()
        await turn(rt, handle.id, "one")
        ids = (await rt.store.get_session(handle.id)).state.message_ids  # type: ignore[union-attr]
    async with SessionRuntime(SQLiteAdapter(path), ScriptedProvider()) as rt:
        receipt = await rt.delete_session(handle.id)
        assert receipt.deleted and not receipt.removed_from_cache
        assert receipt.checkpoints_removed == 1
        events = await rt.store.list_events(handle.id)
        assert events[-1].type == "session.deleted" and events[-1].sequence_number > 1
        await chains_ok(rt, handle.id)
        assert await rt.store.get_messages(ids) == []
        assert await rt.checkpoints.list(handle.id) == []
        # The tombstone syncs; the contents never will.
        pending = [e.record for e in await rt.store.outbox_pending(1000)]
        assert not any(getattr(r, "id", None) in ids for r in pending)
        assert any(getattr(r, "deleted", False) for r in pending)
        with pytest.raises(NotFound):
            await turn(rt, handle.id, "after delete")


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"provider": {"kind": "x"}}, "provider"),
        ({"provider": {"type": "scripted", "extra": 1}}, "provider"),
        ({"model": 42}, "model"),
        ({"model": {"id": ""}}, "model"),
        ({"tools": {"bogus": 1}}, "tools"),
        ({"tools": "calculator"}, "tools"),
        ({"title": 3}, "title"),
        ({"colour": "blue"}, "colour"),
    ],
)
async def test_session_config_is_checked_before_anything_is_written(
    config: dict[str, Any], field: str
) -> None:
    async with SessionRuntime(MemoryAdapter(), ScriptedProvider()) as rt:
        with pytest.raises(SessionConfigError, match=field) as info:
            await rt.create_session(**config)
        assert isinstance(info.value, PleachError) and isinstance(info.value, ValueError)
        assert await rt.sessions.list() == []


async def test_the_reference_config_shape_equals_plain_values() -> None:
    async with SessionRuntime(MemoryAdapter(), ScriptedProvider()) as rt:
        nested = await rt.create_session(
            provider={"type": "scripted"},
            model={"id": "scripted-1"},
            tools={"enabled": ["calculator"]},
        )
        plain = await rt.create_session(
            provider="scripted", model="scripted-1", tools=["calculator"]
        )
        strip = {"id", "hlc", "created_at", "updated_at"}
        a = {k: v for k, v in msgspec.structs.asdict(nested.record).items() if k not in strip}
        b = {k: v for k, v in msgspec.structs.asdict(plain.record).items() if k not in strip}
        assert a == b
        await turn(rt, nested.id, "works")
        assert len(await rt.sessions.list()) == 2


async def test_deleting_a_forks_origin_leaves_the_fork_whole(tmp_path: Path) -> None:
    async with SessionRuntime(SQLiteAdapter(tmp_path / "d.db"), ScriptedProvider()) as rt:
        origin = await rt.create_session()
        await turn(rt, origin.id, "one")
        await turn(rt, origin.id, "two")
        await rt.artifacts.create(origin.id, "notes")
        checkpoints = await rt.checkpoints.list(origin.id)
        fork = await rt.checkpoints.fork(origin.id, checkpoints[0].id)
        whole = await rt.checkpoints.fork(origin.id)
        origin_ids = (await rt.store.get_session(origin.id)).state.message_ids  # type: ignore[union-attr]
        # A user's fork holds its own copies: it never depends on its origin.
        whole_row = await rt.store.get_session(whole.session_id)
        assert whole_row is not None and not set(whole_row.state.message_ids) & set(origin_ids)
        (artifact_id,) = whole_row.state.artifacts
        await rt.delete_session(origin.id)
        assert await rt.store.get_messages(origin_ids) == []
        assert await user_texts(rt, fork.session_id) == ["one"]
        assert await user_texts(rt, whole.session_id) == ["one", "two"]
        assert await rt.artifacts.text(artifact_id) == "notes"
        await turn(rt, fork.session_id, "three")
        assert await user_texts(rt, fork.session_id) == ["one", "three"]


async def test_deleting_a_session_keeps_what_its_conflict_fork_shares(tmp_path: Path) -> None:
    async with SessionRuntime(SQLiteAdapter(tmp_path / "d.db"), ScriptedProvider()) as rt:
        origin = await rt.create_session()
        await turn(rt, origin.id, "one")
        await turn(rt, origin.id, "two")
        row = await rt.store.get_session(origin.id)
        assert row is not None
        shared_ids = row.state.message_ids[:2]
        # A conflict fork as the server makes it: the loser's state, referring to the
        # origin's messages and its checkpoint lineage.
        conflict_fork = msgspec.structs.replace(
            row,
            id="conflict-fork",
            vv={"srv": 1},
            forked_from=origin.id,
            conflict_id="c-1",
            conflict_loser_side="remote",
            state=msgspec.structs.replace(row.state, message_ids=shared_ids),
        )
        await rt.store.commit(WriteBatch(records=[conflict_fork], outbox=False))
        await rt.delete_session(origin.id)
        assert [m.id for m in await rt.store.get_messages(row.state.message_ids)] == shared_ids
        assert await user_texts(rt, "conflict-fork") == ["one"]
        kept = await rt.store.get_checkpoint(row.head_checkpoint_id)  # type: ignore[arg-type]
        assert kept is not None  # the fork's head and its parents stay


async def test_a_users_fork_of_a_kept_session_does_not_carry_its_mark(tmp_path: Path) -> None:
    """A session the server kept beside a delete names its deleted origin
    (``SessionState.kept_from``), and the server spares that origin's content while it
    lives. A user's fork holds copies: it must not carry the mark on, or the origin's
    content would stay on the server as long as the fork does."""
    async with SessionRuntime(SQLiteAdapter(tmp_path / "d.db"), ScriptedProvider()) as rt:
        session = await rt.create_session()
        await turn(rt, session.id, "one")
        row = await rt.store.get_session(session.id)
        assert row is not None
        kept = msgspec.structs.replace(
            row, state=msgspec.structs.replace(row.state, kept_from="deleted-origin")
        )
        # Written under the runtime (as a pulled page would be), read by a fresh one.
        await rt.store.commit(WriteBatch(records=[kept], outbox=False))
    async with SessionRuntime(SQLiteAdapter(tmp_path / "d.db"), ScriptedProvider()) as rt:
        await turn(rt, session.id, "two")  # a device's later version keeps the mark
        again = await rt.store.get_session(session.id)
        assert again is not None and again.state.kept_from == "deleted-origin"
        fork = await rt.checkpoints.fork(session.id)
        fork_row = await rt.store.get_session(fork.session_id)
        assert fork_row is not None and fork_row.state.kept_from is None
        assert await user_texts(rt, fork.session_id) == ["one", "two"]


async def test_a_device_that_lacks_what_a_fork_refers_to_resyncs_once(tmp_path: Path) -> None:
    from shared.clock import HybridClock
    from shared.records import Change
    from tests.test_sync_e2e import ALICE, Cluster

    async with contextlib.AsyncExitStack() as stack:
        cluster = Cluster(tmp_path, stack)
        await cluster.start_server()
        try:
            laptop = await cluster.device("laptop")
            session = await laptop.create_session()
            await turn(laptop, session.id, "shared by a fork")
            await laptop.sync.connect(cluster.url, cluster.token())
            assert await laptop.sync.wait_until_synced(timeout=20)
            await laptop.sync.disconnect()
            row = await laptop.store.get_session(session.id)
            assert row is not None
            ids = row.state.message_ids
            # Offline, the laptop deletes the session: its messages go from the laptop.
            await laptop.delete_session(session.id)
            assert await laptop.store.get_messages(ids) == []
            # Meanwhile the server got a fork that shares them (as a conflict fork does).
            fork = msgspec.structs.replace(
                row,
                id="fork-of-deleted",
                client_id="phone",
                vv={"phone": 1},
                forked_from=session.id,
                conflict_id="c-1",
                conflict_loser_side="remote",
            )
            assert cluster.store is not None
            await cluster.store.push(
                ALICE, "phone", [Change(client_seq=1, record=fork)], HybridClock("srv")
            )
            # Back online: the delete leaves the fork's messages on the server; the laptop
            # takes the fork, sees it lacks them, and reads the feed again once.
            await laptop.sync.connect(cluster.url, cluster.token())
            assert await laptop.sync.wait_until_synced(timeout=20)
            texts = await user_texts(laptop, "fork-of-deleted")
            assert texts == ["shared by a fork"]
            assert (await laptop.sync.status()).dead_letters == 0
        finally:
            await stack.aclose()
            if cluster.server is not None:
                await cluster.stop_server()


async def test_a_warm_turn_hands_nothing_to_the_connections_thread(tmp_path: Path) -> None:
    """Once the core holds the session, a turn speaks to the SQLite connection's thread not
    at all: the look whether another process wrote (``_check_generation``) reads on the
    caller's thread (``peek_meta``), and the commit, planned on the meta the store saw after
    its last commit, is written there too with the check that nothing changed since
    (``Rerunnable``, ``_write_in_place``). Each hop is a thread handoff, which costs more
    than the SQLite work of a turn's rows."""
    store = SQLiteAdapter(tmp_path / "d.db")
    async with SessionRuntime(store, ScriptedProvider()) as rt:
        handle = await rt.create_session()
        await turn(rt, handle.id, "warm up")
        conn = store._conn
        assert conn is not None
        hops: list[str] = []
        execute = conn._execute

        async def counted(fn: Any, *args: Any, **kwargs: Any) -> Any:
            hops.append(getattr(fn, "__name__", "?"))
            return await execute(fn, *args, **kwargs)

        conn._execute = counted  # type: ignore[method-assign]
        for i in range(3):
            hops.clear()
            await turn(rt, handle.id, f"turn {i}")
            assert hops == [], hops
        assert await user_texts(rt, handle.id) == ["warm up", "turn 0", "turn 1", "turn 2"]
        await chains_ok(rt, handle.id)
