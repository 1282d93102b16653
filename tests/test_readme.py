"""The README's commands are the ones users run: every line of its ```bash blocks runs here as
written, or is listed in NOT_IN_CI with the reason a CI machine cannot run it. CI runs the README's
install lines (tests/readme_install.py, in a fresh venv) and test command itself (checked against .ci/run)."""
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from clawrl.config import describe_config
from gateway_support import free_port
from readme_install import install_commands

ROOT = Path(__file__).resolve().parents[1]

TWO_GPU_NODES = "two GPU nodes (the block's two columns are node 0's and node 1's commands)"
INSTALLED_BY_CI = "installs packages; .ci/run runs the Install block in a fresh venv (tests/readme_install.py)"
NOT_IN_CI = {
    **{line: INSTALLED_BY_CI for line in install_commands((ROOT / "README.md").read_text())},
    "python3 -m pytest -q tests": "the suite this test belongs to; .ci/run runs it (test_ci_runs_the_readme_test_command)",
    "bash openclaw-combine/run.sh model.path=/models/Qwen3-1.7B server.host=0.0.0.0 server.api_key=$MY_KEY "
    "run_dir=runs/me": "needs /models/Qwen3-1.7B and the user's key",
    "openclaw plugins install ./extensions/rl-training-headers --accept-capabilities":
        "changes the user's OpenClaw; tests/test_openclaw_real.py installs the plugin into a throwaway OpenClaw home",
    "openclaw config set plugins.entries.rl-training-headers.hooks.allowConversationAccess true":
        "changes the user's OpenClaw; tests/test_openclaw_real.py sets it in a throwaway OpenClaw home",
    "clawrl export-model --run-dir runs/default --out my-model":
        "needs a checkpoint in runs/default, and the quick-start run has none when CI reaches this line "
        "(train.save_every=10); tests/test_export_model.py runs the command on runs with checkpoints",
    "clawrl replay --run-dir runs/default --out runs/default-lr3e-6 train.lr=3e-6":
        "needs a finished run that trained in runs/default, and the quick-start run may not have trained when CI "
        "reaches this line; tests/test_replay.py runs the command on runs that trained",
    "bash openclaw-combine/run.sh trainer.backend=megatron cluster.tp=4 model.path=/models/Qwen3-8B  # 4 GPUs":
        "needs 4 GPUs and /models/Qwen3-8B",
    "export NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1     export NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1":
        TWO_GPU_NODES,
    "export MASTER_PORT=29500 GPUS_PER_NODE=8             export MASTER_PORT=29500 GPUS_PER_NODE=8": TWO_GPU_NODES,
    "bash openclaw-combine/run.sh trainer.backend=megatron cluster.tp=8 cluster.pp=2 model.path=/models/Qwen3-32B":
        TWO_GPU_NODES,
}


def _bash_blocks(text: str) -> list[str]:
    return [line.strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S) for line in block.splitlines()]


def readme_commands() -> list[str]:
    """Every line of the README's ```bash blocks that bash runs (not blank, not only a comment)."""
    return [line for line in _bash_blocks((ROOT / "README.md").read_text()) if line and not line.startswith("#")]


def test_ci_runs_the_readme_test_command():
    """CI runs the README's command as written, adding only the report of the slowest tests."""
    readme_cmds = _bash_blocks((ROOT / "README.md").read_text())
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    test_cmd = next(c for c in readme_cmds if "pytest" in c)
    assert f"{test_cmd} --durations=30" in ci_lines


def test_ci_installs_with_the_readme_install_lines_in_a_fresh_venv_and_tests_in_it():
    """.ci/run installs clawrl only through tests/readme_install.py, which runs the README's lines,
    and every later python3 of it (the suite's too) is that venv's."""
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    installs = [line for line in ci if "pip install" in line and not line.startswith("#")]
    assert not [line for line in installs if "requirements.txt" in line or "-e ." in line], installs
    at = ci.index('python3 tests/readme_install.py "$venv"')
    assert ci[at - 1] == "venv=$(mktemp -d)/venv" and ci[at + 1] == 'export VIRTUAL_ENV=$venv PATH="$venv/bin:$PATH"'
    assert all(ci.index(line) > at for line in ci if line.startswith("python3 ") and line != ci[at])


def test_readme_install_lines_pin_the_build_tools_before_building_without_isolation():
    """Without wheel a fresh venv cannot build the antlr4 sdist (``invalid command 'bdist_wheel'``),
    and an isolated build would download an unpinned setuptools: the first line installs both,
    setuptools at the version constraints.txt pins."""
    lines = install_commands((ROOT / "README.md").read_text())
    locked = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines() if "==" in line)
    assert lines[0] == f"pip install setuptools=={locked['setuptools']} wheel==0.46.3", lines
    assert "-r requirements-sdists.txt" in lines[1] and "-r requirements.txt -c constraints.txt" in lines[2]
    builds = [cmd for line in lines for cmd in line.split("&&") if "-r requirements-sdists.txt" in cmd or " -e ." in cmd]
    assert len(builds) == 2 and all("--no-build-isolation" in cmd for cmd in builds), builds


def test_readme_sglang_install_lines_match_ci():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    for pinned in ("--no-deps -r requirements-sglang.txt", "-r requirements-sglang-io-struct.txt",
                   '--target "$CLAWRL_HOME/sglang-io-struct"'):
        assert pinned in readme and pinned in ci, pinned


def test_install_commands_are_the_install_block_of_the_readme():
    readme = "# x\n## Install\ntext\n```bash\npip install a\n# why\n\npip install b\n```\n```bash\nno\n```\n## Next\n"
    assert install_commands(readme) == ["pip install a", "pip install b"]
    with pytest.raises(ValueError, match="no ```bash block"):
        install_commands("## Install\nnothing\n## Next\n")


def test_constraints_pin_every_requirement_at_its_own_version():
    """requirements.txt and constraints.txt can drift apart when one is edited: they must agree."""
    def pins(name):
        lines = (ROOT / name).read_text().splitlines()
        return dict(line.split(" ")[0].split("==") for line in lines if line and not line.startswith("#"))

    wanted, locked = pins("requirements.txt"), pins("constraints.txt")
    for package, version in wanted.items():
        assert locked.get(package.lower(), "").split("+")[0] == version, package
    assert pins("requirements-sdists.txt").items() <= locked.items()


def test_readme_main_command_is_the_combine_recipe_and_it_exists():
    cmds = _bash_blocks((ROOT / "README.md").read_text())
    assert cmds.index("bash openclaw-combine/run.sh") < cmds.index("python3 -m pytest -q tests")
    assert (ROOT / "openclaw-combine" / "run.sh").is_file()


def test_every_line_left_out_of_ci_is_in_the_readme():
    stale = [line for line in NOT_IN_CI if line not in readme_commands()]
    assert not stale, f"NOT_IN_CI names lines the README no longer has: {stale}"


# --- running them ----------------------------------------------------------------------------------

SESSION = "readme-session"
_SERVER = re.compile(r"bash openclaw-[\w-]+/run\.sh\b(?!.*--help-config)")  # serves until stopped
_ENV_RUN = re.compile(r"bash (terminal|toolcall)-rl/run\.sh\b")  # trains env.max_train_steps steps, then exits


def _code(line: str) -> str:
    return re.sub(r"\s+#\s.*$", "", line)  # without its trailing comment


def _as_run_here(line: str, port: int) -> str:
    """``line`` as CI runs it. Two things differ from a user's machine: the server listens on a free
    port instead of 30000 (so that this test never meets another server), and SESSION_ID is the
    session this test created."""
    code = _code(line).replace("127.0.0.1:30000", f"127.0.0.1:{port}")
    code = code.replace("SESSION_ID", SESSION)
    if _SERVER.match(code) or code.startswith("clawrl chat "):
        code += f" server.port={port}"
    elif _ENV_RUN.match(code):  # its own endpoint, beside the quick-start server
        code += f" server.port={free_port()}"
    return code


def _check(line: str, out: subprocess.CompletedProcess, url: str, work: Path) -> None:
    """What each command must have done, beyond exiting 0."""
    assert out.returncode == 0, f"{line}: exit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    if line.startswith("curl "):
        body = json.loads(out.stdout)
        assert "error" not in body and "detail" not in body, f"{line}: {out.stdout[:500]}"
        if _code(line).endswith("/admin/turns/12"):
            label = json.loads(re.search(r"-d '(.*?)'", line).group(1))["label"]
            assert body["turn_id"] == 12 and body["new_label"] == label, body
        elif _code(line).endswith("/admin/status"):
            assert body["training"]["method"] == "combine" and body["turns"] >= 12, body
        else:
            assert SESSION in out.stdout, out.stdout[:500]
    elif "--help-config" in line:
        assert out.stdout == describe_config()
    elif line.startswith("clawrl chat "):
        assert f"answered by clawrl-tiny at {url}," in out.stderr and out.stdout.strip(), out.stderr
    elif line.startswith("clawrl sessions SESSION_ID"):
        assert f"session {SESSION}" in out.stdout and "main" in out.stdout, out.stdout
    elif line.startswith("clawrl sessions"):
        assert SESSION in out.stdout, out.stdout
    elif line.startswith("clawrl export"):
        target = work / re.search(r"--out (\S+)", line).group(1)
        turns = [json.loads(t) for t in target.read_text().splitlines()]
        assert len(turns) == httpx.get(url + "/admin/status", timeout=10).json()["turns"] >= 12
    elif line.startswith("clawrl env list"):
        rows = [r.split("\t") for r in out.stdout.splitlines()]
        assert len(rows) >= 24 and all(len(r) == 3 and r[1] in ("train", "test") for r in rows), out.stdout
    elif line.startswith("clawrl env check"):
        lines = [json.loads(r) for r in out.stdout.splitlines()]
        assert len(lines) >= 24 and all(r["status"] == "ok" and r["oracle"] == 1.0 > r["nop"] for r in lines), lines
    elif line.startswith("clawrl env eval"):
        result = json.loads(out.stdout.splitlines()[-1])
        limit = re.search(r"--limit (\d+)", line)
        split = len((ROOT / "toolcall-rl" / "data" / "test.jsonl").read_text().splitlines())
        assert result["episodes"] == (int(limit.group(1)) if limit else split) and result["failed"] == 0, result
        assert 0 <= result["success_rate"] <= 1 and -1 <= result["mean_reward"] <= 1, result
        if "--run-dir" in line:  # beside the live quick-start server, which holds runs/default's lock
            assert "clawrl: evaluating " in out.stderr or "has no complete checkpoint" in out.stderr, out.stderr
        else:
            assert result["weight_version"] == 0, result
    elif line.startswith("clawrl env run"):
        report = json.loads(out.stdout.splitlines()[-1])
        assert (report["reward"], report["success"]) == (1.0, True), report
    elif _ENV_RUN.match(line):
        run_dir = work / re.search(r"run_dir=(\S+)", line).group(1)
        steps = int(re.search(r"env\.max_train_steps=(\d+)", line).group(1))
        assert f"env.max_train_steps={steps} train steps done" in out.stdout, out.stdout[-2000:]
        trained = [json.loads(m) for m in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert max(m["step"] for m in trained if "rollout/episodes" in m) == steps
        assert any("eval/success_rate" in m for m in trained)  # the held-out evaluation after the last step
    elif line.startswith("clawrl demo"):
        assert "table in" in out.stdout, out.stdout[-2000:]
    else:
        raise AssertionError(f"{line}: no check for this command; add one to _check")


class _Server:
    """A run.sh that serves until SIGTERM, in its own session (its ranks die with it on failure)."""

    def __init__(self, code: str, work: Path, env: dict):
        self.code, self.log = code, work / f"server-{time.monotonic_ns()}.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(["bash", "-c", f"exec {code}"], cwd=work, env=env, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def wait_up(self, url: str) -> None:
        deadline = time.monotonic() + 300
        while True:
            assert self.proc.poll() is None, f"{self.code}: exit {self.proc.returncode}\n{self.log.read_text()[-4000:]}"
            try:
                if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"{self.code}: not up\n{self.log.read_text()[-4000:]}"
            time.sleep(0.5)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(90) == 0, self.log.read_text()[-4000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


def _converse(url: str, turns: int) -> None:
    """One session of ``turns`` requests through the OpenAI API, as a client with the plugin sends it."""
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    messages = []
    for i in range(turns):
        messages.append({"role": "user", "content": f"What is {i}+5?"})
        r = httpx.post(url + "/v1/chat/completions", headers={"X-Session-Id": SESSION}, timeout=120,
                       json={"model": model, "messages": messages, "max_tokens": 8})
        assert r.status_code == 200, r.text
        messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})


@pytest.mark.slow
def test_every_readme_command_runs_or_is_listed_as_not_runnable_in_ci(tmp_path, tiny_model_dir):
    """The quick-start server (the first run.sh line) comes up; a session of twelve turns gives the
    inspection commands something to show (turn 12, SESSION_ID); then every other command runs in
    README order against it, and the other run.sh lines come up and stop cleanly one by one."""
    planned = [line for line in readme_commands() if line not in NOT_IN_CI]
    servers = [line for line in planned if _SERVER.match(line)]
    assert servers and servers[0] == "bash openclaw-combine/run.sh", servers
    work = tmp_path / "work"  # the user's directory: runs/default and turns.jsonl land here
    work.mkdir()
    for recipe in sorted({*ROOT.glob("openclaw-*"), *ROOT.glob("*-rl")}):
        (work / recipe.name).symlink_to(recipe)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "ADMIN_KEY": "readme-admin-key", "MASTER_PORT": str(free_port())}
    ran = []
    server = _Server(_as_run_here(servers[0], port), work, env)
    try:
        server.wait_up(url)
        ran.append(servers[0])
        _converse(url, 12)
        for line in planned:
            if line not in servers:
                out = subprocess.run(["bash", "-c", _as_run_here(line, port)], cwd=work, env=env,
                                     capture_output=True, text=True, timeout=600)
                _check(line, out, url, work)
                ran.append(line)
        server.stop()
        for line in servers[1:]:
            server = _Server(_as_run_here(line, port), work, env)
            server.wait_up(url)
            status = httpx.get(url + "/admin/status", timeout=10).json()
            assert status["training"]["method"] == "combine", status
            if "trainer.backend=megatron" in line:
                tp = re.search(r"cluster\.tp=(\d+)", line).group(1)
                assert f"layout tp={tp} " in server.log.read_text()
            server.stop()
            ran.append(line)
    finally:
        server.kill()
    assert sorted(ran) == sorted(planned)  # every line the README has, but those in NOT_IN_CI
