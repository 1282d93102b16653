"""The config is the user's contract: every field is read somewhere, bad keys are refused clearly,
the layers compose in their documented order, and the result cannot be changed afterwards."""
import dataclasses
import re
from pathlib import Path

import pytest

from clawrl.config import ConfigError, all_keys, compose
from config_reads import reads_in_source, reads_in_tree

CORE = Path(__file__).resolve().parents[1] / "core" / "clawrl"
CORE_READS = reads_in_tree(CORE, skip=(CORE / "config.py",))


@pytest.mark.parametrize("key", all_keys())
def test_every_config_field_is_read_in_core(key):
    assert key in CORE_READS, f"config field {key} is never read in core/clawrl (an attribute load in code)"


def test_only_attribute_loads_in_code_count_as_reads():
    src = '''
"""cfg.train.save_every in a docstring"""
# cfg.train.keep_last in a comment
import dataclasses
def f(cfg, name, model):
    getattr(cfg.train, name); getattr(cfg.train, "lr" + name); dataclasses.asdict(cfg.engine)
    dataclasses.fields(cfg.server); cfg.train.batch_size = 3
    model.path; model.name  # an HF model's attributes, not the config's
    cfg.judge.model.path  # judge.model.path, not model.path
    train = cfg.train
    return train.max_weight_lag, cfg.train.lora.r
class Buffer:
    def __init__(self, train: "TrainConfig | None", engine_cfg):
        self.train = train or TrainConfig()
        self.engine_cfg = engine_cfg
    def size(self):
        return self.train.stale_policy, self.engine_cfg.threads
'''
    assert set(reads_in_source(src)) == {"train.max_weight_lag", "train.lora.r", "judge.model.path",
                                         "train.stale_policy", "engine.threads"}


def test_override_sets_typed_value():
    cfg = compose(["server.port=1234", "model.path=/models/x", "server.truncate_history=true"])
    assert cfg.server.port == 1234 and cfg.model.path == "/models/x" and cfg.server.truncate_history is True


def test_a_sweep_is_refused_rather_than_stored_as_its_repr():
    """Hydra reads key=a,b as a sweep; stored as it was, server.api_key=k1,k2 became the text
    "ChoiceSweep(..., list=['k1', 'k2'], simple_form=True, ...)", whose comma-separated pieces
    (e.g. "simple_form=True") were then valid API keys. Quoted, the commas are the value's."""
    for override in ("server.api_key=k1,k2", "train.lr=choice(1e-5,2e-5)", "seed=range(1,3)"):
        with pytest.raises(ConfigError, match=r"is a sweep .*quote a value with commas"):
            compose([override])
    assert compose(["server.api_key='k1,k2'"]).server.api_key == "k1,k2"


def test_unknown_key_is_refused_with_closest_names():
    with pytest.raises(ConfigError, match=r"unknown config key 'server.prot'.*server\.port"):
        compose(["server.prot=1"])


def test_wrong_type_is_a_one_line_error():
    with pytest.raises(ConfigError) as e:
        compose(["server.port=abc"])
    assert "\n" not in str(e.value) and "port" in str(e.value)


# --- values are validated at composition --------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ["openclaw-rl/config.yaml", "openclaw-opd/config.yaml", "openclaw-combine/config.yaml"]


@pytest.mark.parametrize("port", ["99999", "65536", "-1"])
def test_server_port_out_of_range_is_refused(port):
    with pytest.raises(ConfigError) as e:
        compose([f"server.port={port}"])
    assert str(e.value) == f"server.port={port}: must be between 0 and 65535"


def test_server_port_zero_means_any_free_port():
    # `clawrl demo`, the real-OpenClaw tests and bench_serve_training all bind server.port=0
    assert compose(["server.port=0"]).server.port == 0
    assert compose(["server.port=65535"]).server.port == 65535


@pytest.mark.parametrize("key", ["cluster.control_port", "cluster.sync_port"])
def test_cluster_ports_are_ports_or_zero_for_auto(key):
    assert compose([f"{key}=0"]) and compose([f"{key}=4000"])
    for bad in ("70000", "-1"):
        with pytest.raises(ConfigError, match=rf"^{key}={bad}: must be between 0 and 65535$"):
            compose([f"{key}={bad}"])


def test_cluster_control_and_sync_ports_must_differ():
    with pytest.raises(ConfigError, match="cluster.control_port=4000 and cluster.sync_port=4000: must differ"):
        compose(["cluster.control_port=4000", "cluster.sync_port=4000"])


@pytest.mark.parametrize("override,allowed", [
    ("train.stale_policy=dorp", "drop, importance_weight"),
    ("engine.backend=vllm", "torch, sglang"),
    ("trainer.backend=deepspeed", "torch, megatron"),
    ("model.dtype=int8", "auto, float32, fp32, bfloat16, bf16, float16, fp16"),
    ("train.baseline=mean", "reward, ema"),
    ("train.group_advantage=ppo", "grpo, dr_grpo"),
    ("train.kl_estimator=k4", "k1, k2, k3"),
    ("train.aggregation=sum", "token-mean, seq-mean-token-mean, seq-mean-token-sum"),
    ("judge.kind=vibes", "rules, prm, env"),
    ("opd.hint_judge=llm", "rules, model"),
    ("opd.topk_kl=sideways", "reverse, forward"),
    ("logging.level=LOUD", "DEBUG, INFO, WARNING, ERROR, CRITICAL"),
    ("logging.wandb.mode=cloud", "offline, online, disabled"),
    ("demo.user=nobody", "bare, worked, student, teacher"),
])
def test_bad_enum_is_refused_with_the_allowed_values(override, allowed):
    key, value = override.split("=")
    with pytest.raises(ConfigError) as e:
        compose([override])
    msg = str(e.value)
    assert msg.startswith(f"{key}='{value}': must be one of {allowed}") and "\n" not in msg


def test_the_first_example_message_reads_as_documented():
    with pytest.raises(ConfigError) as e:
        compose(["train.stale_policy=dorp"])
    assert str(e.value) == "train.stale_policy='dorp': must be one of drop, importance_weight"


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:3"])
def test_model_device_accepts_auto_cpu_cuda_and_cuda_n(device):
    assert compose([f"model.device={device}"]).model.device == device


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:x", "CPU"])
def test_model_device_refuses_anything_else(device):
    with pytest.raises(ConfigError, match=r"must be auto, cpu, cuda or cuda:N"):
        compose([f"model.device={device}"])


def test_logging_level_is_case_insensitive():
    assert compose(["logging.level=debug"]).logging.level == "debug"
    assert compose(["logging.level=Warning"]).logging.level == "Warning"


@pytest.mark.parametrize("key", ["train.lora.dropout", "train.baseline_decay"])
def test_probability_above_one_is_refused(key):
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}=1.5: must be >= 0 and < 1$"):
        compose([f"{key}=1.5"])
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}=-0.1: "):
        compose([f"{key}=-0.1"])


@pytest.mark.parametrize("override,reason", [
    ("train.batch_size=0", ">= 1"),
    ("train.micro_batch_tokens=0", ">= 1"),
    ("train.save_every=0", ">= 1"),
    ("train.keep_last=0", ">= 1"),
    ("train.max_weight_lag=-1", ">= 0"),
    ("train.max_bad_steps=0", ">= 1"),
    ("train.lora.r=0", ">= 1"),
    ("engine.max_batch_size=0", ">= 1"),
    ("engine.max_context=0", ">= 1"),
    ("server.max_queue=-1", ">= 0"),
    ("server.max_body_bytes=0", ">= 1"),
    ("server.default_max_tokens=0", ">= 1"),
    ("judge.votes=0", ">= 1"),
    ("judge.concurrency=0", ">= 1"),
    ("judge.retries=-1", ">= 0"),
    ("judge.timeout_s=0", "> 0"),
    ("opd.topk=21", "between 0 and 20"),
    ("opd.concurrency=0", ">= 1"),
    ("cluster.tp=0", ">= 1"),
    ("cluster.pp=0", ">= 1"),
    ("cluster.procs_per_node=0", ">= 1"),
    ("cluster.engines=0", ">= 1"),
    ("cluster.bucket_mb=0", ">= 1"),
    ("cluster.timeout_s=0", "> 0"),
    ("cluster.engine_gpus=-1", ">= 0"),
    ("sessions.idle_timeout_s=0", "> 0"),
    ("combine.opd_wait_s=0", "> 0"),
    ("combine.w_rl=-1", ">= 0"),
    ("train.lr=0", "> 0"),
    ("train.kl_coef=-0.1", ">= 0"),
    ("train.grad_clip=-1", ">= 0"),
    ("demo.interactions=0", ">= 1"),
    ("demo.eval_prompts=0", ">= 1"),
])
def test_sizes_counts_and_timeouts_out_of_range_are_refused(override, reason):
    key, value = override.split("=")
    with pytest.raises(ConfigError) as e:
        compose([override])
    # floats show as floats (judge.timeout_s=0.0)
    assert re.fullmatch(rf"{re.escape(key)}={re.escape(value)}(\.0)?: must be {re.escape(reason)}", str(e.value))


@pytest.mark.parametrize("override,fragment", [
    ("train.eps_clip_low=-0.1", "train.eps_clip_low=-0.1: must be >= 0 and < 1"),
    ("train.eps_clip_high=-0.1", "train.eps_clip_high=-0.1: must be >= 0"),
    ("train.dual_clip_c=1.0", "train.dual_clip_c=1.0: must be > 1"),
    ("train.tis_cap=0", "train.tis_cap=0.0: must be > 0"),
    ("train.icepop_band=[0.5]", "must be null or [low, high]"),
    ("train.icepop_band=[1.5,2.0]", "0 < low <= 1 <= high"),
    ("train.icepop_band=[0.5,0.9]", "0 < low <= 1 <= high"),
    ("train.icepop_band=[0,2]", "0 < low <= 1 <= high"),
    ("train.lr=nan", "train.lr=nan: must be a finite number"),
    ("train.entropy_coef=inf", "train.entropy_coef=inf: must be a finite number"),
    ("train.lora.target_modules=[]", "must name at least one module"),
    ("run_dir=''", "run_dir='': must not be empty"),
    ("cluster.ray_address=somewhere", "must be auto, local, host:port or ray://host:port"),
])
def test_loss_knobs_and_other_checks(override, fragment):
    with pytest.raises(ConfigError) as e:
        compose([override])
    assert fragment in str(e.value)


def test_combine_needs_a_nonzero_weight():
    assert compose(["method=combine", "combine.w_opd=0"]).combine.w_opd == 0
    assert compose(["method=rl", "combine.w_rl=0", "combine.w_opd=0"])  # unused outside combine
    with pytest.raises(ConfigError, match="method=combine needs at least one weight > 0"):
        compose(["method=combine", "combine.w_rl=0", "combine.w_opd=0"])


def test_optional_fields_accept_null_and_valid_values():
    cfg = compose(["train.dual_clip_c=null", "train.tis_cap=null", "engine.max_context=null", "engine.threads=2",
                   "train.icepop_band=[0.5,2.0]", "model.path=null", "server.api_key=null"])
    assert cfg.train.dual_clip_c is None and cfg.train.tis_cap is None and cfg.engine.max_context is None
    assert cfg.train.icepop_band == [0.5, 2.0] and cfg.engine.threads == 2


def test_method_and_teacher_are_not_restricted_to_a_list():
    # method is checked where it runs (a future method may be dir/file.py:Class); opd.teacher is a path
    assert compose(["method=methods/mine.py:Mine"]).method == "methods/mine.py:Mine"
    assert compose(["opd.teacher=/models/Qwen3-8B"]).opd.teacher == "/models/Qwen3-8B"


def test_a_bad_value_in_a_yaml_layer_is_refused_and_named(tmp_path):
    layer = tmp_path / "config.yaml"
    layer.write_text("method: rl\nserver:\n  port: 99999\ntrain:\n  stale_policy: dorp\n")
    with pytest.raises(ConfigError) as e:
        compose(yaml_path=str(layer))
    msg = str(e.value)
    assert f"server.port=99999: must be between 0 and 65535 (in {layer})" in msg
    assert "train.stale_policy='dorp': must be one of drop, importance_weight" in msg and "\n" not in msg
    # an override wins over the layer, so fixing both on the command line composes
    cfg = compose(["server.port=8000", "train.stale_policy=drop"], yaml_path=str(layer))
    assert cfg.server.port == 8000


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_recipe_configs_compose(recipe):
    cfg = compose(yaml_path=str(ROOT / recipe))
    assert cfg.method == recipe.split("/")[0].removeprefix("openclaw-")


def test_the_defaults_validate(tmp_path):
    from clawrl.config import ClawrlConfig, ModelConfig, config_problems

    assert config_problems(ClawrlConfig()) == []
    # a model directory without a clawrl.yaml of its own: the dataclass defaults and nothing else
    assert compose([f"model.path={tmp_path}"]) == ClawrlConfig(model=ModelConfig(path=str(tmp_path)))


# --- layers: defaults < the model's own < a recipe's YAML < the command line ----------------------

def _model_dir(tmp_path, yaml_text: str) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "clawrl.yaml").write_text(yaml_text)
    return model


def test_a_value_set_only_in_a_recipe_yaml_takes_effect(tmp_path):
    recipe = tmp_path / "config.yaml"
    recipe.write_text("method: opd\ntrain:\n  max_weight_lag: 7\njudge:\n  votes: 5\n")
    plain, layered = compose(), compose(yaml_path=str(recipe))
    assert (plain.method, plain.train.max_weight_lag, plain.judge.votes) == ("rl", 4, 3)
    assert (layered.method, layered.train.max_weight_lag, layered.judge.votes) == ("opd", 7, 5)


def test_the_opd_recipe_turns_on_top_k_distillation():
    from clawrl.config import OpdConfig

    assert OpdConfig().topk == 0 and compose().opd.topk == 0
    cfg = compose(yaml_path=str(ROOT / "openclaw-opd" / "config.yaml"))
    assert cfg.method == "opd" and cfg.opd.topk == 8
    assert compose(["opd.topk=2"], yaml_path=str(ROOT / "openclaw-opd" / "config.yaml")).opd.topk == 2


@pytest.mark.parametrize("path_from", ["recipe", "command line"])
def test_each_layer_wins_over_the_one_below(tmp_path, path_from):
    """train.lr is set by the model, train.batch_size by the model and the recipe, train.save_every by
    all three: each is the value of the highest layer that sets it. model.path itself may come from
    the recipe or the command line; either way the model's defaults apply."""
    model = _model_dir(tmp_path, "train:\n  lr: 2.0e-5\n  batch_size: 4\n  save_every: 7\n")
    recipe = tmp_path / "config.yaml"
    recipe.write_text((f"model:\n  path: {model}\n" if path_from == "recipe" else "")
                      + "train:\n  batch_size: 16\n  save_every: 9\n")
    cmdline = ["train.save_every=11"] + ([f"model.path={model}"] if path_from == "command line" else [])
    cfg = compose(cmdline, yaml_path=str(recipe))
    assert cfg.model.path == str(model)
    assert cfg.train.keep_last == 3  # no layer sets it: the dataclass default
    assert cfg.train.lr == 2e-5  # the model's defaults win over the dataclass default (1e-5)
    assert cfg.train.batch_size == 16  # the recipe wins over the model's defaults
    assert cfg.train.save_every == 11  # the command line wins over the recipe
    assert compose([f"model.path={model}"]).train.batch_size == 4  # the model's defaults alone


def test_the_embedded_model_has_its_own_defaults_and_composing_never_builds_it(tmp_path, monkeypatch):
    from clawrl.config import EMBEDDED_DEFAULTS, TrainConfig
    from clawrl.embedded import build

    def refuse(*a, **kw):
        raise AssertionError("composition must not build or look up the embedded model")

    monkeypatch.setattr(build, "default_model_path", refuse)
    monkeypatch.setattr(build, "build_model", refuse)
    assert TrainConfig().lr == 1e-5
    assert compose().train.lr == 1e-4 and compose(["model.path=null"]).train.lr == 1e-4
    assert compose().train.kl_coef == 1.0 and TrainConfig().kl_coef == 0.0
    assert compose([f"model.path={tmp_path}"]).train.lr == 1e-5  # another model: not the embedded defaults
    recipe = tmp_path / "config.yaml"
    recipe.write_text("train:\n  lr: 3.0e-5\n")
    assert compose(yaml_path=str(recipe)).train.lr == 3e-5
    assert compose(["train.lr=5e-5"], yaml_path=str(recipe)).train.lr == 5e-5
    # shipped as package data, so an installed clawrl has it too
    assert EMBEDDED_DEFAULTS.relative_to(CORE).as_posix() == "conf/embedded.yaml"
    assert "conf/*.yaml" in re.search(r"package_data=\{\"clawrl\": \[(.*?)\]\}", (ROOT / "setup.py").read_text()).group(1)


def test_the_serve_log_line_says_which_model_defaults_applied_and_why(tmp_path):
    from clawrl.config import EMBEDDED_DEFAULTS, model_defaults_report

    recipe = str(ROOT / "openclaw-rl" / "config.yaml")
    line = model_defaults_report(compose(yaml_path=recipe))
    lr = compose(yaml_path=recipe).train.lr
    assert line.startswith(f"per-model defaults from {EMBEDDED_DEFAULTS} (model.path is null: the embedded tiny model")
    assert f"train.lr={lr}" in line and "replaced" not in line
    assert "is for 1-8B models" in line  # the reason, from the comment above the key in conf/embedded.yaml
    line = model_defaults_report(compose(["train.lr=1e-3"], yaml_path=recipe))
    assert f"train.lr={lr}, replaced by 0.001 from the recipe or command line" in line
    model = _model_dir(tmp_path, "train:\n  # sized for this model\n  lr: 2.0e-5\n  batch_size: 4\n")
    line = model_defaults_report(compose([f"model.path={model}", "train.batch_size=2"]))
    assert line == (f"per-model defaults from {model / 'clawrl.yaml'} (clawrl.yaml in model.path): train.lr=2e-05 "
                    "(sized for this model); train.batch_size=4, replaced by 2 from the recipe or command line")
    line = model_defaults_report(compose([f"model.path={tmp_path}"]))
    assert line.startswith(f"per-model defaults: none ({tmp_path} has no clawrl.yaml)") and "train.lr=1e-05" in line


def test_unknown_keys_in_any_layer_are_refused_with_the_file_named(tmp_path):
    model = _model_dir(tmp_path, "train:\n  lrr: 1.0e-4\n")
    with pytest.raises(ConfigError) as e:
        compose([f"model.path={model}"])
    assert str(e.value).startswith(f"unknown config key 'train.lrr' in {model / 'clawrl.yaml'}; did you mean train.lr")
    recipe = tmp_path / "config.yaml"
    recipe.write_text("opd:\n  top_k: 8\n")
    with pytest.raises(ConfigError, match=rf"^unknown config key 'opd.top_k' in {re.escape(str(recipe))}; "
                                          r"did you mean opd\.topk"):
        compose(yaml_path=str(recipe))
    with pytest.raises(ConfigError, match=r"^unknown config key 'opd.top_k'; did you mean opd\.topk"):
        compose(["opd.top_k=8"])


def test_a_bad_value_in_a_models_defaults_is_named_and_the_model_cannot_choose_itself(tmp_path):
    model = _model_dir(tmp_path, "train:\n  batch_size: 0\n")
    with pytest.raises(ConfigError) as e:
        compose([f"model.path={model}"])
    assert str(e.value) == f"train.batch_size=0: must be >= 1 (in {model / 'clawrl.yaml'})"
    assert compose([f"model.path={model}", "train.batch_size=2"]).train.batch_size == 2
    (model / "clawrl.yaml").write_text(f"model:\n  path: {tmp_path}\n")
    with pytest.raises(ConfigError, match="model.path in .*clawrl.yaml: a model's own defaults cannot choose"):
        compose([f"model.path={model}"])


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_recipe_holds_only_what_differs_from_the_defaults(recipe):
    """A recipe that restates a default hides which settings make the method; method is the one key
    every recipe names (openclaw-rl's equals the default)."""
    from omegaconf import OmegaConf

    from clawrl.config import ClawrlConfig, _get, _leaf_keys

    layer = OmegaConf.load(ROOT / recipe)
    restated = [key for key in _leaf_keys(layer)
                if key != "method" and OmegaConf.select(layer, key) == _get(ClawrlConfig(), key)]
    assert not restated, f"{recipe} restates defaults: {restated}"
    assert layer.method == recipe.split("/")[0].removeprefix("openclaw-")


def test_the_composed_config_is_frozen():
    cfg = compose()
    for section, name, value in ((cfg, "method", "opd"), (cfg.train, "lr", 1.0), (cfg.train.lora, "r", 4),
                                 (cfg.server, "port", 1)):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(section, name, value)
    changed = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, lr=1.0))
    assert changed.train.lr == 1.0 and cfg.train.lr == 1e-4


def test_the_demo_defaults_validate():
    from clawrl.demo.run import DEMO_DEFAULTS

    for method in ("rl", "opd", "combine"):
        compose([*DEMO_DEFAULTS, f"method={method}"])


def test_choices_match_what_core_accepts():
    """Every value core accepts for an enum field is accepted at composition, and nothing else."""
    from clawrl import buffer, engines, judges, metrics
    from clawrl.config import ClawrlConfig, _leaves
    from clawrl.demo.users import USERS
    from clawrl.envs import sandbox
    from clawrl.engines import delta_rule, static_decode
    from clawrl.envs import source as env_source
    from clawrl.envs.swe import env as swe_env
    from clawrl.judges.hints import HINT_KINDS
    from clawrl.losses import AGGREGATION_MODES, GROUP_MODES
    from clawrl.losses.kl import KL_ESTIMATORS
    from clawrl.trainers import base as trainers
    from clawrl.trainers import compiled_layers, torch_trainer
    from clawrl.trainers.objective import TOPK_KL

    core = {
        "engine.backend": engines.BACKENDS, "trainer.backend": trainers.BACKENDS,
        "train.stale_policy": buffer.STALE_POLICIES, "train.baseline": buffer.BASELINES,
        "train.group_advantage": GROUP_MODES, "train.kl_estimator": KL_ESTIMATORS,
        "train.aggregation": AGGREGATION_MODES, "judge.kind": judges.KINDS, "opd.hint_judge": HINT_KINDS,
        "opd.topk_kl": TOPK_KL, "logging.wandb.mode": metrics.WANDB_MODES, "demo.user": tuple(USERS),
        "sandbox.backend": sandbox.BACKEND_CHOICES, "env.sample_mode": env_source.SAMPLE_MODES,
        "env.step_judge": env_source.STEP_JUDGES, "engine.decode_attention": static_decode.ATTENTIONS,
        "train.param_dtype": ("auto", *torch_trainer.PARAM_DTYPES), "env.swe_reward": swe_env.REWARDS,
        "model.linear_attention": delta_rule.CHOICES, "train.compile": compiled_layers.MODES,
        "train.compile_scope": compiled_layers.SCOPES,
    }
    choices = {key: f.metadata["choices"] for key, f in _leaves(ClawrlConfig) if f.metadata.get("choices")}
    for key, accepted in core.items():
        assert set(choices[key]) == set(accepted), key
    assert set(choices) - set(core) == {"model.dtype", "logging.level"}


def test_logging_levels_and_dtypes_match_what_core_accepts():
    import logging

    import torch

    from clawrl.config import DTYPES, LOG_LEVELS, LoggingConfig
    from clawrl.engines.loading import resolve_dtype
    from clawrl.metrics import configure_logging

    for dtype in DTYPES:
        resolve_dtype(dtype, torch.device("cpu"))
    before = logging.getLogger("clawrl").level
    try:
        for level in LOG_LEVELS:
            configure_logging(LoggingConfig(level=level.lower()))
    finally:
        logging.getLogger("clawrl").setLevel(before)


# --- every field explains itself -----------------------------------------------------------------

@pytest.mark.parametrize("key", all_keys())
def test_every_field_has_help_text(key):
    from clawrl.config import field_help

    assert len(field_help(key).strip()) > 5


def test_option_refuses_a_field_without_help():
    from clawrl.config import option

    with pytest.raises(ValueError, match="help text"):
        option(1, "  ")


def test_fields_are_documented_in_metadata_not_comments():
    src = (CORE / "config.py").read_text()
    body = src[src.index("class ModelConfig"):src.index("def _default")]
    assert not re.search(r"^\s+# ", body, re.M), "document a field with option(..., help), not a # comment"


def test_describe_config_lists_every_key_with_type_default_and_help():
    from clawrl.config import describe_config, field_help

    text = describe_config()
    lines = {line.split()[0]: line for line in text.splitlines() if line.strip()}
    for key in all_keys():
        assert key in lines, f"{key} missing from describe_config()"
        assert field_help(key) in lines[key]
    assert re.search(r"^server\.port\s+int\s+30000\s+.*\[between 0 and 65535\]$", text, re.M)
    assert re.search(r"^train\.stale_policy\s+str\s+drop\s+.*\[one of drop, importance_weight\]$", text, re.M)
    assert re.search(r"^engine\.max_context\s+int\|null\s+null\s", text, re.M)
    assert re.search(r"^train\.lora\.target_modules\s+list\[str\]\s+\[q_proj,k_proj,v_proj,o_proj\]\s", text, re.M)


# --- user-facing examples compose ----------------------------------------------------------------

# and directories the text has just written (model.path=E, my-model): a bare name that is no directory
# is refused as an unknown model name
_PLACEHOLDERS = {"N", "M", "DIR", "...", "E", "my-model"}


def _documented_overrides() -> dict[str, str]:
    """Literal ``key=value`` overrides in the docs, READMEs, run.sh scripts and benchmarks."""
    keys = sorted(all_keys(), key=len, reverse=True)
    pattern = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, keys)) + r")=(\[[^\]\s]*\]|[^\s\"'`,;)\]}]+)")
    files = [*ROOT.glob("*.md"), *ROOT.glob("docs/*.md"), *ROOT.glob("*/run.sh"), *ROOT.glob("benchmarks/*.py")]
    found = {}
    for path in files:
        for m in pattern.finditer(path.read_text()):
            value = m.group(2).rstrip(".:")
            if value in _PLACEHOLDERS or any(c in value for c in "{}$%|<>("):
                continue
            found.setdefault(f"{m.group(1)}={value}", str(path.relative_to(ROOT)))
    return found


def test_every_documented_override_composes():
    found = _documented_overrides()
    assert len(found) > 20  # the scan still finds the examples
    refused = []
    for override, where in sorted(found.items()):
        try:
            compose([override])
        except ConfigError as e:
            refused.append(f"{where}: {e}")
    assert not refused, "\n".join(refused)
