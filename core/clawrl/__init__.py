"""clawrl: train a self-hosted LLM agent from its own live conversations."""
__version__ = "0.1.0"
