"""Hash chains over event and audit rows, proofs and redaction. No event loop."""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.hashchain import (
    _CANONICAL,
    GENESIS,
    _content,
    _content_pairs,
    _heads,
    audit_core_digest,
    audit_digest,
    audit_digests,
    audit_identity_digest,
    chain_audit,
    chain_event,
    event_digest,
    generate_proof,
    link,
    verify_chain,
    verify_proof,
)
from shared.ids import uuid7
from shared.records import AuditRow, Event, Outcome, Usage
from tests.factories import make_audit, make_event

N = 6


def tampered(value: Any) -> Any:
    """A different value of the same type."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1 if value < 2**64 - 1 else value - 1  # (within msgpack's integers)
    if isinstance(value, float):
        return value + 1.5
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, dict):
        return {**value, "tampered": True}
    if isinstance(value, Usage):
        return msgspec.structs.replace(value, output_tokens=tampered(value.output_tokens))
    if isinstance(value, Outcome):
        return msgspec.structs.replace(value, status="provider-error")
    if value is None:
        return "set"
    raise AssertionError(f"no tampering for {value!r}")


def event_chain(n: int = N) -> list[Event]:
    session_id = uuid7()
    rows: list[Event] = []
    prev = GENESIS
    for i in range(n):
        row = chain_event(
            make_event(session_id=session_id, payload={"i": i, "text": f"m{i}"}), prev, i + 1
        )
        rows.append(row)
        prev = row.row_hash
    return rows


def audit_chain(n: int = N) -> list[AuditRow]:
    rows: list[AuditRow] = []
    prev = GENESIS
    for i in range(n):
        row = chain_audit(
            make_audit(
                seq_within_turn=i,
                subject_key=f"subject-{i}",
                detail={"prompt_chars": 100 + i},
                cost_usd=0.01 * i,
            ),
            prev,
            i + 1,
        )
        rows.append(row)
        prev = row.row_hash
    return rows


# Fields an attacker might alter; ``canonical`` is the chain's own flag, outside the hash.
EVENT_FIELDS = [f for f in Event.__struct_fields__ if f != "canonical"]
AUDIT_FIELDS = [f for f in AuditRow.__struct_fields__ if f != "redacted"]


# -- event chains ------------------------------------------------------------------------


def test_chained_events_link_and_verify() -> None:
    rows = event_chain()
    assert rows[0].prev_hash == GENESIS
    for i, row in enumerate(rows):
        assert row.sequence_number == i + 1
        assert row.row_hash == link(row.prev_hash, event_digest(row))
        if i:
            assert row.prev_hash == rows[i - 1].row_hash
    result = verify_chain(rows)
    assert result.ok
    assert result.checked == N
    assert result.first_bad_index is None
    assert result.head_hash == rows[-1].row_hash


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300)
@given(
    texts=st.lists(st.text(), min_size=8, max_size=8),
    payload=st.dictionaries(st.text(), _JSON, max_size=6),
    number=st.integers(0, 2**64 - 1),
    chain=st.tuples(st.text(), st.text(), st.booleans()),
)
def test_an_event_digest_is_the_sha256_of_its_content_as_a_sorted_map(
    texts: list[str], payload: dict[str, Any], number: int, chain: tuple[str, str, bool]
) -> None:
    """``event_digest`` encodes an event's content as keys and values in turn (no dict made):
    over generated events (any text in any field, any JSON payload, keys of any script, any
    sequence number, any chain fields), its bytes are those of the dict of every field but
    the chain's, encoded with its keys sorted, as the digest was always defined."""
    import hashlib

    names = ["id", "session_id", "org_id", "user_id", "client_id", "hlc", "type"]
    event = Event(
        **dict(zip(names, texts, strict=False)),
        payload=payload,
        sequence_number=number,
        prev_hash=chain[0],
        row_hash=chain[1],
        canonical=chain[2],
    )
    content = msgspec.structs.asdict(event)
    for name in ("prev_hash", "row_hash", "canonical"):
        del content[name]
    defined = msgspec.msgpack.Encoder(order="deterministic").encode(content)
    assert event_digest(event) == hashlib.sha256(defined).hexdigest()
    # The chain's fields are outside it; any other field is in it.
    other = msgspec.structs.replace(event, prev_hash=chain[0] + "x", canonical=not chain[2])
    assert event_digest(other) == event_digest(event)
    moved = msgspec.structs.replace(event, type=event.type + "x")
    assert event_digest(moved) != event_digest(event)


def test_empty_chain_verifies_to_genesis() -> None:
    result = verify_chain([])
    assert result.ok
    assert result.head_hash == GENESIS


def test_chain_continues_from_a_custom_genesis() -> None:
    rows = event_chain()
    assert verify_chain(rows[2:], genesis=rows[1].row_hash).ok
    bad = verify_chain(rows[2:])
    assert not bad.ok
    assert bad.first_bad_index == 0


@pytest.mark.parametrize("field", EVENT_FIELDS)
def test_altering_any_event_field_is_caught_at_its_index(field: str) -> None:
    rows = event_chain()
    for k in range(N):
        altered = list(rows)
        altered[k] = msgspec.structs.replace(rows[k], **{field: tampered(getattr(rows[k], field))})
        result = verify_chain(altered)
        assert not result.ok, (field, k)
        assert result.first_bad_index == k, (field, k)
        assert result.checked == k


def test_canonical_flag_is_outside_the_hash() -> None:
    rows = event_chain()
    placed = [msgspec.structs.replace(r, canonical=True) for r in rows]
    assert verify_chain(placed).ok


@settings(max_examples=100)
@given(st.data())
def test_swapping_two_rows_is_caught_at_the_first(data: st.DataObject) -> None:
    rows = event_chain()
    i = data.draw(st.integers(min_value=0, max_value=N - 2))
    j = data.draw(st.integers(min_value=i + 1, max_value=N - 1))
    swapped = list(rows)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    result = verify_chain(swapped)
    assert not result.ok
    assert result.first_bad_index == i


@pytest.mark.parametrize("k", range(N - 1))
def test_deleting_a_row_is_caught_where_it_was(k: int) -> None:
    rows = event_chain()
    result = verify_chain(rows[:k] + rows[k + 1 :])
    assert not result.ok
    assert result.first_bad_index == k
    assert result.reason == "prev_hash mismatch"


def test_deleting_the_last_row_changes_the_head() -> None:
    # Truncation leaves a valid shorter chain: only the head hash gives it away.
    rows = event_chain()
    result = verify_chain(rows[:-1])
    assert result.ok
    assert result.head_hash != verify_chain(rows).head_hash


def test_event_proof_for_every_row() -> None:
    rows = event_chain()
    for k, row in enumerate(rows):
        proof = generate_proof(rows, row.id)
        assert proof.index == k
        assert proof.head_hash == rows[-1].row_hash
        assert len(proof.following_digests) == N - 1 - k
        assert verify_proof(proof)
        assert verify_proof(proof, row)
        # Survives the wire.
        wire = msgspec.msgpack.decode(msgspec.msgpack.encode(proof), type=type(proof))
        assert verify_proof(wire, row)


@pytest.mark.parametrize("field", [f for f in EVENT_FIELDS if f not in ("row_hash", "prev_hash")])
def test_event_proof_fails_for_an_altered_row(field: str) -> None:
    rows = event_chain()
    for row in rows:
        proof = generate_proof(rows, row.id)
        altered = msgspec.structs.replace(row, **{field: tampered(getattr(row, field))})
        assert not verify_proof(proof, altered), field


def test_event_proof_fails_for_a_wrong_head_or_path() -> None:
    rows = event_chain()
    for k, row in enumerate(rows):
        proof = generate_proof(rows, row.id)
        assert not verify_proof(msgspec.structs.replace(proof, head_hash="0" * 64), row)
        assert not verify_proof(msgspec.structs.replace(proof, prev_hash="0" * 64), row)
        if k < N - 1:
            path = list(proof.following_digests)
            path[0] = "0" * 64
            assert not verify_proof(msgspec.structs.replace(proof, following_digests=path), row)
    # A proof of row 0 does not vouch for row 1.
    assert not verify_proof(generate_proof(rows, rows[0].id), rows[1])


def test_proof_for_an_unknown_id_raises() -> None:
    with pytest.raises(KeyError):
        generate_proof(event_chain(), uuid7())


# -- audit chains ------------------------------------------------------------------------


def test_chained_audit_rows_verify() -> None:
    rows = audit_chain()
    for i, row in enumerate(rows):
        assert row.payload_digest == audit_digest(row)
        assert row.row_hash == link(row.prev_hash, row.payload_digest)
        assert row.sequence_number == i + 1
    result = verify_chain(rows)
    assert result.ok
    assert result.head_hash == rows[-1].row_hash


def redact(row: AuditRow) -> AuditRow:
    return msgspec.structs.replace(row, subject_key=None, request_id=None, detail={}, redacted=True)


@pytest.mark.parametrize("k", range(N))
def test_redaction_still_verifies(k: int) -> None:
    rows = audit_chain()
    redacted = list(rows)
    redacted[k] = redact(rows[k])
    assert redacted[k].subject_key is None
    assert redacted[k].request_id is None
    assert redacted[k].detail == {}
    result = verify_chain(redacted)
    assert result.ok
    assert result.head_hash == rows[-1].row_hash
    # Proofs keep working for the redacted row and its neighbours.
    for row in redacted:
        assert verify_proof(generate_proof(redacted, row.id), row)


def test_redacting_every_row_still_verifies() -> None:
    assert verify_chain([redact(r) for r in audit_chain()]).ok


@pytest.mark.parametrize("k", range(N))
def test_altered_usage_without_redaction_fails(k: int) -> None:
    rows = audit_chain()
    altered = list(rows)
    altered[k] = msgspec.structs.replace(
        rows[k], usage=msgspec.structs.replace(rows[k].usage, input_tokens=999_999)
    )
    result = verify_chain(altered)
    assert not result.ok
    assert result.first_bad_index == k
    assert result.reason == "payload altered"


@pytest.mark.parametrize("field", AUDIT_FIELDS)
def test_altering_any_audit_field_is_caught_at_its_index(field: str) -> None:
    rows = audit_chain()
    for k in range(N):
        altered = list(rows)
        altered[k] = msgspec.structs.replace(rows[k], **{field: tampered(getattr(rows[k], field))})
        result = verify_chain(altered)
        assert not result.ok, (field, k)
        assert result.first_bad_index == k, (field, k)


@pytest.mark.parametrize("k", range(N))
def test_altered_usage_on_a_redacted_row_fails(k: int) -> None:
    """Redaction clears identifying fields only: the tokens and cost stay tamper-evident."""
    rows = [redact(r) for r in audit_chain()]
    altered = list(rows)
    altered[k] = msgspec.structs.replace(
        rows[k], usage=msgspec.structs.replace(rows[k].usage, output_tokens=1), cost_usd=0.0
    )
    result = verify_chain(altered)
    assert not result.ok and result.first_bad_index == k
    assert not verify_proof(generate_proof(rows, rows[k].id), altered[k])


def test_redacted_row_with_an_altered_digest_fails() -> None:
    rows = audit_chain()
    altered = list(rows)
    altered[2] = msgspec.structs.replace(redact(rows[2]), payload_digest="0" * 64)
    result = verify_chain(altered)
    assert not result.ok
    assert result.first_bad_index == 2


def test_audit_proof_for_every_row() -> None:
    rows = audit_chain()
    for row in rows:
        proof = generate_proof(rows, row.id)
        assert proof.digest == row.payload_digest
        assert verify_proof(proof, row)
        assert not verify_proof(msgspec.structs.replace(proof, head_hash="0" * 64), row)


def test_audit_proof_fails_for_an_altered_row() -> None:
    # The stored digest vouches for the row only when the row still matches it.
    rows = audit_chain()
    for row in rows:
        proof = generate_proof(rows, row.id)
        altered = msgspec.structs.replace(
            row, usage=msgspec.structs.replace(row.usage, output_tokens=123_456)
        )
        assert not verify_proof(proof, altered)
        assert not verify_proof(proof, msgspec.structs.replace(row, cost_usd=99.0))


@settings(max_examples=50)
@given(
    detail=st.dictionaries(st.text(max_size=8), st.text(max_size=20), max_size=3),
    subject=st.none() | st.text(max_size=12),
    request_id=st.none() | st.text(max_size=12),
)
def test_audit_digests_are_what_a_chained_row_holds(
    detail: dict[str, Any], subject: str | None, request_id: str | None
) -> None:
    """``audit_digests``: the two digests ``chain_audit`` gives a row, from its content."""
    made = make_audit(detail=detail, subject_key=subject, request_id=request_id)
    row = chain_audit(made, "", 1)
    assert audit_digests(row) == (row.payload_digest, row.identity_digest)
    assert audit_digests(msgspec.structs.replace(row, payload_digest="", identity_digest="")) == (
        row.payload_digest,
        row.identity_digest,
    )
    assert audit_digests(msgspec.structs.replace(row, model="other"))[0] != row.payload_digest


# -- the digests as they were defined: dicts, sorted by the encoder ----------------------
# The digests are persisted in hash chains, so these are their definition: each test below
# holds ``shared.hashchain`` (no dict made, nothing sorted) to these bytes.

_DETERMINISTIC = msgspec.msgpack.Encoder(order="deterministic")
_AUDIT_CHAIN = ("prev_hash", "row_hash", "payload_digest", "redacted", "identity_digest")
_IDENTIFYING = ("subject_key", "request_id", "detail")


def _defined_sha(value: object) -> str:
    return hashlib.sha256(_DETERMINISTIC.encode(value)).hexdigest()


def defined_identity_digest(row: AuditRow) -> str:
    return _defined_sha({f: getattr(row, f) for f in _IDENTIFYING})


def defined_core_digest(row: AuditRow) -> str:
    body = msgspec.structs.asdict(row)
    for field in _AUDIT_CHAIN + _IDENTIFYING:
        del body[field]
    return _defined_sha(body)


def defined_payload_digest(row: AuditRow, identity: str) -> str:
    return hashlib.sha256((defined_core_digest(row) + identity).encode()).hexdigest()


def defined_audit_digest(row: AuditRow) -> str:
    identity = row.identity_digest if row.redacted else defined_identity_digest(row)
    return defined_payload_digest(row, identity)


_TEXT = st.text() | st.text(min_size=200, max_size=2000)  # any script, some long
_MAYBE_TEXT = st.none() | _TEXT
_INT = st.integers(-(2**63), 2**64 - 1)
_FLOAT = st.floats()  # nan and infinities too
_OUTCOME = st.builds(
    Outcome,
    status=st.sampled_from(["ok", "user-aborted", "provider-error", "tool-error"]),
    code=_MAYBE_TEXT,
    message=_MAYBE_TEXT,
)
_USAGE = st.just(Usage()) | st.builds(
    Usage,
    input_tokens=_INT,
    output_tokens=_INT,
    cache_creation_input_tokens=_INT,
    cache_read_input_tokens=_INT,
    output_estimated=st.booleans(),
)
_AUDIT_ROW = st.builds(
    AuditRow,
    id=_TEXT,
    org_id=_TEXT,
    user_id=_TEXT,
    client_id=_TEXT,
    hlc=_TEXT,
    session_id=_TEXT,
    turn_id=_TEXT,
    stage_id=_TEXT,
    seq_within_turn=_INT,
    provider=_TEXT,
    model=_TEXT,
    outcome=_OUTCOME,
    usage=_USAGE,
    parent_turn_id=_MAYBE_TEXT,
    subagent_depth=_INT,
    request_id=_MAYBE_TEXT,
    latency_ms=_FLOAT,
    cost_usd=st.none() | _FLOAT,
    subject_key=_MAYBE_TEXT,
    detail=st.dictionaries(_TEXT, _JSON, max_size=6),
    sequence_number=_INT,
    payload_digest=_TEXT,
    prev_hash=_TEXT,
    row_hash=_TEXT,
    redacted=st.booleans(),
    identity_digest=_TEXT,
)


@settings(max_examples=400)
@given(row=_AUDIT_ROW)
def test_audit_digests_are_the_sha256_of_their_fields_as_sorted_maps(row: AuditRow) -> None:
    """The audit digests encode a row's fields as keys and values in turn (no dict made):
    over generated rows (any text or None in any field, nested ``Outcome`` and ``Usage`` of
    any value, any JSON detail, nan and infinite floats, redacted or not, any chain fields),
    each is the sha256 of the dict of its fields encoded with the keys sorted, as defined."""
    identity = defined_identity_digest(row)
    assert audit_identity_digest(row) == identity
    assert audit_core_digest(row) == defined_core_digest(row)
    assert audit_digest(row) == defined_audit_digest(row)
    assert audit_digests(row) == (defined_payload_digest(row, identity), identity)


@settings(max_examples=100)
@given(row=_AUDIT_ROW, redacted=st.booleans())
def test_a_chained_or_redacted_row_digests_as_defined(row: AuditRow, redacted: bool) -> None:
    """A row as ``chain_audit`` places it, then redacted or not, digests as defined; its
    chain's fields are outside both digests, and the core's fields inside the core's."""
    chained = chain_audit(row, "", 1)
    placed = redact(chained) if redacted else chained
    assert placed.payload_digest == defined_audit_digest(placed) == audit_digest(placed)
    assert audit_identity_digest(placed) == defined_identity_digest(placed)
    assert audit_core_digest(placed) == defined_core_digest(placed)
    moved = msgspec.structs.replace(
        placed, prev_hash="x", row_hash="y", payload_digest="z", sequence_number=2
    )
    assert audit_identity_digest(moved) == audit_identity_digest(placed)
    assert audit_core_digest(moved) != audit_core_digest(placed)  # sequence_number is core
    assert audit_core_digest(
        msgspec.structs.replace(placed, usage=tampered(placed.usage))
    ) != audit_core_digest(placed)


@pytest.mark.parametrize("count", [1, 3, 7, 8, 9, 15, 16, 17, 18, 40])
def test_a_map_head_is_right_for_any_field_count(count: int) -> None:
    """``_heads`` computes the map's head (a fixmap up to 15 keys, then a map 16) and the
    array's (a fixarray up to 15 items, then an array 16) from the count: at each side of
    both bounds, the spliced bytes are those of the sorted map."""
    kind = msgspec.defstruct(
        f"Fields{count}", [(f"f{i}", Any) for i in reversed(range(count))], kw_only=True
    )
    row = kind(**{f"f{i}": [i, "v" * i, {"k": None}] for i in range(count)})
    fields = _content(kind, ())
    head, skip = _heads(fields)
    pairs = _CANONICAL.encode(_content_pairs(kind, fields)(row))
    assert head + pairs[skip:] == _DETERMINISTIC.encode(msgspec.structs.asdict(row))
    assert len(head) == (1 if count <= 15 else 3)
