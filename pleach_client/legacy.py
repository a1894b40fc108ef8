"""The reference's flat methods that moved to facets, and ``rt.tenant``.

Each flat method still works and forwards to its facet, with a ``DeprecationWarning`` that
names the facet to use (the reference marks them ``@deprecated`` and drops them in its next
major version; so will pleach). ``SessionRuntime`` inherits them from ``LegacySurface``, kept
here so the whole legacy surface goes in one place when it goes.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Literal

from .stream import Callback

if TYPE_CHECKING:
    from shared.records import Session

    from .core import DeviceCore
    from .facets import CheckpointsFacet, EventsFacet
    from .plugins import PluginManager
    from .receipts import RollbackReceipt, SyncConflictResolveReceipt
    from .runtime import SessionsFacet
    from .safety import SafetyFacet, SafetyPolicySummary, SafetyRegistry
    from .sync import SyncFacet

__all__ = ["LegacySurface", "TenantFacet", "deprecated"]


def deprecated(name: str, instead: str) -> None:
    """Warn that ``SessionRuntime.<name>`` is deprecated in favour of ``instead``."""
    warnings.warn(
        f"SessionRuntime.{name} is deprecated and goes in the next major version; use {instead}",
        DeprecationWarning,
        stacklevel=3,
    )


class TenantFacet:
    """``runtime.tenant``: who this runtime acts for, fixed at construction."""

    def __init__(self, core: DeviceCore) -> None:
        self._core = core

    @property
    def org_id(self) -> str:
        return self._core.org_id

    @property
    def user_id(self) -> str:
        return self._core.user_id

    @property
    def client_id(self) -> str:
        """This device's id (it changes only when a restored file re-keys the device)."""
        return self._core.client_id

    def get_tenant_id(self) -> str:
        """``"{org_id}/{user_id}"``: the tenant every record of this runtime belongs to."""
        return f"{self._core.org_id}/{self._core.user_id}"


class LegacySurface:
    """Flat methods of the reference, forwarding to facets with a ``DeprecationWarning``."""

    if TYPE_CHECKING:
        sessions: SessionsFacet
        checkpoints: CheckpointsFacet
        events: EventsFacet
        plugins: PluginManager
        safety: SafetyFacet
        tenant: TenantFacet

        @property
        def sync(self) -> SyncFacet: ...

    async def rollback_to_checkpoint(self, session_id: str, checkpoint_id: str) -> RollbackReceipt:
        """Deprecated: ``rt.checkpoints.rollback``."""
        deprecated("rollback_to_checkpoint", "rt.checkpoints.rollback(session_id, checkpoint_id)")
        return await self.checkpoints.rollback(session_id, checkpoint_id)

    async def save_session(self, state: Session) -> Session:
        """Deprecated: ``rt.sessions.save``."""
        deprecated("save_session", "rt.sessions.save(session)")
        return await self.sessions.save(state)

    def get_time_travel_api(self) -> CheckpointsFacet:
        """Deprecated: ``rt.checkpoints`` (``list``, ``rollback``, ``fork``, ``state_at``)."""
        deprecated("get_time_travel_api", "rt.checkpoints")
        return self.checkpoints

    def get_tenant_id(self) -> str:
        """Deprecated: ``rt.tenant.get_tenant_id()``."""
        deprecated("get_tenant_id", "rt.tenant.get_tenant_id()")
        return self.tenant.get_tenant_id()

    def get_plugin_manager(self) -> PluginManager:
        """Deprecated: ``rt.plugins``."""
        deprecated("get_plugin_manager", "rt.plugins")
        return self.plugins

    def get_safety_registry(self) -> SafetyRegistry:
        """Deprecated: ``rt.safety.get_registry()``."""
        deprecated("get_safety_registry", "rt.safety.get_registry()")
        return self.safety.get_registry()

    def list_active_safety_policies(self) -> list[SafetyPolicySummary]:
        """Deprecated: ``rt.safety.get_active()``."""
        deprecated("list_active_safety_policies", "rt.safety.get_active()")
        return self.safety.get_active()

    async def resolve_conflict(
        self, session_id: str, conflict_id: str, resolution: Literal["local", "remote"]
    ) -> SyncConflictResolveReceipt:
        """Deprecated: ``rt.sync.resolve_conflict``."""
        deprecated("resolve_conflict", "rt.sync.resolve_conflict(session_id, conflict_id, side)")
        return await self.sync.resolve_conflict(session_id, conflict_id, resolution)

    def on(self, event_type: str, handler: Callback) -> None:
        """Deprecated: ``rt.events.on``."""
        deprecated("on", "rt.events.on(event_type, handler)")
        self.events.on(event_type, handler)

    def once(self, event_type: str, handler: Callback) -> None:
        """Deprecated: ``rt.events.once``."""
        deprecated("once", "rt.events.once(event_type, handler)")
        self.events.once(event_type, handler)

    def off(self, event_type: str, handler: Callback) -> bool:
        """Deprecated: ``rt.events.off``."""
        deprecated("off", "rt.events.off(event_type, handler)")
        return self.events.off(event_type, handler)
