"""Every torch.distributed process group clawrl creates, made here and nowhere else.

- ``init_world``: the trainer ranks' default world, from the launcher's environment (RANK,
  WORLD_SIZE, MASTER_ADDR, MASTER_PORT): NCCL with one GPU per local rank when CUDA is available,
  gloo otherwise.
- ``command_group``: a gloo group over that world for the driver's commands, which are pickled
  bytes on the CPU even when the world is NCCL (``clawrl.cluster.rank_main``).
- ``init_model_parallel``: megatron-core's tensor-, pipeline- and data-parallel groups over the
  world (the megatron trainer ranks).
- ``host_store``, ``join_store`` and ``standalone_group``: a group outside the world, on a store of
  its own and never registered with torch.distributed, so none of the world's collectives waits for
  its members: the weight-sync group between trainer rank 0 and the serving engine's process
  (``clawrl.weight_transport``).
- ``sglang_update_group``: rank 0 of SGLang's weights-update group, the group SGLang's workers
  join on ``init_weights_update_group`` (``clawrl.weight_transport_sglang``).
"""
from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist


def init_world(local_rank: int, timeout_s: float | None = None) -> None:
    """Join the default world: NCCL on GPU ``local_rank`` (modulo the GPUs here) with CUDA, gloo
    without. ``timeout_s``: every collective's bound (None: torch's default)."""
    timeout = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        dist.init_process_group("nccl", **timeout)
    else:
        dist.init_process_group("gloo", **timeout)


def command_group(timeout_s: float) -> dist.ProcessGroup:
    """A gloo group of the whole world, for CPU collectives beside an NCCL world."""
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def init_model_parallel(tp: int, pp: int):
    """megatron-core's model-parallel groups over the world (once per process: a second call keeps
    the first layout); returns megatron's ``parallel_state``, which hands the groups out."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    return parallel_state


def host_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A store hosted in this process for groups outside the world; port 0 takes a free one
    (read ``.port``)."""
    return dist.TCPStore(host, port, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)


def join_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client connection to the store another process hosts at ``host:port``."""
    return dist.TCPStore(host, port, None, False, timedelta(seconds=timeout_s))


_nccl_env_lock = threading.Lock()


@contextmanager
def _nccl_env_for_this_group():
    """ProcessGroupNCCL reads these when built. Blocking wait makes ``wait(timeout)`` block the
    CPU and raise on timeout; clean-up-only error handling aborts the communicator on a timeout
    instead of killing the process, which here is the serving driver. Set only around this
    group's constructor, so the trainer's megatron groups keep their own settings."""
    wanted = {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    with _nccl_env_lock:
        saved = {k: os.environ.get(k) for k in wanted}
        os.environ.update(wanted)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def standalone_group(store: dist.Store, prefix: str, rank: int, world_size: int, backend: str,
                     timeout_s: float) -> dist.Backend:
    """This process's member of a ``world_size`` group formed on ``store`` under ``prefix``, outside
    the default world; used only through its own collectives (``group.broadcast``). Blocks until
    every rank has joined, at most ``timeout_s``. ``backend``: gloo (CPU tensors) or nccl (CUDA)."""
    prefixed = dist.PrefixStore(prefix, store)
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = False
    options._timeout = timeout
    with _nccl_env_for_this_group():
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)


def sglang_update_group(master_address: str, master_port: int, world_size: int, group_name: str, backend: str,
                        timeout_s: float) -> dist.ProcessGroup:
    """Rank 0 of SGLang's weights-update group: hosts its TCP rendezvous at
    ``master_address:master_port`` and blocks until SGLang's workers (ranks 1..) have joined, at most
    ``timeout_s``. Formed as SGLang 0.5.23's ``init_custom_process_group`` forms its side
    (``tcp://`` rendezvous, a ``PrefixStore`` named after the group, torch's process-group helper),
    so both sides build the same store keys; tests/test_sglang_distributed.py runs SGLang's own
    function against this one. Used through ``dist.broadcast(..., group=...)``."""
    from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world, rendezvous

    timeout = timedelta(seconds=timeout_s)
    host = f"[{master_address}]" if ":" in master_address else master_address
    store, rank, world = next(rendezvous(f"tcp://{host}:{master_port}", 0, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = dist.PrefixStore(group_name, store)
    if backend == "nccl":
        with _nccl_env_for_this_group():
            group, _ = _new_process_group_helper(world, rank, [], Backend(backend), store, group_name=group_name,
                                                 backend_options=None, timeout=timeout)
    else:
        group, _ = _new_process_group_helper(world, rank, [], Backend(backend), store, group_name=group_name,
                                             backend_options=None, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world)}
    return group
