"""The hostile-world campaign's CI slice (``tests/campaign/``; ``make soak`` runs the full one).

- 20 kill rounds: real device processes and a real ``pleach-server`` process SIGKILLed at
  seeded points in turn commits, page applies, flushes and acknowledgements, restarted; then
  nothing lost, nothing doubled, every invariant of the simulation and every chain holds.
- A few PostgreSQL outages through the fault-injecting proxy under two server processes,
  with the devices writing throughout (PostgreSQL required: skipped without it, failed
  without it under ``CI``).
- The verdict's counting and the proxy's faults, without processes.

Only counts are asserted (rounds run, kills made, zero lost, zero duplicates); the machine is
shared and noisy, so no timing is. ``CAMPAIGN_KILL_ROUNDS`` / ``CAMPAIGN_OUTAGES`` resize it.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from pleach_client.providers.scripted import ScriptedProvider
from pleach_client.runtime import SessionRuntime
from pleach_client.store.sqlite import SQLiteAdapter
from pleach_server.auth import issue_token
from pleach_server.server import SyncServer
from pleach_server.store import SQLiteServerStore, Tenant
from shared.errors import StorageUnavailable
from tests.campaign.faultproxy import FaultProxy
from tests.campaign.fleet import count_duplicates, count_lost
from tests.campaign.kill import run_kill
from tests.campaign.outage import run_outage, through
from tests.loop import next_tick
from tests.sim.invariants import Ledger, View
from tests.sim.network import Proxy
from tests.test_server_store_postgres import pg_available  # noqa: F401 - a fixture, by name

KILL_ROUNDS = int(os.environ.get("CAMPAIGN_KILL_ROUNDS", "20"))
OUTAGES = int(os.environ.get("CAMPAIGN_OUTAGES", "5"))


async def test_kill_campaign(tmp_path: Path) -> None:
    report = await run_kill(KILL_ROUNDS, seed=20261130, backend="sqlite", workdir=tmp_path)
    print(report.summary())
    summary = json.dumps(report.as_dict(), indent=1)
    assert report.rounds == KILL_ROUNDS, summary
    assert report.kills == KILL_ROUNDS, summary
    assert report.device_kills > 0 and report.server_kills > 0, summary
    assert report.verdict.committed > 0, summary
    assert report.verdict.lost == 0, summary
    assert report.verdict.duplicates == 0, summary
    assert report.ok, summary


@pytest.mark.postgres
@pytest.mark.usefixtures("pg_available")
async def test_outage_campaign(tmp_path: Path) -> None:
    report = await run_outage(OUTAGES, seed=20261130, workdir=tmp_path, max_outage=1.5)
    print(report.summary())
    summary = json.dumps(report.as_dict(), indent=1)
    assert report.rounds == OUTAGES, summary
    assert report.verdict.committed > 0, summary
    assert report.verdict.lost == 0, summary
    assert report.verdict.duplicates == 0, summary
    assert report.ok, summary


# -- the verdict's counting ---------------------------------------------------------------------


def _view(name: str, sessions: dict[str, tuple[str | None, list[tuple[str, str]]]]) -> View:
    """A holder whose live sessions are ``id -> (forked_from, [(message id, user text)])``."""
    view = View(name)
    for sid, (forked_from, messages) in sessions.items():
        view.sessions[sid] = {"deleted": False, "forked_from": forked_from}
        view.transcripts[sid] = [
            (mid, "user", json.dumps([{"type": "text", "text": text}])) for mid, text in messages
        ]
    return view


def test_lost_and_duplicated_messages_are_counted() -> None:
    ledger = Ledger()
    ledger.wrote(0, "m1", "s1", "a.0.0")
    ledger.wrote(1, "m2", "s1", "a.0.1")
    whole = _view("dev0", {"s1": (None, [("m1", "a.0.0"), ("m2", "a.0.1")])})
    # A fork holds copies (new ids, same text) of what it shares with its origin: not lost
    # where only the copy is, not a duplicate either.
    forked = _view(
        "dev1", {"s1": (None, [("m1", "a.0.0")]), "s2": ("s1", [("c1", "a.0.0"), ("c2", "a.0.1")])}
    )
    assert count_lost(ledger, [whole, forked]) == (0, [])
    assert count_duplicates([whole, forked]) == (0, [])

    missing = _view("server", {"s1": (None, [("m1", "a.0.0")])})
    lost, lines = count_lost(ledger, [whole, missing])
    assert lost == 1 and "a.0.1" in lines[0] and "server" in lines[0]

    twice = _view("dev2", {"s1": (None, [("m1", "a.0.0"), ("m3", "a.0.0")])})
    unrelated = _view("dev3", {"s1": (None, [("m1", "a.0.0")]), "s9": (None, [("m9", "a.0.0")])})
    assert count_duplicates([twice])[0] == 1
    assert count_duplicates([unrelated])[0] == 1


# -- the fault proxy ------------------------------------------------------------------------------


async def test_fault_proxy_cuts_refuses_and_stalls() -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1024):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    proxy = FaultProxy("127.0.0.1", server.sockets[0].getsockname()[1])
    await proxy.start()
    opened: list[asyncio.StreamWriter] = []

    async def dial() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        opened.append(writer)
        return reader, writer

    try:
        async with asyncio.timeout(20):
            reader, writer = await dial()
            writer.write(b"one")
            assert await reader.readexactly(3) == b"one"

            proxy.stalled = True  # bytes are held, in order, until the stall is lifted
            writer.write(b"two")
            read = asyncio.create_task(reader.readexactly(6))
            await next_tick()  # the pumps run: nothing may come through
            writer.write(b"three"[:3])
            await writer.drain()
            assert not read.done()
            proxy.stalled = False
            assert await read == b"twothr"

            assert proxy.cut() == 1  # open connections reset
            assert await reader.read() == b""

            proxy.refusing = True  # new ones accepted and reset at once
            reader, writer = await dial()
            assert await reader.read() == b""
            assert proxy.refused == 1
            proxy.heal()
            reader, writer = await dial()
            writer.write(b"back")
            assert await reader.readexactly(4) == b"back"
    finally:
        for w in opened:
            w.transport.abort()
        await proxy.close()
        server.close()
        await server.wait_closed()


def test_through_points_a_dsn_at_the_proxy() -> None:
    assert through("postgresql://postgres@127.0.0.1:5432/test", 6000) == (
        "postgresql://postgres@127.0.0.1:6000/test"
    )
    assert through("postgresql://u:pw@db.internal/x?sslmode=disable", 7) == (
        "postgresql://u:pw@127.0.0.1:7/x?sslmode=disable"
    )


# -- found by the campaign --------------------------------------------------------------------------


class _Bounds:
    """Stands in for ``random`` in ``pleach_client.sync``: records the upper bound of every
    reconnect backoff draw (``uniform(0, delay)``) and draws 0, so nothing waits."""

    def __init__(self) -> None:
        self.bounds: list[float] = []
        self.drawn = asyncio.Condition()

    def uniform(self, a: float, b: float) -> float:
        if a == 0:
            self.bounds.append(b)

            async def notify() -> None:
                async with self.drawn:
                    self.drawn.notify_all()

            asyncio.get_running_loop().create_task(notify())
            return 0.0
        return (a + b) / 2

    async def wait_for(self, count: int) -> None:
        async with asyncio.timeout(20), self.drawn:
            await self.drawn.wait_for(lambda: len(self.bounds) >= count)


async def test_reconnect_backoff_starts_over_after_a_good_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a connection that worked, the next reconnect waits the initial backoff again.

    A device whose healthy connections were each ended by a network blip must not wait up to
    ``backoff_initial * 2**blips`` (capped at ``backoff_max``: 30 s by default) to reconnect.
    """
    import pleach_client.sync as sync_module

    draws = _Bounds()
    monkeypatch.setattr(sync_module, "random", draws)
    tenant = Tenant(org_id="o", user_id="u")
    secret = b"backoff-secret"
    store = SQLiteServerStore(tmp_path / "server.db")
    await store.open()
    server = SyncServer(store, port=0, secret=secret)
    await server.start()
    proxy = Proxy("dev", lambda: ("127.0.0.1", server.port))
    await proxy.start()
    try:
        async with SessionRuntime(
            SQLiteAdapter(tmp_path / "d.db"), ScriptedProvider(), user_id="u", org_id="o"
        ) as rt:
            rt.sync.backoff_initial, rt.sync.backoff_max = 0.01, 1000.0
            await rt.sync.connect(proxy.url, issue_token(secret, tenant, None))
            for blip in range(1, 7):
                assert await rt.sync.wait_until_synced(timeout=20)  # connected and healthy
                proxy.cut()
                await draws.wait_for(blip)  # the loop saw the cut and drew its backoff
            assert await rt.sync.wait_until_synced(timeout=20)
            await rt.sync.disconnect()
    finally:
        await proxy.close()
        await server.shutdown()
        await store.close()
    assert draws.bounds == [0.01] * len(draws.bounds), draws.bounds


class _OneFailedPush(SQLiteServerStore):
    """A SQLite store whose next push from ``client_id`` fails as a database outage would
    (3009, retryable), once."""

    fail_next: str | None = None

    async def push(self, tenant: Tenant, client_id: str, *args: Any, **kwargs: Any) -> Any:
        if client_id == self.fail_next:
            self.fail_next = None
            raise StorageUnavailable("injected: the database is away for this push")
        return await super().push(tenant, client_id, *args, **kwargs)


async def _until(rt: SessionRuntime, check: Callable[[], Awaitable[bool]]) -> None:
    """Wait, page by page (``sync.applied``), until ``check()`` holds."""
    applied = asyncio.Event()
    rt.events.on("sync.applied", lambda _: applied.set())
    async with asyncio.timeout(20):
        while True:
            applied.clear()
            if await check():
                return
            await applied.wait()


async def test_a_lost_ack_then_a_failed_resend_is_not_a_copied_device(tmp_path: Path) -> None:
    """Found by ``python -m tests.campaign kill --backend postgres`` (one run in two of 200
    rounds: 'audit-chain: <device> chain of <id> fails at 0: prev_hash mismatch')."""
    tenant = Tenant(org_id="o", user_id="u")
    secret = b"lost-ack-secret"
    token = issue_token(secret, tenant, None)
    store = _OneFailedPush(tmp_path / "server.db")
    await store.open()
    server = SyncServer(store, port=0, secret=secret)
    await server.start()
    proxy = Proxy("x", lambda: ("127.0.0.1", server.port))
    await proxy.start()

    def runtime(name: str) -> SessionRuntime:
        return SessionRuntime(
            SQLiteAdapter(tmp_path / f"{name}.db"), ScriptedProvider(), user_id="u", org_id="o"
        )

    async def turn(rt: SessionRuntime, session_id: str, text: str) -> None:
        async for _ in rt.execute_message(session_id, text):
            pass

    try:
        async with runtime("x") as x, runtime("y") as y:
            x_id = x.client_id
            for rt in (x, y):
                rt.sync.backoff_initial, rt.sync.backoff_max = 0.01, 0.05
            await x.sync.connect(proxy.url, token)
            await y.sync.connect(f"ws://127.0.0.1:{server.port}/sync", token)
            sid = (await x.sessions.create(title="shared")).id
            await turn(x, sid, "x0")
            assert await x.sync.wait_until_synced(timeout=20)
            assert await y.sync.wait_until_synced(timeout=20)

            # X's next push commits, its ack is lost with the connection, and X stays away.
            proxy.partitioned = proxy.drop_next_ack = True
            await turn(x, sid, "x1")
            mine = (await x.store.get_session(sid)).vv[x_id]  # type: ignore[union-attr]

            async def y_has_it() -> bool:
                row = await y.store.get_session(sid)
                return row is not None and row.vv.get(x_id, 0) >= mine

            await _until(y, y_has_it)
            await turn(y, sid, "y0")  # builds on X's version
            assert await y.sync.wait_until_synced(timeout=20)

            # X comes back; its resend meets a database outage (3009), then it pulls Y's page.
            store.fail_next = x_id
            proxy.heal()
            assert await x.sync.wait_until_synced(timeout=20)
            assert await y.sync.wait_until_synced(timeout=20)
            assert await x.sync.wait_until_synced(timeout=20)
            assert store.fail_next is None  # the outage did happen
            await turn(x, sid, "x2")  # X writes on, under whatever id it has now
            assert await x.sync.wait_until_synced(timeout=20)
            assert await y.sync.wait_until_synced(timeout=20)

            assert x.client_id == x_id, "X took its own committed push for another copy's"
            for rt in (x, y):
                chains = {r.client_id for r in await rt.audit.rows()}
                for client_id in sorted(chains):
                    report = await rt.audit.verify_chain(client_id)
                    assert report.ok, (rt.client_id, client_id, report)
            await x.sync.disconnect()
            await y.sync.disconnect()
    finally:
        await proxy.close()
        await server.shutdown()
        await store.close()
