"""Schedules: what the simulation does, generated from one seed and nothing else.

A ``Schedule`` is plain data: how many devices, each device's clock offset, and a list of
``Op``s. ``generate(seed)`` draws all of it from one ``random.Random(seed)``; nothing else
decides the schedule. Ops name their targets indirectly (``pick`` is an index into what the
device knows when the op runs), so any sub-list of a schedule is still a valid schedule:
that is what lets the shrinker drop ops freely.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

# The server refuses stamps more than 60 s ahead of its own clock; devices stay well inside.
MAX_SKEW_MS = 20_000

# A device's push batch size: one change a push puts a turn's changes in several pushes in
# flight at once; 200 is the default.
BATCH_SIZES: tuple[int, ...] = (1, 2, 3, 200)

# (kind, weight). Every kind is handled by ``harness.World.run_op``.
OP_WEIGHTS: tuple[tuple[str, int], ...] = (
    ("create", 5),
    ("turn", 22),
    ("turn_tool", 6),
    ("turn_abort", 5),
    ("turn_fail", 4),
    ("rename", 6),
    ("rollback", 5),
    ("fork", 3),
    ("delete", 3),
    ("resolve", 5),
    ("artifact_create", 3),
    ("artifact_edit", 5),
    ("offline", 6),
    ("online", 8),
    ("sync", 5),
    ("net_cut", 4),
    ("net_hold_live", 3),
    ("net_delay", 3),
    ("net_release", 4),
    ("net_drop_ack", 3),
    ("net_ack_error", 3),
    ("net_partition", 2),
    ("crash", 3),
    ("restart", 2),
    ("server_restart", 2),
    ("skew", 2),
    ("backup", 2),
    ("restore", 2),
    ("clone", 1),
)

NETWORK_OPS = frozenset(k for k, _ in OP_WEIGHTS if k.startswith("net_"))
TURN_OPS = frozenset({"turn", "turn_tool", "turn_abort", "turn_fail"})


@dataclass(frozen=True)
class Op:
    """One step. ``dev`` is a device index; ``pick`` chooses a session, checkpoint, conflict
    or artifact among those the device knows when the op runs; ``arg`` is a small integer
    parameter (a clock offset, a side)."""

    kind: str
    dev: int
    pick: int = 0
    arg: int = 0

    def __str__(self) -> str:
        return f"{self.kind}(dev={self.dev}, pick={self.pick}, arg={self.arg})"


@dataclass(frozen=True)
class Schedule:
    seed: int
    devices: int
    skews_ms: tuple[int, ...]
    ops: tuple[Op, ...] = field(default=())
    batches: tuple[int, ...] = ()
    """Each device's push batch size (``SyncFacet.batch_size``; none given: the default). Small
    ones put several pushes in flight at once, so refusals and lost acks land mid-window."""

    def batch_of(self, device: int) -> int | None:
        return self.batches[device] if device < len(self.batches) else None

    def with_ops(self, ops: list[Op] | tuple[Op, ...]) -> Schedule:
        return replace(self, ops=tuple(ops))

    def describe(self) -> str:
        lines = [
            f"seed {self.seed}: {self.devices} devices, clock offsets (ms) {list(self.skews_ms)}, "
            f"push batches {list(self.batches)}, {len(self.ops)} ops"
        ]
        lines.extend(f"  {i:3d}. {op}" for i, op in enumerate(self.ops))
        return "\n".join(lines)


def generate(
    seed: int,
    *,
    min_ops: int = 8,
    max_ops: int = 20,
    min_devices: int = 2,
    max_devices: int = 5,
    server_faults: bool = True,
) -> Schedule:
    """The schedule of ``seed``: the same seed always gives the same schedule."""
    rng = random.Random(seed)
    # Fewer devices are likelier (cheaper); every count from min to max occurs.
    counts = list(range(min_devices, max_devices + 1))
    devices = rng.choices(counts, weights=[len(counts) - i for i in range(len(counts))])[0]
    skews = tuple(
        rng.randint(-MAX_SKEW_MS, MAX_SKEW_MS) if rng.random() < 0.5 else 0 for _ in range(devices)
    )
    kinds = [k for k, _ in OP_WEIGHTS if server_faults or k != "server_restart"]
    weights = [w for k, w in OP_WEIGHTS if server_faults or k != "server_restart"]
    count = rng.randint(min_ops, max_ops)
    # Every schedule starts with a session on some device, so the first turns have a target.
    ops = [Op("create", rng.randrange(devices))]
    for _ in range(count - 1):
        kind = rng.choices(kinds, weights)[0]
        dev = rng.randrange(devices)
        pick = rng.randrange(1 << 16)
        arg = rng.randint(-MAX_SKEW_MS, MAX_SKEW_MS) if kind == "skew" else rng.randrange(2)
        ops.append(Op(kind, dev, pick, arg))
    # Drawn last, so a seed's devices and ops are what they were before batches were drawn.
    batches = tuple(rng.choice(BATCH_SIZES) for _ in range(devices))
    return Schedule(seed=seed, devices=devices, skews_ms=skews, ops=tuple(ops), batches=batches)


__all__ = ["MAX_SKEW_MS", "NETWORK_OPS", "OP_WEIGHTS", "TURN_OPS", "Op", "Schedule", "generate"]
