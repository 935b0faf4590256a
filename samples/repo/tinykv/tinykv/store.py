"""The Store: a dict in memory, a write-ahead log on disk, compaction in between."""

from __future__ import annotations

import os
import time
from typing import Iterator

from tinykv.wal import Record, WriteAheadLog

COMPACTION_RATIO = 2.0


class Store:
    """Key-value store. Keys are strings, values are bytes."""

    def __init__(self, directory: str, clock=time.time) -> None:
        os.makedirs(directory, exist_ok=True)
        self._clock = clock
        self._data: dict[str, tuple[bytes, float]] = {}
        self._wal = WriteAheadLog(os.path.join(directory, "tinykv.wal"))
        self._records = 0
        for record in self._wal.replay():
            self._apply(record)
            self._records += 1

    def _apply(self, record: Record) -> None:
        if record.op == "P":
            self._data[record.key] = (record.value, record.expires_at)
        else:
            self._data.pop(record.key, None)

    def _alive(self, expires_at: float) -> bool:
        return expires_at == 0 or expires_at > self._clock()

    def put(self, key: str, value: bytes, ttl_s: float | None = None) -> None:
        expires_at = self._clock() + ttl_s if ttl_s else 0.0
        record = Record("P", key, value, expires_at)
        self._wal.append(record)
        self._apply(record)
        self._records += 1
        self._maybe_compact()

    def get(self, key: str) -> bytes | None:
        item = self._data.get(key)
        if item is None or not self._alive(item[1]):
            return None
        return item[0]

    def delete(self, key: str) -> bool:
        if key not in self._data:
            return False
        record = Record("D", key, b"", 0.0)
        self._wal.append(record)
        self._apply(record)
        self._records += 1
        self._maybe_compact()
        return True

    def scan(self, prefix: str = "") -> Iterator[tuple[str, bytes]]:
        for key in sorted(self._data):
            value, expires_at = self._data[key]
            if key.startswith(prefix) and self._alive(expires_at):
                yield key, value

    def _maybe_compact(self) -> None:
        if self._records > COMPACTION_RATIO * max(len(self._data), 16):
            self.compact()

    def compact(self) -> None:
        live = [Record("P", k, v, e) for k, (v, e) in sorted(self._data.items()) if self._alive(e)]
        self._wal.rewrite(live)
        self._data = {r.key: (r.value, r.expires_at) for r in live}
        self._records = len(live)

    def close(self) -> None:
        self._wal.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
