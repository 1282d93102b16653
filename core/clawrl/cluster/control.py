"""The driver's end of the control channel to the trainer ranks.

The driver (``clawrl serve`` on node 0) listens on loopback; global trainer rank 0, which static
rendezvous always places on node 0, connects back with the shared ``CLAWRL_CLUSTER_KEY`` (the
connection is authenticated because it carries pickles). Rank 0 then relays every command to all
ranks (``rank_main``), every rank runs the same method of its program collectively, and rank 0
replies with its own result, or with the first failing rank and its exception.

Wire format, one pickle per message:
- driver -> rank 0: ``("call", seq, method, args, kwargs)`` or ``("shutdown", seq)``; rank 0
  forwards these bytes unchanged to the other ranks, so a large batch is pickled once.
- rank 0 -> driver: ``{"world_size": ..., "error": None}`` once every rank has built its program,
  then ``(seq, ok, result_or_error_line)`` per command. Replies carry the command's ``seq`` so a
  late reply to a command that timed out is never taken for the next command's; seq -1 is rank 0's
  last word before it exits (its control loop broke), the answer to whatever is pending.
"""
from __future__ import annotations

import logging
import pickle
import secrets
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from typing import Any, Protocol

log = logging.getLogger(__name__)

KEY_ENV = "CLAWRL_CLUSTER_KEY"
CALL, SHUTDOWN = "call", "shutdown"


class ClusterError(RuntimeError):
    """A launch, a rank or the control channel failed; the message is one line for the user."""


class RankProcesses(Protocol):
    """What the control channel needs of the process running the ranks (launch.RankAgent)."""

    def exited(self) -> bool: ...

    def report(self) -> str: ...

    def stop(self, grace_s: float) -> None: ...

    def wait(self, timeout: float | None) -> int | None: ...


def cluster_key(environ) -> str:
    """The control channel's key: ``CLAWRL_CLUSTER_KEY`` when set, else a fresh random one that the
    driver hands to its own node's ranks (only node 0's rank 0 ever connects)."""
    return environ.get(KEY_ENV) or secrets.token_hex(32)


class ControlServer:
    """Driver side: ``call`` a method on every trainer rank and get rank 0's result.

    One call at a time (a lock serialises threads). Every wait is bounded by ``timeout_s``, and while
    waiting the rank processes are watched, so a crashed rank surfaces as its own report rather
    than as a silent timeout.
    """

    def __init__(self, host: str, port: int, key: str, timeout_s: float):
        self.timeout_s = timeout_s
        self._key = key.encode()
        try:
            self._listener = Listener((host, port), family="AF_INET", authkey=self._key)
        except OSError as e:
            raise ClusterError(f"cannot listen on {host}:{port} for the trainer control channel: {e.strerror or e} "
                               "(set cluster.control_port=...)") from None
        self.address = self._listener.address  # the port chosen when port is 0
        self.processes: RankProcesses | None = None
        self.node = None  # the launch.NodeEnv these ranks were started with (set by start_trainer_ranks)
        self.world_size: int | None = None
        self._conn: Connection | None = None
        self._connected = threading.Event()
        self._closing = False
        self._lock = threading.Lock()
        self._seq = 0
        self._ready = False
        threading.Thread(target=self._accept, name="cluster-control-accept", daemon=True).start()

    def _accept(self) -> None:
        # Listener.accept has no timeout, so it runs here; shutdown wakes it with a connection of its own.
        while not self._closing:
            try:
                conn = self._listener.accept()
            except OSError:  # the listener was closed
                return
            except Exception as e:  # a wrong key (AuthenticationError) or a peer that hung up mid-handshake
                log.warning("control channel: refused a connection: %s", e)
                continue
            if self._closing:
                conn.close()
                return
            self._conn = conn
            self._connected.set()
            self._listener.close()  # rank 0 is the only peer; nobody else gets to try
            return

    def wait_ready(self, timeout: float | None = None) -> dict:
        """Block until rank 0 has connected and every rank has built its program; returns rank 0's
        hello (``world_size``). Raises ClusterError naming the failing rank, or after ``timeout``."""
        with self._lock:
            return self._wait_ready(self.timeout_s if timeout is None else timeout)

    def _wait_ready(self, timeout: float) -> dict:
        if self._ready:
            return {"world_size": self.world_size}
        deadline = time.monotonic() + timeout
        while not self._connected.wait(0.2):
            self._check_ranks()
            if time.monotonic() > deadline:
                raise ClusterError(f"trainer rank 0 did not connect to {self.address[0]}:{self.address[1]} "
                                   f"within {timeout:g} s")
        hello = self._recv(deadline, timeout, "building the rank programs")
        if hello.get("error"):
            raise ClusterError(hello["error"])
        self.world_size = hello["world_size"]
        self._ready = True
        return hello

    def call(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """Run ``program.method(*args, **kwargs)`` on every rank; return rank 0's result.

        Raises ClusterError (one line) naming the first rank that raised, the rank processes'
        failure report when they exited, or a timeout after ``timeout`` (default cluster.timeout_s).
        """
        if not method or method.startswith("_"):
            raise ClusterError(f"'{method}' is not a public method of the rank program")
        timeout = self.timeout_s if timeout is None else timeout
        with self._lock:
            self._wait_ready(timeout)
            deadline = time.monotonic() + timeout
            self._seq += 1
            seq = self._seq
            self._send(pickle.dumps((CALL, seq, method, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL), method)
            while True:
                reply_seq, ok, value = self._recv(deadline, timeout, f"'{method}'")
                if reply_seq == seq:
                    break
                if reply_seq == -1:  # rank 0 is exiting; the rank processes' report names the root cause
                    raise ClusterError(self._lost(f"'{method}'", fallback=value))
                log.warning("control channel: dropped a late reply to command %d", reply_seq)
        if not ok:
            raise ClusterError(value)
        return value

    def _send(self, payload: bytes, what: str) -> None:
        try:
            self._conn.send_bytes(payload)
        except OSError:
            raise ClusterError(self._lost(what)) from None

    def _recv(self, deadline: float, timeout: float, what: str):
        conn = self._conn
        try:
            while not conn.poll(0.2):
                self._check_ranks()
                if time.monotonic() > deadline:
                    raise ClusterError(f"trainer rank 0 sent no reply to {what} within {timeout:g} s")
            return pickle.loads(conn.recv_bytes())  # plain pickles (see rank_main._dumps)
        except (EOFError, OSError):
            raise ClusterError(self._lost(what)) from None

    def _lost(self, what: str, fallback: str | None = None) -> str:
        # The connection dropped: the ranks are exiting; their own report says why, once they have.
        if self.processes is not None and self.processes.wait(min(self.timeout_s, 30.0)) is not None:
            return self.processes.report()
        return fallback or f"trainer rank 0 closed the control channel during {what}"

    def _check_ranks(self) -> None:
        if self.processes is not None and self.processes.exited():
            raise ClusterError(self.processes.report())

    def shutdown(self, timeout: float | None = None) -> None:
        """Ask every rank to exit, then make sure this node's rank processes are gone (stopped after
        ``timeout``). Safe to call twice and after a failure."""
        timeout = self.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._lock:
            self._closing = True
            if self._conn is not None and not self._conn.closed:
                try:
                    self._seq += 1
                    self._conn.send_bytes(pickle.dumps((SHUTDOWN, self._seq)))
                    if self._conn.poll(max(0.0, deadline - time.monotonic())):
                        pickle.loads(self._conn.recv_bytes())  # rank 0's acknowledgement: every rank has left its loop
                except (EOFError, OSError):
                    pass
                self._conn.close()
            elif not self._connected.is_set():
                self._wake_accept()
            self._listener.close()
            if self.processes is not None and self.processes.wait(max(0.0, deadline - time.monotonic())) is None:
                self.processes.stop(grace_s=10.0)

    def _wake_accept(self) -> None:
        try:
            Client(self.address, family="AF_INET", authkey=self._key).close()
        except Exception:  # nothing is listening any more: nothing to wake
            pass
