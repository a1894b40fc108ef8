"""A device process for the campaign: a ``SessionRuntime`` on its own SQLite file that runs
turns (``ScriptedProvider``) and syncs, until it is stopped or killed.

    python -m tests.campaign.device --db PATH --url URL --token TOKEN --org O --user U
        --name NAME --life N --seed S [--pace 0.05,0.2] [--backoff 0.05,0.5]

Every user text is ``NAME.LIFE.N``: unique across restarts without reading the file back.

What it prints (one line each, flushed):

- ``ready <client_id>`` once the runtime is open and sync is started;
- ``@turn``, ``@write``, ``@apply``, ``@flush``, ``@settle`` as it enters a kill point: a turn's
  commit, another local write (a new session), a remote page's commit (a pull or a live page),
  a push about to be sent, a ``PushAck`` about to be settled (the server has committed);
- ``committed <text> <message_id> <session_id>`` after a turn committed;
- ``rekeyed <client_id>`` when the runtime took a new client id (seen after a turn);
- ``stopped`` after ``stop``.

What it reads on stdin:

- ``arm POINT STAGE K DELAY_MS``: SIGKILL itself at the K-th pass through POINT from now on,
  at STAGE ``in`` (inside the transaction before its writes; before the push is built; before
  the outbox rows are removed) or ``after`` (once the store call returned), DELAY_MS later
  (0: right there, synchronously);
- ``stop``: finish the turn under way, close the runtime, print ``stopped``, exit 0.

The kill points are a subclass of ``SQLiteAdapter`` (the public store class) that the runtime
uses like any other: nothing of the runtime is patched.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from pleach_client.providers.scripted import ScriptedProvider
from pleach_client.runtime import SessionRuntime
from pleach_client.store.base import (
    CommitReceipt,
    InPlace,
    OutboxEntry,
    Plan,
    Rerunnable,
    TxReader,
    WriteBatch,
)
from pleach_client.store.sqlite import SQLiteAdapter
from pleach_client.stream import MessageAdded

POINTS = ("turn", "write", "apply", "flush", "settle")
STAGES = ("in", "after")


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Armed:
    """One pending self-kill: at the ``countdown``-th pass through ``point`` at ``stage``."""

    def __init__(self, point: str, stage: str, countdown: int, delay_ms: float) -> None:
        if point not in POINTS or stage not in STAGES or countdown < 1 or delay_ms < 0:
            raise ValueError(f"bad kill point {point} {stage} {countdown} {delay_ms}")
        self.point, self.stage, self.countdown, self.delay_ms = point, stage, countdown, delay_ms

    def passing(self, point: str, stage: str) -> bool:
        """True when this pass is the one: the caller kills (now or after the delay)."""
        if point != self.point or stage != self.stage:
            return False
        self.countdown -= 1
        return self.countdown == 0


class KillPoints(SQLiteAdapter):
    """``SQLiteAdapter`` that announces its kill points and dies at an armed one."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.in_turn = False
        self.armed: Armed | None = None

    def passing(self, point: str, stage: str) -> None:
        if stage == "in":
            say(f"@{point}")
        armed = self.armed
        if armed is None or not armed.passing(point, stage):
            return
        self.armed = None
        if armed.delay_ms == 0:
            die()
        asyncio.get_running_loop().call_later(armed.delay_ms / 1000, die)

    async def transact(self, plan: Plan) -> CommitReceipt:
        kind: list[str] = []

        async def marked(tx: TxReader) -> WriteBatch | None:
            batch = await plan(tx)
            if batch is not None:
                point = "apply" if "cursor" in batch.meta else "turn" if self.in_turn else "write"
                kind[:] = [point]  # (a rerunnable plan may be called twice)
                self.passing(point, "in")  # nothing written yet
            return batch

        # A plan keeps its mark: a turn's commit and a live page's apply are then written as
        # they are outside the campaign (in place, on the caller's thread).
        kept: Plan = marked
        if isinstance(plan, Rerunnable):
            kept = Rerunnable(marked)
        elif isinstance(plan, InPlace):
            kept = InPlace(marked)
        receipt = await super().transact(kept)
        if kind:
            self.passing(kind[0], "after")
        return receipt

    async def outbox_pending(self, limit: int = 500, *, after: int = 0) -> list[OutboxEntry]:
        entries = await super().outbox_pending(limit, after=after)
        if entries:
            self.passing("flush", "in")
            self.passing("flush", "after")
        return entries

    async def outbox_remove(self, client_seqs: list[int]) -> None:
        self.passing("settle", "in")
        await super().outbox_remove(client_seqs)
        self.passing("settle", "after")


async def run(args: argparse.Namespace) -> int:
    store = KillPoints(Path(args.db))
    rng = random.Random(f"{args.seed}:{args.name}:{args.life}")
    pace_lo, pace_hi = (float(x) for x in args.pace.split(","))
    backoff_lo, backoff_hi = (float(x) for x in args.backoff.split(","))
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)

    async def commands() -> None:
        async for raw in stdin:
            words = raw.decode().split()
            if words[:1] == ["arm"]:
                point, stage, countdown, delay = words[1:5]
                store.armed = Armed(point, stage, int(countdown), float(delay))
            elif words[:1] == ["stop"]:
                stopping.set()
                return
        stopping.set()  # stdin closed: the campaign is gone

    async with SessionRuntime(store, ScriptedProvider(), user_id=args.user, org_id=args.org) as rt:
        # The campaign restarts servers hundreds of times: a short reconnect backoff keeps a
        # round short (the simulation does the same).
        rt.sync.backoff_initial, rt.sync.backoff_max = backoff_lo, backoff_hi
        await rt.sync.connect(args.url, args.token)
        client_id = rt.client_id
        say(f"ready {client_id}")
        reader = asyncio.create_task(commands())
        n = 0
        while not stopping.is_set():
            live = await rt.sessions.list()
            if not live or rng.random() < 0.1:
                store.in_turn = False
                session_id = (await rt.sessions.create(title=f"{args.name}.{args.life}.{n}")).id
            else:
                # One of the three most recently updated: often another device's, so two
                # devices write one session at once (conflicts, forks) now and then.
                session_id = rng.choice(live[:3]).id
            text = f"{args.name}.{args.life}.{n}"
            user_ids: list[str] = []
            store.in_turn = True
            try:
                async for event in rt.execute_message(session_id, text):
                    if isinstance(event, MessageAdded) and event.role == "user":
                        user_ids.append(event.message_id)
            finally:
                store.in_turn = False
            for message_id in user_ids:
                say(f"committed {text} {message_id} {session_id}")
            if rt.client_id != client_id:  # the sync loop took a new id (it saw its id reused)
                client_id = rt.client_id
                say(f"rekeyed {client_id}")
            n += 1
            try:
                # Pacing the offered load (a person typing), not waiting for anything.
                async with asyncio.timeout(rng.uniform(pace_lo, pace_hi)):
                    await stopping.wait()
            except TimeoutError:
                pass
        reader.cancel()
        await rt.sync.disconnect()
    say("stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.campaign.device")
    for flag in ("--db", "--url", "--token", "--org", "--user", "--name"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--life", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pace", default="0.05,0.2", help="seconds between turns: min,max")
    parser.add_argument("--backoff", default="0.05,0.5", help="reconnect backoff: initial,max")
    return asyncio.run(run(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
