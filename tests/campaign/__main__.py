"""``python -m tests.campaign``: the hostile-world campaign, rerunnable by anyone.

    python -m tests.campaign kill     [--rounds 200] [--seed 0] [--backend sqlite|postgres|both]
    python -m tests.campaign outage   [--outages 30] [--max-outage 3] [--seed 0]   (PostgreSQL)
    python -m tests.campaign load     [--devices 1000] [--seconds 60] [--interval 10] [--backend ...]
    python -m tests.campaign fairness [--fair-seconds 20] [--flood 50] [--backend ...]
    python -m tests.campaign memory   [--connections 1000] [--backend ...]
    python -m tests.campaign all      (each of the above, on both stores where it applies)

``--json`` prints one JSON object per run on stdout (progress goes to stderr). PostgreSQL is
``PLEACH_TEST_PG_DSN`` (default ``postgresql://postgres@127.0.0.1:5432/test``); when it does not
answer, its runs are skipped with the reason, or fail when ``CI`` is set.

Exit status 1 when a kill or outage run lost or duplicated anything or broke an invariant.
The load figures are printed, never judged.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

from .kill import run_kill
from .load import (
    fairness_summary,
    load_summary,
    memory_summary,
    run_fairness,
    run_load,
    run_memory,
)
from .outage import run_outage
from .procs import PG_DSN, postgres_unreachable

COMMANDS = ("kill", "outage", "load", "fairness", "memory", "all")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.campaign", description=__doc__)
    parser.add_argument("command", choices=COMMANDS)
    parser.add_argument("--backend", choices=("sqlite", "postgres", "both"), default="both")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=200, help="kill rounds per store (200)")
    parser.add_argument("--outages", type=int, default=30, help="database outages (30)")
    parser.add_argument("--max-outage", type=float, default=3.0, help="longest outage, s (3)")
    parser.add_argument("--devices", type=int, default=1000, help="load: connections (1000)")
    parser.add_argument("--seconds", type=float, default=60.0, help="load: measured s (60)")
    parser.add_argument(
        "--interval", type=float, default=10.0, help="load: s between a device's pushes (10)"
    )
    parser.add_argument("--fair-seconds", type=float, default=20.0, help="fairness: s per phase")
    parser.add_argument("--flood", type=int, default=50, help="fairness: flood connections")
    parser.add_argument("--connections", type=int, default=1000, help="memory: connections")
    parser.add_argument("--json", action="store_true", help="JSON objects on stdout")
    args = parser.parse_args(argv)
    # The proxies write to sockets their peers just closed; asyncio says so at WARNING.
    logging.basicConfig(level=logging.CRITICAL)
    return asyncio.run(stoppable(campaign(args)))


async def stoppable(work: Coroutine[Any, Any, int]) -> int:
    """Run ``work``; SIGTERM or SIGINT (even when the shell started us with SIGINT ignored, as
    it does for a background job) cancels it, so every process it started is stopped."""
    loop = asyncio.get_running_loop()
    task = asyncio.create_task(work)
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, task.cancel)
    try:
        return await task
    except asyncio.CancelledError:
        print("stopped: every process this run started has been stopped", file=sys.stderr)
        return 130
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)


async def campaign(args: argparse.Namespace) -> int:
    out = sys.stderr if args.json else sys.stdout

    def log(line: str) -> None:
        print(line, file=out, flush=True)

    stores = ["sqlite", "postgres"] if args.backend == "both" else [args.backend]
    why = (
        await postgres_unreachable(PG_DSN)
        if "postgres" in stores
        or args.command
        in (
            "outage",
            "all",
        )
        else None
    )
    if why is not None:
        message = f"PostgreSQL at {PG_DSN.rpartition('@')[2]} does not answer ({why})"
        if os.environ.get("CI"):
            log(f"CI is set, so PostgreSQL runs may not be skipped: {message}")
            return 1
        log(f"skipping the PostgreSQL runs: {message}")
        stores = [s for s in stores if s != "postgres"]
    failed = False
    cmd = args.command

    async def one(
        name: str, make: Callable[[Path], Awaitable[Any]], summary: Callable[[Any], str]
    ) -> None:
        nonlocal failed
        log(f"{name} ...")
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="pleach-campaign-") as tmp:
            result = await make(Path(tmp))
        if hasattr(result, "ok"):
            failed |= not result.ok or result.verdict.lost > 0 or result.verdict.duplicates > 0
            record = result.as_dict()
        else:
            record = result
        log(summary(result))
        for problem in record.get("problems", [])[:20]:
            log(f"  {problem}")
        log(f"  ({time.monotonic() - started:.0f}s)")
        if args.json:
            print(json.dumps(record), flush=True)

    if cmd in ("kill", "all"):
        for store in stores:
            await one(
                f"kill: {args.rounds} rounds on {store}",
                lambda tmp, store=store: run_kill(args.rounds, args.seed, store, tmp, log=log),
                lambda r: r.summary(),
            )
    if cmd in ("outage", "all") and (why is None):
        await one(
            f"outage: {args.outages} outages",
            lambda tmp: run_outage(
                args.outages, args.seed, tmp, max_outage=args.max_outage, log=log
            ),
            lambda r: r.summary(),
        )
    if cmd in ("load", "all"):
        for store in stores:
            await one(
                f"load: {args.devices} devices on {store}",
                lambda tmp, store=store: run_load(
                    store,
                    tmp,
                    devices=args.devices,
                    seconds=args.seconds,
                    interval=args.interval,
                    log=log,
                ),
                load_summary,
            )
    if cmd in ("fairness", "all"):
        for store in stores:
            await one(
                f"fairness on {store}",
                lambda tmp, store=store: run_fairness(
                    store, tmp, seconds=args.fair_seconds, flood=args.flood, log=log
                ),
                fairness_summary,
            )
    if cmd in ("memory", "all"):
        for store in stores:
            await one(
                f"memory: {args.connections} connections on {store}",
                lambda tmp, store=store: run_memory(
                    store, tmp, connections=args.connections, log=log
                ),
                memory_summary,
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
