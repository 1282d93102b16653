"""Typed configuration, composed by Hydra from these dataclasses plus ``key=value`` overrides.

The dataclasses are the documentation: each field says what it does where it is defined. The
config is frozen after composition, and ``tests/test_config.py`` proves every field is read
somewhere in core, so no flag is parsed and then ignored.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Optional

from omegaconf import OmegaConf


class ConfigError(ValueError):
    """A bad override or value; the message is one line meant for the user."""


@dataclass
class ModelConfig:
    # HF model directory. None: the embedded tiny chat model, built on first use.
    path: Optional[str] = None
    # The model id clients send in "model"; None: the directory's name.
    name: Optional[str] = None
    # "auto": bf16 on CUDA, fp32 on CPU; or float32 | bfloat16 | float16.
    dtype: str = "auto"
    # "auto": cuda if available, else cpu.
    device: str = "auto"


@dataclass
class EngineConfig:
    # torch: the built-in engine. sglang: an SGLang runtime (optional dependency).
    backend: str = "torch"
    # Most requests decoded together in one step; more wait in the queue.
    max_batch_size: int = 32
    # Prompt tokens prefilled per step, so a long prompt does not stall others' decoding.
    prefill_chunk_tokens: int = 2048
    # KV of finished requests kept for prefix reuse, in tokens across all entries (LRU).
    prefix_cache_tokens: int = 131072
    # Context window; None: the model config's max_position_embeddings.
    max_context: Optional[int] = None
    # CPU threads for torch; None: leave torch's default.
    threads: Optional[int] = None


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    # Bearer key for /v1. Mandatory when host is not loopback.
    api_key: Optional[str] = None
    # Bearer key for /admin; defaults to api_key.
    admin_key: Optional[str] = None
    # Request bodies larger than this get 413.
    max_body_bytes: int = 8 * 1024 * 1024
    # Requests waiting for the engine beyond this get 429 with Retry-After.
    max_queue: int = 64
    # Over-long prompts: False answers 400 context_length_exceeded; True keeps the system
    # prompt and the latest turns that fit.
    truncate_history: bool = False
    # Default max tokens for a completion when the client sends none.
    default_max_tokens: int = 512


@dataclass
class SessionsConfig:
    # A session with no request for this long is closed; its last turn gets no next state.
    idle_timeout_s: float = 1800.0


@dataclass
class LoraConfig:
    # Train LoRA adapters (peft) instead of full weights; served weights have LoRA merged.
    enabled: bool = False
    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    # Module names to adapt (peft target_modules).
    target_modules: list = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass
class TrainConfig:
    # False: serve and record only, never train.
    enabled: bool = True
    # Ready samples per train step; training starts once this many are ready.
    batch_size: int = 8
    lr: float = 1e-5
    weight_decay: float = 0.0
    # Gradient-norm clip; 0 disables.
    grad_clip: float = 1.0
    # Dynamic micro-batches: most tokens (prompt + response) in one forward/backward.
    micro_batch_tokens: int = 16384
    gradient_checkpointing: bool = False
    # Checkpoint every N train steps, keeping the last N (written atomically).
    save_every: int = 10
    keep_last: int = 3
    # A sample whose oldest token is more than this many weight versions behind is stale.
    max_weight_lag: int = 4
    # Stale samples: drop (skip with a reason) | importance_weight (train with TIS weights).
    stale_policy: str = "drop"
    # Advantage of a live-chat sample (one per prompt): reward | ema (reward minus a running baseline).
    baseline: str = "reward"
    baseline_decay: float = 0.9
    # For groups of n>1 samples per prompt: grpo (mean/std) | dr_grpo (mean only).
    group_advantage: str = "grpo"
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.28
    # Dual-clip constant for negative advantages; None disables.
    dual_clip_c: Optional[float] = 3.0
    # KL to the reference policy: coefficient (0: off), estimator k1|k2|k3, and where it goes.
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_in_reward: bool = False
    entropy_coef: float = 0.0
    # Rollout/trainer mismatch: TIS cap (None: off) and IcePop band [low, high] (None: off).
    tis_cap: Optional[float] = 2.0
    icepop_band: Optional[list] = None
    # token-mean | seq-mean-token-mean | seq-mean-token-sum
    aggregation: str = "token-mean"
    # NaN/inf losses in a row before training pauses itself.
    max_bad_steps: int = 3
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class TrainerConfig:
    # torch: the built-in HF/torch trainer (one process). megatron: megatron-core with tensor,
    # pipeline and data parallelism over trainer ranks in their own processes (cluster.*).
    backend: str = "torch"


@dataclass
class ClusterConfig:
    """Where trainer ranks and engines run (``trainer.backend=megatron``).

    The node layout comes from the launch environment (NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT,
    GPUS_PER_NODE), as torchrun reads it; these fields are the parallel layout and the plumbing.
    """

    # Tensor- and pipeline-parallel sizes; data parallel = trainer ranks / (tp * pp).
    tp: int = 1
    pp: int = 1
    # Trainer ranks per node when GPUS_PER_NODE is unset (on CPU: processes, gloo).
    procs_per_node: int = 1
    # mcore DDP with the distributed optimizer (optimizer state sharded over data-parallel ranks).
    distributed_optimizer: bool = True
    # Seconds a connection, collective or weight sync may take before it fails with a reason.
    timeout_s: float = 300.0
    # Ports on MASTER_ADDR for the driver's control channel and the weight-sync process group
    # (0: MASTER_PORT + 1 and MASTER_PORT + 2).
    control_port: int = 0
    sync_port: int = 0
    # Weight-sync bucket size: HF-named tensors are streamed in buckets of at most this many MB.
    bucket_mb: int = 256
    # Place serving engines with Ray (an existing cluster at ray_address, or a local one).
    ray: bool = False
    ray_address: str = "auto"
    # Engines to place, and the GPUs each takes (0 on CPU).
    engines: int = 1
    engine_gpus: float = 0.0


@dataclass
class JudgeModelConfig:
    # HF directory of the PRM judge model; None: the frozen base policy.
    path: Optional[str] = None


@dataclass
class JudgeConfig:
    # rules: explicit feedback rules (default). prm: a model judge. env: environment verdicts.
    kind: str = "rules"
    # Votes per turn for the PRM judge; the majority decides, ties give 0.
    votes: int = 3
    # Turns judged at once; a judge call slower than timeout_s is retried up to retries times.
    concurrency: int = 2
    timeout_s: float = 60.0
    retries: int = 1
    model: JudgeModelConfig = field(default_factory=JudgeModelConfig)


@dataclass
class OpdConfig:
    # On-policy distillation: hint judge rules (correction phrases) | model (votes from a judge engine).
    hint_judge: str = "rules"
    # Votes per turn for the model hint judge; a strict majority must accept.
    votes: int = 3
    # Teacher scoring the sampled tokens under the hinted prompt: policy (the serving engine) | a model path.
    teacher: str = "policy"
    # Teacher top-k ids/logprobs stored per token for top-k distillation; 0: sampled tokens only.
    topk: int = 0
    # Turns hint-judged or teacher-scored at once; keep small so scoring never crowds out serving.
    concurrency: int = 1
    # Weight of the top-k distillation loss (used when topk > 0); 0: token advantages only.
    topk_coef: float = 1.0
    # Its direction: reverse (KL(student || teacher), mode-seeking, cannot raise a token the student
    # gives ~0 probability) | forward (KL(teacher || student), pulls the student onto the teacher's top-k).
    topk_kl: str = "reverse"
    # |teacher - student| logprob gap is clipped to this, so one near-impossible token cannot dominate.
    adv_clip: float = 5.0


@dataclass
class CombineConfig:
    # method=combine: A = w_rl * A_rl + w_opd * A_opd per token (a turn with one signal gets that term).
    w_rl: float = 1.0
    w_opd: float = 1.0
    # A judged turn whose teacher score is still missing after this many seconds trains RL-only.
    opd_wait_s: float = 120.0


@dataclass
class WandbConfig:
    # offline (default) | online (falls back to offline without network) | disabled
    mode: str = "offline"
    project: str = "clawrl"


@dataclass
class LoggingConfig:
    level: str = "INFO"
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class DemoConfig:
    # The simulated user's hidden preference: worked ("7 + 5 = 12") | bare (just a number).
    user: str = "worked"
    # Interactions with the simulated user: a question, the model's reply, the user's feedback.
    interactions: int = 160
    # Measure the preference-satisfaction rate before the first and after every N interactions.
    eval_every: int = 40
    # Held-out questions per measurement.
    eval_prompts: int = 64
    # Most tokens of a reply to a question.
    max_tokens: int = 24


@dataclass
class ClawrlConfig:
    # Personal-agent method or environment: rl | opd | combine (set by each method's run.sh).
    method: str = "rl"
    # Everything a run writes: the SQLite store, checkpoints, logs.
    run_dir: str = "runs/default"
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    sessions: SessionsConfig = field(default_factory=SessionsConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    opd: OpdConfig = field(default_factory=OpdConfig)
    combine: CombineConfig = field(default_factory=CombineConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    # ``clawrl demo`` only: the simulated user and how the demo measures learning.
    demo: DemoConfig = field(default_factory=DemoConfig)


def all_keys(cls=ClawrlConfig, prefix: str = "") -> list[str]:
    """Dotted names of every leaf field, e.g. ``server.port``."""
    out = []
    for f in fields(cls):
        default = f.default_factory() if f.default_factory is not field().default_factory else f.default
        if is_dataclass(default):
            out += all_keys(type(default), prefix + f.name + ".")
        else:
            out.append(prefix + f.name)
    return out


def _suggest(key: str) -> str:
    close = difflib.get_close_matches(key, all_keys(), n=3, cutoff=0.5)
    return f"; did you mean {', '.join(close)}?" if close else ""


def compose(overrides: list[str] | tuple[str, ...] = (), yaml_path: str | None = None) -> ClawrlConfig:
    """Build the config: dataclass defaults, then a method's ``config.yaml``, then overrides.

    Unknown keys are refused with the closest valid names. Returns a plain dataclass instance.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    base = OmegaConf.structured(ClawrlConfig)
    OmegaConf.set_struct(base, True)
    layers = []
    if yaml_path:
        layers.append(OmegaConf.load(yaml_path))
    parser = OverridesParser.create()
    try:
        parsed = parser.parse_overrides(list(overrides))
    except Exception as e:  # hydra's own message is multi-line; keep the first line
        raise ConfigError(f"bad override: {str(e).splitlines()[0]}") from None
    dotlist = []
    for ov in parsed:
        key = ov.key_or_group
        if ov.is_delete() or ov.is_add():
            raise ConfigError(f"override '{ov.input_line}': only key=value is supported")
        if key not in all_keys():
            raise ConfigError(f"unknown config key '{key}'{_suggest(key)}")
        value = ov.value()
        dotlist.append((key, value))
    cfg = base
    try:
        for layer in layers:
            for key in _leaf_keys(layer):
                if key not in all_keys():
                    raise ConfigError(f"unknown config key '{key}' in {yaml_path}{_suggest(key)}")
            cfg = OmegaConf.merge(cfg, layer)
        obj = OmegaConf.to_object(cfg)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"{yaml_path}: {str(e).splitlines()[0]}") from None
    cfg = OmegaConf.structured(obj)
    for key, value in dotlist:
        try:
            OmegaConf.update(cfg, key, value, merge=False)
        except Exception as e:
            raise ConfigError(f"{key}={value}: {str(e).splitlines()[0]}") from None
    obj = OmegaConf.to_object(cfg)
    return obj


def _leaf_keys(node, prefix: str = "") -> list[str]:
    out = []
    for k, v in node.items():
        if OmegaConf.is_dict(v):
            out += _leaf_keys(v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}")
    return out


def to_yaml(cfg: ClawrlConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
