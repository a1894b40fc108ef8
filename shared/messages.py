"""Wire frames of the sync protocol: one tagged union, msgpack on the wire.

Every frame is a ``msgspec.Struct`` tagged by ``type``. Decode with one typed decoder built
once (``FrameCodec``) and dispatch with ``match``. New fields get defaults and go last.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from .merge import ConflictedPath
from .records import Change, FeedChange

PROTOCOL_VERSION = 1
DEFAULT_MAX_FRAME_BYTES = 4 * 1024 * 1024

Status = Literal["applied", "duplicate", "superseded", "resolved", "rejected"]
Side = Literal["local", "remote"]


class ConflictReceipt(msgspec.Struct, kw_only=True):
    """What a push that raced another device's edit produced.

    ``winner`` is from the pusher's point of view: ``local`` is the pushed version, ``remote``
    the server's. The losing version lives on as ``fork_session_id``.
    """

    conflict_id: str
    session_id: str
    winner: Side
    fork_session_id: str
    conflicted_paths: list[ConflictedPath] = []
    detected_at: str = ""


class Hello(msgspec.Struct, kw_only=True, tag="hello"):
    protocol: int
    client_id: str
    cursor: int = 0


class Welcome(msgspec.Struct, kw_only=True, tag="welcome"):
    server_id: str
    head_cursor: int
    last_seq: int
    server_hlc: str = ""


class Push(msgspec.Struct, kw_only=True, tag="push"):
    changes: list[Change]


class ChangeResult(msgspec.Struct, kw_only=True):
    client_seq: int
    status: Status
    code: int | None = None
    message: str | None = None
    conflict: ConflictReceipt | None = None
    cursor: int | None = None


class PushAck(msgspec.Struct, kw_only=True, tag="push_ack"):
    results: list[ChangeResult]
    last_seq: int
    head_cursor: int = 0


class Pull(msgspec.Struct, kw_only=True, tag="pull"):
    cursor: int
    limit: int = 500


class Changes(msgspec.Struct, kw_only=True, tag="changes"):
    """A page of the feed. ``live`` pages arrive unsolicited after commits."""

    from_cursor: int
    to_cursor: int
    changes: list[FeedChange]
    more: bool = False
    live: bool = False


class Error(msgspec.Struct, kw_only=True, tag="error"):
    code: int
    message: str
    retryable: bool = False


Frame = Hello | Welcome | Push | PushAck | Pull | Changes | Error
ClientFrame = Hello | Push | Pull
ServerFrame = Welcome | PushAck | Changes | Error


class FrameCodec:
    """Encoder and typed decoder for ``Frame``; build one per connection and reuse it."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[Frame] = msgspec.msgpack.Decoder(Frame)

    def encode(self, frame: Frame) -> bytes:
        return self._encoder.encode(frame)

    def decode(self, data: bytes) -> Frame:
        """Raises ``msgspec.DecodeError`` (malformed) or ``msgspec.ValidationError`` (mistyped)."""
        return self._decoder.decode(data)
