"""Wire frames and the sans-I/O sync state machines, driven by bytes. No event loop."""

from __future__ import annotations

import msgspec
import pytest

from shared.errors import InvalidState, MalformedFrame, ProtocolVersion
from shared.merge import ConflictedPath
from shared.messages import (
    MAX_PROTOCOL,
    MIN_PROTOCOL,
    PROTOCOL_VERSION,
    ChangeResult,
    Changes,
    ConflictReceipt,
    Error,
    Frame,
    FrameCodec,
    Health,
    HealthConflict,
    Hello,
    Pull,
    Push,
    PushAck,
    Welcome,
)
from shared.protocol import ClientProtocol, ServerProtocol, State
from shared.records import Change, FeedChange
from tests.factories import (
    make_artifact_update,
    make_audit,
    make_checkpoint,
    make_event,
    make_message,
    make_session,
)

codec = FrameCodec()


def enc(frame: Frame) -> bytes:
    return codec.encode(frame)


def sent(proto: ServerProtocol | ClientProtocol) -> list[Frame]:
    return [codec.decode(data) for data in proto.data_to_send()]


def only_error(proto: ServerProtocol | ClientProtocol) -> Error:
    frames = sent(proto)
    assert len(frames) == 1, frames
    frame = frames[0]
    assert isinstance(frame, Error)
    return frame


def state(proto: ServerProtocol | ClientProtocol) -> State:
    """The current state, read through a call so mypy does not pin an earlier narrowing."""
    return proto.state


def welcome() -> Welcome:
    return Welcome(server_id="srv-1", head_cursor=7, last_seq=3, server_hlc="hlc")


def open_server(**kwargs: int) -> ServerProtocol:
    server = ServerProtocol(**kwargs)
    server.receive_data(enc(Hello(protocol=PROTOCOL_VERSION, client_id="dev-a")))
    assert [type(e) for e in server.events_received()] == [Hello]
    server.send_welcome(welcome())
    assert [type(f) for f in sent(server)] == [Welcome]
    return server


def open_client() -> ClientProtocol:
    client = ClientProtocol("dev-a", 0)
    client.data_to_send()
    client.receive_data(enc(welcome()))
    assert [type(e) for e in client.events_received()] == [Welcome]
    return client


def all_records() -> list[object]:
    return [
        make_session(title="t"),
        make_message(),
        make_checkpoint(appended=["m1"], snapshot=["m1"]),
        make_event(payload={"k": [1, 2]}),
        make_audit(detail={"x": 1}),
        make_artifact_update(update=b"\x01\x02\xff"),
    ]


# -- codec -------------------------------------------------------------------------------


def every_frame() -> list[Frame]:
    records = all_records()
    receipt = ConflictReceipt(
        conflict_id="c1",
        session_id="s1",
        winner="remote",
        fork_session_id="s2",
        conflicted_paths=[
            ConflictedPath(path="title", local_value="a", remote_value="b", chosen_side="remote")
        ],
        detected_at="now",
    )
    return [
        Hello(protocol=PROTOCOL_VERSION, client_id="dev-a", cursor=12),
        welcome(),
        Push(changes=[Change(client_seq=i + 1, record=r) for i, r in enumerate(records)]),  # type: ignore[arg-type]
        PushAck(
            results=[
                ChangeResult(client_seq=1, status="applied", cursor=5),
                ChangeResult(client_seq=2, status="duplicate"),
                ChangeResult(client_seq=3, status="resolved", conflict=receipt),
                ChangeResult(client_seq=4, status="rejected", code=3007, message="bad"),
            ],
            last_seq=4,
            head_cursor=9,
        ),
        Pull(cursor=3, limit=50),
        Changes(
            from_cursor=3,
            to_cursor=9,
            changes=[FeedChange(cursor=4 + i, record=r) for i, r in enumerate(records)],  # type: ignore[arg-type]
            more=True,
            live=True,
        ),
        Error(code=3008, message="slow down", retryable=True),
        Health(
            pending=3,
            dead_letters=1,
            cursor=9,
            last_flush_at=1.5,
            last_flush_outcome="partial",
            last_flushed=2,
            last_error="boom",
            last_error_code=3009,
            conflicts=[
                HealthConflict(
                    conflict_id="c1", session_id="s1", winner="local", fork_session_id="s2"
                )
            ],
            sent_at=2.5,
        ),
    ]


@pytest.mark.parametrize("frame", every_frame(), ids=lambda f: type(f).__name__)
def test_codec_round_trip(frame: Frame) -> None:
    data = codec.encode(frame)
    assert isinstance(data, bytes)
    decoded = codec.decode(data)
    assert type(decoded) is type(frame)
    assert decoded == frame
    assert FrameCodec().decode(data) == frame  # any codec instance reads it


def test_codec_covers_every_frame_type() -> None:
    assert {type(f) for f in every_frame()} == set(Frame.__args__)


def test_codec_rejects_garbage() -> None:
    with pytest.raises(msgspec.DecodeError):
        codec.decode(b"\xc1")
    with pytest.raises(msgspec.ValidationError):
        codec.decode(msgspec.msgpack.encode({"type": "pull", "cursor": "three"}))
    with pytest.raises(msgspec.ValidationError):
        codec.decode(msgspec.msgpack.encode({"type": "nope"}))


# -- server ------------------------------------------------------------------------------


def test_server_hello_then_welcome_opens() -> None:
    server = ServerProtocol()
    assert server.state is State.AWAITING_HELLO
    hello = Hello(protocol=PROTOCOL_VERSION, client_id="dev-a", cursor=5)
    server.receive_data(enc(hello))
    assert server.events_received() == [hello]
    assert server.events_received() == []
    assert server.client_id == "dev-a"
    assert server.hello == hello
    assert server.state is State.AWAITING_HELLO
    assert server.data_to_send() == []
    server.send_welcome(welcome())
    assert state(server) is State.OPEN
    # The agreed version and the Hello's request id are filled in by the protocol.
    assert sent(server) == [msgspec.structs.replace(welcome(), protocol=PROTOCOL_VERSION)]
    assert server.version == PROTOCOL_VERSION
    assert server.close_reason is None


@pytest.mark.parametrize("frame", [Push(changes=[]), Pull(cursor=0)], ids=["push", "pull"])
def test_server_push_or_pull_before_hello_closes(frame: Frame) -> None:
    server = ServerProtocol()
    server.receive_data(enc(frame))
    assert server.events_received() == []
    err = only_error(server)
    assert err.code == 3004
    assert err.retryable is False
    assert server.state is State.CLOSING
    assert isinstance(server.close_reason, MalformedFrame)
    # Nothing more is read or sent once closing.
    server.receive_data(enc(Hello(protocol=PROTOCOL_VERSION, client_id="dev-a")))
    assert server.events_received() == []
    assert server.data_to_send() == []
    with pytest.raises(InvalidState):
        server.send_welcome(welcome())


def test_server_push_before_welcome_closes() -> None:
    server = ServerProtocol()
    server.receive_data(enc(Hello(protocol=PROTOCOL_VERSION, client_id="dev-a")))
    server.events_received()
    server.receive_data(enc(Pull(cursor=0)))
    assert only_error(server).code == 3004
    assert server.state is State.CLOSING


@pytest.mark.parametrize("version", [0, PROTOCOL_VERSION + 1, 999])
def test_server_wrong_protocol_version_closes(version: int) -> None:
    server = ServerProtocol()
    server.receive_data(enc(Hello(protocol=version, client_id="dev-a")))
    assert server.events_received() == []
    err = only_error(server)
    assert err.code == 3003
    assert server.state is State.CLOSING
    assert isinstance(server.close_reason, ProtocolVersion)
    assert server.hello is None
    with pytest.raises(InvalidState):
        server.send_welcome(welcome())


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",
        b"not msgpack at all \xff\xfe",
        msgspec.msgpack.encode([1, 2, 3]),
        msgspec.msgpack.encode({"type": "pull"}),  # missing cursor
        msgspec.msgpack.encode({"type": "pull", "cursor": "three"}),
        msgspec.msgpack.encode({"type": "push", "changes": [{"client_seq": 1}]}),
        msgspec.msgpack.encode({"type": "launch-missiles"}),
        msgspec.msgpack.encode({"cursor": 1}),  # untagged
    ],
)
def test_server_malformed_frame_is_not_fatal(data: bytes) -> None:
    server = open_server()
    server.receive_data(data)
    assert server.events_received() == []
    err = only_error(server)
    assert err.code == 3004
    assert server.state is State.OPEN
    assert server.close_reason is None
    # The connection is still usable.
    server.receive_data(enc(Pull(cursor=4, limit=10)))
    assert server.events_received() == [Pull(cursor=4, limit=10)]
    server.send_changes(4, 4, [])
    assert [type(f) for f in sent(server)] == [Changes]


def test_server_malformed_frame_before_hello_is_not_fatal() -> None:
    server = ServerProtocol()
    server.receive_data(b"\xc1")
    assert only_error(server).code == 3004
    assert server.state is State.AWAITING_HELLO
    server.receive_data(enc(Hello(protocol=PROTOCOL_VERSION, client_id="dev-a")))
    assert [type(e) for e in server.events_received()] == [Hello]


def test_server_oversize_frame_closes() -> None:
    server = open_server(max_frame_bytes=128)
    big = enc(Pull(cursor=1, limit=2))
    assert len(big) <= 128
    server.receive_data(big)
    assert server.events_received() == [Pull(cursor=1, limit=2)]
    huge = enc(Push(changes=[Change(client_seq=1, record=make_message())]))
    assert len(huge) > 128
    server.receive_data(huge)
    assert server.events_received() == []
    err = only_error(server)
    assert err.code == 3005
    assert server.state is State.CLOSING
    assert server.close_reason is not None and server.close_reason.code == 3005


def test_server_oversize_garbage_is_too_large_not_malformed() -> None:
    server = open_server(max_frame_bytes=128)
    server.receive_data(b"\xc1" * 129)
    assert only_error(server).code == 3005
    assert server.state is State.CLOSING


@pytest.mark.parametrize(
    "frame",
    [
        welcome(),
        PushAck(results=[], last_seq=0),
        Changes(from_cursor=0, to_cursor=0, changes=[]),
        Error(code=3001, message="x"),
    ],
    ids=lambda f: type(f).__name__,
)
@pytest.mark.parametrize("opened", [False, True])
def test_server_rejects_server_only_frames(frame: Frame, opened: bool) -> None:
    server = open_server() if opened else ServerProtocol()
    server.receive_data(enc(frame))
    assert server.events_received() == []
    err = only_error(server)
    assert err.code == 3004
    assert server.state is State.CLOSING


def test_server_second_hello_after_welcome_closes() -> None:
    server = open_server()
    server.receive_data(enc(Hello(protocol=PROTOCOL_VERSION, client_id="dev-b")))
    assert server.events_received() == []
    assert only_error(server).code == 3004
    assert server.state is State.CLOSING
    assert server.client_id == "dev-a"


def test_server_second_hello_before_welcome_closes() -> None:
    # A pump that answers Hello later must not see the device swap its id in between.
    server = ServerProtocol()
    server.receive_data(enc(Hello(protocol=PROTOCOL_VERSION, client_id="dev-a")))
    server.receive_data(enc(Hello(protocol=PROTOCOL_VERSION, client_id="dev-b")))
    assert [e.client_id for e in server.events_received()] == ["dev-a"]  # type: ignore[union-attr]
    assert server.client_id == "dev-a"
    assert only_error(server).code == 3004
    assert server.state is State.CLOSING


def test_server_sending_in_the_wrong_state_raises() -> None:
    server = ServerProtocol()
    with pytest.raises(InvalidState):
        server.send_welcome(welcome())  # no Hello yet
    with pytest.raises(InvalidState):
        server.send_push_ack([], 0, 0)
    with pytest.raises(InvalidState):
        server.send_changes(0, 0, [])
    assert server.data_to_send() == []

    opened = open_server()
    with pytest.raises(InvalidState):
        opened.send_welcome(welcome())  # twice
    opened.send_push_ack([], 0, 0)
    assert [type(f) for f in sent(opened)] == [PushAck]

    opened.fail(MalformedFrame("bye"))
    assert opened.state is State.CLOSING
    with pytest.raises(InvalidState):
        opened.send_push_ack([], 0, 0)
    with pytest.raises(InvalidState):
        opened.send_changes(0, 0, [])


def test_fail_queues_one_error_and_is_idempotent_when_closing() -> None:
    server = open_server()
    server.fail(MalformedFrame("soft"), fatal=False)
    assert server.state is State.OPEN
    server.fail(ProtocolVersion("hard"))
    server.fail(MalformedFrame("ignored"))
    frames = sent(server)
    assert [(f.code, f.message) for f in frames] == [(3004, "soft"), (3003, "hard")]  # type: ignore[union-attr]
    assert isinstance(server.close_reason, ProtocolVersion)


# -- client ------------------------------------------------------------------------------


def test_client_queues_hello_on_creation() -> None:
    client = ClientProtocol("dev-a", 42)
    assert client.state is State.AWAITING_HELLO
    # ``protocol`` is the lowest version, so a server that predates ranges still accepts it.
    assert sent(client) == [
        Hello(
            protocol=MIN_PROTOCOL,
            client_id="dev-a",
            cursor=42,
            min_protocol=MIN_PROTOCOL,
            max_protocol=MAX_PROTOCOL,
            request_id=1,
        )
    ]
    assert client.hello_request_id == 1
    assert client.outstanding == (1,)
    assert client.data_to_send() == []


def test_client_welcome_opens() -> None:
    client = ClientProtocol("dev-a", 0)
    client.data_to_send()
    client.receive_data(enc(welcome()))
    assert client.events_received() == [welcome()]
    assert client.state is State.OPEN
    assert client.welcome == welcome()
    assert client.version == 1  # a Welcome without ``protocol`` is from a version 1 server
    assert client.outstanding == ()


def test_client_send_before_welcome_raises() -> None:
    client = ClientProtocol("dev-a", 0)
    client.data_to_send()
    with pytest.raises(InvalidState):
        client.send_push([])
    with pytest.raises(InvalidState):
        client.send_pull(0)
    assert client.data_to_send() == []


def test_client_decodes_push_ack_changes_and_error() -> None:
    client = open_client()  # a version 1 server: answers are matched by order
    push_id = client.send_push([])
    pull_id = client.send_pull(7)
    again_id = client.send_pull(8)
    assert (push_id, pull_id, again_id) == (2, 3, 4)
    client.data_to_send()
    ack = PushAck(results=[ChangeResult(client_seq=1, status="applied", cursor=8)], last_seq=1)
    changes = Changes(
        from_cursor=7, to_cursor=8, changes=[FeedChange(cursor=8, record=make_message())]
    )
    error = Error(code=3009, message="db down", retryable=True)
    for frame in (ack, changes, error):
        client.receive_data(enc(frame))
    assert client.events_received() == [ack, changes, error]
    # An Error frame is surfaced, not answered.
    assert client.state is State.OPEN
    assert client.data_to_send() == []
    assert client.outstanding == ()


def test_client_error_before_welcome_is_surfaced() -> None:
    client = ClientProtocol("dev-a", 0)
    client.data_to_send()
    client.receive_data(enc(Error(code=3001, message="who are you")))
    assert client.events_received() == [Error(code=3001, message="who are you")]
    assert client.state is State.AWAITING_HELLO


@pytest.mark.parametrize(
    "frame",
    [
        PushAck(results=[], last_seq=0),
        Changes(from_cursor=0, to_cursor=0, changes=[]),
        Hello(protocol=PROTOCOL_VERSION, client_id="x"),
        Pull(cursor=0),
    ],
    ids=lambda f: type(f).__name__,
)
def test_client_rejects_unexpected_frame_before_welcome(frame: Frame) -> None:
    client = ClientProtocol("dev-a", 0)
    client.data_to_send()
    client.receive_data(enc(frame))
    assert client.events_received() == []
    assert only_error(client).code == 3004
    assert client.state is State.CLOSING


def test_client_rejects_second_welcome_and_malformed_is_not_fatal() -> None:
    client = open_client()
    client.receive_data(b"\xc1")
    assert only_error(client).code == 3004
    assert client.state is State.OPEN
    client.receive_data(enc(welcome()))
    assert only_error(client).code == 3004
    assert state(client) is State.CLOSING
    with pytest.raises(InvalidState):
        client.send_pull(0)


def test_client_oversize_frame_closes() -> None:
    client = ClientProtocol("dev-a", 0, max_frame_bytes=32)
    client.data_to_send()
    client.receive_data(b"\x00" * 33)
    assert only_error(client).code == 3005
    assert client.state is State.CLOSING


# -- both ends wired together ------------------------------------------------------------


def pump(src: ServerProtocol | ClientProtocol, dst: ServerProtocol | ClientProtocol) -> list[Frame]:
    """Deliver everything ``src`` queued to ``dst``; return what ``dst`` decoded."""
    for data in src.data_to_send():
        dst.receive_data(data)
    return dst.events_received()


def test_full_exchange() -> None:
    client = ClientProtocol("dev-a", 0)
    server = ServerProtocol()

    (hello,) = pump(client, server)
    assert isinstance(hello, Hello)
    assert (hello.client_id, hello.cursor, hello.request_id) == ("dev-a", 0, 1)
    server.send_welcome(Welcome(server_id="srv", head_cursor=0, last_seq=0))
    (got_welcome,) = pump(server, client)
    assert isinstance(got_welcome, Welcome)
    assert got_welcome.protocol == MAX_PROTOCOL and got_welcome.request_id == 1
    assert client.version == server.version == MAX_PROTOCOL
    assert client.state is server.state is State.OPEN

    records = all_records()
    changes = [Change(client_seq=i + 1, record=r) for i, r in enumerate(records)]  # type: ignore[arg-type]
    push_id = client.send_push(changes)
    (push,) = pump(client, server)
    assert push == Push(changes=changes, request_id=push_id)

    results = [
        ChangeResult(client_seq=c.client_seq, status="applied", cursor=c.client_seq)
        for c in changes
    ]
    server.send_push_ack(
        results, last_seq=len(changes), head_cursor=len(changes), request_id=push_id
    )
    (ack,) = pump(server, client)
    assert ack == PushAck(
        results=results, last_seq=len(changes), head_cursor=len(changes), request_id=push_id
    )

    pull_id = client.send_pull(0, limit=4)
    (pull,) = pump(client, server)
    assert pull == Pull(cursor=0, limit=4, request_id=pull_id)
    assert isinstance(pull, Pull)

    feed = [FeedChange(cursor=i + 1, record=r) for i, r in enumerate(records)]  # type: ignore[arg-type]
    server.send_changes(0, 4, feed[:4], more=True, request_id=pull_id)
    server.send_changes(4, 6, feed[4:], live=True, request_id=pull_id)  # live: id dropped
    pages = pump(server, client)
    assert pages == [
        Changes(from_cursor=0, to_cursor=4, changes=feed[:4], more=True, request_id=pull_id),
        Changes(from_cursor=4, to_cursor=6, changes=feed[4:], live=True),
    ]
    assert [fc.record for page in pages for fc in page.changes] == records  # type: ignore[union-attr]

    assert client.state is server.state is State.OPEN
    assert client.data_to_send() == server.data_to_send() == []
    assert client.close_reason is None and server.close_reason is None


def test_exchange_with_a_protocol_error_reaches_the_client() -> None:
    client = ClientProtocol("dev-a", 0)
    server = ServerProtocol()
    pump(client, server)
    server.send_welcome(welcome())
    pump(server, client)
    server.receive_data(b"\xc1")  # a corrupt frame on the wire
    (error,) = pump(server, client)
    assert isinstance(error, Error) and error.code == 3004
    pull_id = client.send_pull(7)
    assert pump(client, server) == [Pull(cursor=7, request_id=pull_id)]
