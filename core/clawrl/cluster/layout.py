"""Does a parallel layout fit the model and the machines? Checked on every node before any process
group forms, so a bad ``cluster.tp``/``cluster.pp`` fails in a second with the numbers named, not
minutes later inside megatron with a shape error.
"""
from __future__ import annotations

import json
from pathlib import Path

from clawrl.config import ConfigError


def read_hf_config(path: str | None) -> tuple[dict, str]:
    """``config.json`` of the HF model directory ``path`` and the model's display name. ``path`` is
    resolved by the entry point (``clawrl.embedded.build.resolve_model``); None is refused."""
    if path is None:
        raise ConfigError("model.path is not resolved: the entry point must resolve it before checking a layout "
                          "(clawrl.embedded.build.resolve_model)")
    root = Path(path).expanduser()
    cfg_file = root / "config.json"
    try:
        hf_config = json.loads(cfg_file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"model.path={root} has no config.json; expected a Hugging Face model directory") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{cfg_file} is not readable JSON: {str(e).splitlines()[0]}") from None
    if not isinstance(hf_config, dict):
        raise ConfigError(f"{cfg_file} is not a JSON object")
    return hf_config, hf_config.get("clawrl_model_name") or root.name


def check_layout(hf_config: dict, tp: int, pp: int, world_size: int, model: str = "the model") -> None:
    """Refuse (ConfigError, one line) a layout that does not divide the model or the trainer ranks.

    Tensor parallelism splits attention heads, key/value heads and the vocabulary over ``tp``
    ranks; pipeline parallelism splits the layers over ``pp`` stages; what remains of the world is
    data parallel, so ``tp * pp`` must divide it.
    """
    for name, value in (("cluster.tp", tp), ("cluster.pp", pp)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    heads = _count(hf_config, "num_attention_heads", model)
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    layers = _count(hf_config, "num_hidden_layers", model)
    vocab = _count(hf_config, "vocab_size", model)
    if heads % tp:
        raise ConfigError(f"cluster.tp={tp} does not divide the {heads} attention heads of {model}")
    if kv_heads % tp:
        raise ConfigError(f"cluster.tp={tp} does not divide the {kv_heads} key/value heads of {model}")
    if vocab % tp:
        raise ConfigError(f"cluster.tp={tp} does not divide the vocabulary of {vocab} tokens of {model}")
    if layers % pp:
        raise ConfigError(f"cluster.pp={pp} does not divide the {layers} hidden layers of {model}")
    if world_size % (tp * pp):
        raise ConfigError(f"cluster.tp={tp} x cluster.pp={pp} = {tp * pp} does not divide the {world_size} trainer "
                          f"ranks (NNODES x GPUS_PER_NODE)")


def describe_layout(tp: int, pp: int, world_size: int, nnodes: int = 1) -> str:
    """One line for logs and ``clawrl check-parallel``: the layout and where its ranks are."""
    return (f"tp={tp} pp={pp} dp={world_size // (tp * pp)}: {world_size} trainer ranks on "
            f"{nnodes} node{'s' if nnodes != 1 else ''} x {world_size // nnodes}")


def _count(hf_config: dict, key: str, model: str) -> int:
    value = hf_config.get(key)
    if not isinstance(value, int) or value < 1:
        raise ConfigError(f"config.json of {model} has no positive integer {key} (got {value!r})")
    return value
