"""Multi-node launch: bad layouts and launch variables are refused in one line before any process
starts, an unreachable MASTER_ADDR times out naming the address, and two torchrun agents on
loopback (NODE_RANK 0 and 1) form one world the driver talks to."""
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from clawrl.cluster.control import ClusterError
from clawrl.cluster.launch import check_master, free_ports, read_node_env, run_worker_node, start_trainer_ranks
from clawrl.cluster.layout import check_layout, describe_layout, read_hf_config
from clawrl.cluster.probe import PROGRAM
from clawrl.config import ConfigError, compose

LAUNCH_VARS = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GPUS_PER_NODE", "CLAWRL_CLUSTER_KEY")
MODEL = {"num_attention_heads": 16, "num_key_value_heads": 4, "num_hidden_layers": 6, "vocab_size": 1002}


def launch_env(**vars) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["OMP_NUM_THREADS"] = "1"
    env.update({k: str(v) for k, v in vars.items()})
    return env


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("tp, pp, world, message", [
    (3, 1, 3, "cluster.tp=3 does not divide the 16 attention heads of m"),
    (8, 1, 8, "cluster.tp=8 does not divide the 4 key/value heads of m"),
    (4, 1, 4, "cluster.tp=4 does not divide the vocabulary of 1002 tokens of m"),
    (1, 4, 4, "cluster.pp=4 does not divide the 6 hidden layers of m"),
    (2, 2, 6, "cluster.tp=2 x cluster.pp=2 = 4 does not divide the 6 trainer ranks"),
    (0, 1, 1, "cluster.tp must be a positive integer, got 0"),
])
def test_layout_that_does_not_divide_the_model_is_refused(tp, pp, world, message):
    with pytest.raises(ConfigError) as e:
        check_layout(MODEL, tp, pp, world, model="m")
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_tiny_model_layouts(tiny_model_dir):
    hf_config, name = read_hf_config(str(tiny_model_dir))
    assert (hf_config["num_attention_heads"], hf_config["num_hidden_layers"], hf_config["vocab_size"]) == (4, 2, 8192)
    check_layout(hf_config, tp=2, pp=2, world_size=8, model=name)  # dp=2
    with pytest.raises(ConfigError, match=r"^cluster.tp=8 does not divide the 4 attention heads of clawrl-tiny$"):
        check_layout(hf_config, tp=8, pp=1, world_size=8, model=name)
    with pytest.raises(ConfigError, match=r"^cluster.pp=4 does not divide the 2 hidden layers of clawrl-tiny$"):
        check_layout(hf_config, tp=1, pp=4, world_size=4, model=name)
    assert describe_layout(2, 2, 8, nnodes=2) == "tp=2 pp=2 dp=2: 8 trainer ranks on 2 nodes x 4"


def test_an_unresolved_model_path_is_refused_not_built():
    with pytest.raises(ConfigError, match=r"^model.path is not resolved: the entry point must resolve it"):
        read_hf_config(None)


@pytest.mark.parametrize("vars, message", [
    ({"NNODES": "two"}, "NNODES='two' is not an integer"),
    ({"NNODES": 2, "NODE_RANK": 2, "MASTER_ADDR": "127.0.0.1"}, "NODE_RANK=2 is out of range for NNODES=2 (0..1)"),
    ({"NNODES": 2, "NODE_RANK": 1}, "NNODES=2 needs MASTER_ADDR"),
    ({"GPUS_PER_NODE": 0}, "GPUS_PER_NODE=0 must be >= 1"),
    ({"MASTER_PORT": 70000}, "MASTER_PORT=70000 is not a TCP port"),
])
def test_bad_launch_variables_are_refused_in_one_line(vars, message):
    with pytest.raises(ConfigError) as e:
        read_node_env(compose([]), launch_env(**vars))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_single_box_defaults_and_derived_ports():
    node = read_node_env(compose(["cluster.procs_per_node=3"]), launch_env())
    assert (node.nnodes, node.node_rank, node.master_addr, node.procs, node.world_size) == (1, 0, "127.0.0.1", 3, 3)
    assert node.is_driver and (node.control_port, node.sync_port) == (node.master_port + 1, node.master_port + 2)
    worker = read_node_env(compose(["cluster.control_port=4000"]),
                           launch_env(NNODES=3, NODE_RANK=2, MASTER_ADDR="10.1.2.3", GPUS_PER_NODE=2))
    assert not worker.is_driver and worker.master_port == 29500 and worker.control_port == 4000
    assert list(worker.ranks) == [4, 5]


def test_node_0_must_own_master_addr_and_its_port():
    cfg = compose([])
    with pytest.raises(ConfigError, match=r"^MASTER_ADDR 192.0.2.1 is not an address of this node"):
        check_master(read_node_env(cfg, launch_env(MASTER_ADDR="192.0.2.1", MASTER_PORT=29500)))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"^MASTER_PORT {port} on 127.0.0.1 is in use"):
            check_master(read_node_env(cfg, launch_env(MASTER_PORT=port)))


def test_one_machine_picks_its_ports_below_the_ephemeral_range():
    """Ports the kernel hands to outgoing connections could be taken between the pick and the use."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(5):
        port = free_ports("127.0.0.1", 4)
        assert 10000 <= port and port + 3 < low
        for p in range(port, port + 4):
            with socket.socket() as s:
                s.bind(("127.0.0.1", p))  # each of the four is free


@pytest.mark.parametrize("addr", ["127.0.0.1", "192.0.2.1"])  # a closed port; TEST-NET (no route or no answer)
def test_unreachable_master_addr_fails_within_the_timeout_naming_it(addr, tmp_path, tiny_model_dir):
    port = closed_port()
    cfg = compose([f"run_dir={tmp_path}", f"model.path={tiny_model_dir}", "cluster.timeout_s=2"])
    env = launch_env(NNODES=2, NODE_RANK=1, MASTER_ADDR=addr, MASTER_PORT=port)
    started = time.monotonic()
    with pytest.raises(ConfigError) as e:
        run_worker_node(cfg, PROGRAM, env)
    took = time.monotonic() - started
    assert str(e.value).startswith(f"MASTER_ADDR {addr}:{port} unreachable after 2 s") and "\n" not in str(e.value)
    assert 2 <= took < 8
    assert not (tmp_path / "cluster").exists()  # refused before any agent, rank or process group


def test_two_nodes_on_loopback_form_one_world(tmp_path, tiny_model_dir):
    port = closed_port()
    common = {"NNODES": 2, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    overrides = [f"model.path={tiny_model_dir}", "cluster.timeout_s=40"]
    probe = [sys.executable, "-m", "clawrl.cluster.probe", f"run_dir={tmp_path / 'node1'}", *overrides]
    worker = subprocess.Popen(probe,
                              env=launch_env(NODE_RANK=1, **common), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    ranks = None
    try:
        cfg = compose([f"run_dir={tmp_path / 'node0'}", *overrides])
        ranks = start_trainer_ranks(cfg, PROGRAM, launch_env(NODE_RANK=0, **common))
        assert ranks.wait_ready()["world_size"] == 2
        assert (ranks.node.node_rank, ranks.node.world_size, ranks.node.sync_port) == (0, 2, port + 2)
        written = compose(yaml_path=str(tmp_path / "node0" / "cluster" / "config-node0.yaml"))
        assert written.cluster.sync_port == port + 2  # the ranks get the resolved ports
        info = ranks.call("info")
        assert [r["rank"] for r in info] == [0, 1] and {r["world_size"] for r in info} == {2}
        assert [r["node_rank"] for r in info] == [0, 1]  # global rank 0 is on node 0
        assert len({r["pid"] for r in info}) == 2
        assert ranks.call("all_reduce_check") == 1
        ranks.shutdown(timeout=30)
        assert ranks.processes.proc.returncode == 0
        out, _ = worker.communicate(timeout=30)
        assert worker.returncode == 0, out
        assert "node 1: ranks 1..1 done" in out
    finally:
        if ranks is not None:
            ranks.shutdown(timeout=5)
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()


def test_a_failed_launch_names_the_rank_and_its_last_line(tmp_path, tiny_model_dir):
    cfg = compose([f"run_dir={tmp_path}", f"model.path={tiny_model_dir}", "cluster.timeout_s=30"])
    ranks = start_trainer_ranks(cfg, "clawrl.no_such_module:Program", launch_env())
    try:
        with pytest.raises(ClusterError) as e:
            ranks.wait_ready()
        assert str(e.value).startswith("trainer rank 0 failed in building clawrl.no_such_module:Program: "
                                       "ModuleNotFoundError: No module named 'clawrl.no_such_module'")
        assert "\n" not in str(e.value)
        assert ranks.processes.wait(30) == 1  # the ranks exit after a failed build
        report = ranks.processes.report()
        assert report.startswith("trainer ranks on node 0 exited with status 1: rank 0 failed (exit code 1): ")
        assert "No module named 'clawrl.no_such_module'" in report and str(tmp_path) in report
    finally:
        ranks.shutdown(timeout=5)


WORKER = textwrap.dedent("""
    import sys
    from clawrl.cluster.control import ClusterError
    from clawrl.cluster.launch import run_worker_node
    from clawrl.config import compose
    try:
        run_worker_node(compose(sys.argv[1:]), "test_cluster_control:FaultyProbe")
    except ClusterError as e:
        print(f"clawrl: {e}")
        sys.exit(2)
""")


def test_a_rank_dying_on_node_1_fails_both_nodes_and_node_1_names_it(tmp_path, tiny_model_dir):
    port = closed_port()
    tests = str(Path(__file__).resolve().parent)
    common = {"NNODES": 2, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
              "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    overrides = [f"model.path={tiny_model_dir}", "cluster.timeout_s=40"]
    worker = subprocess.Popen([sys.executable, "-c", WORKER, f"run_dir={tmp_path / 'node1'}", *overrides],
                              env=launch_env(NODE_RANK=1, **common), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    ranks = None
    try:
        cfg = compose([f"run_dir={tmp_path / 'node0'}", *overrides])
        ranks = start_trainer_ranks(cfg, "test_cluster_control:FaultyProbe", launch_env(NODE_RANK=0, **common))
        ranks.wait_ready()
        with pytest.raises(ClusterError, match=r"^trainer ranks on node 0 exited with status 1: rank 0 failed"):
            ranks.call("crash_on", 1)  # node 0 sees only its rank 0's broken collective
        out, _ = worker.communicate(timeout=30)
        assert worker.returncode == 2
        # the worker's one-line reason; the dying rank's own output may land before or after it
        reasons = [line for line in out.splitlines() if line.startswith("clawrl: ")]
        assert len(reasons) == 1 and reasons[0].startswith(
            "clawrl: trainer ranks on node 1 exited with status 1: rank 1 failed (exit code 3): rank 1 going down "
            "(log: "), out
    finally:
        if ranks is not None:
            ranks.shutdown(timeout=5)
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
