"""Tell a storage fault (disk full, I/O error, read-only, unopenable) from every other error.

A full disk or a read-only run directory is the operator's problem and says so: the gateway
answers 507 with the reason and stores nothing of that request, while a SQLite error of any other
kind (a constraint, a bad statement) is a bug and stays an internal error. SQLite reports a write
that the file-size limit or a full disk refused as SQLITE_FULL or SQLITE_IOERR (an extended code,
e.g. IOERR_WRITE, whose low byte is IOERR), a read-only file system or file as SQLITE_READONLY.
A failed write rolls its transaction back, and the WAL keeps every commit before it, so the
store is intact and the next write succeeds once there is room.

Checkpoint writes fail differently: Python's own writes raise ``OSError`` (ENOSPC, EDQUOT, EFBIG
for a file-size limit, EROFS), torch wraps it in a ``RuntimeError`` raised from it, and safetensors
(Rust) names it in its message as ``(os error N)``; all of them count.
"""
from __future__ import annotations

import errno
import re
import sqlite3
from typing import Optional

_REASONS = {
    sqlite3.SQLITE_FULL: "the disk is full",
    sqlite3.SQLITE_IOERR: "a disk I/O error (a full disk or a file-size limit reads the same)",
    sqlite3.SQLITE_READONLY: "the store is read-only (a read-only file system or run directory)",
    sqlite3.SQLITE_CANTOPEN: "the store's files cannot be opened or created",
}
_OS_REASONS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EFBIG: "a file-size limit is reached",
    errno.EROFS: "the file system is read-only",
}
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def storage_fault(e: BaseException) -> Optional[str]:
    """Why the disk refused a write, in words, when ``e`` (or an error it was raised from) is a
    storage fault; else None."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, sqlite3.Error):
            code = getattr(e, "sqlite_errorcode", None)
            return None if code is None else _REASONS.get(code & 0xFF)
        if isinstance(e, OSError) and e.errno in _OS_REASONS:
            return _OS_REASONS[e.errno]
        rust = _RUST_OS_ERROR.search(str(e)) if not isinstance(e, OSError) else None
        if rust and int(rust.group(1)) in _OS_REASONS:
            return _OS_REASONS[int(rust.group(1))]
        e = e.__cause__ or e.__context__
    return None
