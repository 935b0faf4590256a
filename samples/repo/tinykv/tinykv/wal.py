"""Append-only write-ahead log with CRC-32 framed records.

Record layout: length (4 bytes, big endian) | crc32 of payload (4 bytes) | payload.
Payload: op (1 byte: P=put, D=delete) | expiry (8-byte float, 0 = none)
         | key length (2 bytes) | key (UTF-8) | value (rest).
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass
from typing import BinaryIO, Iterator

_HEADER = struct.Struct(">II")
_FIXED = struct.Struct(">cdH")


@dataclass(frozen=True)
class Record:
    op: str
    key: str
    value: bytes
    expires_at: float


def encode(record: Record) -> bytes:
    key = record.key.encode("utf-8")
    payload = _FIXED.pack(record.op.encode("ascii"), record.expires_at, len(key)) + key + record.value
    return _HEADER.pack(len(payload), zlib.crc32(payload)) + payload


def read_records(handle: BinaryIO) -> Iterator[Record]:
    """Yield records until the end of the file or the first torn/corrupt record."""
    while True:
        header = handle.read(_HEADER.size)
        if len(header) < _HEADER.size:
            return
        length, checksum = _HEADER.unpack(header)
        payload = handle.read(length)
        if len(payload) < length or zlib.crc32(payload) != checksum:
            return  # a partial write can only be the last record: stop here
        op, expires_at, key_len = _FIXED.unpack_from(payload)
        key = payload[_FIXED.size:_FIXED.size + key_len].decode("utf-8")
        yield Record(op.decode("ascii"), key, payload[_FIXED.size + key_len:], expires_at)


class WriteAheadLog:
    """Appends records and makes them durable with flush + fsync."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._handle = open(path, "ab")

    def append(self, record: Record) -> None:
        self._handle.write(encode(record))
        self._handle.flush()
        os.fsync(self._handle.fileno())

    def replay(self) -> Iterator[Record]:
        with open(self.path, "rb") as handle:
            yield from read_records(handle)

    def rewrite(self, records: list[Record]) -> None:
        """Atomically replace the log with `records` (used by compaction)."""
        tmp = self.path + ".tmp"
        with open(tmp, "wb") as handle:
            for record in records:
                handle.write(encode(record))
            handle.flush()
            os.fsync(handle.fileno())
        self._handle.close()
        os.replace(tmp, self.path)
        self._handle = open(self.path, "ab")

    def close(self) -> None:
        self._handle.close()
