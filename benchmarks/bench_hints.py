"""Measure hint judging on the labelled hint set: acceptance and chosen-hint accuracy.

1. The rules extractor (``RulesHintJudge``, one deterministic vote) on each case's feedback message.
2. The vote-selection rule (``clawrl.judges.hints.choose_hint``: strict-majority acceptance, then
   the most-supported hint, ties to the shortest) against the baseline OpenClaw-RL uses (accept
   when any vote accepts with a hint, keep the longest), **over the same simulated votes**.

Where the votes come from (be clear about it): a model judge on the 1M-parameter embedded model
produces garbage, so the votes here are *simulated* judge outputs -- hint paraphrases drawn from a
table, with noise at invented rates per vote (faithful 50% (a third of them padded with a verbose
preamble), an extra instruction the user never asked for 15%, a missing instruction or a vague
hint 10%, a wrong reject 10%, an accept without a usable hint 7%, unparseable 8%; on no-hint cases:
reject 70%, a false hint 15%, garbage 15%). The comparison therefore depends on these rates; the
script prints them. ``--model-judge DIR`` also runs ``ModelHintJudge`` on a real model for the
first ``--model-cases`` cases, and ``--teacher-check DIR`` measures whether that model, as the teacher,
follows the ``[Hint: ...]`` it is given (the OPD advantage of a bare vs a worked reply under three hints).

Accuracy criterion: ``clawrl.judges.hint_set.hint_matches`` (the chosen hint names exactly the
case's instructions, found by key phrases independent of the extractor's patterns).

    python benchmarks/bench_hints.py [--cases 120] [--seed 0] [--repeats 30] [--model-judge DIR] [--teacher-check DIR]
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
from typing import Callable, Sequence

from clawrl.judges.base import JudgeInput
from clawrl.judges.hint_set import CANONICAL, HintCase, hint_cases, hint_matches
from clawrl.judges.hints import HintVerdict, HintVote, RulesHintJudge, choose_hint, usable_hint
from clawrl.methods.opd.teacher import hint_tag

PARAPHRASES = {
    "one_line": ("answer in one line", "keep the reply to a single line", "reply on one line only",
                 "give a one-line answer"),
    "one_word": ("answer in one word", "reply with a single word", "use one word only"),
    "just_answer": ("answer with just the answer", "give only the number", "reply with just the result, no explanation"),
    "be_brief": ("be brief", "keep it short", "be more concise", "use fewer words"),
    "no_rhymes": ("without rhymes", "do not rhyme", "avoid rhyming"),
    "no_bold": ("without bold text", "do not use bold", "avoid bold formatting"),
    "no_emoji": ("without emojis", "do not use emojis", "leave out emoji"),
    "uppercase": ("reply in uppercase", "write in all caps", "use capital letters throughout"),
    "lowercase": ("reply in lowercase", "write everything in lower case", "use small letters only"),
    "show_working": ("show the full sum, like 7 + 5 = 12", "show your working", "write out the equation"),
    "more_detail": ("give more detail", "elaborate on the answer", "add more explanation"),
    "language": ("reply in {v}", "answer in {v}", "write the reply in {v}"),
    "answer": ("the answer is {v}", "the correct answer is {v}", "say {v}"),
    "start_with": ("start your reply with '{v}'", "begin the answer with '{v}'"),
    "end_with": ("end your reply with '{v}'", "finish with '{v}'"),
    "use": ("use {v}", "use {v} instead of guessing", "try using {v}"),
}
_EXTRAS = ("more_detail", "uppercase", "lowercase", "no_emoji", "show_working", "be_brief", "no_bold")
_VERBOSE = ("The user was not happy with the previous reply, so next time {h}.",
            "Looking at the user's message, the assistant should {h}.", "In hindsight: {h}, as the user asked.")
_VAGUE = ("improve the answer", "do better", "be more helpful")


def _phrase(rng: random.Random, name: str, value: str) -> str:
    return rng.choice(PARAPHRASES[name]).format(v=value)


def _hint(rng: random.Random, instructions: Sequence[tuple[str, str]]) -> str:
    parts = [_phrase(rng, n, v) for n, v in instructions]
    rng.shuffle(parts)
    text = ", and ".join(parts)
    return text[:1].upper() + text[1:] + "."


def simulated_votes(case: HintCase, m: int, rng: random.Random) -> list[HintVote]:
    """``m`` noisy judge votes on ``case`` (rates in the module docstring)."""
    votes = []
    for _ in range(m):
        r = rng.random()
        if case.has_hint:
            if r < 0.50:
                hint = _hint(rng, case.instructions)
                if rng.random() < 1 / 3:
                    hint = rng.choice(_VERBOSE).format(h=hint.rstrip(".")[:1].lower() + hint.rstrip(".")[1:])
                votes.append(HintVote(True, usable_hint(hint), "faithful"))
            elif r < 0.65:
                have = {n for n, _ in case.instructions}
                extra = rng.choice([e for e in _EXTRAS if e not in have])
                votes.append(HintVote(True, usable_hint(_hint(rng, list(case.instructions) + [(extra, "")])), "extra"))
            elif r < 0.75:
                if len(case.instructions) > 1:
                    kept = list(case.instructions)
                    kept.pop(rng.randrange(len(kept)))
                    votes.append(HintVote(True, usable_hint(_hint(rng, kept)), "partial"))
                else:
                    votes.append(HintVote(True, rng.choice(_VAGUE).capitalize() + ".", "vague"))
            elif r < 0.85:
                votes.append(HintVote(False, "", "wrong reject"))
            elif r < 0.92:
                votes.append(HintVote(True, "", "garbage hint"))
            else:
                votes.append(HintVote(None, "", "unparseable"))
        else:
            if r < 0.70:
                votes.append(HintVote(False, "", "reject"))
            elif r < 0.85:
                name = rng.choice(sorted(n for n in CANONICAL if "{v}" not in CANONICAL[n]))
                votes.append(HintVote(True, usable_hint(_hint(rng, [(name, "")])), "false hint"))
            elif r < 0.92:
                votes.append(HintVote(True, "", "garbage hint"))
            else:
                votes.append(HintVote(None, "", "unparseable"))
    return votes


def take_longest(votes: Sequence[HintVote]) -> HintVerdict:
    """The baseline: accept if any vote accepts with a hint, and keep the longest such hint."""
    hints = [v.hint for v in votes if v.accept is True and v.hint]
    if not hints:
        return HintVerdict(False, "", "no_hint", list(votes), "longest")
    return HintVerdict(True, max(hints, key=len), "accepted", list(votes), "longest")


def score(cases: Sequence[HintCase], verdicts: Sequence[HintVerdict]) -> dict:
    """acceptance accuracy, hint accuracy (matched among accepted cases that have a hint),
    end-to-end accuracy (hint cases: accepted with a matching hint; others: rejected), false accepts."""
    accept_ok = sum(v.accepted == c.has_hint for c, v in zip(cases, verdicts))
    hinted = [(c, v) for c, v in zip(cases, verdicts) if c.has_hint and v.accepted]
    matched = sum(hint_matches(v.hint, c) for c, v in hinted)
    e2e = sum((v.accepted and hint_matches(v.hint, c)) if c.has_hint else not v.accepted
              for c, v in zip(cases, verdicts))
    no_hint = [v for c, v in zip(cases, verdicts) if not c.has_hint]
    return {"acceptance": accept_ok / len(cases), "hint": matched / max(len(hinted), 1), "end_to_end": e2e / len(cases),
            "false_accept": sum(v.accepted for v in no_hint) / max(len(no_hint), 1)}


def judge_input(case: HintCase) -> JudgeInput:
    return JudgeInput(case.case_id, case.request, case.reply, None, [{"role": "user", "content": case.feedback}])


def _mean_sd(values: list[float]) -> str:
    return f"{100 * statistics.mean(values):5.1f} ± {100 * statistics.pstdev(values):4.1f}"


def compare(cases: Sequence[HintCase], m: int, repeats: int, seed: int) -> dict[str, dict[str, list[float]]]:
    rules: dict[str, Callable] = {"consensus (clawrl)": choose_hint, "longest (baseline)": take_longest}
    out = {name: {} for name in rules}
    for rep in range(repeats):
        rng = random.Random(f"{seed}-{m}-{rep}")
        votes = [simulated_votes(c, m, rng) for c in cases]
        for name, rule in rules.items():
            for k, v in score(cases, [rule(vs) for vs in votes]).items():
                out[name].setdefault(k, []).append(v)
    return out


async def model_judge_run(path: str, cases: Sequence[HintCase], votes: int) -> dict:
    from clawrl.config import EngineConfig
    from clawrl.engines.loading import load_model
    from clawrl.engines.torch_engine import TorchEngine
    from clawrl.judges.hints import ModelHintJudge

    engine = TorchEngine(load_model(path, device="cpu"), EngineConfig())
    await engine.start()
    try:
        judge = ModelHintJudge(engine, votes=votes, max_new_tokens=48)
        verdicts = [await judge.extract(judge_input(c)) for c in cases]
    finally:
        await engine.shutdown()
    res = score(cases, verdicts)
    res["garbage_votes"] = sum(v.accept is None for vd in verdicts for v in vd.votes) / (len(cases) * votes)
    return res


async def teacher_check(path: str, n: int, seed: int) -> dict:
    """Does the model follow the hint format? For ``n`` addition questions, the summed OPD advantage
    (hinted teacher minus unhinted student, same model) of a bare reply ("12") and a worked one
    ("7 + 5 = 12.") under three hints. A teacher that uses the hint favours the reply it asks for."""
    import torch

    from clawrl.config import EngineConfig
    from clawrl.embedded.corpus import ADDITION_QUESTIONS, sample_pair
    from clawrl.engines.loading import load_model
    from clawrl.engines.torch_engine import TorchEngine
    from clawrl.losses import opd_advantages
    from clawrl.methods.opd.teacher import teacher_prompt_ids

    loaded = load_model(path, device="cpu")
    tok = loaded.tokenizer
    engine = TorchEngine(loaded, EngineConfig())
    await engine.start()
    rng = random.Random(f"teacher-{seed}")
    hints = ("Answer with just the answer.", "Be brief.", "Show the full sum, like 7 + 5 = 12.")
    sums: dict = {(h, r): [] for h in hints for r in ("bare", "worked")}
    try:
        for _ in range(n):
            a, b = sample_pair(rng, held_out=True)
            messages = [{"role": "user", "content": rng.choice(ADDITION_QUESTIONS).format(a=a, b=b)}]
            prompt = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                                add_special_tokens=False)
            turn = {"messages": messages, "history_len": 1, "tools": None, "prompt_ids": prompt}
            for kind, reply in (("bare", f"{a + b}"), ("worked", f"{a} + {b} = {a + b}.")):
                response = tok.encode(reply + "<|im_end|>", add_special_tokens=False)
                student = (await engine.score(prompt, response)).logprobs
                for h in hints:
                    teacher = (await engine.score(teacher_prompt_ids(tok, turn, h), response)).logprobs
                    adv = opd_advantages(torch.tensor(teacher), torch.tensor(student))
                    sums[(h, kind)].append(float(adv.sum()))
    finally:
        await engine.shutdown()
    return {k: statistics.mean(v) for k, v in sums.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=120)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--model-judge", default=None, help="HF model directory for ModelHintJudge (optional)")
    ap.add_argument("--model-cases", type=int, default=30)
    ap.add_argument("--teacher-check", default=None, help="HF model directory: does its teacher follow the hint?")
    args = ap.parse_args()

    cases = hint_cases(args.cases, args.seed)
    n_hint = sum(c.has_hint for c in cases)
    print(f"labelled set: {len(cases)} cases (seed {args.seed}), {n_hint} with a hint, {len(cases) - n_hint} without")

    judge = RulesHintJudge()
    verdicts = [judge.score(judge_input(c)) for c in cases]
    res = score(cases, verdicts)
    print("\n1. rules extractor, one vote per case (the set and the rules were written by the same engineer: optimistic)")
    print("   acceptance {acceptance:.1%}  hint {hint:.1%}  end-to-end {end_to_end:.1%}  false accept {false_accept:.1%}"
          .format(**res))
    for c, v in zip(cases, verdicts):
        if (v.accepted != c.has_hint) or (c.has_hint and not hint_matches(v.hint, c)):
            print(f"   miss [{c.category}] {c.feedback!r}: got {v.hint or v.reason!r}, want {c.expected_hint or 'no hint'!r}")

    print(f"\n2. selection rules over the same simulated votes ({args.repeats} noise draws; mean ± sd, %)")
    print(f"   {'votes':>5}  {'rule':<20} {'acceptance':>13} {'hint':>13} {'end-to-end':>13} {'false accept':>13}")
    for m in (1, 3, 5):
        for name, metrics in compare(cases, m, args.repeats, args.seed).items():
            print(f"   {m:>5}  {name:<20} " + " ".join(f"{_mean_sd(metrics[k]):>13}" for k in
                                                      ("acceptance", "hint", "end_to_end", "false_accept")))

    if args.model_judge:
        subset = cases[:args.model_cases]
        res = asyncio.run(model_judge_run(args.model_judge, subset, 3))
        print(f"\n3. ModelHintJudge on {args.model_judge}, {len(subset)} cases, 3 votes each")
        print("   acceptance {acceptance:.1%}  hint {hint:.1%}  end-to-end {end_to_end:.1%}  false accept "
              "{false_accept:.1%}  garbage votes {garbage_votes:.1%}".format(**res))

    if args.teacher_check:
        res = asyncio.run(teacher_check(args.teacher_check, 40, args.seed))
        print(f"\n4. teacher check on {args.teacher_check}: mean summed OPD advantage per reply (40 held-out additions)")
        for hint in dict.fromkeys(h for h, _ in res):
            print(f"   {hint_tag(hint):<48} bare {res[(hint, 'bare')]:+7.3f}   worked {res[(hint, 'worked')]:+7.3f}")


if __name__ == "__main__":
    main()
