"""Local stores: the ``StorageAdapter`` protocol, ``MemoryAdapter`` and ``SQLiteAdapter``."""

from .base import CommitReceipt, DeadLetter, OutboxEntry, StorageAdapter, WriteBatch
from .memory import MemoryAdapter
from .sqlite import SQLiteAdapter

__all__ = [
    "CommitReceipt",
    "DeadLetter",
    "MemoryAdapter",
    "OutboxEntry",
    "SQLiteAdapter",
    "StorageAdapter",
    "WriteBatch",
]
