#!/usr/bin/env python3
"""Write gui-rl's task set: data/<split>.jsonl, the same bytes every time.

MiniWoB++ rows are split **by seed**: every wired task (``clawrl.envs.gui.miniwob_tasks.TASKS``)
has train rows on seeds 0..TRAIN_SEEDS-1 and test rows on seeds TEST_SEED_BASE.. (100000 up), so a
test instance is a new layout and new targets of a task trained on. Tasks with one screen whatever
the seed (``FIXED``) are train only. OSWorld-style tasks (``osworld/*.json``, read by
``clawrl.envs.gui.osworld.load_task``, their page inlined) are split **by task** (``OSWORLD_TEST``).

``train_click`` / ``test_click`` are the click family alone (tasks solved by one click on a named
button, link or tab), more seeds each: the learning run's splits (README.md).

    python3 gui-rl/make_tasks.py            # rewrite data/
    python3 gui-rl/make_tasks.py --check    # exit 1 when data/ differs from what this script writes
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from clawrl.envs.gui.miniwob_tasks import FIXED, TASKS, TEST_SEED_BASE
from clawrl.envs.gui.osworld import load_task

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
TRAIN_SEEDS, TEST_SEEDS = 16, 5
CLICK_FAMILY = ("click-button", "click-link", "click-test-2", "unicode-test", "click-tab", "click-dialog-2")
CLICK_TRAIN_SEEDS, CLICK_TEST_SEEDS = 64, 10
CLICK_EASY = ("click-test-2",)
OSWORLD_TEST = ("profile-city", "search-title")


def _miniwob(tasks, seeds, prefix: str = "") -> list[dict]:
    return [{"task_id": f"{prefix}{t}/{s}", "miniwob": t, "seed": s} for s in seeds for t in tasks]


def splits() -> dict[str, list[dict]]:
    osworld = {p.stem: load_task(p) for p in sorted((HERE / "osworld").glob("*.json"))}
    rows = {
        "train": _miniwob(TASKS, range(TRAIN_SEEDS)),
        "test": _miniwob([t for t in TASKS if t not in FIXED], range(TEST_SEED_BASE, TEST_SEED_BASE + TEST_SEEDS)),
        # ids are unique across a task set, so the family's rows have their own (same instances)
        "train_click": _miniwob(CLICK_FAMILY, range(CLICK_TRAIN_SEEDS), "family/"),
        "test_click": _miniwob(CLICK_FAMILY, range(TEST_SEED_BASE, TEST_SEED_BASE + CLICK_TEST_SEEDS), "family/"),
        # the family's easiest task alone (two buttons, ONE and TWO; the untrained model clicks the
        # right one on 1.5% of T=1 first turns, 0.5% across the family): the learning run's train
        # split, evaluated on test_click (README.md, "Learning")
        "train_click_easy": _miniwob(CLICK_EASY, range(CLICK_TRAIN_SEEDS), "easy/"),
    }
    for name, task in osworld.items():
        rows["test" if name in OSWORLD_TEST else "train"].append({"task_id": f"osworld/{name}", "osworld": task})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the files instead of writing them")
    args = parser.parse_args(argv)
    stale = []
    DATA.mkdir(exist_ok=True)
    for split, rows in splits().items():
        text = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows)
        file = DATA / f"{split}.jsonl"
        if args.check:
            if not file.is_file() or file.read_text() != text:
                stale.append(file.name)
        else:
            file.write_text(text)
    if stale:
        print(f"make_tasks: {', '.join(stale)} differ from what make_tasks.py writes; rerun without --check",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
