"""The terminal environment: an agent in a shell, judged by the task's own tests.

One episode is one task directory (Harbor or Terminal-Bench 1.0, ``clawrl.envs.task_formats``) in
its own sandbox (``clawrl.envs.sandbox``): the task's Dockerfile is interpreted on top of the host,
the agent sees the instruction, and each reply's fenced ``bash`` block (or a Qwen/Hermes ``bash`` tool
call, ``BASH_TOOL``: see ``parse_action``) runs in the sandbox, its exit code and output coming back as
the next observation. The agent ends the episode by replying
``DONE``; the turn limit or the task's agent time budget end it too. Then, and only then, the
tests are copied in and run, and their verdict is the reward, so nothing the agent does can read
or edit them.

Reward is the verifier's: Harbor's ``reward.txt``/``reward.json`` or the share of tests passed,
in [0, 1] (OpenClaw-RL's terminal-rl maps the share to 2 x share - 1; an advantage normalised over a
group, as clawrl's are, does not care which).
"""
from __future__ import annotations

import json
import re
import time
from typing import Optional

from clawrl.envs.base import Env, EnvError, Observation, StepOutcome, Task
from clawrl.envs.sandbox import ExecResult, Sandbox, open_sandbox
from clawrl.envs.task_formats import (TerminalTaskSpec, copy_solution, plan_environment, prepare_environment,
                                      spec_of, verify)

SYSTEM_PROMPT = (
    "You are an agent working in a Linux shell with no network. The task's files are in {workdir}, your "
    "working directory. Reply with one ```bash code block holding the commands to run next; you will see "
    "their exit code and output. Each block runs in a fresh shell in {workdir}: variables and background "
    "processes do not carry over, files do. When the task is done, reply with the single word DONE.")
# Most characters of each output stream an observation shows (the tail, where errors are).
OBSERVATION_CHARS = 4000
# The same commands as a tool call, for harnesses that offer the shell as a tool (the embedded model
# learns both spellings; docs/action_formats.md): <tool_call>{"name": "bash", "arguments":
# {"command": "..."}}</tool_call>, or the JSON alone when special tokens were decoded away.
BASH_TOOL = {"type": "function", "function": {
    "name": "bash",
    "description": "Run shell commands in a fresh bash in the working directory and return the exit code and output.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string", "description": "Commands to run"}},
                   "required": ["command"]}}}
_BLOCK = re.compile(r"```[ \t]*(?:bash|sh|shell|console)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_TAGGED_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_BARE_CALL = re.compile(r"\{\s*\"name\"\s*:\s*\"bash\"")
_DONE = re.compile(r"^\W*done\W*$", re.IGNORECASE | re.MULTILINE)


def parse_action(reply: str) -> tuple[Optional[str], bool]:
    """The commands a reply asks to run and whether it says the task is done (a line that is just
    ``DONE``, outside any block or call). Commands are its fenced blocks and its ``bash`` tool calls
    (``BASH_TOOL``: tagged, or bare JSON), in the order they appear, joined by newlines. A call that
    is not valid JSON, names another tool or has no string ``command`` runs nothing: with nothing
    else to run, the reply is malformed and the agent is told so."""
    found: list[tuple[int, str]] = []
    prose = reply
    for m in _TAGGED_CALL.finditer(reply):
        command = _call_command(m.group(1).strip())
        if command is not None:
            found.append((m.start(), command))
        prose = prose[:m.start()] + " " * (m.end() - m.start()) + prose[m.end():]
    for m in _BLOCK.finditer(prose):
        found.append((m.start(), m.group(1).strip("\n")))
    prose = _BLOCK.sub(lambda m: " " * len(m.group(0)), prose)
    for m in _BARE_CALL.finditer(prose):
        try:
            obj, end = json.JSONDecoder().raw_decode(prose, m.start())
        except ValueError:
            continue
        command = _call_command(obj)
        if command is not None:
            found.append((m.start(), command))
        prose = prose[:m.start()] + " " * (end - m.start()) + prose[end:]
    commands = "\n".join(c for _, c in sorted(found) if c.strip()) or None
    return commands, bool(_DONE.search(prose))


def _call_command(call) -> Optional[str]:
    """The ``command`` of a ``bash`` tool call (a JSON string, or a parsed object), else None."""
    if isinstance(call, str):
        try:
            call = json.loads(call)
        except ValueError:
            return None
    if not isinstance(call, dict) or call.get("name") != BASH_TOOL["function"]["name"]:
        return None
    args = call.get("arguments", call.get("parameters"))
    if isinstance(args, str):  # OpenAI's wire format sends the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    command = args.get("command") if isinstance(args, dict) else None
    return command if isinstance(command, str) else None


def malformed(work: str) -> StepOutcome:
    """The step of a reply with neither a bash block nor DONE: the agent is told how to reply, and
    the episode goes on (``work``: what DONE completes, "task" or "fix")."""
    return StepOutcome(Observation([{"role": "user", "content":
        "Your reply had no ```bash code block to run and did not say DONE. Reply with one ```bash "
        f"block of commands, or DONE when the {work} is complete."}]), info={"malformed": True})


def render_result(result: ExecResult) -> str:
    """What the agent sees of one command: the exit code, then each stream's tail."""
    head = f"exit code {result.returncode}"
    if result.timed_out:
        head += f" (killed: the command ran past its time limit, {result.duration_s:.0f} s)"
    parts = [head]
    for name, text in (("stdout", result.stdout), ("stderr", result.stderr)):
        if text:
            if len(text) > OBSERVATION_CHARS:
                text = f"[... {len(text) - OBSERVATION_CHARS} characters cut ...]\n" + text[-OBSERVATION_CHARS:]
            parts.append(f"{name}:\n{text.rstrip()}")
    return "\n".join(parts)


class TerminalEnv(Env):
    """A shell task in a sandbox; ``Task.data["spec"]`` is its ``TerminalTaskSpec``."""

    def __init__(self, sandbox_cfg, exec_timeout_s: float):
        self.sandbox_cfg, self.exec_timeout_s = sandbox_cfg, exec_timeout_s
        self.spec: Optional[TerminalTaskSpec] = None
        self.sandbox: Optional[Sandbox] = None
        self.deadline = 0.0
        self.verdict: Optional[StepOutcome] = None

    @classmethod
    def from_config(cls, cfg) -> "TerminalEnv":
        return cls(cfg.sandbox, cfg.sandbox.exec_timeout_s)

    async def reset(self, task: Task) -> Observation:
        self.spec = spec = spec_of(task)
        plan_environment(spec)  # a task the host cannot run is refused before any sandbox opens
        self.sandbox = open_sandbox(self.sandbox_cfg, cpus=spec.cpus, memory_mb=spec.memory_mb,
                                   network=spec.network)
        await prepare_environment(spec, self.sandbox)
        self.deadline = time.monotonic() + spec.agent_timeout_s
        return Observation([{"role": "system", "content": SYSTEM_PROMPT.format(workdir=self.sandbox.workdir)},
                            {"role": "user", "content": spec.instruction}])

    async def step(self, action: str) -> StepOutcome:
        if self.verdict is not None:
            raise EnvError("the episode is over")
        commands, done = parse_action(action)
        if commands is None and not done:
            return malformed("task")
        if commands is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                return await self._judge("agent_timeout", truncated=True)
            result = await self.sandbox.exec(commands, timeout_s=min(left, self.exec_timeout_s))
            if done:
                return await self._judge("done")
            if time.monotonic() >= self.deadline:
                return await self._judge("agent_timeout", truncated=True)
            return StepOutcome(Observation([{"role": "user", "content": render_result(result)}]))
        return await self._judge("done")

    async def finish(self) -> Optional[StepOutcome]:
        return self.verdict or await self._judge("max_turns", truncated=True)

    async def oracle_actions(self) -> Optional[list[str]]:
        """The oracle is an agent that runs the task's solution, copied in only now (so a model's
        episode never sees it), then says DONE."""
        if self.spec is None or self.spec.solution is None:
            return None
        script = await copy_solution(self.spec, self.sandbox)
        return [f"```bash\nbash {script}\n```", "DONE"]

    async def _judge(self, reason: str, truncated: bool = False) -> StepOutcome:
        verdict = await verify(self.spec, self.sandbox)
        self.verdict = StepOutcome(None, reward=verdict.reward, done=not truncated, truncated=truncated,
                                   info={"success": verdict.success, "reason": reason, "verdict": verdict.detail,
                                         "tests_passed": verdict.passed, "tests_total": verdict.total})
        return self.verdict

    async def close(self) -> None:
        if self.sandbox is not None:
            await self.sandbox.close()
