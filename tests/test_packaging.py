"""The wheel alone: ``python -m build`` makes it, and a fresh virtualenv that installs only the
wheel (pip resolving its declared dependencies) runs ``pleach-server``, ``pleach demo`` and the
README's quickstart, without the test tools.

The wheel is built from the sdist, as ``python -m build`` does by default: the same backend
call as ``python -m build --wheel`` (``make wheel``), but in a fresh unpacked copy, so nothing
left in the tree's ``./build`` can leak into what is tested. Every command of the installed
package runs with its working directory in a temporary folder and without ``PYTHONPATH``: the
source tree is never on its ``sys.path``.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
import tomllib
import urllib.request
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("shared", "pleach_client", "pleach_server")
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
DIST_INFO = f"pleach-{VERSION}.dist-info"
# The [test] extra's tools, by import name: none of them may come with the wheel.
TEST_TOOLS = ("pytest", "pytest_asyncio", "hypothesis", "mypy", "ruff", "build")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment (pip's index settings included) without anything that could
    put the source tree or another environment on the installed package's path, nor pleach's
    own settings or an API key."""
    dropped = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "ANTHROPIC_API_KEY")
    env = {k: v for k, v in os.environ.items() if k not in dropped and not k.startswith("PLEACH_")}
    return {**env, **extra}


def run(
    args: list[str], cwd: Path, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args,
        cwd=cwd,
        env=env or clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


@dataclass(frozen=True)
class Installed:
    wheel: Path
    bin: Path  # the fresh virtualenv's bin folder
    work: Path  # a folder outside the tree, the working directory of every command

    @property
    def python(self) -> str:
        return str(self.bin / "python")

    def exe(self, name: str) -> str:
        return str(self.bin / name)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    """The wheel, built once, installed once into a fresh virtualenv (about 110 MB, removed
    afterwards)."""
    base = tmp_path_factory.mktemp("packaging")
    try:
        yield _build_and_install(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _build_and_install(base: Path) -> Installed:
    dist = base / "dist"
    built = run(
        [sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)], cwd=base, timeout=600
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    wheels = sorted(dist.glob("*.whl"))
    assert [w.name for w in wheels] == [f"pleach-{VERSION}-py3-none-any.whl"], wheels
    venv = base / "venv"
    made = run([sys.executable, "-m", "venv", str(venv)], cwd=base, timeout=300)
    assert made.returncode == 0, made.stderr
    bindir = venv / "bin"
    # Only the wheel: pip resolves its declared dependencies from the configured index.
    pip = run(
        [str(bindir / "python"), "-m", "pip", "install", "-q", str(wheels[0])],
        cwd=base,
        timeout=900,
    )
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
    work = base / "work"
    work.mkdir()
    return Installed(wheel=wheels[0], bin=bindir, work=work)


def test_build_backend_can_read_the_license_field() -> None:
    """A string ``project.license`` (an SPDX expression, PEP 639) needs setuptools 77 or
    newer: 68-76 refuse the whole pyproject.toml, so the build floor must say 77."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    # 61: the first setuptools that reads [project] at all.
    needed = (77,) if isinstance(pyproject["project"].get("license"), str) else (61,)
    floors = [
        tuple(int(p) for p in m.group(1).split("."))
        for req in pyproject["build-system"]["requires"]
        if (m := re.fullmatch(r"setuptools\s*>=\s*([\d.]+)", req.strip()))
    ]
    assert floors and floors[0] >= needed, pyproject["build-system"]["requires"]


def test_make_serve_installs_without_the_test_tools() -> None:
    """``make serve`` installs the package alone: no ``[test]`` extra, not via ``install``."""
    makefile = (ROOT / "Makefile").read_text()
    rule = re.search(r"^serve:(.*)\n((?:\t.*\n)+)", makefile, re.M)
    assert rule, "no serve rule in the Makefile"
    prerequisites, recipe = rule.group(1).split(), rule.group(2)
    assert "install" not in prerequisites, prerequisites
    assert re.search(r"pip install\b.* -e \.\s*$", recipe, re.M), recipe
    assert "[test]" not in recipe, recipe


def test_wheel_holds_every_module_and_py_typed_and_nothing_else(installed: Installed) -> None:
    expected = {
        p.relative_to(ROOT).as_posix()
        for pkg in PACKAGES
        for p in (ROOT / pkg).rglob("*")
        if p.is_file()
        and "__pycache__" not in p.parts
        and (p.suffix == ".py" or p.name == "py.typed")
    }
    with zipfile.ZipFile(installed.wheel) as zf:
        names = set(zf.namelist())
        entry_points = zf.read(f"{DIST_INFO}/entry_points.txt").decode()
        metadata = zf.read(f"{DIST_INFO}/METADATA").decode()
    shipped = {n for n in names if not n.startswith(f"{DIST_INFO}/")}
    assert {f"{pkg}/py.typed" for pkg in PACKAGES} <= shipped
    assert not [n for n in names if n.startswith(("tests/", "bench/", "docs/"))]
    assert shipped == expected, (sorted(shipped - expected), sorted(expected - shipped))
    assert "pleach = pleach_client.cli:main" in entry_points
    assert "pleach-server = pleach_server.cli:main" in entry_points
    # The test tools are an extra, never a plain requirement.
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    for tool in ("pytest", "hypothesis", "mypy", "ruff"):
        lines = [r for r in requires if re.match(rf"Requires-Dist: {tool}\b", r)]
        assert lines and all('extra == "test"' in r for r in lines), lines


def test_installed_package_is_the_wheel_and_brings_no_test_tools(installed: Installed) -> None:
    probe = (
        "import importlib.util, json, shared, pleach_client, pleach_server\n"
        "print(json.dumps({'files': [shared.__file__, pleach_client.__file__,"
        f" pleach_server.__file__], 'tools': [t for t in {TEST_TOOLS!r}"
        " if importlib.util.find_spec(t) is not None]}))\n"
    )
    proc = run([installed.python, "-c", probe], cwd=installed.work)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    venv = installed.bin.parent.resolve()
    for file in found["files"]:
        assert Path(file).resolve().is_relative_to(venv), file
        assert not Path(file).resolve().is_relative_to(ROOT), file
    assert found["tools"] == [], f"the wheel brought test tools: {found['tools']}"
    check = run([installed.python, "-m", "pip", "check"], cwd=installed.work)
    assert check.returncode == 0, check.stdout + check.stderr


def test_help_of_both_commands(installed: Installed) -> None:
    proc = run([installed.exe("pleach"), "--help"], cwd=installed.work)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: pleach") and "demo" in proc.stdout
    proc = run([installed.exe("pleach-server"), "--help"], cwd=installed.work)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: pleach-server") and "--port" in proc.stdout


def _lines(stream: Iterator[str], into: queue.Queue[str | None]) -> None:
    for line in stream:
        into.put(line)
    into.put(None)


def test_server_serves_healthz_and_a_device_syncs_then_it_stops_cleanly(
    installed: Installed,
) -> None:
    """``pleach-server`` on its embedded SQLite default (a file in tmp, its signing secret
    written beside it), on a free loopback port; a device of the same install syncs to it."""
    db = installed.work / "server.db"
    stderr_path = installed.work / "server.stderr"
    with stderr_path.open("w") as stderr:
        server = subprocess.Popen(
            [installed.exe("pleach-server"), "--host", "127.0.0.1", "--port", "0", "--db", str(db)],
            cwd=installed.work,
            env=clean_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    assert server.stdout is not None
    lines: queue.Queue[str | None] = queue.Queue()
    reader = threading.Thread(target=_lines, args=(server.stdout, lines), daemon=True)
    reader.start()
    try:
        url = ""
        deadline = time.monotonic() + 60
        while not url:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"pleach-server did not say it listens: {stderr_path.read_text()}")
            assert line is not None, f"pleach-server ended early: {stderr_path.read_text()}"
            if found := re.search(r"listening on (ws://127\.0\.0\.1:(\d+)/sync)", line):
                url, port = found.group(1), int(found.group(2))
        assert port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as resp:
            assert resp.status == 200
            assert json.loads(resp.read())["status"] == "ok"
        assert db.is_file() and Path(f"{db}.secret").is_file()

        token = run(
            [
                installed.exe("pleach-server"),
                "token",
                "create",
                "--user",
                "anonymous",
                "--db",
                str(db),
            ],
            cwd=installed.work,
        )
        assert token.returncode == 0, token.stderr
        device = str(installed.work / "device.db")
        chat = run(
            [installed.exe("pleach"), "--db", device, "chat", "--offline", "-m", "from the wheel"],
            cwd=installed.work,
        )
        assert chat.returncode == 0 and "You said: from the wheel" in chat.stdout, chat.stderr
        sync = run(
            [installed.exe("pleach"), "--db", device, "--json", "sync", "--server", url,
             "--token", token.stdout.strip()],
            cwd=installed.work,
        )  # fmt: skip
        assert sync.returncode == 0, sync.stderr
        assert '"outcome":"all-flushed"' in sync.stdout and '"pending":0' in sync.stdout
    finally:
        server.terminate()
        code = server.wait(timeout=30)
        reader.join(timeout=30)
        server.stdout.close()
    err = stderr_path.read_text()
    assert code == 0, err
    assert "Traceback" not in err, err


def test_demo_converges(installed: Installed) -> None:
    proc = run([installed.exe("pleach"), "demo"], cwd=installed.work)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "conflict" in proc.stdout and "identical: yes" in proc.stdout


def test_readme_quickstart_runs_on_the_installed_package(
    installed: Installed, tmp_path: Path
) -> None:
    readme = (ROOT / "README.md").read_text()
    code = re.findall(r"```python\n(.*?)```", readme, re.S)[0]
    script = tmp_path / "quickstart.py"
    script.write_text(code)
    proc = run([installed.python, str(script)], cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "[calculator -> 42]" in proc.stdout and "ok=True" in proc.stdout
    assert "state='offline'" in proc.stdout
    assert (tmp_path / "device.db").is_file()
