"""The report's bar plot of acceptance by draft position (matplotlib, no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def require_matplotlib() -> None:
    """Fail now, before any engine runs, when the plot could not be drawn later."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise ImportError(
            "the report's plot needs matplotlib: pip install 'gemma4-spec[report]'"
        ) from error


def plot_acceptance(rates: Sequence[float], path: Path, *, title: str) -> Path:
    """A PNG bar plot: one bar per draft position, its height P(that draft token accepted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    positions = [str(i + 1) for i in range(len(rates))]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    try:
        bars = ax.bar(positions, rates, color="#4c72b0")
        ax.bar_label(bars, labels=[f"{r:.2f}" for r in rates], padding=3)
        ax.set_ylim(0, 1.08)
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance rate (accepted / drafting steps)")
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
    return path
