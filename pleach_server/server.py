"""The sync server: WebSocket ``/sync`` for devices; ``/healthz``, ``/metrics`` and the
sync-health page ``/status`` (``/status.json``) over HTTP.

::

    async with SQLiteServerStore(path) as store:
        async with SyncServer(store, port=0, secret=secret) as srv:
            print(srv.url)             # ws://127.0.0.1:PORT/sync
            await srv.serve_forever()  # until shutdown() (or cancellation)

The bearer token is checked in ``process_request``, BEFORE the upgrade: a missing, forged or
expired token gets an HTTP 401 and no WebSocket. Each accepted connection is a
``Connection`` (see ``connection.py``); fan-out goes through one ``Hub`` per server and, across
server processes, through a ``Notifier``.

The server speaks protocol versions ``MIN_PROTOCOL..MAX_PROTOCOL`` (1 to 9, described in
``shared.messages``): each device's ``Hello`` gets the highest version both sides speak, and
``Welcome`` names it with the token's tenant.

The server does not own the store: open it before, close it after.
"""

from __future__ import annotations

import asyncio
import hmac
import http
import logging
import re
import time
import weakref
from collections.abc import Iterable
from types import TracebackType
from typing import Any, Final, Literal, Self
from urllib.parse import parse_qs, urlsplit

import msgspec
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.extensions.permessage_deflate import ServerPerMessageDeflateFactory
from websockets.frames import CloseCode
from websockets.http11 import Request, Response

from shared.clock import HybridClock
from shared.errors import InvalidState, StorageError, SyncError, Unauthorized
from shared.ids import uuid7
from shared.messages import DEFAULT_MAX_FRAME_BYTES
from shared.tracing import Spans

from .auth import parse_bearer, verify_token_expiry
from .connection import Connection, ConnectionContext
from .gcpauses import GcCollector
from .gcpauses import pauses as gc_pauses
from .health import DEFAULT_FLUSH_AFTER_S, HealthReports
from .hub import DEFAULT_QUEUE_SIZE, Hub
from .notify import LocalNotifier, Notifier
from .status import (
    LOGIN_PAGE,
    RateWindow,
    ServerRates,
    StatusReport,
    build_report,
    render_html,
)
from .store.base import DEFAULT_PULL_BYTES, ServerStore, Tenant

__all__ = ["SYNC_PATH", "SyncMetrics", "SyncServer"]

logger = logging.getLogger("pleach_server.server")

SYNC_PATH = "/sync"
_ADMIN_COOKIE = "pleach_admin"
_ADMIN_TOKEN_RE = re.compile(r"[A-Za-z0-9._~+/=-]{16,512}")
_PUSH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _HubCollector:
    """Exposes the hub's own counters at scrape time (the hub stays free of metrics code)."""

    def __init__(self, hub: Hub) -> None:
        self._hub = hub

    def collect(self) -> Iterable[Metric]:
        drops = CounterMetricFamily(
            "pleach_fanout_drops", "Live frames dropped because a device fell behind"
        )
        drops.add_metric([], self._hub.drops)
        cuts = CounterMetricFamily(
            "pleach_fanout_cuts", "Times a slow device's live queue was cut (it must pull)"
        )
        cuts.add_metric([], self._hub.cuts)
        subs = GaugeMetricFamily("pleach_fanout_subscribers", "Devices receiving live frames")
        subs.add_metric([], len(self._hub))
        return [drops, cuts, subs]


class _HealthCollector:
    """Exposes the device health reports' counters at scrape time."""

    def __init__(self, health: HealthReports) -> None:
        self._health = health

    def collect(self) -> Iterable[Metric]:
        health = self._health
        waiting = GaugeMetricFamily(
            "pleach_health_reports_waiting", "Device health reports not written yet"
        )
        waiting.add_metric([], health.waiting)
        written = CounterMetricFamily(
            "pleach_health_reports_written", "Device health reports written to the store"
        )
        written.add_metric([], health.written)
        writes = CounterMetricFamily(
            "pleach_health_writes", "Store transactions that wrote device health reports"
        )
        writes.add_metric([], health.writes)
        dropped = CounterMetricFamily(
            "pleach_health_reports_dropped",
            "Device health reports never written (too many waited at once)",
        )
        dropped.add_metric([], health.dropped)
        return [waiting, written, writes, dropped]


class SyncMetrics:
    """Prometheus metrics of one server, in a private registry (servers never share one)."""

    def __init__(self, hub: Hub, health: HealthReports) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.connections = Gauge(
            "pleach_connections", "Open device connections (authenticated)", registry=r
        )
        self.frames_received = Counter(
            "pleach_frames_received", "Frames received from devices, by type", ["type"], registry=r
        )
        self.frames_sent = Counter(
            "pleach_frames_sent", "Frames sent to devices, by type", ["type"], registry=r
        )
        self.changes = Counter(
            "pleach_changes", "Pushed changes, by result status", ["status"], registry=r
        )
        self.conflicts = Counter(
            "pleach_conflicts", "Concurrent session edits settled (a fork was kept)", registry=r
        )
        self.errors = Counter(
            "pleach_errors", "Error frames sent to devices, by 3xxx code", ["code"], registry=r
        )
        self.push_seconds = Histogram(
            "pleach_push_seconds",
            "Time to apply one push batch",
            buckets=_PUSH_BUCKETS,
            registry=r,
        )
        self.auth_failures = Counter(
            "pleach_auth_failures", "Upgrade requests refused with 401", registry=r
        )
        r.register(_HubCollector(hub))
        r.register(_HealthCollector(health))
        r.register(GcCollector(gc_pauses()))  # (the process's collector: nothing else runs)
        # Rates over the last minute, for the /status page.
        self.push_rate = RateWindow()
        self.fanout_rate = RateWindow()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


DEFLATE_LEVEL: Final = 1
"""zlib's level for what the server sends: on sync frames (ids and hashes as bytes, then
text) level 1 gives about nine tenths of level 6's ratio in a third of its time."""
CLIENT_WINDOW_BITS: Final = 12
"""The window a device's deflate may use (4 KiB): kept by the server's inflate for each
connection, so it stays small."""


def _deflate() -> ServerPerMessageDeflateFactory:
    """permessage-deflate with no context kept between the frames the server sends.

    Each frame is deflated alone, with zlib's full window and hash table (32 and 64 KiB, made
    for the frame and freed when it is written: nothing held while a connection is idle), at
    level 1. A pull page (about 250 KB) then deflates in about 1.2 ms to about a quarter of its
    size, where a small window kept across frames (1 KiB, memLevel 3, level 6: the setting
    before) took 7.5 ms for about half; a live page of one turn (2-3 KB) takes about 45 µs,
    against 77, for the same ratio (about 2x: what a small window gained from the frames
    before, the frame's own repeats give). A device's frames keep their context, in a
    ``CLIENT_WINDOW_BITS`` window (the server's inflate holds it per connection)."""
    return ServerPerMessageDeflateFactory(
        server_no_context_takeover=True,
        client_max_window_bits=CLIENT_WINDOW_BITS,
        compress_settings={"level": DEFLATE_LEVEL, "memLevel": 8},
    )


class SyncServer:
    """The sync server. Use ``async with SyncServer(store, secret=...) as srv``.

    Limits (all parameters, all with defaults):

    - ``max_frame_bytes`` (4 MiB): a larger frame gets ``Error`` 3005 and a close (1009);
      frames above twice that are refused by the WebSocket layer itself (1009).
    - ``fanout_queue`` (256): live frames held per device before it is cut and must pull.
    - ``max_pull_limit`` (1000): the largest page a ``Pull`` gets, whatever it asks.
    - ``max_pull_bytes`` (1 MiB): a pull or live page also stops once its records add up to
      this many bytes (a larger record travels alone), so one large pull cannot make a huge
      frame, hold the server's memory or stall other devices.
    - ``rate_limit_per_s`` (200) and ``rate_limit_burst`` (2 s worth): frames per second per
      connection; excess frames get ``Error`` 3008 (retryable) and are not processed.
      ``None`` disables the limit.
    - ``tenant_rate_limit_per_s`` (5x the per-connection rate): frames per second for all of
      one tenant's connections to this process together, so a tenant that opens many
      connections gets no more than its share (3008 as above). ``None`` disables it.
    - ``source_rate_limit_per_s`` (25x the per-connection rate): frames per second for all
      connections from one network address together, whatever tenants they act for (3008
      as above). Behind a proxy or load balancer every device shares its address: raise it or
      pass ``None`` there (``--source-rate-limit 0``).
    - ``max_clock_skew_ms`` (60 s): pushed stamps further in the future are refused (3011).
    - ``rate_limit_bytes_per_s`` (16 MiB/s): bytes per second per connection (after
      decompression), refused like frames over the rate (3008). A connection that goes on
      sending through 100 refusals in a row is closed (1008). ``None`` disables it.
    - ``metrics_token`` (None): when set, ``/metrics`` answers only a request carrying
      ``Authorization: Bearer <metrics_token>`` (401 otherwise); unset, it is public.
    - ``shutdown_timeout`` (10 s): how long ``shutdown`` waits for in-flight pushes.
    - ``tenant_store_slots`` (2): how many pushes and pulls of one tenant run in the store at
      once on this process; the rest wait their turn here, not in the store's queue, so a
      tenant that floods (many connections pushing) delays another tenant's push by at most
      two of its own. ``None``: no bound.
    - ``span_exporter`` / ``tracer_provider`` (None): export an OpenTelemetry span for each
      push and pull (``pleach[otel]``), child of the device's flush span when it names one.
    - ``admin_token`` (None): the token of the sync-health page, ``/status`` (HTML) and
      ``/status.json``. Unset, the page is off (404). A request carries it as
      ``Authorization: Bearer <admin_token>``, or opens ``/status?token=<admin_token>`` once:
      the answer sets it as a cookie (HttpOnly, SameSite=Strict) and redirects to ``/status``,
      so a phone's browser keeps it and the token leaves the address bar.
    - ``health_flush_s`` (1 s): how long a device's health report may wait in memory before
      it is written; the reports of that time share one transaction
      (``pleach_server.health``). ``/status`` writes what waits before it reads.
    """

    def __init__(
        self,
        store: ServerStore,
        *,
        host: str = "127.0.0.1",
        port: int = 8765,
        secret: bytes,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        fanout_queue: int = DEFAULT_QUEUE_SIZE,
        max_pull_limit: int = 1000,
        max_pull_bytes: int = DEFAULT_PULL_BYTES,
        rate_limit_per_s: float | None = 200.0,
        tenant_rate_limit_per_s: float | Literal["auto"] | None = "auto",
        rate_limit_burst: float | None = None,
        notifier: Notifier | None = None,
        server_id: str | None = None,
        max_clock_skew_ms: int = 60_000,
        shutdown_timeout: float = 10.0,
        compression: bool = True,
        metrics_token: str | None = None,
        rate_limit_bytes_per_s: float | None = 16 * 1024 * 1024,
        admin_token: str | None = None,
        source_rate_limit_per_s: float | Literal["auto"] | None = "auto",
        span_exporter: Any | None = None,
        tracer_provider: Any | None = None,
        tenant_store_slots: int | None = 2,
        health_flush_s: float = DEFAULT_FLUSH_AFTER_S,
    ) -> None:
        if not secret:
            raise ValueError("secret must not be empty")
        if max_frame_bytes < 1024:
            raise ValueError(f"max_frame_bytes must be at least 1024, got {max_frame_bytes}")
        if rate_limit_bytes_per_s is not None and rate_limit_bytes_per_s <= 0:
            raise ValueError(
                f"rate_limit_bytes_per_s must be positive, got {rate_limit_bytes_per_s}"
            )
        if max_pull_bytes < 1:
            raise ValueError(f"max_pull_bytes must be at least 1, got {max_pull_bytes}")
        if max_pull_limit < 1:
            raise ValueError(f"max_pull_limit must be at least 1, got {max_pull_limit}")
        source_auto = source_rate_limit_per_s == "auto"
        if source_rate_limit_per_s == "auto":
            source_rate_limit_per_s = None if rate_limit_per_s is None else 25 * rate_limit_per_s
        if source_rate_limit_per_s is not None and source_rate_limit_per_s <= 0:
            raise ValueError(
                f"source_rate_limit_per_s must be positive, got {source_rate_limit_per_s}"
            )
        tenant_auto = tenant_rate_limit_per_s == "auto"
        if tenant_rate_limit_per_s == "auto":
            tenant_rate_limit_per_s = None if rate_limit_per_s is None else 5 * rate_limit_per_s
        if tenant_rate_limit_per_s is not None and tenant_rate_limit_per_s <= 0:
            raise ValueError(
                f"tenant_rate_limit_per_s must be positive, got {tenant_rate_limit_per_s}"
            )
        if rate_limit_per_s is not None and rate_limit_per_s <= 0:
            raise ValueError(f"rate_limit_per_s must be positive, got {rate_limit_per_s}")
        self.store = store
        self.host = host
        self._port = port
        self._secret = secret
        self.max_frame_bytes = max_frame_bytes
        self.server_id = server_id or f"srv-{uuid7()}"
        self.shutdown_timeout = shutdown_timeout
        self.compression = compression
        if metrics_token is not None and not metrics_token:
            raise ValueError("metrics_token must not be empty (None: /metrics is public)")
        self._metrics_token = metrics_token
        if admin_token is not None and not _ADMIN_TOKEN_RE.fullmatch(admin_token):
            raise ValueError(
                "admin_token must be at least 16 characters of letters, digits and ._~+/=- "
                "(None: no /status page)"
            )
        self._admin_token = admin_token
        self.hub = Hub(fanout_queue)
        self.notifier: Notifier = notifier if notifier is not None else LocalNotifier()
        # Device health reports, written a second's worth at a time.
        self.health = HealthReports(store, flush_after=health_flush_s)
        self.metrics = SyncMetrics(self.hub, self.health)
        # OpenTelemetry spans of pushes and pulls (no-op without an exporter or provider);
        # a device's flush span, named in Push.trace, is a push span's parent.
        self.spans = Spans(
            exporter=span_exporter, tracer_provider=tracer_provider, service_name="pleach-server"
        )
        self.clock = HybridClock(self.server_id, max_skew_ms=max_clock_skew_ms)
        burst = (
            rate_limit_burst
            if rate_limit_burst is not None
            else max(1.0, 2 * (rate_limit_per_s or 1.0))
        )
        self._ctx = ConnectionContext(
            store=store,
            hub=self.hub,
            notifier=self.notifier,
            clock=self.clock,
            server_id=self.server_id,
            metrics=self.metrics,
            spans=self.spans,
            health=self.health,
            max_frame_bytes=max_frame_bytes,
            max_pull_limit=max_pull_limit,
            max_pull_bytes=max_pull_bytes,
            rate_limit_per_s=rate_limit_per_s,
            rate_limit_burst=burst,
            tenant_rate_limit_per_s=tenant_rate_limit_per_s,
            rate_limit_bytes_per_s=rate_limit_bytes_per_s,
            # By default a tenant's connections together may burst as much as five connections.
            source_rate_limit_per_s=source_rate_limit_per_s,
            tenant_store_slots=tenant_store_slots,
            # By default one address may burst as much as 25 connections.
            source_rate_limit_burst=(
                25 * burst if source_auto else max(1.0, 2 * (source_rate_limit_per_s or 0.0))
            ),
            tenant_rate_limit_burst=(
                5 * burst if tenant_auto else max(1.0, 2 * (tenant_rate_limit_per_s or 0.0))
            ),
        )
        self.connections: set[Connection] = set()
        # Tenant of each accepted upgrade, from process_request to the handler.
        self._tenants: weakref.WeakKeyDictionary[ServerConnection, tuple[Tenant, int | None]] = (
            weakref.WeakKeyDictionary()
        )
        self._ws: Server | None = None
        self._started = False
        self._stopping = False
        self._done = asyncio.Event()
        self._transports: set[asyncio.Transport] = set()

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Bind and start accepting. Call ``shutdown()`` (or leave ``async with``) to stop."""
        if self._started:
            raise InvalidState("server already started")
        self._started = True
        await self.notifier.start(self._on_remote_commit)
        self.health.start()
        try:
            self._ws = await serve(
                self._handler,
                self.host,
                self._port,
                process_request=self._process_request,
                # Frames up to twice our limit reach ServerProtocol and get a coded 3005 Error;
                # beyond that websockets refuses them itself (close 1009) without buffering.
                max_size=2 * self.max_frame_bytes,
                # Each frame deflated alone (``_deflate``): an idle connection holds only its
                # inflate's window of the device's frames, 4 KiB.
                compression=None,
                extensions=[_deflate()] if self.compression else None,
                logger=logging.getLogger("pleach_server.websockets"),
                create_connection=self._connection_class(),
            )
        except BaseException:
            await self.health.close()
            await self.notifier.close()
            raise
        if self._ws.sockets:
            self._port = self._ws.sockets[0].getsockname()[1]
        # DEBUG: the CLI prints the address itself; a library host logs it as it likes.
        logger.debug("listening on %s (server id %s)", self.url, self.server_id)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.shutdown()

    @property
    def port(self) -> int:
        """The bound port (once started, the real one when constructed with ``port=0``)."""
        return self._port

    @property
    def status_enabled(self) -> bool:
        """Whether ``/status`` is served (an admin token was given)."""
        return self._admin_token is not None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"ws://{host}:{self.port}{SYNC_PATH}"

    @property
    def draining(self) -> bool:
        """True once ``shutdown`` has begun: no new pushes are accepted."""
        return self._ctx.draining

    async def serve_forever(self) -> None:
        """Serve until ``shutdown()`` completes; cancelling this shuts the server down."""
        if not self._started:
            await self.start()
        try:
            await self._done.wait()
        except asyncio.CancelledError:
            await asyncio.shield(self.shutdown())
            raise

    async def shutdown(self) -> None:
        """Stop gracefully: stop accepting, let in-flight pushes finish (and be acked),
        close every connection with 1001 (going away), write the device health reports that
        wait, close the notifier.

        Idempotent; concurrent callers all return once the server has stopped.
        """
        if self._stopping:
            await self._done.wait()
            return
        self._stopping = True
        try:
            if self._ws is not None:
                await self._drain_and_close(self._ws)
        finally:
            self.hub.close()
            await self.health.close()
            await self.notifier.close()
            await self.spans.shutdown()
            self._done.set()
            logger.info("stopped")

    async def _drain_and_close(self, ws: Server) -> None:
        self._ctx.draining = True
        ws.server.close()  # stop listening; open connections carry on for now
        inflight = self._ctx.inflight
        if inflight.count:
            logger.info("waiting for %d in-flight push(es)", inflight.count)
            try:
                async with asyncio.timeout(self.shutdown_timeout):
                    await inflight.wait_idle()
            except TimeoutError:
                logger.warning(
                    "%d push(es) still in flight after %.1fs; closing anyway",
                    inflight.count,
                    self.shutdown_timeout,
                )
        ws.close(close_connections=True, code=CloseCode.GOING_AWAY, reason="server shutting down")
        await ws.wait_closed()
        # A connection accepted in the instant the listener closed can reach the protocol
        # after the server stopped waiting for its handlers; drop whatever is left, so a
        # stopped server holds no socket.
        for transport in list(self._transports):
            transport.abort()
        self._transports.clear()

    def _connection_class(self) -> type[ServerConnection]:
        """``ServerConnection`` that tells this server about its transport as it is made, and
        is dropped at once when the server is already stopping."""
        server = self

        class TrackedConnection(ServerConnection):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                super().connection_made(transport)
                assert isinstance(transport, asyncio.Transport)
                if server._stopping and server._done.is_set():
                    transport.abort()
                    return
                server._transports.add(transport)

            def connection_lost(self, exc: Exception | None) -> None:
                server._transports.discard(self.transport)
                super().connection_lost(exc)

        return TrackedConnection

    # -- HTTP routes -------------------------------------------------------------------

    async def _process_request(
        self, connection: ServerConnection, request: Request
    ) -> Response | None:
        path = urlsplit(request.path).path
        if path == SYNC_PATH:
            return self._authorize(connection, request)
        if path == "/healthz":
            return await self._healthz()
        if path in ("/status", "/status.json"):
            return await self._status(request, json=path.endswith(".json"))
        if path == "/metrics":
            if self._metrics_token is not None:
                values = request.headers.get_all("Authorization")
                given = parse_bearer(values[0]) if len(values) == 1 else None
                if given is None or not hmac.compare_digest(given, self._metrics_token):
                    return _response(
                        http.HTTPStatus.UNAUTHORIZED,
                        b"metrics need the metrics token\n",
                        "text/plain; charset=utf-8",
                    )
            return _response(http.HTTPStatus.OK, self.metrics.render(), CONTENT_TYPE_LATEST)
        return _response(http.HTTPStatus.NOT_FOUND, b"not found\n", "text/plain; charset=utf-8")

    def _authorize(self, connection: ServerConnection, request: Request) -> Response | None:
        values = request.headers.get_all("Authorization")
        token = parse_bearer(values[0]) if len(values) == 1 else None
        try:
            tenant, expires = verify_token_expiry(self._secret, token)
        except Unauthorized as exc:
            self.metrics.auth_failures.inc()
            logger.info("refused upgrade from %s: %s", connection.remote_address, exc.message)
            response = _response(
                http.HTTPStatus.UNAUTHORIZED,
                msgspec.json.encode({"code": int(exc.code), "message": exc.message}),
                "application/json",
            )
            response.headers["WWW-Authenticate"] = 'Bearer realm="pleach"'
            return response
        if self._ctx.draining:
            return _response(
                http.HTTPStatus.SERVICE_UNAVAILABLE,
                b"server is shutting down\n",
                "text/plain; charset=utf-8",
            )
        self._tenants[connection] = (tenant, expires)
        return None  # carry on with the upgrade

    def _admin(self, request: Request) -> tuple[bool, str | None]:
        """Whether ``request`` carries the admin token; and a token given in the query."""
        assert self._admin_token is not None
        token = self._admin_token.encode()
        query = parse_qs(urlsplit(request.path).query).get("token")
        if query and len(query) == 1 and hmac.compare_digest(query[0].encode(), token):
            return True, query[0]
        values = request.headers.get_all("Authorization")
        given = parse_bearer(values[0]) if len(values) == 1 else None
        if given is not None and hmac.compare_digest(given.encode(), token):
            return True, None
        for header in request.headers.get_all("Cookie"):
            for part in header.split(";"):
                name, _, value = part.strip().partition("=")
                if name == _ADMIN_COOKIE and hmac.compare_digest(value.encode(), token):
                    return True, None
        return False, None

    async def _status(self, request: Request, *, json: bool) -> Response:
        if self._admin_token is None:
            return _response(
                http.HTTPStatus.NOT_FOUND,
                b"the status page is off: start the server with --admin-token "
                b"(or PLEACH_ADMIN_TOKEN)\n",
                "text/plain; charset=utf-8",
            )
        allowed, from_query = self._admin(request)
        if not allowed:
            if json:
                body = msgspec.json.encode({"error": "the status page needs the admin token"})
                return _response(http.HTTPStatus.UNAUTHORIZED, body, "application/json")
            return _response(
                http.HTTPStatus.UNAUTHORIZED, LOGIN_PAGE.encode(), "text/html; charset=utf-8"
            )
        if from_query is not None:
            # Keep the token in a cookie and take it out of the address bar (and history).
            response = _response(http.HTTPStatus.SEE_OTHER, b"", "text/plain; charset=utf-8")
            response.headers["Location"] = "/status.json" if json else "/status"
            response.headers["Set-Cookie"] = (
                f"{_ADMIN_COOKIE}={from_query}; HttpOnly; SameSite=Strict; Path=/status"
            )
            return response
        try:
            report = await self.status_report()
        except (StorageError, SyncError, OSError) as exc:
            logger.warning("status page: store failed: %s", exc)
            return _response(
                http.HTTPStatus.SERVICE_UNAVAILABLE,
                f"the store cannot be read now: {exc}\n".encode(),
                "text/plain; charset=utf-8",
            )
        if json:
            return _response(http.HTTPStatus.OK, msgspec.json.encode(report), "application/json")
        return _response(
            http.HTTPStatus.OK, render_html(report).encode(), "text/html; charset=utf-8"
        )

    async def status_report(self) -> StatusReport:
        """What ``/status.json`` shows: every device's latest health, per user (the
        reports waiting here are written first, so that it shows them)."""
        await self.health.flush()
        rows = await self.store.list_health()
        tenants = {Tenant(org_id=r.org_id, user_id=r.user_id) for r in rows}
        heads = {t: await self.store.head_cursor(t) for t in tenants}
        connected = [(c.tenant, c.client_id) for c in self.connections if c.client_id]
        metrics = self.metrics
        rates = ServerRates(
            server_id=self.server_id,
            connections=len(self.connections),
            pushed_changes_per_s=metrics.push_rate.rate(),
            fanout_frames_per_s=metrics.fanout_rate.rate(),
            pushed_changes_total=metrics.push_rate.total,
            fanout_frames_total=metrics.fanout_rate.total,
            window_s=metrics.push_rate.window,
        )
        return build_report(rows, heads, connected, rates, time.time())

    async def _healthz(self) -> Response:
        try:
            store_ok = await self.store.healthy()
        except (StorageError, SyncError, OSError) as exc:
            logger.warning("health check: store failed: %s", exc)
            store_ok = False
        ok = store_ok and not self._ctx.draining
        body = msgspec.json.encode(
            {
                "status": "ok" if ok else "unavailable",
                "store": store_ok,
                "connections": len(self.connections),
            }
        )
        status = http.HTTPStatus.OK if ok else http.HTTPStatus.SERVICE_UNAVAILABLE
        return _response(status, body, "application/json")

    # -- connections -------------------------------------------------------------------

    async def _handler(self, ws: ServerConnection) -> None:
        authorized = self._tenants.pop(ws, None)
        if authorized is None:  # only reachable if routing changes: never serve anonymous
            logger.error("connection without an authorized tenant; closing")
            await ws.close(CloseCode.INTERNAL_ERROR, "not authorized")
            return
        tenant, expires = authorized
        conn = Connection(ws, tenant, self._ctx, expires=expires)
        self.connections.add(conn)
        try:
            await conn.run()
        finally:
            self.connections.discard(conn)

    async def _on_remote_commit(self, tenant: Tenant, from_cursor: int, to_cursor: int) -> None:
        """Another instance committed ``(from_cursor, to_cursor]``: serve our devices."""
        await self._ctx.fan_out(tenant, from_cursor, to_cursor, local=False)


def _response(status: http.HTTPStatus, body: bytes, content_type: str) -> Response:
    headers = Headers(
        [
            ("Content-Type", content_type),
            ("Content-Length", str(len(body))),
            ("Connection", "close"),
            ("Cache-Control", "no-store"),
        ]
    )
    return Response(status.value, status.phrase, headers, body)
