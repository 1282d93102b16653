"""toolcall-rl's generated task suite: big enough, reproducible, fairly split, and unseen.

Unseen twice over: the test split shares no problem (its numbers within a template) with train and
holds templates train never shows; and no test problem appears in the embedded model's corpus:
neither its question nor its exact arithmetic (all its numbers and its answer in one message)
anywhere in the chats the embedded build can train on."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Iterator


from clawrl.config import compose
from clawrl.embedded import build
from clawrl.embedded.corpus import Chat
from clawrl.envs.answers import answers_match
from clawrl.envs.task_formats import ROWS, discover
from clawrl.orchestration.env_commands import resolve
from clawrl.orchestration.evaluation import episode_env

REPO = Path(__file__).resolve().parents[1]
SUITE = REPO / "toolcall-rl"
ENV_BY_PATH = f"{REPO / 'core/clawrl/envs/toolcall.py'}:ToolCallEnv"  # until ENVS["toolcall"] is registered
_spec = importlib.util.spec_from_file_location("toolcall_make_tasks", SUITE / "make_tasks.py")
make_tasks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_tasks)


def rows(split: str) -> list[dict]:
    return [json.loads(line) for line in (SUITE / "data" / f"{split}.jsonl").read_text().splitlines()]


def test_the_suite_has_1000_problems_and_a_test_split_of_200():
    train, test = rows("train"), rows("test")
    assert len(train) + len(test) >= 1000 and len(test) >= 200
    for row in train + test:
        assert set(row) == {"task_id", "question", "answer", "template", "solution"}, row
        assert all(isinstance(v, str) and v for v in row.values()), row


def test_the_loader_reads_it_as_a_row_dataset_with_two_splits():
    records = discover(SUITE)
    assert {r.format for r in records} == {ROWS}
    assert Counter(r.split for r in records) == {"train": len(rows("train")), "test": len(rows("test"))}


def test_the_files_are_what_the_generator_writes_for_its_seed(tmp_path):
    assert make_tasks.main(["--check"]) == 0
    assert make_tasks.main(["--out", str(tmp_path)]) == 0
    assert (tmp_path / "test.jsonl").read_bytes() == (SUITE / "data" / "test.jsonl").read_bytes()
    other = make_tasks.make_suite(seed=1)
    assert [r["question"] for r in other["test"]] != [r["question"] for r in rows("test")]


def test_every_solution_prints_its_canonical_answer():
    for row in rows("train") + rows("test"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(row["solution"], {})
        assert out.getvalue().strip() == row["answer"], row["task_id"]
        assert answers_match(row["answer"], row["answer"])


def test_splits_share_no_question_and_no_problem():
    train, test = rows("train"), rows("test")
    assert not {r["task_id"] for r in train} & {r["task_id"] for r in test}
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    assert not {_arithmetic(r) for r in train} & {_arithmetic(r) for r in test}


def test_the_test_split_holds_two_templates_train_never_shows():
    train_templates = {r["template"] for r in rows("train")}
    test_templates = Counter(r["template"] for r in rows("test"))
    held_out = set(test_templates) - train_templates
    assert len(held_out) >= 2 and held_out == set(make_tasks.HELD_OUT)
    assert train_templates <= set(test_templates)  # and every train template is tested on fresh numbers
    assert all(test_templates[t] >= 20 for t in held_out)


# ----- the embedded model's corpus -----

# Every message the template renders costs at least 4 tokens (<|im_start|>, the role, a newline,
# <|im_end|>; a tool message at least <tool_response>, </tool_response> and two newlines), so
# counting 4 per message over-counts the chats a build reads: a superset of what it trains on.
MIN_TOKENS_PER_MESSAGE = 4
# Dates are one operand; "2 decimal places" and "24-hour clock" are format, not arithmetic.
_OPERAND = re.compile(r"\d{4}-\d{2}-\d{2}|\d+(?:\.\d+)?")
_FORMAT = re.compile(r"\d+ decimal places|24-hour")


def _operands(text: str) -> frozenset[str]:
    """The numbers in ``text``, canonical (``03`` is ``3``, ``12.50`` is ``12.5``), dates whole."""
    out = set()
    for n in _OPERAND.findall(_FORMAT.sub(" ", text)):
        if "-" not in n:
            whole, _, frac = n.partition(".")
            n = (whole.lstrip("0") or "0") + ("." + frac.rstrip("0") if frac.rstrip("0") else "")
        out.add(n)
    return frozenset(out)


def _distinctive(n: str) -> bool:
    """An operand a chat about something else is unlikely to hold: a date, a number with a
    fraction, or an integer of 3+ digits that is not a year."""
    return "-" in n or "." in n or (len(n) >= 3 and not (len(n) == 4 and 1900 <= int(n) <= 2100))


def _arithmetic(row: dict) -> frozenset[str]:
    """A problem's exact arithmetic: the operands of its question."""
    return _operands(row["question"])


def _chat_texts(chat: Chat) -> Iterator[str]:
    for m in chat.messages:
        if isinstance(m.get("content"), str):
            yield m["content"]
        for call in m.get("tool_calls") or ():
            yield json.dumps(call["function"].get("arguments"))


def corpus_texts(seed: int = 0) -> Iterator[str]:
    """Every message text the embedded build of ``seed`` can train on (a superset: the chats of each
    stream, short, long and agent, up to the tokens its steps consume, plus the tokenizer's chats)."""
    budgets = build.token_budgets(build.DEFAULT_STEPS)
    assert set(budgets) == {"short", "long", "agent", "drill"} and all(budgets.values())
    for kind, budget in budgets.items():
        tokens = 0
        for batch in build._chat_batches(seed, kind):
            for chat in batch:
                yield from _chat_texts(chat)
                tokens += MIN_TOKENS_PER_MESSAGE * len(chat.messages)
            if tokens >= budget:
                break
    for chat in build.tokenizer_chats(seed):
        yield from _chat_texts(chat)


def corpus_hits(problems: list[dict], texts) -> list[str]:
    """The problems whose question, or whose exact arithmetic (every operand in one message: the
    question reworded, a worked answer, a tool call's code), some corpus text contains."""
    by_key: dict[str, list[tuple[dict, frozenset]]] = defaultdict(list)
    for p in problems:
        operands = _arithmetic(p)
        key = max(operands, key=lambda n: (_distinctive(n), len(n), n))  # every hit holds it
        by_key[key].append((p, operands))
    hits = []
    for text in texts:
        found = _operands(text)
        for n in found & by_key.keys():
            hits += [f"{p['task_id']}: its arithmetic is in {text[:160]!r}" for p, ops in by_key[n] if ops <= found]
    return hits


def test_every_test_problem_has_an_operand_that_marks_it():
    # What makes "all operands in one message" a sharp test: no problem is made of small numbers only.
    assert all(any(_distinctive(n) for n in _arithmetic(r)) for r in rows("test") + rows("train"))


def test_the_corpus_check_finds_a_problem_the_corpus_does_contain():
    texts = [t for _, t in zip(range(50000), corpus_texts())]
    m = next(m for t in texts if (m := re.fullmatch(r"Use the calculator to compute (\d\d)\*(\d\d)\.", t)))
    a, b = m.groups()
    planted = {"task_id": "planted", "question": f"What is {a} times {b}?", "answer": str(int(a) * int(b))}
    unrelated = {"task_id": "unrelated", "question": "What is 4821 * 397?", "answer": "1913937"}
    hits = corpus_hits([planted, unrelated], texts)
    assert hits and all(h.startswith("planted:") for h in hits)


def test_the_corpus_check_finds_a_train_problem_of_the_agent_episodes():
    # The corpus's toolcall episodes are train problems: the check, given those, must find them.
    agent = next(b for b in build._chat_batches(0, "agent"))
    texts = [t for chat in agent for t in _chat_texts(chat)]
    questions = {t for t in texts}
    seen = [r for r in rows("train") if r["question"] in questions]
    assert seen, "no toolcall episode in the first agent batch"
    hits = corpus_hits(seen[:3], texts)
    assert {h.split(":")[0] for h in hits} == {r["task_id"] for r in seen[:3]}


def test_the_corpus_never_shows_a_held_out_template():
    from clawrl.embedded.agentic import toolcall_rows

    assert {r["template"] for r in toolcall_rows()} == set(make_tasks.TRAIN_TEMPLATES)
    held_out = {re.sub(r"\d+", "N", r["question"]) for r in rows("test") if r["template"] in make_tasks.HELD_OUT}
    assert held_out and not held_out & {re.sub(r"\d+", "N", r["question"]) for r in toolcall_rows()}


def test_no_test_problem_appears_in_the_embedded_model_corpus():
    hits = corpus_hits(rows("test"), corpus_texts())
    assert not hits, "\n".join(hits[:20])


def test_the_method_directory_names_its_tasks_and_environment():
    task_set = resolve("toolcall-rl", [f"env.name={ENV_BY_PATH}"])
    assert len(task_set.records) == len(rows("train")) + len(rows("test"))
    assert type(episode_env(task_set.cfg, task_set.records[0])).__name__ == "ToolCallEnv"
    recipe = compose([], yaml_path=str(SUITE / "config.yaml"))
    assert (recipe.env.name, recipe.env.tasks) == ("toolcall", ".")
