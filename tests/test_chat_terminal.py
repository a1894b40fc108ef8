"""``pleach chat`` in a real terminal, as a person uses it: tmux send-keys and capture-pane.

The offline model streams slowly (``PLEACH_OFFLINE_DELAY``), so a Ctrl-C lands mid-reply.
"""

from __future__ import annotations

import os
import select
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.test_cli import pleach

ROOT = Path(__file__).resolve().parent.parent


class Terminal:
    """One tmux session running one command, 120x40. What the pane receives is also piped
    (``tmux pipe-pane``) into a FIFO this test reads: ``until`` wakes when output arrives."""

    def __init__(self, name: str, fifo: Path) -> None:
        self.name = name
        # Opened before tmux writes to it (non-blocking: no writer yet), kept for the test.
        self._out = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        subprocess.run(
            ["tmux", "pipe-pane", "-O", "-t", name, f"cat >> {shlex.quote(str(fifo))}"],
            check=True,
        )

    def close(self) -> None:
        os.close(self._out)

    def keys(self, *keys: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.name, *keys], check=True)

    def screen(self) -> str:
        return subprocess.run(
            ["tmux", "capture-pane", "-p", "-S", "-200", "-t", self.name],
            check=True,
            capture_output=True,
            text=True,
        ).stdout

    def until(self, predicate: Callable[[str], bool], timeout: float = 30.0) -> str:
        """The screen once ``predicate`` holds: checked now, then each time the pane gets
        output (a read of the FIFO wakes on it), for at most ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            if predicate(screen):
                return screen
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"terminal never showed it; last screen:\n{screen}")
            ready, _, _ = select.select([self._out], [], [], left)
            if ready:
                try:
                    os.read(self._out, 65536)
                except BlockingIOError:
                    pass


@pytest.fixture
def terminal(tmp_path: Path) -> Iterator[Callable[[str], Terminal]]:
    if shutil.which("tmux") is None:
        if os.environ.get("CI"):
            pytest.fail("tmux is not installed")
        pytest.skip("tmux is not installed here")
    terminals: list[Terminal] = []

    def start(command: str) -> Terminal:
        name = f"pleach-{uuid.uuid4().hex[:8]}"
        env = f"PYTHONPATH={shlex.quote(str(ROOT))} PLEACH_OFFLINE_DELAY=0.15 TERM=xterm-256color"
        # After the command, `cat` keeps the pane (and its last screen) open until teardown, so
        # the test can read what it printed on the way out.
        shell = (
            f"cd {shlex.quote(str(tmp_path))} && env {env} {command}; echo EXIT=$?; "
            "exec cat > /dev/null"
        )
        subprocess.run(
            ["tmux", "new-session", "-d", "-x", "120", "-y", "40", "-s", name, shell], check=True
        )
        fifo = tmp_path / f"{name}.out"
        os.mkfifo(fifo)
        terminals.append(Terminal(name, fifo))
        return terminals[-1]

    yield start
    for terminal in terminals:
        subprocess.run(["tmux", "kill-session", "-t", terminal.name], capture_output=True)
        terminal.close()


def test_chat_in_a_terminal(terminal: Callable[[str], Terminal], tmp_path: Path) -> None:
    db = tmp_path / "d.db"
    cmd = f"{shlex.quote(sys.executable)} -m pleach_client.cli --db {db} chat --offline"
    term = terminal(cmd)
    term.until(lambda s: "new session" in s and s.rstrip().endswith(">"))

    # Slash commands are answered locally, never sent to the model.
    term.keys("/help", "Enter")
    term.until(lambda s: "/sessions" in s and "/quit" in s)
    term.keys("/bogus", "Enter")
    term.until(lambda s: "unknown command /bogus" in s)

    # A long message streams word by word; Ctrl-C mid-reply aborts the turn, not the chat.
    term.keys("tell me a long story about the sea and the ships upon it", "Enter")
    term.until(lambda s: "You said: tell" in s)
    term.keys("C-c")
    screen = term.until(lambda s: "(turn aborted; what was said so far is kept)" in s)
    assert "EXIT=" not in screen
    term.until(lambda s: s.rstrip().endswith(">"))

    # The chat goes on: a short turn completes after the aborted one.
    term.keys("second", "Enter")
    term.until(lambda s: "You said: second" in s)
    term.keys("/sessions", "Enter")
    screen = term.until(lambda s: "messages" in s.split("/sessions")[-1])
    assert "* " in screen.split("/sessions")[-1]

    # Ctrl-D at an idle prompt ends the chat; the session is saved.
    term.until(lambda s: s.rstrip().endswith(">"))
    term.keys("C-d")
    screen = term.until(lambda s: "EXIT=" in s)
    assert "EXIT=0" in screen and "saved in" in screen and "Traceback" not in screen

    # Both turns are in the file: the aborted one with the user's message and the partial reply.
    code, out, _ = pleach("--db", str(db), "sessions", "list")
    assert code == 0 and "4 messages" in out, out


def test_ctrl_c_at_an_idle_prompt_ends_the_chat(
    terminal: Callable[[str], Terminal], tmp_path: Path
) -> None:
    db = tmp_path / "d.db"
    cmd = f"{shlex.quote(sys.executable)} -m pleach_client.cli --db {db} chat --offline"
    term = terminal(cmd)
    term.until(lambda s: "new session" in s and s.rstrip().endswith(">"))
    term.keys("C-c")
    screen = term.until(lambda s: "EXIT=" in s)
    assert "Traceback" not in screen and "EXIT=0" in screen and "saved in" in screen
