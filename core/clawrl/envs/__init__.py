"""Where agentic samples come from: environments behind one interface (``clawrl.envs.base.Env``),
their task sets (``clawrl.envs.tasks``), token-exact episodes (``clawrl.envs.rollout``) and GRPO
groups of them (``clawrl.envs.source``).

``env.name`` picks the source of samples: ``chat`` (the default) is the gateway's live sessions; any
other value names an environment class, built in or ``dir/file.py:ClassName``.
"""
from clawrl.envs.base import Env, EnvError, Observation, StepOutcome, Task
from clawrl.envs.gui import GuiEnv
from clawrl.envs.swe.env import SweEnv
from clawrl.envs.terminal import TerminalEnv
from clawrl.envs.toolcall import ToolCallEnv
from clawrl.plugins import plugin_class

CHAT = "chat"
# Built-in environments by name.
ENVS: dict[str, type[Env]] = {"terminal": TerminalEnv, "toolcall": ToolCallEnv, "swe": SweEnv, "gui": GuiEnv}


def env_class(spec: str) -> type[Env]:
    """The environment class ``env.name`` names; a one-line ConfigError otherwise."""
    return plugin_class("env.name", spec, Env, ENVS)


__all__ = ["CHAT", "ENVS", "Env", "EnvError", "Observation", "StepOutcome", "Task", "env_class"]
