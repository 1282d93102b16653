"""What a megatron-core layer compiled whole (``train.compile_scope=layer``) needs to be one graph.

Dynamo splits a compiled function wherever it meets something it cannot trace (a graph break) and
resumes after it; inside a context manager it cannot resume, and runs the rest of the function
eagerly, compiling only the pieces it calls. Megatron's attention runs its core attention and its
output projection inside ``FineGrainedActivationOffloadingInterface`` contexts, so a single break
there left most of every layer eager: on an H100 at the 1.7B shape, the megatron step's kernels took
as long as the torch trainer's, but its GPU sat idle 66 ms a step waiting for the host to launch
them. Two breaks, both gone:

- the core attention (``SdpaCoreAttention``) goes through ``packed_attention.causal_within``, one
  operator to dynamo;
- ``RowParallelLinear`` always asks ``get_tensor_model_parallel_group_if_none`` for its group with
  None, and on rank 0 that warns through ``warnings.warn``, which dynamo cannot trace or defer (one of
  its arguments is a class). ``install`` wraps the function that ``tensor_parallel.layers`` calls so
  that None resolves to the default tensor-parallel group without the warning; anything else goes to
  megatron's function unchanged.
"""
from __future__ import annotations


def install() -> None:
    """Wrap ``tensor_parallel.layers``' group lookup (once; later calls find it wrapped)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import layers

    megatrons = layers.get_tensor_model_parallel_group_if_none
    if getattr(megatrons, "quiet_default_group", False):
        return

    def get_tensor_model_parallel_group_if_none(tp_group, is_expert=False, check_initialized=True):
        if tp_group is None and not is_expert and parallel_state.is_initialized():
            return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)
        return megatrons(tp_group, is_expert, check_initialized)

    get_tensor_model_parallel_group_if_none.quiet_default_group = True
    layers.get_tensor_model_parallel_group_if_none = get_tensor_model_parallel_group_if_none
