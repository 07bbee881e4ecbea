"""The lab's subcommands of ``p2p-diloco`` (``chaos``, ``simulate``), registered as entry points of the group
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
        _print_chaos_figures(reanalyze(args.reanalyze), args.reanalyze)
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
    _print_chaos_figures(report, out)
    return 130 if stop.event.is_set() else 0


def _print_chaos_figures(report: dict, out: str) -> None:
    import statistics

    figures = report["figures"]
    timed = [r for r in figures["rejoin"] if r["seconds"] is not None]
    fast = sum(r["seconds"] <= 60.0 for r in timed)
    held = [f"{r['island']} {r['seconds'] if r['seconds'] is not None else '-'} s ({'+'.join(r['held_back'])})"
            for r in figures["rejoin"] if r.get("held_back")]
    median = f", median {statistics.median(r['seconds'] for r in timed):.1f} s" if timed else ""
    print(f"goodput {figures['goodput']:.3f}, alive utilization {figures['alive_utilization']:.3f} "
          f"(ready {figures['ready_utilization']:.3f}), global downtime {figures['global_downtime_seconds']:.1f} s, "
          f"stall per failure median {figures['stall_seconds_median']} s / max {figures['stall_seconds_max']} s, "
          f"rejoin within 60 s: {fast} of {len(timed)} timed restarts{median}"
          f"{'; held back: ' + ', '.join(held) if held else ''}; report in {out}/report.json")
    if "checkpoints" in report:
        saved = report["checkpoints"]
        print(f"checkpoints: {saved['saved']} saved, {saved['files']} kept, {len(saved['unreadable'])} unreadable; "
              f"restarts: {saved['resumed_newest']} resumed the newest, {saved['nothing_to_resume']} had none, "
              f"{saved['not_started']} killed before their start, lost: {saved['resumed_older']} resumed an older "
              f"one, {saved['not_resumed']} none")


CHAOS = Command(
    help="run a local swarm with scheduled faults and report what they cost",
    description="Start a bootstrap node and islands on 127.0.0.1 (or in network namespaces), inject the "
    "schedule's faults (kill and restart, freeze, bootstrap death, a donor killed mid-download, a faulty "
    "island, cut or throttled links) and write report.json (goodput, utilization, global downtime, stall per "
    "failure, time to rejoin) and timeline.png to the output folder.",
    add_arguments=_chaos_arguments,
    run=run_chaos,
)


# the flags of one simulated job (--paper sets its own) and their defaults
SINGLE_JOB = {"arm": "learners", "chips": 150_000, "learners": 8, "learner_mode": "elastic", "checkpoint_s": 0.0,
              "checkpoint_save_s": 0.0,
              "step_s": 1.0, "step_sd_s": 0.0, "outer_period_s": 600.0, "fragments": 1, "quorum": 2, "grace_s": 0.0}


def _simulate_arguments(parser: argparse.ArgumentParser) -> None:
    job = SINGLE_JOB
    parser.add_argument("--paper", action="store_true",
                        help="simulate every cell of Decoupled DiLoCo's goodput table and print it beside the paper's "
                        "(the arms, sizes and rounds are the table's: only the failure, repair, restart, resize, "
                        "rejoin and time-step flags apply)")
    parser.add_argument("--chaos", default="", metavar="SCHEDULE",
                        help="predict the goodput of a chaos schedule (docs/CHAOS.md) instead: its islands, faults and "
                        "round clock, with --startup-s and --utilization")
    parser.add_argument("--volunteers", type=int, nargs="+", metavar="N",
                        help="simulate volunteer swarms of N islands present on average instead (islands that come "
                        "and go, of different speeds: docs/SCALE.md), one per N, with --stay-h, --stay-shape, "
                        "--speed-sd, --startup-s, --state-mb, --bandwidth-mbps and the round flags")
    parser.add_argument("--stay-h", type=float, default=4.0, metavar="H",
                        help="with --volunteers: an island's mean stay, hours (default: 4)")
    parser.add_argument("--stay-shape", type=float, default=0.5, metavar="K",
                        help="with --volunteers: Weibull shape of the stays (1: exponential; default 0.5: many short "
                        "stays, a few long ones)")
    parser.add_argument("--speed-sd", type=float, default=0.5, metavar="S",
                        help="with --volunteers: log-normal spread of the islands' speeds (default: 0.5)")
    parser.add_argument("--state-mb", type=float, default=8.6, metavar="MB",
                        help="with --volunteers: the state a newcomer downloads, MB (default 8.6: the tiny preset's "
                        "Theta and momentum; a 1B-parameter model's is 8,000)")
    parser.add_argument("--bandwidth-mbps", type=float, default=100.0, metavar="MBPS",
                        help="with --volunteers: a newcomer's download rate, megabits/s (default: 100)")
    parser.add_argument("--fallback-defer", type=int, default=2, metavar="N",
                        help="with --volunteers: rounds below the quorum whose work an island carries over "
                        "(outer.fallback_defer)")
    parser.add_argument("--startup-s", type=float, metavar="S",
                        help="with --chaos: seconds from an island's restart to its first inner step (default 20); "
                        "with --volunteers: from a newcomer's start to its first step, without the download "
                        "(default 60)")
    parser.add_argument("--utilization", type=float, default=0.98, metavar="U",
                        help="with --chaos: share of a running island's time in inner steps (measured without faults)")
    parser.add_argument("--arm", choices=["dp", "elastic", "learners"], default=job["arm"],
                        help="data-parallel, elastic data-parallel or M learners (default: %(default)s)")
    parser.add_argument("--chips", type=int, default=job["chips"], metavar="N", help="(default: %(default)s)")
    parser.add_argument("--learners", type=int, default=job["learners"], metavar="M", help="learners (the learners arm)")
    parser.add_argument("--learner-mode", choices=["elastic", "rigid"], default=job["learner_mode"],
                        help="a learner drops a failed slice (elastic) or restarts whole (rigid)")
    parser.add_argument("--slice-chips", type=int, metavar="N", help="chips per slice (default: the paper fit's, 125)")
    parser.add_argument("--chip-mtbi-days", type=float, default=365.0, metavar="D",
                        help="mean time between interruptions of one chip, days (default: a year)")
    parser.add_argument("--repair-s", type=float, metavar="S", help="seconds until a failed slice is back (default: the paper fit's, 0 for "
                        "data-parallel, which restarts on spares, 600 otherwise)")
    parser.add_argument("--restart-s", type=float, metavar="S", help="seconds of a rigid job's restart (default: the paper fit's, 78)")
    parser.add_argument("--resize-s", type=float, metavar="S", help="seconds of an elastic job's pause per change (default: the paper fit's, 22)")
    parser.add_argument("--rejoin-wait-s", type=float, metavar="S",
                        help="seconds a repaired slice waits for an elastic job's next pause before it pauses the job "
                        "itself (0: at once; default: the paper fit's, 180)")
    parser.add_argument("--tick-s", type=float, metavar="S",
                        help="simulate in steps of S seconds: every event at the end of its step, a step's failures "
                        "first (0: continuous time; default: the paper fit's, 2)")
    parser.add_argument("--checkpoint-s", type=float, default=job["checkpoint_s"], metavar="S",
                        help="a rigid job's checkpoint interval, seconds of training (work since the last one is "
                        "lost; 0: none; with --checkpoint-save-s and no --checkpoint-s: Young's interval)")
    parser.add_argument("--checkpoint-save-s", type=float, default=job["checkpoint_save_s"], metavar="S",
                        help="seconds a rigid job pauses to save each checkpoint")
    parser.add_argument("--step-s", type=float, default=job["step_s"], metavar="S")
    parser.add_argument("--step-sd-s", type=float, default=job["step_sd_s"], metavar="S",
                        help="spread of a slice's step time")
    parser.add_argument("--outer-period-s", type=float, default=job["outer_period_s"], metavar="S")
    parser.add_argument("--fragments", type=int, default=job["fragments"], metavar="P")
    parser.add_argument("--quorum", type=int, default=job["quorum"], metavar="K",
                        help="learners a round needs (at least 2 in any case)")
    parser.add_argument("--grace-s", type=float, default=job["grace_s"], metavar="S")
    parser.add_argument("--hours", type=float, default=24.0 * 7, metavar="H", help="simulated wall time")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="", metavar="DIR", help="also write results.json and goodput.png here")


def run_simulate(args: argparse.Namespace, stop) -> int:
    """``p2p-diloco simulate``: one simulated job, or the paper's whole table (``--paper``).

    :returns: 0 done, 130 interrupted
    :raises p2p_diloco.errors.ConfigError: values the simulator refuses
    """
    import math
    import tempfile
    from pathlib import Path

    from pydantic import ValidationError
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from p2p_diloco.errors import ConfigError
    from p2p_diloco.files import write_json
    from p2p_diloco.lab import simulate as sim
    from p2p_diloco.lab.plots import plot_goodput_vs_chips

    given = {key: value for key, value in (("slice_chips", args.slice_chips), ("repair_s", args.repair_s),
                                            ("restart_s", args.restart_s), ("resize_s", args.resize_s),
                                            ("rejoin_wait_s", args.rejoin_wait_s), ("tick_s", args.tick_s))
             if value is not None}
    if not (math.isfinite(args.chip_mtbi_days) and args.chip_mtbi_days > 0):
        raise ConfigError(f"--chip-mtbi-days must be a positive number of days (got {args.chip_mtbi_days})")
    modes = [flag for flag, given in (("--paper", args.paper), ("--chaos", args.chaos),
                                      ("--volunteers", args.volunteers)) if given]
    if len(modes) > 1:
        raise ConfigError(f"{' and '.join(modes)} are different simulations: choose one")
    if args.paper or args.chaos:
        what = "--paper simulates the table's own" if args.paper else "--chaos simulates the schedule's own"
        ignored = [f"--{key.replace('_', '-')}" for key, default in SINGLE_JOB.items() if getattr(args, key) != default]
        if ignored:
            raise ConfigError(f"{what} arms, sizes and rounds: drop {' '.join(ignored)}")
    if args.chaos:
        return _predict_chaos(args)
    out = Path(args.out) if args.out else None
    if out is not None:  # before the simulation, not after it
        try:
            out.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=out):
                pass
        except OSError as e:
            raise ConfigError(f"cannot write to --out {args.out}: {e.strerror or e}") from None

    if args.volunteers:
        return _simulate_volunteers(args, out, stop)
    try:  # every value is checked before the simulation starts
        if args.paper:
            cells = sim.paper_cells(chip_mtbi_s=args.chip_mtbi_days * 86400, hours=args.hours, seed=args.seed, **given)
        else:
            config = sim.paper_config(
                args.arm, args.chips, args.learners if args.arm == "learners" else 1,
                learner_mode=args.learner_mode, chip_mtbi_s=args.chip_mtbi_days * 86400,
                checkpoint_save_s=args.checkpoint_save_s, step_s=args.step_s, step_sd_s=args.step_sd_s,
                outer_period_s=args.outer_period_s, fragments=args.fragments, quorum=args.quorum,
                grace_s=args.grace_s, hours=args.hours, seed=args.seed, **given,
                **({"checkpoint_s": args.checkpoint_s} if args.checkpoint_s or not args.checkpoint_save_s else {}))
    except ValidationError as e:
        from p2p_diloco.flags import format_validation_error

        raise ConfigError(format_validation_error(e)) from None

    def interrupted(done: float) -> None:
        if stop.event.is_set():
            raise KeyboardInterrupt
        bar.update(task, completed=done)

    try:
        with Progress(TextColumn("simulating"), BarColumn(), TimeRemainingColumn(), transient=True,
                      console=Console(stderr=True)) as bar:
            task = bar.add_task("simulate", total=1.0)
            if args.paper:
                rows = sim.paper_table(cells, progress=interrupted)
            else:
                result = sim.simulate(config, progress=interrupted)
    except KeyboardInterrupt:
        return 130
    if not args.paper:
        print(f"{sim.arm_label(config.arm, config.learners)}, {config.chips:,} chips: goodput "
              f"{100 * result.goodput:.1f}%, uptime {100 * result.uptime:.2f}%, {result.failures:,} slice failures "
              f"in {config.hours:g} h, rounds {result.rounds_ok:,} ok / {result.rounds_fallback:,} fallback")
        rows = [{"label": sim.arm_label(config.arm, config.learners), "chips": config.chips,
                 "ours": round(100 * result.goodput, 1), "paper": None, **result.__dict__}]
    else:
        labels = list(dict.fromkeys(row["label"] for row in rows))
        print("| arm | " + " | ".join(f"{chips // 1000:,}k" for chips in sim.PAPER_CHIPS) + " |")
        print("|---|" + "---|" * len(sim.PAPER_CHIPS))
        for label in labels:
            cells = [row for row in rows if row["label"] == label]
            print(f"| {label} | " + " | ".join(f"{row['ours']:.1f} ({row['paper']})" for row in cells) + " |")
        worst = max(rows, key=lambda row: abs(row["ours"] - row["paper"]))
        print(f"ours (paper's) goodput, %; largest gap {abs(worst['ours'] - worst['paper']):.1f} points "
              f"({worst['label']}, {worst['chips']:,} chips)")
    if out is not None:
        write_json(out / "results.json", {"args": {k: v for k, v in vars(args).items() if k != "lab_command"},
                                          "rows": rows})
        plot_goodput_vs_chips(rows, out / "goodput.png", "goodput under failures (simulated)")
        print(f"wrote {out}/results.json and {out}/goodput.png")
    return 0


def _predict_chaos(args: argparse.Namespace) -> int:
    """``p2p-diloco simulate --chaos SCHEDULE``: the goodput the schedule should measure."""
    from p2p_diloco.errors import ConfigError
    from p2p_diloco.lab.chaos import load_schedule
    from p2p_diloco.lab.simulate import predict_chaos

    startup = 20.0 if args.startup_s is None else args.startup_s
    if not (0 < args.utilization <= 1) or not (0 <= startup < 3600):
        raise ConfigError(f"--utilization must lie in (0, 1] and --startup-s in [0, 3600) "
                          f"(got {args.utilization}, {startup})")
    schedule = load_schedule(args.chaos)  # (a ConfigError names a bad file)
    config, result = predict_chaos(schedule, startup_s=startup, utilization=args.utilization)
    print(f"{args.chaos}: {schedule.islands} islands, {schedule.minutes:g} minutes, {len(schedule.faults)} faults: "
          f"predicted goodput {result.goodput:.3f} (start-up {startup:g} s, utilization {args.utilization:g}); "
          f"rounds {result.rounds_ok} ok / {result.rounds_fallback} fallback")
    return 0


# the single job's flags that mean something else (or nothing) for a volunteer swarm
_NOT_FOR_VOLUNTEERS = ("arm", "chips", "learners", "learner_mode", "checkpoint_s", "checkpoint_save_s", "step_s",
                       "step_sd_s")


def _simulate_volunteers(args: argparse.Namespace, out, stop) -> int:
    """``p2p-diloco simulate --volunteers N ...``: one volunteer swarm per N, in a table (and with
    ``out``, results.json and goodput.png)."""
    from pydantic import ValidationError

    from p2p_diloco.errors import ConfigError
    from p2p_diloco.files import write_json
    from p2p_diloco.lab.plots import plot_goodput_vs_chips
    from p2p_diloco.lab.volunteers import VolunteerConfig, simulate_volunteers

    ignored = [f"--{key.replace('_', '-')}" for key in _NOT_FOR_VOLUNTEERS if getattr(args, key) != SINGLE_JOB[key]]
    ignored += [f"--{key.replace('_', '-')}" for key in ("slice_chips", "repair_s", "restart_s", "resize_s",
                                                          "rejoin_wait_s") if getattr(args, key) is not None]
    if ignored:
        raise ConfigError(f"--volunteers simulates islands, not chips and jobs: drop {' '.join(ignored)}")
    if min(args.volunteers) <= 0:
        raise ConfigError(f"--volunteers takes numbers of islands above 0 (got {min(args.volunteers)})")
    try:  # every size is checked before the first simulation
        configs = [VolunteerConfig(
            islands=n, stay_mean_s=args.stay_h * 3600, stay_shape=args.stay_shape, speed_sd=args.speed_sd,
            startup_s=60.0 if args.startup_s is None else args.startup_s, state_bytes=args.state_mb * 1e6,
            bandwidth_Bps=args.bandwidth_mbps * 1e6 / 8, outer_period_s=args.outer_period_s, fragments=args.fragments,
            quorum=args.quorum, grace_s=args.grace_s, fallback_defer=args.fallback_defer, hours=args.hours,
            seed=args.seed) for n in args.volunteers]
    except ValidationError as e:
        from p2p_diloco.flags import format_validation_error

        raise ConfigError(format_validation_error(e)) from None
    rows = []
    print("| islands (present) | joins | goodput | lost: start-up | departures | alone | rounds ok / fallback "
          "| members per round |")
    print("|---|---|---|---|---|---|---|---|")
    for config in configs:
        if stop.event.is_set():
            return 130
        result = simulate_volunteers(config)
        rows.append({"label": "volunteers", "chips": config.islands, "ours": round(100 * result.goodput, 1),
                     "paper": None, **result.__dict__})
        print(f"| {config.islands:,} ({result.present:,.1f}) | {result.joins:,} | {100 * result.goodput:.1f}% "
              f"| {100 * result.startup:.1f}% | {100 * result.departure:.1f}% | {100 * result.alone:.1f}% "
              f"| {result.rounds_ok:,} / {result.rounds_fallback:,} | {result.members:,.1f} |")
    print(f"{args.hours:g} h each; stays of {args.stay_h:g} h on average (Weibull shape {args.stay_shape:g}), "
          f"start-up {configs[0].startup_s:g} s + {configs[0].download_s:.1f} s of download, T_outer "
          f"{args.outer_period_s:g} s")
    if out is not None:
        write_json(out / "results.json", {"args": {k: v for k, v in vars(args).items() if k != "lab_command"},
                                          "rows": rows})
        plot_goodput_vs_chips(rows, out / "goodput.png", "volunteer swarms: goodput (simulated)", x_label="islands")
        print(f"wrote {out}/results.json and {out}/goodput.png")
    return 0


SIMULATE = Command(
    help="simulate a training job's goodput under hardware failures (data-parallel, elastic, M learners), or "
    "a volunteer swarm's",
    description="A discrete-event simulation of chips that fail and come back: data-parallel training stops "
    "for every failure, elastic data-parallel pauses to drop and re-add slices, and M independent learners "
    "(Decoupled DiLoCo) lose only their own slices while the outer rounds run on the swarm's clock. --paper "
    "reproduces the goodput table of arXiv 2604.21428 with the assumptions of docs/SCALE.md; --chaos predicts a "
    "chaos run's; --volunteers simulates swarms of islands that come and go.",
    add_arguments=_simulate_arguments,
    run=run_simulate,
)
