#!/usr/bin/env python3
"""Do rogue peers cost a private run its rounds? One private swarm on this machine (a bootstrap node and
3 admitted islands) measured in alternating windows of the same length: without rogues, then with
rogue peers (no certificate, a forged, an expired, a stolen and a revoked one; :mod:`p2p_diloco.lab.rogues`)
knocking on every door (the DHT and each island's averagers) for the whole window, and so on. Counts each
island's ok rounds per arm (rounds that started in the arm's windows), and the rogues' attempts and
breaches. The rogues run on this machine too, so their CPU counts against the islands. Usage (about
2 x --pairs x --window minutes, plus 2 minutes):

    .venv/bin/python scripts/bench_admission.py --pairs 2 --window 2 --out runs/bench-admission
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from p2p_diloco import files
from p2p_diloco.island.events import read_events
from p2p_diloco.lab.localswarm import LocalSwarm
from p2p_diloco.lab.rogues import PrivateRun, targets_of

ISLANDS = ["island-0", "island-1", "island-2"]
FRAGMENTS = 2
FLAGS = ["--preset", "tiny", "--device", "cpu", "--threads", "1", "--outer-period", "8",
         "--outer-fragments", str(FRAGMENTS), "--outer-matchmaking-time", "1.5", "--outer-grace-window", "0.5",
         "--outer-allreduce-timeout", "1.5", "--outer-request-timeout", "0.5", "--progress-period", "1",
         "--eval-every", "50", "--eval-batches", "2", "--inner-warmup-steps", "10"]


def rounds(swarm: LocalSwarm, name: str) -> list[dict]:
    path = swarm.events_path(name)
    return [e for e in read_events(str(path)) if e.get("event") == "round"] if path.exists() else []


def wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(1.0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=2, help="pairs of windows (without, then with rogues)")
    parser.add_argument("--window", type=float, default=2.0, help="minutes per window")
    parser.add_argument("--out", default="runs/bench-admission")
    args = parser.parse_args(argv)
    out = Path(args.out)
    swarm = LocalSwarm(out / "swarm", run_id="bench_admission")
    run = PrivateRun(out / "keys", swarm.run_id)
    windows: dict[str, list[tuple[float, float]]] = {"clean": [], "rogues": []}
    reports = []
    try:
        swarm.start_bootstrap(*run.flags("boot", "bootstrap"), "--revocations", str(run.revocations_path))
        for name in ISLANDS:
            swarm.start_island(name, *FLAGS, *run.flags(name))
        wait(lambda: any(len(e.get("members", [])) == 3 for e in rounds(swarm, "island-0")), 240,
             "a round of all three islands")
        rogues = run.arm_rogues(victim="island-0")
        targets = [t for name in ISLANDS for t in targets_of(
            next(e for e in read_events(str(swarm.events_path(name))) if e.get("event") == "start"),
            swarm.run_id, FRAGMENTS)]
        time.sleep(20)  # the revocation list with the "revoked" rogue reaches every island
        for pair in range(args.pairs):
            for arm in ("clean", "rogues"):
                report = out / f"rogues-{pair}.json"
                attack = swarm.start_process(
                    f"rogues-{pair}", "p2p_diloco.lab.rogues", "--dir", str(rogues), "--initial-peers",
                    *swarm.initial_peers, "--target", *targets, "--attacks", "1000000", "--pause", "0.5",
                    "--out", str(report)) if arm == "rogues" else None
                start = time.time()
                print(f"{time.strftime('%H:%M:%S')} window {pair + 1}/{args.pairs}: {arm}", flush=True)
                time.sleep(args.window * 60)
                windows[arm].append((start, time.time()))
                if attack is not None:
                    attack.stop(30)
                    reports.append(json.loads(report.read_text()))
    finally:
        swarm.close()
    figures = {}
    for arm, spans in windows.items():
        figures[arm] = {}
        for name in ISLANDS:
            rs = [e for e in rounds(swarm, name) if any(a <= e["t_start"] < b for a, b in spans)]
            figures[arm][name] = {"ok": sum(e["outcome"] == "ok" for e in rs), "rounds": len(rs),
                                  "strangers": sorted({m for e in rs for m in e.get("members", [])} - set(ISLANDS))}
    ratios = [figures["rogues"][n]["ok"] / max(1, figures["clean"][n]["ok"]) for n in ISLANDS]
    rogue_totals = {k: sum(r[k] for r in reports) for k in ("attempts", "refused", "breaches", "seconds")}
    result = {"windows": windows, "figures": figures, "ok_ratio_median": statistics.median(ratios),
              "ok_ratios": ratios, "rogues": rogue_totals, "rogue_errors": [e for r in reports for e in r["errors"]][:20]}
    files.write_json(out / "admission_report.json", result)
    print(f"{'island':10} {'without rogues: ok/rounds':>26} {'with rogues: ok/rounds':>24}")
    for name in ISLANDS:
        c, r = figures["clean"][name], figures["rogues"][name]
        print(f"{name:10} {c['ok']:>19}/{c['rounds']:<6} {r['ok']:>17}/{r['rounds']:<6}")
    strangers = sorted({s for arm in figures.values() for f in arm.values() for s in f["strangers"]})
    print(f"ok rounds with rogues / without: median {result['ok_ratio_median']:.2f} "
          f"({', '.join(f'{x:.2f}' for x in ratios)}); rogues: {rogue_totals['attempts']} attempts in "
          f"{rogue_totals['seconds']:.0f} s, {rogue_totals['refused']} refused, {rogue_totals['breaches']} breaches; "
          f"strangers in rounds: {strangers or 'none'}")
    errors = result["rogue_errors"]
    if errors:  # an attempt that was neither refused nor a breach (a hang, an unreachable island): look
        print(f"{len(errors)} attempt(s) ended otherwise, e.g. {errors[0]}")
    return 0 if rogue_totals["breaches"] == 0 and not strangers and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
