"""The ``clawrl`` command's own surface: ``--help`` reads as whole sentences and points onward,
``--help-config`` lists every key (also through a recipe's run.sh), the read-only commands find the
default run directory, and the shared console logging keeps libraries' per-request lines out."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clawrl.cli import main
from clawrl.config import ClawrlConfig, all_keys, describe_config
from clawrl.sessions import SessionLinker
from clawrl.store import TurnStore

ROOT = Path(__file__).resolve().parents[1]
CLAWRL = [sys.executable, "-c", "import sys; from clawrl.cli import main; sys.exit(main())"]


def help_text(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def prose(text: str) -> list[str]:
    """The help's free-text paragraphs: not the usage, not a section of options or commands."""
    blocks = [b.strip() for b in text.split("\n\n") if b.strip()]
    return [" ".join(b.split()) for b in blocks if not b.startswith("usage:") and not b.splitlines()[0].endswith(":")]


@pytest.mark.parametrize("argv", [(), ("chat",)])
def test_help_is_whole_sentences(capsys, argv):
    paragraphs = prose(help_text(capsys, *argv))
    assert paragraphs, "no description"
    for p in paragraphs:
        assert p[0].isupper() and p.endswith("."), f"cut off: {p!r}"


def test_top_level_help_points_at_the_readme_and_the_config_listing(capsys):
    text = " ".join(help_text(capsys).split())
    assert "Train a self-hosted LLM agent from its own live conversations." in text
    assert "README.md" in text and "clawrl serve --help-config" in text


@pytest.mark.parametrize("cmd", ["serve", "demo"])
def test_help_config_lists_every_key_and_exits_0(cmd):
    out = subprocess.run([*CLAWRL, cmd, "--help-config"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == describe_config()
    listed = {line.split()[0] for line in out.stdout.splitlines() if line.strip()}
    assert set(all_keys()) <= listed


@pytest.mark.parametrize("recipe", ["openclaw-combine", "openclaw-rl", "openclaw-opd", "terminal-rl"])
def test_run_sh_passes_help_config_to_serve(recipe):
    out = subprocess.run(["bash", str(ROOT / recipe / "run.sh"), "--help-config"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == describe_config()


# --- the default run directory ---------------------------------------------------------------------

def test_sessions_export_and_rollback_default_to_the_configs_run_dir(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    default = Path(ClawrlConfig().run_dir)
    assert main(["sessions"]) == 2  # nothing there yet: the error names the default
    assert capsys.readouterr().err.strip() == f"clawrl: run directory {default} does not exist"
    assert main(["rollback", "--to", "1"]) == 2
    assert capsys.readouterr().err.strip() == f"clawrl: no checkpoints in {default / 'checkpoints'}"

    store = TurnStore(tmp_path / default)
    linker = SessionLinker(store, 60.0)
    plan = linker.begin([{"role": "user", "content": "Hi"}], None, caller_key="k", user=None)
    linker.record(plan, prompt_ids=[1, 2], response_ids=[3], logprobs=[-0.1], weight_versions=[0],
                  finish_reason="stop", status="complete", response_text="Hello")
    store.close()
    assert main(["sessions"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].startswith("SESSION") and rows[1].split()[0] == plan.session_id
    assert main(["export"]) == 0
    assert '"response_text": "Hello"' in capsys.readouterr().out


# --- console logging -------------------------------------------------------------------------------

@pytest.fixture
def restore_logging():
    from clawrl.logs import LIBRARY_LOGGERS

    root = logging.getLogger()
    names = ["clawrl", *LIBRARY_LOGGERS]
    saved = (root.level, list(root.handlers), {n: (logging.getLogger(n).level, list(logging.getLogger(n).filters))
                                                for n in names})
    yield
    root.setLevel(saved[0])
    for h in [h for h in root.handlers if h not in saved[1]]:
        root.removeHandler(h)
        h.close()
    for n, (level, filters) in saved[2].items():
        logging.getLogger(n).setLevel(level)
        logging.getLogger(n).filters[:] = filters


def test_libraries_log_warnings_only_unless_debug(restore_logging, capsys):
    import uvicorn

    from clawrl.logs import setup_logging

    setup_logging("info")
    uvicorn.Config(lambda scope, receive, send: None, log_level="info")  # resets uvicorn's logger levels
    for name in ("httpx", "httpx2", "uvicorn.access", "transformers", "some.other.library"):
        logging.getLogger(name).info("%s says hello", name)
    logging.getLogger("httpx").warning("httpx warns")
    logging.getLogger("clawrl.test").info("clawrl speaks")
    captured = capsys.readouterr()
    console = captured.err + captured.out
    assert "says hello" not in console
    assert "httpx warns" in console and "clawrl speaks" in console

    setup_logging("DEBUG")
    logging.getLogger("httpx").debug("request details")
    logging.getLogger("clawrl.test").debug("clawrl details")
    err = capsys.readouterr().err
    assert "request details" in err and "clawrl details" in err


def test_console_level_and_log_file_split_what_is_shown_from_what_is_kept(restore_logging, capsys, tmp_path):
    from clawrl.logs import setup_logging

    handler = setup_logging("info", console_level="WARNING", log_file=tmp_path / "run.log")
    logging.getLogger("clawrl.test").info("every sample")
    logging.getLogger("clawrl.test").warning("something is off")
    handler.flush()
    err = capsys.readouterr().err
    assert "something is off" in err and "every sample" not in err
    kept = (tmp_path / "run.log").read_text()
    assert "every sample" in kept and "something is off" in kept


def test_a_bad_log_level_is_a_config_error():
    from clawrl.config import ConfigError
    from clawrl.logs import setup_logging

    with pytest.raises(ConfigError, match="logging.level=LOUD"):
        setup_logging("LOUD")


def test_an_offline_wandb_run_ends_with_the_sync_command(tmp_path, capsys):
    pytest.importorskip("wandb")
    from clawrl.config import LoggingConfig, WandbConfig
    from clawrl.metrics import MetricsLogger

    metrics = MetricsLogger(tmp_path, LoggingConfig(wandb=WandbConfig(mode="offline")))
    metrics.log_step(1, {"loss": 0.5})
    metrics.close()
    metrics.close()
    hints = [line for line in capsys.readouterr().err.splitlines() if "wandb sync" in line]
    assert len(hints) == 1, hints  # once, however often close() is called
    offline_dir = Path(hints[0].rsplit("wandb sync ", 1)[1])
    assert offline_dir.parent == tmp_path / "wandb" and offline_dir.name.startswith("offline-run-")
    assert any(offline_dir.glob("*.wandb"))  # the run's data, what `wandb sync` uploads


def test_a_reader_that_leaves_early_gets_no_traceback():
    """`clawrl env list gui-rl | head -1`: the pipe closes before clawrl writes; it exits 141 (as
    SIGPIPE would) and writes no BrokenPipeError traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "clawrl.cli", "env", "list", "gui-rl"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # long before the interpreter has started and written a row
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
