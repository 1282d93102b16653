"""``MegatronTrainer``: the driver's ``Trainer`` for ``trainer.backend=megatron``.

The serving process (the driver) owns the loop; the model lives in the trainer ranks, separate
processes started by torchrun (``clawrl.cluster.launch``), which run ``MegatronRanks`` in lockstep.
Each ``Trainer`` method here is one command over the control channel: rank 0 relays it to every
rank and answers. Weights reach the engine through ``BroadcastWeightSync``: the ranks gather one
parameter at a time and rank 0 streams HF-named buckets into the engine's process
(``send_weights``), so the driver never holds the trainer's copy.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time

import torch

from clawrl.cluster.control import ClusterError
from clawrl.cluster.launch import read_node_env, start_trainer_ranks
from clawrl.cluster.layout import check_layout, describe_layout, read_hf_config
from clawrl.config import ClawrlConfig, ConfigError
from clawrl.engines.base import Engine
from clawrl.samples import Sample
from clawrl.trainers.base import StepResult, Trainer, TrainerError
from clawrl.engines.sglang_engine import SGLangWeightUpdates
from clawrl.weight_sync import BroadcastWeightSync, SGLangWeightSync
from clawrl.weight_transport import ServedWeights

log = logging.getLogger(__name__)

PROGRAM = "clawrl.trainers.megatron.ranks:MegatronRanks"


class MegatronTrainer(Trainer):
    """Starts the trainer ranks of this node (and, through the launch environment, of the others)
    and waits until every rank has loaded its shard; see the module docstring."""

    def __init__(self, cfg: ClawrlConfig, model_path: str):
        self.cfg = cfg
        if cfg.train.lora.enabled:
            raise TrainerError("train.lora.enabled=true needs trainer.backend=torch; the megatron backend trains "
                               "every weight")
        try:
            node = read_node_env(cfg)
            hf_config, name = read_hf_config(model_path)
            check_layout(hf_config, cfg.cluster.tp, cfg.cluster.pp, node.world_size, name)
            # the ranks read the resolved model directory, not the embedded default's name
            rank_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(model_path)))
            self.control = start_trainer_ranks(rank_cfg, PROGRAM, node=node)
            self.node = node
            log.info("megatron trainer ranks starting: %s", describe_layout(cfg.cluster.tp, cfg.cluster.pp,
                                                                            node.world_size, node.nnodes))
            self.control.wait_ready()
        except (ConfigError, ClusterError) as e:
            raise TrainerError(str(e).splitlines()[0]) from None
        self.step = 0
        self.paused_reason = None
        self._lock = threading.Lock()

    def _call(self, method: str, *args):
        try:
            return self.control.call(method, *args)
        except ClusterError as e:
            raise TrainerError(str(e).splitlines()[0]) from None

    def train_step(self, samples: list[Sample], weight_version: int) -> StepResult:
        with self._lock:
            out = self._call("train_step", samples, weight_version)
        if out["ok"]:
            self.step = int(out["metrics"]["step"])
        self.paused_reason = out.get("paused_reason")
        if out.get("skipped_reason") in ("nonfinite_loss", "nonfinite_grad"):
            log.warning("train step skipped: %s", out["skipped_reason"])
        return StepResult(out["ok"], out["metrics"], out["skipped_reason"])

    def logprobs(self, samples: list[Sample]) -> list[list[float]]:
        with self._lock:
            return self._call("logprobs", samples)

    def send_weights(self, version: int, endpoint) -> None:
        """``StreamsWeights``: the ranks stream the weights to ``endpoint`` (the engine's receiver)."""
        with self._lock:
            self._call("send_weights", version, endpoint)

    def weight_sync(self, engine: Engine) -> BroadcastWeightSync | SGLangWeightSync:
        """Weights cross processes: a ``BroadcastWeightSync`` hosted on this node. NCCL when the
        engine's GPU is not one the trainer ranks use; CUDA IPC when it shares rank 0's GPU (NCCL
        cannot put two ranks on one device); gloo through host memory on CPU. An SGLang engine
        receives over SGLang's own weights-update group instead (``SGLangWeightSync``), whose
        rendezvous rank 0 hosts on ``cluster.sglang_group_port``."""
        if isinstance(getattr(engine, "weight_updates", None), SGLangWeightUpdates):
            info = engine.model_info()
            device = torch.device(info.device)
            if device.type == "cuda" and (device.index or 0) < self.node.procs:
                raise TrainerError(f"SGLang serves on GPU {device.index or 0}, which a trainer rank of this node uses; "
                                   "NCCL cannot join two ranks of SGLang's weights-update group on one GPU: set "
                                   f"model.device=cuda:N with N >= {self.node.procs}")
            return SGLangWeightSync(engine.weight_updates, ServedWeights.of_model_dir(info.path), self.cfg.cluster,
                                    host=self.node.master_addr, port=self.node.sync_port,
                                    group_host=self.node.master_addr,
                                    group_port=self.cfg.cluster.sglang_group_port or self.node.master_port + 3,
                                    backend="nccl" if torch.cuda.is_available() else "gloo")
        device = torch.device(engine.model_info().device)
        separate_gpu = device.type == "cuda" and (device.index or 0) >= self.node.procs
        backend = "nccl" if separate_gpu else "ipc" if device.type == "cuda" else "gloo"
        return BroadcastWeightSync(engine, self.cfg.cluster, host=self.node.master_addr, port=self.node.sync_port,
                                   backend=backend)

    def export_weights(self) -> dict[str, torch.Tensor]:
        """The whole HF state in this process (a full copy: for tests and small models; serving
        streams through ``send_weights`` instead)."""
        with self._lock:
            return self._call("hf_state")

    def state_dict(self) -> dict:
        with self._lock:
            return self._call("state_dict")

    def load_state_dict(self, state: dict) -> None:
        with self._lock:
            try:
                self._call("load_state_dict", state)
            except TrainerError as e:
                raise TrainerError(f"cannot resume the megatron trainer: {e}") from None
        self.step = int(state["step"])

    def clear_pause(self) -> None:
        with self._lock:
            self._call("clear_pause")
        self.paused_reason = None

    def close(self) -> None:
        started = time.monotonic()
        self.control.shutdown()
        log.info("megatron trainer ranks stopped in %.1f s", time.monotonic() - started)
