"""Every plot of the project (matplotlib, no display needed): loss curves and chaos timelines drawn
from the islands' event logs, and the experiments' and benchmarks' comparisons of arms. Files are
written atomically (:mod:`p2p_diloco.files`)."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional, Sequence

from p2p_diloco.files import atomic_path

from p2p_diloco.island.events import read_events


def plot_loss_vs_tokens(event_logs: Mapping[str, str | Path], out_path: str | Path, title: str = "") -> Path:
    """Training loss (smoothed) and eval loss against tokens trained, one colour per island.

    :param event_logs: island name -> path of its JSONL event log
    :returns: the PNG's path
    """
    plt = _pyplot()

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
    return _save(fig, out_path)


def plot_timeline(events: Mapping[str, list], *, alive: Mapping[str, list], frozen: Mapping[str, list],
                  faults: list, start: float, end: float, out_path: str | Path,
                  cut: Optional[Mapping[str, list]] = None, throttled: Optional[Mapping[str, list]] = None,
                  faulty: Optional[Mapping[str, list]] = None) -> Path:
    """One row per island over the run: training (green), loading after a (re)start (orange),
    frozen by SIGSTOP (blue), down (red); a cut link is a purple stripe, a throttled one a yellow
    stripe and a stretch of sending garbage a black stripe under the row; faults are vertical marks.
    Times in seconds from ``start``.

    :param events: island -> its events; ``alive``/``frozen``/``cut``/``throttled``/``faulty``: island ->
        [(start, end)] wall times
    :returns: the PNG's path
    """
    plt = _pyplot()
    from matplotlib.patches import Patch

    from p2p_diloco.lab.figures import clip, loading_intervals, step_intervals, subtract

    colors = {"training": "#4caf50", "loading": "#ff9800", "frozen": "#2196f3", "down": "#e53935",
              "link cut": "#8e24aa", "throttled": "#fdd835", "faulty": "#212121"}
    names = sorted(events)
    fig, ax = plt.subplots(figsize=(11, 0.6 * len(names) + 2.0), dpi=120)
    for row, name in enumerate(names):
        spans = clip([tuple(s) for s in alive.get(name, [])], start, end)
        loading = clip(loading_intervals(step_intervals(events[name]), [tuple(s) for s in alive.get(name, [])]),
                       start, end)
        cold = clip([tuple(s) for s in frozen.get(name, [])], start, end)
        parts = {
            "down": subtract([(start, end)], spans),
            "frozen": cold,
            "loading": subtract(loading, cold),
            "training": subtract(subtract(spans, loading), cold),
        }
        for state, intervals in parts.items():
            ax.broken_barh([(a - start, b - a) for a, b in intervals], (row - 0.35, 0.7), color=colors[state])
        for state, table in (("link cut", cut), ("throttled", throttled), ("faulty", faulty)):
            intervals = clip([tuple(s) for s in (table or {}).get(name, [])], start, end)
            ax.broken_barh([(a - start, b - a) for a, b in intervals], (row - 0.45, 0.12), color=colors[state])
    for fault in faults:
        x = fault["t"] - start
        ax.axvline(x, color="black", lw=0.8, alpha=0.6)
        ax.text(x, len(names) - 0.4, f"{fault['kind']} {fault.get('island', '')}".strip(), rotation=90,
                fontsize=7, va="bottom", ha="right")
    ax.set_yticks(range(len(names)), names)
    ax.set_xlim(0, end - start)
    ax.set_ylim(-0.6, len(names) + 1.2)
    ax.set_xlabel("seconds since every island trained")
    ax.legend(handles=[Patch(color=c, label=s) for s, c in colors.items()], loc="upper right", fontsize=8, ncol=7)
    return _save(fig, out_path)


def plot_eval_vs_tokens(rows: Sequence[dict], out_path: Path, title: str) -> Path:
    """Mean eval loss against swarm tokens, one line per arm (PNG)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for row in rows:
        if row.get("curve"):
            xs, ys = zip(*row["curve"])
            ax.plot([x / 1e6 for x in xs], ys, marker="o", lw=1.5, label=f"{row['arm']} ({row['eval_loss']})")
    ax.set_xlabel("tokens trained by the whole swarm (millions)")
    ax.set_ylabel("eval loss, held-out split (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out_path)


def plot_compare(rows: Sequence[dict], out_path: Path, title: str) -> Path:
    """Eval loss vs swarm tokens and vs wall time, one line per arm (PNG)."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8), dpi=120)
    for row in rows:
        if not row.get("curve"):
            continue
        tokens, seconds, loss = zip(*row["curve"])
        label = f"{row['arm']} ({row['eval_loss']})"
        left.plot([t / 1e6 for t in tokens], loss, marker="o", lw=1.5, label=label)
        right.plot(seconds, loss, marker="o", lw=1.5, label=label)
    left.set_xlabel("tokens trained by all learners (millions)")
    right.set_xlabel("seconds since the arm's first inner step")
    for ax in (left, right):
        ax.set_ylabel("eval loss, held-out split (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return _save(fig, out_path)


def plot_goodput_vs_chips(rows: Sequence[dict], out_path: Path, title: str, x_label: str = "chips") -> Path:
    """Goodput (%) against chips, one colour per arm: ours solid, the paper's dashed where given (PNG).

    :param rows: {label, chips, ours, paper (or None)} per cell (:func:`p2p_diloco.lab.simulate.paper_table`)
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    labels = list(dict.fromkeys(row["label"] for row in rows))
    for index, label in enumerate(labels):
        cells = sorted((row for row in rows if row["label"] == label), key=lambda row: row["chips"])
        chips = [row["chips"] for row in cells]
        color = colors[index % len(colors)]
        ax.plot(chips, [row["ours"] for row in cells], marker="o", lw=1.5, color=color, label=f"{label} (ours)")
        if all(row.get("paper") is not None for row in cells):
            ax.plot(chips, [row["paper"] for row in cells], ls="--", marker="x", lw=1, color=color,
                    label=f"{label} (paper)")
    ax.set_xscale("log")
    ax.set_xlabel(x_label)
    ax.set_ylabel("goodput (%)")
    ax.set_ylim(0, 100)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, out_path)


def _pyplot():
    """matplotlib's pyplot on the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out_path: str | Path) -> Path:
    """Lay out, write (atomically) and close a figure; returns the PNG's path."""
    plt = _pyplot()
    fig.tight_layout()
    out = Path(out_path)
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return out
