"""pleach's side of ``bench.peers``; runs from the project's ``.venv``.

``conversation``: ``SessionRuntime(SQLiteAdapter(path), ScriptedProvider(...))``, one session,
then per turn ``async for _ in rt.execute_message(session_id, user_text): pass``; the scripted
model replies with the turn's 800-byte text (streamed word by word, as the provider does), and
each turn commits its messages, events, audit rows, checkpoint and outbox rows. The file is
measured after the runtime closed.

``sync``: pleach's own live and full-sync figures, from ``bench.bench_sync``'s functions
(``fanout``, ``relay_latency``, ``sync_round``, ``echo_round``) run with this run's round
counts, plus a fresh device pulling another device's K turns. Each part that fails is reported
in the JSON (``failed``) and the others still run.

``python -m bench.peers.pleach_side conversation --dir DIR [--turns N]`` or
``python -m bench.peers.pleach_side sync --dir DIR [--rounds R] [--turns K] [--reps N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from bench.peers.common import (
    assistant_text,
    conversation_figures,
    emit,
    percentile,
    remove_db,
    user_text,
    versions,
)

CLIENT_ID = "bench-peers-device"
PACKAGES = ("pleach", "websockets", "aiosqlite", "msgspec")


# -- conversation ------------------------------------------------------------------------------


async def conversation(turns: int, path: Path) -> list[float]:
    from pleach_client.providers.base import ProviderRequest
    from pleach_client.providers.scripted import ScriptedProvider, ScriptedReply
    from pleach_client.runtime import SessionRuntime
    from pleach_client.store.sqlite import SQLiteAdapter

    replies = 0

    def reply(_: ProviderRequest) -> ScriptedReply:
        nonlocal replies
        text = assistant_text(replies)
        replies += 1
        return ScriptedReply(text=text)

    provider = ScriptedProvider(default_reply=reply)
    seconds: list[float] = []
    async with SessionRuntime(SQLiteAdapter(path), provider, client_id=CLIENT_ID) as rt:
        session_id = (await rt.create_session(title="bench-peers")).id
        for i in range(turns):
            started = time.perf_counter()
            async for _ in rt.execute_message(session_id, user_text(i)):
                pass
            seconds.append(time.perf_counter() - started)
    assert replies == turns, f"{replies} model calls for {turns} turns"
    return seconds


# -- live and full sync ------------------------------------------------------------------------


async def fresh_pull(server: Any, root: Path, label: str, k: int) -> dict[str, Any]:
    """Device A commits K turns and syncs them (not timed); then a fresh device B of the same
    user runs ``sync_once`` (connect, nothing to flush, pull everything, apply): timed."""
    from bench import bench_local, bench_sync
    from pleach_server.auth import issue_token

    tenant = bench_sync.new_tenant(label)
    token = issue_token(bench_sync.SECRET, tenant, 3600)
    async with bench_sync.device(root / f"{label}-a.db", tenant, f"{label}-a") as a:
        session_id = (await a.create_session(title=label)).id
        await bench_local.turns(a, session_id, 0, k)
        changes = await a.store.outbox_count()
        payloads = await bench_sync.outbox_payloads(a)
        mine = await a.store.get_session(session_id)
        assert mine is not None
        want = mine.vv[a.client_id]  # B must reach A's last version of the session
        await a.sync.sync_once(server.url, token, timeout=bench_sync.TIMEOUT)
    async with bench_sync.device(root / f"{label}-b.db", tenant, f"{label}-b") as b:
        pulled: list[int] = []
        pull = b.sync.pull

        async def counted_pull() -> int:
            n = await pull()
            pulled.append(n)
            return n

        b.sync.pull = counted_pull  # type: ignore[method-assign]
        started = time.perf_counter()
        await b.sync.sync_once(server.url, token, timeout=bench_sync.TIMEOUT)
        seconds = time.perf_counter() - started
        theirs = await b.store.get_session(session_id)
        assert theirs is not None and theirs.vv.get(a.client_id, 0) >= want, theirs
    return {"changes": changes, "pulled": sum(pulled), "seconds": seconds, "payloads": payloads}


async def sync_figures(root: Path, rounds: int, k: int, reps: int) -> dict[str, Any]:
    from websockets.asyncio.server import serve

    from bench import bench_sync
    from pleach_server.server import SyncServer
    from pleach_server.store import SQLiteServerStore

    out: dict[str, Any] = {}
    async with (
        SQLiteServerStore(root / "server.db") as store,
        SyncServer(store, port=0, secret=bench_sync.SECRET) as server,
        serve(bench_sync._echo, "127.0.0.1", 0, max_size=None) as echo,
    ):
        echo_url = f"ws://127.0.0.1:{echo.sockets[0].getsockname()[1]}"
        # live: bench_sync's fan-out (A's commit -> B's sync.applied), then its raw relay of
        # one turn's encoded Push
        try:
            latencies, in_store, payload, _, _ = await bench_sync.fanout(server, root, rounds)
            relay = await bench_sync.relay_latency(payload, rounds)
            out["live"] = {
                "rounds": rounds,
                "payload_bytes": len(payload),
                "p50_ms": statistics.median(latencies) * 1e3,
                "p99_ms": percentile(latencies, 99) * 1e3,
                "server_store_push_mean_ms": in_store * 1e3,
                "relay_p50_ms": statistics.median(relay) * 1e3,
                "relay_p99_ms": percentile(relay, 99) * 1e3,
            }
        except Exception as exc:  # report it, go on with the rest
            traceback.print_exc()
            out["live"] = {"failed": f"{type(exc).__name__}: {exc}"}

        # full sync (bench_sync's figure): a device's K offline turns, sync_once (flush + pull
        # back); baseline: the same Push payloads echoed, connect included
        try:
            warm = await bench_sync.sync_round(server, root, "peers-sync-warm", 3)
            await bench_sync.echo_round(echo_url, warm.payloads)
            totals: list[float] = []
            echoes: list[float] = []
            changes = 0
            size = 0
            for rep in range(reps):  # interleaved, so noise hits both alike
                r = await bench_sync.sync_round(server, root, f"peers-sync-{rep}", k)
                changes, size = r.changes, sum(len(p) for p in r.payloads)
                totals.append(r.total)
                echoes.append(await bench_sync.echo_round(echo_url, r.payloads))
            out["sync_once"] = {
                "turns": k,
                "changes": changes,
                "bytes": size,
                "reps": reps,
                "changes_per_s": changes / statistics.median(totals),
                "turns_per_s": k / statistics.median(totals),
                "echo_changes_per_s": changes / statistics.median(echoes),
                "echo_turns_per_s": k / statistics.median(echoes),
            }
        except Exception as exc:
            traceback.print_exc()
            out["sync_once"] = {"failed": f"{type(exc).__name__}: {exc}"}

        # full sync to a fresh device: B pulls A's K turns; baseline: A's Push payloads (the
        # same records; B receives them as Pull batches) echoed, connect included
        try:
            await fresh_pull(server, root, "peers-fresh-warm", 3)
            pulls: list[dict[str, Any]] = []
            echoes = []
            for rep in range(reps):
                pulls.append(await fresh_pull(server, root, f"peers-fresh-{rep}", k))
                echoes.append(await bench_sync.echo_round(echo_url, pulls[-1]["payloads"]))
            changes = pulls[0]["changes"]
            seconds = statistics.median(p["seconds"] for p in pulls)
            out["fresh_pull"] = {
                "turns": k,
                "changes": changes,  # what A made; B applies them all (checked)
                "pull_calls_returned": pulls[0]["pulled"],  # sum of pull()'s counts, for info
                "bytes": sum(len(p) for p in pulls[0]["payloads"]),
                "reps": reps,
                "changes_per_s": changes / seconds,
                "turns_per_s": k / seconds,
                "echo_changes_per_s": changes / statistics.median(echoes),
                "echo_turns_per_s": k / statistics.median(echoes),
            }
        except Exception as exc:
            traceback.print_exc()
            out["fresh_pull"] = {"failed": f"{type(exc).__name__}: {exc}"}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("mode", choices=("conversation", "sync"))
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--turns", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    result: dict[str, Any]
    if args.mode == "conversation":
        path = args.dir / "pleach.db"
        remove_db(path)
        seconds = asyncio.run(conversation(args.turns, path))
        result = conversation_figures(seconds, path)
        remove_db(path)
    else:
        # a fresh directory: the server's and the devices' files must not outlive the run
        with tempfile.TemporaryDirectory(prefix="pleach-sync-", dir=args.dir) as tmp:
            result = asyncio.run(sync_figures(Path(tmp), args.rounds, args.turns, args.reps))
    result["versions"] = versions(*PACKAGES)
    emit(result)


if __name__ == "__main__":
    main()
