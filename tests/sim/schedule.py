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
    ("resume", 3),
)

# The ops drawn between the steps of a "races" schedule (``_race_ops``): edits, more conflicts
# and deletes, devices going off and on, and some network and process faults.
RACE_NOISE: tuple[tuple[str, int], ...] = (
    ("turn", 10),
    ("rename", 6),
    ("delete", 3),
    ("resolve", 6),
    ("fork", 1),
    ("rollback", 1),
    ("artifact_edit", 2),
    ("offline", 5),
    ("online", 6),
    ("sync", 5),
    ("net_cut", 1),
    ("net_drop_ack", 1),
    ("net_hold_live", 1),
    ("crash", 1),
    ("server_restart", 1),
    ("resume", 2),
)

MIXES: tuple[str, ...] = ("all", "races")
"""How a schedule is drawn: ``all``, every op by ``OP_WEIGHTS``; ``races``, a conflict, a
turn in its fork, a delete on a device that never saw the resolve, and the resolve, in a
drawn order with drawn ops between them (``_race_ops``). A seed means one schedule per mix."""

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
    mix: str = "all"
    """The op weights it was drawn with (``MIXES``)."""

    @property
    def small_id_blocks(self) -> bool:
        """Whether the devices' SQLite stores keep every session's message ids in blocks of
        two (``tests.factories.small_id_blocks``): every other seed, so that the blocks' path
        (written by long sessions only, with the defaults) meets every schedule's races. Of
        the seed, not of its draw: the ops of a seed stay what they were."""
        return self.seed % 2 == 0

    @property
    def server_id_blocks(self) -> bool:
        """Whether the server store keeps every session of more than two message ids in
        blocks of three (``tests.server_store_conformance.SMALL_BLOCKS``; with the defaults
        only a session of more than 128 ids): every other four seeds, apart from the two
        parities above. The embedded backends only (a server process keeps its defaults)."""
        return (self.seed // 4) % 2 == 1

    @property
    def folds_after_pulls(self) -> bool:
        """Whether the devices fold, at the end of each pull, the log of every session it
        brought an event (``SyncFacet.fold_after_pull_events`` = 1; the default is a thousand
        events, which no schedule reaches): every other pair of seeds, apart from the blocks'
        parity, so that folds kept by pulls meet every schedule's races and the checker's
        resume reads them (``hydration-differs``)."""
        return (self.seed // 2) % 2 == 1

    def protocol_of(self, device: int) -> int | None:
        """The newest protocol version ``device`` offers (None: the newest this code speaks).
        Every other eight seeds the last device stays before protocol 9 (at 8 half the time,
        at 7 or 6 a quarter each), so that a fleet of mixed versions meets every schedule's
        races: its bodies travel with their long texts written out (before 9,
        ``shared.compact.inflated``) and in the form before 8 (``shared.compact.explicit``)
        both ways, beside devices that write texts deflated, their device implied and audit
        usage as arrays."""
        if (self.seed // 8) % 2 == 0 or device != self.devices - 1:
            return None
        return (8, 7, 8, 6)[(self.seed // 16) % 4]

    def batch_of(self, device: int) -> int | None:
        return self.batches[device] if device < len(self.batches) else None

    def with_ops(self, ops: list[Op] | tuple[Op, ...]) -> Schedule:
        return replace(self, ops=tuple(ops))

    def describe(self) -> str:
        mix = "" if self.mix == "all" else f" ({self.mix} mix)"
        lines = [
            f"seed {self.seed}{mix}: {self.devices} devices, clock offsets (ms) "
            f"{list(self.skews_ms)}, push batches {list(self.batches)}, {len(self.ops)} ops"
            + (", ids in small blocks" if self.small_id_blocks else "")
            + (", logs folded after pulls" if self.folds_after_pulls else "")
            + (", server ids in small blocks" if self.server_id_blocks else "")
            + "".join(
                f", dev{i} at protocol {v}"
                for i in range(self.devices)
                if (v := self.protocol_of(i)) is not None
            )
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
    mix: str = "all",
) -> Schedule:
    """The schedule of ``seed`` in ``mix``: the same seed always gives the same schedule."""
    rng = random.Random(seed)
    # Fewer devices are likelier (cheaper); every count from min to max occurs.
    counts = list(range(min_devices, max_devices + 1))
    devices = rng.choices(counts, weights=[len(counts) - i for i in range(len(counts))])[0]
    skews = tuple(
        rng.randint(-MAX_SKEW_MS, MAX_SKEW_MS) if rng.random() < 0.5 else 0 for _ in range(devices)
    )
    if mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r}; one of {MIXES}")
    if mix == "races":
        devices = max(devices, 3)
        skews = (*skews, *(0 for _ in range(devices - len(skews))))
        ops = _race_ops(rng, devices, server_faults)
        batches = tuple(rng.choice(BATCH_SIZES) for _ in range(devices))
        return Schedule(
            seed=seed, devices=devices, skews_ms=skews, ops=tuple(ops), batches=batches, mix=mix
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
    return Schedule(
        seed=seed, devices=devices, skews_ms=skews, ops=tuple(ops), batches=batches, mix=mix
    )


def _race_ops(rng: random.Random, devices: int, server_faults: bool) -> list[Op]:
    """A resolve and a delete that meet. Roles: ``a`` and ``b`` edit the first session while
    ``b`` is offline, and both sync, so each sees the conflict and its fork; ``d`` has the
    session but is offline from then on, and deletes it; ``a`` or ``b`` writes a turn in the
    fork (``pick`` 1: the second session by age) and resolves the conflict either way; then
    the delete and the resolve reach the server in a drawn order. Between every two steps,
    0-2 ops drawn from ``RACE_NOISE``. Every sub-list is still a valid schedule."""
    a, b, d = rng.sample(range(devices), 3)
    resolver = rng.choice((a, b))
    steps: list[list[Op]] = [
        [Op("create", a), Op("turn", a)],
        [Op("online", a), Op("online", b), Op("online", d)],
        [Op("sync", a), Op("sync", b), Op("sync", d)],
        [Op("offline", d), Op("offline", b)],
        [Op("turn", a), Op("turn", b)],
        [Op("online", b), Op("sync", b), Op("sync", a), Op("sync", b)],
        [Op("turn", resolver, pick=1)],
        [Op("delete", d, pick=0)],
    ]
    resolve = [Op("offline", resolver), Op("resolve", resolver, pick=0, arg=rng.randrange(2))]
    delete_first = rng.random() < 0.5
    back = [Op("online", d), Op("sync", d)]
    again = [Op("online", resolver), Op("sync", resolver)]
    steps += [resolve, *([back, again] if delete_first else [again, back])]
    steps.append([Op("sync", x) for x in (a, b, d)])
    kinds = [k for k, _ in RACE_NOISE if server_faults or k != "server_restart"]
    weights = [w for k, w in RACE_NOISE if server_faults or k != "server_restart"]
    ops: list[Op] = []
    for step in steps:
        ops += step
        for _ in range(rng.choice((0, 0, 1, 2))):
            kind = rng.choices(kinds, weights)[0]
            ops.append(Op(kind, rng.randrange(devices), rng.randrange(1 << 16), rng.randrange(2)))
    return ops


__all__ = [
    "MAX_SKEW_MS",
    "MIXES",
    "NETWORK_OPS",
    "OP_WEIGHTS",
    "RACE_NOISE",
    "TURN_OPS",
    "Op",
    "Schedule",
    "generate",
]
