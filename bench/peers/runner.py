"""``python -m bench.peers [--quick] [--install] [--json [PATH]]``: pleach beside its peers.

Runs each side in a subprocess of its own: pleach and the raw ``sqlite3`` floor from this
interpreter (the project's ``.venv``), the peers from ``.venv-peers`` (``--install`` creates it
and installs the pinned peer packages there, one group at a time; ``.venv`` is never touched).
Each subprocess prints one JSON line; a side that fails to install or to run is reported with
its reason and the others go on. Prints one table per workload (value, unit, ratio to the
floor measured in the same run) and, with ``--json``, writes every figure to PATH (default
``bench/results-peers.json``).

Workloads: ``conversation`` (1,000 turns, 200 + 800 bytes a turn, one SQLite file; floor:
plain ``sqlite3`` inserting the same two messages, one transaction per turn, run before each
side and after the last, the median of those runs), ``live`` (one client's change reaching a
second live client; floor: a raw ``websockets`` relay of the same bytes) and ``full sync`` (K
turns reaching a fresh client; floor: a raw ``websockets`` echo of the same bytes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.peers.common import MARKER

ROOT = Path(__file__).resolve().parents[2]
PEERS_VENV = ROOT / ".venv-peers"
DEFAULT_JSON = ROOT / "bench" / "results-peers.json"
SUBPROCESS_TIMEOUT = 900.0  # seconds; a side that takes longer is stopped and reported
INSTALL_TIMEOUT = 600.0

# Pinned so that a regenerated table compares like with like; bump them here on purpose.
# websockets in .venv-peers is pinned to the version in .venv (see ``peer_requirements``), so
# both sides' raw baselines run on the same websockets.
PEER_GROUPS: dict[str, list[str]] = {
    "langgraph": ["langgraph==1.2.24", "langgraph-checkpoint-sqlite==3.1.2"],
    "openai-agents": ["openai-agents==0.24.0"],
    "pycrdt-websocket": ["pycrdt==0.14.13", "pycrdt-websocket==0.16.5"],
}


@dataclass(frozen=True)
class Sizes:
    turns: int  # conversation turns
    rounds: int  # live rounds
    sync_turns: int  # full-sync turns
    reps: int  # full-sync repetitions


FULL = Sizes(turns=1000, rounds=200, sync_turns=150, reps=3)
QUICK = Sizes(turns=300, rounds=50, sync_turns=40, reps=2)


# -- the table ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One printed figure; ``ratio`` is ``value / floor`` (read it with the unit). A row with
    ``value`` None is a heading; ``is_floor`` marks the floor rows themselves."""

    figure: str
    value: float | None = None
    unit: str = ""
    floor: float | None = None
    is_floor: bool = False

    @property
    def ratio(self) -> float | None:
        if self.value is None or self.floor is None or self.floor == 0:
            return None
        return self.value / self.floor

    def to_json(self) -> dict[str, Any]:
        return {
            "figure": self.figure,
            "value": self.value,
            "unit": self.unit,
            "floor": self.floor,
            "ratio": self.ratio,
        }


def _num(value: float | None) -> str:
    if value is None or math.isnan(value):
        return ""
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def render(title: str, rows: Sequence[Row]) -> str:
    """A plain fixed-width table: figure, value, unit, ratio to the floor."""
    header = ("figure", "value", "unit", "ratio to floor")
    cells = []
    for r in rows:
        if r.value is None:
            ratio = ""
        elif r.is_floor:
            ratio = "(floor)"
        else:
            ratio = "-" if r.ratio is None else f"{r.ratio:.2f}x"
        cells.append((r.figure, _num(r.value), r.unit, ratio))
    widths = [max(len(str(c[i])) for c in [header, *cells]) for i in range(len(header))]
    right = {1, 3}

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if i in right else v.ljust(w)
            for i, (v, w) in enumerate(zip(values, widths, strict=True))
        ).rstrip()

    out = [title, line(header), "-" * len(line(header))]
    out.extend(line(c) for c in cells)
    return "\n".join(out)


# -- install and run the sides -----------------------------------------------------------------


def peers_python() -> Path:
    return PEERS_VENV / "bin" / "python"


def peer_requirements() -> dict[str, list[str]]:
    groups = {name: list(reqs) for name, reqs in PEER_GROUPS.items()}
    try:
        groups["pycrdt-websocket"].append(f"websockets=={metadata.version('websockets')}")
    except metadata.PackageNotFoundError:
        groups["pycrdt-websocket"].append("websockets")
    return groups


def _tail(text: str, lines: int = 6) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def install() -> dict[str, str]:
    """Create ``.venv-peers`` if needed and install each peer group; returns group -> "ok" or
    why it failed. Never touches ``.venv``."""
    status: dict[str, str] = {}
    if not peers_python().exists():
        print(f"creating {PEERS_VENV.name} ...", flush=True)
        made = subprocess.run(
            [sys.executable, "-m", "venv", str(PEERS_VENV)], capture_output=True, text=True
        )
        if made.returncode != 0:
            why = f"python -m venv failed: {_tail(made.stderr)}"
            return {name: why for name in PEER_GROUPS}
        subprocess.run(
            [str(peers_python()), "-m", "pip", "install", "-q", "--upgrade", "pip"],
            capture_output=True,
            timeout=INSTALL_TIMEOUT,
        )
    for name, reqs in peer_requirements().items():
        print(f"installing {name} into {PEERS_VENV.name}: {' '.join(reqs)}", flush=True)
        try:
            done = subprocess.run(
                [str(peers_python()), "-m", "pip", "install", "-q", *reqs],
                capture_output=True,
                text=True,
                timeout=INSTALL_TIMEOUT,
            )
        except subprocess.TimeoutExpired:
            status[name] = f"pip install timed out after {INSTALL_TIMEOUT:.0f}s"
        else:
            status[name] = (
                "ok" if done.returncode == 0 else f"pip install failed: {_tail(done.stderr)}"
            )
        if status[name] != "ok":
            print(f"  {name}: {status[name]}", flush=True)
    return status


def run_side(label: str, python: Path, module: str, args: Sequence[str]) -> dict[str, Any]:
    """Run ``python -m module args`` in the project root; its JSON line, or ``failed``."""
    if not python.exists():
        return {"failed": f"{python} does not exist (run `make bench-peers`, or --install)"}
    print(f"  {label} ...", end=" ", flush=True)
    started = time.perf_counter()
    try:
        done = subprocess.run(
            [str(python), "-m", module, *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=SUBPROCESS_TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        print("timed out", flush=True)
        return {"failed": f"stopped after {SUBPROCESS_TIMEOUT:.0f}s"}
    seconds = time.perf_counter() - started
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARKER)]
    if done.returncode != 0 or not lines:
        why = _tail(done.stderr) or _tail(done.stdout) or f"exit code {done.returncode}"
        print(f"failed ({seconds:.1f}s)", flush=True)
        return {"failed": why}
    print(f"{seconds:.1f}s", flush=True)
    result: dict[str, Any] = json.loads(lines[-1][len(MARKER) :])
    result["wall_s"] = seconds
    return result


# -- workloads ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Side:
    key: str
    label: str  # the row heading
    python: Path
    module: str
    args: tuple[str, ...] = ()


def conversation_sides() -> list[Side]:
    here = Path(sys.executable)
    return [
        Side(
            "pleach",
            "pleach: SessionRuntime(SQLiteAdapter), ScriptedProvider, a checkpoint per turn",
            here,
            "bench.peers.pleach_side",
            ("conversation",),
        ),
        Side(
            "langgraph",
            "LangGraph SqliteSaver, add_messages (invoke per turn, its checkpoints)",
            peers_python(),
            "bench.peers.peer_langgraph",
            ("--variant", "add_messages"),
        ),
        Side(
            "langgraph-delta",
            "LangGraph SqliteSaver, DeltaChannel (beta; invoke per turn, its checkpoints)",
            peers_python(),
            "bench.peers.peer_langgraph",
            ("--variant", "delta"),
        ),
        Side(
            "openai-agents",
            "OpenAI Agents SQLiteSession.add_items (no model call, no checkpoints)",
            peers_python(),
            "bench.peers.peer_openai_agents",
        ),
    ]


FIGURES = (
    ("file_bytes", "file bytes after {turns:,} turns (db + wal + shm, closed)", "bytes"),
    ("p50_early_us", "turn p50, turns {early}", "us"),
    ("p50_late_us", "turn p50, turns {late}", "us"),
    ("p99_late_us", "turn p99, turns {late}", "us"),
)


def _window(pair: Sequence[int]) -> str:
    return f"{pair[0]:,}-{pair[1]:,}"


def conversation(sizes: Sizes, tmp: Path) -> tuple[dict[str, Any], list[Row], list[str]]:
    print(f"conversation: {sizes.turns:,} turns per side", flush=True)
    turns = ("--turns", str(sizes.turns), "--dir", str(tmp))
    floors: list[dict[str, Any]] = []
    results: dict[str, Any] = {}

    def floor(n: int) -> None:
        r = run_side(f"floor #{n}: raw sqlite3", Path(sys.executable), "bench.peers.floor", turns)
        if "failed" not in r:
            floors.append(r)

    for n, side in enumerate(conversation_sides(), start=1):
        floor(n)
        results[side.key] = run_side(side.label, side.python, side.module, (*side.args, *turns))
    floor(len(results) + 1)

    notes: list[str] = []
    rows: list[Row] = []
    median_floor: dict[str, float] = {}
    if floors:
        first = floors[0]
        names = {
            "turns": first["turns"],
            "early": _window(first["early_window"]),
            "late": _window(first["late_window"]),
        }
        median_floor = {k: statistics.median(f[k] for f in floors) for k, _, _ in FIGURES}
        rows.append(
            Row(
                f"floor: raw sqlite3, 2 INSERTs in 1 transaction per turn (median of"
                f" {len(floors)} runs)"
            )
        )
        for key, text, unit in FIGURES:
            value = median_floor[key]
            rows.append(Row("  " + text.format(**names), value, unit, value, is_floor=True))
    else:
        notes.append("floor: every run failed, so no ratios")
        names = {"turns": sizes.turns, "early": "early", "late": "late"}
    for side in conversation_sides():
        result = results[side.key]
        if "failed" in result:
            notes.append(f"{side.label}: failed: {result['failed']}")
            continue
        heading = side.label
        if "checkpoints" in result:
            heading += f" [{result['checkpoints']:,} checkpoint rows]"
        rows.append(Row(heading))
        for key, text, unit in FIGURES:
            label = text.format(
                turns=result["turns"],
                early=_window(result["early_window"]),
                late=_window(result["late_window"]),
            )
            rows.append(Row("  " + label, result[key], unit, median_floor.get(key)))
    data = {"turns": sizes.turns, "floor_runs": floors, "floor": median_floor, "sides": results}
    return data, rows, notes


def live_and_sync(
    sizes: Sizes, tmp: Path
) -> tuple[dict[str, Any], list[Row], list[Row], list[str]]:
    print(
        f"live ({sizes.rounds} rounds) and full sync ({sizes.sync_turns} turns, {sizes.reps} reps)",
        flush=True,
    )
    common = ("--dir", str(tmp), "--rounds", str(sizes.rounds), "--turns", str(sizes.sync_turns))
    pycrdt = run_side(
        "pycrdt-websocket",
        peers_python(),
        "bench.peers.peer_pycrdt",
        (*common, "--reps", str(max(sizes.reps, 5))),
    )
    pleach = run_side(
        "pleach (bench_sync's functions)",
        Path(sys.executable),
        "bench.peers.pleach_side",
        ("sync", *common, "--reps", str(sizes.reps)),
    )
    notes: list[str] = []
    live: list[Row] = []
    sync: list[Row] = []

    def latency(floor_label: str, label: str, part: dict[str, Any]) -> None:
        live.append(Row(floor_label))
        live.append(Row("  p50", part["relay_p50_ms"], "ms", part["relay_p50_ms"], True))
        live.append(Row("  p99", part["relay_p99_ms"], "ms", part["relay_p99_ms"], True))
        live.append(Row(label))
        live.append(Row("  p50", part["p50_ms"], "ms", part["relay_p50_ms"]))
        live.append(Row("  p99", part["p99_ms"], "ms", part["relay_p99_ms"]))

    def rate(floor_label: str, label: str, part: dict[str, Any]) -> None:
        sync.append(Row(floor_label))
        for key, unit in (("changes_per_s", "changes/s"), ("turns_per_s", "turns/s")):
            echo = part[f"echo_{key}"]
            sync.append(Row(f"  {unit.split('/')[0]}", echo, unit, echo, True))
        sync.append(Row(label))
        for key, unit in (("changes_per_s", "changes/s"), ("turns_per_s", "turns/s")):
            sync.append(Row(f"  {unit.split('/')[0]}", part[key], unit, part[f"echo_{key}"]))

    if "failed" in pycrdt:
        notes.append(f"pycrdt-websocket: failed: {pycrdt['failed']}")
    else:
        lv, sy = pycrdt["live"], pycrdt["sync"]
        latency(
            f"floor: raw websockets relay A -> B of pycrdt's update"
            f" ({lv['payload_bytes']:,.0f} B, 1 turn)",
            f"pycrdt-websocket: A's Map transaction (1 turn) -> B's observer,"
            f" {lv['rounds']} rounds",
            lv,
        )
        rate(
            f"floor: raw websockets echo of the bytes the fresh client received"
            f" ({sy['bytes'] / 1024:,.0f} KiB)",
            f"pycrdt-websocket: fresh client C syncs {sy['turns']} turns = {sy['changes']}"
            f" changes (median of {sy['reps']})",
            sy,
        )
    if "failed" in pleach:
        notes.append(f"pleach sync figures: failed: {pleach['failed']}")
    else:
        lv = pleach["live"]
        if "failed" in lv:
            notes.append(f"pleach live: failed: {lv['failed']}")
        else:
            latency(
                f"floor: raw websockets relay A -> B of pleach's Push"
                f" ({lv['payload_bytes'] / 1024:.1f} KiB, 1 turn)",
                f"pleach: A's turn commit -> B's sync.applied (bench_sync fan-out),"
                f" {lv['rounds']} rounds",
                lv,
            )
            store_push = lv["server_store_push_mean_ms"]
            live.append(Row("  of which the server's store.push, mean", store_push, "ms"))
        for key, text in (
            (
                "sync_once",
                "pleach: sync_once of {turns} offline turns = {changes:,} changes"
                " (flush; nothing pulled back, protocol 6; bench_sync), median of {reps}",
            ),
            (
                "fresh_pull",
                "pleach: fresh device B pulls A's {turns} turns = {changes:,} changes"
                " (sync_once), median of {reps}",
            ),
        ):
            part = pleach[key]
            if "failed" in part:
                notes.append(f"pleach {key}: failed: {part['failed']}")
                continue
            rate(
                f"floor: raw websockets echo of pleach's Push payloads"
                f" ({part['bytes'] / 1024:,.0f} KiB)",
                text.format(**part),
                part,
            )
    data = {"pycrdt-websocket": pycrdt, "pleach": pleach}
    return data, live, sync, notes


# -- main --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer turns and rounds")
    parser.add_argument(
        "--install", action="store_true", help="create .venv-peers and install the peers first"
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        type=Path,
        nargs="?",
        const=DEFAULT_JSON,
        help="also write the figures as JSON to PATH (default bench/results-peers.json)",
    )
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL

    started = time.perf_counter()
    installed = install() if args.install else {}
    results: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "quick": args.quick,
        "sizes": sizes.__dict__,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "sqlite": sqlite3.sqlite_version,
            "platform": platform.platform(terse=True),
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        },
        "install": installed,
    }
    with tempfile.TemporaryDirectory(prefix="pleach-bench-peers-") as tmp:
        conv, conv_rows, notes = conversation(sizes, Path(tmp))
        sync_data, live_rows, sync_rows, sync_notes = live_and_sync(sizes, Path(tmp))
    notes += sync_notes
    for name, status in installed.items():
        if status != "ok":
            notes.append(f"install {name}: {status}")

    tables = [
        render(
            f"conversation: 1 session, {sizes.turns:,} turns of 200 + 800 bytes, one SQLite file",
            conv_rows,
        ),
        render("live: a change on client A reaching live client B", live_rows),
        render("full sync: K turns reaching a fresh client", sync_rows),
    ]
    print()
    print("\n\n".join(tables))
    if notes:
        print("\nnot measured:")
        for note in notes:
            print(f"- {note}")
    total = time.perf_counter() - started
    print(f"\n({total:.1f}s, {os.cpu_count()} cpus{', --quick' if args.quick else ''})")

    results.update(
        conversation=conv,
        live_and_sync=sync_data,
        versions=_versions(conv, sync_data),
        tables={
            "conversation": [r.to_json() for r in conv_rows],
            "live": [r.to_json() for r in live_rows],
            "full_sync": [r.to_json() for r in sync_rows],
        },
        printed="\n\n".join(tables),
        notes=notes,
        seconds=total,
    )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"results written to {args.json}")
    return 0


def _versions(*sections: dict[str, Any]) -> dict[str, str]:
    """Every package version any side reported (pleach's venv and the peers' may differ:
    then both are kept, as ``name`` and ``name (side)``)."""
    out: dict[str, str] = {}
    for section in sections:
        for side, result in section.get("sides", section).items():
            if not isinstance(result, dict):
                continue
            for name, version in result.get("versions", {}).items():
                if out.setdefault(name, version) != version:
                    out[f"{name} ({side})"] = version
    return out
