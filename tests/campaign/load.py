"""Load, fairness and memory of a real ``pleach-server`` process, on either store.

- ``run_load``: ``devices`` light device connections (``devices / 2`` users x 2 devices, from
  ``generators`` ``loadgen`` processes) each push one small change about every ``interval``
  s for ``seconds`` (after ``warm``). Push-ack latency p50/p99/p99.9/max, the server's RSS
  (started, with every device connected, at the end, peak) and CPU, PostgreSQL's CPU, the
  generators' CPU.
- ``run_fairness``: one honest tenant (one device, a push every ``honest_interval`` s) alone,
  then while another tenant floods the same server with ``flood`` connections pushing as fast
  as they are answered (the server's per-connection and per-tenant rate limits refuse the
  excess with 3008). The honest tenant's p99 under the flood over its p99 at rest is the factor.
- ``run_memory``: RSS after one warm-up connection, after ``connections`` idle devices connect
  (``Hello``/``Welcome``), and after they all close, for ``cycles`` cycles: memory per
  connection, and how much comes back.

Nothing is asserted: the figures are printed (docs/RELIABILITY.md publishes a run).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from bench.bench_live import percentile, postgres_cpu_seconds, proc_cpu_seconds, rss_kib
from bench.bench_server_mem import pleach_counts, raise_nofile
from pleach_server.store import Tenant
from shared.ids import uuid7
from tests.loop import hold

from .kill import server_for
from .loadgen import Light
from .procs import PG_DSN, SECRET, ServerProc, child_env

LINE_TIMEOUT = 300.0  # safety net for a generator's next line (1,000 handshakes on 2 cores)
SETTLE_TIMEOUT = 60.0
SETTLE_POLL_S = 0.05
RESULT_LINE_LIMIT = 64 * 1024 * 1024  # a result line carries every latency sample


def status_kib(pid: int, key: str) -> int:
    """A ``/proc/<pid>/status`` memory field (``VmRSS``, ``VmHWM``...) in KiB."""
    with open(f"/proc/{pid}/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith(f"{key}:"):
                return int(line.split()[1])
    raise RuntimeError(f"no {key} for pid {pid}")


def latency(samples: list[float]) -> dict[str, Any]:
    if not samples:
        return {"samples": 0}
    return {
        "samples": len(samples),
        "p50_ms": round(percentile(samples, 0.50) * 1e3, 2),
        "p99_ms": round(percentile(samples, 0.99) * 1e3, 2),
        "p999_ms": round(percentile(samples, 0.999) * 1e3, 2),
        "max_ms": round(max(samples) * 1e3, 2),
        "mean_ms": round(statistics.fmean(samples) * 1e3, 2),
    }


class LoadGen:
    """One ``tests.campaign.loadgen`` process, driven line by line."""

    def __init__(self, url: str, org: str, *args: str) -> None:
        self.url = url
        self.org = org
        self.args = list(args)
        self.proc: asyncio.subprocess.Process | None = None
        self.stderr: list[str] = []
        self._drain: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    async def start(self) -> int:
        """Spawn it; returns the connections it opened once all are welcomed."""
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.campaign.loadgen", "--url", self.url,
            "--secret", SECRET, "--org", self.org, "--run", uuid7()[-12:], *self.args,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=child_env(), limit=RESULT_LINE_LIMIT,
        )  # fmt: skip
        self._drain = asyncio.create_task(self._read_stderr())
        return int((await self.line("ready")).split()[1])

    async def _read_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        async for raw in self.proc.stderr:
            self.stderr.append(raw.decode(errors="replace"))
            del self.stderr[:-200]

    async def line(self, prefix: str) -> str:
        """The next line starting with ``prefix`` (others are skipped)."""
        assert self.proc is not None and self.proc.stdout is not None
        async with asyncio.timeout(LINE_TIMEOUT):
            while True:
                raw = await self.proc.stdout.readline()
                if not raw:
                    await self.proc.wait()
                    if self._drain is not None:
                        await self._drain
                    raise RuntimeError(
                        f"loadgen ended ({self.proc.returncode}):\n{''.join(self.stderr)[-3000:]}"
                    )
                text = raw.decode().strip()
                if text.startswith(prefix):
                    return text
                if text.startswith("failed"):
                    raise RuntimeError(f"loadgen {text}:\n{''.join(self.stderr)[-3000:]}")

    async def send(self, line: str) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        await self.proc.stdin.drain()

    async def go(self, seconds: float, warm: float) -> None:
        await self.send(f"go {seconds} {warm}")

    async def result(self) -> dict[str, Any]:
        return dict(json.loads((await self.line("result")).partition(" ")[2]))

    async def close(self) -> None:
        if self.proc is None:
            return
        if self.proc.returncode is None:
            with contextlib.suppress(ConnectionError):
                await self.send("exit")
            try:
                await self.line("closed")
            except (RuntimeError, TimeoutError):
                self.proc.kill()
            await self.proc.wait()
        if self._drain is not None:
            await self._drain
            self._drain = None


@contextlib.asynccontextmanager
async def generators(gens: list[LoadGen]) -> AsyncIterator[list[LoadGen]]:
    """``gens`` (started inside), each closed when the block ends."""
    try:
        yield gens
    finally:
        await asyncio.gather(*(g.close() for g in gens), return_exceptions=True)


class Cpu:
    """CPU seconds of the server, PostgreSQL (every ``postgres`` process) and other pids."""

    def __init__(self, server: ServerProc, with_pg: bool, others: list[int]) -> None:
        self.server, self.with_pg, self.others = server, with_pg, others
        self.at = self._read()

    def _read(self) -> tuple[float, float, float, float]:
        return (
            time.perf_counter(),
            proc_cpu_seconds(self.server.pid),
            postgres_cpu_seconds() if self.with_pg else 0.0,
            sum(proc_cpu_seconds(p) for p in self.others),
        )

    def since(self) -> dict[str, float]:
        """Percent of one core each used since construction (or the last call)."""
        now = self._read()
        wall = now[0] - self.at[0]
        out = {
            "server_cpu_pct": round((now[1] - self.at[1]) / wall * 100, 1),
            "generators_cpu_pct": round((now[3] - self.at[3]) / wall * 100, 1),
        }
        if self.with_pg:
            out["postgres_cpu_pct"] = round((now[2] - self.at[2]) / wall * 100, 1)
        self.at = now
        return out


async def run_load(
    backend: str,
    workdir: Path,
    *,
    devices: int = 1000,
    seconds: float = 60.0,
    warm: float = 5.0,
    interval: float = 10.0,
    processes: int = 2,
    dsn: str = PG_DSN,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    raise_nofile(2 * devices + 512)  # the server process inherits it
    users = max(1, devices // 2)
    started = time.monotonic()
    async with server_for(backend, workdir, dsn) as server:
        rss_start = rss_kib(server.pid)
        share = [users // processes + (1 if i < users % processes else 0) for i in range(processes)]
        firsts = [sum(share[:i]) for i in range(processes)]
        gens = []
        for i, (first, n) in enumerate(zip(firsts, share, strict=True)):
            if n:
                flags = ["--first-user", str(first), "--users", str(n), "--per-user", "2"]
                flags += ["--mode", "load", "--interval", str(interval), "--seed", str(i)]
                gens.append(LoadGen(server.url, "campaign-load", *flags))
        async with generators(gens):
            opened = sum(await asyncio.gather(*(g.start() for g in gens)))
            log(f"  {opened} devices connected in {time.monotonic() - started:.0f}s")
            rss_connected = rss_kib(server.pid)
            for g in gens:
                await g.go(seconds, warm)
            # Timing the measurement window: CPU is read at its start and its end.
            await hold(warm + 0.05)
            cpu = Cpu(server, backend == "postgres", [g.pid for g in gens])
            await hold(seconds)
            used = cpu.since()
            results = await asyncio.gather(*(g.result() for g in gens))
            rss_loaded = rss_kib(server.pid)
            hwm = status_kib(server.pid, "VmHWM")
    samples = [s for r in results for s in r["samples"]]
    errors: dict[str, int] = {}
    for r in results:
        for code, n in r["errors"].items():
            errors[code] = errors.get(code, 0) + n
    return {
        "campaign": "load",
        "backend": backend,
        "devices": opened,
        "users": users,
        "generators": len(gens),
        "interval_s": interval,
        "offered_pushes_per_s": round(opened / interval, 1),
        "acked_pushes_per_s": round(len(samples) / seconds, 1),
        "seconds": seconds,
        "warm": warm,
        "ack_latency": latency(samples),
        "errors": errors,
        "closed": sum(r["closed"] for r in results),
        "live_frames_per_s": round(sum(r["live_frames"] for r in results) / (seconds + warm), 1),
        **used,
        "server_rss_mib": {
            "started": round(rss_start / 1024, 1),
            "connected": round(rss_connected / 1024, 1),
            "after_load": round(rss_loaded / 1024, 1),
            "peak": round(hwm / 1024, 1),
        },
        "server_kib_per_connection": round((rss_connected - rss_start) / max(1, opened), 1),
        "wall_s": round(time.monotonic() - started, 1),
    }


def load_summary(r: dict[str, Any]) -> str:
    lat, rss = r["ack_latency"], r["server_rss_mib"]
    pg = f", postgres {r['postgres_cpu_pct']}%" if "postgres_cpu_pct" in r else ""
    return (
        f"load ({r['backend']}): {r['devices']} devices ({r['users']} users x 2), "
        f"{r['offered_pushes_per_s']} pushes/s offered, {r['acked_pushes_per_s']} acked/s over "
        f"{r['seconds']:.0f}s; ack p50 {lat.get('p50_ms')} ms, p99 {lat.get('p99_ms')} ms, "
        f"p99.9 {lat.get('p999_ms')} ms, max {lat.get('max_ms')} ms; errors {r['errors']}; "
        f"CPU server {r['server_cpu_pct']}%{pg}, generators {r['generators_cpu_pct']}% of a "
        f"core; server RSS {rss['started']} -> {rss['connected']} MiB connected -> "
        f"{rss['after_load']} MiB after load (peak {rss['peak']}), "
        f"{r['server_kib_per_connection']} KiB per connection"
    )


async def run_fairness(
    backend: str,
    workdir: Path,
    *,
    seconds: float = 20.0,
    warm: float = 2.0,
    flood: int = 50,
    honest_interval: float = 0.02,
    dsn: str = PG_DSN,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    started = time.monotonic()
    async with server_for(backend, workdir, dsn) as server:
        honest = LoadGen(
            server.url, "campaign-honest", "--users", "1", "--per-user", "1",
            "--mode", "load", "--interval", str(honest_interval),
        )  # fmt: skip
        flooder = LoadGen(
            server.url, "campaign-flood", "--users", "1", "--per-user", str(flood),
            "--mode", "flood",
        )  # fmt: skip
        async with generators([honest, flooder]):
            await asyncio.gather(honest.start(), flooder.start())
            cpu = Cpu(server, backend == "postgres", [flooder.pid])
            await honest.go(seconds, warm)
            rest = await honest.result()
            rest_cpu = cpu.since()
            log("  at rest measured; flooding")
            await flooder.go(24 * 3600, 0)  # until stopped
            await flooder.line("flooding")
            cpu.since()
            await honest.go(seconds, warm)
            attack = await honest.result()
            attack_cpu = cpu.since()
            await flooder.send("stop")
            flood_result = await flooder.result()
    at_rest, under = latency(rest["samples"]), latency(attack["samples"])
    flood_s = flood_result["seconds_run"]
    return {
        "campaign": "fairness",
        "backend": backend,
        "seconds": seconds,
        "honest_interval_s": honest_interval,
        "at_rest": {**at_rest, "errors": rest["errors"], **rest_cpu},
        "under_flood": {**under, "errors": attack["errors"], **attack_cpu},
        "p99_factor": round(under["p99_ms"] / at_rest["p99_ms"], 2),
        "p50_factor": round(under["p50_ms"] / at_rest["p50_ms"], 2),
        "flood": {
            "connections": flood,
            "frames_per_s": round(flood_result["pushes"] / flood_s, 1),
            "applied_per_s": round(flood_result["acked"] / flood_s, 1),
            "errors_per_s": {
                code: round(n / flood_s, 1) for code, n in flood_result["errors"].items()
            },
            "closed_by_server": flood_result["closed"],
            "reconnects": flood_result["reconnects"],
        },
        "wall_s": round(time.monotonic() - started, 1),
    }


def fairness_summary(r: dict[str, Any]) -> str:
    rest, under, fl = r["at_rest"], r["under_flood"], r["flood"]
    return (
        f"fairness ({r['backend']}): honest tenant push-ack p50/p99 {rest['p50_ms']}/"
        f"{rest['p99_ms']} ms at rest, {under['p50_ms']}/{under['p99_ms']} ms while another "
        f"tenant floods with {fl['connections']} connections ({fl['frames_per_s']} frames/s, "
        f"{fl['applied_per_s']} applied/s, refused {fl['errors_per_s']}/s, "
        f"{fl['closed_by_server']} closes): p99 x{r['p99_factor']}, p50 x{r['p50_factor']}; "
        f"server CPU {rest['server_cpu_pct']}% -> {under['server_cpu_pct']}%"
    )


async def _connections_settle(url: str, count: int) -> None:
    """Until the server's ``/metrics`` counts ``count`` connections and live subscribers.

    A bounded poll of an external process: the server raises no event another process could
    wait on when it has finished closing connections."""
    for _ in range(int(SETTLE_TIMEOUT / SETTLE_POLL_S)):
        if await pleach_counts(url) == (float(count), float(count)):
            return
        await hold(SETTLE_POLL_S)  # between two reads of another process's /metrics
    raise TimeoutError(
        f"the server did not settle at {count} connections: {await pleach_counts(url)}"
    )


async def run_memory(
    backend: str,
    workdir: Path,
    *,
    connections: int = 1000,
    cycles: int = 4,
    dsn: str = PG_DSN,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    raise_nofile(2 * connections + 512)
    started = time.monotonic()
    run = uuid7()[-12:]
    secret = SECRET.encode()

    def light(url: str, i: int) -> Light:
        tenant = Tenant(org_id="campaign-mem", user_id=f"{run}-u{i // 2}")
        return Light(url, secret, tenant, f"{run}-d{i}")

    async def open_idle(devices: list[Light]) -> None:
        limit = asyncio.Semaphore(50)

        async def one(dev: Light) -> None:
            async with limit:
                await dev.open()

        await asyncio.gather(*(one(d) for d in devices))

    opened: list[int] = []
    closed: list[int] = []
    async with server_for(backend, workdir, dsn) as server:
        warmup = light(server.url, connections)  # one-time costs before "before"; kept open
        await warmup.open()
        await _connections_settle(server.url, 1)
        before = rss_kib(server.pid)
        try:
            for cycle in range(cycles):
                devices = [light(server.url, i) for i in range(connections)]
                try:
                    await open_idle(devices)
                    await _connections_settle(server.url, connections + 1)
                    opened.append(rss_kib(server.pid))
                finally:
                    await asyncio.gather(*(d.close() for d in devices))
                await _connections_settle(server.url, 1)
                closed.append(rss_kib(server.pid))
                log(f"  cycle {cycle + 1}: {opened[-1] / 1024:.1f} MiB open, "
                    f"{closed[-1] / 1024:.1f} MiB closed")  # fmt: skip
        finally:
            await warmup.close()
    grown = opened[0] - before
    return {
        "campaign": "memory",
        "backend": backend,
        "connections": connections,
        "cycles": cycles,
        "rss_mib": {
            "before": round(before / 1024, 1),
            "open": [round(k / 1024, 1) for k in opened],
            "closed": [round(k / 1024, 1) for k in closed],
        },
        "kib_per_connection": round(grown / connections, 1),
        "returned_after_close_pct": round((opened[0] - closed[0]) / grown * 100, 1)
        if grown > 0
        else None,
        "retained_after_close_mib": round((closed[0] - before) / 1024, 1),
        # Freed memory is reused: the last cycle grows the RSS little or not at all.
        "last_cycle_growth_mib": round((closed[-1] - closed[-2]) / 1024, 1) if cycles > 1 else None,
        "wall_s": round(time.monotonic() - started, 1),
    }


def memory_summary(r: dict[str, Any]) -> str:
    rss = r["rss_mib"]
    return (
        f"memory ({r['backend']}): {r['connections']} idle connections cost "
        f"{r['kib_per_connection']} KiB each; RSS {rss['before']} MiB -> {rss['open']} open -> "
        f"{rss['closed']} closed ({r['cycles']} cycles): {r['returned_after_close_pct']}% "
        f"returned after close, {r['retained_after_close_mib']} MiB kept, "
        f"{r['last_cycle_growth_mib']} MiB more in the last cycle"
    )


__all__ = [
    "fairness_summary",
    "load_summary",
    "memory_summary",
    "run_fairness",
    "run_load",
    "run_memory",
]
