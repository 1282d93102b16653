"""Console logging for ``clawrl serve`` and ``clawrl demo``, set up in one place.

clawrl's own loggers log at ``logging.level``; the libraries under it (HTTP clients, uvicorn's
access log, transformers, hydra, ray, wandb, ...) only from WARNING up unless the level is DEBUG,
so a line per HTTP request does not bury what clawrl says. ``console_level`` raises the console's
threshold above that (the demo keeps its console to its progress bar and table) while ``log_file``
still receives every record at the configured level.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

from tqdm import tqdm

from clawrl.config import ConfigError

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Libraries that log per request, per file or per step at INFO; any other library inherits the
# root logger's level, which is WARNING too. uvicorn's startup/shutdown lines ("uvicorn.error")
# follow the server's own log_level and are left alone.
LIBRARY_LOGGERS = (
    "httpx", "httpx2", "httpcore", "httpcore2", "openai", "uvicorn.access", "urllib3", "transformers",
    "huggingface_hub", "filelock", "hydra", "ray", "wandb", "asyncio", "matplotlib", "PIL", "fsspec",
    "torch", "peft", "megatron",
)
# Loggers whose level is reset after set-up by the library itself (uvicorn.Config sets
# "uvicorn.access" to the server's log_level), so their threshold is kept by a filter too.
_PINNED = ("uvicorn.access",)
_CONSOLE, _FILE = "clawrl-console", "clawrl-file"


class _Stderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record comes (a test runner swaps it per test),
    through ``tqdm.write`` so a line lands above a progress bar instead of breaking it."""

    def __init__(self):
        super().__init__(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


class _AtLeast(logging.Filter):
    def __init__(self, level: int):
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.level


def parse_level(level: str) -> int:
    """``logging.level`` (any case) as a logging level number, or ConfigError in one line."""
    number = logging.getLevelName(str(level).upper())
    if not isinstance(number, int):
        raise ConfigError(f"logging.level={level}: use DEBUG, INFO, WARNING or ERROR")
    return number


def setup_logging(level: str, console_level: str | None = None,
                  log_file: str | Path | None = None) -> logging.Handler | None:
    """Log clawrl at ``level`` and libraries at WARNING (DEBUG when ``level`` is DEBUG) to stderr,
    showing only records at ``console_level`` and up there when given, and every record to
    ``log_file`` when given (its handler is returned, for a caller that stops logging there). Calling
    it again replaces the handlers an earlier call installed and leaves others (a test runner's) alone."""
    own = parse_level(level)
    libraries = logging.DEBUG if own <= logging.DEBUG else logging.WARNING
    root = logging.getLogger()
    for handler in [h for h in root.handlers if h.get_name() in (_CONSOLE, _FILE)]:
        root.removeHandler(handler)
        handler.close()
    formatter = logging.Formatter(FORMAT)
    console = _Stderr()
    console.set_name(_CONSOLE)
    console.setFormatter(formatter)
    if console_level is not None:
        console.setLevel(parse_level(console_level))
    root.addHandler(console)
    file_handler = None
    if log_file is not None:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(log_file, encoding="utf-8")
        file_handler.set_name(_FILE)
        file_handler.setFormatter(formatter)
        root.addHandler(file_handler)
    root.setLevel(libraries)
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(libraries)
        if name in _PINNED:
            for f in [f for f in logger.filters if isinstance(f, _AtLeast)]:
                logger.removeFilter(f)
            logger.addFilter(_AtLeast(libraries))
    logging.getLogger("clawrl").setLevel(own)
    return file_handler
