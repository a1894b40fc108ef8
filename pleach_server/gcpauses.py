"""The cyclic garbage collector in a server process: its pauses, measured for ``/metrics``,
and what start-up made, set aside from it (``freeze_startup``).

While CPython's collector runs, nothing else in the process does: every device's push, pull
and live frame waits. A collection of the oldest generation walks every object the collector
tracks, and the time it takes grows with them: in a ``pleach-server`` process, about 29,000
objects of start-up (modules, classes, functions: many references each) and about 115 more
for each idle device connection (websockets' and asyncio's per-connection objects, the
connection's own). Under the live load of ``bench/bench_live.py`` (100 devices writing), a
server that set nothing aside made such a collection every few seconds, each pausing it
15-50 ms: the worst of the changes measured then waited for it.

``freeze_startup`` moves what start-up made into the collector's permanent generation
(``gc.freeze``), which no collection walks: a process's full collection then walks what its
connections and work hold, not the program. ``bench/bench_gc.py`` times it in two server
processes taking turns, one with start-up set aside: with 100 idle connections a full
collection took 0.21-0.25x the other's time (1.0-1.5 ms against 4.2-6.3), with 1,000 0.51-0.78x
(18-92 ms against 36-117: that walk moves with the machine's caches). Objects frozen are still
freed when their last reference goes (reference counting); only a cycle among them would never
be reclaimed, which is why it is done once, before the store or any connection exists: what is
frozen then (the program, its configuration) lives as long as the process anyway. The
``pleach-server`` command does it (``PLEACH_GC_FREEZE=0``: not); an application that runs
``SyncServer`` in its own process may call it the same way, once its imports are done.

``GcPauses`` keeps each collection's pause, by generation, in the buckets of a histogram; a
server's ``/metrics`` gives them as ``pleach_gc_pause_seconds`` (one process-wide record,
whatever number of servers it runs) beside ``pleach_gc_frozen_objects``.
"""

from __future__ import annotations

import bisect
import gc
import threading
import time
from collections.abc import Iterable
from typing import Any, Final

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric

__all__ = ["BUCKETS", "GcCollector", "GcPauses", "freeze_startup", "pauses"]

BUCKETS: Final = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
"""Upper bounds (seconds) of the pause histogram's buckets, then one for any longer pause."""
GENERATIONS: Final = 3


class GcPauses:
    """The pauses of every collection since ``install``: counts per generation and bucket,
    their sums and the longest. Kept by a ``gc.callbacks`` entry: a collection runs with the
    GIL held from its start to its stop, so a start and its stop are one collection's."""

    def __init__(self) -> None:
        self._started = 0.0
        self.counts = [[0] * (len(BUCKETS) + 1) for _ in range(GENERATIONS)]
        self.sums = [0.0] * GENERATIONS
        self.longest = [0.0] * GENERATIONS

    def install(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        seconds = time.perf_counter() - self._started
        generation = info.get("generation", GENERATIONS - 1)
        if not 0 <= generation < GENERATIONS:
            return
        self.counts[generation][bisect.bisect_left(BUCKETS, seconds)] += 1
        self.sums[generation] += seconds
        if seconds > self.longest[generation]:
            self.longest[generation] = seconds


_pauses: GcPauses | None = None
_lock = threading.Lock()


def pauses() -> GcPauses:
    """The process's one ``GcPauses``, installed on first use."""
    global _pauses
    with _lock:
        if _pauses is None:
            _pauses = GcPauses()
            _pauses.install()
        return _pauses


class GcCollector:
    """``pleach_gc_pause_seconds`` (a histogram by ``generation``), the longest pause by
    generation, and ``pleach_gc_frozen_objects``, read at scrape time."""

    def __init__(self, record: GcPauses) -> None:
        self._record = record

    def collect(self) -> Iterable[Metric]:
        record = self._record
        histogram = HistogramMetricFamily(
            "pleach_gc_pause_seconds",
            "Pauses of the cyclic garbage collector in this process (nothing else runs)",
            labels=["generation"],
        )
        longest = GaugeMetricFamily(
            "pleach_gc_pause_longest_seconds",
            "The longest collector pause in this process, by generation",
            labels=["generation"],
        )
        for generation in range(GENERATIONS):
            counts = list(record.counts[generation])
            cumulative, buckets = 0, []
            for bound, count in zip((*map(str, BUCKETS), "+Inf"), counts, strict=True):
                cumulative += count
                buckets.append((bound, cumulative))
            label = [str(generation)]
            histogram.add_metric(label, buckets, record.sums[generation])
            longest.add_metric(label, record.longest[generation])
        frozen = GaugeMetricFamily(
            "pleach_gc_frozen_objects",
            "Objects set aside from every collection at start-up (gc.freeze)",
        )
        frozen.add_metric([], gc.get_freeze_count())
        return [histogram, longest, frozen]


def freeze_startup() -> int:
    """Collect once, then move every object the collector tracks into its permanent
    generation (``gc.freeze``); returns how many are there. Call it once, when the imports
    and configuration are done and before any store, connection or task exists."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
