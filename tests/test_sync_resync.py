"""The device's resync for messages a taken session names and it lacks: the decision
(``syncplan.ResyncLedger``, pure) driven by generated pulls; ``SyncFacet._wants_resync`` over
a real store (ids survive a cancelled look-up, and a pass from the start of the feed that a
disconnect or a restart cut short is made again); and the case end to end, on a real server,
as the simulation found it (seed 330,233 of the races mix)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import msgspec
import pytest

from pleach_client.runtime import SessionRuntime
from pleach_client.syncplan import RESYNC_DUE, ResyncLedger, resync_ids, resync_text
from shared.clock import HybridClock
from shared.records import Change
from tests.test_sync_e2e import ALICE, Cluster, chat, cluster  # noqa: F401 - a fixture, by name

# -- the decision, on generated pulls ------------------------------------------------------


class _Model:
    """A device's view of messages during pulls: ``server`` holds some ids, the device
    ``held`` some, and ``stored`` are the ids kept under ``RESYNC_DUE``. A page notes ids a
    taken session names and the device lacks (stored with the page); a pass from the start of
    the feed brings every id the server holds, or some of them when it is cut short; a page
    may sweep held ids again (a tombstone of the session they are filed under, while no live
    session names them: seed 11,000,540); a crash forgets what the ledger held in memory. The
    ledger decides; the model plays the reads and writes as ``SyncFacet`` does."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.universe = [f"m-{i}" for i in range(rng.randint(1, 12))]
        self.server = {m for m in self.universe if rng.random() < 0.7}
        self.held: set[str] = set()
        self.stored: set[str] = set()
        self.noted_ever: set[str] = set()
        self.ledger = ResyncLedger()
        self.completed: dict[str, int] = {}
        self.looks = 0
        self.pages = True
        self.sweeps = True
        self.named: set[str] = set()  # ids the sessions name now (a sweep: none names them)
        self.reconnected = False

    def page(self) -> None:
        """A page: a taken session names some ids, and the server's among them may come
        with it (they are then held, as an applied page stores them)."""
        if not self.pages:
            return
        # (Not what a pass under way looks for: ``plan_page`` keeps it through the cascade.)
        sweepable = sorted(self.held - self.ledger.passing)
        if self.sweeps and sweepable and self.rng.random() < 0.2:
            for m in self.rng.sample(sweepable, self.rng.randint(1, len(sweepable))):
                self.held.discard(m)
                self.named.discard(m)
        named = self.rng.sample(self.universe, self.rng.randint(0, len(self.universe)))
        self.named |= set(named)
        for m in named:
            if m in self.server and self.rng.random() < 0.5:
                self.held.add(m)
        lacking = {m for m in named if m not in self.held}
        self.noted_ever |= lacking
        if lacking:
            self.stored |= lacking  # in the page's transaction
            self.ledger.stored()

    def pull(self, cut_at: float) -> bool:
        """One pull, cut short (a disconnect, a cancel, a crash) with probability ``cut_at``
        at each step; whether it reached its end. A pass is for ids never passed before, so
        a pull makes at most one pass per id: more would be a loop."""
        if self.reconnected:
            self.ledger.stored()  # a new connection looks once
            self.reconnected = False
        self.ledger.pull_started()
        passes = 0
        while True:
            for _ in range(self.rng.randint(0, 3)):
                if self._cut(cut_at):
                    return False
                self.page()
            if self._cut(cut_at):
                return False
            for m in self.ledger.passing:
                self.completed[m] = self.completed.get(m, 0) + 1
            # (``SyncFacet`` looks up which of the pass's ids it still lacks.)
            self.ledger.end_of_feed({m for m in self.ledger.passing if m not in self.held})
            if not self.ledger.maybe_stored:
                assert not self.stored, "ids stored that no look will read"
                return True
            self.looks += 1
            if self._cut(cut_at):
                return False  # cancelled during the look-up: its transaction wrote nothing
            due = self.ledger.due(self.stored)
            keep = {m for m in due if m not in self.held}
            self.stored = keep  # the look-up's transaction
            self.ledger.start_pass(keep)
            if not keep:
                return True
            passes += 1
            assert passes <= len(self.universe), "a pull kept reading the feed again"
            if self._cut(cut_at):
                self.held |= {m for m in self.server if self.rng.random() < 0.5}  # partway
                return False
            self.held |= self.server  # the pass reads the whole feed

    def _cut(self, cut_at: float) -> bool:
        if self.rng.random() >= cut_at:
            return False
        self.reconnected = True
        if self.rng.random() < 0.3:
            self.ledger = ResyncLedger()  # a crash: the process starts again
        return True


@pytest.mark.parametrize("cut_at", [0.0, 0.1, 0.3])
def test_generated_pulls_end_holding_every_message_the_server_holds(cut_at: float) -> None:
    """Whatever pulls were cut short on the way (disconnects, cancels, crashes), two pulls
    that reach their end leave the device holding every noted message that the server
    holds and nothing stored, also when pages swept ids that a pass had brought (and named
    them again); in one process an id gets one complete pass at most in those two pulls,
    however often pages name it; and a pull that finds nothing lacking does not look (no
    transaction) once the device holds everything."""
    for seed in range(400):
        model = _Model(random.Random(seed * 7 + int(cut_at * 10)))
        for _ in range(model.rng.randint(1, 12)):
            model.pull(cut_at)
        model.completed.clear()
        model.sweeps = False
        assert model.pull(0.0) and model.pull(0.0), f"seed {seed}: a quiet pull did not end"
        looks = model.looks
        model.pages = False
        assert model.pull(0.0) and model.looks == looks, f"seed {seed}: a quiet pull looked"
        lost = (model.noted_ever & model.named & model.server) - model.held
        assert not lost, f"seed {seed} (cut_at {cut_at}): lacks {sorted(lost)} the server holds"
        assert not model.ledger.passing and not model.stored, seed
        again = {m: n for m, n in model.completed.items() if n > 1}
        assert not again, f"seed {seed}: ids passed for more than once: {again}"


def test_a_pass_cut_short_is_made_again_and_a_complete_one_is_not() -> None:
    ledger = ResyncLedger()
    assert ledger.wants_look(["m-1", "m-2"]) is True
    ledger.pull_started()
    ledger.end_of_feed()
    assert ledger.due({"m-1", "m-2"}) == {"m-1", "m-2"}
    ledger.start_pass({"m-1", "m-2"})  # a pass from the start begins
    ledger.pull_started()  # ... and a disconnect cuts it short: the next pull
    ledger.end_of_feed()
    assert ledger.due({"m-1", "m-2"}) == {"m-1", "m-2"}, "a pass cut short was counted"
    ledger.start_pass({"m-2"})  # m-1 arrived meanwhile: the pass is for m-2
    ledger.end_of_feed()  # the pass reached the end of the feed: m-2 is done
    assert ledger.done == {"m-2"} and ledger.due({"m-2"}) == set()
    assert ledger.wants_look(["m-2"]) is False  # done: a later page starts no pass
    assert ledger.wants_look(["m-2", "m-3"]) is True


def test_ids_a_pass_brought_may_get_a_pass_again_if_they_go_missing_again() -> None:
    """Seed 11,000,540: a pass brought a conflict fork's first messages; a later tombstone of
    the session they are filed under swept them (no live session named them then), and a
    later version of the fork named them again. Only ids a complete pass did not bring are
    done: those it brought get a pass of their own when they are lacking again."""
    ledger = ResyncLedger()
    ledger.start_pass({"brought", "lost"})
    ledger.end_of_feed(unfound={"lost"})  # the pass brought one; the server lacks the other
    assert ledger.done == {"lost"} and not ledger.passing
    assert ledger.wants_look(["brought"]) is True  # swept since, named again: a pass is due
    assert ledger.due({"brought", "lost"}) == {"brought"}
    assert ledger.wants_look(["lost"]) is False  # the server did not have it: not again


def test_stored_ids_are_bounded_and_junk_reads_as_none(monkeypatch: pytest.MonkeyPatch) -> None:
    import pleach_client.syncplan as syncplan

    assert syncplan.resync_ids(None) == set() and syncplan.resync_ids("not json") == set()
    assert syncplan.resync_ids('{"a": 1}') == set() and syncplan.resync_ids("[1, 2]") == set()
    assert syncplan.resync_ids(syncplan.resync_text({"b", "a"})) == {"a", "b"}
    assert syncplan.resync_text(set()) == ""
    monkeypatch.setattr(syncplan, "MAX_RESYNC_IDS", 10)
    many = {f"m-{i:03d}" for i in range(100)}
    assert len(syncplan.resync_ids(syncplan.resync_text(many))) == 10
    ledger = ResyncLedger()
    for i in range(100):
        ledger.start_pass({f"m-{i}"})
        ledger.end_of_feed()
        assert len(ledger.done) <= 10


# -- the sync facet, over a real store -----------------------------------------------------


async def _store(runtime: SessionRuntime, ids: list[str]) -> None:
    await runtime.store.set_meta(RESYNC_DUE, resync_text(set(ids)))


async def test_a_cancelled_look_keeps_the_missing_ids_for_the_next_pull(
    runtime: SessionRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    sync = runtime.sync
    await _store(runtime, ["m-1", "m-2"])
    started = asyncio.Event()

    async def stalls(plan: Any) -> Any:
        started.set()
        await asyncio.Event().wait()  # a disconnect cancels the pull while it looks

    monkeypatch.setattr(runtime.core, "transact_remote", stalls)
    look = asyncio.ensure_future(sync._wants_resync())
    await started.wait()
    look.cancel()
    with pytest.raises(asyncio.CancelledError):
        await look
    assert resync_ids(await runtime.store.get_meta(RESYNC_DUE)) == {"m-1", "m-2"}
    monkeypatch.undo()
    # The next look finds them missing here (no store holds them): a pass, once.
    assert await sync._wants_resync() is True
    assert await sync._wants_resync() is False  # the pass reached the end: done
    assert sync._resync.done == {"m-1", "m-2"}
    assert not await runtime.store.get_meta(RESYNC_DUE)  # none stored any more
    await _store(runtime, ["m-1"])
    assert await sync._wants_resync() is False


async def test_a_resync_that_a_disconnect_or_a_restart_cut_short_is_made_again(
    runtime: SessionRuntime,
) -> None:
    """The pull that decided on a pass from the start was cut short (seed 330,233 of the
    races mix: the device went offline right then): it had counted the pass as made, and
    the device never asked for the messages again. A restart forgets the ledger; the ids
    stored with the page that found them are read again."""
    sync = runtime.sync
    await _store(runtime, ["m-1"])
    sync._resync.pull_started()
    assert await sync._wants_resync() is True
    sync._resync.pull_started()  # the pass was cut short; a new connection pulls
    assert await sync._wants_resync() is True
    sync._resync = ResyncLedger()  # ... cut short again, by a crash this time
    assert await sync._wants_resync() is True
    assert await sync._wants_resync() is False


# -- end to end: real runtimes, a real server ----------------------------------------------


async def test_a_device_gets_a_forks_messages_back_though_a_disconnect_cut_its_resync(
    cluster: Cluster,  # noqa: F811 - the fixture imported above
) -> None:
    """The tablet deleted a session offline (its messages purged there), while two other
    devices renamed it at once: the server keeps the loser as a conflict fork that shares the
    session's messages. Back online, the tablet takes the fork, lacks its first messages and
    decides to read the feed again from the start, and the connection drops in that instant
    (seed 330,233 of the races mix). The next connection makes the pass, and the tablet ends
    with the fork's whole transcript."""
    laptop, phone, tablet = [await cluster.device(n) for n in ("laptop", "phone", "tablet")]
    session = await laptop.create_session(title="trip")
    await chat(laptop, session.id, "u1")
    await cluster.online(laptop, phone, tablet)
    for rt in (laptop, phone, tablet):
        await rt.sync.disconnect()
    await tablet.delete_session(session.id)
    await laptop.sessions.rename(session.id, "laptop's")
    await phone.sessions.rename(session.id, "phone's")
    await cluster.online(laptop)
    await cluster.online(phone)
    await cluster.settle(laptop, phone)
    forks = [s for s in await laptop.sessions.list() if s.forked_from == session.id]
    assert len(forks) == 1, "the concurrent renames left no conflict fork"
    fork = forks[0]
    want = [m.id for m in await laptop.sessions.messages(fork.id)]
    assert len(want) >= 2

    decided = tablet.sync._wants_resync
    cuts = 0

    async def cut_once() -> bool:
        nonlocal cuts
        wants = await decided()
        if wants and cuts == 0:
            cuts += 1
            raise ConnectionError("offline in the instant the resync was decided")
        return wants

    tablet.sync._wants_resync = cut_once  # type: ignore[method-assign]
    await cluster.online(tablet)
    assert cuts == 1, "the tablet never lacked the fork's messages: the case was not built"
    held = [m.id for m in await tablet.sessions.messages(fork.id)]
    assert held == want, f"the tablet lacks {sorted(set(want) - set(held))}"


async def test_a_pass_keeps_what_it_looks_for_though_the_fork_names_it_no_longer(
    cluster: Cluster,  # noqa: F811 - the fixture imported above
) -> None:
    """The laptop deleted a session offline (its messages purged there) while the server got
    a fork that shares them. Back online, the laptop takes the fork, lacks its messages and
    decides on a pass from the start of the feed; before the pass reads the feed, the fork's
    newest version names none of them (a rollback on another device). The pass met the
    session's tombstone with nothing naming the messages, swept them again, and counted the
    pass as made; when a later version named them again (a resolve), the laptop never asked
    for them (seed 10,741,194 of the races mix: `missing-message-record`). A pass keeps what
    it looks for through the delete cascade."""
    laptop = await cluster.device("laptop")
    session = await laptop.create_session(title="trip")
    await chat(laptop, session.id, "shared by a fork")
    await cluster.online(laptop)
    await laptop.sync.disconnect()
    row = await laptop.store.get_session(session.id)
    assert row is not None and row.state.message_ids
    shared = list(row.state.message_ids)
    await laptop.delete_session(session.id)
    assert await laptop.store.get_messages(shared) == []

    store = cluster.store
    assert store is not None
    clock = HybridClock("srv")

    async def fork_version(n: int, message_ids: list[str]) -> None:
        version = msgspec.structs.replace(
            row,
            id="fork-of-deleted",
            client_id="phone",
            vv={"phone": n},
            hlc=clock.now(),
            updated_at=clock.now(),
            state=msgspec.structs.replace(row.state, message_ids=message_ids),
            forked_from=session.id,
            conflict_id="c-1",
            conflict_loser_side="remote",
        )
        await store.push(ALICE, "phone", [Change(client_seq=n, record=version)], clock)

    await fork_version(1, shared)
    decided = laptop.sync._wants_resync
    rolled_back = 0

    async def then_a_rollback() -> bool:
        nonlocal rolled_back
        wants = await decided()
        if wants and not rolled_back:
            rolled_back += 1
            await fork_version(2, [])  # the fork's newest version names none of them
        return wants

    laptop.sync._wants_resync = then_a_rollback  # type: ignore[method-assign]
    await cluster.online(laptop)
    assert rolled_back == 1, "the laptop never lacked the fork's messages: no case was built"
    await laptop.sync.disconnect()
    await fork_version(3, shared)  # named again (as a resolve would)
    await cluster.online(laptop)
    row = await laptop.store.get_session("fork-of-deleted")
    assert row is not None and row.state.message_ids == shared
    held = [m.id for m in await laptop.sessions.messages("fork-of-deleted")]
    assert held == shared, f"the laptop lacks {sorted(set(shared) - set(held))}"
