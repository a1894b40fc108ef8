"""Collaborative artifacts: documents that merge without conflicts (pycrdt / Yjs CRDT).

An artifact belongs to a session (its id is in ``session.state.artifacts``). Each edit is
stored as one immutable ``ArtifactUpdate`` record holding a Yjs update; records sync by union
of ids like messages, and any device that has the same set of updates has the same document,
whatever order they arrived in. Concurrent offline edits are both kept: no fork is needed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from shared.clock import HybridClock
from shared.errors import NotFound
from shared.ids import uuid7
from shared.records import ArtifactUpdate, Session

from .core import SessionChange, existing
from .receipts import ArtifactReceipt
from .stream import ArtifactCreated

if TYPE_CHECKING:
    import pycrdt

    from .runtime import SessionRuntime

log = logging.getLogger("pleach.artifacts")
BODY = "body"


class ArtifactsFacet:
    """``runtime.artifacts``: create, read and edit collaborative text documents."""

    def __init__(self, rt: SessionRuntime) -> None:
        self._rt = rt

    async def create(self, session_id: str, text: str = "") -> ArtifactReceipt:
        """A new artifact in ``session_id``, optionally with initial text."""
        import pycrdt

        core = self._rt.core
        artifact_id = uuid7()
        doc: pycrdt.Doc[pycrdt.Text] = pycrdt.Doc()
        body = doc.get(BODY, type=pycrdt.Text)
        body += text
        update = self._record(session_id, artifact_id, doc.get_update())
        event = core.draft_event(session_id, "artifact.created", {"artifact_id": artifact_id})

        def add(current: Session) -> SessionChange:
            state = msgspec.structs.replace(
                current.state, artifacts=[*current.state.artifacts, artifact_id]
            )
            return SessionChange(
                row=msgspec.structs.replace(current, state=state),
                records=[update],
                events=[event],
            )

        await core.write([(session_id, existing(add))])
        self._rt.emit(ArtifactCreated(session_id=session_id, artifact_id=artifact_id))
        return ArtifactReceipt(
            artifact_id=artifact_id,
            session_id=session_id,
            update_id=update.id,
            update_bytes=len(update.update),
            length=len(text),
        )

    async def copy_to(self, artifact_id: str, session_id: str) -> ArtifactUpdate | None:
        """A new artifact in ``session_id`` with the same document, as one update record (not
        written: the caller writes it with what it belongs to); None if there is none."""
        updates = await self._rt.store.list_artifact_updates(artifact_id)
        if not updates:
            return None
        core = self._rt.core
        return copy_document(updates, session_id, core.client_id, core.clock)

    async def list(self, session_id: str) -> list[str]:
        return [*(await self._rt.core.session(session_id)).state.artifacts]

    async def doc(self, artifact_id: str) -> pycrdt.Doc[pycrdt.Text]:
        """The document rebuilt from every stored update (order does not matter)."""
        import pycrdt

        updates = await self._rt.store.list_artifact_updates(artifact_id)
        if not updates:
            raise NotFound(f"no artifact {artifact_id}")
        doc: pycrdt.Doc[pycrdt.Text] = pycrdt.Doc()
        doc.get(BODY, type=pycrdt.Text)
        try:
            doc.apply_update(pycrdt.merge_updates(*(u.update for u in updates)))
        except ValueError:
            # A peer's update that is not a valid one (a bug, a hostile device) must not
            # make the artifact unreadable: apply the others one by one, and say which not.
            doc = pycrdt.Doc()
            doc.get(BODY, type=pycrdt.Text)
            for update in updates:
                try:
                    doc.apply_update(update.update)
                except ValueError as exc:
                    log.warning(
                        "artifact %s: update %s from device %s is not a valid update, skipped: %s",
                        artifact_id,
                        update.id,
                        update.client_id,
                        exc,
                    )
        return doc

    async def text(self, artifact_id: str) -> str:
        import pycrdt

        doc = await self.doc(artifact_id)
        return str(doc.get(BODY, type=pycrdt.Text))

    async def edit(
        self, artifact_id: str, change: Callable[[pycrdt.Text], object]
    ) -> ArtifactReceipt:
        """Apply ``change`` to the document's text and store the resulting update.

        ``change`` receives the ``pycrdt.Text`` (``insert``, ``+=``, ``del text[a:b]``...).
        """
        import pycrdt

        updates = await self._rt.store.list_artifact_updates(artifact_id)
        if not updates:
            raise NotFound(f"no artifact {artifact_id}")
        session_id = updates[0].session_id
        doc = await self.doc(artifact_id)
        before = doc.get_state()
        body = doc.get(BODY, type=pycrdt.Text)
        change(body)
        delta = doc.get_update(before)
        record = self._record(session_id, artifact_id, delta)
        # Through the session's edit, so an edit of a deleted session's artifact is refused.
        await self._rt.core.write(
            [(session_id, existing(lambda _: SessionChange(records=[record])))]
        )
        return ArtifactReceipt(
            artifact_id=artifact_id,
            session_id=session_id,
            update_id=record.id,
            update_bytes=len(delta),
            length=len(str(body)),
        )

    async def append(self, artifact_id: str, text: str) -> ArtifactReceipt:
        def add(body: pycrdt.Text) -> None:
            body += text

        return await self.edit(artifact_id, add)

    def _record(self, session_id: str, artifact_id: str, update: bytes) -> ArtifactUpdate:
        core = self._rt.core
        return ArtifactUpdate(
            id=uuid7(),
            artifact_id=artifact_id,
            session_id=session_id,
            org_id=core.org_id,
            user_id=core.user_id,
            client_id=core.client_id,
            hlc=core.now(),
            update=update,
        )


def copy_document(
    updates: list[ArtifactUpdate], session_id: str, client_id: str, clock: HybridClock
) -> ArtifactUpdate:
    """A new artifact in ``session_id`` holding the document of ``updates`` (one artifact's,
    not empty), as one update record written by ``client_id``."""
    import pycrdt

    first = updates[0]
    return ArtifactUpdate(
        id=uuid7(),
        artifact_id=uuid7(),
        session_id=session_id,
        org_id=first.org_id,
        user_id=first.user_id,
        client_id=client_id,
        hlc=clock.now(),
        update=pycrdt.merge_updates(*(u.update for u in updates)),
    )
