"""One rank's megatron-core GPTModel, and the packed forward the trainer runs through it.

The layer spec is transformer-engine's when it is importable and megatron's local (pure torch)
spec otherwise; ``layer_spec_kind`` says which. Both train the same weights; the names of the two
fused norms differ (``convert.plan(te_names=...)``). In the local spec, the core attention is
swapped for ``SdpaCoreAttention``: megatron's own materialises the ``[heads, L, L]`` scores and
probabilities of every layer for backward (an 8192-token row of a 0.6B model ran an H200 out of
memory), while ``scaled_dot_product_attention`` takes the same mask through fused kernels.

Packing: a micro-batch is one row of concatenated sequences. ``packed_forward`` does what
``GPTModel.forward`` does, with two differences that make packing exact on the local spec:

- rotary positions restart for every sequence (``position_ids``), by indexing the rotary table
  with them; ``GPTModel.forward`` would use 0..L-1 for the whole row;
- attention runs causally within each sequence, so no sequence sees another: the sequences' bounds
  travel as megatron's ``PackedSeqParams`` in the ``sbhd`` layout (which leaves rotary and the
  layout alone and reaches the core attention), and ``SdpaCoreAttention`` attends one sequence
  at a time (one varlen flash call on a GPU) instead of over the whole row under a block mask,
  which cost O(L^2) in the row's total length and ruled out the flash kernels. Transformer-engine's
  attention would not read those bounds, so with it the trainer packs one sample per micro-batch
  (``MegatronRanks._batches``) and the mask path stays.

Only the rows whose logits predict a response token go through the output layer, which bounds the
``[tokens, vocab / tp]`` logits to the trained tokens.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from clawrl.trainers import packed_attention
from clawrl.trainers.megatron import rope_table
from clawrl.trainers.megatron.convert import Arch


def has_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def layer_spec_kind() -> str:
    return "transformer-engine" if has_transformer_engine() else "local"


def transformer_config(arch: Arch, tp: int, pp: int, dtype: torch.dtype, on_cuda: bool, recompute: bool = False):
    """``recompute``: full activation recomputation, one layer at a time (``train.gradient_checkpointing``)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        recompute_granularity="full" if recompute else None, recompute_method="uniform" if recompute else None,
        recompute_num_layers=1 if recompute else None,
        num_layers=arch.layers, hidden_size=arch.hidden, num_attention_heads=arch.heads,
        num_query_groups=arch.kv_heads, kv_channels=arch.head_dim, ffn_hidden_size=arch.ffn,
        normalization="RMSNorm", layernorm_epsilon=arch.norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=arch.qkv_bias, qk_layernorm=arch.qk_norm,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=False,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=False,
        hidden_dropout=0.0, attention_dropout=0.0,
        # Packed micro-batches have different lengths; pipeline sends must carry their shapes.
        variable_seq_lengths=True,
        # Dense models have no experts; megatron still validates this against variable lengths.
        moe_token_dispatcher_type="alltoall",
        # Fused kernels are CUDA-only or need transformer-engine/apex; the unfused paths are exact.
        use_cpu_initialization=not on_cuda, persist_layer_norm=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
    )


def sdpa_core_attention():
    """A megatron ``DotProductAttention`` whose forward is torch's ``scaled_dot_product_attention``
    (same inputs, outputs, scale and mask convention; built lazily so megatron stays optional)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SdpaCoreAttention(DotProductAttention):
        # traceable by a layer compiled whole (train.compile_scope=layer): the packed path is one
        # operator to dynamo (packed_attention.causal_within), so no graph break falls inside megatron's
        # activation-offloading context around this call, where dynamo could not resume the layer's graph
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if attention_bias is not None:
                raise ValueError("SdpaCoreAttention takes no attention bias")
            if packed_seq_params is not None and packed_seq_params.qkv_format != "sbhd":
                raise ValueError(f"SdpaCoreAttention packs in the sbhd layout, not {packed_seq_params.qkv_format}")
            seq, batch = query.shape[0], query.shape[1]
            if packed_seq_params is not None:  # one row (batch 1) of sequences end to end: [s, 1, heads, d]
                out = packed_attention.causal_within(query[:, 0], key[:, 0], value[:, 0],
                                                     packed_seq_params.cu_seqlens_q, self.softmax_scale)
                return out.reshape(seq, batch, -1)
            # a key/value head serves its group's query heads, which are contiguous: read in place
            # (grouped-query attention), no repeated copy of keys and values
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
            gqa = k.shape[1] != q.shape[1]
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=None if attention_mask is None else ~attention_mask,
                is_causal=attention_mask is None, scale=self.softmax_scale,
                dropout_p=self.attention_dropout.p if self.training else 0.0, enable_gqa=gqa)
            return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)

    return SdpaCoreAttention


def build_gpt(arch: Arch, config, pre_process: bool, post_process: bool):
    from megatron.core.models.gpt import GPTModel

    if has_transformer_engine():
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_norm)
    else:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        spec = get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm, normalization="RMSNorm")
        spec.submodules.self_attention.submodules.core_attention = sdpa_core_attention()
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=arch.vocab,
                    max_sequence_length=arch.max_positions, pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=arch.tied, position_embedding_type="rope",
                    rotary_base=int(arch.rope_theta) if float(arch.rope_theta).is_integer() else arch.rope_theta)


def block_causal_mask(segment: torch.Tensor) -> torch.Tensor:
    """``[1, 1, L, L]`` bool, True where attention is *not* allowed (megatron's convention)."""
    n = segment.shape[0]
    causal = torch.ones(n, n, dtype=torch.bool, device=segment.device).tril()
    return ~(causal & (segment[:, None] == segment[None, :]))[None, None]


def packed_forward(gpt, input_ids: torch.Tensor, position_ids: torch.Tensor, segment: torch.Tensor,
                   logit_rows: torch.Tensor, bounds: tuple[tuple[int, int], ...] = ()) -> torch.Tensor:
    """Hidden states ``[L, 1, H]`` on a non-last stage; on the last stage, the logits ``[T, V/tp]``
    of ``logit_rows``. ``input_ids``/``position_ids`` are ``[1, L]``; ``bounds`` are the sequences'
    (start, end) offsets in the row. With them (and the local spec's ``SdpaCoreAttention``), each
    sequence attends within itself; without them, through the block-diagonal mask of ``segment``."""
    from megatron.core.packed_seq_params import PackedSeqParams

    decoder_input = gpt.embedding(input_ids=input_ids, position_ids=position_ids) if gpt.pre_process else None
    positions = position_ids[0]
    table = gpt.rotary_pos_emb(int(positions.max()) + 1)  # [max_pos, 1, 1, head_dim]
    rotary = table.index_select(0, positions.to(table.device))
    if rope_table.usable(gpt.config):  # cos and sin once for all layers (rope_table says why)
        rope_table.install()
        rotary = rope_table.table(rotary)
    if len(bounds) > 1 and not has_transformer_engine():
        cu = packed_attention.bounds_arg(bounds)  # the offsets causal_within reads
        longest = max(end - start for start, end in bounds)
        packing = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                                  max_seqlen_kv=longest)
        hidden = gpt.decoder(hidden_states=decoder_input, attention_mask=None, rotary_pos_emb=rotary,
                             packed_seq_params=packing)
    elif len(bounds) == 1:  # one sequence: the core attention's causal path, no mask to build
        hidden = gpt.decoder(hidden_states=decoder_input, attention_mask=None, rotary_pos_emb=rotary)
    else:
        hidden = gpt.decoder(hidden_states=decoder_input, attention_mask=block_causal_mask(segment),
                             rotary_pos_emb=rotary)
    if not gpt.post_process:
        return hidden
    weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
    logits, _ = gpt.output_layer(hidden.index_select(0, logit_rows), weight=weight)
    return logits[:, 0]
