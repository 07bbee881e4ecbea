"""Command-line plumbing shared by compare.py and wan.py (the logic is in p2p_diloco/lab/benchmark.py)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# (light imports only: the lab's modules load torch, hivemind and matplotlib, seconds that a bad flag
# should not wait for; they load once the flags are checked)
from p2p_diloco.config import LR_SCHEDULES, InnerConfig  # noqa: E402


def parser_with_common_flags(doc: str, *, steps: int, arms, period_help: str) -> argparse.ArgumentParser:
    """The flags every benchmark script takes: learners, budget, H, evaluation, data, outer step."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--learners", type=int, default=4, help="learners per arm (default 4)")
    parser.add_argument("--steps", type=int, default=steps, help=f"inner steps per learner (default {steps})")
    parser.add_argument("--h", type=int, default=50, help="inner steps between syncs (default 50)")
    parser.add_argument("--eval-every-steps", type=int, default=50, help="comparators' eval interval (steps)")
    parser.add_argument("--eval-batches", type=int, default=16, help="held-out batches per evaluation")
    parser.add_argument("--eval-seconds", type=float, default=45.0, help="our islands' eval interval (seconds)")
    parser.add_argument("--shards", type=int, default=1,
                        help="cut the training split into N shards, learner r on shard r mod N (default 1: i.i.d.)")
    parser.add_argument("--outer-lr", type=float, default=1.0, help="outer SGD lr of torchft and ours (default 1)")
    parser.add_argument("--outer-momentum", type=float, default=0.0,
                        help="outer Nesterov momentum of torchft and ours (default 0: plain averaging, as hivemind)")
    parser.add_argument("--inner-lr", type=float, default=InnerConfig().lr,
                        help=f"every arm's inner AdamW peak lr (default {InnerConfig().lr})")
    parser.add_argument("--inner-schedule", "--lr-schedule", dest="inner_schedule", choices=LR_SCHEDULES,
                        default="constant",
                        help="every arm's inner learning rate after warm-up: constant, or a cosine decay to "
                        f"{InnerConfig().min_lr_ratio} x "
                        "over each learner's steps (default constant; in the failure pass a restarted hivemind, "
                        "torchft or ours learner warms up again and decays over the steps it has left, while DDP "
                        "resumes its schedule from its checkpoint)")
    parser.add_argument("--ours-period", type=float, default=0.0, help=period_help)
    parser.add_argument("--arms", nargs="+", default=list(arms), choices=arms, metavar="ARM",
                        help=f"arms to run, in order (default: {' '.join(arms)})")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one pass of one arm may take")
    parser.add_argument("--out", default="", help="output folder (default runs/bench/<script>-<time>)")
    return parser


def bench_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace, name: str, **extra):
    """Check the common flags (exit 2 with a message on bad ones) and build the
    :class:`p2p_diloco.lab.benchmark.Bench`."""
    if args.learners < 2:
        parser.error("--learners must be at least 2")
    if args.steps < 4 or args.h < 1 or args.eval_every_steps < 1 or args.eval_batches < 1 or args.shards < 1:
        parser.error("--steps must be at least 4; --h, --eval-every-steps, --eval-batches and --shards at least 1")
    if (args.timeout <= 0 or args.eval_seconds <= 0 or args.inner_lr <= 0 or args.ours_period < 0
            or extra.get("restart_after", 0) < 0):
        parser.error("--timeout, --eval-seconds and --inner-lr must be positive, "
                     "--ours-period and --restart-after not negative")
    if len(set(args.arms)) != len(args.arms):
        parser.error("an arm is named twice in --arms")
    out = Path(args.out or f"runs/bench/{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    if out.exists() and any(out.iterdir()):
        # event logs append and learners resume from checkpoints: an old run's files would mix in
        parser.error(f"--out {out} is not empty: give a new folder (or remove it)")
    from p2p_diloco.lab.benchmark import Bench

    return Bench(out=out, learners=args.learners, steps=args.steps, h=args.h, eval_every_steps=args.eval_every_steps,
                 eval_seconds=args.eval_seconds, eval_batches=args.eval_batches, shards=args.shards,
                 outer_lr=args.outer_lr, outer_momentum=args.outer_momentum, inner_lr=args.inner_lr,
                 schedule=args.inner_schedule, ours_period=args.ours_period, timeout=args.timeout, **extra)


def run(body: Callable[[], None]) -> int:
    """Run a benchmark: Ctrl+C or SIGTERM exits 130, a failed arm 1 (:func:`p2p_diloco.lab.experiment.run_script`)."""
    from p2p_diloco.lab.experiment import run_script

    return run_script(body)
