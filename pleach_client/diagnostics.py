"""``runtime.diagnostics``: readiness probes for what the host wired, each with a reason.

``await rt.diagnostics.probe()`` checks the store (integrity where the store can tell, every
session's event log, the outbox), the provider (a key for Anthropic; nothing for a scripted
provider), and, when a server is known (``server=``/``token=``, or the ones ``rt.sync`` was
connected with), the server's ``/healthz``, the token and its tenant, and this device's clock
against the server's. Each probe is ``ok``, ``warn`` or ``fail`` with a reason a person can act
on; ``ready`` is True when none failed. Nothing is written and nothing is pushed. ``pleach
doctor`` prints the same checks.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Literal

import msgspec

from shared.errors import PleachError

if TYPE_CHECKING:
    from .runtime import SessionRuntime

__all__ = ["DiagnosticsFacet", "DiagnosticsReport", "Probe"]


class Probe(msgspec.Struct, kw_only=True):
    name: str
    level: Literal["ok", "warn", "fail"]
    reason: str


class DiagnosticsReport(msgspec.Struct, kw_only=True):
    ready: bool
    probes: list[Probe]

    def failed(self) -> list[Probe]:
        return [p for p in self.probes if p.level == "fail"]


class DiagnosticsFacet:
    """``runtime.diagnostics``."""

    def __init__(self, rt: SessionRuntime) -> None:
        self._rt = rt

    def provider_probe(self) -> Probe:
        provider = self._rt._provider
        if provider is None:
            if os.environ.get("ANTHROPIC_API_KEY", "").strip():
                return Probe(
                    name="provider", level="ok", reason="Anthropic, key from ANTHROPIC_API_KEY"
                )
            return Probe(
                name="provider",
                level="fail",
                reason="no provider given and ANTHROPIC_API_KEY is not set: a turn would fail",
            )
        if provider.name == "anthropic":
            client = getattr(provider, "client", None)
            has_key = client is not None and any(
                getattr(client, field, None) for field in ("api_key", "auth_token", "credentials")
            )
            if not has_key:
                return Probe(name="provider", level="fail", reason="Anthropic without credentials")
            return Probe(name="provider", level="ok", reason="Anthropic, credentials present")
        return Probe(name="provider", level="ok", reason=f"{provider.name}: no credentials needed")

    async def probe(
        self, *, server: str | None = None, token: str | None = None, timeout: float = 5.0
    ) -> DiagnosticsReport:
        from .doctor import check_runtime_store, check_server

        rt = self._rt
        probes: list[Probe] = []
        try:
            checks = await check_runtime_store(rt)
        except PleachError as exc:  # pragma: no cover - check_runtime_store reports them
            probes.append(Probe(name="store", level="fail", reason=str(exc)))
        else:
            probes.extend(Probe(name=c.name, level=c.level, reason=c.detail) for c in checks)
        probes.append(self.provider_probe())
        server = server or rt.sync.server_url
        token = token or rt.sync.server_token
        if server:
            checks = await check_server(
                server,
                token,
                rt.client_id,
                rt.user_id,
                rt.org_id,
                timeout=timeout,
                now_ms=rt.core.clock.wall,
            )
            probes.extend(Probe(name=c.name, level=c.level, reason=c.detail) for c in checks)
        else:
            probes.append(
                Probe(name="server", level="warn", reason="no server known: offline only")
            )
        return DiagnosticsReport(ready=all(p.level != "fail" for p in probes), probes=probes)
