"""Hash chains over event-log rows (per session) and audit rows (per tenant and device).

``row_hash = sha256(prev_hash || digest(row))``, hex encoded, with ``prev_hash = ""`` for the
first row. For events, ``digest`` is the sha256 of the row's canonical msgpack bytes (keys
sorted) over every field except the chain's own (``prev_hash``, ``row_hash``, ``canonical``).

Audit rows split their content in two: the identifying fields (``subject_key``,
``request_id``, ``detail``) and the core (everything else but the chain fields).
``payload_digest = sha256(core_digest || identity_digest)`` and the row keeps its
``identity_digest``. A GDPR soft delete clears the identifying fields and sets ``redacted``;
the chain still verifies from the stored identity digest, while the core (tokens, cost,
outcome...) stays covered: altering it is detected, redacted or not.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final, TypeVar

import msgspec

from .records import AuditRow, Event

GENESIS = ""

_CANONICAL = msgspec.msgpack.Encoder(order="deterministic")
_EVENT_CHAIN_FIELDS = frozenset({"prev_hash", "row_hash", "canonical"})
_AUDIT_CHAIN_FIELDS = frozenset(
    {"prev_hash", "row_hash", "payload_digest", "redacted", "identity_digest"}
)
AUDIT_IDENTIFYING_FIELDS = ("subject_key", "request_id", "detail")

Chained = Event | AuditRow


_Row = TypeVar("_Row", bound=msgspec.Struct)


def _content(kind: type[msgspec.Struct], skip: Iterable[str]) -> tuple[str, ...]:
    """The fields of ``kind`` but ``skip``, in the order a canonical map sorts its keys."""
    return tuple(sorted(set(kind.__struct_fields__).difference(skip)))


def _content_pairs(kind: type[_Row], fields: Sequence[str]) -> Callable[[_Row], tuple[object, ...]]:
    """A function giving a ``kind`` row's ``fields`` as their names and values in turn: a
    tuple display of them, made once, so a call builds one tuple (no dict made, none sorted).
    Values go in as they are: the encoder writes a nested Struct or dict the same in a tuple
    as in a dict (``test_hashchain`` holds every digest to the dict's bytes)."""
    items = "".join(f"{name!r}, r.{name}, " for name in fields)
    scope: dict[str, Any] = {}
    exec(f"def pairs(r):\n    return ({items})\n", scope)
    pairs: Callable[[_Row], tuple[object, ...]] = scope["pairs"]
    return pairs


def _heads(fields: Sequence[str]) -> tuple[bytes, int]:
    """The head of the map of ``fields``, and the length of the head of the array of their
    names and values: each encoded with 0 for every value, less the pairs both end with. The
    count decides both (a fixmap up to 15 keys, then a map 16; a fixarray up to 15 items,
    then an array 16), so they are computed, not written down."""
    pairs = sum(len(_CANONICAL.encode(name)) + 1 for name in fields)  # (0: one byte)
    as_map = _CANONICAL.encode(dict.fromkeys(fields, 0))
    as_array = _CANONICAL.encode([x for name in fields for x in (name, 0)])
    return as_map[:-pairs], len(as_array) - pairs


# Each digest below is the sha256 of some of a row's fields as canonical msgpack: a map, its
# keys sorted. Those bytes are the map's head, then each key and its value in key order: the
# very bytes an array of those keys and values holds after its own head. So a digest encodes
# the row's ``..._PAIRS`` (an array) and hashes the map's ``..._HEAD`` then that array's bytes
# past its own head (``..._SKIP`` bytes long): the bytes a dict of the fields encodes to, with
# no dict made and none sorted.

_EVENT_CONTENT: Final = _content(Event, _EVENT_CHAIN_FIELDS)
"""The fields an event's digest covers, in the order its canonical encoding sorts them."""
_EVENT_PAIRS: Final = _content_pairs(Event, _EVENT_CONTENT)
_EVENT_HEAD, _EVENT_SKIP = _heads(_EVENT_CONTENT)

_AUDIT_IDENTITY: Final = tuple(sorted(AUDIT_IDENTIFYING_FIELDS))
"""The fields an audit row's identity digest covers, sorted."""
_IDENTITY_PAIRS: Final = _content_pairs(AuditRow, _AUDIT_IDENTITY)
_IDENTITY_HEAD, _IDENTITY_SKIP = _heads(_AUDIT_IDENTITY)

_AUDIT_CORE: Final = _content(AuditRow, _AUDIT_CHAIN_FIELDS | set(AUDIT_IDENTIFYING_FIELDS))
"""The fields an audit row's core digest covers (neither identifying nor the chain's), sorted:
more than 15, so a map 16's head (``_heads`` computes it from the count)."""
_CORE_PAIRS: Final = _content_pairs(AuditRow, _AUDIT_CORE)
_CORE_HEAD, _CORE_SKIP = _heads(_AUDIT_CORE)


def event_digest(event: Event) -> str:
    """The sha256 of the event's content (every field but the chain's) as canonical msgpack:
    a map, its keys sorted. Encoded as its keys and values in turn (``_EVENT_PAIRS``) after
    the map's head: the bytes of ``asdict`` less the chain's fields, in a third less time."""
    pairs = _CANONICAL.encode(_EVENT_PAIRS(event))
    return hashlib.sha256(_EVENT_HEAD + pairs[_EVENT_SKIP:]).hexdigest()


def audit_identity_digest(row: AuditRow) -> str:
    """The sha256 of the row's identifying fields, as they are now, as canonical msgpack: a
    map, its keys sorted. Encoded as ``event_digest`` is (``_IDENTITY_PAIRS``): the bytes of
    a dict of them, in about a quarter less time."""
    pairs = _CANONICAL.encode(_IDENTITY_PAIRS(row))
    return hashlib.sha256(_IDENTITY_HEAD + pairs[_IDENTITY_SKIP:]).hexdigest()


def audit_core_digest(row: AuditRow) -> str:
    """The sha256 of every field that is neither identifying nor the chain's, as canonical
    msgpack: a map, its keys sorted (nested ``outcome`` and ``usage`` as the encoder writes
    them anywhere). Encoded as ``event_digest`` is (``_CORE_PAIRS``): the bytes of ``asdict``
    less the other fields, in about 40% less time."""
    pairs = _CANONICAL.encode(_CORE_PAIRS(row))
    return hashlib.sha256(_CORE_HEAD + pairs[_CORE_SKIP:]).hexdigest()


def _payload_digest(row: AuditRow, identity: str) -> str:
    return hashlib.sha256((audit_core_digest(row) + identity).encode()).hexdigest()


def audit_digest(row: AuditRow) -> str:
    """The payload digest the row's content gives (the stored identity digest if redacted)."""
    identity = row.identity_digest if row.redacted else audit_identity_digest(row)
    return _payload_digest(row, identity)


def audit_digests(row: AuditRow) -> tuple[str, str]:
    """The payload digest and the identity digest an unredacted row's content gives
    (``audit_digest`` and ``audit_identity_digest``, the identity's computed once)."""
    identity = audit_identity_digest(row)
    return _payload_digest(row, identity), identity


def audit_content_ok(row: AuditRow) -> bool:
    """The row's content (and, unless redacted, its identity digest) match its payload digest."""
    if not row.redacted and row.identity_digest != audit_identity_digest(row):
        return False
    return audit_digest(row) == row.payload_digest


def link(prev_hash: str, digest: str) -> str:
    return hashlib.sha256(prev_hash.encode() + digest.encode()).hexdigest()


def row_digest(row: Chained) -> str:
    """The digest a row's hash is computed over (the stored one for audit rows)."""
    if isinstance(row, Event):
        return event_digest(row)
    return row.payload_digest or audit_digest(row)


def chain_event(event: Event, prev_hash: str, sequence_number: int) -> Event:
    """A copy of ``event`` placed at ``sequence_number`` after ``prev_hash``."""
    placed = msgspec.structs.replace(event, sequence_number=sequence_number, prev_hash=prev_hash)
    return msgspec.structs.replace(placed, row_hash=link(prev_hash, event_digest(placed)))


def chain_audit(row: AuditRow, prev_hash: str, sequence_number: int) -> AuditRow:
    """A copy of ``row`` placed at ``sequence_number``, with its payload digest fixed."""
    placed = msgspec.structs.replace(
        row,
        sequence_number=sequence_number,
        prev_hash=prev_hash,
        identity_digest=audit_identity_digest(row),
        redacted=False,
    )
    digest = audit_digest(placed)
    return msgspec.structs.replace(placed, payload_digest=digest, row_hash=link(prev_hash, digest))


class ChainVerification(msgspec.Struct, kw_only=True):
    """Result of ``verify_chain``: ``first_bad_index`` is None when the chain verifies."""

    ok: bool
    checked: int
    first_bad_index: int | None = None
    reason: str | None = None
    head_hash: str = GENESIS


def verify_chain(rows: Sequence[Chained], genesis: str = GENESIS) -> ChainVerification:
    """Check rows in chain order; name the first index whose link or content is wrong."""
    prev = genesis
    for index, row in enumerate(rows):
        if row.prev_hash != prev:
            return ChainVerification(
                ok=False, checked=index, first_bad_index=index, reason="prev_hash mismatch"
            )
        if isinstance(row, AuditRow):
            if not audit_content_ok(row):
                return ChainVerification(
                    ok=False, checked=index, first_bad_index=index, reason="payload altered"
                )
            digest = row.payload_digest
        else:
            digest = event_digest(row)
        if link(prev, digest) != row.row_hash:
            return ChainVerification(
                ok=False, checked=index, first_bad_index=index, reason="row_hash mismatch"
            )
        prev = row.row_hash
    return ChainVerification(ok=True, checked=len(rows), head_hash=prev)


class Proof(msgspec.Struct, kw_only=True):
    """The hashes that place one row in a chain: recompute from ``prev_hash`` to ``head_hash``."""

    record_id: str
    index: int
    prev_hash: str
    digest: str
    following_digests: list[str]
    head_hash: str


def generate_proof(rows: Sequence[Chained], record_id: str) -> Proof:
    """Proof that the row ``record_id`` sits at its index of the chain ``rows``."""
    for index, row in enumerate(rows):
        if row.id == record_id:
            return Proof(
                record_id=record_id,
                index=index,
                prev_hash=row.prev_hash,
                digest=row_digest(row),
                following_digests=[row_digest(r) for r in rows[index + 1 :]],
                head_hash=rows[-1].row_hash,
            )
    raise KeyError(record_id)


def verify_proof(proof: Proof, row: Chained | None = None) -> bool:
    """True when the proof links up to its head hash (and matches ``row`` when given)."""
    if row is not None and (row.id != proof.record_id or row_digest(row) != proof.digest):
        return False
    if isinstance(row, AuditRow) and not audit_content_ok(row):
        return False  # the stored digest no longer covers the row's content
    current = link(proof.prev_hash, proof.digest)
    for digest in proof.following_digests:
        current = link(current, digest)
    return current == proof.head_hash
