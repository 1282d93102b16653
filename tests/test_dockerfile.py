"""The Dockerfile interpreter: a task's Dockerfile read as a plan for the host, and applied in a
real (bubblewrap) sandbox. Unsupported or failing lines refuse the task naming the line."""
from __future__ import annotations

import asyncio
import importlib.metadata
import io
import tarfile
from pathlib import Path

import pytest

from clawrl.config import SandboxConfig
from clawrl.envs.sandbox import open_sandbox
from clawrl.envs.task_formats.dockerfile import (CopyStep, RunStep, WorkdirStep, image_name, is_common_base,
                                                 parse_dockerfile, plan_environment)
from clawrl.envs.task_formats.dockerignore import is_ignored
from clawrl.envs.task_formats.environment import prepare_environment
from clawrl.envs.task_formats.harbor import read_harbor
from clawrl.envs.task_formats.packages import drop_satisfied, missing_packages
from clawrl.envs.task_formats.spec import TaskRefused
from clawrl.envs.task_formats.tb1 import read_tb1
from tests.required_tools import skip_unless_available

FIXTURES = Path(__file__).parent / "fixtures" / "tasks"


def harbor_task(tmp_path: Path, dockerfile: str, files: dict[str, str] | None = None, toml: str = "") -> Path:
    """A minimal Harbor task whose environment/ holds ``dockerfile`` and ``files``."""
    task = tmp_path / "t"
    (task / "environment").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "task.toml").write_text(toml or '[metadata]\nsplit = "train"\n')
    (task / "instruction.md").write_text("do it")
    (task / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    (task / "environment" / "Dockerfile").write_text(dockerfile)
    for name, text in (files or {}).items():
        p = task / "environment" / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return task


def plan_of(task: Path, base_env=None):
    spec, _ = read_harbor(task)
    return plan_environment(spec, base_env)


def refusal(task: Path) -> str:
    with pytest.raises(TaskRefused) as e:
        plan_of(task)
    return str(e.value)


@pytest.fixture
def sandbox_cfg() -> SandboxConfig:
    skip_unless_available("bwrap")
    return SandboxConfig(backend="bwrap")


def prepared(cfg: SandboxConfig, task: Path, probe: str):
    """Prepare ``task`` in a fresh sandbox, run ``probe`` there, return (plan, ExecResult, workdir, env)."""
    async def go():
        spec, _ = read_harbor(task) if (task / "task.toml").is_file() else read_tb1(task)
        sandbox = open_sandbox(cfg)
        try:
            plan = await prepare_environment(spec, sandbox)
            result = await sandbox.exec(probe)
            return plan, result, sandbox.workdir, dict(sandbox.env)
        finally:
            await sandbox.close()
    return asyncio.run(go())


# ----- reading -----

def test_continuations_comments_and_heredocs_become_logical_lines(tmp_path):
    f = tmp_path / "Dockerfile"
    f.write_text("# syntax=docker/dockerfile:1\nFROM debian:12\n\nRUN echo a \\\n  # a comment inside\n\n"
                 "    && echo b\nrun <<EOF\necho one\necho two\nEOF\nCOPY <<-END /app/x.txt\n\thello\n\tEND\n"
                 "ENV A=1\n")
    ins = parse_dockerfile(f)
    assert [(i.lineno, i.keyword) for i in ins] == [(2, "FROM"), (4, "RUN"), (8, "RUN"), (12, "COPY"), (15, "ENV")]
    assert ins[1].args == "echo a && echo b"
    assert ins[2].heredocs == ("echo one\necho two\n",)
    assert ins[3].heredocs == ("hello\n",)


def test_unclosed_heredoc_is_refused_with_its_line(tmp_path):
    f = tmp_path / "Dockerfile"
    f.write_text("FROM debian\nRUN <<EOF\necho never closed\n")
    with pytest.raises(TaskRefused, match=r"Dockerfile:2: heredoc <<EOF has no closing EOF"):
        parse_dockerfile(f)


@pytest.mark.parametrize("image, common", [
    ("debian:bookworm-slim", True), ("ubuntu:24.04", True), ("python:3.12-slim-bookworm", True),
    ("buildpack-deps:jammy", True), ("docker.io/library/python:3.11", True),
    ("public.ecr.aws/docker/library/debian:bookworm-slim@sha256:4724b8cc51e3", True),
    ("ghcr.io/laude-institute/t-bench/ubuntu-24-04:20250624", True),
    ("ghcr.io/laude-institute/t-bench/python-3-13:20250620", True),
    ("alpine:3.19", False), ("node:20", False), ("nvidia/cuda:12.4.0-runtime-ubuntu22.04", False),
    ("ghcr.io/acme/python:3.11", False), ("localhost:5000/debian", False)])
def test_common_base_images_run_on_the_host_and_others_do_not(image, common):
    assert is_common_base(image) is common


def test_image_name_strips_registry_tag_and_digest():
    assert image_name("docker.io/library/python:3.11-slim@sha256:abc") == "python"
    assert image_name("localhost:5000/debian") == "localhost:5000/debian"


def test_env_both_syntaxes_arg_defaults_and_substitution(tmp_path):
    task = harbor_task(tmp_path, "ARG BASE=python:3.11-slim\nFROM ${BASE}\nARG BASE\nARG MODE=fast\nARG EMPTY\n"
                       "ENV A=1 B=\"two words\" C='$A literal' D=${MODE}-$A\nENV OLD the rest of it\n"
                       "ENV PATH=/opt/tool/bin:$PATH E=${NOPE:-fallback} F=${A:+set}\nRUN echo $A\n")
    plan = plan_of(task, base_env={"PATH": "/usr/bin"})
    assert plan.base_image == "python:3.11-slim"
    assert plan.env == {"A": "1", "B": "two words", "C": "$A literal", "D": "fast-", "OLD": "the rest of it",
                        "PATH": "/opt/tool/bin:/usr/bin", "E": "fallback", "F": "set"}
    run = [s for s in plan.steps if isinstance(s, RunStep)][0]
    # ARG values are visible to RUN (the pre-FROM BASE, redeclared, keeps its value), as in Docker
    assert run.env["MODE"] == "fast" and run.env["BASE"] == "python:3.11-slim" and run.env["EMPTY"] == ""
    assert run.command == "echo $A"  # the shell expands RUN lines, not the interpreter


def test_workdir_is_relative_to_the_previous_one_and_the_last_is_the_tasks(tmp_path):
    plan = plan_of(harbor_task(tmp_path, "FROM debian\nWORKDIR /srv\nWORKDIR project/../code\nRUN pwd\n"))
    assert [s.path for s in plan.steps if isinstance(s, WorkdirStep)] == ["/srv", "/srv/code"]
    assert plan.workdir == "/srv/code"
    assert [s.cwd for s in plan.steps if isinstance(s, RunStep)] == ["/srv/code"]


def test_no_workdir_means_app_and_task_toml_workdir_wins(tmp_path):
    assert plan_of(harbor_task(tmp_path / "a", "FROM debian\nRUN true\n")).workdir == "/app"
    task = harbor_task(tmp_path / "b", "FROM debian\nWORKDIR /srv\n",
                       toml='[environment]\nworkdir = "/data"\n')
    assert plan_of(task).workdir == "/data"


def test_copy_expands_directories_globs_and_honours_dockerignore(tmp_path):
    task = harbor_task(tmp_path, "FROM python:3.12\nWORKDIR /app\nCOPY src/ ./src/\nCOPY *.cfg conf/\n"
                       "COPY --chmod=755 run.sh /usr2/run\n",
                       files={"src/a.py": "a", "src/deep/b.py": "b", "src/skip.log": "x", "x.cfg": "1",
                              "y.cfg": "2", "run.sh": "echo", ".dockerignore": "**/*.log\n"})
    copies = [s for s in plan_of(task).steps if isinstance(s, CopyStep)]
    assert [d for _, d in copies[0].files] == ["/app/src/a.py", "/app/src/deep/b.py"]
    assert "/app/src/deep" in copies[0].dirs
    assert [d for _, d in copies[1].files] == ["/app/conf/x.cfg", "/app/conf/y.cfg"]
    assert copies[2].files[0][1] == "/usr2/run" and copies[2].chmod == 0o755


def test_copy_never_brings_in_a_tb1_tasks_tests_or_solution(tmp_path):
    task = tmp_path / "tb"
    (task / "tests").mkdir(parents=True)
    (task / "tests" / "test_outputs.py").write_text("def test(): pass\n")
    (task / "solution.sh").write_text("echo solved\n")
    (task / "run-tests.sh").write_text("pytest\n")
    (task / "data.txt").write_text("data\n")
    (task / "task.yaml").write_text("instruction: do it\n")
    (task / "Dockerfile").write_text("FROM ubuntu:24.04\nWORKDIR /app\nCOPY . .\n")
    spec, _ = read_tb1(task)
    copy = [s for s in plan_environment(spec).steps if isinstance(s, CopyStep)][0]
    assert sorted(d for _, d in copy.files) == ["/app/Dockerfile", "/app/data.txt", "/app/task.yaml"]


@pytest.mark.parametrize("line, reason", [
    ("ADD https://example.com/x.tgz /app/", "ADD of a URL needs network"),
    ("COPY --from=builder /out /app/", "COPY --from copies out of another image"),
    ("COPY ../secret /app/", "lies outside the build context"),
    ("COPY missing.txt /app/", "missing.txt is not in the build context"),
    ("USER app", "USER app: the sandbox runs everything as its one user"),
    ("FROM debian AS second", "multi-stage builds need an image builder"),
    ("RUN --mount=type=cache,target=/root/.cache pip install x", "RUN flags (--mount=type=cache"),
    ('SHELL ["/bin/zsh", "-c"]', "only SHELL"),
    ("FROBNICATE now", "FROBNICATE is not an instruction this host can interpret"),
])
def test_unsupported_lines_are_refused_naming_the_line(tmp_path, line, reason):
    (tmp_path / "secret").write_text("s")
    message = refusal(harbor_task(tmp_path, f"FROM debian:12\nWORKDIR /app\n{line}\n"))
    assert message.startswith("t: Dockerfile:3: ") and reason in message
    assert "\n" not in message


def test_harmless_instructions_are_ignored_and_user_root_accepted(tmp_path):
    plan = plan_of(harbor_task(tmp_path, 'FROM debian\nLABEL a=b\nMAINTAINER me\nEXPOSE 80\nUSER root\n'
                               'VOLUME /data\nHEALTHCHECK CMD true\nSTOPSIGNAL SIGINT\nCMD ["sleep", "1"]\n'
                               'ENTRYPOINT ["x"]\nSHELL ["/bin/bash", "-o", "pipefail", "-c"]\nRUN false | true\n'))
    assert [a.split(": ")[1].split()[0] for a in plan.ignored] == [
        "LABEL", "MAINTAINER", "EXPOSE", "VOLUME", "HEALTHCHECK", "STOPSIGNAL", "CMD", "ENTRYPOINT"]
    assert [s.command for s in plan.steps if isinstance(s, RunStep)] == ["set -o pipefail; false | true"]


def test_own_image_is_refused_naming_the_image_and_the_backend_setting():
    spec, _ = read_harbor(FIXTURES / "harbor-own-image")
    with pytest.raises(TaskRefused) as e:
        plan_environment(spec)
    assert str(e.value) == ("harbor-own-image: Dockerfile:1: needs its own image ghcr.io/acme/toolchain-runtime:2.4 "
                            "(only debian, ubuntu, python, buildpack-deps bases run here, on the host's userland; an "
                            "image of its own needs a container backend, which no sandbox.backend provides)")


def test_instruction_before_from_and_missing_from_are_refused(tmp_path):
    assert "an instruction before FROM" in refusal(harbor_task(tmp_path / "a", "RUN true\nFROM debian\n"))
    assert "no FROM line" in refusal(harbor_task(tmp_path / "b", "ARG X=1\n"))


# ----- applied in a sandbox -----

def test_fixture_dockerfile_builds_files_env_and_workdir_in_the_sandbox(sandbox_cfg):
    plan, r, workdir, env = prepared(sandbox_cfg, FIXTURES / "harbor-word-count",
                                     'pwd; cat greeting.txt; wc -w < data/poem.txt; echo "$POEM_DIR"; '
                                     'echo more >> data/poem.txt && echo writable; python3 -c "print(6*7)"')
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:7] == ["/app", "hello there", "9", "/app/data", "writable", "42", ""]
    assert workdir == "/app" and env["GREETING"] == "hello there" and env["LANG"] == "C.UTF-8"


def test_tb1_heredoc_and_exec_form_run_lines(sandbox_cfg):
    plan, r, workdir, _ = prepared(sandbox_cfg, FIXTURES / "tb1-csv-sum", "cat sales.csv; ls")
    assert r.stdout == "region,amount\nnorth,10\nsouth,5\nnorth,7\nnotes.txt\nsales.csv\n"


def test_failing_run_line_refuses_the_task_naming_the_line_and_the_network(sandbox_cfg):
    spec, _ = read_harbor(FIXTURES / "harbor-failing-run")

    async def go():
        sandbox = open_sandbox(sandbox_cfg)
        try:
            with pytest.raises(TaskRefused) as e:
                await prepare_environment(spec, sandbox)
            # the lines before it ran; the ones after did not
            assert (await sandbox.read_file("/app/setup.log")) == b"setting up\n"
            assert not sandbox.host_path("/app/after.log").exists()
            return str(e.value)
        finally:
            await sandbox.close()
    message = asyncio.run(go())
    assert message.startswith("harbor-failing-run: Dockerfile:5: RUN apt-get update && apt-get install -y "
                              "--no-install-recommends cowsay-clawrl-missing: failed with exit code ")
    assert ("(it installs cowsay-clawrl-missing, which the host lacks, and the sandbox has no network to fetch "
            "them)") in message


def test_a_failing_plain_line_names_its_exit_code_and_last_words(sandbox_cfg, tmp_path):
    task = harbor_task(tmp_path, "FROM debian\nWORKDIR /app\nRUN echo fine\nRUN echo 'broken config' >&2; exit 3\n")
    spec, _ = read_harbor(task)

    async def go():
        async with open_sandbox(sandbox_cfg) as sandbox:
            with pytest.raises(TaskRefused) as e:
                await prepare_environment(spec, sandbox)
            return str(e.value)
    assert asyncio.run(go()) == ("t: Dockerfile:4: RUN echo 'broken config' >&2; exit 3: failed with exit code 3: "
                                 "broken config")


def test_run_lines_get_new_top_level_dirs_and_add_unpacks_archives(sandbox_cfg, tmp_path):
    task = harbor_task(tmp_path, "FROM ubuntu:22.04\nWORKDIR /work\nADD bundle.tar /opt/bundle/\n"
                       "RUN mkdir -p /input /output && cp /opt/bundle/inner/x.txt /input/\n"
                       "COPY --chmod=700 tool.sh /opt/tool.sh\n", files={"tool.sh": "echo tool\n"})
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = b"from the tarball\n"
        info = tarfile.TarInfo("inner/x.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    (task / "environment" / "bundle.tar").write_bytes(buf.getvalue())
    _, r, workdir, _ = prepared(sandbox_cfg, task, "cat /input/x.txt; ls -d /output; /opt/tool.sh; pwd; "
                                "stat -c %a /opt/tool.sh; touch /opt/tool.sh && echo agent-can-modify")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "from the tarball\n/output\ntool\n/work\n700\nagent-can-modify\n"
    assert workdir == "/work"


def test_copy_to_a_read_only_place_is_refused_naming_the_line(sandbox_cfg, tmp_path):
    task = harbor_task(tmp_path, "FROM debian\nCOPY tool.sh /usr/local/bin/tool\n", files={"tool.sh": "x"})
    spec, _ = read_harbor(task)

    async def go():
        async with open_sandbox(sandbox_cfg) as sandbox:
            with pytest.raises(TaskRefused) as e:
                await prepare_environment(spec, sandbox)
            return str(e.value)
    message = asyncio.run(go())
    assert message.startswith("t: Dockerfile:2: COPY tool.sh /usr/local/bin/tool: ")
    assert "read-only" in message


# ----- package installs the host already satisfies -----

def test_satisfied_installs_become_true_and_the_rest_of_the_line_stays():
    skip_unless_available("dpkg-query", "not a Debian/Ubuntu host: apt lines are never satisfied here")
    pytest_version = importlib.metadata.version("pytest")
    line = ("apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends bash "
            f"coreutils && rm -rf /var/lib/apt/lists/* ; pip install --no-cache-dir pytest=={pytest_version} "
            "&& echo done")
    command, dropped = drop_satisfied(line)
    assert command == "true && true && true ; true && echo done"
    assert len(dropped) == 4


@pytest.mark.parametrize("line", [
    "apt-get install -y bash clawrl-no-such-package",  # one package missing: the line must fail as written
    "pip install pytest==0.0.1",  # a version the host does not have
    "pip install -r requirements.txt",
    "apt-get install -y bash || echo ignored",  # || : dropping a command could change what runs
    "apt-get install -y bash > /dev/null",
    "pip install $(cat pkgs)",
])
def test_lines_the_host_does_not_satisfy_run_as_written(line):
    assert drop_satisfied(line) == (line, [])


def test_missing_packages_names_what_the_host_lacks():
    skip_unless_available("dpkg-query", "not a Debian/Ubuntu host: every apt package counts as missing")
    assert missing_packages("apt-get update && apt-get install -y bash clawrl-no-such-package && "
                            "pip install --no-cache-dir pytest==0.0.1 clawrl-no-such-dist") == [
        "clawrl-no-such-package", "pytest==0.0.1", "clawrl-no-such-dist"]
    assert missing_packages("echo apt-get install nothing") == []


def test_a_dockerfile_whose_packages_are_all_here_builds(sandbox_cfg, tmp_path):
    skip_unless_available("dpkg-query", "not a Debian/Ubuntu host: apt lines are never satisfied here")
    task = harbor_task(tmp_path, "FROM debian:bookworm\nWORKDIR /app\nRUN apt-get update && \\\n"
                       "    apt-get install -y --no-install-recommends bash coreutils && \\\n"
                       "    rm -rf /var/lib/apt/lists/* && echo built > /app/built.txt\n"
                       "RUN apt-get clean\n")
    _, r, _, _ = prepared(sandbox_cfg, task, "cat built.txt")
    assert r.stdout == "built\n"


def test_a_link_out_of_the_build_context_is_never_read(tmp_path):
    task = harbor_task(tmp_path, "FROM debian\nWORKDIR /app\nCOPY conf/ /app/conf/\n", files={"conf/a.txt": "a"})
    (task / "environment" / "conf" / "stolen").symlink_to("/etc/hostname")
    assert "conf/stolen links outside the build context" in refusal(task)


def test_the_build_limit_covers_the_whole_build(sandbox_cfg, tmp_path):
    task = harbor_task(tmp_path, "FROM debian\nWORKDIR /app\nRUN sleep 0.6\nRUN sleep 0.6\nRUN echo late\n",
                       toml="[environment]\nbuild_timeout_sec = 1.0\n")
    spec, _ = read_harbor(task)

    async def go():
        async with open_sandbox(sandbox_cfg) as sandbox:
            with pytest.raises(TaskRefused) as e:
                await prepare_environment(spec, sandbox)
            return str(e.value)
    assert asyncio.run(go()) == "t: Dockerfile:4: RUN sleep 0.6: ran past the build limit of 1 s"


def test_dockerignore_last_rule_wins_and_a_directory_rule_covers_its_contents():
    rules = [(False, "docs"), (False, "*.md"), (True, "README.md"), (False, "**/cache")]
    assert is_ignored("docs/guide/a.txt", rules)
    assert is_ignored("notes.md", rules) and not is_ignored("README.md", rules)
    assert not is_ignored("sub/notes.md", rules)  # * stays within one path component
    assert is_ignored("a/b/cache/x.bin", rules) and not is_ignored("a/b/cached", rules)


def test_a_prebuilt_docker_image_runs_only_when_it_is_a_common_base(tmp_path):
    def task(name: str, image: str) -> Path:
        d = tmp_path / name
        (d / "tests").mkdir(parents=True)
        (d / "task.toml").write_text(f'[environment]\ndocker_image = "{image}"\n')
        (d / "instruction.md").write_text("x")
        (d / "tests" / "test.sh").write_text("true\n")
        return d
    plan = plan_of(task("base", "python:3.12-slim"))
    assert (plan.base_image, plan.workdir) == ("python:3.12-slim", "/app")
    spec, _ = read_harbor(task("own", "acme/runner:1"))
    with pytest.raises(TaskRefused, match=r"^own: needs its own image acme/runner:1 \(only debian"):
        plan_environment(spec)
