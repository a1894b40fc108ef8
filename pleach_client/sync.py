"""Sync: connect to a pleach server, flush the outbox, pull, apply live changes.

``runtime.sync.connect(url, token)`` starts a background loop that reconnects with exponential
backoff and jitter. On every (re)connect: ``Hello``/``Welcome`` (outbox rows the server
already has are dropped), flush in batches, pull from the cursor; then it applies live
``Changes`` and flushes after every local write. Offline for a second or a week: same path.
The wire work is done by the sans-I/O ``shared.protocol.ClientProtocol``; this is its pump.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import websockets
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from shared.clock import HybridClock, Order, vv_compare
from shared.errors import ChainError, InvalidState, NotFound, PleachError, SyncError
from shared.hashchain import chain_event, verify_chain
from shared.merge import Resolution, resolve_conflicts
from shared.messages import (
    DEFAULT_MAX_FRAME_BYTES,
    Changes,
    ConflictReceipt,
    Error,
    Frame,
    PushAck,
    Welcome,
)
from shared.protocol import ClientProtocol
from shared.records import Change, Event, FeedChange, Record, Session

from .receipts import FlushOutcome
from .store.base import WriteBatch
from .stream import SyncApplied, SyncConflict

if TYPE_CHECKING:
    from .runtime import SessionRuntime

log = logging.getLogger("pleach.sync")

SyncState = Literal["connected", "connecting", "offline", "needs-auth"]
Side = Literal["local", "remote"]


class FailedEntry(msgspec.Struct, kw_only=True):
    client_seq: int
    code: int | None
    message: str
    attempts: int


class OutboxFlushReceipt(msgspec.Struct, kw_only=True):
    """What a flush did. ``failed_entries`` were dead-lettered or are stuck (with a reason)."""

    outcome: FlushOutcome
    flushed: int
    failed_entries: list[FailedEntry]
    flushed_at: float
    pending_before: int
    pending_after: int
    conflicts: list[ConflictReceipt] = []


class SyncStatus(msgspec.Struct, kw_only=True):
    state: SyncState
    uploading: bool
    downloading: bool
    pending: int
    dead_letters: int
    last_synced_at: float | None
    has_synced: bool
    cursor: int
    last_error: str | None
    last_error_code: int | None = None
    server_url: str | None = None


class SyncConflictResolveReceipt(msgspec.Struct, kw_only=True):
    resolved: bool
    session_id: str
    conflict_id: str
    resolution: Side
    resolved_at: str
    swapped: bool = False
    fork_session_id: str | None = None


class SyncCoordinator:
    """The pure merge rule, public for hosts that push through their own channel."""

    @staticmethod
    def resolve_conflicts(local: Session, remote: Session) -> Resolution:
        return resolve_conflicts(local, remote)


class _Link:
    """One open connection: the socket, the protocol, and the in-flight request."""

    def __init__(self, ws: ClientConnection, protocol: ClientProtocol) -> None:
        self.ws = ws
        self.protocol = protocol
        self.waiters: deque[asyncio.Future[Frame]] = deque()
        self.lock = asyncio.Lock()

    async def flush_out(self) -> None:
        for data in self.protocol.data_to_send():
            await self.ws.send(data)

    async def request(self, send: Callable[[], None], timeout: float) -> Frame:
        """Send one request frame and wait for its answer (answers come in order)."""
        async with self.lock:
            future: asyncio.Future[Frame] = asyncio.get_running_loop().create_future()
            self.waiters.append(future)
            send()
            await self.flush_out()
            try:
                async with asyncio.timeout(timeout):
                    return await future
            except TimeoutError:
                # Answers are matched by order: a lost answer would shift every later one.
                # Drop the connection instead; the loop reconnects and resends what is unacked.
                self.ws.transport.abort()
                raise ConnectionError(f"no answer within {timeout}s; reconnecting") from None

    def fail_all(self, exc: BaseException) -> None:
        while self.waiters:
            future = self.waiters.popleft()
            if not future.done():
                future.set_exception(exc)
                future.exception()  # mark retrieved: a waiter may already have gone


class SyncFacet:
    """``runtime.sync``: connect, flush, pull, status, dead letters, conflicts."""

    def __init__(
        self,
        rt: SessionRuntime,
        *,
        batch_size: int = 200,
        pull_limit: int = 500,
        backoff_initial: float = 0.2,
        backoff_max: float = 30.0,
        request_timeout: float = 30.0,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    ) -> None:
        self._rt = rt
        self.batch_size = batch_size
        self.pull_limit = pull_limit
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.request_timeout = request_timeout
        self.max_frame_bytes = max_frame_bytes
        self._url: str | None = None
        self._token: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._link: _Link | None = None
        self._state: SyncState = "offline"
        self._uploading = False
        self._downloading = False
        self._last_error: str | None = None
        self._last_error_code: int | None = None
        self._last_synced_at: float | None = None
        self._dirty = asyncio.Event()
        self._behind = asyncio.Event()
        self._changed = asyncio.Condition()
        self._live: deque[Changes] = deque()
        self._flush_lock = asyncio.Lock()
        self._apply_lock = asyncio.Lock()
        self._head_cursor = 0
        self._auto = True
        # Per session: the last canonical event this device holds (filled on first apply).
        self._canonical_heads: dict[str, tuple[int, str]] = {}

    # -- public API ---------------------------------------------------------------------------
    async def connect(self, url: str, token: str, *, auto: bool = True) -> None:
        """Start syncing with ``url`` (``ws://host:port/sync``) in the background.

        With ``auto`` false the connection is kept but nothing is flushed or pulled until
        ``flush_outbox()`` / ``pull()`` are called.
        """
        if self._task is not None and not self._task.done():
            await self.disconnect()
        self._url, self._token = url, token
        self._auto = auto
        self._set_state("connecting")
        self._task = asyncio.create_task(self._run(), name="pleach-sync")

    async def disconnect(self) -> None:
        """Stop the background loop and close the connection; pending rows stay queued."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._set_state("offline")

    @property
    def connected(self) -> bool:
        return self._state == "connected" and self._link is not None

    async def status(self) -> SyncStatus:
        store = self._rt.store
        cursor = int(await store.get_meta("cursor") or 0)
        return SyncStatus(
            state=self._state,
            uploading=self._uploading,
            downloading=self._downloading,
            pending=await store.outbox_count(),
            dead_letters=await store.dead_letter_count(),
            last_synced_at=self._last_synced_at,
            has_synced=(await store.get_meta("has_synced")) == "1",
            cursor=cursor,
            last_error=self._last_error,
            last_error_code=self._last_error_code,
            server_url=self._url,
        )

    async def wait_until_synced(self, timeout: float = 30.0) -> bool:
        """Wait until connected, the outbox is empty and the cursor reached the head.

        Returns False when ``timeout`` passes first (check ``status()`` for why).
        """

        async def synced() -> bool:
            if not self.connected or self._uploading or self._downloading or self._live:
                return False
            if await self._rt.store.outbox_count():
                return False
            return int(await self._rt.store.get_meta("cursor") or 0) >= self._head_cursor

        try:
            async with asyncio.timeout(timeout):
                while True:
                    async with self._changed:
                        if await synced():
                            return True
                        await self._changed.wait()
        except TimeoutError:
            return False

    async def flush_outbox(self) -> OutboxFlushReceipt:
        """Push every pending outbox row now; returns what happened, row by row."""
        async with self._flush_lock:
            return await self._flush()

    async def pull(self) -> int:
        """Pull from the stored cursor to the server's head; returns records applied."""
        link = self._require_link()
        return await self._pull(link)

    async def dead_letters(self) -> list[Any]:
        return list(await self._rt.store.dead_letters())

    async def retry_dead_letter(self, client_seq: int) -> int | None:
        """Queue a dead letter again (new client_seq, returned); None if unknown."""
        seq = await self._rt.store.retry_dead_letter(client_seq)
        self.notify_local_write()
        return seq

    async def discard_dead_letter(self, client_seq: int) -> bool:
        return await self._rt.store.discard_dead_letter(client_seq)

    async def sync_once(self, url: str, token: str, timeout: float = 30.0) -> OutboxFlushReceipt:
        """Connect, flush, pull to the head, disconnect: one round for scripts and the CLI."""
        await self.connect(url, token, auto=False)
        try:
            async with asyncio.timeout(timeout):
                async with self._changed:
                    await self._changed.wait_for(lambda: self._state in ("connected", "needs-auth"))
            if self._state == "needs-auth":
                raise SyncError(self._last_error or "unauthorized")
            receipt = await self.flush_outbox()
            await self.pull()
            self._last_synced_at = time.time()
            await self._rt.store.set_meta("has_synced", "1")
            return receipt
        finally:
            await self.disconnect()

    async def resolve_conflict(
        self, session_id: str, conflict_id: str, resolution: Side
    ) -> SyncConflictResolveReceipt:
        """Choose which branch of a conflict keeps the session id.

        ``"local"`` is the version the pushing device had, ``"remote"`` the server's. When the
        chosen side lost, the session and its fork swap contents (both as new versions), so
        every device converges on the choice. Works offline: the swap is queued.
        """
        rt = self._rt
        session = await rt._load_session(session_id)
        forks = [
            s
            for s in await rt.store.list_sessions()
            if s.conflict_id == conflict_id and s.forked_from == session_id
        ]
        if not forks:
            raise NotFound(f"no fork for conflict {conflict_id} of session {session_id}")
        fork = forks[0]
        now = rt._clock.now()
        if fork.conflict_loser_side != resolution:
            return SyncConflictResolveReceipt(
                resolved=True,
                session_id=session_id,
                conflict_id=conflict_id,
                resolution=resolution,
                resolved_at=now,
                fork_session_id=fork.id,
            )
        flipped: Side = "remote" if resolution == "local" else "local"
        new_session = rt._bump(
            msgspec.structs.replace(
                session,
                title=fork.title,
                state=fork.state,
                head_checkpoint_id=fork.head_checkpoint_id,
            ),
            base=session,
        )
        new_fork = rt._bump(
            msgspec.structs.replace(
                fork,
                title=session.title,
                state=session.state,
                head_checkpoint_id=session.head_checkpoint_id,
                conflict_loser_side=flipped,
            ),
            base=fork,
        )
        await rt._load_session(fork.id)
        ev = rt._new_event(
            new_session,
            "sync.conflict.resolved",
            {"conflict_id": conflict_id, "resolution": resolution, "fork_session_id": fork.id},
        )
        await rt._write([ev, new_fork, new_session])
        return SyncConflictResolveReceipt(
            resolved=True,
            session_id=session_id,
            conflict_id=conflict_id,
            resolution=resolution,
            resolved_at=now,
            swapped=True,
            fork_session_id=fork.id,
        )

    def notify_local_write(self) -> None:
        """Called by the runtime after every local commit: wakes the flusher."""
        self._dirty.set()

    # -- the background loop -----------------------------------------------------------------
    def _set_state(self, state: SyncState) -> None:
        self._state = state
        self._poke()

    def _poke(self) -> None:
        async def notify() -> None:
            async with self._changed:
                self._changed.notify_all()

        with contextlib.suppress(RuntimeError):  # no running loop: nobody can be waiting
            asyncio.get_running_loop().create_task(notify())

    def _error(self, message: str, code: int | None = None) -> None:
        self._last_error, self._last_error_code = message, code
        log.info("sync: %s", message)

    async def _run(self) -> None:
        delay = self.backoff_initial
        while True:
            self._set_state("connecting")
            try:
                await self._session()
                delay = self.backoff_initial
            except InvalidStatus as exc:
                status = exc.response.status_code
                self._error(
                    f"server refused the connection: HTTP {status}", 3001 if status == 401 else None
                )
                if status in (401, 403):
                    self._set_state("needs-auth")
                    return  # a new token is needed: connect() again with one
            except (OSError, ConnectionClosed, InvalidHandshake, TimeoutError) as exc:
                self._error(f"offline: {type(exc).__name__}: {exc}")
            except InvalidURI as exc:
                self._error(f"bad server URL: {exc}")
                self._set_state("offline")
                return
            except SyncError as exc:
                self._error(exc.message, int(exc.code))
            except PleachError as exc:  # a refused page (bad chain), a store failure...
                self._error(f"{type(exc).__name__}: {exc}")
            finally:
                self._link = None
            self._set_state("offline")
            # Exponential backoff with full jitter, so a fleet does not reconnect in lockstep.
            await asyncio.sleep(random.uniform(0, delay))
            delay = min(delay * 2, self.backoff_max)

    async def _session(self) -> None:
        assert self._url is not None and self._token is not None
        rt = self._rt
        cursor = int(await rt.store.get_meta("cursor") or 0)
        async with websockets.connect(
            self._url,
            additional_headers={"Authorization": f"Bearer {self._token}"},
            max_size=self.max_frame_bytes * 2,
            open_timeout=self.request_timeout,
        ) as ws:
            protocol = ClientProtocol(rt.client_id, cursor, max_frame_bytes=self.max_frame_bytes)
            link = _Link(ws, protocol)
            welcome_future: asyncio.Future[Frame] = asyncio.get_running_loop().create_future()
            link.waiters.append(welcome_future)
            await link.flush_out()
            reader = asyncio.create_task(self._reader(link), name="pleach-sync-reader")
            try:
                async with asyncio.timeout(self.request_timeout):
                    welcome = await welcome_future
                if not isinstance(welcome, Welcome):
                    raise _as_error(welcome)
                self._head_cursor = welcome.head_cursor
                await self._server_has(welcome.last_seq)
                self._link = link
                self._set_state("connected")
                if not self._auto:
                    await reader
                    raise ConnectionError("connection closed by the server")
                await self._catch_up(link)
                while True:
                    waits = [
                        asyncio.ensure_future(self._dirty.wait()),
                        asyncio.ensure_future(self._behind.wait()),
                        reader,
                    ]
                    try:
                        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        for w in waits[:2]:
                            w.cancel()
                    if reader.done():
                        reader.result()  # re-raises why the connection ended
                        raise ConnectionError("connection closed by the server")
                    await self._catch_up(link)
            finally:
                self._link = None
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError, ConnectionClosed):
                    await reader
                link.fail_all(ConnectionError("connection closed"))

    async def _catch_up(self, link: _Link) -> None:
        self._dirty.clear()
        self._behind.clear()
        async with self._flush_lock:
            await self._flush()
        while self._live:
            frame = self._live.popleft()
            cursor = int(await self._rt.store.get_meta("cursor") or 0)
            if frame.from_cursor > cursor:
                self._live.clear()
                break
            await self._apply(frame.changes, frame.to_cursor)
        await self._pull(link)
        self._last_synced_at = time.time()
        await self._rt.store.set_meta("has_synced", "1")
        self._poke()

    async def _reader(self, link: _Link) -> None:
        try:
            await self._read_frames(link)
        finally:
            # Whoever waits for an answer learns the connection is gone, now.
            link.fail_all(ConnectionError("connection closed"))

    async def _read_frames(self, link: _Link) -> None:
        async for data in link.ws:
            if isinstance(data, str):
                data = data.encode()
            link.protocol.receive_data(data)
            for frame in link.protocol.events_received():
                if isinstance(frame, Changes) and frame.live:
                    self._head_cursor = max(self._head_cursor, frame.to_cursor)
                    self._live.append(frame)
                    self._behind.set()
                elif link.waiters:
                    future = link.waiters.popleft()
                    if not future.done():
                        future.set_result(frame)
                elif isinstance(frame, Error):
                    self._error(frame.message, frame.code)
            await link.flush_out()
            if link.protocol.close_reason is not None:
                raise link.protocol.close_reason

    def _require_link(self) -> _Link:
        if self._link is None:
            raise InvalidState("not connected: call connect() and wait for the connection")
        return self._link

    # -- push -------------------------------------------------------------------------------
    async def _server_has(self, last_seq: int) -> None:
        """Drop outbox rows the server already applied (their acks were lost)."""
        pending = await self._rt.store.outbox_pending(limit=1_000_000)
        done = [e.client_seq for e in pending if e.client_seq <= last_seq]
        if done:
            await self._rt.store.outbox_remove(done)

    async def _flush(self) -> OutboxFlushReceipt:
        store = self._rt.store
        pending_before = await store.outbox_count()
        flushed = 0
        failed: list[FailedEntry] = []
        conflicts: list[ConflictReceipt] = []
        if pending_before == 0:
            return OutboxFlushReceipt(
                outcome="none-pending",
                flushed=0,
                failed_entries=[],
                flushed_at=time.time(),
                pending_before=0,
                pending_after=0,
            )
        self._uploading = True
        self._poke()
        try:
            while True:
                entries = await store.outbox_pending(self.batch_size)
                if not entries:
                    break
                link = self._link
                if link is None:
                    failed.extend(
                        FailedEntry(
                            client_seq=e.client_seq,
                            code=None,
                            attempts=e.attempts,
                            message="offline: queued until the server is reachable",
                        )
                        for e in entries
                    )
                    break
                changes = [Change(client_seq=e.client_seq, record=e.record) for e in entries]
                try:
                    answer = await link.request(
                        lambda link=link, changes=changes: link.protocol.send_push(changes),  # type: ignore[misc]
                        self.request_timeout,
                    )
                except (ConnectionError, ConnectionClosed, TimeoutError) as exc:
                    await store.outbox_mark_attempt([e.client_seq for e in entries], None, str(exc))
                    failed.extend(
                        FailedEntry(
                            client_seq=e.client_seq,
                            code=None,
                            attempts=e.attempts + 1,
                            message=f"connection lost: {exc}",
                        )
                        for e in entries
                    )
                    break
                if isinstance(answer, Error):
                    await store.outbox_mark_attempt(
                        [e.client_seq for e in entries], answer.code, answer.message
                    )
                    self._error(answer.message, answer.code)
                    failed.extend(
                        FailedEntry(
                            client_seq=e.client_seq,
                            code=answer.code,
                            attempts=e.attempts + 1,
                            message=answer.message,
                        )
                        for e in entries
                    )
                    break
                if not isinstance(answer, PushAck):
                    raise _as_error(answer)
                self._head_cursor = max(self._head_cursor, answer.head_cursor)
                progress, batch_conflicts = await self._settle(entries, answer, failed)
                flushed += progress
                conflicts.extend(batch_conflicts)
                if progress == 0 and not any(r.status == "rejected" for r in answer.results):
                    break
        finally:
            self._uploading = False
            self._poke()
        pending_after = await store.outbox_count()
        if pending_after == 0 and not failed:
            outcome: FlushOutcome = "all-flushed"
        elif flushed == 0:
            outcome = "all-stuck"
        else:
            outcome = "partial"
        return OutboxFlushReceipt(
            outcome=outcome,
            flushed=flushed,
            failed_entries=failed,
            flushed_at=time.time(),
            pending_before=pending_before,
            pending_after=pending_after,
            conflicts=conflicts,
        )

    async def _settle(
        self, entries: list[Any], ack: PushAck, failed: list[FailedEntry]
    ) -> tuple[int, list[ConflictReceipt]]:
        """Apply one PushAck to the outbox: remove, dead-letter, or keep for resend."""
        store = self._rt.store
        by_seq = {e.client_seq: e for e in entries}
        done: list[int] = []
        conflicts: list[ConflictReceipt] = []
        for result in ack.results:
            entry = by_seq.get(result.client_seq)
            if entry is None:
                continue
            if result.status == "rejected" and result.code == 3006:
                continue  # a gap: resent from last_seq + 1 on the next round
            if result.status == "rejected":
                await store.outbox_dead_letter(
                    result.client_seq, result.code or 3007, result.message or "rejected"
                )
                failed.append(
                    FailedEntry(
                        client_seq=result.client_seq,
                        code=result.code,
                        message=result.message or "rejected",
                        attempts=entry.attempts + 1,
                    )
                )
                continue
            done.append(result.client_seq)
            if result.status == "resolved" and result.conflict is not None:
                conflicts.append(result.conflict)
        # Anything at or below the server's last_seq is on the server, whatever the result.
        done.extend(
            s
            for s in by_seq
            if s <= ack.last_seq and s not in done and not any(f.client_seq == s for f in failed)
        )
        if done:
            await store.outbox_remove(sorted(set(done)))
        for receipt in conflicts:
            await self._record_conflict(receipt)
        return len(set(done)), conflicts

    async def _record_conflict(self, receipt: ConflictReceipt) -> None:
        """Log the conflict in the session's event log: it syncs, so every device sees it."""
        rt = self._rt
        try:
            session = await rt._load_session(receipt.session_id)
        except NotFound:
            return
        payload = msgspec.to_builtins(receipt)
        ev = rt._new_event(session, "sync.conflict", payload)
        await rt._write([ev])
        rt._emit(_conflict_event(receipt))

    # -- pull and apply ------------------------------------------------------------------------
    async def _pull(self, link: _Link) -> int:
        applied = 0
        self._downloading = True
        self._poke()
        try:
            while True:
                cursor = int(await self._rt.store.get_meta("cursor") or 0)
                answer = await link.request(
                    lambda cursor=cursor: link.protocol.send_pull(cursor, self.pull_limit),  # type: ignore[misc]
                    self.request_timeout,
                )
                if isinstance(answer, Error):
                    self._error(answer.message, answer.code)
                    if answer.code == 3010 and cursor > 0:
                        # Cursor too old: resync from the start of the retained feed. Local
                        # applies are idempotent, so re-reading what we have costs only time.
                        await self._rt.store.set_meta("cursor", "0")
                        continue
                    raise _as_error(answer)
                if not isinstance(answer, Changes):
                    raise _as_error(answer)
                self._head_cursor = max(self._head_cursor, answer.to_cursor)
                applied += await self._apply(answer.changes, answer.to_cursor)
                if not answer.more:
                    return applied
        finally:
            self._downloading = False
            self._poke()

    async def _apply(self, changes: list[FeedChange], to_cursor: int) -> int:
        """Apply one page of remote changes in ONE local transaction with the cursor."""
        async with self._apply_lock:
            cursor = int(await self._rt.store.get_meta("cursor") or 0)
            if to_cursor <= cursor and changes:
                return 0  # already applied (a live page that a pull overtook)
            return await self._apply_page(changes, max(to_cursor, cursor))

    async def _apply_page(self, changes: list[FeedChange], to_cursor: int) -> int:
        rt = self._rt
        store = rt.store
        clock: HybridClock = rt._clock
        records: list[Record] = []
        sessions_taken: list[Session] = []
        remote_sessions: dict[str, Session] = {}
        events_by_session: dict[str, list[Event]] = {}
        stream_events: list[Any] = []
        for change in changes:
            record = change.record
            try:
                clock.observe(record.hlc)
            except PleachError as exc:  # skew or a malformed stamp: apply, but say so
                log.warning("remote stamp not observed: %s", exc)
            match record:
                case Session():
                    # The server only ever replaces a session id by a dominating version, in
                    # feed order: the last version of an id in the page is the one to compare.
                    remote_sessions[record.id] = record
                case Event():
                    events_by_session.setdefault(record.session_id, []).append(record)
                case _:
                    records.append(record)
        for record in remote_sessions.values():
            local = await store.get_session(record.id)
            if local is not None:
                order = vv_compare(record.vv, local.vv)
                if order not in (Order.DOMINATES, Order.EQUAL):
                    continue  # ours is newer or concurrent: our push settles it
                if order is Order.EQUAL and local == record:
                    continue
            records.append(record)
            sessions_taken.append(record)
        locks = [
            rt._turn_locks.setdefault(sid, asyncio.Lock()) for sid in sorted(events_by_session)
        ]
        async with contextlib.AsyncExitStack() as stack:
            for lock in locks:
                await stack.enter_async_context(lock)
            heads: dict[str, tuple[int, str]] = {}
            canonical_heads: dict[str, tuple[int, str]] = {}
            for session_id, incoming in events_by_session.items():
                rebased, head, canonical_head, fresh = await self._rebase(session_id, incoming)
                canonical_heads[session_id] = canonical_head
                stream_events.extend(
                    _conflict_event(msgspec.convert(e.payload, ConflictReceipt))
                    for e in fresh
                    if e.type == "sync.conflict" and e.client_id != rt.client_id
                )
                records.extend(rebased)
                heads[session_id] = head
            await store.commit(
                WriteBatch(
                    records=records,
                    outbox=False,
                    meta={"cursor": str(to_cursor), "hlc": clock.last},
                )
            )
            rt._event_heads.update(heads)
            self._canonical_heads.update(canonical_heads)
        for session in sessions_taken:
            if session.deleted:
                rt._cache.pop(session.id, None)
            else:
                rt._cache[session.id] = session
            if rt._active is not None and rt._active.id == session.id:
                rt._active.record = session
        touched = {s.id for s in sessions_taken} | set(events_by_session)
        for sid in touched:
            rt._emit(SyncApplied(session_id=sid, records=len(changes)))
        for ev in stream_events:
            rt._emit(ev)
        self._poke()
        return len(changes)

    async def _rebase(
        self, session_id: str, incoming: list[Event]
    ) -> tuple[list[Event], tuple[int, str], tuple[int, str], list[Event]]:
        """Merge canonical events into a session's log and rebase the provisional tail.

        Returns the rows to write, the new head of the whole log, the new canonical head and
        the events seen for the first time. The canonical chain is verified first, from the
        canonical head this device already holds; a chain that fails is refused (ChainError)
        and nothing of the page is applied. After the first page of a session only the
        provisional tail is read, not the whole log.
        """
        store = self._rt.store
        cached = self._canonical_heads.get(session_id)
        if cached is None:
            existing = await store.list_events(session_id)
            verified = sorted((e for e in existing if e.canonical), key=_seq)
            head = (verified[-1].sequence_number, verified[-1].row_hash) if verified else (0, "")
            tail = [e for e in existing if not e.canonical]
        else:
            head, verified = cached, []
            tail = [
                e
                for e in await store.list_events(session_id, from_sequence=cached[0] + 1)
                if not e.canonical
            ]
        # Pages may overlap (a live page and a pull): what is at or below the head is known.
        new = sorted((e for e in incoming if e.sequence_number > head[0]), key=_seq)
        contiguous = [e.sequence_number for e in new] == list(
            range(head[0] + 1, head[0] + 1 + len(new))
        )
        chain = verified + new
        report = verify_chain(chain, genesis=head[1] if cached else "")
        if not report.ok or not contiguous:
            index = report.first_bad_index if not report.ok else len(verified)
            raise ChainError(
                f"pulled event chain of session {session_id} does not verify at index "
                f"{index}: {report.reason or 'sequence numbers are not contiguous'}",
                index=index,
            )
        canonical_head = (new[-1].sequence_number, new[-1].row_hash) if new else head
        placed_ids = {e.id for e in new}
        fresh = [e for e in new if e.id not in {t.id for t in tail}]
        seq, prev = canonical_head
        out = list(new)
        for event in sorted((e for e in tail if e.id not in placed_ids), key=_seq):
            seq += 1
            placed = chain_event(event, prev, seq)
            prev = placed.row_hash
            if placed != event:
                out.append(placed)
        return out, (seq, prev), canonical_head, fresh


def _seq(event: Event) -> int:
    return event.sequence_number


def _conflict_event(receipt: ConflictReceipt) -> SyncConflict:
    return SyncConflict(
        session_id=receipt.session_id,
        conflict_id=receipt.conflict_id,
        fork_session_id=receipt.fork_session_id,
        winner=receipt.winner,
        conflicted_paths=receipt.conflicted_paths,
    )


def _as_error(frame: Frame) -> SyncError:
    from shared.errors import MalformedFrame, sync_error

    if isinstance(frame, Error):
        return sync_error(frame.code, frame.message, retryable=frame.retryable)
    return MalformedFrame(f"unexpected {type(frame).__name__}")


__all__ = [
    "FailedEntry",
    "OutboxFlushReceipt",
    "SyncConflictResolveReceipt",
    "SyncCoordinator",
    "SyncFacet",
    "SyncStatus",
]
