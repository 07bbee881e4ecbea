#!/usr/bin/env python3
"""DDP vs our islands over emulated wide-area links: each learner in its own network namespace,
joined to the others through a bridge by a veth pair throttled with ``tc tbf`` (both directions).

Same model, data and token budget as scripts/bench/compare.py; reports the time to the token budget
(wall), tokens/s, eval loss and bytes per token of each arm. Needs root and the ``ip``/``tc`` tools;
elsewhere it prints why and exits 0 without running (nothing to measure).

    sudo .venv/bin/python scripts/bench/wan.py [--rate 50mbit] [--steps 100]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from p2p_diloco.benchmark import Bench, combine, markdown, plot, run_pass  # noqa: E402
from p2p_diloco.netns import check_available  # noqa: E402

ARMS = ("ddp", "ours")
COLUMNS = [("arm", "arm"), ("wall_seconds", "time to budget s"), ("tokens_per_second", "tokens/s"),
           ("eval_loss", "eval loss"), ("eval_vs_ddp", "vs ddp"), ("eval_loss_mean_model", "eval loss, mean model"),
           ("mean_model_vs_ddp", "vs ddp"), ("utilization", "utilization"),
           ("bytes_per_token", "bytes/token"), ("fewer_bytes_than_ddp", "x fewer bytes than ddp"),
           ("ratios", "ratio to ddp (loss, wall, tokens/s)")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="50mbit", help="tc rate of every learner's link (default 50mbit)")
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument("--steps", type=int, default=100, help="inner steps per learner (default 100)")
    parser.add_argument("--h", type=int, default=50, help="inner steps between our syncs (default 50)")
    parser.add_argument("--eval-every-steps", type=int, default=50)
    parser.add_argument("--eval-batches", type=int, default=16, help="held-out batches per evaluation")
    parser.add_argument("--eval-seconds", type=float, default=45.0)
    parser.add_argument("--shards", type=int, default=1,
                        help="cut the training split into N shards, learner r on shard r mod N (default 1: i.i.d.)")
    parser.add_argument("--outer-lr", type=float, default=1.0, help="outer SGD lr of torchft and ours (default 1)")
    parser.add_argument("--outer-momentum", type=float, default=0.0,
                        help="outer Nesterov momentum of torchft and ours (default 0: plain averaging, as hivemind)")
    parser.add_argument("--ours-period", type=float, default=0.0,
                        help="our outer period in seconds (default: H x 0.5 s, a tiny-preset step of 4 learners "
                        "on 2 cores; DDP's own step time here is mostly waiting for the link)")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS, metavar="ARM")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--out", default="", help="output folder (default runs/bench/wan-<time>)")
    args = parser.parse_args()
    if args.learners < 2 or args.steps < 4:
        parser.error("--learners must be at least 2 and --steps at least 4")
    reason = check_available()
    if reason:
        print(f"skipped: {reason}")
        return 0
    out = Path(args.out or f"runs/bench/wan-{time.strftime('%Y%m%d-%H%M%S')}")
    bench = Bench(out=out, learners=args.learners, steps=args.steps, h=args.h, eval_every_steps=args.eval_every_steps,
                  eval_seconds=args.eval_seconds, eval_batches=args.eval_batches, shards=args.shards,
                  outer_lr=args.outer_lr, outer_momentum=args.outer_momentum, ours_period=args.ours_period,
                  timeout=args.timeout, rate=args.rate)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for name in args.arms:
            print(f"[wan] {name}: {args.learners} learners x {args.steps} steps, links at {args.rate}", flush=True)
            rows.append(run_pass(name, bench, failure=False))
            print(f"[wan]   wall {rows[-1]['wall_seconds']} s, eval loss {rows[-1]['eval_loss']}", flush=True)
    except KeyboardInterrupt:
        print("interrupted: every process of the running arm was stopped", file=sys.stderr)
        return 130
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    table = combine(rows, [])
    text = markdown(table, COLUMNS)
    (out / "results.json").write_text(json.dumps({"rate": args.rate, "rows": rows, "table": table}, indent=2) + "\n")
    (out / "table.md").write_text(text + "\n")
    plot(rows, out / "wan.png", f"{args.learners} learners x {args.steps} steps, links at {args.rate}")
    print(f"\n{text}\n\nplot: {out / 'wan.png'}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
