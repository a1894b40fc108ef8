"""``python -m bench.bench_instructions [--turns N]``: a turn's work in instructions.

Wall and CPU time on a shared machine move by more than a small change moves them; the
instructions a process executes do not (valgrind's callgrind counts them, whatever else the
machine is doing). This runs ``bench_conversation``'s workload under callgrind twice, for 10
and for 10 + N turns (40 by default), and divides the difference by N: the instructions of
one turn, the start-up and the first turns taken out. Beside it, measured the same way, the
floor of the turn's own work (``bench_conversation.own_rows_run``: the provider's stream of
the same reply consumed by a bare loop, then plain ``sqlite3`` running the statements the
turn's commit ran, captured beforehand from a real run).

Callgrind counts user-space instructions of every thread (the store's SQLite thread too),
not the kernel's: a thread hand-off saved shows in time, hardly here. It runs a process at a
fiftieth of its speed, so this takes a few minutes; it is not part of ``make bench``. Without
valgrind it says so and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.bench_conversation import Statements, own_rows_run, pleach_run
from bench.bench_local import Row, render

FIRST = 10
"""Turns run before those counted (each count is the difference of two runs)."""


def _run_one(kind: str, turns: int, folder: Path) -> None:
    """One measured run, in this process: ``turns`` turns of pleach, or of the floor."""
    if kind == "ours":
        asyncio.run(pleach_run(folder / f"ours-{turns}.db", turns))
        return
    captured: list[Statements] = pickle.loads((folder / "statements.pickle").read_bytes())
    asyncio.run(own_rows_run(folder / f"floor-{turns}.db", captured[:turns]))


def _instructions(kind: str, turns: int, folder: Path) -> int:
    """The instructions callgrind counts for one run of ``kind``."""
    out = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--callgrind-out-file=/dev/null",
            sys.executable,
            "-m",
            "bench.bench_instructions",
            "--run",
            kind,
            str(turns),
            str(folder),
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    found = re.search(r"Collected : (\d+)", out.stderr)
    if found is None:
        raise RuntimeError(f"callgrind printed no count:\n{out.stderr[-2000:]}")
    return int(found.group(1))


def run(turns: int = 40) -> list[Row]:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pleach-bench-instr-") as tmp:
        folder = Path(tmp)
        captured: list[Statements] = []
        asyncio.run(pleach_run(folder / "capture.db", FIRST + turns, captured))
        (folder / "statements.pickle").write_bytes(pickle.dumps(captured))
        per_turn = {}
        for kind in ("ours", "floor"):
            low = _instructions(kind, FIRST, folder)
            high = _instructions(kind, FIRST + turns, folder)
            per_turn[kind] = (high - low) / turns
    rows = [
        Row(
            f"turn, instructions (turns {FIRST + 1}-{FIRST + turns})",
            per_turn["ours"],
            "instr",
            "stream + its rows raw",
            per_turn["floor"],
        )
    ]
    title = "bench_instructions: a turn's instructions (valgrind callgrind)"
    print(render(title, rows))
    print(f"({time.perf_counter() - started:.1f}s, {os.cpu_count()} cpus)")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--turns", type=int, default=40, help="turns counted (default 40)")
    parser.add_argument("--run", nargs=3, metavar=("KIND", "TURNS", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run:
        kind, turns, folder = args.run
        _run_one(kind, int(turns), Path(folder))
        return 0
    if shutil.which("valgrind") is None:
        print("bench_instructions: valgrind is not installed (Debian: apt install valgrind)")
        return 0
    run(args.turns)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
