"""Nothing a user wrote is lost: six reported symptoms, reproduced as a user hits them.

Each test drives the public API with real parts: SQLite files, a real sync server on a free
loopback port, real subprocesses. Each failed before the device core was rebuilt around one
owner of its state (``pleach_client.core``).

Waits are on conditions (``wait_until_synced``, stream events, process output); a timeout is
only a safety net, or a window where there is nothing to wait on (said where it is).
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import AsyncExitStack, aclosing
from pathlib import Path
from typing import Any

import pytest

from pleach_client.providers.base import Provider, ProviderEvent, ProviderRequest
from pleach_client.providers.scripted import ScriptedProvider
from pleach_client.runtime import SessionRuntime
from pleach_client.store.sqlite import SQLiteAdapter
from pleach_client.stream import StreamEventBase
from pleach_server.auth import issue_token
from pleach_server.server import SyncServer
from pleach_server.store import SQLiteServerStore, Tenant
from shared.errors import PleachError

ROOT = Path(__file__).resolve().parent.parent
SECRET = b"test-secret-nothing-lost"
ALICE = Tenant(org_id="acme", user_id="alice")
BOB = Tenant(org_id="acme", user_id="bob")
SAFETY = 30.0  # seconds: a safety net on waits that end on a condition


class Cluster:
    """A server on a free loopback port and the devices connected to it, torn down together."""

    def __init__(self, tmp: Path, stack: AsyncExitStack) -> None:
        self.tmp = tmp
        self.stack = stack
        self.store: SQLiteServerStore | None = None
        self.server: SyncServer | None = None

    async def start(self) -> None:
        self.store = SQLiteServerStore(self.tmp / "server.db")
        await self.store.open()
        self.server = SyncServer(self.store, port=0, secret=SECRET)
        await self.server.start()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.shutdown()
            self.server = None
        if self.store is not None:
            await self.store.close()
            self.store = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"ws://127.0.0.1:{self.server.port}/sync"

    def token(self, tenant: Tenant = ALICE) -> str:
        return issue_token(SECRET, tenant, 3600)

    async def device(
        self,
        name: str,
        tenant: Tenant = ALICE,
        provider: Provider | None = None,
    ) -> SessionRuntime:
        """A runtime on ``<name>.db``; the same name again opens the same file anew."""
        rt = SessionRuntime(
            SQLiteAdapter(self.tmp / f"{name}.db"),
            provider or ScriptedProvider(),
            user_id=tenant.user_id,
            org_id=tenant.org_id,
            client_id=name,
        )
        await self.stack.enter_async_context(rt)
        rt.sync.backoff_initial = 0.01
        rt.sync.backoff_max = 0.2
        return rt

    async def connect(self, *devices: SessionRuntime) -> None:
        for rt in devices:
            await rt.sync.connect(
                self.url, self.token(Tenant(org_id=rt.org_id, user_id=rt.user_id))
            )

    async def settle(self, *devices: SessionRuntime) -> None:
        # Each device's pushes reach the others live; go round a few times.
        for _ in range(3):
            for rt in devices:
                assert await rt.sync.wait_until_synced(SAFETY), await rt.sync.status()

    async def online(self, *devices: SessionRuntime) -> None:
        await self.connect(*devices)
        await self.settle(*devices)

    def pushes_received(self) -> float:
        """Push frames the server has received so far (its Prometheus counter)."""
        assert self.server is not None
        value = self.server.metrics.registry.get_sample_value(
            "pleach_frames_received_total", {"type": "push"}
        )
        return value or 0.0


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with AsyncExitStack() as stack:
        c = Cluster(tmp_path, stack)
        await c.start()
        try:
            yield c
        finally:
            await stack.aclose()
            await c.stop()


async def chat(rt: SessionRuntime, session_id: str, text: str) -> list[StreamEventBase]:
    return [e async for e in rt.execute_message(session_id, text)]


async def user_texts_everywhere(rt: SessionRuntime) -> dict[str, set[str]]:
    """User message texts of every non-deleted session on the device, by session id."""
    out: dict[str, set[str]] = {}
    for session in await rt.sessions.list():
        messages = await rt.store.get_messages(session.state.message_ids)
        out[session.id] = {
            block.get("text", "")
            for m in messages
            if m.role == "user"
            for block in m.content
            if block.get("type") == "text"
        }
    return out


async def assert_kept(rt: SessionRuntime, *texts: str) -> None:
    held = await user_texts_everywhere(rt)
    everything = set().union(*held.values()) if held else set()
    missing = [t for t in texts if t not in everything]
    assert not missing, (
        f"{rt.client_id}: user messages {missing} are in no non-deleted session; "
        f"sessions hold {held}"
    )


# -- 1. resume overlays another branch ------------------------------------------------------


async def test_resume_after_pulling_a_concurrent_version_keeps_the_offline_turn(
    cluster: Cluster,
) -> None:
    a = await cluster.device("a")
    b = await cluster.device("b")
    session = await a.create_session(title="shared")
    await chat(a, session.id, "before the split")
    await cluster.online(a, b)
    await b.resume_session(session.id)

    # A stays connected but pushes nothing by itself (auto=False): its next turn is unpushed.
    await a.sync.connect(cluster.url, cluster.token(), auto=False)
    assert await a.sync.wait_until_synced(SAFETY), await a.sync.status()
    await chat(a, session.id, "written offline on a")
    await chat(b, session.id, "written on b meanwhile")
    await cluster.settle(b)

    # A pulls B's concurrent version before its own push is acknowledged.
    await a.sync.pull()
    assert (await a.sync.status()).pending > 0, "A's offline turn must still be unpushed"
    await a.close()

    a2 = await cluster.device("a")  # a new runtime on the same file
    resumed = await a2.resume_session(session.id)
    b_branch = {c.id for c in await a2.checkpoints.list(session.id) if c.client_id == "b"}
    assert b_branch, "B's checkpoint should have been pulled"
    await chat(a2, session.id, "after reopening a")
    await cluster.online(a2)
    await cluster.settle(a2, b, a2)

    for rt in (a2, b):
        await assert_kept(
            rt,
            "before the split",
            "written offline on a",
            "written on b meanwhile",
            "after reopening a",
        )
    # Resume overlays only a checkpoint of the session's own lineage, never B's branch.
    assert not ("checkpoint" in resumed.layers and resumed.record.head_checkpoint_id in b_branch), (
        f"resume overlaid B's concurrent branch: layers {resumed.layers}, "
        f"head {resumed.record.head_checkpoint_id} is B's"
    )


# -- 2. two processes on one device file ----------------------------------------------------

WRITER_TURNS = 20
ROUNDS = 3


class Writer:
    """One ``tests.writer_proc`` subprocess and what it reported."""

    def __init__(self, proc: asyncio.subprocess.Process, label: str) -> None:
        self.proc = proc
        self.label = label
        self.lines: list[str] = []

    @classmethod
    async def start(cls, db: Path, session_id: str, label: str, turns: int) -> Writer:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.writer_proc",
            str(db),
            session_id,
            label,
            str(turns),
            cwd=ROOT,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        return cls(proc, label)

    async def ready(self) -> bool:
        """Wait for ``ready`` (True) or an early refusal/exit (False)."""
        assert self.proc.stdout is not None
        line = (await self.proc.stdout.readline()).decode().strip()
        self.lines.append(line)
        return line == "ready"

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")

    async def finish(self) -> tuple[int, str]:
        out, err = await self.proc.communicate()
        self.lines.extend(out.decode().splitlines())
        assert self.proc.returncode is not None
        return self.proc.returncode, err.decode()

    @property
    def committed(self) -> list[str]:
        return [
            f"{self.label} {line.split()[1]}" for line in self.lines if line.startswith("committed")
        ]

    @property
    def refusal(self) -> str | None:
        return next((line for line in self.lines if line.startswith("refused:")), None)


async def run_writers(db: Path, targets: list[tuple[str, str]]) -> list[Writer]:
    """Start one writer per ``(session_id, label)``, release them together, wait for all."""
    writers = [await Writer.start(db, sid, label, WRITER_TURNS) for sid, label in targets]
    async with asyncio.timeout(120):  # a safety net: every writer ends by itself
        ready = [await w.ready() for w in writers]
        for w, ok in zip(writers, ready, strict=True):
            if ok:
                w.go()
        results = [await w.finish() for w in writers]
    for w, (code, err) in zip(writers, results, strict=True):
        # Accepted outcomes: completed (0), or refused with a clear PleachError (3).
        assert code in (0, 3), f"writer {w.label} crashed (exit {code}):\n{err[-3000:]}"
        if code == 3:
            assert w.refusal, f"writer {w.label} exited 3 without saying why"
        else:
            assert len(w.committed) == WRITER_TURNS, w.lines
    return writers


async def check_nothing_lost(db: Path, writers: list[Writer], sessions: list[str]) -> None:
    async with SessionRuntime(SQLiteAdapter(db), ScriptedProvider(), user_id="u", org_id="o") as rt:
        kept: set[str] = set()
        for sid in sessions:
            messages = await rt.sessions.messages(sid)
            kept |= {
                m.content[0].get("text", "") for m in messages if m.role == "user" and m.content
            }
        outcome = {w.label: (w.refusal or f"completed {len(w.committed)} turns") for w in writers}
        for w in writers:
            lost = [t for t in w.committed if t not in kept]
            assert not lost, f"committed turns lost from the transcript: {lost}; {outcome}"
        for sid in sessions:
            report = await rt.events.verify_chain(sid)
            assert report.ok, f"event chain of {sid} is broken: {report}; {outcome}"
        audit = await rt.audit.verify_chain()
        assert audit.ok, f"audit chain is broken: {audit}; {outcome}"
        assert any(not w.refusal for w in writers), f"both writers were refused: {outcome}"


async def _make_sessions(db: Path, count: int) -> list[str]:
    async with SessionRuntime(SQLiteAdapter(db), ScriptedProvider(), user_id="u", org_id="o") as rt:
        ids = []
        for n in range(count):
            handle = await rt.create_session(title=f"s{n}")
            await chat(rt, handle.id, f"seed {n}")
            ids.append(handle.id)
        return ids


async def test_two_processes_on_one_session(tmp_path: Path) -> None:
    for round_ in range(ROUNDS):
        db = tmp_path / f"same-{round_}.db"
        (sid,) = await _make_sessions(db, 1)
        writers = await run_writers(db, [(sid, "one"), (sid, "two")])
        await check_nothing_lost(db, writers, [sid])


async def test_two_processes_on_two_sessions(tmp_path: Path) -> None:
    for round_ in range(ROUNDS):
        db = tmp_path / f"two-{round_}.db"
        s1, s2 = await _make_sessions(db, 2)
        writers = await run_writers(db, [(s1, "one"), (s2, "two")])
        await check_nothing_lost(db, writers, [s1, s2])


# -- 3. delete in a fresh process -----------------------------------------------------------


async def _session_with_a_turn(db: Path) -> tuple[str, list[str]]:
    async with SessionRuntime(
        SQLiteAdapter(db), ScriptedProvider(), user_id="alice", org_id="acme"
    ) as rt:
        handle = await rt.create_session(title="to delete")
        await chat(rt, handle.id, "delete me later")
        row = await rt.sessions.find(handle.id)
        assert row is not None
        return handle.id, list(row.state.message_ids)


async def test_delete_in_a_fresh_process_chains_on_the_existing_log(tmp_path: Path) -> None:
    db = tmp_path / "device.db"
    sid, _ = await _session_with_a_turn(db)
    async with SessionRuntime(
        SQLiteAdapter(db), ScriptedProvider(), user_id="alice", org_id="acme"
    ) as rt:
        receipt = await rt.delete_session(sid)  # S was never loaded in this runtime
        assert receipt.deleted
        report = await rt.events.verify_chain(sid)
        assert report.ok, f"session.deleted did not chain on the existing log: {report}"
        assert not receipt.removed_from_cache, "S was never loaded, so not removed from a cache"


async def test_delete_in_a_fresh_process_removes_messages_and_checkpoints(tmp_path: Path) -> None:
    db = tmp_path / "device.db"
    sid, message_ids = await _session_with_a_turn(db)
    assert message_ids
    async with SessionRuntime(
        SQLiteAdapter(db), ScriptedProvider(), user_id="alice", org_id="acme"
    ) as rt:
        await rt.delete_session(sid)
        assert await rt.checkpoints.list(sid) == []
        left = await rt.store.get_messages(message_ids)
        assert left == [], f"{len(left)} messages of the deleted session are still stored"


async def test_delete_reaches_other_devices_and_new_ones(cluster: Cluster) -> None:
    a = await cluster.device("a")
    b = await cluster.device("b")
    session = await a.create_session(title="to delete")
    await chat(a, session.id, "delete me later")
    message_ids = (await a.sessions.find(session.id)).state.message_ids  # type: ignore[union-attr]
    await cluster.online(a, b)
    await b.resume_session(session.id)
    handle = b.get_active_session()
    assert handle is not None and handle.id == session.id
    await a.close()

    a2 = await cluster.device("a")  # a fresh runtime on A's file: S is not loaded
    receipt = await a2.delete_session(session.id)
    assert receipt.deleted
    await cluster.online(a2)
    await cluster.settle(a2, b)

    assert await b.sessions.find(session.id) is None
    active = b.get_active_session()
    assert active is None or active.id != session.id, "B still has the deleted session active"
    assert await b.checkpoints.list(session.id) == []
    assert await b.store.get_messages(message_ids) == [], "B still stores the deleted messages"

    c = await cluster.device("c")  # connects after the delete
    await cluster.online(c)
    assert await c.checkpoints.list(session.id) == [], "a new device downloaded S's checkpoints"
    assert await c.store.get_messages(message_ids) == [], "a new device downloaded S's messages"


# -- 4. the reference's config shape -------------------------------------------------------


@pytest.fixture
async def device_rt(tmp_path: Path) -> AsyncIterator[SessionRuntime]:
    async with SessionRuntime(
        SQLiteAdapter(tmp_path / "device.db"), ScriptedProvider(), user_id="alice", org_id="acme"
    ) as rt:
        yield rt


async def test_reference_config_shape_equals_the_flat_one(device_rt: SessionRuntime) -> None:
    rt = device_rt
    shaped = await rt.create_session(
        provider={"type": "scripted"},
        model={"id": "scripted-1"},
        tools={"enabled": ["calculator"]},
    )
    flat = await rt.create_session(provider="scripted", model="scripted-1", tools=["calculator"])
    for handle in (shaped, flat):
        assert handle.provider == "scripted", handle.record
        assert handle.model == "scripted-1", handle.record
        assert list(handle.record.tools) == ["calculator"], handle.record
        events = await chat(rt, handle.id, "6*7?")
        assert events[-1].type == "turn.complete", events[-1]
    listed = {s.id: s for s in await rt.sessions.list()}
    assert {shaped.id, flat.id} <= set(listed)
    assert (listed[shaped.id].provider, listed[shaped.id].model, listed[shaped.id].tools) == (
        listed[flat.id].provider,
        listed[flat.id].model,
        listed[flat.id].tools,
    )


BAD_CONFIGS = [
    pytest.param(
        {"provider": {"kind": "x"}},
        "provider",
        id="provider-dict-without-type",
    ),
    pytest.param(
        {"model": 42},
        "model",
        id="model-int",
    ),
    pytest.param(
        {"tools": {"bogus": 1}},
        "tools",
        id="tools-dict-without-enabled",
    ),
    pytest.param({"bogus": 1}, "bogus", id="unknown-keyword"),
]


@pytest.mark.parametrize(("config", "field"), BAD_CONFIGS)
async def test_bad_config_is_refused_at_once(
    device_rt: SessionRuntime, config: dict[str, Any], field: str
) -> None:
    rt = device_rt
    before = [s.id for s in await rt.sessions.list()]
    with pytest.raises((PleachError, ValueError, TypeError)) as caught:
        await rt.create_session(**config)
    assert field in str(caught.value), f"the error does not name {field!r}: {caught.value}"
    assert [s.id for s in await rt.sessions.list()] == before


# -- 5. tenant mismatch --------------------------------------------------------------------


async def test_tenant_mismatch_keeps_rows_pending_and_says_why(cluster: Cluster) -> None:
    anon = await cluster.device("anon", tenant=Tenant(org_id="default", user_id="anonymous"))
    session = await anon.create_session(title="mine")
    await chat(anon, session.id, "written before signing in")
    pending = (await anon.sync.status()).pending
    assert pending > 0
    await anon.sync.connect(cluster.url, cluster.token(ALICE))
    # The API's own bounded wait: it must come back False (never synced).
    synced = await anon.sync.wait_until_synced(timeout=5)
    status = await anon.sync.status()
    assert not synced, f"a device of another tenant reported itself synced: {status}"
    assert status.last_error_code == 3002, status
    assert status.last_error and re.search(
        r"mismatch|does not match|tenant", status.last_error, re.IGNORECASE
    ), status.last_error
    assert status.dead_letters == 0, f"rows were dead-lettered: {status}"
    assert status.pending == pending, f"rows left the outbox: {status}"


async def test_wrong_users_token_does_not_push_in_a_tight_loop(cluster: Cluster) -> None:
    dev = await cluster.device("alice-laptop")
    session = await dev.create_session(title="mine")
    await chat(dev, session.id, "synced as alice")
    await cluster.online(dev)
    await dev.sync.disconnect()
    await chat(dev, session.id, "written while signed out")  # pending again

    before = cluster.pushes_received()
    await dev.sync.connect(cluster.url, cluster.token(BOB))
    # The window: wait_until_synced cannot succeed with another user's token, and there is no
    # event for "kept retrying"; its bounded wait is the observation window.
    assert not await dev.sync.wait_until_synced(timeout=2)
    pushes = cluster.pushes_received() - before
    assert pushes < 20, f"{pushes:.0f} Push frames in 2 s: the device retries in a tight loop"
    status = await dev.sync.status()
    assert status.last_error_code == 3002, status


# -- 6. a remote page applied while a turn is in flight --------------------------------------


class GatedProvider:
    """A ``ScriptedProvider`` whose next call waits on ``gate`` (when set) before streaming.

    ``entered`` is set once the call is waiting: the turn is then in flight, its user
    message minted but not committed.
    """

    name = "scripted"

    def __init__(self) -> None:
        self.inner = ScriptedProvider()
        self.gate: asyncio.Event | None = None
        self.entered = asyncio.Event()

    async def stream(self, request: ProviderRequest) -> AsyncGenerator[ProviderEvent, None]:
        gate, self.gate = self.gate, None
        if gate is not None:
            self.entered.set()
            await gate.wait()
        async with aclosing(self.inner.stream(request)) as events:
            async for event in events:
                yield event


async def test_remote_version_applied_during_a_turn_loses_nothing(cluster: Cluster) -> None:
    provider = GatedProvider()
    a = await cluster.device("a", provider=provider)
    b = await cluster.device("b")
    session = await a.create_session(title="shared")
    await chat(a, session.id, "first on a")
    await cluster.online(a, b)
    await b.resume_session(session.id)

    gate = asyncio.Event()
    provider.gate = gate
    turn = asyncio.create_task(chat(a, session.id, "a in flight"))
    try:
        async with asyncio.timeout(SAFETY):
            await provider.entered.wait()
        # B builds on A's version: B's version dominates the one A's turn started from.
        await chat(b, session.id, "b meanwhile")
        await cluster.settle(b)
        # A gets B's page live. A runtime may apply it now or hold it until the turn ends;
        # there is no event for "held", so A's own bounded wait is the observation window.
        applied_in_flight = await a.sync.wait_until_synced(timeout=3)
        assert not turn.done()
    finally:
        gate.set()
    async with asyncio.timeout(SAFETY):
        events = await turn
    assert events[-1].type == "turn.complete", events[-1]
    await cluster.settle(a, b, a)

    for rt in (a, b):
        held = await user_texts_everywhere(rt)
        everything = set().union(*held.values())
        missing = {"first on a", "a in flight", "b meanwhile"} - everything
        assert not missing, (
            f"{rt.client_id}: {sorted(missing)} in no session "
            f"(B's page applied during A's turn: {applied_in_flight}); sessions hold {held}"
        )
