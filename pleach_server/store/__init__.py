"""Server stores: the ``ServerStore`` protocol and its implementations."""

from .base import PullResult, PushResult, ServerStore, Tenant
from .sqlite import SQLiteServerStore

__all__ = ["PullResult", "PushResult", "SQLiteServerStore", "ServerStore", "Tenant"]
