#!/usr/bin/env python3
"""Side by side on one machine: torch DDP, hivemind.Optimizer, torchft DiLoCo and our islands.

Same model (tiny preset), data shards, inner AdamW and token budget (learners x steps x 2048 tokens)
for every arm; a clean pass, then a failure pass in which one learner is SIGKILLed halfway through
its steps (restarted 20 s later where the arm can rejoin). Writes results.json, table.md and
compare.png (eval loss vs tokens and vs wall time) under --out. Definitions: p2p_diloco/benchmark.py.

    .venv/bin/pip install -e '.[bench]'          # torchft==0.2.0
    .venv/bin/python scripts/bench/compare.py [--steps 200] [--h 50] [--arms ddp ours] [--no-failure]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from p2p_diloco.benchmark import ARMS, Bench, run_bench  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--learners", type=int, default=4, help="learners per arm (default 4)")
    parser.add_argument("--steps", type=int, default=200, help="inner steps per learner (default 200)")
    parser.add_argument("--h", type=int, default=50, help="inner steps between syncs (default 50)")
    parser.add_argument("--eval-every-steps", type=int, default=50, help="comparators' eval interval (steps)")
    parser.add_argument("--eval-batches", type=int, default=16, help="held-out batches per evaluation")
    parser.add_argument("--eval-seconds", type=float, default=45.0, help="our islands' eval interval (seconds)")
    parser.add_argument("--shards", type=int, default=1,
                        help="cut the training split into N shards, learner r on shard r mod N (default 1: i.i.d.)")
    parser.add_argument("--outer-lr", type=float, default=1.0, help="outer SGD lr of torchft and ours (default 1)")
    parser.add_argument("--outer-momentum", type=float, default=0.0,
                        help="outer Nesterov momentum of torchft and ours (default 0: plain averaging, as hivemind)")
    parser.add_argument("--ours-period", type=float, default=0.0,
                        help="our outer period in seconds (default: H x the ddp arm's step time)")
    parser.add_argument("--restart-after", type=float, default=20.0, help="seconds from kill to restart")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS, metavar="ARM",
                        help=f"arms to run, in order (default: {' '.join(ARMS)})")
    parser.add_argument("--no-failure", action="store_true", help="skip the failure pass")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one pass of one arm may take")
    parser.add_argument("--out", default="", help="output folder (default runs/bench/compare-<time>)")
    args = parser.parse_args()
    if args.learners < 2:
        parser.error("--learners must be at least 2")
    if args.steps < 4 or args.h < 1 or args.eval_every_steps < 1:
        parser.error("--steps must be at least 4, --h and --eval-every-steps at least 1")
    if "torchft" in args.arms:
        try:
            import torchft  # noqa: F401
        except ImportError:
            parser.error("the torchft arm needs torchft: pip install -e '.[bench]' (or drop it with --arms)")
    out = Path(args.out or f"runs/bench/compare-{time.strftime('%Y%m%d-%H%M%S')}")
    bench = Bench(out=out, learners=args.learners, steps=args.steps, h=args.h, eval_every_steps=args.eval_every_steps,
                  eval_seconds=args.eval_seconds, eval_batches=args.eval_batches, shards=args.shards,
                  outer_lr=args.outer_lr, outer_momentum=args.outer_momentum, restart_after=args.restart_after,
                  ours_period=args.ours_period, timeout=args.timeout)
    try:
        run_bench(bench, args.arms, failure=not args.no_failure)
    except KeyboardInterrupt:
        print("interrupted: every process of the running arm was stopped", file=sys.stderr)
        return 130
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
