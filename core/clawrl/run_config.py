"""The run's own config, stored in its run directory (``run_config.yaml``), and read back.

A run is started with overrides (``model.path``, ``train.*``, ``method``, a recipe's ``config.yaml``);
commands that later read the run (``clawrl replay``, ``clawrl export-model``) need the same settings,
and asking the user to repeat them invites a mismatch. So when a run starts (``attach_learning``, for
``clawrl serve``, a recipe, ``clawrl demo``) the composed config is written into the run directory, every
key with its resolved value, secrets left out: every key whose name ends in ``key``, ``secret``,
``password`` or ``token`` (``server.api_key``, ``server.admin_key``) is written as null, never its value,
and a credential inside any other string value (``clawrl.redact``: ``sk-...``, ``hf_...``, a bearer token)
is masked.

A restart with the same config leaves the file alone; a restart with another one keeps the earlier file
as ``run_config.1.yaml`` (``.2``, ...) and writes the new one, so ``run_config.yaml`` is always what the run
runs with now and nothing it ran with is lost.

``compose_for_run`` composes a command's config for an existing run: the stored config as a layer over
the defaults and the model's defaults, the command line's overrides over it (they win). It says what it
took (every stored value that differs from the default) and what the command line overrode. A run
directory from before clawrl stored its config composes from the command line alone, and says so.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

from clawrl.config import ClawrlConfig, ConfigError, all_keys, compose
from clawrl.errors import CliError
from clawrl.redact import is_secret_key, public_config

log = logging.getLogger(__name__)

CONFIG_FILE = "run_config.yaml"  # not config.yaml: a recipe's or the user's --config file may sit in a run dir
HEADER = ("# clawrl: the resolved config this run started with (keys naming a secret are written as null).\n"
          "# clawrl replay and clawrl export-model read it; their command-line overrides win.\n")


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in node.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_text(cfg: ClawrlConfig) -> str:
    """``cfg`` as the YAML stored in a run directory: every key, secrets as null."""
    data = public_config(dataclasses.asdict(cfg), secrets_as_null=True)
    return HEADER + OmegaConf.to_yaml(OmegaConf.create(data))


def save_run_config(cfg: ClawrlConfig, run_dir: str | Path) -> Path:
    """Write ``cfg`` into ``run_dir/run_config.yaml`` (atomically); an earlier, different one is kept as
    ``run_config.N.yaml``. Returns the path."""
    root = Path(run_dir)
    path = root / CONFIG_FILE
    text = config_text(cfg)
    try:
        root.mkdir(parents=True, exist_ok=True)
        if path.is_file():
            if path.read_text() == text:
                return path
            n = 1
            while (root / f"run_config.{n}.yaml").exists():
                n += 1
            os.replace(path, root / f"run_config.{n}.yaml")
            log.info("the run's config changed since it last started: the earlier one is kept as run_config.%d.yaml", n)
        fd, tmp = tempfile.mkstemp(dir=root, prefix=".run_config.", suffix=".yaml")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:
        raise CliError(f"cannot write the run's config to {path}: {e.strerror or e}") from None
    return path


@dataclass
class RunConfig:
    """A command's config for an existing run, and where its values came from."""

    cfg: ClawrlConfig
    stored: Optional[Path]  # the run's run_config.yaml, None when the run has none
    taken: dict[str, Any] = field(default_factory=dict)  # stored values that differ from the defaults
    overridden: list[str] = field(default_factory=list)  # keys the command line set
    dropped: list[str] = field(default_factory=list)  # stored keys this clawrl no longer knows
    earlier: list[Path] = field(default_factory=list)  # run_config.N.yaml: what the run started with before

    def notes(self, command: str) -> list[str]:
        """What to tell the user: one line each."""
        if self.stored is None:
            return [f"the run directory has no stored {CONFIG_FILE} (a run started before clawrl stored its config): "
                    f"{command} uses the command line's settings only; give the run's own (model.path, train.*, method)"]
        shown = ", ".join(f"{k}={v}" for k, v in self.taken.items()) or "all defaults"
        lines = [f"config from {self.stored}: {shown}"]
        if self.overridden:
            lines.append(f"overridden on the command line: {', '.join(self.overridden)}")
        if self.dropped:
            lines.append(f"{self.stored} holds keys this clawrl does not know, left out: {', '.join(self.dropped)}")
        if self.earlier:
            lines.append(f"the run was restarted with another config before ({', '.join(p.name for p in self.earlier)}"
                         f" kept); {CONFIG_FILE}, the newest, is used")
        return lines


def compose_for_run(run_dir: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """The config for a command on run ``run_dir``: defaults < the model's defaults < the run's stored
    config < ``overrides``. Raises ConfigError (one line) on an unreadable stored config or a bad
    override."""
    root = Path(run_dir).expanduser()
    path = root / CONFIG_FILE
    if not path.is_file():
        return RunConfig(compose(overrides), None)
    try:
        loaded = OmegaConf.to_container(OmegaConf.load(path))
    except Exception as e:
        raise ConfigError(f"{path}: {str(e).splitlines()[0]}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: expected key: value pairs")
    flat = _flat(loaded)
    known = set(all_keys())
    dropped = sorted(k for k in flat if k not in known)
    kept = {k: v for k, v in flat.items() if k in known and not is_secret_key(k)}
    layer = OmegaConf.create({})
    for k, v in kept.items():
        OmegaConf.update(layer, k, v, force_add=True)
    cfg = compose(overrides, layer=(str(path), layer))
    defaults = _flat(dataclasses.asdict(ClawrlConfig()))
    set_here = [o.split("=", 1)[0].lstrip("+~") for o in overrides]
    taken = {k: v for k, v in kept.items() if k not in set_here and defaults.get(k, object()) != v}
    earlier = sorted(root.glob("run_config.*.yaml"), key=lambda p: int(p.name.split(".")[1])
                     if p.name.split(".")[1].isdigit() else 0)
    return RunConfig(cfg, path, taken, set_here, dropped, earlier)
