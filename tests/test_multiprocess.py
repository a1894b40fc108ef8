"""Several server processes acting as one, on one PostgreSQL database.

First the ``PostgresNotifier`` in-process (own commits skipped, remote ones delivered in order,
reconnects after its connection is killed), then real ``pleach-server`` subprocesses on free
loopback ports sharing one fresh schema and one ``PLEACH_SECRET``, with raw WebSocket devices
speaking msgpack frames: a change pushed on process 1 reaches a device on process 2 live;
process 1 is killed with SIGKILL and its device resumes on process 2 with nothing lost or
duplicated.

Nothing here sleeps to wait: every wait is on a frame, a process output line, or a condition.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from websockets.asyncio.client import connect

from pleach_server.store.base import Tenant
from pleach_server.store.pg_notify import PostgresNotifier
from shared.clock import HybridClock
from shared.messages import (
    Push,
)
from tests.server_factories import Device, new_tenant
from tests.test_server_store_postgres import (
    PG_DSN,
    pg_available,  # noqa: F401 - a session fixture, used by name
    pg_store,
    scratch_schema,
    terminate_backends,
)
from tests.wsclient import Client

pytestmark = pytest.mark.postgres

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 20.0
SECRET = "multiprocess-test-secret"


@pytest.fixture(autouse=True)
def _needs_postgres(pg_available: None) -> None:  # noqa: F811 - the fixture above
    """Every test here needs PostgreSQL: skip, or fail under CI, when it is unreachable."""


@pytest.fixture
async def schema() -> AsyncIterator[str]:
    async with scratch_schema() as name:
        yield name


# -- the notifier, in-process ------------------------------------------------------------------


class Heard:
    """An ``on_commit`` callback that records what it is given."""

    def __init__(self) -> None:
        self.pages: list[tuple[Tenant, int, int]] = []
        self._changed = asyncio.Condition()

    async def __call__(self, tenant: Tenant, from_cursor: int, to_cursor: int) -> None:
        async with self._changed:
            self.pages.append((tenant, from_cursor, to_cursor))
            self._changed.notify_all()

    async def until(self, count: int) -> list[tuple[Tenant, int, int]]:
        async with asyncio.timeout(TIMEOUT), self._changed:
            await self._changed.wait_for(lambda: len(self.pages) >= count)
        return self.pages


@contextlib.asynccontextmanager
async def listening(schema: str, server_id: str) -> AsyncIterator[tuple[PostgresNotifier, Heard]]:
    notifier = PostgresNotifier(PG_DSN, server_id=server_id, schema=schema)
    heard = Heard()
    await notifier.start(heard)
    try:
        yield notifier, heard
    finally:
        await notifier.close()


async def test_notifier_delivers_other_servers_commits_in_order_and_skips_its_own(
    schema: str,
) -> None:
    tenant = new_tenant()
    one, two = HybridClock("srv-one"), HybridClock("srv-two")
    dev = Device(tenant)
    session = dev.session()
    async with (
        pg_store(schema) as store,
        listening(schema, "srv-one") as (n1, heard1),
        listening(schema, "srv-two") as (n2, heard2),
        listening("some_other_schema", "srv-three") as (_, heard3),
    ):
        pushes = []
        for clock, records in (
            (one, [session, dev.message(session.id)]),
            (two, [dev.message(session.id)]),
            (two, [dev.event(session.id), dev.message(session.id)]),
            (one, [dev.message(session.id)]),
        ):
            pushes.append(await store.push(tenant, dev.client_id, dev.changes(*records), clock))
        page = [(tenant, r.cursors[0] - 1, r.cursors[-1]) for r in pushes]

        # Each process hears only the other's commits, in commit order (the two consecutive
        # commits of srv-two may arrive merged into one page).
        got1 = await heard1.until(1)
        while got1[-1][2] != page[2][2]:
            got1 = await heard1.until(len(got1) + 1)
        assert got1 in ([page[1], page[2]], [(tenant, page[1][1], page[2][2])])
        assert await heard2.until(2) == [page[0], page[3]]
        # One connection delivers in commit order: srv-two has handled its own two commits
        # before page 3. srv-one's own page 3 is handled before a later commit it hears.
        assert n2.own == 2
        before = len(heard1.pages)
        later = await store.push(tenant, dev.client_id, dev.changes(dev.message(session.id)), two)
        got1 = await heard1.until(before + 1)
        assert got1[before:] == [(tenant, later.cursors[0] - 1, later.cursors[-1])]
        await n1.publish(tenant, 0, 1)  # a no-op: the push itself notified
        assert n1.published == 1 and n1.own == 2
        assert heard3.pages == []  # another schema's commits are not ours


def test_pages_merge_per_tenant_but_never_across_an_own_commit() -> None:
    """Queueing rules, without a database: the notifier is not started."""
    notifier = PostgresNotifier(PG_DSN, server_id="me", schema="s", max_pending=3)
    a, b = Tenant(org_id="o", user_id="a"), Tenant(org_id="o", user_id="b")

    def note(tenant: Tenant, lo: int, hi: int, server: str = "them") -> None:
        payload = (
            f'{{"schema":"s","org":"{tenant.org_id}","user":"{tenant.user_id}",'
            f'"from":{lo},"to":{hi},"server":"{server}"}}'
        )
        notifier._on_notification(None, 0, "pleach_feed", payload)

    note(a, 0, 2)
    note(b, 2, 3)
    note(a, 3, 5)  # merged into a's queued page: (0, 5]
    note(a, 5, 6, server="me")  # our own: skipped, and seals a's page
    note(a, 6, 8)  # a new page: merging across (5, 6] would resend it to our devices
    assert [(p.tenant, p.from_cursor, p.to_cursor) for p in notifier._pending] == [
        (a, 0, 5),
        (b, 2, 3),
        (a, 6, 8),
    ]
    note(b, 8, 9)  # merges into b's page: the queue does not grow
    note(Tenant(org_id="o", user_id="c"), 9, 10)  # full: the oldest page is dropped
    assert notifier.dropped == 1 and len(notifier._pending) == 3
    assert [p.to_cursor for p in notifier._pending] == [9, 8, 10]
    notifier._on_notification(None, 0, "pleach_feed", "not json")  # logged, ignored
    assert len(notifier._pending) == 3


async def test_notifier_reconnects_after_its_connection_is_killed(schema: str) -> None:
    tenant = new_tenant()
    dev = Device(tenant)
    clock = HybridClock("srv-remote")
    async with (
        pg_store(schema) as store,
        listening(schema, "srv-local") as (notifier, heard),
    ):
        first = await store.push(tenant, dev.client_id, dev.changes(dev.session()), clock)
        assert await heard.until(1) == [(tenant, first.cursors[0] - 1, first.cursors[0])]

        assert await terminate_backends(notifier.application_name) == 1
        async with asyncio.timeout(TIMEOUT):
            await notifier.wait_reconnected(1)
        assert notifier.listening

        second = await store.push(tenant, dev.client_id, dev.changes(dev.session()), clock)
        assert (await heard.until(2))[1] == (tenant, second.cursors[0] - 1, second.cursors[0])


# -- real processes ----------------------------------------------------------------------------


def _env(schema: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLEACH_")}
    env["PYTHONPATH"] = str(ROOT)
    env["PLEACH_SECRET"] = SECRET
    env["PLEACH_PG_SCHEMA"] = schema
    env.pop("PYTHONASYNCIODEBUG", None)  # the servers run as in production
    return env


class ServerProcess:
    """One ``pleach-server`` subprocess on a free port; ``url`` once it is listening."""

    def __init__(self, proc: asyncio.subprocess.Process, url: str) -> None:
        self.proc = proc
        self.url = url
        self.stderr: list[str] = []
        self._drain = asyncio.create_task(self._read_stderr())

    @classmethod
    async def start(cls, schema: str) -> ServerProcess:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pleach_server.cli", "--port", "0", "--db", PG_DSN,
            "--log-level", "warning", "--pool-size", "4", "--known-mib", "1",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=_env(schema),
        )  # fmt: skip
        assert proc.stdout is not None
        try:
            async with asyncio.timeout(TIMEOUT):
                line = (await proc.stdout.readline()).decode()
                assert line.startswith("pleach-server listening on ws://127.0.0.1:"), line
                data = (await proc.stdout.readline()).decode()
            assert f"schema={schema}" in data and "postgres@" not in data, data
        except BaseException:
            proc.kill()
            _, err = await proc.communicate()
            print(err.decode(), file=sys.stderr)
            raise
        return cls(proc, line.split()[-1])

    async def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        async for line in self.proc.stderr:
            self.stderr.append(line.decode())

    async def kill(self) -> None:
        self.proc.kill()
        await self.proc.wait()
        await self._drain

    async def stop(self) -> None:
        """SIGTERM, and wait for a clean exit (0)."""
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            async with asyncio.timeout(TIMEOUT):
                await self.proc.wait()
            assert self.proc.returncode == 0, "".join(self.stderr)
        await self._drain


@contextlib.asynccontextmanager
async def servers(schema: str, count: int) -> AsyncIterator[list[ServerProcess]]:
    started: list[ServerProcess] = []
    try:
        # One at a time would work too; at once also proves concurrent migrations are safe.
        results = await asyncio.gather(
            *(ServerProcess.start(schema) for _ in range(count)), return_exceptions=True
        )
        for result in results:
            if isinstance(result, ServerProcess):
                started.append(result)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        yield started
    finally:
        for srv in started:
            if srv.proc.returncode is None:
                await srv.stop()
            else:
                await srv._drain


async def create_token(schema: str, tenant: Tenant) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pleach_server.cli", "token", "create",
        "--user", tenant.user_id, "--org", tenant.org_id, "--db", PG_DSN,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=_env(schema),
    )  # fmt: skip
    async with asyncio.timeout(TIMEOUT):
        out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    return out.decode().strip()


@contextlib.asynccontextmanager
async def device(url: str, token: str) -> AsyncIterator[Client]:
    async with connect(
        url,
        additional_headers={"Authorization": f"Bearer {token}"},
        compression=None,
        proxy=None,
        open_timeout=TIMEOUT,
        close_timeout=2,
    ) as ws:
        yield Client(ws)


async def test_a_change_on_process_1_reaches_a_device_on_process_2_live(schema: str) -> None:
    tenant = new_tenant()
    token = await create_token(schema, tenant)
    a, b = Device(tenant), Device(tenant)
    session = a.session(title="from A")
    async with (
        servers(schema, 2) as (p1, p2),
        device(p1.url, token) as on_p1,
        device(p2.url, token) as on_p2,
    ):
        assert (await on_p1.hello(a.client_id)).server_id != (
            await on_p2.hello(b.client_id)
        ).server_id
        first = a.changes(session, a.message(session.id))
        ack = await on_p1.push(first)
        assert [r.status for r in ack.results] == ["applied", "applied"]

        await on_p2.live_until({session.id})  # B never pulled: this came from process 1
        await on_p2.live_until({c.record.id for c in first})
        assert on_p2.live_ids() == [c.record.id for c in first]

        # And back: B's change reaches A on process 1. A's own push does not come back live
        # from either process (protocol 5: its ack said where its rows are).
        assert ack.as_pushed_from is not None
        reply = b.message(session.id, "from B")
        ack_b = await on_p2.push(b.changes(reply))
        assert [r.status for r in ack_b.results] == ["applied"]
        await on_p1.live_until({reply.id})
        assert on_p1.live_ids() == [reply.id]
        (frame,) = on_p1.live
        assert frame.from_cursor == ack.head_cursor  # right after A's rows: nothing to pull


async def test_killed_process_devices_resume_on_another_with_nothing_lost(schema: str) -> None:
    tenant = new_tenant()
    token = await create_token(schema, tenant)
    a, b = Device(tenant), Device(tenant)
    session = a.session()
    batch1 = a.changes(session, *(a.message(session.id) for _ in range(3)))
    batch2 = a.changes(*(a.message(session.id) for _ in range(3)), a.event(session.id))
    batch3 = a.changes(a.message(session.id), a.event(session.id))
    everything = {c.record.id for c in batch1 + batch2 + batch3}

    async with servers(schema, 2) as (p1, p2), device(p2.url, token) as on_p2:
        await on_p2.hello(b.client_id)
        async with device(p1.url, token) as on_p1:
            welcome = await on_p1.hello(a.client_id)
            assert welcome.last_seq == 0
            ack1 = await on_p1.push(batch1)
            assert [r.status for r in ack1.results] == ["applied"] * 4

            # Batch 2 commits, but its ack never reaches A: process 1 dies first.
            await on_p1.send(Push(changes=batch2))
            await on_p2.live_until({c.record.id for c in batch2})  # committed: B saw it
            await p1.kill()
            assert p1.proc.returncode == -signal.SIGKILL

        # A reconnects to process 2 and resends everything it has no ack for.
        async with device(p2.url, token) as resumed:
            welcome = await resumed.hello(a.client_id)
            assert welcome.last_seq == batch2[-1].client_seq  # batch 2 is there
            ack = await resumed.push(batch2 + batch3)
            assert [r.status for r in ack.results] == ["duplicate"] * 4 + ["applied"] * 2
            assert ack.last_seq == batch3[-1].client_seq

            await on_p2.live_until({c.record.id for c in batch3})
            live = on_p2.live_ids()
            assert len(live) == len(set(live)) == len(everything)  # nothing twice
            assert set(live) == everything

            pulled = await on_p2.pull_all()
            assert len(pulled) == len(everything)  # nothing lost, nothing duplicated
            assert {c.record.id for c in pulled} == everything
            assert [c.cursor for c in pulled] == sorted(c.cursor for c in pulled)
            assert await resumed.pull_all() == pulled
