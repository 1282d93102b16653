"""Read a task's Dockerfile as a plan for the host: the base image, the working directory, the
environment, and the steps that build the task's files.

There is no image builder here. A task whose Dockerfile starts ``FROM`` a common base image
(debian, ubuntu, python, buildpack-deps, and Terminal-Bench's ubuntu/python/debian bases) runs on
top of the host's own userland, which stands in for that image; its other instructions become
steps applied in the task's sandbox (``clawrl.envs.task_formats.environment``):

- ``WORKDIR`` (relative to the previous one; the last is the task's working directory),
- ``COPY``/``ADD`` from the build context (globs; ``.dockerignore``; ``--chmod``; ADD unpacks a
  local tar archive; ADD of a URL and ``COPY --from`` are refused),
- ``RUN`` (shell form through bash, exec form as argv; heredocs), run in the sandbox, without
  network; a failing line refuses the task naming the line,
- ``ENV`` (``K=V ...`` and ``K V``) and ``ARG`` with defaults (visible to RUN, as in Docker),
- ``SHELL`` with bash or sh (``-o pipefail`` honoured), ``USER root``.

``LABEL``, ``EXPOSE``, ``CMD``, ``ENTRYPOINT``, ``MAINTAINER``, ``HEALTHCHECK``, ``STOPSIGNAL``,
``VOLUME`` and ``ONBUILD`` change nothing a task's files or commands see, so they are ignored.
Refused, each with its line: an unknown or custom image (it needs its own image, which only a
container backend could give; none of clawrl's ``sandbox.backend`` choices is one), a multi-stage
build, ``USER`` other than root (the sandbox has one user), anything else unknown.
"""
from __future__ import annotations

import glob
import json
import re
import tarfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Mapping, Optional

from clawrl.envs.task_formats.dockerfile_words import env_pairs, split_words
from clawrl.envs.task_formats.dockerignore import is_ignored, read_dockerignore
from clawrl.envs.task_formats.spec import DEFAULT_WORKDIR, TaskRefused, TerminalTaskSpec

# Names of base images whose userland the host (Debian) stands in for, after registry prefixes,
# tags and digests are stripped. Terminal-Bench 1.0's own bases are ubuntu-24-04, python-3-13, ...
COMMON_BASES = ("debian", "ubuntu", "python", "buildpack-deps")
_REGISTRY_PREFIXES = ("docker.io/library/", "docker.io/", "index.docker.io/library/", "library/",
                      "public.ecr.aws/docker/library/", "mirror.gcr.io/library/", "mirror.gcr.io/",
                      "ghcr.io/laude-institute/t-bench/", "ghcr.io/laude-institute/terminal-bench/")
DOCKER_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
IGNORED = {"LABEL", "EXPOSE", "CMD", "ENTRYPOINT", "MAINTAINER", "HEALTHCHECK", "STOPSIGNAL", "VOLUME", "ONBUILD"}
_HEREDOC = re.compile(r"<<(-?)([\"']?)([A-Za-z_][A-Za-z0-9_]*)\2")


@dataclass(frozen=True)
class Instruction:
    """One logical Dockerfile line: continuations joined, comments dropped, heredoc bodies kept."""

    lineno: int  # the line it starts on
    keyword: str  # upper-cased
    args: str
    heredocs: tuple[str, ...] = ()  # bodies of <<WORD ... WORD, in order

    def where(self, dockerfile: Path) -> str:
        text = " ".join(f"{self.keyword} {self.args}".split())
        return f"{dockerfile.name}:{self.lineno}: {text[:120]}{'...' if len(text) > 120 else ''}"


@dataclass(frozen=True)
class RunStep:
    at: str  # "Dockerfile:12: RUN ..." for messages
    command: str | list[str]
    cwd: str
    env: dict[str, str]


@dataclass(frozen=True)
class CopyStep:
    """COPY/ADD, expanded when planned: every file with its in-sandbox destination, the
    directories to create (empty ones included), and ADD's local archives to unpack."""

    at: str
    files: tuple[tuple[Path, str], ...]  # (host file in the build context, absolute in-sandbox path)
    dirs: tuple[str, ...]  # in-sandbox directories to create
    chmod: Optional[int]  # --chmod; None keeps each file's own mode
    archives: tuple[tuple[Path, str], ...] = ()  # ADD: (tar file, in-sandbox directory to unpack it into)
    content: Optional[tuple[str, str]] = None  # COPY <<EOF: (in-sandbox path, text)


@dataclass(frozen=True)
class WorkdirStep:
    at: str
    path: str


Step = RunStep | CopyStep | WorkdirStep


@dataclass(frozen=True)
class EnvironmentPlan:
    """What preparing a task's environment will do, decided before any sandbox exists."""

    base_image: Optional[str]
    workdir: str
    env: dict[str, str]  # the Dockerfile's ENV, expanded (base variables not repeated)
    steps: tuple[Step, ...] = ()
    ignored: tuple[str, ...] = field(default=())  # "Dockerfile:3: EXPOSE 80" lines that changed nothing


def plan_environment(spec: TerminalTaskSpec, base_env: Optional[Mapping[str, str]] = None) -> EnvironmentPlan:
    """The plan for ``spec``'s environment; TaskRefused (one line: the task, the Dockerfile line,
    the reason) when the host cannot provide it. ``base_env`` is what ``$PATH`` and friends expand
    to (the sandbox's environment; Docker's default PATH when None)."""
    try:
        return _plan_task(spec, base_env)
    except TaskRefused as e:
        raise TaskRefused(f"{spec.task_id}: {e}") from None


def _plan_task(spec: TerminalTaskSpec, base_env: Optional[Mapping[str, str]]) -> EnvironmentPlan:
    if spec.refusal:
        raise TaskRefused(spec.refusal)
    if spec.network:
        raise TaskRefused("asks for network, and the sandbox has none (every sandbox.backend runs tasks in an "
                          "empty network namespace)")
    if spec.image is not None:
        _check_base(spec.image, "")
    workdir = spec.workdir or DEFAULT_WORKDIR
    if spec.dockerfile is None:  # the host as it is, in the declared working directory
        return EnvironmentPlan(base_image=spec.image, workdir=workdir, env={},
                               steps=(WorkdirStep("(working directory)", workdir),))
    context = spec.build_context or spec.dockerfile.parent
    excluded = _hidden_from_build(spec)
    return _plan(parse_dockerfile(spec.dockerfile), spec.dockerfile, context, excluded,
                 dict(base_env) if base_env is not None else {"PATH": DOCKER_DEFAULT_PATH}, spec.workdir)


def parse_dockerfile(path: Path) -> list[Instruction]:
    """The instructions of a Dockerfile; TaskRefused for a file it cannot read."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise TaskRefused(f"{path}: cannot read ({e})") from None
    out: list[Instruction] = []
    i = 0
    while i < len(lines):
        raw = lines[i]
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            i += 1
            continue
        start = i + 1
        parts = []
        line = raw.rstrip()
        while line.endswith("\\"):
            parts.append(line[:-1])
            i += 1
            # comment and empty lines inside a continuation are dropped, as Docker does
            while i < len(lines) and (not lines[i].strip() or lines[i].lstrip().startswith("#")):
                i += 1
            line = lines[i].rstrip() if i < len(lines) else ""
        parts.append(line)
        i += 1
        logical = " ".join(p.strip() for p in parts if p.strip())
        keyword, _, args = logical.partition(" ")
        keyword = keyword.upper()
        heredocs = []
        if keyword in ("RUN", "COPY", "ADD"):
            for m in _HEREDOC.finditer(args):
                strip_tabs, word = m.group(1) == "-", m.group(3)
                body = []
                while i < len(lines) and (lines[i].lstrip("\t") if strip_tabs else lines[i]) != word:
                    body.append(lines[i].lstrip("\t") if strip_tabs else lines[i])
                    i += 1
                if i >= len(lines):
                    raise TaskRefused(f"{path.name}:{start}: heredoc <<{word} has no closing {word} line")
                i += 1
                heredocs.append("\n".join(body) + "\n")
        out.append(Instruction(start, keyword, args.strip(), tuple(heredocs)))
    return out


def image_name(image: str) -> str:
    """The bare name of an image reference: registry prefix, tag and digest stripped."""
    ref = image.split("@", 1)[0]
    for prefix in _REGISTRY_PREFIXES:
        if ref.startswith(prefix):
            ref = ref[len(prefix):]
            break
    name = ref.rsplit(":", 1)[0] if ":" in ref.rsplit("/", 1)[-1] else ref
    return name


def is_common_base(image: str) -> bool:
    name = image_name(image)
    if name in COMMON_BASES:
        return True
    # Terminal-Bench's bases are named like ubuntu-24-04 and python-3-13
    return re.fullmatch(r"(ubuntu|debian|python)-[0-9][0-9-]*(-slim)?", name) is not None


def _check_base(image: str, at: str) -> None:
    if not is_common_base(image):
        shown = image.split("@", 1)[0]
        raise TaskRefused(f"{at + ': ' if at else ''}needs its own image {shown} (only {', '.join(COMMON_BASES)} bases run here, on "
                          f"the host's userland; an image of its own needs a container backend, which no "
                          f"sandbox.backend provides)")


def _hidden_from_build(spec: TerminalTaskSpec) -> tuple[Path, ...]:
    """What COPY must never bring in: the tests and the oracle (copied only when their time comes),
    whatever the build context and .dockerignore say."""
    hidden = [p for p in (spec.tests_dir, spec.solution, *spec.extra_test_files) if p is not None]
    if spec.solution is not None and spec.solution.parent.name == "solution":
        hidden.append(spec.solution.parent)
    hidden += [spec.path / "solution.yaml", spec.path / "solution"]
    return tuple(p.resolve() for p in hidden)


def _plan(instructions: list[Instruction], dockerfile: Path, context: Path, hidden: tuple[Path, ...],
          base_env: dict[str, str], declared_workdir: Optional[str]) -> EnvironmentPlan:
    args: dict[str, str] = {}  # ARG values in scope
    global_args: dict[str, str] = {}  # ARGs declared before FROM: a later bare ARG NAME takes their value
    env: dict[str, str] = {}  # ENV set by the Dockerfile
    base_image: Optional[str] = None
    workdir = "/"
    workdir_set = False
    steps: list[Step] = []
    ignored: list[str] = []
    shell_prefix = ""
    ignore_rules = read_dockerignore(context)
    for ins in instructions:
        at = ins.where(dockerfile)
        scope = {**base_env, **args, **env}
        if ins.keyword == "FROM":
            if base_image is not None:
                raise TaskRefused(f"{at}: multi-stage builds need an image builder; only one FROM runs here")
            words = [w for w in split_words(ins.args, scope, at) if not w.startswith("--platform")]
            if not words or (len(words) > 1 and not (len(words) == 3 and words[1].lower() == "as")):
                raise TaskRefused(f"{at}: expected FROM image [AS name]")
            base_image = words[0]
            _check_base(base_image, f"{dockerfile.name}:{ins.lineno}")
            global_args, args = args, {}  # ARGs before FROM are only for FROM, as in Docker
        elif base_image is None and ins.keyword != "ARG":
            raise TaskRefused(f"{at}: an instruction before FROM")
        elif ins.keyword == "ARG":
            for word in split_words(ins.args, scope, at):
                name, eq, default = word.partition("=")
                if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                    raise TaskRefused(f"{at}: bad ARG name {name!r}")
                if eq:
                    args[name] = default
                else:
                    args.setdefault(name, global_args.get(name, ""))
        elif ins.keyword == "ENV":
            env.update(env_pairs(ins.args, scope, at))
        elif ins.keyword == "WORKDIR":
            words = split_words(ins.args, scope, at)
            if len(words) != 1:
                raise TaskRefused(f"{at}: WORKDIR takes one path")
            workdir = _absolute(words[0], workdir)
            workdir_set = True
            steps.append(WorkdirStep(at, workdir))
        elif ins.keyword == "RUN":
            steps.append(_run_step(ins, at, workdir, {**args, **env}, shell_prefix))
        elif ins.keyword in ("COPY", "ADD"):
            steps.append(_copy_step(ins, at, scope, workdir, context, hidden, ignore_rules))
        elif ins.keyword == "SHELL":
            shell_prefix = _shell_prefix(ins.args, at)
        elif ins.keyword == "USER":
            user = " ".join(split_words(ins.args, scope, at))
            if user.split(":")[0] not in ("root", "0"):
                raise TaskRefused(f"{at}: USER {user}: the sandbox runs everything as its one user")
        elif ins.keyword in IGNORED:
            ignored.append(at)
        else:
            raise TaskRefused(f"{at}: {ins.keyword} is not an instruction this host can interpret")
    if base_image is None:
        raise TaskRefused(f"{dockerfile.name}: no FROM line")
    final = declared_workdir or (workdir if workdir_set else DEFAULT_WORKDIR)
    if not workdir_set:
        steps.insert(0, WorkdirStep("(working directory)", final))
    return EnvironmentPlan(base_image=base_image, workdir=final, env=env, steps=tuple(steps), ignored=tuple(ignored))


def _run_step(ins: Instruction, at: str, cwd: str, env: dict[str, str], shell_prefix: str) -> RunStep:
    text = ins.args
    if text.startswith("--"):
        raise TaskRefused(f"{at}: RUN flags ({text.split()[0]}) need an image builder")
    if text.startswith("["):
        argv = _json_list(text, at)
        if argv is None:
            raise TaskRefused(f"{at}: RUN's exec form must be a JSON list of strings")
        return RunStep(at, argv, cwd, env)
    if ins.heredocs:
        m = _HEREDOC.match(text)
        if m is not None and m.end() == len(text):
            script = ins.heredocs[0]  # RUN <<EOF: the body is the script
        else:  # RUN cmd <<EOF ...: bash reads the heredocs itself
            lines = [text]
            for body, m in zip(ins.heredocs, _HEREDOC.finditer(text)):
                lines += [body.rstrip("\n"), m.group(3)]
            script = "\n".join(lines)
    else:
        script = text
    return RunStep(at, shell_prefix + script, cwd, env)


def _copy_step(ins: Instruction, at: str, scope: dict[str, str], workdir: str, context: Path,
               hidden: tuple[Path, ...], ignore_rules: list[tuple[bool, str]]) -> CopyStep:
    text = ins.args
    chmod: Optional[int] = None
    while text.startswith("--"):
        flag, _, text = text.partition(" ")
        text = text.strip()
        name, _, value = flag[2:].partition("=")
        if name == "chmod":
            try:
                chmod = int(value, 8)
            except ValueError:
                raise TaskRefused(f"{at}: --chmod={value} is not an octal mode") from None
        elif name == "from":
            raise TaskRefused(f"{at}: COPY --from copies out of another image, which needs an image builder")
        elif name not in ("chown", "link"):  # ownership: the sandbox has one user
            raise TaskRefused(f"{at}: {ins.keyword} flag --{name} is not supported here")
    words = _json_list(text, at) if text.startswith("[") else split_words(text, scope, at)
    if words is None or len(words) < 2:
        raise TaskRefused(f"{at}: {ins.keyword} needs a source and a destination")
    *sources, dest_word = words
    dest = _absolute(dest_word, workdir)
    if ins.heredocs:
        if len(sources) != 1 or not _HEREDOC.fullmatch(sources[0]) or dest_word.endswith("/"):
            raise TaskRefused(f"{at}: one heredoc source, copied to a file path, per COPY is supported")
        return CopyStep(at, (), (), chmod, content=(dest, ins.heredocs[0]))
    root = context.resolve()
    matched: list[Path] = []
    for src in sources:
        if re.match(r"^[a-z][a-z0-9+.-]*://", src, re.IGNORECASE) or src.startswith("git@"):
            raise TaskRefused(f"{at}: {ins.keyword} of a URL needs network, and the sandbox has none")
        pattern = str(root / src.lstrip("/"))
        found = sorted(glob.glob(pattern)) if glob.has_magic(src) else [pattern]
        for m in found:
            p = Path(m).resolve()
            if p != root and root not in p.parents:
                raise TaskRefused(f"{at}: {src} lies outside the build context {context}")
        if not found or not Path(found[0]).exists():
            raise TaskRefused(f"{at}: {src} is not in the build context {context}")
        for m in found:
            p = Path(m).resolve()
            if not _excluded(p, root, hidden, ignore_rules):
                matched.append(p)
    into = dest_word.endswith("/") or len(sources) > 1 or glob.has_magic(sources[0])
    files: list[tuple[Path, str]] = []
    dirs: list[str] = [dest] if into else []
    archives: list[tuple[Path, str]] = []
    for p in matched:
        if p.is_dir():  # a directory's contents, not the directory itself, as in Docker
            dirs.append(dest)
            for sub in sorted(p.rglob("*")):
                real = sub.resolve()
                if real != root and root not in real.parents:  # a link out of the context: never read
                    raise TaskRefused(f"{at}: {sub.relative_to(root)} links outside the build context {context}")
                if _excluded(real, root, hidden, ignore_rules):
                    continue
                target = f"{dest.rstrip('/')}/{sub.relative_to(p).as_posix()}"
                if sub.is_dir():
                    dirs.append(target)
                elif sub.is_file():
                    files.append((sub, target))
        elif ins.keyword == "ADD" and tarfile.is_tarfile(p):
            archives.append((p, dest))
            dirs.append(dest)
        else:
            files.append((p, f"{dest.rstrip('/')}/{p.name}" if into else dest))
    return CopyStep(at, tuple(files), tuple(dict.fromkeys(dirs)), chmod, tuple(archives))


def _shell_prefix(args: str, at: str) -> str:
    argv = _json_list(args, at)
    if not argv or argv[-1] != "-c" or PurePosixPath(argv[0]).name not in ("bash", "sh"):
        raise TaskRefused(f"{at}: only SHELL [\"/bin/bash\" or \"/bin/sh\", ..., \"-c\"] runs here")
    options = argv[1:-1]
    prefix = ""
    while options:
        opt = options.pop(0)
        if opt == "-o" and options:
            prefix += f"set -o {options.pop(0)}; "
        elif re.fullmatch(r"-[eux]+", opt):
            prefix += f"set {opt}; "
        else:
            raise TaskRefused(f"{at}: SHELL option {opt} is not supported here")
    return prefix


def _absolute(path: str, workdir: str) -> str:
    joined = PurePosixPath(workdir) / path
    parts: list[str] = []
    for part in joined.parts[1:]:
        if part == "..":
            if parts:
                parts.pop()
        elif part not in (".", ""):
            parts.append(part)
    return "/" + "/".join(parts)


def _json_list(text: str, at: str) -> Optional[list[str]]:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        return None
    return value


def _excluded(path: Path, root: Path, hidden: tuple[Path, ...], rules: list[tuple[bool, str]]) -> bool:
    """Whether COPY leaves ``path`` out: the task's tests and solution always, else .dockerignore."""
    if any(path == h or h in path.parents for h in hidden):
        return True
    return is_ignored(path.relative_to(root).as_posix() if path != root else ".", rules)
