"""The agent loop: token-exact multi-turn episodes, their limits, their failures, and the samples
an environment source makes of them.

Most tests drive the loop with a scripted engine over the embedded model's real tokenizer (so the
special tokens, the chat template and the ids are the real ones, and each test takes well under a
second); two run the tiny model itself: a tool-call episode whose sampled ids must survive every
turn, and a per-turn group that trains a step."""
from __future__ import annotations

import asyncio
import itertools
import logging
from pathlib import Path
from typing import Callable, Optional

import pytest
from transformers import AutoTokenizer

from clawrl.config import ConfigError, compose
from clawrl.embedded.tokenizer import render_chat
from clawrl.engines import make_engine
from clawrl.engines.base import ContextLengthExceeded, EngineError, GenerateResult, ModelInfo, SamplingParams
from clawrl.envs import Env, EnvError, Observation, StepOutcome, Task
from clawrl.envs.rollout import run_episode
from clawrl.envs.source import EnvSource, make_env_source
from clawrl.envs.task_formats import discover
from clawrl.envs.terminal import TerminalEnv
from clawrl.envs.toolcall import PYTHON_TOOL, ToolCallEnv
from clawrl.judges.base import Judge, JudgeInput, Verdict, Vote
from clawrl.envs.tool_calls import format_tool_call
from clawrl.trainers.backends import make_trainer
from tests.required_tools import skip_unless_available

REPO = Path(__file__).resolve().parents[1]
TASK = Task("t-1", {"question": "What is 4821 * 397?", "answer": "1913937"})
GUESS_ENV = "tests/guess_number_env.py:GuessNumber"


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


# ----- a scripted engine and two small environments


class Cut(str):
    """A scripted reply the engine stops at the token limit: no end-of-turn token is sampled."""


class ScriptedEngine:
    """'Samples' the replies ``script(rollout, turn)`` names, tokenised as a model emits them (the
    text's ids, then ``<|im_end|>`` unless the reply is a ``Cut``), at most ``max_new_tokens`` of
    them. Rollouts are told apart by their sampling seed, numbered in order of first request. Every
    prompt and budget is kept; ``delay(turn)`` seconds pass before a reply."""

    def __init__(self, tok, script: Callable[[int, int], str], delay: Callable[[int], float] = lambda turn: 0.0,
                 max_context: Optional[int] = None):
        self.tok, self.script, self.delay, self.max_context = tok, script, delay, max_context
        self.rollouts: dict = {}
        self.prompts: dict[int, list[list[int]]] = {}
        self.budgets: dict[int, list[int]] = {}
        self.samples: dict[int, list[list[int]]] = {}

    async def generate(self, prompt_ids, params):
        rollout = self.rollouts.setdefault(params.seed, len(self.rollouts))
        if self.max_context is not None and len(prompt_ids) + params.max_new_tokens > self.max_context:
            raise ContextLengthExceeded(len(prompt_ids), params.max_new_tokens, self.max_context)
        turn = len(self.prompts.setdefault(rollout, []))
        self.prompts[rollout].append(list(prompt_ids))
        self.budgets.setdefault(rollout, []).append(params.max_new_tokens)
        await asyncio.sleep(self.delay(turn))
        text = self.script(rollout, turn)
        ids = self.tok(str(text), add_special_tokens=False)["input_ids"]
        ids = ids if isinstance(text, Cut) else ids + [self.tok.eos_token_id]
        finish = "length" if len(ids) > params.max_new_tokens or isinstance(text, Cut) else "stop"
        ids = ids[:params.max_new_tokens]
        self.samples.setdefault(rollout, []).append(ids)
        # distinct logprobs and the turn as the weight version, so misplaced ones show
        return GenerateResult(request_id=f"{rollout}-{turn}", prompt_ids=list(prompt_ids), token_ids=ids,
                              logprobs=[-(turn + 1) - i / 1000 for i in range(len(ids))],
                              weight_versions=[turn] * len(ids), finish_reason=finish)


def run(engine, env, params=SamplingParams(max_new_tokens=64, seed=0), max_turns=4, task=TASK, **limits):
    return asyncio.run(run_episode(engine, engine.tok, env, task, params, max_turns, **limits))


class ShellLike(Env):
    """Terminal-like: each reply's ```bash block 'runs' (its output is the command echoed back),
    DONE ends the episode with ``reward``; a reply with neither is malformed. ``fail`` names a
    call (reset, step, finish, close) that raises, ``hang`` one that never returns."""

    def __init__(self, reward: float = 1.0, fail: str = "", hang: str = "", label: str = ""):
        self.reward, self.fail, self.hang, self.label = reward, fail, hang, label
        self.seen: list[str] = []
        self.finished = self.closed = False

    async def _call(self, name: str) -> None:
        if self.fail == name:
            raise RuntimeError(f"{name} exploded\nsecond line")
        if self.hang == name:
            await asyncio.sleep(60)

    async def reset(self, task):
        await self._call("reset")
        return Observation([{"role": "system", "content": "You are in a shell."},
                            {"role": "user", "content": "List the files, then say DONE."}])

    async def step(self, action):
        await self._call("step")
        self.seen.append(action)
        if action.strip() == "DONE":
            return StepOutcome(None, reward=self.reward, done=True, info={"reason": "done", "label": self.label})
        if "```bash\n" not in action:
            return StepOutcome(Observation([{"role": "user", "content": "No ```bash block and no DONE."}]),
                               info={"malformed": True})
        command = action.split("```bash\n", 1)[1].split("```", 1)[0].strip()
        return StepOutcome(Observation([{"role": "user", "content": f"exit code 0\nstdout:\n{command}"}]),
                           reward=0.0)

    async def finish(self):
        await self._call("finish")
        self.finished = True
        return StepOutcome(None, reward=0.25, truncated=True, info={"reason": "judged at finish", "label": self.label})

    async def close(self):
        self.closed = True
        await self._call("close")


def assert_token_exact(engine, rollout: int, episode) -> None:
    """Each turn's prompt is the previous one, the ids sampled there unchanged, and what came
    between; the episode's ids and mask say the same."""
    prompts, sampled = engine.prompts[rollout], engine.samples[rollout]
    assert episode.sampled == sampled[:episode.turns] and prompts[0] == episode.prompt_ids
    for k in range(1, episode.turns):
        assert prompts[k][:len(prompts[k - 1])] == prompts[k - 1]
        assert prompts[k][len(prompts[k - 1]):len(prompts[k - 1]) + len(sampled[k - 1])] == sampled[k - 1]
    for k, ids in enumerate(sampled[:episode.turns]):  # no sampled id changes in any later prompt
        start = len(prompts[k])
        for later in prompts[k + 1:]:
            assert later[start:start + len(ids)] == ids
    trained = [t for t, m in zip(episode.response_ids, episode.loss_mask) if m]
    assert trained == [t for ids in sampled[:episode.turns] for t in ids]
    assert episode.loss_mask[-1] == 1  # it ends with the model's reply, never an unanswered observation
    contexts = episode.turn_contexts()
    assert [c for c, _, _ in contexts] == prompts[:episode.turns]
    assert [episode.response_ids[s:e] for _, s, e in contexts] == sampled[:episode.turns]


# ----- tokens


def test_a_shell_episode_keeps_every_sampled_id_and_masks_what_came_between(tok):
    replies = ["Let me look.\n```bash\nls -la\n```", Cut("```bash\ncat notes.txt"), "DONE"]
    engine = ScriptedEngine(tok, lambda r, t: replies[t])
    env = ShellLike()
    episode = run(engine, env, max_turns=5)
    assert (episode.turns, episode.done, episode.truncated, episode.reward) == (3, True, False, 1.0)
    assert episode.reason == "done"
    assert_token_exact(engine, 0, episode)
    # the environment read each reply less the end-of-turn token
    assert env.seen == ["Let me look.\n```bash\nls -la\n```", "```bash\ncat notes.txt", "DONE"]
    first_gap = engine.prompts[0][1][len(engine.prompts[0][0]) + len(engine.samples[0][0]):]
    assert tok.decode(first_gap) == ("\n<|im_start|>user\nexit code 0\nstdout:\nls -la<|im_end|>\n"
                                     "<|im_start|>assistant\n")
    # a reply cut at the token limit sampled no <|im_end|>: the template's one comes in between, masked
    second_gap = engine.prompts[0][2][len(engine.prompts[0][1]) + len(engine.samples[0][1]):]
    assert tok.decode(second_gap).startswith("<|im_end|>\n<|im_start|>user\n")
    # in-between tokens carry logprob 0 and the version of the turn before
    between = [(lp, v) for lp, v, m in zip(episode.logprobs, episode.weight_versions, episode.loss_mask) if not m]
    assert between and {lp for lp, _ in between} == {0.0} and {v for _, v in between} == {0, 1}
    assert [lp for lp, m in zip(episode.logprobs, episode.loss_mask) if m][0] == -1.0
    assert env.closed


def test_tool_call_tags_reach_the_environment_and_the_tools_are_the_templates_own(tok, tmp_path):
    skip_unless_available("bwrap")
    call = format_tool_call("x = 4821 * 397\nprint(x)")
    replies = ["I will compute it.\n" + call, format_tool_call("print(x + 1)"), "So it is \\boxed{1913937}."]
    engine = ScriptedEngine(tok, lambda r, t: replies[t])
    env = ToolCallEnv(compose([f"sandbox.root={tmp_path}"]).sandbox)
    episode = run(engine, env)
    assert (episode.reward, episode.turns, episode.info["tool_calls"], episode.info["tool_errors"]) == (1.0, 3, 2, 0)
    assert episode.transcript[2] == {"role": "assistant", "content": "I will compute it.\n" + call}
    assert_token_exact(engine, 0, episode)
    # the tool section in the first prompt is what the template renders for tools=[PYTHON_TOOL]
    assert tok.decode(episode.prompt_ids) == render_chat(episode.transcript[:2], tools=[PYTHON_TOOL],
                                                        add_generation_prompt=True)
    second = engine.prompts[0][1]
    assert tok.decode(second[len(engine.prompts[0][0]) + len(engine.samples[0][0]):]) == (
        "\n<|im_start|>user\n<tool_response>\n1913937\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_a_real_terminal_task_played_through_the_token_loop_keeps_its_ids_and_its_verdict(tok, tmp_path):
    skip_unless_available("bwrap")
    [record] = discover(REPO / "terminal-rl" / "tasks" / "text-word-frequency")
    solve = (REPO / "terminal-rl" / "tasks" / "text-word-frequency" / "solution" / "solve.sh").read_text()
    replies = ["```bash\nls /app\n```", "```bash\n" + solve + "```", "DONE"]
    engine = ScriptedEngine(tok, lambda r, t: replies[t])
    env = TerminalEnv.from_config(compose([f"sandbox.root={tmp_path}"]))
    episode = run(engine, env, params=SamplingParams(max_new_tokens=512, seed=0), task=record.task, max_turns=4)
    assert (episode.turns, episode.done, episode.reward, episode.info["success"]) == (3, True, 1.0, True)
    assert "book.txt" in episode.transcript[3]["content"] and episode.transcript[3]["content"].startswith("exit code 0")
    assert_token_exact(engine, 0, episode)


# A template that, like Qwen3's, drops the thinking of assistant turns before the last user message:
# an earlier turn renders differently once an observation follows it.
FORGETFUL_TEMPLATE = r"""{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
{%- set content = m.content -%}
{%- if m.role == 'assistant' and loop.index0 < ns.last_user and '</think>' in content -%}
{%- set content = content.split('</think>')[-1].lstrip('\n') -%}
{%- endif -%}
{{ '<|im_start|>' + m.role + '\n' + content + '<|im_end|>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"""


def test_a_template_that_rewrites_earlier_turns_still_gets_exact_tokens(tiny_model_dir):
    forgetful = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    forgetful.chat_template = FORGETFUL_TEMPLATE
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>hm</think>a"}]
    before = forgetful.apply_chat_template(history, tokenize=False)
    after = forgetful.apply_chat_template(history + [{"role": "user", "content": "r"}], tokenize=False)
    assert not after.startswith(before)  # so a diff of two renders could not work here
    replies = ["<think>first I list</think>```bash\nls\n```", "<think>now cat</think>```bash\ncat a\n```", "DONE"]
    engine = ScriptedEngine(forgetful, lambda r, t: replies[t])
    episode = run(engine, ShellLike())
    assert (episode.turns, episode.reward) == (3, 1.0)
    assert_token_exact(engine, 0, episode)
    gap = engine.prompts[0][2][len(engine.prompts[0][1]) + len(engine.samples[0][1]):]
    assert forgetful.decode(gap) == "\n<|im_start|>user\nexit code 0\nstdout:\ncat a<|im_end|>\n<|im_start|>assistant\n"


# ----- limits


def test_the_turn_limit_truncates_and_the_environment_judges_the_final_state(tok):
    engine = ScriptedEngine(tok, lambda r, t: "```bash\nls\n```")
    env = ShellLike()
    episode = run(engine, env, max_turns=2)
    assert (episode.turns, episode.truncated, episode.done, episode.reason, episode.reward) == (2, True, False,
                                                                                               "max_turns", 0.25)
    assert env.finished and episode.info["reason"] == "judged at finish" and not episode.failed
    assert_token_exact(engine, 0, episode)


LONG_REPLY = "```bash\necho " + "word " * 10 + "\n```"


def second_prompt_length(tok) -> int:
    """How long the second turn's prompt of a ShellLike episode of LONG_REPLY turns is."""
    engine = ScriptedEngine(tok, lambda r, t: LONG_REPLY)
    run(engine, ShellLike(), max_turns=2)
    return len(engine.prompts[0][1])


def test_the_total_token_cap_shrinks_the_last_turn_and_truncates(tok):
    cap = second_prompt_length(tok) + 10
    engine = ScriptedEngine(tok, lambda r, t: LONG_REPLY)
    episode = run(engine, ShellLike(), params=SamplingParams(max_new_tokens=30, seed=0), max_turns=6,
                  max_total_tokens=cap)
    assert (episode.truncated, episode.reason, episode.reward, episode.turns) == (True, "max_total_tokens", 0.25, 2)
    assert engine.budgets[0] == [30, 10]  # the last turn got only what was left
    assert len(episode.prompt_ids) + len(episode.response_ids) == cap  # the observation after it did not fit
    assert episode.loss_mask[-1] == 1
    assert_token_exact(engine, 0, episode)


def test_a_full_context_window_truncates_instead_of_failing(tok):
    window = second_prompt_length(tok) + 10
    engine = ScriptedEngine(tok, lambda r, t: LONG_REPLY, max_context=window)
    episode = run(engine, ShellLike(), params=SamplingParams(max_new_tokens=30, seed=0), max_turns=6)
    assert (episode.truncated, episode.reason, episode.turns, episode.failed) == (True, "context_length", 2, False)
    assert engine.budgets[0] == [30, 10] and len(episode.prompt_ids) + len(episode.response_ids) == window


def test_a_slow_model_turn_past_the_time_limit_truncates_and_the_verdict_still_comes(tok):
    engine = ScriptedEngine(tok, lambda r, t: "```bash\nls\n```", delay=lambda turn: 5.0 if turn == 1 else 0.0)
    env = ShellLike()
    episode = run(engine, env, timeout_s=0.5)
    assert (episode.turns, episode.truncated, episode.reason, episode.reward) == (1, True, "episode_timeout", 0.25)
    assert env.finished and env.closed and not episode.failed
    assert episode.loss_mask[-1] == 1 and len(engine.prompts[0]) == 2  # the cut turn left nothing behind


def test_an_episode_the_time_limit_ends_before_any_reply_counts_as_failed(tok):
    env = ShellLike()
    episode = run(ScriptedEngine(tok, lambda r, t: "DONE", delay=lambda turn: 5.0), env, timeout_s=0.3)
    assert episode.failed and episode.error == "episode_timeout ended the episode before the model's first reply"
    assert episode.turns == 0 and not env.finished and env.closed  # nothing was done to judge


@pytest.mark.parametrize("where", ["reset", "step", "finish"])
def test_an_environment_call_past_the_time_limit_fails_the_episode(tok, where):
    engine = ScriptedEngine(tok, lambda r, t: "```bash\nls\n```")
    env = ShellLike(hang=where)
    episode = run(engine, env, max_turns=2, timeout_s=0.3)
    assert episode.failed and episode.reason == "failed" and env.closed
    assert episode.error == f"timeout: env.{where} ran past env.episode_timeout_s (0.3 s)"


def test_a_malformed_reply_is_told_what_was_wrong_and_counted(tok):
    replies = ["I would list the files.", "```bash\nls\n```", "DONE"]
    engine = ScriptedEngine(tok, lambda r, t: replies[t])
    episode = run(engine, ShellLike())
    assert (episode.malformed, episode.turns, episode.reward) == (1, 3, 1.0)
    assert episode.transcript[3] == {"role": "user", "content": "No ```bash block and no DONE."}


# ----- failures


@pytest.mark.parametrize("where", ["reset", "step", "finish"])
def test_an_environment_that_raises_fails_its_episode_with_the_reason(tok, where):
    engine = ScriptedEngine(tok, lambda r, t: "```bash\nls\n```")
    env = ShellLike(fail=where)
    episode = run(engine, env, max_turns=2)
    assert episode.failed and env.closed
    assert episode.error == f"env.{where} raised RuntimeError: {where} exploded"


class Answers(Env):
    """Answers every reply with ``outcome``, whatever it is."""

    def __init__(self, outcome):
        self.outcome = outcome

    async def reset(self, task):
        return Observation([{"role": "user", "content": "Say anything."}])

    async def step(self, action):
        return self.outcome


@pytest.mark.parametrize("outcome, why", [
    (None, "env.step returned NoneType, not a StepOutcome"),
    (StepOutcome(None, reward=float("nan"), done=True), "env.step gave the reward nan, not a finite number"),
    (StepOutcome(None, reward="high", done=True), "env.step gave the reward 'high', not a number"),
    (StepOutcome({"role": "user", "content": "hi"}), "env.step gave a dict observation, not an Observation"),
    (StepOutcome(None, reward=1.0, done=True, info=["solved"]), "env.step gave info as a list, not a dict"),
])
def test_an_environment_answering_nonsense_fails_its_episode(tok, outcome, why):
    # a NaN reward would otherwise poison its group's statistics; None would crash the loop
    episode = run(ScriptedEngine(tok, lambda r, t: "hello"), Answers(outcome))
    assert episode.failed and episode.error == why and episode.turns == 1


def test_a_failing_close_is_logged_and_the_episode_stands(tok, caplog):
    engine = ScriptedEngine(tok, lambda r, t: "DONE")
    with caplog.at_level(logging.WARNING, logger="clawrl.envs.rollout"):
        episode = run(engine, ShellLike(fail="close"))
    assert not episode.failed and episode.reward == 1.0
    assert episode.info["close_error"] == "env.close raised RuntimeError: close exploded"
    assert "close exploded" in caplog.text


def test_an_aborted_engine_request_fails_the_episode(tok):
    class Aborting(ScriptedEngine):
        async def generate(self, prompt_ids, params):
            return GenerateResult("r", list(prompt_ids), [], [], [], "abort")

    episode = run(Aborting(tok, lambda r, t: ""), ShellLike())
    assert episode.failed and "aborted" in episode.error


def test_a_cancelled_episode_still_closes_its_environment(tok):
    env = ShellLike()
    engine = ScriptedEngine(tok, lambda r, t: "```bash\nls\n```", delay=lambda turn: 5.0 if turn == 1 else 0.0)

    async def go():
        episode = asyncio.ensure_future(run_episode(engine, tok, env, TASK, SamplingParams(seed=0), 4))
        while len(engine.prompts.get(0, [])) < 2:  # the second turn is being sampled
            await asyncio.sleep(0.01)
        episode.cancel()
        with pytest.raises(asyncio.CancelledError):
            await episode

    asyncio.run(go())
    assert env.closed and not env.finished  # a shutdown is not a verdict


def test_bad_limits_are_refused_in_one_line(tok):
    engine = ScriptedEngine(tok, lambda r, t: "DONE")
    for limits, why in (({"max_total_tokens": 1}, "max_total_tokens must be >= 2"),
                        ({"timeout_s": 0}, "timeout_s must be > 0")):
        with pytest.raises(EnvError, match=why):
            run(engine, ShellLike(), **limits)


# ----- groups and samples


def source_of(tok, envs: list[Env], script, group_size: int, **kw) -> tuple[EnvSource, ScriptedEngine]:
    engine = ScriptedEngine(tok, script)
    made = iter(envs)
    source = EnvSource(lambda: next(made), [TASK], engine, tok, group_size,
                       SamplingParams(max_new_tokens=32, temperature=0.7, seed=0), max_turns=4, **kw)
    return source, engine


def shell_script(rollout: int, turn: int) -> str:
    return ["```bash\nls\n```", "```bash\npwd\n```", "DONE"][turn]


def test_per_turn_samples_carry_each_turns_exact_context_and_the_episodes_advantage(tok):
    envs = [ShellLike(reward=1.0, label="a"), ShellLike(reward=0.0, label="b")]
    source, engine = source_of(tok, envs, shell_script, 2, sample_mode="per_turn")
    episodes, samples = asyncio.run(source.next_group())
    assert [e.turns for e in episodes] == [3, 3] and len(samples) == 6
    assert len({s.group_id for s in samples}) == 1 and len({s.sample_id for s in samples}) == 6
    for k, e in enumerate(episodes):
        rollout = k  # rollouts start in order, and all of them see the same prompts here
        turn_samples = samples[3 * k:3 * k + 3]
        assert [s.turn_id for s in turn_samples] == [0, 1, 2]
        assert [s.prompt_ids for s in turn_samples] == engine.prompts[rollout]
        assert [s.response_ids for s in turn_samples] == engine.samples[rollout]
        assert all(s.loss_mask == [1] * len(s.response_ids) for s in turn_samples)
        assert [s.rollout_logprobs[0] for s in turn_samples] == [-1.0, -2.0, -3.0]
        assert [s.weight_versions for s in turn_samples] == [[t] * len(s.response_ids)
                                                           for t, s in enumerate(turn_samples)]
        assert {s.advantage for s in turn_samples} == {turn_samples[0].advantage} and turn_samples[0].advantage
        assert all(s.reward == e.reward and s.extra["temperature"] == 0.7 for s in turn_samples)
    assert samples[0].advantage == pytest.approx(-samples[3].advantage) and samples[0].advantage > 0


def test_a_turn_that_sampled_nothing_makes_no_per_turn_sample(tok):
    def script(rollout, turn):
        return [Cut(""), "DONE"][turn] if rollout == 0 else "DONE"

    source, _ = source_of(tok, [ShellLike(reward=0.0), ShellLike(reward=1.0)], script, 2, sample_mode="per_turn")
    episodes, samples = asyncio.run(source.next_group())
    assert [e.turns for e in episodes] == [2, 1] and episodes[0].sampled[0] == []
    assert [s.turn_id for s in samples] == [1, 0] and all(s.response_ids for s in samples)


def test_a_trajectory_sample_is_the_whole_episode_with_the_mask_on_sampled_ids(tok):
    envs = [ShellLike(reward=1.0), ShellLike(reward=0.0)]
    source, engine = source_of(tok, envs, shell_script, 2)
    episodes, samples = asyncio.run(source.next_group())
    assert len(samples) == 2 and [s.turn_id for s in samples] == [0, 0]
    for k, (e, s) in enumerate(zip(episodes, samples)):
        assert s.prompt_ids == e.prompt_ids and s.response_ids == e.response_ids and s.loss_mask == e.loss_mask
        assert s.rollout_logprobs == e.logprobs and s.weight_versions == e.weight_versions
        # the whole trajectory holds the last turn's context, then that turn's sampled ids
        assert s.prompt_ids + s.response_ids == engine.prompts[k][-1] + engine.samples[k][-1]
        assert sum(s.loss_mask) == sum(len(ids) for ids in e.sampled) == sum(map(len, engine.samples[k]))


def test_failed_episodes_are_left_out_of_the_group_statistics(tok, caplog):
    envs = [ShellLike(reward=1.0), ShellLike(fail="step"), ShellLike(reward=0.0)]
    source, _ = source_of(tok, envs, shell_script, 3)
    with caplog.at_level(logging.INFO, logger="clawrl.envs.source"):
        episodes, samples = asyncio.run(source.next_group())
    assert [e.failed for e in episodes] == [False, True, False]
    assert [s.reward for s in samples] == [1.0, 0.0]  # the two healthy ones, compared with each other only
    assert samples[0].advantage == pytest.approx(-samples[1].advantage) == pytest.approx(0.7071, abs=1e-3)
    assert source.counters["failed"] == 1 and source.counters["episodes"] == 3
    assert "env.step raised RuntimeError: step exploded" in caplog.text and "'failed': 1" in caplog.text


def test_a_group_with_fewer_than_two_healthy_episodes_yields_nothing(tok, caplog):
    def unmakeable():
        raise ValueError("no sandbox today")

    envs = [ShellLike(reward=1.0), ShellLike(fail="reset")]
    source, _ = source_of(tok, envs, shell_script, 3)
    made = iter(envs + [None])
    source.new_env = lambda: next(made) or unmakeable()
    with caplog.at_level(logging.WARNING, logger="clawrl.envs.source"):
        episodes, samples = asyncio.run(source.next_group())
    assert samples == [] and [e.failed for e in episodes] == [False, True, True]
    assert episodes[2].error == "making the environment raised ValueError: no sandbox today"
    assert source.counters["groups_too_few_healthy"] == 1 and source.counters["groups_kept"] == 0
    assert "1 of 3 episodes are healthy" in caplog.text


def test_a_group_whose_rewards_are_all_equal_is_filtered_and_counted(tok, caplog):
    envs = [ShellLike(reward=1.0), ShellLike(reward=1.0), ShellLike(fail="step"), ShellLike(reward=1.0)]
    source, _ = source_of(tok, envs, lambda r, t: "DONE", 4)
    with caplog.at_level(logging.INFO, logger="clawrl.envs.source"):
        episodes, samples = asyncio.run(source.next_group())
    assert samples == [] and [e.reward for e in episodes if not e.failed] == [1.0, 1.0, 1.0]
    assert source.counters["groups_filtered_equal"] == 1 and source.counters["groups"] == 1
    assert "every reward is 1" in caplog.text


def test_groups_of_one_train_on_their_own_reward_and_a_failed_one_yields_nothing(tok):
    source, _ = source_of(tok, [ShellLike(reward=0.5), ShellLike(fail="step")], shell_script, 1)
    _, samples = asyncio.run(source.next_group())
    assert [(s.reward, s.advantage) for s in samples] == [(0.5, 0.5)]  # no peers: A = r (as live chat)
    episodes, samples = asyncio.run(source.next_group())
    assert samples == [] and episodes[0].failed and source.counters["failed"] == 1


def test_an_engine_failure_is_raised_not_blamed_on_the_environment(tok):
    class Broken(ScriptedEngine):
        async def generate(self, prompt_ids, params):
            raise EngineError("the engine is shut down")

    envs = [ShellLike(), ShellLike()]
    source = EnvSource(lambda: envs.pop(), [TASK], Broken(tok, shell_script), tok, 2, SamplingParams(), 2)
    made = list(envs)
    with pytest.raises(EngineError, match="shut down"):
        asyncio.run(source.next_group())
    assert all(env.closed for env in made) and source.counters["failed"] == 0


def test_truncations_and_malformed_replies_are_counted_by_reason(tok):
    envs = [ShellLike(reward=1.0), ShellLike(reward=0.0)]
    def script(rollout, turn):
        return ["no block here", "```bash\nls\n```", "DONE"][turn] if rollout == 0 else "```bash\nls\n```"

    source, _ = source_of(tok, envs, script, 2)
    episodes, samples = asyncio.run(source.next_group())
    assert [e.reason for e in episodes] == ["done", "max_turns"] and len(samples) == 2
    c = source.counters
    assert (c["truncated"], c["truncated:max_turns"], c["malformed_replies"], c["turns"]) == (1, 1, 1, 7)


def test_the_config_picks_the_sample_mode_and_the_limits(tiny_model_dir):
    cfg = compose([f"model.path={tiny_model_dir}", f"env.name={GUESS_ENV}", "env.sample_mode=per_turn",
                   "env.max_total_tokens=300", "env.episode_timeout_s=12.5"])

    class NoEngine:
        tokenizer = None

    source = make_env_source(cfg, NoEngine())
    assert (source.sample_mode, source.max_total_tokens, source.episode_timeout_s) == ("per_turn", 300, 12.5)
    with pytest.raises(ConfigError, match="sample_mode"):
        compose(["env.sample_mode=per_episode"])
    with pytest.raises(EnvError, match="env.sample_mode must be one of trajectory, per_turn"):
        EnvSource(ShellLike, [TASK], NoEngine(), None, 2, SamplingParams(), 2, sample_mode="per_step")


# ----- per-step scores


class StepRules(Judge):
    """Scores a step by its reply: +1 for ls, -1 for pwd; garbage otherwise; raises on 'boom'."""

    kind = "step-rules"

    def __init__(self):
        self.seen: list[JudgeInput] = []

    async def judge(self, item):
        self.seen.append(item)
        if "boom" in item.reply:
            raise RuntimeError("judge down")
        score = 1 if "ls" in item.reply else -1 if "pwd" in item.reply else None
        return Verdict(score or 0, [Vote(score, "rule")], self.kind)


def test_step_scores_shift_each_turns_advantage_by_the_weight(tok):
    judge = StepRules()
    envs = [ShellLike(reward=1.0), ShellLike(reward=0.0)]
    source, _ = source_of(tok, envs, shell_script, 2, sample_mode="per_turn", step_judge=judge,
                          step_score_weight=0.5)
    episodes, samples = asyncio.run(source.next_group())
    assert [e.step_scores for e in episodes] == [[1, -1, None]] * 2  # DONE has no next state to judge
    base = [samples[0].advantage, samples[3].advantage]
    assert base[0] == pytest.approx(0.7071 + 0.5, abs=1e-3) and base[1] == pytest.approx(-0.7071 + 0.5, abs=1e-3)
    assert [s.advantage - samples[3 * (k // 3) + 2].advantage for k, s in enumerate(samples)] == \
        pytest.approx([0.5, -0.5, 0.0] * 2)
    assert [s.extra.get("step_score") for s in samples] == [1, -1, None] * 2
    # the judge saw the reply and the observation after it, with the task as the request
    first = judge.seen[0]
    assert first.request == "List the files, then say DONE." and first.reply == "```bash\nls\n```"
    assert first.next_state == [{"role": "user", "content": "exit code 0\nstdout:\nls"}]
    assert source.counters["steps_judged"] == 4


def test_a_failing_step_judge_costs_the_score_not_the_episode(tok, caplog):
    engine = ScriptedEngine(tok, lambda r, t: ["```bash\necho boom\n```", "```bash\nfoo\n```", "DONE"][t])
    with caplog.at_level(logging.WARNING, logger="clawrl.envs.rollout"):
        episode = asyncio.run(run_episode(engine, tok, ShellLike(), TASK, SamplingParams(max_new_tokens=64, seed=0), 4,
                                          step_judge=StepRules()))
    assert not episode.failed and episode.reward == 1.0 and episode.step_scores == [None, None, None]
    assert "the step judge failed on turn 0: RuntimeError: judge down" in caplog.text


def test_step_scores_need_per_turn_samples(tok):
    with pytest.raises(EnvError, match="use it with env.sample_mode=per_turn"):
        source_of(tok, [], shell_script, 2, step_judge=StepRules())


class GuessAndJudge:
    """The policy guesses 7 (rollouts with an odd seed) or 50; as the PRM judge it votes -1 when the
    next state says 'lower', else +1. One engine for both, as make_env_source wires it."""

    def __init__(self, tok):
        self.tokenizer, self.judge_prompts = tok, []

    def model_info(self):
        return ModelInfo("scripted", "", "", len(self.tokenizer), 4096, [self.tokenizer.eos_token_id], 0, "cpu",
                         "float32")

    async def generate(self, prompt_ids, params):
        text = self.tokenizer.decode(prompt_ids)
        if "## Next state" in text:
            self.judge_prompts.append(text)
            reply = "It went the wrong way. Score: -1" if "lower" in text.split("## Next state")[1] else "Score: +1"
        else:
            reply = "7" if params.seed % 2 else "50"
        ids = self.tokenizer(reply, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return GenerateResult("r", list(prompt_ids), ids, [-0.5] * len(ids), [0] * len(ids), "stop")


def test_the_prm_judge_scores_steps_through_make_env_source(tok, tiny_model_dir):
    cfg = compose([f"model.path={tiny_model_dir}", f"env.name={GUESS_ENV}", "env.sample_mode=per_turn",
                   "env.step_judge=prm", "env.step_score_weight=0.25", "judge.votes=3", "env.group_size=2",
                   "env.max_turns=2"])
    engine = GuessAndJudge(tok)
    source = make_env_source(cfg, engine)
    assert source.step_judge.votes == 3 and source.step_score_weight == 0.25
    episodes, samples = asyncio.run(source.next_group())
    by_turns = sorted(episodes, key=lambda e: e.turns)
    assert [e.turns for e in by_turns] == [1, 2] and by_turns[0].reward == 1.0
    assert by_turns[1].step_scores == [-1, -1]  # "No, lower." twice, three votes each
    assert len(engine.judge_prompts) == 2 * 3 and "## User request\nGuess my number" in engine.judge_prompts[0]
    losing = [s for s in samples if s.reward < 1.0]
    assert [s.extra["step_score"] for s in losing] == [-1, -1]
    winner = next(s for s in samples if s.reward == 1.0)
    assert [s.advantage for s in losing] == pytest.approx([-winner.advantage - 0.25] * 2)


# ----- with the tiny model


class RecordingEngine:
    """The real engine, each prompt and sampled reply kept per rollout (by sampling seed)."""

    def __init__(self, engine):
        self.engine, self.rollouts, self.prompts, self.samples = engine, {}, {}, {}

    async def generate(self, prompt_ids, params):
        rollout = self.rollouts.setdefault(params.seed, len(self.rollouts))
        self.prompts.setdefault(rollout, []).append(list(prompt_ids))
        result = await self.engine.generate(prompt_ids, params)
        self.samples.setdefault(rollout, []).append(list(result.token_ids))
        return result


def test_the_tiny_model_in_a_tool_call_episode_never_sees_its_ids_change(tiny_model_dir, tmp_path):
    skip_unless_available("bwrap")  # a reply may be a well-formed call, which opens the sandbox
    cfg = compose([f"model.path={tiny_model_dir}", "engine.threads=1", f"sandbox.root={tmp_path}"])
    engine = make_engine(cfg)
    recorder = RecordingEngine(engine)

    async def go():
        # ten tokens hold no finished call and no boxed 7-digit answer, so an episode rarely ends at once
        await engine.start()
        try:
            for seed in range(5, 8):
                episode = await run_episode(recorder, engine.tokenizer, ToolCallEnv.from_config(cfg), TASK,
                                            SamplingParams(max_new_tokens=10, temperature=1.0, seed=seed), 3)
                if episode.turns >= 2:
                    return recorder.rollouts[seed], episode
            raise AssertionError("every episode ended after one reply")
        finally:
            await engine.shutdown()

    rollout, episode = asyncio.run(go())
    assert not episode.failed and episode.reward in (-1.0, 1.0)
    assert_token_exact(recorder, rollout, episode)
    # every reply but a final answer was malformed or called the tool
    assert episode.malformed + episode.info["tool_calls"] >= episode.turns - (episode.reason != "max_turns")


def test_a_per_turn_group_of_the_tiny_model_trains_one_step(tiny_model_dir):
    cfg = compose([f"model.path={tiny_model_dir}", "method=rl", "train.lr=1e-3", "engine.threads=1",
                   "logging.wandb.mode=disabled", f"env.name={GUESS_ENV}", "env.group_size=2", "env.max_turns=3",
                   "env.max_tokens_per_turn=6", "env.sample_mode=per_turn", "seed=3"])
    engine = make_engine(cfg)
    source = make_env_source(cfg, engine)
    recorder = source.engine = RecordingEngine(engine)

    async def go():
        await engine.start()
        try:
            for _ in itertools.count():  # the first group whose rollouts differ
                episodes, samples = await source.next_group()
                if samples or source.counters["groups"] == len(source.tasks):
                    return episodes, samples
        finally:
            await engine.shutdown()

    episodes, samples = asyncio.run(go())
    assert samples and len(samples) == sum(e.turns for e in episodes)
    prompts = [p for r in sorted(recorder.prompts) for p in recorder.prompts[r]][-len(samples):]
    assert [s.prompt_ids for s in samples] == prompts
    trainer = make_trainer(cfg, str(tiny_model_dir))
    try:
        before = trainer.logprobs(samples)
        assert all(b == pytest.approx(s.rollout_logprobs, abs=2e-3) for b, s in zip(before, samples))
        result = trainer.train_step(samples, 0)
        assert result.ok, result.skipped_reason
    finally:
        trainer.close()
