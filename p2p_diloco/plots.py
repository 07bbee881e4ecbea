"""Plots of runs, drawn from the islands' event logs (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from p2p_diloco.events import read_events


def plot_loss_vs_tokens(event_logs: Mapping[str, str | Path], out_path: str | Path, title: str = "") -> Path:
    """Training loss (smoothed) and eval loss against tokens trained, one colour per island.

    :param event_logs: island name -> path of its JSONL event log
    :returns: the PNG's path
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=120)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (name, path) in enumerate(sorted(event_logs.items())):
        if not Path(path).exists():
            continue
        events = read_events(str(path))
        color = colors[index % len(colors)]
        steps = [e for e in events if e.get("event") == "step" and e.get("loss") is not None]
        if steps:
            smoothed, ema = [], None
            for e in steps:
                ema = e["loss"] if ema is None else 0.95 * ema + 0.05 * e["loss"]
                smoothed.append(ema)
            ax.plot([e["tokens"] / 1e6 for e in steps], smoothed, color=color, alpha=0.45, lw=1,
                    label=f"{name} train (EMA)")
        evals = [e for e in events if e.get("event") == "eval"]
        if evals:
            ax.plot([e["tokens"] / 1e6 for e in evals], [e["eval_loss"] for e in evals], color=color, marker="o",
                    lw=2, label=f"{name} eval")
    ax.set_xlabel("tokens trained by the island (millions)")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title or "loss vs tokens")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
