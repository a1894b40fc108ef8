"""A subprocess for the durability test: runs turns forever, printing each committed turn.

Usage: python -m tests.scripts.turn_writer DB_PATH SESSION_ID_FILE
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from pleach_client.providers.scripted import ScriptedProvider, ScriptedReply
from pleach_client.runtime import SessionRuntime
from pleach_client.store.sqlite import SQLiteAdapter


async def main(db: str, session_file: str) -> None:
    reply = ScriptedReply(
        text="a reply of several words", tool_calls=[("calculator", {"expression": "2+3"})]
    )
    provider = ScriptedProvider(
        default_reply=lambda req: (
            reply if len(req.messages) % 4 == 1 else ScriptedReply(text="done")
        )
    )
    async with SessionRuntime(SQLiteAdapter(db), provider, user_id="u", org_id="o") as rt:
        path = Path(session_file)
        if path.exists():
            session_id = (await rt.resume_session(path.read_text().strip())).id
        else:
            session_id = (await rt.create_session()).id
            path.write_text(session_id)
        n = 0
        while True:
            async for event in rt.execute_message(session_id, f"turn {n}"):
                if event.type == "turn.complete":
                    sys.stdout.write(f"committed {n}\n")
                    sys.stdout.flush()
            n += 1


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
