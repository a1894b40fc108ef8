"""``python -m tests.sim``: replay a seed (shrinking it when it fails), or soak.

    python -m tests.sim --seed 1234 [--backend sqlite|postgres|process] [--shrink-budget 120]
    python -m tests.sim --soak 10000 [--start 0] [--backend sqlite] [--report failures.txt]
    either with [--mix races]: schedules drawn to make conflicts, resolves and deletes meet

A soak prints each failing seed's first problem as it fails, and keeps every problem of each
failing schedule with the schedule itself in a report file (``--report``; by default
``pleach-soak-START-N.txt`` in the working directory, written only when something failed): a
failure that does not come back in a replay can still be read.

Exit status 1 when any schedule failed.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from .harness import Outcome
from .runner import BACKENDS, replay, run_seeds
from .schedule import MIXES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.sim")
    parser.add_argument("--seed", type=int, help="replay this seed (and shrink it if it fails)")
    parser.add_argument("--soak", type=int, metavar="N", help="run N schedules")
    parser.add_argument("--start", type=int, default=0, help="first seed of a soak")
    parser.add_argument("--backend", choices=BACKENDS, default="sqlite")
    parser.add_argument("--shrink-budget", type=float, default=120.0, help="seconds")
    parser.add_argument("--report", type=Path, help="where a soak keeps its failures' problems")
    parser.add_argument(
        "--mix",
        choices=sorted(MIXES),
        default="all",
        help="the op weights schedules are drawn with: all (every op), races (conflicts, "
        "resolves and deletes meeting); a seed means one schedule per mix",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.CRITICAL)
    if args.seed is not None:
        outcome, _ = asyncio.run(
            replay(args.seed, args.backend, shrink_budget_s=args.shrink_budget, mix=args.mix)
        )
        return 0 if outcome.ok else 1
    if args.soak is not None:
        report = args.report or Path(f"pleach-soak-{args.start}-{args.soak}.txt")
        return asyncio.run(soak(args.soak, args.start, args.backend, report, args.mix))
    parser.print_help()
    return 2


def failure_report(outcome: Outcome) -> str:
    """Everything a failing schedule left: its problems, counts and the schedule itself."""
    lines = [
        f"seed {outcome.schedule.seed} ({outcome.backend}) failed: {len(outcome.problems)} "
        f"problem(s), {outcome.ops_done} ops done, {outcome.ops_skipped} skipped, "
        f"{outcome.seconds:.2f}s",
        *(f"  problem: {p}" for p in outcome.problems),
        *(f"  stat {k}: {v}" for k, v in sorted(outcome.stats.items())),
        outcome.schedule.describe(),
    ]
    return "\n".join(lines) + "\n"


async def soak(
    count: int,
    start: int,
    backend_name: str,
    report_path: Path | None = None,
    mix: str = "all",
) -> int:
    failed: list[Outcome] = []
    kept = 0  # schedules in which the server kept a resolved version beside a delete
    pushes: Counter[str] = Counter()  # how the PostgreSQL store's pushes ran
    started = time.monotonic()
    done = 0

    def report(outcome: Outcome) -> None:
        nonlocal done, kept
        done += 1
        kept += bool(outcome.stats.get("kept_beside_delete"))
        pushes.update({k[7:]: v for k, v in outcome.stats.items() if k.startswith("pushes_")})
        if not outcome.ok:
            failed.append(outcome)
            print(f"FAIL seed {outcome.schedule.seed}: {outcome.problems[0]}", flush=True)
            if report_path is not None:
                # This run's failures only: the first one replaces a report left by another run.
                with report_path.open("a" if len(failed) > 1 else "w", encoding="utf-8") as out:
                    out.write(failure_report(outcome))
        if done % 100 == 0:
            rate = done / (time.monotonic() - started)
            print(f"{done}/{count} schedules, {len(failed)} failed, {rate:.1f}/s", flush=True)

    with tempfile.TemporaryDirectory(prefix="pleach-soak-") as tmp:
        await run_seeds(
            list(range(start, start + count)), backend_name, Path(tmp), report=report, mix=mix
        )
    elapsed = time.monotonic() - started
    name = backend_name if mix == "all" else f"{backend_name}, {mix} mix"
    print(
        f"soak ({name}): {done} schedules in {elapsed:.0f}s, {len(failed)} failed; {kept} kept "
        "a resolved version beside a delete"
        + ("; pushes " + ", ".join(f"{k} {v}" for k, v in sorted(pushes.items())) if pushes else "")
        + (f"; failing seeds: {[o.schedule.seed for o in failed]}" if failed else "")
    )
    if failed and report_path is not None:
        print(f"every problem of each failing schedule: {report_path}")
    if failed:
        how = f"--backend {backend_name}" + ("" if mix == "all" else f" --mix {mix}")
        print(f"replay one with: python -m tests.sim --seed SEED {how}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
