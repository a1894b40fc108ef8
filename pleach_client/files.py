"""File references: files a user attaches to a message, which the model sees as document or
image blocks and which sync as artifacts of the session.

``execute_message(session_id, text, file_references=[...])`` takes, for each file, a
``FileReference`` (``path=``; or ``data=`` with ``media_type=`` and ``name=``; or the
``artifact_id=`` of a file attached before), a path, or the same as a dict. Each new file is
checked (type, size, text that is UTF-8) before anything is written, then stored as an
artifact of the session: a document holding its name and media type and its content (base64
for a binary file), written in pieces of at most 256 Ki characters so each update record stays
well under the sync limit. The user message keeps a small ``file_reference`` block naming the
artifact; each model request swaps it for the block the API takes:

- PNG, JPEG, GIF and WebP images: an ``image`` block;
- PDF: a ``document`` block (base64);
- text (``text/*``, JSON, XML, YAML, CSV...): a ``document`` block with a text source.

A file whose artifact is gone (its session was deleted on another device, say) becomes a text
block saying so. ``rt.files`` lists a session's files; a bounded cache (32 MiB) keeps the
blocks of recent files, so a long conversation does not rebuild them at every call.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import hashlib
import mimetypes
import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import msgspec

from shared.errors import InvalidInput, NotFound, RecordTooLarge
from shared.ids import uuid7
from shared.records import ArtifactUpdate, Event, Session

from .artifacts import BODY
from .core import SessionChange, existing
from .stream import ArtifactCreated

if TYPE_CHECKING:
    import pycrdt

    from .runtime import SessionRuntime

__all__ = ["FILE_BLOCK", "AttachedFile", "FileReference", "FilesFacet"]

FILE_BLOCK = "file_reference"
"""The type of the block a stored user message keeps for an attached file."""
MAX_FILE_BYTES = 8 * 1024 * 1024
"""The largest file a message takes (by default; ``FilesFacet(max_file_bytes=)``)."""
CHUNK_CHARS = 256 * 1024
DEFAULT_CACHE_BYTES = 32 * 1024 * 1024
META = "file"

IMAGE_TYPES = frozenset({"image/png", "image/jpeg", "image/gif", "image/webp"})
TEXT_TYPES = frozenset(
    {
        "application/json",
        "application/xml",
        "application/x-yaml",
        "application/yaml",
        "application/x-sh",
        "application/javascript",
        "application/toml",
    }
)
_EXTRA_TYPES = {".md": "text/markdown", ".yaml": "application/yaml", ".yml": "application/yaml"}

Kind = Literal["image", "pdf", "text"]


class FileReference(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A file for ``execute_message(..., file_references=[...])``: give ``path``, or
    ``data`` (with ``media_type``, and a ``name``), or the ``artifact_id`` of a file
    attached before. ``media_type`` is guessed from the name when not given."""

    path: str | None = None
    data: bytes | None = None
    name: str | None = None
    media_type: str | None = None
    artifact_id: str | None = None


class AttachedFile(msgspec.Struct, frozen=True, kw_only=True):
    """A file stored as an artifact of a session (``rt.files.list``)."""

    artifact_id: str
    session_id: str
    name: str
    media_type: str
    size: int
    sha256: str


FileRef = FileReference | str | os.PathLike[str] | Mapping[str, Any]


class _New(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    media_type: str
    kind: str
    body: str
    size: int
    sha256: str


class Attachments(msgspec.Struct, kw_only=True):
    """What ``attach`` did: the blocks for the user message, the events to yield."""

    blocks: list[dict[str, Any]] = []
    events: list[ArtifactCreated] = []


def _kind(media_type: str) -> Kind | None:
    if media_type in IMAGE_TYPES:
        return "image"
    if media_type == "application/pdf":
        return "pdf"
    if media_type.startswith("text/") or media_type in TEXT_TYPES:
        return "text"
    return None


def _as_reference(ref: FileRef) -> FileReference:
    if isinstance(ref, FileReference):
        return ref
    if isinstance(ref, str | os.PathLike):
        return FileReference(path=os.fspath(ref))
    if isinstance(ref, Mapping):
        try:
            return msgspec.convert(dict(ref), FileReference)
        except msgspec.ValidationError as exc:
            raise InvalidInput(f"file reference {dict(ref)!r} is not valid: {exc}") from exc
    raise InvalidInput(
        f"a file reference is a FileReference, a path or a dict, not {type(ref).__name__}"
    )


def _read(path: Path, limit: int) -> bytes:
    with path.open("rb") as f:
        return f.read(limit + 1)


class FilesFacet:
    """``runtime.files``: files attached to messages (``execute_message(file_references=)``)."""

    def __init__(
        self,
        rt: SessionRuntime,
        *,
        max_file_bytes: int = MAX_FILE_BYTES,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        self._rt = rt
        self.max_file_bytes = max_file_bytes
        self._cache_bytes = cache_bytes
        self._cache: OrderedDict[str, tuple[dict[str, Any], int]] = OrderedDict()
        self._cached = 0

    # -- reads ------------------------------------------------------------------------------
    async def get(self, artifact_id: str) -> AttachedFile | None:
        """The file stored as ``artifact_id``; None if there is none (or it is no file)."""
        found = await self._load(artifact_id)
        return found[0] if found is not None else None

    async def list(self, session_id: str) -> builtins.list[AttachedFile]:
        """The files attached in a session, in the order they were attached."""
        out = []
        for artifact_id in await self._rt.artifacts.list(session_id):
            found = await self.get(artifact_id)
            if found is not None:
                out.append(found)
        return out

    # -- the turn's side --------------------------------------------------------------------
    async def attach(self, session: Session, refs: Sequence[FileRef]) -> Attachments:
        """Check every reference, then store the new files as artifacts of ``session`` (one
        write). Raises ``InvalidInput`` (an unusable file), ``RecordTooLarge`` (over
        ``max_file_bytes``) or ``NotFound`` (an ``artifact_id`` that is no file here) before
        anything is written. Returns the user message's blocks and the events to yield."""
        references = [_as_reference(r) for r in refs]
        planned: builtins.list[AttachedFile | _New] = []
        for ref in references:
            if ref.artifact_id is not None:
                known = await self.get(ref.artifact_id)
                if known is None:
                    raise NotFound(
                        f"no attached file {ref.artifact_id} on this device (sync first, or "
                        "attach the file itself); nothing was written"
                    )
                planned.append(known)
            else:
                planned.append(await self._prepare(ref))
        out = Attachments()
        records: builtins.list[ArtifactUpdate] = []
        events: builtins.list[Event] = []
        new_ids: builtins.list[str] = []
        core = self._rt.core
        for item in planned:
            if isinstance(item, AttachedFile):
                out.blocks.append(_reference_block(item))
                continue
            artifact_id = uuid7()
            records.extend(self._records(session.id, artifact_id, item))
            info = AttachedFile(
                artifact_id=artifact_id,
                session_id=session.id,
                name=item.name,
                media_type=item.media_type,
                size=item.size,
                sha256=item.sha256,
            )
            events.append(
                core.draft_event(
                    session.id,
                    "artifact.created",
                    {
                        "artifact_id": artifact_id,
                        "kind": "file",
                        "name": item.name,
                        "media_type": item.media_type,
                        "size": item.size,
                    },
                )
            )
            new_ids.append(artifact_id)
            out.blocks.append(_reference_block(info))
            out.events.append(
                ArtifactCreated(
                    session_id=session.id,
                    artifact_id=artifact_id,
                    kind="file",
                    name=item.name,
                    media_type=item.media_type,
                )
            )
            self._remember(
                artifact_id, _api_block(item.kind, item.media_type, item.name, item.body)
            )
        if new_ids:

            def add(current: Session) -> SessionChange:
                state = msgspec.structs.replace(
                    current.state, artifacts=[*current.state.artifacts, *new_ids]
                )
                row = msgspec.structs.replace(current, state=state)
                return SessionChange(row=row, records=list(records), events=events)

            await core.write([(session.id, existing(add))])
        return out

    async def expand(
        self, messages: builtins.list[dict[str, Any]]
    ) -> builtins.list[dict[str, Any]]:
        """``messages`` (a request's) with each ``file_reference`` block replaced by the block
        the API takes. The dicts given are not changed (they are the transcript's)."""
        out: builtins.list[dict[str, Any]] | None = None
        for i, message in enumerate(messages):
            content = message.get("content")
            if not isinstance(content, builtins.list) or not any(
                isinstance(b, dict) and b.get("type") == FILE_BLOCK for b in content
            ):
                continue
            if out is None:
                out = builtins.list(messages)
            blocks = []
            for block in content:
                if isinstance(block, dict) and block.get("type") == FILE_BLOCK:
                    blocks.append(await self._api_block_for(block))
                else:
                    blocks.append(block)
            out[i] = {**message, "content": blocks}
        return messages if out is None else out

    # -- internals --------------------------------------------------------------------------
    async def _prepare(self, ref: FileReference) -> _New:
        limit = self.max_file_bytes
        if ref.data is not None:
            data, name = ref.data, ref.name or "attachment"
        elif ref.path is not None:
            path = Path(ref.path)
            try:
                data = await asyncio.to_thread(_read, path, limit)
            except OSError as exc:
                raise InvalidInput(f"cannot read {path}: {exc}; nothing was written") from exc
            name = ref.name or path.name
        else:
            raise InvalidInput("a file reference needs a path, data or an artifact_id")
        if len(data) > limit:
            raise RecordTooLarge(
                f"file {name!r} is over the {limit:,}-byte limit for an attached file; "
                "nothing was written"
            )
        media_type = ref.media_type or _guess(name)
        kind = _kind(media_type) if media_type else None
        if media_type is None or kind is None:
            raise InvalidInput(
                f"file {name!r} ({media_type or 'unknown type'}) cannot be shown to the model: "
                "attach an image (PNG, JPEG, GIF, WebP), a PDF or a text file; nothing was "
                "written"
            )
        if kind == "text":
            try:
                body = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InvalidInput(
                    f"file {name!r} is declared {media_type} but is not UTF-8 text ({exc.reason} "
                    f"at byte {exc.start}); nothing was written"
                ) from exc
        else:
            body = base64.b64encode(data).decode("ascii")
        return _New(
            name=name,
            media_type=media_type,
            kind=kind,
            body=body,
            size=len(data),
            sha256=hashlib.sha256(data).hexdigest(),
        )

    def _records(
        self, session_id: str, artifact_id: str, item: _New
    ) -> builtins.list[ArtifactUpdate]:
        """The file as a document, in updates of at most ``CHUNK_CHARS`` characters each."""
        import pycrdt

        core = self._rt.core
        doc: pycrdt.Doc[Any] = pycrdt.Doc()
        meta = doc.get(META, type=pycrdt.Map)
        body = doc.get(BODY, type=pycrdt.Text)
        updates: builtins.list[bytes] = []
        before = doc.get_state()
        meta["name"] = item.name
        meta["media_type"] = item.media_type
        meta["kind"] = item.kind
        meta["size"] = item.size
        meta["sha256"] = item.sha256
        updates.append(doc.get_update(before))
        for start in range(0, len(item.body), CHUNK_CHARS):
            before = doc.get_state()
            body += item.body[start : start + CHUNK_CHARS]
            updates.append(doc.get_update(before))
        return [
            ArtifactUpdate(
                id=uuid7(),
                artifact_id=artifact_id,
                session_id=session_id,
                org_id=core.org_id,
                user_id=core.user_id,
                client_id=core.client_id,
                hlc=core.now(),
                update=update,
            )
            for update in updates
        ]

    async def _load(self, artifact_id: str) -> tuple[AttachedFile, str, str] | None:
        """The file's info, kind and body, read from its artifact."""
        import pycrdt

        updates = await self._rt.store.list_artifact_updates(artifact_id)
        if not updates:
            return None
        try:
            doc = cast("pycrdt.Doc[Any]", await self._rt.artifacts.doc(artifact_id))
        except NotFound:
            return None
        meta: dict[str, Any] = dict(doc.get(META, type=pycrdt.Map))
        name, media_type = meta.get("name"), meta.get("media_type")
        kind = meta.get("kind")
        if not isinstance(name, str) or not isinstance(media_type, str) or kind is None:
            return None  # a document artifact, not a file
        info = AttachedFile(
            artifact_id=artifact_id,
            session_id=updates[0].session_id,
            name=name,
            media_type=media_type,
            size=int(meta.get("size") or 0),
            sha256=str(meta.get("sha256") or ""),
        )
        return info, str(kind), str(doc.get(BODY, type=pycrdt.Text))

    async def _api_block_for(self, block: dict[str, Any]) -> dict[str, Any]:
        artifact_id = str(block.get("artifact_id"))
        cached = self._cache.get(artifact_id)
        if cached is not None:
            self._cache.move_to_end(artifact_id)
            return cached[0]
        found = await self._load(artifact_id)
        if found is None:
            name = block.get("name") or artifact_id
            return {"type": "text", "text": f"[attached file {name} is no longer available]"}
        info, kind, body = found
        api = _api_block(kind, info.media_type, info.name, body)
        self._remember(artifact_id, api)
        return api

    def _remember(self, artifact_id: str, block: dict[str, Any]) -> None:
        size = len(str(block.get("source", {}).get("data", "")))
        if size > self._cache_bytes:
            return
        old = self._cache.pop(artifact_id, None)
        if old is not None:
            self._cached -= old[1]
        self._cache[artifact_id] = (block, size)
        self._cached += size
        while self._cached > self._cache_bytes and self._cache:
            _, (_, dropped) = self._cache.popitem(last=False)
            self._cached -= dropped


def _guess(name: str) -> str | None:
    suffix = Path(name).suffix.lower()
    if suffix in _EXTRA_TYPES:
        return _EXTRA_TYPES[suffix]
    guessed, _ = mimetypes.guess_type(name, strict=False)
    return guessed


def _reference_block(info: AttachedFile) -> dict[str, Any]:
    return {
        "type": FILE_BLOCK,
        "artifact_id": info.artifact_id,
        "name": info.name,
        "media_type": info.media_type,
        "size": info.size,
    }


def _api_block(kind: str, media_type: str, name: str, body: str) -> dict[str, Any]:
    if kind == "image":
        return {
            "type": "image",
            "source": {"type": "base64", "media_type": media_type, "data": body},
        }
    if kind == "pdf":
        return {
            "type": "document",
            "source": {"type": "base64", "media_type": "application/pdf", "data": body},
            "title": name,
        }
    return {
        "type": "document",
        "source": {"type": "text", "media_type": "text/plain", "data": body},
        "title": name,
    }
