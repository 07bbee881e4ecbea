"""The lab's subcommands of ``p2p-diloco`` (``chaos``), registered as entry points of the group
``p2p_diloco.commands`` (pyproject.toml): the CLI lists and runs them without importing the lab,
so nothing outside the lab imports it (docs/DESIGN.md, "Layers")."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Command:
    """A subcommand: its help line, description, flags and what it runs (returns the exit code)."""

    help: str
    description: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, object], int]


def _chaos_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--schedule", default="", metavar="FILE", help="a TOML or YAML schedule (see docs/CHAOS.md)")
    parser.add_argument("--out", default="", metavar="DIR", help="output folder (default: runs/chaos-<timestamp>)")
    parser.add_argument("--islands", type=int, metavar="N", help="override the schedule's number of islands")
    parser.add_argument("--minutes", type=float, metavar="X", help="override the schedule's measured minutes")
    parser.add_argument("--reanalyze", default="", metavar="DIR",
                        help="recompute report.json and timeline.png of a finished run folder, then exit")


def run_chaos(args: argparse.Namespace, stop) -> int:
    """``p2p-diloco chaos``: run a schedule and print its headline figures.

    :param stop: the command's :class:`p2p_diloco.procs.StopSignal`
    :returns: 0 done, 1 the swarm did not start, 130 interrupted
    :raises p2p_diloco.errors.ConfigError: an unreadable or invalid schedule
    """
    from p2p_diloco.lab.chaos import ChaosConfig, ChaosRun, load_schedule, reanalyze

    if args.reanalyze:
        _print_chaos_figures(reanalyze(args.reanalyze)["figures"], args.reanalyze)
        return 0
    config = load_schedule(args.schedule) if args.schedule else ChaosConfig()
    overrides = {key: value for key, value in (("islands", args.islands), ("minutes", args.minutes)) if value}
    if overrides:
        config = ChaosConfig.model_validate(config.model_dump() | overrides)
    out = args.out or f"runs/chaos-{time.strftime('%Y%m%d-%H%M%S')}"
    run = ChaosRun(config, out, stop.event)
    try:
        report = run.run()
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        run.close()
    _print_chaos_figures(report["figures"], out)
    return 130 if stop.event.is_set() else 0


def _print_chaos_figures(figures: dict, out: str) -> None:
    rejoins = [r["seconds"] for r in figures["rejoin"]]
    print(f"goodput {figures['goodput']:.3f}, alive utilization {figures['alive_utilization']:.3f} "
          f"(ready {figures['ready_utilization']:.3f}), global downtime {figures['global_downtime_seconds']:.1f} s, "
          f"stall per failure median {figures['stall_seconds_median']} s / max {figures['stall_seconds_max']} s, "
          f"rejoin {rejoins} s; report in {out}/report.json")


CHAOS = Command(
    help="run a local swarm with scheduled faults and report what they cost",
    description="Start a bootstrap node and islands on 127.0.0.1 (or in network namespaces), inject the "
    "schedule's faults (kill and restart, freeze, bootstrap death, a donor killed mid-download, a faulty "
    "island, cut or throttled links) and write report.json (goodput, utilization, global downtime, stall per "
    "failure, time to rejoin) and timeline.png to the output folder.",
    add_arguments=_chaos_arguments,
    run=run_chaos,
)
