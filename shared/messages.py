"""Wire frames of the sync protocol: one tagged union, msgpack on the wire.

Every frame is a ``msgspec.Struct`` tagged by ``type``. Decode with one typed decoder built
once (``FrameCodec``) and dispatch with ``match``. New fields get defaults and go last; never
reorder fields. Decoders ignore fields they do not know, so a field added to a known frame
never breaks an older peer.

Protocol versions (``Hello`` offers a range, ``Welcome.protocol`` names the one chosen: the
highest both sides speak):

- **1**: ``Hello{protocol}`` names one version. Answers carry no request id: a device matches
  them to its requests by order (the server answers one frame at a time, in order).
- **2**: ``Hello`` may offer ``min_protocol..max_protocol``. Request frames (``Hello``,
  ``Push``, ``Pull``) carry a ``request_id`` that the answer (``Welcome``, ``PushAck``, a
  non-live ``Changes``, or an ``Error`` answering the request) echoes; an ``Error`` with
  ``request_id`` 0 answers nothing. ``Welcome`` names the version and the token's tenant
  (``org_id``, ``user_id``). A frame whose tag the receiver does not know is skipped when its
  map carries ``optional: true`` (``optional`` is a reserved key in every frame map); without
  it, it is a malformed frame (3004). Send an optional frame only to a peer at version 2 or
  later: version 1 peers refuse unknown tags.

- **3**: the server checks that each pushed audit row continues its device's chain where the
  server holds it (the next ``sequence_number`` after the chain's last row, whose ``row_hash``
  is the row's ``prev_hash``). A row that does not is refused with 3013 (``ChainBroken``), and
  so is everything after it in the batch (``last_seq`` stays before it, as for 3011); its
  ``ChangeResult`` names the chain's last place (``chain_sequence``, ``chain_hash``: 0 and ""
  for a chain the server holds nothing of). A device at version 2 or earlier is not checked.

- **4**: a ``Push`` may name ``skipped`` client_seq numbers (at most ``MAX_SKIPPED``): numbers
  whose record is sent at a later number, in the same push or a later one (a session queued
  once per turn refers to its one stored row, so a flush would send that row once per queued
  number, and before the messages queued after it). The server answers
  each ``superseded`` (``duplicate`` at or below ``last_seq``), in sequence with the changes,
  and they change nothing. A device sends ``skipped`` only to a server at version 4 or later:
  an older one would see a gap.

- **5**: a ``PushAck`` may name ``as_pushed_from``: the tenant's feed head just before the
  push's rows, when those rows are exactly its applied changes as the device pushed them
  (events at the places and with the hashes the device gave them; nothing else written among
  them). A device whose cursor is at ``as_pushed_from`` takes its cursor to the last of them
  and marks its events canonical, without pulling its own changes back. The server does not
  send a version 5 device the live page of its own push: the device either takes it from the
  acknowledgement or pulls it.

- **6**: records may travel as their stored bytes: a ``Push`` may carry ``bodies`` (each
  ``[client_seq, record]``) instead of ``changes``, and a ``Changes`` page ``bodies`` (each
  ``[cursor, record]``), where each record is one msgpack value in the compact form of
  ``shared.compact`` (the map form of ``encode_record`` is read too). A frame carries its
  records in one of the two fields, never both. The server keeps a record stored as pushed
  in the bytes it came in, and serves a page from the bytes it stored; a device stores a
  record it takes as is in the bytes it came in, and sends its outbox from the bytes it
  stored. No record is encoded again on the way (each is still decoded once on each side, to
  be checked), and the compact form is about half the bytes of the map form. A record that
  does not decode is refused as a mistyped frame (3004), and so is a frame that carries both
  fields. A server sends ``bodies`` only to a device at version 6 or later; a device sends
  them only to such a server.

- **7**: a session body in a frame's ``bodies`` may carry its message ids as a reference to the
  list this connection carried last for that session, followed by the new ids (ext 5 in
  place of ext 4; ``shared.idrefs``). Each direction of a connection keeps the lists it
  carried, by one rule on both sides; the receiver makes each body whole before reading it,
  so a store keeps, and a page forwards, the body as it would have come whole. Live pages
  keep lists of their own, apart from pushes and answers (a server may send live pages
  behind answers sent after them). A turn of a
  2,000-message session then sends its session row in about 150 bytes instead of 32 KB. A
  reference the receiver cannot resolve is a fatal 3004: the connection ends, and the lists
  start empty on the next one.

- **8**: a record in a frame's ``bodies`` may leave out what it would say twice. A
  ``client_id`` equal to the node of the record's own ``hlc`` stamp is written as nil, and
  read back as that node (``shared.compact.implied_client``): every record a device stamps
  itself is such a record (about 17 bytes a record, the device's id as a UUID; more for a
  longer id). An audit row's ``usage`` and ``outcome`` are arrays of their fields in order,
  trailing defaults left out, as a record's own (about 110 bytes a row: no field names). An
  event's ``type`` and its payload's keys that are in ``shared.compact.WORDS`` go as their
  indexes there (about 35 bytes an event), and an event writes every field, its
  ``canonical`` flag too, so that marking it canonical changes one byte in place. The stores
  keep the bodies as they came, so the saving is on disk too. A body sent to a peer before
  version 8 is written in the form before (``shared.compact.explicit``: the bytes the codec
  wrote before, every other value's as it is), on each side's way out, so such a peer never
  reads any of these.

- **9**: a record in a frame's ``bodies`` may hold a text of ``shared.compact.DEFLATE_MIN``
  (128) characters or more inside a list or a map (never a record's own field) deflated:
  ext 6, its UTF-8 as raw deflate (``zlib``, level 6), where that saves at least an eighth
  of its bytes and the text is at most ``shared.compact.INFLATE_RATIO`` (16) times the
  ext's bytes. A message of real prose is then
  about half its bytes (800 bytes of text in about 400), on the wire and in every store,
  which keep bodies as they came. A reader refuses an ext 6 that is not one whole deflate
  stream, that inflates past the ratio (inflating stops there), or whose text is not UTF-8,
  as any malformed record (3004), and a server refuses so a pushed record over
  ``MAX_RECORD_BYTES`` with its texts written out. A body sent to a peer before version 9
  has its texts written out (``shared.compact.inflated``), on each side's way out.

A version 1 peer reads version 2 frames unchanged (it ignores the new fields), which is why the
server fills them whatever version it agreed.
"""

from __future__ import annotations

import typing
from typing import Annotated, Final, Literal

import msgspec

from . import compact
from .merge import ConflictedPath
from .records import Change, FeedChange

MIN_PROTOCOL = 1
"""The oldest protocol version this code speaks."""
MAX_PROTOCOL = 9
"""The newest protocol version this code speaks."""
PROTOCOL_VERSION = MAX_PROTOCOL
"""The newest version (a ``Hello`` naming only it negotiates exactly it)."""
CHAINS_CHECKED_SINCE = 3
"""The version from which the server checks that pushed audit rows continue their chains."""
SKIPPED_SINCE = 4
"""The version from which a ``Push`` may name ``skipped`` numbers (no record of their own)."""
AS_PUSHED_SINCE = 5
"""The version from which a ``PushAck`` may name ``as_pushed_from`` and the server keeps a
push's live page from the device that pushed it."""
COMPACT_SINCE = 6
"""The version from which records may travel as their stored bytes (``bodies``)."""
IMPLIED_SINCE = 8
"""The version from which a body may leave its device implied by its stamp (nil
``client_id``), hold an audit row's usage and outcome as arrays and an event's words as
indexes (``shared.compact.explicit`` writes the form before for a peer before it)."""
DEFLATED_SINCE = 9
"""The version from which a body may hold a long text deflated (ext 5; ``shared.compact``
``inflated`` writes the texts out for a peer before it)."""
MAX_SKIPPED = 10_000
"""The most ``skipped`` numbers one ``Push`` may name."""
DEFAULT_MAX_FRAME_BYTES = 4 * 1024 * 1024
MAX_RECORD_BYTES = DEFAULT_MAX_FRAME_BYTES // 2
"""The largest record a device writes (encoded): a push of it alone stays well under the frame
limit, so no record can wedge a device's outbox."""
MAX_PREVIOUS_IDS = 16
"""How many earlier client ids a ``Hello`` may name."""

Status = Literal["applied", "duplicate", "superseded", "resolved", "rejected"]
Side = Literal["local", "remote"]


class ConflictReceipt(msgspec.Struct, kw_only=True):
    """What a push that raced another device's edit produced.

    ``winner`` is from the pusher's point of view: ``local`` is the pushed version, ``remote``
    the server's. The losing version lives on as ``fork_session_id``. ``pushed_by`` and
    ``stored_by`` name the devices that wrote each, so any device can tell which was its own.
    """

    conflict_id: str
    session_id: str
    winner: Side
    fork_session_id: str
    conflicted_paths: list[ConflictedPath] = []
    detected_at: str = ""
    pushed_by: str = ""
    """The client id that wrote the pushed version (empty from an older server)."""
    stored_by: str = ""
    """The client id that wrote the version the server held."""


class KeptReceipt(msgspec.Struct, kw_only=True):
    """A version of a session that lost to a concurrent delete and was kept as a new session
    (the payload of the ``sync.delete.kept`` event the server writes in the deleted session's
    log): the version may hold what a conflict resolution moved out of its fork.

    ``session_id`` is the deleted session, ``fork_session_id`` the kept version's new id;
    ``version_by`` and ``deleted_by`` name the devices that wrote the version and the delete.
    """

    session_id: str
    fork_session_id: str
    version_by: str = ""
    deleted_by: str = ""
    detected_at: str = ""


class Hello(msgspec.Struct, kw_only=True, tag="hello"):
    """The first frame of a connection: who the device is and which versions it speaks.

    ``protocol`` is the version a server that predates ranges reads (a version 1 server
    accepts only ``protocol == 1``): set it to the lowest version you speak.
    ``min_protocol`` and ``max_protocol`` (0: same as ``protocol``) bound the range offered.
    ``previous_client_ids`` are ids this device wrote under before it took ``client_id`` (its
    file was restored or copied): its queued records may still carry one (at most 16).
    """

    protocol: int
    client_id: str
    cursor: int = 0
    min_protocol: int = 0
    max_protocol: int = 0
    request_id: int = 0
    previous_client_ids: Annotated[list[str], msgspec.Meta(max_length=MAX_PREVIOUS_IDS)] = []

    def protocol_range(self) -> tuple[int, int]:
        """The versions offered, ``(lowest, highest)``; empty when lowest > highest."""
        return (self.min_protocol or self.protocol, self.max_protocol or self.protocol)


class Welcome(msgspec.Struct, kw_only=True, tag="welcome"):
    """The answer to ``Hello``. ``protocol`` defaults to 1: a version 1 server omits it.

    ``org_id`` and ``user_id`` are the tenant of the token the connection authenticated with
    (empty from a server that predates them).
    """

    server_id: str
    head_cursor: int
    last_seq: int
    server_hlc: str = ""
    protocol: int = 1
    org_id: str = ""
    user_id: str = ""
    request_id: int = 0


class ChangeBody(msgspec.Struct, array_like=True, gc=False):
    """(Version 6) One outbox entry as ``[client_seq, record]``, the record as one msgpack
    value in its stored bytes (see ``shared.compact``)."""

    client_seq: int
    body: msgspec.Raw


def change_bodies(changes: list[Change], bodies: list[bytes]) -> list[ChangeBody]:
    """``Push.bodies`` of ``changes`` whose records are stored as ``bodies`` (in order)."""
    return [ChangeBody(c.client_seq, msgspec.Raw(b)) for c, b in zip(changes, bodies, strict=True)]


class FeedBody(msgspec.Struct, array_like=True, gc=False):
    """(Version 6) One feed entry as ``[cursor, record]``, the record in its stored bytes."""

    cursor: int
    body: msgspec.Raw


class Push(msgspec.Struct, kw_only=True, tag="push"):
    """``trace``: the W3C ``traceparent`` of the device's flush span (empty: none), the
    parent of the server's push span.

    At version 6 the records may come as ``bodies`` instead of ``changes``; the receiving
    protocol decodes them into ``changes`` and keeps ``bodies`` beside them, in order."""

    changes: list[Change]
    request_id: int = 0
    trace: Annotated[str, msgspec.Meta(max_length=128)] = ""
    skipped: Annotated[list[int], msgspec.Meta(max_length=MAX_SKIPPED)] = []
    """Numbers in sequence with ``changes`` that carry no record (version 4; see above)."""
    bodies: list[ChangeBody] = []
    """(Version 6) The changes as their records' bytes, instead of ``changes``."""


class ChangeResult(msgspec.Struct, kw_only=True, gc=False):
    client_seq: int
    status: Status
    code: int | None = None
    message: str | None = None
    conflict: ConflictReceipt | None = None
    cursor: int | None = None
    chain_sequence: int | None = None
    """With a 3013: the ``sequence_number`` of the last row the server holds of the refused
    audit row's chain (0: none); ``chain_hash`` is that row's ``row_hash`` ("": none)."""
    chain_hash: str | None = None


class PushAck(msgspec.Struct, kw_only=True, tag="push_ack"):
    results: list[ChangeResult]
    last_seq: int
    head_cursor: int = 0
    request_id: int = 0
    as_pushed_from: int | None = None
    """(Version 5) The tenant's feed head just before this push's rows, when the rows at the
    ``cursor`` of its ``applied`` results are the tenant's only rows after it, each the
    change as pushed (an event at the pushed place and hashes, canonical). None otherwise."""


class Pull(msgspec.Struct, kw_only=True, tag="pull"):
    cursor: int
    limit: int = 500
    request_id: int = 0


class Changes(msgspec.Struct, kw_only=True, tag="changes"):
    """A page of the feed. ``live`` pages arrive unsolicited after commits (``request_id`` 0);
    a page answering a ``Pull`` echoes its ``request_id``."""

    from_cursor: int
    to_cursor: int
    changes: list[FeedChange]
    more: bool = False
    live: bool = False
    request_id: int = 0
    bodies: list[FeedBody] = []
    """(Version 6) The page's entries as their records' bytes, instead of ``changes``; the
    receiving protocol decodes them into ``changes`` and keeps them beside, in order."""


class Error(msgspec.Struct, kw_only=True, tag="error"):
    """A refusal. ``code`` is an ``ErrorCode``; ``request_id`` names the request it answers
    (0: it answers none, e.g. a frame that could not be read, or the reason for a close)."""

    code: int
    message: str
    retryable: bool = False
    request_id: int = 0


MAX_HEALTH_TEXT = 500
"""The longest text (an error message) a ``Health`` frame carries; a device cuts longer ones."""
MAX_HEALTH_CONFLICTS = 10
"""How many recent conflicts a ``Health`` frame names."""
_Id = Annotated[str, msgspec.Meta(max_length=64)]
_Count = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]


class HealthConflict(msgspec.Struct, kw_only=True):
    """One conflict a device's push settled (``winner`` from the device's point of view)."""

    conflict_id: _Id
    session_id: _Id
    winner: Side
    fork_session_id: _Id
    detected_at: _Id = ""


class Health(msgspec.Struct, kw_only=True, tag="health"):
    """How a device's sync stands, told to the server (protocol 2; no answer).

    Sent after each connect, then when something in it changes (at most once a second) and
    at least every 30 s while connected. The server keeps the latest per device for its
    ``/status`` page. Every field is bounded: the server refuses (3004) a frame that is not.
    ``last_flush_at`` and ``sent_at`` are the device's clock (seconds since the epoch).
    """

    pending: _Count
    dead_letters: _Count
    cursor: _Count
    last_flush_at: float | None = None
    last_flush_outcome: Annotated[str, msgspec.Meta(max_length=32)] = ""
    last_flushed: _Count = 0
    last_error: Annotated[str, msgspec.Meta(max_length=MAX_HEALTH_TEXT)] | None = None
    last_error_code: int | None = None
    conflicts: Annotated[list[HealthConflict], msgspec.Meta(max_length=MAX_HEALTH_CONFLICTS)] = []
    sent_at: float = 0.0
    optional: bool = True
    request_id: int = 0
    protocol: Annotated[int, msgspec.Meta(ge=0, le=255)] = 0
    """The protocol version agreed on the connection the report came on, as the server keeps
    it (the server sets it when it keeps the report, whatever the device sent); 0 unknown."""


Frame = Hello | Welcome | Push | PushAck | Pull | Changes | Error | Health
ClientFrame = Hello | Push | Pull | Health
ServerFrame = Welcome | PushAck | Changes | Error

FRAME_TAGS: frozenset[str] = frozenset(
    str(cls.__struct_config__.tag) for cls in typing.get_args(Frame)
)
"""The tags of every frame this code knows."""


def unpacked(frame: Push | Changes) -> Push | Changes:
    """``frame`` with its ``bodies`` (version 6) decoded into ``changes``, kept beside them.
    Raises ``msgspec.ValidationError`` when the frame carries both, ``msgspec.DecodeError``
    (or ``ValidationError``) when a record does not decode."""
    if not frame.bodies:
        return frame
    if frame.changes:
        raise msgspec.ValidationError("a frame carries changes or bodies, not both")
    decode = compact.decode
    if isinstance(frame, Push):
        changes: list[Change] | list[FeedChange] = [
            Change(client_seq=b.client_seq, record=decode(memoryview(b.body))) for b in frame.bodies
        ]
    else:
        changes = [
            FeedChange(cursor=b.cursor, record=decode(memoryview(b.body))) for b in frame.bodies
        ]
    return msgspec.structs.replace(frame, changes=changes)


class Envelope(msgspec.Struct):
    """What any frame map may be read as without knowing its tag (other keys are skipped).

    ``optional`` is reserved in every frame map: a frame type that older peers may skip
    declares ``optional: bool = True``.
    """

    type: str
    optional: bool = False
    request_id: int = 0


class FrameCodec:
    """Encoder and typed decoder for ``Frame``. Its msgspec encoder and decoders are shared
    by every codec (they keep no state between calls; one each per connection were three more
    objects a server's garbage collector walks for every idle connection)."""

    _encoder: Final = msgspec.msgpack.Encoder()
    _decoder: Final[msgspec.msgpack.Decoder[Frame]] = msgspec.msgpack.Decoder(Frame)
    _envelope: Final[msgspec.msgpack.Decoder[Envelope]] = msgspec.msgpack.Decoder(Envelope)

    def encode(self, frame: Frame) -> bytes:
        return self._encoder.encode(frame)

    def decode(self, data: bytes) -> Frame:
        """Raises ``msgspec.DecodeError`` (malformed, or nested too deep to decode) or
        ``msgspec.ValidationError`` (mistyped)."""
        try:
            return self._decoder.decode(data)
        except RecursionError as exc:
            raise msgspec.DecodeError("frame nested too deep to decode") from exc

    def peek(self, data: bytes) -> Envelope | None:
        """Read ``data`` as an ``Envelope`` (tag, ``optional``, ``request_id``), or ``None``
        when it is not a map with a string ``type`` and well-typed reserved keys."""
        try:
            return self._envelope.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            return None
