"""What every side of ``bench.peers`` shares: the workload's texts, the figures, the JSON line.

Standard library only: this module is imported from ``.venv`` (pleach, the floors) and from
``.venv-peers`` (the peers) alike.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import math
import platform
import re
import sqlite3
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "ASSISTANT_BYTES",
    "MARKER",
    "USER_BYTES",
    "assistant_text",
    "conversation_figures",
    "emit",
    "file_bytes",
    "percentile",
    "remove_db",
    "turn_args",
    "user_text",
    "versions",
    "windows",
]

USER_BYTES = 200
ASSISTANT_BYTES = 800
MARKER = "BENCH-PEERS-JSON "  # the one stdout line the runner reads

_STRIDE = 7_919  # a prime: each turn's texts start far from the last turn's


@functools.cache
def _corpus() -> str:
    """Real English prose, the same on every machine with the same Python: the reference
    documentation's topics that ship with the standard library (``pydoc_data.topics``), its
    whitespace made single spaces and non-ASCII characters left out. A workload of repeated
    words would compress tenfold and flatter any store that compresses text; this prose
    compresses about as chat text does (``deflate``: 1.5x at 200 bytes, 2.1x at 800)."""
    from pydoc_data.topics import topics

    text = re.sub(r"\s+", " ", " ".join(topics[key] for key in sorted(topics)))
    return text.encode("ascii", "ignore").decode("ascii")


def _text(label: str, i: int, size: int) -> str:
    """Turn ``i``'s text for ``label``: its head, then prose (``_corpus``), exactly ``size``
    bytes of ASCII, different for each turn and label."""
    head = f"turn {i} {label}: "
    corpus = _corpus()
    length = size - len(head)
    start = (i * _STRIDE + len(label) * 104_729) * length % (len(corpus) - length)
    return head + corpus[start : start + length]


def user_text(i: int) -> str:
    """Turn ``i``'s user message: 200 bytes."""
    return _text("user", i, USER_BYTES)


def assistant_text(i: int) -> str:
    """Turn ``i``'s assistant reply: 800 bytes."""
    return _text("assistant", i, ASSISTANT_BYTES)


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0-100)."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def file_bytes(path: Path) -> int:
    """The database file plus its WAL and shared-memory files, if any."""
    total = 0
    for suffix in ("", "-wal", "-shm"):
        candidate = Path(f"{path}{suffix}")
        if candidate.exists():
            total += candidate.stat().st_size
    return total


def remove_db(path: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


def windows(turns: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The early and late windows of 100 turns (1-based, inclusive): 51-150 and the last 100.

    With fewer than 250 turns the windows shrink so they never overlap.
    """
    width = min(100, max(1, turns // 3))
    early_start = min(51, turns - 2 * width + 1)
    return (early_start, early_start + width - 1), (turns - width + 1, turns)


def conversation_figures(seconds: Sequence[float], path: Path) -> dict[str, Any]:
    """The workload's figures from each turn's seconds and the closed database file."""
    (e0, e1), (l0, l1) = windows(len(seconds))
    early = seconds[e0 - 1 : e1]
    late = seconds[l0 - 1 : l1]
    return {
        "turns": len(seconds),
        "file_bytes": file_bytes(path),
        "early_window": [e0, e1],
        "late_window": [l0, l1],
        "p50_early_us": statistics.median(early) * 1e6,
        "p50_late_us": statistics.median(late) * 1e6,
        "p99_late_us": percentile(late, 99) * 1e6,
        "total_s": sum(seconds),
    }


def versions(*packages: str) -> dict[str, str]:
    out = {
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
    }
    for name in packages:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def turn_args(description: str, default_turns: int = 1000) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--turns", type=int, default=default_turns)
    parser.add_argument("--dir", type=Path, required=True, help="where the database file goes")
    parser.add_argument("--variant", default="", help="a variant of the peer, if it has any")
    return parser.parse_args()


def emit(result: dict[str, Any]) -> None:
    """Print the figures as the one line the runner reads (logs go to stderr)."""
    sys.stdout.write(MARKER + json.dumps(result) + "\n")
    sys.stdout.flush()
