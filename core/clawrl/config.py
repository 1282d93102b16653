"""Typed configuration, composed by Hydra from these dataclasses plus ``key=value`` overrides.

Each layer wins over the ones before it:

1. the dataclass defaults below;
2. the model's own defaults: ``clawrl.yaml`` in the ``model.path`` directory, if there is one,
   or, for the embedded tiny model (``model.path`` null), ``conf/embedded.yaml`` in this package;
3. a recipe's YAML (a method directory's ``config.yaml``, ``clawrl serve --config``);
4. the command line's ``key=value`` overrides.

The dataclasses are the documentation: every field carries its help text and the values it
accepts (a range, choices or a pattern) in its metadata (see ``option``). ``compose()`` refuses an
unknown key in any layer with the closest valid names, and then any value its field does not
accept, in one line naming the key, the value, what is allowed and the file it came from. The
composed config is frozen: code that needs a changed copy uses ``dataclasses.replace``.
``describe_config()`` lists every key with its type, default, help and allowed values.
``tests/test_config.py`` proves every field is read somewhere in core, so no flag is parsed and
then ignored.
"""
from __future__ import annotations

import difflib
import math
import re
from dataclasses import MISSING, dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional

from omegaconf import OmegaConf

from clawrl.models.catalog import ModelNameError, known_defaults, resolve_model_ref


class ConfigError(ValueError):
    """A bad override or value; the message is one line meant for the user."""


def option(default: Any, help: str, *, ge=None, le=None, gt=None, lt=None, choices=None,
           ignore_case: bool = False, pattern: str | None = None, nonempty: bool = False,
           check: Callable[[Any], str | None] | None = None, allowed: str | None = None,
           type_name: str | None = None):
    """A leaf field: its default, its help text and the values ``compose()`` accepts for it.

    ``ge``/``gt``/``le``/``lt`` bound a number; ``choices`` lists the accepted strings
    (``ignore_case``: compared upper-cased); ``pattern`` is a regex the whole string must match,
    described by ``allowed``; ``nonempty`` refuses an empty string; ``check(value)`` returns a
    reason the value is refused, or None (``allowed`` describes what it accepts). None passes
    every check (OmegaConf already refuses None for a field that is not Optional). A list default
    is copied per instance (``default_factory``).
    """
    if not help or not help.strip():
        raise ValueError("every config field needs help text")
    metadata = {"help": help.strip(), "ge": ge, "le": le, "gt": gt, "lt": lt,
                "choices": tuple(choices) if choices else None, "ignore_case": ignore_case,
                "pattern": pattern, "nonempty": nonempty, "check": check, "allowed": allowed,
                "type_name": type_name}
    if isinstance(default, list):
        return field(default_factory=lambda d=tuple(default): list(d), metadata=metadata)
    return field(default=default, metadata=metadata)


def section(cls: type, help: str):
    """A nested group of fields (``server.*``, ``train.lora.*``), with a one-line description."""
    return field(default_factory=cls, metadata={"help": help.strip()})


def _check_icepop_band(band) -> str | None:
    if len(band) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in band):
        return "must be null or [low, high], two numbers"
    low, high = band
    if not (0 < low <= 1 <= high) or not math.isfinite(high):
        return "must be null or [low, high] with 0 < low <= 1 <= high < inf"
    return None


def _check_module_names(names) -> str | None:
    if not names:
        return "must name at least one module"
    if not all(isinstance(n, str) and n.strip() for n in names):
        return "must be a list of non-empty module names"
    return None


# A host as a Host header or an origin writes it: a DNS name or IPv4 address, or an IPv6 address in
# brackets; an origin is scheme://host[:port] (gateway/origin.py parses both with these).
HOST_NAME = r"\[[0-9a-fA-F:.]+\]|[^\[\]:/@?#\s]+"
ORIGIN = rf"([a-zA-Z][a-zA-Z0-9+.-]*)://({HOST_NAME})(?::([0-9]{{1,5}}))?"


def _check_hosts(hosts) -> str | None:
    for h in hosts:  # an IPv6 address may come without brackets
        if not isinstance(h, str) or not (h == "*" or any(re.fullmatch(HOST_NAME, n) for n in (h, f"[{h}]"))):
            return f"must be host names without scheme or port ('*': any); {_show(h)} is not one"
    return None


def _check_origins(origins) -> str | None:
    for o in origins:
        m = re.fullmatch(ORIGIN, o) if isinstance(o, str) else None
        if m is None or (m.group(3) is not None and int(m.group(3)) > 65535):
            return f"must be origins scheme://host[:port] (no path, no '*', no 'null'); {_show(o)} is not one"
    return None


# Per-model defaults: a file of this name in model.path; the embedded model's ship with the package.
MODEL_DEFAULTS_FILE = "clawrl.yaml"
EMBEDDED_DEFAULTS = Path(__file__).resolve().parent / "conf" / "embedded.yaml"

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DTYPES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16")


@dataclass(frozen=True)
class ModelConfig:
    path: Optional[str] = option(None, "HF model directory, or the name of a model clawrl model get/import "
                                 "installed (clawrl model list). null: the embedded tiny chat model, built on first "
                                 "use.")
    name: Optional[str] = option(None, 'The model id clients send in "model"; null: the directory\'s name.')
    dtype: str = option("auto", "Serving dtype. auto: bf16 on CUDA, fp32 on CPU; or float32 | bfloat16 | float16 "
                        "(fp32, bf16, fp16 are aliases).", choices=DTYPES)
    device: str = option("auto", "Serving device. auto: cuda if available, else cpu; or cpu | cuda | cuda:N.",
                         pattern=r"auto|cpu|cuda(:\d+)?", allowed="auto, cpu, cuda or cuda:N")
    linear_attention: str = option("auto", "Kernels of the linear-attention (Gated DeltaNet) layers of hybrid models "
                                   "(Qwen3-Next, Qwen3.5), serving and training. auto: flash-linear-attention on a "
                                   "GPU when it imports (pip install 'clawrl[fla]'), else pure torch; training falls "
                                   "back to torch where fla refuses its gated backward (Hopper with Triton < 3.7.1, "
                                   "fla issue #640). torch: the pure-torch chunked/recurrent path. fla: "
                                   "flash-linear-attention, an error without it, without a GPU, or where it "
                                   "cannot train. Unused by attention-only models.",
                                   choices=("auto", "torch", "fla"))


@dataclass(frozen=True)
class EngineConfig:
    backend: str = option("torch", "torch: the built-in engine. sglang: an SGLang runtime (optional dependency).",
                          choices=("torch", "sglang"))
    max_batch_size: int = option(32, "Most requests decoded together in one step; more wait in the queue.", ge=1)
    prefill_chunk_tokens: int = option(2048, "Prompt tokens prefilled per step, so a long prompt does not stall "
                                       "others' decoding.", ge=1)
    prefix_cache_tokens: int = option(131072, "KV of finished requests kept for prefix reuse, in tokens across "
                                      "all entries (LRU); 0: no prefix cache.", ge=0)
    max_context: Optional[int] = option(None, "Context window in tokens; null: the model config's "
                                        "max_position_embeddings.", ge=1)
    threads: Optional[int] = option(None, "CPU threads for torch; null: leave torch's default.", ge=1)
    decode_attention: str = option("sdpa", "Attention of the CUDA-graph decode step. sdpa: masked SDPA over the "
                                   "padded width; its bf16 logprobs match a training forward on the tested models. "
                                   "triton: a split-K kernel that reads only each sequence's live tokens (about "
                                   "10% more decode tok/s on an H200), whose bf16 logits can differ from a "
                                   "forward's by rounding; without Triton or a GPU, sdpa is used.",
                                   choices=("sdpa", "triton"))


@dataclass(frozen=True)
class RateLimitConfig:
    requests_per_minute: Optional[int] = option(None, "Requests to /v1 each caller (each server.api_key key; "
                                                "without keys, all loopback clients together) may make per "
                                                "minute; beyond it: 429 with Retry-After. null: no limit.", ge=1)
    tokens_per_minute: Optional[int] = option(None, "Tokens each caller may use per minute: a chat request "
                                              "reserves its prompt plus n * max_tokens and gets back what it "
                                              "did not generate; beyond it: 429 with Retry-After (one request "
                                              "larger than the whole limit: 400). null: no limit.", ge=1)


@dataclass(frozen=True)
class ServerConfig:
    host: str = option("127.0.0.1", "Address to listen on; anything but loopback requires server.api_key.",
                       nonempty=True)
    port: int = option(30000, "TCP port to listen on; 0: any free port (the one chosen is printed).", ge=0, le=65535)
    api_key: Optional[str] = option(None, "Bearer key for /v1 (several: comma-separated, one per caller). "
                                    "Mandatory when host is not loopback.")
    admin_key: Optional[str] = option(None, "Bearer key for /admin (server.api_key never opens it); "
                                            "null: /admin answers loopback clients only.")
    max_body_bytes: int = option(8 * 1024 * 1024, "Request bodies larger than this get 413.", ge=1)
    max_queue: int = option(64, "Requests waiting for the engine beyond this get 429 with Retry-After; "
                            "0: none wait.", ge=0)
    truncate_history: bool = option(False, "Over-long prompts: false answers 400 context_length_exceeded; true "
                                    "keeps the system prompt and the latest turns that fit.")
    default_max_tokens: int = option(512, "Default max tokens for a completion when the client sends none.", ge=1)
    default_temperature: Optional[float] = option(None, "Sampling temperature of a chat request that sends none; "
                                                  "0: greedy, for clients that cannot set one. null: the model's "
                                                  "generation_config.json temperature, else 1.", ge=0, le=2)
    allowed_hosts: Optional[list] = option(None, "Host names the server answers to (the Host header without its port; "
                                           "others get 421, which defeats DNS rebinding); '*': any. null: server.host, "
                                           "localhost, 127.0.0.1 and ::1 on a loopback bind; any on another bind "
                                           "(which requires server.api_key).", check=_check_hosts,
                                           allowed="null or a list of host names or '*'", type_name="list[str]")
    allowed_origins: list = option([], "Web page origins (scheme://host[:port]) besides the server's own that may "
                                   "call it from a browser, answered with CORS; a request with another Origin gets "
                                   "403. []: none, no CORS.", check=_check_origins,
                                   allowed="a list of origins scheme://host[:port]", type_name="list[str]")
    rate_limit: RateLimitConfig = section(RateLimitConfig, "Per-caller limits on requests and tokens per minute.")


@dataclass(frozen=True)
class SessionsConfig:
    idle_timeout_s: float = option(1800.0, "A session with no request for this many seconds is closed; its last "
                                   "turn gets no next state.", gt=0)


@dataclass(frozen=True)
class LoraConfig:
    enabled: bool = option(False, "Train LoRA adapters (peft) instead of full weights; served weights have "
                           "LoRA merged.")
    r: int = option(8, "LoRA rank.", ge=1)
    alpha: int = option(16, "LoRA alpha; adapters are scaled by alpha / r.", ge=1)
    dropout: float = option(0.0, "Dropout on the LoRA path, a probability.", ge=0, lt=1)
    target_modules: list = option(["q_proj", "k_proj", "v_proj", "o_proj"],
                                  "Module names to adapt (peft target_modules).", check=_check_module_names,
                                  allowed="one or more module names", type_name="list[str]")


@dataclass(frozen=True)
class TrainConfig:
    enabled: bool = option(True, "false: serve and record only, never train.")
    batch_size: int = option(8, "Ready samples per train step; training starts once this many are ready. A "
                             "backlog makes steps larger, so that no waiting sample ages past max_weight_lag "
                             "(clawrl.step_size).", ge=1)
    max_batch_size: Optional[int] = option(None, "Most samples in one train step when a backlog makes steps grow; "
                                           "what does not fit may then be dropped as stale. null: no bound "
                                           "(micro_batch_tokens bounds memory, not the step's time).", ge=1)
    lr: float = option(1e-5, "Learning rate (AdamW).", gt=0)
    weight_decay: float = option(0.0, "AdamW weight decay.", ge=0)
    grad_clip: float = option(1.0, "Gradient-norm clip; 0 disables.", ge=0)
    micro_batch_tokens: int = option(16384, "Dynamic micro-batches: most tokens (prompt + response) in one "
                                     "forward/backward.", ge=1)
    gradient_checkpointing: bool = option(False, "Recompute activations in the backward pass: less memory, "
                                          "slower steps.")
    compile: str = option("auto", "torch.compile each decoder layer's elementwise work and the passes over the "
                          "logits (fused kernels; the first steps compile): on | off | auto (on a GPU only, where "
                          "both backends measured faster compiled on the Qwen3-1.7B shape, BENCHMARKS.md; CPU runs "
                          "stay eager).", choices=("off", "on", "auto"))
    compile_scope: str = option("auto", "What train.compile compiles of each decoder layer, in both backends: parts "
                                "(its norms and MLP) | layer (the layer whole, fusing rotary and the residual adds "
                                "too; attention stays eager; 1.38x the HF loop against parts' 1.25x on one H200) | "
                                "auto (layer, but parts for a hybrid linear-attention model).",
                                choices=("auto", "parts", "layer"))
    param_dtype: str = option("auto", "Torch trainer's parameters: bfloat16 (bf16 weights, float32 master weights, "
                              "gradients and AdamW state) | float32 (float32 weights, bf16 autocast on a GPU) | "
                              "auto (bfloat16 on a GPU, float32 on CPU).", choices=("auto", "bfloat16", "float32"))
    save_every: int = option(10, "Checkpoint every N train steps (written atomically).", ge=1)
    keep_last: int = option(3, "Checkpoints kept; older ones are pruned.", ge=1)
    max_weight_lag: int = option(4, "A sample whose oldest token is more than this many weight versions behind "
                                 "is stale.", ge=0)
    stale_policy: str = option("drop", "Stale samples: drop (skip with a reason) | importance_weight (train with "
                               "TIS weights).", choices=("drop", "importance_weight"))
    baseline: str = option("reward", "Advantage of a live-chat sample (one per prompt): reward | ema (reward minus "
                           "a running baseline).", choices=("reward", "ema"))
    baseline_decay: float = option(0.9, "Decay of the ema baseline: value <- decay * value + (1 - decay) * reward.",
                                   ge=0, lt=1)
    group_advantage: str = option("grpo", "For groups of n>1 samples per prompt: grpo (mean/std) | dr_grpo "
                                  "(mean only).", choices=("grpo", "dr_grpo"))
    eps_clip_low: float = option(0.2, "PPO clip: the ratio may fall to 1 - eps_clip_low before clipping.",
                                 ge=0, lt=1)
    eps_clip_high: float = option(0.28, "PPO clip: the ratio may rise to 1 + eps_clip_high (DAPO clip-higher).",
                                  ge=0)
    dual_clip_c: Optional[float] = option(3.0, "Dual-clip constant for negative advantages; null disables.", gt=1)
    kl_coef: float = option(0.0, "KL to the reference policy: coefficient; 0: off.", ge=0)
    kl_estimator: str = option("k3", "KL estimator: k1 | k2 | k3.", choices=("k1", "k2", "k3"))
    kl_in_reward: bool = option(False, "true: the KL is folded into the advantage; false: a loss term.")
    replay_coef: float = option(0.0, "Reference replay: each step the frozen starting policy (the KL's reference) "
                                "writes its own reply to every distinct prompt of the step, and the policy trains "
                                "on it under that prompt (replay_topk: NLL of its ids, or KL to its top-k) times "
                                "this coefficient, so that what the user's feedback does not judge is pulled back "
                                "toward the start; 0: off. Torch trainer only (BENCHMARKS.md, issue 21: on the "
                                "embedded model it kept sums only by slowing the preference).", ge=0)
    replay_temperature: float = option(0.0, "Sampling temperature of the reference's replayed reply "
                                       "(train.replay_coef); 0: greedy.", ge=0)
    replay_max_tokens: int = option(256, "Most tokens of the reference's replayed reply (train.replay_coef).", ge=1)
    replay_topk: int = option(0, "The reference replay's term: 0: token NLL of the replayed reply's ids; K > 0: "
                              "forward KL from the reference's top-K distribution (K bins plus the tail) at each "
                              "of its positions, which has no gradient while the policy equals the reference "
                              "(greedy NLL sharpens it).", ge=0)
    entropy_coef: float = option(0.0, "Weight of the entropy bonus; 0: off (negative: an entropy penalty).")
    tis_cap: Optional[float] = option(2.0, "Rollout/trainer mismatch: truncated importance sampling cap on "
                                      "pi_old/pi_rollout; null: off.", gt=0)
    icepop_band: Optional[list] = option(None, "Rollout/trainer mismatch: IcePop band [low, high]; tokens whose "
                                         "pi_old/pi_rollout falls outside are masked; null: off.",
                                         check=_check_icepop_band, allowed="null or [low, high] with "
                                         "0 < low <= 1 <= high < inf", type_name="list[float]")
    aggregation: str = option("token-mean", "Loss aggregation: token-mean | seq-mean-token-mean | "
                              "seq-mean-token-sum.",
                              choices=("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"))
    max_bad_steps: int = option(3, "NaN/inf losses in a row before training pauses itself.", ge=1)
    lora: LoraConfig = section(LoraConfig, "LoRA adapters instead of full fine-tuning.")


@dataclass(frozen=True)
class TrainerConfig:
    backend: str = option("torch", "torch: the built-in HF/torch trainer (one process). megatron: megatron-core "
                          "with tensor, pipeline and data parallelism over trainer ranks in their own processes "
                          "(cluster.*).", choices=("torch", "megatron"))


@dataclass(frozen=True)
class ClusterConfig:
    """Where trainer ranks and engines run (``trainer.backend=megatron``).

    The node layout comes from the launch environment (NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT,
    GPUS_PER_NODE), as torchrun reads it; these fields are the parallel layout and the plumbing.
    """

    tp: int = option(1, "Tensor-parallel size; data parallel = trainer ranks / (tp * pp).", ge=1)
    pp: int = option(1, "Pipeline-parallel size; data parallel = trainer ranks / (tp * pp).", ge=1)
    procs_per_node: int = option(1, "Trainer ranks per node when GPUS_PER_NODE is unset (on CPU: processes, "
                                 "gloo).", ge=1)
    distributed_optimizer: bool = option(True, "mcore DDP with the distributed optimizer (optimizer state sharded "
                                         "over data-parallel ranks).")
    timeout_s: float = option(300.0, "Seconds a connection, collective or weight sync may take before it fails "
                              "with a reason.", gt=0)
    control_port: int = option(0, "Port on MASTER_ADDR for the driver's control channel; 0: MASTER_PORT + 1.",
                               ge=0, le=65535)
    sync_port: int = option(0, "Port on MASTER_ADDR for the weight-sync process group; 0: MASTER_PORT + 2.",
                            ge=0, le=65535)
    bucket_mb: int = option(256, "Weight-sync bucket size: HF-named tensors are streamed in buckets of at most "
                            "this many MB.", ge=1)
    sglang_group_port: int = option(0, "With engine.backend=sglang: port on MASTER_ADDR where trainer rank 0 hosts "
                                    "the rendezvous of SGLang's weights-update group (SGLang's workers join it to "
                                    "receive weights); 0: MASTER_PORT + 3.", ge=0, le=65535)
    ray: bool = option(False, "Place serving engines with Ray (an existing cluster at ray_address, or a local one).")
    ray_address: str = option("auto", "Ray cluster: auto (RAY_ADDRESS, else a new local one) | local | host:port | "
                              "ray://host:port.", pattern=r"auto|local|([A-Za-z][A-Za-z0-9+.-]*://)?\S+:\d+",
                              allowed="auto, local, host:port or ray://host:port")
    engines: int = option(1, "Serving engines to place with Ray.", ge=1)
    engine_gpus: float = option(0.0, "GPUs each Ray-placed engine takes (0 on CPU; fractions share a GPU).", ge=0)


@dataclass(frozen=True)
class JudgeModelConfig:
    path: Optional[str] = option(None, "HF directory (or installed model name) of the PRM judge model; null: the "
                                 "frozen base policy.")


@dataclass(frozen=True)
class JudgeConfig:
    kind: str = option("rules", "The reward judge. rules: explicit feedback rules. prm: a model judge with "
                       "majority votes. env: environment verdicts.", choices=("rules", "prm", "env"))
    votes: int = option(3, "Votes per turn for the PRM judge; the majority decides, ties give 0.", ge=1)
    concurrency: int = option(2, "Turns judged at once.", ge=1)
    timeout_s: float = option(60.0, "A judge call slower than this many seconds fails (and is retried).", gt=0)
    retries: int = option(1, "Retries of a failed or timed-out judge call.", ge=0)
    model: JudgeModelConfig = section(JudgeModelConfig, "The PRM judge's model.")


@dataclass(frozen=True)
class OpdConfig:
    hint_judge: str = option("rules", "On-policy distillation: hint judge rules (correction phrases) | model "
                             "(votes from a judge engine).", choices=("rules", "model"))
    votes: int = option(3, "Votes per turn for the model hint judge; a strict majority must accept.", ge=1)
    teacher: str = option("policy", "Teacher scoring the sampled tokens under the hinted prompt: policy (the "
                          "serving engine) | base (a frozen copy of the starting policy, which cannot drift with "
                          "the student) | a model path or installed model name.", nonempty=True)
    topk: int = option(0, "Teacher top-k ids/logprobs stored per token for top-k distillation; 0: sampled tokens "
                       "only.", ge=0, le=20)
    concurrency: int = option(1, "Turns hint-judged or teacher-scored at once; keep small so scoring never crowds "
                              "out serving.", ge=1)
    topk_coef: float = option(1.0, "Weight of the top-k distillation loss (used when topk > 0); 0: token "
                              "advantages only.", ge=0)
    topk_kl: str = option("reverse", "Direction of the top-k distillation: reverse (KL(student || teacher), "
                          "mode-seeking, cannot raise a token the student gives ~0 probability) | forward "
                          "(KL(teacher || student), pulls the student onto the teacher's top-k).",
                          choices=("reverse", "forward"))
    adv_clip: float = option(5.0, "|teacher - student| logprob gap is clipped to this, so one near-impossible "
                             "token cannot dominate.", gt=0)
    hinted_sample: bool = option(False, "Also sample a reply from the teacher under the hinted prompt and train the "
                                 "student on those sampled tokens under the original prompt (token NLL weighted by "
                                 "the hint judge's acceptance, times hinted_coef): learns what the policy never "
                                 "samples without the hint, which token advantages cannot. method=opd or combine.")
    hinted_coef: float = option(1.0, "Weight of the hinted-sample NLL term (opd.hinted_sample).", ge=0)
    hinted_temperature: float = option(1.0, "Sampling temperature of the reply under the hinted prompt "
                                       "(opd.hinted_sample); 0: greedy.", ge=0)
    hinted_max_tokens: int = option(256, "Most tokens of the reply sampled under the hinted prompt "
                                    "(opd.hinted_sample).", ge=1)


@dataclass(frozen=True)
class CombineConfig:
    w_rl: float = option(1.0, "method=combine: weight of the RL advantage in A = w_rl * A_rl + w_opd * A_opd "
                         "per token (a turn with one signal gets that term).", ge=0)
    w_opd: float = option(1.0, "method=combine: weight of the OPD advantage in A = w_rl * A_rl + w_opd * A_opd.",
                          ge=0)
    opd_wait_s: float = option(120.0, "A judged turn whose teacher score is still missing after this many seconds "
                               "trains RL-only.", gt=0)


@dataclass(frozen=True)
class EnvConfig:
    name: str = option("chat", "Where samples come from: chat (the gateway's live sessions) or an environment, a "
                       "built-in name or dir/file.py:ClassName (clawrl.envs).")
    tasks: Optional[str] = option(None, "Task set directory (dataset.toml + data/<split>.jsonl); None: the "
                                  "environment's own tasks.")
    split: str = option("train", "The task split rolled out for training.")
    group_size: int = option(4, "Rollouts of one task that form a GRPO group (compared with each other).", ge=1)
    max_turns: int = option(8, "Model turns an episode may take before it is truncated.", ge=1)
    max_tokens_per_turn: int = option(256, "Most tokens the model may sample in one turn of an episode.", ge=1)
    temperature: float = option(1.0, "Sampling temperature of rollouts (> 0, so a group's rollouts differ).", gt=0)
    sample_mode: str = option("trajectory", "How an episode becomes samples: trajectory (one per episode, the loss "
                              "mask on the model's tokens) | per_turn (one per model turn, with exactly the context "
                              "it saw; each takes its episode's advantage).", choices=("trajectory", "per_turn"))
    max_total_tokens: Optional[int] = option(None, "Most tokens in one episode, its first prompt included; then it "
                                             "is truncated. null: the engine's context window.", ge=2)
    episode_timeout_s: Optional[float] = option(1800.0, "Wall-clock limit of an episode's reset and turns; then it "
                                                "is truncated (an environment call still running fails it). The "
                                                "closing verdict gets as long again. null: no limit.", gt=0)
    step_judge: str = option("none", "Per-step scores: none | prm (the PRM judge, judge.votes votes from the policy "
                             "engine, scores each turn from the observation that followed it; needs "
                             "env.sample_mode=per_turn).", choices=("none", "prm"))
    step_score_weight: float = option(0.5, "With env.step_judge=prm: a turn's advantage is its episode's plus this "
                                      "times its step score (-1/0/+1).", ge=0)
    groups_in_flight: int = option(2, "Groups rolled out at once by clawrl serve (each runs env.group_size "
                                   "episodes concurrently).", ge=1)
    rollout_ahead: int = option(2, "Rollouts pause while this many train batches (train.batch_size samples "
                                "each) are ready and untrained, which bounds how stale a trained sample is.", ge=1)
    max_train_steps: Optional[int] = option(None, "Stop after this many train steps: checkpoint, evaluate, and exit "
                                            "0. null: run until stopped.", ge=1)
    eval_every: int = option(0, "Evaluate the served weights on env.eval_split every N train steps (and after "
                             "the last one with env.max_train_steps); 0: never during training.", ge=0)
    eval_split: str = option("test", "The held-out split of the periodic evaluation.", nonempty=True)
    eval_limit: Optional[int] = option(None, "Evaluate on the first N tasks of env.eval_split only (the "
                                       "periodic evaluation is greedy, one play per task). null: all.", ge=1)
    swe_reward: str = option("resolved", "env.name=swe's reward: resolved (+1 when the episode's patch resolves the "
                             "instance, else -1) | f2p_share (2 x the share of FAIL_TO_PASS tests that pass - 1, "
                             "and -1 when a PASS_TO_PASS test breaks).", choices=("resolved", "f2p_share"))
    gui_episode_max_time_s: float = option(120.0, "env.name=gui: MiniWoB's EPISODE_MAX_TIME, the seconds a task page "
                                           "gives an episode before it ends it with reward -1 (MiniWoB's own 10 s is "
                                           "less than a model on CPU needs for a few turns).", gt=0)
    gui_browsers: int = option(2, "env.name=gui: headless Chromium instances open at once in this process (the "
                               "browser pool; an episode waits for a free one). 2 suits a 2-core machine "
                               "(BENCHMARKS.md).", ge=1)


@dataclass(frozen=True)
class SandboxConfig:
    backend: str = option("auto", "Where agentic environments run commands: auto (bwrap, else unshare, else "
                          "refuse) | bwrap | unshare | subprocess (no isolation; needs sandbox.allow_unisolated).",
                          choices=("auto", "bwrap", "unshare", "subprocess"))
    allow_unisolated: bool = option(False, "Allow the plain subprocess backend, which does NOT isolate: commands "
                                    "see and may change the whole host. Only for trusted tasks.")
    root: Optional[str] = option(None, "Directory under which sandboxes keep their writable trees; None: the "
                                 "system temp directory.")
    uid_base: int = option(61000, "First host uid of the sandbox slots (as root, each concurrent sandbox runs as "
                           "its own uid uid_base..uid_base+slots-1, which no account may use).", ge=1000)
    slots: int = option(32, "Most sandboxes open at once on this host (as root: the size of the uid pool).", ge=1)
    cpu_time_s: int = option(600, "CPU seconds one sandboxed process may use (RLIMIT_CPU).", ge=1)
    memory_mb: int = option(2048, "Address space of one sandboxed process in MiB (RLIMIT_AS); a task's memory_mb "
                            "may lower it.", ge=64)
    max_procs: int = option(128, "Processes and threads a sandbox may have at once (RLIMIT_NPROC of its uid).",
                            ge=4)
    max_file_mb: int = option(1024, "Largest file a sandboxed process may write, in MiB (RLIMIT_FSIZE).", ge=1)
    max_open_files: int = option(1024, "Open files per sandboxed process (RLIMIT_NOFILE).", ge=16)
    exec_timeout_s: float = option(300.0, "Default wall-clock limit of one exec; then its whole process tree is "
                                   "killed.", gt=0)
    kill_grace_s: float = option(1.0, "After the wall clock, seconds between SIGTERM and SIGKILL.", ge=0)
    max_output_bytes: int = option(1_000_000, "Bytes of stdout and of stderr kept per exec (the tail; the cut is "
                                   "marked).", ge=1024)


@dataclass(frozen=True)
class WandbConfig:
    mode: str = option("offline", "offline (default) | online (falls back to offline without network) | "
                       "disabled.", choices=("offline", "online", "disabled"))
    project: str = option("clawrl", "WandB project name.", nonempty=True)


@dataclass(frozen=True)
class LoggingConfig:
    level: str = option("INFO", "Log level of clawrl's loggers, any case.", choices=LOG_LEVELS, ignore_case=True)
    wandb: WandbConfig = section(WandbConfig, "WandB metrics logging (metrics.jsonl is always written).")


@dataclass(frozen=True)
class DemoConfig:
    user: str = option("worked", 'The simulated user\'s hidden preference: worked ("7 + 5 = 12") | bare (just a '
                       'number) | student (a bare number, natural corrections) | teacher (a friendly "Sure!" '
                       'and the worked sum); for a real model, everyday questions: concise (short replies, '
                       'thumbs only) | opener (replies opening with "Sure!").',
                       choices=("bare", "worked", "student", "teacher", "concise", "opener"))
    interactions: int = option(160, "Interactions with the simulated user: a question, the model's reply, the "
                               "user's feedback.", ge=1)
    eval_every: int = option(40, "Measure the preference-satisfaction rate before the first and after every N "
                             "interactions.", ge=1)
    eval_prompts: int = option(64, "Held-out questions per measurement.", ge=1)
    max_tokens: int = option(24, "Most tokens of a reply to a question.", ge=1)
    temperature: Optional[float] = option(1.0, "Sampling temperature of the user's questions and the held-out "
                                          "preference measure; null: send none (the server's default applies).",
                                          ge=0)


@dataclass(frozen=True)
class ClawrlConfig:
    method: str = option("rl", "How samples train: rl | opd | combine, or a Method subclass by path, "
                         "dir/file.py:ClassName (clawrl.methods; set by each method directory's config.yaml).",
                         nonempty=True)
    run_dir: str = option("runs/default", "Everything a run writes: the SQLite store, checkpoints, logs.",
                          nonempty=True)
    seed: int = option(0, "Seed for LoRA adapter init, the SGLang runtime, model-judge votes and the demo.")
    model: ModelConfig = section(ModelConfig, "The policy model being served and trained.")
    engine: EngineConfig = section(EngineConfig, "The inference engine.")
    server: ServerConfig = section(ServerConfig, "The OpenAI-compatible HTTP server.")
    sessions: SessionsConfig = section(SessionsConfig, "Linking requests into sessions.")
    train: TrainConfig = section(TrainConfig, "What trains and how: batches, the policy loss, checkpoints.")
    trainer: TrainerConfig = section(TrainerConfig, "The training backend.")
    cluster: ClusterConfig = section(ClusterConfig, "Parallel layout and placement (megatron trainer, Ray engines).")
    judge: JudgeConfig = section(JudgeConfig, "The reward judge (rl, combine).")
    opd: OpdConfig = section(OpdConfig, "On-policy distillation (opd, combine).")
    combine: CombineConfig = section(CombineConfig, "method=combine: mixing the RL and OPD advantages.")
    env: EnvConfig = section(EnvConfig, "The source of samples: live chat or an environment's rollouts.")
    sandbox: SandboxConfig = section(SandboxConfig, "Where agentic environments run commands: isolation "
                                     "backend, uids and limits.")
    logging: LoggingConfig = section(LoggingConfig, "Logs and metrics.")
    demo: DemoConfig = section(DemoConfig, "clawrl demo only: the simulated user and how the demo measures "
                               "learning.")


def _default(f):
    return f.default_factory() if f.default_factory is not MISSING else f.default


def _leaves(cls=ClawrlConfig, prefix: str = ""):
    """(dotted key, dataclass field) of every leaf, in definition order."""
    for f in fields(cls):
        default = _default(f)
        if is_dataclass(default):
            yield from _leaves(type(default), prefix + f.name + ".")
        else:
            yield prefix + f.name, f


def all_keys(cls=ClawrlConfig, prefix: str = "") -> list[str]:
    """Dotted names of every leaf field, e.g. ``server.port``."""
    return [key for key, _ in _leaves(cls, prefix)]


def field_help(key: str) -> str:
    """The help text of a leaf key, e.g. ``field_help("server.port")``."""
    for k, f in _leaves():
        if k == key:
            return f.metadata["help"]
    raise KeyError(key)


def _num(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _range_text(m: dict) -> str | None:
    ge, gt, le, lt = m.get("ge"), m.get("gt"), m.get("le"), m.get("lt")
    if ge is not None and le is not None and gt is None and lt is None:
        return f"between {_num(ge)} and {_num(le)}"
    parts = [f"{op} {_num(v)}" for op, v in ((">=", ge), (">", gt), ("<=", le), ("<", lt)) if v is not None]
    return " and ".join(parts) or None


def allowed_text(key: str) -> str | None:
    """What ``key`` accepts, in words (None: any value of its type)."""
    for k, f in _leaves():
        if k == key:
            return _allowed(f)
    raise KeyError(key)


def _allowed(f) -> str | None:
    m = f.metadata
    if m.get("choices"):
        return "one of " + ", ".join(m["choices"]) + (" (any case)" if m.get("ignore_case") else "")
    if m.get("allowed"):
        return m["allowed"]
    rng = _range_text(m)
    if rng:
        return rng
    if m.get("nonempty"):
        return "a non-empty string"
    return None


def _show(value) -> str:
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return "null" if value is None else str(value)


def _problem(f, value) -> str | None:
    """Why ``value`` is refused for field ``f`` (the text after ``key=value: ``), or None."""
    m = f.metadata
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return "must be a finite number"
    if isinstance(value, str):
        if m.get("choices"):
            given = value.upper() if m.get("ignore_case") else value
            if given not in m["choices"]:
                return "must be " + _allowed(f)
        if m.get("pattern") and not re.fullmatch(m["pattern"], value):
            return "must be " + (m.get("allowed") or f"a match of {m['pattern']}")
        if m.get("nonempty") and not value.strip():
            return "must not be empty"
    if isinstance(value, (int, float)):
        ge, gt, le, lt = m.get("ge"), m.get("gt"), m.get("le"), m.get("lt")
        if ((ge is not None and not value >= ge) or (gt is not None and not value > gt)
                or (le is not None and not value <= le) or (lt is not None and not value < lt)):
            return "must be " + _range_text(m)
    if m.get("check"):
        return m["check"](value)
    return None


def _get(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _cross_problems(cfg: ClawrlConfig) -> list[tuple[str, str]]:
    """Mistakes no single field shows: (key, one-line message)."""
    out = []
    c = cfg.cluster
    if c.control_port and c.control_port == c.sync_port:
        out.append(("cluster.sync_port", f"cluster.control_port={c.control_port} and cluster.sync_port="
                    f"{c.sync_port}: must differ (0 for either: derived from MASTER_PORT)"))
    hinted = cfg.opd.hinted_sample and cfg.opd.hinted_coef > 0  # the hinted replies' NLL trains on its own
    if cfg.method == "combine" and cfg.combine.w_rl == 0 and cfg.combine.w_opd == 0 and not hinted:
        out.append(("combine.w_rl", f"combine.w_rl={_num(cfg.combine.w_rl)} and combine.w_opd="
                    f"{_num(cfg.combine.w_opd)}: method=combine needs at least one weight > 0, or "
                    "opd.hinted_sample=true (nothing would train)"))
    t = cfg.train
    if t.replay_coef > 0 and cfg.trainer.backend != "torch":
        out.append(("train.replay_coef", f"train.replay_coef={_num(t.replay_coef)} with trainer.backend="
                    f"{cfg.trainer.backend}: the reference replay runs in the torch trainer only (set "
                    "train.replay_coef=0, or trainer.backend=torch)"))
    if t.max_batch_size is not None and t.max_batch_size < t.batch_size:
        out.append(("train.max_batch_size", f"train.max_batch_size={t.max_batch_size} and train.batch_size="
                    f"{t.batch_size}: a step takes at least batch_size, so the bound must be at least that"))
    return out


def config_problems(cfg: ClawrlConfig) -> list[tuple[str, str]]:
    """Every value ``cfg`` holds that its field does not accept: (key, one-line message)."""
    out = []
    for key, f in _leaves():
        reason = _problem(f, _get(cfg, key))
        if reason:
            out.append((key, f"{key}={_show(_get(cfg, key))}: {reason}"))
    return out + _cross_problems(cfg)


def validate_config(cfg: ClawrlConfig, sources: dict[str, str] | None = None) -> None:
    """Raise ConfigError (one line) if any value of ``cfg`` is not accepted by its field.

    ``sources`` maps a key to where its value came from (a YAML file), added to the message.
    """
    problems = config_problems(cfg)
    if problems:
        sources = sources or {}
        raise ConfigError("; ".join(msg + (f" (in {sources[key]})" if key in sources else "")
                                    for key, msg in problems))


def _type_name(f) -> str:
    if f.metadata.get("type_name"):
        name = f.metadata["type_name"]
        return name + "|null" if str(f.type).startswith("Optional[") else name
    t = str(f.type)
    if t.startswith("Optional[") and t.endswith("]"):
        return t[len("Optional["):-1] + "|null"
    return t


def _default_text(value) -> str:
    if isinstance(value, list):
        return "[" + ",".join(str(v) for v in value) + "]"
    if isinstance(value, str):
        return value if value else "''"
    return _show(value)


def describe_config() -> str:
    """Every key as ``key  type  default  help [allowed]``, one line each (``--help-config``)."""
    rows = [(key, _type_name(f), _default_text(_default(f)), f.metadata["help"], _allowed(f))
            for key, f in _leaves()]
    wk = max(len(r[0]) for r in rows + [("key",)])
    wt = max(len(r[1]) for r in rows)
    wd = max(len(r[2]) for r in rows)
    lines = ["clawrl configuration: set any key with key=value (e.g. server.port=8000). Each layer wins over the "
             "one before: the defaults below, the model's own (clawrl.yaml in model.path; the embedded model's: "
             "clawrl/conf/embedded.yaml), a method's config.yaml, your key=value overrides.", "",
             f"{'key'.ljust(wk)}  {'type'.ljust(wt)}  {'default'.ljust(wd)}  help [allowed values]"]
    for key, typ, default, help_text, allowed in rows:
        line = f"{key.ljust(wk)}  {typ.ljust(wt)}  {default.ljust(wd)}  {help_text}"
        lines.append(line + (f" [{allowed}]" if allowed else ""))
    return "\n".join(lines) + "\n"


def _suggest(key: str) -> str:
    close = difflib.get_close_matches(key, all_keys(), n=3, cutoff=0.5)
    return f"; did you mean {', '.join(close)}?" if close else ""


def model_defaults_path(model_path: str | None) -> Path | None:
    """The per-model defaults layered for ``model.path``: ``<model.path>/clawrl.yaml`` when that file
    exists, else for a model ``clawrl model get`` installed the package's ``conf/models/NAME.yaml``, and
    for the embedded model (``model.path`` null) the package's ``conf/embedded.yaml``.
    Only looks for a file: never loads, and never builds, a model."""
    if model_path is None:
        return EMBEDDED_DEFAULTS
    path = Path(model_path).expanduser() / MODEL_DEFAULTS_FILE
    return path if path.is_file() else known_defaults(Path(model_path).expanduser())


def _key_comments(path: Path) -> dict[str, str]:
    """The comment lines right above each key of a YAML file, joined: a per-model defaults file says
    there why it sets a value (``conf/embedded.yaml``)."""
    out: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    comment: list[str] = []
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            comment.append(stripped.lstrip("#").strip())
            continue
        m = re.match(r"^(\s*)([A-Za-z_][\w]*)\s*:", line)
        if not m:
            comment = []
            continue
        indent = len(m.group(1))
        stack = [(i, k) for i, k in stack if i < indent] + [(indent, m.group(2))]
        if comment:
            out[".".join(k for _, k in stack)] = " ".join(comment)
        comment = []
    return out


def model_defaults_report(cfg: ClawrlConfig) -> str:
    """What the serve log says about the per-model defaults layer (``model_defaults_path``) of a
    composed ``cfg`` (before the embedded model is resolved to its directory): which file applied and
    why, each key it sets with the value it set, whether the recipe or the command line replaced it,
    and the reason the file gives in a comment above the key."""
    path = model_defaults_path(cfg.model.path)
    if path is None:
        return (f"per-model defaults: none ({cfg.model.path} has no {MODEL_DEFAULTS_FILE}), so the dataclass "
                f"defaults apply wherever the recipe and the command line set nothing (train.lr={cfg.train.lr:g}, "
                "sized for 1-8B models); a clawrl.yaml beside the model's config.json would set its own")
    why = ("model.path is null: the embedded tiny model's calibrated settings" if cfg.model.path is None
           else f"{MODEL_DEFAULTS_FILE} in model.path" if path.name == MODEL_DEFAULTS_FILE
           else "clawrl's settings for this known model, measured on it")
    layer = _load_layer(path)
    comments = _key_comments(path)
    parts = []
    for key in _leaf_keys(layer):
        value, used = OmegaConf.select(layer, key), OmegaConf.select(OmegaConf.structured(cfg), key)
        part = f"{key}={value}" + ("" if used == value else f", replaced by {used} from the recipe or command line")
        if key in comments:
            part += f" ({comments[key]})"
        parts.append(part)
    return f"per-model defaults from {path} ({why}): " + "; ".join(parts)


def compose(overrides: list[str] | tuple[str, ...] = (), yaml_path: str | None = None,
            layer: tuple[str, Any] | None = None) -> ClawrlConfig:
    """Build the config: dataclass defaults < the model's defaults < ``yaml_path`` < ``layer`` < ``overrides``.

    ``layer`` is a (name, OmegaConf tree of known keys) already loaded, such as a run's stored
    config (``clawrl.run_config``); ``name`` is what error messages call it.

    ``model.path`` picks the model's defaults (``model_defaults_path``) but is itself set by the
    recipe or the command line, so this composes twice: once without the model's layer to learn
    ``model.path``, then with it. Unknown keys in any layer are refused with the closest valid
    names (and the file named), then every value is checked against what its field accepts
    (``validate_config``). Returns a frozen ClawrlConfig.
    """
    dotlist = _parse_overrides(overrides)
    layers = [(str(yaml_path), _load_layer(yaml_path))] if yaml_path else []
    if layer is not None:
        layers.append(layer)
    first, _ = _merge(layers, dotlist)
    model_file = model_defaults_path(_model_ref(first.model.path, "model.path"))
    if model_file is not None:
        model_layer = _load_layer(model_file)
        if "model.path" in _leaf_keys(model_layer):
            raise ConfigError(f"model.path in {model_file}: a model's own defaults cannot choose the model")
        layers.insert(0, (str(model_file), model_layer))
    cfg, sources = _merge(layers, dotlist)
    validate_config(cfg, sources)
    return _resolve_model_names(cfg)


def _model_ref(value: str | None, key: str) -> str | None:
    try:
        return resolve_model_ref(value)
    except ModelNameError as e:
        raise ConfigError(f"{key}={value}: {e}") from None


def _resolve_model_names(cfg: ClawrlConfig) -> ClawrlConfig:
    """Model settings that name an installed model (``clawrl model get``) as its directory."""
    teacher = cfg.opd.teacher if cfg.opd.teacher in ("policy", "base") else _model_ref(cfg.opd.teacher, "opd.teacher")
    judge_model = replace(cfg.judge.model, path=_model_ref(cfg.judge.model.path, "judge.model.path"))
    return replace(cfg, model=replace(cfg.model, path=_model_ref(cfg.model.path, "model.path")),
                   judge=replace(cfg.judge, model=judge_model), opd=replace(cfg.opd, teacher=teacher))


def _parse_overrides(overrides) -> list[tuple[str, Any]]:
    """``key=value`` strings as (key, typed value), unknown keys refused."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception as e:  # hydra's own message is multi-line; keep the first line
        raise ConfigError(f"bad override: {str(e).splitlines()[0]}") from None
    known = set(all_keys())
    dotlist = []
    for ov in parsed:
        key = ov.key_or_group
        if ov.is_delete() or ov.is_add():
            raise ConfigError(f"override '{ov.input_line}': only key=value is supported")
        if key not in known:
            raise ConfigError(f"unknown config key '{key}'{_suggest(key)}")
        if ov.is_sweep_override():  # hydra reads key=a,b as a sweep; its repr would become the value
            raise ConfigError(f"override '{ov.input_line}' is a sweep (unquoted commas, choice() or range()), "
                              f"which clawrl does not run; quote a value with commas ({key}='a,b') or give a "
                              f"list ({key}=[a,b])")
        dotlist.append((key, ov.value()))
    return dotlist


def _load_layer(path) -> Any:
    """A YAML layer, every key in it known."""
    try:
        layer = OmegaConf.load(path)
    except Exception as e:
        raise ConfigError(f"{path}: {str(e).splitlines()[0]}") from None
    if not OmegaConf.is_dict(layer):
        raise ConfigError(f"{path}: expected key: value pairs, not a list")
    known = set(all_keys())
    for key in _leaf_keys(layer):
        if key not in known:
            raise ConfigError(f"unknown config key '{key}' in {path}{_suggest(key)}")
    return layer


def _merge(layers: list[tuple[str, Any]], dotlist: list[tuple[str, Any]]) -> tuple[ClawrlConfig, dict[str, str]]:
    """The defaults with ``layers`` merged in order, then ``dotlist`` set; and, for each key the
    value of which came from a layer, that layer's file (for error messages)."""
    cfg = _writable(OmegaConf.structured(ClawrlConfig))
    OmegaConf.set_struct(cfg, True)
    sources: dict[str, str] = {}
    for name, layer in layers:
        try:
            cfg = OmegaConf.merge(cfg, layer)
        except Exception as e:
            raise ConfigError(f"{name}: {str(e).splitlines()[0]}") from None
        sources.update(dict.fromkeys(_leaf_keys(layer), name))
    for key, value in dotlist:
        try:
            OmegaConf.update(cfg, key, value, merge=False)
        except Exception as e:
            raise ConfigError(f"{key}={value}: {str(e).splitlines()[0]}") from None
        sources.pop(key, None)
    try:
        return OmegaConf.to_object(cfg), sources
    except Exception as e:
        raise ConfigError(str(e).splitlines()[0]) from None


def _writable(node):
    """OmegaConf marks a frozen dataclass's nodes read-only; composition must write to them."""
    OmegaConf.set_readonly(node, False)
    if OmegaConf.is_dict(node):
        for key in node:
            child = node._get_node(key)
            if OmegaConf.is_config(child):
                _writable(child)
    return node


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
