"""Sizes are bounded: no record can wedge an outbox, no page makes a huge frame.

A message too large to sync is refused before anything is written; a tool's huge output is
cut; a flush of large records goes in several frames under the server's limit; a device
catches up on large records through pages cut by bytes. Real server, real SQLite files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pleach_client.providers.scripted import ScriptedProvider, ScriptedReply
from pleach_client.runtime import SessionRuntime
from pleach_client.store.sqlite import SQLiteAdapter
from pleach_client.tools import Tool
from pleach_client.turn import MAX_MESSAGE_BYTES, MAX_TOOL_RESULT_CHARS
from pleach_server.auth import issue_token
from pleach_server.server import SyncServer
from pleach_server.store import SQLiteServerStore, Tenant
from shared.errors import RecordTooLarge
from shared.records import Message

SECRET = b"bounded-test-secret"
ALICE = Tenant(org_id="acme", user_id="alice")
TIMEOUT = 30.0


def runtime(path: Path, provider: ScriptedProvider | None = None, **kw: object) -> SessionRuntime:
    return SessionRuntime(
        SQLiteAdapter(path),
        provider or ScriptedProvider(),
        org_id=ALICE.org_id,
        user_id=ALICE.user_id,
        **kw,  # type: ignore[arg-type]
    )


async def say(rt: SessionRuntime, session_id: str, text: str) -> None:
    async for _ in rt.execute_message(session_id, text):
        pass


async def test_a_message_too_large_to_sync_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    async with runtime(tmp_path / "d.db") as rt:
        session_id = (await rt.create_session(title="x")).id
        before = (await rt.store.outbox_count(), await rt.store.get_session(session_id))
        with pytest.raises(RecordTooLarge, match="over the"):
            await say(rt, session_id, "x" * (MAX_MESSAGE_BYTES + 1))
        assert (await rt.store.outbox_count(), await rt.store.get_session(session_id)) == before
        await say(rt, session_id, "a normal message goes on")
        assert [m.role for m in await rt.sessions.messages(session_id)] == ["user", "assistant"]


async def test_a_huge_tool_output_is_cut_and_the_turn_commits(tmp_path: Path) -> None:
    provider = ScriptedProvider(
        [ScriptedReply(text="reading", tool_calls=[("dump", {})]), ScriptedReply(text="done")]
    )
    tool = Tool("dump", "dumps", {"type": "object", "properties": {}}, lambda _: "y" * 3_000_000)
    async with runtime(tmp_path / "d.db", provider, tools=[tool]) as rt:
        session_id = (await rt.create_session(title="x")).id
        await say(rt, session_id, "dump it")
        messages = await rt.sessions.messages(session_id)
        (result,) = [b for m in messages for b in m.content if b.get("type") == "tool_result"]
        assert len(result["content"]) < MAX_TOOL_RESULT_CHARS + 100
        assert "more characters cut" in result["content"]
        assert await rt.store.outbox_count() > 0


async def test_large_records_push_in_frames_under_the_limit_and_pull_in_byte_pages(
    tmp_path: Path,
) -> None:
    """Eight messages of 600 KB each: one 200-row batch would be a 5 MB frame, over the
    server's 4 MiB limit (3005 for ever, before); now each frame stays under it. A second
    device pulls them in pages of at most 1 MiB of records. (No rate limits: the turns'
    9.6 MB, the scripted replies echoing each message, are more than the byte rate's burst,
    and a fast machine pushes them within it: 3008 for the last frames.)"""
    big = ["z" * 600_000 + f" {i}" for i in range(8)]
    async with (
        SQLiteServerStore(tmp_path / "server.db", synchronous="NORMAL") as store,
        SyncServer(
            store, port=0, secret=SECRET, rate_limit_per_s=None, rate_limit_bytes_per_s=None
        ) as srv,
    ):
        token = issue_token(SECRET, ALICE, 3600)
        async with runtime(tmp_path / "a.db") as a:
            session_id = (await a.create_session(title="big")).id
            for text in big:
                await say(a, session_id, text)
            receipt = await a.sync.sync_once(srv.url, token, timeout=TIMEOUT)
            assert receipt.outcome == "all-flushed" and receipt.failed_entries == [], receipt
            assert (await a.sync.status()).dead_letters == 0
        pages: list[int] = []
        async with runtime(tmp_path / "b.db") as b:
            original = b.sync._apply  # count the pages B applies (each one pull answer)

            async def counting(changes: list, to_cursor: int, bodies: Any = None) -> int:  # type: ignore[type-arg]
                pages.append(
                    sum(
                        len(c.record.content[0].get("text", ""))
                        for c in changes
                        if isinstance(c.record, Message)
                    )
                )
                return await original(changes, to_cursor, bodies)

            b.sync._apply = counting  # type: ignore[method-assign]
            await b.sync.sync_once(srv.url, token, timeout=TIMEOUT)
            texts = [
                m.content[0]["text"]
                for m in await b.sessions.messages(session_id)
                if m.role == "user"
            ]
        assert texts == big
        assert len(pages) >= 4 and max(pages) <= 2 * 1024 * 1024


async def test_a_garbage_artifact_update_from_a_peer_leaves_the_artifact_readable(
    tmp_path: Path,
) -> None:
    """A device (buggy or hostile) pushes an artifact update that is not a valid one: the
    other devices still read the artifact, from every valid update, and go on syncing."""
    import msgspec

    from shared.records import ArtifactUpdate

    async with (
        SQLiteServerStore(tmp_path / "server.db", synchronous="NORMAL") as store,
        SyncServer(store, port=0, secret=SECRET, rate_limit_per_s=None) as srv,
    ):
        token = issue_token(SECRET, ALICE, 3600)
        async with runtime(tmp_path / "a.db") as a:
            session_id = (await a.create_session(title="doc")).id
            receipt = await a.artifacts.create(session_id, "hello")
            await a.artifacts.append(receipt.artifact_id, " world")
            good = (await a.store.list_artifact_updates(receipt.artifact_id))[0]
            poison = msgspec.structs.replace(
                good, id="0" + good.id[1:], update=b"not a crdt update", hlc=a.core.now()
            )
            await a.core.write(records=[poison])
            assert isinstance(poison, ArtifactUpdate)
            await a.sync.sync_once(srv.url, token, timeout=TIMEOUT)
            assert await a.artifacts.text(receipt.artifact_id) == "hello world"
        async with runtime(tmp_path / "b.db") as b:
            await b.sync.sync_once(srv.url, token, timeout=TIMEOUT)
            assert await b.artifacts.text(receipt.artifact_id) == "hello world"
            await b.artifacts.append(receipt.artifact_id, "!")
            assert await b.artifacts.text(receipt.artifact_id) == "hello world!"


async def test_a_device_refuses_a_poisoned_session_from_a_page_and_keeps_syncing(
    tmp_path: Path,
) -> None:
    """Whatever a peer (or a hostile server) sends, one bad record is refused alone: a
    version vector that would overflow the next bump does not block the session's turns."""
    import msgspec

    from shared.records import FeedChange

    async with runtime(tmp_path / "d.db") as rt:
        session_id = (await rt.create_session(title="mine")).id
        await say(rt, session_id, "before")
        row = await rt.store.get_session(session_id)
        assert row is not None
        poisoned = msgspec.structs.replace(row, vv={"peer": 2**63 - 1}, title="poisoned")
        other = msgspec.structs.replace(row, id="0" + row.id[1:], vv={"peer": 1}, title="fine")
        page = [FeedChange(cursor=1, record=poisoned), FeedChange(cursor=2, record=other)]
        await rt.sync._apply(page, 2)  # a page as the sync loop applies it
        assert (await rt.store.get_session(session_id)).title == "mine"  # type: ignore[union-attr]
        assert (await rt.store.get_session(other.id)) is not None
        await say(rt, session_id, "after")  # turns on that session go on
        texts = [m.content[0]["text"] for m in await rt.sessions.messages(session_id)]
        assert [t for t in texts if t in ("before", "after")] == ["before", "after"]
