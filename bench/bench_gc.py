"""``python -m bench.bench_gc [--quick]``: the garbage collector's pause in a server process.

While CPython's collector runs, a ``pleach-server`` process serves no one, and a full
collection walks every object the process tracks (``pleach_server.gcpauses``). This starts a
server process as ``pleach-server`` makes one (the command's own imports, a SyncServer on a
SQLite store in a temporary file, what start-up made set aside with ``freeze_startup`` before
the store opens), opens N idle device connections to it from this process (each a device of
its own that did ``Hello`` / ``Welcome``: ``bench_server_mem``'s), then has the server time
full collections (``gc.collect()``, the median of five) with start-up set aside, then again
with it walked too (``gc.unfreeze()``): the same process, the same connections, one moment.
That second figure is the floor the first is set beside (what the server paid before it froze
anything). It also counts the objects each idle connection adds to the walk.

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

if TYPE_CHECKING:  # (the server process imports what pleach-server does, and no more)
    from bench.bench_local import Row

__all__ = ["main", "run"]

ROOT = Path(__file__).resolve().parent.parent
REPEATS = 5
TIMEOUT = 120.0


def _pauses(repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        started = time.perf_counter()
        gc.collect()
        out.append(time.perf_counter() - started)
    return out


async def _serve(db: str, secret: str) -> None:
    """The server process: ``pleach-server``'s imports and start-up, then answers ``measure``
    on stdin with one JSON line (the collections timed), and stops at the end of stdin."""
    import pleach_server.cli  # noqa: F401  (the command's imports, as it starts)
    from pleach_server.gcpauses import freeze_startup
    from pleach_server.server import SyncServer
    from pleach_server.store import SQLiteServerStore

    store = SQLiteServerStore(db)
    server = SyncServer(store, port=0, secret=secret.encode())
    frozen = freeze_startup()  # (as the command does: before the store opens)
    await store.open()
    try:
        async with server:
            idle = len(gc.get_objects())
            print(json.dumps({"url": server.url, "frozen": frozen, "idle": idle}), flush=True)
            loop = asyncio.get_running_loop()
            while line := await loop.run_in_executor(None, sys.stdin.readline):
                if line.strip() != "measure":
                    continue
                gc.collect()  # (what the connections' handshakes left: gone before timing)
                tracked = len(gc.get_objects())
                with_freeze = _pauses(REPEATS)
                gc.unfreeze()
                walked_all = _pauses(REPEATS)
                answer = {"tracked": tracked, "frozen": with_freeze, "unfrozen": walked_all}
                print(json.dumps(answer), flush=True)
    finally:
        await store.close()


async def _measure(count: int, root: Path) -> dict[str, float]:
    from bench.bench_push import SECRET
    from bench.bench_server_mem import device_opener, open_many, raise_nofile

    raise_nofile(2 * count + 256)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLEACH_")}
    env["PYTHONPATH"] = str(ROOT)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.bench_gc", "--serve", str(root / f"server-{count}.db"), SECRET,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    try:
        async with asyncio.timeout(TIMEOUT):
            started = json.loads(await proc.stdout.readline())
            async with AsyncExitStack() as stack:
                await open_many(count, device_opener(started["url"], f"gc{count}"), stack)
                proc.stdin.write(b"measure\n")
                await proc.stdin.drain()
                answer = json.loads(await proc.stdout.readline())
            proc.stdin.close()
            await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return {
        "frozen_ms": statistics.median(answer["frozen"]) * 1e3,
        "unfrozen_ms": statistics.median(answer["unfrozen"]) * 1e3,
        "per_connection": (answer["tracked"] - started["idle"]) / count,
        "start_up": started["frozen"],
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
                    "start-up walked too",
                    m["unfrozen_ms"],
                )
            )
            notes.append(
                f"{count} connections: {m['per_connection']:.0f} objects walked per idle "
                f"connection; {m['start_up']:,.0f} objects of start-up set aside"
            )
    notes.append(
        f"each figure the median of {REPEATS} gc.collect() timed in the server process, "
        "start-up set aside first (as pleach-server runs), then with gc.unfreeze(): the same "
        "connections, one moment; nothing else runs in a process while it collects"
    )
    return rows, notes


def run(quick: bool = False) -> list[Row]:
    """Measure, print the table, return the rows."""
    from bench.bench_local import render

    started = time.perf_counter()
    rows, notes = asyncio.run(_run([100] if quick else [100, 1000]))
    print(render("bench_gc: the garbage collector's pause in a server process", rows))
    for note in notes:
        print(f"- {note}")
    print(f"({time.perf_counter() - started:.1f}s, {os.cpu_count()} cpus)")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="100 connections only")
    parser.add_argument("--serve", nargs=2, metavar=("DB", "SECRET"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(_serve(*args.serve))
        return 0
    run(args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
