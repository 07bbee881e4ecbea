#!/usr/bin/env python3
"""E8: what one faulty or malicious island does to a swarm, with the defences of docs/SECURITY.md.

Every arm is a swarm of N islands (default 4) on the same data and token budget; in the attack arms
the last island (or the last two, ``--attackers 2``) attacks from its first round with values every
check lets through (``--debug-attack``, :class:`p2p_diloco.lab.faults.AttackingFormat`):

  mean         no attacker, the plain weighted mean (``--outer-aggregator mean``): today's rounds
  clip         no attacker, the defaults (weight cap, CenteredClip without far-off members)
  flip+inflate reversed updates at the bound, a million times its weight
  inflate      its honest update, a million times its weight
  flip         reversed updates at the bound
  noise        its update plus 10 standard deviations of Gaussian noise
  bias         its update plus 1 standard deviation along one fixed direction, every round
  replay       its first update, again in every round
  lying_reducer  honest updates, but every part it reduces returned reversed
  mean:flip+inflate  the attack against the plain mean (no defence), for scale

Figures per arm: the honest islands' final eval loss (mean) and its ratio to the clean arm's, the
round time (median seconds from a round's slot to its end, ok rounds of honest islands), and when
each attacker was flagged (seconds after its first round, and how many rounds with it went before).

    .venv/bin/python scripts/experiments/e8_attacks.py [--islands 4] [--attackers 1] [--steps 150] [--quorum K]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from _common import select_arms  # noqa: E402

from p2p_diloco import files  # noqa: E402
from p2p_diloco.island.events import read_events  # noqa: E402
from p2p_diloco.lab.experiment import Arm, run_arm, run_script, table  # noqa: E402

ATTACK_ARMS = ["flip+inflate", "inflate", "flip", "noise", "bias", "replay", "lying_reducer", "mean:flip+inflate"]


def build(islands: int, attackers: int, steps: int, quorum: int = 0) -> list[Arm]:
    period = 12.0 * islands / 4  # 8 islands share the 2 cores: a longer period for a similar H
    common = ["--outer-quorum", str(quorum)] if quorum else []
    arms = [Arm("mean", islands, steps, ["--outer-aggregator", "mean", *common], period=period),
            Arm("clip", islands, steps, common, period=period)]
    for name in ATTACK_ARMS:
        aggregator, _, attack = name.rpartition(":")
        arms.append(Arm(name, islands, steps, (["--outer-aggregator", aggregator] if aggregator else []) + common,
                        per_island={i: ["--debug-attack", attack] for i in range(islands - attackers, islands)},
                        period=period))
    return arms


def attack_figures(arm: Arm, folder: Path, attackers: int) -> dict:
    """The honest islands' eval loss and round time, and when each attacker was flagged."""
    names = [f"island-{i}" for i in range(arm.islands)]
    bad = names[arm.islands - attackers:] if arm.per_island else []
    events = {n: read_events(str(folder / f"{n}.events.jsonl")) for n in names
              if (folder / f"{n}.events.jsonl").exists()}
    honest = [n for n in names if n not in bad and n in events]
    finals = [next((e["eval_loss"] for e in reversed(events[n]) if e.get("event") == "eval"), None) for n in honest]
    finals = [f for f in finals if f is not None]
    rounds = [e for n in honest for e in events[n] if e.get("event") == "round"]
    seconds = [e["t_end"] - e["slot_time"] for e in rounds if e["outcome"] == "ok"]
    flagged = {}
    for culprit in bad:
        with_it = sorted(e["slot_time"] for e in rounds if culprit in e.get("members", []))
        flags = sorted(e["t"] for n in honest for e in events[n]
                       if e.get("event") == "flag" and e.get("culprit") == culprit and e.get("how") == "caught")
        if flags and with_it:
            flagged[culprit] = {"after_s": round(flags[0] - with_it[0], 1),
                                "rounds_before": sum(t < flags[0] for t in with_it),
                                "by": sum(1 for n in honest if any(e.get("event") == "flag" and e.get("culprit") == culprit
                                                                   for e in events[n]))}
        else:
            flagged[culprit] = None
    return {"honest_eval_loss": round(statistics.fmean(finals), 4) if finals else None,
            "round_seconds": round(statistics.median(seconds), 2) if seconds else None,
            "honest_rounds_ok": sum(e["outcome"] == "ok" for e in rounds),
            "honest_rounds_rejected": sum(e["outcome"] == "rejected" for e in rounds),
            "honest_rounds_halved": sum(bool(e.get("halvings")) for e in rounds),
            "flagged": flagged}


COLUMNS = [("arm", "arm"), ("honest_eval_loss", "honest eval loss"), ("vs_clean", "vs clean"),
           ("round_seconds", "round s (median)"), ("honest_rounds_ok", "honest rounds ok"),
           ("honest_rounds_halved", "rounds halved"),
           ("flag", "attacker flagged (s after its first round / rounds before / by)"), ("seconds", "wall s")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--islands", type=int, default=4)
    parser.add_argument("--attackers", type=int, default=1)
    parser.add_argument("--steps", type=int, default=150, help="inner steps per island (default 150)")
    parser.add_argument("--quorum", type=int, default=0,
                        help="--outer-quorum of every island in every arm (default: the product's)")
    parser.add_argument("--arms", nargs="+", default=None, metavar="ARM", help="run only these arms (by name)")
    parser.add_argument("--out", default="", help="output folder (default runs/experiments/e8-<time>)")
    args = parser.parse_args(argv)
    if not 1 <= args.attackers < args.islands / 2:
        parser.error("--attackers must be at least 1 and fewer than half the islands")
    arms = select_arms(parser, build(args.islands, args.attackers, args.steps, args.quorum), args.arms)
    out = Path(args.out or f"runs/experiments/e8-{time.strftime('%Y%m%d-%H%M%S')}")

    def body():
        out.mkdir(parents=True, exist_ok=True)
        rows = []
        for arm in arms:
            print(f"[e8] arm {arm.name}: {arm.islands} islands x {arm.max_steps} steps", flush=True)
            row = run_arm(arm, out) | attack_figures(arm, out / arm.name, args.attackers)
            rows.append(row)
            files.write_json(out / "results.json", rows)
            print(f"[e8]   honest eval loss {row['honest_eval_loss']}, flagged {row['flagged']}", flush=True)
        clean = next((r["honest_eval_loss"] for r in rows if r["arm"] == "clip"), None)
        for row in rows:
            if clean and row["honest_eval_loss"]:
                row["vs_clean"] = round(row["honest_eval_loss"] / clean, 3)
            row["flag"] = "; ".join(f"{k}: {v['after_s']} s / {v['rounds_before']} / {v['by']}" if v else f"{k}: no"
                                    for k, v in row["flagged"].items()) or "-"
        files.write_json(out / "results.json", rows)
        text = table(rows, COLUMNS)
        title = f"E8: attacks by {args.attackers} of {args.islands} islands"
        files.write_text(out / "table.md", f"# {title}\n\n{text}\n")
        print(f"\n{title}\n\n{text}")

    return run_script(body)


if __name__ == "__main__":
    raise SystemExit(main())
