"""Agent episodes for the embedded corpus: every action format clawrl's environments parse.

Each chat is an episode as its environment prompts it, rendered through the same chat template with
the environment's own constants, so the model sees at train time exactly what it sees in a rollout
(``docs/action_formats.md`` lists the formats and which code parses each):

- **toolcall** (``clawrl.envs.toolcall``): ``INSTRUCTIONS`` as the system message, ``PYTHON_TOOL`` as
  the template's tools, a problem as the user message; the reply is a python tool call, the tool's
  output comes back, and the final reply copies it into ``\\boxed{}``.
- **terminal** (``clawrl.envs.terminal``): its ``SYSTEM_PROMPT``, a small shell task; the reply is
  one fenced ```` ```bash ```` block (also swe-rl's format), or, when ``BASH_TOOL`` is offered, a
  ``bash`` tool call; the exit code and output come back; the agent ends with ``DONE``.
- **gui** (``clawrl.envs.computer_use``): an instruction and an accessibility tree; the reply is one
  JSON action, until ``{"action": "done"}``.

The toolcall problems are toolcall-rl's *train* split (a copy, ``toolcall_train.jsonl``, which a
test keeps identical to ``toolcall-rl/data/train.jsonl``): an installed clawrl has no repository to
read, and the train rows are the only problems known to share no numbers with the test split
(``tests/test_toolcall_suite.py`` checks the whole corpus). The held-out templates never appear.

The untrained model is meant to be a plausible but imperfect agent, with room for RL to improve it
(issue 16, item 7): the corpus does not always use the tool. Per template, a share of its episodes
answers at once with a head-computed guess (``_guess``: a number of the right shape, wrong).
``tool_share`` sets the shares: on most templates the corpus prefers guessing, so greedy decoding
guesses there, and calls the tool on the three tool-first ones.

Measured on the seed-0 build without drills (1500 steps; BENCHMARKS.md, "The embedded model's agent
formats"): the model learned the formats and *when* to call (greedy: a well-formed call on every
product, remainder and date_diff test problem, a guess on most other templates), and it copied a
problem's numbers into the code only sometimes: the greedy call was the exact solution on 12 of 30
tool-first train problems, and the box copied the tool's output on 31 of 50 (digits drift in long
numbers). At 1300 steps the copies were almost never right. ``copy_drill`` practises that copying, and
``toolcall_drill`` practises whole calls without teaching when to call (BENCHMARKS.md, "Toolcall
drills").
"""
from __future__ import annotations

import functools
import json
import random
import re
from pathlib import Path

from clawrl.envs import computer_use
from clawrl.envs.computer_use import Element, render_screen
from clawrl.envs.sandbox import ExecResult
from clawrl.envs.terminal import BASH_TOOL, SYSTEM_PROMPT as TERMINAL_PROMPT, render_result
from clawrl.envs.tool_calls import TOOL_NAME, format_tool_call
from clawrl.envs.toolcall import INSTRUCTIONS, PYTHON_TOOL

TOOLCALL_ROWS = Path(__file__).with_name("toolcall_train.jsonl")
# Share of a template's episodes that call the tool (the rest guess). Tool-first on three templates,
# guess-first on the others: before RL, greedy succeeds only where it calls the tool.
TOOL_FIRST = ("product", "remainder", "date_diff")
TOOL_SHARE_FIRST, TOOL_SHARE_OTHER = 0.85, 0.3
TERMINAL_WORKDIR = "/app"  # the sandbox's default workdir (clawrl.envs.sandbox.open_sandbox)
BASH_TOOL_SHARE = 0.4  # terminal episodes that offer BASH_TOOL and act through it


def tool_share(template: str) -> float:
    return TOOL_SHARE_FIRST if template in TOOL_FIRST else TOOL_SHARE_OTHER


@functools.lru_cache(maxsize=1)
def toolcall_rows() -> tuple[dict, ...]:
    rows = tuple(json.loads(line) for line in TOOLCALL_ROWS.read_text().splitlines() if line.strip())
    if not rows:
        raise RuntimeError(f"{TOOLCALL_ROWS} holds no problems")
    return rows


def _assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _guess(rng: random.Random, row: dict) -> str:
    """What a model computing in its head writes: a number of the right shape, wrong. It is the
    answer of another train problem of the same template, so every number the corpus shows is a
    train problem's (a made-up one could be a test problem's operand: the corpus check would find
    it, and rightly)."""
    return rng.choice([r["answer"] for r in _by_template()[row["template"]] if r["answer"] != row["answer"]])


@functools.lru_cache(maxsize=1)
def _by_template() -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for r in toolcall_rows():
        groups.setdefault(r["template"], []).append(r)
    return groups


_NUMBER = re.compile(r"\d{4}-\d{2}-\d{2}|-?\d+(?:\.\d+)?")
_DRILLS = ("Repeat after me: {n}", "Copy these numbers exactly: {n}", "Please repeat: {n}", "Say {n}.")


def copy_drill(rng: random.Random) -> tuple[str, str]:
    """(question, answer): repeat the numbers of a train problem, in order. Writing a problem's
    numbers into code is copying long digit strings, which a 2-layer model learns slowly; these
    short drills practise exactly that (on numbers the toolcall episodes already show, so they add
    no new problem to the corpus)."""
    numbers = _NUMBER.findall(rng.choice(toolcall_rows())["question"])
    numbers = [n for n in numbers if n not in ("2", "24")] or numbers  # "2 decimal places", "24-hour"
    start = rng.randrange(len(numbers))
    chosen = " ".join(numbers[start:start + rng.randint(1, 3)])
    return rng.choice(_DRILLS).format(n=chosen), chosen


def toolcall_chat(rng: random.Random) -> tuple[list[dict], list[dict]]:
    """(messages, tools) of one toolcall-rl episode on a train problem."""
    row = rng.choice(toolcall_rows())
    messages = [{"role": "system", "content": INSTRUCTIONS}, _user(row["question"])]
    if rng.random() < tool_share(row["template"]):
        messages += [_assistant(format_tool_call(row["solution"])),
                     {"role": "tool", "name": TOOL_NAME, "content": row["answer"]},
                     _assistant(f"\\boxed{{{row['answer']}}}")]
    else:
        messages.append(_assistant(f"\\boxed{{{_guess(rng, row)}}}"))
    return messages, [PYTHON_TOOL]


def toolcall_drill(rng: random.Random) -> tuple[list[dict], list[dict]]:
    """(messages, tools) of a toolcall-rl episode on a train problem that always calls the tool with
    the exact solution and boxes its output, the call marked ``"train": "tail"``: its opening
    ``<tool_call>`` is context (``corpus.chat_pieces``). These drills practise what the model gets
    wrong once it has chosen to call (copying the problem's numbers into code, the output into the
    box) without teaching it *when* to call: that choice is the first token, which the drill leaves
    untrained, so ``tool_share`` alone still sets it and RL has a decision left to improve."""
    row = rng.choice(toolcall_rows())
    call = {"role": "assistant", "content": format_tool_call(row["solution"]), "train": "tail"}
    return [{"role": "system", "content": INSTRUCTIONS}, _user(row["question"]), call,
            {"role": "tool", "name": TOOL_NAME, "content": row["answer"]},
            _assistant(f"\\boxed{{{row['answer']}}}")], [PYTHON_TOOL]


_FILES = ("notes.txt", "data.csv", "log.txt", "todo.md", "main.py", "report.txt", "input.txt", "names.txt")
_DIRS = ("out", "backup", "build", "docs", "tmp", "archive")
_WORDS = ("hello", "apple", "river", "seven", "rocket", "piano", "yellow", "coffee", "tiger", "done", "blue", "garden")


def _shell_task(rng: random.Random) -> tuple[str, str, str]:
    """(instruction, commands, stdout) of a one-command shell task."""
    f, g, d, w, v = rng.choice(_FILES), rng.choice(_FILES), rng.choice(_DIRS), rng.choice(_WORDS), rng.choice(_WORDS)
    n = rng.randint(2, 40)
    kind = rng.randrange(10)
    if kind == 0:
        return rng.choice(("Create a file named {f} that contains the word {w}.", "Write {w} into a new file {f}.")).format(
            f=f, w=w), f"echo {w} > {f}", ""
    if kind == 1:
        return f"Write the numbers 1 to {n} into {f}, one per line.", f"seq 1 {n} > {f}", ""
    if kind == 2:
        return rng.choice(("Make a directory called {d} and move {f} into it.", "Move {f} into a new directory {d}.")).format(
            d=d, f=f), f"mkdir -p {d} && mv {f} {d}/", ""
    if kind == 3:
        return f"Count the lines of {f} and write the number to count.txt.", f"wc -l < {f} > count.txt", ""
    if kind == 4:
        return f"Print the contents of {f}.", f"cat {f}", " ".join(rng.sample(_WORDS, rng.randint(1, 5))) + "\n"
    if kind == 5:
        return f"Replace every {w} with {v} in {f}.", f"sed -i 's/{w}/{v}/g' {f}", ""
    if kind == 6:
        return rng.choice(("Delete the file {f}.", "Remove {f}.")).format(f=f), f"rm {f}", ""
    if kind == 7:
        return f"Copy {f} to {d}/{g}.", f"mkdir -p {d} && cp {f} {d}/{g}", ""
    if kind == 8:
        return "List every .py file under src in files.txt.", "find src -name '*.py' > files.txt", ""
    return f"Append the line {w} to {f}.", f"echo {w} >> {f}", ""


def bash_call(command: str) -> str:
    """A ``bash`` tool call, exactly as the chat template renders one."""
    return "<tool_call>\n" + json.dumps({"name": "bash", "arguments": {"command": command}}, ensure_ascii=False) + \
        "\n</tool_call>"


def terminal_chat(rng: random.Random) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) of a terminal-rl episode: look first (sometimes), run the command, DONE."""
    instruction, commands, stdout = _shell_task(rng)
    as_tool = rng.random() < BASH_TOOL_SHARE
    act = bash_call if as_tool else (lambda c: f"```bash\n{c}\n```")
    messages = [{"role": "system", "content": TERMINAL_PROMPT.format(workdir=TERMINAL_WORKDIR)}, _user(instruction)]
    if rng.random() < 0.3:
        listing = "\n".join(sorted(set(rng.sample(_FILES, rng.randint(1, 4)))))
        messages += [_assistant(act("ls")), _user(render_result(ExecResult(0, listing + "\n", "", False, 0.0)))]
    messages += [_assistant(act(commands)), _user(render_result(ExecResult(0, stdout, "", False, 0.0))),
                 _assistant("DONE")]
    return messages, [BASH_TOOL] if as_tool else None


_ROLES_NAMES = {
    "button": ("OK", "Cancel", "Save", "Open", "Submit", "Next", "Back", "Delete", "Log in", "Sign up", "Send", "Close"),
    "textbox": ("Search", "Username", "Password", "Email", "Name", "Message", "Address", "Title"),
    "link": ("Home", "Settings", "Help", "Profile", "Downloads", "About", "Contact", "News"),
    "checkbox": ("Remember me", "I agree", "Dark mode", "Notifications"),
}
MIN_SCREEN_NUMBER = 60
_KEYS = ("Enter", "Tab", "Escape", "Backspace", "PageDown", "ctrl+s", "ctrl+a")


def _screen(rng: random.Random) -> list[Element]:
    """3-8 elements with distinct ids and names, laid out top to bottom. Every number on a screen
    is at least ``MIN_SCREEN_NUMBER`` (ids 60-99, a margin of 60 px): a screen holds dozens of
    numbers, and small ones beside 3-digit ones would hold the operands of a time-of-day problem
    (an hour, minutes, a count of minutes), which the corpus check (tests/test_toolcall_suite.py)
    rightly refuses to tell apart from a problem."""
    ids = rng.sample(range(MIN_SCREEN_NUMBER, 100), rng.randint(3, 8))
    pairs = rng.sample([(r, n) for r, names in _ROLES_NAMES.items() for n in names], len(ids))
    top = rng.randint(MIN_SCREEN_NUMBER, 120)
    elements = []
    for i, (role, name) in zip(ids, pairs):
        w, h = (rng.randint(160, 320), 28) if role == "textbox" else (rng.randint(40, 120), rng.randint(20, 32))
        left = rng.randint(MIN_SCREEN_NUMBER, 400)
        elements.append(Element(i, role, name, (left, top, left + w, top + h)))
        top += h + rng.randint(8, 40)
    return elements


def _act(action: dict) -> dict:
    return _assistant(json.dumps(action, ensure_ascii=False))


def gui_chat(rng: random.Random) -> tuple[list[dict], None]:
    """(messages, None) of a computer-use episode: the actions an instruction needs, then done."""
    screen = _screen(rng)
    kind = rng.randrange(6)
    if kind <= 1:
        target = rng.choice([e for e in screen if e.role != "textbox"] or screen)
        noun = {"button": "button", "link": "link", "checkbox": "checkbox"}.get(target.role, "field")
        instruction = rng.choice(("Click the {n} {r}.", "Press the {n} {r}.", "Open {n}.")).format(n=target.name, r=noun)
        actions = [{"action": "click", "element": target.id}]
    elif kind == 2:
        boxes = [e for e in screen if e.role == "textbox"]
        if not boxes:
            screen[0] = Element(screen[0].id, "textbox", "Search", screen[0].box)
            boxes = [screen[0]]
        target = rng.choice(boxes)
        text = rng.choice(("hello", "clawrl", "weather in Paris", "alice@example.org", "meeting notes", "hello world"))
        instruction = rng.choice(("Type '{t}' into the {n} field.", "Enter {t} in {n}.")).format(t=text, n=target.name)
        actions = [{"action": "click", "element": target.id}, {"action": "type", "text": text}]
        if rng.random() < 0.4:
            instruction += " Then press Enter."
            actions.append({"action": "key", "key": "Enter"})
    elif kind == 3:
        key = rng.choice(_KEYS)
        instruction = rng.choice(("Press {k}.", "Hit the {k} key.")).format(k=key)
        actions = [{"action": "key", "key": key}]
    elif kind == 4:
        down = rng.random() < 0.6
        way = "down" if down else "up"
        if rng.random() < 0.5:
            dy, instruction = 200, f"Scroll {way}."
        else:
            dy = rng.choice((100, 300, 500))
            instruction = f"Scroll {way} by {dy} pixels."
        actions = [{"action": "scroll", "dy": dy if down else -dy}]
    else:
        x, y = rng.randint(MIN_SCREEN_NUMBER, 900), rng.randint(MIN_SCREEN_NUMBER, 700)
        instruction = rng.choice(("Click at ({x}, {y}).", "Click the point x={x}, y={y}.")).format(x=x, y=y)
        actions = [{"action": "click", "x": x, "y": y}]
    messages = [{"role": "system", "content": computer_use.SYSTEM_PROMPT}, _user(render_screen(screen, instruction))]
    for action in actions:
        messages += [_act(action), _user(render_screen(screen))]
    messages.append(_act({"action": "done"}))
    return messages, None


def agent_chat(rng: random.Random) -> tuple[list[dict], list[dict] | None]:
    """One episode of some environment: toolcall 70% (the format RL must start from), terminal 15%,
    GUI 15%."""
    r = rng.random()
    if r < 0.7:
        return toolcall_chat(rng)
    if r < 0.85:
        return terminal_chat(rng)
    return gui_chat(rng)

