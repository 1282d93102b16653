"""Inference engines behind one interface (``clawrl.engines.base.Engine``)."""
