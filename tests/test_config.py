"""The config is the user's contract: every field is read somewhere, bad keys are refused clearly."""
import re
from pathlib import Path

import pytest

from clawrl.config import ConfigError, all_keys, compose

CORE = Path(__file__).resolve().parents[1] / "core" / "clawrl"


def _core_sources() -> str:
    return "\n".join(
        p.read_text() for p in CORE.rglob("*.py") if p.name != "config.py"
    )


@pytest.mark.parametrize("key", all_keys())
def test_every_config_field_is_read_in_core(key):
    src = _core_sources()
    *section, leaf = key.split(".")
    if section:
        # cfg.server.port, server_cfg.port, self.engine_cfg.threads ...
        pattern = rf"\w*{section[-1]}\w*\.{leaf}\b"
    else:
        pattern = rf"\bcfg\.{leaf}\b"
    assert re.search(pattern, src), f"config field {key} is never read in core/clawrl"


def test_override_sets_typed_value():
    cfg = compose(["server.port=1234", "model.path=/models/x", "server.truncate_history=true"])
    assert cfg.server.port == 1234 and cfg.model.path == "/models/x" and cfg.server.truncate_history is True


def test_unknown_key_is_refused_with_closest_names():
    with pytest.raises(ConfigError, match=r"unknown config key 'server.prot'.*server\.port"):
        compose(["server.prot=1"])


def test_wrong_type_is_a_one_line_error():
    with pytest.raises(ConfigError) as e:
        compose(["server.port=abc"])
    assert "\n" not in str(e.value) and "port" in str(e.value)
