"""tinykv: an in-memory key-value store made durable by a write-ahead log."""

from tinykv.store import Store

__all__ = ["Store"]
__version__ = "0.3.1"
