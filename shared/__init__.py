"""Pure building blocks shared by the pleach client and server: no I/O here."""

__all__: list[str] = []
"""Its modules are imported by name (``shared.records``, ``shared.messages``...)."""
