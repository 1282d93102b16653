"""Load an HF causal-LM directory for serving.

Every way a model directory can be unusable is checked up front and reported as one line naming
the culprit (missing path, no config, unknown architecture, no chat template, a corrupt weights
file), because the user meets these errors at ``clawrl serve`` / ``clawrl chat`` time and a
transformers traceback tells them nothing. The directory is always given: the entry point resolves
``model.path`` (no path: the embedded model, ``clawrl.embedded.build.resolve_model``) before any
engine is made, so loading never picks or builds a model.
"""
from __future__ import annotations

import json
import logging
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from clawrl.engines.model_defaults import end_of_turn_ids

log = logging.getLogger(__name__)


class ModelLoadError(Exception):
    """A model directory that cannot be served; the message is one line meant for the user."""


@dataclass
class LoadedModel:
    """An HF model in eval mode plus what serving needs to know about it."""

    model: torch.nn.Module
    tokenizer: object  # a transformers PreTrainedTokenizerBase with a chat template
    name: str  # the id clients send as "model"
    path: str
    architecture: str  # e.g. Qwen3ForCausalLM
    max_context: int
    eos_token_ids: list[int]
    device: torch.device
    dtype: torch.dtype


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ModelLoadError(f"unknown device '{device}'") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device '{device}' requested but CUDA is not available")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ModelLoadError(f"unknown dtype '{dtype}'; use auto, float32, bfloat16 or float16")
    return table[dtype]


def require_path(path: str | None) -> str:
    """``path``, or a one-line ModelLoadError when the model was never resolved to a directory."""
    if path is None:
        raise ModelLoadError("model.path is not resolved: the entry point must resolve it before making an engine "
                             "(clawrl.embedded.build.resolve_model)")
    return path


def load_model(path: str, device: str = "auto", dtype: str = "auto", name: str | None = None) -> LoadedModel:
    """Load the model directory ``path`` for serving, as ``name`` (default: the directory's name)."""
    root = Path(require_path(path)).expanduser()
    if not root.exists():
        raise ModelLoadError(f"model path {root} does not exist")
    if not root.is_dir():
        raise ModelLoadError(f"model path {root} is not a directory")
    if not (root / "config.json").is_file():
        raise ModelLoadError(f"{root} has no config.json; expected a Hugging Face model directory")
    config = _load_config(root)
    arch = _causal_lm_architecture(config, root)
    tokenizer = _load_tokenizer(root)
    _check_weight_files(root)

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(root), dtype=dt)
    except Exception as e:  # transformers raises many types; the user needs the first line
        raise ModelLoadError(f"cannot load weights from {root}: {_first_line(e)}") from None
    model.to(dev).eval()
    max_context = int(getattr(config, "max_position_embeddings", 0) or 0) or int(tokenizer.model_max_length)
    eos = end_of_turn_ids(tokenizer, getattr(model, "generation_config", None), model.config)
    log.info("loaded %s (%s) from %s on %s/%s, context %d, eos %s",
             name or root.name, arch, root, dev, str(dt).removeprefix("torch."), max_context, eos)
    return LoadedModel(model, tokenizer, name or root.name, str(root), arch, max_context, eos, dev, dt)


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


def _load_config(root: Path):
    try:
        raw = json.loads((root / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{root / 'config.json'} is not valid JSON: {_first_line(e)}") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if not model_type:
        raise ModelLoadError(f"{root / 'config.json'} has no model_type; unsupported architecture")
    if model_type not in CONFIG_MAPPING_NAMES:
        raise ModelLoadError(f"unsupported architecture: model_type '{model_type}' is unknown to transformers")
    try:
        return AutoConfig.from_pretrained(str(root))
    except Exception as e:
        raise ModelLoadError(f"cannot read {root / 'config.json'}: {_first_line(e)}") from None


def _causal_lm_architecture(config, root: Path) -> str:
    model_type = config.model_type
    declared = list(getattr(config, "architectures", None) or [])
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        named = f" ({declared[0]})" if declared else ""
        raise ModelLoadError(f"unsupported architecture: model_type '{model_type}'{named} is not a causal language model")
    if declared and not any(a.endswith("ForCausalLM") or a.endswith("LMHeadModel") for a in declared):
        raise ModelLoadError(f"unsupported architecture: {declared[0]} in {root} is not a causal language model")
    return declared[0] if declared else MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]


def _load_tokenizer(root: Path):
    try:
        tok = AutoTokenizer.from_pretrained(str(root))
    except Exception as e:
        raise ModelLoadError(f"cannot load the tokenizer from {root}: {_first_line(e)}") from None
    if not getattr(tok, "chat_template", None):
        raise ModelLoadError(
            f"{root} has no chat template (tokenizer_config.json chat_template or chat_template.jinja); "
            "clawrl serves chat models only"
        )
    return tok


def _check_weight_files(root: Path) -> None:
    """Refuse truncated or garbled weight files by name before transformers trips over them."""
    shards = sorted(root.glob("*.safetensors"))
    if not shards and not any(root.glob("*.bin")) and not any(root.glob("*.pt")):
        raise ModelLoadError(f"{root} has no weights (*.safetensors or pytorch_model*.bin)")
    for f in shards:
        problem = _safetensors_problem(f)
        if problem:
            raise ModelLoadError(f"corrupt weights file {f}: {problem}")
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            needed = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError):
            raise ModelLoadError(f"corrupt weights index {index}") from None
        missing = sorted(n for n in needed if not (root / n).is_file())
        if missing:
            raise ModelLoadError(f"weights file {root / missing[0]} named in {index.name} is missing")


def _safetensors_problem(f: Path) -> str | None:
    """The safetensors layout: u64 header length, JSON header of tensor byte ranges, the data."""
    size = f.stat().st_size
    try:
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                return "file is shorter than its header"
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                return "header length exceeds the file size (truncated?)"
            header = json.loads(fh.read(n))
    except (OSError, ValueError) as e:
        return f"unreadable header ({_first_line(e)})"
    if not isinstance(header, dict):
        return "header is not a JSON object"
    end = 0
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        try:
            end = max(end, int(meta["data_offsets"][1]))
        except (TypeError, KeyError, IndexError, ValueError):
            return f"tensor {key} has no valid data_offsets"
    if 8 + n + end > size:
        return f"truncated: {size} bytes, the header describes {8 + n + end}"
    return None

