#!/usr/bin/env python3
"""DDP vs our islands over emulated wide-area links: each learner in its own network namespace,
joined to the others through a bridge by a veth pair throttled with ``tc tbf`` (both directions).

Same model, data and token budget as scripts/bench/compare.py; reports the time to the token budget
(wall), tokens/s, eval loss and bytes per token of each arm. Needs root and the ``ip``/``tc`` tools;
elsewhere it prints why and exits 0 without running (nothing to measure).

    sudo .venv/bin/python scripts/bench/wan.py [--rate 50mbit] [--steps 100]
"""

from __future__ import annotations


from _common import bench_from_args, parser_with_common_flags, run

from p2p_diloco import files
from p2p_diloco.lab.netns import check_available

ARMS = ("ddp", "ours")
COLUMNS = [("arm", "arm"), ("wall_seconds", "time to budget s"), ("tokens_per_second", "tokens/s"),
           ("eval_loss", "eval loss"), ("eval_vs_ddp", "vs ddp"), ("eval_loss_mean_model", "eval loss, mean model"),
           ("mean_model_vs_ddp", "vs ddp"), ("utilization", "utilization"),
           ("bytes_per_token", "bytes/token"), ("fewer_bytes_than_ddp", "x fewer bytes than ddp"),
           ("ratios", "ratio to ddp (loss, wall, tokens/s)")]


def main() -> int:
    parser = parser_with_common_flags(
        __doc__, steps=100, arms=ARMS,
        period_help="our outer period in seconds (default: H x 0.5 s, a tiny-preset step of 4 learners on 2 cores; "
        "DDP's own step time here is mostly waiting for the link)")
    parser.add_argument("--rate", default="50mbit", help="tc rate of every learner's link (default 50mbit)")
    args = parser.parse_args()
    bench = bench_from_args(parser, args, "wan", rate=args.rate)
    reason = check_available()
    if reason:
        print(f"skipped: {reason}")
        return 0
    return run(lambda: run_wan(bench, args.arms))


def run_wan(bench, arms) -> None:
    """Run each arm's clean pass over the throttled links, then write the table and the plot."""
    from p2p_diloco.lab.benchmark import combine, run_pass
    from p2p_diloco.lab.experiment import table
    from p2p_diloco.lab.plots import plot_compare

    bench.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in arms:
        print(f"[wan] {name}: {bench.learners} learners x {bench.steps} steps, links at {bench.rate}", flush=True)
        rows.append(run_pass(name, bench, failure=False))
        print(f"[wan]   wall {rows[-1]['wall_seconds']} s, eval loss {rows[-1]['eval_loss']}", flush=True)
    combined = combine(rows, [])
    text = table(combined, COLUMNS)
    files.write_json(bench.out / "results.json", {"rate": bench.rate, "rows": rows, "table": combined})
    files.write_text(bench.out / "table.md", text + "\n")
    plot_compare(rows, bench.out / "wan.png", f"{bench.learners} learners x {bench.steps} steps, links at {bench.rate}")
    print(f"\n{text}\n\nplot: {bench.out / 'wan.png'}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
