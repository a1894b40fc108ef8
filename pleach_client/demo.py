"""``pleach demo``: two devices and a sync server, offline and back, with no network or key.

The server runs as its own process (``pleach-server`` on a free loopback port, embedded
SQLite); the laptop and the phone are two runtimes, each on its own SQLite file, using the
scripted offline provider. Each step is printed as it happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from .providers.scripted import ScriptedProvider
from .runtime import SessionRuntime
from .store.sqlite import SQLiteAdapter
from .stream import MessageComplete


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


async def _start_server(folder: Path) -> tuple[asyncio.subprocess.Process, str, str]:
    env = {**os.environ, "PLEACH_SECRET": "demo-secret-" + os.urandom(8).hex()}
    db = folder / "server.db"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "pleach_server.cli",
        "--port",
        "0",
        "--db",
        str(db),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
    )
    assert proc.stdout is not None
    url = ""
    async with asyncio.timeout(30):
        while not url:
            line = (await proc.stdout.readline()).decode()
            if not line:
                raise RuntimeError("pleach-server exited before it listened")
            found = re.search(r"(ws://\S+/sync)", line)
            if found:
                url = found.group(1)
    token_proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "pleach_server.cli",
        "token",
        "create",
        "--user",
        "demo-user",
        "--org",
        "demo",
        "--db",
        str(db),
        stdout=asyncio.subprocess.PIPE,
        env=env,
    )
    out, _ = await token_proc.communicate()
    return proc, url, out.decode().strip()


async def _chat(rt: SessionRuntime, session_id: str, who: str, text: str) -> None:
    _say(f"  [{who}] you: {text}")
    reply = ""
    async for event in rt.execute_message(session_id, text):
        if isinstance(event, MessageComplete):
            reply = "".join(b.get("text", "") for b in event.content if b.get("type") == "text")
    _say(f"  [{who}] assistant: {reply}")


async def run_demo(keep: str | None = None) -> int:
    folder = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="pleach-demo-"))
    folder.mkdir(parents=True, exist_ok=True)
    server, url, token = await _start_server(folder)
    try:
        _say(f"1. sync server started: {url} (data in {folder / 'server.db'})")
        async with contextlib.AsyncExitStack() as stack:
            laptop = await stack.enter_async_context(
                SessionRuntime(
                    SQLiteAdapter(folder / "laptop.db"),
                    ScriptedProvider(),
                    user_id="demo-user",
                    org_id="demo",
                    client_id="laptop",
                )
            )
            phone = await stack.enter_async_context(
                SessionRuntime(
                    SQLiteAdapter(folder / "phone.db"),
                    ScriptedProvider(),
                    user_id="demo-user",
                    org_id="demo",
                    client_id="phone",
                )
            )

            _say("2. the laptop chats offline (on a plane):")
            session = await laptop.create_session(title="trip plan")
            await _chat(laptop, session.id, "laptop", "Plan a day in Lisbon")
            status = await laptop.sync.status()
            _say(f"   laptop sync status: {status.state}, {status.pending} changes pending")

            _say("3. the laptop lands and syncs:")
            await laptop.sync.connect(url, token)
            await laptop.sync.wait_until_synced(30)
            status = await laptop.sync.status()
            _say(f"   laptop: {status.state}, pending {status.pending}, cursor {status.cursor}")

            _say("4. the phone connects and continues the same session:")
            await phone.sync.connect(url, token)
            await phone.sync.wait_until_synced(30)
            handle = await phone.resume_session(session.id)
            _say(f"   phone sees {len(handle.message_ids)} messages of '{handle.title}'")
            await _chat(phone, session.id, "phone", "Add a good lunch spot")
            await phone.sync.wait_until_synced(30)
            await laptop.sync.wait_until_synced(30)

            _say("5. both go offline and edit the session at the same time:")
            await laptop.sync.disconnect()
            await phone.sync.disconnect()
            await _chat(laptop, session.id, "laptop", "Make it a rainy-day plan")
            await _chat(phone, session.id, "phone", "Make it a sunny-day plan")

            conflicts: list[object] = []
            laptop.events.on("sync.conflict", conflicts.append)
            phone.events.on("sync.conflict", conflicts.append)
            _say("6. both reconnect:")
            await laptop.sync.connect(url, token)
            await laptop.sync.wait_until_synced(30)
            await phone.sync.connect(url, token)
            await phone.sync.wait_until_synced(30)
            await laptop.sync.wait_until_synced(30)
            for event in conflicts[:1]:
                paths = ", ".join(p.path for p in event.conflicted_paths)  # type: ignore[attr-defined]
                _say(
                    f"   conflict {event.conflict_id}: winner {event.winner}, "  # type: ignore[attr-defined]
                    f"diverged {paths}"
                )
                _say(f"   the other branch lives on as fork {event.fork_session_id}")  # type: ignore[attr-defined]
            _say(f"   sync.conflict events seen on the devices: {len(conflicts)}")

            _say("7. both devices end identical:")
            same = True
            for sid in sorted({s.id for s in await laptop.sessions.list()}):
                a = await laptop.sessions.messages(sid)
                b = await phone.sessions.messages(sid)
                same = same and [m.id for m in a] == [m.id for m in b]
                row = await laptop.sessions.find(sid)
                kind = f"fork of {row.forked_from[:8]}" if row and row.forked_from else "session"
                _say(f"   {sid[:8]} ({kind}): laptop {len(a)} messages, phone {len(b)}")
            _say("   identical: yes" if same else "   identical: NO")
            return 0 if same and conflicts else 1
    finally:
        server.terminate()
        with contextlib.suppress(ProcessLookupError):
            await server.wait()
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)
