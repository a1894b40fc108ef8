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
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import websockets
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI
from websockets.extensions.permessage_deflate import ClientPerMessageDeflateFactory

from shared.aio import reap
from shared.compact import Bodies, inflated
from shared.errors import (
    ErrorCode,
    Forbidden,
    InvalidState,
    NotFound,
    PleachError,
    StorageUnavailable,
    SyncError,
)
from shared.idrefs import ID_REFS_SINCE, unresolved
from shared.merge import Resolution, resolve_conflicts
from shared.messages import (
    AS_PUSHED_SINCE,
    COMPACT_SINCE,
    DEFAULT_MAX_FRAME_BYTES,
    DEFLATED_SINCE,
    MAX_HEALTH_CONFLICTS,
    MAX_HEALTH_TEXT,
    MAX_PROTOCOL,
    MAX_SKIPPED,
    SKIPPED_SINCE,
    Changes,
    ConflictReceipt,
    Error,
    FeedBody,
    Frame,
    Health,
    HealthConflict,
    PushAck,
    Welcome,
)
from shared.protocol import Answer, ClientProtocol, Live, Notice
from shared.records import (
    AuditRow,
    Change,
    Event,
    FeedChange,
    Session,
)

from .apply import missing_content, plan_page
from .core import RemoteView, SessionChange
from .facets import Copy, copy_into
from .hydration import load_hydration
from .link import Link
from .receipts import (
    FailedEntry,
    FlushOutcome,
    OutboxFlushReceipt,
    Side,
    SyncConflictResolveReceipt,
)
from .store.base import OutboxEntry, TxReader, WriteBatch
from .syncplan import (
    FOLD_AFTER_PULL_EVENTS,
    RESYNC_DUE,
    Echo,
    ResyncLedger,
    Sent,
    echo_lands,
    echo_of,
    logs_to_fold,
    resync_ids,
    resync_text,
    settle,
    unsettled,
)

if TYPE_CHECKING:
    from .runtime import SessionRuntime

log = logging.getLogger("pleach.sync")

MAX_RECHAINS_PER_FLUSH = 3
"""How often one flush chains refused audit rows on from the server's place (3013) and goes
on; past that it stops and the next flush tries again (a server that keeps refusing cannot
make a device spin)."""
MAX_ECHOES = 64
"""The most acknowledged pushes whose own rows wait for the cursor to reach them; past that,
the device pulls them back instead."""
PUSHES_IN_FLIGHT = 4
"""How many pushes a flush sends before it waits for the first one's ack (``pipeline``): the
device reads and encodes the next while the server applies the one before. Each is at most a
batch and half a frame."""
IN_PLACE_PAGE = 1000
"""A page of at most this many changes (a pull's, at its default ``pull_limit``; a live one:
a turn is nine) is applied on the loop's thread, its reads and writes included
(``InPlace``): each of its store calls would cost a hop to the store's thread. A larger page
(a ``pull_limit`` raised past it) goes to that thread. A page of a catch-up was applied there
too, its write beside the decode of the next page, but the two threads contend for the GIL:
the write of a 1,000-change page took about 11 ms beside the decode where it takes 4.5 alone,
and each of the plan's reads (about ten a page) waited for the decode to let the loop run.
In place, a 100,000-change catch-up took 1.42-1.65 s against 1.88-2.34 s (three pairs); the
loop is held about 10 ms a page."""
HEALTH_MIN_INTERVAL_S = 1.0
"""A device tells the server its health at most this often..."""
HEALTH_HEARTBEAT_S = 30.0
"""...and at least this often while connected."""

SyncState = Literal["connected", "connecting", "offline", "needs-auth"]


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
    protocol: int | None = None
    """The protocol version agreed with the server on the open connection (None: none open).
    From 6, records travel as their stored bytes (see ``shared.messages``)."""


class SyncProgress(msgspec.Struct, kw_only=True):
    """How far a sync has come: ``phase`` "upload" counts changes sent of those queued at
    its start; "download" counts feed positions applied of those the server announced."""

    phase: Literal["upload", "download"]
    done: int
    total: int


ProgressCallback = Callable[[SyncProgress], None]


@dataclass
class _InFlight:
    """A push sent and not yet answered: its outbox entries, its changes, its request."""

    entries: list[OutboxEntry]
    changes: list[Change]
    request_id: int
    answer: asyncio.Future[Frame]


class SyncCoordinator:
    """The pure merge rule, public for hosts that push through their own channel."""

    @staticmethod
    def resolve_conflicts(local: Session, remote: Session) -> Resolution:
        return resolve_conflicts(local, remote)


class SyncFacet:
    """``runtime.sync``: connect, flush, pull, status, dead letters, conflicts."""

    def __init__(
        self,
        rt: SessionRuntime,
        *,
        batch_size: int = 200,
        pull_limit: int = 1000,
        backoff_initial: float = 0.2,
        backoff_max: float = 30.0,
        request_timeout: float = 30.0,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        live_grace: float = 1.0,
        pipeline: int = PUSHES_IN_FLIGHT,
        max_protocol: int = MAX_PROTOCOL,
    ) -> None:
        self._rt = rt
        self.max_protocol = max_protocol
        """The newest protocol version this device offers (a lower one pins it, e.g. while
        a fleet of servers is upgraded; the server picks the newest both speak)."""
        self._id_refs_failed = False
        """A connection ended because this device's id lists and the server's disagreed
        (protocol 7, ``shared.idrefs``): from then on this runtime offers protocol 6 at most,
        which sends every session row whole. A safety net: nothing is lost either way (the
        connection ends and what it carried is sent again), but a pair whose lists kept
        disagreeing would otherwise reconnect for ever."""
        self.pipeline = max(1, pipeline)
        self.fold_after_pull_events = FOLD_AFTER_PULL_EVENTS
        """A pull that brings a session this many events or more folds its log at the feed's
        end and keeps the fold, so that the session's first resume after it reads one row
        (``syncplan.logs_to_fold``); 0 turns it off."""
        self.live_grace = live_grace
        self.batch_size = batch_size
        self.pull_limit = pull_limit
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.request_timeout = request_timeout
        self.max_frame_bytes = max_frame_bytes
        self._url: str | None = None
        self._token: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._link: Link | None = None
        self._state: SyncState = "offline"
        self._uploading = False
        self._downloading = False
        self._last_error: str | None = None
        self._last_error_code: int | None = None
        self._last_synced_at: float | None = None
        self._dirty = False
        """A local commit since the last flush (or a timer's wake: flush whatever is queued)."""
        self._wake = asyncio.Event()
        """Set by a local commit, a live page (or a page that wants a pull) and the end of the
        connection's reader: the one event the loop waits on (``_wait_for_work``), so that
        each reaches it in one step of the event loop."""
        self._changed = asyncio.Condition()
        self._watchers = 0
        """Callers waiting on ``_changed`` (or about to): with none, ``_poke`` makes no task."""
        self._live: deque[Changes] = deque()
        self._flush_lock = asyncio.Lock()
        self._progress: ProgressCallback | None = None
        self._apply_lock = asyncio.Lock()
        self._head_cursor = 0
        self._auto = True
        self._retry_delay: float | None = None
        self._resync = ResyncLedger()  # messages taken sessions name and this device lacks
        self._cursor = 0  # this device's feed cursor as last written here (the store has it)
        self._pull_due = True  # pull at the next catch-up (a new connection, a gap...)
        # Whether the last flush left anything queued or refused (then every round flushes).
        self._queued_after_flush = True
        # Pushes whose own feed rows the acks described (protocol 5), not yet taken: each is
        # taken when the cursor reaches its start (``_take_echoes``).
        self._echoes: list[Echo] = []
        self._marked_synced = False
        self._reconnect_now = False
        self._failures = 0  # connection attempts that ended in an error
        self._issued = 0  # the highest client_seq known given out (re-read when exceeded)
        self._welcomed = 0  # connections that got as far as Welcome (the backoff starts over)
        self._server_seq = 0  # the server's last_seq of this device, as last told
        # The highest client_seq sent in a push whose outcome this device does not know (the
        # server's store failed under it, the answer never came): the server may hold it.
        self._unsure_through = 0
        # What this device last told the server of its health (the server's /status page).
        self._health_key: tuple[Any, ...] | None = None
        self._health_at = float("-inf")  # monotonic time of the last Health sent
        self._health_stale = False  # changed since, but sent less than a second ago
        self._dead_count: int | None = None  # cached; None: read it again
        self._last_flush: OutboxFlushReceipt | None = None
        self._conflicts: deque[ConflictReceipt] = deque(maxlen=MAX_HEALTH_CONFLICTS)

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
            await reap(task)
        self._set_state("offline")

    @property
    def server_url(self) -> str | None:
        """The server this runtime last connected to (None: never)."""
        return self._url

    @property
    def server_token(self) -> str | None:
        """The token it connected with (for ``rt.diagnostics``)."""
        return self._token

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
            last_synced_at=self._last_synced_at or _float(await store.get_meta("last_synced_at")),
            has_synced=(await store.get_meta("has_synced")) == "1",
            cursor=cursor,
            last_error=self._last_error,
            last_error_code=self._last_error_code,
            server_url=self._url,
            protocol=self._link.protocol.version if self._link is not None else None,
        )

    async def wait_for(self, predicate: Callable[[], bool], timeout: float = 30.0) -> bool:
        """Wait until ``predicate()`` holds, looked at again at each change of the sync loop's
        state (connecting, connected, an error, a page applied...); False when ``timeout``
        passes first. ``rt.sync.wait_for(lambda: rt.sync.connected)``, say."""
        try:
            with self._watching():
                async with asyncio.timeout(timeout), self._changed:
                    await self._changed.wait_for(predicate)
        except TimeoutError:
            return False
        return True

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
            with self._watching():
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
        """Pull from the stored cursor to the server's head; returns records applied.

        When a queued change may be on the server unacknowledged (a push was answered 3009,
        or its answer never came), the queue is flushed first: a page applied before the
        server says whether it holds the change could carry another device's version built on
        it, which this device would take for another copy of its file writing under its id.
        If the server still cannot say, ``StorageUnavailable`` (3009, retryable) is raised
        and nothing is applied."""
        link = self._require_link()
        if await self._unsettled():
            async with self._flush_lock:
                await self._flush()
            if await self._unsettled():
                raise StorageUnavailable(
                    "changes of this device may be on the server unacknowledged and the "
                    "server cannot yet say: pull again once it answers pushes"
                )
            link = self._require_link()
        return await self._pull(link)

    async def dead_letters(self) -> list[Any]:
        return list(await self._rt.store.dead_letters())

    async def retry_dead_letter(self, client_seq: int) -> int | None:
        """Queue a dead letter again (new client_seq, returned); None if unknown."""
        seq = await self._rt.store.retry_dead_letter(client_seq)
        self._dead_count = None
        self.notify_local_write()
        return seq

    async def discard_dead_letter(self, client_seq: int) -> bool:
        self._dead_count = None
        return await self._rt.store.discard_dead_letter(client_seq)

    async def sync_once(
        self,
        url: str,
        token: str,
        timeout: float = 30.0,
        *,
        on_progress: ProgressCallback | None = None,
    ) -> OutboxFlushReceipt:
        """Connect, flush, pull to the head, disconnect: one round for scripts and the CLI.

        ``on_progress`` is called with a ``SyncProgress`` after each pushed batch and each
        applied page (the CLI draws its progress bar from it).
        """
        failures = self._failures
        self._progress = on_progress
        await self.connect(url, token, auto=False)
        try:
            answered = await self.wait_for(
                lambda: self._state in ("connected", "needs-auth") or self._failures > failures,
                timeout,
            )
            if not answered:
                raise SyncError(f"no answer from {url} within {timeout:g} s")
            if self._state == "needs-auth":
                raise SyncError(self._last_error or "unauthorized")
            if self._state != "connected":
                raise SyncError(f"cannot sync with {url}: {self._last_error or 'unreachable'}")
            receipt = await self.flush_outbox()
            for _ in range(3):
                if self._link is not None:
                    break
                # The device took a new client id during the flush (its file was restored or
                # copied): the loop reconnects as the new id; flush again there.
                if not await self.wait_for(lambda: self._link is not None, timeout):
                    raise TimeoutError(f"no connection as the new id within {timeout:g} s")
                receipt = await self.flush_outbox()
            if receipt.pending_after and await self._unsettled():
                log.warning(
                    "sync: changes of this device may be on the server unacknowledged; the "
                    "pull waits until they settle (sync again)"
                )
            else:
                await self.pull()
            if self._link is not None:
                await self._report_health(self._link, receipt, force=True)
            self._last_synced_at = time.time()
            await self._rt.store.set_meta("has_synced", "1")
            await self._rt.store.set_meta("last_synced_at", repr(self._last_synced_at))
            return receipt
        finally:
            self._progress = None
            await self.disconnect()

    async def resolve_conflict(
        self, session_id: str, conflict_id: str, resolution: Side
    ) -> SyncConflictResolveReceipt:
        """Choose which branch of a conflict keeps the session id.

        ``"local"`` is this device's version, ``"remote"`` the other device's, as in the
        reference. (On a third device, which wrote neither, ``"local"`` is the version that
        was pushed last and ``"remote"`` the one the server held.) When the chosen side lost,
        the session and its fork swap contents (both as new versions), so every device
        converges on the choice. Works offline: the swap is queued.
        """
        core = self._rt.core
        await core.session(session_id)
        chosen = resolution
        resolution = await self._pusher_side(session_id, conflict_id, resolution)
        forks = [
            s
            for s in await self._rt.store.list_sessions()
            if s.conflict_id == conflict_id and s.forked_from == session_id
        ]
        if not forks:
            raise NotFound(f"no fork for conflict {conflict_id} of session {session_id}")
        fork_id = forks[0].id
        now = core.now()
        if forks[0].conflict_loser_side != resolution:
            return SyncConflictResolveReceipt(
                resolved=True,
                session_id=session_id,
                conflict_id=conflict_id,
                resolution=chosen,
                resolved_at=now,
                fork_session_id=fork_id,
            )
        flipped: Side = "remote" if resolution == "local" else "local"
        for _ in range(3):  # the rows may change while the copies are made: then again
            if await self._swap(session_id, fork_id, conflict_id, resolution, flipped):
                break
        else:
            raise InvalidState(f"session {session_id} kept changing; resolve again")
        return SyncConflictResolveReceipt(
            resolved=True,
            session_id=session_id,
            conflict_id=conflict_id,
            resolution=chosen,
            resolved_at=now,
            swapped=True,
            fork_session_id=fork_id,
        )

    async def _pusher_side(self, session_id: str, conflict_id: str, side: Side) -> Side:
        """``side`` as this device means it, in the pusher's terms (those of the fork's
        ``conflict_loser_side``): flipped when this device wrote the version the server held."""
        me = {self._rt.client_id, *await self._rt.core.previous_client_ids()}
        for event in await self._rt.store.list_events(session_id):
            if event.type != "sync.conflict" or not isinstance(event.payload, dict):
                continue
            if event.payload.get("conflict_id") != conflict_id:
                continue
            if event.payload.get("pushed_by") in me:
                return side
            if event.payload.get("stored_by") in me:
                return "remote" if side == "local" else "local"
        return side

    async def _swap(
        self, session_id: str, fork_id: str, conflict_id: str, resolution: Side, flipped: Side
    ) -> bool:
        """Swap the contents of a session and its fork, as copies (new ids) owned by the
        session that receives them: neither depends on the other's content afterwards, so a
        concurrent delete of one (on another device) cannot take what the other now shows.
        False when either row changed since the copies were made."""
        rt, core = self._rt, self._rt.core
        session, fork = await core.session(session_id), await core.session(fork_id)
        for_fork = await copy_into(
            rt, fork_id, session.state.message_ids, session.state.artifacts, kind="resolve"
        )
        for_session = await copy_into(
            rt, session_id, fork.state.message_ids, fork.state.artifacts, kind="resolve"
        )
        stale: list[bool] = []

        def swapped(
            current: Session | None, was: Session, other: Session, copy: Copy
        ) -> SessionChange | None:
            if current is None or current.deleted:
                raise NotFound(f"session {was.id} was deleted")
            if current.state != was.state or current.title != was.title:
                stale.append(True)
                return None
            # Marked as a resolve's: a delete of this session that never saw this version
            # must not take what came out of the other one (the server keeps it as a fork).
            state = msgspec.structs.replace(
                other.state,
                message_ids=copy.message_ids,
                artifacts=copy.artifact_ids,
                resolved={core.client_id: current.vv.get(core.client_id, 0)},
            )
            row = msgspec.structs.replace(
                current, title=other.title, state=state, head_checkpoint_id=copy.checkpoint.id
            )
            if current.id == fork_id:
                row = msgspec.structs.replace(row, conflict_loser_side=flipped)
                return SessionChange(row=row, records=copy.records)
            event = core.draft_event(
                session_id,
                "sync.conflict.resolved",
                {"conflict_id": conflict_id, "resolution": resolution, "fork_session_id": fork_id},
            )
            return SessionChange(row=row, records=copy.records, events=[event])

        def check(current: Session | None, was: Session) -> None:
            if current is None or current.deleted:
                raise NotFound(f"session {was.id} was deleted")
            if current.state != was.state or current.title != was.title:
                stale.append(True)

        await core.write(
            [
                (session_id, lambda current: check(current, session)),
                (fork_id, lambda current: check(current, fork)),
                (fork_id, lambda c: None if stale else swapped(c, fork, session, for_fork)),
                (session_id, lambda c: None if stale else swapped(c, session, fork, for_session)),
            ]
        )
        return not stale

    def notify_local_write(self) -> None:
        """Called by the runtime after every local commit: wakes the flusher."""
        self._dirty = True
        self._wake.set()

    # -- the background loop -----------------------------------------------------------------
    def _set_state(self, state: SyncState) -> None:
        self._state = state
        self._poke()

    @contextlib.contextmanager
    def _watching(self) -> Iterator[None]:
        """Around a wait on ``_changed``: from its first look at the state, the loop's pokes
        notify it (a poke before that changed what it then looks at)."""
        self._watchers += 1
        try:
            yield
        finally:
            self._watchers -= 1

    def _poke(self) -> None:
        if not self._watchers:
            return  # nobody waits: no task to notify nobody (a live page makes two or three)

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
            welcomed = self._welcomed
            try:
                await self._session()
                delay = self.backoff_initial
            except InvalidStatus as exc:
                status = exc.response.status_code
                reason = _refusal(bytes(exc.response.body or b""))
                self._error(
                    f"server refused the connection: HTTP {status}"
                    + (f": {reason}" if reason else ""),
                    ErrorCode.UNAUTHORIZED if status == 401 else None,
                )
                if status in (401, 403):
                    self._set_state("needs-auth")
                    return  # a new token is needed: connect() again with one
            except (OSError, ConnectionClosed, InvalidHandshake, TimeoutError) as exc:
                if self._reconnect_now:  # closed by this device when it took a new id
                    self._reconnect_now = False
                    self._link = None
                    continue
                self._error(f"offline: {type(exc).__name__}: {exc}")
            except InvalidURI as exc:
                self._error(f"bad server URL: {exc}")
                self._set_state("offline")
                return
            except TenantMismatch as exc:
                self._error(exc.message, int(exc.code))
                self._link = None
                self._set_state("needs-auth")
                return  # nothing was sent; the rows stay queued until connect() with a token
            except SyncError as exc:
                self._error(exc.message, int(exc.code))
                if exc.code == ErrorCode.MALFORMED_FRAME and unresolved(exc.message):
                    self._id_refs_failed = True
                    log.warning(
                        "sync: the server's id lists and this device's disagreed; this runtime "
                        "now sends every session row whole (protocol %d)",
                        ID_REFS_SINCE - 1,
                    )
            except PleachError as exc:  # a refused page (bad chain), a store failure...
                self._error(f"{type(exc).__name__}: {exc}")
            finally:
                self._link = None
            self._failures += 1
            self._set_state("offline")
            if self._welcomed > welcomed:
                delay = self.backoff_initial  # that connection worked: start over
            # Exponential backoff with full jitter, so a fleet does not reconnect in lockstep.
            await asyncio.sleep(random.uniform(0, delay))
            delay = min(delay * 2, self.backoff_max)

    async def _session(self) -> None:
        assert self._url is not None and self._token is not None
        rt = self._rt
        cursor = int(await rt.store.get_meta("cursor") or 0)
        self._cursor = cursor
        self._pull_due = True
        self._queued_after_flush = True  # a new connection flushes first, whatever is queued
        self._echoes.clear()
        self._health_key, self._health_at, self._health_stale = None, float("-inf"), False
        async with websockets.connect(
            self._url,
            additional_headers={"Authorization": f"Bearer {self._token}"},
            max_size=self.max_frame_bytes * 2,
            open_timeout=self.request_timeout,
            compression=None,
            extensions=[_deflate()],
        ) as ws:
            protocol = ClientProtocol(
                rt.client_id,
                cursor,
                max_frame_bytes=self.max_frame_bytes,
                max_protocol=(
                    min(self.max_protocol, ID_REFS_SINCE - 1)
                    if self._id_refs_failed
                    else self.max_protocol
                ),
                previous_client_ids=await rt.core.previous_client_ids(),
            )
            link = Link(ws, protocol)
            welcome_future = link.expect(protocol.hello_request_id)
            await link.flush_out()
            reader = asyncio.create_task(self._reader(link), name="pleach-sync-reader")
            reader.add_done_callback(lambda _: self._wake.set())
            try:
                async with asyncio.timeout(self.request_timeout):
                    welcome = await welcome_future
                if not isinstance(welcome, Welcome):
                    raise _as_error(welcome)
                mismatch = _tenant_mismatch(welcome, rt.org_id, rt.user_id)
                if mismatch is not None:
                    raise TenantMismatch(mismatch)
                self._head_cursor = welcome.head_cursor
                self._server_seq = welcome.last_seq
                self._unsure_through = 0  # the welcome says what the server holds
                # Queued rows at or below the server's last_seq are not dropped by number: a
                # copy of this device's file (a restored backup, a copied file) may have used
                # those numbers for other changes. The flush resends them and the server says,
                # change by change, whether it holds each (duplicate) or not (3012).
                if welcome.last_seq > await rt.store.last_client_seq():
                    log.warning(
                        "sync: the server knows client_seq %d of this device, which never gave "
                        "it out: another copy of this file has synced",
                        welcome.last_seq,
                    )
                self._link = link
                self._welcomed += 1
                self._resync.stored()  # (another process on this file may have stored ids)
                self._set_state("connected")
                if not self._auto:
                    await reader
                    raise ConnectionError("connection closed by the server")
                await self._catch_up(link)
                while True:
                    # Behind the head with nothing queued: the page is on its way live (our own
                    # push comes back that way); if it has not come within the grace, pull.
                    behind = self._cursor < self._head_cursor and not self._live
                    timeouts = [
                        self._retry_delay,
                        self.live_grace if behind else None,
                        self._health_wait(),
                    ]
                    timeout = min((t for t in timeouts if t is not None), default=None)
                    # Rows a push could not place (rate limited, store down) are retried after
                    # a growing delay, not only at the next local write.
                    if not await self._wait_for_work(timeout):
                        self._dirty = True
                        if behind:
                            self._pull_due = True
                    if reader.done():
                        reader.result()  # re-raises why the connection ended
                        raise ConnectionError("connection closed by the server")
                    await self._catch_up(link)
            finally:
                self._link = None
                try:
                    # Not a suppress(CancelledError): a disconnect() landing here must stop
                    # the loop, not be taken for the reader's own cancellation (shared.aio).
                    await reap(reader, ConnectionClosed)
                finally:
                    link.fail_all(ConnectionError("connection closed"))

    async def _wait_for_work(self, timeout: float | None) -> bool:
        """Wait until a local commit, a live page or the reader's end (``_wake``), for at most
        ``timeout`` seconds; whether one came."""
        if not self._wake.is_set():
            try:
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
            except TimeoutError:
                return False
        self._wake.clear()
        return True

    async def _catch_up(self, link: Link) -> None:
        # A live page alone (no local write since a flush that left nothing queued) needs no
        # flush: its outbox read would sit between the page and its apply. Anything queued,
        # unsure or refused keeps every round flushing until it is settled, and a loop that
        # wakes on its timers sets ``_dirty`` (another process's rows on this file go then).
        flush, self._dirty = self._dirty or self._queued_after_flush, False
        if flush:
            async with self._flush_lock:
                receipt = await self._flush()
            self._queued_after_flush = bool(receipt.pending_after or receipt.failed_entries)
        else:
            receipt = _none_pending()
        if receipt.pending_after and receipt.outcome != "all-flushed":
            last = self._retry_delay or self.backoff_initial / 2
            self._retry_delay = min(last * 2, self.backoff_max) * random.uniform(0.5, 1.0)
        else:
            self._retry_delay = None
        if receipt.pending_after and await self._unsettled():
            # Some queued change may already be on the server, unacknowledged (its ack was
            # lost and the resend failed): a page now may hold another device's version built
            # on it, which this device cannot tell from a copy of its file writing under the
            # same numbers. Apply nothing until the resend settles; then pull what was missed.
            self._live.clear()
            self._pull_due = True
            await self._report_health(link, receipt)
            self._poke()
            return
        while self._live:
            await self._take_echoes()  # a page of this device's own push first, if it is next
            frame = self._live.popleft()
            if frame.from_cursor > self._cursor:
                self._live.clear()  # a gap (or a "you fell behind" marker): pull instead
                self._pull_due = True
                break
            await self._apply(frame.changes, frame.to_cursor, frame.bodies)
        await self._take_echoes()
        if self._echoes:
            self._pull_due = True  # rows of others come before them, and not live: pull
        pull, self._pull_due = self._pull_due, False
        if pull:
            await self._pull(link)
        await self._report_health(link, receipt)
        self._last_synced_at = time.time()
        if not self._marked_synced:
            await self._rt.store.set_meta("has_synced", "1")
            self._marked_synced = True
        self._poke()

    async def _unsettled(self) -> bool:
        """Whether a queued change may be on the server unacknowledged (see ``unsettled``)."""
        first = await self._rt.store.outbox_pending(1)
        return unsettled(
            first[0].client_seq if first else None, self._server_seq, self._unsure_through
        )

    def _unsure(self, sent: list[OutboxEntry]) -> None:
        """``sent`` went out in a push whose outcome this device will not learn from it."""
        if sent:
            self._unsure_through = max(self._unsure_through, sent[-1].client_seq)

    # -- health ----------------------------------------------------------------------------
    def _health_wait(self) -> float:
        """Seconds until a Health frame is due: a held-back change after a second, else a
        heartbeat every ``HEALTH_HEARTBEAT_S``."""
        since = time.monotonic() - self._health_at
        due = HEALTH_MIN_INTERVAL_S if self._health_stale else HEALTH_HEARTBEAT_S
        return max(0.0, due - since)

    async def _report_health(
        self, link: Link, receipt: OutboxFlushReceipt, *, force: bool = False
    ) -> None:
        """Tell the server how this device's sync stands, when it changed (at most once a
        second) or every ``HEALTH_HEARTBEAT_S``. Costs no store read unless a flush
        dead-lettered something (the dead-letter count is cached)."""
        if receipt.outcome != "none-pending":
            self._last_flush = receipt
            self._conflicts.extend(receipt.conflicts)
            if receipt.failed_entries:
                self._dead_count = None
        if self._dead_count is None:
            self._dead_count = await self._rt.store.dead_letter_count()
        flush = self._last_flush
        error = self._last_error
        key = (
            receipt.pending_after,
            self._dead_count,
            self._cursor,
            None if flush is None else flush.flushed_at,
            error,
            len(self._conflicts),
        )
        since = time.monotonic() - self._health_at
        if not force and key == self._health_key and since < HEALTH_HEARTBEAT_S:
            return
        if not force and since < HEALTH_MIN_INTERVAL_S:
            self._health_stale = True  # the loop wakes to send it when the second is up
            return
        health = Health(
            pending=receipt.pending_after,
            dead_letters=self._dead_count,
            cursor=self._cursor,
            last_flush_at=None if flush is None else flush.flushed_at,
            last_flush_outcome="" if flush is None else flush.outcome,
            last_flushed=0 if flush is None else flush.flushed,
            last_error=None if error is None else error[:MAX_HEALTH_TEXT],
            last_error_code=self._last_error_code if error is not None else None,
            conflicts=[
                HealthConflict(
                    conflict_id=c.conflict_id[:64],
                    session_id=c.session_id[:64],
                    winner=c.winner,
                    fork_session_id=c.fork_session_id[:64],
                    detected_at=c.detected_at[:64],
                )
                for c in self._conflicts
            ],
            sent_at=time.time(),
        )
        if link.protocol.send_health(health):
            await link.flush_out()
        self._health_key = key
        self._health_at = time.monotonic()
        self._health_stale = False

    async def _reader(self, link: Link) -> None:
        try:
            await self._read_frames(link)
        finally:
            # Whoever waits for an answer learns the connection is gone, now.
            link.fail_all(ConnectionError("connection closed"))

    async def _read_frames(self, link: Link) -> None:
        async for data in link.ws:
            if isinstance(data, str):
                data = data.encode()
            link.protocol.receive_data(data)
            for event in link.protocol.take_events():
                match event:
                    case Live(changes=frame):
                        self._head_cursor = max(self._head_cursor, frame.to_cursor)
                        self._live.append(frame)
                        self._wake.set()
                    case Answer(request_id=request_id, frame=frame):
                        link.answer(request_id, frame)
                    case Notice(frame=frame):
                        self._error(frame.message, frame.code)
            await link.flush_out()
            if link.protocol.close_reason is not None:
                raise link.protocol.close_reason

    def _require_link(self) -> Link:
        if self._link is None:
            raise InvalidState("not connected: call connect() and wait for the connection")
        return self._link

    # -- identity -----------------------------------------------------------------------------
    async def _rekey(self, why: str, *, code: ErrorCode = ErrorCode.IDENTITY_REUSED) -> None:
        """Another copy of this device's file wrote under its client id (a restored backup, a
        copied file), or the server no longer knows the numbers before this device's queue:
        take a new id, renumber what is queued, and reconnect as the new id. Nothing queued is
        dropped; the server takes it all from the new id."""
        rt = self._rt
        old = rt.client_id
        # What is still queued is what the server does not hold (what it held was answered
        # ``duplicate`` and settled first: it comes earlier in the sequence).
        pending = await rt.store.outbox_count()
        new = await rt.core.rekey()
        self._issued = 0  # the queue was renumbered
        self._unsure_through = 0
        self._cursor = int(await rt.store.get_meta("cursor") or 0)
        message = (
            f"{why}: this device now syncs as a new device "
            f"(client id {new}, was {old}); its {pending} queued change(s) will be sent "
            "again under the new id"
        )
        log.warning("sync: %s", message)
        self._error(message, int(code))
        link, self._link = self._link, None
        if link is not None:  # it speaks for the old id: the loop reconnects as the new one
            self._reconnect_now = True
            await link.ws.close(code=1000, reason="client id changed")

    # -- push -------------------------------------------------------------------------------
    async def _flush(self) -> OutboxFlushReceipt:
        store = self._rt.store
        # The first batch is read before anything is counted: a queue shorter than a batch
        # (a turn or two, the live case) is counted by it, one store call fewer per flush.
        head = await store.outbox_pending(self.batch_size)
        pending_before = len(head) if len(head) < self.batch_size else await store.outbox_count()
        first: list[OutboxEntry] | None = head
        flushed = 0
        failed: list[FailedEntry] = []
        conflicts: list[ConflictReceipt] = []
        if pending_before == 0:
            return _none_pending()
        self._uploading = True
        self._poke()
        span = self._rt.spans.start(
            "pleach.sync.flush",
            kind="sync.flush",
            attributes={
                "pleach.org_id": self._rt.org_id,
                "pleach.user_id": self._rt.user_id,
                "pleach.client_id": self._rt.client_id,
                "pleach.pending": pending_before,
            },
        )
        rechains = 0
        drained = False
        # Pushes sent and not yet answered, oldest first: the next one goes out while the one
        # before it is applied on the server, so neither side waits on the other's work.
        window: deque[_InFlight] = deque()
        link = self._link
        read_all = False  # the last read reached the outbox's end, and all of it was sent
        saw_none = False  # the last read found nothing after the pushes sent
        try:
            while True:
                # Fill the window: each push starts after the last one sent. An outbox read to
                # its end is read again only once the window is empty (a live turn: two reads).
                while link is not None and self._link is link and len(window) < self.pipeline:
                    if window and (read_all or not self._past_the_server(window[0])):
                        break
                    after = window[-1].entries[-1].client_seq if window else 0
                    entries = (
                        first
                        if first is not None
                        else await store.outbox_pending(self.batch_size, after=after)
                    )
                    first = None
                    saw_none = not entries
                    if saw_none:
                        break
                    flight = await self._send_push(link, entries, span.traceparent)
                    window.append(flight)
                    read_all = len(entries) < self.batch_size and len(flight.entries) == len(
                        entries
                    )
                if not window:
                    if link is None:
                        entries = (
                            first
                            if first is not None
                            else await store.outbox_pending(self.batch_size)
                        )
                        failed.extend(
                            FailedEntry(
                                client_seq=e.client_seq,
                                code=None,
                                attempts=e.attempts,
                                message="offline: queued until the server is reachable",
                            )
                            for e in entries
                        )
                    else:
                        drained = saw_none and self._link is link  # nothing left to count
                    break
                flight = window.popleft()
                assert link is not None  # a push in flight went out on it
                try:
                    answer = await link.wait(flight.answer, self.request_timeout)
                except (ConnectionError, ConnectionClosed, TimeoutError) as exc:
                    entries = self._drop_window(link, flight, window)
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
                entries = flight.entries
                if isinstance(answer, Error):
                    self._drop_window(link, None, window)
                    if answer.code == ErrorCode.STORAGE_UNAVAILABLE:
                        self._unsure(entries)  # it may have failed after its commit
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
                    self._drop_window(link, None, window)
                    raise _as_error(answer)
                self._head_cursor = max(self._head_cursor, answer.head_cursor)
                progress, batch_conflicts, rechained, whole = await self._settle(
                    entries, answer, failed
                )
                if not whole:
                    # The server refused the pushes after it as a sequence gap: they go again
                    # from the oldest queued change, whose ack then settles them exactly.
                    self._drop_window(link, None, window, unsure=False)
                if (link.protocol.version or 0) >= AS_PUSHED_SINCE and self._link is link:
                    await self._expect_echo(flight.changes, answer)
                flushed += progress
                conflicts.extend(batch_conflicts)
                if self._progress is not None:
                    self._progress(SyncProgress(phase="upload", done=flushed, total=pending_before))
                if rechained and rechains < MAX_RECHAINS_PER_FLUSH and self._link is link:
                    rechains += 1
                    continue  # the refused audit rows go again, chained on from the server's
                if progress == 0 or self._link is not link or not whole:
                    # Nothing moved (a sequence gap: do not spin), the id changed, or changes
                    # stay queued (a clock ahead, a chain to mend): the next flush goes on.
                    self._drop_window(link, None, window, unsure=bool(window))
                    break
        finally:
            self._uploading = False
            self._poke()
            span.set(**{"pleach.flushed": flushed, "pleach.failed": len(failed)})
            span.end()
        pending_after = 0 if drained else await store.outbox_count()
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

    async def _send_push(self, link: Link, entries: list[OutboxEntry], trace: str) -> _InFlight:
        """Send a push of the longest prefix of ``entries`` that fits a frame, unanswered."""
        version = link.protocol.version or 0
        changes, skipped, bodies = _push_of(
            entries,
            self.max_frame_bytes // 2,
            version >= SKIPPED_SINCE,
            version >= COMPACT_SINCE,
            deflated=version >= DEFLATED_SINCE,
        )
        request_id, answer = await link.send(
            lambda: link.protocol.send_push(changes, trace=trace, skipped=skipped, bodies=bodies)
        )
        return _InFlight(entries[: len(changes) + len(skipped)], changes, request_id, answer)

    def _past_the_server(self, flight: _InFlight) -> bool:
        """Whether a push in flight starts past every number the server may hold of this
        device (its last word on them, and what went out unanswered): only then may more go
        out behind it. A push of numbers the server may hold (a lost ack resent, a copied
        file's) goes alone: its ack may say another copy writes under this id, and nothing
        more may go out under the id until the device has taken a new one (the server refuses
        new numbers under a reused id only within the push that shows it)."""
        first = flight.entries[0].client_seq
        return first > self._server_seq and first > self._unsure_through

    def _drop_window(
        self,
        link: Link | None,
        flight: _InFlight | None,
        window: deque[_InFlight],
        *,
        unsure: bool = True,
    ) -> list[OutboxEntry]:
        """Stop waiting for the pushes in ``window`` (and ``flight``); their entries stay
        queued and go again from the oldest. ``unsure``: the server may have applied them
        (``_unsure``: no page is applied until a resend settles them); not when the push
        before them kept a change, as the server then refused them as a sequence gap. Their
        entries, oldest first."""
        dropped = ([flight] if flight is not None else []) + list(window)
        window.clear()
        if link is not None:
            for each in dropped:
                link.forget(each.request_id)
        entries = [e for each in dropped for e in each.entries]
        if unsure:
            self._unsure(entries)
        return entries

    async def _settle(
        self, entries: list[OutboxEntry], ack: PushAck, failed: list[FailedEntry]
    ) -> tuple[int, list[ConflictReceipt], bool, bool]:
        """Apply one PushAck to the outbox (the decision is ``syncplan.settle``); also whether
        refused audit rows were chained on from the server's place (3013), and whether the
        push is settled whole (``Settlement.settled_all``: the pushes after it stand)."""
        store = self._rt.store
        self._server_seq = ack.last_seq
        self._unsure_through = 0  # the ack is exact, and its push began at the oldest queued
        # The highest client_seq this file gave out only grows with local writes, and what was
        # just sent was given out: the store is asked only when the server claims more than
        # that (another copy of this file, or writes since), not once a push.
        issued = self._issued = max(self._issued, max(e.client_seq for e in entries))
        if ack.last_seq > issued:
            issued = self._issued = await store.last_client_seq()
        plan = settle([Sent(e.client_seq, e.attempts) for e in entries], ack, issued)
        for client_seq, code, message in plan.dead:
            await store.outbox_dead_letter(client_seq, code, message)
        failed.extend(plan.failed)
        if plan.skew is not None:
            self._error(
                f"this device's clock is ahead of the server's ({plan.skew}); "
                f"{len(plan.keep)} change(s) stay queued and go once it is right",
                int(ErrorCode.CLOCK_SKEW),
            )
        if plan.remove:
            await store.outbox_remove(plan.remove)
        if plan.lost_numbers:
            await self._rekey(
                f"the server counts this device's changes only to client_seq {ack.last_seq}, "
                f"and the oldest still queued is {entries[0].client_seq}: it lost or never had "
                "the ones between (a server restored from a backup, another server, or this "
                "file opened as another user)",
                code=ErrorCode.SEQUENCE_GAP,
            )
        elif plan.rekey:
            await self._rekey(
                "this device's file was restored or copied: "
                + (
                    f"the server holds client_seq {ack.last_seq} of this device, which only "
                    f"ever gave out {issued}"
                    if ack.last_seq > issued
                    else "the server holds other changes under this device's client_seq numbers"
                )
            )
        elif plan.rechain is not None:
            rechained = await self._rechain(entries, plan.rechain)
            return plan.progress, plan.conflicts, rechained, False
        # A conflict's sync.conflict event is written by the server into the session's log:
        # this device, like every other, raises the stream event when the event arrives.
        return plan.progress, plan.conflicts, False, plan.settled_all

    async def _expect_echo(self, changes: list[Change], ack: PushAck) -> None:
        """Note what a version 5 ack says of the push's own feed rows, and take them now if
        the cursor is where they start. The server sends no live page of them to this device:
        rows the ack does not describe as pushed are pulled."""
        if all(result.cursor is None for result in ack.results):
            return  # the push wrote no feed row
        echo = echo_of(changes, ack)
        if echo is None or len(self._echoes) >= MAX_ECHOES:
            self._pull_due = True
            return
        self._echoes.append(echo)
        await self._take_echoes()

    async def _take_echoes(self) -> None:
        """Take the noted pushes whose rows start at the cursor, in order (``_echo``); forget
        those the cursor has passed (a pull read them back)."""
        while self._echoes:
            self._echoes = [e for e in self._echoes if e.to_cursor > self._cursor]
            echo = next((e for e in self._echoes if e.from_cursor == self._cursor), None)
            if echo is None:
                return
            self._echoes.remove(echo)
            if not await self._echo(echo):
                self._echoes.clear()
                self._pull_due = True
                return

    async def _echo(self, echo: Echo) -> bool:
        """Take a push's own rows as its ack described them, in one transaction: the cursor
        goes to ``echo.to_cursor`` and its events become canonical where they are. Decided
        under the write lock: only when the stored cursor is still at ``echo.from_cursor`` and
        every event is where the device placed it (``syncplan.echo_lands``); else nothing is
        written and the device pulls the rows back instead. Whether it was taken."""
        by_session: dict[str, list[Event]] = {}
        for event in echo.events:
            by_session.setdefault(event.session_id, []).append(event)

        async def plan(tx: TxReader, view: RemoteView) -> tuple[WriteBatch | None, bool]:
            if int(await tx.get_meta("cursor") or 0) != echo.from_cursor:
                return None, False
            for session_id, events in by_session.items():
                first = events[0].sequence_number
                start = max(1, first - 1)
                limit = len(events) + (first - start)
                held = await tx.event_places(session_id, from_sequence=start, limit=limit)
                if not echo_lands(events, held):
                    return None, False
                view.canonical_heads[session_id] = (events[-1].sequence_number, events[-1].row_hash)
            # Each is stored as pushed (its id, place and hashes checked): only its flag
            # changes, which the store writes from the stored bytes.
            batch = WriteBatch(
                canonical=[e.id for e in echo.events],
                outbox=False,
                meta={"cursor": str(echo.to_cursor)},
            )
            return batch, True

        in_place = len(echo.events) <= IN_PLACE_PAGE
        _, taken = await self._rt.core.transact_remote(plan, in_place=in_place)
        if taken:
            self._cursor = echo.to_cursor
            self._poke()
        return bool(taken)

    async def _rechain(self, entries: list[OutboxEntry], rechain: tuple[int, int, str]) -> bool:
        """The server refused a queued audit row for not continuing its chain where the server
        holds it (3013): chain the queued rows of that chain on from the server's place. Whether
        any moved."""
        client_seq, sequence_number, row_hash = rechain
        row = next((e.record for e in entries if e.client_seq == client_seq), None)
        if not isinstance(row, AuditRow):
            return False  # the server named a change that is no audit row: nothing to do
        moved = await self._rt.core.rechain_audit(row.client_id, (sequence_number, row_hash))
        log.info(
            "sync: the server holds the audit chain of %s up to place %d; %d queued row(s) "
            "chained on from there",
            row.client_id,
            sequence_number,
            moved,
        )
        return moved > 0

    # -- pull and apply ------------------------------------------------------------------------
    async def _pull(self, link: Link) -> int:
        """Pull and apply pages until the feed's end. One page ahead: the next page is asked
        for as soon as a page says there is more, so the server reads it (and the network
        carries it) while this device applies the one in hand. At most two pages are held; a
        page applied out of turn is a no-op (apply is idempotent, keyed by the cursor). A page
        asked on a link that an apply closed (the device took a new id) is dropped: the pull
        starts again on the new link, from the stored cursor."""
        applied = 0
        self._resync.pull_started()  # (a pass from the start is complete only within a pull)
        self._downloading = True
        self._poke()
        start = int(await self._rt.store.get_meta("cursor") or 0)
        span = self._rt.spans.start(
            "pleach.sync.pull",
            kind="sync.pull",
            attributes={
                "pleach.org_id": self._rt.org_id,
                "pleach.user_id": self._rt.user_id,
                "pleach.client_id": self._rt.client_id,
                "pleach.cursor": start,
            },
        )
        ahead: asyncio.Task[Frame] | None = None
        ahead_from = 0
        grown: Counter[str] = Counter()  # events this pull brought, by session
        try:
            while True:
                if ahead is None:
                    cursor = int(await self._rt.store.get_meta("cursor") or 0)
                    self._report_download(start, cursor)
                    answer = await self._ask_page(link, cursor)
                else:
                    cursor, answer, ahead = ahead_from, await ahead, None
                if isinstance(answer, Error):
                    self._error(answer.message, answer.code)
                    if answer.code == ErrorCode.CURSOR_TOO_OLD and cursor > 0:
                        # Cursor too old: resync from the start of the retained feed. Local
                        # applies are idempotent, so re-reading what we have costs only time.
                        await self._rt.store.set_meta("cursor", "0")
                        self._cursor = 0
                        continue
                    raise _as_error(answer)
                if not isinstance(answer, Changes):
                    raise _as_error(answer)
                self._head_cursor = max(self._head_cursor, answer.to_cursor)
                if answer.more:
                    ahead_from = answer.to_cursor
                    ahead = asyncio.ensure_future(self._ask_page(link, ahead_from))
                    # The request goes out now: a page's apply runs in place and may
                    # not give the loop a turn before it is done.
                    await asyncio.sleep(0)
                if answer.changes or answer.to_cursor > cursor:
                    applied += await self._apply(answer.changes, answer.to_cursor, answer.bodies)
                    grown.update(_event_sessions(answer.changes))
                    self._report_download(start, answer.to_cursor)
                if self._link is not link:
                    return applied  # the device took a new id: the new link pulls on
                if not answer.more and await self._wants_resync():
                    # A session this device took refers to messages it does not hold (it
                    # deleted their session before it learned of a fork that shares them):
                    # read the feed again from the start, once for those ids.
                    await self._rt.store.set_meta("cursor", "0")
                    self._cursor = 0
                    continue
                if not answer.more:
                    await self._keep_folds(grown)
                    return applied
        except BaseException as exc:
            span.error(exc)
            raise
        finally:
            if ahead is not None:  # an apply failed, a re-key, a cancel: drop the page ahead
                ahead.cancel()
                ahead.add_done_callback(_retrieved)
            self._downloading = False
            self._poke()
            span.set(**{"pleach.applied": applied, "pleach.to_cursor": self._cursor})
            span.end()

    async def _keep_folds(self, grown: Counter[str]) -> None:
        """Fold the logs this pull grew by ``fold_after_pull_events`` or more and keep the folds
        (``load_hydration``), at the feed's end: a session's first resume after a long pull then
        reads its fold instead of its whole log. A fold that fails is logged and left to that
        resume, which folds the log itself; the pull stands either way."""
        for session_id in logs_to_fold(grown, self.fold_after_pull_events):
            try:
                await load_hydration(self._rt.store, session_id)
            except PleachError as exc:
                log.warning(
                    "sync: the log of session %s was not folded after the pull (its next "
                    "resume folds it): %s",
                    session_id,
                    exc,
                )

    async def _ask_page(self, link: Link, cursor: int) -> Frame:
        return await link.request(
            lambda: link.protocol.send_pull(cursor, self.pull_limit), self.request_timeout
        )

    def _report_download(self, start: int, cursor: int) -> None:
        if self._progress is not None and cursor >= start:
            total = max(self._head_cursor, cursor) - start
            self._progress(SyncProgress(phase="download", done=cursor - start, total=total))

    async def _apply(
        self, changes: list[FeedChange], to_cursor: int, bodies: list[FeedBody] | None = None
    ) -> int:
        """Apply one page of remote changes in ONE local transaction with the cursor.

        Decided inside the write (``syncplan.decide_session`` and ``syncplan.rebase`` on the
        rows as they are under the lock), so a turn committing meanwhile is never
        overwritten and a page that a pull already overtook is a no-op. ``bodies``: the
        page's records as the bytes they came in (protocol 6), in order with ``changes``: a
        record stored as it came is stored in them, not encoded again. The ids a pass from the
        start of the feed under way looks for are kept through the page's delete cascade
        (``plan_page``'s ``wanted``).
        """
        rt = self._rt
        wanted = set(self._resync.passing)
        known = None
        if bodies and list(map(_CURSOR, bodies)) == list(map(_CURSOR, changes)):
            # (Paired by place as well as by order: each pair is one entry of the page.)
            known = Bodies.pairs(list(map(_RECORD, changes)), list(map(bytes, map(_BODY, bodies))))
        emitted: list[Any] = []

        missing: list[str] = []

        written: list[int] = []
        reused: list[bool] = []

        async def plan(tx: TxReader, view: RemoteView) -> tuple[WriteBatch | None, int]:
            cursor = int(await tx.get_meta("cursor") or 0)
            written[:] = [cursor]
            if to_cursor <= cursor and changes:
                return None, 0  # already applied (a live page that a pull overtook)
            batch = await plan_page(tx, view, changes, emitted, wanted)
            batch.bodies = known
            reused[:] = [view.identity_reused]
            written[:] = [max(to_cursor, cursor)]
            batch.meta = {**batch.meta, "cursor": str(written[0])}
            lacking = await missing_content(tx, view, batch)
            if lacking:  # stored with the page: a cancel or a crash after it cannot lose them
                stored = resync_ids(await tx.get_meta(RESYNC_DUE))
                batch.meta[RESYNC_DUE] = resync_text(stored | set(lacking))
                self._resync.stored()  # (before the commit: a cancel after it cannot skip it)
            missing[:] = lacking
            return batch, len(changes)

        # A page (a live one, or a pull's) is read and written in place (``InPlace``): see
        # ``IN_PLACE_PAGE``.
        in_place = len(changes) <= IN_PLACE_PAGE
        _, applied = await rt.core.transact_remote(plan, in_place=in_place)
        if written:
            self._cursor = written[0]
        if reused and reused[0]:
            await self._rekey(
                "this device's file was restored or copied: a page holds another version "
                "under this device's id and counter"
            )
        if self._resync.wants_look(missing):
            self._pull_due = True  # for a live page: the loop pulls, and resyncs, next
            self._wake.set()
        for event in emitted:
            rt.emit(event)
        self._poke()
        return int(applied)

    async def _wants_resync(self) -> bool:
        """At the end of the feed: whether to read it again from the start, for messages that
        taken sessions name and this device still lacks (a session row may arrive a page
        before its messages). ``ResyncLedger`` decides, on the ids the pages stored under
        ``RESYNC_DUE``: a pass is done once it reaches the end of the feed, so a pass cut
        short (a disconnect, a cancel, a crash) is made again by the next pull; a complete
        pass that could not find them (the server lost them too) is not repeated. The look-up
        and the ids kept stored are one transaction."""
        passing = sorted(self._resync.passing)
        unfound: list[str] = []
        if passing:  # (a complete pass: which of its ids it did not bring)

            async def lookup(tx: TxReader, view: RemoteView) -> tuple[None, None]:
                unfound[:] = await tx.missing_messages(passing)
                return None, None

            await self._rt.core.transact_remote(lookup)
        self._resync.end_of_feed(unfound)
        if not self._resync.maybe_stored:
            return False
        keep: set[str] = set()

        async def check(tx: TxReader, view: RemoteView) -> tuple[WriteBatch | None, None]:
            text = await tx.get_meta(RESYNC_DUE)
            due = self._resync.due(resync_ids(text))
            lacking = await tx.missing_messages(sorted(due)) if due else []
            keep.clear()
            keep.update(set(lacking) & due)
            kept = resync_text(keep)
            return (None if kept == (text or "") else WriteBatch(meta={RESYNC_DUE: kept})), None

        await self._rt.core.transact_remote(check)
        self._resync.start_pass(keep)
        if not keep:
            return False
        log.warning("sync: %d referenced message(s) missing here; resyncing", len(keep))
        return True


def _deflate() -> ClientPerMessageDeflateFactory:
    """The device's permessage-deflate: websockets' default offer, deflating at level 1 with
    zlib's full hash table, in the window the server allows (``pleach-server``: 4 KiB, its
    context kept across frames). A push of 1,000 changes (about 250 KB) deflates in about 2
    ms to under a third of its size, where websockets' default level in the 1 KiB window the
    server allowed before took 4-5 ms for under half."""
    return ClientPerMessageDeflateFactory(compress_settings={"level": 1, "memLevel": 8})


def _none_pending() -> OutboxFlushReceipt:
    """The receipt of a flush that found nothing queued."""
    return OutboxFlushReceipt(
        outcome="none-pending",
        flushed=0,
        failed_entries=[],
        flushed_at=time.time(),
        pending_before=0,
        pending_after=0,
    )


def _float(value: str | None) -> float | None:
    try:
        return float(value) if value else None
    except ValueError:
        return None


_CHANGE_ENCODER = msgspec.msgpack.Encoder()


class _Refusal(msgspec.Struct):
    message: str = ""


def _refusal(body: bytes | None) -> str:
    """The server's reason in a refused upgrade's JSON body (``token expired``...), or ""."""
    if not body:
        return ""
    try:
        return msgspec.json.decode(body, type=_Refusal).message[:200]
    except msgspec.DecodeError:
        return ""


_CURSOR, _RECORD, _BODY = attrgetter("cursor"), attrgetter("record"), attrgetter("body")

_BODY_OVERHEAD = 10
"""The bytes a ``ChangeBody`` adds to its record's (an array head and a client_seq)."""


def _push_of(
    entries: list[OutboxEntry],
    budget: int,
    skipping: bool,
    as_bodies: bool = False,
    *,
    deflated: bool = True,
) -> tuple[list[Change], list[int], list[bytes] | None]:
    """A push of the longest prefix of ``entries`` whose frame stays within ``budget`` bytes
    of changes (the first always, so a push frame stays under the server's frame limit
    however large the records): its changes, its ``skipped`` numbers, and, with
    ``as_bodies`` (the server speaks protocol 6) when every entry holds its stored bytes, the
    bytes of each change's record (None otherwise). Sizes are counted in the form sent:
    without ``deflated`` (a server before protocol 9), a body with its texts written out
    (``compact.inflated``, once a record), which may be many times its bytes, and the bodies
    given are those (``send_push`` finds nothing more to write out).

    With ``skipping`` (the server speaks protocol 4), an entry whose record is sent again
    later is skipped: a session queued once per turn refers to its one stored row (one object,
    ``outbox_entries``), which then goes once, at its last number, after the records it refers
    to, where it went once per queued turn. Each record counts once against the budget then.
    Later may be beyond this push (``OutboxEntry.again_later``): the row is its newest version,
    which names messages queued after this number, and must not reach the server before them
    (a fork the server makes of it would name messages it may never take).
    """
    as_bodies = as_bodies and all(e.body for e in entries)
    total = 0
    end = len(entries)
    counted: set[int] = set()
    sent: dict[int, bytes] = {}  # a record's body as it goes, by the record

    def body_sent(entry: OutboxEntry) -> bytes:
        body = sent.get(id(entry.record))
        if body is None:
            body = sent[id(entry.record)] = entry.body if deflated else inflated(entry.body)
        return body

    for count, entry in enumerate(entries):
        if skipping and (entry.again_later or id(entry.record) in counted):
            continue
        counted.add(id(entry.record))
        if as_bodies:
            total += len(body_sent(entry)) + _BODY_OVERHEAD
        else:
            total += len(
                _CHANGE_ENCODER.encode(Change(client_seq=entry.client_seq, record=entry.record))
            )
        if count and total > budget:
            end = count
            break
    prefix = entries[:end]
    plain = [Change(client_seq=e.client_seq, record=e.record) for e in prefix]
    body_of = {id(e.record): body_sent(e) for e in prefix} if as_bodies else {}

    def bodies(changes: list[Change]) -> list[bytes] | None:
        return [body_of[id(c.record)] for c in changes] if as_bodies else None

    if not skipping:
        return plain, [], bodies(plain)
    last = {id(e.record): e.client_seq for e in prefix if not e.again_later}
    changes = [c for c in plain if last.get(id(c.record)) == c.client_seq]
    skipped = [c.client_seq for c in plain if last.get(id(c.record)) != c.client_seq]
    if len(skipped) > MAX_SKIPPED:  # a batch larger than any default: sent whole instead
        return plain, [], bodies(plain)
    return changes, skipped, bodies(changes)


class TenantMismatch(Forbidden):
    """The token's tenant is not the one this device writes as (``Welcome`` said so)."""


def _tenant_mismatch(welcome: Welcome, org_id: str, user_id: str) -> str | None:
    """Why this device cannot sync with the token the server accepted, or None."""
    if not welcome.org_id and not welcome.user_id:
        return None  # an older server that does not say
    if (welcome.org_id, welcome.user_id) == (org_id, user_id):
        return None
    return (
        f"tenant mismatch: this device writes as org {org_id!r} user {user_id!r}, but the "
        f"token is for org {welcome.org_id!r} user {welcome.user_id!r}; nothing was sent and "
        "pending changes stay queued. Use a token for this device's user, or open the "
        "runtime with the token's user_id/org_id."
    )


def _event_sessions(changes: list[FeedChange]) -> Iterator[str]:
    """The session of each event a page carries."""
    return (c.record.session_id for c in changes if isinstance(c.record, Event))


def _retrieved(task: asyncio.Task[Any]) -> None:
    """Marks a dropped task's outcome as seen (a lost connection's error is the caller's)."""
    if not task.cancelled():
        task.exception()


def _as_error(frame: Frame) -> SyncError:
    from shared.errors import MalformedFrame, sync_error

    if isinstance(frame, Error):
        return sync_error(frame.code, frame.message, retryable=frame.retryable)
    return MalformedFrame(f"unexpected {type(frame).__name__}")


__all__ = [
    "FailedEntry",
    "OutboxFlushReceipt",
    "ProgressCallback",
    "SyncConflictResolveReceipt",
    "SyncCoordinator",
    "SyncFacet",
    "SyncProgress",
    "SyncStatus",
]
