"""Checkpoints of the trainer, and rollback to an earlier weight version.

Layout under ``run_dir/checkpoints/``::

    step_<N>/weights.safetensors    full model in the serving dtype (or adapter.safetensors: the LoRA adapter alone)
    step_<N>/trainer_state.pt       RNG, step, weight version, buffer state
    step_<N>/optimizer.pt           the newest checkpoint only: optimizer state, and the trainer's
                                    higher-precision weights when they differ from the served ones
    step_<N>/manifest.json          step, weight version, kind, sha256 + size of every file
    VERSION                         the highest weight version ever served (a high-water mark)
    ROLLBACK                        a pending or applied rollback (see ``rollback``)

A checkpoint is written into a temporary directory, fsynced and renamed into place, so a crash
leaves either the old set or the new one, never half a checkpoint. A write that fails (a full disk)
removes its temporary files at once, so the failure does not keep the disk full; temporary files a
crash left behind are removed at the next start. On start, the newest checkpoint whose files match
their checksums is loaded; an unreadable or corrupt one is skipped with a log line and the previous
one is used.

Versions only move forward. Every token a sample holds is tagged with the version that produced
it, and the buffer counts staleness by subtracting versions. So when the weights resumed are older
than what was served last (the newest checkpoint is corrupt, the run crashed between checkpoints,
or a rollback), they are served under a new number, ``highest version ever served + 1``, and every
sample of the abandoned line simply becomes older by version arithmetic.

Rollback (``clawrl rollback --run-dir D --to V``) only writes ``ROLLBACK``; the next start applies
it: it loads the checkpoint of version ``V``, saves it again as a new checkpoint with a higher step
and the new version, and records the abandoned steps so a later fallback never resumes them.

Size. On a GPU the trainer keeps float32 masters and AdamW moments: for a 1.7B model 6.9 GB of
masters and 13.8 GB of moments beside 3.4 GB of bf16 weights. Every checkpoint keeps the weights in
the dtype the engine serves (what an export or a rollback serves); only the newest keeps
``optimizer.pt``, which a resume needs to continue exactly. Writing a checkpoint drops the
previous ones' (manifest first, then the file, so a crash leaves each checkpoint valid). A resume
from an older one -- a rollback, or a fallback past a corrupt newest -- restarts the optimizer from
the served weights, and the trainer says so in the log.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from clawrl.config import TrainConfig
from clawrl.errors import CliError
from clawrl.hashes import sha256_file
from clawrl.trainers.base import Trainer, TrainerError

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"
OPTIMIZER_FILE = "optimizer.pt"
MANIFEST = "manifest.json"
VERSION_FILE = "VERSION"
ROLLBACK_FILE = "ROLLBACK"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_SUFFIX = ".tmp"
_TEMP_DIR = re.compile(r"^\.(tmp|old)-step_\d+-\d+$")  # a checkpoint being written, or one being replaced


class CheckpointError(RuntimeError):
    """A checkpoint problem the user must act on; the message is one line."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint whose files are missing, unreadable or fail their checksum."""


@dataclass
class ResumeState:
    """What a start resumed from: the step, the version to serve, and the buffer's saved state.

    ``source_version`` is the version the weights were saved as; when it differs from
    ``weight_version`` the weights are served again under a new number (see the module docstring)."""

    step: int
    weight_version: int
    buffer_state: dict | None
    checkpoint: Path
    source_version: int
    rolled_back: bool = False


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _torch_save(obj, path: Path) -> None:
    """``torch.save`` through a Python file, so that a full disk raises its OSError (torch's own
    writer reports it as an unexplained RuntimeError)."""
    with open(path, "wb") as f:
        torch.save(obj, f)


def _write_json(path: Path, data: dict) -> None:
    """Atomically replace ``path`` with ``data`` (write, fsync, rename; a failed write leaves no temp)."""
    tmp = path.with_name(f".{path.name}{_TMP_SUFFIX}")
    try:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync(path.parent)


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is unreadable: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return data


class CheckpointStore:
    """The checkpoints of one run directory: save, prune, resume, rollback bookkeeping."""

    def __init__(self, run_dir: str | Path, train_cfg: TrainConfig | None = None):
        self.root = Path(run_dir) / "checkpoints"
        cfg = train_cfg or TrainConfig()
        if cfg.save_every < 1 or cfg.keep_last < 1:
            raise CheckpointError(f"train.save_every and train.keep_last must be >= 1, got "
                                  f"{cfg.save_every} and {cfg.keep_last}")
        self.save_every, self.keep_last = cfg.save_every, cfg.keep_last

    # ---------------------------------------------------------------- listing

    def steps(self) -> list[int]:
        """Steps of the checkpoint directories present, newest first (valid or not)."""
        if not self.root.is_dir():
            return []
        found = (_STEP_DIR.match(p.name) for p in self.root.iterdir() if p.is_dir())
        return sorted((int(m.group(1)) for m in found if m), reverse=True)

    def path(self, step: int) -> Path:
        return self.root / f"step_{step}"

    def manifest(self, step: int) -> dict | None:
        """The manifest of ``step``, or None when it is missing or unreadable."""
        try:
            return _read_json(self.path(step) / MANIFEST)
        except CheckpointError:
            return None

    def high_water(self) -> int:
        data = _read_json(self.root / VERSION_FILE) or {}
        return int(data.get("max_version", 0))

    def record_version(self, version: int) -> None:
        """Remember that ``version`` was served (only ever raises the mark)."""
        if version > self.high_water():
            self.root.mkdir(parents=True, exist_ok=True)
            _write_json(self.root / VERSION_FILE, {"max_version": int(version)})

    def rollback_record(self) -> dict | None:
        return _read_json(self.root / ROLLBACK_FILE)

    def _abandoned(self, step: int, record: dict | None) -> bool:
        return any(lo < step <= hi for lo, hi in (record or {}).get("abandoned", []))

    # ---------------------------------------------------------------- saving

    def after_step(self, trainer: Trainer, weight_version: int, buffer_state: dict | None = None) -> Path | None:
        """Call after each successful train step and weight push: records the served version and
        saves a checkpoint every ``train.save_every`` steps."""
        self.record_version(weight_version)
        if trainer.step % self.save_every == 0:
            return self.save(trainer, weight_version, buffer_state)
        return None

    def save(self, trainer: Trainer, weight_version: int, buffer_state: dict | None = None) -> Path:
        """Write ``step_<trainer.step>`` atomically, then prune to the last ``train.keep_last``."""
        step = trainer.step
        state = trainer.state_dict()
        weights = {k: v.contiguous() for k, v in state.pop("weights").items()}
        optimizer = {"optimizer": state.pop("optimizer", None), "weights": None}
        serve_dtype = getattr(trainer, "serve_dtype", None)
        if serve_dtype is not None and any(v.is_floating_point() and v.dtype != serve_dtype for v in weights.values()):
            # the served dtype for every checkpoint; the trainer's own precision for the newest only
            optimizer["weights"] = weights
            weights = {k: v.to(serve_dtype) if v.is_floating_point() else v for k, v in weights.items()}
        kind = state["kind"]
        self.root.mkdir(parents=True, exist_ok=True)
        self.record_version(weight_version)
        tmp = self.root / f".tmp-step_{step}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            files = self._write_into(tmp, step, kind, weights, state, optimizer, weight_version, buffer_state)
            final = self._move_into_place(tmp, step)
        except BaseException:  # a full disk, most often: what was written goes, the disk is not kept full
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("checkpoint %s saved (weight version %d, %s, %s)", final, weight_version, kind,
                 f"{sum(m['bytes'] for m in files.values()) / 2**20:.1f} MiB")
        try:
            self._prune()
            self._drop_optimizer_state(keep=step)
        except OSError as e:  # the new checkpoint is whole; the next save tidies up again
            log.warning("checkpoint %s saved, but tidying the older ones failed (%s); the next save retries",
                        final, e)
        return final

    def _write_into(self, tmp: Path, step: int, kind: str, weights: dict, state: dict, optimizer: dict,
                    weight_version: int, buffer_state: dict | None) -> dict:
        """Write a checkpoint's files and manifest into ``tmp``, fsynced; returns the manifest's files."""
        weights_file = "adapter.safetensors" if kind == "lora" else "weights.safetensors"
        save_file(weights, str(tmp / weights_file), metadata={"step": str(step), "kind": kind})
        _torch_save({**state, "weight_version": int(weight_version), "buffer_state": buffer_state}, tmp / STATE_FILE)
        names = [weights_file, STATE_FILE]
        if optimizer["optimizer"] is not None:
            _torch_save(optimizer, tmp / OPTIMIZER_FILE)
            names.append(OPTIMIZER_FILE)
        files = {}
        for name in names:
            _fsync(tmp / name)
            files[name] = {"sha256": sha256_file(tmp / name), "bytes": (tmp / name).stat().st_size}
        manifest = {"format": 2, "step": step, "weight_version": int(weight_version), "kind": kind,
                    "created_at": time.time(), "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
        _fsync(tmp / MANIFEST)
        _fsync(tmp)
        return files

    def _move_into_place(self, tmp: Path, step: int) -> Path:
        final = self.path(step)
        if final.exists():  # an older, unusable checkpoint of the same step: replace it
            stale = self.root / f".old-step_{step}-{os.getpid()}"
            os.replace(final, stale)
            try:
                os.replace(tmp, final)
            except BaseException:
                os.replace(stale, final)
                raise
            shutil.rmtree(stale, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync(self.root)
        return final

    def remove_temporaries(self) -> None:
        """Remove what a crash mid-write left behind (a checkpoint's temporary directory, a JSON
        file's temporary copy), in one log line. Only at start, under the run lock: nothing is
        being written then."""
        if not self.root.is_dir():
            return
        found = [p for p in self.root.iterdir() if _TEMP_DIR.match(p.name) or p.name.endswith(_TMP_SUFFIX)]
        found += [p for step in self.steps() for p in self.path(step).glob(f".*{_TMP_SUFFIX}")]
        if not found:
            return
        size = sum(f.stat().st_size for p in found for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file())
        for p in found:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        log.warning("removed %d temporary checkpoint file(s) an earlier run left behind (%.1f MiB): %s", len(found),
                    size / 2**20, ", ".join(sorted(str(p.relative_to(self.root)) for p in found)))

    def _drop_optimizer_state(self, keep: int) -> None:
        """Only the newest checkpoint keeps ``optimizer.pt``: each other one loses it, manifest first
        (an atomic rewrite), then the file, so that every checkpoint stays valid at every moment."""
        for step in self.steps():
            path = self.path(step)
            if step == keep or not (path / OPTIMIZER_FILE).exists():
                continue
            manifest = self.manifest(step)
            if manifest is not None and OPTIMIZER_FILE in manifest.get("files", {}):
                manifest["files"] = {k: v for k, v in manifest["files"].items() if k != OPTIMIZER_FILE}
                _write_json(path / MANIFEST, manifest)
            (path / OPTIMIZER_FILE).unlink(missing_ok=True)
            log.info("checkpoint step_%d: optimizer state dropped (only the newest, step_%d, keeps it)", step, keep)

    def _prune(self) -> None:
        """Keep the newest ``keep_last`` checkpoints of the live line. Checkpoints of an abandoned
        line (after a rollback) are left alone, and so is a pending rollback's target."""
        record = self.rollback_record()
        pending = record.get("target_step") if record and not record.get("applied") else None
        live = [s for s in self.steps() if not self._abandoned(s, record) and s != pending]
        for step in live[self.keep_last:]:
            shutil.rmtree(self.path(step), ignore_errors=True)
            log.info("checkpoint step_%d pruned (train.keep_last=%d)", step, self.keep_last)

    # ---------------------------------------------------------------- loading

    def verify(self, step: int) -> dict:
        """The manifest of ``step`` if every file matches its recorded size and checksum."""
        path = self.path(step)
        try:
            manifest = _read_json(path / MANIFEST)
        except CheckpointError as e:
            raise CorruptCheckpoint(str(e)) from None
        if manifest is None:
            raise CorruptCheckpoint(f"{path} has no {MANIFEST}")
        try:
            files = dict(manifest["files"])
            int(manifest["weight_version"]), int(manifest["step"])
        except (KeyError, TypeError, ValueError):
            raise CorruptCheckpoint(f"{path / MANIFEST} lacks files, step or weight_version") from None
        for name, meta in files.items():
            f = path / name
            if not f.is_file():
                raise CorruptCheckpoint(f"{f} is missing")
            if f.stat().st_size != meta.get("bytes") or sha256_file(f) != meta.get("sha256"):
                raise CorruptCheckpoint(f"{f} does not match its checksum")
        return manifest

    def load(self, step: int) -> tuple[dict, dict]:
        """``(trainer state with weights, manifest)`` of a verified checkpoint."""
        manifest = self.verify(step)
        path = self.path(step)
        weights_file = next((n for n in manifest["files"] if n.endswith(".safetensors")), None)
        if weights_file is None or STATE_FILE not in manifest["files"]:
            raise CorruptCheckpoint(f"{path} lacks its weights or {STATE_FILE}")
        try:
            state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
            state["weights"] = load_file(str(path / weights_file))
            if OPTIMIZER_FILE in manifest["files"]:
                extra = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
                state["optimizer"] = extra["optimizer"]
                if extra.get("weights") is not None:  # the trainer's own precision, not the served rounding
                    state["weights"] = extra["weights"]
        except Exception as e:  # checksums matched, yet unreadable: written by an incompatible version
            reason = str(e).splitlines()[0][:200] if str(e) else ""
            raise CorruptCheckpoint(f"{path} is unreadable: {type(e).__name__}: {reason}") from None
        return state, manifest

    def resume(self, trainer: Trainer) -> ResumeState | None:
        """Load the newest usable checkpoint into ``trainer`` (applying a pending rollback first).

        Returns None when there is nothing to resume (a fresh run). The returned version is the one
        to serve: the checkpoint's own, or a new one above everything served when the weights are
        older than the newest served version.
        """
        self.remove_temporaries()
        record = self.rollback_record()
        steps = self.steps()
        pending = bool(record) and not record.get("applied")
        if pending:
            target = int(record["target_step"])
            order = [s for s in steps if s <= target]
            log.info("applying the rollback to step_%d (weight version %s) requested with clawrl rollback",
                     target, record.get("target_version"))
        else:
            order = [s for s in steps if not self._abandoned(s, record)]
        for step in order:
            try:
                state, manifest = self.load(step)
                trainer.load_state_dict(state)
            except CorruptCheckpoint as e:
                log.warning("checkpoint step_%d is unusable (%s); falling back to the previous one", step, e)
                continue
            except TrainerError as e:
                raise CheckpointError(f"cannot resume from {self.path(step)}: {e}") from None
            buffer_state = state.get("buffer_state")
            if pending:
                return self._apply_rollback(trainer, record, step, int(manifest["weight_version"]), buffer_state)
            version = saved_as = int(manifest["weight_version"])
            served = self.high_water()
            if version < served:
                log.warning("checkpoint step_%d holds weight version %d, but version %d was served since; "
                            "serving its weights as version %d", step, version, served, served + 1)
                version = served + 1
            self.record_version(version)
            log.info("resumed from checkpoint step_%d: trainer step %d, weight version %d",
                     step, trainer.step, version)
            return ResumeState(trainer.step, version, buffer_state, self.path(step), saved_as)
        if order:
            log.error("no usable checkpoint among %s; starting from the base model", [f"step_{s}" for s in order])
        elif pending:
            raise CheckpointError(f"rollback target step_{record['target_step']} is gone from {self.root}")
        return None

    def _apply_rollback(self, trainer: Trainer, record: dict, step: int, saved_as: int,
                        buffer_state: dict | None) -> ResumeState:
        newest = max(self.steps())
        version = max(int(record["new_version"]), self.high_water() + 1)
        trainer.step = newest + 1  # steps keep increasing, so the rolled-back line never collides
        path = self.save(trainer, version, buffer_state)
        record = {**record, "applied": True, "applied_step": trainer.step, "applied_version": version,
                  "abandoned": [*record.get("abandoned", []), [step, newest]]}
        _write_json(self.root / ROLLBACK_FILE, record)
        self._prune()
        log.warning("rolled back to step_%d: serving its weights as version %d (saved as %s); samples of "
                    "versions up to %d stay in the buffer as older samples", step, version, path.name, version - 1)
        return ResumeState(trainer.step, version, buffer_state, path, saved_as, rolled_back=True)

    # ---------------------------------------------------------------- rollback

    def request_rollback(self, to_version: int) -> dict:
        """Record that the next start should resume the checkpoint of weight version ``to_version``,
        served under a new version above every version so far. Returns the record."""
        steps = self.steps()
        if not steps:
            raise CheckpointError(f"no checkpoints in {self.root}")
        versions = {s: m["weight_version"] for s in steps if (m := self.manifest(s)) and "weight_version" in m}
        matches = [s for s, v in versions.items() if int(v) == to_version]
        if not matches:
            known = ", ".join(str(v) for v in sorted(set(versions.values()))) or "none readable"
            raise CheckpointError(f"no checkpoint has weight version {to_version}; available: {known}")
        target = max(matches)
        try:
            self.verify(target)
        except CorruptCheckpoint as e:
            raise CheckpointError(f"the checkpoint of weight version {to_version} is corrupt: {e}") from None
        previous = self.rollback_record() or {}
        new_version = max([self.high_water(), *map(int, versions.values()),
                           int(previous.get("applied_version", previous.get("new_version", 0)))]) + 1
        record = {"target_step": target, "target_version": to_version, "new_version": new_version,
                  "requested_at": time.time(), "applied": False, "abandoned": previous.get("abandoned", [])}
        _write_json(self.root / ROLLBACK_FILE, record)
        return record


def rollback_cli(args) -> int:
    """``clawrl rollback --run-dir D --to VERSION``."""
    store = CheckpointStore(args.run_dir)
    try:
        record = store.request_rollback(int(args.to))
    except CheckpointError as e:
        raise CliError(str(e)) from None
    print(f"clawrl: rollback recorded: the next start resumes step_{record['target_step']} (weight version "
          f"{record['target_version']}) and serves it as weight version {record['new_version']}", flush=True)
    return 0
