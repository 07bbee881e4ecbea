#!/usr/bin/env python3
"""Memory across failed rounds: does an island's RSS grow when its rounds keep failing?

Runs one island with no peers and a quorum of 2 (so every round waits out its grace window, fails and
falls back), with a short outer period, and samples the resident memory of its main process and of
each hivemind helper process (DHT, averagers) once per failed round. Prints a table and writes a JSON
report. Usage (about 2.5 minutes; one failed round per second, alternating between 2 fragments):

    .venv/bin/python scripts/bench_rss.py --rounds 100 --out runs/bench-rss
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from p2p_diloco.island.events import read_events
from p2p_diloco.lab.localswarm import LocalSwarm
from p2p_diloco.procs import descendants
from p2p_diloco import files


def rss_kib(pid: int) -> int:
    """Resident set size of one process, KiB (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=60, help="failed rounds to observe after the warm-up")
    parser.add_argument("--warmup", type=int, default=10, help="failed rounds before the first measurement")
    parser.add_argument("--out", default="runs/bench-rss")
    args = parser.parse_args(argv)
    out = Path(args.out)
    for old in ("lone.events.jsonl", "lone.summary.json", "lone.log", "rss_report.json"):  # a previous run's
        (out / old).unlink(missing_ok=True)
    swarm = LocalSwarm(out, run_id="rss")
    samples = []
    try:
        island = swarm.start_island(
            "lone", "--preset", "tiny", "--device", "cpu", "--threads", "1", "--outer-period", "2",
            "--outer-matchmaking-time", "0.4", "--outer-grace-window", "0.1", "--outer-allreduce-timeout", "0.4",
            "--outer-request-timeout", "0.1", "--outer-quorum", "2", "--eval-every", "1000",
            initial_peers=[],
        )
        target = args.warmup + args.rounds
        seen = 0
        while seen < target:
            if not island.alive():
                print("the island exited early; see", island.log_path, file=sys.stderr)
                return 1
            time.sleep(1.0)
            path = swarm.events_path("lone")
            failed = [e for e in read_events(str(path)) if e.get("event") == "round"
                      and e.get("outcome") == "fallback"] if path.exists() else []
            if len(failed) > seen:
                seen = len(failed)
                tree = [island.pid, *descendants(island.pid)]
                samples.append({"failed_rounds": seen, "t": time.time(),
                                "rss_kib": {str(pid): rss_kib(pid) for pid in tree}})
    finally:
        swarm.close()
    measured = [s for s in samples if s["failed_rounds"] >= args.warmup]
    start, end = measured[0], measured[-1]
    window = max(1, min(10, len(measured) // 4))  # medians of the first and last samples: RSS is noisy
    rows = []
    for pid in end["rss_kib"]:  # every process alive at the end (helpers start after the main process)
        having = [s for s in measured if pid in s["rss_kib"]]
        before = statistics.median(s["rss_kib"][pid] for s in having[:window])
        after = statistics.median(s["rss_kib"][pid] for s in having[-window:])
        role = "main" if int(pid) == island.pid else "helper"
        rows.append({"pid": int(pid), "role": role, "rss_mib_before": round(before / 1024, 1),
                     "rss_mib_after": round(after / 1024, 1), "growth_mib": round((after - before) / 1024, 2),
                     "rss_mib_max": round(max(s["rss_kib"][pid] for s in having) / 1024, 1)})
    total_growth = sum(r["growth_mib"] for r in rows)
    report = {"failed_rounds": [start["failed_rounds"], end["failed_rounds"]], "processes": rows,
              "total_growth_mib": round(total_growth, 2),
              "growth_kib_per_failed_round": round(total_growth * 1024 / max(1, end["failed_rounds"] - start["failed_rounds"]), 2),
              "samples": samples}
    out.mkdir(parents=True, exist_ok=True)
    files.write_json(out / "rss_report.json", report)
    print(f"RSS from failed round {start['failed_rounds']} to {end['failed_rounds']} "
          f"(medians of the first and last {window} samples):")
    for r in rows:
        print(f"  {r['role']:6s} pid {r['pid']:>7d}: {r['rss_mib_before']:8.1f} -> {r['rss_mib_after']:8.1f} MiB "
              f"({r['growth_mib']:+.2f}; max {r['rss_mib_max']:.1f})")
    print(f"total {total_growth:+.2f} MiB, {report['growth_kib_per_failed_round']:+.1f} KiB per failed round; "
          f"report in {out}/rss_report.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
