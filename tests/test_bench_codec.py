"""The codec benchmark runs on a device file as the store writes it."""

from __future__ import annotations

from bench import bench_codec


def test_the_codec_benchmark_reads_each_body_as_the_store_gives_it() -> None:
    """``bench_codec`` measures the codec on a real device file's bodies of every table. It
    reads them as the store's queries give them (whole), so the bodies the store keeps short
    (device schema 10) are measured, not refused: it once read them raw and failed, and no
    test ran it (a row per table and direction, each with its floor)."""
    rows = bench_codec.run(quick=True)
    figures = {row.figure.split(" (")[0] for row in rows}
    tables = ("events", "messages", "checkpoints", "audit", "sessions")
    assert figures == {f"{way} {table}" for way in ("decode", "encode") for table in tables}
    assert all(row.value > 0 and row.baseline > 0 for row in rows)
