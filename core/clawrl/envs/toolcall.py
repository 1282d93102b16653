"""The tool-call environment: solve a problem with a Python interpreter, answer in ``\\boxed{}``.

OpenClaw-RL's toolcall-rl (after ReTool): the model may call a ``python`` tool as often as the turn
limit allows and ends the episode with a final answer in ``\\boxed{...}``. The reward is +1 for a
correct answer and -1 for anything else: a wrong answer, or no answer before the turn limit
(``finish``). There is no bonus for well-formed tool use; ``info`` counts calls, failing cells and
malformed replies so that the rate of well-formed tool use can be reported beside the reward.

Replies are read by ``clawrl.envs.tool_calls`` (Qwen-style ``<tool_call>`` JSON, the same without
its tags, or a fenced python block); each call runs as one cell of the episode's persistent
interpreter (``clawrl.envs.python_tool``: state kept across calls by replay), in a sandbox opened
at the first call, so episodes that never call the tool cost no sandbox. A call's output comes back
as a ``tool`` message, which the chat template renders the Qwen way (``<tool_response>`` on the
user side). A malformed reply gets a ``user`` message saying what was wrong.

Tasks are rows (``dataset.toml`` + ``data/<split>.jsonl``; ``toolcall-rl/`` ships a generated
suite): the question from ``question`` (or ``problem``/``prompt``), the answer from ``answer`` (or
``ground_truth``; GSM8K's ``#### N`` tail is taken), and optionally ``solution``, a Python cell
that prints the answer, which only the oracle uses.
"""
from __future__ import annotations

from typing import Optional

from clawrl.envs.answers import answers_match, expected_answer
from clawrl.envs.base import Env, EnvError, Observation, StepOutcome, Task
from clawrl.envs.python_tool import PythonSession, render_cell
from clawrl.envs.sandbox import Sandbox, open_sandbox
from clawrl.envs.tool_calls import TOOL_NAME, format_tool_call, parse_reply

# The most a cell (its replay included) may run; a calculator call needs well under a second.
CELL_TIMEOUT_S = 15.0
# Calls run from one reply; further ones are dropped with a note (verl caps parallel calls too).
MAX_CALLS_PER_REPLY = 4
QUESTION_FIELDS = ("question", "problem", "prompt")
ANSWER_FIELDS = ("answer", "ground_truth")

# The tool reaches the model through the chat template (``Observation.tools``), which words the
# tool section as the model was trained to read it.
PYTHON_TOOL = {"type": "function", "function": {
    "name": TOOL_NAME,
    "description": "Run Python code in a persistent interpreter (variables are kept between calls, as in a "
                   "notebook) and return what it prints; the value of a final expression is shown too.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "Python code to run"}},
                   "required": ["code"]}}}
INSTRUCTIONS = ("Solve the problem. Do not compute in your head: call the python tool to calculate, then give the "
                "final answer as \\boxed{ANSWER}.")


def task_fields(task: Task) -> tuple[str, str]:
    """(question, canonical answer) of a row; EnvError naming what is missing."""
    question = next((task.data[k] for k in QUESTION_FIELDS if isinstance(task.data.get(k), str)), None)
    answer = next((task.data[k] for k in ANSWER_FIELDS if task.data.get(k) not in (None, "")), None)
    if question is None or not question.strip():
        raise EnvError(f"task {task.task_id} has no question (a {' / '.join(QUESTION_FIELDS)} field)")
    if answer is None or not expected_answer(answer):
        raise EnvError(f"task {task.task_id} has no answer (an {' / '.join(ANSWER_FIELDS)} field)")
    return question, expected_answer(answer)


class ToolCallEnv(Env):
    """One problem, a python tool, a boxed answer: +1 right, -1 otherwise."""

    def __init__(self, sandbox_cfg, cell_timeout_s: float = CELL_TIMEOUT_S):
        self.sandbox_cfg, self.cell_timeout_s = sandbox_cfg, cell_timeout_s
        self.sandbox: Optional[Sandbox] = None
        self.session: Optional[PythonSession] = None
        self.task: Optional[Task] = None
        self.expected = ""
        self.verdict: Optional[StepOutcome] = None
        self.counts = {"tool_calls": 0, "tool_errors": 0, "malformed_replies": 0}

    @classmethod
    def from_config(cls, cfg) -> "ToolCallEnv":
        return cls(cfg.sandbox, min(cfg.sandbox.exec_timeout_s, CELL_TIMEOUT_S))

    async def reset(self, task: Task) -> Observation:
        question, self.expected = task_fields(task)
        self.task = task
        return Observation([{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": question}],
                           tools=[PYTHON_TOOL])

    async def step(self, action: str) -> StepOutcome:
        if self.task is None:
            raise EnvError("step before reset")
        if self.verdict is not None:
            raise EnvError("the episode is over")
        reply = parse_reply(action)
        if reply.error is not None:
            self.counts["malformed_replies"] += 1
            return StepOutcome(Observation([{"role": "user", "content":
                f"Your reply was malformed: {reply.error}. Call the tool with <tool_call>\n"
                f"{{\"name\": \"{TOOL_NAME}\", \"arguments\": {{\"code\": \"...\"}}}}\n</tool_call>, "
                f"or give the final answer as \\boxed{{ANSWER}}."}]),
                info={"malformed": True, "error": reply.error, **self.counts})
        if reply.calls:
            return StepOutcome(Observation(await self._run_calls(reply.calls)), info=dict(self.counts))
        return self._judge(reply.answer, "answered")

    async def _run_calls(self, calls: list[str]) -> list[dict]:
        if self.session is None:
            self.sandbox = open_sandbox(self.sandbox_cfg)
            self.session = PythonSession(self.sandbox, self.cell_timeout_s)
        messages = []
        for code in calls[:MAX_CALLS_PER_REPLY]:
            result = await self.session.run(code)
            self.counts["tool_calls"] += 1
            self.counts["tool_errors"] += not result.ok
            messages.append({"role": "tool", "name": TOOL_NAME, "content": render_cell(result, self.cell_timeout_s)})
        if len(calls) > MAX_CALLS_PER_REPLY:
            messages[-1]["content"] += (f"\n[{len(calls) - MAX_CALLS_PER_REPLY} more calls were not run: at most "
                                        f"{MAX_CALLS_PER_REPLY} per reply]")
        return messages

    def _judge(self, answer: Optional[str], reason: str, truncated: bool = False) -> StepOutcome:
        correct = answer is not None and answers_match(answer, self.expected)
        self.verdict = StepOutcome(None, reward=1.0 if correct else -1.0, done=not truncated, truncated=truncated,
                                   info={"success": correct, "reason": reason, "answer": answer,
                                         "expected": self.expected, **self.counts})
        return self.verdict

    async def finish(self) -> Optional[StepOutcome]:
        """Out of turns without a final answer: -1."""
        return self.verdict or self._judge(None, "max_turns", truncated=True)

    async def oracle_actions(self) -> Optional[list[str]]:
        """Compute the answer with one python call (the row's ``solution`` cell, else a cell that
        prints the answer), then box it."""
        if self.task is None:
            return None
        code = self.task.data.get("solution") or f"print({self.expected!r})"
        return [format_tool_call(code), f"The tool computed it. \\boxed{{{self.expected}}}"]

    async def close(self) -> None:
        if self.sandbox is not None:
            await self.sandbox.close()
            self.sandbox = self.session = None
