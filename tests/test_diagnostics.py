"""``runtime.diagnostics``: readiness probes with reasons, against a real server process'
in-process twin (a real websockets server on loopback) and real SQLite files."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from pleach_client.providers.scripted import ScriptedProvider
from pleach_client.runtime import SessionRuntime
from pleach_client.store.sqlite import SQLiteAdapter
from pleach_server.auth import issue_token
from pleach_server.server import SyncServer
from pleach_server.store.base import Tenant
from pleach_server.store.sqlite import SQLiteServerStore

SECRET = b"diagnostics-secret"
ALICE = Tenant(org_id="acme", user_id="alice")


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[SyncServer]:
    async with SQLiteServerStore(tmp_path / "server.db") as store:
        srv = SyncServer(store, port=0, secret=SECRET)
        await srv.start()
        try:
            yield srv
        finally:
            await srv.shutdown()


def levels(report: object) -> dict[str, str]:
    return {p.name: p.level for p in report.probes}  # type: ignore[attr-defined]


async def test_an_offline_device_is_ready_and_says_it_is_offline(tmp_path: Path) -> None:
    async with SessionRuntime(SQLiteAdapter(tmp_path / "d.db"), ScriptedProvider()) as rt:
        session = await rt.create_session()
        async for _ in rt.execute_message(session.id, "hi"):
            pass
        report = await rt.diagnostics.probe()
    assert report.ready and not report.failed()
    got = levels(report)
    assert got["store"] == got["event logs"] == got["provider"] == "ok"
    assert got["outbox"] == "ok" and got["server"] == "warn"
    reasons = {p.name: p.reason for p in report.probes}
    assert "1 session log(s) verify" in reasons["event logs"]
    assert "offline" in reasons["server"]


async def test_no_provider_and_no_key_is_not_ready(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    async with SessionRuntime(SQLiteAdapter(tmp_path / "d.db")) as rt:
        report = await rt.diagnostics.probe()
    assert not report.ready
    (failed,) = report.failed()
    assert failed.name == "provider" and "ANTHROPIC_API_KEY" in failed.reason


async def test_the_server_the_token_and_the_clock(server: SyncServer, tmp_path: Path) -> None:
    url = f"ws://127.0.0.1:{server.port}/sync"
    async with SessionRuntime(
        SQLiteAdapter(tmp_path / "d.db"),
        ScriptedProvider(),
        user_id=ALICE.user_id,
        org_id=ALICE.org_id,
    ) as rt:
        await rt.sync.sync_once(url, issue_token(SECRET, ALICE, 3600))
        report = await rt.diagnostics.probe()  # the server rt.sync knows
        assert report.ready, report
        got = levels(report)
        assert got["server"] == got["token"] == got["clock"] == "ok"

        bob = issue_token(SECRET, Tenant(org_id="acme", user_id="bob"), 3600)
        report = await rt.diagnostics.probe(server=url, token=bob)
        assert not report.ready and levels(report)["token"] == "fail"
        assert "acme/bob" in next(p.reason for p in report.failed())

        forged = issue_token(b"another-secret", ALICE, 3600)
        report = await rt.diagnostics.probe(server=url, token=forged)
        assert levels(report)["token"] == "fail"

        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            dead = f"ws://127.0.0.1:{s.getsockname()[1]}/sync"
        report = await rt.diagnostics.probe(server=dead, token="x", timeout=2)
        assert levels(report)["server"] == "fail" and "cannot reach" in report.failed()[0].reason


async def test_a_device_clock_far_ahead_fails_the_clock_probe(
    server: SyncServer, tmp_path: Path
) -> None:
    import time

    url = f"ws://127.0.0.1:{server.port}/sync"
    ahead = 10 * 60 * 1000
    async with SessionRuntime(
        SQLiteAdapter(tmp_path / "d.db"),
        ScriptedProvider(),
        user_id=ALICE.user_id,
        org_id=ALICE.org_id,
        wall_clock=lambda: int(time.time() * 1000) + ahead,
    ) as rt:
        report = await rt.diagnostics.probe(server=url, token=issue_token(SECRET, ALICE, 3600))
    clock = next(p for p in report.probes if p.name == "clock")
    assert (
        clock.level == "fail" and "ahead of the server" in clock.reason and "3011" in clock.reason
    )
