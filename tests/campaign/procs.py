"""``pleach-server`` processes for the campaign: start, SIGKILL, restart, on either store.

The existing helpers each fit one test (a SQLite file only, a fixed DSN, stderr discarded);
the campaign needs all of: a SQLite file or any PostgreSQL DSN (the outage proxy's), a restart
on the same data, the pid (CPU, RSS), and the server's stderr kept to find tracebacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import asyncpg  # type: ignore[import-untyped]

from pleach_server.auth import issue_token
from pleach_server.store import Tenant
from shared.ids import uuid7

ROOT = Path(__file__).resolve().parents[2]
SECRET = "campaign-secret"
PG_DSN = os.environ.get("PLEACH_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")
START_TIMEOUT = 60.0  # a safety net for a process to say it listens (a loaded machine)
STDERR_KEPT = 400
# The server's log format (pleach_server.cli): "<date> <time> LEVEL logger.name: message".
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ [A-Z]+ ([\w.]+): ")


def token(tenant: Tenant) -> str:
    return issue_token(SECRET.encode(), tenant, None)


def child_env() -> dict[str, str]:
    """The environment of a child process: this checkout importable, no ``PLEACH_*`` leaking
    in, no asyncio debug mode (the children run as in production)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLEACH_")}
    env["PYTHONPATH"] = str(ROOT)
    env.pop("PYTHONASYNCIODEBUG", None)
    return env


class ServerProc:
    """One ``pleach-server`` process on a free loopback port, restartable on the same data.

    ``db`` is a SQLite path or a PostgreSQL DSN (then ``schema`` too). While it is down,
    ``upstream()`` answers port 0 (refused), so a proxy never reaches another listener that
    took the old port.
    """

    def __init__(
        self, db: str, *, schema: str | None = None, extra: Sequence[str] = (), name: str = "srv"
    ) -> None:
        self.db = db
        self.schema = schema
        self.extra = list(extra)
        self.name = name
        self.proc: asyncio.subprocess.Process | None = None
        self.port = 0
        self.starts = 0
        self.stderr: list[str] = []
        # Tracebacks in the log, by the logger whose line they follow ("uncaught" otherwise).
        self.tracebacks_by: Counter[str] = Counter()
        self._drain: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/sync"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def upstream(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port if self.running else 0)

    async def start(self) -> None:
        args = ["--port", "0", "--db", self.db, "--secret", SECRET, "--log-level", "warning"]
        if self.schema is not None:
            args += ["--schema", self.schema]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pleach_server.cli", *args, *self.extra,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=child_env(),
        )  # fmt: skip
        assert proc.stdout is not None
        try:
            async with asyncio.timeout(START_TIMEOUT):
                line = (await proc.stdout.readline()).decode()
                if not line.startswith("pleach-server listening on ws://127.0.0.1:"):
                    raise RuntimeError(f"{self.name} did not start: {line!r}")
        except BaseException:
            if proc.returncode is None:
                proc.kill()
            _, err = await proc.communicate()
            raise RuntimeError(f"{self.name} did not start:\n{err.decode()[-2000:]}") from None
        self.port = int(line.split()[-1].rsplit(":", 1)[1].split("/", 1)[0])
        self.proc = proc
        self.starts += 1
        self._drain = asyncio.create_task(self._read(proc))

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None and proc.stderr is not None

        async def pump(stream: asyncio.StreamReader, keep: bool) -> None:
            previous = ""
            async for raw in stream:
                if not keep:
                    continue
                line = raw.decode(errors="replace")
                if line.startswith("Traceback"):
                    logged = LOG_LINE.match(previous)
                    self.tracebacks_by[logged.group(1) if logged else "uncaught"] += 1
                previous = line
                self.stderr.append(line)
                del self.stderr[:-STDERR_KEPT]

        await asyncio.gather(pump(proc.stdout, False), pump(proc.stderr, True))

    async def _reap(self) -> int:
        proc, drain = self.proc, self._drain
        self._drain = None
        assert proc is not None
        code = await proc.wait()
        if drain is not None:
            await drain
        return code

    async def kill(self) -> int:
        """SIGKILL; returns the exit status (-9)."""
        assert self.proc is not None
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)
        return await self._reap()

    async def restart(self) -> None:
        await self.kill()
        await self.start()

    async def stop(self) -> int | None:
        """SIGTERM and wait (SIGKILL after the safety net); the exit status."""
        if self.proc is None:
            return None
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(START_TIMEOUT):
                    await self.proc.wait()
            except TimeoutError:
                self.proc.kill()
        return await self._reap()

    @property
    def tracebacks(self) -> int:
        """Tracebacks of pleach's own code (logged by ``pleach_server`` or uncaught); those
        a library logs about itself (``asyncpg.pool`` refilling its floor during an outage)
        are in ``tracebacks_by`` but not counted here."""
        return sum(n for k, n in self.tracebacks_by.items() if k.startswith(("pleach", "uncaught")))

    def library_tracebacks(self) -> dict[str, int]:
        return {
            k: n for k, n in self.tracebacks_by.items() if not k.startswith(("pleach", "uncaught"))
        }

    def traceback_text(self) -> str:
        return "".join(self.stderr)[-3000:]


def sqlite_db(workdir: Path) -> str:
    return str(workdir / "server.db")


@contextlib.asynccontextmanager
async def pg_schema(dsn: str = PG_DSN) -> AsyncIterator[str]:
    """A fresh schema name for one run, dropped afterwards (the servers create it)."""
    schema = f"pleach_campaign_{uuid7().replace('-', '')}"
    try:
        yield schema
    finally:
        conn = await asyncpg.connect(dsn, timeout=10)
        try:
            await conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        finally:
            await conn.close()


async def postgres_unreachable(dsn: str = PG_DSN) -> str | None:
    """Why PostgreSQL at ``dsn`` cannot be used, or None when it answers."""
    try:
        conn = await asyncpg.connect(dsn, timeout=5)
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        return f"{type(exc).__name__}: {exc}"
    try:
        await conn.fetchval("SELECT 1")
    finally:
        await conn.close()
    return None


__all__ = [
    "PG_DSN",
    "ROOT",
    "SECRET",
    "ServerProc",
    "child_env",
    "pg_schema",
    "postgres_unreachable",
    "sqlite_db",
    "token",
]
