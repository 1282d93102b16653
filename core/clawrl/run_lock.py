"""One server per run directory.

Two servers on one ``run_dir`` would both take the same ready samples from the store and train them
twice (each sample must train exactly once), and both would write checkpoints into the same place.
So ``clawrl serve`` holds an exclusive ``flock`` on ``run_dir/clawrl.lock`` for its whole life,
and a second server is refused in one line that names the holder's pid.

The kernel drops the lock when the holder dies, ``kill -9`` included, so a crash never leaves a
stale lock behind; the pid written in the file is only there to make the refusal useful. The file
descriptor is not inherited by child processes (Python opens it close-on-exec), so trainer ranks or
engines that outlive a dead server cannot keep its run directory locked.

Read-only commands (``clawrl sessions``, ``clawrl export``) and ``clawrl rollback`` (which only
records what the next start should do) do not take the lock: they work beside a running server.
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_FILENAME = "clawrl.lock"


class RunDirError(RuntimeError):
    """The run directory cannot be held; the message is one line."""


class RunDirBusy(RunDirError):
    """Another live process holds the run directory."""


class RunDirLock:
    """An exclusive, non-blocking ``flock`` on ``run_dir/clawrl.lock``, held until ``release()``."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_FILENAME
        self._fd: int | None = None

    def acquire(self) -> "RunDirLock":
        """Hold the lock; RunDirBusy when another process holds it, RunDirError when the directory
        cannot be written (read-only, full, not a directory): a server could store nothing there."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RunDirError(f"run_dir={self.path.parent} cannot be written: {_why(e)}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirBusy(f"run_dir={self.path.parent} is in use by another clawrl server (pid {holder}); "
                             "stop it first, or choose another run_dir=...") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            os.fsync(fd)
        except OSError as e:
            os.close(fd)
            raise RunDirError(f"run_dir={self.path.parent} cannot be written: {_why(e)}") from None
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)  # no stale pid for the next reader; the lock itself goes with close
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunDirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _why(e: OSError) -> str:
    """An OSError in words an operator acts on ("read-only file system", "no space left on device")."""
    return (e.strerror or str(e)).lower()
