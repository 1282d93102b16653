"""Tell a storage fault (disk full, I/O error, read-only, unopenable) from every other SQLite error.

A full disk or a read-only run directory is the operator's problem and says so: the gateway
answers 507 with the reason and stores nothing of that request, while a SQLite error of any other
kind (a constraint, a bad statement) is a bug and stays an internal error. SQLite reports a write
that the file-size limit or a full disk refused as SQLITE_FULL or SQLITE_IOERR (an extended code,
e.g. IOERR_WRITE, whose low byte is IOERR), a read-only file system or file as SQLITE_READONLY.
A failed write rolls its transaction back, and the WAL keeps every commit before it, so the
store is intact and the next write succeeds once there is room.
"""
from __future__ import annotations

import sqlite3
from typing import Optional

_REASONS = {
    sqlite3.SQLITE_FULL: "the disk is full",
    sqlite3.SQLITE_IOERR: "a disk I/O error (a full disk or a file-size limit reads the same)",
    sqlite3.SQLITE_READONLY: "the store is read-only (a read-only file system or run directory)",
    sqlite3.SQLITE_CANTOPEN: "the store's files cannot be opened or created",
}


def storage_fault(e: BaseException) -> Optional[str]:
    """Why SQLite could not write, in words, when ``e`` is a storage fault; else None."""
    code = getattr(e, "sqlite_errorcode", None) if isinstance(e, sqlite3.Error) else None
    if code is None:
        return None
    return _REASONS.get(code & 0xFF)
