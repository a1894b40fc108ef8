"""The seeded simulation's CI slice: many schedules of devices, a server and faults, each
ending in the invariants of ``tests/sim/invariants.py`` ("nothing a user wrote is lost").

Three slices, each running its schedules one after another in one event loop:

- ``SIM_SQLITE`` schedules (default 500) on an embedded server over ``SQLiteServerStore``;
- ``SIM_POSTGRES`` (default 40) on an embedded server over ``PostgresServerStore``;
- ``SIM_PROCESS`` (default 50) through a real ``pleach-server`` subprocess.

Replay one seed (with shrinking) with ``PLEACH_SIM_SEED=1234 pytest tests/test_simulation.py
-k replay`` (``PLEACH_SIM_BACKEND`` picks the backend), or ``python -m tests.sim --seed 1234``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.sim.harness import Outcome
from tests.sim.runner import replay, run_seeds
from tests.test_server_store_postgres import require_postgres

SQLITE_SCHEDULES = int(os.environ.get("SIM_SQLITE", "500"))
POSTGRES_SCHEDULES = int(os.environ.get("SIM_POSTGRES", "40"))
PROCESS_SCHEDULES = int(os.environ.get("SIM_PROCESS", "50"))
# Each slice starts at its own seed, so the three together cover distinct schedules.
SQLITE_FIRST, POSTGRES_FIRST, PROCESS_FIRST = 0, 100_000, 200_000


def _summary(name: str, outcomes: list[Outcome], seconds: float) -> str:
    failed = [o for o in outcomes if not o.ok]
    ops = sum(o.ops_done for o in outcomes)
    lines = [
        f"{name}: {len(outcomes)} schedules, {ops} ops, {len(failed)} failed, {seconds:.1f}s",
    ]
    for o in failed:
        lines.append(f"  seed {o.schedule.seed}: " + " | ".join(o.problems[:3]))
    if failed:
        lines.append(
            f"  replay: PLEACH_SIM_SEED=<seed> PLEACH_SIM_BACKEND={outcomes[0].backend} "
            "pytest tests/test_simulation.py -k replay"
        )
    return "\n".join(lines)


async def _slice(name: str, backend: str, first: int, count: int, tmp: Path) -> None:
    started = time.monotonic()
    outcomes = await run_seeds(list(range(first, first + count)), backend, tmp)
    summary = _summary(name, outcomes, time.monotonic() - started)
    print(summary)
    assert len(outcomes) == count
    assert all(o.ok for o in outcomes), summary


async def test_simulation_sqlite_store(tmp_path: Path) -> None:
    await _slice("sqlite store", "sqlite", SQLITE_FIRST, SQLITE_SCHEDULES, tmp_path)


@pytest.mark.postgres
async def test_simulation_postgres_store(tmp_path: Path) -> None:
    require_postgres()
    await _slice("postgres store", "postgres", POSTGRES_FIRST, POSTGRES_SCHEDULES, tmp_path)


async def test_simulation_server_process(tmp_path: Path) -> None:
    await _slice("server process", "process", PROCESS_FIRST, PROCESS_SCHEDULES, tmp_path)


@pytest.mark.skipif("PLEACH_SIM_SEED" not in os.environ, reason="set PLEACH_SIM_SEED to replay")
async def test_replay_seed() -> None:
    """Replay ``PLEACH_SIM_SEED``; when it fails, shrink it and print the shrunk schedule."""
    seed = int(os.environ["PLEACH_SIM_SEED"])
    backend = os.environ.get("PLEACH_SIM_BACKEND", "sqlite")
    budget = float(os.environ.get("PLEACH_SIM_SHRINK_BUDGET", "120"))
    outcome, shrunk = await replay(seed, backend, shrink_budget_s=budget)
    assert outcome.ok, "\n".join(outcome.problems) + (
        "\n" + shrunk.describe() if shrunk is not None else ""
    )
