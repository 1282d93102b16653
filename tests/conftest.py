"""Fixtures shared across the test suite."""
import pytest


@pytest.fixture(scope="session")
def tiny_model_dir():
    """The embedded default model (built once into CLAWRL_HOME, about 4 minutes, then cached)."""
    from clawrl.embedded.build import default_model_path

    return default_model_path()


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes over ~30 s; still runs in CI")
