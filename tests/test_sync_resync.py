"""The device's resync for messages a taken session names and it lacks
(``SyncFacet._wants_resync``): the ids it still has to look at survive a cancel."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pleach_client.runtime import SessionRuntime


async def test_a_cancelled_look_keeps_the_missing_ids_for_the_next_pull(
    runtime: SessionRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    sync = runtime.sync
    sync._missing.update({"m-1", "m-2"})
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
    assert sync._missing == {"m-1", "m-2"}
    monkeypatch.undo()
    # The next look finds them missing here (no store holds them): a resync, once.
    assert await sync._wants_resync() is True
    assert sync._missing == set() and sync._resynced == {"m-1", "m-2"}
    sync._missing.update({"m-1"})
    assert await sync._wants_resync() is False
