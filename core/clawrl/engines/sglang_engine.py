"""The SGLang backend (optional dependency): SGLang's runtime behind clawrl's Engine interface.

SGLang is imported only when this backend is chosen, so clawrl installs and runs without it.
"""
from __future__ import annotations

from clawrl.engines.base import EngineError

INSTALL_HINT = "SGLang is not installed; pip install sglang (GPU only), or use engine.backend=torch"


def _import_sglang():
    try:
        import sglang  # noqa: F401
    except ImportError:
        raise EngineError(INSTALL_HINT) from None
    return sglang


class SGLangEngine:
    def __init__(self, cfg):
        _import_sglang()
        raise EngineError("the SGLang adapter is not built yet; use engine.backend=torch")
