"""Sync costs against a real ``SyncServer`` on loopback (SQLite server store on a temp file).

Every figure is printed beside a baseline measured in the same run on the same machine:

- ``sync_once``: one device commits K turns offline, then ``runtime.sync.sync_once`` connects,
  flushes the outbox (``Push`` batches of 200, each acknowledged) and pulls the feed back.
  Baseline: raw ``websockets`` round trips of the very same encoded ``Push`` payloads to an echo
  server (connect included): the same bytes up and down, i.e. what the network layer alone
  costs. The flush and pull phases are shown on their own (no baseline). Then the same with
  the server and the echo each in a process of their own (``pleach-server`` on a SQLite file,
  ``bench.ws_baselines echo``), as a user meets them: the server's work no longer shares the
  device's core and GIL, so what the two sides do at once shows.
  Then the same K turns queued in a session already 2,000 turns long (600 with
  ``--quick``) and synced: its row, queued at each turn, names every message id, and the
  flush reads the row's id blocks back; beside the new session's rate.
- ``fan-out``: devices A and B connected live; A commits a turn (t0: commit returned), its sync
  loop pushes it, the server fans it out, B applies it (t1: B's ``sync.applied`` for the
  session, checked against B's store). Baseline: a raw ``websockets`` relay that forwards
  A's message (one turn's encoded ``Push``) to B. Medians and p95 over the rounds, and when
  each step of the way began or was done (``Hops``: A's outbox read begun and done, A's push
  sent, the server's push begun and done, B's apply begun), as the median time after the
  commit. Then the
  same at turn 1,000 of a session (300 with ``--quick``), against a relay of that turn's
  ``Push`` as A sends it at protocol 7 on a connection that carried the turns before: the
  session's row names every message id, and the frame carries only the new ones, with a
  reference to the list carried before (``shared.idrefs``).

Run ``python -m bench.bench_sync [--quick]``; bounded (well under a minute, loopback only).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve

from bench import bench_push
from bench.bench_live import helper
from bench.bench_local import Row, p95, render, turns
from pleach_client.providers.scripted import ScriptedProvider
from pleach_client.runtime import SessionRuntime
from pleach_client.store.sqlite import SQLiteAdapter
from pleach_client.stream import StreamEventBase
from pleach_client.sync import _push_of
from pleach_server.auth import issue_token
from pleach_server.server import SyncServer
from pleach_server.store import SQLiteServerStore, Tenant
from shared.idrefs import IdLists
from shared.ids import uuid7
from shared.messages import FrameCodec, Push, change_bodies

__all__ = ["main", "run"]

SECRET = b"bench-secret-for-sync"
TIMEOUT = 30.0


def device(path: Path, tenant: Tenant, client_id: str) -> SessionRuntime:
    return SessionRuntime(
        SQLiteAdapter(path),
        ScriptedProvider(),
        user_id=tenant.user_id,
        org_id=tenant.org_id,
        client_id=client_id,
    )


def new_tenant(label: str) -> Tenant:
    """A tenant of its own, so a device's pull reads only its own feed."""
    return Tenant(org_id="bench", user_id=f"{label}-{uuid7()}")


async def outbox_payloads(
    rt: SessionRuntime, skip: int = 0, *, as_bodies: bool = True, ids: IdLists | None = None
) -> list[bytes]:
    """The ``Push`` frames a flush would send for the pending outbox (after ``skip`` rows), cut
    and made as the flush makes them (``_push_of``: a record several numbers refer to goes
    once, the others are ``skipped``; each record as its stored bytes, as at protocol 6).
    ``ids``: the id lists a protocol 7 connection has carried (``shared.idrefs``), taken
    further by these frames: a long session's ids go as a reference to what it carried, as
    ``ClientProtocol.send_push`` sends them. ``as_bodies=False``: as records, the frames a
    version 5 device sends."""
    codec = FrameCodec()
    pending = (await rt.store.outbox_pending(limit=1_000_000))[skip:]
    size, budget = rt.sync.batch_size, rt.sync.max_frame_bytes // 2
    frames: list[bytes] = []
    while pending:
        changes, skipped, bodies = _push_of(
            pending[:size], budget, skipping=True, as_bodies=as_bodies
        )
        if bodies is None:
            frames.append(codec.encode(Push(changes=changes, skipped=skipped)))
        else:  # protocol 6: each record as its stored bytes
            if ids is not None:  # protocol 7: a long list as a reference
                bodies = [bytes(ids.shrink(body)) for body in bodies]
            packed = change_bodies(changes, bodies)
            frames.append(codec.encode(Push(changes=[], skipped=skipped, bodies=packed)))
        pending = pending[len(changes) + len(skipped) :]
    return frames


# -- (a) sync_once throughput ------------------------------------------------------------------


def push_seconds(server: SyncServer) -> float:
    """Seconds the server has spent in ``store.push`` so far (its own Prometheus histogram)."""
    for metric in server.metrics.push_seconds.collect():
        for sample in metric.samples:
            if sample.name.endswith("_sum"):
                return sample.value
    return 0.0


@dataclass
class SyncRound:
    changes: int
    total: float
    flush: float
    pull: float
    pulled: int
    server_push: float
    payloads: list[bytes]
    map_payloads: list[bytes]
    """The same changes as protocol 5 frames (records, not their stored bytes)."""


def _around(
    obj: Any,
    name: str,
    returned: Callable[[float, float], None],
    called: Callable[[float], None] | None = None,
) -> None:
    """Wrap ``obj.name`` (an async method) on the instance: ``called(start)`` as it is called,
    when given, and ``returned(start, end)`` as it returns or raises."""
    method: Callable[..., Awaitable[Any]] = getattr(obj, name)

    async def wrapped(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        if called is not None:
            called(started)
        try:
            return await method(*args, **kwargs)
        finally:
            returned(started, time.perf_counter())

    setattr(obj, name, wrapped)


def _time_method(obj: Any, name: str, into: dict[str, float]) -> None:
    """Wrap ``obj.name`` (an async method) on the instance to add its seconds to ``into``."""

    def add(started: float, ended: float) -> None:
        into[name] = into.get(name, 0.0) + ended - started

    _around(obj, name, add)


async def offline_turns(rt: SessionRuntime, label: str, k: int) -> tuple[int, list[bytes]]:
    """K turns in a new session, offline: the changes queued and the Push frames they make."""
    session_id = (await rt.create_session(title=label)).id
    await turns(rt, session_id, 0, k)
    return await rt.store.outbox_count(), await outbox_payloads(rt)


async def map_payloads(rt: SessionRuntime) -> list[bytes]:
    return await outbox_payloads(rt, as_bodies=False)


async def sync_round(server: SyncServer, tmp: Path, label: str, k: int) -> SyncRound:
    tenant = new_tenant(label)
    async with device(tmp / f"{label}.db", tenant, f"dev-{label}") as rt:
        changes, payloads = await offline_turns(rt, label, k)
        as_records = await map_payloads(rt)
        token = issue_token(SECRET, tenant, 3600)
        phases: dict[str, float] = {}
        pulled: list[int] = []
        _time_method(rt.sync, "flush_outbox", phases)
        pull = rt.sync.pull

        async def counted_pull() -> int:
            n = await pull()
            pulled.append(n)
            return n

        rt.sync.pull = counted_pull  # type: ignore[method-assign]
        _time_method(rt.sync, "pull", phases)
        in_store = push_seconds(server)
        started = time.perf_counter()
        receipt = await rt.sync.sync_once(server.url, token, timeout=TIMEOUT)
        total = time.perf_counter() - started
        in_store = push_seconds(server) - in_store
        assert receipt.outcome == "all-flushed" and receipt.flushed == changes, receipt
        assert await rt.store.outbox_count() == 0
    return SyncRound(
        changes,
        total,
        phases["flush_outbox"],
        phases["pull"],
        sum(pulled),
        in_store,
        payloads,
        as_records,
    )


async def _echo(ws: ServerConnection) -> None:
    async for message in ws:
        await ws.send(message)


async def long_session_flushes(
    server: SyncServer, tmp: Path, prefill: int, k: int, reps: int
) -> list[float]:
    """Changes a second of ``reps`` full syncs of ``k`` turns queued offline in a session of
    ``prefill`` turns already synced (the same device; the session ``k`` turns longer each
    time): a long session's row is queued at each turn, and a flush reads the row's id blocks
    back (once a batch), where a new session's row holds its few ids."""
    tenant = new_tenant("long-flush")
    token = issue_token(SECRET, tenant, 3600)
    rates: list[float] = []
    async with device(tmp / "long-flush.db", tenant, "dev-long-flush") as rt:
        session_id = (await rt.create_session(title="long")).id
        await turns(rt, session_id, 0, prefill)
        await rt.sync.sync_once(server.url, token, timeout=TIMEOUT)
        for rep in range(reps):
            await turns(rt, session_id, prefill + rep * k, k)
            started = time.perf_counter()
            receipt = await rt.sync.sync_once(server.url, token, timeout=TIMEOUT)
            rates.append(receipt.flushed / (time.perf_counter() - started))
            assert receipt.outcome == "all-flushed", receipt
    return rates


async def echo_round(url: str, payloads: list[bytes]) -> float:
    """Connect, send each payload and wait for it to come back, close; returns seconds."""
    started = time.perf_counter()
    async with connect(url, max_size=None, proxy=None) as ws:
        for payload in payloads:
            await ws.send(payload)
            async with asyncio.timeout(TIMEOUT):
                await ws.recv()
    return time.perf_counter() - started


async def throughput(server: SyncServer, tmp: Path, k: int, reps: int) -> list[Row]:
    async with serve(_echo, "127.0.0.1", 0, max_size=None) as echo:
        echo_url = f"ws://127.0.0.1:{echo.sockets[0].getsockname()[1]}"
        warm = await sync_round(server, tmp, "sync-warm", 3)  # warm up once, both sides
        await echo_round(echo_url, warm.payloads)
        rounds: list[SyncRound] = []
        echoes: list[float] = []
        map_echoes: list[float] = []
        for rep in range(reps):  # interleaved, so noise hits both alike
            rounds.append(await sync_round(server, tmp, f"sync-{rep}", k))
            echoes.append(await echo_round(echo_url, rounds[-1].payloads))
            map_echoes.append(await echo_round(echo_url, rounds[-1].map_payloads))
    changes = rounds[0].changes
    assert all(r.changes == changes for r in rounds)
    kib = sum(len(p) for p in rounds[0].payloads) / 1024
    map_kib = sum(len(p) for p in rounds[0].map_payloads) / 1024
    echo_rate = changes / statistics.median(echoes)
    sync_rate = changes / statistics.median(r.total for r in rounds)
    return [
        Row(
            f"sync_once, {k} turns = {changes} changes, {kib:.0f} KiB (median of {reps})",
            sync_rate,
            "changes/s",
            "ws echo, same payloads",
            echo_rate,
        ),
        Row(
            # The floor as it was before protocol 6: the same changes as records (the map
            # form) are about twice the bytes, so their echo is slower.
            f"  against an echo of the same changes as records ({map_kib:.0f} KiB)",
            sync_rate,
            "changes/s",
            "ws echo, protocol 5 frames",
            changes / statistics.median(map_echoes),
        ),
        Row(
            "  flush phase (Push + PushAck batches)",
            changes / statistics.median(r.flush for r in rounds),
            "changes/s",
        ),
        Row(
            "    of which the server's store.push",
            changes / statistics.median(r.server_push for r in rounds),
            "changes/s",
        ),
        Row(
            # Protocol 5: the acks say where the device's own rows are, so the pull after the
            # flush reads nothing of them back (it pulled every row back before).
            f"  pull phase ({rounds[0].pulled} changes pulled back, applied)",
            statistics.median(r.pull for r in rounds) * 1e3,
            "ms",
        ),
    ]


async def apart_round(url: str, tmp: Path, label: str, k: int) -> tuple[int, float, list[bytes]]:
    """One ``sync_once`` of K offline turns against a server process: changes, seconds, and
    the Push frames it sent (for the echo)."""
    tenant = new_tenant(label)
    async with device(tmp / f"{label}.db", tenant, f"dev-{label}") as rt:
        changes, payloads = await offline_turns(rt, label, k)
        token = issue_token(bench_push.SECRET.encode(), tenant, 3600)
        started = time.perf_counter()
        receipt = await rt.sync.sync_once(url, token, timeout=TIMEOUT)
        total = time.perf_counter() - started
        assert receipt.outcome == "all-flushed" and receipt.flushed == changes, receipt
    return changes, total, payloads


async def throughput_apart(tmp: Path, k: int, reps: int) -> list[Row]:
    async with (
        bench_push.servers(str(tmp / "apart-server.db"), None, 1) as (server,),
        helper("echo") as echo,
    ):
        _, _, warm = await apart_round(server.url, tmp, "apart-warm", 3)
        await echo_round(echo.url, warm)
        totals: list[float] = []
        echoes: list[float] = []
        changes = 0
        for rep in range(reps):  # interleaved, so noise hits both alike
            changes, total, payloads = await apart_round(server.url, tmp, f"apart-{rep}", k)
            totals.append(total)
            echoes.append(await echo_round(echo.url, payloads))
    return [
        Row(
            f"sync_once, server in its own process (median of {reps})",
            changes / statistics.median(totals),
            "changes/s",
            "ws echo process, same payloads",
            changes / statistics.median(echoes),
        )
    ]


# -- (b) live fan-out latency ------------------------------------------------------------------


HOPS: Final = (
    ("A's outbox read begun", "read>"),
    ("A's outbox read done", "read"),
    ("A's push sent", "sent"),
    ("the server's push begun", "pushed>"),
    ("the server's push done", "pushed"),
    ("B's apply begun", "applied>"),
)
"""The steps of a change's way from A's commit to B's apply that ``Hops`` times: each one's
name in the table and its mark. (B's apply ends with the round: its ``sync.applied``.)"""


class Hops:
    """When each step of a change's way from A's commit to B's apply began or ended, as seconds
    after the commit: the step's method wrapped on its instance (A's outbox read, A's push
    frame sent, the server's ``store.push``, B's page applied), each mark kept with its time;
    a round keeps the first of each mark between its commit and B's apply (``of_round``)."""

    def __init__(self) -> None:
        self.marks: list[tuple[str, float]] = []

    def wrap(self, obj: Any, name: str, mark: str, *, begun: bool = False) -> None:
        """``obj.name`` (an async method) marks ``mark`` as it returns, and ``mark`` with ``>``
        as it is called too when ``begun`` (``_around``)."""
        marks = self.marks
        _around(
            obj,
            name,
            lambda _, ended: marks.append((mark, ended)),
            (lambda started: marks.append((mark + ">", started))) if begun else None,
        )

    def of_round(self, t0: float, t1: float) -> dict[str, float]:
        """Each mark's first time in ``[t0, t1]``, as seconds after ``t0``; the marks are
        forgotten."""
        first: dict[str, float] = {}
        for mark, at in self.marks:
            if t0 <= at <= t1 and mark not in first:
                first[mark] = at - t0
        self.marks.clear()
        return first


async def fanout(
    server: SyncServer, tmp: Path, rounds: int, prefill: int = 0
) -> tuple[list[float], float, bytes, bytes, dict[str, list[float]]]:
    """A commits a turn, B applies it: seconds per round (after one warm-up round), the mean
    seconds the server spent in ``store.push`` per round, and one turn's encoded ``Push``
    as A sends it (the baseline's payload: at protocol 7, on a connection that carried the
    turns before, so a long session's ids go as a reference), and the same as a version 5
    device sends it (records, every id). ``prefill``: turns A's session holds before the
    rounds (its session row names every message, so a whole row grows with the session)."""
    label = f"fan{prefill}"
    tenant = new_tenant(label)
    token = issue_token(SECRET, tenant, 3600)
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(device(tmp / f"{label}-a.db", tenant, f"{label}-a"))
        b = await stack.enter_async_context(device(tmp / f"{label}-b.db", tenant, f"{label}-b"))
        session_id = (await a.create_session(title="fan-out")).id
        await turns(a, session_id, 0, prefill)
        carried = IdLists()  # what a protocol 7 connection carried of the pushes before
        await outbox_payloads(a, ids=carried)
        before = await a.store.outbox_count()
        await turns(a, session_id, prefill, 1)
        payload = (await outbox_payloads(a, skip=before, ids=carried))[0]
        map_payload = (await outbox_payloads(a, skip=before, as_bodies=False))[0]
        for rt in (a, b):  # A first: B then pulls A's session when it connects
            await rt.sync.connect(server.url, token)
            assert await rt.sync.wait_until_synced(TIMEOUT), await rt.sync.status()
        assert await a.sync.wait_until_synced(TIMEOUT), await a.sync.status()

        committed: list[float] = []
        applied: list[float] = []
        wake = asyncio.Event()

        def on_commit(_: StreamEventBase) -> None:
            committed.append(time.perf_counter())

        def on_applied(event: StreamEventBase) -> None:
            if getattr(event, "session_id", None) == session_id:
                applied.append(time.perf_counter())
                wake.set()

        # checkpoint.created is emitted right after the turn's commit returns, before any
        # other task can run (so before A's sync loop can start the push).
        a.events.on("checkpoint.created", on_commit)
        b.events.on("sync.applied", on_applied)
        hops = Hops()
        hops.wrap(a.store, "outbox_pending", "read", begun=True)
        hops.wrap(a.sync, "_send_push", "sent")
        hops.wrap(server.store, "push", "pushed", begun=True)
        hops.wrap(b.sync, "_apply", "applied", begun=True)
        steps: dict[str, list[float]] = {mark: [] for _, mark in HOPS}
        out: list[float] = []
        in_store = 0.0
        for r in range(rounds + 1):
            if r == 1:  # round 0 warms up
                in_store = push_seconds(server)
            committed.clear()
            applied.clear()
            wake.clear()
            await turns(a, session_id, prefill + r + 1, 1)
            assert len(committed) == 1
            # Both rows are read only once B has applied something (each read of a long
            # session's row is work of the measured path's size, and it would run beside it):
            # t1 is the first apply after the last look that did not find A's version.
            async with asyncio.timeout(TIMEOUT):
                checked = 0
                while True:
                    while len(applied) <= checked:  # emitted right after the commit
                        await wake.wait()
                        wake.clear()
                    seen = len(applied)
                    row = await a.store.get_session(session_id)
                    theirs = await b.store.get_session(session_id)
                    assert row is not None
                    if theirs is not None and theirs.vv.get(a.client_id, 0) >= row.vv[a.client_id]:
                        t1 = applied[checked]
                        break
                    checked = seen
            marks = hops.of_round(committed[0], t1)
            if r > 0:
                out.append(t1 - committed[0])
                for mark, at in marks.items():
                    if mark in steps:
                        steps[mark].append(at)
            for rt in (a, b):  # quiet before the next round
                assert await rt.sync.wait_until_synced(TIMEOUT), await rt.sync.status()
        in_store = (push_seconds(server) - in_store) / rounds
        del server.store.push  # (the store's own method again, for what runs after)
    return out, in_store, payload, map_payload, steps


async def relay_latency(payload: bytes, rounds: int) -> list[float]:
    """Raw websockets: A sends ``payload`` to a relay that forwards it to B."""
    peers: dict[bytes, ServerConnection] = {}
    both = asyncio.Event()

    async def relay(ws: ServerConnection) -> None:
        role = await ws.recv()
        assert isinstance(role, bytes)
        peers[role] = ws
        if len(peers) == 2:
            both.set()
        async for message in ws:
            await peers[b"b"].send(message)

    async with serve(relay, "127.0.0.1", 0, max_size=None) as server:
        url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with (
            connect(url, max_size=None, proxy=None) as a,
            connect(url, max_size=None, proxy=None) as b,
        ):
            await a.send(b"a")
            await b.send(b"b")
            await asyncio.wait_for(both.wait(), TIMEOUT)
            out: list[float] = []
            for r in range(rounds + 1):
                started = time.perf_counter()
                await a.send(payload)
                async with asyncio.timeout(TIMEOUT):
                    await b.recv()
                if r > 0:  # round 0 warms up
                    out.append(time.perf_counter() - started)
    return out


# -- the run -----------------------------------------------------------------------------------


async def _run(quick: bool) -> list[Row]:
    k, reps, rounds = (40, 2, 10) if quick else (150, 3, 30)
    long_session = 300 if quick else 1000
    with tempfile.TemporaryDirectory(prefix="pleach-bench-") as tmp:
        root = Path(tmp)
        async with (
            SQLiteServerStore(root / "server.db") as store,
            SyncServer(store, port=0, secret=SECRET) as server,
        ):
            rows = await throughput(server, root, k, reps)
            at = long_session * 2
            rates = await long_session_flushes(server, root, at, k, reps)
            rows.append(
                Row(
                    f"  the same {k} turns queued in a session at turn {at:,} (median of {reps})",
                    statistics.median(rates),
                    "changes/s",
                    "the same in a new session",
                    rows[0].value,
                )
            )
            rows += await throughput_apart(root, k, reps)
            latencies, in_store, payload, map_payload, steps = await fanout(server, root, rounds)
            late, late_store, late_payload, _, late_steps = await fanout(
                server, root, rounds, prefill=long_session
            )
        baseline = await relay_latency(payload, rounds)
        map_baseline = await relay_latency(map_payload, rounds)
        late_baseline = await relay_latency(late_payload, rounds)
    kib = len(payload) / 1024
    rows += [
        Row(
            f"fan-out A commit -> B applied, median of {rounds} (1 turn, {kib:.1f} KiB)",
            statistics.median(latencies) * 1e3,
            "ms",
            "ws relay A -> B",
            statistics.median(baseline) * 1e3,
        ),
        Row(
            f"  against a relay of the same turn as records ({len(map_payload) / 1024:.1f} KiB)",
            statistics.median(latencies) * 1e3,
            "ms",
            "ws relay, protocol 5",
            statistics.median(map_baseline) * 1e3,
        ),
        Row(
            "fan-out A commit -> B applied, p95",
            p95(latencies) * 1e3,
            "ms",
            "ws relay A -> B",
            p95(baseline) * 1e3,
        ),
        Row("  of which the server's store.push, mean", in_store * 1e3, "ms"),
        *hop_rows(steps, "after the commit, median"),
        Row(
            f"fan-out at turn {long_session:,} of a session, median of {rounds} "
            f"({len(late_payload) / 1024:.1f} KiB)",
            statistics.median(late) * 1e3,
            "ms",
            "ws relay A -> B",
            statistics.median(late_baseline) * 1e3,
        ),
        Row(
            f"  at turn {long_session:,} against turn 1, median",
            statistics.median(late) * 1e3,
            "ms",
            "turn 1",
            statistics.median(latencies) * 1e3,
        ),
        Row(
            f"  at turn {long_session:,}, of which the server's store.push, mean",
            late_store * 1e3,
            "ms",
            "turn 1",
            in_store * 1e3,
        ),
        *hop_rows(late_steps, f"at turn {long_session:,}, after the commit", steps),
    ]
    return rows


def hop_rows(
    steps: dict[str, list[float]], when: str, before: dict[str, list[float]] | None = None
) -> list[Row]:
    """A row for each step ``Hops`` timed: the median of its rounds, in ms after A's commit
    (beside the same step of ``before``'s rounds, turn 1's, when given). A step no round
    reached (a page a pull applied, say) has no row."""
    rows = []
    for name, mark in HOPS:
        if not steps[mark]:
            continue
        value = statistics.median(steps[mark]) * 1e3
        then = before[mark] if before is not None else []
        label = f"    {name}, {when}"
        if then:
            rows.append(Row(label, value, "ms", "turn 1", statistics.median(then) * 1e3))
        else:
            rows.append(Row(label, value, "ms"))
    return rows


def run(quick: bool = False) -> list[Row]:
    """Run every measurement, print the table, return the rows."""
    started = time.perf_counter()
    rows = asyncio.run(_run(quick))
    print(render("bench_sync: sync_once throughput, live fan-out latency", rows))
    print(f"({time.perf_counter() - started:.1f}s, {os.cpu_count()} cpus)")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer turns, repetitions, rounds")
    args = parser.parse_args(argv)
    run(args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
