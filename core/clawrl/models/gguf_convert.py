"""A GGUF file as a plain Hugging Face model directory, and the manifest that says what it holds.

transformers reads a GGUF (``gguf_file=``) by dequantizing every tensor to float32, but a model
loaded that way keeps GGUF's ``quantization_config`` and ``save_pretrained`` refuses it; the same
weights in a model built from the same config without it save as an ordinary directory
(safetensors, tokenizer, chat template, generation config) that every loader reads. What
transformers cannot read is refused from the header first, with the reason: an architecture its
GGUF loader does not know or that is no causal LM, a tensor type it cannot dequantize, a file with
no tokenizer or chat template (clawrl serves chat models).
"""
from __future__ import annotations

import contextlib
import io
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from clawrl.errors import CliError
from clawrl.hashes import sha256_file
from clawrl.models.catalog import MANIFEST
from clawrl.paths import share_tree

# The tensor types transformers' GGUF loader dequantizes (its GGUF documentation's list).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                   "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_XS", "IQ4_NL")
MANIFEST_FORMAT = 1


@dataclass(frozen=True)
class GgufFacts:
    """What the header says: the GGUF and HF architecture, tensor types and the licence it names."""

    architecture: str
    model_type: str
    tensor_types: dict[str, int]
    licence: str | None


def inspect_gguf(path: Path) -> GgufFacts:
    """The header of ``path``, or CliError naming why transformers could not make a chat model of it."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise CliError("reading a GGUF needs the gguf package: pip install 'clawrl[models]'") from None
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # a bad magic number, a truncated header: the reader raises several types
        raise CliError(f"{path} is not a readable GGUF file: {_first_line(e)}") from None
    arch = _field(reader, "general.architecture")
    if not arch:
        raise CliError(f"{path} names no general.architecture; not a model GGUF")
    try:
        model_type = load_gguf_checkpoint(str(path))["config"]["model_type"]
    except Exception as e:
        raise CliError(f"{path}: architecture '{arch}' is not one transformers' GGUF loader reads "
                       f"({_first_line(e)})") from None
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise CliError(f"{path}: architecture '{arch}' (model_type {model_type}) is not a causal language model")
    types = Counter(t.tensor_type.name for t in reader.tensors)
    unsupported = sorted(set(types) - set(SUPPORTED_TYPES))
    if unsupported:
        raise CliError(f"{path}: tensor type {', '.join(unsupported)} is not one transformers can dequantize "
                       f"(it reads {', '.join(SUPPORTED_TYPES)})")
    for key, what in (("tokenizer.ggml.model", "tokenizer"), ("tokenizer.chat_template", "chat template")):
        if not _field(reader, key):
            raise CliError(f"{path} has no {what} ({key}); clawrl serves chat models only")
    return GgufFacts(arch, model_type, dict(types), _field(reader, "general.license"))


def _field(reader, key: str):
    field = reader.fields.get(key)
    return field.contents() if field is not None else None


def _first_line(e: BaseException) -> str:
    return (str(e).strip() or type(e).__name__).splitlines()[0]


def convert_gguf(path: Path, out: Path) -> None:
    """Dequantize ``path`` into the new directory ``out`` (float32 weights, as dequantized)."""
    with contextlib.redirect_stderr(io.StringIO()):  # transformers' own bars; the caller shows progress
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        config = loaded.config
        del config.quantization_config  # GGUF's own: save_pretrained refuses a model that has one
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        model.generation_config = loaded.generation_config
        model.save_pretrained(str(out))
        tokenizer.save_pretrained(str(out))


def write_manifest(out: Path, name: str, source: dict, licence: dict) -> dict:
    """Hash every file of ``out`` into its manifest, made world-readable with them."""
    share_tree(out)
    files = {}
    for f in sorted(p for p in out.iterdir() if p.is_file()):
        files[f.name] = {"size": f.stat().st_size, "sha256": sha256_file(f)}
    manifest = {"format": MANIFEST_FORMAT, "name": name, "source": source, "licence": licence, "files": files,
                "converted_with": _versions()}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    (out / MANIFEST).chmod(0o644)
    return manifest


def _versions() -> dict:
    """The library versions that did the conversion (their tokenizer files differ across versions)."""
    from importlib.metadata import version

    return {package: version(package) for package in ("transformers", "gguf", "torch")}


def read_manifest(root: Path) -> dict | None:
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) else None


def manifest_problem(root: Path, source: dict | None = None) -> str | None:
    """Why ``root`` is not the complete model its manifest describes (from ``source``, when given),
    or None. Sizes first, so a truncated file is found without hashing the rest."""
    manifest = read_manifest(root)
    if manifest is None:
        return f"has no readable {MANIFEST} (a partial or foreign directory)"
    if source is not None and manifest.get("source") != source:
        return f"was installed from {_source_text(manifest.get('source'))}, not {_source_text(source)}"
    files = manifest["files"]
    for name, want in files.items():
        f = root / name
        if not f.is_file():
            return f"is missing {name}"
        if f.stat().st_size != want.get("size"):
            return f"has {name} of {f.stat().st_size} bytes, not {want.get('size')}"
    for name, want in files.items():
        if sha256_file(root / name) != want.get("sha256"):
            return f"has {name} with another sha256 than its manifest's (corrupt)"
    return None


def _source_text(source) -> str:
    if not isinstance(source, dict):
        return "an unknown source"
    if "package" in source:
        return f"{source['package']} {source.get('version')}"
    return f"GGUF sha256 {str(source.get('gguf_sha256'))[:12]}"


def directory_size(root: Path) -> int:
    return sum(f.stat().st_size for f in root.iterdir() if f.is_file())
