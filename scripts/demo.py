#!/usr/bin/env python3
"""The main job: a local swarm on 127.0.0.1 training on the embedded Shakespeare corpus.

Starts a bootstrap node and N islands, serves the live dashboard (its URL is printed) and shows the
swarm's status (from the islands' DHT records) while they train, then prints a per-island summary and writes, under runs/<timestamp>/, each island's
summary and event log, the status history and a loss-vs-tokens PNG. Ctrl+C or the end of the run stops
every process it started. Run it through ./scripts/demo.sh, which prepares .venv first.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

from rich.console import Console
from rich.table import Table

from p2p_diloco.net.dht import quiet_hivemind, start_dht
from p2p_diloco.observe.dashboard import Dashboard
from p2p_diloco.errors import ConfigError, NetworkError, UserError
from p2p_diloco.lab.localswarm import LOOPBACK, LocalSwarm
from p2p_diloco.lab.plots import plot_loss_vs_tokens
from p2p_diloco.procs import install_child_hooks
from p2p_diloco.net.records import ProgressBoard, make_validators
from p2p_diloco.observe.status import render_table, swarm_snapshot
from p2p_diloco import files

STARTUP_ALLOWANCE = 120.0  # seconds for islands to import, build the model and join before training


def parse_args(argv=None) -> argparse.Namespace:
    """The demo's command line (``--help`` lists it)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--islands", type=int, default=3, help="number of islands (default: 3)")
    parser.add_argument("--minutes", type=float, default=3.0, help="training minutes per island (default: 3)")
    parser.add_argument("--preset", default="tiny", choices=["tiny", "small", "base"], help="model size")
    parser.add_argument("--run-id", default="demo", help="run name (default: demo)")
    parser.add_argument("--out", default="", help="output folder (default: runs/<timestamp>)")
    parser.add_argument("--period", type=float, default=20.0, help="outer period T_outer in seconds (default: 20)")
    parser.add_argument("--fragments", type=int, default=2, help="fragments P (default: 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per island (default: 1)")
    parser.add_argument("--eval-every", type=float, default=60.0, help="seconds between evals (default: 60)")
    parser.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"], help="island device (default: cpu)")
    parser.add_argument("--dashboard-port", type=int, default=8080,
                        help="port of the live dashboard on 127.0.0.1 (default: 8080, a free one if taken; 0: a free one)")
    args = parser.parse_args(argv)
    if not 1 <= args.islands <= 16:
        parser.error("--islands must be between 1 and 16")
    if args.minutes <= 0:
        parser.error("--minutes must be positive")
    if not 0 <= args.dashboard_port <= 65535:
        parser.error("--dashboard-port must be between 0 and 65535")
    return args


def island_args(args: argparse.Namespace, index: int) -> list[str]:
    """Flags of island ``index``: its own shard, round timings scaled to the outer period."""
    budget = args.period / args.fragments  # seconds between two rounds on the swarm
    matchmaking = min(2.0, 0.35 * budget)
    return [
        "--preset", args.preset, "--device", args.device, "--threads", str(args.threads),
        "--max-minutes", str(args.minutes), "--eval-every", str(args.eval_every),
        # records every second, living 8 s: the dashboard shows a change within a few seconds and a
        # killed island as departed within ~10 s
        "--progress-period", "1", "--progress-ttl", "8",
        "--data-num-shards", str(max(8, args.islands)), "--data-shard-index", str(index),
        "--outer-fragments", str(args.fragments), "--outer-period", str(args.period),
        "--outer-matchmaking-time", f"{matchmaking:.3f}", "--outer-grace-window", f"{min(1.0, 0.15 * budget):.3f}",
        "--outer-allreduce-timeout", f"{min(3.0, 0.35 * budget):.3f}",
        "--outer-request-timeout", f"{min(0.5, matchmaking / 2 - 0.05):.3f}",
    ]


def summary_table(summaries: dict[str, dict | None]) -> Table:
    """The per-island summary printed at the end."""
    table = Table(title="per-island summary", title_justify="left")
    for column in ("island", "steps", "tokens", "eval loss first -> last", "rounds ok/failed", "group sizes",
                   "utilization", "MB sent", "bytes/token", "x fewer than DP"):
        table.add_column(column, justify="left" if column == "island" else "right")
    for name, s in summaries.items():
        if s is None:
            table.add_row(name, "-", "-", "(no summary: see its log)", "-", "-", "-", "-", "-", "-")
            continue
        table.add_row(
            name, str(s["inner_steps"]), f"{s['tokens'] / 1e6:.2f}M",
            f"{_fmt(s['eval_loss_first'])} -> {_fmt(s['eval_loss_last'])}",
            f"{s['outer_rounds_ok']}/{s['outer_rounds_failed']}",
            " ".join(f"{k}:{v}" for k, v in s["group_sizes"].items()) or "-",
            f"{s['compute_utilization']:.3f}", f"{s['bytes_sent'] / 1e6:.1f}",
            f"{s['bytes_per_token']:.1f}" if s.get("bytes_per_token") is not None else "-",
            f"{s['reduction_vs_dp']:.0f}" if s.get("reduction_vs_dp") is not None else "-",
        )
    return table


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def start_dashboard(board: ProgressBoard, args: argparse.Namespace, console: Console) -> Dashboard | None:
    """The live dashboard of the observer's records, on ``--dashboard-port`` or else on a free port;
    None (after a warning) when its chart files are missing and cannot be fetched (offline)."""
    try:
        dashboard = Dashboard(args.run_id, port=args.dashboard_port)
    except NetworkError:
        console.print(f"[yellow]port {args.dashboard_port} is taken: the dashboard takes a free one[/yellow]")
        dashboard = Dashboard(args.run_id, port=0)
    except ConfigError as e:
        console.print(f"[yellow]no dashboard: {e}[/yellow]")
        return None
    dashboard.start(board)
    console.print(f"[bold]dashboard: {dashboard.url}[/bold] (JSON: {dashboard.url}api/status, "
                  f"Prometheus: {dashboard.url}metrics)")
    return dashboard


def main(argv=None) -> int:
    """Run the demo; returns the exit code (0: every island finished cleanly, 130: interrupted)."""
    args = parse_args(argv)
    console = Console(stderr=True)
    if not console.is_terminal:
        console.width = max(console.width, 140)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_hivemind(verbose=False)
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    install_child_hooks()
    out = Path(args.out or Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)

    stop = threading.Event()

    def on_signal(signum, _frame):
        if stop.is_set():
            console.print("[red]second signal: killing every process of the demo[/red]")
            for managed in swarm.all():
                managed.signal(signal.SIGKILL)
            sys.exit(130)
        console.print(f"[yellow]{signal.Signals(signum).name}: stopping the swarm...[/yellow]")
        stop.set()

    swarm = LocalSwarm(out, run_id=args.run_id)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    observer = dashboard = None
    history = (out / "status_history.jsonl").open("w", encoding="utf-8")
    try:
        try:
            peers = swarm.start_bootstrap()
        except RuntimeError as e:
            console.print(f"[red]error: {e}[/red]")
            return 1
        console.print(f"bootstrap node up: INITIAL_PEERS={' '.join(peers)}")
        for index in range(args.islands):
            swarm.start_island(f"island-{index}", *island_args(args, index))
        console.print(f"started {args.islands} islands; outputs and logs in {out}/")
        validators, public_key = make_validators(args.run_id)
        try:
            observer = start_dht(initial_peers=peers, host_maddrs=[LOOPBACK], client_mode=True,
                                           record_validators=validators, join_timeout=30)
        except UserError as e:
            console.print(f"[red]error: the observer could not join the swarm: {e}[/red]")
            return 1
        signal.signal(signal.SIGINT, on_signal)  # hivemind may have reset it
        board = ProgressBoard(observer, args.run_id, public_key)
        dashboard = start_dashboard(board, args, console)
        deadline = time.monotonic() + args.minutes * 60 + STARTUP_ALLOWANCE
        live = None
        if console.is_terminal:
            from rich.live import Live

            live = Live(console=console, refresh_per_second=1)
            live.start()
        last_print = 0.0
        while not stop.is_set():
            snapshot = swarm_snapshot(board.read(), args.run_id)
            history.write(json.dumps(snapshot) + "\n")
            history.flush()
            if live is not None:
                live.update(render_table(snapshot))
            elif time.monotonic() - last_print >= 15:
                totals = snapshot["totals"]
                console.print(f"{time.strftime('%H:%M:%S')} {totals['islands']} islands, "
                              f"{totals['tokens'] / 1e6:.2f}M tokens, {totals['tokens_per_second']:,.0f} tok/s, "
                              f"rounds {totals['rounds_ok']} ok / {totals['rounds_failed']} failed")
                last_print = time.monotonic()
            swarm.remember_trees()
            if all(not island.alive() for island in swarm.islands.values()) or time.monotonic() > deadline:
                break
            stop.wait(3.0)
        if live is not None:
            live.stop()
    finally:
        history.close()
        if dashboard is not None:
            dashboard.close()
        leftovers = swarm.close()
        if observer is not None:
            observer.shutdown()
        if leftovers:
            console.print(f"[red]force-killed leftover processes: {leftovers}[/red]")

    summaries = {name: swarm.summary(name) for name in swarm.islands}
    files.write_json(out / "summaries.json", summaries)
    plot = plot_loss_vs_tokens({name: swarm.events_path(name) for name in swarm.islands}, out / "loss_vs_tokens.png",
                               title=f"{args.islands} islands, {args.preset} preset, {args.minutes:g} min")
    stdout = Console()
    if not stdout.is_terminal:
        stdout.width = max(stdout.width, 140)
    stdout.print(summary_table(summaries))
    console.print(f"wrote {out}/summaries.json, status_history.jsonl, {plot.name} and each island's log")
    codes = {name: island.popen.returncode for name, island in swarm.islands.items()}
    failed = [name for name, code in codes.items() if code not in (0, None) or summaries[name] is None]
    if failed:
        for name in failed:
            lines = swarm.islands[name].log_path.read_text(errors="replace").strip().splitlines()
            console.print(f"[red]{name} did not finish cleanly (exit code {codes[name]}): "
                          f"{lines[-1] if lines else 'no output'}[/red]")
        return 1
    return 130 if stop.is_set() else 0


if __name__ == "__main__":
    sys.exit(main())
