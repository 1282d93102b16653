"""The megatron-core training backend (``trainer.backend=megatron``).

- ``convert``: HF <-> Megatron weights (Qwen3, Qwen2, Llama), sharded per rank, streamed per tensor.
- ``model``: the GPTModel of one rank and its packed forward.
- ``ranks``: ``MegatronRanks``, the program every trainer rank runs (SPMD): train step, export, state.
- ``trainer``: ``MegatronTrainer``, the driver-side ``Trainer`` that commands the ranks.
- ``cpu_shims``: what megatron-core needs to run on CPU with gloo (used only without CUDA).

Nothing here is imported unless the megatron backend is chosen, so megatron-core stays optional.
"""
