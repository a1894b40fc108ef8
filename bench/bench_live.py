"""Live latency under load: 100 devices writing at once through one real ``pleach-server``.

50 users, 2 devices each (each user its own tenant and token), all connected live to one
``pleach-server`` subprocess on loopback. Every device commits turns in its own session
(``ScriptedProvider``, a short reply) at a steady jittered pace; for every commit on device A
(t0: its ``checkpoint.created``, emitted right after the commit returns) we time until its peer
B (same user) has applied it (t1: B's ``sync.applied`` for A's session, on the page whose
session row carries that commit's version). p50 and p99 over every commit of the measurement
window, after a warm-up.

Baseline, in the same run: a plain ``websockets`` relay subprocess with the same number of
connections (one per device, paired the same way), each client sending at the same pace a
frame of the same bytes as one real turn's encoded ``Push`` (distinct turns, plus an 8-byte
sequence number), which the relay forwards to the peer connection. Both use websockets'
default permessage-deflate, as pleach does. The issue's targets (p50 at most 3x, p99 at most
6x) are ratios to this plain relay.

Second baseline, same run, same connections, pace and payloads: a durable relay, which first
commits each frame as one row to a SQLite file (WAL, ``synchronous=FULL``: one fsync per
frame, on its own thread) and forwards it only then, the least a durable server hop costs.
pleach's p50 and p99 are also given as a ratio to it, and its own p50 and p99 beside the
plain relay's. One note line gives each hop's fsync policy.

It runs on both server stores: SQLite (a temporary file) and PostgreSQL
(``PLEACH_TEST_PG_DSN``; skipped, with the reason printed, when it does not answer). CPU used
by the client process, the server process and PostgreSQL during the window is printed, so the
load can be read as "loaded" or "saturated"; the server's CPU a turn is also set beside the
durable relay's a frame, and the devices' health reports the server wrote beside the store
transactions they took (``pleach_server.health``: a second's reports in one).

Run ``python -m bench.bench_live [--quick]`` (``--help`` for the pace and sizes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import math
import os
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg  # type: ignore[import-untyped]
from websockets.asyncio.client import ClientConnection, connect

from bench.bench_local import Row, render
from bench.bench_push import DEFAULT_DSN, drop_schema, servers
from bench.bench_push import SECRET as SERVER_SECRET
from pleach_client.providers.scripted import ScriptedProvider, ScriptedReply
from pleach_client.runtime import SessionRuntime
from pleach_client.store.sqlite import SQLiteAdapter
from pleach_client.stream import StreamEventBase
from pleach_server.auth import issue_token
from pleach_server.gcpauses import GcPauses
from pleach_server.gcpauses import pauses as gc_pauses
from pleach_server.store import SQLiteServerStore, Tenant
from shared.ids import uuid7
from shared.messages import FrameCodec, Push
from shared.records import Change, FeedChange, Session

__all__ = ["main", "run"]

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 60.0
TURN_TEXT = "Plan tomorrow in three short bullets, please."
REPLY = ScriptedReply(text="Done: three short bullets for tomorrow.")
SEQ_BYTES = 8


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..1)."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


# -- processes: CPU, RSS, metrics, small helper servers ----------------------------------------

_TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
        fields = handle.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime


def postgres_cpu_seconds() -> float:
    """CPU seconds of every process named ``postgres`` on this machine (0 if none)."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/comm", encoding="ascii") as handle:
                if handle.read().strip() != "postgres":
                    continue
            total += proc_cpu_seconds(int(entry))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not ours to read
    return total


def rss_kib(pid: int) -> int:
    """``VmRSS`` of process ``pid`` in KiB."""
    with open(f"/proc/{pid}/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def scrape_metrics(url: str) -> dict[str, float]:
    """GET ``/metrics`` of the server behind ``url`` (ws://host:port/...); samples by name."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    async with asyncio.timeout(TIMEOUT):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            request = f"GET /metrics HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n"
            writer.write(request.encode() + b"\r\n")
            data = await reader.read()
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
    status, _, rest = data.partition(b"\r\n")
    if b" 200 " not in status:
        raise RuntimeError(f"/metrics answered {status!r}")
    body = rest.partition(b"\r\n\r\n")[2].decode()
    out: dict[str, float] = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


class Helper:
    """A baseline server of ``bench.ws_baselines`` in a subprocess."""

    def __init__(self, proc: asyncio.subprocess.Process, url: str) -> None:
        self.proc = proc
        self.url = url

    @property
    def pid(self) -> int:
        return self.proc.pid


@contextlib.asynccontextmanager
async def helper(kind: str, *extra: str) -> AsyncIterator[Helper]:
    """Run ``python -m bench.ws_baselines KIND ...`` until the block ends (it prints its URL)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONASYNCIODEBUG"}
    env["PYTHONPATH"] = str(ROOT)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.ws_baselines",
        kind,
        *extra,
        stdout=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(TIMEOUT):
            line = (await proc.stdout.readline()).decode().strip()
        if not line.startswith("listening on "):
            raise RuntimeError(f"bench.ws_baselines {kind} did not start: {line!r}")
        yield Helper(proc, line.split()[-1])
    finally:
        if proc.returncode is None:
            proc.terminate()
        await proc.wait()


# -- the devices -------------------------------------------------------------------------------


@dataclass
class Device:
    rt: SessionRuntime
    token: str
    session_id: str = ""
    vv: int = 0  # this device's component of its own session's version vector
    last_commit: float = 0.0
    commits: list[tuple[int, float]] = field(default_factory=list)  # (vv, t0)
    seen: list[tuple[int, float]] = field(default_factory=list)  # peer session: (vv, t1)
    peer: Device | None = None

    @property
    def client_id(self) -> str:
        return self.rt.client_id


def hook(dev: Device, progress: asyncio.Event) -> None:
    """Record this device's commit times, and when it applies its peer's commits.

    ``sync.applied`` (emitted right after the page's transaction committed) gives t1; the page
    itself (the arguments of the sync loop's ``_apply``) tells which version of the peer's
    session it carried, so t1 is matched to exactly the commits that page delivered.
    """
    assert dev.peer is not None
    peer_session, peer_client = dev.peer.session_id, dev.peer.client_id
    stamps: dict[str, float] = {}

    def on_commit(event: StreamEventBase) -> None:
        if event.session_id == dev.session_id:
            dev.last_commit = time.perf_counter()

    def on_applied(event: StreamEventBase) -> None:
        stamps[event.session_id] = time.perf_counter()

    dev.rt.events.on("checkpoint.created", on_commit)
    dev.rt.events.on("sync.applied", on_applied)
    apply_page: Callable[..., Awaitable[int]] = dev.rt.sync._apply

    async def applying(changes: list[FeedChange], to_cursor: int, bodies: Any = None) -> int:
        stamps.clear()
        applied = await apply_page(changes, to_cursor, bodies)
        t1 = stamps.pop(peer_session, None)
        if t1 is not None:
            top = max(
                (
                    c.record.vv.get(peer_client, 0)
                    for c in changes
                    if isinstance(c.record, Session) and c.record.id == peer_session
                ),
                default=0,
            )
            if top and (not dev.seen or top > dev.seen[-1][0]):
                dev.seen.append((top, t1))
                progress.set()
        return applied

    dev.rt.sync._apply = applying  # type: ignore[method-assign]


def device_runtime(path: Path, tenant: Tenant, client_id: str) -> SessionRuntime:
    return SessionRuntime(
        SQLiteAdapter(path),
        ScriptedProvider(default_reply=REPLY),
        user_id=tenant.user_id,
        org_id=tenant.org_id,
        client_id=client_id,
    )


async def turn(rt: SessionRuntime, session_id: str, i: int) -> None:
    async for _ in rt.execute_message(session_id, f"turn {i}: {TURN_TEXT}"):
        pass


async def open_devices(stack: AsyncExitStack, tmp: Path, users: int) -> list[Device]:
    """``users`` pairs of devices, each device with its own session (not connected yet)."""
    devices: list[Device] = []
    secret = SERVER_SECRET.encode()
    await asyncio.to_thread(tmp.mkdir, parents=True, exist_ok=True)
    for u in range(users):
        tenant = Tenant(org_id="bench-live", user_id=f"user-{u}-{uuid7()}")
        token = issue_token(secret, tenant, 3600)
        pair = []
        for role in "ab":
            rt = await stack.enter_async_context(
                device_runtime(tmp / f"u{u}{role}.db", tenant, f"u{u}-{role}")
            )
            dev = Device(rt, token)
            dev.session_id = (await rt.create_session(title=f"u{u}{role}")).id
            row = await rt.store.get_session(dev.session_id)
            assert row is not None
            dev.vv = row.vv[rt.client_id]
            pair.append(dev)
        pair[0].peer, pair[1].peer = pair[1], pair[0]
        devices += pair
    return devices


async def all_synced(devices: Sequence[Device]) -> None:
    results = await asyncio.gather(*(d.rt.sync.wait_until_synced(TIMEOUT) for d in devices))
    if not all(results):
        stuck = [d for d, ok in zip(devices, results, strict=True) if not ok]
        raise RuntimeError(f"{len(stuck)} device(s) not synced: {await stuck[0].rt.sync.status()}")


async def paced(
    interval: float,
    start: float,
    stop_at: float,
    rng: random.Random,
    act: Callable[[int], Awaitable[None]],
) -> int:
    """Call ``act(i)`` about every ``interval`` s (uniform jitter +-50%, random phase) until
    ``stop_at``; a late call goes at once (the schedule does not slip). Returns calls made."""
    next_at = start + rng.uniform(0, interval)
    i = 0
    while next_at < stop_at:
        delay = next_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)  # pacing the offered load, not waiting for an event
        await act(i)
        i += 1
        next_at += interval * rng.uniform(0.5, 1.5)
    return i


@dataclass
class LiveResult:
    samples: list[float]
    turns: int  # commits in the window
    window: float
    client_cpu: float  # seconds over the window
    server_cpu: float
    pg_cpu: float
    push_mean: float  # seconds per push batch on the server during the window
    pushes: float  # push batches the server handled during the window
    health_reports: float = 0.0  # device health reports the server wrote during the window
    health_writes: float = 0.0  # the store transactions they took
    server_gc: GcWindow | None = None  # pleach-server's collector pauses during the window
    client_gc: GcWindow | None = None  # this (client) process's


@dataclass
class GcWindow:
    """A process's garbage collector pauses during the window (``pleach_server.gcpauses``):
    collections and seconds paused, all generations and the full ones (generation 2)."""

    collections: float
    seconds: float
    full: float
    full_seconds: float
    frozen: float  # objects set aside from every collection at start-up (gc.freeze)

    @classmethod
    def of_metrics(cls, m0: dict[str, float], m1: dict[str, float]) -> GcWindow:
        def grew(name: str) -> float:
            return m1.get(name, 0.0) - m0.get(name, 0.0)

        counts = [grew(f'pleach_gc_pause_seconds_count{{generation="{g}"}}') for g in range(3)]
        sums = [grew(f'pleach_gc_pause_seconds_sum{{generation="{g}"}}') for g in range(3)]
        frozen = m1.get("pleach_gc_frozen_objects", 0.0)
        return cls(sum(counts), sum(sums), counts[2], sums[2], frozen)

    @classmethod
    def of_record(cls, before: tuple[list[int], list[float]], record: GcPauses) -> GcWindow:
        counts = [sum(now) - was for now, was in zip(record.counts, before[0], strict=True)]
        sums = [now - was for now, was in zip(record.sums, before[1], strict=True)]
        return cls(sum(counts), sum(sums), counts[2], sums[2], gc.get_freeze_count())

    def note(self, window: float) -> str:
        mean = self.full_seconds / self.full * 1e3 if self.full else 0.0
        return (
            f"{self.collections:.0f} pauses, {self.seconds * 1e3:.0f} ms in all "
            f"({self.seconds / window * 100:.1f}% of the window); {self.full:.0f} full, "
            f"{mean:.1f} ms each on average; {self.frozen:.0f} start-up objects frozen"
        )


def gc_snapshot(record: GcPauses) -> tuple[list[int], list[float]]:
    return [sum(c) for c in record.counts], list(record.sums)


async def live(
    server_url: str,
    server_pid: int,
    tmp: Path,
    users: int,
    interval: float,
    warm: float,
    seconds: float,
    with_pg: bool,
) -> LiveResult:
    progress = asyncio.Event()
    async with AsyncExitStack() as stack:
        devices = await open_devices(stack, tmp, users)
        for dev in devices[0::2]:  # A devices first, then B: each pulls the other's session
            await dev.rt.sync.connect(server_url, dev.token)
        await all_synced(devices[0::2])
        for dev in devices[1::2]:
            await dev.rt.sync.connect(server_url, dev.token)
        await all_synced(devices)
        await all_synced(devices)
        for dev in devices:
            hook(dev, progress)

        start = time.perf_counter() + 0.05
        warm_end, stop_at = start + warm, start + warm + seconds
        master = random.Random(20261129)

        async def write(dev: Device) -> None:
            async def act(i: int) -> None:
                await turn(dev.rt, dev.session_id, i)
                dev.vv += 1
                dev.commits.append((dev.vv, dev.last_commit))

            await paced(interval, start, stop_at, random.Random(master.random()), act)

        client_gc = gc_pauses()

        async def measure_cpu() -> tuple[float, float, float, dict[str, float], dict[str, float]]:
            await asyncio.sleep(max(0.0, warm_end - time.perf_counter()))
            before = (
                time.process_time(),
                proc_cpu_seconds(server_pid),
                postgres_cpu_seconds() if with_pg else 0.0,
                await scrape_metrics(server_url),
            )
            gc_before.append(gc_snapshot(client_gc))
            await asyncio.sleep(max(0.0, stop_at - time.perf_counter()))
            gc_window.append(GcWindow.of_record(gc_before[0], client_gc))
            return (
                time.process_time() - before[0],
                proc_cpu_seconds(server_pid) - before[1],
                (postgres_cpu_seconds() - before[2]) if with_pg else 0.0,
                before[3],
                await scrape_metrics(server_url),
            )

        gc_before: list[tuple[list[int], list[float]]] = []
        gc_window: list[GcWindow] = []
        cpu_task = asyncio.create_task(measure_cpu())
        await asyncio.gather(*(write(d) for d in devices))
        client_cpu, server_cpu, pg_cpu, m0, m1 = await cpu_task

        # Every commit must reach its peer: wait for the pages (no deadline but TIMEOUT).
        async with asyncio.timeout(TIMEOUT):
            while any(
                d.peer is not None and (d.peer.seen or [(0, 0.0)])[-1][0] < d.vv for d in devices
            ):
                progress.clear()
                await progress.wait()
        await all_synced(devices)
        for dev in devices:  # the counted versions are the stored ones
            row = await dev.rt.store.get_session(dev.session_id)
            assert row is not None and row.vv[dev.client_id] == dev.vv, (row, dev.vv)
            assert dev.peer is not None
            theirs = await dev.peer.rt.store.get_session(dev.session_id)
            assert theirs is not None and theirs.vv[dev.client_id] == dev.vv

    samples: list[float] = []
    for dev in devices:
        assert dev.peer is not None
        seen = dev.peer.seen
        j = 0
        for vv, t0 in dev.commits:
            while seen[j][0] < vv:
                j += 1
            if warm_end <= t0 < stop_at:
                samples.append(seen[j][1] - t0)
    key = "pleach_push_seconds"
    pushes = m1.get(f"{key}_count", 0.0) - m0.get(f"{key}_count", 0.0)
    push_sum = m1.get(f"{key}_sum", 0.0) - m0.get(f"{key}_sum", 0.0)

    def grew(name: str) -> float:
        return m1.get(name, 0.0) - m0.get(name, 0.0)

    return LiveResult(
        samples,
        len(samples),
        seconds,
        client_cpu,
        server_cpu,
        pg_cpu,
        push_sum / pushes if pushes else float("nan"),
        pushes,
        grew("pleach_health_reports_written_total"),
        grew("pleach_health_writes_total"),
        GcWindow.of_metrics(m0, m1),
        gc_window[0],
    )


# -- the baseline relay ------------------------------------------------------------------------


async def turn_payloads(tmp: Path, count: int) -> list[bytes]:
    """``count`` distinct real turns' encoded ``Push`` frames (9 changes each)."""
    codec = FrameCodec()
    tenant = Tenant(org_id="bench-live", user_id=f"probe-{uuid7()}")
    out: list[bytes] = []
    async with device_runtime(tmp / "probe.db", tenant, "probe") as rt:
        session_id = (await rt.create_session(title="probe")).id
        await turn(rt, session_id, 0)
        done = await rt.store.outbox_count()
        for i in range(1, count + 1):
            await turn(rt, session_id, i)
            pending = (await rt.store.outbox_pending(limit=1_000_000))[done:]
            done += len(pending)
            out.append(
                codec.encode(
                    Push(
                        changes=[Change(client_seq=e.client_seq, record=e.record) for e in pending]
                    )
                )
            )
    return out


@dataclass
class RelayResult:
    samples: list[float]
    client_cpu: float
    server_cpu: float
    frames: int  # frames sent (and relayed) in all, warm-up included


async def relay_run(
    relay: Helper,
    pairs: int,
    payloads: Sequence[bytes],
    interval: float,
    warm: float,
    seconds: float,
) -> RelayResult:
    sent: dict[tuple[int, int], float] = {}  # (sender index, seq) -> t0
    got: dict[tuple[int, int], float] = {}
    expected = 0
    progress = asyncio.Event()
    conns: list[ClientConnection] = []
    async with AsyncExitStack() as stack:
        for p in range(pairs):
            for role in "ab":
                ws = await stack.enter_async_context(connect(relay.url, max_size=None, proxy=None))
                await ws.send(f"{p}:{role}".encode())
                conns.append(ws)
        for ws in conns:
            async with asyncio.timeout(TIMEOUT):
                assert await ws.recv() == b"ok"

        async def read(index: int, ws: ClientConnection) -> None:
            peer = index ^ 1
            async for message in ws:
                assert isinstance(message, bytes)
                got[(peer, int.from_bytes(message[:SEQ_BYTES], "big"))] = time.perf_counter()
                if len(got) >= expected:
                    progress.set()

        readers = [asyncio.create_task(read(i, ws)) for i, ws in enumerate(conns)]
        start = time.perf_counter() + 0.05
        warm_end, stop_at = start + warm, start + warm + seconds
        master = random.Random(20261129)

        async def write(index: int, ws: ClientConnection) -> int:
            async def act(i: int) -> None:
                body = payloads[(index + i) % len(payloads)]
                sent[(index, i)] = time.perf_counter()
                await ws.send(i.to_bytes(SEQ_BYTES, "big") + body)

            return await paced(interval, start, stop_at, random.Random(master.random()), act)

        async def cpu() -> tuple[float, float]:
            await asyncio.sleep(max(0.0, warm_end - time.perf_counter()))
            c0, s0 = time.process_time(), proc_cpu_seconds(relay.pid)
            await asyncio.sleep(max(0.0, stop_at - time.perf_counter()))
            return time.process_time() - c0, proc_cpu_seconds(relay.pid) - s0

        cpu_task = asyncio.create_task(cpu())
        counts = await asyncio.gather(*(write(i, ws) for i, ws in enumerate(conns)))
        client_cpu, server_cpu = await cpu_task
        expected = sum(counts)
        async with asyncio.timeout(TIMEOUT):
            while len(got) < expected:
                progress.clear()
                await progress.wait()
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
    samples = [got[k] - t0 for k, t0 in sent.items() if warm_end <= t0 < stop_at]
    return RelayResult(samples, client_cpu, server_cpu, expected)


def logged_frames(path: Path) -> int:
    """Rows the durable relay committed to ``path`` (one per relayed frame)."""
    conn = sqlite3.connect(path)
    try:
        count: int = conn.execute("SELECT count(*) FROM frames").fetchone()[0]
        return count
    finally:
        conn.close()


def filesystem(path: Path) -> str:
    """The type of the filesystem ``path`` is on (``ext4``, ``tmpfs``...), from /proc/mounts."""
    best, kind = "", "unknown"
    target = str(path.resolve())
    with contextlib.suppress(OSError), open("/proc/mounts", encoding="utf-8") as handle:
        for line in handle:
            fields = line.split()
            if len(fields) < 3:
                continue
            mount = fields[1].replace("\\040", " ")
            inside = target == mount or target.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best):
                best, kind = mount, fields[2]
    return kind


# -- the run -----------------------------------------------------------------------------------


async def pg_setting(dsn: str) -> tuple[str | None, str]:
    """(``synchronous_commit``, "") when PostgreSQL answers, else (None, why not)."""
    try:
        conn = await asyncpg.connect(dsn, timeout=5)
    except (OSError, asyncpg.PostgresError, TimeoutError) as exc:
        return None, f"{type(exc).__name__}: {exc}"
    try:
        value = await conn.fetchval("SHOW synchronous_commit")
        fsync = await conn.fetchval("SHOW fsync")
        return f"synchronous_commit={value}, fsync={fsync}", ""
    finally:
        await conn.close()


@dataclass
class Config:
    users: int
    interval: float
    warm: float
    seconds: float
    dsn: str


def gc_note(label: str, r: LiveResult) -> str:
    """The collectors' pauses during the window: nothing else runs in a process meanwhile, so
    a change under way then waits for them (``pleach_server.gcpauses``)."""
    assert r.server_gc is not None and r.client_gc is not None
    return (
        f"{label}: garbage collector during the window: pleach-server "
        f"{r.server_gc.note(r.window)}; the client process (the 100 devices in one process, "
        f"where each device has a process of its own in use) {r.client_gc.note(r.window)}"
    )


def live_rows(label: str, r: LiveResult, relay: RelayResult, durable: RelayResult) -> list[Row]:
    window = r.window
    return [
        Row(
            f"{label}: A commit -> B applied, p50 ({len(r.samples)} samples)",
            percentile(r.samples, 0.5) * 1e3,
            "ms",
            "ws relay, p50",
            percentile(relay.samples, 0.5) * 1e3,
        ),
        Row(
            f"{label}: A commit -> B applied, p99",
            percentile(r.samples, 0.99) * 1e3,
            "ms",
            "ws relay, p99",
            percentile(relay.samples, 0.99) * 1e3,
        ),
        *(
            Row(
                f"{label}:   p{q}, against the durable relay",
                percentile(r.samples, q / 100) * 1e3,
                "ms",
                f"durable relay, p{q}",
                percentile(durable.samples, q / 100) * 1e3,
            )
            for q in (50, 99)
        ),
        Row(f"{label}:   mean", statistics.fmean(r.samples) * 1e3, "ms"),
        Row(
            f"{label}:   server store.push per batch, mean ({r.pushes:.0f} batches)",
            r.push_mean * 1e3,
            "ms",
        ),
        Row(f"{label}:   turns committed (all devices)", r.turns / window, "turns/s"),
        Row(f"{label}:   CPU, client process (100 devices)", r.client_cpu / window * 100, "% core"),
        Row(f"{label}:   CPU, pleach-server process", r.server_cpu / window * 100, "% core"),
        Row(
            f"{label}:   CPU, pleach-server process, per turn",
            r.server_cpu / max(1, r.turns) * 1e3,
            "ms",
            "durable relay, a frame",
            durable.server_cpu / max(1, len(durable.samples)) * 1e3,
        ),
        Row(
            f"{label}:   device health reports written",
            r.health_reports / window,
            "reports/s",
            "its transactions",
            r.health_writes / window,
        ),
        *(
            [Row(f"{label}:   CPU, postgres processes", r.pg_cpu / window * 100, "% core")]
            if r.pg_cpu
            else []
        ),
    ]


def relay_rows(relay: RelayResult, durable: RelayResult) -> list[Row]:
    """The durable relay's own figures, beside the plain relay's."""
    return [
        Row(
            f"durable relay: frame A -> B, p50 ({len(durable.samples)} samples)",
            percentile(durable.samples, 0.5) * 1e3,
            "ms",
            "ws relay, p50",
            percentile(relay.samples, 0.5) * 1e3,
        ),
        Row(
            "durable relay: frame A -> B, p99",
            percentile(durable.samples, 0.99) * 1e3,
            "ms",
            "ws relay, p99",
            percentile(relay.samples, 0.99) * 1e3,
        ),
    ]


async def _run(quick: bool, cfg: Config) -> tuple[list[Row], list[str]]:
    notes: list[str] = []
    rows: list[Row] = []
    devices = 2 * cfg.users
    with tempfile.TemporaryDirectory(prefix="pleach-bench-live-") as tmp:
        root = Path(tmp)
        payloads = await turn_payloads(root, 40)
        mean_payload = statistics.fmean(len(p) for p in payloads)
        offered = devices / cfg.interval
        notes.append(
            f"offered load: {devices} devices ({cfg.users} users x 2), each 1 turn per "
            f"{cfg.interval * 1e3:.0f} ms +-50% = {offered:.0f} turns/s, "
            f"{offered * 9:.0f} changes/s, one Push frame of {mean_payload / 1024:.1f} KiB per "
            f"turn; {cfg.warm:.0f} s warm-up, then {cfg.seconds:.0f} s measured"
        )
        device_sync = SQLiteAdapter(root / "unused.db").synchronous
        server_sync = SQLiteServerStore(root / "unused-server.db").synchronous
        setting, why = await pg_setting(cfg.dsn)
        fs = await asyncio.to_thread(filesystem, root)
        notes.append(
            f"fsync policy per hop: device A, B SQLite WAL synchronous={device_sync} (no fsync "
            "per commit: survives an app crash, not power loss); server SQLite (pleach-server's "
            f"SQLiteServerStore default) WAL synchronous={server_sync} (one fsync per push "
            "transaction: survives power loss); server PostgreSQL "
            f"{setting or 'not measured'}; durable relay SQLite WAL synchronous=FULL (one "
            f"fsync per frame); ws relay none; SQLite files on {fs} ({tmp})"
        )

        async with servers(str(root / "server.db"), None, 1) as (srv,):
            sqlite = await live(
                srv.url, srv.proc.pid, root / "sqlite", cfg.users, cfg.interval,
                cfg.warm, cfg.seconds, with_pg=False,
            )  # fmt: skip
        async with helper("relay") as relay_srv:
            relay = await relay_run(
                relay_srv, cfg.users, payloads, cfg.interval, cfg.warm, cfg.seconds
            )
        log = root / "durable-relay.db"
        async with helper("durable-relay", "--db", str(log)) as durable_srv:
            durable = await relay_run(
                durable_srv, cfg.users, payloads, cfg.interval, cfg.warm, cfg.seconds
            )
        logged = await asyncio.to_thread(logged_frames, log)
        if logged != durable.frames:
            raise RuntimeError(f"durable relay committed {logged} of {durable.frames} frames")
        for name, r in (("ws relay", relay), ("durable relay", durable)):
            notes.append(
                f"{name}: {devices} connections, {len(r.samples)} samples; CPU client "
                f"{r.client_cpu / cfg.seconds * 100:.0f}% core, relay process "
                f"{r.server_cpu / cfg.seconds * 100:.0f}% core"
                + (f"; {logged} frames committed, one transaction each" if r is durable else "")
            )
        rows += live_rows("SQLite", sqlite, relay, durable)
        notes.append(gc_note("SQLite", sqlite))

        if setting is None:
            notes.append(f"PostgreSQL half skipped: {cfg.dsn} does not answer ({why})")
        else:
            schema = f"pleach_bench_live_{uuid7().replace('-', '')}"
            try:
                async with servers(cfg.dsn, schema, 1) as (srv,):
                    pg = await live(
                        srv.url, srv.proc.pid, root / "pg", cfg.users, cfg.interval,
                        cfg.warm, cfg.seconds, with_pg=True,
                    )  # fmt: skip
            finally:
                await drop_schema(cfg.dsn, schema)
            rows += live_rows("PostgreSQL", pg, relay, durable)
            notes.append(gc_note("PostgreSQL", pg))
        rows += relay_rows(relay, durable)
    return rows, notes


def run(quick: bool = False, cfg: Config | None = None) -> list[Row]:
    """Run every measurement, print the table, return the rows."""
    if cfg is None:
        cfg = Config(
            users=50,
            interval=2.0,
            warm=2.0 if quick else 3.0,
            seconds=4.0 if quick else 12.0,
            dsn=DEFAULT_DSN,
        )
    started = time.perf_counter()
    rows, notes = asyncio.run(_run(quick, cfg))
    print(render("bench_live: live latency under load (a turn on A until applied on B)", rows))
    for note in notes:
        print(f"- {note}")
    load = os.getloadavg()
    print(
        f"({time.perf_counter() - started:.1f}s, {os.cpu_count()} cpus, load average {load[0]:.2f})"
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="a shorter measurement window")
    parser.add_argument("--users", type=int, default=50, help="users, 2 devices each (50)")
    parser.add_argument(
        "--interval", type=float, default=2.0, help="mean seconds between a device's turns (2.0)"
    )
    parser.add_argument("--seconds", type=float, default=None, help="measured seconds (12, 4)")
    parser.add_argument("--dsn", default=DEFAULT_DSN, help="PostgreSQL (PLEACH_TEST_PG_DSN)")
    args = parser.parse_args(argv)
    cfg = Config(
        users=args.users,
        interval=args.interval,
        warm=2.0 if args.quick else 3.0,
        seconds=args.seconds or (4.0 if args.quick else 12.0),
        dsn=args.dsn,
    )
    run(args.quick, cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
