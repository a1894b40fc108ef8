"""The ``pleach`` command: chat, sessions, events, sync, status, demo.

Errors print one clear line (``pleach: ...``) and exit non-zero; never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from shared.errors import PleachError

from .providers.base import Provider
from .runtime import SessionRuntime
from .store.sqlite import SQLiteAdapter
from .stream import (
    ErrorEvent,
    MessageComplete,
    MessageDelta,
    ToolCompleted,
    ToolFailed,
    ToolStarted,
    TurnComplete,
)

DEFAULT_DB = "pleach.db"
DEFAULT_USER = "anonymous"
DEFAULT_ORG = "default"


def _globals(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    """``--db``, ``--user`` and ``--org``, accepted before or after the subcommand."""

    def d(value: str) -> str:
        return value if defaults else argparse.SUPPRESS

    parser.add_argument(
        "--db",
        default=d(os.environ.get("PLEACH_CLIENT_DB", DEFAULT_DB)),
        help="device database file (env PLEACH_CLIENT_DB; default ./pleach.db)",
    )
    parser.add_argument(
        "--user",
        default=d(os.environ.get("PLEACH_USER", DEFAULT_USER)),
        help=f"user id (env PLEACH_USER; default {DEFAULT_USER!r})",
    )
    parser.add_argument(
        "--org",
        default=d(os.environ.get("PLEACH_ORG", DEFAULT_ORG)),
        help=f"org id (env PLEACH_ORG; default {DEFAULT_ORG!r})",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        default=False if defaults else argparse.SUPPRESS,
        help="print results as JSON (for scripts) instead of text",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pleach", description="pleach: offline-first agent sessions"
    )
    _globals(parser, defaults=True)
    common = argparse.ArgumentParser(add_help=False)
    _globals(common, defaults=False)
    sub = parser.add_subparsers(dest="command", required=True)

    chat = sub.add_parser("chat", parents=[common], help="chat in a session, streaming replies")
    chat.add_argument("--session", help="continue this session id")
    chat.add_argument(
        "--offline",
        action="store_true",
        help="use the scripted offline provider (no API key, no network)",
    )
    chat.add_argument("--model", help="model for a new session")
    chat.add_argument(
        "-m",
        "--message",
        action="append",
        help="send this message and exit (repeatable); otherwise read lines",
    )

    sessions = sub.add_parser("sessions", parents=[common], help="list, show or delete sessions")
    ssub = sessions.add_subparsers(dest="action", required=True)
    ssub.add_parser("list", parents=[common])
    show = ssub.add_parser("show", parents=[common])
    show.add_argument("session_id")
    delete = ssub.add_parser("delete", parents=[common])
    delete.add_argument("session_id")

    events = sub.add_parser("events", parents=[common], help="event-log tools")
    esub = events.add_subparsers(dest="action", required=True)
    verify = esub.add_parser("verify", parents=[common], help="verify a session's hash chain")
    verify.add_argument("session_id")

    sync = sub.add_parser("sync", parents=[common], help="flush the outbox and pull, once")
    sync.add_argument(
        "--server",
        required="PLEACH_SERVER" not in os.environ,
        default=os.environ.get("PLEACH_SERVER"),
        help="ws://host:port/sync",
    )
    sync.add_argument(
        "--token", required="PLEACH_TOKEN" not in os.environ, default=os.environ.get("PLEACH_TOKEN")
    )
    sync.add_argument("--timeout", type=float, default=30.0)

    sub.add_parser("status", parents=[common], help="what is pending, stuck or synced")
    doctor = sub.add_parser(
        "doctor", parents=[common], help="check the store, the server, the token and the clock"
    )
    doctor.add_argument("--server", default=os.environ.get("PLEACH_SERVER"), help="ws://.../sync")
    doctor.add_argument("--token", default=os.environ.get("PLEACH_TOKEN"))
    dead = sub.add_parser(
        "dead-letters", parents=[common], help="changes the server refused: list, retry, discard"
    )
    dsub = dead.add_subparsers(dest="action", required=True)
    dsub.add_parser("list", parents=[common])
    retry = dsub.add_parser("retry", parents=[common], help="queue it again (a new client_seq)")
    retry.add_argument("client_seq", type=int)
    discard = dsub.add_parser("discard", parents=[common], help="forget it for good")
    discard.add_argument("client_seq", type=int)
    demo = sub.add_parser(
        "demo", parents=[common], help="two devices and a server, offline and back, no API key"
    )
    demo.add_argument("--keep", help="keep the demo files in this folder")
    return parser


def _provider(offline: bool) -> Provider:
    if offline:
        from .providers.scripted import ScriptedProvider, echo_reply

        delay = float(os.environ.get("PLEACH_OFFLINE_DELAY", "0") or 0)
        if delay <= 0:
            return ScriptedProvider()
        # A slower offline model (seconds per streamed word), for demos and trying Ctrl-C.
        return ScriptedProvider(
            default_reply=lambda request: dataclasses.replace(echo_reply(request), delay=delay)
        )
    if not os.environ.get("ANTHROPIC_API_KEY"):
        raise PleachError(
            "ANTHROPIC_API_KEY is not set. Set it to chat with Claude, "
            "or run `pleach chat --offline` for the scripted offline provider."
        )
    from .providers.anthropic import AnthropicProvider

    return AnthropicProvider.from_env()


class _Controls:
    """Ctrl-C and SIGTERM for ``pleach chat``: Ctrl-C during a turn aborts the turn (it is
    committed and accounted, as any abort) and returns to the prompt; Ctrl-C at the prompt,
    or SIGTERM at any time (after aborting a running turn), ends the chat."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.turn: asyncio.Event | None = None
        self.stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGINT, self._interrupt)
        loop.add_signal_handler(signal.SIGTERM, self._terminate)

    def _interrupt(self) -> None:
        if self.turn is not None and not self.turn.is_set():
            self.turn.set()
        else:
            self.stop.set()

    def _terminate(self) -> None:
        if self.turn is not None:
            self.turn.set()
        self.stop.set()

    async def until_stopped(self, waiting: Any) -> Any:
        """The result of ``waiting``, or None if the chat is stopped first."""
        task = asyncio.ensure_future(waiting)
        stopped = asyncio.ensure_future(self.stop.wait())
        done, _ = await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if task in done:
            return task.result()
        task.cancel()
        return None

    def close(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            self.loop.remove_signal_handler(signum)


def _stdin_lines(loop: asyncio.AbstractEventLoop) -> asyncio.Queue[str | None]:
    """Lines of stdin, read by a daemon thread (so a Ctrl-C at the prompt ends the chat at
    once instead of waiting for Enter); None at the end of input."""
    queue: asyncio.Queue[str | None] = asyncio.Queue()

    def read() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(queue.put_nowait, line)
        loop.call_soon_threadsafe(queue.put_nowait, None)

    threading.Thread(target=read, name="pleach-stdin", daemon=True).start()
    return queue


WAITING_NOTICE_AFTER = 2.0


async def _waiting_notice() -> None:
    """A sign of life when the model has not started answering after a moment."""
    await asyncio.sleep(WAITING_NOTICE_AFTER)
    _out("(waiting for the model... Ctrl-C aborts)")


def _out(text: str = "", end: str = "\n") -> None:
    sys.stdout.write(text + end)
    sys.stdout.flush()


async def _chat(args: argparse.Namespace) -> int:
    provider = _provider(args.offline)
    async with SessionRuntime(
        SQLiteAdapter(args.db), provider, user_id=args.user, org_id=args.org
    ) as rt:
        if args.session:
            handle = await rt.resume_session(args.session)
            _out(
                f"resumed session {handle.id} ({handle.provider}/{handle.model}, "
                f"{len(handle.message_ids)} messages)"
            )
        else:
            handle = await rt.create_session(model=args.model)
            _out(f"new session {handle.id} ({handle.provider}/{handle.model})")
        if (args.user, args.org) == (DEFAULT_USER, DEFAULT_ORG):
            _out(
                f"(as user {DEFAULT_USER!r} of org {DEFAULT_ORG!r}: set --user/--org or "
                "PLEACH_USER/PLEACH_ORG to sync as yourself)"
            )
        messages = args.message if args.message else None
        failed = False
        controls = _Controls(asyncio.get_running_loop())
        lines = None if messages is not None else _stdin_lines(asyncio.get_running_loop())
        try:
            while not controls.stop.is_set():
                if messages is not None:
                    if not messages:
                        break
                    text = messages.pop(0).strip()
                    if not text:
                        _out("(empty message skipped)")
                        continue
                    _out(f"> {text}")
                else:
                    assert lines is not None
                    _out("> ", end="")
                    line = await controls.until_stopped(lines.get())
                    if line is None:  # end of input, Ctrl-C or SIGTERM at the prompt
                        _out()
                        break
                    # Bytes that are not UTF-8 become U+FFFD rather than failing the turn.
                    text = line.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
                    text = text.strip()
                    if not text:
                        continue
                    if text.startswith("/"):
                        if await _slash(text, rt, handle.id, args):
                            break
                        continue
                controls.turn = asyncio.Event()
                waiting = asyncio.create_task(_waiting_notice())
                async for event in rt.execute_message(handle.id, text, abort=controls.turn):
                    if event.type not in ("message.added", "stream.started"):
                        waiting.cancel()
                    match event:
                        case MessageDelta(delta=delta):
                            _out(delta, end="")
                        case MessageComplete():
                            _out()
                        case ToolStarted(name=name, input=tool_input):
                            _out(f"[tool {name} {tool_input}]")
                        case ToolCompleted(output=output):
                            _out(f"[tool -> {output}]")
                        case ToolFailed(error=error):
                            _out(f"[tool failed: {error}]")
                        case ErrorEvent(code=code, error=error):
                            _out(f"error ({code}): {error}")
                        case TurnComplete(outcome=outcome):
                            if outcome == "user-aborted":
                                _out("\n(turn aborted; what was said so far is kept)")
                            failed = failed or outcome not in ("ok", "user-aborted")
                waiting.cancel()
                controls.turn = None
        finally:
            controls.close()
        _out(f"session {handle.id} saved in {args.db}")
    return 1 if failed else 0


def _runtime(args: argparse.Namespace) -> SessionRuntime:
    """The runtime of a command that reads the device file (which must exist)."""
    _existing_db(args)
    return SessionRuntime(SQLiteAdapter(args.db), user_id=args.user, org_id=args.org)


def _existing_db(args: argparse.Namespace) -> str:
    """The device database of a command that reads one: it must exist (a typo in ``--db``
    would otherwise create an empty database and show nothing)."""
    if not os.path.exists(args.db):
        raise PleachError(
            f"no device database at {args.db} (give --db, or start one with `pleach chat`)"
        )
    return str(args.db)


SLASH_HELP = """commands (not sent to the model):
  /help      this list
  /sessions  the sessions in this file
  /status    what is queued, refused or synced
  /quit      end the chat (Ctrl-D or Ctrl-C at the prompt too)
Ctrl-C during a reply aborts the turn and keeps what was said."""


async def _slash(text: str, rt: SessionRuntime, session_id: str, args: argparse.Namespace) -> bool:
    """Run a chat command; True when the chat should end."""
    command = text.split()[0].lower()
    if command in ("/quit", "/exit"):
        return True
    if command == "/help":
        _out(SLASH_HELP)
    elif command == "/sessions":
        for s in await rt.sessions.list():
            mark = "*" if s.id == session_id else " "
            _out(f"{mark} {s.id}  {len(s.state.message_ids)} messages  {s.title or '(untitled)'}")
    elif command == "/status":
        _print_status(await rt.sync.status())
    else:
        _out(f"unknown command {command}: /help lists them (nothing was sent to the model)")
    return False


async def _sessions(args: argparse.Namespace) -> int:
    async with _runtime(args) as rt:
        if args.action == "list":
            rows = await rt.sessions.list()
            if not rows:
                _out("no sessions")
            for s in rows:
                fork = f" fork of {s.forked_from}" if s.forked_from else ""
                _out(
                    f"{s.id}  {s.provider}/{s.model}  {len(s.state.message_ids)} messages  "
                    f"{s.title or '(untitled)'}{fork}"
                )
        elif args.action == "show":
            messages = await rt.sessions.messages(args.session_id)
            for m in messages:
                for block in m.content:
                    kind = block.get("type")
                    if kind == "text":
                        body = block.get("text", "")
                    elif kind == "tool_use":
                        body = f"[tool_use {block.get('name')} {block.get('input')}]"
                    elif kind == "tool_result":
                        body = f"[tool_result {block.get('content')}]"
                    else:
                        continue
                    flag = " (aborted)" if m.aborted else ""
                    _out(f"{m.role}{flag}: {body}")
        else:
            receipt = await rt.delete_session(args.session_id)
            if args.json:
                _out(msgspec.json.encode(receipt).decode())
            elif receipt.deleted:
                _out(
                    f"deleted session {receipt.session_id} (its messages, "
                    f"{receipt.checkpoints_removed} checkpoint(s) and artifacts; the event log "
                    "and audit rows stay); other devices delete it when they sync"
                )
            else:
                _out(f"session {receipt.session_id} was not deleted")
            return 0 if receipt.deleted else 1
    return 0


async def _events(args: argparse.Namespace) -> int:
    async with _runtime(args) as rt:
        report = await rt.events.verify_chain(args.session_id)
        if report.ok:
            _out(f"ok: {report.checked} events verify (head {report.head_hash[:16]})")
            return 0
        _out(f"broken at index {report.first_bad_index}: {report.reason}")
        return 1


async def _sync(args: argparse.Namespace) -> int:
    async with _runtime(args) as rt:
        receipt = await rt.sync.sync_once(args.server, args.token, timeout=args.timeout)
        status = await rt.sync.status()
        if args.json:
            _out(msgspec.json.encode(receipt).decode())
            _out(msgspec.json.encode(status).decode())
        else:
            _out(
                f"sent {receipt.flushed} change(s); {len(receipt.failed_entries)} refused or "
                f"stuck; {receipt.pending_after} still queued"
            )
            for failed in receipt.failed_entries:
                _out(f"  change {failed.client_seq}: {failed.code or '-'} {failed.message}")
            for conflict in receipt.conflicts:
                _out(
                    f"  conflict in session {conflict.session_id}: the {conflict.winner} "
                    f"version kept the session, the other lives on as {conflict.fork_session_id}"
                )
            _print_status(status)
        return 0 if receipt.outcome in ("all-flushed", "none-pending") else 1


def _ago(stamp: float | None) -> str:
    if stamp is None:
        return "never"
    seconds = max(0, int(time.time() - stamp))
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp))
    if seconds < 120:
        return f"{when} ({seconds} s ago)"
    if seconds < 7200:
        return f"{when} ({seconds // 60} min ago)"
    return f"{when} ({seconds // 3600} h ago)"


def _print_status(status: Any) -> None:
    state = status.state
    if state == "offline" and status.has_synced:
        state = "not connected now (this command does not stay connected)"
    rows = [
        ("state", state),
        ("queued", f"{status.pending} change(s) not yet on the server"),
        ("dead letters", f"{status.dead_letters} (pleach dead-letters list)"),
        ("last synced", _ago(status.last_synced_at)),
        ("feed cursor", str(status.cursor)),
    ]
    if status.last_error:
        code = f" [{status.last_error_code}]" if status.last_error_code else ""
        rows.append(("last error", f"{status.last_error}{code}"))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        _out(f"{name:<{width}}  {value}")


async def _status(args: argparse.Namespace) -> int:
    async with _runtime(args) as rt:
        status = await rt.sync.status()
        if args.json:
            _out(msgspec.json.encode(status).decode())
            return 0
        _print_status(status)
        for dead in await rt.sync.dead_letters():
            _out(f"  dead letter {dead.client_seq}: {dead.code} {dead.message}")
    return 0


async def _dead_letters(args: argparse.Namespace) -> int:
    async with _runtime(args) as rt:
        if args.action == "list":
            letters = await rt.sync.dead_letters()
            if not letters:
                _out("no dead letters")
            for dead in letters:
                record = dead.record
                _out(
                    f"{dead.client_seq}  {type(record).__name__} {record.id}  {dead.code}: "
                    f"{dead.message}  ({dead.attempts} attempts)"
                )
            return 0
        if args.action == "retry":
            seq = await rt.sync.retry_dead_letter(args.client_seq)
            if seq is None:
                raise PleachError(f"no dead letter {args.client_seq}")
            _out(f"queued again as {seq}; it goes with the next sync")
            return 0
        if not await rt.sync.discard_dead_letter(args.client_seq):
            raise PleachError(f"no dead letter {args.client_seq}")
        _out(f"dead letter {args.client_seq} discarded")
        return 0


async def _doctor(args: argparse.Namespace) -> int:
    from .doctor import check_server, check_store

    checks = await check_store(args.db, args.user, args.org)
    if args.server:
        client_id = "doctor"
        if await asyncio.to_thread(os.path.exists, args.db):
            async with SQLiteAdapter(args.db) as store:
                client_id = await store.get_meta("client_id") or client_id
        checks += await check_server(args.server, args.token, client_id, args.user, args.org)
    else:
        from .doctor import Check

        checks.append(Check("warn", "server", "not checked: give --server (or PLEACH_SERVER)"))
    if args.json:
        _out(msgspec.json.encode(checks).decode())
    else:
        width = max(len(c.name) for c in checks)
        for check in checks:
            _out(f"{check.level:<4}  {check.name:<{width}}  {check.detail}")
    return 1 if any(c.level == "fail" for c in checks) else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handlers: dict[str, Any] = {
        "chat": _chat,
        "sessions": _sessions,
        "events": _events,
        "sync": _sync,
        "status": _status,
        "dead-letters": _dead_letters,
        "doctor": _doctor,
    }
    try:
        if args.command == "demo":
            from .demo import run_demo

            return asyncio.run(run_demo(keep=args.keep))
        return int(asyncio.run(handlers[args.command](args)))
    except PleachError as exc:
        sys.stderr.write(f"pleach: {exc}\n")
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`| head`): whatever turn was running is committed as
        # aborted already; leave quietly, as a command killed by SIGPIPE would.
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return 141
    except OSError as exc:
        sys.stderr.write(f"pleach: {exc}\n")
        return 2


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
