"""The sync-health page: what each device last reported, and the server's own rates.

Devices send ``Health`` frames (``shared.messages``); the server keeps the latest per device
in its store (``ServerStore.put_health``; a second's reports in one write,
``pleach_server.health``). ``/status.json`` and ``/status`` (HTML, readable on
a phone) show, per user, each device's last report: when it was seen, how far its cursor lags
the user's feed head, how many changes wait in its outbox, its dead letters, its last flush and
error, and its recent conflicts; with a verdict per device that answers the question users ask:
is what I wrote safely on the server?

Everything here but ``RateWindow`` is a pure function of its arguments (no I/O): the server
reads the store and its counters, and passes them in.
"""

from __future__ import annotations

import html
import time
from collections.abc import Iterable, Mapping
from typing import Literal

import msgspec

from shared.messages import Health, HealthConflict

from .store.base import DeviceHealth, Tenant

__all__ = [
    "DeviceStatus",
    "RateWindow",
    "ServerRates",
    "StatusReport",
    "UserStatus",
    "build_report",
    "device_verdict",
    "render_html",
]

Verdict = Literal["ok", "warn", "fail"]

STALE_AFTER_S = 300.0
"""A device not heard from for this long, with changes still queued, is a warning."""


class RateWindow:
    """Events per second over the last ``window`` seconds, in one-second buckets."""

    def __init__(self, window: int = 60, *, started: float | None = None) -> None:
        self.window = window
        self._buckets = [0] * window
        self._seconds = [0] * window
        self._started = time.monotonic() if started is None else started
        self.total = 0

    def add(self, count: int = 1, now: float | None = None) -> None:
        second = int(time.monotonic() if now is None else now)
        slot = second % self.window
        if self._seconds[slot] != second:
            self._seconds[slot] = second
            self._buckets[slot] = 0
        self._buckets[slot] += count
        self.total += count

    def rate(self, now: float | None = None) -> float:
        """The mean per second over the window (over the time since start, if shorter)."""
        moment = time.monotonic() if now is None else now
        second = int(moment)
        counted = sum(
            n
            for n, s in zip(self._buckets, self._seconds, strict=True)
            if second - self.window < s <= second
        )
        span = min(float(self.window), max(1.0, moment - self._started))
        return counted / span


class ServerRates(msgspec.Struct, kw_only=True):
    """This server process's own figures (each process of a cluster reports its own)."""

    server_id: str
    connections: int
    pushed_changes_per_s: float
    fanout_frames_per_s: float
    pushed_changes_total: int
    fanout_frames_total: int
    window_s: int


class DeviceStatus(msgspec.Struct, kw_only=True):
    client_id: str
    verdict: Verdict
    summary: str
    last_seen: float
    connected_here: bool
    pending: int | None = None
    dead_letters: int | None = None
    cursor: int | None = None
    lag: int | None = None
    last_flush_at: float | None = None
    last_flush_outcome: str = ""
    last_flushed: int = 0
    last_error: str | None = None
    last_error_code: int | None = None
    conflicts: list[HealthConflict] = []
    protocol: int | None = None
    """The protocol version of the connection its last report came on (None: not known, a
    report kept by a server before this field)."""


class UserStatus(msgspec.Struct, kw_only=True):
    org_id: str
    user_id: str
    head_cursor: int
    verdict: Verdict
    devices: list[DeviceStatus]


class StatusReport(msgspec.Struct, kw_only=True):
    generated_at: float
    server: ServerRates
    users: list[UserStatus]


def device_verdict(health: Health | None, lag: int | None, age_s: float) -> tuple[Verdict, str]:
    """Is what this device wrote safe on the server? A verdict and a one-line reason."""
    if health is None:
        return "fail", "its last report could not be read"
    if health.dead_letters:
        return "fail", (
            f"{health.dead_letters} change(s) refused by the server: "
            "run `pleach dead-letters list` on that device"
        )
    if health.pending and age_s > STALE_AFTER_S:
        return "warn", (
            f"{health.pending} change(s) still queued when last seen, "
            f"{_duration(age_s)} ago: not on the server yet"
        )
    if health.pending:
        return "warn", f"{health.pending} change(s) on their way to the server"
    if health.last_error:
        return "warn", f"last error: {health.last_error}"
    if lag:
        return "ok", f"all its changes are on the server; {lag} feed entries still to fetch"
    return "ok", "all its changes are on the server, and it has everything"


def build_report(
    rows: Iterable[DeviceHealth],
    heads: Mapping[Tenant, int],
    connected: Iterable[tuple[Tenant, str]],
    server: ServerRates,
    now: float,
) -> StatusReport:
    """Group the devices' latest health per user, worst verdict first."""
    here = set(connected)
    decoder = msgspec.msgpack.Decoder(Health)
    users: dict[Tenant, list[DeviceStatus]] = {}
    for row in rows:
        tenant = Tenant(org_id=row.org_id, user_id=row.user_id)
        try:
            health: Health | None = decoder.decode(row.health)
        except (msgspec.DecodeError, msgspec.ValidationError):
            health = None
        head = heads.get(tenant, 0)
        lag = None if health is None else max(0, head - health.cursor)
        verdict, summary = device_verdict(health, lag, now - row.seen_at)
        device = DeviceStatus(
            client_id=row.client_id,
            verdict=verdict,
            summary=summary,
            last_seen=row.seen_at,
            connected_here=(tenant, row.client_id) in here,
            lag=lag,
        )
        if health is not None:
            device.pending = health.pending
            device.dead_letters = health.dead_letters
            device.cursor = health.cursor
            device.last_flush_at = health.last_flush_at
            device.last_flush_outcome = health.last_flush_outcome
            device.last_flushed = health.last_flushed
            device.last_error = health.last_error
            device.last_error_code = health.last_error_code
            device.conflicts = list(health.conflicts)
            device.protocol = health.protocol or None
        users.setdefault(tenant, []).append(device)
    rank = {"fail": 0, "warn": 1, "ok": 2}
    out = []
    for tenant, devices in users.items():
        devices.sort(key=lambda d: (rank[d.verdict], -d.last_seen))
        out.append(
            UserStatus(
                org_id=tenant.org_id,
                user_id=tenant.user_id,
                head_cursor=heads.get(tenant, 0),
                verdict=devices[0].verdict,
                devices=devices,
            )
        )
    out.sort(key=lambda u: (rank[u.verdict], u.org_id, u.user_id))
    return StatusReport(generated_at=now, server=server, users=out)


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{int(seconds)} s"
    if seconds < 5400:
        return f"{int(seconds // 60)} min"
    if seconds < 172_800:
        return f"{int(seconds // 3600)} h"
    return f"{int(seconds // 86400)} days"


def _ago(stamp: float | None, now: float) -> str:
    return "never" if stamp is None else f"{_duration(now - stamp)} ago"


_CSS = """
body{font:16px/1.4 system-ui,sans-serif;margin:0;background:#f4f5f7;color:#1d2125}
header{background:#1d2125;color:#fff;padding:12px 16px}
header h1{font-size:20px;margin:0}
header p{margin:4px 0 0;font-size:13px;opacity:.8}
main{padding:8px 12px;max-width:960px;margin:auto}
section{background:#fff;border-radius:10px;margin:12px 0;padding:10px 12px;
box-shadow:0 1px 2px #0002}
h2{font-size:17px;margin:2px 0 8px;word-break:break-all}
.device{border-top:1px solid #e3e5e8;padding:8px 0}
.device:first-of-type{border-top:0}
.id{font-family:ui-monospace,monospace;font-size:13px;word-break:break-all}
.badge{display:inline-block;border-radius:6px;padding:1px 8px;font-size:13px;font-weight:600;
margin-right:6px}
.ok{background:#dcf5e3;color:#136c2e}.warn{background:#fff1cc;color:#7a5200}
.fail{background:#ffd9d9;color:#a00}
dl{display:grid;grid-template-columns:auto 1fr;gap:2px 12px;margin:6px 0 0;font-size:14px}
dt{color:#5e6c84}dd{margin:0}
.rates{display:flex;flex-wrap:wrap;gap:8px}
.rate{background:#fff;border-radius:10px;padding:8px 12px;flex:1 1 130px;box-shadow:0 1px 2px #0002}
.rate b{display:block;font-size:20px}
ul{margin:4px 0 0;padding-left:18px;font-size:13px}
"""


def render_html(report: StatusReport) -> str:
    """The report as one self-contained page (no scripts; it reloads itself every 10 s)."""
    e = html.escape
    now = report.generated_at
    s = report.server
    counts = {"ok": 0, "warn": 0, "fail": 0}
    for user in report.users:
        for device in user.devices:
            counts[device.verdict] += 1
    parts = [
        "<!doctype html><html lang=en><head><meta charset=utf-8>",
        '<meta name=viewport content="width=device-width,initial-scale=1">',
        '<meta http-equiv=refresh content="10">',
        f"<title>pleach sync health</title><style>{_CSS}</style></head><body>",
        "<header><h1>pleach sync health</h1>",
        f"<p>server {e(s.server_id)} &middot; "
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(now))} UTC</p></header><main>",
        '<div class="rates">',
        f'<div class="rate"><b>{s.pushed_changes_per_s:.1f}/s</b>changes pushed</div>',
        f'<div class="rate"><b>{s.fanout_frames_per_s:.1f}/s</b>live frames sent</div>',
        f'<div class="rate"><b>{s.connections}</b>connections here</div>',
        f'<div class="rate"><b><span class="badge ok">{counts["ok"]}</span>'
        f'<span class="badge warn">{counts["warn"]}</span>'
        f'<span class="badge fail">{counts["fail"]}</span></b>devices ok / warn / at risk</div>',
        "</div>",
    ]
    if not report.users:
        parts.append("<section><p>No device has reported yet.</p></section>")
    for user in report.users:
        parts.append(
            f"<section><h2>{e(user.user_id)} <small>({e(user.org_id)})</small></h2>"
            f"<div>feed head {user.head_cursor}</div>"
        )
        for d in user.devices:
            parts.append(
                f'<div class="device"><span class="badge {d.verdict}">{d.verdict}</span>'
                f'<span class="id">{e(d.client_id)}</span><div>{e(d.summary)}</div><dl>'
            )
            rows = [
                (
                    "last seen",
                    _ago(d.last_seen, now) + (" (connected here)" if d.connected_here else ""),
                ),
                ("queued", "?" if d.pending is None else str(d.pending)),
                ("dead letters", "?" if d.dead_letters is None else str(d.dead_letters)),
                ("cursor lag", "?" if d.lag is None else str(d.lag)),
                ("protocol", "?" if d.protocol is None else str(d.protocol)),
                (
                    "last flush",
                    f"{d.last_flush_outcome or '-'}, {d.last_flushed} sent, "
                    f"{_ago(d.last_flush_at, now)}",
                ),
            ]
            if d.last_error:
                code = f" [{d.last_error_code}]" if d.last_error_code else ""
                rows.append(("last error", d.last_error + code))
            parts.extend(f"<dt>{e(k)}</dt><dd>{e(v)}</dd>" for k, v in rows)
            parts.append("</dl>")
            if d.conflicts:
                parts.append("<div>recent conflicts:</div><ul>")
                parts.extend(
                    f"<li>session <span class=id>{e(c.session_id)}</span>: the {e(c.winner)} "
                    f"version won, the other is fork <span class=id>"
                    f"{e(c.fork_session_id)}</span></li>"
                    for c in d.conflicts
                )
                parts.append("</ul>")
            parts.append("</div>")
        parts.append("</section>")
    parts.append("</main></body></html>")
    return "".join(parts)


LOGIN_PAGE = (
    "<!doctype html><html lang=en><head><meta charset=utf-8>"
    '<meta name=viewport content="width=device-width,initial-scale=1">'
    f"<title>pleach sync health</title><style>{_CSS}</style></head><body>"
    "<header><h1>pleach sync health</h1></header><main><section>"
    "<p>This page needs the server's admin token.</p>"
    '<form method=get action="/status"><input name=token type=password '
    'autocomplete=current-password placeholder="admin token" required> '
    "<button>Open</button></form></section></main></body></html>"
)
