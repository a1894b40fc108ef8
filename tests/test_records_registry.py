"""The record-kind registry: every kind of the ``Record`` union is registered, consistently."""

from __future__ import annotations

import gc
from typing import get_args

import msgspec
import pytest

from shared import compact
from shared.records import (
    CASCADE_KINDS,
    RECORD_KINDS,
    ArtifactUpdate,
    AuditRow,
    Checkpoint,
    Event,
    Message,
    Outcome,
    Record,
    RecordKind,
    RecordKindInfo,
    Session,
    decode_record,
    encode_record,
    kind_info,
    kind_of,
    record_kind,
    session_of,
)


def _samples() -> list[Record]:
    base = {"org_id": "o", "user_id": "u", "client_id": "c", "hlc": "h"}
    return [
        Session(
            id="s", provider="p", model="m", created_at="h", updated_at="h", vv={"c": 1}, **base
        ),
        Message(id="m", session_id="s", role="user", content=[], **base),
        Checkpoint(id="k", session_id="s", parent_id=None, turn_id=None, **base),
        Event(id="e", session_id="s", type="t", **base),
        AuditRow(
            id="a",
            session_id="s",
            turn_id="t",
            stage_id="main",
            seq_within_turn=0,
            provider="p",
            model="m",
            outcome=Outcome(status="ok"),
            **base,
        ),
        ArtifactUpdate(id="x", artifact_id="doc", session_id="s", update=b"", **base),
    ]


def test_every_member_of_the_union_is_registered_in_union_order() -> None:
    assert [info.cls for info in RECORD_KINDS.values()] == list(get_args(Record))
    assert set(RECORD_KINDS) == set(get_args(RecordKind))


@pytest.mark.parametrize("info", list(RECORD_KINDS.values()), ids=list(RECORD_KINDS))
def test_names_are_the_class_names_and_the_wire_tags(info: RecordKindInfo) -> None:
    assert info.name == info.cls.__name__
    struct_info = msgspec.inspect.type_info(info.cls)
    assert isinstance(struct_info, msgspec.inspect.StructType)
    assert struct_info.tag_field == "record_kind" and struct_info.tag == info.name
    assert kind_info(info.name) is info


@pytest.mark.parametrize("info", list(RECORD_KINDS.values()), ids=list(RECORD_KINDS))
def test_named_fields_exist(info: RecordKindInfo) -> None:
    fields = set(info.cls.__struct_fields__)
    assert info.required_ids[0] == "id"
    assert set(info.required_ids) <= fields
    if info.session_field is not None:
        assert info.session_field in fields and info.session_field in info.required_ids


def test_the_rules_of_each_kind() -> None:
    table = {
        name: (
            info.merge,
            info.deleted_with_session,
            info.server_placed,
            info.by_reference,
            info.session_field,
        )
        for name, info in RECORD_KINDS.items()
    }
    assert table == {
        "Session": ("versioned", False, False, True, None),
        "Message": ("immutable", True, False, False, "session_id"),
        "Checkpoint": ("immutable", True, False, False, "session_id"),
        "Event": ("append-only", False, True, True, "session_id"),
        "AuditRow": ("append-only", False, False, False, "session_id"),
        "ArtifactUpdate": ("immutable", True, False, False, "session_id"),
    }
    assert CASCADE_KINDS == ("Message", "Checkpoint", "ArtifactUpdate")
    # Append-only kinds survive a session's deletion: that is what append-only means here.
    assert not any(
        i.deleted_with_session for i in RECORD_KINDS.values() if i.merge == "append-only"
    )
    assert RECORD_KINDS["ArtifactUpdate"].required_ids == ("id", "session_id", "artifact_id")


def test_helpers_on_records() -> None:
    samples = _samples()
    assert [type(r) for r in samples] == list(get_args(Record))  # one sample per kind
    for record in samples:
        info = kind_of(record)
        assert isinstance(record, info.cls)
        assert record_kind(record) == info.name
        # The name is the tag a decoder dispatches on.
        assert msgspec.msgpack.decode(encode_record(record))["record_kind"] == info.name
        assert decode_record(encode_record(record)) == record
        expected = None if isinstance(record, Session) else "s"
        assert session_of(record) == info.session_of(record) == expected


def test_unknown_kinds_and_non_records_are_refused() -> None:
    with pytest.raises(KeyError, match="Widget"):
        kind_info("Widget")
    with pytest.raises(TypeError, match="not a record"):
        kind_of("a string")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        RECORD_KINDS["Widget"] = RECORD_KINDS["Session"]  # type: ignore[index]


def test_records_are_not_tracked_by_the_collector_however_they_are_made() -> None:
    """Every kind (and what a record holds) is ``gc=False``: made, decoded from either form
    and converted, none is tracked, so a long read adds nothing to the collector's work. A kind
    added without it fails here."""
    for record in _samples():
        for made in (
            record,
            decode_record(encode_record(record)),
            compact.decode(compact.encode(record)),
            msgspec.structs.replace(record),
        ):
            assert not gc.is_tracked(made), type(made).__name__
    assert not gc.is_tracked(Outcome(status="ok"))
