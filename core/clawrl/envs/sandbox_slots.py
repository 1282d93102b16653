"""Host uids for sandboxes: one unprivileged uid per concurrent sandbox, never shared.

Why a uid per sandbox: rlimits do not bind root, and RLIMIT_NPROC counts every process of a uid on
the whole host, so a process limit only means "this sandbox may have N processes" when nothing else
runs as that uid. Why a lock file per uid: two clawrl processes on one host (two runs, a test and a
run) draw from the same pool, and an ``flock`` is the one claim that the kernel drops by itself when
its holder dies, so a crashed run never leaks a slot.

When clawrl does not run as root it cannot switch uids; its own uid is already unprivileged, so every
sandbox runs as that uid (``UidSlot.shared``). RLIMIT_NPROC then counts the user's other processes
too, which is why the limit is only exact as root.
"""
from __future__ import annotations

import fcntl
import os
import pwd
import signal
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from clawrl.envs.base import EnvError

# Host-wide, not per TMPDIR: the uids are host-wide, so their claims must be too.
SLOT_LOCK_DIR = Path("/tmp/clawrl-sandbox-slots")


@dataclass
class UidSlot:
    """A claimed uid (and gid of the same number). ``shared`` means no claim was taken: clawrl is not
    root and every sandbox runs as clawrl's own uid."""

    uid: int
    gid: int
    index: int
    shared: bool
    _lock_fd: Optional[int] = None

    def release(self) -> None:
        """Drop the claim (idempotent)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None


def _uid_taken_by_account(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        return False


def _check_lock_dir() -> None:
    """Make the lock directory, and refuse one that another user could have planted in /tmp (a
    symlink, or a directory they own or may write): root would create files wherever it points."""
    try:
        SLOT_LOCK_DIR.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(SLOT_LOCK_DIR)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        raise EnvError(f"{SLOT_LOCK_DIR} is not a directory that only root may write; remove it")


def claim_slot(uid_base: int, slots: int) -> UidSlot:
    """Claim a free uid from ``uid_base .. uid_base+slots-1`` (as root), or the caller's own uid
    (not root). Uids that belong to an account in /etc/passwd are skipped: clawrl kills whatever runs
    as a slot's uid, which must never be a real user's processes. EnvError when all are taken."""
    if os.geteuid() != 0:
        return UidSlot(uid=os.getuid(), gid=os.getgid(), index=0, shared=True)
    _check_lock_dir()
    skipped = 0
    for index in range(slots):
        uid = uid_base + index
        if _uid_taken_by_account(uid):
            skipped += 1
            continue
        fd = os.open(SLOT_LOCK_DIR / f"{uid}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        # A previous holder that crashed may have left processes behind; the uid is ours now.
        kill_uid(uid, signal.SIGKILL)
        return UidSlot(uid=uid, gid=uid, index=index, shared=False, _lock_fd=fd)
    extra = f" ({skipped} skipped: they belong to accounts in /etc/passwd)" if skipped else ""
    raise EnvError(f"all {slots} sandbox slots (uids {uid_base}..{uid_base + slots - 1}) are in use{extra}; "
                   f"raise sandbox.slots or close sandboxes")


def _proc_uid(pid: str) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])  # the real uid
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return None


def pids_of_uid(uid: int) -> list[int]:
    """Live processes whose real uid is ``uid`` (from /proc)."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and _proc_uid(p) == uid]


def kill_uid(uid: int, sig: int) -> int:
    """Send ``sig`` to every process of ``uid``; how many there were. Never for uid 0 or our own."""
    if uid == 0 or uid == os.getuid():
        raise ValueError(f"refusing to kill every process of uid {uid}")
    pids = pids_of_uid(uid)
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return len(pids)
