"""One trainer rank, as torchrun starts it on every node:

    python -m clawrl.cluster.rank_main --program module:Class --config run_dir/cluster/config-node0.yaml \
        [--driver 127.0.0.1:PORT]

Every rank builds ``Class(cfg)`` (any callable taking the config) and then runs whatever the driver
asks, collectively: global rank 0 holds the driver's connection and relays each command to the
others over a gloo group of its own (gloo even when the program's world is NCCL, since commands are
pickled bytes on the CPU). Ranks exit when the driver says shutdown, when its connection drops, or
when torchrun's agent is gone, so a dead driver never leaves ranks behind.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import pickle
import sys
import threading
import time
from multiprocessing.connection import Client, Connection

import torch
import torch.distributed as dist

from clawrl.cluster.control import KEY_ENV, SHUTDOWN
from clawrl.cluster.groups import command_group, init_world
from clawrl.config import compose

log = logging.getLogger("clawrl.cluster.rank")

HEARTBEAT = b""  # rank 0 relays this when the driver is quiet, so idle ranks never hit the group timeout


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m clawrl.cluster.rank_main", description=__doc__.splitlines()[0])
    p.add_argument("--program", required=True,
                   help="module:Class (or any callable) called with the config on every rank")
    p.add_argument("--config", required=True, help="the composed config (YAML or JSON) the driver wrote")
    p.add_argument("--driver", default=None, help="host:port of the driver's control channel (node 0 only)")
    args = p.parse_args(argv)
    if "RANK" not in os.environ:
        p.error("RANK is unset: trainer ranks are started by torchrun (clawrl.cluster.launch)")
    rank = int(os.environ["RANK"])
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank {rank}: %(message)s")
    _exit_with_agent()
    cfg = compose(yaml_path=args.config)
    timeout_s = cfg.cluster.timeout_s
    conn = None
    if rank == 0:
        if not args.driver:
            log.error("global rank 0 runs on node 0, which must pass --driver host:port")
            return 2
        conn = _connect(args.driver, timeout_s)
        if conn is None:
            return 1
    # the program's world (NCCL with CUDA, gloo without) and the gloo group for commands
    init_world(int(os.environ.get("LOCAL_RANK", "0")), timeout_s)
    control = command_group(timeout_s)
    program, error = _build(args.program, cfg)
    error = _first_failure(control, error, f"building {args.program}")
    if conn is not None:
        conn.send_bytes(_dumps({"world_size": dist.get_world_size(), "error": error}))
    if error:
        log.error("%s", error)
        # Skip interpreter teardown: it would destroy the process groups' C++ threads while they
        # still run, which aborts the rank (SIGABRT, "terminate called without an active
        # exception") and hides the exit status that says the build failed.
        logging.shutdown()
        os._exit(1)
    try:
        _serve(program, conn, control, heartbeat_s=max(1.0, min(timeout_s / 4, 30.0)))
    except Exception as e:  # a collective failed: a peer rank died or the world is broken; nothing to resume
        log.error("control loop failed: %s: %s", type(e).__name__, _line(e))
        if conn is not None:
            _try_send(conn, (-1, False, f"trainer rank 0's control loop failed: {type(e).__name__}: {_line(e)}"))
        # Give torchrun's agent time to see the rank that died first, so its report names that one
        # (it stops us meanwhile); then skip process-group teardown, which can block on a dead peer.
        time.sleep(3.0)
        os._exit(1)
    started = time.monotonic()
    dist.destroy_process_group()
    log.info("control loop ended; process groups destroyed in %.1f s", time.monotonic() - started)
    return 0


def _exit_with_agent() -> None:
    """Exit when torchrun's agent dies (it would have stopped us had it exited cleanly): torchrun
    starts each rank in its own session, so a killed agent would otherwise leave us orphaned."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        log.error("torchrun agent (pid %d) is gone; exiting", parent)
        os._exit(1)

    threading.Thread(target=watch, name="agent-watch", daemon=True).start()


def _connect(address: str, timeout_s: float) -> Connection | None:
    host, _, port = address.rpartition(":")
    key = os.environ.get(KEY_ENV, "").encode()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Client((host, int(port)), family="AF_INET", authkey=key)
        except OSError as e:
            if time.monotonic() > deadline:
                log.error("cannot reach the driver's control channel at %s after %g s: %s", address, timeout_s, e)
                return None
            time.sleep(0.5)
        except Exception as e:  # AuthenticationError: a different CLAWRL_CLUSTER_KEY
            log.error("the driver at %s refused this rank: %s (is CLAWRL_CLUSTER_KEY the same?)", address, e)
            return None


def _build(spec: str, cfg):
    module, _, name = spec.partition(":")
    try:
        if not module or not name:
            raise ValueError(f"--program must be module:Class, got '{spec}'")
        return getattr(importlib.import_module(module), name)(cfg), None
    except Exception as e:
        log.exception("building %s failed", spec)
        return None, f"{type(e).__name__}: {_line(e)}"


def _first_failure(group, error: str | None, what: str) -> str | None:
    """Gather every rank's error (or None) on rank 0; there, one line naming the first failing rank
    and how many others failed. None elsewhere and when all succeeded."""
    rank = dist.get_rank()
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(error, gathered, dst=0, group=group)
    if rank != 0:
        return error
    failed = [(r, e) for r, e in enumerate(gathered) if e is not None]
    if not failed:
        return None
    first, message = failed[0]
    others = f" (ranks {', '.join(str(r) for r, _ in failed[1:])} failed too)" if len(failed) > 1 else ""
    return f"trainer rank {first} failed in {what}: {message}{others}"


def _serve(program, conn: Connection | None, group, heartbeat_s: float) -> None:
    while True:
        payload = _next_command(conn, heartbeat_s) if conn is not None else None
        payload = _broadcast_bytes(payload, group)
        if payload == HEARTBEAT:
            continue
        message = pickle.loads(payload)
        if message[0] == SHUTDOWN:
            if conn is not None:
                _try_send(conn, (message[1], True, None))
            return
        _, seq, method, args, kwargs = message
        result, error = None, None
        try:
            result = getattr(program, method)(*args, **kwargs)
        except Exception as e:
            log.exception("%s failed", method)
            error = f"{type(e).__name__}: {_line(e)}"
        error = _first_failure(group, error, f"'{method}'")
        if conn is not None:
            if not _try_send(conn, (seq, error is None, result if error is None else error)):
                _try_send(conn, (seq, False, f"trainer rank 0's reply to '{method}' cannot be pickled"))


def _next_command(conn: Connection, heartbeat_s: float) -> bytes:
    """The driver's next command; a heartbeat when it is quiet; shutdown when it has gone away."""
    try:
        if not conn.poll(heartbeat_s):
            return HEARTBEAT
        return conn.recv_bytes()
    except (EOFError, OSError):
        log.info("the driver closed the control channel; shutting down")
        return pickle.dumps((SHUTDOWN, -1))


def _broadcast_bytes(payload: bytes | None, group) -> bytes:
    """Rank 0's ``payload`` on every rank: its length, then the bytes, as uint8 CPU tensors."""
    length = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
    dist.broadcast(length, src=0, group=group)
    n = int(length.item())
    if n == 0:
        return HEARTBEAT
    if dist.get_rank() == 0:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    else:
        data = torch.empty(n, dtype=torch.uint8)
    dist.broadcast(data, src=0, group=group)
    return payload if payload is not None else data.numpy().tobytes()


def _dumps(obj) -> bytes:
    """Plain pickle: ``Connection.send`` would use torch's multiprocessing reductions, which pass
    tensors as shared-memory handles the driver cannot open (another host, another authkey)."""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _try_send(conn: Connection, reply) -> bool:
    """False only when ``reply`` does not pickle; a driver that is gone shows at the next read."""
    try:
        conn.send_bytes(_dumps(reply))
        return True
    except (OSError, EOFError):
        return True
    except Exception:  # the result does not pickle
        return False


def _line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


if __name__ == "__main__":
    sys.exit(main())
