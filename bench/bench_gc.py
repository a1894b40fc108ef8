"""``python -m bench.bench_gc [--quick]``: the garbage collector's pause in a server process.

While CPython's collector runs, a ``pleach-server`` process serves no one, and a full
collection walks every object the process tracks (``pleach_server.gcpauses``). This starts two
server processes as ``pleach-server`` makes one (the command's own imports, a SyncServer on a
SQLite store in a temporary file): the first sets what start-up made aside with
``freeze_startup`` before its store opens, as the command does; the second does not, as the
command did before (``PLEACH_GC_FREEZE=0``): that one is the floor. Each gets N idle device
connections from this process (each a device of its own that did ``Hello`` / ``Welcome``:
``bench_server_mem``'s), then each times a full collection (``gc.collect()``) in turn, the two
taking turns seven times, and each figure is the median of its seven: the same connections,
the same moments (one server measured after the other, the machine's load moved the ratio
from 0.4x to 1.0x between two runs of one hour at 1,000 connections). It also counts the
objects each idle connection adds to a collection's walk.

Run ``python -m bench.bench_gc [--quick]`` (``--quick``: 100 connections only).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (a server process imports what pleach-server does, and no more)
    from bench.bench_local import Row

__all__ = ["main", "run"]

ROOT = Path(__file__).resolve().parent.parent
REPEATS = 7
TIMEOUT = 120.0


async def _serve(db: str, secret: str, freeze: str) -> None:
    """A server process: ``pleach-server``'s imports and start-up (what start-up made set
    aside when ``freeze`` is ``1``), then for each ``collect`` line on stdin one timed full
    collection, answered as a JSON line; it stops at the end of stdin."""
    import pleach_server.cli  # noqa: F401  (the command's imports, as it starts)
    from pleach_server.gcpauses import freeze_startup
    from pleach_server.server import SyncServer
    from pleach_server.store import SQLiteServerStore

    store = SQLiteServerStore(db)
    server = SyncServer(store, port=0, secret=secret.encode())
    frozen = freeze_startup() if freeze == "1" else 0  # (the command: before the store opens)
    await store.open()
    try:
        async with server:
            gc.collect()
            idle = len(gc.get_objects())
            print(json.dumps({"url": server.url, "frozen": frozen, "idle": idle}), flush=True)
            loop = asyncio.get_running_loop()
            while line := await loop.run_in_executor(None, sys.stdin.readline):
                if line.strip() != "collect":
                    continue
                tracked = len(gc.get_objects())
                started = time.perf_counter()
                gc.collect()
                seconds = time.perf_counter() - started
                print(json.dumps({"seconds": seconds, "tracked": tracked}), flush=True)
    finally:
        await store.close()


class _Server:
    def __init__(self, proc: asyncio.subprocess.Process, started: dict[str, object]) -> None:
        self.proc = proc
        self.started = started

    @classmethod
    async def start(cls, db: Path, secret: str, freeze: bool) -> _Server:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PLEACH_")}
        env["PYTHONPATH"] = str(ROOT)
        # (asyncio's debug mode keeps a traceback for each task and handle: more objects per
        # connection than a server in use holds, 277 where 116; the test suite turns it on)
        env.pop("PYTHONASYNCIODEBUG", None)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.bench_gc", "--serve", str(db), secret,
            "1" if freeze else "0",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env,
        )  # fmt: skip
        assert proc.stdout is not None
        try:
            async with asyncio.timeout(TIMEOUT):
                started = json.loads(await proc.stdout.readline())
        except BaseException:
            proc.kill()
            await proc.wait()
            raise
        return cls(proc, started)

    async def collect(self) -> dict[str, float]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(b"collect\n")
        await self.proc.stdin.drain()
        async with asyncio.timeout(TIMEOUT):
            answer: dict[str, float] = json.loads(await self.proc.stdout.readline())
        return answer

    async def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            async with asyncio.timeout(TIMEOUT):
                await self.proc.wait()
        finally:
            if self.proc.returncode is None:
                self.proc.kill()
                await self.proc.wait()


async def _measure(count: int, root: Path) -> dict[str, float]:
    """``count`` idle connections to each of the two servers, then their collections timed
    in turn (``REPEATS`` each)."""
    from bench.bench_push import SECRET
    from bench.bench_server_mem import device_opener, open_many, raise_nofile

    raise_nofile(4 * count + 256)
    frozen = await _Server.start(root / f"frozen-{count}.db", SECRET, True)
    try:
        walked = await _Server.start(root / f"walked-{count}.db", SECRET, False)
        try:
            async with AsyncExitStack() as stack:
                for name, srv in (("f", frozen), ("w", walked)):
                    opener = device_opener(str(srv.started["url"]), f"gc{name}{count}")
                    await open_many(count, opener, stack)
                pauses: dict[str, list[float]] = {"frozen": [], "walked": []}
                tracked = 0.0
                for i in range(REPEATS):
                    pair = [("frozen", frozen), ("walked", walked)]
                    for name, srv in pair if i % 2 == 0 else pair[::-1]:
                        answer = await srv.collect()
                        pauses[name].append(answer["seconds"])
                        if name == "frozen":
                            tracked = answer["tracked"]
        finally:
            await walked.stop()
    finally:
        await frozen.stop()
    idle = float(frozen.started["idle"])  # type: ignore[arg-type]
    return {
        "frozen_ms": statistics.median(pauses["frozen"]) * 1e3,
        "walked_ms": statistics.median(pauses["walked"]) * 1e3,
        "per_connection": (tracked - idle) / count,
        "start_up": float(frozen.started["frozen"]),  # type: ignore[arg-type]
    }


async def _run(counts: list[int]) -> tuple[list[Row], list[str]]:
    from bench.bench_local import Row

    rows: list[Row] = []
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="pleach-bench-gc-") as tmp:
        for count in counts:
            m = await _measure(count, Path(tmp))
            rows.append(
                Row(
                    f"a full collection in pleach-server, {count} idle connections",
                    m["frozen_ms"],
                    "ms",
                    "start-up not set aside",
                    m["walked_ms"],
                )
            )
            notes.append(
                f"{count} connections: {m['per_connection']:.0f} objects walked per idle "
                f"connection; {m['start_up']:,.0f} objects of start-up set aside"
            )
    notes.append(
        f"each figure the median of {REPEATS} gc.collect() timed in its server process, the two "
        "processes taking turns; nothing else runs in a process while it collects"
    )
    return rows, notes


def run(quick: bool = False) -> list[Row]:
    """Measure, print the table, return the rows."""
    from bench.bench_local import report

    started = time.perf_counter()
    rows, notes = asyncio.run(_run([100] if quick else [100, 1000]))
    report("bench_gc: the garbage collector's pause in a server process", rows, notes, started)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="100 connections only")
    parser.add_argument(
        "--serve", nargs=3, metavar=("DB", "SECRET", "FREEZE"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(_serve(*args.serve))
        return 0
    run(args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
