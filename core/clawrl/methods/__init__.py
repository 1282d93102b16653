"""Methods: how a sample trains (Binary RL, OPD, Combine, or a class from a file).

``base.Method`` is the interface; ``registry.load_method(cfg)`` builds the one ``cfg.method`` names:
``rl``, ``opd``, ``combine``, or ``dir/file.py:ClassName``.
"""
