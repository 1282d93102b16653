"""Read the store's write-ahead log before SQLite recovers it, and say what recovery will drop.

After a crash, SQLite replays ``clawrl.sqlite-wal`` frame by frame and stops at the first frame
whose salts or running checksum do not match; everything from there on is silently dropped. That
is right for a torn tail (a commit that was being written when the process died: it never
returned, so no turn in it was acknowledged, since ``synchronous=FULL`` fsyncs every commit
before it returns). It is data loss when a frame in the middle is damaged (a bad disk, a bad
copy): the commits after it were acknowledged. SQLite cannot tell the two apart afterwards, and
its recovery rewrites the log, so the server checks first (``check_wal``, called before the
store opens): a torn tail is logged as a warning, a damaged frame with valid-looking frames after
it as an error that counts the commits lost, and the damaged log is copied aside for forensics.

The format (https://www.sqlite.org/fileformat.html, "The WAL File Format"): a 32-byte header
(magic, version, page size, checkpoint sequence, two salts, two checksums), then frames of a
24-byte header (page number, database size after a commit or 0, the salts, the checksums) and
one page. The checksum runs over the header's first 24 bytes, then over each frame's first 8
bytes and its page, in 32-bit words of the byte order the magic names.
"""
from __future__ import annotations

import logging
import shutil
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

HEADER, FRAME_HEADER = 32, 24
_MAGIC = {0x377F0682: "<", 0x377F0683: ">"}  # the low bit: checksum words big-endian
_MASK = 0xFFFFFFFF


@dataclass
class WalReport:
    frames: int  # frames SQLite will replay (through the last valid commit)
    commits: int  # commits among them
    torn_bytes: int = 0  # the unfinished last write: frames after the last commit, a half-written frame
    damaged_frame: Optional[int] = None  # a frame that fails although frames written after it follow
    commits_after_damage: int = 0  # commit frames after the damaged one: acknowledged, and lost


def _checksum(data: bytes, order: str, s0: int, s1: int) -> tuple[int, int]:
    words = struct.unpack(f"{order}{len(data) // 4}I", data)
    for i in range(0, len(words), 2):
        s0 = (s0 + words[i] + s1) & _MASK
        s1 = (s1 + words[i + 1] + s0) & _MASK
    return s0, s1


def inspect_wal(wal: Path) -> Optional[WalReport]:
    """What recovery will keep and drop of ``wal``; None when there is no log or a header SQLite
    ignores. Frames of an earlier generation (other salts) after the valid ones are normal: SQLite
    rewrites the log from the start after a checkpoint and leaves the old frames behind."""
    try:
        data = wal.read_bytes()
    except FileNotFoundError:
        return None
    if len(data) < HEADER:
        return None
    magic, _version, page_size, _seq, salt1, salt2, c0, c1 = struct.unpack(">8I", data[:HEADER])
    order = _MAGIC.get(magic)
    if order is None or page_size < 512 or page_size & (page_size - 1) or \
            _checksum(data[:24], order, 0, 0) != (c0, c1):
        return None
    size = FRAME_HEADER + page_size
    s0, s1 = c0, c1
    frames = commits = kept = kept_commits = 0
    offset = HEADER
    while offset + size <= len(data):
        page, db_size, f1, f2, k0, k1 = struct.unpack(">6I", data[offset:offset + FRAME_HEADER])
        if (f1, f2) != (salt1, salt2):
            break
        s0, s1 = _checksum(data[offset:offset + 8], order, s0, s1)
        s0, s1 = _checksum(data[offset + FRAME_HEADER:offset + size], order, s0, s1)
        if (s0, s1) != (k0, k1) or page == 0:
            break
        frames, offset = frames + 1, offset + size
        if db_size:
            commits += 1
            kept, kept_commits = frames, commits
    report = WalReport(kept, kept_commits, torn_bytes=(frames - kept) * size)

    def salts_at(o: int) -> tuple[int, int]:
        return struct.unpack(">2I", data[o + 8:o + 16])

    if offset + size > len(data):  # a half-written frame ends the file
        report.torn_bytes += len(data) - offset
        return report
    ours = [o for o in range(offset + size, len(data) - size + 1, size) if salts_at(o) == (salt1, salt2)]
    if ours:  # written after the failing frame: that frame is damage, not an unfinished end
        report.torn_bytes = 0
        report.damaged_frame = frames + 1  # 1-based, as a reader counts
        report.commits_after_damage = sum(1 for o in ours if struct.unpack(">I", data[o + 4:o + 8])[0])
    elif salts_at(offset) == (salt1, salt2):  # the last frame written fails: the write never finished
        report.torn_bytes += size
    return report


def check_wal(db_path: Path) -> Optional[WalReport]:
    """Inspect ``db_path``'s write-ahead log before the store opens it; log what recovery drops,
    and keep a copy of a damaged log beside it (``<name>-wal.damaged-<unix time>``)."""
    wal = db_path.with_name(db_path.name + "-wal")
    report = inspect_wal(wal)
    if report is None:
        return None
    if report.damaged_frame is None:
        if report.torn_bytes:
            log.warning("the store's write-ahead log ends in %d bytes of a write that never finished (a crash "
                        "mid-commit); SQLite drops them. No acknowledged turn is in them: every acknowledged "
                        "commit was fsynced whole. %d commits are replayed", report.torn_bytes, report.commits)
        return report
    copy = wal.with_name(f"{wal.name}.damaged-{int(time.time())}")
    shutil.copy2(wal, copy)
    log.error("the store's write-ahead log is damaged at frame %d: SQLite replays the %d commits before it and "
              "drops the rest, %d later commit(s) that were acknowledged; their turns are lost. The damaged "
              "log is kept as %s. Check the disk", report.damaged_frame, report.commits,
              report.commits_after_damage, copy)
    return report
