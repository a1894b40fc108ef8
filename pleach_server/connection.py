"""One device connection: a thin pump around the sans-I/O ``ServerProtocol``.

The reader loop feeds each WebSocket message to ``ServerProtocol.receive_data`` and handles
the frames it yields (``Hello`` -> ``Welcome``, ``Push`` -> ``PushAck`` + fan-out, ``Pull`` ->
``Changes``). After ``Welcome`` the connection subscribes to the ``Hub`` and a writer task
drains its bounded queue of live frames. Both loops write through one ordered outbox, so
frames leave in the order the protocol produced them.

Every request frame gets exactly one answer, which echoes its ``request_id``: the result, or
an ``Error`` (refused by the rate limit, by the store, or by the protocol).

Failures map to the wire, never to a dead server:

- a ``SyncError`` from the store (``StorageUnavailable``, ``CursorTooOld``, ...) becomes an
  ``Error`` frame answering the request, and the connection stays open;
- a protocol violation the ``ServerProtocol`` deems fatal is sent as an ``Error`` frame, then
  the WebSocket closes with 1008 (1009 for a frame over ``max_frame_bytes``);
- anything unexpected is logged with its traceback, answered with a retryable
  ``StorageUnavailable`` ``Error`` and closes this one connection with 1011.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import msgspec
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed
from websockets.frames import CloseCode

from shared import compact
from shared.aio import reap
from shared.clock import HybridClock
from shared.errors import (
    FrameTooLarge,
    InvalidState,
    MalformedFrame,
    RateLimited,
    StorageError,
    StorageUnavailable,
    SyncError,
    Unauthorized,
)
from shared.messages import (
    AS_PUSHED_SINCE,
    CHAINS_CHECKED_SINCE,
    COMPACT_SINCE,
    DEFLATED_SINCE,
    MIN_PROTOCOL,
    SKIPPED_SINCE,
    ChangeResult,
    Changes,
    FeedBody,
    Health,
    Hello,
    Pull,
    Push,
    Welcome,
)
from shared.protocol import ServerProtocol, State
from shared.tracing import Spans

from .health import HealthReports
from .hub import Hub, Subscription
from .notify import Notifier
from .store.base import DeviceHealth, PushResult, ServerStore, Tenant, feed_changes

if TYPE_CHECKING:
    from .server import SyncMetrics

__all__ = ["Connection", "ConnectionContext", "InFlight", "TokenBucket"]

logger = logging.getLogger("pleach_server.connection")
_HEALTH_CODEC: Final = msgspec.msgpack.Encoder()
"""Encodes a device's health report for its row (shared: an encoder keeps no state between
calls, and each connection's own was one more object for the collector to walk)."""

FLOOD_CLOSE_AFTER = 100
HEALTH_MIN_INTERVAL_S = 0.5
"""Health frames closer together than this (per connection) are dropped, not written."""
"""Frames refused in a row (3008) after which a connection is closed (1008)."""

# A WebSocket close reason must fit in a control frame (123 bytes of UTF-8).
_MAX_CLOSE_REASON = 120


class TokenBucket:
    """A token bucket: ``rate`` tokens per second, holding at most ``burst``.

    ``allow()`` spends one token and says whether there was one. ``clock`` is injectable
    for tests (seconds, monotonic).
    """

    def __init__(
        self, rate: float, burst: float, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError(f"rate must be > 0 and burst >= 1, got {rate}, {burst}")
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._tokens = burst
        self._stamp = clock()

    def allow(self, cost: float = 1.0) -> bool:
        """Spend ``cost`` tokens if there are that many (a cost above ``burst`` is allowed
        when the bucket is full, so one large item is never refused for ever)."""
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now
        cost = min(cost, self.burst)
        if self._tokens >= cost:
            self._tokens -= cost
            return True
        return False


class InFlight:
    """Counts operations that a graceful shutdown must let finish (pushes, with their ack)."""

    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        self.count += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.count -= 1
            if self.count == 0:
                self._idle.set()

    async def wait_idle(self) -> None:
        """Return once nothing is in flight."""
        await self._idle.wait()


@dataclass(eq=False, kw_only=True)
class ConnectionContext:
    """What every connection of one server shares. Built by ``SyncServer``."""

    store: ServerStore
    hub: Hub
    notifier: Notifier
    clock: HybridClock
    server_id: str
    metrics: SyncMetrics
    spans: Spans
    health: HealthReports
    max_frame_bytes: int
    max_pull_limit: int
    max_pull_bytes: int
    rate_limit_per_s: float | None
    rate_limit_burst: float
    inflight: InFlight = field(default_factory=InFlight)
    draining: bool = False
    tenant_rate_limit_per_s: float | None = None
    tenant_rate_limit_burst: float = 1.0
    rate_limit_bytes_per_s: float | None = None
    source_rate_limit_per_s: float | None = None
    source_rate_limit_burst: float = 1.0
    tenant_store_slots: int | None = 2
    _tenant_buckets: dict[Tenant, TokenBucket] = field(default_factory=dict)
    _source_buckets: dict[str, TokenBucket] = field(default_factory=dict)
    _tenant_slots: dict[Tenant, tuple[asyncio.Semaphore, list[int]]] = field(default_factory=dict)

    @contextlib.asynccontextmanager
    async def store_slot(self, tenant: Tenant) -> AsyncIterator[None]:
        """Hold one of the tenant's store slots here while its push or pull runs.

        The store is shared (SQLite's one writer; a PostgreSQL pool): without a bound, one
        tenant with many connections queues many operations in front of everyone else's. A
        tenant's pushes are serialized by its lock in the store anyway, so the bound costs it
        little, and another tenant's push waits behind at most that many of its operations.
        (Two, not one: a push whose connection died may still hold its slot while the device's
        resend comes in on a new connection.)
        """
        if self.tenant_store_slots is None:
            yield
            return
        entry = self._tenant_slots.get(tenant)
        if entry is None:
            entry = (asyncio.Semaphore(self.tenant_store_slots), [0])
            self._tenant_slots[tenant] = entry
        semaphore, users = entry
        users[0] += 1
        try:
            async with semaphore:
                yield
        finally:
            users[0] -= 1
            if users[0] == 0:
                del self._tenant_slots[tenant]  # nobody waits: no state kept per idle tenant

    def tenant_bucket(self, tenant: Tenant) -> TokenBucket | None:
        """The tenant's shared token bucket here (None: no per-tenant limit). At most 10,000
        tenants' buckets are kept; the oldest is dropped first (a fresh bucket is full)."""
        return _shared_bucket(
            self._tenant_buckets,
            tenant,
            self.tenant_rate_limit_per_s,
            self.tenant_rate_limit_burst,
        )

    def source_bucket(self, source: str) -> TokenBucket | None:
        """The bucket shared by every connection from one network address, whatever tenants
        they authenticate as (None: no per-source limit); kept like ``tenant_bucket``'s."""
        return _shared_bucket(
            self._source_buckets,
            source,
            self.source_rate_limit_per_s,
            self.source_rate_limit_burst,
        )

    async def fan_out(
        self,
        tenant: Tenant,
        from_cursor: int,
        to_cursor: int,
        *,
        local: bool,
        pushed: PushResult | None = None,
        origin: Subscription | None = None,
    ) -> None:
        """Publish the tenant's feed page ``(from_cursor, to_cursor]`` to its devices here.

        ``from_cursor`` must be a head of the tenant read BEFORE the commit (cursors are not
        contiguous per tenant), so the page read here is complete. Reads it once, whatever
        the number of devices, unless ``pushed`` (the push that committed the page) holds
        the whole page: its rows directly follow ``from_cursor`` and fit one page. ``local``
        commits are also announced to the other instances. Never raises for a store failure:
        it publishes an empty marker at ``to_cursor`` instead, so devices pull to catch up.
        ``origin``: the pushing device's subscription, left out (protocol 5: it takes its own
        rows from the acknowledgement, or pulls them).
        """
        whole = _whole_page(
            pushed, from_cursor, to_cursor, self.max_pull_limit, self.max_pull_bytes
        )
        if whole and self.hub.subscribers(tenant):
            assert pushed is not None
            bodies = [
                FeedBody(c.cursor, msgspec.Raw(b))
                for c, b in zip(pushed.feed, pushed.bodies, strict=True)
            ]
            self.hub.publish(
                tenant, from_cursor, to_cursor, pushed.feed, bodies=bodies, skip=origin
            )
        elif self.hub.subscribers(tenant):
            limit = max(1, min(to_cursor - from_cursor, self.max_pull_limit))
            try:
                page = await self.store.pull(
                    tenant, from_cursor, limit, self.max_pull_bytes, raw=True
                )
            except (SyncError, StorageError) as exc:
                logger.warning(
                    "fan-out read of %s (%d, %d] failed: %s", tenant, from_cursor, to_cursor, exc
                )
                self.hub.publish(tenant, to_cursor, to_cursor, [], skip=origin)
            else:
                if page.bodies:
                    self.hub.publish(
                        tenant, from_cursor, page.to_cursor, [], bodies=page.bodies, skip=origin
                    )
                if page.to_cursor < to_cursor:
                    # Page cut short (limit): tell devices there is more to pull.
                    self.hub.publish(tenant, to_cursor, to_cursor, [], skip=origin)
        if local:
            try:
                await self.notifier.publish(tenant, from_cursor, to_cursor)
            except (SyncError, StorageError, OSError) as exc:
                # Best effort: other instances' devices catch up on their next pull.
                logger.warning("notifier publish for %s failed: %s", tenant, exc)


def _bodies_of(push: Push) -> list[bytes]:
    """The bytes each of ``push``'s changes came in (protocol 6), in order; none when they
    are not one for one (the protocol makes them so: this only guards the pairing)."""
    if [b.client_seq for b in push.bodies] != [c.client_seq for c in push.changes]:
        return []
    return [bytes(b.body) for b in push.bodies]


def _whole_page(
    pushed: PushResult | None, from_cursor: int, to_cursor: int, limit: int, max_bytes: int
) -> bool:
    """Whether ``pushed`` holds the tenant's whole feed page ``(from_cursor, to_cursor]``, as
    a pull of ``limit`` rows and ``max_bytes`` would return it: its rows directly follow
    ``from_cursor`` (no other commit of the tenant came between) and fit one page."""
    if pushed is None or not pushed.feed or pushed.previous_head != from_cursor:
        return False
    if pushed.feed[-1].cursor != to_cursor or len(pushed.feed) > limit:
        return False
    if len(pushed.feed) == 1:
        return True  # a page always holds its first row, whatever its size
    return sum(map(len, pushed.bodies)) <= max_bytes  # as a pull counts: the stored bytes


def _shared_bucket(
    table: dict[Any, TokenBucket], key: Any, rate: float | None, burst: float
) -> TokenBucket | None:
    """The bucket of ``key`` in ``table`` (an LRU of at most 10,000), made when missing."""
    if rate is None:
        return None
    bucket = table.pop(key, None)
    if bucket is None:
        bucket = TokenBucket(rate, max(1.0, burst))
        while len(table) >= 10_000:
            table.pop(next(iter(table)))
    table[key] = bucket  # most recently used last
    return bucket


def written_out(
    bodies: list[FeedBody], to_cursor: int, more: bool, budget: int
) -> tuple[list[FeedBody], int, bool]:
    """A pull page for a device before protocol 9: its bodies with their texts written out
    (``compact.inflated``), cut after the last body that keeps them within ``budget`` bytes
    (the first is kept whatever its size), its end and ``more`` moved to the cut. A page is
    made to its budget in stored bytes, and a deflated text may hold up to 16 times its
    bytes: written out whole, a page could pass the frame limit such a device reads."""
    out: list[FeedBody] = []
    total = 0
    for item in bodies:
        body = compact.inflated(item.body)
        total += len(body)
        if out and total > budget:
            return out, out[-1].cursor, True
        out.append(item if body is item.body else FeedBody(item.cursor, msgspec.Raw(body)))
    return out, to_cursor, more


class Connection:
    """One authenticated device connection. ``await run()`` serves it until it closes.

    ``run`` never raises for anything the peer or the store does; it returns when the
    WebSocket is closed.
    """

    def __init__(
        self,
        ws: ServerConnection,
        tenant: Tenant,
        ctx: ConnectionContext,
        *,
        expires: float | None = None,
    ) -> None:
        self.ws = ws
        self.tenant = tenant
        self.ctx = ctx
        self.expires = expires  # when the token it authenticated with expires (epoch s)
        self.protocol = ServerProtocol(max_frame_bytes=ctx.max_frame_bytes)
        self.subscription: Subscription | None = None
        self.client_id: str | None = None
        self.aliases: frozenset[str] = frozenset()  # the device's earlier client ids
        self._limiter = (
            TokenBucket(ctx.rate_limit_per_s, ctx.rate_limit_burst)
            if ctx.rate_limit_per_s is not None
            else None
        )
        # One bucket for all of a tenant's connections here: opening more connections does
        # not buy a tenant more of the server than its share.
        self._tenant_limiter = ctx.tenant_bucket(tenant)
        # And one for all connections from one address, whatever tokens they hold: many
        # accounts from one machine get no more than one source's share.
        remote = ws.remote_address
        self._source_limiter = ctx.source_bucket(
            str(remote[0]) if isinstance(remote, tuple) and remote else "unknown"
        )
        self._byte_limiter = (
            TokenBucket(ctx.rate_limit_bytes_per_s, 2.0 * ctx.max_frame_bytes)
            if ctx.rate_limit_bytes_per_s is not None
            else None
        )
        self._refused_in_a_row = 0
        self._health_at = float("-inf")
        # Encoded frames waiting to be written, with their type for metrics. Reader and
        # writer both append; whoever holds the send lock writes them all, in order.
        self._outbox: deque[tuple[str, bytes]] = deque()
        self._send_lock = asyncio.Lock()
        self._writer: asyncio.Task[None] | None = None
        self._expiring: asyncio.Task[None] | None = None  # (the close, once the token expired)
        self._internal_error = False

    def __repr__(self) -> str:
        return f"<Connection {self.tenant.org_id}/{self.tenant.user_id} {self.client_id}>"

    # -- lifecycle ---------------------------------------------------------------------

    async def run(self) -> None:
        metrics = self.ctx.metrics
        metrics.connections.inc()
        # The token's expiry as a timer, not a task waiting: no task, coroutines and future
        # held for the connection's life (a full collection of the server walks each; see
        # ``pleach_server.gcpauses``). The close runs as a task once it fires.
        timer = (
            asyncio.get_running_loop().call_later(
                max(0.0, self.expires - time.time()), self._token_expired
            )
            if self.expires is not None
            else None
        )
        try:
            await self._read_loop()
        except ConnectionClosed:
            pass  # the peer went away (or we closed): nothing left to answer
        except Exception:
            logger.exception("%r failed", self)
            await self._abort(CloseCode.INTERNAL_ERROR, "internal server error")
        finally:
            if timer is not None:
                timer.cancel()
            expiring, self._expiring = self._expiring, None
            if expiring is not None:
                await reap(expiring)
            await self._stop_writer()
            metrics.connections.dec()

    def _token_expired(self) -> None:
        self._expiring = asyncio.create_task(self._expire(), name="pleach-token-expiry")

    async def _expire(self) -> None:
        """When the token expires, so does the connection: an ``Error`` 3001 (the device asks
        for a new token), then a close. An open connection is not a way around expiry."""
        self.protocol.fail(Unauthorized("token expired: reconnect with a new token"))
        self._take("error")
        with contextlib.suppress(ConnectionClosed):
            await self._flush()
        await self._abort(CloseCode.POLICY_VIOLATION, "token expired")

    async def _stop_writer(self) -> None:
        if self.subscription is not None:
            self.subscription.close()
        writer, self._writer = self._writer, None
        if writer is not None:
            # It may be blocked writing to a device that stopped reading: cancel it.
            await reap(writer)

    async def _abort(self, code: int, reason: str) -> None:
        """Close the WebSocket, swallowing only "already closed"."""
        with contextlib.suppress(ConnectionClosed):
            await self.ws.close(code, _close_reason(reason))

    # -- reader ------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        protocol = self.protocol
        received = self.ctx.metrics.frames_received
        async for message in self.ws:
            if isinstance(message, str):
                received.labels("text").inc()
                self._fail(MalformedFrame("text frames are not accepted; send binary msgpack"))
            elif not self._allowed(len(message)):
                self._refused_in_a_row += 1
                if self._refused_in_a_row > FLOOD_CLOSE_AFTER:
                    # A peer that ignores 3008 and goes on sending is cut: every frame it
                    # sends costs inflating and reading, answered or not.
                    received.labels("rate_limited").inc()
                    await self._abort(CloseCode.POLICY_VIOLATION, "flooding: frames ignored 3008")
                    return
                received.labels("rate_limited").inc()
                # Answered, not processed: the Error echoes the request id, if readable.
                error = RateLimited("too many frames; slow down and resend")
                protocol.refuse(message, error)
                self._take("error")
                self.ctx.metrics.errors.labels(str(int(error.code))).inc()
            else:
                self._refused_in_a_row = 0
                ignored = protocol.ignored_frames
                protocol.receive_data(message)
                if self._take("error"):  # receive_data only ever queues Error frames
                    reason = protocol.close_reason
                    # Non-fatal decode failures are always malformed frames.
                    code = reason.code if reason is not None else MalformedFrame.code
                    self.ctx.metrics.errors.labels(str(int(code))).inc()
                events = protocol.events_received()
                if protocol.ignored_frames > ignored:
                    received.labels("ignored").inc()
                elif not events:
                    received.labels("invalid").inc()
                for event in events:
                    received.labels(type(event).__name__.lower()).inc()
                    if protocol.state is not State.CLOSING:
                        await self._handle(event)
            await self._flush()
            if protocol.state is State.CLOSING:
                await self._close_for_protocol_error()
                return

    async def _close_for_protocol_error(self) -> None:
        reason = self.protocol.close_reason
        if self._internal_error:
            code = CloseCode.INTERNAL_ERROR
        elif isinstance(reason, FrameTooLarge):
            code = CloseCode.MESSAGE_TOO_BIG
        else:
            code = CloseCode.POLICY_VIOLATION
        message = reason.message if reason is not None else "protocol error"
        logger.info("%r closing (%d): %s", self, code, message)
        await self._abort(code, message)

    async def _handle(self, event: Hello | Push | Pull | Health) -> None:
        """Answer one frame. Queues the answer (or an ``Error``); the caller flushes."""
        request_id = event.request_id
        try:
            match event:
                case Hello():
                    await self._on_hello(event)
                case Push():
                    await self._on_push(event)
                case Pull():
                    await self._on_pull(event)
                case Health():
                    self._on_health(event)
                case _:
                    # ServerProtocol only yields the three above; guard against drift.
                    raise InvalidState(f"unexpected event {type(event).__name__}")
        except SyncError as exc:
            self._fail(exc, request_id=request_id)
        except StorageError as exc:
            logger.warning("%r: store failed: %s", self, exc)
            self._fail(StorageUnavailable(str(exc), retryable=exc.retryable), request_id=request_id)
        except ConnectionClosed:
            raise
        except Exception:
            # A bug, not the peer's fault: log it, tell the device to retry, and drop only
            # this connection (the reader loop sees CLOSING and closes with 1011).
            logger.exception("%r: unexpected error handling %s", self, type(event).__name__)
            self._internal_error = True
            self.protocol.fail(
                StorageUnavailable("internal server error", retryable=True), request_id=request_id
            )
            self._take("error")
            self.ctx.metrics.errors.labels(str(int(StorageUnavailable.code))).inc()

    async def _on_hello(self, hello: Hello) -> None:
        if not hello.client_id:
            self.protocol.fail(
                MalformedFrame("Hello needs a client_id"), request_id=hello.request_id
            )
            self._take("error")
            return
        ctx = self.ctx
        last_seq, head = await ctx.store.client_state(self.tenant, hello.client_id)
        self.protocol.send_welcome(
            Welcome(
                server_id=ctx.server_id,
                head_cursor=head,
                last_seq=last_seq,
                server_hlc=ctx.clock.now(),
                org_id=self.tenant.org_id,
                user_id=self.tenant.user_id,
            )
        )
        self.client_id = hello.client_id
        self.aliases = frozenset(hello.previous_client_ids) - {hello.client_id}
        self._take("welcome")
        # Welcome goes out before any live frame: subscribe only once it is written. A commit
        # in between is not lost: the device pulls from its cursor after Welcome.
        await self._flush()
        self.subscription = ctx.hub.subscribe(self.tenant)
        ctx.hub.note_head(self.tenant, head)
        self._writer = asyncio.create_task(
            self._write_loop(self.subscription), name=f"pleach-writer-{hello.client_id}"
        )

    async def _on_push(self, push: Push) -> None:
        ctx = self.ctx
        assert self.client_id is not None  # ServerProtocol yields Push only after Hello
        if ctx.draining:
            raise StorageUnavailable("server is shutting down; reconnect and push again")
        with ctx.inflight.track():
            # The tenant's head before this commit: the live frame starts there. Feed cursors
            # are shared by all tenants, so it is not min(cursors) - 1.
            before = ctx.hub.head(self.tenant)
            if before is None:
                before = await ctx.store.head_cursor(self.tenant)
            started = time.perf_counter()
            async with ctx.store_slot(self.tenant):
                result = await self._push_in_slot(push)
            ctx.metrics.push_seconds.observe(time.perf_counter() - started)
            self._count_results(result.results)
            # Version 5: the ack says when the push's rows are its changes as pushed, and its
            # own live page is not sent to it (it takes the rows from the ack, or pulls).
            echoes = (self.protocol.version or MIN_PROTOCOL) >= AS_PUSHED_SINCE
            # The other devices hear of it first (a change reaching them is the latency that
            # counts; the pusher's ack follows at once), and whatever becomes of the pusher's
            # socket: committed is committed.
            if result.cursors:
                await asyncio.shield(
                    ctx.fan_out(
                        self.tenant,
                        before,
                        max(result.cursors),
                        local=True,
                        pushed=result,
                        origin=self.subscription if echoes else None,
                    )
                )
            self.protocol.send_push_ack(
                result.results,
                result.last_seq,
                result.head_cursor,
                request_id=push.request_id,
                as_pushed_from=result.previous_head if echoes and result.as_pushed else None,
            )
            self._take("push_ack")
            await self._flush()

    async def _push_in_slot(self, push: Push) -> PushResult:
        ctx = self.ctx
        assert self.client_id is not None
        with ctx.spans.span(
            "pleach.server.push",
            kind="server.push",
            traceparent=push.trace,
            attributes={
                "pleach.org_id": self.tenant.org_id,
                "pleach.user_id": self.tenant.user_id,
                "pleach.client_id": self.client_id,
                "pleach.changes": len(push.changes) + len(push.skipped),
                "pleach.skipped": len(push.skipped),
            },
        ) as span:
            version = self.protocol.version or MIN_PROTOCOL
            result = await ctx.store.push(
                self.tenant,
                self.client_id,
                push.changes,
                ctx.clock,
                aliases=self.aliases,
                chains=version >= CHAINS_CHECKED_SINCE,
                skipped=push.skipped if version >= SKIPPED_SINCE else (),
                bodies=_bodies_of(push),
            )
            span.set(
                **{
                    "pleach.applied": sum(r.status == "applied" for r in result.results),
                    "pleach.rejected": sum(r.status == "rejected" for r in result.results),
                    "pleach.last_seq": result.last_seq,
                }
            )
        return result

    def _on_health(self, health: Health) -> None:
        """Keep the device's latest health (``pleach_server.health`` writes it within a
        second, with every other report of that second; more than one report in
        ``HEALTH_MIN_INTERVAL_S`` are dropped: a device sends one a second at most)."""
        assert self.client_id is not None  # ServerProtocol yields Health only after Hello
        now = time.monotonic()
        if now - self._health_at < HEALTH_MIN_INTERVAL_S:
            self.ctx.metrics.frames_received.labels("health_dropped").inc()
            return
        self._health_at = now
        # The version this connection agreed, never the device's word for it.
        health = msgspec.structs.replace(health, protocol=self.protocol.version or 0)
        body = _HEALTH_CODEC.encode(health)
        self.ctx.health.put(DeviceHealth.of(self.tenant, self.client_id, body, time.time()))

    def _count_results(self, results: list[ChangeResult]) -> None:
        metrics = self.ctx.metrics
        # One counter step per status, not per change (a labelled step is a lookup and a
        # lock in prometheus_client: about 4 us, which a push of 200 paid 200 times).
        statuses = Counter(item.status for item in results)
        applied = statuses["applied"] + statuses["resolved"]
        if applied:
            metrics.push_rate.add(applied)
        for status, count in statuses.items():
            metrics.changes.labels(status).inc(count)
        conflicts = sum(item.conflict is not None for item in results)
        if conflicts:
            metrics.conflicts.inc(conflicts)

    async def _on_pull(self, pull: Pull) -> None:
        if not 0 <= pull.cursor < 2**63:
            raise MalformedFrame(f"cursor must be between 0 and 2^63 - 1, got {pull.cursor}")
        limit = max(1, min(pull.limit, self.ctx.max_pull_limit))
        with self.ctx.spans.span(
            "pleach.server.pull",
            kind="server.pull",
            attributes={
                "pleach.org_id": self.tenant.org_id,
                "pleach.user_id": self.tenant.user_id,
                "pleach.client_id": self.client_id or "",
                "pleach.cursor": pull.cursor,
            },
        ) as span:
            raw = self._speaks_bodies
            async with self.ctx.store_slot(self.tenant):
                page = await self.ctx.store.pull(
                    self.tenant, pull.cursor, limit, self.ctx.max_pull_bytes, raw=raw
                )
            bodies, to_cursor, more = page.bodies, page.to_cursor, page.more
            if raw and self._writes_texts_out:
                bodies, to_cursor, more = written_out(
                    bodies, to_cursor, more, self.ctx.max_pull_bytes
                )
            size = len(bodies) if raw else len(page.changes)
            span.set(**{"pleach.changes": size, "pleach.to_cursor": to_cursor})
        self.protocol.send_changes(
            pull.cursor,
            to_cursor,
            page.changes,
            more=more,
            request_id=pull.request_id,
            bodies=bodies if raw else None,
        )
        self._take("changes")

    @property
    def _speaks_bodies(self) -> bool:
        """Whether the device takes records as their stored bytes (protocol 6)."""
        return (self.protocol.version or MIN_PROTOCOL) >= COMPACT_SINCE

    @property
    def _writes_texts_out(self) -> bool:
        """Whether the device takes bodies with their texts written out (before protocol 9):
        a page for it is measured so (``written_out``)."""
        return (self.protocol.version or MIN_PROTOCOL) < DEFLATED_SINCE

    # -- writer ------------------------------------------------------------------------

    async def _write_loop(self, subscription: Subscription) -> None:
        try:
            while True:
                frame = await subscription.get()
                if self.protocol.state is not State.OPEN:
                    return
                self._send_live(frame)
                self._take("changes_live")
                self.ctx.metrics.fanout_rate.add()
                await self._flush()
        except (InvalidState, ConnectionClosed):
            return  # unsubscribed, or the socket is gone: the reader loop cleans up
        except Exception:
            logger.exception("%r: live writer failed", self)
            await self._abort(CloseCode.INTERNAL_ERROR, "internal server error")

    def _send_live(self, frame: Changes) -> None:
        """Queue a live page in the form this device reads: its stored bytes (protocol 6),
        or its records (decoded here when the hub holds only bytes). A page whose bytes do
        not decode goes as an empty marker at its end: the device pulls, and the pull
        answers with the store's error. So does a page that a device before protocol 9
        would get past the pull budget with its texts written out (``written_out`` would
        cut it): the device pulls it in pages cut to the budget."""
        start, end = frame.from_cursor, frame.to_cursor
        if self._speaks_bodies and (frame.bodies or not frame.changes):
            bodies = frame.bodies
            if bodies and self._writes_texts_out:
                bodies, _, cut = written_out(bodies, end, False, self.ctx.max_pull_bytes)
                if cut:
                    self.protocol.send_changes(end, end, [], more=frame.more, live=True)
                    return
            self.protocol.send_changes(start, end, [], more=frame.more, live=True, bodies=bodies)
            return
        try:
            changes = frame.changes or feed_changes(frame.bodies)
        except StorageError as exc:
            logger.warning("%r: live page (%d, %d] not sent: %s", self, start, end, exc)
            start, changes = end, []
        self.protocol.send_changes(start, end, changes, more=frame.more, live=True)

    # -- output ------------------------------------------------------------------------

    def _allowed(self, size: int) -> bool:
        """Whether a frame of ``size`` bytes is within this connection's, its tenant's and its
        source address's frame rates and this connection's byte rate."""
        if self._limiter is not None and not self._limiter.allow():
            return False
        if self._tenant_limiter is not None and not self._tenant_limiter.allow():
            return False
        if self._source_limiter is not None and not self._source_limiter.allow():
            return False
        return self._byte_limiter is None or self._byte_limiter.allow(size)

    def _fail(self, error: SyncError, *, request_id: int = 0) -> None:
        """Queue a non-fatal ``Error`` frame for ``error`` answering ``request_id`` (0: none);
        the connection stays open."""
        self.protocol.fail(error, fatal=False, request_id=request_id)
        self._take("error")
        self.ctx.metrics.errors.labels(str(int(error.code))).inc()

    def _take(self, kind: str) -> int:
        """Move what the protocol queued into the outbox, labelled ``kind``; return how many."""
        out = self.protocol.data_to_send()
        for data in out:
            self._outbox.append((kind, data))
        return len(out)

    async def _flush(self) -> None:
        """Write every queued frame, in order. Raises ``ConnectionClosed`` when it is gone."""
        if not self._outbox:
            return
        sent = self.ctx.metrics.frames_sent
        async with self._send_lock:
            while self._outbox:
                kind, data = self._outbox.popleft()
                await self.ws.send(data)
                sent.labels(kind).inc()


def _close_reason(text: str) -> str:
    raw = text.encode("utf-8")[:_MAX_CLOSE_REASON]
    return raw.decode("utf-8", errors="ignore")
