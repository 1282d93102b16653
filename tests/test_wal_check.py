"""A torn or damaged write-ahead log is told apart before SQLite's recovery drops it (issue 20,
item 5). The logs here come from a real crash: a process that commits rows with the store's own
settings (WAL, synchronous=FULL) and is killed with SIGKILL, so SQLite never checkpoints them."""
from __future__ import annotations

import logging
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from clawrl.wal_check import FRAME_HEADER, HEADER, check_wal, inspect_wal

ROWS = 12

CRASH = r"""
import os, signal, sqlite3, sys
c = sqlite3.connect(sys.argv[1], isolation_level=None)
c.execute("PRAGMA journal_mode=WAL"); c.execute("PRAGMA synchronous=FULL")
c.execute("PRAGMA wal_autocheckpoint=0")
c.execute("CREATE TABLE turns (id INTEGER PRIMARY KEY, body BLOB)")
if sys.argv[2] == "restart":  # fill the log, checkpoint it, and start it over from its first frame
    for i in range(30):
        c.execute("INSERT INTO turns (body) VALUES (randomblob(3000))")
    c.execute("PRAGMA wal_checkpoint(RESTART)")
    c.execute("DELETE FROM turns")
for i in range(int(sys.argv[3])):
    c.execute("BEGIN IMMEDIATE"); c.execute("INSERT INTO turns (body) VALUES (randomblob(3000))"); c.execute("COMMIT")
os.kill(os.getpid(), signal.SIGKILL)
"""


def crashed(tmp_path: Path, mode: str = "plain", rows: int = ROWS) -> Path:
    db = tmp_path / "clawrl.sqlite"
    subprocess.run([sys.executable, "-c", CRASH, str(db), mode, str(rows)], timeout=60)
    assert db.with_name("clawrl.sqlite-wal").stat().st_size > HEADER
    return db


def rows(db: Path) -> int:
    with sqlite3.connect(db) as c:
        assert c.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        return c.execute("SELECT count(*) FROM turns").fetchone()[0]


def frame_size(db: Path) -> int:
    wal = db.with_name(db.name + "-wal").read_bytes()
    return FRAME_HEADER + int.from_bytes(wal[8:12], "big")


def test_an_intact_log_after_a_crash_replays_every_commit(tmp_path, caplog):
    db = crashed(tmp_path)
    report = inspect_wal(db.with_name("clawrl.sqlite-wal"))
    assert report.commits == ROWS + 1 and report.torn_bytes == 0 and report.damaged_frame is None
    with caplog.at_level(logging.WARNING, logger="clawrl.wal_check"):
        check_wal(db)
    assert caplog.text == ""
    assert rows(db) == ROWS


def test_a_torn_last_write_is_a_warning_and_only_that_commit_goes(tmp_path, caplog):
    db = crashed(tmp_path)
    wal = db.with_name("clawrl.sqlite-wal")
    with open(wal, "r+b") as f:
        f.truncate(wal.stat().st_size - 100)  # the last frame half-written, as a crash mid-commit leaves it
    report = inspect_wal(wal)
    assert report.damaged_frame is None and report.torn_bytes > 0 and report.commits == ROWS
    with caplog.at_level(logging.WARNING, logger="clawrl.wal_check"):
        check_wal(db)
    assert "never finished" in caplog.text and "No acknowledged turn" in caplog.text
    assert not list(tmp_path.glob("*.damaged-*"))
    assert rows(db) == ROWS - 1  # SQLite dropped exactly the unfinished commit


def test_a_damaged_frame_is_an_error_counting_the_later_commits_lost_and_the_log_is_kept(tmp_path, caplog):
    db = crashed(tmp_path)
    wal = db.with_name("clawrl.sqlite-wal")
    size = frame_size(db)
    report = inspect_wal(wal)
    total_frames = (wal.stat().st_size - HEADER) // size
    data = bytearray(wal.read_bytes())
    bad = 6  # a frame in the middle: flip one byte of its page
    data[HEADER + (bad - 1) * size + FRAME_HEADER + 500] ^= 0xFF
    wal.write_bytes(bytes(data))
    damaged = inspect_wal(wal)
    assert damaged.damaged_frame == bad and damaged.frames < bad
    assert 0 < damaged.commits_after_damage and damaged.commits + damaged.commits_after_damage <= report.commits
    assert total_frames > bad
    with caplog.at_level(logging.WARNING, logger="clawrl.wal_check"):
        check_wal(db)
    record = next(r for r in caplog.records if r.levelno == logging.ERROR)
    assert f"damaged at frame {bad}" in record.getMessage() and "lost" in record.getMessage()
    kept = list(tmp_path.glob("clawrl.sqlite-wal.damaged-*"))
    assert len(kept) == 1 and kept[0].read_bytes() == bytes(data)  # evidence kept before recovery
    assert rows(db) == damaged.commits - 1  # what SQLite keeps is what the report said (1 commit: the table)


def test_frames_left_from_an_earlier_generation_of_the_log_are_normal(tmp_path, caplog):
    db = crashed(tmp_path, mode="restart", rows=3)
    report = inspect_wal(db.with_name("clawrl.sqlite-wal"))
    assert report.torn_bytes == 0 and report.damaged_frame is None and report.commits >= 3
    with caplog.at_level(logging.WARNING, logger="clawrl.wal_check"):
        check_wal(db)
    assert caplog.text == ""
    assert rows(db) == 3


@pytest.mark.parametrize("content", [b"", b"short", b"\0" * 64])
def test_no_log_or_a_header_sqlite_ignores_is_nothing_to_report(tmp_path, content):
    wal = tmp_path / "clawrl.sqlite-wal"
    assert inspect_wal(wal) is None
    wal.write_bytes(content)
    assert inspect_wal(wal) is None
