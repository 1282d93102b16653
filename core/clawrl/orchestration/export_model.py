"""``clawrl export-model``: a run's trained weights as a Hugging Face model directory.

A run directory holds trainer checkpoints (``clawrl.checkpoints``), which only clawrl reads: the
full model or only a LoRA adapter, optimizer state, no config or tokenizer. To use the trained
model anywhere else (``transformers``, another server, ``clawrl serve model.path=DIR`` in a new
run) it has to become an ordinary model directory: ``config.json``, the tokenizer with its chat
template, ``generation_config.json`` and ``model.safetensors``, from the base model the run trained
(``model.path``, as the run was configured: ``clawrl export-model`` composes the run's stored
``run_config.yaml`` under the command line's overrides, ``clawrl.run_config``) with the checkpoint's weights
in place.

The weights are exactly those the trainer served at that version: the checkpoint is found and read
by ``clawrl env eval``'s own code (``orchestration.evaluation.complete_checkpoint``: complete files
only, checksums checked, no lock taken, nothing written into the run directory, so it works beside
a live server), and a LoRA adapter is merged by the torch trainer's own ``export_weights``
(``serving_weights``), the merge it pushes to the engine. With ``--adapter`` the adapter is written
unmerged in PEFT's format instead (``adapter_config.json``, ``adapter_model.safetensors``, saved by
peft itself), to load over the base with ``peft.PeftModel.from_pretrained``.

Everything runs on the CPU (a live server may hold the GPU) and is written into a temporary sibling
of ``--out`` that is renamed into place at the end, so a failed export leaves nothing behind. The
weights are float32, the trainer's own precision (what the engine serves on a CPU), unless
``model.dtype`` says bfloat16 or float16 (what the engine serves on a GPU under ``auto``). The base
model's clawrl defaults (its ``clawrl.yaml``; the embedded model's ``conf/embedded.yaml``) go along
into a model directory as ``clawrl.yaml``, so serving the export composes the same configuration as
serving the base; ``clawrl_export.json`` records where the weights came from.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from transformers import AutoTokenizer
from transformers.utils import logging as transformers_logging

from clawrl.checkpoints import CheckpointError, CheckpointStore
from clawrl.config import MODEL_DEFAULTS_FILE, ClawrlConfig, compose, model_defaults_path
from clawrl.embedded.build import resolve_model
from clawrl.engines.loading import load_model, resolve_dtype
from clawrl.errors import CliError
from clawrl.orchestration.env_commands import count_arg
from clawrl.orchestration.evaluation import RunCheckpoint, complete_checkpoint, lora_trainer, serving_weights
from clawrl.run_config import compose_for_run

COMMAND = "clawrl export-model"
PROVENANCE = "clawrl_export.json"


@dataclass
class Exported:
    """What an export wrote: the directory, the checkpoint and version it holds, and how."""

    out: Path
    checkpoint: Path
    weight_version: int
    form: str  # "full" | "merged" (LoRA merged into the base) | "adapter" (PEFT)
    base: str
    notes: list[str]


def export_model(cfg: ClawrlConfig, run_dir: str | Path, out: str | Path, version: Optional[int] = None,
                 adapter: bool = False, note: Callable[[str], None] = lambda line: None) -> Exported:
    """Write run ``run_dir``'s checkpoint of weight ``version`` (default: the newest complete one)
    to the new directory ``out`` as an HF model (or, with ``adapter``, a PEFT adapter) over
    ``cfg.model.path``. Checkpoints passed over (incomplete, corrupt) are told to ``note`` as soon as
    the one to export is found. Raises CliError, with one line, on bad input."""
    root = Path(run_dir).expanduser()
    if not root.is_dir():
        raise CliError(f"--run-dir {run_dir}: no such run directory")
    out = Path(out).expanduser()
    _check_out(out)
    try:
        found, notes = complete_checkpoint(root, version)
    except CheckpointError as e:
        raise CliError(f"--run-dir {run_dir}: {e}") from None
    if found is None:
        raise CliError(_nothing_to_export(root, version, notes))
    for line in notes:
        note(line)
    kind = found.state.get("kind")
    if adapter and kind != "lora":
        raise CliError(f"--adapter: {found.checkpoint} holds {kind} weights, not a LoRA adapter "
                       "(the run trained without train.lora.enabled=true)")
    defaults = model_defaults_path(cfg.model.path)  # before the embedded model is resolved to its directory
    cfg = resolve_model(cfg)
    # On the CPU: a live server may hold the GPU, and the merge is the trainer's own on any device.
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, device="cpu"))
    base = str(cfg.model.path)
    tmp = out.parent / f".{out.name}.export-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if adapter:
            form = "adapter"
            _write_adapter(found, cfg, tmp)
        else:
            form = "merged" if kind == "lora" else "full"
            weights = serving_weights(found.state, found.checkpoint, cfg, command=COMMAND)
            _write_model(weights, found.checkpoint, cfg, tmp)
        if defaults is not None and not adapter:  # an adapter directory is no model.path
            shutil.copyfile(defaults, tmp / MODEL_DEFAULTS_FILE)
        (tmp / PROVENANCE).write_text(json.dumps({
            "run_dir": str(root.resolve()), "checkpoint": found.checkpoint.name,
            "weight_version": found.weight_version, "form": form, "base_model": base,
            "exported_at": time.time()}, indent=2) + "\n")
        try:
            os.replace(tmp, out)  # onto a missing or empty directory
        except OSError as e:
            raise CliError(f"--out {out}: cannot be written ({e.strerror or e})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Exported(out, found.checkpoint, found.weight_version, form, base, notes)


def _check_out(out: Path) -> None:
    if out.is_dir():
        if any(out.iterdir()):
            raise CliError(f"--out {out} exists and is not empty; give a new or empty directory")
    elif out.exists() or out.is_symlink():
        raise CliError(f"--out {out} exists and is not a directory")


def _nothing_to_export(root: Path, version: Optional[int], notes: list[str]) -> str:
    """The one-line reason there is no checkpoint to export, with what there is instead."""
    store = CheckpointStore(root)
    versions = sorted({int(m["weight_version"]) for s in store.steps()
                       if (m := store.manifest(s)) and "weight_version" in m})
    passed_over = f" ({len(notes)} incomplete or corrupt passed over: {notes[0]})" if notes else ""
    if version is None:
        return f"{root} has no complete checkpoint to export{passed_over}"
    known = ", ".join(map(str, versions)) or "none"
    return f"{root} has no complete checkpoint of weight version {version} (checkpointed versions: {known}){passed_over}"


def _dtype(cfg: ClawrlConfig) -> torch.dtype:
    return resolve_dtype(cfg.model.dtype, torch.device("cpu"))


def _write_model(weights: dict[str, torch.Tensor], checkpoint: Path, cfg: ClawrlConfig, tmp: Path) -> None:
    """The base model directory (config, tokenizer and chat template, generation config, as
    transformers loads them) saved again with ``weights`` in place. The checks of ``load_model``
    (a chat template, a causal LM, readable weights) apply to the base here."""
    loaded = load_model(str(cfg.model.path), device="cpu", dtype=cfg.model.dtype)
    model = loaded.model
    params = {name for name, _ in model.named_parameters()}  # tied weights appear once
    known = set(model.state_dict())
    missing, extra = sorted(params - set(weights)), sorted(set(weights) - known)
    if missing or extra:
        raise CliError(f"{checkpoint} does not fit the model {cfg.model.path} (was the run trained from another "
                       f"model.path?): missing {missing[:3]}, unexpected {extra[:3]}")
    dtype = _dtype(cfg)
    try:
        with torch.no_grad():
            model.load_state_dict({k: v.to(dtype) for k, v in weights.items()}, strict=False)
    except RuntimeError as e:  # a shape mismatch
        reason = str(e).strip().splitlines()
        raise CliError(f"{checkpoint} does not fit the model {cfg.model.path} (was the run trained from another "
                       f"model.path?): {reason[-1].strip() if reason else e}") from None
    model.save_pretrained(str(tmp))
    loaded.tokenizer.save_pretrained(str(tmp))


def _write_adapter(found: RunCheckpoint, cfg: ClawrlConfig, tmp: Path) -> None:
    """The LoRA adapter, unmerged, as peft saves it (``base_model_name_or_path``: the base), plus the
    base's tokenizer and chat template."""
    trainer = lora_trainer(found.state, found.checkpoint, cfg)
    trainer.model.save_pretrained(str(tmp))
    AutoTokenizer.from_pretrained(str(cfg.model.path)).save_pretrained(str(tmp))


def _parse_version(value: Optional[str]) -> Optional[int]:
    if value is None:
        return None
    if value.strip() == "0":
        raise CliError(f"--version must be a whole number >= 1, got {value!r} (version 0 is the base model)")
    return count_arg(value, "--version")


def export_model_cli(args) -> int:
    """``clawrl export-model --run-dir D [--version V] --out DIR [--adapter] [key=value ...]``."""
    version = _parse_version(args.version)
    note = lambda line: print(f"clawrl: {line}", file=sys.stderr, flush=True)  # noqa: E731
    run = compose_for_run(args.run_dir, args.overrides) if Path(args.run_dir).expanduser().is_dir() else None
    cfg = run.cfg if run is not None else compose(args.overrides)
    transformers_logging.disable_progress_bar()  # the console: notes, then the one line that says what was done
    done = export_model(cfg, args.run_dir, args.out, version=version, adapter=args.adapter, note=note)
    for line in run.notes(COMMAND) if run is not None else ():  # where the config came from (an error is one line)
        note(line)
    what = {"full": "full weights", "merged": f"LoRA merged into {done.base}",
            "adapter": f"PEFT LoRA adapter over {done.base}"}[done.form]
    print(f"clawrl: exported {done.checkpoint} (weight version {done.weight_version}, {what}) to {done.out}",
          flush=True)
    return 0
