"""The ``pleach`` command as a user runs it: real subprocesses, real files."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pleach_client.runtime import SessionRuntime
from pleach_client.store.sqlite import SQLiteAdapter

ROOT = Path(__file__).resolve().parent.parent


def pleach(*args: str, env: dict[str, str] | None = None, stdin: str = "") -> tuple[int, str, str]:
    base = {k: v for k, v in os.environ.items() if k != "ANTHROPIC_API_KEY"}
    proc = subprocess.run(
        [sys.executable, "-m", "pleach_client.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**base, "PYTHONPATH": str(ROOT), **(env or {})},
    )
    return proc.returncode, proc.stdout, proc.stderr


def test_chat_without_key_says_so_in_one_line(tmp_path: Path) -> None:
    code, _, err = pleach("--db", str(tmp_path / "d.db"), "chat", "-m", "hi")
    assert code == 2
    assert "ANTHROPIC_API_KEY is not set" in err and "--offline" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_offline_chat_sessions_and_events(tmp_path: Path) -> None:
    db = str(tmp_path / "d.db")
    code, out, _ = pleach("--db", db, "chat", "--offline", "-m", "hello", "-m", "2 more")
    assert code == 0 and "You said: hello" in out
    session_id = re.search(r"new session (\S+)", out).group(1)  # type: ignore[union-attr]
    code, out, _ = pleach(
        "--db", db, "chat", "--offline", "--session", session_id, stdin="from stdin\n/quit\n"
    )
    assert code == 0 and "resumed session" in out and "You said: from stdin" in out
    code, out, _ = pleach("--db", db, "sessions", "list")
    assert session_id in out and "6 messages" in out
    code, out, _ = pleach("--db", db, "sessions", "show", session_id)
    assert "user: hello" in out and "assistant: You said: 2 more" in out
    code, out, _ = pleach("--db", db, "events", "verify", session_id)
    assert code == 0 and out.startswith("ok:")
    code, out, _ = pleach("--db", db, "status", "--json")
    assert code == 0 and '"state":"offline"' in out and '"pending":' in out
    code, out, _ = pleach("--db", db, "status")
    assert code == 0 and "queued" in out and re.search(r"last synced +never", out)
    code, out, _ = pleach("--db", db, "sessions", "delete", session_id)
    assert code == 0 and f"deleted session {session_id}" in out
    code, _, err = pleach("--db", db, "sessions", "show", session_id)
    assert code == 2 and "no session" in err and "Traceback" not in err


def test_sessions_list_says_which_session_was_kept_beside_a_delete(tmp_path: Path) -> None:
    """A session the server kept beside a delete (``SessionState.kept_from``) reappears as a
    new session; the listing says why, and names the deleted one."""
    import msgspec

    from pleach_client.providers.scripted import ScriptedProvider
    from pleach_client.store.base import WriteBatch

    db = tmp_path / "d.db"

    async def make() -> str:
        async with SessionRuntime(SQLiteAdapter(db), ScriptedProvider()) as rt:
            plain = await rt.create_session(title="plain")
            kept = await rt.create_session(title="kept")
            row = await rt.store.get_session(kept.id)
            assert row is not None
            state = msgspec.structs.replace(row.state, kept_from=plain.id)
            marked = msgspec.structs.replace(row, forked_from=plain.id, state=state)
            await rt.store.commit(WriteBatch(records=[marked], outbox=False))
            await rt.delete_session(plain.id)
            return plain.id

    deleted = asyncio.run(make())
    code, out, err = pleach("--db", str(db), "sessions", "list")
    assert code == 0, err
    (line,) = out.strip().splitlines()
    assert f"kept beside the delete of {deleted}" in line and "the delete won" in line


def test_demo_converges() -> None:
    code, out, err = pleach("demo")
    assert code == 0, out + err
    assert "conflict" in out and "identical: yes" in out


@contextlib.contextmanager
def server_process(tmp_path: Path) -> Iterator[tuple[str, Callable[[str, str], str]]]:
    """A ``pleach-server`` process on a free port: its URL, and a function making a token
    for ``(user, org)``. Terminated on exit."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PLEACH_SECRET": "cli-test-secret"}
    db = str(tmp_path / "server.db")
    server = subprocess.Popen(
        [sys.executable, "-m", "pleach_server.cli", "--port", "0", "--db", db],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )

    def token(user: str, org: str) -> str:
        return subprocess.run(
            [sys.executable, "-m", "pleach_server.cli", "token", "create", "--user", user,
             "--org", org, "--db", db],
            capture_output=True, text=True, env=env, cwd=ROOT, check=True, timeout=60,
        ).stdout.strip()  # fmt: skip

    try:
        assert server.stdout is not None
        url = ""
        for line in server.stdout:
            found = re.search(r"(ws://\S+/sync)", line)
            if found:
                url = found.group(1)
                break
        assert url, "the server did not say where it listens"
        yield url, token
    finally:
        server.terminate()
        server.wait(timeout=30)
        if server.stdout is not None:
            server.stdout.close()


def test_sync_and_status_against_a_server_process(tmp_path: Path) -> None:
    with server_process(tmp_path) as (url, make_token):
        token = make_token("anonymous", "default")
        db = str(tmp_path / "d.db")
        assert pleach("--db", db, "chat", "--offline", "-m", "sync me")[0] == 0
        code, out, err = pleach("--db", db, "sync", "--server", url, "--token", token, "--json")
        assert code == 0, err
        assert '"outcome":"all-flushed"' in out and '"pending":0' in out
        code, out, _ = pleach("--db", db, "status", "--json")
        assert '"has_synced":true' in out and '"dead_letters":0' in out
        assert '"last_synced_at":null' not in out  # kept across processes
        code, out, err = pleach("--db", db, "sync", "--server", url, "--token", token)
        assert code == 0, err
        assert "sent 0 change(s)" in out and "s ago)" in out
        assert err == "" and "\x1b" not in out  # piped: no progress bar, no colour
        code, _, err = pleach("--db", db, "sync", "--server", url, "--token", "forged")
        assert code == 2 and "401" in err and "Traceback" not in err


def test_sync_starts_a_new_device_from_the_server(tmp_path: Path) -> None:
    """``pleach sync`` on a file that does not exist yet is a new device: it says so and takes
    what the server holds; when that first sync fails, no file is left behind."""
    with server_process(tmp_path) as (url, make_token):
        token = make_token("anonymous", "default")
        laptop, phone = str(tmp_path / "laptop.db"), str(tmp_path / "phone.db")
        assert pleach("--db", laptop, "chat", "--offline", "-m", "from the laptop")[0] == 0
        assert pleach("--db", laptop, "sync", "--server", url, "--token", token)[0] == 0
        code, out, err = pleach("--db", phone, "sync", "--server", url, "--token", token)
        assert code == 0, err
        assert "is new: this device starts empty" in err
        code, out, _ = pleach("--db", phone, "sessions", "list", "--json")
        _, mine, _ = pleach("--db", laptop, "sessions", "list", "--json")
        assert code == 0 and out == mine and "from the laptop" not in err
        again = pleach("--db", phone, "sync", "--server", url, "--token", token)
        assert again[0] == 0 and "is new" not in again[2]  # the second time it is not
    unreachable = str(tmp_path / "typo.db")
    code, _, err = pleach(
        "--db", unreachable, "sync", "--server", "ws://127.0.0.1:9/sync", "--token", "t"
    )
    assert code == 2 and "cannot sync with" in err
    assert not any(Path(unreachable + suffix).exists() for suffix in ("", "-wal", "-shm"))


def test_cli_reasons_for_the_usual_mistakes(tmp_path: Path) -> None:
    """A typo in --db, a server's database, an unreachable server: one line each, a non-zero
    exit, fast; --db also works after the subcommand."""
    import sqlite3

    def pleach(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pleach_client.cli", *args],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    missing = pleach("sessions", "list", "--db", str(tmp_path / "typo.db"))
    assert missing.returncode == 2 and "no device database" in missing.stderr
    assert not (tmp_path / "typo.db").exists()

    server_db = tmp_path / "server.db"
    conn = sqlite3.connect(server_db)
    conn.execute("CREATE TABLE feed (cursor INTEGER)")
    conn.close()
    wrong = pleach("status", "--db", str(server_db))
    assert wrong.returncode == 2 and "server database" in wrong.stderr

    device = tmp_path / "d.db"
    made = pleach("chat", "--offline", "-m", "hello", "--db", str(device))
    assert made.returncode == 0 and "anonymous" in made.stdout  # the default user, said
    down = pleach("--db", str(device), "sync", "--server", "ws://127.0.0.1:9/sync", "--token", "t")
    assert down.returncode == 2 and "cannot sync with" in down.stderr
    assert len(down.stderr.strip().splitlines()) == 1
    assert "no answer" not in down.stderr  # it failed on the refusal, not on a timeout


async def _read_until(stream: asyncio.StreamReader, marker: bytes) -> bytes:
    seen = b""
    async with asyncio.timeout(60):
        while marker not in seen:
            chunk = await stream.read(256)
            if not chunk:
                break
            seen += chunk
    return seen


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
async def test_chat_interrupted_mid_turn_keeps_the_turn(tmp_path: Path, signum: int) -> None:
    """Ctrl-C during a reply aborts the turn and returns to the prompt; SIGTERM aborts it and
    ends the chat. Either way the user's message and the partial reply are committed."""
    db = tmp_path / "chat.db"
    env = {**os.environ, "PLEACH_OFFLINE_DELAY": "0.2"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pleach_client.cli", "chat", "--offline", "--db", str(db),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(b"please tell me a long story about the sea\n")
    await proc.stdin.drain()
    await _read_until(proc.stdout, b"You said:")  # the reply is streaming
    proc.send_signal(signum)
    seen = await _read_until(proc.stdout, b"turn aborted")
    assert b"turn aborted" in seen
    if signum == signal.SIGINT:  # back at the prompt: the chat goes on
        proc.stdin.write(b"second\n")
        await proc.stdin.drain()
        await _read_until(proc.stdout, b"You said: second")
        proc.stdin.close()
    async with asyncio.timeout(60):
        await proc.wait()
    assert proc.returncode == 0
    async with SessionRuntime(SQLiteAdapter(db)) as rt:
        (session,) = await rt.sessions.list()
        messages = await rt.sessions.messages(session.id)
    assert messages[0].content[0]["text"] == "please tell me a long story about the sea"
    assert messages[1].role == "assistant" and messages[1].aborted
    if signum == signal.SIGINT:
        assert [m.content[0]["text"] for m in messages[2:]] == ["second", "You said: second"]


def test_chat_takes_input_that_is_not_utf8_and_keeps_the_turn(tmp_path: Path) -> None:
    db = tmp_path / "u.db"
    out = subprocess.run(
        [sys.executable, "-m", "pleach_client.cli", "chat", "--offline", "--db", str(db)],
        input=b"caf\xe9 au lait\n",
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert b"Traceback" not in out.stderr
    shown = subprocess.run(
        [sys.executable, "-m", "pleach_client.cli", "sessions", "list", "--db", str(db)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "2 messages" in shown.stdout


@pytest.mark.parametrize("command", [["sync", "dead-letters"], ["dead-letters"]])
def test_dead_letters_list_retry_and_discard(tmp_path: Path, command: list[str]) -> None:
    """A change the server refused can be listed, queued again or dropped from the CLI, as
    `pleach sync dead-letters ...` or `pleach dead-letters ...`."""
    from pleach_client.store.base import WriteBatch
    from tests.factories import make_message

    db = tmp_path / "d.db"

    async def refused() -> tuple[int, int]:
        async with SQLiteAdapter(db) as store:
            receipt = await store.commit(WriteBatch(records=[make_message(), make_message()]))
            for seq in receipt.client_seqs:
                await store.outbox_dead_letter(seq, 3007, "record client_id is not the device")
            return receipt.client_seqs[0], receipt.client_seqs[1]

    first, second = asyncio.run(refused())

    def pleach(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pleach_client.cli", *command, *args, "--db", str(db)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    listed = pleach("list")
    assert (
        listed.returncode == 0 and f"{first}  Message" in listed.stdout and "3007" in listed.stdout
    )
    assert json.loads(pleach("list", "--json").stdout)[1]["client_seq"] == second
    retried = pleach("retry", str(first), "--json")
    assert retried.returncode == 0 and json.loads(retried.stdout)["client_seq"] == first
    assert pleach("discard", str(second)).returncode == 0
    gone = pleach("discard", str(second))
    assert gone.returncode == 2 and gone.stderr == f"pleach: no dead letter {second}\n"
    assert "no dead letters" in pleach("list").stdout


async def test_a_message_that_is_not_valid_text_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    from shared.errors import InvalidInput

    async with SessionRuntime(SQLiteAdapter(tmp_path / "d.db")) as rt:
        session_id = (await rt.create_session()).id
        before = await rt.store.outbox_count()
        with pytest.raises(InvalidInput, match="not valid text"):
            async for _ in rt.execute_message(session_id, "lone \ud800 surrogate"):
                pass
        assert await rt.store.outbox_count() == before


def test_doctor_checks_the_store_server_token_and_clock(tmp_path: Path) -> None:
    with server_process(tmp_path) as (url, make_token):
        token = make_token("ann", "acme")
        db = str(tmp_path / "d.db")
        assert (
            pleach("--db", db, "--user", "ann", "--org", "acme", "chat", "--offline", "-m", "x")[0]
            == 0
        )
        code, out, _ = pleach(
            "doctor",
            "--db",
            db,
            "--user",
            "ann",
            "--org",
            "acme",
            "--server",
            url,
            "--token",
            token,
        )
        assert code == 0, out
        for name in ("store", "event logs", "outbox", "server", "token", "clock"):
            assert re.search(rf"^ok +{name} ", out, re.M), (name, out)
        code, out, _ = pleach("doctor", "--db", db, "--server", url, "--token", token)
        assert code == 1 and re.search(r"^fail +token .*acme/ann", out, re.M)  # wrong user
        code, out, _ = pleach("doctor", "--db", db, "--server", url, "--token", "forged")
        assert code == 1 and re.search(r"^fail +token +refused: HTTP 401", out, re.M)
    code, out, _ = pleach("doctor", "--db", db, "--server", url)
    assert code == 1 and re.search(r"^fail +server +cannot reach", out, re.M)


def test_chat_slash_commands_are_answered_here_not_sent_to_the_model(tmp_path: Path) -> None:
    db = tmp_path / "c.db"
    out = subprocess.run(
        [sys.executable, "-m", "pleach_client.cli", "chat", "--offline", "--db", str(db)],
        input="/help\n/sessions\n/status\n/nope\nhello\n/quit\nafter quitting\n",
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "/sessions  the sessions in this file" in out.stdout
    assert "queued" in out.stdout and "unknown command /nope" in out.stdout
    assert "You said: hello" in out.stdout and "after quitting" not in out.stdout

    async def texts() -> list[str]:
        async with SessionRuntime(SQLiteAdapter(db)) as rt:
            (session,) = await rt.sessions.list()
            return [m.content[0]["text"] for m in await rt.sessions.messages(session.id)]

    assert asyncio.run(texts()) == ["hello", "You said: hello"]


def test_chat_into_a_closed_pipe_keeps_the_turn_and_leaves_quietly(tmp_path: Path) -> None:
    """`pleach chat ... | head -1`: the reader goes away mid-reply; the turn (with the user's
    message) is committed as aborted, and the command ends without a traceback."""
    db = tmp_path / "p.db"
    env = {**os.environ, "PLEACH_OFFLINE_DELAY": "0.05"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pleach_client.cli", "chat", "--offline", "--db", str(db),
         "-m", "a message long enough to stream for a while"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    while not proc.stdout.readline().startswith(b"> "):  # the turn has started
        pass
    proc.stdout.close()  # the reader goes away, like `head` having read enough
    proc.wait(timeout=120)
    err = proc.stderr.read()
    proc.stderr.close()
    assert proc.returncode == 141 and b"Traceback" not in err

    async def texts() -> list[str]:
        async with SessionRuntime(SQLiteAdapter(db)) as rt:
            (session,) = await rt.sessions.list()
            return [m.content[0]["text"] for m in await rt.sessions.messages(session.id)]

    assert asyncio.run(texts())[0] == "a message long enough to stream for a while"


def pleach_tty(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """`pleach` with stdout and stderr on a pseudo-terminal, as in a person's shell: its exit
    code and everything it drew."""
    import pty
    import select

    leader, follower = pty.openpty()
    drop = ("NO_COLOR", "FORCE_COLOR", "ANTHROPIC_API_KEY")
    base = {k: v for k, v in os.environ.items() if k not in drop}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pleach_client.cli", *args],
        stdin=subprocess.DEVNULL, stdout=follower, stderr=follower, cwd=ROOT,
        env={**base, "PYTHONPATH": str(ROOT), "TERM": "xterm-256color", "COLUMNS": "120",
             **(env or {})},
    )  # fmt: skip
    os.close(follower)
    seen = b""
    try:
        while True:
            ready, _, _ = select.select([leader], [], [], 120)
            assert ready, "pleach went silent on its terminal"
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the command ended and closed the terminal
                break
            if not chunk:
                break
            seen += chunk
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=120)
    return proc.returncode, seen.decode().replace("\r\n", "\n")


# A foreground colour (30-38, 90-97) in an SGR escape; 39 (the default colour) is not one.
COLOUR = re.compile(r"\x1b\[(?:\d+;)*(?:3[0-8]|9[0-7])(?:;\d+)*m")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def test_tables_and_colours_on_a_terminal_plain_text_in_a_pipe(tmp_path: Path) -> None:
    db = str(tmp_path / "d.db")
    assert pleach("--db", db, "chat", "--offline", "-m", "hello")[0] == 0

    code, screen = pleach_tty("--db", db, "doctor")
    assert code == 0, screen
    assert re.search(r"\x1b\[32mok\b", screen) and re.search(r"\x1b\[33mwarn\b", screen)
    assert re.search(r"^ *check +detail *$", ANSI.sub("", screen), re.M)  # a table's header
    code, screen = pleach_tty("--db", db, "sessions", "list")
    assert code == 0 and re.search(
        r"^ *session +model +messages +title", ANSI.sub("", screen), re.M
    )
    assert COLOUR.search(screen)
    code, screen = pleach_tty("--db", db, "status")
    assert code == 0 and re.search(r"queued[^\n]*\x1b\[33m\d+ change", screen)  # pending: yellow

    # --no-color (anywhere) and NO_COLOR: the same tables, no colour
    for args, env in ((["status", "--no-color", "--db", db], {}), (["--db", db, "doctor"], {"NO_COLOR": "1"})):  # fmt: skip
        code, screen = pleach_tty(*args, env=env)
        assert code == 0 and not COLOUR.search(screen), screen
        assert re.search(r"^(state|ok) ", ANSI.sub("", screen), re.M)

    code, screen = pleach_tty("--db", str(tmp_path / "typo.db"), "status")
    assert code == 2 and "\x1b[31mpleach: no device database" in screen  # red, on stderr
    assert len(ANSI.sub("", screen).strip().splitlines()) == 1

    for args in (["status"], ["doctor"], ["sessions", "list"]):  # a pipe: plain lines
        code, out, err = pleach("--db", db, *args)
        assert code == 0 and out and "\x1b" not in out + err and "─" not in out, out


def test_usage_mistakes_are_one_line_and_exit_2(tmp_path: Path) -> None:
    db = str(tmp_path / "d.db")
    assert pleach("--db", db, "chat", "--offline", "-m", "hello")[0] == 0
    env = {k: v for k, v in os.environ.items() if k not in ("PLEACH_SERVER", "PLEACH_TOKEN")}

    def run(*args: str) -> tuple[int, str]:
        proc = subprocess.run(
            [sys.executable, "-m", "pleach_client.cli", "--db", db, *args],
            capture_output=True, text=True, timeout=120, cwd=ROOT,
            env={**env, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        assert proc.stdout == ""
        return proc.returncode, proc.stderr

    for args, reason in (
        (["sync"], "sync needs --server (or PLEACH_SERVER) and --token (or PLEACH_TOKEN)"),
        (["sync", "--token", "t"], "sync needs --server"),
        (["sync", "ws://127.0.0.1:9/sync"], "give the server as --server URL"),
        (["sessions"], "the following arguments are required"),
        (["nope"], "invalid choice: 'nope'"),
        (["sync", "dead-letters", "retry", "x"], "invalid int value: 'x'"),
    ):
        code, err = run(*args)
        assert code == 2 and reason in err, (args, err)
        assert len(err.splitlines()) == 1 and err.startswith("pleach"), (args, err)


def test_help_and_piped_commands_do_not_import_rich(tmp_path: Path) -> None:
    """rich loads only to draw on a terminal: `pleach --help` and a piped `pleach status`
    stay fast. `pleach --help` loads no runtime, store or codec either: only what parses
    the command line (about half the start of a command that opens the file)."""
    db = str(tmp_path / "d.db")
    assert pleach("--db", db, "chat", "--offline", "-m", "hello")[0] == 0
    for args in (["--help"], ["--db", db, "status"]):
        proc = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "pleach_client.cli", *args],
            capture_output=True, text=True, timeout=120, cwd=ROOT, check=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        assert re.search(r"\| +argparse$", proc.stderr, re.M)  # importtime did report
        assert not re.search(r"\| +rich(\.|$)", proc.stderr, re.M), args
        if args == ["--help"]:  # the environment variables are listed
            for name in ("PLEACH_CLIENT_DB", "PLEACH_TOKEN", "PLEACH_READ_TIMEOUT", "NO_COLOR"):
                assert name in proc.stdout, name
            for module in ("pleach_client.runtime", "pleach_client.store.sqlite", "shared.compact"):
                assert not re.search(rf"\| +{re.escape(module)}$", proc.stderr, re.M), module
        else:  # a command that opens the file does load them
            assert re.search(r"\| +pleach_client\.store\.sqlite$", proc.stderr, re.M)


async def test_sync_progress_bar_follows_a_real_sync(tmp_path: Path) -> None:
    """The bar of `pleach sync`, driven by a real sync of a few thousand changes with a real
    server: it counts what was sent and what a new device received; a sync that ends before
    the bar's delay draws nothing."""
    from io import StringIO

    from rich.console import Console

    from pleach_client.cli import _SyncBar
    from pleach_client.providers.scripted import ScriptedProvider

    def terminal(screen: StringIO) -> Console:
        return Console(
            file=screen, force_terminal=True, force_interactive=True, width=120, no_color=True
        )

    with server_process(tmp_path) as (url, make_token):
        token = make_token("anonymous", "default")
        async with SessionRuntime(SQLiteAdapter(tmp_path / "a.db"), ScriptedProvider()) as rt:
            session_id = (await rt.create_session()).id
            for i in range(300):
                async for _ in rt.execute_message(session_id, f"turn {i}"):
                    pass
            pending = await rt.store.outbox_count()
            sent = StringIO()
            with _SyncBar(terminal(sent), after=0) as bar:
                receipt = await rt.sync.sync_once(url, token, on_progress=bar.update)
            assert bar.shown
        assert pending > 2000 and receipt.flushed == pending
        assert re.search(
            rf"sending +━+ {pending:,}/{pending:,} changes", ANSI.sub("", sent.getvalue())
        )

        async with SessionRuntime(SQLiteAdapter(tmp_path / "b.db")) as rt:
            received = StringIO()
            with _SyncBar(terminal(received), after=0) as bar:
                await rt.sync.sync_once(url, token, on_progress=bar.update)
            cursor = (await rt.sync.status()).cursor
            quick = StringIO()
            with _SyncBar(terminal(quick), after=60) as bar:  # over long before 60 s
                await rt.sync.sync_once(url, token, on_progress=bar.update)
            assert not bar.shown and quick.getvalue() == ""
        assert cursor > 2000  # the feed holds the last version of a session row only
        assert re.search(
            rf"receiving +━+ {cursor:,}/{cursor:,} changes", ANSI.sub("", received.getvalue())
        )
