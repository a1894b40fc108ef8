"""pleach server: the WebSocket sync server that reconciles a user's devices."""

__all__: list[str] = []
"""The server's modules are imported by name (``pleach_server.server.SyncServer``,
``pleach_server.store.SQLiteServerStore``...); this package re-exports nothing."""
