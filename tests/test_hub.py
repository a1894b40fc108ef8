"""Fan-out hub: bounded queues and cuts. Pure (no event loop) except where noted."""

from __future__ import annotations

import asyncio

import pytest

from pleach_server.hub import Hub, Subscription
from pleach_server.store.base import Tenant
from shared.errors import InvalidState
from shared.messages import Changes
from shared.records import FeedChange, Message
from tests.loop import next_tick

A = Tenant(org_id="o", user_id="a")
B = Tenant(org_id="o", user_id="b")


def _feed(cursor: int) -> list[FeedChange]:
    record = Message(
        id=f"m{cursor}",
        session_id="s",
        org_id=A.org_id,
        user_id=A.user_id,
        client_id="dev",
        hlc="0000000000001-000000-dev",
        role="user",
        content=[],
    )
    return [FeedChange(cursor=cursor, record=record)]


def _drain(sub: Subscription) -> list[Changes]:
    out = []
    while (frame := sub.get_nowait()) is not None:
        out.append(frame)
    return out


def test_publish_reaches_only_the_tenant() -> None:
    hub = Hub(queue_size=4)
    a1, a2, b1 = hub.subscribe(A), hub.subscribe(A), hub.subscribe(B)
    assert hub.publish(A, 0, 1, _feed(1)) == 2
    for sub in (a1, a2):
        (frame,) = _drain(sub)
        assert (frame.from_cursor, frame.to_cursor, frame.live) == (0, 1, True)
        assert frame.changes[0].cursor == 1
    assert _drain(b1) == []
    assert hub.publish(Tenant(org_id="x", user_id="y"), 0, 1, []) == 0


def test_full_queue_is_cut_to_one_marker() -> None:
    hub = Hub(queue_size=3)
    slow, fast = hub.subscribe(A), hub.subscribe(A)
    for cursor in range(1, 4):
        hub.publish(A, cursor - 1, cursor, _feed(cursor))
        assert _drain(fast)[0].to_cursor == cursor
    assert len(slow) == 3 and hub.drops == 0
    hub.publish(A, 3, 4, _feed(4))  # the fourth does not fit: cut
    assert hub.drops == 4 and hub.cuts == 1 and slow.cuts == 1
    (marker,) = _drain(slow)
    assert marker == Changes(from_cursor=4, to_cursor=4, changes=[], live=True)
    # The fast device was untouched by the slow one's cut.
    assert [f.to_cursor for f in _drain(fast)] == [4]
    # After a cut, frames queue normally again behind the marker.
    hub.publish(A, 4, 5, _feed(5))
    assert [f.to_cursor for f in _drain(slow)] == [5]


def test_close_unsubscribes() -> None:
    hub = Hub(queue_size=2)
    sub = hub.subscribe(A)
    assert hub.subscribers(A) == 1 and len(hub) == 1
    sub.close()
    sub.close()  # idempotent
    assert hub.subscribers(A) == 0 and len(hub) == 0
    assert hub.publish(A, 0, 1, _feed(1)) == 0


def test_queue_size_must_be_positive() -> None:
    with pytest.raises(ValueError):
        Hub(queue_size=0)


async def test_get_waits_and_close_wakes() -> None:
    hub = Hub(queue_size=2)
    sub = hub.subscribe(A)
    waiter = asyncio.create_task(sub.get())
    await next_tick()  # it runs and blocks on the empty queue
    assert not waiter.done()
    hub.publish(A, 0, 1, _feed(1))
    assert (await waiter).to_cursor == 1
    waiter = asyncio.create_task(sub.get())
    await next_tick()
    assert not waiter.done()
    hub.close()
    with pytest.raises(InvalidState):
        await waiter


def test_head_is_tracked_while_subscribed() -> None:
    hub = Hub(queue_size=4)
    assert hub.head(A) is None
    hub.note_head(A, 5)  # no subscriber: not kept
    assert hub.head(A) is None
    sub = hub.subscribe(A)
    hub.note_head(A, 5)
    assert hub.head(A) == 5
    hub.publish(A, 5, 9, _feed(9))
    assert hub.head(A) == 9
    hub.note_head(A, 7)  # never moves back
    assert hub.head(A) == 9
    sub.close()
    assert hub.head(A) is None
