"""A subprocess for the second-writer test: N turns on one session of a shared device file.

Usage: python -m tests.writer_proc DB_PATH SESSION_ID LABEL TURNS

Opens the runtime, prints ``ready``, waits for a line on stdin (so two processes start their
turns together), then runs TURNS turns with the user text ``LABEL <n>``, printing
``committed <n>`` after each. A ``PleachError`` (the runtime refusing a second writer) prints
``refused: <message>`` and exits with status 3; anything else is a crash (traceback, status 1).
"""

from __future__ import annotations

import asyncio
import sys

from pleach_client.providers.scripted import ScriptedProvider
from pleach_client.runtime import SessionRuntime
from pleach_client.store.sqlite import SQLiteAdapter
from shared.errors import PleachError

REFUSED = 3


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def run(db: str, session_id: str, label: str, turns: int) -> int:
    try:
        async with SessionRuntime(
            SQLiteAdapter(db), ScriptedProvider(), user_id="u", org_id="o"
        ) as rt:
            say("ready")
            await asyncio.to_thread(sys.stdin.readline)
            await rt.resume_session(session_id)
            for n in range(turns):
                async for _ in rt.execute_message(session_id, f"{label} {n}"):
                    pass
                say(f"committed {n}")
    except PleachError as exc:
        say(f"refused: {type(exc).__name__}: {exc}")
        return REFUSED
    say("done")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(run(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))))
