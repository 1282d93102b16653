"""The driver <-> trainer-rank control channel: every rank runs each command, rank 0 replies, a
rank's failure comes back as one line naming it (and the ranks keep serving), a crashed rank is
reported with its last line, and a driver that dies takes its ranks with it."""
import hashlib
import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client
from pathlib import Path

import pytest
import torch.distributed as dist

from clawrl.cluster.control import ClusterError, ControlServer
from clawrl.cluster.launch import start_trainer_ranks
from clawrl.cluster.rank_probe import ClusterProbe
from clawrl.config import compose

TESTS = str(Path(__file__).resolve().parent)
PROGRAM = "test_cluster_control:FaultyProbe"
LAUNCH_VARS = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GPUS_PER_NODE", "CLAWRL_CLUSTER_KEY")


class FaultyProbe(ClusterProbe):
    """The probe, plus commands that fail on one chosen rank (built in the rank processes)."""

    def fail_on(self, rank: int, word: str = "boom") -> str:
        if dist.get_rank() == rank:
            raise ValueError(f"{word} on rank {rank}")
        return "fine"

    def crash_on(self, rank: int) -> None:
        if dist.get_rank() == rank:
            print(f"rank {rank} going down", flush=True)
            os._exit(3)
        dist.barrier()

    def digests(self, payload) -> list[str]:
        """What every rank received, as a hash, gathered."""
        mine = hashlib.sha256(pickle.dumps(payload)).hexdigest()
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return everyone


def single_node(tmp_path, tiny_model_dir, procs=2, timeout_s=30):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([TESTS, env.get("PYTHONPATH", "")]))
    cfg = compose([f"run_dir={tmp_path}", f"model.path={tiny_model_dir}", f"cluster.procs_per_node={procs}",
                   f"cluster.timeout_s={timeout_s}"])
    return cfg, env


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has exited
    except FileNotFoundError:
        return True


def test_channel_refuses_a_wrong_key_and_never_takes_a_late_reply_for_the_next():
    server = ControlServer("127.0.0.1", 0, "right key", timeout_s=5)
    try:
        with pytest.raises(AuthenticationError):
            Client(server.address, family="AF_INET", authkey=b"wrong key")
        rank0 = Client(server.address, family="AF_INET", authkey=b"right key")  # plays rank 0 by hand
        rank0.send({"world_size": 1, "error": None})
        assert server.wait_ready(timeout=5) == {"world_size": 1, "error": None}
        with pytest.raises(ClusterError, match=r"^trainer rank 0 sent no reply to 'slow' within 0.5 s$"):
            server.call("slow", timeout=0.5)
        assert pickle.loads(rank0.recv_bytes()) == ("call", 1, "slow", (), {})
        rank0.send((1, True, "too late"))
        answer = []
        caller = threading.Thread(target=lambda: answer.append(server.call("next", 7, scale=2.0)))
        caller.start()
        assert pickle.loads(rank0.recv_bytes()) == ("call", 2, "next", (7,), {"scale": 2.0})
        rank0.send((2, True, "on time"))
        caller.join(5)
        assert answer == ["on time"]
        with pytest.raises(ClusterError, match="not a public method"):
            server.call("_private")
    finally:
        server.shutdown(timeout=0.5)


def test_a_rank_that_raises_is_named_and_the_ranks_keep_serving(tmp_path, tiny_model_dir):
    cfg, env = single_node(tmp_path, tiny_model_dir)
    ranks = start_trainer_ranks(cfg, PROGRAM, env)
    try:
        assert ranks.wait_ready()["world_size"] == 2
        with pytest.raises(ClusterError) as e:
            ranks.call("fail_on", 1, word="kaput")
        assert str(e.value) == "trainer rank 1 failed in 'fail_on': ValueError: kaput on rank 1"
        assert ranks.call("fail_on", 5) == "fine"
        with pytest.raises(ClusterError, match=r"^trainer rank 0 failed in 'no_such_method': AttributeError"):
            ranks.call("no_such_method")
        # a batch-sized payload reaches every rank intact, and rank 0's result comes back
        payload = [{"tokens": list(range(i, i + 2000)), "reward": float(i)} for i in range(300)]
        want = hashlib.sha256(pickle.dumps(payload)).hexdigest()
        assert ranks.call("digests", payload) == [want, want]
        assert ranks.call("all_reduce_check") == 1
        ranks.shutdown(timeout=20)
        assert ranks.processes.proc.returncode == 0
    finally:
        ranks.shutdown(timeout=5)


def test_idle_ranks_outlive_the_timeout_and_a_crashed_rank_is_reported(tmp_path, tiny_model_dir):
    cfg, env = single_node(tmp_path, tiny_model_dir, timeout_s=6)
    ranks = start_trainer_ranks(cfg, PROGRAM, env)
    try:
        ranks.wait_ready(timeout=60)
        time.sleep(8)  # longer than any collective may wait: rank 0's heartbeats keep the others alive
        assert len(ranks.call("info")) == 2
        started = time.monotonic()
        with pytest.raises(ClusterError) as e:
            ranks.call("crash_on", 1)
        assert time.monotonic() - started < 25
        message = str(e.value)
        assert message.startswith("trainer ranks on node 0 exited with status 1: rank 1 failed (exit code 3): "
                                  "rank 1 going down"), message
        assert "\n" not in message
        with pytest.raises(ClusterError, match="^trainer ranks on node 0 exited"):
            ranks.call("info")  # later calls fail at once with the same report
    finally:
        ranks.shutdown(timeout=5)


DRIVER = textwrap.dedent("""
    import json, sys, time
    from clawrl.cluster.launch import start_trainer_ranks
    from clawrl.config import compose
    ranks = start_trainer_ranks(compose(sys.argv[1:]), "clawrl.cluster.rank_probe:ClusterProbe")
    ranks.wait_ready()
    print(json.dumps({"agent": ranks.processes.proc.pid, "ranks": [r["pid"] for r in ranks.call("info")]}), flush=True)
    time.sleep(600)
""")


def test_ranks_exit_when_the_driver_dies(tmp_path, tiny_model_dir):
    cfg, env = single_node(tmp_path, tiny_model_dir)
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, f"run_dir={tmp_path}", f"model.path={tiny_model_dir}",
                               "cluster.procs_per_node=2", "cluster.timeout_s=10"],
                              env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    pids = []
    try:
        line = driver.stdout.readline()
        assert line, "the driver printed nothing"
        started = json.loads(line)
        pids = [started["agent"], *started["ranks"]]
        assert len(pids) == 3 and not any(gone(p) for p in pids)
        driver.send_signal(signal.SIGKILL)  # no cleanup of any kind runs in the driver
        driver.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(gone(p) for p in pids):
            time.sleep(0.2)
        assert [p for p in pids if not gone(p)] == [], "orphaned agent or rank processes"
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        for pid in pids:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
