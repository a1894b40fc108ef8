"""OpenAI Agents SDK ``SQLiteSession`` (package ``openai-agents``); runs from ``.venv-peers``.

``agents.SQLiteSession(session_id, db_path)``, then per turn
``await session.add_items([user item, assistant item])`` with the turn's 200-byte user text and
800-byte assistant text as ``{"role": ..., "content": ...}`` input items. No model call and no
checkpoint: the session is a message history only (one JSON row per item), which is all the SDK
keeps between runs. The file is measured after ``session.close()``.

``python -m bench.peers.peer_openai_agents --dir DIR [--turns N]``.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from bench.peers.common import (
    assistant_text,
    conversation_figures,
    emit,
    remove_db,
    turn_args,
    user_text,
    versions,
)

PACKAGES = ("openai-agents", "openai")
SESSION_ID = "bench-session"


async def run(turns: int, path: Path) -> list[float]:
    from agents import SQLiteSession  # type: ignore[import-not-found,unused-ignore]

    session = SQLiteSession(SESSION_ID, str(path))
    seconds: list[float] = []
    try:
        for i in range(turns):
            items: list[Any] = [
                {"role": "user", "content": user_text(i)},
                {"role": "assistant", "content": assistant_text(i)},
            ]
            started = time.perf_counter()
            await session.add_items(items)
            seconds.append(time.perf_counter() - started)
        stored = await session.get_items()
        assert len(stored) == 2 * turns, len(stored)
    finally:
        session.close()
    return seconds


def main() -> None:
    args = turn_args(__doc__.split("\n\n")[0] if __doc__ else "")
    path = args.dir / "openai-agents.db"
    remove_db(path)
    try:
        seconds = asyncio.run(run(args.turns, path))
        result = conversation_figures(seconds, path)
    finally:
        remove_db(path)
    result["versions"] = versions(*PACKAGES)
    emit(result)


if __name__ == "__main__":
    main()
