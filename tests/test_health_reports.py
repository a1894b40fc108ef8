"""``pleach_server.health``: device health reports kept in memory, written in batches.

Real SQLite server stores; the one fault (a write that fails) is a store whose ``put_health``
raises before it runs, once.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pleach_server.health import HealthReports, kept_after_failure
from pleach_server.store.base import MAX_DEVICES_PER_TENANT, DeviceHealth, Tenant
from pleach_server.store.sqlite import SQLiteServerStore
from shared.errors import StorageUnavailable
from tests.server_factories import new_tenant
from tests.server_store_conformance import report


class FailingWrites(SQLiteServerStore):
    """A real store whose next ``fail`` writes of health fail before they run."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.fail = 0
        self.calls: list[int] = []  # the size of each write asked for
        self.written = asyncio.Event()

    async def put_health(self, reports: Sequence[DeviceHealth]) -> None:
        self.calls.append(len(reports))
        if self.fail:
            self.fail -= 1
            raise StorageUnavailable("injected: the write did not happen")
        await super().put_health(reports)
        self.written.set()


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[FailingWrites]:
    async with FailingWrites(tmp_path / "server.db") as s:
        yield s


async def kept(store: SQLiteServerStore, *tenants: Tenant) -> dict[tuple[str, str], bytes]:
    orgs = {t.org_id for t in tenants}
    return {
        (r.user_id, r.client_id): r.health
        for r in await store.list_health(100_000)
        if r.org_id in orgs
    }


async def test_the_reports_of_a_second_share_one_write(store: FailingWrites) -> None:
    ann, bob = new_tenant(), new_tenant()
    reports = HealthReports(store, flush_after=3600)
    newest: dict[tuple[str, str], bytes] = {}
    for round_ in range(3):  # each device reports three times before the write
        for tenant in (ann, bob):
            for d in range(10):
                body = f"{tenant.user_id}/{d}/{round_}".encode()
                reports.put(report(tenant, f"dev-{d}", body, 1000.0 + round_))
                newest[(tenant.user_id, f"dev-{d}")] = body
    assert reports.waiting == 20 and store.calls == []
    assert await kept(store, ann, bob) == {}  # nothing written yet
    assert await reports.flush() == 20
    assert store.calls == [20] and reports.writes == 1 and reports.written == 20
    assert await kept(store, ann, bob) == newest
    assert await reports.flush() == 0 and store.calls == [20]  # nothing waits: no write


async def test_the_writer_writes_what_waits_by_itself(store: FailingWrites) -> None:
    tenant = new_tenant()
    reports = HealthReports(store, flush_after=0.0)
    reports.start()
    try:
        reports.put(report(tenant, "laptop", b"one", 1.0))
        async with asyncio.timeout(10):
            await store.written.wait()
        assert await kept(store, tenant) == {(tenant.user_id, "laptop"): b"one"}
        assert reports.waiting == 0
    finally:
        await reports.close()


async def test_the_writer_tries_again_after_a_failed_write(
    store: FailingWrites, caplog: pytest.LogCaptureFixture
) -> None:
    tenant = new_tenant()
    reports = HealthReports(store, flush_after=0.0)
    store.fail = 3  # the store is down for three tries
    reports.start()
    try:
        reports.put(report(tenant, "laptop", b"kept", 1.0))
        async with asyncio.timeout(10):
            await store.written.wait()
    finally:
        await reports.close()
    assert store.calls == [1, 1, 1, 1]
    assert await kept(store, tenant) == {(tenant.user_id, "laptop"): b"kept"}
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert said == [
        "1 device health report(s) not written: injected: the write did not happen",
        "device health reports written again",
    ]


async def test_a_failed_write_keeps_the_reports_and_a_newer_one_wins(
    store: FailingWrites,
) -> None:
    tenant = new_tenant()
    reports = HealthReports(store, flush_after=3600)
    reports.put(report(tenant, "laptop", b"laptop-1", 1.0))
    reports.put(report(tenant, "phone", b"phone-1", 1.0))
    store.fail = 1
    with pytest.raises(StorageUnavailable):
        await reports.flush()
    assert reports.waiting == 2 and reports.writes == 0
    reports.put(report(tenant, "phone", b"phone-2", 2.0))  # came after the failed write
    assert await reports.flush() == 2
    assert await kept(store, tenant) == {
        (tenant.user_id, "laptop"): b"laptop-1",
        (tenant.user_id, "phone"): b"phone-2",
    }


async def test_close_writes_what_waits(store: FailingWrites) -> None:
    tenant = new_tenant()
    reports = HealthReports(store, flush_after=3600)
    reports.start()
    reports.put(report(tenant, "laptop", b"last words", 5.0))
    await reports.close()
    assert await kept(store, tenant) == {(tenant.user_id, "laptop"): b"last words"}


async def test_close_with_the_store_failing_logs_and_returns(
    store: FailingWrites, caplog: pytest.LogCaptureFixture
) -> None:
    tenant = new_tenant()
    reports = HealthReports(store, flush_after=3600)
    reports.put(report(tenant, "laptop", b"lost", 5.0))
    store.fail = 1
    await reports.close()
    assert "1 device health report(s) not written at close" in caplog.text


async def test_waiting_reports_are_bounded(store: FailingWrites) -> None:
    """A flood of invented device ids holds at most ``max_pending`` reports: the oldest
    waiting ones go, and are counted."""
    tenant = new_tenant()
    reports = HealthReports(store, flush_after=3600, max_pending=4)
    for d in range(10):
        reports.put(report(tenant, f"dev-{d}", b"h", float(d)))
    reports.put(report(tenant, "dev-7", b"again", 11.0))  # one that waits: no drop
    assert reports.waiting == 4 and reports.dropped == 6
    assert await reports.flush() == 4
    assert set(await kept(store, tenant)) == {(tenant.user_id, f"dev-{d}") for d in (6, 7, 8, 9)}


async def test_waiting_bytes_are_bounded(store: FailingWrites) -> None:
    """Large reports (the protocol allows about 12 KB) are bounded by their bytes too; the
    newest report always waits, whatever its size."""
    tenant = new_tenant()
    reports = HealthReports(store, flush_after=3600, max_bytes=1000)
    for d in range(5):
        reports.put(report(tenant, f"dev-{d}", b"x" * 300, float(d)))
    assert reports.waiting == 3 and reports.dropped == 2  # 900 bytes of the newest three
    reports.put(report(tenant, "dev-3", b"y" * 100, 9.0))  # replaces its 300: 700 bytes
    assert reports.waiting == 3 and reports.dropped == 2
    reports.put(report(tenant, "huge", b"z" * 5000, 10.0))
    assert reports.waiting == 1 and reports.dropped == 5
    assert await reports.flush() == 1
    assert set(await kept(store, tenant)) == {(tenant.user_id, "huge")}


def test_bad_settings_are_refused(tmp_path: Path) -> None:
    store = SQLiteServerStore(tmp_path / "unused.db")
    with pytest.raises(ValueError, match="flush_after"):
        HealthReports(store, flush_after=-1)
    with pytest.raises(ValueError, match="max_pending"):
        HealthReports(store, max_pending=0)
    with pytest.raises(ValueError, match="max_bytes"):
        HealthReports(store, max_bytes=0)


# -- generated ----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(12))
async def test_generated_reports_writes_and_failures(store: FailingWrites, seed: int) -> None:
    """Random reports of devices of several users, writes that succeed or fail, a small or a
    large bound. Invariants: what waits never exceeds the bound; what the store keeps of a
    device never gets older; after a last write, every device keeps its newest report, but
    for at most as many devices as reports were dropped (the bound), and the per-user bound."""
    rng = random.Random(seed)
    tenants = [new_tenant() for _ in range(3)]
    devices = [(t, f"dev-{d}") for t in tenants for d in range(rng.choice([3, 8, 70]))]
    bound = rng.choice([2, 5, 10_000])
    byte_bound = rng.choice([200, 1 << 20])
    reports = HealthReports(store, flush_after=3600, max_pending=bound, max_bytes=byte_bound)
    newest: dict[tuple[str, str], tuple[float, bytes]] = {}
    seen: dict[tuple[str, str], float] = {}
    clock = 0.0
    for _ in range(rng.randrange(50, 300)):
        roll = rng.random()
        if roll < 0.8:
            tenant, client = rng.choice(devices)
            clock += 1.0
            body = f"{client}@{clock}".encode() + b"." * rng.choice([0, 0, 40, 150])
            reports.put(report(tenant, client, body, clock))
            newest[(tenant.user_id, client)] = (clock, body)
        else:
            store.fail = int(roll < 0.87)
            try:
                await reports.flush()
            except StorageUnavailable:
                pass
            for r in await store.list_health(100_000):
                key = (r.user_id, r.client_id)
                assert r.seen_at >= seen.get(key, 0.0), f"{key} went back (seed {seed})"
                seen[key] = r.seen_at
        assert reports.waiting <= bound
        waiting = sum(len(r.health) for r in reports._waiting.values())
        assert reports.waiting == 1 or waiting <= byte_bound
    store.fail = 0
    await reports.flush()
    held = {
        (r.user_id, r.client_id): (r.seen_at, r.health) for r in await store.list_health(100_000)
    }
    per_user = {t.user_id: sum(1 for k in newest if k[0] == t.user_id) for t in tenants}
    stale = [k for k, v in newest.items() if held.get(k) != v]
    trimmed = sum(max(0, n - MAX_DEVICES_PER_TENANT) for n in per_user.values())
    assert len(stale) <= reports.dropped + trimmed, (seed, stale[:5], reports.dropped)
    if bound == 10_000 and byte_bound == 1 << 20:
        assert reports.dropped == 0
    if reports.dropped == 0:
        for user, n in per_user.items():
            assert sum(1 for k in held if k[0] == user) == min(n, MAX_DEVICES_PER_TENANT)
        if not trimmed:
            assert stale == []


keys = st.tuples(st.sampled_from("ab"), st.sampled_from("xy"), st.sampled_from("pqrs"))


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(keys, st.floats(0, 100), max_size=12),
    st.dictionaries(keys, st.floats(101, 200), max_size=12),
    st.integers(1, 30),
    st.integers(1, 400),
)
def test_kept_after_failure(
    failed: dict[tuple[str, str, str], float],
    waiting: dict[tuple[str, str, str], float],
    bound: int,
    byte_bound: int,
) -> None:
    def as_reports(
        d: dict[tuple[str, str, str], float],
    ) -> dict[tuple[str, str, str], DeviceHealth]:
        return {
            k: DeviceHealth(
                org_id=k[0], user_id=k[1], client_id=k[2], seen_at=v, health=b"h" * len(k[2]) * 10
            )
            for k, v in d.items()
        }

    out = kept_after_failure(as_reports(failed), as_reports(waiting), bound, byte_bound)
    everyone = [*(k for k in failed if k not in waiting), *waiting]
    # The newest that fit both bounds, the oldest going first (the newest always stays).
    fit, size = 0, 0
    for k in reversed(everyone):
        if fit and (fit + 1 > bound or size + 10 * len(k[2]) > byte_bound):
            break
        fit, size = fit + 1, size + 10 * len(k[2])
    assert list(out) == everyone[len(everyone) - fit :]
    for k, r in out.items():
        assert r.seen_at == (waiting[k] if k in waiting else failed[k])  # the newer one wins
