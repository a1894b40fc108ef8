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


class Transcript:
    """A session's messages (ids, records) and their API form. Treat as immutable.

    ``api`` and ``has_files`` (some message refers to an attached file, so a request built
    from it needs ``rt.files.expand``) are made when first asked for, then kept: a transcript
    read to be shown (``sessions.messages``) costs no conversion, and the turn that follows
    converts it once, or only its own messages when it extends a transcript that has its API
    form (a session without files never pays a scan)."""

    __slots__ = ("_api", "_has_files", "ids", "messages")

    def __init__(
        self,
        ids: list[str],
        messages: list[Message],
        api: list[dict[str, Any]] | None = None,
        has_files: bool | None = None,
    ) -> None:
        self.ids = ids
        self.messages = messages
        self._api = api
        self._has_files = has_files

    @classmethod
    def of(cls, ids: list[str], messages: list[Message]) -> Transcript:
        return cls(list(ids), list(messages))

    @property
    def api(self) -> list[dict[str, Any]]:
        if self._api is None:
            self._api = to_api_messages(self.messages)
        return self._api

    @property
    def has_files(self) -> bool:
        if self._has_files is None:
            self._has_files = has_file_blocks(self.messages)
        return self._has_files

    def extended(self, messages: list[Message]) -> Transcript:
        """This transcript with ``messages`` appended (only they are converted, when this
        one's API form is made; else the new one makes its own when asked)."""
        api = None if self._api is None else extend_api(list(self._api), messages)
        files = None if self._has_files is None else self._has_files or has_file_blocks(messages)
        return Transcript(self.ids + [m.id for m in messages], self.messages + messages, api, files)
