"""Small-scale experiments: arms of local swarms run one after the other on the same data, model and
token budget, then a table and a plot (scripts/experiments/, docs/RESULTS.md).

An *arm* is one swarm: a bootstrap node and N islands on 127.0.0.1 (``p2p-diloco peer`` processes,
tiny preset by default), each stopped after ``max_steps`` inner steps, so every arm trains the
tokens its islands x steps x batch x sequence length say. Figures come from the islands' summaries
and event logs; nothing is timed inside a test.
"""

from __future__ import annotations

import math
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from p2p_diloco.island.events import read_events
from p2p_diloco.lab.localswarm import LocalSwarm
from p2p_diloco.lab.plots import plot_eval_vs_tokens
from p2p_diloco import files

# what every arm shares unless an arm overrides it: the tiny model on the embedded corpus, one
# torch thread per island, a short outer period and evals often enough for a curve
COMMON = [
    "--preset", "tiny", "--device", "cpu", "--threads", "1",
    "--outer-matchmaking-time", "1.5", "--outer-grace-window", "0.5", "--outer-allreduce-timeout", "2",
    "--outer-request-timeout", "0.5", "--progress-period", "2", "--progress-ttl", "10",
    "--eval-every", "30", "--eval-batches", "16", "--inner-warmup-steps", "20", "--join-timeout", "60",
]


@dataclass
class Arm:
    """One swarm of an experiment.

    :param name: row label (also the run id and folder)
    :param islands: number of islands
    :param max_steps: inner steps per island (the token budget, with the batch)
    :param args: flags for every island (after :data:`COMMON`)
    :param per_island: extra flags for island i
    :param period: outer period T_outer in seconds (``--outer-period``)
    """

    name: str
    islands: int
    max_steps: int
    args: list[str] = field(default_factory=list)
    per_island: dict[int, list[str]] = field(default_factory=dict)
    period: float = 12.0


def run_arm(arm: Arm, out: Path, *, timeout: float = 1800.0) -> dict:
    """Run one arm to the end and return its figures (see :func:`arm_figures`).

    :param out: the experiment's folder; the arm writes logs, summaries and events in ``out/arm.name``
    :param timeout: seconds to wait for the islands to reach ``max_steps`` before stopping them
    :raises RuntimeError: if no island wrote a summary
    """
    folder = out / arm.name
    swarm = LocalSwarm(folder, run_id=re.sub(r"[^A-Za-z0-9_-]", "_", arm.name))  # "P=4,mix" -> "P_4_mix"
    started = time.time()
    try:
        swarm.start_bootstrap()
        for index in range(arm.islands):
            swarm.start_island(
                f"island-{index}", *COMMON, "--outer-period", str(arm.period), "--max-steps", str(arm.max_steps),
                "--data-shard-index", str(index), *arm.args, *arm.per_island.get(index, []))
        swarm.wait_islands(timeout)
    finally:
        swarm.close()
    summaries = [swarm.summary(f"island-{index}") for index in range(arm.islands)]
    if not any(summaries):
        raise RuntimeError(f"arm {arm.name}: no island wrote a summary; see the logs in {folder}")
    events = {f"island-{index}": read_events(str(swarm.events_path(f"island-{index}")))
              for index in range(arm.islands) if swarm.events_path(f"island-{index}").exists()}
    figures = arm_figures(arm, [s for s in summaries if s], events) | {"seconds": round(time.time() - started, 1)}
    files.write_json(folder / "figures.json", figures)
    return figures


def arm_figures(arm: Arm, summaries: Sequence[dict], events: dict[str, list[dict]]) -> dict:
    """An arm's figures from its islands' summaries and events.

    eval_loss: mean of the islands' final eval losses (held-out split); tokens: all islands together;
    bytes_per_token: bytes sent by all islands / tokens; reduction_vs_dp: data-parallel's bytes per
    token (``8 x parameters / tokens per step``) over ours; utilization: mean compute utilization;
    h: mean inner steps per outer period; curve: (swarm tokens, mean eval loss) at each eval.
    """
    tokens = sum(s["tokens"] for s in summaries)
    sent = sum(s["bytes_sent"] for s in summaries)
    evals = [s["eval_loss_last"] for s in summaries if s.get("eval_loss_last") is not None]
    dp = summaries[0].get("dp_bytes_per_token")
    per_token = sent / tokens if tokens else None
    curves = [[e for e in island if e.get("event") == "eval"] for island in events.values()]
    curve = []
    for index in range(min((len(c) for c in curves), default=0)):
        points = [c[index] for c in curves]
        curve.append((sum(p["tokens"] for p in points) * len(summaries) / len(points),
                      statistics.fmean(p["eval_loss"] for p in points)))
    return {
        "arm": arm.name,
        "islands": len(summaries),
        "eval_loss": round(statistics.fmean(evals), 4) if evals else None,
        "eval_loss_spread": round(max(evals) - min(evals), 4) if evals else None,
        "tokens": tokens,
        "wall_seconds": round(max(s["wall_seconds"] for s in summaries), 1),
        "utilization": round(statistics.fmean(s["compute_utilization"] for s in summaries), 3),
        "h": _mean([s.get("inner_steps_per_outer_period") for s in summaries]),
        "rounds_ok": sum(s["outer_rounds_ok"] for s in summaries),
        "rounds_failed": sum(s["outer_rounds_failed"] for s in summaries),
        "bytes_per_token": round(per_token, 2) if per_token is not None else None,
        "reduction_vs_dp": round(dp / per_token, 1) if dp and per_token else None,
        "peak_bytes_per_step": max(s.get("peak_bytes_per_inner_step", 0) for s in summaries),
        "curve": curve,
    }


def _mean(values: Sequence[Optional[float]]) -> Optional[float]:
    present = [v for v in values if v is not None and math.isfinite(v)]
    return round(statistics.fmean(present), 1) if present else None


COLUMNS = [("arm", "arm"), ("islands", "islands"), ("tokens", "tokens"), ("eval_loss", "eval loss"),
           ("eval_loss_spread", "spread"), ("h", "H"), ("utilization", "util"), ("rounds_ok", "rounds ok"),
           ("rounds_failed", "failed"), ("bytes_per_token", "bytes/token"), ("reduction_vs_dp", "x fewer than DP"),
           ("peak_bytes_per_step", "peak bytes/step"), ("wall_seconds", "wall s")]


def table(rows: Sequence[dict], columns: Sequence[tuple[str, str]] = COLUMNS) -> str:
    """A Markdown table of arms' figures ("-" where a figure is missing)."""
    def cell(value) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
        if isinstance(value, int):
            return f"{value:,}"
        return str(value)

    lines = ["| " + " | ".join(title for _, title in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(cell(row.get(key)) for key, _ in columns) + " |" for row in rows]
    return "\n".join(lines)


def run_experiment(name: str, title: str, arms: Sequence[Arm], out: Path, *, timeout: float = 1800.0) -> list[dict]:
    """Run ``arms`` one after the other, then write ``out/results.json``, ``out/table.md`` and
    ``out/<name>.png`` and print the table."""
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for arm in arms:
        print(f"[{name}] arm {arm.name}: {arm.islands} islands x {arm.max_steps} steps", flush=True)
        rows.append(run_arm(arm, out, timeout=timeout))
        print(f"[{name}]   eval loss {rows[-1]['eval_loss']}, {rows[-1]['seconds']} s", flush=True)
    files.write_json(out / "results.json", rows)
    text = table(rows)
    files.write_text(out / "table.md", f"# {title}\n\n{text}\n")
    plot_eval_vs_tokens(rows, out / f"{name}.png", title)
    print(f"\n{title}\n\n{text}\n\nplot: {out / f'{name}.png'}")
    return rows


def run_script(body: Callable[[], object]) -> int:
    """Run an experiment or benchmark script's work: Ctrl+C or SIGTERM (every process of the running
    arm is stopped on the way out) exits 130, a failed arm (RuntimeError) 1 with one ``error:`` line."""
    import signal
    import sys

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    try:
        body()
    except KeyboardInterrupt:
        print("interrupted: every process of the running arm was stopped", file=sys.stderr)
        return 130
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
