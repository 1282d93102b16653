"""The README's commands are the ones CI runs: a drift between them would let a broken README pass."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bash_blocks(text: str) -> list[str]:
    return [line.strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S) for line in block.splitlines()]


def test_ci_runs_the_readme_test_command():
    """CI runs the README's command as written, adding only the report of the slowest tests."""
    readme_cmds = _bash_blocks((ROOT / "README.md").read_text())
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    test_cmd = next(c for c in readme_cmds if "pytest" in c)
    assert f"{test_cmd} --durations=30" in ci_lines


def test_readme_install_matches_ci_install():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    for pinned in ("-r requirements-sdists.txt", "-r requirements.txt -c constraints.txt"):
        assert pinned in readme and pinned in ci, pinned
    assert "pip install -e ." in readme and "-e ." in ci


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
