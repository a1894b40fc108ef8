"""A session's transcript as the model sees it, kept incrementally.

``to_api_messages`` turns stored ``Message`` records into the Anthropic API's message list.
``Transcript`` is one session's messages with that list beside them, so a turn converts only
its own new messages, not the whole conversation again: the per-turn cost of building a
request stays flat however long the session grows (the list itself is copied, which is a C
loop over pointers).

The API dicts are shared between the cache and every request built from it: nothing may
mutate them. ``extend_api`` never does; a merge of two same-role messages makes a new dict.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from shared.records import Message

__all__ = ["FILE_BLOCK", "Transcript", "extend_api", "has_file_blocks", "to_api_messages"]


def _blocks(message: Message) -> list[dict[str, Any]]:
    """The blocks the API accepts: empty text and unsigned (aborted) thinking dropped."""
    blocks = []
    for block in message.content:
        kind = block.get("type")
        if kind == "text" and not block.get("text"):
            continue
        if kind == "thinking" and not block.get("signature"):
            continue
        blocks.append(dict(block))
    return blocks


def extend_api(out: list[dict[str, Any]], messages: Iterable[Message]) -> list[dict[str, Any]]:
    """Append ``messages`` to the API list ``out`` (which it returns).

    Consecutive messages of one role are merged (tool results first). ``out``'s dicts are not
    mutated: a merge replaces the last entry with a new dict.
    """
    for message in messages:
        blocks = _blocks(message)
        if not blocks:
            continue
        if out and out[-1]["role"] == message.role:
            merged = out[-1]["content"] + blocks
            merged.sort(key=lambda b: 0 if b.get("type") == "tool_result" else 1)
            out[-1] = {"role": message.role, "content": merged}
        else:
            out.append({"role": message.role, "content": blocks})
    return out


def to_api_messages(messages: Iterable[Message]) -> list[dict[str, Any]]:
    """Messages as the Anthropic API accepts them (see ``extend_api``)."""
    return extend_api([], messages)


FILE_BLOCK = "file_reference"
"""The block a message keeps for an attached file (``pleach_client.files`` expands it)."""


def has_file_blocks(messages: Iterable[Message]) -> bool:
    """Whether any of ``messages`` refers to an attached file."""
    return any(b.get("type") == FILE_BLOCK for m in messages for b in m.content)


@dataclass(frozen=True)
class Transcript:
    """A session's messages (ids, records) and their API form. Treat as immutable.

    ``has_files``: some message refers to an attached file, so a request built from it needs
    ``rt.files.expand`` (kept incrementally: a session without files never pays a scan)."""

    ids: list[str]
    messages: list[Message]
    api: list[dict[str, Any]]
    has_files: bool = False

    @classmethod
    def of(cls, ids: list[str], messages: list[Message]) -> Transcript:
        return cls(list(ids), list(messages), to_api_messages(messages), has_file_blocks(messages))

    def extended(self, messages: list[Message]) -> Transcript:
        """This transcript with ``messages`` appended (only they are converted)."""
        return Transcript(
            self.ids + [m.id for m in messages],
            self.messages + messages,
            extend_api(list(self.api), messages),
            self.has_files or has_file_blocks(messages),
        )
