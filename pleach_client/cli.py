"""The ``pleach`` command: chat, sessions, events, sync, status, doctor, demo.

Errors print one clear line (``pleach: ...``) and exit non-zero; never a traceback. On a
terminal the output is drawn with ``rich`` (tables, colours, a progress bar for a long sync);
into a pipe or a file it is plain lines, and ``--json`` is machine JSON. ``rich`` is imported
only by the functions that draw, so ``pleach --help`` and piped commands do not load it.
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
from typing import TYPE_CHECKING, Any, Final, NoReturn

import msgspec

from shared.errors import PleachError

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID
    from rich.table import Table
    from rich.text import Text

    from shared.messages import ConflictReceipt

    from .providers.base import Provider
    from .runtime import SessionRuntime
    from .store.base import DeadLetter
    from .sync import SyncProgress, SyncStatus

DEFAULT_DB = "pleach.db"
DEFAULT_USER = "anonymous"
DEFAULT_ORG = "default"


ENVIRONMENT = """environment variables:
  PLEACH_CLIENT_DB        the device database file (--db; default ./pleach.db)
  PLEACH_USER, PLEACH_ORG who this device writes as (--user, --org)
  PLEACH_SERVER           the sync server, ws://host:port/sync (--server of sync and doctor)
  PLEACH_TOKEN            the device's token for that server (--token)
  ANTHROPIC_API_KEY       the key `pleach chat` calls Claude with (not needed with --offline)
  ANTHROPIC_BASE_URL      another address for the Anthropic API
  PLEACH_CONNECT_TIMEOUT  seconds to connect to the model before giving up (default 10)
  PLEACH_READ_TIMEOUT     seconds the model may stay silent before giving up (default 60)
  PLEACH_OFFLINE_DELAY    seconds per streamed word of the offline model (default 0)
  NO_COLOR                any value: no colours (as --no-color)"""


class _UsageError(Exception):
    """A command line argparse refused: reported in one line by ``main``."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        if self.prog == "pleach sync" and "://" in message:  # `pleach sync ws://...`
            message += ": give the server as --server URL"
        raise _UsageError(f"{self.prog}: {message} (see `{self.prog} --help`)")


def _globals(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    """``--db``, ``--user``, ``--org``, ``--json`` and ``--no-color``, accepted before or
    after the subcommand."""

    def d(value: Any) -> Any:
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
        default=d(False),
        help="print results as JSON (for scripts) instead of text",
    )
    parser.add_argument(
        "--no-color",
        action="store_true",
        default=d(False),
        help="no colours on a terminal (env NO_COLOR too); piped output never has any",
    )


def _dead_letters_parser(sub: argparse._SubParsersAction[_Parser], common: _Parser) -> None:
    dead = sub.add_parser(
        "dead-letters", parents=[common], help="changes the server refused: list, retry, discard"
    )
    dsub = dead.add_subparsers(dest="action", required=True)
    dsub.add_parser("list", parents=[common], help="each refused change and the reason")
    retry = dsub.add_parser("retry", parents=[common], help="queue it again (a new client_seq)")
    retry.add_argument("client_seq", type=int)
    discard = dsub.add_parser("discard", parents=[common], help="forget it for good")
    discard.add_argument("client_seq", type=int)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pleach",
        description="pleach: offline-first agent sessions",
        epilog=ENVIRONMENT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _globals(parser, defaults=True)
    common = _Parser(add_help=False)
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

    sync = sub.add_parser(
        "sync",
        parents=[common],
        help="flush the outbox and pull, once (or: sync dead-letters list|retry|discard)",
        description="Send what is queued and pull what is new, once, with a progress bar on "
        "a terminal when it takes a while. `pleach sync dead-letters ...` lists, retries or "
        "discards the changes the server refused.",
    )
    # Not required here: `pleach sync dead-letters list` needs neither (checked in _sync).
    sync.add_argument(
        "--server",
        default=os.environ.get("PLEACH_SERVER"),
        help="ws://host:port/sync (env PLEACH_SERVER)",
    )
    sync.add_argument(
        "--token",
        default=os.environ.get("PLEACH_TOKEN"),
        help="this device's token (env PLEACH_TOKEN)",
    )
    sync.add_argument("--timeout", type=float, default=30.0, help="seconds (default 30)")
    _dead_letters_parser(sync.add_subparsers(dest="sync_command", metavar="dead-letters"), common)

    sub.add_parser("status", parents=[common], help="what is pending, stuck or synced")
    doctor = sub.add_parser(
        "doctor", parents=[common], help="check the store, the server, the token and the clock"
    )
    doctor.add_argument(
        "--server",
        default=os.environ.get("PLEACH_SERVER"),
        help="ws://.../sync (env PLEACH_SERVER)",
    )
    doctor.add_argument(
        "--token", default=os.environ.get("PLEACH_TOKEN"), help="(env PLEACH_TOKEN)"
    )
    _dead_letters_parser(sub, common)
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


def _no_color(args: argparse.Namespace | None) -> bool:
    """``--no-color``, or ``NO_COLOR`` set to anything (https://no-color.org)."""
    return bool(getattr(args, "no_color", False)) or bool(os.environ.get("NO_COLOR"))


def _console(args: argparse.Namespace | None, *, err: bool = False) -> Console | None:
    """A rich console on stdout (or stderr) when that stream is a terminal; None when it is
    not: the command then prints plain lines, stable for grep and scripts (and rich is not
    even imported)."""
    stream = sys.stderr if err else sys.stdout
    try:
        if not stream.isatty():
            return None
    except ValueError:  # closed
        return None
    from rich.console import Console

    # markup and highlighting off: titles, messages and reasons are shown as they are.
    return Console(
        file=stream, no_color=_no_color(args), markup=False, highlight=False, emoji=False
    )


def _table(*headers: str) -> Table:
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, header_style="bold", pad_edge=False, show_edge=False)
    for header in headers:
        table.add_column(header)
    return table


def _text(value: str, style: str = "") -> Text:
    from rich.text import Text

    return Text(value, style=style)


LEVEL_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red"}


def _error_line(line: str, args: argparse.Namespace | None, no_color: bool = False) -> None:
    """A failure's reason on stderr: one line, red on a terminal."""
    console = None if no_color else _console(args, err=True)
    if console is None:
        sys.stderr.write(line + "\n")
    else:
        console.print(_text(line, "red"), soft_wrap=True)


async def _chat(args: argparse.Namespace) -> int:
    from .stream import (
        ErrorEvent,
        MessageComplete,
        MessageDelta,
        ToolCompleted,
        ToolFailed,
        ToolStarted,
        TurnComplete,
    )

    async with _runtime(args, may_start=True, provider=_provider(args.offline)) as rt:
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


def _runtime(
    args: argparse.Namespace, *, may_start: bool = False, provider: Provider | None = None
) -> SessionRuntime:
    """The runtime of a command that reads the device file, which must exist unless the
    command ``may_start`` a new device (``pleach sync``, ``pleach chat``)."""
    from .runtime import SessionRuntime
    from .store.sqlite import SQLiteAdapter

    if not may_start:
        _existing_db(args)
    return SessionRuntime(SQLiteAdapter(args.db), provider, user_id=args.user, org_id=args.org)


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
        _print_status(await rt.sync.status(), args)
    else:
        _out(f"unknown command {command}: /help lists them (nothing was sent to the model)")
    return False


def _json(value: Any) -> None:
    _out(msgspec.json.encode(value).decode())


_KEPT_WHY: Final = (
    " (a conflict was resolved into it on one device while another deleted it: the delete won,"
    " and what the resolve moved was kept here)"
)


async def _sessions(args: argparse.Namespace) -> int:
    async with _runtime(args) as rt:
        if args.action == "list":
            rows = await rt.sessions.list()
            if args.json:
                _json(rows)
                return 0
            console = _console(args)
            if console is None:
                if not rows:
                    _out("no sessions")
                for s in rows:
                    fork = f" fork of {s.forked_from}" if s.forked_from else ""
                    if s.state.kept_from:
                        fork = f" kept beside the delete of {s.state.kept_from}" + _KEPT_WHY
                    _out(
                        f"{s.id}  {s.provider}/{s.model}  {len(s.state.message_ids)} messages  "
                        f"{s.title or '(untitled)'}{fork}"
                    )
                return 0
            if not rows:
                console.print(_text("no sessions", "dim"))
                return 0
            forks = any(s.forked_from for s in rows)
            table = _table("session", "model", "messages", "title", *(["fork of"] if forks else []))
            table.columns[2].justify = "right"
            for s in rows:
                cells = [
                    _text(s.id, "cyan"),
                    _text(f"{s.provider}/{s.model}"),
                    _text(str(len(s.state.message_ids))),
                    _text(s.title, "bold") if s.title else _text("(untitled)", "dim"),
                ]
                if forks:
                    kept = " (kept beside its delete)" if s.state.kept_from else ""
                    cells.append(_text((s.forked_from or "") + kept, "yellow"))
                table.add_row(*cells)
            console.print(table)
        elif args.action == "show":
            messages = await rt.sessions.messages(args.session_id)
            if args.json:
                _json(messages)
                return 0
            console = _console(args)
            for m in messages:
                for block in m.content:
                    kind = block.get("type")
                    if kind == "text":
                        body, style = block.get("text", ""), ""
                    elif kind == "tool_use":
                        body = f"[tool_use {block.get('name')} {block.get('input')}]"
                        style = "dim"
                    elif kind == "tool_result":
                        body, style = f"[tool_result {block.get('content')}]", "dim"
                    else:
                        continue
                    flag = " (aborted)" if m.aborted else ""
                    if console is None:
                        _out(f"{m.role}{flag}: {body}")
                        continue
                    line = _text(m.role, "bold cyan" if m.role == "user" else "bold green")
                    line.append(flag, style="yellow")
                    line.append(": ")
                    line.append(body, style=style)
                    console.print(line)
        else:
            receipt = await rt.delete_session(args.session_id)
            if args.json:
                _json(receipt)
            elif receipt.deleted:
                _say(
                    args,
                    f"deleted session {receipt.session_id} (its messages, "
                    f"{receipt.checkpoints_removed} checkpoint(s) and artifacts; the event log "
                    "and audit rows stay); other devices delete it when they sync",
                    "green",
                )
            else:
                _say(args, f"session {receipt.session_id} was not deleted", "yellow")
            return 0 if receipt.deleted else 1
    return 0


def _say(args: argparse.Namespace, text: str, style: str = "") -> None:
    """One line on stdout, in ``style`` on a terminal."""
    console = _console(args)
    if console is None:
        _out(text)
    else:
        console.print(_text(text, style))


async def _events(args: argparse.Namespace) -> int:
    async with _runtime(args) as rt:
        report = await rt.events.verify_chain(args.session_id)
        if args.json:
            _json(report)
        elif report.ok:
            _say(
                args, f"ok: {report.checked} events verify (head {report.head_hash[:16]})", "green"
            )
        else:
            _say(args, f"broken at index {report.first_bad_index}: {report.reason}", "bold red")
        return 0 if report.ok else 1


class _SyncBar:
    """The progress bar of ``pleach sync``, on stderr: drawn only when stderr is a terminal and
    the sync is still running ``after`` seconds in (a quick sync prints nothing), and gone
    when it ends (transient). ``update`` is the ``on_progress`` of ``sync_once``."""

    AFTER = 0.5
    LABELS = {"upload": "sending", "download": "receiving"}

    def __init__(self, console: Console | None, after: float = AFTER) -> None:
        self._console = console
        self._after = after
        self._latest: dict[str, SyncProgress] = {}
        self._progress: Progress | None = None
        self._tasks: dict[str, TaskID] = {}
        self._connecting: TaskID | None = None
        self._timer: asyncio.TimerHandle | None = None

    def __enter__(self) -> _SyncBar:
        if self._console is not None and self._console.is_interactive:
            self._timer = asyncio.get_running_loop().call_later(self._after, self._show)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._progress is not None:
            self._progress.stop()

    @property
    def shown(self) -> bool:
        return self._progress is not None

    def update(self, progress: SyncProgress) -> None:
        self._latest[progress.phase] = progress
        if self._progress is not None:
            self._draw(progress)

    def _show(self) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn("{task.description:<9}", style="bold"),
            BarColumn(complete_style="cyan", finished_style="green"),
            TextColumn("{task.fields[count]}"),
            TimeRemainingColumn(elapsed_when_finished=True),
            console=self._console,
            transient=True,
            redirect_stdout=False,  # stdout may be a pipe: leave it alone
        )
        self._progress.start()
        if not self._latest:
            self._connecting = self._progress.add_task("connecting", total=None, count="")
        for progress in list(self._latest.values()):
            self._draw(progress)

    def _draw(self, progress: SyncProgress) -> None:
        assert self._progress is not None
        if self._connecting is not None:
            self._progress.remove_task(self._connecting)
            self._connecting = None
        total = max(progress.total, progress.done)
        count = f"{progress.done:,}/{total:,} changes"
        task = self._tasks.get(progress.phase)
        if task is None:
            task = self._progress.add_task(self.LABELS[progress.phase], total=total, count="")
            self._tasks[progress.phase] = task
        self._progress.update(task, total=total, completed=progress.done, count=count)


async def _sync(args: argparse.Namespace) -> int:
    if args.sync_command == "dead-letters":
        return await _dead_letters(args)
    if not args.server or not args.token:
        missing = " and ".join(
            f"--{name} (or {env})"
            for name, env in (("server", "PLEACH_SERVER"), ("token", "PLEACH_TOKEN"))
            if not getattr(args, name)
        )
        raise PleachError(f"sync needs {missing}")
    fresh = _new_device_file(args.db)
    try:
        async with _runtime(args, may_start=True) as rt:
            with _SyncBar(_console(args, err=True)) as bar:
                receipt = await rt.sync.sync_once(
                    args.server, args.token, timeout=args.timeout, on_progress=bar.update
                )
            status = await rt.sync.status()
    except BaseException:
        if fresh:
            _remove_device_file(args.db)
        raise
    ok = receipt.outcome in ("all-flushed", "none-pending")
    if args.json:
        _json(receipt)
        _json(status)
        return 0 if ok else 1
    summary = (
        f"sent {receipt.flushed} change(s); {len(receipt.failed_entries)} refused or "
        f"stuck; {receipt.pending_after} still queued"
    )
    console = _console(args)
    if console is None:
        _out(summary)
        for failed in receipt.failed_entries:
            _out(f"  change {failed.client_seq}: {failed.code or '-'} {failed.message}")
        for conflict in receipt.conflicts:
            _out(f"  {_conflict_line(conflict)}")
    else:
        console.print(_text(summary, "green" if ok else "yellow"))
        if receipt.failed_entries:
            table = _table("change", "code", "reason", "attempts")
            for failed in receipt.failed_entries:
                table.add_row(
                    str(failed.client_seq),
                    _text(str(failed.code or "-"), "red"),
                    failed.message,
                    str(failed.attempts),
                )
            console.print(table)
        for conflict in receipt.conflicts:
            console.print(_text(_conflict_line(conflict), "yellow"))
    _print_status(status, args)
    return 0 if ok else 1


def _conflict_line(conflict: ConflictReceipt) -> str:
    return (
        f"conflict in session {conflict.session_id}: the {conflict.winner} version kept the "
        f"session, the other lives on as {conflict.fork_session_id}"
    )


def _new_device_file(path: str) -> bool:
    """Whether ``pleach sync`` starts a new device at ``path`` (no file there yet): it says
    so, makes the file and fills it with what the server holds."""
    if os.path.exists(path):
        return False
    print(
        f"pleach: {path} is new: this device starts empty and takes what the server holds",
        file=sys.stderr,
    )
    return True


def _remove_device_file(path: str) -> None:
    """A new device's file whose first sync failed goes again: a typo in --db leaves nothing
    behind."""
    for suffix in ("", "-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path + suffix)


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


STATE_STYLE = {"connected": "green", "connecting": "yellow", "offline": "yellow"}


def _print_status(status: SyncStatus, args: argparse.Namespace) -> None:
    state: str = status.state
    state_style = STATE_STYLE.get(state, "bold red")
    if state == "offline" and status.has_synced:
        state, state_style = "not connected now (this command does not stay connected)", ""
    rows = [
        ("state", state, state_style),
        (
            "queued",
            f"{status.pending} change(s) not yet on the server",
            "yellow" if status.pending else "green",
        ),
        (
            "dead letters",
            f"{status.dead_letters} (pleach sync dead-letters list)",
            "yellow" if status.dead_letters else "green",
        ),
        ("last synced", _ago(status.last_synced_at), "" if status.has_synced else "yellow"),
        ("feed cursor", str(status.cursor), ""),
    ]
    if status.protocol is not None:
        rows.append(("protocol", f"version {status.protocol}", ""))
    if status.last_error:
        code = f" [{status.last_error_code}]" if status.last_error_code else ""
        rows.append(("last error", f"{status.last_error}{code}", "red"))
    console = _console(args)
    if console is None:
        width = max(len(name) for name, _, _ in rows)
        for name, value, _ in rows:
            _out(f"{name:<{width}}  {value}")
        return
    from rich.table import Table

    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    for name, value, style in rows:
        grid.add_row(name, _text(value, style))
    console.print(grid)


def _dead_letter_table(letters: list[DeadLetter]) -> Table:
    table = _table("seq", "record", "code", "reason", "attempts")
    table.columns[0].justify = table.columns[4].justify = "right"
    for dead in letters:
        table.add_row(
            str(dead.client_seq),
            f"{type(dead.record).__name__} {dead.record.id}",
            _text(str(dead.code), "red"),
            dead.message,
            str(dead.attempts),
        )
    return table


async def _status(args: argparse.Namespace) -> int:
    async with _runtime(args) as rt:
        status = await rt.sync.status()
        if args.json:
            _json(status)
            return 0
        _print_status(status, args)
        letters = await rt.sync.dead_letters()
        console = _console(args)
        if console is None:
            for dead in letters:
                _out(f"  dead letter {dead.client_seq}: {dead.code} {dead.message}")
        elif letters:
            console.print()
            console.print(_dead_letter_table(letters))
    return 0


async def _dead_letters(args: argparse.Namespace) -> int:
    async with _runtime(args) as rt:
        if args.action == "list":
            letters = await rt.sync.dead_letters()
            if args.json:
                _json(letters)
                return 0
            console = _console(args)
            if console is not None:
                if letters:
                    console.print(_dead_letter_table(letters))
                else:
                    console.print(_text("no dead letters", "green"))
                return 0
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
            if args.json:
                _json({"client_seq": args.client_seq, "queued_as": seq})
            else:
                _say(args, f"queued again as {seq}; it goes with the next sync", "green")
            return 0
        if not await rt.sync.discard_dead_letter(args.client_seq):
            raise PleachError(f"no dead letter {args.client_seq}")
        if args.json:
            _json({"client_seq": args.client_seq, "discarded": True})
        else:
            _say(args, f"dead letter {args.client_seq} discarded", "green")
        return 0


async def _doctor(args: argparse.Namespace) -> int:
    from .doctor import Check, check_server, check_store

    checks = await check_store(args.db, args.user, args.org)
    if args.server:
        client_id = "doctor"
        if await asyncio.to_thread(os.path.exists, args.db):
            from .store.sqlite import SQLiteAdapter

            async with SQLiteAdapter(args.db) as store:
                client_id = await store.get_meta("client_id") or client_id
        checks += await check_server(args.server, args.token, client_id, args.user, args.org)
    else:
        checks.append(Check("warn", "server", "not checked: give --server (or PLEACH_SERVER)"))
    failed = any(c.level == "fail" for c in checks)
    console = _console(args)
    if args.json:
        _json(checks)
    elif console is None:
        width = max(len(c.name) for c in checks)
        for check in checks:
            _out(f"{check.level:<4}  {check.name:<{width}}  {check.detail}")
    else:
        table = _table("", "check", "detail")
        for check in checks:
            table.add_row(_text(check.level, LEVEL_STYLE[check.level]), check.name, check.detail)
        console.print(table)
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parser().parse_args(argv)
    except _UsageError as exc:
        _error_line(str(exc), None, no_color="--no-color" in argv)
        return 2
    handlers: dict[str, Any] = {
        "chat": _chat,
        "sessions": _sessions,
        "events": _events,
        "sync": _sync,
        "status": _status,
        "dead-letters": _dead_letters,
        "doctor": _doctor,
    }
    # Every command builds a runtime, which imports the sync module on first use: import it
    # here, before the loop runs, so that no step of the loop spends that time (an import
    # of 0.1 s inside a task is a slow callback, and asyncio's debug mode says so on stderr).
    from . import sync as _sync_module  # noqa: F401

    try:
        if args.command == "demo":
            from .demo import run_demo

            return asyncio.run(run_demo(keep=args.keep))
        return int(asyncio.run(handlers[args.command](args)))
    except PleachError as exc:
        _error_line(f"pleach: {exc}", args)
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
        _error_line(f"pleach: {exc}", args)
        return 2


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
