"""Reliability campaign: kill -9 a serving, judging, training server at chosen moments, restart it on
the same run directory, and check that nothing was lost (issue 20, item 1); then hostile requests,
disk-full recoveries and a soak (issue 40, item 7).

    python benchmarks/reliability.py [--kills 30] [--sandbox-kills 10] [--seed 0] [--no-hostile]
                                     [--disk-full 3] [--soak-s 600] [--soak-streams 32]
                                     [--out benchmarks/results/reliability.json] [key=value ...]

A load thread keeps chatting through ``clawrl serve`` (method rl, the rules judge, a train step
every two judged turns, a checkpoint every step): sessions of a question and the user's feedback,
half of them streamed. Each kill waits for a moment in the server's own log, then sends SIGKILL
after a random delay of a few milliseconds:

- ``stream``: while a streamed reply is being sent;
- ``judge``: just after new samples entered the buffer, while they are judged;
- ``train``: just after a batch was taken for a train step (the step, the swap or the save runs);
- ``swap``: as the engine takes the new weights;
- ``checkpoint``: as the step's checkpoint is being written;
- ``sandbox`` (a second server, on toolcall-rl with the embedded model, ``sandbox_campaign``):
  while an episode's sandbox runs its python interpreter.

After each kill, with the server dead, and again after the restart:

1. every acknowledged turn (a 200 reply, a stream that reached ``[DONE]``) is in the store, complete;
2. no sample trains twice on the surviving line: a sample whose train step is at or before the
   checkpoint the restart resumed keeps that step forever (later steps lost with their weights
   may train their samples again; that is the buffer's requeue);
3. the served weights are a complete checkpoint: the served version, through its alias if the
   restart re-served older weights, is a checkpoint whose files verify (or the base model);
4. the run resumes by itself: under the same load, a train step beyond the resumed one happens.

Each kill is reported as survived or, with what was lost, not. Then, on fresh run directories:
the hostile requests of ``benchmarks/hostile.py`` (each handled as issue 40 demands, the server still
serving after it), ``--disk-full`` fills and frees of a tmpfs run directory (``benchmarks/disk_full.py``)
and a soak of ``--soak-streams`` concurrent sessions for ``--soak-s`` seconds while training
(``benchmarks/soak.py``: RSS over time, latency p50/p99, errors). The figures (the tables of
RELIABILITY.md's "Standing campaign") go to stdout and everything to ``--out``.
``tests/test_crash_campaign.py`` runs one kill per moment in CI, ``tests/test_reliability_campaign.py``
the rest of the machinery.
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from clawrl.checkpoints import CheckpointStore, CorruptCheckpoint
from clawrl.config import compose
from clawrl.envs.sandbox_slots import pids_of_uid
from clawrl.store import STORE_FILENAME, TurnStore

MOMENTS = {  # moment -> (a line of the server's log that announces it, the most delay after it, s)
    "stream": (None, 0.0),
    "judge": ("new sample(s)", 0.02),
    "train": ("for training at weight version", 0.15),
    "swap": ("weights updated to version", 0.003),
    "checkpoint": ("trained in step", 0.02),
}
SERVE_OVERRIDES = ["method=rl", "judge.kind=rules", "train.batch_size=2", "train.save_every=1", "train.keep_last=3",
                   "engine.threads=1", "logging.wandb.mode=disabled"]
_RESUMED = re.compile(r"train step (\d+), serving weight version (\d+)")
CLAWRL = [sys.executable, "-c", "import sys; from clawrl.cli import main; sys.exit(main())"]


@dataclass
class Acked:
    """What the server acknowledged: turn ids of 200 replies, and sessions whose stream finished;
    and the requests it did not answer with 200, by status or exception name."""
    turns: set[int] = field(default_factory=set)
    streamed_sessions: list[str] = field(default_factory=list)
    errors: collections.Counter = field(default_factory=collections.Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def error(self, what) -> None:
        with self.lock:
            self.errors[str(what)] += 1


class Server:
    def __init__(self, run_dir: Path, port: int, log: Path, overrides: list[str]):
        self.url, self.log = f"http://127.0.0.1:{port}", log
        self.start_at = log.stat().st_size if log.exists() else 0
        with open(log, "a") as out:
            self.proc = subprocess.Popen([*CLAWRL, "serve", f"run_dir={run_dir}", f"server.port={port}",
                                          *SERVE_OVERRIDES, *overrides], stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited {self.proc.returncode}: {self.text()[-3000:]}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("serve did not come up: " + self.text()[-3000:])
            time.sleep(0.1)

    def text(self) -> str:
        with open(self.log, errors="replace") as f:
            f.seek(self.start_at)
            return f.read()

    def status(self) -> dict:
        return httpx.get(self.url + "/admin/status", timeout=10).json()

    def resumed(self) -> tuple[int, int]:
        """(train step, weight version) the server started from, as its learner logged them (the
        status may already have moved on under load)."""
        deadline = time.monotonic() + 30
        while not (found := _RESUMED.search(self.text())):
            if time.monotonic() > deadline:
                raise RuntimeError("the learner never said where it resumed: " + self.text()[-2000:])
            time.sleep(0.05)
        return int(found[1]), int(found[2])

    def model(self) -> str:
        return httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)


class Load(threading.Thread):
    """Sessions of a question and feedback, one after another, until stopped; every acknowledgment
    is recorded. Connection errors (the server was killed) are expected and only end that session."""

    def __init__(self, url: str, model: str, acked: Acked, rng: random.Random):
        super().__init__(daemon=True)
        self.url, self.model, self.acked, self.rng = url, model, acked, rng
        self.stop = threading.Event()
        self.streaming = threading.Event()  # set while a streamed reply is arriving

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.session()
            except (httpx.HTTPError, ValueError, KeyError) as e:
                self.acked.error(type(e).__name__)
                time.sleep(0.05)

    def session(self) -> None:
        sid = uuid.uuid4().hex
        asked = [{"role": "user", "content": f"Tell me about the number {self.rng.randint(0, 10 ** 6)}."}]
        body = {"model": self.model, "messages": asked, "max_tokens": 24}
        headers = {"X-Session-Id": sid}
        if self.rng.random() < 0.5:
            text = []
            with httpx.stream("POST", self.url + "/v1/chat/completions", json={**body, "stream": True},
                              headers=headers, timeout=30) as r:
                if r.status_code != 200:
                    return self.acked.error(r.status_code)
                for line in r.iter_lines():
                    self.streaming.set()
                    if line == "data: [DONE]":
                        with self.acked.lock:
                            self.acked.streamed_sessions.append(sid)
                    elif line.startswith("data: "):
                        delta = json.loads(line[6:])["choices"]
                        text += [d["delta"].get("content") or "" for d in delta]
                self.streaming.clear()
            reply = "".join(text)
        else:
            r = httpx.post(self.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
            if r.status_code != 200:
                return self.acked.error(r.status_code)
            with self.acked.lock:
                self.acked.turns.update(int(t) for t in r.headers["x-turn-ids"].split(","))
            reply = r.json()["choices"][0]["message"]["content"] or ""
        feedback = self.rng.choice(["Thanks!", "No, that's wrong."])
        r = httpx.post(self.url + "/v1/chat/completions", headers={**headers, "X-Session-Done": "1"}, timeout=30,
                       json={**body, "max_tokens": 1, "messages": asked + [
                           {"role": "assistant", "content": reply}, {"role": "user", "content": feedback}]})
        if r.status_code != 200:
            return self.acked.error(r.status_code)
        with self.acked.lock:
            self.acked.turns.update(int(t) for t in r.headers["x-turn-ids"].split(","))


def wait_for_line(server: Server, needle: str, after: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if needle in server.text()[after:]:
            return True
        time.sleep(0.002)
    return False


def trained_steps(run_dir: Path) -> dict[int, int]:
    with sqlite3.connect(run_dir / STORE_FILENAME) as c:
        return dict(c.execute("SELECT sample_id, train_step FROM samples WHERE state = 'trained'").fetchall())


def lost_turns(run_dir: Path, acked: Acked) -> list[str]:
    """Acknowledged turns missing from the store or not complete, in words."""
    with acked.lock:  # first: what was acknowledged before the read below must be in it
        wanted, streamed = set(acked.turns), list(acked.streamed_sessions)
    store = TurnStore(run_dir, create=False)
    try:
        turns = {t["turn_id"]: t for t in store.iter_turns()}
    finally:
        store.close()
    lost = [f"turn {t}" for t in sorted(wanted) if turns.get(t, {}).get("status") != "complete"]
    complete_by_session: dict[str, int] = {}
    for t in turns.values():
        if t["status"] == "complete":
            complete_by_session[t["session_id"]] = complete_by_session.get(t["session_id"], 0) + 1
    for s in streamed:
        if not complete_by_session.get(s):
            mine = [(t["turn_id"], t["status"]) for t in turns.values() if t["session_id"] == s]
            lost.append(f"streamed turn of session {s} (its turns: {mine or 'none'})")
    return lost


def trained_again(locked: dict[int, int], now: dict[int, int]) -> list[str]:
    """Samples whose train step on the surviving line changed: each one trained twice."""
    return [f"sample {s} trained in step {step} was trained again (now step {now.get(s)})"
            for s, step in locked.items() if now.get(s) != step]


def served_weights_problem(run_dir: Path, version: int) -> str | None:
    """None when ``version`` serves a checkpoint whose files verify (or the base model)."""
    with sqlite3.connect(run_dir / STORE_FILENAME) as c:
        aliases = dict(c.execute("SELECT version, source FROM weight_aliases").fetchall())
    source = version
    while source in aliases:
        source = aliases[source]
    if source == 0:
        return None
    checkpoints = CheckpointStore(run_dir, compose(SERVE_OVERRIDES).train)
    for step in checkpoints.steps():
        manifest = checkpoints.manifest(step) or {}
        if manifest.get("weight_version") == source:
            try:
                checkpoints.verify(step)
            except CorruptCheckpoint as e:
                return f"served version {version} is checkpoint step_{step}, which does not verify: {e}"
            return None
    return f"served version {version} (weights of version {source}) is no checkpoint on disk"


def campaign(run_dir: Path, kills: int, seed: int, overrides: list[str], log: Path, progress=print) -> list[dict]:
    rng = random.Random(seed)
    acked = Acked()
    locked: dict[int, int] = {}  # sample -> the train step it has on the surviving line, for good
    results = []
    moments = list(MOMENTS)
    port = _free_port()
    server = Server(run_dir, port, log, overrides)
    load = Load(server.url, server.model(), acked, rng)
    load.start()
    try:
        for k in range(kills):
            moment = moments[k % len(moments)]
            needle, delay = MOMENTS[moment]
            mark = len(server.text())
            if needle is None:
                hit = load.streaming.wait(60)
            else:
                hit = wait_for_line(server, needle, mark, 90)
            time.sleep(rng.uniform(0, delay))
            server.kill()
            lost = lost_turns(run_dir, acked)
            twice = trained_again(locked, trained_steps(run_dir))
            problems = lost + twice

            server = Server(run_dir, port, log, overrides)  # the same port: the load goes on
            resumed, version = server.resumed()
            problems += [p for p in [served_weights_problem(run_dir, version)] if p]
            after = trained_steps(run_dir)
            locked.update({s: step for s, step in after.items() if step <= resumed})
            deadline = time.monotonic() + 120
            while server.status()["training"]["train_step"] <= resumed:
                if time.monotonic() > deadline:
                    problems.append(f"no train step after resuming at step {resumed}")
                    break
                time.sleep(0.2)
            lost_later = [t for t in lost_turns(run_dir, acked) if t not in lost]
            problems += lost_later
            results.append({"kill": k + 1, "moment": moment, "moment_seen": hit, "resumed_step": resumed,
                            "served_version": version, "acked_turns": len(acked.turns),
                            "acked_streams": len(acked.streamed_sessions), "turns_lost": len(lost + lost_later),
                            "trained_twice": len(twice), "problems": problems})
            progress(f"kill {k + 1}/{kills} ({moment}{'' if hit else ', moment not seen'}): resumed at step "
                     f"{resumed}, version {version}: "
                     + ("survived" if not problems else "; ".join(problems)))
    finally:
        load.stop.set()
        server.kill()
        load.join(30)
    return results


SANDBOX_OVERRIDES = ["env.name=toolcall", f"env.tasks={Path(__file__).resolve().parent.parent / 'toolcall-rl'}",
                     "env.group_size=2", "env.groups_in_flight=2", "env.max_turns=3", "env.max_tokens_per_turn=64"]


def sandbox_pids(server_pid: int, uid_base: int = 61000, slots: int = 32) -> set[int]:
    """Live processes of the sandbox uids (``sandbox.uid_base`` and ``sandbox.slots`` defaults)
    that descend from ``server_pid``: the slots are host-wide, and another server's sandboxes are
    not this one's."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat[stat.rindex(")") + 2:].split()[1])

    def descends(pid: int) -> bool:
        for _ in range(64):
            pid = parents.get(pid, 0)
            if pid == server_pid:
                return True
            if pid <= 1:
                return False
        return False

    return {p for uid in range(uid_base, uid_base + slots) for p in pids_of_uid(uid) if descends(p)}


def still_alive(pids: set[int], uid_base: int = 61000, slots: int = 32) -> set[int]:
    """Those of ``pids`` that still run as a sandbox uid (a reused pid would have another uid)."""
    return {p for uid in range(uid_base, uid_base + slots) for p in pids_of_uid(uid)} & pids


def episode_states(run_dir: Path) -> dict[int, str]:
    with sqlite3.connect(run_dir / STORE_FILENAME) as c:
        return dict(c.execute("SELECT episode_id, state FROM episodes").fetchall())


def sandbox_campaign(run_dir: Path, kills: int, seed: int, overrides: list[str], log: Path,
                     progress=print) -> list[dict]:
    """Kill -9 while a toolcall-rl episode's sandbox (its persistent python interpreter, a tool
    call) is running, as root (each sandbox has its own uid, which is how the moment is seen).
    Checks: no sandbox process outlives the server, every finished episode stays as it was, every
    running one is marked aborted on restart, no sample trains twice on the surviving line, the
    served weights are a complete checkpoint, and rollouts resume (new episodes finish)."""
    rng = random.Random(seed)
    overrides = SANDBOX_OVERRIDES + list(overrides)
    locked: dict[int, int] = {}
    results = []
    port = _free_port()
    server = Server(run_dir, port, log, overrides)
    try:
        for k in range(kills):
            deadline = time.monotonic() + 120
            while not (hit := bool(sandbox_pids(server.proc.pid))) and time.monotonic() < deadline:
                time.sleep(0.005)
            time.sleep(rng.uniform(0, 0.05))
            ours = sandbox_pids(server.proc.pid)
            server.kill()
            problems = []
            time.sleep(1.0)  # bwrap's --die-with-parent takes the namespace down with the server
            if orphans := still_alive(ours):
                problems.append(f"{len(orphans)} of its {len(ours)} sandbox process(es) outlived the server")
            before = episode_states(run_dir)
            twice = trained_again(locked, trained_steps(run_dir))
            problems += twice

            server = Server(run_dir, port, log, overrides)
            resumed, version = server.resumed()
            problems += [p for p in [served_weights_problem(run_dir, version)] if p]
            locked.update({s: step for s, step in trained_steps(run_dir).items() if step <= resumed})
            finished_before = sum(st in ("finished", "failed") for st in before.values())
            deadline = time.monotonic() + 180
            while True:
                after = episode_states(run_dir)
                done = sum(st in ("finished", "failed") for st in after.values())
                if done > finished_before:
                    break
                if time.monotonic() > deadline:
                    problems.append("no episode finished after the restart")
                    break
                time.sleep(0.2)
            problems += [f"episode {e} was {st} and is now {after.get(e)}" for e, st in before.items()
                         if st in ("finished", "failed") and after.get(e) != st]
            problems += [f"episode {e} was running at the kill and is now {after.get(e)}"
                         for e, st in before.items() if st == "running" and after.get(e) != "aborted"]
            running = sum(st == "running" for st in before.values())
            results.append({"kill": k + 1, "moment": "sandbox", "moment_seen": hit, "resumed_step": resumed,
                            "served_version": version, "episodes_running_at_kill": running,
                            "turns_lost": 0, "trained_twice": len(twice),
                            "episodes_finished": finished_before, "problems": problems})
            progress(f"sandbox kill {k + 1}/{kills}{'' if hit else ' (no sandbox seen)'}: {running} episode(s) "
                     f"running, {finished_before} finished; resumed at step {resumed}: "
                     + ("survived" if not problems else "; ".join(problems)))
    finally:
        server.kill()
    return results


def summary(results: list[dict]) -> list[dict]:
    rows = []
    for moment in [*MOMENTS, "sandbox"]:
        mine = [r for r in results if r["moment"] == moment]
        if mine:
            rows.append({"moment": moment, "tried": len(mine), "moment_seen": sum(r["moment_seen"] for r in mine),
                         "survived": sum(not r["problems"] for r in mine),
                         "lost": sum(len(r["problems"]) for r in mine)})
    return rows


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sibling(name: str):
    """``benchmarks/<name>.py`` as module ``name`` (this directory is no package); they import this
    module as ``reliability``, so it is registered under that name first."""
    sys.modules.setdefault("reliability", sys.modules[__name__])
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def hostile_campaign(run_dir: Path, overrides: list[str], log: Path, progress=print) -> list[dict]:
    """The hostile requests against one training server; one that stops it serving gets a restart."""
    port = _free_port()
    server = Server(run_dir, port, log, overrides)

    def revive() -> str:
        nonlocal server
        server.kill()
        server = Server(run_dir, port, log, overrides)
        return server.url

    try:
        return sibling("hostile").run_cases(server.url, server.model(), revive, progress)
    finally:
        server.kill()


def figures(out: dict) -> str:
    """The standing campaign's figures as RELIABILITY.md shows them."""
    kills = out.get("results", [])
    lines = ["| kills (kill -9) | acknowledged turns lost | samples trained twice |", "|---:|---:|---:|",
             f"| {len(kills)} | {sum(r.get('turns_lost', 0) for r in kills)} | "
             f"{sum(r.get('trained_twice', 0) for r in kills)} |", ""]
    hostile = out.get("hostile", [])
    lines += [f"Hostile cases: {sum(r['handled'] for r in hostile)} of {len(hostile)} handled.", "",
              "| hostile case | handled | what happened |", "|---|---|---|"]
    lines += [f"| {r['case']} | {'yes' if r['handled'] else 'NO'} | {r['detail'].replace('|', '/')} |" for r in hostile]
    disk = out.get("disk_full", {"cycles": []})
    recovered = sum(not c["problems"] for c in disk["cycles"])
    lines += ["", f"Disk-full recoveries: {recovered} of {len(disk['cycles'])}"
              + (f" (not run: {disk['skipped']})" if disk.get("skipped") else "") + "."]
    soak = out.get("soak")
    if soak:
        errors = sum(soak["errors"].values())
        lines += ["", "| streams | seconds | requests | latency p50 / p99 | train steps | RSS start / peak / end "
                  "| RSS slope, second half | errors | turns lost |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
                  f"| {soak['sessions']} | {soak['seconds']:.0f} | {soak['requests']} | {soak['latency_p50_s']} s / "
                  f"{soak['latency_p99_s']} s | {soak['train_steps']} | {soak['rss_mb_first']} / {soak['rss_mb_peak']} / "
                  f"{soak['rss_mb_last']} MB | {soak['rss_slope_second_half_mb_per_min']:+} MB/min | {errors} "
                  f"{dict(soak['errors']) or ''} | {len(soak['lost'])} |"]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run-dir", help="where the run lives (default: a new temporary directory)")
    ap.add_argument("--out", default=str(Path(__file__).with_name("results") / "reliability.json"))
    ap.add_argument("--sandbox-kills", type=int, default=10,
                    help="kills during toolcall-rl episodes in their sandboxes (as root; 0: none)")
    ap.add_argument("--sandbox-model", help="model.path of the sandbox campaign (default: the embedded model, "
                    "which calls its python tool)")
    ap.add_argument("--no-hostile", action="store_true", help="skip the hostile requests (benchmarks/hostile.py)")
    ap.add_argument("--disk-full", type=int, default=3, help="fills and frees of a tmpfs run directory (0: none)")
    ap.add_argument("--soak-s", type=float, default=600.0, help="seconds of the soak while training (0: none)")
    ap.add_argument("--soak-streams", type=int, default=32, help="concurrent sessions of the soak")
    ap.add_argument("overrides", nargs="*", help="key=value for clawrl serve (model.path=..., ...)")
    args = ap.parse_args(argv)
    import tempfile
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="clawrl-crash-"))
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = run_dir.parent / f"{run_dir.name}-serve.log"
    started = time.monotonic()
    results = campaign(run_dir, args.kills, args.seed, args.overrides, log) if args.kills else []
    if args.sandbox_kills:
        env_dir = run_dir.with_name(run_dir.name + "-sandbox")
        model = [f"model.path={args.sandbox_model}"] if args.sandbox_model else []
        results += sandbox_campaign(env_dir, args.sandbox_kills, args.seed, model, env_dir.parent / (
            env_dir.name + "-serve.log"))
    rows = summary(results)
    print("| moment | kills | moment seen | survived | lost |\n|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['moment']} | {r['tried']} | {r['moment_seen']} | {r['survived']} | {r['lost']} |")
    out = {"kills": args.kills, "seed": args.seed, "overrides": args.overrides,
           "acked_turns": max((r.get("acked_turns", 0) for r in results), default=0), "summary": rows, "results": results,
           "command": "python benchmarks/reliability.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    failed = any(r["problems"] for r in results)
    if not args.no_hostile:
        out["hostile"] = hostile_campaign(run_dir.with_name(run_dir.name + "-hostile"), args.overrides,
                                          run_dir.parent / f"{run_dir.name}-hostile-serve.log")
        failed |= not all(r["handled"] for r in out["hostile"])
    if args.disk_full:
        out["disk_full"] = sibling("disk_full").disk_full_campaign(
            run_dir.with_name(run_dir.name + "-tmpfs"), args.disk_full, args.seed, args.overrides,
            run_dir.parent / f"{run_dir.name}-disk-full-serve.log")
        failed |= any(c["problems"] for c in out["disk_full"]["cycles"])
    if args.soak_s:
        soak = sibling("soak").soak(run_dir.with_name(run_dir.name + "-soak"), args.soak_streams, args.soak_s,
                                    2.0, args.overrides, run_dir.parent / f"{run_dir.name}-soak-serve.log")
        out["soak"] = soak
        failed |= bool(soak["lost"])
    out["wall_s"] = round(time.monotonic() - started, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(figures(out))
    print(f"{sum(r['survived'] for r in rows)}/{len(results)} kills survived; campaign {out['wall_s']} s; "
          f"figures in {args.out}; server logs beside {run_dir}")
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
