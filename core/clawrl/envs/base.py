"""The environment interface: where agentic samples come from.

An environment is a conversation partner with a verdict. ``reset(task)`` opens an episode and
returns the first observation; each ``step(action)`` takes the model's reply (its text, already
decoded from the exact sampled ids, which the rollout keeps; special tokens such as ``<tool_call>``
are kept, the end-of-turn token is not) and returns the next observation,
a reward or None, and whether the episode is ``done`` (the task ended) or ``truncated`` (a limit
cut it short). Observations are chat messages, so the model's chat template renders them like
any other turn; a message may carry images for GUI environments.

Environments are plug-ins: ``env.name`` names a built-in one or a path ``dir/file.py:ClassName``
(``clawrl.envs.loading``). They are async because real ones wait on sandboxes and browsers, and
one process runs many episodes at once on a 2-core machine.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class Observation:
    """What the model sees next: chat messages (``{"role": ..., "content": ...}``), and optional
    images (PNG bytes) for environments that show a screen.

    ``tools`` (OpenAI function schemas, on the first observation) are the tools the agent may call:
    the rollout hands them to the chat template, so every model words its tool section the way it
    was trained to read one rather than in the environment's paraphrase."""

    messages: list[dict]
    images: list[bytes] = field(default_factory=list)
    tools: Optional[list[dict]] = None


@dataclass
class StepOutcome:
    """The environment's answer to one action."""

    observation: Optional[Observation]  # None when the episode is over
    reward: Optional[float] = None  # None: no verdict at this step
    done: bool = False  # the task ended (solved, failed, given up)
    truncated: bool = False  # a limit ended it before the task did
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Task:
    """One task of a task set: its id (stable across runs, so groups and splits are reproducible)
    and whatever the environment needs to set it up."""

    task_id: str
    data: dict[str, Any] = field(default_factory=dict)


class Env(abc.ABC):
    """One episode at a time; make a new instance per concurrent episode (``from_config``)."""

    @classmethod
    def from_config(cls, cfg) -> "Env":
        """A fresh instance for one episode under ``cfg`` (the run's ClawrlConfig). Environments
        that need settings (sandbox limits, say) override this; the default takes none."""
        return cls()

    @abc.abstractmethod
    async def reset(self, task: Task) -> Observation:
        """Start an episode of ``task``; the first observation (e.g. the system and user messages)."""

    @abc.abstractmethod
    async def step(self, action: str) -> StepOutcome:
        """Apply the model's reply and say what follows."""

    async def finish(self) -> Optional["StepOutcome"]:
        """The verdict on an episode the rollout cut short (out of turns) before the environment
        ended it: its reward and info, with no observation. Environments that judge the final state
        (a terminal task's tests) judge it here; None keeps the last reward ``step`` gave."""
        return None

    async def oracle_actions(self) -> Optional[list[str]]:
        """After ``reset``: the replies of an agent that knows the answer, in order, or None when
        the task has no oracle. ``clawrl env check`` plays them to prove a task can be solved."""
        return None

    async def close(self) -> None:
        """Release what the episode holds (processes, sandboxes). Called once, also after errors."""

    @classmethod
    def tasks(cls, split: str) -> list[Task]:
        """The environment's own task set for ``split`` (train, test, ...); environments whose
        tasks come from files load them with ``clawrl.envs.tasks.load_tasks`` instead."""
        raise EnvError(f"{cls.__name__} ships no task set; give one with env.tasks=PATH")


class EnvError(RuntimeError):
    """A bad environment, task set or episode; the message is one line."""
