#!/usr/bin/env python3
"""Write a long chaos schedule of many faults of every kind, and its fault-free baseline.

The faults are drawn with a seed and placed so that the swarm can survive them by design, as a
real swarm's operators would hope theirs does: at most 2 islands down (killed and restarting,
frozen) at once, at most 1 island faulty (NaN, Inf or an attack within the bounds: the defaults
bound one attacker per group, docs/SECURITY.md), no fault on an island that is restarting, and the
last ``--quiet`` seconds without new faults so that the final evaluations compare trained models.

    .venv/bin/python scripts/make_chaos_schedule.py --faults 100 --minutes 30 --islands 5 \\
        --out docs/chaos/hundred.toml      # and docs/chaos/hundred_baseline.toml
    .venv/bin/python scripts/make_chaos_schedule.py --slowdown 2 --out docs/chaos/hundred_paced.toml
    .venv/bin/python scripts/make_chaos_schedule.py --slowdown 2 --checkpoint-every 60 \\
        --out docs/chaos/hundred_checkpoints.toml
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2p_diloco.lab.chaos import load_schedule  # noqa: E402

# kind -> share of the faults; the single bootstrap death is added on top of the draw
MIX = {"kill": 0.14, "kill_donor": 0.05, "freeze": 0.18, "cut": 0.16, "throttle": 0.16, "corrupt": 0.31}
# what island i sends while faulty (an island sends one kind: its flags are set at start); every
# attack of docs/SECURITY.md that can be switched on and off (not the lying reducer)
CORRUPTIONS = ["flip+inflate", "noise", "nan", "bias", "replay", "huge", "flip", "inflate"]
RESTART_COST = 45.0  # seconds an island is down after its restart begins (start-up, join) on 2 shared cores


def draw(faults: int, seconds: float, islands: int, quiet: float, seed: int) -> list[dict]:
    """The faults, in time order (see the module docstring for the rules). Each slot takes the first
    kind of the shuffled mix that the rules allow then; a kind that no rule allows waits for a later
    slot, and a slot that none fits gets a short throttle."""
    rng = random.Random(seed)
    names = [f"island-{i}" for i in range(islands)]
    pending = [kind for kind, share in MIX.items() for _ in range(round(share * (faults - 1)))]
    pending = (pending + ["freeze"] * faults)[:faults - 1]
    rng.shuffle(pending)
    down_until = {n: 0.0 for n in names}  # killed, restarting or frozen
    linked_until = {n: 0.0 for n in names}  # cut or throttled
    faulty_until = 0.0  # one faulty island at a time
    first, last = 20.0, seconds - quiet
    step = (last - first) / faults

    def place(kind: str, t: float):
        nonlocal faulty_until
        up = [n for n in names if down_until[n] <= t]
        down = len(names) - len(up)
        if kind in ("kill", "freeze") and down < 2:
            island = rng.choice(up)
            if kind == "kill":
                restart = float(rng.choice([5, 10, 15, 20]))
                down_until[island] = t + restart + RESTART_COST
                return {"island": island, "restart_after": restart}
            duration = float(rng.randint(5, 20))
            down_until[island] = t + duration
            return {"island": island, "duration": duration}
        if kind == "kill_donor" and down == 0:
            island = rng.choice(names)
            for n in names:  # the joiner restarts, whichever island serves it is killed: nothing else meanwhile
                down_until[n] = t + 30.0
            down_until[island] = t + RESTART_COST
            return {"island": island, "restart_after": 10.0}
        free = [n for n in up if linked_until[n] <= t]
        if kind in ("cut", "throttle") and free:
            island = rng.choice(free)
            duration = float(rng.randint(10, 25))
            linked_until[island] = t + duration
            return {"island": island, "duration": duration,
                    **({"rate": rng.choice(["2mbit", "5mbit", "10mbit", "20mbit"])} if kind == "throttle" else {})}
        if kind == "corrupt" and faulty_until <= t and up:
            island = rng.choice(up)
            duration = float(rng.randint(30, 60))
            faulty_until = t + duration + 5.0
            return {"island": island, "value": CORRUPTIONS[names.index(island) % len(CORRUPTIONS)],
                    "duration": duration}
        return None

    out = []
    for slot in range(faults):
        t = first + slot * step
        if slot == faults // 3:
            out.append({"at": round(t, 1), "kind": "kill_bootstrap"})
            continue
        for i, kind in enumerate(pending):
            fault = place(kind, t)
            if fault is not None:
                pending.pop(i)
                break
        else:
            kind = "throttle"
            island = rng.choice([n for n in names if linked_until[n] <= t] or names)
            fault = {"island": island, "duration": 10.0, "rate": "10mbit"}
            linked_until[island] = t + 10.0
        out.append({"at": round(t, 1), "kind": kind, **fault})
    return out


def write(path: Path, islands: int, minutes: float, period: float, faults: list[dict], command: str,
          slowdown: float = 1.0, checkpoint_every: float = 0.0) -> None:
    paced = f', "--slowdown", "{slowdown:g}"' if slowdown > 1.0 else ""
    head = [f"# Written by {command}", f"# {len(faults)} faults" if faults else "# the fault-free baseline",
            f"islands = {islands}", f"minutes = {minutes:g}", f"period = {period:g}", 'network = "netns"',
            *([f"checkpoint_every = {checkpoint_every:g}"] if checkpoint_every else []),
            f'island_args = ["--eval-every", "60", "--eval-batches", "4"{paced}]', ""]
    body = []
    for fault in faults:
        body.append("[[faults]]")
        body += [f"{key} = {value!r}".replace("'", '"') for key, value in fault.items()]
        body.append("")
    path.write_text("\n".join(head + body))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", type=int, default=100)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--islands", type=int, default=5)
    parser.add_argument("--period", type=float, default=20.0, help="T_outer in seconds")
    parser.add_argument("--quiet", type=float, default=120.0, help="seconds at the end without new faults")
    parser.add_argument("--seed", type=int, default=16)
    parser.add_argument("--slowdown", type=float, default=1.0,
                        help="every island on a device this many times slower (the lab's --slowdown), in both "
                             "schedules: islands of a real swarm have machines of their own, and on a few shared "
                             "cores islands computing flat out starve each restart's start-up; the faults drawn "
                             "are the same")
    parser.add_argument("--checkpoint-every", type=float, default=0.0,
                        help="seconds between each island's checkpoints, in both schedules (0: none); a killed "
                             "island resumes from its newest, a kill_donor joiner starts on an empty disk")
    parser.add_argument("--out", required=True, help="the schedule; its baseline goes next to it (_baseline)")
    args = parser.parse_args(argv)
    if args.islands < 3 or args.faults < 10 or args.minutes * 60 <= args.quiet + 60:
        parser.error("need 3 or more islands, 10 or more faults and a run longer than --quiet + 60 s")
    if args.slowdown < 1.0:
        parser.error("--slowdown must be 1 or more")
    if args.checkpoint_every < 0.0:
        parser.error("--checkpoint-every must be 0 (none) or more")
    faults = draw(args.faults, args.minutes * 60, args.islands, args.quiet, args.seed)
    out = Path(args.out)
    command = "scripts/make_chaos_schedule.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write(out, args.islands, args.minutes, args.period, faults, command, args.slowdown, args.checkpoint_every)
    baseline = out.with_name(out.stem + "_baseline" + out.suffix)
    write(baseline, args.islands, args.minutes, args.period, [], command, args.slowdown, args.checkpoint_every)
    load_schedule(str(out))
    load_schedule(str(baseline))  # both valid
    kinds = sorted({f["kind"] for f in faults})
    print(f"{out}: {len(faults)} faults ({', '.join(kinds)}); {baseline}: none")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
