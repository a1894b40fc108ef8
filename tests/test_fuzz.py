"""A CI slice of the frame fuzzer (``tests/fuzz.py``): 10,000 mutated and junk frames against a
live server; nothing may break it, leak another tenant's data or go unanswered by a code."""

from __future__ import annotations

from pathlib import Path

from tests.fuzz import run_fuzz


async def test_ten_thousand_hostile_frames(tmp_path: Path) -> None:
    report = await run_fuzz(10_000, seed=7, workdir=tmp_path)
    assert report.problems == [], report.summary()
    assert report.tracebacks == 0
    assert report.frames == 10_000
    # The mutations reached the rules, not only the decoder: pushes were answered too.
    assert report.answers["PushAck"] > 0 and report.answers["Error"] > 0
