"""The demo's picture: preference-satisfaction rate against interactions, one line per run."""
from __future__ import annotations

from pathlib import Path


def plot_curves(curves: dict[str, list[tuple[int, float]]], out: Path, title: str,
                side_curves: dict[str, list[tuple[int, float]]] | None = None) -> Path:
    """Write a PNG of ``{label: [(interactions, rate), ...]}`` to ``out`` and return it;
    ``side_curves`` (e.g. correctness) are drawn dashed, so they read as context, not the result."""
    import matplotlib

    matplotlib.use("Agg")  # files only; the demo may run without a display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for label, points in curves.items():
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="o", label=label)
    for label, points in (side_curves or {}).items():
        xs, ys = zip(*points)
        ax.plot(xs, ys, linestyle="--", marker=".", alpha=0.7, label=label)
    ax.set_xlabel("interactions with the simulated user")
    ax.set_ylabel("fraction of held-out questions")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
