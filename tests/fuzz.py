"""Frame fuzzing against a live server: ``python -m tests.fuzz [--frames N] [--seed S]``.

A real ``SyncServer`` (SQLite store, a temporary file) on a loopback port; a seeded generator
sends it mutations of well-formed frames (``Hello``, ``Push`` with every record kind, ``Pull``)
and junk: flipped, cut and spliced bytes; values swapped for other types, huge or negative
numbers, NUL bytes, long strings, deep nesting, missing and unknown keys; random msgpack.
Connections are reopened as the server closes them.

What must hold, whatever is sent:

- the server never fails inside (no traceback logged by ``pleach_server``);
- every ``Error`` frame carries a known code, and every close a known close code;
- nothing of another tenant is ever returned (a bystander tenant's records stay out of every
  page the fuzzing tenant gets, and the bystander's data stays as it was);
- afterwards the server still serves a well-behaved device.

``make test`` runs a 3,000-frame slice (``tests/test_fuzz.py``); ``make soak`` runs 100,000.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import sys
import tempfile
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from pleach_server.auth import issue_token
from pleach_server.server import SyncServer
from pleach_server.store import SQLiteServerStore, Tenant
from shared import compact, idrefs
from shared.errors import ErrorCode
from shared.ids import uuid7
from shared.messages import (
    Changes,
    Error,
    FeedBody,
    FrameCodec,
    Hello,
    Pull,
    Push,
    Welcome,
    unpacked,
)
from shared.records import SessionState
from tests.server_factories import Device, new_tenant

SECRET = b"fuzz-secret"
KNOWN_CLOSE_CODES = {1000, 1001, 1008, 1009, 1011}
KNOWN_ERROR_CODES = {int(code) for code in ErrorCode}


@dataclass
class FuzzReport:
    frames: int = 0
    connections: int = 0
    errors: Counter[int] = field(default_factory=Counter)
    closes: Counter[int] = field(default_factory=Counter)
    answers: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    tracebacks: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        return (
            f"{self.frames} frames over {self.connections} connections in {self.seconds:.1f}s; "
            f"answers {dict(self.answers)}; errors {dict(self.errors)}; closes "
            f"{dict(self.closes)}; server tracebacks {self.tracebacks}; problems "
            f"{len(self.problems)}"
        )


class _Tracebacks(logging.Handler):
    """Counts records logged with an exception by the server's loggers."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("pleach_server") and record.exc_info:
            self.records.append(record)


# -- generating frames -------------------------------------------------------------------------


def _seeds(dev: Device) -> list[dict[str, Any]]:
    """Well-formed frames as builtins: what the mutations start from."""
    session = dev.session(title="fuzz")
    records = [
        session,
        dev.message(session.id),
        dev.message(session.id, _PROSE),  # protocol 9: its text deflated (ext 6)
        dev.checkpoint(session.id),
        dev.event(session.id),
        dev.audit(session.id),
    ]
    frames: list[Any] = [
        Hello(protocol=2, client_id=dev.client_id, min_protocol=1, max_protocol=2, request_id=1),
        Hello(protocol=1, client_id=dev.client_id, min_protocol=1, max_protocol=4, request_id=1),
        Push(changes=dev.changes(*records), request_id=2),
        Push(changes=dev.changes(session), skipped=[dev.next_seq - 3], request_id=4),
        Pull(cursor=0, limit=50, request_id=3),
        Hello(protocol=1, client_id=dev.client_id, min_protocol=1, max_protocol=6, request_id=1),
        Hello(protocol=1, client_id=dev.client_id, min_protocol=1, max_protocol=7, request_id=1),
        Hello(protocol=1, client_id=dev.client_id, min_protocol=1, max_protocol=8, request_id=1),
        Hello(protocol=1, client_id=dev.client_id, min_protocol=1, max_protocol=9, request_id=1),
    ]
    # Protocol 6: the records as their compact bytes, inline (each one msgpack value).
    bodies = [
        [c.client_seq, msgspec.msgpack.decode(compact.encode(c.record))]
        for c in dev.changes(*records)
    ]
    pushed = {"type": "push", "changes": [], "request_id": 5, "bodies": bodies}
    # Protocol 7: a long session whole, then its next version as a reference to that list.
    ids = [uuid7() for _ in range(idrefs.MIN_IDS)]
    lists = idrefs.IdLists()
    versions = [
        msgspec.structs.replace(session, state=SessionState(message_ids=ids)),
        msgspec.structs.replace(session, state=SessionState(message_ids=[*ids, uuid7()])),
    ]
    long_pushes = [
        {
            "type": "push",
            "changes": [],
            "request_id": 6 + i,
            "bodies": [[c.client_seq, msgspec.msgpack.decode(lists.shrink(compact.encode(v)))]],
        }
        for i, (c, v) in enumerate(zip(dev.changes(*versions), versions, strict=True))
    ]
    return [msgspec.to_builtins(f) for f in frames] + [pushed, *long_pushes]


_PROSE = " ".join(
    "a long text that the codec keeps deflated where it saves an eighth of its bytes".split() * 4
)


def _deflated(rng: random.Random) -> msgspec.msgpack.Ext:
    """An ext 6 (a deflated text): whole, cut short, past the inflate ratio, or junk."""
    choice = rng.randrange(4)
    if choice == 0:
        return msgspec.msgpack.Ext(6, zlib.compress(_PROSE.encode(), 6, wbits=-15))
    if choice == 1:
        return msgspec.msgpack.Ext(6, zlib.compress(_PROSE.encode(), 6, wbits=-15)[:-5])
    if choice == 2:
        return msgspec.msgpack.Ext(6, zlib.compress(b"x" * 1_000_000, 9, wbits=-15))
    return msgspec.msgpack.Ext(6, rng.randbytes(rng.randrange(60)))


def _weird(rng: random.Random, depth: int = 0) -> Any:
    choice = rng.randrange(15)
    if choice == 0:
        return rng.choice([0, -1, 2**63 - 1, -(2**63), 2**64 - 1, 1 << 40])
    if choice == 1:
        return rng.random() * rng.choice([1, 1e308, -1e-308])
    if choice == 2:
        return "\x00" * rng.randrange(1, 5)
    if choice == 3:
        return "x" * rng.choice([0, 1, 300, 70_000])
    if choice == 4:
        return None
    if choice == 5:
        return rng.choice([True, False])
    if choice == 6:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(40)))
    if choice == 7 and depth < 3:
        return [_weird(rng, depth + 1) for _ in range(rng.randrange(4))]
    if choice == 8 and depth < 3:
        return {f"k{rng.randrange(100)}": _weird(rng, depth + 1) for _ in range(3)}
    if choice == 9:
        nested: Any = []
        for _ in range(rng.choice([50, 500, 2000])):
            nested = [nested]
        return nested
    if choice == 10:
        return "\ud800"  # a lone surrogate cannot be encoded: stays a plain str below
    if choice == 11:
        return "é" * rng.randrange(1, 50)
    if choice == 12:
        return rng.randrange(-5, 5)
    if choice == 13:
        return _deflated(rng)
    return "push"


def _mutate_value(rng: random.Random, value: Any, depth: int = 0) -> Any:
    """Replace, drop or add somewhere inside ``value`` (builtins)."""
    if isinstance(value, dict) and value and depth < 6:
        keys = list(value)
        key = rng.choice(keys)
        action = rng.randrange(4)
        out = dict(value)
        if action == 0:
            out.pop(key)
        elif action == 1:
            out[f"unknown_{rng.randrange(9)}"] = _weird(rng)
        elif action == 2:
            out[key] = _weird(rng)
        else:
            out[key] = _mutate_value(rng, value[key], depth + 1)
        return out
    if isinstance(value, list) and value and depth < 6:
        out_list = list(value)
        i = rng.randrange(len(out_list))
        action = rng.randrange(3)
        if action == 0:
            out_list[i] = _mutate_value(rng, out_list[i], depth + 1)
        elif action == 1:
            out_list.append(_weird(rng))
        else:
            out_list = out_list * rng.choice([2, 50])
        return out_list
    return _weird(rng)


def _encode(value: Any) -> bytes | None:
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20_000))
    try:
        return msgspec.msgpack.encode(value)
    except (TypeError, ValueError, OverflowError, RecursionError, msgspec.EncodeError):
        return None
    finally:
        sys.setrecursionlimit(limit)


def _bytes_mutation(rng: random.Random, data: bytes) -> bytes:
    action = rng.randrange(5)
    raw = bytearray(data)
    if action == 0 and raw:
        for _ in range(rng.randrange(1, 8)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
    elif action == 1:
        raw = raw[: rng.randrange(len(raw) + 1)]
    elif action == 2:
        raw += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    elif action == 3 and raw:
        a = rng.randrange(len(raw))
        raw = raw[:a] + raw[a:] * 2
    else:
        raw = bytearray(rng.randbytes(rng.randrange(1, 200)))
    return bytes(raw)


def frames(seed: int, seeds: list[dict[str, Any]]) -> Any:
    """An endless, seeded stream of frames to send (bytes, or a str for a text frame)."""
    rng = random.Random(seed)
    while True:
        base = rng.choice(seeds)
        kind = rng.randrange(10)
        if kind == 0:
            yield "text frames are refused"
            continue
        data = _encode(_mutate_value(rng, base)) if kind < 6 else None
        if data is None:
            data = _bytes_mutation(rng, msgspec.msgpack.encode(base))
        yield data


# -- running -----------------------------------------------------------------------------------


async def _drain(
    ws: ClientConnection,
    codec: FrameCodec,
    report: FuzzReport,
    mine: Tenant,
    received: idrefs.IdLists,
) -> None:
    """Read what the server answered so far (without waiting long) and check it.
    ``received``: the connection's id lists (protocol 7 pages refer to them)."""
    while True:
        try:
            async with asyncio.timeout(0.001 if report.frames % 200 else 0.05):
                data = await ws.recv()
        except TimeoutError:
            return
        if isinstance(data, str):
            report.problems.append("the server sent a text frame")
            continue
        try:
            frame = codec.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            report.problems.append(f"the server sent an undecodable frame: {exc}")
            continue
        report.answers[type(frame).__name__] += 1
        if isinstance(frame, Error) and frame.code not in KNOWN_ERROR_CODES:
            report.problems.append(f"unknown error code {frame.code}: {frame.message}")
        if isinstance(frame, Error):
            report.errors[frame.code] += 1
        if isinstance(frame, Changes):
            try:
                grown = [
                    FeedBody(b.cursor, msgspec.Raw(received.grow(b.body))) for b in frame.bodies
                ]
                frame = unpacked(msgspec.structs.replace(frame, bodies=grown))  # protocol 6, 7
            except (msgspec.DecodeError, RecursionError) as exc:
                report.problems.append(f"the server sent a record that does not decode: {exc}")
                continue
            for change in frame.changes:
                record = change.record
                if (record.org_id, record.user_id) != (mine.org_id, mine.user_id):
                    report.problems.append(f"another tenant's record {record.id} was returned")
        if isinstance(frame, Welcome) and (frame.org_id, frame.user_id) != (
            mine.org_id,
            mine.user_id,
        ):
            report.problems.append("Welcome named another tenant")


async def run_fuzz(count: int, seed: int, workdir: Path) -> FuzzReport:
    report = FuzzReport()
    handler = _Tracebacks()
    logging.getLogger().addHandler(handler)
    started = time.perf_counter()
    codec = FrameCodec()
    try:
        async with (
            SQLiteServerStore(workdir / "fuzz.db", synchronous="NORMAL") as store,
            SyncServer(store, port=0, secret=SECRET, rate_limit_per_s=None) as srv,
        ):
            fuzzer, bystander = Device(new_tenant()), Device(new_tenant())
            # The bystander's data, which nothing the fuzzer sends may reach.
            from shared.clock import HybridClock

            bystander_session = bystander.session(title="bystander")
            await store.push(
                bystander.tenant,
                bystander.client_id,
                bystander.changes(bystander_session, bystander.message(bystander_session.id)),
                HybridClock("fuzz-server"),
            )
            before = await store.pull(bystander.tenant, 0, 100)
            headers = {"Authorization": f"Bearer {issue_token(SECRET, fuzzer.tenant, 3600)}"}
            stream = frames(seed, _seeds(fuzzer))
            hello = codec.encode(Hello(protocol=2, client_id=fuzzer.client_id, max_protocol=2))
            hello7 = codec.encode(Hello(protocol=2, client_id=fuzzer.client_id, max_protocol=7))
            while report.frames < count:
                report.connections += 1
                try:
                    async with connect(
                        srv.url, additional_headers=headers, proxy=None, max_size=None
                    ) as ws:
                        received = idrefs.IdLists()
                        if report.connections % 3:
                            await ws.send(hello if report.connections % 3 == 1 else hello7)
                        while report.frames < count:
                            await ws.send(next(stream))
                            report.frames += 1
                            await _drain(ws, codec, report, fuzzer.tenant, received)
                except ConnectionClosed as exc:
                    code = exc.rcvd.code if exc.rcvd is not None else 1006
                    report.closes[code] += 1
                    if code not in KNOWN_CLOSE_CODES:
                        report.problems.append(f"closed with an unknown code {code}")
            # The server still serves a well-behaved device, and the bystander is untouched.
            honest = Device(fuzzer.tenant)
            async with connect(srv.url, additional_headers=headers, proxy=None) as ws:
                await ws.send(
                    codec.encode(
                        Hello(protocol=2, client_id=honest.client_id, max_protocol=2, request_id=1)
                    )
                )
                welcome = codec.decode(await ws.recv())
                if not isinstance(welcome, Welcome):
                    report.problems.append(f"a well-behaved device got {welcome!r}")
            after = await store.pull(bystander.tenant, 0, 100)
            if [c.record for c in after.changes] != [c.record for c in before.changes]:
                report.problems.append("the bystander tenant's data changed")
    finally:
        logging.getLogger().removeHandler(handler)
        report.tracebacks = len(handler.records)
        for record in handler.records[:3]:
            report.problems.append(f"server traceback: {record.getMessage()}")
        report.seconds = time.perf_counter() - started
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__)
    parser.add_argument("--frames", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pleach-fuzz-") as tmp:
        report = asyncio.run(run_fuzz(args.frames, args.seed, Path(tmp)))
    print(report.summary())
    for problem in report.problems[:20]:
        print("PROBLEM", problem)
    return 1 if report.problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
