#!/usr/bin/env python3
"""Write toolcall-rl's task suite: data/train.jsonl and data/test.jsonl, the same bytes for the same seed.

Every problem needs a computation a tiny model cannot do in its head (multi-digit products, long
sums, unit conversions, calendar arithmetic, ...), and a few lines of Python can. Each row is
``{"task_id", "question", "answer", "template", "solution"}``: ``answer`` is the canonical answer
(an integer, a decimal with the places the question asks for, or a YYYY-MM-DD / HH:MM string),
``solution`` a Python cell that prints it (the oracle's tool call; never shown to the model).

The test split holds every train template on fresh numbers plus ``HELD_OUT`` templates that train
never shows, so a test success rate measures calling the tool on unseen problems, not recall.
No two problems of the whole suite share their numbers within a template (``signature``), so no
test problem's arithmetic appears in train either.

    python3 toolcall-rl/make_tasks.py            # rewrite data/ (seed 0)
    python3 toolcall-rl/make_tasks.py --check    # exit 1 when data/ differs from what the seed gives
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import random
import sys
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
SEED = 0
TRAIN_PER_TEMPLATE = 100
TEST_PER_TEMPLATE = 16  # train templates, on fresh numbers
HELD_OUT_PER_TEMPLATE = 40  # test-only templates

# A problem: (question, canonical answer, solution cell, the numbers that make it this problem).
Problem = tuple[str, str, str, tuple]


def _pick(rng: random.Random, phrasings: tuple[str, ...], **values) -> str:
    return rng.choice(phrasings).format(**values)


def product(rng: random.Random) -> Problem:
    a, b = rng.randint(100, 99999), rng.randint(100, 9999)
    q = _pick(rng, ("What is {a} * {b}?", "What is {a} times {b}?", "Multiply {a} by {b}.",
                    "Compute the product of {a} and {b}."), a=a, b=b)
    return q, str(a * b), f"print({a} * {b})", (a, b)


def list_sum(rng: random.Random) -> Problem:
    xs = [rng.randint(10, 99999) for _ in range(rng.randint(6, 12))]
    listed = ", ".join(map(str, xs))
    q = _pick(rng, ("What is the sum of these numbers: {l}?", "Add up these numbers: {l}.",
                    "Compute the total of {l}."), l=listed)
    return q, str(sum(xs)), f"print(sum([{listed}]))", tuple(xs)


# name, plural, target, factor: the factors are the exact definitions (or their float inverses).
_CONVERSIONS = (
    ("mile", "miles", "kilometres", 1.609344),
    ("pound", "pounds", "kilograms", 0.45359237),
    ("inch", "inches", "centimetres", 2.54),
    ("foot", "feet", "metres", 0.3048),
    ("US gallon", "US gallons", "litres", 3.785411784),
    ("ounce", "ounces", "grams", 28.349523125),
    ("nautical mile", "nautical miles", "kilometres", 1.852),
    ("acre", "acres", "square metres", 4046.8564224),
    ("kilometre", "kilometres", "miles", 1 / 1.609344),
    ("kilogram", "kilograms", "pounds", 1 / 0.45359237),
)


def unit_conversion(rng: random.Random) -> Problem:
    _, plural, target, factor = rng.choice(_CONVERSIONS)
    x = round(rng.uniform(10, 9999), rng.choice((0, 1, 2)))
    x_text = str(int(x)) if x.is_integer() else repr(x)
    value = round(x * factor, 2)
    q = _pick(rng, ("Convert {x} {u} to {t}. Round to 2 decimal places.",
                    "How many {t} are {x} {u}? Round to 2 decimal places.",
                    "{x} {u} is how many {t}? Give the answer rounded to 2 decimal places."),
              x=x_text, u=plural, t=target)
    return q, f"{value:.2f}", f"print(f'{{round({x_text} * {factor!r}, 2):.2f}}')", (plural, target, x_text)


def temperature(rng: random.Random) -> Problem:
    f = round(rng.choice((-1, 1)) * rng.randint(0, 2500) / 10 + rng.randint(1, 9) / 100, 2)  # e.g. 98.63, -12.47
    c = round((f - 32) * 5 / 9, 2)
    q = _pick(rng, ("Convert {f} degrees Fahrenheit to Celsius. Round to 2 decimal places.",
                    "What is {f} °F in °C? Round to 2 decimal places."), f=f)
    return q, f"{c:.2f}", f"print(f'{{round(({f} - 32) * 5 / 9, 2):.2f}}')", (f,)


def _date(rng: random.Random) -> dt.date:
    return dt.date(1950, 1, 1) + dt.timedelta(days=rng.randint(0, 365 * 110))


def date_add(rng: random.Random) -> Problem:
    d, n = _date(rng), rng.randint(40, 4000)
    after = rng.random() < 0.6
    result = d + dt.timedelta(days=n if after else -n)
    q = _pick(rng, ("What date is {n} days {w} {d}? Answer as YYYY-MM-DD.",
                    "Which date comes {n} days {w} {d}? Answer in the form YYYY-MM-DD."),
              n=n, w="after" if after else "before", d=d.isoformat())
    sign = "+" if after else "-"
    code = f"import datetime\nprint(datetime.date.fromisoformat('{d.isoformat()}') {sign} datetime.timedelta(days={n}))"
    return q, result.isoformat(), code, (d.isoformat(), n, after)


def date_diff(rng: random.Random) -> Problem:
    a, b = sorted((_date(rng), _date(rng)))
    if (b - a).days < 40:
        b = a + dt.timedelta(days=40 + rng.randint(0, 900))
    q = _pick(rng, ("How many days are there from {a} to {b}?", "How many days after {a} is {b}?",
                    "Count the days between {a} and {b}."), a=a.isoformat(), b=b.isoformat())
    code = (f"import datetime\nprint((datetime.date.fromisoformat('{b.isoformat()}') - "
            f"datetime.date.fromisoformat('{a.isoformat()}')).days)")
    return q, str((b - a).days), code, (a.isoformat(), b.isoformat())


def power_mod(rng: random.Random) -> Problem:
    base, exp, mod = rng.randint(3, 97), rng.randint(50, 999), rng.choice((1000, 10007, 9973, 100003, 65537))
    q = _pick(rng, ("What is {b}^{e} mod {m}?", "What is the remainder of {b} to the power {e} divided by {m}?"),
              b=base, e=exp, m=mod)
    return q, str(pow(base, exp, mod)), f"print(pow({base}, {exp}, {mod}))", (base, exp, mod)


def remainder(rng: random.Random) -> Problem:
    a, b = rng.randint(100000, 99999999), rng.randint(101, 9999)
    q = _pick(rng, ("What is the remainder when {a} is divided by {b}?", "What is {a} mod {b}?"), a=a, b=b)
    return q, str(a % b), f"print({a} % {b})", (a, b)


def compound_interest(rng: random.Random) -> Problem:
    p, r, y = rng.randint(2101, 50000), rng.choice((1.5, 2, 2.5, 3, 3.25, 4, 4.5, 5, 6, 7.5)), rng.randint(3, 30)
    value = round(p * (1 + r / 100) ** y, 2)
    q = (f"{p} dollars are invested at {r}% interest per year, compounded yearly. What is the balance after "
         f"{y} years? Round to 2 decimal places.")
    return q, f"{value:.2f}", f"print(f'{{round({p} * (1 + {r} / 100) ** {y}, 2):.2f}}')", (p, r, y)


def range_sum(rng: random.Random) -> Problem:
    a = rng.randint(100, 9999)
    b = a + rng.randint(500, 99999)
    q = _pick(rng, ("What is the sum of all integers from {a} to {b}, inclusive?",
                    "Add up every whole number from {a} through {b}."), a=a, b=b)
    return q, str((a + b) * (b - a + 1) // 2), f"print(sum(range({a}, {b} + 1)))", (a, b)


def duration_seconds(rng: random.Random) -> Problem:
    d, h, m, s = rng.randint(100, 999), rng.randint(0, 23), rng.randint(0, 59), rng.randint(0, 59)
    q = _pick(rng, ("How many seconds are in {d} days, {h} hours, {m} minutes and {s} seconds?",
                    "Convert {d} days {h} hours {m} minutes {s} seconds to seconds."), d=d, h=h, m=m, s=s)
    return q, str(((d * 24 + h) * 60 + m) * 60 + s), f"print((({d} * 24 + {h}) * 60 + {m}) * 60 + {s})", (d, h, m, s)


# Test only: the same skill (write the computation as code), problems train never shows.
def gcd(rng: random.Random) -> Problem:
    k = rng.randint(2, 999)
    a, b = k * rng.randint(100, 9999), k * rng.randint(100, 9999)
    q = _pick(rng, ("What is the greatest common divisor of {a} and {b}?", "Find gcd({a}, {b})."), a=a, b=b)
    return q, str(math.gcd(a, b)), f"import math\nprint(math.gcd({a}, {b}))", (a, b)


def clock_add(rng: random.Random) -> Problem:
    h, m, n = rng.randint(0, 23), rng.randint(0, 59), rng.randint(100, 9999)
    total = (h * 60 + m + n) % (24 * 60)
    q = f"A clock shows {h:02d}:{m:02d}. What time does it show {n} minutes later? Answer as HH:MM (24-hour clock)."
    code = f"t = ({h} * 60 + {m} + {n}) % (24 * 60)\nprint(f'{{t // 60:02d}}:{{t % 60:02d}}')"
    return q, f"{total // 60:02d}:{total % 60:02d}", code, (h, m, n)


TRAIN_TEMPLATES: dict[str, Callable[[random.Random], Problem]] = {
    f.__name__: f for f in (product, list_sum, unit_conversion, temperature, date_add, date_diff, power_mod,
                            remainder, compound_interest, range_sum, duration_seconds)
}
HELD_OUT: dict[str, Callable[[random.Random], Problem]] = {f.__name__: f for f in (gcd, clock_add)}


def signature(template: str, numbers: tuple) -> str:
    """What makes a problem the same problem: its template and its numbers (not the phrasing)."""
    return json.dumps([template, list(numbers)])


def make_suite(seed: int = SEED) -> dict[str, list[dict]]:
    """{"train": rows, "test": rows}. Test problems are drawn first, so train avoids them."""
    seen: set[str] = set()
    splits: dict[str, list[dict]] = {"test": [], "train": []}
    plan = [("test", name, fn, TEST_PER_TEMPLATE) for name, fn in TRAIN_TEMPLATES.items()]
    plan += [("test", name, fn, HELD_OUT_PER_TEMPLATE) for name, fn in HELD_OUT.items()]
    plan += [("train", name, fn, TRAIN_PER_TEMPLATE) for name, fn in TRAIN_TEMPLATES.items()]
    for split, name, fn, count in plan:
        rng = random.Random(f"toolcall-rl/{seed}/{split}/{name}")
        made = 0
        while made < count:
            question, answer, solution, numbers = fn(rng)
            sig = signature(name, numbers)
            if sig in seen:
                continue
            seen.add(sig)
            made += 1
            splits[split].append({"task_id": f"{split}-{name}-{made:03d}", "question": question, "answer": answer,
                                  "template": name, "solution": solution})
    return {"train": splits["train"], "test": splits["test"]}


def render(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--out", type=Path, default=DATA, help="directory of the split files (default: data/)")
    parser.add_argument("--check", action="store_true", help="compare with the files instead of writing them")
    args = parser.parse_args(argv)
    suite = make_suite(args.seed)
    stale = []
    for split, rows in suite.items():
        path = args.out / f"{split}.jsonl"
        text = render(rows)
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"{path}: {len(rows)} problems, {len({r['template'] for r in rows})} templates")
    if stale:
        print(f"make_tasks: {', '.join(stale)} differ from seed {args.seed}; rerun without --check", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
