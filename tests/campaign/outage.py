"""The outage campaign: PostgreSQL goes away under running servers and writing devices.

``servers`` ``pleach-server`` processes share one fresh schema, reaching PostgreSQL only through
a ``FaultProxy``; ``users`` users with ``devices`` device processes each, spread over the
servers, turn and sync throughout. Each round, drawn from ``seed``:

1. waits until a random device has had a push acknowledged (the world is healthy again);
2. puts on one fault for a drawn duration (``max_outage`` at most):

   - ``cut``: every database connection reset, the database back at once;
   - ``down``: every connection reset and new ones refused for the duration (a restart);
   - ``refuse``: open connections keep working, new ones are refused (out of slots);
   - ``stall``: no byte moves for the duration (a network freeze), then all of it does;

3. lifts it, and times how long until every device has a push acknowledged again.

Devices never stop writing: their turns commit locally and queue. At the end every device
stops and ``fleet.verify`` judges as in the kill campaign: zero lost, zero duplicates.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from tests.loop import hold

from .faultproxy import FaultProxy
from .fleet import DeviceProc, Verdict, make_users, verify
from .procs import PG_DSN, ServerProc, pg_schema

HEALTHY_TIMEOUT = 60.0  # safety net: a device gets a push acknowledged once the database is up
KINDS = ("cut", "down", "refuse", "stall")


@dataclass
class OutageReport:
    seed: int
    rounds: int = 0
    by_kind: Counter[str] = field(default_factory=Counter)
    outage_seconds: float = 0.0
    written_during: int = 0  # user messages committed while the database was unreachable
    connections_cut: int = 0
    connections_refused: int = 0
    recovery: list[float] = field(default_factory=list)  # lifted -> every device acked again
    problems: list[str] = field(default_factory=list)
    verdict: Verdict = field(default_factory=Verdict)
    server_tracebacks: int = 0
    library_tracebacks: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems and not self.verdict.problems and self.server_tracebacks == 0

    def as_dict(self) -> dict[str, Any]:
        rec = sorted(self.recovery)
        return {
            "campaign": "outage",
            "backend": "postgres",
            "seed": self.seed,
            "rounds": self.rounds,
            "by_kind": dict(sorted(self.by_kind.items())),
            "outage_seconds": round(self.outage_seconds, 1),
            "written_during_outages": self.written_during,
            "connections_cut": self.connections_cut,
            "connections_refused": self.connections_refused,
            "recovery_s_median": round(statistics.median(rec), 3) if rec else None,
            "recovery_s_max": round(rec[-1], 3) if rec else None,
            "server_tracebacks": self.server_tracebacks,
            "library_tracebacks": dict(self.library_tracebacks),
            **self.verdict.as_dict(),
            "problems": self.problems + self.verdict.problems,
            "seconds": round(self.seconds, 1),
        }

    def summary(self) -> str:
        v, d = self.verdict, self.as_dict()
        return (
            f"outage (postgres, seed {self.seed}): {self.rounds} outages "
            f"{dict(sorted(self.by_kind.items()))}, {self.outage_seconds:.1f}s without a "
            f"database, {self.written_during} user messages written meanwhile; recovery "
            f"median {d['recovery_s_median']}s, max {d['recovery_s_max']}s; "
            f"{v.committed} user messages committed in {v.sessions} sessions "
            f"({v.conflict_forks} conflict forks), lost {v.lost}, duplicates {v.duplicates}; "
            f"server tracebacks {self.server_tracebacks}; "
            f"{len(self.problems) + len(v.problems)} problems; {self.seconds:.0f}s"
        )


def through(dsn: str, port: int) -> str:
    """``dsn`` with its host and port replaced by the proxy's loopback address."""
    parts = urlsplit(dsn)
    auth = parts.netloc.rpartition("@")[0]
    netloc = f"{auth}@127.0.0.1:{port}" if auth else f"127.0.0.1:{port}"
    return urlunsplit(parts._replace(netloc=netloc))


async def _acked(devs: list[DeviceProc], timeout: float) -> list[DeviceProc]:
    """Wait until each device has had a push acknowledged; the ones that did not in time."""
    results = await asyncio.gather(*(d.marker("settle", timeout) for d in devs))
    return [d for d, ok in zip(devs, results, strict=True) if not ok]


async def run_outage(
    rounds: int,
    seed: int,
    workdir: Path,
    *,
    servers: int = 2,
    users: int = 2,
    devices: int = 2,
    max_outage: float = 2.0,
    pace: str = "0.05,0.2",
    dsn: str = PG_DSN,
    log: Callable[[str], None] = print,
) -> OutageReport:
    started = time.monotonic()
    report = OutageReport(seed)
    rng = random.Random(seed)
    workdir.mkdir(parents=True, exist_ok=True)
    target = urlsplit(dsn)
    proxy = FaultProxy(target.hostname or "127.0.0.1", target.port or 5432)
    await proxy.start()
    procs: list[ServerProc] = []
    fleet: list[DeviceProc] = []
    people = make_users(users)
    try:
        async with pg_schema(dsn) as schema:
            try:
                for i in range(servers):  # one by one: the first migrates
                    srv = ServerProc(
                        through(dsn, proxy.port),
                        schema=schema,
                        # A short statement timeout and pool size: outages show sooner.
                        extra=["--pool-size", "4", "--statement-timeout-ms", "3000"],
                        name=f"srv{i}",
                    )
                    await srv.start()
                    procs.append(srv)
                for u, user in enumerate(people):
                    for d in range(devices):
                        srv = procs[(u * devices + d) % len(procs)]
                        dev = DeviceProc(
                            f"u{u}d{d}",
                            workdir / f"u{u}d{d}.db",
                            user,
                            lambda srv=srv: srv.url,  # type: ignore[misc]
                            seed=seed,
                            pace=pace,
                        )
                        user.devices.append(dev)
                        fleet.append(dev)
                await asyncio.gather(*(dev.start() for dev in fleet))
                first = rng.sample(KINDS, len(KINDS))  # every kind early, even in a short run
                for r in range(rounds):
                    late = await _acked([rng.choice(fleet)], HEALTHY_TIMEOUT)
                    if late:
                        report.problems.append(f"stuck: {late[0].name} got no ack before round {r}")
                    kind = first[r] if r < len(first) else rng.choice(KINDS)
                    duration = 0.0 if kind == "cut" else rng.uniform(0.2, max_outage)
                    before = sum(len(u.ledger.written) for u in people)
                    report.connections_cut += proxy.cut() if kind in ("cut", "down") else 0
                    proxy.refusing = kind in ("down", "refuse")
                    proxy.stalled = kind == "stall"
                    refused = proxy.refused
                    if duration:
                        # The outage lasts this long: the fault itself, not a wait for an event.
                        await hold(duration)
                    proxy.heal()
                    lifted = time.monotonic()
                    report.connections_refused += proxy.refused - refused
                    report.written_during += sum(len(u.ledger.written) for u in people) - before
                    late = await _acked(fleet, HEALTHY_TIMEOUT)
                    if late:
                        report.problems.append(
                            f"no-recovery: {[d.name for d in late]} got no ack within "
                            f"{HEALTHY_TIMEOUT}s after a {kind} outage"
                        )
                    report.recovery.append(time.monotonic() - lifted)
                    report.by_kind[kind] += 1
                    report.outage_seconds += duration
                    report.rounds += 1
                    if (r + 1) % 10 == 0:
                        log(f"  {r + 1}/{rounds} outages")
                for dev in fleet:
                    code = await dev.stop()
                    if code != 0:
                        report.problems.append(f"device-exit: {dev.name} stopped with {code}")
                report.verdict = await verify(people, procs[0].url)
            finally:
                for dev in fleet:
                    if dev.running:
                        await dev.kill()
                for srv in procs:
                    await srv.stop()
    finally:
        await proxy.close()
    for srv in procs:
        report.server_tracebacks += srv.tracebacks
        report.library_tracebacks.update(srv.library_tracebacks())
        if srv.tracebacks:
            report.problems.append(f"server-traceback: {srv.name}: {srv.traceback_text()}")
    report.seconds = time.monotonic() - started
    return report


__all__ = ["OutageReport", "run_outage", "through"]
