"""Where clawrl keeps what it builds: ``$CLAWRL_HOME``, default ``~/.cache/clawrl``."""
import os
from pathlib import Path


def data_dir() -> Path:
    root = Path(os.environ.get("CLAWRL_HOME", Path.home() / ".cache" / "clawrl"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def share_tree(root: Path) -> None:
    """Make ``root`` and everything in it readable by every local user (files 0644, directories
    0755): a model built into the cache is shared, while mkdtemp and safetensors (which writes
    through a private temporary file) leave 0700 and 0600 whatever the umask."""
    root.chmod(0o755)
    for parent, dirs, files in os.walk(root):
        for name in dirs:
            Path(parent, name).chmod(0o755)
        for name in files:
            Path(parent, name).chmod(0o644)
