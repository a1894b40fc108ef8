"""The kill campaign: SIGKILL devices and servers at seeded points, restart them, lose nothing.

One ``pleach-server`` process (a SQLite file, or a fresh PostgreSQL schema) behind the
simulation's loopback proxy (``tests/sim/network.Proxy``: a restarted server listens on a new
port, the devices keep dialling the proxy). ``users`` users with ``devices`` device processes
each (``device.py``), all turning and syncing at once. Each round draws from ``seed``:

- a **device kill** (two rounds in three): a device and a point (a turn's commit, a remote
  page's commit, a push about to go, a ``PushAck`` about to be settled, a new session's
  write), and either

  - *inside*: the device is armed to SIGKILL itself at the K-th pass (K in 1..3) through the
    point, at stage ``in`` (inside the transaction before its writes; before the push is
    read; before the acknowledged rows are removed) or ``after`` (once the store call
    returned), at once or 0-5 ms later (the push on the wire, the next statement running); or
  - *outside*: the campaign waits for the device to print the point's marker and SIGKILLs it
    0-20 ms later;

- a **server kill** (one round in three): the campaign waits for a device's marker (a push
  going out, an ack arriving, a page being applied, a turn committing) and SIGKILLs the
  server 0-20 ms later: inside a push transaction, between commit and ack, mid fan-out,
  mid pull.

The victim is restarted at once on the same file or database; the next round starts when it
is back (its ``ready`` line, or the server's ``listening`` line): the others keep working
throughout. At the end every device stops, is synced, and ``fleet.verify`` judges: zero lost,
zero duplicates, every invariant of the simulation, every chain verifies.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.loop import hold
from tests.sim.network import Proxy

from .device import STAGES
from .fleet import DeviceProc, Verdict, make_users, verify
from .procs import PG_DSN, ServerProc, pg_schema, sqlite_db

POINT_TIMEOUT = 30.0  # safety net: a busy device passes every point many times a second
DEVICE_POINTS = (("turn", 4), ("apply", 3), ("flush", 3), ("settle", 3), ("write", 1))
SERVER_POINTS = ("flush", "settle", "apply", "turn")


@dataclass
class KillReport:
    backend: str
    seed: int
    rounds: int = 0
    device_kills: int = 0
    server_kills: int = 0
    by_point: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    verdict: Verdict = field(default_factory=Verdict)
    server_tracebacks: int = 0
    seconds: float = 0.0

    @property
    def kills(self) -> int:
        return self.device_kills + self.server_kills

    @property
    def ok(self) -> bool:
        return not self.problems and not self.verdict.problems and self.server_tracebacks == 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "campaign": "kill",
            "backend": self.backend,
            "seed": self.seed,
            "rounds": self.rounds,
            "kills": self.kills,
            "device_kills": self.device_kills,
            "server_kills": self.server_kills,
            "by_point": dict(sorted(self.by_point.items())),
            "server_tracebacks": self.server_tracebacks,
            **self.verdict.as_dict(),
            "problems": self.problems + self.verdict.problems,
            "seconds": round(self.seconds, 1),
        }

    def summary(self) -> str:
        v = self.verdict
        return (
            f"kill ({self.backend}, seed {self.seed}): {self.rounds} rounds, {self.kills} kills "
            f"survived ({self.device_kills} device, {self.server_kills} server); "
            f"{v.committed} user messages committed in {v.sessions} sessions "
            f"({v.conflict_forks} conflict forks), lost {v.lost}, duplicates {v.duplicates}; "
            f"server tracebacks {self.server_tracebacks}; "
            f"{len(self.problems) + len(v.problems)} problems; {self.seconds:.0f}s"
        )


@contextlib.asynccontextmanager
async def server_for(backend: str, workdir: Path, dsn: str = PG_DSN) -> AsyncIterator[ServerProc]:
    """A started server process on ``backend``'s store (a fresh schema for PostgreSQL)."""
    if backend == "sqlite":
        server = ServerProc(sqlite_db(workdir))
        await server.start()
        try:
            yield server
        finally:
            await server.stop()
    elif backend == "postgres":
        async with pg_schema(dsn) as schema:
            server = ServerProc(dsn, schema=schema)
            await server.start()
            try:
                yield server
            finally:
                await server.stop()
    else:
        raise ValueError(f"unknown backend {backend!r}: sqlite or postgres")


def _weighted(rng: random.Random, pairs: tuple[tuple[str, int], ...]) -> str:
    return rng.choices([p for p, _ in pairs], weights=[w for _, w in pairs])[0]


async def _kill_device(rng: random.Random, dev: DeviceProc, report: KillReport) -> None:
    point = _weighted(rng, DEVICE_POINTS)
    if rng.random() < 0.5:
        stage = rng.choice(STAGES)
        countdown = rng.randint(1, 3)
        delay_ms = rng.choice([0.0, rng.uniform(0.0, 5.0)])
        how = f"device:{point}:{stage}{'+delay' if delay_ms else ''}"
        await dev.arm(point, stage, countdown, delay_ms)
        try:
            async with asyncio.timeout(POINT_TIMEOUT):
                code = await dev.wait_exit()
        except TimeoutError:
            report.problems.append(
                f"stuck: {dev.name} did not pass {point} {countdown} times in {POINT_TIMEOUT}s"
            )
            code = await dev.kill()
    else:
        how = f"device:{point}:outside"
        if not await dev.marker(point, POINT_TIMEOUT):
            report.problems.append(f"stuck: {dev.name} did not pass {point} in {POINT_TIMEOUT}s")
        # The moment of the kill: a seeded delay after the marker (choosing, not waiting).
        await hold(rng.uniform(0.0, 0.02))
        code = await dev.kill()
    if code != -9:
        last = dev.traceback_texts[-1] if dev.traceback_texts else "".join(dev.stderr[-10:])
        report.problems.append(f"device-exit: {dev.name} ended with {code}, not by SIGKILL: {last}")
    report.device_kills += 1
    report.by_point[how] += 1
    await dev.start()


async def _kill_server(
    rng: random.Random, server: ServerProc, devices: list[DeviceProc], report: KillReport
) -> None:
    watch = rng.choice(devices)
    point = rng.choice(SERVER_POINTS)
    if not await watch.marker(point, POINT_TIMEOUT):
        report.problems.append(f"stuck: {watch.name} did not pass {point} in {POINT_TIMEOUT}s")
    await hold(rng.uniform(0.0, 0.02))  # the moment of the kill, as above
    code = await server.kill()
    if code != -9:
        report.problems.append(f"server-exit: the server ended with {code}, not by SIGKILL")
    report.server_kills += 1
    report.by_point[f"server:{point}"] += 1
    await server.start()


async def run_kill(
    rounds: int,
    seed: int,
    backend: str,
    workdir: Path,
    *,
    users: int = 2,
    devices: int = 2,
    pace: str = "0.05,0.2",
    dsn: str = PG_DSN,
    log: Callable[[str], None] = print,
) -> KillReport:
    """Play ``rounds`` kill rounds drawn from ``seed``; the report says what survived."""
    started = time.monotonic()
    report = KillReport(backend, seed)
    rng = random.Random(seed)
    workdir.mkdir(parents=True, exist_ok=True)
    async with server_for(backend, workdir, dsn) as server:
        proxy = Proxy("campaign", server.upstream)
        await proxy.start()
        people = make_users(users)
        fleet: list[DeviceProc] = []
        try:
            for u, user in enumerate(people):
                for d in range(devices):
                    dev = DeviceProc(
                        f"u{u}d{d}",
                        workdir / f"u{u}d{d}.db",
                        user,
                        lambda: proxy.url,
                        seed=seed,
                        pace=pace,
                    )
                    user.devices.append(dev)
                    fleet.append(dev)
            await asyncio.gather(*(dev.start() for dev in fleet))
            for r in range(rounds):
                if rng.random() < 2 / 3:
                    await _kill_device(rng, rng.choice(fleet), report)
                else:
                    await _kill_server(rng, server, fleet, report)
                report.rounds += 1
                if (r + 1) % 25 == 0:
                    log(f"  {r + 1}/{rounds} rounds, {report.kills} kills")
            for dev in fleet:
                code = await dev.stop()
                if code not in (0, -9):
                    report.problems.append(f"device-exit: {dev.name} stopped with {code}")
            report.verdict = await verify(people, server.url)
        finally:
            for dev in fleet:
                if dev.running:
                    await dev.kill()
            await proxy.close()
    report.server_tracebacks = server.tracebacks  # stopped now: its last words included
    if server.tracebacks:
        report.problems.append(f"server-traceback: {server.traceback_text()}")
    report.seconds = time.monotonic() - started
    return report


__all__ = ["KillReport", "run_kill", "server_for"]
