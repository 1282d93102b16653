"""HF <-> Megatron weights for the Qwen3, Qwen2 and Llama families, one tensor at a time.

Loading (HF -> Megatron): every rank reads, from the safetensors files, only the HF tensors its
pipeline stage needs and keeps its tensor-parallel slice. Exporting (Megatron -> HF): for each
Megatron parameter in a fixed order, the owning stage gathers the TP shards of that one parameter,
turns it into HF-named tensors, and hands them on; the caller streams them into buckets. At no
point does any rank hold the whole model in HF form.

The layouts that differ from HF:

- ``linear_qkv`` fuses q, k and v *per query group*: for each of the ``g`` key/value heads, its
  ``heads / g`` query heads, then its k head, then its v head (rows of ``head_dim``). TP splits
  whole groups, so a rank's slice is a contiguous block of groups.
- ``linear_fc1`` fuses ``[gate; up]`` and TP splits each half, so rank r holds
  ``[gate_r; up_r]`` (not a contiguous slice of the full ``[gate; up]``).
- Row-parallel layers (``linear_proj``, ``linear_fc2``) split the input dimension (dim 1);
  column-parallel ones and the vocabulary (embedding, output layer) split dim 0.
- With the transformer-engine layer spec, the pre-attention and pre-MLP norms are fused into
  ``linear_qkv`` and ``linear_fc1`` (``layer_norm_weight``); ``te_names`` maps them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open

FAMILIES = ("qwen3", "qwen2", "llama")


class ConversionError(ValueError):
    """A model this converter cannot map (family, rope scaling, missing tensor); one line."""


@dataclass(frozen=True)
class Arch:
    """The numbers of an HF decoder that decide the Megatron model and the weight layout."""

    family: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    norm_eps: float
    rope_theta: float
    max_positions: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool

    @property
    def q_per_group(self) -> int:
        return self.heads // self.kv_heads


def read_arch(model_dir: str | Path) -> Arch:
    """The ``Arch`` of an HF model directory (its ``config.json``)."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConversionError(f"cannot read {path}: {e}") from None
    return arch_from_config(cfg, str(model_dir))


def arch_from_config(cfg: dict, where: str = "the model") -> Arch:
    family = cfg.get("model_type")
    if family == "mistral":
        family = "llama"  # same weights and layout as llama once sliding windows are off
        if cfg.get("sliding_window"):
            raise ConversionError(f"{where}: mistral with a sliding window is not supported by the megatron backend")
    if family not in FAMILIES:
        raise ConversionError(f"{where}: model_type {cfg.get('model_type')!r} is not supported by the megatron "
                              f"backend (supported: {', '.join(FAMILIES)})")
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ConversionError(f"{where}: rope type {rope_type!r} is not supported by the megatron backend (default only)")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    return Arch(
        family=family, layers=int(cfg["num_hidden_layers"]), hidden=hidden, heads=heads,
        kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads), ffn=int(cfg["intermediate_size"]),
        vocab=int(cfg["vocab_size"]), norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        max_positions=int(cfg.get("max_position_embeddings", 4096)),
        tied=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=family == "qwen3",
    )


# ---------------------------------------------------------------- names


def _layer_map(arch: Arch) -> list[tuple[str, list[str], str]]:
    """(Megatron name within a layer, HF names within a layer, how TP splits it)."""
    attn = [("self_attention.linear_qkv.weight",
             ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"], "qkv")]
    if arch.qkv_bias:
        attn.append(("self_attention.linear_qkv.bias",
                     ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"], "qkv"))
    out = [("input_layernorm.weight", ["input_layernorm.weight"], "replicated"), *attn,
           ("self_attention.linear_proj.weight", ["self_attn.o_proj.weight"], "row")]
    if arch.qk_norm:
        out += [("self_attention.q_layernorm.weight", ["self_attn.q_norm.weight"], "replicated"),
                ("self_attention.k_layernorm.weight", ["self_attn.k_norm.weight"], "replicated")]
    out += [("pre_mlp_layernorm.weight", ["post_attention_layernorm.weight"], "replicated"),
            ("mlp.linear_fc1.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"], "fc1"),
            ("mlp.linear_fc2.weight", ["mlp.down_proj.weight"], "row")]
    return out


@dataclass(frozen=True)
class ParamPlan:
    """One Megatron parameter of one pipeline stage and the HF tensors it is made of."""

    stage: int
    name: str  # Megatron name on its stage (layer indices local to the stage)
    hf_names: tuple[str, ...]
    split: str  # replicated | row | column | qkv | fc1


_TE_NAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
             "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


def plan(arch: Arch, pp: int, te_names: bool = False) -> list[ParamPlan]:
    """Every Megatron parameter of every stage, in export order (embedding, layers, norm, head)."""
    per_stage = arch.layers // pp
    out = [ParamPlan(0, "embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "column")]
    for layer in range(arch.layers):
        stage, local = divmod(layer, per_stage)
        for mname, hf_names, split in _layer_map(arch):
            if te_names:
                mname = _TE_NAMES.get(mname, mname)
            out.append(ParamPlan(stage, f"decoder.layers.{local}.{mname}",
                                 tuple(f"model.layers.{layer}.{n}" for n in hf_names), split))
    out.append(ParamPlan(pp - 1, "decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"))
    if not arch.tied:
        out.append(ParamPlan(pp - 1, "output_layer.weight", ("lm_head.weight",), "column"))
    return out


# ---------------------------------------------------------------- layouts


def fuse(entry: ParamPlan, arch: Arch, hf: list[torch.Tensor]) -> torch.Tensor:
    """The full (unsharded) Megatron tensor from its HF tensors."""
    if entry.split == "qkv":
        q, k, v = hf
        g, hd = arch.kv_heads, arch.head_dim
        rest = q.shape[1:]
        q = q.reshape(g, arch.q_per_group * hd, *rest)
        return torch.cat([q, k.reshape(g, hd, *rest), v.reshape(g, hd, *rest)], dim=1).reshape(-1, *rest)
    if entry.split == "fc1":
        return torch.cat(hf, dim=0)
    (single,) = hf
    return single


def unfuse(entry: ParamPlan, arch: Arch, full: torch.Tensor) -> list[torch.Tensor]:
    """The HF tensors of a full Megatron tensor (inverse of ``fuse``)."""
    if entry.split == "qkv":
        g, hd = arch.kv_heads, arch.head_dim
        rest = full.shape[1:]
        grouped = full.reshape(g, (arch.q_per_group + 2) * hd, *rest)
        qn = arch.q_per_group * hd
        return [grouped[:, :qn].reshape(-1, *rest), grouped[:, qn:qn + hd].reshape(-1, *rest),
                grouped[:, qn + hd:].reshape(-1, *rest)]
    if entry.split == "fc1":
        return list(full.chunk(2, dim=0))
    return [full]


def shard(entry: ParamPlan, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """This TP rank's slice of a full Megatron tensor."""
    if entry.split == "replicated" or tp == 1:
        return full
    if entry.split == "fc1":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)
    dim = 1 if entry.split == "row" else 0  # qkv: whole query groups, contiguous
    return full.chunk(tp, dim=dim)[rank]


def unshard(entry: ParamPlan, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full Megatron tensor from every TP rank's slice (inverse of ``shard``)."""
    if entry.split == "replicated" or len(shards) == 1:
        return shards[0]
    if entry.split == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
    return torch.cat(shards, dim=1 if entry.split == "row" else 0)


# ---------------------------------------------------------------- HF files


class HFTensors:
    """Lazy access to an HF model directory's safetensors, one tensor at a time."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise ConversionError(f"{self.dir}: no *.safetensors weights (the megatron backend reads safetensors)")
        self._where: dict[str, Path] = {}
        self._open = {}
        for f in files:
            handle = safe_open(str(f), framework="pt")
            self._open[f] = handle
            for key in handle.keys():
                self._where[key] = f

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        f = self._where.get(name)
        if f is None:
            raise ConversionError(f"{self.dir}: tensor {name} is missing from the safetensors files")
        return self._open[f].get_tensor(name)


def load_stage(arch: Arch, get: Callable[[str], torch.Tensor], stage: int, pp: int, tp: int, tp_rank: int,
               te_names: bool = False) -> dict[str, torch.Tensor]:
    """This rank's Megatron tensors (its stage, its TP slice). With tied embeddings, the last stage
    of a pipeline holds its own copy of the embedding as ``output_layer.weight`` (megatron keeps
    the two equal by summing their gradients)."""
    out = {}
    for entry in plan(arch, pp, te_names):
        if entry.stage == stage:
            out[entry.name] = shard(entry, fuse(entry, arch, [get(n) for n in entry.hf_names]), tp, tp_rank)
    if arch.tied and stage == pp - 1 and pp > 1:
        head = ParamPlan(stage, "output_layer.weight", ("model.embed_tokens.weight",), "column")
        out[head.name] = shard(head, get("model.embed_tokens.weight"), tp, tp_rank)
    return out


def hf_tensors(entry: ParamPlan, arch: Arch, full: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs of one gathered Megatron parameter."""
    yield from zip(entry.hf_names, unfuse(entry, arch, full))
