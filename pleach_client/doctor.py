"""``pleach doctor``: check the device store, the server, the token and the clock.

Each check gives ``ok``, ``warn`` or ``fail`` with a reason a person can act on. Nothing is
written anywhere: the store is opened read-only for the checks that read it, and the server
is only greeted (``Hello``/``Welcome``), never pushed to.
"""

from __future__ import annotations

import asyncio
import os
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import msgspec
import websockets
from websockets.exceptions import InvalidHandshake, InvalidStatus, InvalidURI

from shared.clock import Timestamp
from shared.errors import InvalidRecord, PleachError
from shared.messages import Error, FrameCodec, Hello, Welcome

from .runtime import SessionRuntime
from .store.sqlite import SQLiteAdapter

Level = Literal["ok", "warn", "fail"]
CLOCK_WARN_MS = 5_000
CLOCK_FAIL_MS = 60_000  # the server's default limit: stamps further ahead are refused (3011)


@dataclass
class Check:
    level: Level
    name: str
    detail: str


async def check_store(db: str, user: str, org: str) -> list[Check]:
    if not await asyncio.to_thread(os.path.exists, db):
        return [Check("fail", "store", f"no device database at {db}")]
    try:
        async with SessionRuntime(SQLiteAdapter(db), user_id=user, org_id=org) as rt:
            return await check_runtime_store(rt, db)
    except PleachError as exc:
        return [Check("fail", "store", str(exc))]


async def check_runtime_store(rt: SessionRuntime, name: str | None = None) -> list[Check]:
    """The store of an open runtime: integrity (where the store can check it), every
    session's event log, the outbox."""
    out: list[Check] = []
    store = rt.store
    name = name or type(store).__name__
    integrity = getattr(store, "integrity_check", None)
    try:
        problems = await integrity() if integrity is not None else []
        if problems:
            out.append(Check("fail", "store", f"{name} is damaged: {problems[0]}"))
        else:
            out.append(Check("ok", "store", f"{name} is sound (client id {rt.client_id})"))
        broken = []
        sessions = await rt.sessions.list()
        for session in sessions:
            report = await rt.events.verify_chain(session.id)
            if not report.ok:
                broken.append(session.id)
        if broken:
            out.append(Check("fail", "event logs", f"{len(broken)} chain(s) break: {broken[0]}..."))
        else:
            out.append(Check("ok", "event logs", f"{len(sessions)} session log(s) verify"))
        status = await rt.sync.status()
        level: Level = "warn" if status.dead_letters else "ok"
        out.append(
            Check(
                level,
                "outbox",
                f"{status.pending} change(s) queued, {status.dead_letters} dead letter(s)",
            )
        )
    except PleachError as exc:
        out.append(Check("fail", "store", str(exc)))
    return out


def _health_url(server: str) -> str:
    parts = urllib.parse.urlsplit(server)
    scheme = "https" if parts.scheme == "wss" else "http"
    return urllib.parse.urlunsplit((scheme, parts.netloc, "/healthz", "", ""))


def _healthz(server: str, timeout: float) -> Check:
    try:
        with urllib.request.urlopen(_health_url(server), timeout=timeout) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:
        return Check("fail", "server", f"{_health_url(server)} answered HTTP {exc.code}")
    except (OSError, ValueError) as exc:
        return Check("fail", "server", f"cannot reach {_health_url(server)}: {exc}")
    return Check("ok", "server", f"{_health_url(server)}: {body.decode(errors='replace')}")


async def check_server(
    server: str,
    token: str | None,
    client_id: str,
    user: str,
    org: str,
    timeout: float = 5.0,
    now_ms: Callable[[], int] | None = None,
) -> list[Check]:
    out = [await asyncio.to_thread(_healthz, server, timeout)]
    if out[0].level == "fail":
        return out
    if not token:
        out.append(Check("warn", "token", "no token given (--token or PLEACH_TOKEN)"))
        return out
    codec = FrameCodec()
    try:
        async with asyncio.timeout(timeout):
            async with websockets.connect(
                server, additional_headers={"Authorization": f"Bearer {token}"}
            ) as ws:
                hello = Hello(protocol=1, client_id=client_id, max_protocol=2, request_id=1)
                await ws.send(codec.encode(hello))
                data = await ws.recv()
                answer = codec.decode(data if isinstance(data, bytes) else data.encode())
    except InvalidStatus as exc:
        body = bytes(exc.response.body or b"").decode(errors="replace")
        return [*out, Check("fail", "token", f"refused: HTTP {exc.response.status_code} {body}")]
    except (OSError, TimeoutError, InvalidHandshake, InvalidURI, msgspec.DecodeError) as exc:
        return [*out, Check("fail", "token", f"no Welcome: {type(exc).__name__}: {exc}")]
    if isinstance(answer, Error):
        return [*out, Check("fail", "token", f"server said {answer.code}: {answer.message}")]
    if not isinstance(answer, Welcome):
        return [*out, Check("fail", "token", f"unexpected answer {type(answer).__name__}")]
    if answer.org_id and (answer.org_id, answer.user_id) != (org, user):
        out.append(
            Check(
                "fail",
                "token",
                f"the token is for {answer.org_id}/{answer.user_id}, this device writes as "
                f"{org}/{user}: use --user/--org or a token for this user",
            )
        )
    else:
        out.append(Check("ok", "token", f"accepted for {org}/{user}, protocol {answer.protocol}"))
    out.append(_clock(answer.server_hlc, now_ms() if now_ms else int(time.time() * 1000)))
    return out


def _clock(server_hlc: str, now_ms: int) -> Check:
    try:
        server_ms = Timestamp.decode(server_hlc).wall_ms
    except InvalidRecord:
        return Check("warn", "clock", "the server did not send its time")
    skew = now_ms - server_ms
    text = f"this device is {abs(skew)} ms {'ahead of' if skew > 0 else 'behind'} the server"
    if skew > CLOCK_FAIL_MS:
        return Check("fail", "clock", text + ": its changes would be refused (3011) until fixed")
    if abs(skew) > CLOCK_WARN_MS:
        return Check("warn", "clock", text)
    return Check("ok", "clock", text)
