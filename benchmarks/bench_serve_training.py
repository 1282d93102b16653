"""Serving while training, through the real launch path: ``bash <recipe>/run.sh`` as a user starts
it, driven by the demo's simulated users over HTTP. What does training cost the people chatting?

After ``--warmup-seconds`` of unmeasured load, two phases under the same load, in one run: training
paused (``POST /admin/pause``: the baseline; judging and the teacher's scoring still run) and
training on (``POST /admin/resume``). Each of ``--sessions`` concurrent users asks an addition
question, reads the reply and answers with its natural feedback (``clawrl.demo.users``), which
closes the turn so it is judged and trained; every ``--stream-every``-th question is streamed (time
to first token). Every request's latency and status is kept; a failure is a non-200, an error event
in a stream, no answer at all, or a 200 without a reply. ``/admin/status`` is polled throughout
(weight version, train step, samples). Prints per phase: requests, failures, reply length (a model
that learns shorter answers serves faster), latency p50/p99, TTFT p50/p99, and while training:
steps, weight versions served and samples trained per minute; then p99(training) / p99(paused).
Finally SIGTERM must stop the server with status 0 and leave no process of the run behind (trainer
ranks included); the exit status is 1 when a request failed or the stop was not clean.

Samples judged while paused wait as a backlog that trains right after the resume (those more than
``train.max_weight_lag`` versions old by then are skipped as stale, and counted, as are the
feedback turns, which end their session and so never get a next state).

    python benchmarks/bench_serve_training.py [--recipe openclaw-combine] [--sessions 4] [--seconds 30]
        [--batch-size 4] [--json OUT] [--run-dir DIR] [key=value ...]
    # megatron, two gloo ranks on CPU:
    python benchmarks/bench_serve_training.py trainer.backend=megatron cluster.tp=2 cluster.procs_per_node=2
    # GPUs, from a checkout that is not pip-installed (run.sh falls back to `python3 -m clawrl.cli`):
    PYTHONPATH=core python benchmarks/bench_serve_training.py model.path=/models/Qwen3-1.7B model.device=cuda ...

Overrides pass through to run.sh after the benchmark's own (``run_dir``, ``server.host=127.0.0.1``,
``server.port=0``, ``train.batch_size``, ``logging.wandb.mode=disabled``), so they win. With
``server.api_key`` / ``server.admin_key`` among them, their first key is sent as the bearer.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from clawrl.demo.users import ask, make_user

ROOT = Path(__file__).resolve().parent.parent
SERVING = re.compile(r"clawrl: serving (\S+) at (http://\S+)/v1 ")
# The server's own account of what runs where (the engine's device, the trainer and its layout).
PLACEMENT = re.compile(r" INFO (clawrl\.engines\.loading: loaded .*|clawrl\.trainers\S*: "
                       r"(?:torch trainer|megatron trainer ranks starting).*)$", re.M)
TEMPERATURE = 1.0  # what a client that sets nothing samples at (as the demo)


@dataclass
class Request:
    phase: str
    kind: str  # question | feedback
    stream: bool
    status: int  # HTTP status; 0: no answer (connection error, timeout)
    ok: bool
    latency_s: float
    ttft_s: float | None  # streams: first content delta
    tokens: int | None  # completion tokens (usage)
    fingerprint: str | None  # clawrl-w<weight version> that answered
    error: str | None
    started: float  # seconds since the benchmark's clock started


# ------------------------------------------------------------------ the server, as run.sh starts it

def start_server(recipe: Path, overrides: list[str], run_dir: Path, log: Path) -> subprocess.Popen:
    """``bash <recipe>/run.sh`` in a session of its own (so its process group can be killed), with
    ``core`` on PYTHONPATH as an absolute path: a checkout that is not pip-installed still imports."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "core"), env.get("PYTHONPATH", "")) if p)
    with open(log, "w") as out:
        return subprocess.Popen(["bash", str(recipe / "run.sh"), *overrides], env=env, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(proc: subprocess.Popen, log: Path, headers: dict, timeout: float) -> tuple[str, str]:
    """The endpoint the server printed, once ``/admin/status`` answers there: (base url, model)."""
    deadline = time.monotonic() + timeout
    found = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before it was ready:\n{tail(log)}")
        found = found or SERVING.search(log.read_text(errors="replace"))
        if found:
            try:
                if httpx.get(found.group(2) + "/admin/status", headers=headers, timeout=10).status_code == 200:
                    return found.group(2), found.group(1)
            except httpx.TransportError:
                pass
        time.sleep(0.5)
    raise SystemExit(f"the server was not ready within {timeout:g} s:\n{tail(log)}")


def tail(log: Path, chars: int = 4000) -> str:
    return log.read_text(errors="replace")[-chars:]


def parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[1])  # a zombie has exited


def live_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def descendants(root: int) -> set[int]:
    """Every live process below ``root``: torchrun agents and ranks run in sessions of their own,
    so the process tree, not the process group, finds them."""
    parents = {pid: parent_of(pid) for pid in live_pids()}
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def processes_of(run_dir: Path) -> set[int]:
    """Live processes whose command line names ``run_dir`` (the ranks' config and logs are under
    it), whoever their parent is now: an orphaned rank is found too. This process and its
    ancestors are never counted (a wrapper such as ``timeout`` may name ``--run-dir`` too)."""
    ours, pid = set(), os.getpid()
    while pid and pid not in ours:
        ours.add(pid)
        pid = parent_of(pid) or 0
    mine = set()
    for pid in set(live_pids()) - ours:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if str(run_dir) in cmdline and parent_of(pid) is not None:
            mine.add(pid)
    return mine


def alive(pids: set[int]) -> set[int]:
    return {pid for pid in pids if parent_of(pid) is not None}


def stop_server(proc: subprocess.Popen, run_dir: Path, timeout: float) -> dict:
    """SIGTERM, as an operator stops it (run.sh execs the server: the signal reaches it); then what
    is left of everything it had started."""
    started = descendants(proc.pid) | processes_of(run_dir)
    proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        code = None
    took = time.monotonic() - t0
    time.sleep(1.0)  # ranks exit once their agent is gone; give them a moment before counting
    left = sorted(alive(started) | processes_of(run_dir))
    return {"exit_code": code, "stop_s": round(took, 1), "processes_started": len(started), "processes_left": left}


def kill_everything(proc: subprocess.Popen, run_dir: Path) -> None:
    """The last resort in ``finally``: the server's process group, then each process of the run."""
    pids = descendants(proc.pid) | processes_of(run_dir)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in sorted(pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if proc.poll() is None:
        proc.wait(30)


# ------------------------------------------------------------------ the load: simulated users

class Load:
    """``sessions`` simulated users chatting concurrently, each in its own thread and connection."""

    def __init__(self, url: str, model: str, headers: dict, args, clock: float):
        self.url, self.model, self.headers, self.args, self.clock = url, model, headers, args, clock
        self.user = make_user(args.user)
        self.requests: list[Request] = []
        self._lock = threading.Lock()

    def run_phase(self, phase: str, seconds: float, at_least: int = 0) -> float:
        """Every session chats until ``seconds`` have passed (an interaction under way finishes) and
        it has had ``at_least`` interactions. Returns the phase's wall time."""
        t0 = time.monotonic()
        threads = [threading.Thread(target=self._session, args=(phase, k, t0 + seconds, at_least), daemon=True)
                   for k in range(self.args.sessions)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.monotonic() - t0

    def _session(self, phase: str, k: int, deadline: float, at_least: int) -> None:
        rng = random.Random(f"bench-{self.args.seed}-{phase}-{k}")
        with httpx.Client(base_url=self.url, headers=self.headers, timeout=self.args.request_timeout) as client:
            i = 0
            while i < at_least or time.monotonic() < deadline:
                q = ask(rng, held_out=False)
                session = {"X-Session-Id": f"bench-{phase}-{k}-{i}"}
                asked = [{"role": "user", "content": q.text}]
                stream = self.args.stream_every > 0 and (k + i) % self.args.stream_every == 0
                reply = self._chat(client, phase, "question", stream, session, {
                    "model": self.model, "messages": asked, "max_tokens": self.args.max_tokens,
                    "temperature": TEMPERATURE, "seed": rng.randrange(1 << 31)})
                if reply is not None:
                    # The feedback is the next state of the reply's turn and ends the session, so the
                    # model's one-token answer to it is stored but never judged (as the demo does).
                    self._chat(client, phase, "feedback", False, {**session, "X-Session-Done": "1"}, {
                        "model": self.model, "max_tokens": 1, "temperature": TEMPERATURE,
                        "messages": asked + [{"role": "assistant", "content": reply},
                                             {"role": "user", "content": self.user.feedback(q, reply, rng)}]})
                else:
                    time.sleep(0.5)  # a server that is gone fails fast: do not spin on it
                i += 1

    def _chat(self, client: httpx.Client, phase: str, kind: str, stream: bool, headers: dict, body: dict) -> str | None:
        """One request, recorded; returns the reply text, or None when it failed."""
        t0 = time.monotonic()
        status, ttft, fingerprint, error, reply, tokens = 0, None, None, None, None, None
        try:
            if stream:
                status, ttft, fingerprint, reply, tokens, error = self._streamed(client, headers, body, t0)
            else:
                r = client.post("/v1/chat/completions", headers=headers, json=body)
                status = r.status_code
                if r.status_code == 200:
                    out = r.json()
                    fingerprint = out.get("system_fingerprint")
                    tokens = (out.get("usage") or {}).get("completion_tokens")
                    choices = out.get("choices") or []
                    reply = choices[0].get("message", {}).get("content") if choices else None
                    if reply is None:
                        error = "200 without a reply"
                else:
                    error = r.text[:200]
        except (httpx.HTTPError, ValueError) as e:
            error = f"{type(e).__name__}: {e}"[:200]
        latency = time.monotonic() - t0
        ok = status == 200 and error is None
        with self._lock:
            self.requests.append(Request(phase, kind, stream, status, ok, latency, ttft, tokens, fingerprint, error,
                                         round(t0 - self.clock, 3)))
        return reply if ok else None

    @staticmethod
    def _streamed(client: httpx.Client, headers: dict, body: dict, t0: float):
        status, ttft, fingerprint, tokens, parts, finished, done = 0, None, None, None, [], False, False
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with client.stream("POST", "/v1/chat/completions", headers=headers, json=body) as r:
            status = r.status_code
            if status != 200:
                return status, None, None, None, None, r.read().decode(errors="replace")[:200]
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    return status, ttft, fingerprint, None, None, f"error event: {json.dumps(event['error'])[:180]}"
                fingerprint = fingerprint or event.get("system_fingerprint")
                tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
                for choice in event.get("choices") or []:
                    text = choice.get("delta", {}).get("content")
                    if text:
                        ttft = ttft if ttft is not None else time.monotonic() - t0
                        parts.append(text)
                    finished = finished or choice.get("finish_reason") is not None
        if not (done and finished):
            return status, ttft, fingerprint, None, None, "stream ended without finish_reason and [DONE]"
        return status, ttft, fingerprint, "".join(parts), tokens, None


class StatusPoller:
    """``/admin/status`` every ``every`` seconds in a thread: the training timeline."""

    def __init__(self, url: str, headers: dict, clock: float, every: float = 1.0):
        self.url, self.headers, self.clock, self.every = url, headers, clock, every
        self.phase = "warm-up"
        self.timeline: list[dict] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(headers=self.headers, timeout=30) as client:
            while not self._stop.wait(self.every):
                try:
                    self.timeline.append({"t": round(time.monotonic() - self.clock, 2), "phase": self.phase,
                                          **summary(client.get(self.url + "/admin/status").json())})
                except (httpx.HTTPError, ValueError, KeyError):
                    self.errors += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)


def summary(status: dict) -> dict:
    t = status["training"]
    s = t.get("samples", {})
    return {"weight_version": status["weight_version"], "train_step": t.get("train_step", 0),
            "trained": s.get("trained", 0), "skipped": s.get("skipped_by_reason", {}), "judged": s.get("judged", 0),
            "ready": s.get("ready", 0), "paused": t.get("paused")}


# ------------------------------------------------------------------ results

def percentile(values: list[float], q: float) -> float | None:
    """Nearest rank: the smallest value with at least ``q`` of the values at or below it."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def phase_result(requests: list[Request], wall_s: float, before: dict, after: dict) -> dict:
    done = [r for r in requests if r.ok]
    latencies = [r.latency_s for r in done]
    questions = [r.latency_s for r in done if r.kind == "question"]
    ttfts = [r.ttft_s for r in done if r.stream and r.ttft_s is not None]
    failures = [r for r in requests if not r.ok]
    trained = after["trained"] - before["trained"]
    replies = [r.tokens for r in done if r.kind == "question" and r.tokens is not None]
    skipped = {k: n - before["skipped"].get(k, 0) for k, n in after["skipped"].items()}
    skipped = {k: n for k, n in skipped.items() if n > 0}
    return {
        "wall_s": round(wall_s, 1), "requests": len(requests), "failures": len(failures),
        "failure_examples": sorted({f"{r.status}: {r.error}" for r in failures})[:5],
        "interactions": sum(r.kind == "question" for r in requests), "streamed": sum(r.stream for r in requests),
        "requests_per_s": round(len(requests) / wall_s, 2),
        "reply_tokens_mean": round(sum(replies) / len(replies), 1) if replies else None,
        "tokens_per_s": round(sum(r.tokens or 0 for r in done) / wall_s, 1),
        "latency_p50_s": percentile(latencies, 0.5), "latency_p99_s": percentile(latencies, 0.99),
        "question_p50_s": percentile(questions, 0.5), "question_p99_s": percentile(questions, 0.99),
        "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p99_s": percentile(ttfts, 0.99),
        "weight_versions_served": sorted({int(r.fingerprint.rsplit("w", 1)[1]) for r in done if r.fingerprint}),
        "train_steps": after["train_step"] - before["train_step"],
        "weight_version": [before["weight_version"], after["weight_version"]],
        "samples_trained": trained, "samples_skipped": skipped,
        "samples_trained_per_min": round(60 * trained / wall_s, 1),
        # of the judged samples a step reached in this phase, the share dropped for exceeding max_weight_lag
        "stale_fraction": round(skipped.get("stale", 0) / (trained + skipped.get("stale", 0)), 4)
        if trained + skipped.get("stale", 0) else None,
    }


def ms(v: float | None) -> str:
    return "-" if v is None else f"{1000 * v:.0f} ms"


def print_phase(name: str, p: dict) -> None:
    print(f"{name}: {p['requests']} requests ({p['interactions']} questions, {p['streamed']} streamed) in "
          f"{p['wall_s']:.0f} s, {p['failures']} failed; replies {p['reply_tokens_mean']} tokens on average, "
          f"{p['tokens_per_s']} tokens/s; latency p50 {ms(p['latency_p50_s'])} p99 "
          f"{ms(p['latency_p99_s'])}; question p50 {ms(p['question_p50_s'])} p99 {ms(p['question_p99_s'])}; "
          f"TTFT p50 {ms(p['ttft_p50_s'])} p99 {ms(p['ttft_p99_s'])}", flush=True)
    for example in p["failure_examples"]:
        print(f"  failed: {example}")


def measure(url: str, model: str, args, chat_headers: dict, admin_headers: dict, clock: float) -> dict:
    """The warm-up, then the paused and the training phase under the same load; prints each."""
    with httpx.Client(base_url=url, headers=admin_headers, timeout=60) as admin:
        if not admin.get("/admin/status").json()["training"]["enabled"]:
            raise SystemExit("training is disabled on this server (train.enabled=false): nothing to compare")
        admin.post("/admin/pause").raise_for_status()
        poller = StatusPoller(url, admin_headers, clock)
        try:
            load = Load(url, model, chat_headers, args, clock)
            # Not measured: first-request costs and a cold prefix cache would land in the baseline only.
            load.run_phase("warm-up", args.warmup_seconds, at_least=1)
            phases = {}
            phase_plan = (("paused", "training paused", None), ("training", "training on", "/admin/resume"))
            for name, label, switch in phase_plan:
                if switch:
                    admin.post(switch).raise_for_status()
                poller.phase = name
                before = summary(admin.get("/admin/status").json())
                wall = load.run_phase(name, args.seconds)
                after = summary(admin.get("/admin/status").json())
                phases[name] = phase_result([r for r in load.requests if r.phase == name], wall, before, after)
                print_phase(label, phases[name])
        finally:
            poller.stop()
    t = phases["training"]
    served = t["weight_versions_served"]
    versions = f"{len(served)} versions served" + (f" (w{served[0]}..w{served[-1]})" if served else "")
    skipped = ", ".join(f"{k} {n}" for k, n in sorted(t["samples_skipped"].items())) or "none"
    stale = "-" if t["stale_fraction"] is None else f"{t['stale_fraction']:.1%}"
    print(f"training on: {t['train_steps']} train steps, weight version {t['weight_version'][0]} -> "
          f"{t['weight_version'][1]}, {versions}; {t['samples_trained']} samples trained "
          f"({t['samples_trained_per_min']:.1f} per minute); turns skipped: {skipped}; dropped as stale: {stale}",
          flush=True)
    base, loaded = phases["paused"]["latency_p99_s"], t["latency_p99_s"]
    ratio = loaded / base if base and loaded else None
    print(f"latency p99 training / paused: {'-' if ratio is None else f'{ratio:.2f}'} ({ms(loaded)} / {ms(base)})",
          flush=True)
    return {"phases": phases, "p99_ratio_training_over_paused": ratio, "status_timeline": poller.timeline,
            "status_poll_errors": poller.errors, "requests": [asdict(r) for r in load.requests]}


def bearer(overrides: list[str]) -> tuple[dict, dict]:
    """(chat headers, admin headers) from ``server.api_key`` / ``server.admin_key`` among the
    overrides (their first key), as the server checks them. The API key never opens /admin; the
    benchmark's server is on loopback, where /admin needs no key unless server.admin_key is set."""
    keys = {k: v for k, v in (o.split("=", 1) for o in overrides if "=" in o)}
    api = (keys.get("server.api_key") or "").split(",")[0].strip()
    admin = (keys.get("server.admin_key") or "").split(",")[0].strip()
    auth = lambda key: {"Authorization": f"Bearer {key}"} if key else {}  # noqa: E731
    return auth(api), auth(admin)


def commit() -> str:
    out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="openclaw-combine", help="method directory whose run.sh starts the server")
    ap.add_argument("--sessions", type=int, default=4, help="concurrent simulated users")
    ap.add_argument("--seconds", type=float, default=30, help="length of each phase")
    ap.add_argument("--warmup-seconds", type=float, default=10, help="unmeasured load first, training paused")
    ap.add_argument("--batch-size", type=int, default=4, help="train.batch_size (an override wins)")
    ap.add_argument("--max-tokens", type=int, default=24, help="most tokens of a reply to a question")
    ap.add_argument("--stream-every", type=int, default=2, help="stream every Nth question (0: none)")
    ap.add_argument("--user", default="student", help="simulated user (clawrl.demo.users)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run-dir", default=None, help="the server's run_dir (default: a fresh temp directory)")
    ap.add_argument("--json", default=None, help="write the numbers here")
    ap.add_argument("--ready-timeout", type=float, default=900, help="seconds for the server to come up")
    ap.add_argument("--request-timeout", type=float, default=300)
    ap.add_argument("overrides", nargs="*", help="key=value overrides for run.sh, e.g. trainer.backend=megatron")
    args = ap.parse_args()
    recipe = (ROOT / args.recipe) if not Path(args.recipe).is_dir() else Path(args.recipe)
    if not (recipe / "run.sh").is_file():
        ap.error(f"no run.sh in {recipe}")
    if args.sessions < 1 or args.seconds <= 0 or args.batch_size < 1:
        ap.error("--sessions and --batch-size must be >= 1 and --seconds > 0")
    make_user(args.user)  # an unknown user is refused before anything starts
    run_dir = Path(args.run_dir).resolve() if args.run_dir else Path(tempfile.mkdtemp(prefix="bench-serve-training-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "bench-server.log"
    overrides = [f"run_dir={run_dir}", "server.host=127.0.0.1", "server.port=0", f"train.batch_size={args.batch_size}",
                 "logging.wandb.mode=disabled", *args.overrides]
    chat_headers, admin_headers = bearer(overrides)
    command = " ".join(["bash", str(recipe.relative_to(ROOT) if recipe.is_relative_to(ROOT) else recipe) + "/run.sh",
                        *overrides])
    print(f"# bench_serve_training: commit {commit()}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs; {args.sessions} sessions x {args.seconds:g} s per phase, user '{args.user}'")
    print(f"# server: {command}\n# server log: {log}", flush=True)

    clock = time.monotonic()
    proc = start_server(recipe, overrides, run_dir, log)
    try:
        url, model = wait_ready(proc, log, admin_headers, args.ready_timeout)
        print(f"ready in {time.monotonic() - clock:.0f} s: {model} at {url}", flush=True)
        placement = PLACEMENT.findall(log.read_text(errors="replace"))
        print("\n".join(f"# {line}" for line in placement), flush=True)
        result = {"commit": commit(), "command": command, "args": vars(args), "model": model, "placement": placement,
                  **measure(url, model, args, chat_headers, admin_headers, clock)}
        stop = result["stop"] = stop_server(proc, run_dir, timeout=120)
        print(f"SIGTERM: exit {stop['exit_code']} after {stop['stop_s']} s; {stop['processes_started']} processes "
              f"below the server, {len(stop['processes_left'])} left {stop['processes_left'] or ''}", flush=True)
    finally:
        kill_everything(proc, run_dir)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"numbers in {args.json}")
    failed = sum(not r["ok"] for r in result["requests"])  # the warm-up's too
    clean = stop["exit_code"] == 0 and not stop["processes_left"]
    if failed or not clean:
        print(f"NOT CLEAN: {failed} failed requests; server exit {stop['exit_code']}, "
              f"{len(stop['processes_left'])} processes left\n{tail(log, 2000)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
