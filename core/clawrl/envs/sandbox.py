"""Sandboxes: where agentic environments run the model's commands, isolated from the host.

One interface, ``Sandbox`` (``exec``, ``write_file``, ``read_file``, ``close``), and three backends
that ``open_sandbox`` picks from ``sandbox.backend``:

- ``bwrap`` (bubblewrap), preferred: one small setuid-free binary that builds the whole view;
- ``unshare`` (util-linux), as root only: the same view built by a short shell script with
  ``mount``, ``pivot_root`` and ``setpriv``;
- ``subprocess``: no isolation at all, only with ``sandbox.allow_unisolated=true``.

What every isolating exec gets, and why:

- **Its own host uid** (one per open sandbox, ``clawrl.envs.sandbox_slots``): rlimits do not bind
  root, RLIMIT_NPROC counts per uid, and a uid nobody else uses lets ``close`` kill whatever is left
  by uid. Privileges are dropped with no_new_privs and an empty capability set, so no setuid binary
  or file capability can give them back. (Not root? clawrl's own uid is already unprivileged and is
  used as is.)
- **Fresh namespaces per exec**: pid (so the exec's process tree dies with its init: nothing
  backgrounded, nohup'd, setsid'd or double-forked outlives the exec), net (only a loopback, up, and
  nothing else: no route to the host's 127.0.0.1 or anywhere), mount, ipc and uts.
- **A minimal view of the host**: a read-only /usr, /etc and /lib*, /bin, /sbin as on the host, the
  Python environment (``sys.prefix``, ``sys.base_prefix``; only those directories, never the rest of
  HOME, which may hold keys), a fresh /proc, a minimal /dev, and the sandbox's writable top-level
  directories (/app, /tmp, /logs, ...) bound read-write from ``Sandbox.root`` on the host. Nothing
  else of the host (run_dir, /root, /work) exists inside.
- **rlimits** on CPU time, address space, processes, file size and open files (``prlimit``), and a
  **wall clock** per exec that SIGTERMs every process in the exec's pid namespace and SIGKILLs its
  init after ``sandbox.kill_grace_s`` (which takes the whole namespace down).
- **Capped output**: the tail of stdout and of stderr, ``sandbox.max_output_bytes`` each.

Files are read and written from the host side (``sandbox_files``), resolving symlinks the way the
sandbox would, so a link planted by the sandboxed process cannot redirect clawrl onto a host file.
Execs are asyncio subprocesses: many sandboxes run at once without blocking the event loop.

What it does not do (there are no cgroups or quotas to lean on here): a sandbox's total memory is
bounded only by max_procs x memory_mb, its CPU share only by pinning (``cpus``), its disk use only
per file (max_file_mb). The top-level directories of the system view and of the Python environment
(/usr, /etc, ..., /root where pyenv lives) cannot be made writable.
"""
from __future__ import annotations

import abc
import asyncio
import fcntl
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from clawrl.config import SandboxConfig
from clawrl.envs.base import EnvError
from clawrl.envs.sandbox_files import UnsafePath, make_dirs, open_beneath, resolve
from clawrl.envs.sandbox_slots import UidSlot, claim_slot, kill_uid, pids_of_uid

BACKENDS = ("bwrap", "unshare", "subprocess")
BACKEND_CHOICES = ("auto", *BACKENDS)  # sandbox.backend
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class SandboxError(EnvError):
    """A sandbox that cannot be opened or used; the message is one line."""


@dataclass(frozen=True)
class ExecResult:
    """What one exec did. ``returncode`` is negative when the process clawrl started was killed by
    that signal (the wall clock's SIGKILL, say); a command killed by a signal inside an isolating
    sandbox reports 128+N, as a shell does, because an init stands between it and clawrl."""

    returncode: int
    stdout: str  # utf-8, errors="replace"; the tail, the cut marked, when over sandbox.max_output_bytes
    stderr: str
    timed_out: bool  # the wall-clock limit killed the process tree
    duration_s: float


@dataclass(frozen=True)
class Limits:
    """The rlimits of one sandbox: the configured ones, tightened by the task."""

    cpu_time_s: int
    memory_mb: int
    max_procs: int
    max_file_mb: int
    max_open_files: int
    cpus: Optional[float]

    def prlimit_argv(self, with_nproc: bool = True) -> list[str]:
        """``prlimit`` setting these limits (soft = hard, but CPU: SIGXCPU at the soft limit, then
        SIGKILL one second later even if the process handles SIGXCPU)."""
        argv = [_tool("prlimit"), f"--cpu={self.cpu_time_s}:{self.cpu_time_s + 1}",
                f"--as={self.memory_mb << 20}", f"--fsize={self.max_file_mb << 20}",
                f"--nofile={self.max_open_files}", "--core=0"]
        if with_nproc:
            argv.append(f"--nproc={self.max_procs}")
        return argv + ["--"]

    def taskset_argv(self, slot_index: int) -> list[str]:
        """Pin to ceil(cpus) of the host's CPUs, a different set per slot, when a task asks for
        fewer CPUs than the host has (there are no cgroups here to share CPU time finer)."""
        host = sorted(os.sched_getaffinity(0))
        if self.cpus is None or math.ceil(self.cpus) >= len(host):
            return []
        n = max(1, math.ceil(self.cpus))
        chosen = [host[(slot_index * n + i) % len(host)] for i in range(n)]
        return [_tool("taskset"), "-c", ",".join(map(str, chosen))]


def _tool(name: str) -> str:
    """The absolute path of a util-linux tool (it runs under a cleared PATH), or its bare name."""
    return shutil.which(name, path=_PATH) or name


class _Tail:
    """The last ``cap`` bytes of a stream, and how many came before them."""

    def __init__(self, cap: int):
        self.cap, self.buf, self.cut = cap, bytearray(), 0

    def add(self, data: bytes) -> None:
        self.buf += data
        if len(self.buf) > self.cap:
            drop = len(self.buf) - self.cap
            del self.buf[:drop]
            self.cut += drop

    def text(self) -> str:
        body = self.buf.decode("utf-8", errors="replace")
        return f"[clawrl: {self.cut} earlier bytes cut]\n{body}" if self.cut else body


async def _drain(stream: asyncio.StreamReader, tail: _Tail) -> None:
    while chunk := await stream.read(65536):
        tail.add(chunk)


async def _feed(stream: asyncio.StreamWriter, data: bytes) -> None:
    try:
        stream.write(data)
        await stream.drain()
        stream.close()
    except (BrokenPipeError, ConnectionResetError):
        pass


def _python_dirs() -> list[str]:
    """The Python environment's directories outside /usr (a venv's prefix and its base)."""
    out: list[str] = []
    for p in (sys.prefix, sys.base_prefix):
        real = os.path.realpath(p)
        if not (real == "/usr" or real.startswith("/usr/")) and real not in out:
            out.append(real)
    return out


# Top-level names a sandbox may not make writable: the read-only system view. The Python
# environment may live anywhere (/root/.pyenv, a venv in /tmp): it is mounted read-only over the
# sandbox's own directories, after them, so it shows even inside a writable /tmp or /root.
SYSTEM_TOP = frozenset({"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "proc", "dev", "sys",
                        "run", "boot"})


def _host_view() -> list[tuple[str, str, str]]:
    """(kind, name, what) for the top-level system entries shown read-only: a 'dir' bound from the
    host, or a 'link' re-created with the host's target (/bin -> usr/bin on merged-/usr hosts)."""
    out = [("dir", "usr", "/usr"), ("dir", "etc", "/etc")]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = f"/{name}"
        if os.path.islink(host):
            out.append(("link", name, os.readlink(host)))
        elif os.path.isdir(host):
            out.append(("dir", name, host))
    return out


def _check_abs(path: str, what: str) -> None:
    if not isinstance(path, str) or not path.startswith("/"):
        raise SandboxError(f"{what} must be an absolute path inside the sandbox, got {path!r}")


class Sandbox(abc.ABC):
    """A writable tree on the host plus a way to run commands over it. Use ``open_sandbox``."""

    backend: str = ""

    def __init__(self, sandbox_cfg: SandboxConfig, slot: UidSlot, base: Path, limits: Limits,
                 env: Optional[dict[str, str]], workdir: str, writable: Iterable[str]):
        _check_abs(workdir, "workdir")
        self.sandbox_cfg = sandbox_cfg
        self.slot = slot
        self.limits = limits
        self.workdir = workdir
        self._base = base
        self._base_lock: Optional[int] = None  # flock on base/lock while this sandbox lives (_new_base)
        self.root = base / "tree"  # the writable top-level dirs: root/app is /app inside
        self.root.mkdir(mode=0o755)
        self._closed = False
        self.env: dict[str, str] = {"PATH": self._path_var(), "HOME": workdir, "LANG": "C.UTF-8",
                                    "TERM": "dumb", **(env or {})}
        for w in writable:
            self.add_writable(w)
        self.add_writable("/" + self._top(workdir))
        self._ensure_dir(workdir)

    # ----- paths -----

    def _path_var(self) -> str:
        # python3 is the Python environment clawrl runs in (mounted read-only), ahead of /usr/bin's.
        return os.path.dirname(os.path.realpath(sys.executable)) + ":" + _PATH

    def _chown(self, fd: int) -> None:
        if not self.slot.shared:
            os.fchown(fd, self.slot.uid, self.slot.gid)

    def _top(self, path: str) -> str:
        _check_abs(path, "path")
        top = path.strip("/").split("/")[0]
        if not top or top in (".", ".."):
            raise SandboxError(f"{path!r} is not under a writable top-level directory")
        if top in SYSTEM_TOP:
            raise SandboxError(f"{path!r} is read-only inside the sandbox (/{top} is the host's)")
        return top

    def add_writable(self, path: str) -> None:
        """Make top-level directory ``path`` (e.g. "/tests") writable; bound in from the next exec on."""
        top = self._top(path)
        if "/" in path.strip("/"):
            raise SandboxError(f"writable dirs are top-level (like /app), got {path!r}")
        d = self.root / top
        if not d.exists():
            d.mkdir(mode=0o755)
            if not self.slot.shared:
                os.chown(d, self.slot.uid, self.slot.gid)

    def _resolve(self, path: str) -> list[str]:
        self._top(path)
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            parts = resolve(fd, path)
        except UnsafePath as e:
            raise SandboxError(f"{path}: {e}") from None
        finally:
            os.close(fd)
        if not parts:
            raise SandboxError(f"{path!r} resolves to the sandbox's /")
        self._top("/" + "/".join(parts))  # a link may lead elsewhere, e.g. /app/x -> /etc/passwd
        return parts

    def host_path(self, path: str) -> Path:
        """The host path behind an absolute in-sandbox path under a writable top-level directory
        (/app/x -> root/app/x), links resolved as the sandbox sees them; SandboxError for read-only
        or unknown places. Creating the top-level directory makes it writable from the next exec."""
        parts = self._resolve(path)
        self.add_writable("/" + parts[0])
        return self.root.joinpath(*parts)

    def _ensure_dir(self, path: str) -> None:
        parts = self._resolve(path)
        self.add_writable("/" + parts[0])
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            make_dirs(fd, parts, chown=self._chown)
        finally:
            os.close(fd)

    # ----- files -----

    def _write(self, path: str, data: bytes, mode: int) -> None:
        parts = self._resolve(path)
        self.add_writable("/" + parts[0])
        rfd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fd = open_beneath(rfd, parts, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode, chown=self._chown)
        except (UnsafePath, IsADirectoryError, NotADirectoryError) as e:
            raise SandboxError(f"cannot write {path}: {e}") from None
        finally:
            os.close(rfd)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            os.fchmod(f.fileno(), mode & 0o1777)  # never setuid/setgid: clawrl may be root

    def _read(self, path: str) -> bytes:
        parts = self._resolve(path)
        rfd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fd = open_beneath(rfd, parts, os.O_RDONLY)
        except FileNotFoundError:
            raise SandboxError(f"no such file in the sandbox: {path}") from None
        except (UnsafePath, IsADirectoryError, NotADirectoryError) as e:
            raise SandboxError(f"cannot read {path}: {e}") from None
        finally:
            os.close(rfd)
        with os.fdopen(fd, "rb") as f:
            return f.read()

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        """Write ``data`` (str: utf-8) to in-sandbox ``path``, creating parent directories; the file
        belongs to the sandbox's uid, so its commands may change it."""
        self._check_open()
        blob = data.encode() if isinstance(data, str) else bytes(data)
        await asyncio.to_thread(self._write, path, blob, mode)

    async def read_file(self, path: str) -> bytes:
        """The bytes of in-sandbox ``path`` (under a writable top-level directory)."""
        self._check_open()
        return await asyncio.to_thread(self._read, path)

    # ----- exec -----

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError("the sandbox is closed")

    def _writable_tops(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.is_symlink())

    @abc.abstractmethod
    def _argv(self, argv: list[str], env: dict[str, str], cwd: str) -> list[str]:
        """The host command line that runs ``argv`` in this sandbox with exactly ``env``, in ``cwd``."""

    def _host_cwd(self, cwd: str) -> str:
        """Where the host-side process starts (isolating backends: the sandbox tree, not ours)."""
        return str(self.root)

    async def exec(self, command: str | list[str], *, timeout_s: float | None = None,
                   env: dict[str, str] | None = None, cwd: str | None = None,
                   stdin: bytes | None = None) -> ExecResult:
        """Run ``command`` (a str runs under /bin/bash -c) and wait for it, at most ``timeout_s``
        (default sandbox.exec_timeout_s) of wall clock. ``env`` adds to the sandbox's ``env``; ``cwd``
        defaults to the workdir. No process of the exec outlives it."""
        self._check_open()
        argv = ["/bin/bash", "-c", command] if isinstance(command, str) else [str(a) for a in command]
        if not argv or not argv[0]:
            raise SandboxError("empty command")
        if "=" in argv[0]:
            raise SandboxError(f"a command may not start with a NAME=VALUE word: {argv[0]!r}")
        cwd = cwd or self.workdir
        _check_abs(cwd, "cwd")
        full_env = {**self.env, **(env or {})}
        for k in full_env:
            if not k or "=" in k or "\0" in k:
                raise SandboxError(f"bad environment variable name {k!r}")
        timeout = self.sandbox_cfg.exec_timeout_s if timeout_s is None else float(timeout_s)
        host_argv = self._argv(argv, full_env, cwd)
        cap = self.sandbox_cfg.max_output_bytes
        out, err = _Tail(cap), _Tail(cap)
        start = time.monotonic()
        spawn = asyncio.ensure_future(asyncio.create_subprocess_exec(
            *host_argv, stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=self._host_env(full_env),
            cwd=self._host_cwd(cwd), start_new_session=True))
        try:
            proc = await asyncio.shield(spawn)
        except asyncio.CancelledError:
            # Cancelled while the process starts: Python 3.11 hangs forever if that start itself is
            # cancelled (its transport waits for pipes that never connected), so the start runs to
            # its end, and the process then goes the way of any cancelled exec.
            proc = await spawn
            await self._stop(proc)
            raise
        readers = [asyncio.create_task(_drain(proc.stdout, out)), asyncio.create_task(_drain(proc.stderr, err))]
        if stdin is not None:  # fed alongside, so a command that never reads it still meets the wall clock
            readers.append(asyncio.create_task(_feed(proc.stdin, stdin)))
        timed_out = False
        try:
            try:
                await asyncio.wait_for(proc.wait(), timeout)
            except asyncio.TimeoutError:
                timed_out = True
                await self._stop(proc)
        except BaseException:  # cancelled: the process tree must not outlive us
            await asyncio.shield(self._stop(proc))
            for r in readers:
                r.cancel()
            raise
        await self._after_exit(proc)
        _, pending = await asyncio.wait(readers, timeout=2.0)
        for r in pending:  # only an unisolated straggler can hold a pipe open this long
            r.cancel()
        return ExecResult(returncode=proc.returncode, stdout=out.text(), stderr=err.text(),
                          timed_out=timed_out, duration_s=time.monotonic() - start)

    def _host_env(self, env: dict[str, str]) -> dict[str, str]:
        """The environment of the host-side process: a clean one (the sandbox's env travels in the
        command line), so nothing of clawrl's environment (keys, LD_PRELOAD) leaks or runs as root."""
        return {"PATH": _PATH, "LANG": "C.UTF-8"}

    @abc.abstractmethod
    def _signal_all(self, proc: asyncio.subprocess.Process, sig: int) -> None:
        """Send ``sig`` to every process of the exec."""

    async def _stop(self, proc: asyncio.subprocess.Process) -> None:
        """SIGTERM everything the exec runs, SIGKILL after the grace; returns once it is gone."""
        if proc.returncode is None:
            self._signal_all(proc, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), self.sandbox_cfg.kill_grace_s)
            except asyncio.TimeoutError:
                pass
        self._signal_all(proc, signal.SIGKILL)
        await proc.wait()

    async def _after_exit(self, proc: asyncio.subprocess.Process) -> None:
        """After the exec's process exited: isolating backends have nothing left (the pid namespace
        died with its init)."""

    # ----- lifetime -----

    async def close(self) -> None:
        """Kill anything left running as the slot's uid, free the slot, delete the tree (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            if not self.slot.shared:
                await _kill_uid_until_gone(self.slot.uid)
        finally:
            self.slot.release()
            await asyncio.to_thread(shutil.rmtree, self._base, True)
            _release_base(self)

    async def __aenter__(self) -> "Sandbox":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


async def _kill_uid_until_gone(uid: int, rounds: int = 200) -> None:
    """SIGKILL every process of ``uid`` until none is left (a fork bomb may fork between two
    sweeps; zombies take a moment to be reaped)."""
    for _ in range(rounds):
        if not kill_uid(uid, signal.SIGKILL):
            return
        await asyncio.sleep(0.01)
    left = pids_of_uid(uid)
    if left:
        raise SandboxError(f"processes {left[:5]} of sandbox uid {uid} survived SIGKILL")


def _children(pid: int) -> list[int]:
    """The child processes of ``pid`` (from /proc; scanning parents where the kernel lacks the
    children file)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except (FileNotFoundError, ProcessLookupError):
        pass
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat", "rb") as f:
                if int(f.read().rsplit(b")", 1)[1].split()[1]) == pid:
                    out.append(int(p))
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            pass
    return out


def _pid_ns(pid: int | str) -> Optional[str]:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None


class _NamespacedSandbox(Sandbox):
    """Shared by the isolating backends: the exec's processes are its pid namespace's members."""

    def _drop_argv(self) -> list[str]:
        """Become the slot's uid with no capabilities and no way back (as root; not root: nothing to
        drop, bwrap already runs everything as clawrl's uid without capabilities)."""
        if self.slot.shared:
            return []
        return [_tool("setpriv"), f"--reuid={self.slot.uid}", f"--regid={self.slot.gid}", "--clear-groups",
                "--no-new-privs", "--inh-caps=-all", "--bounding-set=-all", "--"]

    def _inner_argv(self, argv: list[str], env: dict[str, str]) -> list[str]:
        """rlimits, CPU pinning, the uid drop, then exactly ``env``: each binary execs the next. The
        environment comes last so that nothing a task sets (LD_PRELOAD naming a file it wrote)
        reaches the steps that still run as root."""
        return (self.limits.prlimit_argv() + self.limits.taskset_argv(self.slot.index) + self._drop_argv()
                + ["/usr/bin/env", "-i", *(f"{k}={v}" for k, v in env.items())] + argv)

    def _signal_all(self, proc: asyncio.subprocess.Process, sig: int) -> None:
        namespaces = {ns for c in _children(proc.pid) if (ns := _pid_ns(c)) and ns != _pid_ns("self")}
        if namespaces:
            for p in os.listdir("/proc"):
                if p.isdigit() and _pid_ns(p) in namespaces:
                    try:
                        os.kill(int(p), sig)
                    except ProcessLookupError:
                        pass
        if sig == signal.SIGKILL and proc.returncode is None:  # not reaped yet: the pid is still its
            try:
                os.kill(proc.pid, sig)  # its death SIGKILLs the namespace's init, and so the namespace
            except ProcessLookupError:
                pass


class BwrapSandbox(_NamespacedSandbox):
    """bubblewrap builds the view in one process: fresh namespaces, read-only binds, its own init
    as pid 1 (it reaps orphans and takes everything down when the command exits)."""

    backend = "bwrap"

    def _argv(self, argv: list[str], env: dict[str, str], cwd: str) -> list[str]:
        out = ["bwrap", "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
               "--die-with-parent",  # clawrl's kill of bwrap reaches the namespace
               "--new-session",  # no terminal to push keystrokes into (TIOCSTI)
               "--clearenv", "--hostname", "sandbox"]
        if self.slot.shared:
            out += ["--unshare-user"]  # unprivileged bwrap needs a user namespace to mount anything
        else:
            # As root bwrap drops every capability unless told; setpriv needs these three to switch
            # to the slot's uid and clear the bounding set, and then drops them all.
            out += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"]
        for kind, name, what in _host_view():
            out += ["--ro-bind", what, f"/{name}"] if kind == "dir" else ["--symlink", what, f"/{name}"]
        out += ["--proc", "/proc", "--dev", "/dev"]
        tops = self._writable_tops()
        for top in tops:
            out += ["--bind", str(self.root / top), f"/{top}"]
        if "tmp" not in tops:
            out += ["--tmpfs", "/tmp"]
        made = {"/"}
        for d in _python_dirs():  # last: over a writable /tmp or /root that holds it
            # bwrap would create /root (above /root/.pyenv/...) with the host's 0700, which the slot's
            # uid could not traverse; missing parents are made 0755 instead (empty but for the env).
            for parent in list(reversed(Path(d).parents))[1:]:
                if str(parent) not in made:
                    made.add(str(parent))
                    out += ["--perms", "0755", "--dir", str(parent)]
            out += ["--ro-bind", d, d]
        out += ["--remount-ro", "/", "--chdir", cwd, "--"]
        return out + self._inner_argv(argv, env)


class UnshareSandbox(_NamespacedSandbox):
    """util-linux ``unshare`` makes the namespaces; a shell script inside, still root but only in
    new namespaces, mounts the view onto a skeleton of empty mount points (made once, at open),
    pivots into it, brings loopback up, and runs the command through prlimit and setpriv. That
    shell stays as pid 1 to reap orphans; when the command exits, so does it, and the kernel kills
    the rest of the namespace. Every mount happens in the exec's private mount namespace: the host
    only ever sees the empty skeleton."""

    backend = "unshare"
    DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        if self.slot.shared:
            raise SandboxError("the unshare backend needs root (it mounts the view as root before dropping "
                               "to the slot's uid); use sandbox.backend=bwrap")
        # The skeleton: root-owned, 0755, and read-only once pivoted into. Making it here in Python
        # saves each exec a few dozen mkdir/ln processes.
        self._view = view = self._base / "view"
        view.mkdir(mode=0o755)
        for kind, name, what in _host_view():
            (view / name).mkdir() if kind == "dir" else (view / name).symlink_to(what)
        for d in _python_dirs():
            (view / d.lstrip("/")).mkdir(mode=0o755, parents=True, exist_ok=True)
        for d in ("proc", "tmp", "dev/shm", ".old"):
            (view / d).mkdir(mode=0o755, parents=True, exist_ok=True)  # /tmp: made already if Python is there
        for n in self.DEV_NODES:
            (view / "dev" / n).touch(mode=0o644)
        (view / "dev" / "fd").symlink_to("/proc/self/fd")
        for i, n in enumerate(("stdin", "stdout", "stderr")):
            (view / "dev" / n).symlink_to(f"fd/{i}")

    def _script(self, cwd: str) -> str:
        q = shlex.quote
        tops = self._writable_tops()
        for top in tops:
            (self._view / top).mkdir(mode=0o755, exist_ok=True)
        lines = ["set -e", f"NR={q(str(self._view))}",
                 'mount --bind "$NR" "$NR"']  # pivot_root wants a mount point
        # Non-recursive binds: submounts (Docker's /etc/hosts, ...) stay out, only what is chosen.
        ro = "mount --bind -o ro,nosuid,nodev"
        for kind, name, what in _host_view():
            if kind == "dir":
                lines.append(f'{ro} {q(what)} "$NR/{name}"')
        for top in tops:
            lines.append(f'mount --bind -o nosuid,nodev {q(str(self.root / top))} "$NR/{top}"')
        if "tmp" not in tops:
            lines.append('mount -t tmpfs -o mode=1777,nosuid,nodev clawrl-tmp "$NR/tmp"')
        for d in _python_dirs():  # last: over a writable /tmp or /root that holds it
            lines.append(f'mkdir -p -m 0755 "$NR"{q(d)}; {ro} {q(d)} "$NR"{q(d)}')
        lines += [
            'mount -t proc -o nosuid,nodev,noexec proc "$NR/proc"',  # this pid namespace's processes only
            f'for n in {" ".join(self.DEV_NODES)}; do mount --bind "/dev/$n" "$NR/dev/$n"; done',
            'mount -t tmpfs -o mode=1777,nosuid,nodev clawrl-shm "$NR/dev/shm"',
            _loopback_up(),
            'cd "$NR"; pivot_root . .old; cd /',
            "umount -l /.old",  # the host's tree is gone from this namespace
            "mount -o remount,bind,ro /",
            "hostname sandbox",
            f"cd {q(cwd)}",
            "set +e",
            # The shell's own messages ("Killed") must not land in the command's stderr.
            'exec 3>&2 2>/dev/null; "$@" 2>&3 3>&-; exit $?',
        ]
        return "\n".join(lines)

    def _argv(self, argv: list[str], env: dict[str, str], cwd: str) -> list[str]:
        # setpriv --pdeathsig: if clawrl dies, unshare dies, and --kill-child takes the namespace
        # with it (bwrap's --die-with-parent does the same there).
        return ([_tool("setpriv"), "--pdeathsig", "KILL", "--", "unshare", "--mount", "--pid", "--net", "--ipc", "--uts", "--fork", "--kill-child",
                 "--propagation", "private", "--", "/bin/sh", "-c", self._script(cwd), "clawrl-sandbox"]
                + self._inner_argv(argv, env))


def _loopback_up() -> str:
    """Shell that brings ``lo`` up in the new network namespace: ``ip`` where iproute2 is installed,
    else two ioctls from the running Python."""
    if shutil.which("ip"):
        return "ip link set lo up"
    code = ("import socket,fcntl,struct;s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM);"
            "f=struct.unpack('16sh14x',fcntl.ioctl(s,0x8913,struct.pack('16sh14x',b'lo',0)))[1];"
            "fcntl.ioctl(s,0x8914,struct.pack('16sh14x',b'lo',f|1))")
    return f"{shlex.quote(sys.executable)} -c {shlex.quote(code)}"


class SubprocessSandbox(Sandbox):
    """No isolation: commands run on the host as clawrl's own user, in the host's filesystem and
    network; absolute paths like /app are the HOST's, so commands should use relative paths (the
    working directory is the host path behind the workdir). Only with sandbox.allow_unisolated."""

    backend = "subprocess"

    def _argv(self, argv: list[str], env: dict[str, str], cwd: str) -> list[str]:
        # No RLIMIT_NPROC: it would count all of this user's processes, clawrl's own included.
        return self.limits.prlimit_argv(with_nproc=False) + argv

    def _host_env(self, env: dict[str, str]) -> dict[str, str]:
        try:
            home = self.host_path(env.get("HOME", self.workdir))
        except SandboxError:  # a HOME outside the writable dirs: the workdir's host path instead
            home = self.host_path(self.workdir)
        return {**env, "HOME": str(home)}

    def _host_cwd(self, cwd: str) -> str:
        return str(self.host_path(cwd))

    def _signal_all(self, proc: asyncio.subprocess.Process, sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)  # its own session: the exec's process group
        except ProcessLookupError:
            pass

    async def _after_exit(self, proc: asyncio.subprocess.Process) -> None:
        self._signal_all(proc, signal.SIGKILL)  # stragglers of the group (not setsid'd ones: no isolation)


_CLASSES: dict[str, type[Sandbox]] = {"bwrap": BwrapSandbox, "unshare": UnshareSandbox,
                                      "subprocess": SubprocessSandbox}
_TOOLS = {"bwrap": ("bwrap", "prlimit", "setpriv"),
          "unshare": ("unshare", "prlimit", "setpriv", "mount", "umount", "pivot_root", "hostname"),
          "subprocess": ("prlimit",)}
_probed: dict[str, Optional[str]] = {}  # backend -> None (works) or why not; once per process


def _probe(backend: str, sandbox: Sandbox) -> Optional[str]:
    """Why ``backend`` does not work here, or None: it must actually run a command as the slot's uid
    (a binary that exists but lacks namespaces or privileges fails here, once, not in every exec)."""
    if backend in _probed:
        return _probed[backend]
    missing = [t for t in _TOOLS[backend] if shutil.which(t) is None]
    if missing:
        _probed[backend] = reason = f"{', '.join(missing)} not found"
        return reason
    argv = sandbox._argv(["/bin/sh", "-c", "id -u; cat /proc/sys/kernel/hostname"], {"PATH": _PATH},
                         sandbox.workdir)
    try:
        r = subprocess.run(argv, env=sandbox._host_env({}), cwd=sandbox._host_cwd(sandbox.workdir),
                           capture_output=True, timeout=30, start_new_session=True)
        got = r.stdout.decode(errors="replace").split()
        want = [str(sandbox.slot.uid), "sandbox"]
        said = " ".join(r.stderr.decode(errors="replace").split()) or " ".join(got)  # one line
        reason = None if r.returncode == 0 and got == want else \
            f"test command failed (exit {r.returncode}): {said[:200]}"
    except (OSError, subprocess.TimeoutExpired) as e:
        reason = f"test command failed: {e}"
    _probed[backend] = reason
    return reason


def open_sandbox(cfg: SandboxConfig, *, env: dict[str, str] | None = None, workdir: str = "/app",
                 writable: Iterable[str] = ("/app", "/tmp", "/logs"), cpus: float | None = None,
                 memory_mb: int | None = None, network: bool = False) -> Sandbox:
    """A new sandbox with the backend ``cfg.backend`` names (auto: bwrap, then unshare; the
    unisolated subprocess backend only when ``cfg.allow_unisolated``). ``memory_mb``/``cpus`` from a
    task tighten the configured limits; ``network=True`` is refused (no backend here has any).

    The first open of each backend in a process runs one probe command synchronously (tens of ms),
    so that a backend that exists but cannot work here is refused once, with its reason."""
    if network:
        raise SandboxError("the task needs network access, which no sandbox backend here provides")
    if cpus is not None and cpus <= 0:
        raise SandboxError(f"cpus must be > 0, got {cpus}")
    if memory_mb is not None and memory_mb < 16:
        raise SandboxError(f"memory_mb must be >= 16, got {memory_mb}")
    limits = Limits(cpu_time_s=cfg.cpu_time_s, memory_mb=min(cfg.memory_mb, memory_mb or cfg.memory_mb),
                    max_procs=cfg.max_procs, max_file_mb=cfg.max_file_mb, max_open_files=cfg.max_open_files,
                    cpus=cpus)
    if cfg.backend == "subprocess" and not cfg.allow_unisolated:
        raise SandboxError("sandbox.backend=subprocess does not isolate; set sandbox.allow_unisolated=true to "
                           "accept that")
    candidates = ["bwrap", "unshare"] if cfg.backend == "auto" else [cfg.backend]
    if cfg.backend == "auto" and cfg.allow_unisolated:
        candidates.append("subprocess")
    root = Path(cfg.root) if cfg.root else Path(tempfile.gettempdir())
    root.mkdir(parents=True, exist_ok=True)
    _sweep_dead(root)
    reasons = []
    for backend in candidates:
        if _probed.get(backend, None) is not None:
            reasons.append(f"{backend}: {_probed[backend]}")
            continue
        try:
            sandbox = _make(backend, cfg, root, limits, env, workdir, writable)
        except SandboxError as e:
            if len(candidates) == 1:
                raise
            _probed[backend] = str(e)
            reasons.append(f"{backend}: {e}")
            continue
        reason = None if backend == "subprocess" else _probe(backend, sandbox)
        if reason is None:
            return sandbox
        _close_now(sandbox)
        reasons.append(f"{backend}: {reason}")
    if cfg.backend == "auto":
        raise SandboxError(f"no isolating sandbox works here ({'; '.join(reasons)}); install bubblewrap "
                           f"(apt-get install bubblewrap), or set sandbox.allow_unisolated=true knowing that "
                           f"commands then run unisolated on the host")
    raise SandboxError(f"sandbox.backend={cfg.backend} does not work here: {'; '.join(reasons)}")


def _make(backend: str, cfg: SandboxConfig, root: Path, limits: Limits, env, workdir, writable) -> Sandbox:
    try:
        slot = claim_slot(cfg.uid_base, cfg.slots) if backend != "subprocess" else \
            UidSlot(uid=os.getuid(), gid=os.getgid(), index=0, shared=True)
    except EnvError as e:
        raise SandboxError(str(e)) from None
    base, lock = _new_base(root)
    try:
        sandbox = _CLASSES[backend](cfg, slot, base, limits, env, workdir, writable)
    except BaseException:
        slot.release()
        shutil.rmtree(base, ignore_errors=True)
        os.close(lock)
        raise
    sandbox._base_lock = lock
    return sandbox


BASE_PREFIX = "clawrl-sbx-"
_swept: set[str] = set()  # roots already cleared of dead sandboxes by this process


def _new_base(root: Path) -> tuple[Path, int]:
    """A new sandbox directory under ``root`` and its liveness lock: an flock on ``base/lock``,
    taken before the file gets that name, so that no sweeper ever sees it unlocked."""
    base = Path(tempfile.mkdtemp(prefix=BASE_PREFIX, dir=root))
    fd = os.open(base / "lock.new", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.rename(base / "lock.new", base / "lock")
    return base, fd


def _release_base(sandbox: Sandbox) -> None:
    if sandbox._base_lock is not None:
        os.close(sandbox._base_lock)  # after the tree is gone, so no sweeper races the owner
        sandbox._base_lock = None


def _sweep_dead(root: Path) -> None:
    """Delete the sandbox directories under ``root`` whose owner died without closing them (a
    killed clawrl): their lock is free. Once per root per process; only this user's directories."""
    if str(root) in _swept:
        return
    _swept.add(str(root))
    for entry in os.scandir(root):
        try:
            if not entry.name.startswith(BASE_PREFIX) or not entry.is_dir(follow_symlinks=False) \
                    or entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            fd = os.open(os.path.join(entry.path, "lock"), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue  # gone meanwhile; or no lock (yet): not a sandbox directory, or one being made
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # its owner is alive
        try:
            shutil.rmtree(entry.path, ignore_errors=True)
        finally:
            os.close(fd)


def _close_now(sandbox: Sandbox) -> None:
    """Close a sandbox that never ran anything (a failed probe), without an event loop."""
    sandbox._closed = True
    sandbox.slot.release()
    shutil.rmtree(sandbox._base, ignore_errors=True)
    _release_base(sandbox)
