"""Protocol 7: a long session's message ids sent once per connection (``shared.idrefs``).

The guarantee: whatever sequence of bodies a sender sends, the receiver reads back every one
byte for byte, and the two sides' lists stay equal; a reference the receiver cannot resolve
is refused, never read as some other list. Shown by generated sequences, then at the
protocol's seams (a push refused unread, a reconnect), then end to end over a real server.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pleach_client.runtime import SessionRuntime
from pleach_server.store.base import APART, session_row, stored_body
from shared import compact, idrefs
from shared.errors import ErrorCode, RateLimited
from shared.idrefs import MIN_IDS, IdLists
from shared.ids import uuid7
from shared.messages import MAX_PROTOCOL, Changes, FeedBody, FrameCodec, Push, Welcome
from shared.protocol import Answer, ClientProtocol, Live, ServerProtocol, State
from shared.records import Change, Session, SessionState
from tests.factories import make_event, make_message, make_session
from tests.test_sync_e2e import ALICE, Cluster, chat, snapshot

codec = FrameCodec()


def _session(session_id: str, ids: list[str], title: str = "") -> Session:
    return make_session(id=session_id, title=title, state=SessionState(message_ids=ids))


_OPS = st.lists(
    st.tuples(
        st.sampled_from(
            ["append", "append-many", "cut", "replace", "same", "texts", "other", "map", "none"]
        ),
        st.integers(min_value=0, max_value=2),  # which session
        st.integers(min_value=0, max_value=90),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(ops=_OPS, budget=st.sampled_from([idrefs.MAX_HELD_BYTES, 3000, 1100]))
def test_the_receiver_reads_every_body_as_sent_and_the_lists_agree(
    ops: list[tuple[str, int, int]], budget: int
) -> None:
    """Generated bodies of three sessions (lists grown by a few or many, cut, replaced, sent
    again unchanged, holding ids that are no UUIDs, no list at all), other records and
    map-form bodies between them, through a sender and a receiver of the same budget (small
    ones evict): every body reads back byte for byte, a grown list of at least ``MIN_IDS``
    ids travels as a reference, and both sides hold the same lists throughout."""
    sender, receiver = IdLists(budget), IdLists(budget)
    sessions = [uuid7() for _ in range(3)]
    lists: list[list[str]] = [[], [], []]
    for op, which, n in ops:
        ids = lists[which]
        kept = None
        if op == "append":
            ids = ids + [uuid7() for _ in range(n % 3 + 1)]
        elif op == "append-many":
            ids = ids + [uuid7() for _ in range(n)]
        elif op == "cut":
            ids = ids[: max(0, len(ids) - n)]
        elif op == "replace":
            ids = [uuid7() for _ in range(n)]
        elif op == "texts":
            ids = [*ids, f"not-a-uuid-{n}"]
        if op == "other":
            body = compact.encode(make_message(session_id=sessions[which]))
        elif op == "map":
            body = msgspec.msgpack.encode(msgspec.to_builtins(_session(sessions[which], ids)))
        elif op == "none":
            body = compact.encode(make_session(id=sessions[which]))
            ids = []
        else:
            body = compact.encode(_session(sessions[which], ids, title=f"{op} {n}"))
            kept = sender._held.get(compact.packed(sessions[which]))
        lists[which] = ids
        wire = sender.shrink(body)
        assert receiver.grow(wire) == body
        assert receiver._held == sender._held and receiver.held_bytes == sender.held_bytes
        assert sender.held_bytes <= budget
        data = compact.uuids_bytes(ids) if op not in ("other", "map", "none") else None
        extends = kept is not None and data is not None and data.startswith(kept[0])
        assert (wire is not body) == extends, (op, len(ids))
        if extends and len(ids) - len(kept[0]) // 16 < 50:  # type: ignore[index]
            assert len(wire) < len(body) - 16 * (MIN_IDS - 50)


def test_a_reference_not_held_as_named_is_refused() -> None:
    session_id = uuid7()
    ids = [uuid7() for _ in range(MIN_IDS)]
    sender, receiver = IdLists(), IdLists()
    first = compact.encode(_session(session_id, ids))
    assert receiver.grow(sender.shrink(first)) == first
    second = compact.encode(_session(session_id, [*ids, uuid7()]))
    wire = sender.shrink(second)
    assert wire != second and len(wire) < 300
    with pytest.raises(msgspec.DecodeError, match="has not carried"):
        IdLists().grow(wire)  # a receiver that never saw the first list
    forged = bytearray(wire)
    at = bytes(wire).index(receiver._held[compact.packed(session_id)][1])  # the digest named
    forged[at] ^= 1
    with pytest.raises(msgspec.DecodeError, match="has not carried"):
        receiver.grow(bytes(forged))
    assert receiver.grow(wire) == second  # the refusal took nothing: the true one still reads


def _open_pair(max_protocol: int = MAX_PROTOCOL) -> tuple[ClientProtocol, ServerProtocol]:
    """A device's protocol and a server's, past Hello and Welcome (``max_protocol``: the
    device's newest)."""
    client = ClientProtocol("dev-a", 0, max_protocol=max_protocol)
    server = ServerProtocol()
    for data in client.data_to_send():
        server.receive_data(data)
    server.events_received()
    server.send_welcome(Welcome(server_id="s", head_cursor=0, last_seq=0, server_hlc="h"))
    for data in server.data_to_send():
        client.receive_data(data)
    (welcome,) = client.take_events()
    assert isinstance(welcome, Answer)
    assert client.version == server.version == max_protocol
    return client, server


def _push(client: ClientProtocol, records: list[Session], seq: int) -> bytes:
    bodies = [compact.encode(r) for r in records]
    changes = [Change(client_seq=seq + i, record=r) for i, r in enumerate(records)]
    client.send_push(changes, bodies=bodies)
    (data,) = client.data_to_send()
    return data


def test_a_push_and_a_page_carry_a_long_lists_new_ids_only() -> None:
    """Device to server and server to device: the second version of a 2,000-message session
    goes in a few hundred bytes, and each side reads the body the other stored."""
    client, server = _open_pair()
    assert MAX_PROTOCOL >= idrefs.ID_REFS_SINCE
    session_id = uuid7()
    ids = [uuid7() for _ in range(2000)]
    first, second = _session(session_id, ids), _session(session_id, [*ids, uuid7(), uuid7()])
    sizes = []
    for seq, version in enumerate((first, second), start=1):
        data = _push(client, [version], seq)
        sizes.append(len(data))
        server.receive_data(data)
        (push,) = server.events_received()
        assert isinstance(push, Push)
        assert bytes(push.bodies[0].body) == compact.encode(version)
        assert push.changes[0].record == version
    assert sizes[0] > 32_000 and sizes[1] < 400
    pages = []
    for cursor, version in enumerate((first, second), start=1):
        body = msgspec.Raw(compact.encode(version))
        server.send_changes(cursor - 1, cursor, [], live=True, bodies=[FeedBody(cursor, body)])
        (data,) = server.data_to_send()
        pages.append(len(data))
        client.receive_data(data)
        (event,) = client.take_events()
        assert isinstance(event, Live) and isinstance(event.changes, Changes)
        assert bytes(event.changes.bodies[0].body) == compact.encode(version)
        assert event.changes.changes[0].record == version
    assert pages[0] > 32_000 and pages[1] < 400


def test_live_pages_held_behind_answers_still_resolve() -> None:
    """The protocol lets live pages reach the device behind answers sent after them (the
    simulation's proxy does so): live pages and answers keep lists of their own, each in its
    own order, so every page resolves however the two streams interleave."""
    client, server = _open_pair()
    session_id = uuid7()
    ids = [uuid7() for _ in range(100)]
    versions = [_session(session_id, ids[: 70 + 10 * i]) for i in range(4)]
    frames: dict[str, list[bytes]] = {"live": [], "answer": []}
    for i, version in enumerate(versions):
        body = [FeedBody(i + 1, msgspec.Raw(compact.encode(version)))]
        for kind in ("live", "answer"):
            if kind == "answer":
                client.send_pull(i)
                client.data_to_send()
            server.send_changes(i, i + 1, [], live=kind == "live", request_id=i + 2, bodies=body)
            (data,) = server.data_to_send()
            frames[kind].append(data)
    assert len(frames["live"][-1]) < 600 and len(frames["answer"][-1]) < 600
    for data in [*frames["answer"], *frames["live"]]:  # every live page held behind
        client.receive_data(data)
    events = client.take_events()
    assert len(events) == 8 and client.state is State.OPEN
    pages = [e.changes if isinstance(e, Live) else e.frame for e in events]  # type: ignore[union-attr]
    got = [p.changes[0].record for p in pages]  # type: ignore[union-attr]
    assert got == versions + versions


def test_a_push_refused_unread_still_moves_the_servers_lists() -> None:
    """A rate limit refuses a push before reading it; the device's lists moved as it sent
    it, and the server's move too, so the next push's reference resolves."""
    client, server = _open_pair()
    session_id = uuid7()
    ids = [uuid7() for _ in range(100)]
    server.receive_data(_push(client, [_session(session_id, ids)], 1))
    server.events_received()
    grown = _session(session_id, [*ids, uuid7()])
    refused = _push(client, [grown], 2)
    server.refuse(refused, RateLimited("slow down"))
    assert server.received_ids._held == client.sent_ids._held
    again = _session(session_id, [*grown.state.message_ids, uuid7()])
    data = _push(client, [again], 2)
    assert len(data) < 400
    server.receive_data(data)
    (push,) = server.events_received()
    assert isinstance(push, Push) and push.changes[0].record == again


def test_a_reference_the_server_cannot_resolve_ends_the_connection() -> None:
    """Lists that disagree (a peer's forged reference) are a fatal 3004: nothing of the frame
    is taken, and the connection closes, so the next one starts with empty lists."""
    client, server = _open_pair()
    session_id = uuid7()
    ids = [uuid7() for _ in range(100)]
    client.sent_ids.shrink(compact.encode(_session(session_id, ids)))  # never sent
    server.receive_data(_push(client, [_session(session_id, [*ids, uuid7()])], 1))
    assert server.events_received() == []
    assert server.state is State.CLOSING
    (error,) = [codec.decode(d) for d in server.data_to_send()]
    assert error.code == ErrorCode.MALFORMED_FRAME and error.request_id == 2  # type: ignore[union-attr]
    assert "has not carried" in error.message  # type: ignore[union-attr]


def test_a_device_of_protocol_6_gets_whole_lists() -> None:
    client, server = _open_pair(max_protocol=6)
    session_id = uuid7()
    ids = [uuid7() for _ in range(100)]
    for seq, version in enumerate((ids, [*ids, uuid7()]), start=1):
        record = _session(session_id, version)
        stored = compact.encode(record)
        body = compact.explicit(stored)  # and its device named: a peer before protocol 8
        assert body != stored and record.client_id.encode() in body
        assert body in _push(client, [record], seq)
        server.send_changes(0, seq, [], live=True, bodies=[FeedBody(seq, msgspec.Raw(stored))])
        assert body in b"".join(server.data_to_send())
    assert len(client.sent_ids) == len(server.sent_ids) == 0


def test_other_kinds_pass_untouched() -> None:
    lists = IdLists()
    rng = random.Random(7)
    for record in [make_message(), make_event(), make_session()]:
        body = compact.encode(record)
        assert lists.shrink(body) is body
        assert lists.grow(body) is body
    junk = bytes(rng.getrandbits(8) for _ in range(40))
    assert lists.shrink(junk) is junk and lists.grow(b"\xdc\x00") == b"\xdc\x00"
    assert len(lists) == 0


# -- a long list kept apart from its body (the server stores' id blocks) --------------------


@settings(max_examples=200, deadline=None)
@given(
    count=st.integers(min_value=0, max_value=300),
    least=st.integers(min_value=1, max_value=200),
    title=st.text(max_size=20),
)
def test_a_body_apart_from_its_ids_joins_back_byte_for_byte(
    count: int, least: int, title: str
) -> None:
    ids = [uuid7() for _ in range(count)]
    session = _session(uuid7(), ids, title)
    body = compact.encode(session)
    apart = idrefs.ids_apart(body, least)
    if count < max(least, 2):  # (one id is no list ext: it stays in the body)
        assert apart is None
        return
    assert apart is not None
    rest, blob = apart
    assert len(blob) == 16 * count and len(rest) < len(body) - 16 * count + 8
    assert compact.decode(rest) == msgspec.structs.replace(session, state=SessionState())
    assert idrefs.ids_joined(rest, blob) == body
    assert compact.id_list_texts(blob) == ids


def test_a_list_is_put_back_in_place_at_every_size_or_else_by_encoding() -> None:
    """``ids_joined`` writes the list's ext at its offset (one copy of it) with the header
    msgspec writes for its size (ext 8, 16 and 32); a body whose parts are encoded another
    way (a key as a longer string) is joined by encoding the parts again, to the same
    record."""
    for count in (2, 15, 16, 4_095, 4_096, 5_000):
        session = _session(uuid7(), [uuid7() for _ in range(count)])
        body = compact.encode(session)
        apart = idrefs.ids_apart(body, 1)
        assert apart is not None
        rest, blob = apart
        assert idrefs.ids_joined(rest, blob) == body
        odd = rest.replace(b"\xabmessage_ids", b"\xd9\x0bmessage_ids")
        assert odd != rest and compact.decode(odd) == compact.decode(rest)
        assert idrefs.ids_joined(odd, blob) == body  # (its parts encoded again, as msgspec does)


def test_bodies_that_are_not_apart_are_not_joined() -> None:
    session = _session(uuid7(), [uuid7() for _ in range(5)])
    body = compact.encode(session)
    assert idrefs.ids_joined(body, b"") is None  # its list is in it
    assert idrefs.ids_joined(compact.encode(make_message()), b"") is None
    assert idrefs.ids_joined(idrefs.ids_apart(body, 1)[0], b"x" * 15) is None  # type: ignore[index]
    texts = _session(uuid7(), ["not-a-uuid", "nor-this"])
    assert idrefs.ids_apart(compact.encode(texts), 1) is None


_LISTS = st.lists(st.integers(min_value=0, max_value=60), max_size=70)


@settings(max_examples=300, deadline=None)
@given(
    before=st.one_of(st.none(), _LISTS),
    after=_LISTS,
    inline=st.integers(min_value=0, max_value=8),
    block=st.integers(min_value=1, max_value=9),
)
def test_a_session_rows_blocks_written_over_the_stored_ones_hold_its_ids(
    before: list[int] | None, after: list[int], inline: int, block: int
) -> None:
    """``session_row``: whatever the stored blocks held (or nothing known of them), the
    blocks it writes, over them, less those it drops, hold the new list exactly; and the row's
    body with them is the version's body."""
    pool = [uuid7() for _ in range(61)]
    layout = idrefs.IdLayout(inline, block)
    session_id = uuid7()
    size = 16 * block
    blocks: dict[int, bytes] = {}
    stored: bytes | None = None
    if before is not None:
        old = session_row(
            compact.encode(_session(session_id, [pool[i] for i in before])), b"", layout
        )
        blocks = dict(old.puts)
        stored = b"".join(blocks[p] for p in sorted(blocks)) if old.ids_count is not None else b""
    body = compact.encode(_session(session_id, [pool[i] for i in after]))
    row = session_row(body, stored, layout)
    if row.drop_from is not None:
        blocks = {p: ids for p, ids in blocks.items() if p < row.drop_from}
    blocks.update(row.puts)
    if row.ids_count is None:
        assert row.body == body and not blocks
        return
    data = b"".join(blocks[p] for p in sorted(blocks))
    assert sorted(blocks) == list(range(len(blocks)))
    assert all(len(ids) == size for p, ids in blocks.items() if p < len(blocks) - 1)
    assert len(data) == 16 * row.ids_count and row.body[:1] == APART
    assert stored_body(1, row.body, row.ids_count, data) == body
    if stored is not None and data.startswith(stored) and len(stored) % size == 0:
        assert all(p >= len(stored) // size for p, _ in row.puts)  # appended: new blocks only


@contextlib.asynccontextmanager
async def _long_session_online(
    tmp_path: Path,
) -> AsyncIterator[tuple[Cluster, SessionRuntime, SessionRuntime, str]]:
    """A real server, a laptop that wrote a session of more than ``MIN_IDS`` messages offline
    and a phone, both online and settled: ``(cluster, laptop, phone, session id)``."""
    async with AsyncExitStack() as stack:
        cluster = Cluster(tmp_path, stack)
        await cluster.start_server()
        try:
            laptop, phone = await cluster.device("laptop"), await cluster.device("phone")
            session = await laptop.create_session(title="long")
            for i in range(MIN_IDS // 2 + 1):
                await chat(laptop, session.id, f"offline {i}")
            await cluster.online(laptop, phone)
            yield cluster, laptop, phone, session.id
        finally:
            await stack.aclose()
            await cluster.stop_server()


async def test_a_long_conversation_continues_on_another_device_with_small_frames(
    tmp_path: Path,
) -> None:
    """End to end over a real server: a session of more than ``MIN_IDS`` messages written
    offline reaches the phone whole; each further turn's push then names its session's list
    by reference (a few hundred bytes, not every id again), the server keeps the whole row,
    and the phone, live, holds exactly what the laptop holds, after a reconnect too."""
    async with _long_session_online(tmp_path) as (cluster, laptop, phone, session_id):
        link = laptop.sync._link
        assert link is not None and link.protocol.version == MAX_PROTOCOL
        sent: list[bytes] = []
        send = link.ws.send

        async def recorded(data: Any) -> None:
            sent.append(bytes(data))
            await send(data)

        link.ws.send = recorded  # type: ignore[method-assign]
        for i in range(3):
            await chat(laptop, session_id, f"online {i}")
            await cluster.settle(laptop, phone)
        assert await snapshot(phone, session_id) == await snapshot(laptop, session_id)
        row = await laptop.store.get_session(session_id)
        assert row is not None and len(row.state.message_ids) == 2 * (MIN_IDS // 2 + 4)
        assert cluster.store is not None
        stored = [
            e.record
            for e in (await cluster.store.pull(ALICE, 0, 10_000)).changes
            if e.record.id == session_id
        ]
        assert stored[-1] == row  # the server keeps the whole row
        listed = compact.uuids_bytes(row.state.message_ids[:MIN_IDS])
        assert listed is not None and listed in compact.encode(row)
        assert len(sent) >= 3 and not any(listed in data for data in sent)  # sent once
        key = compact.packed(session_id)
        assert key in link.protocol.sent_ids._held
        phone_link = phone.sync._link
        assert phone_link is not None
        assert key in phone_link.protocol.received_live_ids._held  # the pages came live
        await laptop.sync.disconnect()
        await chat(laptop, session_id, "after a reconnect")
        await cluster.online(laptop, phone)
        assert await snapshot(phone, session_id) == await snapshot(laptop, session_id)


async def test_lists_that_disagree_end_the_connection_and_the_device_goes_on_whole(
    tmp_path: Path,
) -> None:
    """A device whose lists no longer match the server's (here, its live lists forgotten as
    though by a bug) refuses the next reference (3004), reconnects, and from then on offers
    protocol 6: every row goes whole, and nothing is lost or stuck."""
    async with _long_session_online(tmp_path) as (cluster, laptop, phone, session_id):
        await chat(laptop, session_id, "the first live page carries the list whole")
        await cluster.settle(laptop, phone)
        link = phone.sync._link
        assert link is not None and link.protocol.version == MAX_PROTOCOL
        assert len(link.protocol.received_live_ids) == 1
        link.protocol.received_live_ids._held.clear()  # the phone's lists now disagree
        await chat(laptop, session_id, "this page refers to the list")
        await cluster.settle(laptop, phone)
        assert phone.sync._id_refs_failed
        assert (await phone.sync.status()).protocol == 6
        assert await snapshot(phone, session_id) == await snapshot(laptop, session_id)
        await chat(laptop, session_id, "and on, whole")
        await cluster.settle(laptop, phone)
        assert await snapshot(phone, session_id) == await snapshot(laptop, session_id)
        assert (await laptop.sync.status()).protocol == MAX_PROTOCOL
