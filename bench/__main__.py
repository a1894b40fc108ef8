"""``python -m bench [--quick] [--json [PATH]]``: every benchmark, one table each.

Runs ``bench_local`` (device turns, storage, codec), ``bench_conversation`` (one 1,000-turn
conversation against plain sqlite3), ``bench_sync`` (sync throughput, live fan-out),
``bench_live`` (live latency with 100 devices writing, SQLite and PostgreSQL servers),
``bench_long_session`` (a turn's push and pull on the server as a session grows),
``bench_server_mem`` (server memory per idle connection), ``bench_gc`` (a full garbage
collection's pause in a server process), ``bench_catchup`` (a new device
catching up, resume of a long session), ``bench_codec`` (the storage codec per record) and
``bench_push`` (server push throughput, SQLite vs
PostgreSQL) when it is importable and its PostgreSQL is reachable; otherwise it says why it
skipped. ``--quick`` runs fewer
iterations. ``--json [PATH]`` also writes every figure to PATH (default ``bench/results.json``);
nothing is written without it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import importlib
import io
import json
import os
import platform
import sqlite3
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from bench import (
    bench_catchup,
    bench_codec,
    bench_conversation,
    bench_gc,
    bench_live,
    bench_local,
    bench_long_session,
    bench_server_mem,
    bench_startup,
    bench_sync,
)
from bench.bench_local import Row

DEFAULT_JSON = Path(__file__).resolve().parent / "results.json"
SECTIONS: list[tuple[str, Any]] = [
    ("bench_local", bench_local),
    ("bench_conversation", bench_conversation),
    ("bench_sync", bench_sync),
    ("bench_live", bench_live),
    ("bench_server_mem", bench_server_mem),
    ("bench_gc", bench_gc),
    ("bench_catchup", bench_catchup),
    ("bench_codec", bench_codec),
    ("bench_startup", bench_startup),
    ("bench_long_session", bench_long_session),
]
PUSH_QUICK_ARGS = ["--batches", "20", "--devices", "4"]
PG_CONNECT_TIMEOUT = 3.0


class _Tee(io.TextIOBase):
    """Writes to the real stdout and keeps a copy."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self.copy = io.StringIO()

    def write(self, text: str) -> int:
        self.copy.write(text)
        return self._out.write(text)

    def flush(self) -> None:
        self._out.flush()


async def _pg_reachable(dsn: str) -> str | None:
    """None when PostgreSQL at ``dsn`` accepts a connection, else why not."""
    try:
        import asyncpg  # type: ignore[import-untyped]
    except ImportError as exc:
        return f"asyncpg is not installed ({exc})"
    try:
        conn = await asyncpg.connect(dsn, timeout=PG_CONNECT_TIMEOUT)
    except Exception as exc:  # a probe: whatever the reason, the answer is "not reachable"
        return f"PostgreSQL is not reachable ({type(exc).__name__}: {exc})"
    await conn.close()
    return None


def _run_push(quick: bool) -> dict[str, Any]:
    """Run ``bench.bench_push.main`` if it is there and PostgreSQL answers."""
    try:
        module = importlib.import_module("bench.bench_push")
    except ImportError as exc:
        return {"skipped": f"bench_push is not importable ({exc})"}
    entry: Callable[[list[str]], object] | None = getattr(module, "main", None)
    if not callable(entry):
        return {"skipped": "bench_push has no main() entry point"}
    dsn = str(getattr(module, "DEFAULT_DSN", os.environ.get("PLEACH_TEST_PG_DSN", "")))
    why = asyncio.run(_pg_reachable(dsn)) if dsn else "no PostgreSQL DSN configured"
    if why is not None:
        return {"skipped": why}
    argv = PUSH_QUICK_ARGS if quick else []
    tee = _Tee(sys.stdout)
    started = time.perf_counter()
    try:
        with contextlib.redirect_stdout(tee):
            print("bench_push: server push throughput, SQLite vs PostgreSQL")
            entry(list(argv))
    except SystemExit as exc:  # its argument parser refused our arguments
        if exc.code not in (0, None):
            return {"skipped": f"bench_push exited with {exc.code!r} for arguments {argv}"}
    except Exception as exc:  # one failing must not hide the others: report it, run the rest
        traceback.print_exc()
        return {"failed": f"{type(exc).__name__}: {exc}"}
    return {"argv": argv, "seconds": time.perf_counter() - started, "output": tee.copy.getvalue()}


def _section(run: Callable[[bool], list[Row]], quick: bool) -> dict[str, Any]:
    started = time.perf_counter()
    rows = run(quick)
    return {"seconds": time.perf_counter() - started, "rows": [r.to_json() for r in rows]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    parser.add_argument(
        "--json",
        metavar="PATH",
        type=Path,
        nargs="?",
        const=DEFAULT_JSON,
        help="also write the results as JSON to PATH (default bench/results.json)",
    )
    args = parser.parse_args(argv)

    started = time.perf_counter()
    results: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "quick": args.quick,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "sqlite": sqlite3.sqlite_version,
            "platform": platform.platform(terse=True),
        },
    }
    failed = False
    for name, module in SECTIONS:
        try:
            results[name] = _section(module.run, args.quick)
        except Exception as exc:  # one failing must not hide the others: report it, go on
            traceback.print_exc()
            results[name] = {"failed": f"{type(exc).__name__}: {exc}"}
            failed = True
        print()
    push = _run_push(args.quick)
    if "skipped" in push:
        print(f"bench_push: skipped: {push['skipped']}")
    if "failed" in push:
        print(f"bench_push: failed: {push['failed']}")
    results["bench_push"] = push
    total = time.perf_counter() - started
    results["seconds"] = total
    print(f"\nall benchmarks: {total:.1f}s{' (--quick)' if args.quick else ''}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"results written to {args.json}")
    return 1 if failed or "failed" in push else 0


if __name__ == "__main__":
    sys.exit(main())
