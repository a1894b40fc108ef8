"""``python -m bench.bench_startup``: how long a person waits for ``pleach`` to start.

Wall time of a fresh interpreter (median of 7) for ``pleach --help``, ``pleach status`` on a
small device file and ``import pleach_client`` (with ``SessionRuntime``), beside ``python -c
pass`` measured in the same run: the floor every Python program pays.

Each runs with its modules' bytecode cached, as an installed package runs (pip compiles it
when it installs; Python writes it at the first import otherwise): ``PYTHONDONTWRITEBYTECODE``
is taken out of the commands' environment, and each command runs once before it is timed. A
machine that sets it would otherwise time the compilation of every module at every start
(about 150 ms of the import, measured).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.bench_local import Row, render

_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
"""The commands' environment: bytecode is written, and read, as for an installed package."""


def _wall(args: list[str], reps: int) -> float:
    subprocess.run(args, capture_output=True, check=True, timeout=120, env=_ENV)  # (caches)
    out = []
    for _ in range(reps):
        started = time.perf_counter()
        subprocess.run(args, capture_output=True, check=True, timeout=120, env=_ENV)
        out.append(time.perf_counter() - started)
    return statistics.median(out)


def run(quick: bool = False) -> list[Row]:
    reps = 3 if quick else 7
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="pleach-startup-") as tmp:
        db = str(Path(tmp) / "d.db")
        subprocess.run(
            [py, "-m", "pleach_client.cli", "chat", "--offline", "-m", "hi", "--db", db],
            capture_output=True,
            check=True,
            timeout=120,
            env=_ENV,
        )
        floor = _wall([py, "-c", "pass"], reps)
        rows = [
            Row(label, _wall(args, reps) * 1e3, "ms", "python -c pass", floor * 1e3)
            for label, args in (
                ("pleach --help", [py, "-m", "pleach_client.cli", "--help"]),
                ("pleach status", [py, "-m", "pleach_client.cli", "status", "--db", db]),
                (
                    "import pleach_client (SessionRuntime)",
                    [py, "-c", "from pleach_client import SessionRuntime"],
                ),
            )
        ]
    print(render("bench_startup: a fresh process, wall time (median)", rows))
    print(f"({os.cpu_count()} cpus)")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true")
    run(parser.parse_args(argv).quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
