"""The megatron backend launched as a user launches it: ``run.sh`` with the multi-node variables.

Two nodes on loopback (NODE_RANK 1 first, then the driver on NODE_RANK 0) serve chats, train a
step with tp=2 across the nodes and serve the new weights without failing a request; SIGTERM to
node 0 stops both nodes cleanly and leaves no torchrun agent or rank behind. The Combine recipe
does the same on one node with two ranks, and a NODE_RANK=1 whose MASTER_ADDR never answers is
refused in one line before any process group forms.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

pytest.importorskip("megatron.core")

from engine_testing import make_model_dir  # noqa: E402
from gateway_support import free_port  # noqa: E402
from recipe_support import wait_until  # noqa: E402

from clawrl.cluster.launch import free_ports  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LAUNCH_VARS = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GPUS_PER_NODE", "CLAWRL_CLUSTER_KEY")
# Feedback the rules judge rewards (+1 / -1), so each closed turn becomes a training sample.
RL_TURNS = (("Hi", "Thanks!"), ("What is 7+5?", "No, that's wrong."))
# Combine: two corrections give hints (OPD) and a reward; the thanks gives only a reward.
COMBINE_TURNS = (("Hi", "Too long. One line, please."), ("What is 7+5?", "Just the number, please."),
                 ("Tell me a story about a cat.", "Thanks!"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random Qwen3 with 4 heads, 2 key/value heads and a 400-token vocabulary: tp=2 divides it."""
    return make_model_dir(tmp_path_factory.mktemp("qwen3"), arch="qwen3")


def node_env(**launch) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.update({k: str(v) for k, v in launch.items()})
    return env


def master_port() -> int:
    """A free MASTER_PORT whose derived ports (control +1, weight sync +2) are free too, picked as
    the launcher picks one."""
    return free_ports("127.0.0.1", 3)


def fast_overrides(model_dir: Path, run_dir: Path) -> list[str]:
    return [f"model.path={model_dir}", "model.name=model", f"run_dir={run_dir}", "trainer.backend=megatron",
            "cluster.tp=2", "cluster.timeout_s=60", "cluster.bucket_mb=1", "train.batch_size=2",
            "train.micro_batch_tokens=256", "logging.wandb.mode=disabled", "engine.threads=1"]


def start_node(recipe: str, overrides: list[str], env: dict, log: Path) -> subprocess.Popen:
    """``bash <recipe>/run.sh`` in a session of its own, its output in ``log``."""
    with open(log, "w") as out:
        return subprocess.Popen(["bash", str(ROOT / recipe / "run.sh"), *overrides], env=env,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[1])  # a zombie has exited


def live_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def descendants(roots: list[int]) -> set[int]:
    """Every live process below ``roots`` (torchrun agents and ranks run in sessions of their own,
    so the process tree, not the process group, finds them)."""
    parents = {pid: parent_of(pid) for pid in live_pids()}
    found, frontier = set(), set(roots)
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def processes_of(run_dir: Path) -> set[int]:
    """Live processes whose command line names ``run_dir``: the agents and ranks of that run
    (their config and log paths are under it), whoever their parent is now."""
    mine = set()
    for pid in live_pids():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if str(run_dir) in cmdline and parent_of(pid) is not None:
            mine.add(pid)
    return mine


def kill_all(procs: list[subprocess.Popen], others: set[int]) -> None:
    """Kill what these tests started, each by its own process group (each is a session leader)."""
    for pid in [p.pid for p in procs] + sorted(others):
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for p in procs:
        if p.poll() is None:
            p.wait(30)


class Traffic:
    """Chats sent one after another from a thread for the whole run, so some land while the
    weights swap; every response's status and ``system_fingerprint`` is kept in order."""

    def __init__(self, url: str):
        self.url = url
        self.seen: list[tuple[int, str | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                try:
                    r = client.post(self.url + "/v1/chat/completions", json={
                        "model": "model", "messages": [{"role": "user", "content": f"ping {uuid.uuid4().hex[:6]}"}],
                        "max_tokens": 4})
                    self.seen.append((r.status_code, r.json().get("system_fingerprint") if r.is_success else None))
                except httpx.HTTPError:  # no answer at all: a failed request too
                    self.seen.append((0, None))
                time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(70)


def chat(client: httpx.Client, url: str, question: str, feedback: str) -> list[tuple[int, str | None]]:
    """One session: a question, the reply, then the user's feedback, which closes the turn (it
    gives the reply its next state) and ends the session. Returns both responses' status and
    fingerprint."""
    session = {"X-Session-Id": uuid.uuid4().hex}
    asked = [{"role": "user", "content": question}]
    first = client.post(url + "/v1/chat/completions", headers=session,
                        json={"model": "model", "messages": asked, "max_tokens": 8})
    assert first.status_code == 200, first.text
    reply = first.json()["choices"][0]["message"]["content"]
    second = client.post(url + "/v1/chat/completions", headers={**session, "X-Session-Done": "1"}, json={
        "model": "model", "max_tokens": 1,
        "messages": asked + [{"role": "assistant", "content": reply}, {"role": "user", "content": feedback}]})
    return [(r.status_code, r.json().get("system_fingerprint") if r.is_success else None) for r in (first, second)]


def train_and_serve_one_step(url: str, turns, procs, logs):
    """Drive ``turns`` while background chats run; wait until a train step is served. Returns the
    final /admin/status, the sessions' and the background chats' (status, fingerprint)s."""
    wait_until(lambda: httpx.get(url + "/healthz", timeout=2).status_code == 200, procs, logs, timeout=120)
    traffic = Traffic(url)
    try:
        with httpx.Client(timeout=60) as client:
            sessions = [seen for q, fb in turns for seen in chat(client, url, q, fb)]
        status = wait_until(lambda: (lambda s: s if s["weight_version"] >= 1 else None)(
            httpx.get(url + "/admin/status", timeout=10).json()), procs, logs, timeout=120)
        wait_until(lambda: any(fp == "clawrl-w1" for _, fp in traffic.seen), procs, logs, timeout=60)
    finally:
        traffic.stop()
    return status, sessions, traffic.seen


def assert_served_without_a_failure(sessions: list[tuple[int, str | None]], traffic: list[tuple[int, str | None]]):
    failed = [code for code, _ in sessions + traffic if code != 200]
    assert not failed, f"{len(failed)} of {len(sessions + traffic)} chat requests failed: {failed}"
    assert {fp for _, fp in sessions} <= {"clawrl-w0", "clawrl-w1"}
    # The background chats are sequential, so their fingerprints are in serving order: the old
    # version, then the new one for good (no request answered by w0 once w1 served).
    fingerprints = [fp for _, fp in traffic]
    assert fingerprints[0] == "clawrl-w0" and "clawrl-w1" in fingerprints
    assert set(fingerprints[fingerprints.index("clawrl-w1"):]) == {"clawrl-w1"}


@pytest.mark.slow
def test_two_nodes_through_run_sh_train_with_tp_across_nodes_and_stop_cleanly(model_dir, tmp_path):
    run_dir, port, server_port = tmp_path / "run", master_port(), free_port()
    launch = {"NNODES": 2, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "GPUS_PER_NODE": 1}
    overrides = fast_overrides(model_dir, run_dir)
    logs = [tmp_path / "node1.out", tmp_path / "node0.out"]
    procs: list[subprocess.Popen] = []
    ranks: set[int] = set()
    try:
        procs.append(start_node("openclaw-rl", overrides, node_env(NODE_RANK=1, **launch), logs[0]))
        procs.append(start_node("openclaw-rl", overrides + [f"server.port={server_port}"],
                                node_env(NODE_RANK=0, **launch), logs[1]))
        url = f"http://127.0.0.1:{server_port}"
        status, sessions, traffic = train_and_serve_one_step(url, RL_TURNS, procs, logs)
        assert status["training"]["method"] == "rl" and status["training"]["train_step"] >= 1
        assert_served_without_a_failure(sessions, traffic)
        node0, node1 = logs[1].read_text(), logs[0].read_text()
        assert "megatron trainer ranks starting: tp=2 pp=1 dp=1: 2 trainer ranks on 2 nodes x 1" in node0
        assert "node 1 of 2 (trainer ranks only): trainer ranks 1..1" in node1
        assert (run_dir / "cluster" / "node0.log").exists() and (run_dir / "cluster" / "node1.log").exists()

        ranks = descendants([p.pid for p in procs])
        assert len(ranks) >= 4, ranks  # a torchrun agent and a rank per node
        procs[1].send_signal(signal.SIGTERM)  # run.sh execs clawrl: the signal reaches the driver itself
        for p, log in zip(procs, logs):
            try:
                code = p.wait(60)
            except subprocess.TimeoutExpired:
                pytest.fail(f"node still running 60 s after SIGTERM to node 0:\n{log.read_text()[-3000:]}")
            assert code == 0, log.read_text()[-3000:]
        assert not {pid for pid in ranks if parent_of(pid) is not None}  # every agent and rank has exited
        assert not processes_of(run_dir)  # nor is any other process of this run left, orphaned or not
        assert "stopped by SIGTERM" in logs[1].read_text()
    finally:
        kill_all(procs, ranks | processes_of(run_dir))


@pytest.mark.slow
def test_combine_on_one_node_with_two_tensor_parallel_ranks_serves_its_first_step(model_dir, tmp_path):
    run_dir, server_port = tmp_path / "run", free_port()
    overrides = fast_overrides(model_dir, run_dir) + ["cluster.procs_per_node=2", f"server.port={server_port}"]
    logs = [tmp_path / "node0.out"]
    procs: list[subprocess.Popen] = []
    try:
        procs.append(start_node("openclaw-combine", overrides, node_env(), logs[0]))
        url = f"http://127.0.0.1:{server_port}"
        status, sessions, traffic = train_and_serve_one_step(url, COMBINE_TURNS, procs, logs)
        t = status["training"]
        assert t["method"] == "combine" and t["train_step"] >= 1 and t["opd"]["hints_accepted"] >= 1
        assert_served_without_a_failure(sessions, traffic)
        assert "megatron trainer ranks starting: tp=2 pp=1 dp=1: 2 trainer ranks on 1 node x 2" in logs[0].read_text()
        procs[0].send_signal(signal.SIGTERM)
        assert procs[0].wait(60) == 0, logs[0].read_text()[-3000:]
        assert not processes_of(run_dir)
    finally:
        kill_all(procs, processes_of(run_dir))


def test_node_1_with_an_unreachable_master_addr_fails_in_one_line_naming_it(model_dir, tmp_path):
    port = free_port()  # nothing listens there
    env = node_env(NNODES=2, NODE_RANK=1, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, GPUS_PER_NODE=1)
    run_dir = tmp_path / "run"
    started = time.monotonic()
    proc = subprocess.run(["bash", str(ROOT / "openclaw-rl" / "run.sh"), *fast_overrides(model_dir, run_dir),
                           "cluster.timeout_s=3"], env=env, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - started
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"clawrl: MASTER_ADDR 127.0.0.1:{port} unreachable after 3 s"), lines
    assert 3 <= took < 20, took  # cluster.timeout_s, plus clawrl's start (importing torch and transformers)
    assert not (run_dir / "cluster").exists()  # refused before any agent, rank or process group
