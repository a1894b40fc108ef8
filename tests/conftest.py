"""Shared fixtures: real stores on temporary files, scripted and real-SDK providers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from pleach_client.providers.scripted import ScriptedProvider
from pleach_client.runtime import SessionRuntime
from pleach_client.store.base import StorageAdapter
from pleach_client.store.memory import MemoryAdapter
from pleach_client.store.sqlite import SQLiteAdapter
from tests.factories import small_id_blocks


@pytest.fixture(params=["memory", "sqlite", "sqlite-blocks"])
def adapter(request: pytest.FixtureRequest, tmp_path: Path) -> StorageAdapter:
    """A fresh (unopened) local store of each kind: the runtime opens it. ``sqlite-blocks``:
    SQLite with every session's ids in small blocks (``small_id_blocks``)."""
    if request.param == "memory":
        return MemoryAdapter()
    if request.param == "sqlite-blocks":
        return small_id_blocks(SQLiteAdapter(tmp_path / "device.db"))
    return SQLiteAdapter(tmp_path / "device.db")


@pytest.fixture
def scripted() -> ScriptedProvider:
    return ScriptedProvider()


@pytest.fixture
async def runtime(
    adapter: StorageAdapter, scripted: ScriptedProvider
) -> AsyncIterator[SessionRuntime]:
    async with SessionRuntime(adapter, scripted, user_id="alice", org_id="acme") as rt:
        yield rt
