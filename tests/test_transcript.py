"""The incrementally kept transcript equals a full conversion, and never mutates what it shares."""

from __future__ import annotations

import copy
import itertools

from hypothesis import given
from hypothesis import strategies as st

from pleach_client.transcript import Transcript, extend_api, to_api_messages
from shared.records import Message

BLOCKS = st.sampled_from(
    [
        {"type": "text", "text": "hello"},
        {"type": "text", "text": ""},
        {"type": "thinking", "thinking": "hm", "signature": "sig"},
        {"type": "thinking", "thinking": "cut off"},
        {"type": "tool_use", "id": "t1", "name": "calc", "input": {}},
        {"type": "tool_result", "tool_use_id": "t1", "content": "2"},
    ]
)


def _message(i: int, role: str, blocks: list[dict[str, object]]) -> Message:
    return Message(
        id=f"m{i}",
        session_id="s",
        org_id="o",
        user_id="u",
        client_id="c",
        hlc=f"{i}",
        role=role,  # type: ignore[arg-type]
        content=[dict(b) for b in blocks],
    )


MESSAGES = st.lists(
    st.tuples(st.sampled_from(["user", "assistant"]), st.lists(BLOCKS, max_size=3)), max_size=12
).map(lambda specs: [_message(i, role, blocks) for i, (role, blocks) in enumerate(specs)])


@given(MESSAGES, st.data())
def test_extended_equals_full_conversion(messages: list[Message], data: st.DataObject) -> None:
    cut = data.draw(st.integers(0, len(messages)))
    base = Transcript.of([m.id for m in messages[:cut]], messages[:cut])
    before = copy.deepcopy(base.api)
    extended = base.extended(messages[cut:])
    assert extended.api == to_api_messages(messages)
    assert extended.ids == [m.id for m in messages]
    assert base.api == before, "extending must not mutate the base transcript"


@given(MESSAGES)
def test_extend_api_never_mutates_shared_dicts(messages: list[Message]) -> None:
    out = to_api_messages(messages)
    frozen = copy.deepcopy(out)
    shared = list(out)
    extend_api(
        shared, [_message(99, out[-1]["role"] if out else "user", [{"type": "text", "text": "x"}])]
    )
    assert out == frozen
    assert all(m["role"] != n["role"] for m, n in itertools.pairwise(shared))


def test_consecutive_same_role_merge_puts_tool_results_first() -> None:
    a = _message(0, "user", [{"type": "text", "text": "why"}])
    b = _message(1, "user", [{"type": "tool_result", "tool_use_id": "t", "content": "x"}])
    (merged,) = to_api_messages([a, b])
    assert [block["type"] for block in merged["content"]] == ["tool_result", "text"]


FILE = {"type": "file_reference", "artifact_id": "a1", "name": "x.png"}


@given(
    st.lists(st.tuples(st.sampled_from(["user", "assistant"]), st.booleans()), max_size=12),
    st.integers(0, 12),
)
def test_has_files_is_kept_incrementally(parts: list[tuple[str, bool]], split: int) -> None:
    """Whether a request needs its files expanded is known without scanning the transcript:
    built at once or extended turn by turn, the flag says whether any message has a file."""
    messages = [
        _message(i, role, [{"type": "text", "text": "hi"}, *([FILE] if has else [])])
        for i, (role, has) in enumerate(parts)
    ]
    whole = Transcript.of([m.id for m in messages], messages)
    head = Transcript.of([m.id for m in messages[:split]], messages[:split])
    grown = head.extended(messages[split:])
    expected = any(has for _, has in parts)
    assert whole.has_files == grown.has_files == expected
