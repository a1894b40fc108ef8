"""Device processes of several users, and the final verdict on what they wrote.

``DeviceProc`` drives one ``tests/campaign/device.py`` process: start (a new life after each
death), wait for its kill-point markers, arm a self-kill, SIGKILL it, stop it. Every
``committed`` line it prints goes into its user's ``Ledger`` (the simulation's).

``Fleet.verify()`` runs once every device process has stopped: it opens each device file in
this process, syncs every device until nothing moves, then checks

- the simulation's invariants (``tests/sim/invariants.check``): every device and the server
  hold the same sessions, transcripts, checkpoints, event logs and audit rows, every event
  and audit chain verifies, nothing pending or dead-lettered, no unannounced conflict;
- **lost**: each committed user message (every ``committed`` line) is in a live session of
  every device of its user and of the server;
- **duplicates**: no user text appears twice in one transcript, or in two live sessions that
  are not of one family (a fork, which copies what it shares with its origin).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from websockets.asyncio.client import connect

from pleach_client.providers.scripted import ScriptedProvider
from pleach_client.runtime import SessionRuntime
from pleach_client.store.sqlite import SQLiteAdapter
from pleach_server.store import Tenant
from shared.ids import uuid7
from tests.sim.invariants import Ledger, View, check, device_view, families, server_view
from tests.wsclient import Client

from .procs import child_env, token

READY_TIMEOUT = 60.0  # safety net: a device process says ``ready`` (a loaded machine)
STOP_TIMEOUT = 60.0
SYNC_TIMEOUT = 60.0
SYNC_PASSES = 8
STDERR_KEPT = 200
TRACEBACKS_KEPT = 3


class DeviceProc:
    """One device process across its lives (each restart is a new life, same file)."""

    def __init__(
        self,
        name: str,
        db: Path,
        user: User,
        url: Callable[[], str],
        *,
        seed: int,
        pace: str = "0.05,0.2",
        backoff: str = "0.05,0.5",
    ) -> None:
        self.name = name
        self.db = db
        self.user = user
        self.url = url
        self.seed = seed
        self.pace = pace
        self.backoff = backoff
        self.life = -1
        self.proc: asyncio.subprocess.Process | None = None
        self.client_id = ""
        self.client_ids: list[str] = []  # every id it wrote under (more than one: a re-key)
        self.counts: Counter[str] = Counter()
        self.kills = 0
        self.stderr: list[str] = []
        self.tracebacks = 0
        self.traceback_texts: list[str] = []  # the first few, whole
        self._changed = asyncio.Condition()
        self._drain: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self) -> None:
        """A new life: spawn the process and wait until it says ``ready``."""
        self.life += 1
        ready = self.counts["ready"]
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.campaign.device",
            "--db", str(self.db), "--url", self.url(), "--token", self.user.token,
            "--org", self.user.tenant.org_id, "--user", self.user.tenant.user_id,
            "--name", self.name, "--life", str(self.life), "--seed", str(self.seed),
            "--pace", self.pace, "--backoff", self.backoff,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=child_env(),
        )  # fmt: skip
        self._drain = asyncio.create_task(self._read(self.proc))
        if not await self.until(lambda: self.counts["ready"] > ready, READY_TIMEOUT):
            raise RuntimeError(f"{self.name} did not start:\n{''.join(self.stderr)[-2000:]}")

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None and proc.stderr is not None

        async def out(stream: asyncio.StreamReader) -> None:
            async for raw in stream:
                words = raw.decode().split()
                if not words:
                    continue
                head = words[0]
                if head == "committed":
                    text, message_id, session_id = words[1:4]
                    self.user.ledger.wrote(
                        len(self.user.ledger.written), message_id, session_id, text
                    )
                elif head in ("ready", "rekeyed"):
                    self.client_id = words[1]
                    if words[1] not in self.client_ids:
                        self.client_ids.append(words[1])
                async with self._changed:
                    self.counts[head] += 1
                    self._changed.notify_all()

        async def err(stream: asyncio.StreamReader) -> None:
            block: list[str] | None = None
            async for raw in stream:
                line = raw.decode(errors="replace")
                if line.startswith("Traceback"):
                    self.tracebacks += 1
                    block = []
                if block is not None:
                    block.append(line)
                    # A traceback ends at its first unindented line after the header.
                    if len(block) > 1 and not line.startswith((" ", "\t")):
                        if len(self.traceback_texts) < TRACEBACKS_KEPT:
                            self.traceback_texts.append("".join(block[-60:]))
                        block = None
                self.stderr.append(line)
                del self.stderr[:-STDERR_KEPT]

        try:
            await asyncio.gather(out(proc.stdout), err(proc.stderr))
        finally:
            async with self._changed:
                self._changed.notify_all()  # whoever waits learns the process is gone

    async def until(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait for ``predicate`` (checked at every line the process prints); False when the
        process ended or ``timeout`` (a safety net) passed first."""
        try:
            async with asyncio.timeout(timeout), self._changed:
                await self._changed.wait_for(lambda: predicate() or not self.running)
        except TimeoutError:
            return False
        return predicate()

    async def marker(self, point: str, timeout: float) -> bool:
        """Wait until the process next passes ``point`` (it printed ``@point``)."""
        seen = self.counts[f"@{point}"]
        return await self.until(lambda: self.counts[f"@{point}"] > seen, timeout)

    async def send(self, line: str) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        with contextlib.suppress(ConnectionError):
            await self.proc.stdin.drain()

    async def arm(self, point: str, stage: str, countdown: int, delay_ms: float) -> None:
        await self.send(f"arm {point} {stage} {countdown} {delay_ms:.3f}")

    async def wait_exit(self) -> int:
        assert self.proc is not None
        code = await self.proc.wait()
        if self._drain is not None:
            await self._drain
            self._drain = None
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        if code == -9:
            self.kills += 1
        return code

    async def kill(self) -> int:
        assert self.proc is not None
        if self.proc.returncode is None:
            self.proc.kill()
        return await self.wait_exit()

    async def stop(self) -> int:
        """``stop``, then wait for the exit (0); a process already dead is left as it is."""
        if self.proc is None:
            return 0
        if self.proc.returncode is None:
            await self.send("stop")
            try:
                async with asyncio.timeout(STOP_TIMEOUT):
                    return await self.wait_exit()
            except TimeoutError:
                self.proc.kill()
        return await self.wait_exit()


@dataclass
class User:
    tenant: Tenant
    token: str
    ledger: Ledger = field(default_factory=Ledger)
    devices: list[DeviceProc] = field(default_factory=list)


@dataclass
class _Device:
    """What ``tests/sim/invariants.check`` reads of a device: its name and runtime."""

    name: str
    rt: SessionRuntime


@dataclass
class _World:
    devices: list[_Device]
    ledger: Ledger


@dataclass
class Verdict:
    committed: int = 0  # user messages the devices reported committed
    lost: int = 0
    duplicates: int = 0
    problems: list[str] = field(default_factory=list)
    sync_passes: int = 0
    rekeys: int = 0  # new client ids taken by devices (none expected: no file is copied)
    sessions: int = 0  # on the server, all users
    conflict_forks: int = 0  # of them, forks kept by concurrent edits of one session

    def as_dict(self) -> dict[str, Any]:
        return {
            "committed": self.committed,
            "rekeys": self.rekeys,
            "sessions": self.sessions,
            "conflict_forks": self.conflict_forks,
            "lost": self.lost,
            "duplicates": self.duplicates,
            "problems": self.problems,
            "sync_passes": self.sync_passes,
        }


def _user_texts(view: View, sid: str) -> list[str]:
    texts = []
    for _, role, content in view.transcripts.get(sid, []):
        if role == "user":
            texts += [b.get("text", "") for b in json.loads(content) if isinstance(b, dict)]
    return texts


def count_lost(ledger: Ledger, views: list[View]) -> tuple[int, list[str]]:
    """Committed user messages missing from some holder (its id, or a copy: same text)."""
    held: list[tuple[str, set[str], set[str]]] = []
    for view in views:
        ids: set[str] = set()
        texts: set[str] = set()
        for sid in view.live():
            ids.update(m for m, _, _ in view.transcripts.get(sid, []))
            texts.update(_user_texts(view, sid))
        held.append((view.name, ids, texts))
    lost: list[str] = []
    for w in ledger.written:
        for name, ids, texts in held:
            if w.message_id not in ids and w.text not in texts:
                lost.append(f"lost: {w.text} ({w.message_id}) is in no live session on {name}")
                break
    return len(lost), lost


def count_duplicates(views: list[View]) -> tuple[int, list[str]]:
    """User texts held twice by one holder: twice in a transcript, or in two families."""
    family = families(views)
    found: dict[str, str] = {}
    for view in views:
        where: dict[str, list[str]] = {}
        for sid in sorted(view.live()):
            for text in _user_texts(view, sid):
                where.setdefault(text, []).append(sid)
        for text, sids in where.items():
            if len(sids) != len(set(sids)):
                found.setdefault(text, f"duplicate: {text} twice in one session on {view.name}")
            elif len({family.get(s, s) for s in sids}) > 1:
                found.setdefault(
                    text, f"duplicate: {text} in unrelated sessions {sids} on {view.name}"
                )
    return len(found), list(found.values())


async def _audit_forensics(user: User, runtimes: list[_Device], found: list[str]) -> list[str]:
    """For a chain that fails: its first rows on every device (seq, id, prev, hash), and
    which device's id it is, so the failure can be read without the files."""
    owners = {cid: dev.name for dev in user.devices for cid in dev.client_ids}
    out = []
    for problem in found:
        if not problem.startswith("audit-chain"):
            continue
        client_id = problem.split(" chain of ", 1)[1].split()[0]
        out.append(f"forensics: chain {client_id} is {owners.get(client_id, 'no device')}'s")
        for d in runtimes:
            rows = await d.rt.store.list_audit(client_id=client_id)
            out.append(
                f"forensics: on {d.name}: "
                + ", ".join(
                    f"#{r.sequence_number} {r.id[-6:]} prev {r.prev_hash[:8]} hash {r.row_hash[:8]}"
                    for r in rows[:6]
                )
            )
    return out


async def fetch_feed(url: str, bearer: str) -> list[Any]:
    """Every change of the token's tenant, pulled from cursor 0 by an observer connection."""
    async with connect(
        url,
        additional_headers={"Authorization": f"Bearer {bearer}"},
        proxy=None,
        open_timeout=30,
        close_timeout=5,
    ) as ws:
        client = Client(ws)
        await client.hello(f"observer-{uuid7()}")
        return await client.pull_all()


def make_users(count: int, org: str = "campaign") -> list[User]:
    users = []
    for u in range(count):
        tenant = Tenant(org_id=org, user_id=f"user{u}-{uuid7()[-12:]}")
        users.append(User(tenant, token(tenant)))
    return users


async def verify(users: list[User], url: str) -> Verdict:
    """Sync every device (in this process) until nothing moves, then judge. Every device
    process must have stopped."""
    verdict = Verdict()
    for user in users:
        assert not any(d.running for d in user.devices), "stop the device processes first"
        verdict.committed += len(user.ledger.written)
        runtimes: list[_Device] = []
        try:
            for dev in user.devices:
                rt = SessionRuntime(
                    SQLiteAdapter(dev.db),
                    ScriptedProvider(),
                    user_id=user.tenant.user_id,
                    org_id=user.tenant.org_id,
                )
                await rt.open()
                runtimes.append(_Device(dev.name, rt))
            for n in range(1, SYNC_PASSES + 1):
                verdict.sync_passes = n
                moved = 0
                for d in runtimes:
                    receipt = await d.rt.sync.sync_once(url, user.token, timeout=SYNC_TIMEOUT)
                    moved += receipt.flushed + receipt.pending_after
                feed = await fetch_feed(url, user.token)
                head = feed[-1].cursor if feed else 0
                cursors = [(await d.rt.sync.status()).cursor for d in runtimes]
                if moved == 0 and all(c >= head for c in cursors):
                    break
            else:
                verdict.problems.append(
                    f"no-quiescence: {user.tenant.user_id} still moving after {SYNC_PASSES} passes"
                )
            # The simulation's invariants, but its per-message loss check (built for short
            # schedules: it decodes every transcript once per message) is ``count_lost``.
            world = _World(runtimes, Ledger())
            found = await check(world, feed)  # type: ignore[arg-type]
            verdict.problems += found
            if any(p.startswith("audit-chain") for p in found):
                verdict.problems += await _audit_forensics(user, runtimes, found)
            scratch: list[str] = []
            views = [await device_view(world, i, scratch) for i in range(len(runtimes))]  # type: ignore[arg-type]
            server = server_view(feed)
            views.append(server)
            verdict.sessions += len(server.sessions)
            verdict.conflict_forks += sum(1 for x in server.sessions.values() if x["conflict_id"])
            lost, lost_lines = count_lost(user.ledger, views)
            dups, dup_lines = count_duplicates(views)
            verdict.lost += lost
            verdict.duplicates += dups
            verdict.problems += lost_lines[:10] + dup_lines[:10]
        finally:
            for d in runtimes:
                await d.rt.close()
    for user in users:
        for dev in user.devices:
            verdict.rekeys += max(0, len(dev.client_ids) - 1)
            if len(dev.client_ids) > 1:
                verdict.problems.append(f"rekey: {dev.name} wrote under {dev.client_ids}")
            for text in dev.traceback_texts:
                verdict.problems.append(f"device-traceback: {dev.name}: {text}")
    return verdict


__all__ = ["DeviceProc", "User", "Verdict", "fetch_feed", "make_users", "verify"]
