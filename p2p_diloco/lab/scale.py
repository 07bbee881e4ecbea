"""How a swarm behaves as it grows (docs/SCALE.md, "Many islands on one machine"; issue 18).

For each swarm size it starts a bootstrap node and N lightweight islands on 127.0.0.1
(:class:`p2p_diloco.lab.localswarm.LocalSwarm`): the product's island with the lab's synthetic
learner (``--debug-synthetic-step-s``, :class:`p2p_diloco.lab.faults.SyntheticLearner`), which skips
the forward and backward pass but sends pseudo-gradients of the real model's size through the real
syncer, DHT and averagers. Once every island has trained, it measures for ``--rounds`` outer periods:

- **rounds**: from the islands' ``round`` events whose slot lies in the window: outcomes, group
  sizes, group formation (``t_formed - slot_time``: from the slot to the all-reduce's start, i.e.
  matchmaking past the slot) and round time (``t_merged - slot_time``), the latter also as a share of
  the time between two slots of a fragment (T_outer / P);
- **agreement**: per slot, how many distinct new states (hashes) the islands' ok rounds produced (1:
  one group, every island on the same fragment version);
- **DHT records**: an observer's client-mode DHT (as ``p2p-diloco status`` joins) reads the run's
  progress records every 2 s: read latency (seconds) and how many islands' records it saw;
- **bootstrap node**: CPU (cores: CPU seconds of its process tree over the window) and memory
  (PSS of its tree, MiB);
- **memory**: the machine's used memory per island (MiB, over what was used before the swarm).

``--client-islands K`` makes the last K islands of each size client-mode members (``--client-mode
on``: a DHT node that stores and serves nothing, an averager that reduces no part), as islands
behind NAT take part.

Figures are medians with the 90th percentile (``p90``) and the extremes. Run from the repository
root (about 15 minutes on 2 cores for 4, 8, 16 and 32 islands)::

    .venv/bin/python scripts/bench/swarm_scale.py --islands 4 8 16 32 --rounds 10 --out runs/bench/scale

It prints a Markdown table and writes ``results.json`` and ``table.md`` under ``--out``. Exit codes:
0; 1 when a swarm did not start (one ``error:`` line); 2 for bad flags; 130 on Ctrl+C or SIGTERM
(every process started is ended by PID: :meth:`LocalSwarm.close`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Optional, Sequence

from p2p_diloco import files
from p2p_diloco.island.events import read_events
from p2p_diloco.lab.localswarm import LocalSwarm
from p2p_diloco.procs import StopSignal, descendants


# fewer malloc arenas for the islands' threads, a tighter heap for p2pd (Go), the collector's objects
# frozen before each fork (p2p_diloco.procs): about 210 MiB less per island (docs/SCALE.md, "Memory
# per island")
LEAN = {"MALLOC_ARENA_MAX": "2", "GOGC": "25", "P2P_DILOCO_GC_FREEZE": "1"}


GRACE_S = 1.0  # the islands' --outer-grace-window, seconds


class ScaleError(Exception):
    """A swarm that could not be measured (it did not start in time)."""


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--islands", type=int, nargs="+", default=[4, 8, 16, 32], metavar="N",
                        help="swarm sizes, measured one after the other")
    parser.add_argument("--rounds", type=int, default=10, metavar="R", help="outer periods measured per size")
    parser.add_argument("--period", type=float, default=20.0, metavar="S", help="T_outer, seconds")
    parser.add_argument("--fragments", type=int, default=1, metavar="P")
    parser.add_argument("--groups", type=int, default=1, metavar="G",
                        help="the islands' --outer-groups: G groups take turns on each fragment's slots")
    parser.add_argument("--step-s", type=float, default=1.0, metavar="S", help="a synthetic inner step, seconds")
    parser.add_argument("--matchmaking-time", type=float, default=3.0, metavar="S",
                        help="the islands' --outer-matchmaking-time")
    parser.add_argument("--progress-period", type=float, default=5.0, metavar="S",
                        help="the islands' --progress-period (their records' TTL: 4 times as long)")
    parser.add_argument("--preset", default="tiny", help="the model whose size the pseudo-gradients have")
    parser.add_argument("--hidden-size", type=int, default=0, metavar="D",
                        help="override the preset's hidden size (with --layers: a micro model, e.g. 16 and 1, "
                        "34k parameters: the swarm's mechanics without the bandwidth of its rounds)")
    parser.add_argument("--layers", type=int, default=0, metavar="L", help="override the preset's layers")
    parser.add_argument("--client-islands", type=int, default=0, metavar="K",
                        help="the last K islands of each size take part as client-mode members (--client-mode on: "
                             "their DHT nodes store and serve nothing, they reduce no part), as islands behind NAT do")
    parser.add_argument("--dht-wait-timeout", type=float, default=3.0, metavar="S",
                        help="the islands' --dht-wait-timeout (hivemind's default: 3 s)")
    parser.add_argument("--start-timeout", type=float, default=600.0, metavar="S",
                        help="seconds every island of a swarm may take to train")
    parser.add_argument("--out", default="", metavar="DIR", help="default runs/bench/scale-<time>")
    args = parser.parse_args(argv)
    if min(args.islands) < 2 or args.rounds < 1 or args.period <= 0 or min(args.fragments, args.groups) < 1 \
            or args.step_s <= 0:
        parser.error("--islands needs 2 or more, --rounds, --fragments and --groups 1 or more, --period and --step-s > 0")
    if not 0 <= args.client_islands < min(args.islands):
        parser.error(f"--client-islands must leave a full member in every size (0 to {min(args.islands) - 1}): "
                     "client-mode members reduce no part")
    if allreduce_timeout(args) <= 0:
        parser.error(f"--period / (--fragments x --groups) must exceed --matchmaking-time + {GRACE_S + 0.5:g} s "
                     "(the grace window and an all-reduce)")
    return args


def allreduce_timeout(args: argparse.Namespace) -> float:
    """The islands' --outer-allreduce-timeout (seconds): up to 10 s, and what is left of the time
    between two slots (T_outer / (P G)) after matchmaking, the grace window and 0.5 s."""
    return min(10.0, args.period / (args.fragments * args.groups) - args.matchmaking_time - GRACE_S - 0.5)


def island_flags(args: argparse.Namespace) -> list[str]:
    """The lightweight islands' flags: synthetic steps, one torch thread, no evaluation to speak of."""
    return ["--preset", args.preset, "--device", "cpu", "--threads", "1", "--outer-fragments", str(args.fragments),
            "--outer-groups", str(args.groups),
            "--outer-period", str(args.period), "--outer-matchmaking-time", str(args.matchmaking_time),
            "--outer-grace-window", str(GRACE_S), "--outer-allreduce-timeout", str(allreduce_timeout(args)),
            "--outer-request-timeout", str(min(1.0, args.matchmaking_time / 3)),
            "--progress-period", str(args.progress_period), "--progress-ttl", str(4 * args.progress_period),
            "--eval-every", "100000", "--dht-wait-timeout", str(args.dht_wait_timeout), "--join-timeout", str(args.start_timeout),
            "--debug-synthetic-step-s", str(args.step_s), *micro_flags(args.hidden_size, args.layers)]


def micro_flags(hidden_size: int = 0, layers: int = 0) -> list[str]:
    """Flags that shrink the preset's model (0: as it is): heads of 8 dimensions, an MLP twice as wide."""
    flags = []
    if hidden_size:
        flags += ["--model-hidden-size", str(hidden_size), "--model-num-heads", str(max(1, hidden_size // 8)),
                  "--model-intermediate-size", str(2 * hidden_size)]
    if layers:
        flags += ["--model-num-layers", str(layers)]
    return flags


def _summary(values: Sequence[float]) -> dict:
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    return {"n": len(values), "median": round(statistics.median(ordered), 3),
            "p90": round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 3),
            "min": round(ordered[0], 3), "max": round(ordered[-1], 3)}


def _tree(pid: int) -> list:
    import psutil

    processes = []
    for p in [pid, *descendants(pid)]:
        try:
            processes.append(psutil.Process(p))
        except psutil.Error:
            pass
    return processes


def _cpu_seconds(processes) -> float:
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
            total += times.user + times.system
        except Exception:
            pass
    return total


def _pss_mib(processes) -> float:
    total = 0
    for process in processes:
        try:
            total += process.memory_full_info().pss
        except Exception:
            pass
    return total / 2**20


def _trained(swarm: LocalSwarm, names: Sequence[str]) -> bool:
    return all(swarm.events_path(name).exists()
               and any(e.get("event") == "step" for e in read_events(swarm.events_path(name))) for name in names)


def round_figures(events: dict[str, list[dict]], start: float, end: float, period: float, fragments: int) -> dict:
    """The rounds of ``events`` (island -> its events) whose slot lies in [start, end): outcomes, group
    sizes, formation and round times (seconds), the round time's share of the time between two slots
    (``period / fragments``: T_outer / (P G) with G groups taking turns), and per slot the number of
    distinct new states of its ok rounds."""
    outcomes, sizes, formed, took, hashes = defaultdict(int), [], [], [], defaultdict(set)
    for evs in events.values():
        for e in evs:
            if e.get("event") != "round" or not start <= e.get("slot_time", -1) < end:
                continue
            outcomes[e["outcome"]] += 1
            if e["outcome"] != "ok":
                continue
            sizes.append(e.get("group_size", 0))
            if "t_formed" in e:
                formed.append(e["t_formed"] - e["slot_time"])
            took.append(e["t_merged"] - e["slot_time"])
            hashes[(e["fragment"], e["slot"])].add(e.get("new_hash"))
    between = period / fragments
    return {"outcomes": dict(outcomes), "group_size": _summary(sizes), "formation_s": _summary(formed),
            "round_s": _summary(took), "round_share": _summary([t / between for t in took]),
            "states_per_slot": _summary([len(h) for h in hashes.values()]), "slots": len(hashes)}


def measure(n: int, args: argparse.Namespace, out: Path, stop: StopSignal) -> dict:
    """One swarm of ``n`` islands: start it, wait until all train, measure ``args.rounds`` periods.

    :raises ScaleError: an island exited or not all trained within ``--start-timeout``
    """
    import psutil

    from p2p_diloco.config import StatusConfig
    from p2p_diloco.observe.status import check_initial_peers, join_as_observer

    swarm = LocalSwarm(out / f"n{n}", run_id=f"scale-{n}", env=LEAN)
    names = [f"island-{i}" for i in range(n)]
    used_before = psutil.virtual_memory().used
    dht = None
    try:
        swarm.start_bootstrap()
        launched = time.time()
        for i, name in enumerate(names):
            client = ["--client-mode", "on"] if i >= n - args.client_islands else []
            swarm.start_island(name, *island_flags(args), *client)
        deadline = time.monotonic() + args.start_timeout
        while not _trained(swarm, names):
            dead = [name for name in names if not swarm.islands[name].alive()]
            if dead or time.monotonic() > deadline or stop.event.is_set():
                raise ScaleError(f"{n} islands: {', '.join(dead) or 'not all'} did not start training "
                                 f"(logs under {swarm.workdir})")
            stop.event.wait(2.0)
        ready = time.time() - launched
        config = StatusConfig(initial_peers=swarm.initial_peers, run_id=swarm.run_id, join_timeout=60)
        dht, board = join_as_observer(config, check_initial_peers(config), stop)
        stop.event.wait(args.period)  # the first rounds of late starters
        bootstrap = _tree(swarm.bootstrap.pid)
        cpu_before, start = _cpu_seconds(bootstrap), time.time()
        reads, seen, pss, used = [], [], [], []
        while time.time() < start + args.rounds * args.period and not stop.event.is_set():
            began = time.perf_counter()
            records = board.try_read()
            if records is not None:
                reads.append(time.perf_counter() - began)
                seen.append(len(records))
            pss.append(_pss_mib(bootstrap))
            used.append((psutil.virtual_memory().used - used_before) / 2**20 / n)
            stop.event.wait(2.0)
        end = time.time()
        cpu = (_cpu_seconds(bootstrap) - cpu_before) / (end - start)
        # the rounds of the window's last slot end before the next slot (their all-reduce timeout fits
        # the slot spacing, T_outer / (P x G)): closing the swarm before then would cancel them
        stop.event.wait(args.period / (args.fragments * args.groups))
    finally:
        if dht is not None:
            dht.shutdown()
        leftovers = swarm.close()
    events = {name: read_events(swarm.events_path(name)) for name in names}
    return {"islands": n, "seconds_to_train": round(ready, 1), "window_s": round(end - start, 1), "window": [start, end],
            **round_figures(events, start, end, args.period, args.fragments * args.groups),
            "dht_read_s": _summary(reads), "records_seen": _summary(seen),
            "bootstrap_cpu_cores": round(cpu, 3), "bootstrap_pss_mib": _summary(pss),
            "memory_per_island_mib": _summary(used), "leftover_processes": leftovers}


def markdown_table(rows: Sequence[dict]) -> str:
    def cell(summary: dict, digits: int = 2) -> str:
        if not summary.get("n"):
            return "-"
        return f"{summary['median']:.{digits}f} ({summary['p90']:.{digits}f})"

    lines = ["| islands | start to all training (s) | ok / other rounds | group size | formation (s) | round (s) "
             "| round / (T_outer / P) | states per slot | DHT read (s) | records seen | bootstrap CPU (cores) "
             "| bootstrap PSS (MiB) | memory per island (MiB) |", "|" + "---|" * 13]
    for row in rows:
        ok = row["outcomes"].get("ok", 0)
        other = sum(row["outcomes"].values()) - ok
        lines.append(f"| {row['islands']} | {row['seconds_to_train']:.0f} | {ok} / {other} | "
                     f"{cell(row['group_size'], 0)} | {cell(row['formation_s'])} | {cell(row['round_s'])} | "
                     f"{cell(row['round_share'])} | {cell(row['states_per_slot'], 0)} | {cell(row['dht_read_s'], 3)} | "
                     f"{cell(row['records_seen'], 0)} | {row['bootstrap_cpu_cores']:.3f} | "
                     f"{cell(row['bootstrap_pss_mib'], 0)} | {cell(row['memory_per_island_mib'], 0)} |")
    return "\n".join(lines) + "\n\nmedian (90th percentile) over the measured rounds or samples"


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    out = Path(args.out or f"runs/bench/scale-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    stop = StopSignal()
    stop.install()
    rows = []
    try:
        for n in args.islands:
            print(f"measuring {n} islands ...", file=sys.stderr, flush=True)
            rows.append(measure(n, args, out, stop))
            if stop.event.is_set():
                return 130
    except ScaleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    table = markdown_table(rows)
    print(table)
    files.write_json(out / "results.json", {"args": vars(args), "rows": rows})
    (out / "table.md").write_text(table + "\n")
    return 0 if not stop.event.is_set() else 130
