"""The sync-health page: devices report their health; ``/status`` and ``/status.json`` show it.

Real devices (SQLite files) sync with a real server over loopback; the page is read over HTTP
as a script would (``/status.json``) and in Debian's headless Chromium as a person would.
"""

from __future__ import annotations

import asyncio
import http.client
import os
import shutil
import struct
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import msgspec
import pytest
from websockets.asyncio.client import connect

from pleach_client.providers.scripted import ScriptedProvider
from pleach_client.runtime import SessionRuntime
from pleach_client.store.base import WriteBatch
from pleach_client.store.sqlite import SQLiteAdapter
from pleach_server.auth import issue_token
from pleach_server.server import SyncServer
from pleach_server.status import (
    RateWindow,
    ServerRates,
    build_report,
    device_verdict,
    render_html,
)
from pleach_server.store.base import DeviceHealth, Tenant
from pleach_server.store.sqlite import SQLiteServerStore
from shared.clock import HybridClock
from shared.ids import uuid7
from shared.messages import MAX_PROTOCOL, Health, HealthConflict
from shared.records import Message
from tests.wsclient import Client

SECRET = b"status-page-secret"
ADMIN = "admin-token-0123456789"
ALICE = Tenant(org_id="acme", user_id="alice")
BOB = Tenant(org_id="acme", user_id="bob")


# -- the pure parts ---------------------------------------------------------------------------


def rates() -> ServerRates:
    return ServerRates(
        server_id="srv-1",
        connections=2,
        pushed_changes_per_s=1.5,
        fanout_frames_per_s=3.0,
        pushed_changes_total=90,
        fanout_frames_total=180,
        window_s=60,
    )


def row(tenant: Tenant, client_id: str, health: Health | bytes, seen_at: float) -> DeviceHealth:
    body = health if isinstance(health, bytes) else msgspec.msgpack.encode(health)
    return DeviceHealth.of(tenant, client_id, body, seen_at)


@pytest.mark.parametrize(
    ("fields", "lag", "age", "verdict", "words"),
    [
        ({}, 0, 5.0, "ok", "all its changes are on the server, and it has everything"),
        ({}, 7, 5.0, "ok", "7 feed entries still to fetch"),
        ({"pending": 3}, 0, 5.0, "warn", "3 change(s) on their way"),
        ({"pending": 3}, 0, 3600.0, "warn", "still queued when last seen, 60 min ago"),
        ({"dead_letters": 2, "pending": 1}, 0, 5.0, "fail", "2 change(s) refused"),
        ({"last_error": "token expired"}, 0, 5.0, "warn", "last error: token expired"),
    ],
)
def test_device_verdict_answers_is_my_data_safe(
    fields: dict[str, Any], lag: int, age: float, verdict: str, words: str
) -> None:
    health = Health(**{"pending": 0, "dead_letters": 0, "cursor": 0, **fields})
    got, summary = device_verdict(health, lag, age)
    assert got == verdict and words in summary


def test_report_groups_per_user_worst_first_and_survives_a_corrupt_row() -> None:
    ok = Health(pending=0, dead_letters=0, cursor=10)
    bad = Health(pending=0, dead_letters=1, cursor=4)
    report = build_report(
        [
            row(ALICE, "laptop", ok, 100.0),
            row(ALICE, "phone", bad, 90.0),
            row(BOB, "tablet", b"\xc1 not msgpack", 80.0),
        ],
        {ALICE: 12, BOB: 3},
        [(ALICE, "laptop")],
        rates(),
        now=120.0,
    )
    assert [(u.user_id, u.verdict) for u in report.users] == [("alice", "fail"), ("bob", "fail")]
    alice = report.users[0]
    assert [d.client_id for d in alice.devices] == ["phone", "laptop"]
    phone, laptop = alice.devices
    assert (phone.lag, phone.dead_letters, phone.connected_here) == (8, 1, False)
    assert (laptop.lag, laptop.verdict, laptop.connected_here) == (2, "ok", True)
    (tablet,) = report.users[1].devices
    assert tablet.pending is None and "could not be read" in tablet.summary
    assert render_html(report).count('class="device"') == 3


def test_the_page_escapes_what_devices_send() -> None:
    """Every string on the page came from a device: none may become markup."""
    evil = "<script>alert(1)</script>"
    health = Health(
        pending=0,
        dead_letters=0,
        cursor=0,
        last_error=evil,
        conflicts=[
            HealthConflict(
                conflict_id="c", session_id=evil[:64], winner="local", fork_session_id="f"
            )
        ],
    )
    page = render_html(build_report([row(ALICE, evil, health, 1.0)], {}, [], rates(), now=2.0))
    assert "<script>" not in page and "&lt;script&gt;" in page
    # A report kept before the server noted its connection's protocol: not known.
    assert "<dt>protocol</dt><dd>?</dd>" in page


def test_rate_window_counts_the_last_minute() -> None:
    start = 1000.0
    window = RateWindow(window=60, started=start)
    for second in range(120):
        window.add(2, now=start + second)
    assert window.rate(now=start + 119.5) == pytest.approx(2.0)
    assert window.total == 240
    # Nothing for a minute: the rate falls to zero, the total stays.
    assert window.rate(now=start + 240) == 0.0 and window.total == 240


# -- end to end --------------------------------------------------------------------------------


class Setup:
    def __init__(self, tmp: Path, stack: AsyncExitStack, server: SyncServer) -> None:
        self.tmp, self.stack, self.server = tmp, stack, server
        self.reports = asyncio.Condition()

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.server.port}/sync"

    async def device(self, name: str, tenant: Tenant = ALICE) -> SessionRuntime:
        rt = SessionRuntime(
            SQLiteAdapter(self.tmp / f"{name}.db"),
            ScriptedProvider(),
            user_id=tenant.user_id,
            org_id=tenant.org_id,
            client_id=name,
        )
        await self.stack.enter_async_context(rt)
        return rt

    def token(self, tenant: Tenant = ALICE) -> str:
        return issue_token(SECRET, tenant, 3600)

    async def until(self, predicate: Callable[[Any], bool], timeout: float = 20.0) -> Any:
        """The status report once ``predicate`` holds (re-checked at each health write)."""
        async with asyncio.timeout(timeout), self.reports:
            while True:
                report = msgspec.to_builtins(await self.server.status_report())
                if predicate(report):
                    return report
                await self.reports.wait()


@pytest.fixture
async def setup(tmp_path: Path) -> AsyncIterator[Setup]:
    async with AsyncExitStack() as stack:
        store = SQLiteServerStore(tmp_path / "server.db")
        await store.open()
        stack.push_async_callback(store.close)
        server = SyncServer(store, port=0, secret=SECRET, admin_token=ADMIN)
        await server.start()
        stack.push_async_callback(server.shutdown)
        s = Setup(tmp_path, stack, server)
        # Observe the server's health reports as they come, to wait on them instead of
        # sleeping (the page writes those that wait before it reads).
        put = server.health.put
        notifying: set[asyncio.Task[None]] = set()

        def observed(report: DeviceHealth) -> None:
            put(report)
            task = asyncio.get_running_loop().create_task(notify())
            notifying.add(task)
            task.add_done_callback(notifying.discard)

        async def notify() -> None:
            async with s.reports:
                s.reports.notify_all()

        server.health.put = observed  # type: ignore[method-assign]
        yield s


def devices_of(report: dict[str, Any], user: str) -> dict[str, dict[str, Any]]:
    for u in report["users"]:
        if u["user_id"] == user:
            return {d["client_id"]: d for d in u["devices"]}
    return {}


def get(
    port: int, path: str, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


async def chat(rt: SessionRuntime, session_id: str, text: str) -> None:
    async for _ in rt.execute_message(session_id, text):
        pass


async def poisoned(rt: SessionRuntime, session_id: str) -> None:
    """A record of another tenant in this device's outbox: the server refuses it (3002) and
    the device dead-letters it."""
    foreign = Message(
        id=uuid7(),
        session_id=session_id,
        org_id="other-org",
        user_id="mallory",
        client_id=rt.client_id,
        hlc=HybridClock(rt.client_id).now(),
        role="user",
        content=[{"type": "text", "text": "not mine"}],
    )
    await rt.store.commit(WriteBatch(records=[foreign]))


async def test_devices_report_and_the_page_shows_what_is_safe(setup: Setup) -> None:
    laptop = await setup.device("laptop")
    phone = await setup.device("phone")
    session = await laptop.create_session(title="shared")
    await chat(laptop, session.id, "hello")
    await laptop.sync.connect(setup.url, setup.token())
    assert await laptop.sync.wait_until_synced(20)
    report = await setup.until(lambda r: devices_of(r, "alice").get("laptop", {}).get("cursor"))
    laptop_row = devices_of(report, "alice")["laptop"]
    assert laptop_row["verdict"] == "ok" and laptop_row["pending"] == 0
    assert laptop_row["lag"] == 0 and laptop_row["connected_here"] is True
    assert laptop_row["last_flush_outcome"] == "all-flushed" and laptop_row["last_flushed"] > 0
    assert laptop_row["protocol"] == MAX_PROTOCOL

    # The phone pulls, then edits the session offline while the laptop edits it live: the
    # phone's push conflicts when it syncs, and it says so in its health.
    phone.sync.max_protocol = 5  # a device not moved to protocol 6 yet: the page says so
    assert (await phone.sync.sync_once(setup.url, setup.token())).outcome == "none-pending"
    await chat(phone, session.id, "phone edit")
    await chat(laptop, session.id, "laptop edit")
    await poisoned(laptop, session.id)
    await chat(laptop, session.id, "after the poison")
    receipt = await phone.sync.sync_once(setup.url, setup.token())
    assert len(receipt.conflicts) == 1
    report = await setup.until(
        lambda r: (
            devices_of(r, "alice").get("laptop", {}).get("dead_letters") == 1
            and devices_of(r, "alice").get("phone", {}).get("conflicts")
        )
    )
    rows = devices_of(report, "alice")
    assert rows["laptop"]["verdict"] == "fail" and "refused" in rows["laptop"]["summary"]
    assert rows["laptop"]["pending"] == 0
    (conflict,) = rows["phone"]["conflicts"]
    assert conflict["session_id"] == session.id
    assert conflict["fork_session_id"] == receipt.conflicts[0].fork_session_id
    assert rows["phone"]["connected_here"] is False  # sync_once disconnects
    assert (rows["phone"]["protocol"], rows["laptop"]["protocol"]) == (5, MAX_PROTOCOL)
    user = next(u for u in report["users"] if u["user_id"] == "alice")
    assert user["verdict"] == "fail" and report["users"][0]["user_id"] == "alice"
    assert report["server"]["pushed_changes_total"] > 0
    assert report["server"]["fanout_frames_total"] > 0

    # The owner discards the dead letter: the laptop reports it, the verdict clears.
    (dead,) = await laptop.sync.dead_letters()
    assert await laptop.sync.discard_dead_letter(dead.client_seq)
    await chat(laptop, session.id, "one more")
    report = await setup.until(
        lambda r: devices_of(r, "alice").get("laptop", {}).get("dead_letters") == 0
    )
    assert devices_of(report, "alice")["laptop"]["verdict"] in ("ok", "warn")


async def test_the_protocol_shown_is_the_connections_not_the_devices_word(
    setup: Setup,
) -> None:
    """A device's report may name any version: the server keeps the one its connection
    agreed, and the page shows that."""
    async with connect(
        setup.url,
        additional_headers={"Authorization": f"Bearer {setup.token()}"},
        compression=None,
        proxy=None,
    ) as ws:
        client = Client(ws)
        await client.hello("boaster", 0, 5)
        await client.send(Health(pending=0, dead_letters=0, cursor=0, protocol=200))
        report = await setup.until(lambda r: "boaster" in devices_of(r, "alice"))
    assert devices_of(report, "alice")["boaster"]["protocol"] == 5
    page = render_html(await setup.server.status_report())
    assert "<dt>protocol</dt><dd>5</dd>" in page


async def test_the_page_needs_the_admin_token(setup: Setup) -> None:
    port = setup.server.port
    bob = await setup.device("bobs-phone", BOB)
    await bob.sync.sync_once(setup.url, setup.token(BOB))
    status, _, body = await asyncio.to_thread(get, port, "/status.json")
    assert status == 401 and b"admin token" in body
    status, _, body = await asyncio.to_thread(get, port, "/status")
    assert status == 401 and b"<form" in body
    wrong = {"Authorization": "Bearer " + "x" * len(ADMIN)}
    status, _, _ = await asyncio.to_thread(get, port, "/status.json", wrong)
    assert status == 401
    # A device's own token is not the admin token.
    device = {"Authorization": f"Bearer {setup.token(BOB)}"}
    assert (await asyncio.to_thread(get, port, "/status.json", device))[0] == 401

    status, _, body = await asyncio.to_thread(
        get, port, "/status.json", {"Authorization": f"Bearer {ADMIN}"}
    )
    assert status == 200 and "bobs-phone" in devices_of(msgspec.json.decode(body), "bob")

    # Once in the address bar, then a cookie: the token leaves the URL.
    status, headers, _ = await asyncio.to_thread(get, port, f"/status?token={ADMIN}")
    assert status == 303 and headers["Location"] == "/status"
    cookie = headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
    status, headers, body = await asyncio.to_thread(
        get, port, "/status", {"Cookie": cookie.split(";")[0]}
    )
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert b"bobs-phone" in body and b"pleach sync health" in body


async def test_without_an_admin_token_there_is_no_page(tmp_path: Path) -> None:
    async with SQLiteServerStore(tmp_path / "s.db") as store:
        server = SyncServer(store, port=0, secret=SECRET)
        await server.start()
        try:
            status, _, body = await asyncio.to_thread(get, server.port, "/status")
            assert status == 404 and b"--admin-token" in body
        finally:
            await server.shutdown()
    with pytest.raises(ValueError, match="admin_token"):
        SyncServer(store, port=0, secret=SECRET, admin_token="short")


def chromium() -> str | None:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None and os.environ.get("CI"):
        pytest.fail("chromium is not installed; .ci/run installs Debian's chromium package")
    if found is None:
        pytest.skip("Debian's chromium is not installed here (apt-get install chromium)")
    return found


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


async def test_the_page_in_a_real_browser(setup: Setup, tmp_path: Path) -> None:
    """Headless Chromium, phone-sized: follows the token redirect, keeps the cookie, renders
    the devices; the screenshot is a real picture of the page."""
    browser = chromium()
    laptop = await setup.device("laptop")
    session = await laptop.create_session()
    await chat(laptop, session.id, "hello")
    await poisoned(laptop, session.id)
    await laptop.sync.sync_once(setup.url, setup.token())
    await setup.until(lambda r: devices_of(r, "alice").get("laptop", {}).get("dead_letters"))
    url = f"http://127.0.0.1:{setup.server.port}/status?token={ADMIN}"
    shot = tmp_path / "status.png"
    common = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--window-size=412,915",
    ]
    dom = await asyncio.create_subprocess_exec(
        browser,
        *common,
        "--dump-dom",
        url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    out, _ = await asyncio.wait_for(dom.communicate(), 120)
    page = out.decode()
    assert dom.returncode == 0
    assert "pleach sync health" in page and "laptop" in page
    assert 'class="badge fail"' in page and "refused by the server" in page
    assert "admin token" not in page  # not the login form: the cookie was kept
    snap = await asyncio.create_subprocess_exec(
        browser,
        *common,
        f"--screenshot={shot}",
        url,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    await asyncio.wait_for(snap.wait(), 120)
    data = shot.read_bytes()
    assert png_size(data) == (412, 915) and len(data) > 5_000
    if os.environ.get("PLEACH_UPDATE_SCREENSHOT"):
        target = Path(__file__).resolve().parent.parent / "docs" / "status-page.png"
        target.write_bytes(data)
