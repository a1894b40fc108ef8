"""The simulated world: devices on real SQLite files, a real server, a scripted network.

``run_schedule(schedule, backend, workdir)`` plays one schedule op by op, brings the world to
quiescence (every device online on a clean network, synced until nothing changes) and checks
the invariants (``invariants.check``). Every op runs against the public API of
``SessionRuntime`` and its facets; the server is a real ``SyncServer`` over a real store, or a
real ``pleach-server`` process.

Three backends:

- ``EmbeddedBackend``: a ``SyncServer`` in this event loop over ``SQLiteServerStore`` (a file
  per schedule) or ``PostgresServerStore`` (one schema per run, a tenant per schedule).
  A server restart is ``shutdown()``, store ``close()``, and a new server on the same store.
- ``ProcessBackend``: one ``pleach-server`` subprocess per run over a SQLite file, a tenant per
  schedule; a server restart kills it (SIGKILL) and starts another on the same file.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pleach_client.hydration import hydrate
from pleach_client.providers.scripted import ScriptedProvider, ScriptedReply, echo_reply
from pleach_client.runtime import SessionRuntime
from pleach_client.store.sqlite import SQLiteAdapter
from pleach_server.auth import issue_token
from pleach_server.server import SyncServer
from pleach_server.store import ServerStore, SQLiteServerStore, Tenant
from shared.errors import NotFound
from shared.ids import uuid7
from shared.records import Event
from tests.factories import small_id_blocks
from tests.server_store_conformance import SMALL_BLOCKS

from .invariants import Ledger, check, postgres_layout_problems, server_file_problems
from .network import Proxy
from .schedule import TURN_OPS, Op, Schedule

SECRET = "simulation-secret"
ROOT = Path(__file__).resolve().parents[2]
OP_TIMEOUT = 30.0  # a safety net per op, never a wait
SYNC_OP_TIMEOUT = 1.0  # the ``sync`` op lets sync run this long at most
QUIESCE_TIMEOUT = 10.0  # per device per round
QUIESCE_ROUNDS = 12
STALE_TIMEOUT = 3.0  # a device behind the server with nothing arriving for this long is stuck
PROSE = (
    "The device kept every word while it was offline, and now each one goes to the server and "
    "on to the other devices of the account, as it was written, whatever protocol they speak."
)
"""A long user text (over ``shared.compact.DEFLATE_MIN``) that deflates to about half."""


# -- servers ---------------------------------------------------------------------------------


class Backend:
    """Where the server runs. ``upstream()`` is its current address."""

    name = "backend"

    def upstream(self) -> tuple[str, int]:
        raise NotImplementedError

    def token(self, tenant: Tenant) -> str:
        return issue_token(SECRET.encode(), tenant, None)

    async def begin(self, workdir: Path) -> None:
        """Before a schedule: make sure a server is up for it."""

    async def end(self) -> None:
        """After a schedule."""

    async def restart(self) -> None:
        raise NotImplementedError

    async def feed(self, tenant: Tenant) -> list[Any]:
        """Every change of the tenant's feed, from cursor 0."""
        raise NotImplementedError

    async def head(self, tenant: Tenant) -> int:
        """The tenant's head cursor (the cursor of its latest feed entry)."""
        feed = await self.feed(tenant)
        return feed[-1].cursor if feed else 0

    async def close(self) -> None:
        """After the run."""

    def pushes(self) -> Counter[str]:
        """How its store's pushes ran so far (``PostgresServerStore.pushes``; empty for a
        store that does not count them)."""
        return Counter()


class EmbeddedBackend(Backend):
    """A ``SyncServer`` in this loop; ``make_store(workdir)`` builds an unopened store."""

    def __init__(self, name: str, make_store: Callable[[Path], ServerStore]) -> None:
        self.name = name
        self._make_store = make_store
        self._workdir: Path | None = None
        self.store: ServerStore | None = None
        self.server: SyncServer | None = None
        self.restarts = 0
        self._pushes_before: Counter[str] = Counter()
        """The counts of the stores closed so far (``pushes``)."""
        self.small_id_blocks = False
        """Whether the next schedule's store keeps its sessions' ids in small blocks (set
        before ``begin``, from ``Schedule.server_id_blocks``; restarts keep it)."""

    def upstream(self) -> tuple[str, int]:
        # While restarting there is no server: port 0 refuses, so the device retries later and
        # never reaches another server that took over the old port.
        return ("127.0.0.1", self.server.port if self.server is not None else 0)

    async def _start(self) -> None:
        assert self._workdir is not None
        store = self._make_store(self._workdir)
        if self.small_id_blocks:
            store._id_layout = SMALL_BLOCKS  # type: ignore[attr-defined]
        await store.open()
        server = SyncServer(store, port=0, secret=SECRET.encode())
        try:
            await server.start()
        except BaseException:
            await store.close()
            raise
        self.store, self.server = store, server

    async def _stop(self) -> None:
        server, store = self.server, self.store
        self.server = self.store = None
        if server is not None:
            await server.shutdown()
        if store is not None:
            self._pushes_before.update(getattr(store, "pushes", {}))
            await store.close()

    def pushes(self) -> Counter[str]:
        return self._pushes_before + Counter(getattr(self.store, "pushes", {}))

    async def begin(self, workdir: Path) -> None:
        self._workdir = workdir
        await self._start()

    async def end(self) -> None:
        await self._stop()
        self.server = self.store = None

    async def restart(self) -> None:
        self.restarts += 1
        await self._stop()
        await self._start()

    async def head(self, tenant: Tenant) -> int:
        assert self.store is not None
        return await self.store.head_cursor(tenant)

    async def feed(self, tenant: Tenant) -> list[Any]:
        assert self.store is not None
        out: list[Any] = []
        cursor = 0
        while True:
            page = await self.store.pull(tenant, cursor, 1000)
            out.extend(page.changes)
            cursor = page.to_cursor
            if not page.more:
                return out


class ProcessBackend(Backend):
    """One ``pleach-server`` subprocess (SQLite file), shared by the schedules of a run."""

    name = "process"

    def __init__(self, workdir: Path) -> None:
        self.db = workdir / "server.db"
        self.proc: asyncio.subprocess.Process | None = None
        self.port = 0
        self.restarts = 0
        self._stderr: list[str] = []
        self._drain: asyncio.Task[None] | None = None

    def upstream(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    async def _start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PLEACH_")}
        env["PYTHONPATH"] = str(ROOT)
        env.pop("PYTHONASYNCIODEBUG", None)  # the server runs as in production
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pleach_server.cli", "--port", "0", "--db", str(self.db),
            "--secret", SECRET, "--log-level", "warning",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
        )  # fmt: skip
        assert proc.stdout is not None and proc.stderr is not None
        try:
            async with asyncio.timeout(30):
                line = (await proc.stdout.readline()).decode()
                if not line.startswith("pleach-server listening on ws://127.0.0.1:"):
                    raise RuntimeError(f"pleach-server did not start: {line!r}")
        except BaseException:
            proc.kill()
            _, err = await proc.communicate()
            self._stderr.append(err.decode())
            raise
        self.port = int(line.split()[-1].rsplit(":", 1)[1].split("/", 1)[0])
        self.proc = proc
        self._drain = asyncio.create_task(self._read(proc))

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None and proc.stderr is not None

        async def pump(stream: asyncio.StreamReader) -> None:
            async for line in stream:
                self._stderr.append(line.decode())
                del self._stderr[:-200]

        await asyncio.gather(pump(proc.stdout), pump(proc.stderr))

    async def _kill(self) -> None:
        proc, drain = self.proc, self._drain
        self.proc = self._drain = None
        self.port = 0  # refused until the next start: never another listener on the old port
        if proc is not None:
            if proc.returncode is None:
                proc.send_signal(signal.SIGKILL)
            await proc.wait()
        if drain is not None:
            await drain

    async def begin(self, workdir: Path) -> None:
        self.db.parent.mkdir(parents=True, exist_ok=True)
        if self.proc is None or self.proc.returncode is not None:
            await self._kill()
            await self._start()

    async def restart(self) -> None:
        self.restarts += 1
        await self._kill()
        await self._start()

    async def feed(self, tenant: Tenant) -> list[Any]:
        from websockets.asyncio.client import connect

        from tests.wsclient import Client

        async with connect(
            f"ws://127.0.0.1:{self.port}/sync",
            additional_headers={"Authorization": f"Bearer {self.token(tenant)}"},
            proxy=None,
            open_timeout=20,
            close_timeout=2,
        ) as ws:
            client = Client(ws)
            await client.hello(f"observer-{uuid7()}")
            return await client.pull_all()

    async def close(self) -> None:
        proc = self.proc
        if proc is not None and proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(20):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
        await self._kill()


def sqlite_backend() -> EmbeddedBackend:
    # synchronous=NORMAL: the simulation restarts the server process-internally, never the OS.
    return EmbeddedBackend(
        "sqlite", lambda workdir: SQLiteServerStore(workdir / "server.db", synchronous="NORMAL")
    )


def postgres_backend(dsn: str, schema: str) -> EmbeddedBackend:
    from pleach_server.store.postgres import PostgresServerStore

    return EmbeddedBackend(
        "postgres", lambda _: PostgresServerStore(dsn, schema=schema, pool_min=1, pool_max=4)
    )


# -- devices ---------------------------------------------------------------------------------


def copy_db(src: Path, dst: Path) -> None:
    """Copy a closed SQLite database with its WAL files; stale ones at ``dst`` go first."""
    for suffix in ("", "-wal", "-shm"):
        Path(f"{dst}{suffix}").unlink(missing_ok=True)
    for suffix in ("", "-wal", "-shm"):
        if Path(f"{src}{suffix}").exists():
            shutil.copyfile(f"{src}{suffix}", f"{dst}{suffix}")


class Device:
    """One device: a ``SessionRuntime`` on its own SQLite file, behind its own proxy."""

    def __init__(self, world: World, index: int, skew_ms: int, batch: int | None = None) -> None:
        self.world = world
        self.batch = batch
        self.index = index
        self.name = f"dev{index}"
        self.first_client_id = f"{world.tenant.user_id}-{self.name}"
        self.path = world.workdir / f"{self.name}.db"
        self.backup_path = world.workdir / f"{self.name}.backup.db"
        self.has_backup = False
        self.skew_ms = skew_ms
        self.proxy = Proxy(self.name, world.backend.upstream)
        self.rt: SessionRuntime | None = None
        self.online = False
        self.replies: deque[ScriptedReply] = deque()
        self.conflicts: list[tuple[str, str]] = []  # (session id, conflict id) seen here
        self.applied = asyncio.Event()  # set whenever remote changes are applied here
        self.id_lists_disagreed = False  # a runtime of it fell back from protocol 7

    def note_id_lists(self) -> None:
        """Remember whether the runtime open now saw its id lists disagree with the server's
        (protocol 7): its safety net would hide it from every other check."""
        facet = self.rt._sync if self.rt is not None else None
        if facet is not None and facet._id_refs_failed:
            self.id_lists_disagreed = True

    def wall(self) -> int:
        return int(time.time() * 1000) + self.skew_ms

    def _reply(self, request: Any) -> ScriptedReply:
        if self.replies:
            return self.replies.popleft()
        return echo_reply(request)

    def _on_conflict(self, event: Any) -> None:
        key = (event.session_id, event.conflict_id)
        if key not in self.conflicts:
            self.conflicts.append(key)

    async def open(self) -> SessionRuntime:
        world = self.world
        store = SQLiteAdapter(self.path)
        if world.schedule.small_id_blocks:
            small_id_blocks(store)
        rt = SessionRuntime(
            store,
            ScriptedProvider(default_reply=self._reply),
            user_id=world.tenant.user_id,
            org_id=world.tenant.org_id,
            client_id=self.first_client_id,
            wall_clock=self.wall,  # the device's skewed clock (``skew`` ops move it)
        )
        await rt.open()
        sync = rt.sync
        for attr, value in (("backoff_initial", 0.01), ("backoff_max", 0.1)):
            if hasattr(sync, attr):
                setattr(sync, attr, value)
        if self.batch is not None:
            sync.batch_size = self.batch
        if world.schedule.folds_after_pulls:
            sync.fold_after_pull_events = 1
        pinned = world.schedule.protocol_of(self.index)
        if pinned is not None:
            sync.max_protocol = pinned
        rt.events.on("sync.conflict", self._on_conflict)
        rt.events.on("sync.applied", lambda _: self.applied.set())
        self.rt = rt
        if self.online:
            await self.connect()
        return rt

    async def connect(self) -> None:
        assert self.rt is not None
        await self.rt.sync.connect(self.proxy.url, self.world.backend.token(self.world.tenant))
        self.online = True

    async def disconnect(self) -> None:
        assert self.rt is not None
        await self.rt.sync.disconnect()
        self.online = False

    async def close(self) -> None:
        self.note_id_lists()
        rt, self.rt = self.rt, None
        if rt is not None:
            await rt.close()


# -- the world -------------------------------------------------------------------------------


@dataclass
class Outcome:
    schedule: Schedule
    backend: str
    problems: list[str] = field(default_factory=list)
    ops_done: int = 0
    ops_skipped: int = 0
    seconds: float = 0.0
    stats: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def categories(self) -> set[str]:
        return {p.split(":", 1)[0] for p in self.problems}


class Skip(Exception):
    """The op has no target on this device now (no session, no checkpoint...)."""


class World:
    def __init__(self, schedule: Schedule, backend: Backend, workdir: Path) -> None:
        self.schedule = schedule
        self.backend = backend
        self.workdir = workdir
        self.tenant = Tenant(org_id="sim", user_id=f"u{schedule.seed}-{uuid7()[-12:]}")
        self.devices = [
            Device(self, i, s, schedule.batch_of(i)) for i, s in enumerate(schedule.skews_ms)
        ]
        self.ledger = Ledger()
        self.artifacts: list[str] = []
        self.stats: dict[str, int] = {}
        self.kept = 0  # sync.delete.kept events in the server's feed at the end

    def _count(self, key: str) -> None:
        self.stats[key] = self.stats.get(key, 0) + 1

    # -- targets -----------------------------------------------------------------------------
    async def _session(self, dev: Device, pick: int) -> str:
        """A live session of this device: ``pick`` into its ids in order (uuid7: by age)."""
        assert dev.rt is not None
        live = sorted(s.id for s in await dev.rt.sessions.list())
        if not live:
            raise Skip("no session on this device")
        return live[pick % len(live)]

    # -- ops ---------------------------------------------------------------------------------
    async def run_op(self, index: int, op: Op) -> None:
        dev = self.devices[op.dev]
        rt = dev.rt
        assert rt is not None
        kind = op.kind
        if kind == "create":
            await rt.sessions.create(title=f"s{index}")
        elif kind in TURN_OPS:
            await self._turn(index, op, dev, await self._session(dev, op.pick))
        elif kind == "rename":
            sid = await self._session(dev, op.pick)
            await rt.sessions.rename(sid, f"t{index}")
        elif kind == "rollback":
            sid = await self._session(dev, op.pick)
            checkpoints = await rt.checkpoints.list(sid)
            if not checkpoints:
                raise Skip("no checkpoint")
            target = checkpoints[(op.pick // 7) % len(checkpoints)]
            self.ledger.destructive(index, "rollback", sid)
            await rt.checkpoints.rollback(sid, target.id)
        elif kind == "fork":
            sid = await self._session(dev, op.pick)
            checkpoint_id = None
            if op.arg:
                checkpoints = await rt.checkpoints.list(sid)
                if checkpoints:
                    checkpoint_id = checkpoints[(op.pick // 7) % len(checkpoints)].id
            receipt = await rt.checkpoints.fork(sid, checkpoint_id)
        elif kind == "delete":
            sid = await self._session(dev, op.pick)
            self.ledger.destructive(index, "delete", sid)
            await rt.sessions.delete(sid)
        elif kind == "resolve":
            if not dev.conflicts:
                raise Skip("no conflict seen on this device")
            sid, conflict_id = dev.conflicts[op.pick % len(dev.conflicts)]
            side = "local" if op.arg == 0 else "remote"
            await rt.sync.resolve_conflict(sid, conflict_id, side)
        elif kind == "artifact_create":
            sid = await self._session(dev, op.pick)
            token = f"a{index}"
            receipt = await rt.artifacts.create(sid, token)
            self.artifacts.append(receipt.artifact_id)
            self.ledger.artifact_tokens[receipt.artifact_id] = [token]
            self.ledger.artifact_sessions[receipt.artifact_id] = sid
        elif kind == "artifact_edit":
            if not self.artifacts:
                raise Skip("no artifact")
            artifact_id = self.artifacts[op.pick % len(self.artifacts)]
            token = f" e{index}"
            await rt.artifacts.append(artifact_id, token)  # NotFound: not here yet
            self.ledger.artifact_tokens[artifact_id].append(token.strip())
        elif kind == "resume":
            # A resume folds the log on from the fold an earlier one kept (or whole): it is
            # the whole log's fold, unless a page changed the log meanwhile.
            sid = await self._session(dev, op.pick)
            before = await rt.store.hydration_key(sid)
            handle = await rt.sessions.resume(sid)
            events = await rt.store.list_events(sid)
            if await rt.store.hydration_key(sid) == before and handle.hydrated != hydrate(events):
                raise AssertionError(f"hydration-differs: session {sid} resumed otherwise")
        elif kind == "offline":
            await dev.disconnect()
        elif kind == "online":
            await dev.connect()
        elif kind == "sync":
            if not dev.online or dev.proxy.faulty:
                raise Skip("offline or on a faulty network")
            await rt.sync.wait_until_synced(timeout=SYNC_OP_TIMEOUT)
        elif kind == "net_cut":
            dev.proxy.cut()
        elif kind == "net_hold_live":
            dev.proxy.hold_live = True
        elif kind == "net_delay":
            dev.proxy.delay = True
        elif kind == "net_release":
            dev.proxy.heal()
        elif kind == "net_drop_ack":
            dev.proxy.drop_next_ack = True
        elif kind == "net_ack_error":
            dev.proxy.error_next_ack = True
        elif kind == "net_partition":
            dev.proxy.partitioned = True
            dev.proxy.cut()
        elif kind == "crash":
            # The network goes first, then the runtime, wherever its sync loop is.
            dev.proxy.cut()
            await dev.close()
            await dev.open()
        elif kind == "restart":
            await dev.close()
            await dev.open()
        elif kind == "server_restart":
            # Connections drop as the server goes, as they would on a real restart (and no
            # connection is left half-way through its handshake with a server being stopped).
            for other in self.devices:
                other.proxy.cut()
            await self.backend.restart()
        elif kind == "skew":
            dev.skew_ms = op.arg
        elif kind == "backup":
            # A copy of the file as it is now, taken with the runtime closed (as a backup
            # tool or a copy to a new machine would).
            await dev.close()
            copy_db(dev.path, dev.backup_path)
            dev.has_backup = True
            await dev.open()
        elif kind == "restore":
            # The disk is replaced by the backup. What the device wrote since and never
            # synced is gone with the disk (that is not a sync loss), so the op first lets
            # the device sync; the restored file then writes on under the old identity.
            if not dev.has_backup:
                raise Skip("no backup of this device")
            await self._drained(dev)
            dev.proxy.cut()
            await dev.close()
            copy_db(dev.backup_path, dev.path)
            await dev.open()
            self._count("restored")
        elif kind == "clone":
            # Another device's file is copied over this one's (after this one synced): two
            # devices now write under one identity.
            source = self.devices[op.pick % len(self.devices)]
            if source is dev or source.rt is None:
                raise Skip("no other device to copy")
            await self._drained(dev)
            dev.proxy.cut()
            await dev.close()
            await source.close()
            copy_db(source.path, dev.path)
            await source.open()
            await dev.open()
            self._count("cloned")
        else:
            raise ValueError(f"unknown op {kind}")

    async def _drained(self, dev: Device) -> None:
        """Wait until everything this device wrote is on the server, or skip the op."""
        if dev.rt is None or not dev.online or dev.proxy.faulty:
            raise Skip("offline or on a faulty network: cannot drain")
        if not await dev.rt.sync.wait_until_synced(timeout=SYNC_OP_TIMEOUT):
            raise Skip("did not drain in time")

    async def _turn(self, index: int, op: Op, dev: Device, sid: str) -> None:
        rt = dev.rt
        assert rt is not None
        dev.replies.clear()
        abort: asyncio.Event | None = None
        abort_on = ""
        if op.kind == "turn_tool":
            dev.replies.extend(
                [
                    ScriptedReply(
                        text="Let me compute.", tool_calls=[("calculator", {"expression": "6*7"})]
                    ),
                    ScriptedReply(text="It is 42."),
                ]
            )
        elif op.kind == "turn_abort":
            abort = asyncio.Event()
            if op.arg:
                abort_on = "tool.started"
                dev.replies.append(
                    ScriptedReply(
                        text="About to.", tool_calls=[("calculator", {"expression": "1+1"})]
                    )
                )
            else:
                abort_on = "message.delta"
                dev.replies.append(ScriptedReply(text="a long answer that is cut off midway"))
        elif op.kind == "turn_fail":
            if op.arg:
                dev.replies.append(
                    ScriptedReply(
                        text="partial words then", error="api_error", error_after_chunks=2
                    )
                )
            else:
                dev.replies.append(ScriptedReply(error="overloaded_error"))
        # Every third turn's text is long prose, which a body holds deflated (protocol 9) and
        # a device before 9 gets written out: the invariants read every text back as written.
        text = f"u{index}" if index % 3 else f"u{index} {PROSE}"
        user_ids: list[str] = []
        async with aclosing(rt.execute_message(sid, text, abort=abort)) as events:
            async for event in events:
                if event.type == "message.added" and getattr(event, "role", "") == "user":
                    user_ids.append(event.message_id)  # type: ignore[attr-defined]
                if abort is not None and event.type == abort_on:
                    abort.set()
        dev.replies.clear()
        for message_id in user_ids:
            self.ledger.wrote(index, message_id, sid, text)

    # -- phases ------------------------------------------------------------------------------
    async def start(self) -> None:
        if isinstance(self.backend, EmbeddedBackend):
            self.backend.small_id_blocks = self.schedule.server_id_blocks
        await self.backend.begin(self.workdir)

        async def up(dev: Device) -> None:
            await dev.proxy.start()
            await dev.open()
            await dev.connect()

        await asyncio.gather(*(up(dev) for dev in self.devices))

    async def play(self, outcome: Outcome) -> None:
        for index, op in enumerate(self.schedule.ops):
            try:
                async with asyncio.timeout(OP_TIMEOUT):
                    await self.run_op(index, op)
            except (Skip, NotFound):
                outcome.ops_skipped += 1
                continue
            except TimeoutError:
                outcome.problems.append(f"op-timeout: op {index} {op} took over {OP_TIMEOUT}s")
                return
            except Exception as exc:
                outcome.problems.append(f"op-error: op {index} {op}: {type(exc).__name__}: {exc}")
                return
            outcome.ops_done += 1
            self._count(op.kind)

    async def quiesce(self, outcome: Outcome) -> bool:
        """Heal the network, bring every device online, sync until nothing changes."""
        for dev in self.devices:
            dev.proxy.heal()
            if dev.rt is None:
                await dev.open()
            if not dev.online:
                await dev.connect()
        previous: Any = None
        for _ in range(QUIESCE_ROUNDS):
            for dev in self.devices:
                dev.applied.clear()
            stuck = []
            for dev in self.devices:
                assert dev.rt is not None
                if not await dev.rt.sync.wait_until_synced(timeout=QUIESCE_TIMEOUT):
                    stuck.append(f"{dev.name}: {await dev.rt.sync.status()}")
            if stuck:
                outcome.problems.append("no-quiescence: " + "; ".join(stuck))
                return False
            head = await self.backend.head(self.tenant)
            now = []
            for dev in self.devices:
                assert dev.rt is not None
                status = await dev.rt.sync.status()
                now.append((status.cursor, status.pending))
                if status.cursor >= head:
                    continue
                # Synced by its own account but behind the server: a live page may still be
                # on its way. Wait for something to be applied (bounded), then go round again.
                try:
                    async with asyncio.timeout(STALE_TIMEOUT):
                        await dev.applied.wait()
                except TimeoutError:
                    outcome.problems.append(
                        f"stale-device: {dev.name} reports synced at cursor {status.cursor} "
                        f"while the server's head is {head}, and nothing arrived in "
                        f"{STALE_TIMEOUT}s ({status})"
                    )
                    return False
            if now == previous and all(cursor >= head for cursor, _ in now):
                return True
            previous = now
        outcome.problems.append(f"no-quiescence: still changing after {QUIESCE_ROUNDS} rounds")
        return False

    async def close(self) -> None:
        async def down(dev: Device) -> None:
            with contextlib.suppress(Exception):
                await dev.close()
            await dev.proxy.close()

        await asyncio.gather(*(down(dev) for dev in self.devices))
        await self.backend.end()


async def layout_problems(backend: Backend, workdir: Path) -> list[str]:
    """What the server's store breaks of its own layout (``invariants.server_file_problems``,
    ``invariants.postgres_layout_problems``), read while it is still open."""
    if (workdir / "server.db").exists():
        return server_file_problems(workdir / "server.db")
    store = getattr(backend, "store", None)
    if store is not None and type(store).__name__ == "PostgresServerStore":
        return await postgres_layout_problems(store)
    return []


async def run_schedule(schedule: Schedule, backend: Backend, workdir: Path) -> Outcome:
    """Play ``schedule`` and check the invariants; the outcome lists every violation."""
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    outcome = Outcome(schedule=schedule, backend=backend.name)
    world = World(schedule, backend, workdir)
    pushes = backend.pushes()
    try:
        await world.start()
        await world.play(outcome)
        if not outcome.problems and await world.quiesce(outcome):
            feed = await backend.feed(world.tenant)
            world.kept = sum(
                1
                for change in feed
                if isinstance(change.record, Event) and change.record.type == "sync.delete.kept"
            )
            outcome.problems.extend(await check(world, feed))
            outcome.problems.extend(await layout_problems(backend, workdir))
    finally:
        await world.close()
        shutil.rmtree(workdir, ignore_errors=True)
    outcome.stats = dict(world.stats)
    for way, count in (backend.pushes() - pushes).items():
        outcome.stats[f"pushes_{way}"] = count  # (how the PostgreSQL store's pushes ran)
    if world.kept:
        outcome.stats["kept_beside_delete"] = world.kept
    outcome.seconds = time.monotonic() - started
    return outcome


async def run_many(
    schedules: list[Schedule],
    backend: Backend,
    workdir: Path,
    *,
    on_outcome: Callable[[Outcome], Awaitable[None] | None] | None = None,
) -> list[Outcome]:
    """Run schedules one after another in this loop; returns every outcome."""
    outcomes = []
    for schedule in schedules:
        outcome = await run_schedule(schedule, backend, workdir / f"s{schedule.seed}")
        outcomes.append(outcome)
        if on_outcome is not None:
            result = on_outcome(outcome)
            if result is not None:
                await result
    return outcomes


__all__ = [
    "Backend",
    "EmbeddedBackend",
    "Outcome",
    "ProcessBackend",
    "World",
    "postgres_backend",
    "run_many",
    "run_schedule",
    "sqlite_backend",
]
