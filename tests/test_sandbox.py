"""Sandboxes: each escape attempt fails for every isolating backend, and the limits themselves hold.

The escape tests run for bwrap and unshare alike (parametrized); a backend that does not work here
skips, or fails where CI lists it in CLAWRL_REQUIRE (tests/required_tools.py). Each asserts the
limit it is about (no connection reached the host's listener, the host file is unchanged, the process
count stayed within max_procs ...), not merely that the command failed or timed out.
"""
from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from clawrl.config import SandboxConfig
from clawrl.envs import sandbox as sandbox_mod
from clawrl.envs import sandbox_slots
from clawrl.envs.base import EnvError
from clawrl.envs.sandbox import SandboxError, open_sandbox
from clawrl.envs.sandbox_slots import claim_slot, pids_of_uid
from required_tools import skip_unless_available

ISOLATING = ("bwrap", "unshare")
_works: dict[str, str | None] = {}


def _problem(backend: str) -> str | None:
    """Why ``backend`` cannot open a sandbox here (None: it can), found once per session."""
    if backend not in _works:
        try:
            sb = open_sandbox(SandboxConfig(backend=backend))
        except SandboxError as e:
            _works[backend] = str(e)
        else:
            asyncio.run(sb.close())
            _works[backend] = None
    return _works[backend]


@pytest.fixture(params=ISOLATING)
def backend(request) -> str:
    name = request.param
    problem = _problem(name)
    skip_unless_available(name, reason=f"the {name} sandbox does not work here: {problem}",
                          available=problem is None)
    return name


@pytest.fixture
def cfg(backend, tmp_path) -> SandboxConfig:
    return SandboxConfig(backend=backend, root=str(tmp_path / "sandboxes"), exec_timeout_s=30, kill_grace_s=0.5)


def run(coro):
    return asyncio.run(coro)


async def _gone(uid: int, within_s: float = 3.0) -> list[int]:
    """The processes of ``uid`` still alive after waiting up to ``within_s`` for them to be reaped."""
    deadline = time.monotonic() + within_s
    while (left := pids_of_uid(uid)) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return left


# ----------------------------------------------------------------- escapes (every isolating backend)


def test_cannot_connect_to_a_port_on_the_hosts_loopback(cfg):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    probe = (f"import socket\n"
             f"try:\n    socket.create_connection(('127.0.0.1', {port}), timeout=3); print('CONNECTED')\n"
             f"except OSError as e:\n    print('FAILED', type(e).__name__)\n"
             # loopback inside works: the sandbox's own server on its own lo
             f"s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(1)\n"
             f"c = socket.create_connection(s.getsockname(), timeout=3); print('OWN-LO-OK')\n"
             f"print(sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]))\n")

    async def go():
        async with open_sandbox(cfg) as sb:
            return await sb.exec(["python3", "-c", probe])

    try:
        r = run(go())
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever reached the host's listener
    finally:
        listener.close()
    assert r.returncode == 0, r
    assert "FAILED ConnectionRefusedError" in r.stdout and "CONNECTED" not in r.stdout
    assert "OWN-LO-OK" in r.stdout
    assert "['lo']" in r.stdout  # loopback and nothing else


def test_cannot_write_outside_its_writable_dirs(cfg, tmp_path):
    # Only new, uniquely named files and a file the test planted: were isolation ever broken, this
    # test must not damage the machine it runs on.
    host_file = tmp_path / "host.txt"
    host_file.write_text("original")
    tag = secrets.token_hex(4)
    new_files = [Path(d) / f"clawrl-escape-{tag}" for d in
                 ("/usr", "/etc", "/", str(Path.home()), str(Path(__file__).resolve().parent), sys.prefix, "/dev")]
    targets = [*map(str, new_files), str(host_file)]
    script = "; ".join(f"(echo pwned > {t}) 2>/dev/null && echo WROTE {t}" for t in targets)
    script += f"; (echo pwned >> {host_file}) 2>/dev/null && echo WROTE append"

    async def go():
        async with open_sandbox(cfg) as sb:
            r = await sb.exec(script + "; echo ok > /app/inside.txt && echo INSIDE-OK")
            return r, (sb.root / "app" / "inside.txt").read_text()

    try:
        r, inside = run(go())
        assert "WROTE" not in r.stdout, r.stdout
        assert "INSIDE-OK" in r.stdout and inside == "ok\n"  # the writable dir is writable
        assert host_file.read_text() == "original"
        assert [f for f in new_files if f.exists()] == []
    finally:
        for f in new_files:
            f.unlink(missing_ok=True)


def test_cannot_read_secrets_in_the_run_dir_or_home(cfg, tmp_path):
    token = secrets.token_hex(16)
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    (run_dir / "secret.txt").write_text(token)
    home_secret = Path.home() / f".clawrl-sandbox-secret-{secrets.token_hex(4)}"
    home_secret.write_text(token)
    try:
        paths = [run_dir / "secret.txt", home_secret]
        script = "; ".join(f"cat {p} 2>/dev/null; test -e {p} && echo SEES {p}; "
                           f"cat /proc/1/root{p} /proc/1/cwd/{p.name} 2>/dev/null" for p in paths)
        script += f"; ls -A {Path.home()} 2>/dev/null"

        async def go():
            async with open_sandbox(cfg) as sb:
                return await sb.exec(script)

        r = run(go())
    finally:
        home_secret.unlink()
    assert token not in r.stdout and "SEES" not in r.stdout, r.stdout
    # Of HOME at most the Python environment's mount point is there (pyenv lives in /root here).
    shown = set(r.stdout.split())
    python_dirs = {Path(p).relative_to(Path.home()).parts[0] for p in (sys.prefix, sys.base_prefix)
                   if Path(p).is_relative_to(Path.home())}
    assert shown <= python_dirs, shown


def test_cannot_see_or_signal_host_processes_nor_become_root(cfg):
    head, tail = secrets.token_hex(6), secrets.token_hex(6)
    # a host process whose command line carries a token the sandbox's own script never spells out whole
    host = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", head + tail])
    script = (f"kill -0 {host.pid} 2>/dev/null && echo SIGNALLED; "
              f"t={head}; t=${{t}}{tail}; grep -l \"$t\" /proc/[0-9]*/cmdline 2>/dev/null; "
              "echo PROCS $(ls /proc | grep -c '^[0-9]'); "
              "python3 -c 'import os; os.setuid(0)' 2>/dev/null && echo BECAME-ROOT; "
              "grep -E '^(CapEff|CapPrm|CapBnd|NoNewPrivs)' /proc/self/status")

    async def go():
        async with open_sandbox(cfg) as sb:
            return await sb.exec(script)

    try:
        r = run(go())
        assert host.poll() is None  # still alive: nothing inside reached it
    finally:
        host.kill()
        host.wait()
    # grep -l names every process whose command line holds the token: none may be the host's
    assert "SIGNALLED" not in r.stdout and "/cmdline" not in r.stdout and "BECAME-ROOT" not in r.stdout, r
    assert int(r.stdout.split("PROCS ")[1].split()[0]) <= 8  # only this exec's own processes
    status = dict(line.split(":") for line in r.stdout.splitlines() if ":" in line)
    assert {k: v.strip() for k, v in status.items()} == {
        "CapEff": "0000000000000000", "CapPrm": "0000000000000000", "CapBnd": "0000000000000000",
        "NoNewPrivs": "1"}


def test_fork_bomb_stays_within_max_procs(cfg):
    cfg = replace(cfg, max_procs=24)
    bomb = ("import os, time\n"
            "for _ in range(10):\n"
            "    try:\n        os.fork()\n    except OSError:\n        pass\n"
            "time.sleep(2)\n")

    async def go():
        async with open_sandbox(cfg) as sb:
            uid = sb.slot.uid
            task = asyncio.create_task(sb.exec(["python3", "-c", bomb], timeout_s=20))
            most = 0
            while not task.done():
                most = max(most, len(pids_of_uid(uid)))
                await asyncio.sleep(0.02)
            return await task, most, uid

    r, most, uid = run(go())
    assert not r.timed_out, r
    # Unlimited, 10 rounds of fork() make 1024 processes; the limit held them at max_procs.
    assert 0 < most <= 24, most
    print(f"fork bomb: at most {most} processes of uid {uid}")
    assert most >= 12, f"the bomb only reached {most} processes: did it run?"
    assert pids_of_uid(uid) == []


def test_memory_bomb_hits_the_address_space_limit(cfg):
    async def go():
        async with open_sandbox(cfg, memory_mb=256) as sb:  # a task's memory_mb tightens the limit
            small = await sb.exec(["python3", "-c", "x = bytearray(64 << 20); print('ALLOCATED')"])
            big = await sb.exec(["python3", "-c", "x = bytearray(1 << 30); print('ALLOCATED')"])
            limit = await sb.exec("ulimit -v")
            return small, big, limit

    small, big, limit = run(go())
    assert small.returncode == 0 and "ALLOCATED" in small.stdout, small
    assert big.returncode != 0 and "MemoryError" in big.stderr and "ALLOCATED" not in big.stdout, big
    assert not big.timed_out
    assert limit.stdout.strip() == str(256 * 1024)  # KiB


def test_sigterm_ignoring_process_is_killed_by_the_wall_clock(cfg):
    stubborn = ("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                "print('IGNORING', flush=True)\ntime.sleep(120)\n")

    async def go():
        async with open_sandbox(cfg) as sb:
            r = await sb.exec(["python3", "-c", stubborn], timeout_s=1.5)
            return r, await _gone(sb.slot.uid), sb.slot.uid

    r, left, uid = run(go())
    assert r.timed_out and "IGNORING" in r.stdout, r
    assert r.duration_s < 1.5 + 0.5 + 5, r.duration_s  # wall clock + grace, not the 120 s sleep
    assert left == [], f"processes of uid {uid} survived: {left}"


def test_no_process_is_left_behind_by_an_exec(cfg):
    daemonize = ("import os, time\n"
                 "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(300)\n"
                 "    os._exit(0)\n")
    script = ("sleep 301 & nohup sleep 302 >/dev/null 2>&1 & setsid sleep 303 & ( (sleep 304 &) & ); "
              f"python3 -c {daemonize!r}; sleep 0.3; "
              "echo STARTED $(ls /proc | grep -c '^[0-9]')")

    async def go():
        async with open_sandbox(cfg) as sb:
            r = await sb.exec(script)
            return r, await _gone(sb.slot.uid), sb.slot.uid

    r, left, uid = run(go())
    assert r.returncode == 0, r
    assert int(r.stdout.split()[-1]) >= 6  # the stragglers were really running inside
    assert left == [], f"processes of uid {uid} outlived the exec: {left}"


def test_close_kills_a_running_exec(cfg):
    async def go():
        sb = open_sandbox(cfg)
        uid = sb.slot.uid
        task = asyncio.create_task(sb.exec("sleep 300 & sleep 300", timeout_s=60))
        while len(pids_of_uid(uid)) < 2:
            await asyncio.sleep(0.02)
        await sb.close()
        r = await asyncio.wait_for(task, 10)
        return r, await _gone(uid), sb.root

    r, left, root = run(go())
    assert not r.timed_out and r.returncode != 0
    assert left == [] and not root.exists()


def test_a_cancelled_exec_leaves_nothing_running(cfg):
    async def go():
        async with open_sandbox(cfg) as sb:
            task = asyncio.create_task(sb.exec("sleep 300 & sleep 300", timeout_s=60))
            while len(pids_of_uid(sb.slot.uid)) < 2:
                await asyncio.sleep(0.02)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return await _gone(sb.slot.uid, within_s=0.5), sb.slot.uid

    left, uid = run(go())
    assert left == [], f"processes of uid {uid} outlived a cancelled exec: {left}"


def test_an_exec_cancelled_while_its_process_starts_ends_at_once(cfg):
    """Python 3.11 hangs forever when a subprocess start is cancelled mid-way (seen as a `clawrl env
    check` that never exited after one task failed and gather cancelled the rest)."""
    async def go():
        async with open_sandbox(cfg) as sb:
            for delay in (0, 0, 0.001, 0.002, 0.005):
                task = asyncio.create_task(sb.exec("sleep 300", timeout_s=60))
                await asyncio.sleep(delay)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await asyncio.wait_for(asyncio.shield(task), 30)
            return await _gone(sb.slot.uid, within_s=2.0), sb.slot.uid

    left, uid = run(go())
    assert left == [], f"processes of uid {uid} outlived a cancelled exec: {left}"


def test_cpu_file_size_and_open_file_limits(cfg):
    cfg = replace(cfg, cpu_time_s=1, max_file_mb=1, max_open_files=32)
    many = ("import os\nfds = []\ntry:\n    for _ in range(100): fds.append(os.open('/dev/null', os.O_RDONLY))\n"
            "except OSError as e:\n    print('EMFILE' if e.errno == 24 else e)\nprint(len(fds))\n")

    async def go():
        async with open_sandbox(cfg) as sb:
            spin = await sb.exec(["python3", "-c", "while True: pass"], timeout_s=20)
            big = await sb.exec("head -c 3000000 /dev/zero > /app/big")
            files = await sb.exec(["python3", "-c", many])
            return spin, big, (sb.root / "app" / "big").stat().st_size, files

    spin, big, size, files = run(go())
    assert not spin.timed_out and spin.duration_s < 10, spin  # RLIMIT_CPU, not the wall clock
    assert spin.returncode in (128 + 24, 128 + 9), spin  # SIGXCPU, or SIGKILL at the hard limit
    assert big.returncode != 0 and size <= 1 << 20, (big, size)
    assert "EMFILE" in files.stdout and int(files.stdout.split()[-1]) < 32, files


def test_symlinks_in_the_sandbox_cannot_redirect_host_side_file_access(cfg, tmp_path):
    host_file = tmp_path / "host-secret.txt"  # under /tmp on the host, which the sandbox has its own of
    host_file.write_text("host")
    passwd = Path("/etc/passwd").read_bytes()

    async def go():
        async with open_sandbox(cfg) as sb:
            await sb.exec(f"ln -s /etc/passwd /app/abs; ln -s ../../../../../etc/passwd /app/rel; "
                          f"ln -s {host_file} /app/host; echo inside > /app/real; ln -s /app/real /app/ok; "
                          f"mkdir /app/d; ln -s /usr /app/d/sys; ln -s /app/loop /app/loop")
            for p in ("/app/abs", "/app/rel", "/app/d/sys/bin/ls", "/app/loop"):
                with pytest.raises(SandboxError):
                    await sb.read_file(p)
                with pytest.raises(SandboxError):
                    await sb.write_file(p, "pwned")
            with pytest.raises(SandboxError):
                sb.host_path("/app/abs")
            # a link to a host path names the sandbox's own copy of that place: its /tmp, not the host's
            with pytest.raises(SandboxError, match="no such file"):
                await sb.read_file("/app/host")
            await sb.write_file("/app/host", "written inside")
            inside = sb.root.joinpath(*host_file.parts[1:]).read_text()
            return await sb.read_file("/app/ok"), inside

    ok, inside = run(go())
    assert ok == b"inside\n" and inside == "written inside"
    assert host_file.read_text() == "host" and Path("/etc/passwd").read_bytes() == passwd


# ----------------------------------------------------------------- behaviour


def test_a_python_environment_inside_tmp_shows_read_only_within_a_writable_tmp(cfg, tmp_path, monkeypatch):
    """A venv in /tmp (as CI's may be) is mounted over the sandbox's own writable /tmp."""
    env = tmp_path / "venv"  # pytest's tmp_path is under the host's /tmp
    env.mkdir()
    (env / "marker").write_text("the environment\n")
    env.chmod(0o755)
    for parent in env.parents:
        if str(parent) != "/":
            os.chmod(parent, os.stat(parent).st_mode | 0o005)
    dirs = [*sandbox_mod._python_dirs(), str(env)]
    monkeypatch.setattr(sandbox_mod, "_python_dirs", lambda: dirs)

    async def go():
        async with open_sandbox(cfg) as sb:
            return await sb.exec(f"cat {env}/marker && echo ok > /tmp/mine && cat /tmp/mine && "
                                 f"! touch {env}/planted 2>/dev/null && echo read-only")

    result = run(go())
    assert (result.returncode, result.stdout) == (0, "the environment\nok\nread-only\n"), result.stderr
    assert not (env / "planted").exists()


def test_files_round_trip_and_persist_across_execs(cfg):
    async def go():
        async with open_sandbox(cfg) as sb:
            await sb.write_file("/app/sub/run.sh", "#!/bin/bash\necho from-script \"$@\"\n", mode=0o755)
            r1 = await sb.exec("./sub/run.sh a b && echo more >> sub/run.sh && echo x > made.txt")
            r2 = await sb.exec("cat made.txt")
            made = await sb.read_file("/app/made.txt")
            script = await sb.read_file("/app/sub/run.sh")
            await sb.write_file("/tests/t.sh", b"exit 0\n")  # a new top-level dir, writable from now on
            r3 = await sb.exec("ls /tests && touch /tests/new && echo T-OK")
            return r1, r2, made, script, r3, sb.host_path("/app/made.txt"), sb.root

    r1, r2, made, script, r3, host, root = run(go())
    assert r1.returncode == 0 and r1.stdout == "from-script a b\n", r1
    assert r2.stdout == "x\n" and made == b"x\n"
    assert script.endswith(b"more\n")  # write_file's file belongs to the sandbox's uid
    assert "t.sh" in r3.stdout and "T-OK" in r3.stdout, r3
    assert host == root / "app" / "made.txt"
    assert not root.exists()  # close deletes the tree


def test_env_cwd_home_and_stdin(cfg):
    async def go():
        async with open_sandbox(cfg, env={"BASE": "b"}) as sb:
            sb.env["ADDED"] = "a"
            r = await sb.exec('echo "$BASE $ADDED $ONE $HOME $(pwd)"; cat', env={"ONE": "1"}, cwd="/tmp",
                              stdin=b"piped")
            leak = await sb.exec("env")
            return r, leak

    r, leak = run(go())
    assert r.stdout == "b a 1 /app /tmp\npiped", r
    # nothing of clawrl's own environment leaks in
    assert "PYTEST_CURRENT_TEST" not in leak.stdout and "CLAWRL_REQUIRE" not in leak.stdout


def test_a_tasks_cpus_pin_it_and_its_files_belong_to_the_slot_uid(cfg):
    async def go():
        async with open_sandbox(cfg, cpus=0.5) as sb:
            r = await sb.exec("nproc; stat -c %u /app /tmp; id -u; ls / ")
            return r, sb.slot.uid

    r, uid = run(go())
    nproc, app_owner, tmp_owner, me, *top = r.stdout.split()
    assert nproc == "1"  # ceil(0.5) CPU
    assert app_owner == tmp_owner == me == str(uid)
    assert "tree" not in top and "view" not in top  # clawrl's own layout stays outside


def test_output_is_capped_keeping_the_tail(cfg):
    cfg = replace(cfg, max_output_bytes=1024)

    async def go():
        async with open_sandbox(cfg) as sb:
            return await sb.exec("head -c 100000 /dev/zero | tr '\\0' a; echo END")

    r = run(go())
    assert r.stdout.endswith("aaaaEND\n")
    assert "earlier bytes cut" in r.stdout and len(r.stdout) < 1200


def test_sixteen_sandboxes_run_at_once_without_blocking_the_loop(cfg):
    """A barrier, not a clock: each command says it is ready and then waits for a go file that the
    test writes only once all sixteen are ready. Execs run one after another would never pass the
    barrier (the first waits for a go that needs the sixteenth), however slow or loaded the box."""
    async def go():
        boxes = [open_sandbox(cfg) for _ in range(16)]
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        async def release_when_all_ready():
            ready = [b.host_path("/app/ready") for b in boxes]
            deadline = time.monotonic() + 25
            while not all(p.exists() for p in ready):
                assert time.monotonic() < deadline, f"{sum(p.exists() for p in ready)}/16 sandboxes started"
                await asyncio.sleep(0.02)
            before = ticks
            for b in boxes:
                b.host_path("/app/go").touch()
            return before

        t = asyncio.create_task(ticker())
        try:
            command = "touch ready; while [ ! -e go ]; do sleep 0.02; done; sleep 1; echo passed"
            *results, ticks_at_release = await asyncio.gather(
                *(b.exec(command) for b in boxes), release_when_all_ready())
            ticks_after_sleep = ticks - ticks_at_release
        finally:
            t.cancel()
            await asyncio.gather(*(b.close() for b in boxes))
        return results, ticks_after_sleep, {b.slot.uid for b in boxes}

    results, ticks, uids = run(go())
    assert all(r.returncode == 0 and r.stdout.strip() == "passed" for r in results), results
    assert ticks >= 10  # the loop kept ticking through the sandboxes' one-second sleep
    assert len(uids) == 16  # one uid per sandbox


def test_exec_after_close_and_bad_paths_are_refused(cfg):
    async def go():
        sb = open_sandbox(cfg)
        for bad in ("relative/path", "/usr/bin/x", "/etc/passwd", "/proc/1/environ"):
            with pytest.raises(SandboxError):
                await sb.write_file(bad, "x")
        with pytest.raises(SandboxError):
            await sb.read_file("/app/missing")
        await sb.close()
        await sb.close()  # idempotent
        with pytest.raises(SandboxError):
            await sb.exec("true")

    run(go())


# ----------------------------------------------------------------- choosing a backend


def test_network_is_refused():
    with pytest.raises(SandboxError, match="network"):
        open_sandbox(SandboxConfig(allow_unisolated=True), network=True)


def test_without_isolation_clawrl_refuses_with_a_one_line_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(sandbox_mod, "_probed", {"bwrap": "bwrap not found", "unshare": "unshare not found"})
    with pytest.raises(SandboxError) as e:
        open_sandbox(SandboxConfig(root=str(tmp_path)))
    msg = str(e.value)
    assert "\n" not in msg and "bubblewrap" in msg and "sandbox.allow_unisolated=true" in msg
    assert isinstance(e.value, EnvError)
    with pytest.raises(SandboxError, match="allow_unisolated"):
        open_sandbox(SandboxConfig(backend="subprocess", root=str(tmp_path)))
    # with the flag, auto falls back to the plain subprocess
    sb = open_sandbox(SandboxConfig(root=str(tmp_path), allow_unisolated=True))
    assert sb.backend == "subprocess"
    run(sb.close())


def test_plain_subprocess_backend_works_with_the_flag(tmp_path):
    cfg = SandboxConfig(backend="subprocess", allow_unisolated=True, root=str(tmp_path), kill_grace_s=0.2,
                        exec_timeout_s=0.5)

    async def go():
        async with open_sandbox(cfg, env={"GREETING": "hi"}) as sb:
            await sb.write_file("/app/in.txt", "data\n")
            r = await sb.exec("cat in.txt; echo $GREETING > out.txt; echo $HOME")
            slow = await sb.exec("sleep 30")  # sandbox.exec_timeout_s is the default wall clock
            return r, await sb.read_file("/app/out.txt"), slow, sb.root

    r, out, slow, root = run(go())
    assert r.stdout.splitlines() == ["data", str(root / "app")], r
    assert out == b"hi\n"
    assert slow.timed_out and slow.duration_s < 5


def test_slots_are_never_shared(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("uid slots exist only as root (otherwise every sandbox runs as the user's uid)")
    a = claim_slot(62900, 2)
    b = claim_slot(62900, 2)
    try:
        assert {a.uid, b.uid} == {62900, 62901}
        with pytest.raises(EnvError, match="in use"):
            claim_slot(62900, 2)
        a.release()
        c = claim_slot(62900, 2)
        assert c.uid == a.uid
        c.release()
    finally:
        a.release()
        b.release()


def test_not_root_every_sandbox_shares_the_users_uid_and_unshare_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(sandbox_slots.os, "geteuid", lambda: 4242)
    slot = claim_slot(61000, 4)
    assert slot.shared and slot.uid == os.getuid()  # nothing claimed: the user's uid is unprivileged
    with pytest.raises(SandboxError, match="unshare backend needs root"):
        open_sandbox(SandboxConfig(backend="unshare", root=str(tmp_path)))


def test_a_planted_slot_lock_dir_is_refused(monkeypatch, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("uid slots exist only as root")
    planted = tmp_path / "slots"
    planted.mkdir(mode=0o777)
    planted.chmod(0o777)
    monkeypatch.setattr(sandbox_slots, "SLOT_LOCK_DIR", planted)
    with pytest.raises(EnvError, match="only root may write"):
        claim_slot(62900, 2)
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    monkeypatch.setattr(sandbox_slots, "SLOT_LOCK_DIR", link)
    with pytest.raises(EnvError, match="only root may write"):
        claim_slot(62900, 2)


def test_stdin_the_command_never_reads_does_not_outlast_the_wall_clock(tmp_path):
    cfg = SandboxConfig(backend="subprocess", allow_unisolated=True, root=str(tmp_path), kill_grace_s=0.2)

    async def go():
        async with open_sandbox(cfg) as sb:
            return await sb.exec("sleep 30", stdin=b"x" * (4 << 20), timeout_s=0.5)

    r = run(go())
    assert r.timed_out and r.duration_s < 5, r


def test_all_slots_taken_is_a_clear_error(cfg):
    cfg = replace(cfg, uid_base=62950, slots=1)
    if os.geteuid() != 0:
        pytest.skip("uid slots exist only as root")

    async def go():
        async with open_sandbox(cfg):
            with pytest.raises(SandboxError, match="all 1 sandbox slots .* are in use"):
                open_sandbox(cfg)
        async with open_sandbox(cfg) as sb:  # closing freed it
            return sb.slot.uid

    assert run(go()) == 62950


def test_loopback_comes_up_without_iproute2(monkeypatch, tmp_path):
    problem = _problem("unshare")
    skip_unless_available("unshare", reason=f"the unshare sandbox does not work here: {problem}",
                          available=problem is None)
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **kw: None if name == "ip" else real_which(name, *a, **kw))
    cfg = SandboxConfig(backend="unshare", root=str(tmp_path))
    probe = ("import socket\ns = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(1)\n"
             "socket.create_connection(s.getsockname(), timeout=3); print('OWN-LO-OK')\n")

    async def go():
        async with open_sandbox(cfg) as sb:
            return await sb.exec(["python3", "-c", probe])

    r = run(go())
    assert r.returncode == 0 and "OWN-LO-OK" in r.stdout, r


def test_a_backend_that_cannot_run_is_refused_once_with_its_own_reason(monkeypatch, tmp_path):
    """The probe runs the real command line: here bwrap's is broken, as a kernel without namespaces
    would break it, and the refusal carries bwrap's own words on one line."""
    monkeypatch.setattr(sandbox_mod, "_probed", {"unshare": "unshare not found"})
    real_argv = sandbox_mod.BwrapSandbox._argv
    monkeypatch.setattr(sandbox_mod.BwrapSandbox, "_argv",
                        lambda self, argv, env, cwd: real_argv(self, argv, env, cwd)[:1] + ["--no-such-option"])
    if shutil.which("bwrap") is None:
        pytest.skip("needs the bwrap binary to fail with its own message")
    with pytest.raises(SandboxError) as e:
        open_sandbox(SandboxConfig(root=str(tmp_path)))
    assert "\n" not in str(e.value) and "bwrap: test command failed" in str(e.value)
    assert "--no-such-option" in sandbox_mod._probed["bwrap"]
    assert list(tmp_path.iterdir()) == []  # the failed sandbox left nothing behind


def test_nothing_outlives_a_killed_clawrl(cfg):
    """clawrl dies (SIGKILL, no close) in the middle of an exec: the sandbox's processes die too."""
    child = (
        "import asyncio, sys\n"
        "from clawrl.config import SandboxConfig\n"
        "from clawrl.envs.sandbox import open_sandbox\n"
        "async def main():\n"
        f"    sb = open_sandbox(SandboxConfig(backend={cfg.backend!r}, root={cfg.root!r}))\n"
        "    task = asyncio.create_task(sb.exec('sleep 300 & setsid sleep 300 & sleep 300'))\n"
        "    await asyncio.sleep(0.5)\n"
        "    print(sb.slot.uid, flush=True)\n"
        "    await task\n"
        "asyncio.run(main())\n")

    async def go():
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", child, stdout=asyncio.subprocess.PIPE)
        uid = int(await asyncio.wait_for(proc.stdout.readline(), 30))
        while len(pids_of_uid(uid)) < 3:
            await asyncio.sleep(0.02)
        proc.kill()
        await proc.wait()
        left = await _gone(uid, within_s=5)
        dead = list(Path(cfg.root).iterdir())
        async with open_sandbox(cfg) as sb:  # the next clawrl clears what the dead one left on disk
            return uid, left, dead, sorted(Path(cfg.root).iterdir()), sb._base

    uid, left, dead, after, live = run(go())
    assert left == [], f"processes of uid {uid} outlived the killed clawrl: {left}"
    assert len(dead) == 1 and after == [live]
