"""Which node runs what, checked before anything starts, and the torchrun agent that runs this
node's trainer ranks.

Every node runs the same ``run.sh`` (``clawrl serve``) with its own NODE_RANK. Node 0 is the
driver: gateway, engine, store and learner in one process, plus a torchrun agent child for its
own ranks, the first of which (global rank 0) connects back over the control channel. Every other
node runs only its torchrun agent and waits for it. The ranks form their own torch.distributed
world by static rendezvous at MASTER_ADDR:MASTER_PORT, hosted by node 0's agent.

Launch variables (all optional on one machine):
  NNODES (1), NODE_RANK (0), MASTER_ADDR (127.0.0.1; required with NNODES > 1),
  MASTER_PORT (a free port on one node, 29500 across nodes),
  GPUS_PER_NODE (the CUDA devices here; without CUDA, cluster.procs_per_node gloo processes).
"""
from __future__ import annotations

import atexit
import errno
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping

import torch

from clawrl.cluster.control import KEY_ENV, ClusterError, ControlServer, cluster_key
from clawrl.cluster.layout import check_layout, describe_layout, read_hf_config
from clawrl.config import ClawrlConfig, ConfigError, to_yaml

log = logging.getLogger(__name__)

DEFAULT_MASTER_PORT = 29500  # torchrun's own default, so a cluster set up for torchrun works as is


@dataclass(frozen=True)
class NodeEnv:
    """This node's place in the launch, from the environment and ``cluster.*``."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    procs: int  # trainer ranks on this node (GPUS_PER_NODE)
    control_port: int  # the driver's control channel, on node 0's loopback
    sync_port: int  # the weight-sync process group's rendezvous, on MASTER_ADDR
    timeout_s: float

    @property
    def world_size(self) -> int:
        return self.nnodes * self.procs

    @property
    def is_driver(self) -> bool:
        """The one decision of which node runs what: node 0 runs the driver (gateway, engine,
        store, learner) and global rank 0, which the driver talks to; every other node runs only
        its trainer ranks."""
        return self.node_rank == 0

    @property
    def ranks(self) -> range:
        """Global ranks on this node (static rendezvous numbers them node by node)."""
        return range(self.node_rank * self.procs, (self.node_rank + 1) * self.procs)


def read_node_env(cfg: ClawrlConfig, environ: Mapping[str, str] | None = None) -> NodeEnv:
    """The launch variables, validated; ConfigError (one line) for a bad one."""
    env = os.environ if environ is None else environ
    nnodes = _int_var(env, "NNODES", 1, minimum=1)
    node_rank = _int_var(env, "NODE_RANK", 0, minimum=0)
    if node_rank >= nnodes:
        raise ConfigError(f"NODE_RANK={node_rank} is out of range for NNODES={nnodes} (0..{nnodes - 1})")
    procs = _int_var(env, "GPUS_PER_NODE", _default_procs(cfg), minimum=1)
    cuda = _cuda_devices()
    if cuda and procs > cuda:
        raise ConfigError(f"GPUS_PER_NODE={procs} but this node has {cuda} CUDA devices")
    addr = env.get("MASTER_ADDR", "").strip()
    if not addr:
        if nnodes > 1:
            raise ConfigError(f"NNODES={nnodes} needs MASTER_ADDR: node 0's address, reachable from every node")
        addr = "127.0.0.1"
    if env.get("MASTER_PORT", "").strip():
        port = _int_var(env, "MASTER_PORT", None, minimum=1)
    elif nnodes > 1:
        port = DEFAULT_MASTER_PORT
    else:
        port = free_ports(addr, 4)  # MASTER_PORT, control, sync, SGLang's weights-update group
    control = cfg.cluster.control_port or port + 1
    sync = cfg.cluster.sync_port or port + 2
    for name, value in (("MASTER_PORT", port), ("cluster.control_port", control), ("cluster.sync_port", sync)):
        if not 0 < value < 65536:
            raise ConfigError(f"{name}={value} is not a TCP port (1..65535)")
    return NodeEnv(nnodes, node_rank, addr, port, procs, control, sync, cfg.cluster.timeout_s)


def _int_var(env: Mapping[str, str], name: str, default: int | None, minimum: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ConfigError(f"{name}={value} must be >= {minimum}")
    return value


def _cuda_devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _default_procs(cfg: ClawrlConfig) -> int:
    return _cuda_devices() or cfg.cluster.procs_per_node


def free_ports(host: str, count: int) -> int:
    """A free port p with p+1 .. p+count-1 free too (MASTER_PORT and the ports derived from it).

    Picked below the kernel's ephemeral range: a port the kernel hands out (bind to 0) can be taken
    again, between this check and its use, as the local port of any outgoing connection (gloo's
    and the TCP store's own among them), which once failed a run with EADDRINUSE."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(10000, max(10001, low - count))
        if all(_bindable(host, port + i) for i in range(count)):
            return port
    raise ConfigError(f"no {count} consecutive free ports on {host} below {low}; set MASTER_PORT")


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (Linux's default, 32768, elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def check_master(node: NodeEnv) -> None:
    """MASTER_ADDR works for this node, before any process group forms.

    Node 0 hosts the rendezvous, so MASTER_ADDR must be one of its own addresses and MASTER_PORT
    free there. Any other node waits up to ``cluster.timeout_s`` for node 0 to listen, so nodes may
    start in any order, and fails naming the address if it never does.
    """
    addr, port = node.master_addr, node.master_port
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ConfigError(f"MASTER_ADDR {addr} does not resolve: {e.strerror}") from None
    if node.is_driver:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(sockaddr)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise ConfigError(f"MASTER_PORT {port} on {addr} is in use; set MASTER_PORT=...") from None
                raise ConfigError(f"MASTER_ADDR {addr} is not an address of this node, but NODE_RANK=0 hosts the "
                                  f"rendezvous there: {e.strerror or e}") from None
        return
    deadline = time.monotonic() + node.timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection(sockaddr[:2], timeout=max(0.1, min(left, 5.0))):
                return
        except OSError:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ConfigError(f"MASTER_ADDR {addr}:{port} unreachable after {node.timeout_s:g} s (is node 0 "
                                  "started, and the port open between the nodes?)") from None
            time.sleep(min(0.5, left))


def _prepare(cfg: ClawrlConfig, node: NodeEnv) -> None:
    hf_config, model = read_hf_config(cfg.model.path)
    check_layout(hf_config, cfg.cluster.tp, cfg.cluster.pp, node.world_size, model)
    check_master(node)
    log.info("node %d of %d (%s): trainer ranks %d..%d; layout %s; rendezvous %s:%d", node.node_rank, node.nnodes,
             "driver" if node.is_driver else "trainer ranks only", node.ranks.start, node.ranks.stop - 1,
             describe_layout(cfg.cluster.tp, cfg.cluster.pp, node.world_size, node.nnodes),
             node.master_addr, node.master_port)


def start_trainer_ranks(cfg: ClawrlConfig, program: str, environ: Mapping[str, str] | None = None,
                        node: NodeEnv | None = None) -> ControlServer:
    """Node 0: check the launch, open the control channel, start this node's torchrun agent.

    ``program`` is ``module:callable``, called as ``callable(cfg)`` on every rank. Returns at once;
    ``wait_ready()`` on the result blocks until every rank has built it, ``call()`` runs a method
    on every rank, ``shutdown()`` stops the ranks (also done when this process exits). The
    result's ``node`` is the launch as resolved here (ports included); pass ``node`` to reuse one
    already read, since a single machine's MASTER_PORT is picked afresh on each read.
    """
    env = os.environ if environ is None else environ
    node = node or read_node_env(cfg, env)
    if not node.is_driver:
        raise ConfigError(f"NODE_RANK={node.node_rank} runs trainer ranks only; the driver runs on NODE_RANK=0")
    _prepare(cfg, node)
    key = cluster_key(env)
    server = ControlServer("127.0.0.1", node.control_port, key, node.timeout_s)
    server.node = node
    try:
        server.processes = RankAgent.start(cfg, node, program, {**env, KEY_ENV: key},
                                       driver=f"127.0.0.1:{node.control_port}")
    except BaseException:
        server.shutdown(timeout=0)
        raise
    return server


def run_worker_node(cfg: ClawrlConfig, program: str, environ: Mapping[str, str] | None = None,
                    node: NodeEnv | None = None) -> None:
    """NODE_RANK > 0: run this node's trainer ranks until they exit (the driver's shutdown, or a
    failure: ClusterError with the failing rank's report). SIGINT/SIGTERM stop them."""
    env = os.environ if environ is None else environ
    node = node or read_node_env(cfg, env)
    if node.is_driver:
        raise ConfigError("NODE_RANK=0 runs the driver; start_trainer_ranks starts its ranks")
    _prepare(cfg, node)
    agent = RankAgent.start(cfg, node, program, dict(env), driver=None)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, lambda s, f: agent.terminate()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        status = agent.wait(None)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        agent.stop(grace_s=10.0)
    if status != 0 and not agent.stopped_on_request:
        raise ClusterError(agent.report())


class RankAgent:
    """This node's torchrun agent: a child process in a session of its own (so a Ctrl-C meant for
    the driver reaches the ranks only through an orderly shutdown), logging to
    ``run_dir/cluster/node<N>.log`` with each rank's lines prefixed ``[rank<R>]:``. Its exit is
    noticed at once and reported with the failing rank's last lines."""

    def __init__(self, proc: subprocess.Popen, node: NodeEnv, log_path: Path, log_start: int):
        self.proc = proc
        self.node = node
        self.log_path = log_path
        self._log_start = log_start  # the log is appended to across runs; reports read this run's part
        self.stopped_on_request = False
        threading.Thread(target=self._watch, name=f"rank-agent-{proc.pid}", daemon=True).start()
        _live_agents.add(self)

    @classmethod
    def start(cls, cfg: ClawrlConfig, node: NodeEnv, program: str, env: Mapping[str, str],
              driver: str | None) -> "RankAgent":
        out = Path(cfg.run_dir) / "cluster"
        out.mkdir(parents=True, exist_ok=True)
        config_path = out / f"config-node{node.node_rank}.yaml"
        # The ranks get the ports as resolved here, so they never derive them again.
        resolved = replace(cfg, cluster=replace(cfg.cluster, control_port=node.control_port, sync_port=node.sync_port))
        config_path.write_text(to_yaml(resolved))
        log_path = out / f"node{node.node_rank}.log"
        cmd = torchrun_command(node, program, config_path, out / f"torchrun-node{node.node_rank}", driver)
        child_env = dict(env)
        # The ranks import the same clawrl as this process, installed or not.
        src = str(Path(__file__).resolve().parents[2])
        child_env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
        child_env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = "[rank${rank}]:"
        with open(log_path, "ab") as fh:
            log_start = fh.tell()
            proc = subprocess.Popen(cmd, env=child_env, stdin=subprocess.DEVNULL, stdout=fh,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        log.info("node %d: torchrun agent pid %d for %s; its log: %s", node.node_rank, proc.pid, program, log_path)
        return cls(proc, node, log_path, log_start)

    def _watch(self) -> None:
        status = self.proc.wait()
        _live_agents.discard(self)
        if status != 0 and not self.stopped_on_request:
            log.error("%s\n%s", self.report(), "\n".join("    " + line for line in self._rank_lines()[-20:]))

    def exited(self) -> bool:
        return self.proc.poll() is not None

    def wait(self, timeout: float | None) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def terminate(self) -> None:
        """Ask the agent to stop its ranks and exit (SIGTERM); returns at once."""
        self.stopped_on_request = True
        _signal_group(self.proc.pid, signal.SIGTERM)

    def stop(self, grace_s: float) -> None:
        """SIGTERM the agent (it stops its ranks), then SIGKILL whatever of it and its ranks is left."""
        if self.proc.poll() is not None:
            return
        ranks = _children(self.proc.pid)
        self.terminate()
        if self.wait(grace_s) is None:  # the agent did not stop its ranks: kill both
            _signal_group(self.proc.pid, signal.SIGKILL)
            for pid in ranks:  # torchrun starts each rank in a session of its own
                _signal_group(pid, signal.SIGKILL)
            self.wait(5.0)

    def report(self) -> str:
        """One line: how the agent exited, which rank failed first and its last line, the log."""
        status = self.proc.poll()
        if status is not None and status < 0:
            head = f"the torchrun agent of node {self.node.node_rank} was killed by {signal.Signals(-status).name}"
        else:
            head = f"trainer ranks on node {self.node.node_rank} exited with status {status}"
        text = self._log_text()
        root = _ROOT_CAUSE.search(text)
        if root:
            rank, code = int(root.group(1)), int(root.group(2))
            lines = self._rank_lines(rank)
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            last = f": {lines[-1]}" if lines else ""
            return f"{head}: rank {rank} failed ({how}){last} (log: {self.log_path})"
        lines = [line for line in text.splitlines() if line.strip()]
        return f"{head}{': ' + lines[-1].strip() if lines else ''} (log: {self.log_path})"

    def _log_text(self) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(self._log_start)
                return fh.read().decode(errors="replace")
        except OSError:
            return ""

    def _rank_lines(self, rank: int | None = None) -> list[str]:
        prefix = re.compile(r"^\[rank" + (str(rank) if rank is not None else r"\d+") + r"\]:(.*)$")
        return [m.group(1).rstrip() for line in self._log_text().splitlines()
                if (m := prefix.match(line)) and m.group(1).strip()]


# torchrun's failure summary: "Root Cause (first observed failure): ... rank : 1 (local_rank: 1)
# exitcode : 3 (pid: ...)".
_ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*exitcode\s*:\s*(-?\d+)", re.S)
_live_agents: set[RankAgent] = set()


def torchrun_command(node: NodeEnv, program: str, config_path: Path, log_dir: Path, driver: str | None) -> list[str]:
    """The torchrun agent for this node: static rendezvous (global ranks numbered node by node, so
    rank 0 is on node 0), no restarts (a failed rank fails the run), each rank's output teed into
    the agent's log."""
    cmd = [sys.executable, "-m", "torch.distributed.run",
           "--nnodes", str(node.nnodes), "--node-rank", str(node.node_rank),
           "--nproc-per-node", str(node.procs),
           "--master-addr", node.master_addr, "--master-port", str(node.master_port),
           "--rdzv-conf", f"timeout={max(1, round(node.timeout_s))}",
           "--max-restarts", "0", "--log-dir", str(log_dir), "--tee", "3",
           "-m", "clawrl.cluster.rank_main", "--program", program, "--config", str(config_path)]
    return cmd + (["--driver", driver] if driver else [])


def _children(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*"):  # empty when not Linux, or already gone
        try:
            children += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass
    return children


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop_live_agents() -> None:
    for agent in list(_live_agents):
        agent.stop(grace_s=5.0)


atexit.register(_stop_live_agents)
