"""Sans-I/O sync protocol: ``ClientProtocol`` and ``ServerProtocol``.

Neither touches sockets or asyncio. Feed received bytes to ``receive_data``; take what was
received (``events_received()`` on the server, ``take_events()`` on the client) and bytes to
write from ``data_to_send()``. A protocol violation queues an ``Error`` frame, moves to
``CLOSING`` (when fatal) and records ``close_reason``; the pump must then send what is queued
and close the connection.

Both sides skip a frame whose tag they do not know when its map carries ``optional: true``
(counted in ``ignored_frames``, logged at debug); any other unreadable frame is answered
with a non-fatal 3004.

Versions are negotiated by ``Hello``/``Welcome`` (see ``shared.messages``). The client
matches every answer to its request: by ``request_id`` when it is set, else (version 1, or
before ``Welcome``) by order. It sorts what it receives into ``Answer``, ``Live`` and
``Notice`` events.
"""

from __future__ import annotations

import enum
import functools
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import msgspec

from . import compact
from .errors import (
    FrameTooLarge,
    InvalidState,
    MalformedFrame,
    ProtocolVersion,
    SyncError,
)
from .idrefs import ID_REFS_SINCE, IdLists
from .messages import (
    COMPACT_SINCE,
    DEFAULT_MAX_FRAME_BYTES,
    DEFLATED_SINCE,
    FRAME_TAGS,
    IMPLIED_SINCE,
    MAX_PROTOCOL,
    MAX_RECORD_BYTES,
    MIN_PROTOCOL,
    SKIPPED_SINCE,
    ChangeBody,
    ChangeResult,
    Changes,
    ClientFrame,
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
    change_bodies,
    unpacked,
)
from .records import Change, FeedChange

__all__ = [
    "Answer",
    "AnswerFrame",
    "ClientEvent",
    "ClientProtocol",
    "Live",
    "Notice",
    "ServerProtocol",
    "State",
    "negotiate",
]

logger = logging.getLogger("shared.protocol")

# First protocol version whose answers carry the request's id.
_REQUEST_IDS_SINCE = 2
_HEALTH_SINCE = 2
_MAX_LOGGED_TAG = 64


class State(enum.Enum):
    AWAITING_HELLO = "awaiting-hello"  # server: nothing received yet; client: Hello sent
    OPEN = "open"
    CLOSING = "closing"


def negotiate(offered: tuple[int, int], supported: tuple[int, int]) -> int | None:
    """The highest version in both inclusive ranges ``(lowest, highest)``, or ``None``."""
    low = max(offered[0], supported[0])
    high = min(offered[1], supported[1])
    return high if low <= high else None


_Bodied = TypeVar("_Bodied", ChangeBody, FeedBody)


def _rebodied(bodies: list[_Bodied], change: Callable[[Any], Any]) -> list[_Bodied]:
    """``bodies`` with each body passed through ``change`` (an ``IdLists``' ``grow`` or
    ``shrink``): an item whose body comes back unchanged is kept as it is."""
    return [
        b
        if (body := change(b.body)) is b.body
        else msgspec.structs.replace(b, body=msgspec.Raw(body))
        for b in bodies
    ]


_WRITTEN_OUT_AT: Final = MAX_RECORD_BYTES // compact.INFLATE_RATIO
"""A body of fewer bytes than this holds at most ``MAX_RECORD_BYTES`` written out."""


def _check_written_out(bodies: list[ChangeBody]) -> None:
    """``msgspec.DecodeError`` for a pushed record over ``MAX_RECORD_BYTES`` with its texts
    written out (``compact.inflated``): a device refuses to write one (in the map form, which
    is larger), and a server that stored one could not send it to a device before protocol 9
    in any frame it reads. Only a body of ``_WRITTEN_OUT_AT`` bytes or more can be one."""
    for item in bodies:
        if len(item.body) >= _WRITTEN_OUT_AT:
            size = len(compact.inflated(item.body))
            if size > MAX_RECORD_BYTES:
                raise msgspec.DecodeError(
                    f"record {item.client_seq} is {size:,} bytes with its texts written out, "
                    f"over the {MAX_RECORD_BYTES:,}-byte limit for a record"
                )


class _Protocol:
    def __init__(self, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.max_frame_bytes = max_frame_bytes
        self.state = State.AWAITING_HELLO
        self.codec = FrameCodec()
        self.close_reason: SyncError | None = None
        self.ignored_frames = 0  # optional frames of unknown type, skipped
        self._out: list[bytes] = []
        # (Version 7) The session id lists each direction has carried (``shared.idrefs``):
        # pushes and answers in one, live pages in another, since a live page may reach the
        # device behind answers sent after it (the protocol lets a server hold live pages
        # back); each stream keeps its own order. Each made when first used (an idle
        # connection holds none).
        self.version: int | None = None

    @functools.cached_property
    def sent_ids(self) -> IdLists:
        """The lists this side sent in pushes and answers."""
        return IdLists()

    @functools.cached_property
    def received_ids(self) -> IdLists:
        """The lists this side read in pushes and answers."""
        return IdLists()

    @functools.cached_property
    def sent_live_ids(self) -> IdLists:
        """The lists this side sent in live pages (a server)."""
        return IdLists()

    @functools.cached_property
    def received_live_ids(self) -> IdLists:
        """The lists this side read in live pages (a device)."""
        return IdLists()

    def data_to_send(self) -> list[bytes]:
        """Encoded frames to write, in order, since the last call."""
        out, self._out = self._out, []
        return out

    def _send(self, frame: Frame) -> None:
        if self.state is State.CLOSING:
            raise InvalidState("protocol is closing; nothing more may be sent")
        self._out.append(self.codec.encode(frame))

    def fail(self, error: SyncError, *, fatal: bool = True, request_id: int = 0) -> None:
        """Queue an ``Error`` frame for ``error``; when fatal, move to ``CLOSING``.

        ``request_id`` names the request the error answers (0: none).
        """
        if self.state is State.CLOSING:
            return
        self._out.append(
            self.codec.encode(
                Error(
                    code=int(error.code),
                    message=error.message,
                    retryable=error.retryable,
                    request_id=request_id,
                )
            )
        )
        if fatal:
            self.state = State.CLOSING
            self.close_reason = error

    def _decode(self, data: bytes) -> Frame | None:
        if self.state is State.CLOSING:
            return None
        if len(data) > self.max_frame_bytes:
            self.fail(FrameTooLarge(f"frame of {len(data)} bytes exceeds {self.max_frame_bytes}"))
            return None
        try:
            frame = self.codec.decode(data)
            if isinstance(frame, Push | Changes) and frame.bodies:
                grown = self._grown(frame)
                return None if grown is None else self._unpacked(grown)
            return frame
        except msgspec.ValidationError as exc:
            envelope = self.codec.peek(data)
            if envelope is None:
                self.fail(MalformedFrame(f"mistyped frame: {exc}"), fatal=False)
            elif envelope.type in FRAME_TAGS:
                self.fail(
                    MalformedFrame(f"mistyped frame: {exc}"),
                    fatal=False,
                    request_id=envelope.request_id,
                )
            elif envelope.optional:
                self.ignored_frames += 1
                logger.debug("skipped optional frame %r", envelope.type[:_MAX_LOGGED_TAG])
            else:
                tag = envelope.type[:_MAX_LOGGED_TAG]
                self.fail(
                    MalformedFrame(f"unknown frame type {tag!r} (not marked optional)"),
                    fatal=False,
                    request_id=envelope.request_id,
                )
        except msgspec.DecodeError as exc:
            self.fail(MalformedFrame(f"malformed frame: {exc}"), fatal=False)
        return None

    def _grown(self, frame: Push | Changes) -> Push | Changes | None:
        """(Version 7) ``frame`` with its session bodies' id list references made whole
        (``IdLists.grow``); None, and a fatal 3004, for a reference this side cannot resolve:
        the two sides' lists no longer agree, so the connection ends (the device connects
        again, with empty lists)."""
        if (self.version or 0) < ID_REFS_SINCE:
            return frame
        live = isinstance(frame, Changes) and frame.live
        grow = (self.received_live_ids if live else self.received_ids).grow
        try:
            return msgspec.structs.replace(frame, bodies=_rebodied(frame.bodies, grow))
        except msgspec.DecodeError as exc:
            self.fail(MalformedFrame(f"malformed frame: {exc}"), request_id=frame.request_id)
            return None

    def _unpacked(self, frame: Push | Changes) -> Push | Changes | None:
        """``frame`` with its ``bodies`` (version 6) decoded into ``changes``; None (and a
        non-fatal 3004 answering its request) when a record does not decode, or when the
        frame also carries ``changes``."""
        try:
            if isinstance(frame, Push):
                _check_written_out(frame.bodies)
            return unpacked(frame)
        except (msgspec.DecodeError, RecursionError) as exc:  # ValidationError is one
            self._refuse_unpacked(frame, MalformedFrame(f"mistyped record in frame: {exc}"))
            return None

    def _refuse_unpacked(self, frame: Push | Changes, error: SyncError) -> None:
        self.fail(error, fatal=False, request_id=frame.request_id)


class ServerProtocol(_Protocol):
    """The server side of one device connection.

    Speaks versions ``min_protocol..max_protocol``; ``version`` is the one agreed with the
    device once its ``Hello`` is accepted. Every ``send_*`` takes the ``request_id`` of the
    frame it answers (0 for live pages).
    """

    client_id: str | None = None
    hello: Hello | None = None
    version: int | None = None

    def __init__(
        self,
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        min_protocol: int = MIN_PROTOCOL,
        max_protocol: int = MAX_PROTOCOL,
        previous_client_ids: list[str] | None = None,
    ) -> None:
        super().__init__(max_frame_bytes=max_frame_bytes)
        if not 1 <= min_protocol <= max_protocol:
            raise ValueError(
                f"need 1 <= min_protocol <= max_protocol, got {min_protocol}..{max_protocol}"
            )
        self.supported = (min_protocol, max_protocol)
        self._events: list[ClientFrame] = []

    def events_received(self) -> list[ClientFrame]:
        """Frames decoded since the last call, in order: ``Hello``, then ``Push``/``Pull``."""
        events, self._events = self._events, []
        return events

    def receive_data(self, data: bytes) -> None:
        frame = self._decode(data)
        if frame is None:
            return
        match frame:
            case Hello() if self.state is State.AWAITING_HELLO and self.hello is None:
                offered = frame.protocol_range()
                version = negotiate(offered, self.supported)
                if version is None:
                    self.fail(
                        ProtocolVersion(
                            f"no protocol version in common: device speaks "
                            f"{offered[0]}..{offered[1]}, server speaks "
                            f"{self.supported[0]}..{self.supported[1]}"
                        ),
                        request_id=frame.request_id,
                    )
                    return
                self.hello = frame
                self.version = version
                self.client_id = frame.client_id
                self._events.append(frame)
            case Push() | Pull() | Health() if self.state is State.OPEN:
                self._events.append(frame)
            case Hello():
                self.fail(MalformedFrame("Hello was already received"), request_id=frame.request_id)
            case Push() | Pull() | Health():
                self.fail(MalformedFrame("send Hello first"), request_id=frame.request_id)
            case _:
                self.fail(MalformedFrame(f"a client may not send {type(frame).__name__}"))

    def refuse(self, data: bytes, error: SyncError) -> None:
        """Answer the frame ``data`` with ``error`` without processing it (non-fatal).

        The ``Error`` carries the frame's ``request_id`` when it can be read, so the device's
        request gets its answer. Use it for frames refused before decoding (rate limits).
        """
        envelope = self.codec.peek(data) if len(data) <= self.max_frame_bytes else None
        if envelope is not None and envelope.type == "push" and self.state is State.OPEN:
            self._carried(data)
        self.fail(error, fatal=False, request_id=envelope.request_id if envelope else 0)

    def _carried(self, data: bytes) -> None:
        """(Version 7) The id lists of a push refused unread, taken as the device sent them
        (its lists changed as it sent the push: this side's must too)."""
        if (self.version or 0) < ID_REFS_SINCE:
            return
        try:
            frame = self.codec.decode(data)
        except msgspec.DecodeError:
            return  # (a frame that does not decode changed nobody's lists)
        if isinstance(frame, Push) and frame.bodies:
            self._grown(frame)

    def send_welcome(self, welcome: Welcome) -> None:
        """Answer the accepted ``Hello``; fills in the agreed ``protocol`` and the request id."""
        if self.state is not State.AWAITING_HELLO or self.hello is None or self.version is None:
            raise InvalidState("Welcome answers a Hello")
        self._send(
            msgspec.structs.replace(
                welcome, protocol=self.version, request_id=self.hello.request_id
            )
        )
        self.state = State.OPEN

    def send_push_ack(
        self,
        results: list[ChangeResult],
        last_seq: int,
        head_cursor: int,
        *,
        request_id: int = 0,
        as_pushed_from: int | None = None,
    ) -> None:
        self._require_open()
        self._send(
            PushAck(
                results=results,
                last_seq=last_seq,
                head_cursor=head_cursor,
                request_id=request_id,
                as_pushed_from=as_pushed_from,
            )
        )

    def send_changes(
        self,
        from_cursor: int,
        to_cursor: int,
        changes: list[FeedChange],
        *,
        more: bool = False,
        live: bool = False,
        request_id: int = 0,
        bodies: list[FeedBody] | None = None,
    ) -> None:
        """Queue a ``Changes`` page. ``bodies`` (version 6 only: ``InvalidState`` otherwise)
        are its entries as their stored bytes, sent instead of ``changes``."""
        self._require_open()
        if bodies is not None and (self.version or 0) < COMPACT_SINCE:
            raise InvalidState(f"record bodies need protocol {COMPACT_SINCE}")
        if bodies and (self.version or 0) < IMPLIED_SINCE:
            bodies = _rebodied(bodies, compact.explicit)
        if bodies and (self.version or 0) < DEFLATED_SINCE:
            bodies = _rebodied(bodies, compact.inflated)
        if bodies and (self.version or 0) >= ID_REFS_SINCE:
            bodies = _rebodied(bodies, (self.sent_live_ids if live else self.sent_ids).shrink)
        self._send(
            Changes(
                from_cursor=from_cursor,
                to_cursor=to_cursor,
                changes=[] if bodies is not None else changes,
                more=more,
                live=live,
                request_id=0 if live else request_id,
                bodies=bodies or [],
            )
        )

    def _require_open(self) -> None:
        if self.state is not State.OPEN:
            raise InvalidState(f"connection is {self.state.value}")


# -- the client ------------------------------------------------------------------------------

AnswerFrame = Welcome | PushAck | Changes | Error


@dataclass(frozen=True, slots=True)
class Answer:
    """The answer to this client's request ``request_id`` (an ``Error`` when refused)."""

    request_id: int
    frame: AnswerFrame


@dataclass(frozen=True, slots=True)
class Live:
    """A live page of the feed, pushed after a commit of the tenant (not an answer)."""

    changes: Changes


@dataclass(frozen=True, slots=True)
class Notice:
    """An ``Error`` that answers no request: a frame that could not be read, or why the
    server is about to close."""

    frame: Error


ClientEvent = Answer | Live | Notice

_ANSWERS: dict[type[ClientFrame], tuple[type[AnswerFrame], ...]] = {
    Hello: (Welcome, Error),
    Push: (PushAck, Error),
    Pull: (Changes, Error),
}


class ClientProtocol(_Protocol):
    """The device side of one connection; starts by queueing ``Hello``.

    Requests get increasing ids from 1 (``Hello`` is ``hello_request_id``); ``send_push`` and
    ``send_pull`` return theirs. ``take_events()`` sorts what arrives into ``Answer`` (to one
    of ``outstanding``), ``Live`` and ``Notice``. An answer to no outstanding request (or of
    the wrong kind) is a fatal 3004.
    """

    welcome: Welcome | None = None
    version: int | None = None

    def __init__(
        self,
        client_id: str,
        cursor: int,
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        min_protocol: int = MIN_PROTOCOL,
        max_protocol: int = MAX_PROTOCOL,
        previous_client_ids: list[str] | None = None,
    ) -> None:
        super().__init__(max_frame_bytes=max_frame_bytes)
        if not 1 <= min_protocol <= max_protocol:
            raise ValueError(
                f"need 1 <= min_protocol <= max_protocol, got {min_protocol}..{max_protocol}"
            )
        self.client_id = client_id
        self.supported = (min_protocol, max_protocol)
        self._events: list[ClientEvent] = []
        self._next_id = 1
        self._outstanding: OrderedDict[int, type[ClientFrame]] = OrderedDict()
        self.hello_request_id = self._request(
            lambda rid: Hello(
                protocol=min_protocol,
                client_id=client_id,
                cursor=cursor,
                min_protocol=min_protocol,
                max_protocol=max_protocol,
                request_id=rid,
                previous_client_ids=list(previous_client_ids or []),
            )
        )

    @property
    def outstanding(self) -> tuple[int, ...]:
        """Ids of the requests sent and not yet answered, oldest first."""
        return tuple(self._outstanding)

    def take_events(self) -> list[ClientEvent]:
        """What arrived since the last call, in order, as ``Answer``/``Live``/``Notice``.

        Drains the same queue as ``events_received``: a pump uses one or the other.
        """
        events, self._events = self._events, []
        return events

    def events_received(self) -> list[Frame]:
        """The frames that arrived since the last call, in order, without their sorting.

        For pumps that match answers by order; prefer ``take_events``.
        """
        return [_frame_of(event) for event in self.take_events()]

    def receive_data(self, data: bytes) -> None:
        frame = self._decode(data)
        if frame is None:
            return
        match frame:
            case Welcome() if self.state is State.AWAITING_HELLO:
                self._on_welcome(frame)
            case Changes(live=True) if self.state is State.OPEN:
                self._events.append(Live(frame))
            case PushAck() | Changes() if self.state is State.OPEN:
                self._answer(frame, self.version)
            case Error():
                self._answer(frame, self.version)
            case _:
                self.fail(
                    MalformedFrame(f"unexpected {type(frame).__name__} while {self.state.value}")
                )

    def send_push(
        self,
        changes: list[Change],
        *,
        trace: str = "",
        skipped: list[int] | None = None,
        bodies: list[bytes] | None = None,
    ) -> int:
        """Queue a ``Push``; returns its request id (its ``PushAck`` or ``Error`` echoes it).
        ``trace``: the ``traceparent`` of the span the push belongs to. ``skipped``: numbers
        that carry no record (only to a server at version 4 or later: ``InvalidState``
        otherwise, since an older server would take them for a gap). ``bodies``: the stored
        bytes of each change's record, in order; sent instead of the records to a server at
        version 6 or later, ignored below it."""
        self._require_open()
        if skipped and (self.version is None or self.version < SKIPPED_SINCE):
            raise InvalidState(f"skipped numbers need protocol {SKIPPED_SINCE}")
        if bodies is not None and len(bodies) != len(changes):
            raise ValueError(f"{len(bodies)} bodies for {len(changes)} changes")
        if bodies is not None and (self.version or 0) >= COMPACT_SINCE:
            if (self.version or 0) < IMPLIED_SINCE:
                bodies = [bytes(compact.explicit(body)) for body in bodies]
            if (self.version or 0) < DEFLATED_SINCE:
                bodies = [bytes(compact.inflated(body)) for body in bodies]
            if (self.version or 0) >= ID_REFS_SINCE:
                bodies = [bytes(self.sent_ids.shrink(body)) for body in bodies]
            packed = change_bodies(changes, bodies)
            return self._request(
                lambda rid: Push(
                    changes=[], request_id=rid, trace=trace, skipped=skipped or [], bodies=packed
                )
            )
        return self._request(
            lambda rid: Push(changes=changes, request_id=rid, trace=trace, skipped=skipped or [])
        )

    def send_pull(self, cursor: int, limit: int = 500) -> int:
        """Queue a ``Pull``; returns its request id (its ``Changes`` or ``Error`` echoes it)."""
        self._require_open()
        return self._request(lambda rid: Pull(cursor=cursor, limit=limit, request_id=rid))

    def send_health(self, health: Health) -> bool:
        """Queue a ``Health`` frame (no answer comes); False, and nothing queued, when the
        agreed version predates it (1)."""
        self._require_open()
        if self.version is None or self.version < _HEALTH_SINCE:
            return False
        self._send(msgspec.structs.replace(health, request_id=0, optional=True))
        return True

    def _request(self, build: Callable[[int], Hello | Push | Pull]) -> int:
        frame = build(self._next_id)
        self._send(frame)
        self._outstanding[self._next_id] = type(frame)
        self._next_id += 1
        return frame.request_id

    def _on_welcome(self, frame: Welcome) -> None:
        low, high = self.supported
        if not low <= frame.protocol <= high:
            self.fail(
                ProtocolVersion(
                    f"server chose protocol {frame.protocol}; this device speaks {low}..{high}"
                )
            )
            return
        if self._answer(frame, frame.protocol):
            self.welcome = frame
            self.version = frame.protocol
            self.state = State.OPEN

    def _answer(self, frame: AnswerFrame, version: int | None) -> bool:
        """Queue ``frame`` as the answer to its request (or a ``Notice``); False on failure.

        Until ``Welcome`` names a version with request ids, an answer without one is matched
        by order: it answers the oldest outstanding request.
        """
        request_id = frame.request_id
        by_order = version is None or version < _REQUEST_IDS_SINCE
        if request_id == 0:
            if by_order and self._outstanding:
                request_id = next(iter(self._outstanding))
            elif isinstance(frame, Error):
                self._events.append(Notice(frame))
                return True
            elif by_order:
                self.fail(MalformedFrame(f"{type(frame).__name__} while no request is outstanding"))
                return False
            else:
                self.fail(MalformedFrame(f"{type(frame).__name__} without a request id"))
                return False
        sent = self._outstanding.get(request_id)
        if sent is None:
            self.fail(
                MalformedFrame(
                    f"{type(frame).__name__} answers request {request_id}, which is not outstanding"
                )
            )
            return False
        if not isinstance(frame, _ANSWERS[sent]):
            self.fail(
                MalformedFrame(
                    f"{type(frame).__name__} cannot answer {sent.__name__} (request {request_id})"
                )
            )
            return False
        del self._outstanding[request_id]
        self._events.append(Answer(request_id, frame))
        return True

    def _require_open(self) -> None:
        if self.state is not State.OPEN:
            raise InvalidState(f"connection is {self.state.value}")

    def _refuse_unpacked(self, frame: Push | Changes, error: SyncError) -> None:
        """A page holding a record this device cannot read answers its pull with the error
        (a live page: a ``Notice``); the connection goes on."""
        refusal = Error(code=int(error.code), message=error.message, request_id=frame.request_id)
        if isinstance(frame, Changes) and self.state is State.OPEN:
            if frame.live:
                self._events.append(Notice(refusal))
            else:
                self._answer(refusal, self.version)
            return
        super()._refuse_unpacked(frame, error)


def _frame_of(event: ClientEvent) -> Frame:
    if isinstance(event, Live):
        return event.changes
    return event.frame
