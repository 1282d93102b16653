"""Error types shared across layers. A leaf: it imports nothing from clawrl, so any module may
raise these without depending on the command line that reports them."""


class CliError(Exception):
    """An expected failure: ``clawrl`` prints it as ``clawrl: <reason>`` and exits 2, no traceback."""
