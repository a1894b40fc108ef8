"""Running schedules: backends as context managers, replay with shrinking, soak."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from shared import idrefs

from .harness import (
    Backend,
    Outcome,
    ProcessBackend,
    postgres_backend,
    run_schedule,
    sqlite_backend,
)
from .schedule import Schedule, generate
from .shrink import shrink

PG_DSN = os.environ.get("PLEACH_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")
BACKENDS = ("sqlite", "postgres", "process")


@contextlib.contextmanager
def _short_id_lists() -> Iterator[None]:
    """Protocol 7's id list references for every session of a few ids (``MIN_IDS`` 2, not 64:
    the simulation's sessions are short), on both sides of every connection: only where the
    server runs in this process, since both sides must keep lists by the same rule."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(idrefs, "MIN_IDS", 2)
        yield


@contextlib.asynccontextmanager
async def backends(name: str, workdir: Path) -> AsyncIterator[Callable[[], Backend]]:
    """A factory of backends for a run of schedules.

    Embedded servers are made per schedule (so schedules may run side by side); PostgreSQL
    gets one fresh schema for the run, dropped after; the server process is one for the run.
    """
    if name == "sqlite":
        with _short_id_lists():
            yield sqlite_backend
    elif name == "postgres":
        import asyncpg  # type: ignore[import-untyped]

        from shared.ids import uuid7

        schema = f"pleach_sim_{uuid7().replace('-', '')}"
        try:
            with _short_id_lists():
                yield lambda: postgres_backend(PG_DSN, schema)
        finally:
            conn = await asyncpg.connect(PG_DSN, timeout=10)
            try:
                await conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
            finally:
                await conn.close()
    elif name == "process":
        workdir.mkdir(parents=True, exist_ok=True)
        proc = ProcessBackend(workdir)
        try:
            yield lambda: proc
        finally:
            await proc.close()
    else:
        raise ValueError(f"unknown backend {name!r}; one of {BACKENDS}")


def schedule_for(seed: int, mix: str = "all") -> Schedule:
    """The schedule a seed means in ``mix`` (the same for every backend)."""
    return generate(seed, mix=mix)


async def run_seeds(
    seeds: list[int],
    backend_name: str,
    workdir: Path,
    *,
    report: Callable[[Outcome], None] | None = None,
    concurrency: int = 1,
    max_failures: int | None = None,
    mix: str = "all",
) -> list[Outcome]:
    """Run the seeds' schedules, ``concurrency`` at a time in this loop (embedded servers
    only; a shared server process runs one schedule at a time). Stops starting new schedules
    once ``max_failures`` have failed."""
    outcomes: list[Outcome] = []
    if backend_name == "process":
        concurrency = 1
    pending = list(seeds)
    async with backends(backend_name, workdir / "backend") as make:

        async def worker() -> None:
            while pending:
                if max_failures is not None and sum(not o.ok for o in outcomes) >= max_failures:
                    return
                seed = pending.pop(0)
                schedule = schedule_for(seed, mix)
                outcome = await run_schedule(schedule, make(), workdir / f"s{seed}")
                outcomes.append(outcome)
                if report is not None:
                    report(outcome)

        async with asyncio.TaskGroup() as group:
            for _ in range(max(1, concurrency)):
                group.create_task(worker())
    outcomes.sort(key=lambda o: o.schedule.seed)
    return outcomes


async def replay(
    seed: int,
    backend_name: str = "sqlite",
    *,
    shrink_budget_s: float = 120.0,
    tries: int = 3,
    attempts: int = 5,
    schedule: Schedule | None = None,
    log: Callable[[str], None] = print,
    mix: str = "all",
) -> tuple[Outcome, Schedule | None]:
    """Run one seed; when it fails, shrink it. Returns the outcome and the shrunk schedule."""
    with tempfile.TemporaryDirectory(prefix="pleach-sim-") as tmp:
        workdir = Path(tmp)
        async with backends(backend_name, workdir / "backend") as make:
            runs = 0

            async def run(s: Schedule) -> Outcome:
                nonlocal runs
                runs += 1
                return await run_schedule(s, make(), workdir / f"r{runs}")

            original = schedule or schedule_for(seed, mix)
            log(original.describe())
            # Real sockets vary the interleaving: a failing seed may need a few runs to fail.
            for attempt in range(1, attempts + 1):
                outcome = await run(original)
                if not outcome.ok:
                    log(f"failed on run {attempt}")
                    break
            if outcome.ok:
                log(f"seed {seed} ({backend_name}): all invariants hold in {attempts} runs")
                return outcome, None
            log(f"seed {seed} ({backend_name}) FAILS:")
            for problem in outcome.problems:
                log(f"  {problem}")
            wanted = outcome.categories()

            async def fails(candidate: Schedule) -> bool:
                for _ in range(tries):
                    if (await run(candidate)).categories() & wanted:
                        return True
                return False

            started = time.monotonic()
            shrunk = await shrink(original, fails, budget_s=shrink_budget_s, log=log)
            again = await run(shrunk)
            log(
                f"shrunk from {len(original.ops)} to {len(shrunk.ops)} ops in "
                f"{time.monotonic() - started:.0f}s ({runs} runs):"
            )
            log(shrunk.describe())
            log("the shrunk schedule " + ("fails with:" if not again.ok else "passed this time"))
            for problem in again.problems:
                log(f"  {problem}")
            return outcome, shrunk


__all__ = ["BACKENDS", "PG_DSN", "backends", "replay", "run_seeds", "schedule_for"]
