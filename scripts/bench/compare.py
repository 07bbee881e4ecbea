#!/usr/bin/env python3
"""Side by side on one machine: torch DDP, hivemind.Optimizer, torchft DiLoCo and our islands.

Same model (tiny preset), data, inner AdamW and token budget (learners x steps x 2048 tokens) for
every arm; a clean pass, then a failure pass in which one learner is SIGKILLed halfway through its
steps (restarted 20 s later where the arm can rejoin; DDP restarts through torchrun). Writes
results.json, table.md and compare.png (eval loss vs tokens and vs wall time) under --out.
Definitions: p2p_diloco/benchmark.py; results: docs/BENCHMARKS.md.

    .venv/bin/pip install -e '.[bench]'          # torchft==0.2.0
    .venv/bin/python scripts/bench/compare.py [--steps 200] [--h 50] [--arms ddp ours] [--no-failure]
        [--failure-arms ddp ours]
"""

from __future__ import annotations

from _common import bench_from_args, parser_with_common_flags, run

from p2p_diloco.lab.arms import ARMS


def main() -> int:
    parser = parser_with_common_flags(__doc__, steps=200, arms=ARMS,
                                      period_help="our outer period in seconds (default: H x the ddp arm's step time)")
    parser.add_argument("--restart-after", type=float, default=20.0, help="seconds from kill to restart")
    parser.add_argument("--no-failure", action="store_true", help="skip the failure pass")
    parser.add_argument("--failure-arms", nargs="+", metavar="ARM", default=None,
                        help="arms of the failure pass, in order (default: every arm of --arms)")
    args = parser.parse_args()
    failure_arms = [] if args.no_failure else (args.failure_arms or list(args.arms))
    unknown = [arm for arm in failure_arms if arm not in args.arms]
    if unknown:
        parser.error(f"--failure-arms {' '.join(unknown)}: not in --arms ({' '.join(args.arms)})")
    bench = bench_from_args(parser, args, "compare", restart_after=args.restart_after)
    if "torchft" in args.arms:
        try:
            import torchft  # noqa: F401
        except ImportError:
            parser.error("the torchft arm needs torchft: pip install -e '.[bench]' (or drop it with --arms)")
    from p2p_diloco.lab.benchmark import run_bench

    return run(lambda: run_bench(bench, args.arms, failure_arms=failure_arms))


if __name__ == "__main__":
    raise SystemExit(main())
