"""Sans-I/O sync protocol: ``ClientProtocol`` and ``ServerProtocol``.

Neither touches sockets or asyncio. Feed received bytes to ``receive_data``; take decoded
frames from ``events_received()`` and bytes to write from ``data_to_send()``. A protocol
violation queues an ``Error`` frame, moves to ``CLOSING`` (when fatal) and records
``close_reason``; the pump must then send what is queued and close the connection.
"""

from __future__ import annotations

import enum

import msgspec

from .errors import (
    FrameTooLarge,
    InvalidState,
    MalformedFrame,
    ProtocolVersion,
    SyncError,
)
from .messages import (
    DEFAULT_MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    ChangeResult,
    Changes,
    Error,
    Frame,
    FrameCodec,
    Hello,
    Pull,
    Push,
    PushAck,
    Welcome,
)
from .records import Change, FeedChange


class State(enum.Enum):
    AWAITING_HELLO = "awaiting-hello"  # server: nothing received yet; client: Hello sent
    OPEN = "open"
    CLOSING = "closing"


class _Protocol:
    def __init__(self, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.max_frame_bytes = max_frame_bytes
        self.state = State.AWAITING_HELLO
        self.codec = FrameCodec()
        self.close_reason: SyncError | None = None
        self._events: list[Frame] = []
        self._out: list[bytes] = []

    def events_received(self) -> list[Frame]:
        """Frames decoded since the last call, in order."""
        events, self._events = self._events, []
        return events

    def data_to_send(self) -> list[bytes]:
        """Encoded frames to write, in order, since the last call."""
        out, self._out = self._out, []
        return out

    def _send(self, frame: Frame) -> None:
        if self.state is State.CLOSING:
            raise InvalidState("protocol is closing; nothing more may be sent")
        self._out.append(self.codec.encode(frame))

    def fail(self, error: SyncError, *, fatal: bool = True) -> None:
        """Queue an ``Error`` frame for ``error``; when fatal, move to ``CLOSING``."""
        if self.state is State.CLOSING:
            return
        self._out.append(
            self.codec.encode(
                Error(code=int(error.code), message=error.message, retryable=error.retryable)
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
            return self.codec.decode(data)
        except msgspec.ValidationError as exc:
            self.fail(MalformedFrame(f"mistyped frame: {exc}"), fatal=False)
        except msgspec.DecodeError as exc:
            self.fail(MalformedFrame(f"malformed frame: {exc}"), fatal=False)
        return None


class ServerProtocol(_Protocol):
    """The server side of one device connection."""

    client_id: str | None = None
    hello: Hello | None = None

    def receive_data(self, data: bytes) -> None:
        frame = self._decode(data)
        if frame is None:
            return
        match frame:
            case Hello(protocol=version) if (
                self.state is State.AWAITING_HELLO and self.hello is None
            ):
                if version != PROTOCOL_VERSION:
                    self.fail(
                        ProtocolVersion(
                            f"protocol {version} unsupported; server speaks {PROTOCOL_VERSION}"
                        )
                    )
                    return
                self.hello = frame
                self.client_id = frame.client_id
                self._events.append(frame)
            case Push() | Pull() if self.state is State.OPEN:
                self._events.append(frame)
            case Hello():
                self.fail(MalformedFrame("Hello was already received"))
            case Push() | Pull():
                self.fail(MalformedFrame("send Hello first"))
            case _:
                self.fail(MalformedFrame(f"a client may not send {type(frame).__name__}"))

    def send_welcome(self, welcome: Welcome) -> None:
        if self.state is not State.AWAITING_HELLO or self.hello is None:
            raise InvalidState("Welcome answers a Hello")
        self._send(welcome)
        self.state = State.OPEN

    def send_push_ack(self, results: list[ChangeResult], last_seq: int, head_cursor: int) -> None:
        self._require_open()
        self._send(PushAck(results=results, last_seq=last_seq, head_cursor=head_cursor))

    def send_changes(
        self,
        from_cursor: int,
        to_cursor: int,
        changes: list[FeedChange],
        *,
        more: bool = False,
        live: bool = False,
    ) -> None:
        self._require_open()
        self._send(
            Changes(
                from_cursor=from_cursor, to_cursor=to_cursor, changes=changes, more=more, live=live
            )
        )

    def _require_open(self) -> None:
        if self.state is not State.OPEN:
            raise InvalidState(f"connection is {self.state.value}")


class ClientProtocol(_Protocol):
    """The device side of one connection; starts by queueing ``Hello``."""

    welcome: Welcome | None = None

    def __init__(
        self, client_id: str, cursor: int, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    ) -> None:
        super().__init__(max_frame_bytes=max_frame_bytes)
        self.client_id = client_id
        self._send(Hello(protocol=PROTOCOL_VERSION, client_id=client_id, cursor=cursor))

    def receive_data(self, data: bytes) -> None:
        frame = self._decode(data)
        if frame is None:
            return
        match frame:
            case Welcome() if self.state is State.AWAITING_HELLO:
                self.welcome = frame
                self.state = State.OPEN
                self._events.append(frame)
            case PushAck() | Changes() if self.state is State.OPEN:
                self._events.append(frame)
            case Error():
                self._events.append(frame)
            case _:
                self.fail(
                    MalformedFrame(f"unexpected {type(frame).__name__} while {self.state.value}")
                )

    def send_push(self, changes: list[Change]) -> None:
        self._require_open()
        self._send(Push(changes=changes))

    def send_pull(self, cursor: int, limit: int = 500) -> None:
        self._require_open()
        self._send(Pull(cursor=cursor, limit=limit))

    def _require_open(self) -> None:
        if self.state is not State.OPEN:
            raise InvalidState(f"connection is {self.state.value}")
