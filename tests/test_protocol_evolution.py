"""How the protocol grows: version ranges, optional frames, new fields, request ids.

Sans-I/O: no event loop, bytes in and out of ``ServerProtocol`` / ``ClientProtocol``.
"""

from __future__ import annotations

import logging
import random
import typing

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared import compact
from shared.errors import ErrorCode, InvalidState, MalformedFrame, ProtocolVersion
from shared.messages import (
    DEFLATED_SINCE,
    FRAME_TAGS,
    IMPLIED_SINCE,
    MAX_HEALTH_CONFLICTS,
    MAX_HEALTH_TEXT,
    MAX_PROTOCOL,
    MAX_RECORD_BYTES,
    MIN_PROTOCOL,
    ChangeBody,
    ChangeResult,
    Changes,
    Error,
    FeedBody,
    Frame,
    FrameCodec,
    Health,
    Hello,
    Pull,
    Push,
    PushAck,
    Welcome,
)
from shared.protocol import (
    Answer,
    ClientEvent,
    ClientProtocol,
    Live,
    Notice,
    ServerProtocol,
    State,
    negotiate,
)
from shared.records import Change, FeedChange, Record, encode_record
from tests.factories import make_message
from tests.test_compact import records as compact_records

codec = FrameCodec()


def enc(frame: Frame) -> bytes:
    return codec.encode(frame)


def sent(proto: ServerProtocol | ClientProtocol) -> list[Frame]:
    return [codec.decode(data) for data in proto.data_to_send()]


def only_error(proto: ServerProtocol | ClientProtocol) -> Error:
    (frame,) = sent(proto)
    assert isinstance(frame, Error), frame
    return frame


def state(proto: ServerProtocol | ClientProtocol) -> State:
    return proto.state


def welcome(**fields: typing.Any) -> Welcome:
    return Welcome(server_id="srv", head_cursor=0, last_seq=0, **fields)


def connected() -> tuple[ClientProtocol, ServerProtocol]:
    """A client and a server of this code base, past Hello/Welcome."""
    client, server = ClientProtocol("dev-a", 0), ServerProtocol()
    for data in client.data_to_send():
        server.receive_data(data)
    assert [type(e) for e in server.events_received()] == [Hello]
    server.send_welcome(welcome(org_id="org", user_id="ann"))
    for data in server.data_to_send():
        client.receive_data(data)
    (event,) = client.take_events()
    assert isinstance(event, Answer) and isinstance(event.frame, Welcome)
    assert event.request_id == client.hello_request_id
    return client, server


# -- version negotiation -------------------------------------------------------------------


@given(
    st.tuples(st.integers(0, 9), st.integers(0, 9)),
    st.tuples(st.integers(1, 9), st.integers(1, 9)),
)
def test_negotiate_picks_the_highest_common_version(
    offered: tuple[int, int], supported: tuple[int, int]
) -> None:
    chosen = negotiate(offered, supported)
    common = [
        v for v in range(10) if offered[0] <= v <= offered[1] and supported[0] <= v <= supported[1]
    ]
    assert chosen == (max(common) if common else None)


@pytest.mark.parametrize(
    ("hello", "version"),
    [
        (Hello(protocol=1, client_id="d"), 1),  # a version 1 device: only ``protocol``
        (Hello(protocol=2, client_id="d"), 2),
        (Hello(protocol=1, client_id="d", min_protocol=1, max_protocol=2), 2),
        (Hello(protocol=1, client_id="d", max_protocol=10), 9),
        (Hello(protocol=1, client_id="d", min_protocol=1, max_protocol=3), 3),
        (Hello(protocol=1, client_id="d", min_protocol=1, max_protocol=4), 4),
        (Hello(protocol=1, client_id="d", min_protocol=1, max_protocol=5), 5),
        (Hello(protocol=1, client_id="d", min_protocol=1, max_protocol=6), 6),
        (Hello(protocol=1, client_id="d", min_protocol=1, max_protocol=7), 7),
        (Hello(protocol=1, client_id="d", min_protocol=1, max_protocol=8), 8),
        (Hello(protocol=1, client_id="d", min_protocol=1, max_protocol=9), 9),
        (Hello(protocol=2, client_id="d", min_protocol=1, max_protocol=1), 1),
    ],
)
def test_server_agrees_the_highest_common_version(hello: Hello, version: int) -> None:
    server = ServerProtocol()
    server.receive_data(enc(hello))
    assert server.events_received() == [hello]
    assert server.version == version
    server.send_welcome(welcome())
    (frame,) = sent(server)
    assert isinstance(frame, Welcome) and frame.protocol == version


def test_the_server_range_is_one_to_nine() -> None:
    assert (MIN_PROTOCOL, MAX_PROTOCOL) == (1, 9)
    assert ServerProtocol().supported == (1, 9)


@pytest.mark.parametrize(
    ("hello", "device_range"),
    [
        (Hello(protocol=10, client_id="d", request_id=7), "10..10"),
        (
            Hello(protocol=10, client_id="d", min_protocol=10, max_protocol=11, request_id=7),
            "10..11",
        ),
        (Hello(protocol=0, client_id="d", request_id=7), "0..0"),
        (Hello(protocol=1, client_id="d", min_protocol=9, max_protocol=8, request_id=7), "9..8"),
    ],
)
def test_no_common_version_is_a_3003_naming_both_ranges(hello: Hello, device_range: str) -> None:
    server = ServerProtocol()
    server.receive_data(enc(hello))
    assert server.events_received() == []
    err = only_error(server)
    assert err.code == ErrorCode.PROTOCOL_VERSION
    assert err.request_id == 7  # it answers the Hello
    assert f"device speaks {device_range}" in err.message
    assert "server speaks 1..9" in err.message
    assert server.state is State.CLOSING
    assert isinstance(server.close_reason, ProtocolVersion)


def test_a_narrower_server_refuses_a_newer_only_device() -> None:
    server = ServerProtocol(min_protocol=1, max_protocol=1)
    client = ClientProtocol("d", 0, min_protocol=2, max_protocol=2)
    for data in client.data_to_send():
        server.receive_data(data)
    err = only_error(server)
    assert err.code == ErrorCode.PROTOCOL_VERSION
    assert "device speaks 2..2, server speaks 1..1" in err.message


def test_empty_ranges_are_refused_at_construction() -> None:
    with pytest.raises(ValueError):
        ServerProtocol(min_protocol=2, max_protocol=1)
    with pytest.raises(ValueError):
        ClientProtocol("d", 0, min_protocol=0, max_protocol=1)


def test_client_refuses_a_welcome_outside_its_range() -> None:
    client = ClientProtocol("d", 0)
    client.data_to_send()
    client.receive_data(enc(welcome(protocol=MAX_PROTOCOL + 1, request_id=1)))
    assert client.take_events() == []
    err = only_error(client)
    assert err.code == ErrorCode.PROTOCOL_VERSION
    assert client.state is State.CLOSING
    assert client.welcome is None


def test_welcome_names_version_and_tenant() -> None:
    client, server = connected()
    assert client.version == server.version == MAX_PROTOCOL
    assert client.welcome is not None
    assert (client.welcome.org_id, client.welcome.user_id) == ("org", "ann")


# -- fields added to known frames ----------------------------------------------------------


class HelloV1(msgspec.Struct, kw_only=True, tag="hello"):
    protocol: int
    client_id: str
    cursor: int = 0


class WelcomeV1(msgspec.Struct, kw_only=True, tag="welcome"):
    server_id: str
    head_cursor: int
    last_seq: int
    server_hlc: str = ""


class PushAckV1(msgspec.Struct, kw_only=True, tag="push_ack"):
    results: list[ChangeResult]
    last_seq: int
    head_cursor: int = 0


class ChangesV1(msgspec.Struct, kw_only=True, tag="changes"):
    from_cursor: int
    to_cursor: int
    changes: list[FeedChange]
    more: bool = False
    live: bool = False


class ErrorV1(msgspec.Struct, kw_only=True, tag="error"):
    code: int
    message: str
    retryable: bool = False


FrameV1 = HelloV1 | WelcomeV1 | PushAckV1 | ChangesV1 | ErrorV1


def test_a_version_1_peer_reads_version_2_frames() -> None:
    old = msgspec.msgpack.Decoder(FrameV1)
    got = old.decode(enc(welcome(protocol=2, org_id="o", user_id="u", request_id=1)))
    assert got == WelcomeV1(server_id="srv", head_cursor=0, last_seq=0)
    got = old.decode(enc(PushAck(results=[], last_seq=3, request_id=9)))
    assert got == PushAckV1(results=[], last_seq=3)
    got = old.decode(enc(Changes(from_cursor=1, to_cursor=2, changes=[], request_id=4)))
    assert got == ChangesV1(from_cursor=1, to_cursor=2, changes=[])
    got = old.decode(enc(Error(code=3008, message="slow", request_id=4)))
    assert got == ErrorV1(code=3008, message="slow")


def test_version_2_reads_version_1_frames_with_defaults() -> None:
    hello = codec.decode(msgspec.msgpack.encode(HelloV1(protocol=1, client_id="d")))
    assert hello == Hello(protocol=1, client_id="d")
    assert isinstance(hello, Hello) and hello.protocol_range() == (1, 1)
    old_welcome = codec.decode(
        msgspec.msgpack.encode(WelcomeV1(server_id="s", head_cursor=1, last_seq=0))
    )
    assert isinstance(old_welcome, Welcome)
    assert (old_welcome.protocol, old_welcome.org_id, old_welcome.request_id) == (1, "", 0)


def test_a_field_from_the_future_on_a_known_frame_is_ignored() -> None:
    data = msgspec.msgpack.encode(
        {"type": "pull", "cursor": 3, "request_id": 5, "priority": "high", "optional": False}
    )
    assert codec.decode(data) == Pull(cursor=3, request_id=5)
    _, server = connected()
    server.receive_data(data)
    assert server.events_received() == [Pull(cursor=3, request_id=5)]
    assert server.data_to_send() == []


def test_no_wire_struct_forbids_unknown_fields() -> None:
    from shared import records

    structs: list[type[msgspec.Struct]] = [*typing.get_args(Frame), ChangeResult]
    structs += [
        obj
        for obj in vars(records).values()
        if isinstance(obj, type) and issubclass(obj, msgspec.Struct)
    ]
    for cls in structs:
        assert not cls.__struct_config__.forbid_unknown_fields, cls


# -- frames of unknown type ----------------------------------------------------------------


class Ping(msgspec.Struct, kw_only=True, tag="ping"):
    """A frame type from a later version that older peers may skip."""

    nonce: int
    optional: bool = True
    request_id: int = 0


def test_frame_tags_are_the_union() -> None:
    assert {
        "hello",
        "welcome",
        "push",
        "push_ack",
        "pull",
        "changes",
        "error",
        "health",
    } == FRAME_TAGS


@pytest.mark.parametrize(
    "side", ["server-before-hello", "server", "client-before-welcome", "client"]
)
def test_an_optional_frame_of_unknown_type_is_skipped(
    side: str, caplog: pytest.LogCaptureFixture
) -> None:
    proto: ServerProtocol | ClientProtocol
    if side == "server-before-hello":
        proto = ServerProtocol()
    elif side == "server":
        _, proto = connected()
    elif side == "client-before-welcome":
        proto = ClientProtocol("d", 0)
        proto.data_to_send()
    else:
        proto, _ = connected()
    before = proto.state
    with caplog.at_level(logging.DEBUG, logger="shared.protocol"):
        proto.receive_data(msgspec.msgpack.encode(Ping(nonce=1)))
        proto.receive_data(msgspec.msgpack.encode({"type": "x" * 500, "optional": True, "a": [1]}))
    assert proto.ignored_frames == 2
    assert proto.data_to_send() == []
    assert proto.events_received() == []
    assert proto.state is before and proto.close_reason is None
    assert "skipped optional frame 'ping'" in caplog.text
    assert "x" * 65 not in caplog.text  # a peer's tag is truncated in the log


@pytest.mark.parametrize(
    "data",
    [
        msgspec.msgpack.encode(Ping(nonce=1, optional=False, request_id=4)),
        msgspec.msgpack.encode({"type": "ping", "request_id": 4}),
        msgspec.msgpack.encode({"type": "ping", "optional": "yes", "request_id": 4}),
        msgspec.msgpack.encode({"type": 7, "optional": True}),
        msgspec.msgpack.encode({"optional": True}),
        msgspec.msgpack.encode([{"type": "ping", "optional": True}]),
        # A known tag is never skipped, even if marked optional: it is mistyped.
        msgspec.msgpack.encode({"type": "pull", "cursor": "x", "optional": True, "request_id": 4}),
        b"\xc1",
    ],
)
@pytest.mark.parametrize("side", ["server", "client"])
def test_other_unreadable_frames_are_a_3004(data: bytes, side: str) -> None:
    client, server = connected()
    proto: ServerProtocol | ClientProtocol = server if side == "server" else client
    proto.receive_data(data)
    assert proto.events_received() == []
    err = only_error(proto)
    assert err.code == ErrorCode.MALFORMED_FRAME
    assert proto.ignored_frames == 0
    assert proto.state is State.OPEN  # not fatal, as before
    envelope = codec.peek(data)
    if envelope is not None:
        assert err.request_id == envelope.request_id  # the request gets its answer


def test_refuse_answers_the_frame_it_did_not_process() -> None:
    _, server = connected()
    server.receive_data(b"")  # nothing
    server.data_to_send()
    server.refuse(enc(Pull(cursor=0, request_id=12)), MalformedFrame("no"))
    server.refuse(b"\xc1", MalformedFrame("no"))
    assert [e.request_id for e in sent(server) if isinstance(e, Error)] == [12, 0]
    assert server.events_received() == []
    assert server.state is State.OPEN


# -- request ids and the client's sorting --------------------------------------------------


def test_server_echoes_request_ids() -> None:
    client, server = connected()
    push_id = client.send_push([Change(client_seq=1, record=make_message())])
    pull_id = client.send_pull(0)
    assert client.outstanding == (push_id, pull_id)
    for data in client.data_to_send():
        server.receive_data(data)
    push, pull = server.events_received()
    assert isinstance(push, Push) and isinstance(pull, Pull)
    assert (push.request_id, pull.request_id) == (push_id, pull_id)
    # The pump answers out of order: ids, not order, match them.
    server.send_changes(0, 0, [], request_id=pull.request_id)
    server.send_changes(0, 5, [], live=True)
    server.fail(MalformedFrame("unsolicited"), fatal=False)
    server.send_push_ack([], 1, 5, request_id=push.request_id)
    for data in server.data_to_send():
        client.receive_data(data)
    events = client.take_events()
    assert [type(e) for e in events] == [Answer, Live, Notice, Answer]
    first, live, notice, last = events
    assert isinstance(first, Answer) and first.request_id == pull_id
    assert isinstance(first.frame, Changes) and not first.frame.live
    assert isinstance(live, Live) and live.changes.to_cursor == 5
    assert isinstance(notice, Notice) and notice.frame.code == ErrorCode.MALFORMED_FRAME
    assert isinstance(last, Answer) and last.request_id == push_id
    assert isinstance(last.frame, PushAck)
    assert client.outstanding == ()


def test_an_error_answering_a_request_is_an_answer() -> None:
    client, _ = connected()
    pull_id = client.send_pull(99)
    client.receive_data(
        enc(Error(code=ErrorCode.CURSOR_TOO_OLD, message="old", request_id=pull_id))
    )
    (event,) = client.take_events()
    assert event == Answer(pull_id, Error(code=3010, message="old", request_id=pull_id))
    assert client.outstanding == ()


@pytest.mark.parametrize(
    ("frame", "why"),
    [
        (PushAck(results=[], last_seq=0, request_id=9), "not outstanding"),
        (Changes(from_cursor=0, to_cursor=0, changes=[], request_id=9), "not outstanding"),
        (Error(code=3009, message="x", request_id=9), "not outstanding"),
        (PushAck(results=[], last_seq=0), "without a request id"),
        (Changes(from_cursor=0, to_cursor=0, changes=[]), "without a request id"),
        (PushAck(results=[], last_seq=0, request_id=2), "cannot answer Pull"),
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, str) else v,
)
def test_an_answer_to_no_outstanding_request_is_fatal(frame: Frame, why: str) -> None:
    client, _ = connected()
    assert client.send_pull(0) == 2
    client.data_to_send()
    client.receive_data(enc(frame))
    assert client.take_events() == []
    err = only_error(client)
    assert err.code == ErrorCode.MALFORMED_FRAME and why in err.message
    assert state(client) is State.CLOSING
    assert isinstance(client.close_reason, MalformedFrame)


def test_an_answer_cannot_come_twice() -> None:
    client, _ = connected()
    pull_id = client.send_pull(0)
    client.data_to_send()
    page = Changes(from_cursor=0, to_cursor=0, changes=[], request_id=pull_id)
    client.receive_data(enc(page))
    client.receive_data(enc(page))
    assert client.take_events() == [Answer(pull_id, page)]
    assert "not outstanding" in only_error(client).message


def test_a_version_1_server_is_matched_by_order() -> None:
    client = ClientProtocol("d", 0)
    client.data_to_send()
    client.receive_data(enc(welcome()))  # no ``protocol``, no request id: version 1
    assert client.version == 1
    assert client.take_events() == [Answer(client.hello_request_id, welcome())]
    push_id, pull_id = client.send_push([]), client.send_pull(0)
    client.data_to_send()
    ack = PushAck(results=[], last_seq=0)
    page = Changes(from_cursor=0, to_cursor=0, changes=[])
    live = Changes(from_cursor=0, to_cursor=1, changes=[], live=True)
    error = Error(code=3009, message="down")
    for frame in (ack, live, page, error):
        client.receive_data(enc(frame))
    assert client.take_events() == [
        Answer(push_id, ack),
        Live(live),
        Answer(pull_id, page),
        Notice(error),  # nothing outstanding any more
    ]
    client.receive_data(enc(page))  # an answer with nothing outstanding
    assert "no request is outstanding" in only_error(client).message


def test_before_welcome_an_error_answers_the_hello() -> None:
    # An old server's refusal carries no id; a new server's echoes the Hello's.
    for request_id in (0, 1):
        client = ClientProtocol("d", 0)
        client.data_to_send()
        refusal = Error(code=ErrorCode.PROTOCOL_VERSION, message="no", request_id=request_id)
        client.receive_data(enc(refusal))
        assert client.take_events() == [Answer(client.hello_request_id, refusal)]
        assert client.state is State.AWAITING_HELLO


def test_a_version_2_welcome_must_echo_the_hello() -> None:
    client = ClientProtocol("d", 0)
    client.data_to_send()
    client.receive_data(enc(welcome(protocol=2)))
    assert "Welcome without a request id" in only_error(client).message
    assert client.welcome is None and client.state is State.CLOSING


def test_events_received_is_the_raw_view_of_the_same_queue() -> None:
    client, _ = connected()
    pull_id = client.send_pull(0)
    page = Changes(from_cursor=0, to_cursor=0, changes=[], request_id=pull_id)
    live = Changes(from_cursor=0, to_cursor=1, changes=[], live=True)
    notice = Error(code=3008, message="slow")
    for frame in (live, page, notice):
        client.receive_data(enc(frame))
    assert client.events_received() == [live, page, notice]
    assert client.take_events() == []


# A schedule: the client sends requests, the server answers each exactly once in any order,
# with live pages and unsolicited errors interleaved.
Step = tuple[str, int]


@st.composite
def schedules(draw: st.DrawFn) -> tuple[list[str], list[Step]]:
    kinds = draw(st.lists(st.sampled_from(["push", "pull"]), max_size=12))
    answers: list[Step] = [("answer", i) for i in draw(st.permutations(range(len(kinds))))]
    noise: list[Step] = draw(
        st.lists(st.tuples(st.sampled_from(["live", "notice"]), st.integers(0, 99)), max_size=8)
    )
    steps = answers
    for item in noise:
        steps.insert(draw(st.integers(0, len(steps))), item)
    return kinds, steps


@given(schedules(), st.booleans())
def test_every_answer_reaches_its_request(
    schedule: tuple[list[str], list[Step]], refuse_some: bool
) -> None:
    kinds, steps = schedule
    client, server = connected()
    ids = [client.send_push([]) if kind == "push" else client.send_pull(0) for kind in kinds]
    assert ids == sorted(set(ids)) and all(i > client.hello_request_id for i in ids)
    for data in client.data_to_send():
        server.receive_data(data)
    requests = server.events_received()
    assert [r.request_id for r in requests] == ids  # type: ignore[union-attr]
    expected: list[ClientEvent] = []
    for step, n in steps:
        if step == "live":
            server.send_changes(n, n + 1, [], live=True)
            expected.append(Live(Changes(from_cursor=n, to_cursor=n + 1, changes=[], live=True)))
        elif step == "notice":
            server.fail(MalformedFrame(f"n{n}"), fatal=False)
            expected.append(Notice(Error(code=3004, message=f"n{n}")))
        else:
            request = requests[n]
            rid = request.request_id
            answer: Frame
            if refuse_some and n % 2:
                server.fail(MalformedFrame("refused"), fatal=False, request_id=rid)
                answer = Error(code=3004, message="refused", request_id=rid)
            elif isinstance(request, Push):
                server.send_push_ack([], 0, 0, request_id=rid)
                answer = PushAck(results=[], last_seq=0, head_cursor=0, request_id=rid)
            else:
                server.send_changes(0, 0, [], request_id=rid)
                answer = Changes(from_cursor=0, to_cursor=0, changes=[], request_id=rid)
            expected.append(Answer(rid, answer))  # type: ignore[arg-type]
    for data in server.data_to_send():
        client.receive_data(data)
    assert client.take_events() == expected
    assert client.outstanding == ()
    assert client.state is State.OPEN and client.data_to_send() == []


def test_feed_changes_survive_the_sorting() -> None:
    client, server = connected()
    pull_id = client.send_pull(0)
    feed = [FeedChange(cursor=1, record=make_message())]
    server.receive_data(client.data_to_send()[0])
    server.send_changes(0, 1, feed, request_id=pull_id)
    for data in server.data_to_send():
        client.receive_data(data)
    (event,) = client.take_events()
    assert isinstance(event, Answer) and isinstance(event.frame, Changes)
    assert event.frame.changes == feed


# -- health frames (version 2) ---------------------------------------------------------------


def health(**fields: typing.Any) -> Health:
    return Health(**{"pending": 2, "dead_letters": 0, "cursor": 7, **fields})


def test_health_reaches_the_server_after_hello_unanswered() -> None:
    client, server = connected()
    assert client.send_health(health(request_id=9, optional=False))
    for data in client.data_to_send():
        server.receive_data(data)
    (event,) = server.events_received()
    # Whatever the caller put there, a Health frame is optional and answers nothing.
    assert isinstance(event, Health) and event.optional and event.request_id == 0
    assert event.pending == 2 and event.cursor == 7
    assert server.data_to_send() == [] and client.outstanding == ()


def test_health_is_not_sent_to_a_version_1_server() -> None:
    client = ClientProtocol("dev-a", 0, max_protocol=1)
    client.data_to_send()
    client.receive_data(enc(welcome(protocol=1)))
    client.take_events()
    assert client.send_health(health()) is False
    assert client.data_to_send() == []


def test_a_server_that_predates_health_skips_it() -> None:
    """An older version 2 server does not know the tag: the frame is optional, so skipped."""
    data = msgspec.msgpack.encode(
        {"type": "health-from-the-future", "optional": True, "pending": 1}
    )
    _, server = connected()
    server.receive_data(data)
    assert server.events_received() == [] and server.ignored_frames == 1
    assert state(server) is State.OPEN


def test_health_before_hello_is_refused() -> None:
    server = ServerProtocol()
    server.receive_data(enc(health()))
    assert only_error(server).code == ErrorCode.MALFORMED_FRAME
    assert server.events_received() == []


@pytest.mark.parametrize(
    "fields",
    [
        {"pending": -1},
        {"last_error": "x" * (MAX_HEALTH_TEXT + 1)},
        {
            "conflicts": [
                {"conflict_id": "c", "session_id": "s", "winner": "local", "fork_session_id": "f"}
            ]
            * (MAX_HEALTH_CONFLICTS + 1)
        },
        {"last_flush_outcome": "y" * 33},
    ],
    ids=["negative", "long-error", "many-conflicts", "long-outcome"],
)
def test_an_unbounded_health_frame_is_refused_and_the_connection_goes_on(
    fields: dict[str, typing.Any],
) -> None:
    _, server = connected()
    frame = {"type": "health", "pending": 0, "dead_letters": 0, "cursor": 0, **fields}
    server.receive_data(msgspec.msgpack.encode(frame))
    assert only_error(server).code == ErrorCode.MALFORMED_FRAME
    assert server.events_received() == [] and state(server) is State.OPEN


# -- records as their stored bytes (version 6) ---------------------------------------------


def connected_at(version: int) -> tuple[ClientProtocol, ServerProtocol]:
    """A client offering at most ``version`` and a server of this code base, past Welcome."""
    client, server = ClientProtocol("dev-a", 0, max_protocol=version), ServerProtocol()
    for data in client.data_to_send():
        server.receive_data(data)
    server.events_received()
    server.send_welcome(welcome())
    for data in server.data_to_send():
        client.receive_data(data)
    client.take_events()
    assert client.version == server.version == version
    return client, server


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(compact_records(), min_size=1, max_size=6),
    st.booleans(),
    st.sampled_from([6, 7, 8, 9]),
)
def test_records_travel_as_their_bytes_both_ways(
    records: list[Record], map_form: bool, version: int
) -> None:
    """Generated records of every kind, sent as bytes (compact, or the map form a file of an
    older version holds): the server reads each as the record it is and keeps the bytes
    beside it; a page served from those bytes reaches the device as the same records and
    bytes. The frame on the wire holds no map-form record the sender did not store so.
    Before version 8 a body goes with its device written out (``compact.explicit``), both
    ways; before 9 with its long texts written out (``compact.inflated``); from 9 as it is
    stored."""
    client, server = connected_at(version)
    encode = encode_record if map_form else compact.encode
    stored = [encode(r) for r in records]
    bodies = stored if version >= IMPLIED_SINCE else [compact.explicit(b) for b in stored]
    bodies = bodies if version >= DEFLATED_SINCE else [compact.inflated(b) for b in bodies]
    changes = [Change(client_seq=i + 1, record=r) for i, r in enumerate(records)]
    client.send_push(changes, bodies=stored)
    (data,) = client.data_to_send()
    assert all(body in data for body in bodies)  # the stored bytes, as they are
    server.receive_data(data)
    (push,) = server.events_received()
    assert isinstance(push, Push) and push.changes == changes
    assert [bytes(b.body) for b in push.bodies] == bodies
    pull_id = client.send_pull(0)
    server.receive_data(client.data_to_send()[0])
    page = [FeedBody(i + 1, msgspec.Raw(b)) for i, b in enumerate(stored)]
    server.send_changes(0, len(page), [], bodies=page, request_id=pull_id)
    for data in server.data_to_send():
        client.receive_data(data)
    (event,) = client.take_events()
    assert isinstance(event, Answer) and isinstance(event.frame, Changes)
    assert [c.record for c in event.frame.changes] == records
    assert [bytes(b.body) for b in event.frame.bodies] == bodies


def test_below_version_6_records_go_as_records() -> None:
    client, server = connected_at(5)
    record = make_message()
    client.send_push([Change(client_seq=1, record=record)], bodies=[compact.encode(record)])
    (data,) = client.data_to_send()
    push = codec.decode(data)
    assert isinstance(push, Push) and push.bodies == [] and push.changes[0].record == record
    with pytest.raises(InvalidState):
        server.send_changes(0, 1, [], bodies=[FeedBody(1, msgspec.Raw(compact.encode(record)))])


@pytest.mark.parametrize(
    "body",
    [
        msgspec.msgpack.encode([1, "not a uuid", 5]),  # a message of too few fields
        msgspec.msgpack.encode([99, "x"]),  # no such kind
        msgspec.msgpack.encode(["Message", "x"]),  # a kind that is not an index
        msgspec.msgpack.encode({"record_kind": "Message", "id": 5}),  # a mistyped map form
        msgspec.msgpack.encode(msgspec.msgpack.Ext(9, b"?")),  # an ext no record holds
    ],
)
def test_a_record_that_does_not_decode_is_a_3004_and_the_connection_goes_on(body: bytes) -> None:
    client, server = connected_at(6)
    entry = [1, msgspec.Raw(body)]
    server.receive_data(
        msgspec.msgpack.encode({"type": "push", "changes": [], "request_id": 4, "bodies": [entry]})
    )
    assert server.events_received() == []
    err = only_error(server)
    assert (err.code, err.request_id) == (ErrorCode.MALFORMED_FRAME, 4)
    assert server.state is State.OPEN
    # The device's side: a page holding such a record answers its pull with the error.
    pull_id = client.send_pull(0)
    page = {"type": "changes", "from_cursor": 0, "to_cursor": 1, "changes": [], "bodies": [entry]}
    client.receive_data(msgspec.msgpack.encode({**page, "request_id": pull_id}))
    (event,) = client.take_events()
    assert isinstance(event, Answer) and isinstance(event.frame, Error)
    assert event.frame.code == ErrorCode.MALFORMED_FRAME and event.request_id == pull_id
    assert client.state is State.OPEN and client.outstanding == ()
    # A live page: a notice.
    client.receive_data(msgspec.msgpack.encode({**page, "live": True}))
    (notice,) = client.take_events()
    assert isinstance(notice, Notice) and notice.frame.code == ErrorCode.MALFORMED_FRAME


def test_a_pushed_record_over_the_limit_written_out_is_a_3004_and_the_next_push_goes_on() -> None:
    """A record whose texts, written out, pass ``MAX_RECORD_BYTES`` (a device never writes
    one: it measures the map form, larger still) is refused as a malformed frame, and a
    record just within the limit written out is taken: a server never stores a record it
    could not send to a device before protocol 9."""
    rng = random.Random(5)
    log = "\n".join(" ".join(rng.choice(("ok", "warn")) for _ in range(6)) for _ in range(99_000))
    assert len(log) > MAX_RECORD_BYTES
    over, under = (
        make_message(content=[{"type": "text", "text": log}]),
        make_message(content=[{"type": "text", "text": log[: MAX_RECORD_BYTES // 2]}]),
    )
    bodies = [compact.encode(over), compact.encode(under)]
    assert len(bodies[0]) < MAX_RECORD_BYTES // 8  # deflated: a frame carries it easily
    client, server = connected_at(9)
    for seq, (record, body) in enumerate(zip((over, under), bodies, strict=True), start=1):
        request_id = client.send_push([Change(client_seq=seq, record=record)], bodies=[body])
        for data in client.data_to_send():
            server.receive_data(data)
        if record is over:
            err = only_error(server)
            assert (err.code, err.request_id) == (ErrorCode.MALFORMED_FRAME, request_id)
            assert "written out" in err.message and server.state is State.OPEN
        else:
            (push,) = server.events_received()
            assert isinstance(push, Push) and push.changes[0].record == under


def test_a_frame_with_records_and_bodies_is_refused() -> None:
    _, server = connected_at(6)
    record = make_message()
    both = Push(
        changes=[Change(client_seq=1, record=record)],
        request_id=3,
        bodies=[ChangeBody(2, msgspec.Raw(compact.encode(record)))],
    )
    server.receive_data(enc(both))
    assert server.events_received() == []
    err = only_error(server)
    assert (err.code, err.request_id) == (ErrorCode.MALFORMED_FRAME, 3)
    assert "not both" in err.message and server.state is State.OPEN
