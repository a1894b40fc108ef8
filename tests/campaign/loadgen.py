"""A load-generator process: many light device connections (no runtime, no device file).

    python -m tests.campaign.loadgen --url URL --secret S --org ORG --run RUN
        --first-user A --users N --per-user K --mode load|flood [--interval 2.0] [--seed 0]

A light device is one WebSocket speaking the protocol's frames directly: its token (user
``RUN-u<i>`` of ``ORG``), ``Hello``/``Welcome``, its session record pushed once, then small
pushes (one ``Message`` change each) built by ``tests.server_factories.Device``. Live
``Changes`` pages are counted, not decoded. One push is in flight per connection.

- ``load``: each device pushes about every ``interval`` s (uniform jitter +-50%, random phase);
  the latency of each push is the time from sending it to its ``PushAck``.
- ``flood``: each connection pushes as fast as its answers come back; a refused push (3008,
  rate limited) is sent again, a closed connection (1008 after 100 refusals) reconnects.

Lines on stdout: ``ready <connections>`` once all are welcomed; ``flooding`` once every flood
connection had an answer; ``result <json>`` after each window. On stdin: ``go SECONDS WARM``
runs one window (samples count only after WARM s), ``exit`` closes every connection and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from pleach_server.auth import issue_token
from pleach_server.store import Tenant
from shared.messages import PROTOCOL_VERSION, Error, FrameCodec, Hello, Push, PushAck, Welcome
from shared.records import Change
from tests.loop import hold
from tests.server_factories import Device

CONCURRENT_OPENS = 50  # handshakes in flight at once
TIMEOUT = 60.0  # safety net for one answer


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Light:
    """One light device connection. ``push()`` sends one small change and waits for the
    answer; a refused or lost push is resent by the next ``push()``."""

    def __init__(self, url: str, secret: bytes, tenant: Tenant, client_id: str) -> None:
        self.url = url
        self.token = issue_token(secret, tenant, None)
        self.device = Device(tenant, client_id)
        self.session = self.device.session()
        self.codec = FrameCodec()
        self.ws: ClientConnection | None = None
        self.unsent: list[Change] = self.device.changes(self.session)
        self.live_frames = 0
        self.reconnects = 0
        self._answer: asyncio.Future[Any] | None = None
        self._reader: asyncio.Task[None] | None = None

    async def open(self) -> None:
        async with asyncio.timeout(TIMEOUT):
            ws = await connect(
                self.url, additional_headers={"Authorization": f"Bearer {self.token}"}, proxy=None
            )
            await ws.send(
                self.codec.encode(Hello(protocol=PROTOCOL_VERSION, client_id=self.device.client_id))
            )
            while True:  # a live page of the peer may come first
                data = await ws.recv()
                assert isinstance(data, bytes)
                frame = self.codec.decode(data)
                if isinstance(frame, Welcome):
                    break
                if isinstance(frame, Error):
                    await ws.close()
                    raise ConnectionError(f"refused at Hello: {frame.code} {frame.message}")
        self.ws = ws
        self._reader = asyncio.create_task(self._read(ws))

    async def _read(self, ws: ClientConnection) -> None:
        try:
            async for data in ws:
                assert isinstance(data, bytes)
                head = self.codec.peek(data)
                if head is not None and head.type == "changes":
                    self.live_frames += 1
                    continue
                if self._answer is not None and not self._answer.done():
                    self._answer.set_result(self.codec.decode(data))
        except ConnectionClosed:
            pass
        finally:
            if self._answer is not None and not self._answer.done():
                self._answer.set_exception(ConnectionError("connection closed"))

    async def push(self) -> tuple[float, Any]:
        """One push (the pending change, or a new one); returns (seconds, answer)."""
        if not self.unsent:
            self.unsent = self.device.changes(self.device.message(self.session.id, "x" * 40))
        if self.ws is None:
            self.reconnects += 1
            await self.open()
        assert self.ws is not None
        self._answer = asyncio.get_running_loop().create_future()
        started = time.perf_counter()
        try:
            await self.ws.send(self.codec.encode(Push(changes=self.unsent)))
            async with asyncio.timeout(TIMEOUT):
                answer = await self._answer
        except (ConnectionError, ConnectionClosed) as exc:
            await self.close()
            return time.perf_counter() - started, exc
        elapsed = time.perf_counter() - started
        if isinstance(answer, PushAck):
            self.unsent = []
        return elapsed, answer

    async def close(self) -> None:
        ws, reader = self.ws, self._reader
        self.ws = self._reader = None
        if ws is not None:
            with contextlib.suppress(ConnectionClosed, OSError):
                await ws.close()
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader


async def paced(
    interval: float,
    start: float,
    stop_at: float,
    rng: random.Random,
    act: Callable[[], Awaitable[None]],
) -> None:
    """Call ``act()`` about every ``interval`` s (uniform jitter +-50%, random phase) until
    ``stop_at`` on the clock. A late call goes at once; slots missed while ``act`` was slower
    than the pace are skipped, so an overloaded server cannot stretch the window."""
    next_at = start + rng.uniform(0, interval)
    while next_at < stop_at:
        delay = next_at - time.perf_counter()
        if delay > 0:
            await hold(delay)  # pacing the offered load, not waiting for an event
        await act()
        next_at += interval * rng.uniform(0.5, 1.5)
        next_at = max(next_at, time.perf_counter())


class Tally:
    def __init__(self) -> None:
        self.samples: list[float] = []
        self.pushes = 0
        self.acked = 0
        self.errors: Counter[str] = Counter()
        self.closed = 0

    def note(self, elapsed: float, answer: Any, counted: bool) -> None:
        self.pushes += 1
        if isinstance(answer, PushAck):
            self.acked += 1
            if counted:
                self.samples.append(elapsed)
        elif isinstance(answer, Error):
            self.errors[str(answer.code)] += 1
        else:
            self.closed += 1


async def open_all(devices: list[Light]) -> None:
    limit = asyncio.Semaphore(CONCURRENT_OPENS)

    async def one(dev: Light) -> None:
        async with limit:
            await dev.open()
            _, answer = await dev.push()  # its session record
            if not isinstance(answer, PushAck):
                raise RuntimeError(f"session push refused: {answer!r}")

    await asyncio.gather(*(one(d) for d in devices))


async def window(
    devices: list[Light],
    mode: str,
    interval: float,
    seconds: float,
    warm: float,
    seed: int,
    stop: asyncio.Event,
) -> dict[str, Any]:
    tally = Tally()
    cpu0 = time.process_time()
    start = time.perf_counter() + 0.05
    warm_end, stop_at = start + warm, start + warm + seconds
    master = random.Random(seed)
    live0 = sum(d.live_frames for d in devices)
    answered: set[int] = set()

    async def load(dev: Light) -> None:
        async def act() -> None:
            elapsed, answer = await dev.push()
            tally.note(elapsed, answer, time.perf_counter() - elapsed >= warm_end)

        await paced(interval, start, stop_at, random.Random(master.random()), act)

    async def flood(i: int, dev: Light) -> None:
        while time.perf_counter() < stop_at and not stop.is_set():
            try:
                elapsed, answer = await dev.push()
            except (OSError, InvalidHandshake, TimeoutError):
                tally.closed += 1  # a refused reconnect: try again
                continue
            tally.note(elapsed, answer, time.perf_counter() - elapsed >= warm_end)
            if i not in answered:
                answered.add(i)
                if len(answered) == len(devices):
                    say("flooding")

    if mode == "load":
        await asyncio.gather(*(load(d) for d in devices))
    else:
        await asyncio.gather(*(flood(i, d) for i, d in enumerate(devices)))
    return {
        "samples": tally.samples,
        "pushes": tally.pushes,
        "acked": tally.acked,
        "errors": dict(tally.errors),
        "closed": tally.closed,
        "reconnects": sum(d.reconnects for d in devices),
        "live_frames": sum(d.live_frames for d in devices) - live0,
        "cpu_s": time.process_time() - cpu0,
        "seconds_run": time.perf_counter() - start,
        "seconds": seconds,
        "warm": warm,
    }


async def run(args: argparse.Namespace) -> int:
    secret = args.secret.encode()
    devices = [
        Light(
            args.url,
            secret,
            Tenant(org_id=args.org, user_id=f"{args.run}-u{u}"),
            f"{args.run}-u{u}-d{d}",
        )
        for u in range(args.first_user, args.first_user + args.users)
        for d in range(args.per_user)
    ]
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    running: asyncio.Task[None] | None = None
    try:
        await open_all(devices)
        say(f"ready {len(devices)}")
        rounds = 0
        stop = asyncio.Event()

        async def one_window(seconds: float, warm: float, seed: int) -> None:
            try:
                result = await window(devices, args.mode, args.interval, seconds, warm, seed, stop)
            except BaseException as exc:
                say(f"failed {type(exc).__name__}: {exc}")
                raise
            result["samples"] = [round(x, 6) for x in result["samples"]]
            say("result " + json.dumps(result))

        async for raw in stdin:
            words = raw.decode().split()
            if words[:1] == ["go"]:
                if running is not None:
                    await running
                stop.clear()
                seconds, warm = float(words[1]), float(words[2])
                running = asyncio.create_task(one_window(seconds, warm, args.seed + rounds))
                rounds += 1
            elif words[:1] == ["stop"]:
                stop.set()
            elif words[:1] == ["exit"]:
                break
        stop.set()
        if running is not None:
            await running
    finally:
        await asyncio.gather(*(d.close() for d in devices))
    say("closed")
    return 0


__all__ = ["Light", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.campaign.loadgen")
    for flag in ("--url", "--secret", "--org", "--run"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--first-user", type=int, default=0)
    parser.add_argument("--users", type=int, required=True)
    parser.add_argument("--per-user", type=int, default=2)
    parser.add_argument("--mode", choices=("load", "flood"), default="load")
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    return asyncio.run(run(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
