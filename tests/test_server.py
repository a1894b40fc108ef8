"""End-to-end: a real SyncServer on a free loopback port, a real SQLiteServerStore on a tmp
file, real ``websockets`` clients speaking msgpack frames.

Nothing here sleeps to wait: every wait is on a frame, a close, or a condition.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import random
import signal
import socket
import sys
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from pathlib import Path
from typing import Any

import msgspec
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from pleach_server.auth import issue_token
from pleach_server.connection import FLOOD_CLOSE_AFTER
from pleach_server.gcpauses import GcPauses
from pleach_server.server import SyncServer
from pleach_server.store.base import PullResult, PushResult, Tenant
from pleach_server.store.sqlite import SQLiteServerStore
from shared import compact
from shared.clock import HybridClock
from shared.errors import ErrorCode
from shared.messages import (
    MAX_PROTOCOL,
    PROTOCOL_VERSION,
    Changes,
    Health,
    Hello,
    Pull,
    Push,
    PushAck,
    Welcome,
    unpacked,
)
from shared.protocol import Answer, ClientEvent, ClientProtocol, Live
from shared.records import Change
from tests.loop import until_true
from tests.server_factories import Device, new_tenant
from tests.wsclient import Client

SECRET = b"test-secret"
TIMEOUT = 10.0
ROOT = Path(__file__).resolve().parent.parent


# -- a tiny device client --------------------------------------------------------------------


def token_for(tenant: Tenant, ttl_s: int | None = 3600, secret: bytes = SECRET) -> str:
    return issue_token(secret, tenant, ttl_s)


@contextlib.asynccontextmanager
async def open_client(
    srv: SyncServer, tenant: Tenant | None = None, token: str | None = None, **kwargs: Any
) -> AsyncIterator[Client]:
    if token is None:
        assert tenant is not None
        token = token_for(tenant)
    kwargs.setdefault("compression", None)  # (frames as they are on the wire, unless asked)
    async with connect(
        srv.url,
        additional_headers={"Authorization": f"Bearer {token}"},
        proxy=None,
        open_timeout=TIMEOUT,
        close_timeout=2,
        **kwargs,
    ) as ws:
        yield Client(ws)


@contextlib.asynccontextmanager
async def device(
    srv: SyncServer, dev: Device, cursor: int = 0, protocol: int = PROTOCOL_VERSION
) -> AsyncIterator[Client]:
    """A connected device that has said Hello (at ``protocol``: the newest by default)."""
    async with open_client(srv, dev.tenant) as client:
        await client.hello(dev.client_id, cursor, protocol)
        yield client


async def http_get(port: int, path: str, headers: str = "") -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{headers}\r\n".encode("ascii")
        )
        await writer.drain()
        async with asyncio.timeout(TIMEOUT):
            raw = await reader.read()  # the server closes after an HTTP response
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    hdrs = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    return status, hdrs, body


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SQLiteServerStore]:
    async with SQLiteServerStore(tmp_path / "server.db", synchronous="NORMAL") as s:
        yield s


ServerFactory = Callable[..., Awaitable[SyncServer]]


@pytest.fixture
async def make_server(store: SQLiteServerStore) -> AsyncIterator[ServerFactory]:
    async with contextlib.AsyncExitStack() as stack:

        async def make(**kwargs: Any) -> SyncServer:
            kwargs.setdefault("rate_limit_per_s", None)
            return await stack.enter_async_context(
                SyncServer(store, port=0, secret=SECRET, **kwargs)
            )

        yield make


@pytest.fixture
async def srv(make_server: ServerFactory) -> SyncServer:
    return await make_server()


# -- auth ------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["missing", "forged", "expired", "malformed", "basic"])
async def test_upgrade_without_a_valid_token_is_401(srv: SyncServer, case: str) -> None:
    tenant = new_tenant()
    headers = {
        "missing": {},
        "forged": {"Authorization": f"Bearer {token_for(tenant, secret=b'wrong')}"},
        "expired": {
            "Authorization": "Bearer " + issue_token(SECRET, tenant, ttl_s=1, now=1_000_000_000)
        },
        "malformed": {"Authorization": "Bearer not-a-token"},
        "basic": {"Authorization": "Basic dXNlcjpwYXNz"},
    }[case]
    with pytest.raises(InvalidStatus) as info:
        async with connect(srv.url, additional_headers=headers, proxy=None):
            pytest.fail("a WebSocket was opened without a valid token")
    assert info.value.response.status_code == 401
    assert info.value.response.headers["WWW-Authenticate"].startswith("Bearer")
    body = msgspec.json.decode(info.value.response.body)
    assert body["code"] == ErrorCode.UNAUTHORIZED
    assert len(srv.connections) == 0


async def test_unknown_path_is_404(srv: SyncServer) -> None:
    status, _, _ = await http_get(srv.port, "/nope")
    assert status == 404


# -- hello, push, pull -----------------------------------------------------------------------


async def test_hello_welcome_push_ack_and_last_seq(srv: SyncServer) -> None:
    dev = Device(new_tenant())
    async with open_client(srv, dev.tenant) as client:
        welcome = await client.hello(dev.client_id)
        assert (welcome.server_id, welcome.last_seq, welcome.head_cursor) == (
            srv.server_id,
            0,
            0,
        )
        assert welcome.server_hlc
        session = dev.session(title="plane")
        changes = dev.changes(session, dev.message(session.id))
        ack = await client.push(changes)
        assert [r.status for r in ack.results] == ["applied", "applied"]
        assert ack.last_seq == 2 and ack.head_cursor == 2
        # A resend of the same changes (lost ack) is idempotent.
        again = await client.push(changes)
        assert [r.status for r in again.results] == ["duplicate", "duplicate"]
        assert again.last_seq == 2
    # A reconnecting device learns what the server already has.
    async with open_client(srv, dev.tenant) as client:
        welcome = await client.hello(dev.client_id, cursor=2)
        assert (welcome.last_seq, welcome.head_cursor) == (2, 2)


async def test_frames_are_compressed_each_alone_and_the_devices_in_a_small_window(
    srv: SyncServer,
) -> None:
    """permessage-deflate is on: the server deflates each frame alone (it holds no compressor
    while a connection is idle), and a device's frames keep their context in a 4 KiB window
    (the server's inflate holds it per connection)."""
    dev = Device(new_tenant())
    headers = {"Authorization": f"Bearer {token_for(dev.tenant)}"}
    async with connect(srv.url, additional_headers=headers, proxy=None) as ws:  # deflate offered
        client = Client(ws)
        await client.hello(dev.client_id)
        (extension,) = ws.protocol.extensions
        assert extension.name == "permessage-deflate"
        assert extension.remote_no_context_takeover  # what the server sends
        assert not extension.local_no_context_takeover  # what this device sends
        assert extension.local_max_window_bits == 12
        session = dev.session(title="x" * 5000)
        ack = await client.push(dev.changes(session))
        assert [r.status for r in ack.results] == ["applied"]
        # The page that brings it back, deflated alone, comes whole.
        page = await client.pull(0)
        assert [c.record.title for c in page.changes] == ["x" * 5000]


async def test_pull_pages(srv: SyncServer) -> None:
    dev = Device(new_tenant())
    async with device(srv, dev) as client:
        session = dev.session()
        records = [session] + [dev.message(session.id, f"m{i}") for i in range(6)]
        ack = await client.push(dev.changes(*records))
        assert ack.head_cursor == 7
        cursor, pages = 0, []
        while True:
            page = await client.pull(cursor, limit=3)
            assert page.from_cursor == cursor and not page.live
            pages.append([c.cursor for c in page.changes])
            cursor = page.to_cursor
            if not page.more:
                break
        assert pages == [[1, 2, 3], [4, 5, 6], [7]]
        empty = await client.pull(7)
        assert (empty.changes, empty.to_cursor, empty.more) == ([], 7, False)


async def test_pull_limit_is_clamped(make_server: ServerFactory) -> None:
    srv = await make_server(max_pull_limit=2)
    dev = Device(new_tenant())
    async with device(srv, dev) as client:
        s = dev.session()
        await client.push(dev.changes(s, dev.message(s.id), dev.message(s.id)))
        page = await client.pull(0, limit=1000)
        assert len(page.changes) == 2 and page.more


async def test_record_of_another_tenant_is_rejected_3002(srv: SyncServer) -> None:
    alice, bob = Device(new_tenant()), Device(new_tenant())
    async with device(srv, alice) as client:
        foreign = bob.session()  # bob's tenant on the record, pushed with alice's token
        ack = await client.push(
            [
                Change(
                    client_seq=1, record=msgspec.structs.replace(foreign, client_id=alice.client_id)
                )
            ]
        )
        (result,) = ack.results
        assert result.status == "rejected" and result.code == ErrorCode.FORBIDDEN
        assert ack.last_seq == 1  # a rejected change still advances last_seq
        assert (await client.pull(0)).changes == []


# -- live fan-out ----------------------------------------------------------------------------


async def test_push_reaches_other_devices_of_the_tenant_live(srv: SyncServer) -> None:
    tenant = new_tenant()
    a, b, c = Device(tenant), Device(tenant), Device(new_tenant())
    async with device(srv, a) as ca, device(srv, b) as cb, device(srv, c) as cc:
        session = a.session(title="from A")
        ack = await ca.push(a.changes(session))
        live = await cb.live_frame()
        assert live.live and (live.from_cursor, live.to_cursor) == (0, ack.head_cursor)
        assert [ch.record.id for ch in live.changes] == [session.id]
        # A (protocol 5) learns its rows from the ack, not from a live page of its own push.
        assert ack.as_pushed_from == 0
        # Tenant C's device hears nothing: its next frame is the answer to its own pull.
        page = await cc.pull(0)
        assert page.changes == [] and cc.live == []
        # B keeps working normally after the live frame.
        assert [ch.record.id for ch in (await cb.pull(0)).changes] == [session.id]
        # B's commit reaches A live: the first live frame A gets, so none came of its own.
        from_b = await cb.push(b.changes(b.session(title="from B")))
        first = await ca.live_frame()
        assert (first.from_cursor, first.to_cursor) == (ack.head_cursor, from_b.head_cursor)


async def test_a_device_before_protocol_5_hears_its_own_push_live(srv: SyncServer) -> None:
    """A version 4 device learns its rows' places from the live page of its own push (and
    its ack vouches for nothing); a version 5 device beside it does not get that page."""
    tenant = new_tenant()
    old, new = Device(tenant), Device(tenant)
    async with device(srv, old, protocol=4) as co, device(srv, new) as cn:
        ack = await co.push(old.changes(old.session(title="v4")))
        assert ack.as_pushed_from is None
        assert (await co.live_frame()).to_cursor == ack.head_cursor
        assert (await cn.live_frame()).to_cursor == ack.head_cursor
        second = await cn.push(new.changes(new.session(title="v5")))
        assert second.as_pushed_from == ack.head_cursor
        assert (await co.live_frame()).to_cursor == second.head_cursor
        # The v5 device's next frame answers its pull: no live page of its own push came.
        page = await cn.pull(ack.head_cursor)
        assert page.to_cursor == second.head_cursor and cn.live == []


async def test_live_frame_starts_at_the_tenants_previous_head(srv: SyncServer) -> None:
    """Feed cursors are shared by all tenants: another tenant's commit in between must not
    make a device think it missed something (from_cursor == its own cursor)."""
    tenant = new_tenant()
    a, b, other = Device(tenant), Device(tenant), Device(new_tenant())
    async with device(srv, a) as ca, device(srv, b) as cb, device(srv, other) as co:
        first = await ca.push(a.changes(a.session()))
        live = await cb.live_frame()
        assert live.to_cursor == first.head_cursor
        await co.push(other.changes(other.session(), other.session()))
        second = await ca.push(a.changes(a.session()))
        live = await cb.live_frame()
        assert live.from_cursor == first.head_cursor  # b's cursor: nothing to pull
        assert live.to_cursor == second.head_cursor > first.head_cursor + 1
        assert len(live.changes) == 1


class Bus:
    """Cross-instance notifications in memory: what a Postgres LISTEN/NOTIFY notifier does."""

    def __init__(self) -> None:
        self.members: list[BusNotifier] = []


class BusNotifier:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.on_commit: Callable[[Tenant, int, int], Awaitable[None]] | None = None
        self.published: list[tuple[Tenant, int, int]] = []

    async def start(self, on_commit: Callable[[Tenant, int, int], Awaitable[None]]) -> None:
        self.on_commit = on_commit
        self.bus.members.append(self)

    async def publish(self, tenant: Tenant, from_cursor: int, to_cursor: int) -> None:
        self.published.append((tenant, from_cursor, to_cursor))
        for member in self.bus.members:
            if member is not self and member.on_commit is not None:
                await member.on_commit(tenant, from_cursor, to_cursor)

    async def close(self) -> None:
        if self in self.bus.members:
            self.bus.members.remove(self)


async def test_two_instances_fan_out_through_the_notifier(make_server: ServerFactory) -> None:
    bus = Bus()
    n1, n2 = BusNotifier(bus), BusNotifier(bus)
    srv1 = await make_server(notifier=n1)
    srv2 = await make_server(notifier=n2)
    tenant = new_tenant()
    a, b = Device(tenant), Device(tenant)
    async with device(srv1, a) as ca, device(srv2, b) as cb:
        session = a.session()
        ack = await ca.push(a.changes(session))
        live = await cb.live_frame()  # served by the other instance
        assert (live.from_cursor, live.to_cursor) == (0, ack.head_cursor)
        assert [c.record.id for c in live.changes] == [session.id]
        assert n1.published == [(tenant, 0, ack.head_cursor)]
        assert n2.published == []  # a remote commit is not re-announced


# -- protocol errors -------------------------------------------------------------------------


async def test_malformed_and_mistyped_frames_get_3004_and_the_connection_lives(
    srv: SyncServer,
) -> None:
    dev = Device(new_tenant())
    async with device(srv, dev) as client:
        await client.send_raw(b"\xc1 not msgpack")
        err = await client.error()
        assert err.code == ErrorCode.MALFORMED_FRAME and not err.retryable
        await client.send_raw(msgspec.msgpack.encode({"type": "pull", "cursor": "zero"}))
        assert (await client.error()).code == ErrorCode.MALFORMED_FRAME
        await client.send_raw(msgspec.msgpack.encode({"type": "nope"}))
        assert (await client.error()).code == ErrorCode.MALFORMED_FRAME
        await client.send_raw("text is not allowed")
        assert (await client.error()).code == ErrorCode.MALFORMED_FRAME
        # Nested deeper than the decoder goes (a RecursionError once, and a close with no
        # Error frame): refused like any malformed frame.
        await client.send_raw(b"\x81\xa4type\xa4push" + b"\x91" * 5000 + b"\xc0")
        assert (await client.error()).code == ErrorCode.MALFORMED_FRAME
        deep = {"type": "push", "changes": [{"client_seq": 1, "record": _deep(3000)}]}
        await client.send_raw(_encode_deep(deep))
        assert (await client.error()).code == ErrorCode.MALFORMED_FRAME
        # Still usable.
        ack = await client.push(dev.changes(dev.session()))
        assert ack.results[0].status == "applied"


def _deep(depth: int) -> list[object]:
    outer: list[object] = []
    current = outer
    for _ in range(depth):
        inner: list[object] = []
        current.append(inner)
        current = inner
    return outer


def _encode_deep(value: object) -> bytes:
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)
    try:
        return msgspec.msgpack.encode(value)
    finally:
        sys.setrecursionlimit(limit)


async def test_frame_over_max_frame_bytes_gets_3005_then_1009(
    make_server: ServerFactory,
) -> None:
    srv = await make_server(max_frame_bytes=64 * 1024)
    dev, other = Device(new_tenant()), Device(new_tenant())
    async with device(srv, other) as bystander:
        async with device(srv, dev) as client:
            await client.send_raw(os.urandom(100 * 1024))  # between the limit and twice it
            err = await client.error()
            assert err.code == ErrorCode.FRAME_TOO_LARGE
            closed = await client.closed()
            assert closed.rcvd is not None and closed.rcvd.code == 1009
        async with device(srv, dev) as client:
            await client.send_raw(os.urandom(200 * 1024))  # over twice: websockets refuses
            closed = await client.closed()
            assert closed.rcvd is not None and closed.rcvd.code == 1009
        await assert_still_served(bystander, other)


async def test_a_deflated_frame_is_held_to_the_limits_as_it_inflates(
    make_server: ServerFactory,
) -> None:
    """Frames of zeros, a few KiB on the wire once deflated (a zip bomb): one that inflates to
    between the frame limit and twice it gets 3005 and a close (1009), as a frame that large
    uncompressed; one that inflates to 256 times the limit is refused while it inflates
    (websockets inflates at most twice the limit), and the other devices are served on."""
    srv = await make_server(max_frame_bytes=64 * 1024)
    dev, other = Device(new_tenant()), Device(new_tenant())
    big = b"\x00" * (16 * 1024 * 1024)
    assert len(zlib.compress(big)) < 20 * 1024  # what such a frame weighs on the wire
    async with device(srv, other) as bystander:
        async with open_client(srv, dev.tenant, compression="deflate") as client:
            await client.hello(dev.client_id)
            await client.send_raw(bytes(100 * 1024))  # between the limit and twice it
            err = await client.error()
            assert err.code == ErrorCode.FRAME_TOO_LARGE
            closed = await client.closed()
            assert closed.rcvd is not None and closed.rcvd.code == 1009
        async with open_client(srv, dev.tenant, compression="deflate") as client:
            await client.hello(dev.client_id)
            assert [e.name for e in client.ws.protocol.extensions] == ["permessage-deflate"]
            await client.send_raw(big)
            with pytest.raises(ConnectionClosed) as refused:
                await client.recv()  # no 3005 first: refused before the frame was whole
            assert refused.value.rcvd is not None and refused.value.rcvd.code == 1009
        await assert_still_served(bystander, other)


async def test_push_before_hello_is_an_error_and_closes_1008(srv: SyncServer) -> None:
    dev, other = Device(new_tenant()), Device(new_tenant())
    async with device(srv, other) as bystander:
        async with open_client(srv, dev.tenant) as client:
            await client.send(Push(changes=dev.changes(dev.session())))
            err = await client.error()
            assert err.code == ErrorCode.MALFORMED_FRAME
            closed = await client.closed()
            assert closed.rcvd is not None and closed.rcvd.code == 1008
        async with open_client(srv, dev.tenant) as client:
            await client.send(Hello(protocol=PROTOCOL_VERSION + 99, client_id=dev.client_id))
            assert (await client.error()).code == ErrorCode.PROTOCOL_VERSION
            closed = await client.closed()
            assert closed.rcvd is not None and closed.rcvd.code == 1008
        await assert_still_served(bystander, other)


async def assert_still_served(client: Client, dev: Device) -> None:
    session = dev.session()
    ack = await client.push(dev.changes(session))
    assert ack.results[0].status == "applied"
    page = await client.pull(ack.head_cursor - 1)
    assert [c.record.id for c in page.changes] == [session.id]


async def test_rate_limit_gets_3008_and_the_connection_lives(
    make_server: ServerFactory,
) -> None:
    # Burst of 2 and (practically) no refill: the third frame is over the limit.
    srv = await make_server(rate_limit_per_s=1e-6, rate_limit_burst=2)
    dev = Device(new_tenant())
    async with open_client(srv, dev.tenant) as client:
        await client.hello(dev.client_id)
        await client.pull(0)
        await client.send(Pull(cursor=0))
        err = await client.error()
        assert err.code == ErrorCode.RATE_LIMITED and err.retryable
        assert srv.connections  # still connected


async def test_a_peer_that_ignores_3008_is_cut(make_server: ServerFactory) -> None:
    srv = await make_server(rate_limit_per_s=1e-6, rate_limit_burst=2)
    dev, other = Device(new_tenant()), Device(new_tenant())
    async with open_client(srv, dev.tenant) as client:
        await client.hello(dev.client_id)
        for _ in range(FLOOD_CLOSE_AFTER + 5):
            await client.send(Pull(cursor=0))
        closed = await client.closed()
        assert closed.rcvd is not None and closed.rcvd.code == 1008
    async with open_client(srv, other.tenant) as client:  # others are served
        assert (await client.hello(other.client_id)).head_cursor == 0


async def test_bytes_per_second_are_limited_too(make_server: ServerFactory) -> None:
    srv = await make_server(rate_limit_per_s=None, rate_limit_bytes_per_s=1e-6)
    dev = Device(new_tenant())
    async with open_client(srv, dev.tenant) as client:
        await client.hello(dev.client_id)  # within the burst (twice the frame limit)
        for _ in range(3):  # 9 MiB of junk: the burst is spent during the third
            await client.send_raw(b"\x00" * (3 * 1024 * 1024))
        codes = [(await client.error()).code for _ in range(3)]
        assert codes == [ErrorCode.MALFORMED_FRAME] * 2 + [ErrorCode.RATE_LIMITED]
        # A small frame still fits what is left of the budget.
        assert (await client.pull(0)).to_cursor == 0


async def test_rate_limited_answer_echoes_the_request_id(make_server: ServerFactory) -> None:
    srv = await make_server(rate_limit_per_s=1e-6, rate_limit_burst=2)
    dev = Device(new_tenant())
    async with open_client(srv, dev.tenant) as client:
        await client.hello(dev.client_id)
        await client.pull(0)
        await client.send(Pull(cursor=0, request_id=41))
        err = await client.error()
        assert (err.code, err.request_id) == (ErrorCode.RATE_LIMITED, 41)


async def test_a_tenants_connections_share_one_rate_limit(make_server: ServerFactory) -> None:
    """Opening more connections buys a tenant no more frames; another tenant is untouched."""
    srv = await make_server(rate_limit_per_s=None, tenant_rate_limit_per_s=1e-6)
    flood, honest = Device(new_tenant()), Device(new_tenant())
    async with open_client(srv, flood.tenant) as a, open_client(srv, flood.tenant) as b:
        await a.hello(flood.client_id)  # the bucket holds 1 frame (no per-connection limit)
        await b.send(Hello(protocol=2, client_id=flood.client_id + "-b", request_id=7))
        err = await b.error()
        assert (err.code, err.request_id) == (ErrorCode.RATE_LIMITED, 7)
        async with open_client(srv, honest.tenant) as other:
            welcome = await other.hello(honest.client_id)
            assert welcome.protocol >= 1


async def test_connections_from_one_address_share_one_rate_limit(
    make_server: ServerFactory,
) -> None:
    """Many accounts from one machine get no more frames than one source's share: every
    tenant here is fresh (its own bucket full), yet the second is refused."""
    srv = await make_server(rate_limit_per_s=None, source_rate_limit_per_s=1e-6)
    # The source bucket holds 1 frame (its burst: at least one, twice the rate).
    devices = [Device(new_tenant()) for _ in range(2)]
    async with (
        open_client(srv, devices[0].tenant) as a,
        open_client(srv, devices[1].tenant) as c,
    ):
        await a.hello(devices[0].client_id)
        await c.send(Hello(protocol=2, client_id=devices[1].client_id, request_id=3))
        err = await c.error()
        assert (err.code, err.request_id) == (ErrorCode.RATE_LIMITED, 3) and err.retryable


async def test_no_source_limit_when_disabled(make_server: ServerFactory) -> None:
    srv = await make_server(rate_limit_per_s=None, source_rate_limit_per_s=None)
    devices = [Device(new_tenant()) for _ in range(5)]
    for dev in devices:
        async with open_client(srv, dev.tenant) as client:
            assert (await client.hello(dev.client_id)).head_cursor == 0
    with pytest.raises(ValueError, match="source_rate_limit_per_s"):
        SyncServer(srv.store, port=0, secret=SECRET, source_rate_limit_per_s=0)


async def test_a_flooding_tenant_holds_at_most_two_store_slots(
    store: SQLiteServerStore, make_server: ServerFactory
) -> None:
    """Fairness: one tenant's many concurrent pushes wait their turn in the server, not in
    the shared store's queue, so another tenant's push goes through while they are stuck."""
    flood_tenant = new_tenant()
    inside = 0
    most = 0
    changed = asyncio.Condition()
    release = asyncio.Event()
    push = store.push

    async def held_push(tenant: Tenant, *args: Any, **kwargs: Any) -> Any:
        nonlocal inside, most
        if tenant != flood_tenant:
            return await push(tenant, *args, **kwargs)
        async with changed:
            inside += 1
            most = max(most, inside)
            changed.notify_all()
        try:
            await release.wait()
            return await push(tenant, *args, **kwargs)
        finally:
            inside -= 1

    store.push = held_push  # type: ignore[method-assign]
    srv = await make_server()
    flooders = [Device(flood_tenant) for _ in range(6)]
    honest = Device(new_tenant())
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(device(srv, d)) for d in flooders]
        for dev, client in zip(flooders, clients, strict=True):
            await client.send(Push(changes=dev.changes(dev.session()), request_id=1))
        async with asyncio.timeout(TIMEOUT), changed:
            await changed.wait_for(lambda: inside == 2)
        async with device(srv, honest) as other:
            ack = await other.push(honest.changes(honest.session()))
            assert ack.results[0].status == "applied"
        assert inside == 2  # the other four still wait in the server, outside the store
        release.set()
        for client in clients:
            answer = await client.answer()
            assert isinstance(answer, PushAck) and answer.results[0].status == "applied"
    assert most == 2


async def test_a_nul_in_an_id_and_a_cursor_past_int64_are_bad_input_not_storage_errors(
    srv: SyncServer,
) -> None:
    dev = Device(new_tenant())
    async with device(srv, dev) as client:
        session = msgspec.structs.replace(dev.session(), id="bad\x00id")
        ack = await client.push(dev.changes(session))
        assert [r.code for r in ack.results] == [ErrorCode.INVALID_RECORD]
        await client.send(Pull(cursor=2**63))
        assert (await client.error()).code == ErrorCode.MALFORMED_FRAME
        ok = await client.push(dev.changes(dev.session()))
        assert ok.results[0].status == "applied"


# -- protocol versions, request ids, optional frames -----------------------------------------


async def test_welcome_names_the_agreed_version_and_the_tokens_tenant(srv: SyncServer) -> None:
    dev = Device(new_tenant())
    async with open_client(srv, dev.tenant) as client:
        # A version 1 device names one version and no request id.
        await client.send(Hello(protocol=1, client_id=dev.client_id))
        welcome = await client.answer()
        assert isinstance(welcome, Welcome)
        assert (welcome.protocol, welcome.request_id) == (1, 0)
        assert (welcome.org_id, welcome.user_id) == (dev.tenant.org_id, dev.tenant.user_id)
    async with open_client(srv, dev.tenant) as client:
        await client.send(
            Hello(
                protocol=1,
                client_id=dev.client_id,
                min_protocol=1,
                max_protocol=MAX_PROTOCOL,
                request_id=1,
            )
        )
        welcome = await client.answer()
        assert isinstance(welcome, Welcome)
        assert (welcome.protocol, welcome.request_id) == (MAX_PROTOCOL, 1)
        assert (welcome.org_id, welcome.user_id) == (dev.tenant.org_id, dev.tenant.user_id)


async def test_no_common_version_gets_3003_naming_both_ranges_then_1008(
    srv: SyncServer,
) -> None:
    dev = Device(new_tenant())
    async with open_client(srv, dev.tenant) as client:
        await client.send(
            Hello(
                protocol=10, client_id=dev.client_id, min_protocol=10, max_protocol=11, request_id=1
            )
        )
        err = await client.error()
        assert (err.code, err.request_id) == (ErrorCode.PROTOCOL_VERSION, 1)
        assert f"device speaks 10..11, server speaks 1..{MAX_PROTOCOL}" in err.message
        closed = await client.closed()
        assert closed.rcvd is not None and closed.rcvd.code == 1008


async def test_answers_echo_request_ids_and_live_frames_carry_none(srv: SyncServer) -> None:
    tenant = new_tenant()
    a, b = Device(tenant), Device(tenant)
    async with device(srv, a) as ca, device(srv, b) as cb:
        await ca.send(Push(changes=a.changes(a.session()), request_id=10))
        ack = await ca.answer()
        assert isinstance(ack, PushAck) and ack.request_id == 10
        await ca.send(Pull(cursor=0, request_id=11))
        page = await ca.answer()
        assert isinstance(page, Changes) and not page.live and page.request_id == 11
        await ca.send(Pull(cursor=-1, request_id=12))
        err = await ca.error()
        assert (err.code, err.request_id) == (ErrorCode.MALFORMED_FRAME, 12)
        await ca.send_raw(msgspec.msgpack.encode({"type": "pull", "cursor": "x", "request_id": 13}))
        err = await ca.error()
        assert (err.code, err.request_id) == (ErrorCode.MALFORMED_FRAME, 13)
        live = await cb.live_frame()
        assert live.request_id == 0
        assert all(frame.request_id == 0 for frame in ca.live)


async def test_an_optional_frame_of_unknown_type_is_skipped_and_counted(srv: SyncServer) -> None:
    dev = Device(new_tenant())
    async with device(srv, dev) as client:
        await client.send_raw(
            msgspec.msgpack.encode({"type": "ping", "optional": True, "request_id": 3})
        )
        # Nothing answers it: the next frame is the answer to the pull.
        page = await client.pull(0)
        assert page.changes == []
        await client.send_raw(msgspec.msgpack.encode({"type": "ping", "request_id": 4}))
        err = await client.error()
        assert (err.code, err.request_id) == (ErrorCode.MALFORMED_FRAME, 4)
        assert "ping" in err.message
        status, _, body = await http_get(srv.port, "/metrics")
    assert status == 200
    assert 'pleach_frames_received_total{type="ignored"} 1.0' in body.decode()


async def test_a_client_protocol_pump_sorts_what_a_real_server_sends(srv: SyncServer) -> None:
    tenant = new_tenant()
    a, b = Device(tenant), Device(tenant)
    async with open_client(srv, tenant) as raw, device(srv, b) as cb:
        proto = ClientProtocol(a.client_id, 0)

        async def exchange() -> list[ClientEvent]:
            for data in proto.data_to_send():
                await raw.send_raw(data)
            async with asyncio.timeout(TIMEOUT):
                data = await raw.ws.recv()
            assert isinstance(data, bytes)
            proto.receive_data(data)
            return proto.take_events()

        (event,) = await exchange()
        assert isinstance(event, Answer) and isinstance(event.frame, Welcome)
        assert event.request_id == proto.hello_request_id
        assert (event.frame.org_id, event.frame.user_id) == (tenant.org_id, tenant.user_id)
        assert proto.version == MAX_PROTOCOL

        push_id = proto.send_push(a.changes(a.session()))
        (event,) = await exchange()
        assert event == Answer(push_id, event.frame) and isinstance(event.frame, PushAck)
        assert event.frame.as_pushed_from == 0  # its own commit: told by the ack, not live
        session = b.session()
        await cb.push(b.changes(session))
        (event,) = await exchange()
        assert isinstance(event, Live)
        assert [c.record.id for c in event.changes.changes] == [session.id]
        pull_id = proto.send_pull(0)
        (event,) = await exchange()
        assert isinstance(event, Answer) and event.request_id == pull_id
        assert isinstance(event.frame, Changes) and len(event.frame.changes) == 2
        assert proto.outstanding == () and proto.close_reason is None


class FlakyStore:
    """The real SQLite store, with ``pull`` failing on demand (a database outage)."""

    def __init__(self, inner: SQLiteServerStore) -> None:
        self.inner = inner
        self.fail_pull: Exception | None = None
        self.push_entered = asyncio.Event()
        self.push_gate: asyncio.Event | None = None

    async def open(self) -> None: ...
    async def close(self) -> None: ...

    async def healthy(self) -> bool:
        return self.fail_pull is None and await self.inner.healthy()

    async def client_state(self, tenant: Tenant, client_id: str) -> tuple[int, int]:
        return await self.inner.client_state(tenant, client_id)

    async def push(
        self,
        tenant: Tenant,
        client_id: str,
        changes: list[Change],
        clock: HybridClock,
        *,
        aliases: Collection[str] = (),
        chains: bool = True,
        skipped: Collection[int] = (),
        bodies: Collection[bytes] = (),
    ) -> PushResult:
        self.push_entered.set()
        if self.push_gate is not None:
            await self.push_gate.wait()
        return await self.inner.push(
            tenant,
            client_id,
            changes,
            clock,
            aliases=aliases,
            chains=chains,
            skipped=skipped,
            bodies=bodies,
        )

    async def pull(
        self,
        tenant: Tenant,
        cursor: int,
        limit: int,
        max_bytes: int | None = None,
        *,
        raw: bool = False,
    ) -> PullResult:
        if self.fail_pull is not None:
            raise self.fail_pull
        return await self.inner.pull(tenant, cursor, limit, max_bytes, raw=raw)

    async def head_cursor(self, tenant: Tenant) -> int:
        return await self.inner.head_cursor(tenant)

    async def compact_feed(self, tenant: Tenant, keep_after_cursor: int) -> int:
        return await self.inner.compact_feed(tenant, keep_after_cursor)


async def test_store_errors_become_error_frames_and_the_connection_lives(
    store: SQLiteServerStore,
) -> None:
    from shared.errors import StorageUnavailable

    flaky = FlakyStore(store)
    async with SyncServer(flaky, port=0, secret=SECRET) as srv:
        dev = Device(new_tenant())
        async with device(srv, dev) as client:
            s = dev.session()
            ack = await client.push(dev.changes(s, dev.message(s.id), dev.message(s.id)))
            assert ack.head_cursor == 3
            await store.compact_feed(dev.tenant, 2)
            await client.send(Pull(cursor=1))  # below the floor (0 is a full resync)
            assert (await client.error()).code == ErrorCode.CURSOR_TOO_OLD
            flaky.fail_pull = StorageUnavailable("database is down")
            await client.send(Pull(cursor=2))
            err = await client.error()
            assert err.code == ErrorCode.STORAGE_UNAVAILABLE and err.retryable
            status, _, body = await http_get(srv.port, "/healthz")
            assert status == 503
            assert msgspec.json.decode(body) == {
                "status": "unavailable",
                "store": False,
                "connections": 1,
            }
            flaky.fail_pull = None
            page = await client.pull(2)
            assert [c.cursor for c in page.changes] == [3]


async def test_unexpected_store_failure_closes_only_that_connection_1011(
    store: SQLiteServerStore,
) -> None:
    flaky = FlakyStore(store)
    async with SyncServer(flaky, port=0, secret=SECRET) as srv:
        dev, other = Device(new_tenant()), Device(new_tenant())
        async with device(srv, other) as bystander:
            async with device(srv, dev) as client:
                flaky.fail_pull = RuntimeError("a bug in the store")
                await client.send(Pull(cursor=0))
                err = await client.error()
                assert err.code == ErrorCode.STORAGE_UNAVAILABLE and err.retryable
                closed = await client.closed()
                assert closed.rcvd is not None and closed.rcvd.code == 1011
            flaky.fail_pull = None
            await assert_still_served(bystander, other)


# -- slow consumers --------------------------------------------------------------------------


async def test_slow_device_is_cut_and_others_keep_their_live_frames(
    make_server: ServerFactory,
) -> None:
    srv = await make_server(fanout_queue=8)
    tenant = new_tenant()
    pusher, reader_dev, slow_dev = Device(tenant), Device(tenant), Device(tenant)

    # The slow device never reads: a tiny receive buffer and a 1-frame client queue make its
    # socket back up after a few frames, so the server's writer for it blocks.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", srv.port))
    payload = os.urandom(16 * 1024).hex()  # incompressible, 32 KiB per event

    async with (
        open_client(srv, tenant, sock=sock, max_queue=1) as slow,
        device(srv, pusher) as cp,
        device(srv, reader_dev) as cr,
    ):
        await slow.hello(slow_dev.client_id)
        received: list[Changes] = []
        got = asyncio.Event()
        expected: list[int] = []

        async def read_live() -> None:
            while True:
                received.append(await cr.live_frame())
                got.set()

        reader = asyncio.create_task(read_live())
        session = pusher.session()
        await cp.push(pusher.changes(session))
        heads = []
        for _ in range(400):  # bounded: the cut comes long before this
            ack = await cp.push(pusher.changes(pusher.event(session.id, blob=payload)))
            heads.append(ack.head_cursor)
            if srv.hub.drops > 0:
                break
        assert srv.hub.drops > 0, "the slow device was never cut"
        # A few more after the cut: the fast path is unaffected.
        for _ in range(5):
            ack = await cp.push(pusher.changes(pusher.event(session.id, blob="x")))
            heads.append(ack.head_cursor)
        expected.extend([1, *heads])
        async with asyncio.timeout(TIMEOUT):
            # The last page may have come before its ack did (the others hear first).
            while True:
                got.clear()
                if received and received[-1].to_cursor >= expected[-1]:
                    break
                await got.wait()
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        # The reading device got every commit, in order, with no gap and no marker.
        assert [f.to_cursor for f in received] == expected
        assert all(f.changes for f in received)
        # The slow device, once it reads, finds a cut marker telling it to pull.
        frames: list[Changes] = []
        while not frames or frames[-1].to_cursor < expected[-1]:
            frames.append(await slow.live_frame())
        markers = [f for f in frames if not f.changes]
        assert markers and all(m.from_cursor == m.to_cursor for m in markers)
        assert len(frames) < len(expected)  # it did not get every frame
        page = await slow.pull(markers[0].to_cursor)
        assert page.from_cursor == markers[0].to_cursor

    status, _, body = await http_get(srv.port, "/metrics")
    assert status == 200
    drops = [ln for ln in body.decode().splitlines() if ln.startswith("pleach_fanout_drops_total ")]
    assert drops and float(drops[0].split()[1]) > 0


# -- HTTP: health and metrics ----------------------------------------------------------------


async def test_healthz(srv: SyncServer) -> None:
    status, headers, body = await http_get(srv.port, "/healthz")
    assert status == 200 and headers["content-type"] == "application/json"
    assert msgspec.json.decode(body) == {"status": "ok", "store": True, "connections": 0}
    dev = Device(new_tenant())
    async with device(srv, dev):
        _, _, body = await http_get(srv.port, "/healthz")
        assert msgspec.json.decode(body)["connections"] == 1


async def test_metrics_exposition(srv: SyncServer) -> None:
    dev = Device(new_tenant())
    async with device(srv, dev) as client:
        s = dev.session()
        await client.push(dev.changes(s, dev.message(s.id), dev.message(s.id)))
        await client.push([Change(client_seq=1, record=s)])  # a duplicate
        await client.pull(0)
        status, headers, body = await http_get(srv.port, "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    text = body.decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    assert samples['pleach_changes_total{status="applied"}'] == 3
    assert samples['pleach_changes_total{status="duplicate"}'] == 1
    assert samples["pleach_connections"] == 1
    assert samples['pleach_frames_received_total{type="push"}'] == 2
    assert samples['pleach_frames_received_total{type="hello"}'] == 1
    assert samples['pleach_frames_sent_total{type="push_ack"}'] == 2
    assert samples['pleach_frames_sent_total{type="welcome"}'] == 1
    assert samples["pleach_push_seconds_count"] == 2
    for name in ("pleach_conflicts_total", "pleach_fanout_drops_total", "pleach_errors"):
        assert name in text


async def test_health_reports_wait_in_memory_and_are_written_together(
    make_server: ServerFactory, store: SQLiteServerStore
) -> None:
    """Reports of many devices cost one transaction: they wait in memory (here, for an hour)
    and the status page writes them before it reads; ``/metrics`` counts both."""
    srv = await make_server(health_flush_s=3600)
    devices = [Device(new_tenant()) for _ in range(3)]
    async with contextlib.AsyncExitStack() as stack:
        for n, dev in enumerate(devices):
            client = await stack.enter_async_context(device(srv, dev))
            await client.send(Health(pending=n, dead_letters=0, cursor=0))
            await client.pull(0)  # answered after the report: the server has taken it
    orgs = {d.tenant.org_id for d in devices}
    assert [r for r in await store.list_health() if r.org_id in orgs] == []
    _, _, body = await http_get(srv.port, "/metrics")
    samples = dict(ln.rpartition(" ")[::2] for ln in body.decode().splitlines() if ln[:1] != "#")
    assert float(samples["pleach_health_reports_waiting"]) == 3
    assert float(samples["pleach_health_writes_total"]) == 0
    report = await srv.status_report()
    shown = {d.client_id: d.pending for u in report.users for d in u.devices}
    assert {dev.client_id: shown.get(dev.client_id) for dev in devices} == {
        dev.client_id: n for n, dev in enumerate(devices)
    }
    _, _, body = await http_get(srv.port, "/metrics")
    samples = dict(ln.rpartition(" ")[::2] for ln in body.decode().splitlines() if ln[:1] != "#")
    assert float(samples["pleach_health_reports_waiting"]) == 0
    assert float(samples["pleach_health_reports_written_total"]) == 3
    assert float(samples["pleach_health_writes_total"]) == 1


async def test_health_reports_are_written_at_shutdown(
    make_server: ServerFactory, store: SQLiteServerStore
) -> None:
    srv = await make_server(health_flush_s=3600)
    dev = Device(new_tenant())
    async with device(srv, dev) as client:
        await client.send(Health(pending=7, dead_letters=0, cursor=0))
        await client.pull(0)
    await srv.shutdown()
    rows = [r for r in await store.list_health() if r.org_id == dev.tenant.org_id]
    assert [(r.client_id, msgspec.msgpack.decode(r.health, type=Health).pending) for r in rows] == [
        (dev.client_id, 7)
    ]


def _samples(body: bytes) -> dict[str, float]:
    out = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_gc_pauses_are_kept_by_generation_and_bucket() -> None:
    record = GcPauses()
    record.install()
    try:
        before = [sum(c) for c in record.counts]
        gc.collect(0)
        gc.collect(2)
        after = [sum(c) for c in record.counts]
    finally:
        record.uninstall()
    assert after[0] >= before[0] + 1 and after[2] >= before[2] + 1
    assert record.sums[2] > 0 and 0 < record.longest[2] <= record.sums[2]
    gc.collect(2)  # (uninstalled: no longer counted)
    assert [sum(c) for c in record.counts] == after


async def test_metrics_give_the_collectors_pauses(srv: SyncServer) -> None:
    _, _, body = await http_get(srv.port, "/metrics")
    before = _samples(body)
    gc.collect()
    _, _, body = await http_get(srv.port, "/metrics")
    after = _samples(body)
    count = 'pleach_gc_pause_seconds_count{generation="2"}'
    assert after[count] >= before[count] + 1
    assert after['pleach_gc_pause_seconds_bucket{generation="2",le="+Inf"}'] == after[count]
    assert after['pleach_gc_pause_seconds_sum{generation="2"}'] > 0
    assert after['pleach_gc_pause_longest_seconds{generation="2"}'] > 0
    assert "pleach_gc_frozen_objects" in after


async def test_metrics_behind_a_token_when_one_is_set(make_server: ServerFactory) -> None:
    srv = await make_server(metrics_token="m3trics")
    status, _, _ = await http_get(srv.port, "/metrics")
    assert status == 401
    status, _, _ = await http_get(srv.port, "/metrics", "Authorization: Bearer wrong\r\n")
    assert status == 401
    status, _, body = await http_get(srv.port, "/metrics", "Authorization: Bearer m3trics\r\n")
    assert status == 200 and b"pleach_connections" in body
    status, _, _ = await http_get(srv.port, "/healthz")
    assert status == 200  # health stays open for load balancers


async def test_servers_have_private_metrics(make_server: ServerFactory) -> None:
    one, two = await make_server(), await make_server()
    one.metrics.changes.labels("applied").inc(5)
    assert b'pleach_changes_total{status="applied"} 5.0' in one.metrics.render()
    assert b'status="applied"' not in two.metrics.render()


# -- graceful shutdown -----------------------------------------------------------------------


async def test_shutdown_closes_clients_with_1001(store: SQLiteServerStore) -> None:
    srv = SyncServer(store, port=0, secret=SECRET)
    async with srv:
        serving = asyncio.create_task(srv.serve_forever())
        dev = Device(new_tenant())
        async with device(srv, dev) as client:
            await srv.shutdown()
            closed = await client.closed()
            assert closed.rcvd is not None and closed.rcvd.code == 1001
        async with asyncio.timeout(TIMEOUT):
            await serving  # serve_forever returns once the server has stopped
    await srv.shutdown()  # idempotent
    assert srv.port != 0
    with pytest.raises(OSError):  # no longer listening
        await http_get(srv.port, "/healthz")


async def test_shutdown_lets_an_in_flight_push_finish(store: SQLiteServerStore) -> None:
    flaky = FlakyStore(store)
    flaky.push_gate = asyncio.Event()
    async with SyncServer(flaky, port=0, secret=SECRET) as srv:
        dev = Device(new_tenant())
        async with device(srv, dev) as client:
            await client.send(Push(changes=dev.changes(dev.session())))
            async with asyncio.timeout(TIMEOUT):
                await flaky.push_entered.wait()
            stopping = asyncio.create_task(srv.shutdown())
            # Until shutdown has begun (it then waits for the push): one or two loop ticks.
            assert await until_true(lambda: srv.draining)
            flaky.push_gate.set()
            ack = await client.answer()
            assert isinstance(ack, PushAck) and ack.results[0].status == "applied"
            closed = await client.closed()
            assert closed.rcvd is not None and closed.rcvd.code == 1001
            await stopping
    assert (await store.client_state(dev.tenant, dev.client_id))[0] == 1


# -- the real command ------------------------------------------------------------------------


async def test_pleach_server_subprocess(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLEACH_") and k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)
    db = tmp_path / "cli.db"
    base = [sys.executable, "-m", "pleach_server.cli"]

    token_proc = await asyncio.create_subprocess_exec(
        *base, "token", "create", "--user", "u1", "--org", "o1", "--db", str(db),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    out, err = await token_proc.communicate()
    assert token_proc.returncode == 0, err
    token = out.decode().strip()
    assert token.count(".") == 1
    assert (tmp_path / "cli.db.secret").exists()

    async with pleach_server_process(env, "--db", str(db)) as (proc, url):
        assert url.endswith("/sync")
        assert proc.stdout is not None
        async with asyncio.timeout(TIMEOUT):
            data_line = (await proc.stdout.readline()).decode()
        assert str(db) in data_line

        dev = Device(Tenant(org_id="o1", user_id="u1"))
        async with connect(
            url, additional_headers={"Authorization": f"Bearer {token}"}, proxy=None
        ) as ws:
            client = Client(ws)
            await client.hello(dev.client_id)
            ack = await client.push(dev.changes(dev.session()))
            assert ack.results[0].status == "applied"


@contextlib.asynccontextmanager
async def pleach_server_process(
    env: dict[str, str], *args: str
) -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    """``pleach-server --port 0 <args>`` as a subprocess, until its address line; then the
    process and its ``/sync`` URL. On leaving: SIGTERM, and it must exit 0."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pleach_server.cli", "--port", "0", "--log-level", "warning",
        *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(TIMEOUT * 3):
            line = (await proc.stdout.readline()).decode()
        assert line.startswith("pleach-server listening on ws://127.0.0.1:"), line
        yield proc, line.split()[-1]
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(TIMEOUT * 3):
            _, err = await proc.communicate()
        assert proc.returncode == 0, err
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.communicate()


@pytest.mark.parametrize("freeze", ["", "0"])
async def test_pleach_server_sets_start_up_aside_from_the_collector(
    tmp_path: Path, freeze: str
) -> None:
    """The command freezes what start-up made (``gcpauses.freeze_startup``), which its
    ``/metrics`` count; ``PLEACH_GC_FREEZE=0`` leaves it out."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLEACH_") and k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)
    if freeze:
        env["PLEACH_GC_FREEZE"] = freeze
    async with pleach_server_process(env, "--db", str(tmp_path / "gc.db")) as (_, url):
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        status, _, body = await http_get(port, "/metrics")
    assert status == 200
    frozen = _samples(body)["pleach_gc_frozen_objects"]
    if freeze == "0":
        assert frozen == 0
    else:
        assert frozen > 10_000  # the program: modules, classes, functions


async def test_cli_errors_are_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLEACH_")}
    env["PYTHONPATH"] = str(ROOT)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pleach_server.cli", "--db", "postgresql://db/pleach",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    async with asyncio.timeout(TIMEOUT * 3):
        _, err = await proc.communicate()
    assert proc.returncode != 0
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1 and "PostgreSQL" in lines[0] and "Traceback" not in lines[0]


async def test_a_device_database_given_to_the_server_is_refused_before_any_write(
    tmp_path: Path,
) -> None:
    from pleach_client.store.sqlite import SQLiteAdapter

    device_db = tmp_path / "laptop.db"
    async with SQLiteAdapter(device_db):
        pass
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLEACH_")}
    env["PYTHONPATH"] = str(ROOT)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pleach_server.cli", "--db", str(device_db), "--port", "0",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    async with asyncio.timeout(TIMEOUT * 3):
        _, err = await proc.communicate()
    assert proc.returncode != 0
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1 and "device database" in lines[0], lines
    assert not Path(f"{device_db}.secret").exists()  # nothing written beside it


async def test_a_live_page_reaches_each_device_in_the_form_it_reads(srv: SyncServer) -> None:
    """A page the hub holds only as stored bytes goes to a protocol 6 device as those bytes
    and to a protocol 5 device as records; a page whose bytes do not decode goes to the
    protocol 5 device as an empty marker at its end (it pulls, and the pull answers with the
    store's error), and its connection goes on."""
    from shared import compact
    from shared.messages import FeedBody

    dev = Device(new_tenant())
    old_dev = Device(dev.tenant)
    message = dev.message(dev.session().id)
    body = compact.encode(message)
    async with device(srv, dev) as new, device(srv, old_dev, protocol=5) as old:
        await until_true(lambda: srv.hub.subscribers(dev.tenant) == 2)
        srv.hub.publish(dev.tenant, 0, 7, [], bodies=[FeedBody(7, msgspec.Raw(body))])
        got_new, got_old = await new.live_frame(), await old.live_frame()
        assert [bytes(b.body) for b in got_new.bodies] == [body]
        assert [c.record for c in got_new.changes] == [message]  # (the test client reads them)
        assert got_old.bodies == [] and [c.record for c in got_old.changes] == [message]
        bad = msgspec.msgpack.encode([1, "not a message"])
        srv.hub.publish(dev.tenant, 7, 9, [], bodies=[FeedBody(9, msgspec.Raw(bad))])
        marker = await old.live_frame()
        assert (marker.from_cursor, marker.to_cursor, marker.changes) == (9, 9, [])
        ack = await old.push(old_dev.changes(old_dev.session()))
        assert [r.status for r in ack.results] == ["applied"]


# -- protocol 9: long texts deflated -----------------------------------------------------------


def _log_text(seed: int) -> str:
    """A tool's log of 2,000 short lines: about 48 KB that deflate about 12 times."""
    rng = random.Random(seed)
    return "\n".join(" ".join(rng.choice(("ok", "warn")) for _ in range(6)) for _ in range(2000))


async def test_a_device_before_protocol_9_gets_texts_written_out_in_pages_within_the_budget(
    make_server: ServerFactory,
) -> None:
    """Six messages of 48 KB logs, stored deflated in about 4 KB each: a device at protocol 9
    pulls them in one page of their stored bytes; one at 8 gets each text written out, in
    pages cut to the server's byte budget (one message a page here), never one frame of
    their 290 KB; both read the same records."""
    budget = 64 * 1024
    srv = await make_server(max_pull_bytes=budget)
    dev = Device(new_tenant())
    session = dev.session()
    messages = [dev.message(session.id, _log_text(i)) for i in range(6)]
    async with open_client(srv, dev.tenant) as client:
        await client.hello(dev.client_id)
        ack = await client.push(dev.changes(session, *messages))
        assert {r.status for r in ack.results} == {"applied"}
    stored = [compact.encode(m) for m in messages]
    assert sum(map(len, stored)) < budget // 2  # deflated: the whole history in one page
    written = [bytes(compact.inflated(b)) for b in stored]
    assert all(len(w) > 10 * len(b) for w, b in zip(written, stored, strict=True))
    pages: dict[int, list[int]] = {}
    for protocol in (9, 8):
        async with open_client(srv, dev.tenant, max_size=None) as client:
            welcome = await client.hello(f"{dev.client_id}-{protocol}", protocol=protocol)
            assert welcome.protocol == protocol
            cursor, records, bodies, frames = 0, [], [], []
            while True:
                await client.send(Pull(cursor=cursor, limit=100))
                data = await client.ws.recv()
                assert isinstance(data, bytes)
                page = unpacked(client.codec.decode(data))
                assert isinstance(page, Changes)
                frames.append(len(data))
                records.extend(c.record for c in page.changes)
                bodies.extend(bytes(b.body) for b in page.bodies)
                cursor = page.to_cursor
                if not page.more:
                    break
            pages[protocol] = frames
            assert records[0] == session and records[1:] == messages
            assert bodies[1:] == (stored if protocol == 9 else written)
    assert len(pages[9]) == 1 and pages[9][0] < budget
    assert len(pages[8]) == 6 and max(pages[8]) < budget  # one message a page


async def test_a_live_page_past_the_budget_written_out_reaches_a_device_before_9_as_a_marker(
    make_server: ServerFactory,
) -> None:
    """A push of six 48 KB logs (24 KB stored) goes live to a device at protocol 9 as it is;
    a device at 8, for which it would be 290 KB written out, gets an empty marker at its end
    instead, and pulls the records in pages cut to the budget. A small page goes to it live,
    written out."""
    budget = 64 * 1024
    srv = await make_server(max_pull_bytes=budget)
    dev = Device(new_tenant())
    session = dev.session()
    messages = [dev.message(session.id, _log_text(i)) for i in range(6)]
    small = dev.message(session.id, "a short reply " * 20)
    async with (
        open_client(srv, dev.tenant, max_size=None) as nine,
        open_client(srv, dev.tenant, max_size=None) as eight,
        open_client(srv, dev.tenant) as pusher,
    ):
        await nine.hello(f"{dev.client_id}-9", protocol=9)
        await eight.hello(f"{dev.client_id}-8", protocol=8)
        await pusher.hello(dev.client_id)
        ack = await pusher.push(dev.changes(session, *messages))
        assert {r.status for r in ack.results} == {"applied"}
        whole = await nine.live_frame()
        assert [c.record for c in whole.changes] == [session, *messages]
        marker = await eight.live_frame()
        assert marker.changes == [] and marker.bodies == []
        assert marker.from_cursor == marker.to_cursor == whole.to_cursor
        got, cursor, pages = [], 0, 0
        while True:
            page = await eight.pull(cursor, limit=100)
            got.extend(c.record for c in page.changes)
            cursor, pages = page.to_cursor, pages + 1
            if not page.more:
                break
        assert got == [session, *messages] and pages == 6
        ack = await pusher.push(dev.changes(small))
        assert {r.status for r in ack.results} == {"applied"}
        live = await eight.live_frame()
        assert [c.record for c in live.changes] == [small]
        assert bytes(live.bodies[0].body) == compact.inflated(compact.encode(small))
