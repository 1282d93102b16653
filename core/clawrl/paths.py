"""Where clawrl keeps what it builds: ``$CLAWRL_HOME``, default ``~/.cache/clawrl``."""
import os
from pathlib import Path


def data_dir() -> Path:
    root = Path(os.environ.get("CLAWRL_HOME", Path.home() / ".cache" / "clawrl"))
    root.mkdir(parents=True, exist_ok=True)
    return root
