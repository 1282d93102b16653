"""A notebook-like Python interpreter in a sandbox: state persists from one call to the next.

The sandbox lets no process outlive an exec (``clawrl.envs.sandbox``), so there is no interpreter
process to keep between calls. Persistence is rebuilt instead: each call starts a fresh
``python3`` that first replays the episode's earlier *successful* cells with all their output
suppressed (at the file-descriptor level, so subprocesses are silenced too), then runs the new
cell with its output shown. As in a notebook, the value of a final bare expression is printed.

Why replay rather than pickling the namespace: functions, classes, generators and open modules
defined in a cell do not pickle into a fresh process, and replay keeps every kind of state.

What it costs, and what to know:

- **Time**: call k re-runs cells 1..k-1, so an episode of n calls runs O(n^2) cells. Cells that
  compute something quick (the point of a calculator-style tool) cost ~0.1-0.3 s per exec on a
  loaded 2-core box, dominated by starting the sandbox and Python, not by replay. The exec's wall
  clock covers replay and the new cell together.
- **Side effects happen again**: a cell that appends to a file appends once more on every later
  call; anything that reads the clock or the network (there is none) differs. ``random`` is seeded
  (0) before replay so that cells drawing from it rebuild the same state; other generators
  (numpy's) are not. Files written under the working directory persist as files do.
- **Failed cells are not replayed**, so a cell that raised after assigning a variable leaves no
  trace (a notebook would keep the assignment). A cell that succeeded once but fails on replay is
  reported in the next output as a note.
- ``exit()`` inside a cell counts as a failure (the interpreter is the episode's, not the cell's).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from clawrl.envs.sandbox import Sandbox

# Runs inside the sandbox as ``python3 -u -c RUNNER``; the request ({"replay": [...], "cell": ...})
# arrives on stdin, so nothing of the episode lives in files the cells could edit.
RUNNER = r'''
import ast, json, linecache, os, random, sys, traceback
request = json.loads(sys.stdin.read())
sys.stdin = open(os.devnull)
random.seed(0)
namespace = {"__name__": "__main__", "__builtins__": __builtins__}

def run(source, name, show):
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    tree = ast.parse(source, name)
    last = tree.body.pop() if show and tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, name, "exec"), namespace)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), name, "eval"), namespace)
        if value is not None:
            print(repr(value))

shown = os.dup(1)
quiet = os.open(os.devnull, os.O_WRONLY)
failed = []
for i, source in enumerate(request["replay"], 1):
    os.dup2(quiet, 1)
    os.dup2(quiet, 2)
    try:
        run(source, "<cell %d>" % i, False)
    except BaseException as exc:
        failed.append("%d (%s)" % (i, type(exc).__name__))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(shown, 1)
        os.dup2(shown, 2)
if failed:
    print("[note: replaying earlier cell(s) %s failed this time; their state may be missing]" % ", ".join(failed))
sys.stderr = sys.stdout
try:
    run(request["cell"], "<cell %d>" % (len(request["replay"]) + 1), True)
except BaseException as exc:
    tb = exc.__traceback__
    while tb is not None and not tb.tb_frame.f_code.co_filename.startswith("<cell"):
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb, file=sys.stdout)
    sys.stdout.flush()
    os._exit(1)
sys.stdout.flush()
os._exit(0)
'''
# Most characters of a cell's output an observation shows (the tail, where the error is).
OUTPUT_CHARS = 2000


@dataclass(frozen=True)
class CellResult:
    """What one call printed (stdout and stderr, interleaved) and how it ended."""

    output: str
    ok: bool  # ran to the end without an exception
    timed_out: bool
    duration_s: float


class PythonSession:
    """One episode's interpreter in ``sandbox``; each ``run`` is one cell."""

    def __init__(self, sandbox: Sandbox, timeout_s: float):
        self.sandbox, self.timeout_s = sandbox, timeout_s
        self.cells: list[str] = []  # the successful cells so far, replayed before each new one

    async def run(self, code: str) -> CellResult:
        request = json.dumps({"replay": self.cells, "cell": code}).encode()
        result = await self.sandbox.exec(["python3", "-u", "-c", RUNNER], stdin=request, timeout_s=self.timeout_s,
                                         env={"PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"})
        ok = result.returncode == 0 and not result.timed_out
        if ok:
            self.cells.append(code)
        output = result.stdout
        if result.stderr.strip() and not ok:  # the runner itself failed (out of memory, killed)
            output += result.stderr
        return CellResult(output=output, ok=ok, timed_out=result.timed_out, duration_s=result.duration_s)


def render_cell(result: CellResult, timeout_s: float) -> str:
    """A cell's result as the tool message the agent sees."""
    text = result.output.rstrip()
    if len(text) > OUTPUT_CHARS:
        text = f"[... {len(text) - OUTPUT_CHARS} characters cut ...]\n" + text[-OUTPUT_CHARS:]
    if result.timed_out:
        text += f"\n[killed: the cell ran past its {timeout_s:g} s limit; its state is not kept]"
    elif not result.ok and not text:
        text = "[the interpreter died without output; its state is not kept]"
    return text.strip("\n") or "(no output; print() what you want to see)"
