"""Disk-full recoveries for the reliability campaign (issue 40, item 7): a serving, judging,
training server whose run directory is a small tmpfs, filled to the last byte and freed again.

Each cycle, under the campaign's load (``reliability.Load``): fill the tmpfs; a chat must get 507
``storage_unavailable`` (nothing stored, earlier turns safe) while it is full; free it; within
``RECOVERY_S`` the same server, never restarted, must answer and store a chat again, train a new
step and write a new checkpoint that verifies; no checkpoint temporary directory may be left
behind, no acknowledged turn lost, and the store must pass ``PRAGMA integrity_check``.
Mounting a tmpfs needs root (CI and the dev box are root); elsewhere the cycles are not run.
"""
from __future__ import annotations

import errno
import random
import sqlite3
import subprocess
import time
from pathlib import Path

import httpx

import reliability
from clawrl.checkpoints import CheckpointStore, CorruptCheckpoint
from clawrl.config import compose
from clawrl.store import STORE_FILENAME

TMPFS_MB = 48
HOLD_S = 5.0  # how long the disk stays full under load
RECOVERY_S = 120.0


def mount_tmpfs(path: Path, size_mb: int = TMPFS_MB) -> str | None:
    """Mount a tmpfs of ``size_mb`` on ``path``; None, or why it cannot be mounted here."""
    path.mkdir(parents=True, exist_ok=True)
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)],
                         capture_output=True, text=True)
    return None if out.returncode == 0 else (out.stderr.strip() or f"mount exited {out.returncode}")


def fill(directory: Path) -> Path:
    """Write a file in ``directory`` until its file system has no byte left."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as f:
        for size in (1 << 20, 1 << 12, 1):
            while True:
                try:
                    f.write(b"\0" * size)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break
    return filler


def _newest_verified_checkpoint(run_dir: Path) -> int:
    checkpoints = CheckpointStore(run_dir, compose(reliability.SERVE_OVERRIDES).train)
    for step in sorted(checkpoints.steps(), reverse=True):
        try:
            checkpoints.verify(step)
            return step
        except CorruptCheckpoint:
            continue
    return 0


def _probe(server: reliability.Server, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "Are you there?"}], "max_tokens": 4}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)


def _wait_for(condition, timeout: float) -> float | None:
    """Seconds until ``condition()`` held, or None when it did not within ``timeout``."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        try:
            if condition():
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return None


def cycle(server: reliability.Server, run_dir: Path, model: str, acked: reliability.Acked) -> dict:
    problems = []
    step_before = server.status()["training"]["train_step"]
    filler = fill(run_dir)
    time.sleep(0.5)
    full = _probe(server, model)
    try:
        code = full.json().get("error", {}).get("code")
    except ValueError:
        code = None
    if full.status_code != 507 or code != "storage_unavailable":
        problems.append(f"a chat on the full disk got {full.status_code} {full.text[:160]}, not 507")
    time.sleep(HOLD_S)
    step_at_free = server.status()["training"]["train_step"]
    checkpoint_at_free = _newest_verified_checkpoint(run_dir)
    filler.unlink()
    stored = _wait_for(lambda: _probe(server, model).status_code == 200, RECOVERY_S)
    trained = _wait_for(lambda: server.status()["training"]["train_step"] > step_at_free
                        and _newest_verified_checkpoint(run_dir) > checkpoint_at_free, RECOVERY_S)
    if server.proc.poll() is not None:
        problems.append(f"the server exited ({server.proc.returncode})")
    if stored is None:
        problems.append(f"no chat was stored within {RECOVERY_S:.0f} s of freeing the disk")
    if trained is None:
        problems.append(f"no new train step and checkpoint within {RECOVERY_S:.0f} s of freeing the disk")
    if leftovers := sorted(p.name for p in (run_dir / "checkpoints").glob(".tmp-*")):
        problems.append(f"checkpoint temporary directories left behind: {leftovers}")
    problems += reliability.lost_turns(run_dir, acked)
    with sqlite3.connect(run_dir / STORE_FILENAME) as c:
        if (check := c.execute("PRAGMA integrity_check").fetchone()[0]) != "ok":
            problems.append(f"integrity_check: {check}")
    return {"full_reply": full.status_code, "train_step_before": step_before, "train_step_at_free": step_at_free,
            "stored_again_s": None if stored is None else round(stored, 1),
            "trained_again_s": None if trained is None else round(trained, 1), "problems": problems}


def disk_full_campaign(mount_point: Path, cycles: int, seed: int, overrides: list[str], log: Path,
                       progress=print) -> dict:
    """``cycles`` fills and frees of a tmpfs run directory under load; {"skipped": why} without root."""
    if why := mount_tmpfs(mount_point):
        progress(f"disk full: not run ({why})")
        return {"skipped": why, "cycles": []}
    run_dir = mount_point / "run"
    acked, results = reliability.Acked(), []
    try:
        server = reliability.Server(run_dir, reliability._free_port(), log, overrides)
        model = server.model()
        load = reliability.Load(server.url, model, acked, random.Random(seed))
        load.start()
        try:
            if _wait_for(lambda: server.status()["training"]["train_step"] >= 1, RECOVERY_S) is None:
                raise RuntimeError("the server never trained before the disk was filled: " + server.text()[-2000:])
            for k in range(cycles):
                try:
                    result = cycle(server, run_dir, model, acked)
                except (httpx.HTTPError, OSError) as e:  # the server went away mid-cycle
                    result = {"full_reply": None, "stored_again_s": None, "trained_again_s": None,
                              "problems": [f"{type(e).__name__}: {e}"]}
                results.append(result)
                progress(f"disk full {k + 1}/{cycles}: full -> {result['full_reply']}; stored again after "
                         f"{result['stored_again_s']} s, trained again after {result['trained_again_s']} s: "
                         + ("recovered" if not result["problems"] else "; ".join(result["problems"])))
        finally:
            load.stop.set()
            server.kill()
            load.join(30)
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)
    return {"skipped": None, "cycles": results}
