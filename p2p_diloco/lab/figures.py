"""Run figures computed from the islands' own event logs (definitions: docs/DESIGN.md, "What we measure").

All times are wall-clock seconds. An island's *steps* are the intervals ``[t - dt, t]`` of its
``step`` events; *faults* are what a chaos run did and when (``{"t", "kind", "island", ...}``);
*down* and *frozen* intervals say when an island was not running or was stopped by SIGSTOP.
"""

from __future__ import annotations

import math

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence

Interval = tuple[float, float]


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Union of intervals, as sorted disjoint intervals."""
    merged: list[list[float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def length(intervals: Iterable[Interval]) -> float:
    """Total length of the union of intervals."""
    return sum(b - a for a, b in merge(intervals))


def clip(intervals: Iterable[Interval], start: float, end: float) -> list[Interval]:
    """The parts of the intervals inside [start, end]."""
    return [(max(a, start), min(b, end)) for a, b in intervals if b > start and a < end]


def subtract(base: Sequence[Interval], holes: Iterable[Interval]) -> list[Interval]:
    """``base`` minus ``holes`` (both unions)."""
    result = []
    holes = merge(holes)
    for a, b in merge(base):
        cursor = a
        for h0, h1 in holes:
            if h1 <= cursor or h0 >= b:
                continue
            if h0 > cursor:
                result.append((cursor, h0))
            cursor = max(cursor, h1)
        if cursor < b:
            result.append((cursor, b))
    return result


def step_intervals(events: Iterable[dict]) -> list[Interval]:
    """The inner-step intervals of one island's events."""
    return [(e["t"] - e["dt"], e["t"]) for e in events if e.get("event") == "step"]


def global_downtime(work: Mapping[str, Sequence[Interval]], alive: Mapping[str, Sequence[Interval]],
                    start: float, end: float, min_gap: float = 1.0) -> tuple[float, list[Interval]]:
    """Time in [start, end] during which no island was working (inside an inner step or a held-out
    evaluation) while at least one island was alive (up, frozen or not). Idle stretches shorter
    than ``min_gap`` seconds are the ordinary bookkeeping between two steps of a lone island and do
    not count. Returns (seconds, the idle intervals counted)."""
    anyone_alive = clip(merge(i for intervals in alive.values() for i in intervals), start, end)
    anyone_working = merge(i for intervals in work.values() for i in intervals)
    idle = [i for i in subtract(anyone_alive, anyone_working) if i[1] - i[0] >= min_gap]
    return length(idle), idle


def loading_intervals(steps: Sequence[Interval], alive: Sequence[Interval]) -> list[Interval]:
    """For each span an island's process ran, the stretch from its start to its first inner step
    (imports, data, DHT, downloading the global state): the "loading" state after a (re)start."""
    loading = []
    for a, b in sorted(alive):  # each life separately: a restart right after a kill is a new start
        first = min((s for s, _ in steps if s >= a - 1e-6), default=b)
        loading.append((a, min(first, b)))
    return loading


def eval_intervals(events: Iterable[dict]) -> list[Interval]:
    """The held-out evaluations of one island's events (they are normal work, not a stall)."""
    return [(e["t"] - e.get("dt", 0.0), e["t"]) for e in events if e.get("event") == "eval"]


def _gaps(steps: Sequence[Interval], evals: Sequence[Interval]) -> list[float]:
    """Time between consecutive steps, minus any evaluation inside it."""
    return [max(0.0, b[0] - a[1] - length(clip(evals, a[1], b[0]))) for a, b in zip(steps, steps[1:])]


def stall_after(steps: Sequence[Interval], at: float, window: float, baseline_gap: float,
                evals: Sequence[Interval] = ()) -> float:
    """Extra inner-loop time an island lost in [at, at + window]: the time between its steps there
    (evaluations excluded) beyond ``baseline_gap`` per step boundary (its usual non-step time)."""
    inside = [s for s in steps if at <= s[1] and s[0] <= at + window]
    return sum(max(0.0, gap - baseline_gap) for gap in _gaps(inside, evals))


def typical_gap(steps: Sequence[Interval], evals: Sequence[Interval] = ()) -> float:
    """A generous usual gap between two inner steps of one island (evaluations excluded): the 90th
    percentile, since round bookkeeping at step boundaries is part of normal operation."""
    gaps = sorted(_gaps(steps, evals))
    if not gaps:
        return 0.0
    return gaps[min(len(gaps) - 1, int(0.9 * len(gaps)))]


@dataclass
class RunFigures:
    """The figures of one run (what the chaos report holds)."""

    wall_seconds: float
    islands: int
    useful_seconds: float
    goodput: float  # useful inner-step time / (islands x wall time)
    alive_utilization: float  # useful inner-step time / time islands were up and not frozen
    global_downtime: float
    loading_seconds: float = 0.0  # time islands spent starting up (process start to first step)
    ready_utilization: float = 0.0  # useful inner-step time / time islands were up, not frozen, not loading
    downtime_intervals: list[Interval] = field(default_factory=list)
    stall_per_failure: list[dict] = field(default_factory=list)  # {fault, island, seconds}
    rejoin_seconds: list[dict] = field(default_factory=list)  # {island, restarted, first_round, seconds}

    def as_dict(self) -> dict:
        stalls = [s["seconds"] for s in self.stall_per_failure]
        return {
            "wall_seconds": round(self.wall_seconds, 3),
            "islands": self.islands,
            "useful_seconds": round(self.useful_seconds, 3),
            "goodput": round(self.goodput, 4),
            "alive_utilization": round(self.alive_utilization, 4),
            "loading_seconds": round(self.loading_seconds, 3),
            "ready_utilization": round(self.ready_utilization, 4),
            "global_downtime_seconds": round(self.global_downtime, 3),
            "downtime_intervals": [[round(a, 3), round(b, 3)] for a, b in self.downtime_intervals],
            "stall_per_failure": self.stall_per_failure,
            "stall_seconds_median": round(statistics.median(stalls), 3) if stalls else None,
            "stall_seconds_max": round(max(stalls), 3) if stalls else None,
            "rejoin": self.rejoin_seconds,
        }


def held_back(restart: dict, first: Optional[float], faults: Sequence[dict],
              events: Mapping[str, Sequence[dict]], window: float = 60.0) -> list[str]:
    """What kept a restarted island from contributing in the first ``window`` seconds (or until its
    first contributed round, ``first``) that was imposed on it rather than the system's doing:
    ``cut`` or ``freeze`` (a fault of the schedule on that island), ``probation`` (a strict majority
    of the islands that had trained before the restart held a flag on it then: its rounds are avoided
    by design, and a probation outlives a restart; docs/SECURITY.md)."""
    island, start = restart["island"], restart["t"]
    end = min(first if first is not None else math.inf, start + window)
    reasons = sorted({f["kind"] for f in faults if f.get("island") == island and f["kind"] in ("cut", "freeze")
                      and start < f["t"] < end})
    judges = holders = 0
    for name, evs in events.items():
        if name == island or not any(e.get("event") == "step" and e["t"] < start for e in evs):
            continue
        judges += 1
        held = []  # [from, to] of each of its flags on the island
        for e in evs:
            if e.get("culprit") != island:
                continue
            if e.get("event") == "flag":
                held.append([e["t"], e["t"] + e.get("seconds", 0.0)])
            elif e.get("event") == "unflag" and held and held[-1][1] > e["t"]:
                held[-1][1] = e["t"]
        holders += any(a < end and b > start for a, b in held)
    if judges and 2 * holders > judges:
        reasons.append("probation")
    return reasons


def run_figures(
    events: Mapping[str, Sequence[dict]],
    *,
    start: float,
    end: float,
    alive: Mapping[str, Sequence[Interval]],
    frozen: Mapping[str, Sequence[Interval]],
    faults: Sequence[dict] = (),
    stall_window: float = 10.0,
) -> RunFigures:
    """Goodput, alive utilization, global downtime, stall per failure and time to rejoin.

    :param events: island -> its events (all of its lives, concatenated)
    :param start, end: the measured span of the run
    :param alive: island -> intervals its process ran (killed time excluded, frozen time included)
    :param frozen: island -> intervals it was stopped by SIGSTOP
    :param faults: ``{"t", "kind", "island"}`` for each kill or freeze; ``{"t", "kind": "restart",
        "island"}`` for each restart (time to rejoin runs from it to the end of the all-reduce of the
        island's next contributed ok round; :func:`held_back` says what the schedule or a probation
        imposed on it meanwhile)
    :param stall_window: seconds after a fault in which the survivors' lost time is counted
    """
    # a step that straddles a SIGSTOP measured the frozen seconds too (its dt is wall time): not useful work
    steps = {name: [piece for step in clip(step_intervals(evs), start, end)
                    for piece in subtract([step], frozen.get(name, []))] for name, evs in events.items()}
    useful = sum(length(s) for s in steps.values())
    wall = end - start
    running = sum(length(subtract(clip(alive.get(n, []), start, end), frozen.get(n, []))) for n in events)
    loading = sum(length(subtract(clip(loading_intervals(step_intervals(events[n]), alive.get(n, [])), start, end),
                                  frozen.get(n, []))) for n in events)
    # an evaluation is scheduled work, not a stall (as in stall_after): two islands that happen to
    # evaluate at once while the third is frozen are not downtime
    work = {name: merge([*island_steps, *subtract(clip(eval_intervals(events[name]), start, end),
                                                  frozen.get(name, []))])
            for name, island_steps in steps.items()}
    downtime, idle = global_downtime(work, alive, start, end)
    stalls = []
    for fault in faults:
        if fault["kind"] not in ("kill", "freeze", "kill_bootstrap", "kill_donor", "corrupt", "cut", "throttle"):
            continue
        for name, island_steps in steps.items():
            if name == fault.get("island"):
                continue
            window_alive = clip(alive.get(name, []), fault["t"], fault["t"] + stall_window)
            if length(window_alive) < stall_window * 0.99 or clip(frozen.get(name, []), fault["t"],
                                                                 fault["t"] + stall_window):
                continue  # not a survivor for this whole window
            evals = eval_intervals(events[name])
            seconds = stall_after(island_steps, fault["t"], stall_window, typical_gap(island_steps, evals), evals)
            stalls.append({"fault": fault["kind"], "t": round(fault["t"], 3), "island": name,
                           "seconds": round(seconds, 3)})
    rejoins = []
    for fault in faults:
        if fault["kind"] != "restart" or fault.get("faulty"):
            continue  # a faulty island's rounds are rejected: it never "contributes again"
        # contributing = the others got our pseudo-gradient: the all-reduce's end (t_merged), not the
        # wait for the result's hash a member that missed the base does after it (t_end)
        rounds = [e for e in events.get(fault["island"], []) if e.get("event") == "round"
                  and e.get("outcome") == "ok" and e.get("contributed") and e["t_end"] > fault["t"]]
        first = min((e.get("t_merged", e["t_end"]) for e in rounds), default=None)

        def next_fault(kinds):
            return min((f["t"] for f in faults if f["kind"] in kinds and f.get("island") == fault["island"]
                        and fault["t"] < f["t"] < (first or math.inf)), default=None)

        entry = {"island": fault["island"], "restarted": round(fault["t"], 3)}
        # one that turned faulty before it contributed cannot contribute (its rounds are rejected); one
        # killed again before it contributed is not timed past that kill (its next life is timed from its
        # own restart), and how long it lived says whether it missed the 60 s target all the same (a
        # joiner killed by a kill_donor fault shows only as its next restart)
        turned = next_fault(("corrupt",))
        killed = None if turned is not None else next_fault(("kill", "kill_donor", "restart"))
        if turned is not None:
            entry["turned_faulty"] = round(turned, 3)
        elif killed is not None:
            entry |= {"killed_again": round(killed, 3), "lived_seconds": round(killed - fault["t"], 3)}
        timed = first is not None and turned is None and killed is None
        held = held_back(fault, first, faults, events)
        rejoins.append(entry | {"first_round": round(first, 3) if timed else None,
                                "seconds": round(first - fault["t"], 3) if timed else None}
                       | ({"held_back": held} if held else {}))
    islands = len(events)
    return RunFigures(
        wall_seconds=wall, islands=islands, useful_seconds=useful,
        goodput=useful / (islands * wall) if islands and wall > 0 else 0.0,
        alive_utilization=useful / running if running > 0 else 0.0,
        loading_seconds=loading,
        ready_utilization=useful / (running - loading) if running - loading > 0 else 0.0,
        global_downtime=downtime, downtime_intervals=idle, stall_per_failure=stalls, rejoin_seconds=rejoins,
    )


# what became of an island's newest checkpoint at a restart (see checkpoint_resumes)
CHECKPOINT_OUTCOMES = ("resumed_newest", "nothing_to_resume", "not_started", "resumed_older", "not_resumed")


def checkpoint_resumes(events: Mapping[str, Sequence[dict]], faults: Sequence[dict]) -> list[dict]:
    """For each restart of a run with checkpoints, whether it lost a checkpoint.

    A restart (a ``restart`` fault with its ``checkpoint_dir``) should resume from the newest
    checkpoint its island's earlier lives logged in that folder before the restart (``checkpoint``
    events); its life lasts until the island's next kill, donor kill or restart. Outcomes
    (:data:`CHECKPOINT_OUTCOMES`): ``resumed_newest`` (that one, or a newer file whose write finished
    but whose event the kill cut off: the names sort by time), ``nothing_to_resume`` (none was saved
    there, e.g. a kill_donor joiner's empty folder), ``not_started`` (killed again before its start),
    and the losses: ``resumed_older`` and ``not_resumed``.

    :returns: one ``{"island", "t", "expected", "resumed", "outcome"}`` per restart, in time order
        (``expected``/``resumed``: checkpoint file names, or None)
    """
    ends = {"kill", "kill_donor", "restart"}
    out = []
    for fault in sorted((f for f in faults if f["kind"] == "restart" and "checkpoint_dir" in f), key=lambda f: f["t"]):
        name, start, folder = fault["island"], fault["t"], Path(fault["checkpoint_dir"])
        end = min((f["t"] for f in faults if f.get("island") == name and f["kind"] in ends and f["t"] > start),
                  default=math.inf)
        life = [e for e in events.get(name, ()) if start <= e["t"] < end]
        saved = [Path(e["path"]).name for e in events.get(name, ())
                 if e.get("event") == "checkpoint" and e["t"] < start and Path(e["path"]).parent == folder]
        expected = max(saved, default=None)
        resumes = [Path(e["path"]).name for e in life if e.get("event") == "resume"]
        resumed = resumes[0] if resumes else None
        if not any(e.get("event") == "start" for e in life):
            outcome = "not_started"
        elif resumed is not None:
            outcome = "resumed_newest" if expected is None or resumed >= expected else "resumed_older"
        else:
            outcome = "nothing_to_resume" if expected is None else "not_resumed"
        out.append({"island": name, "t": start, "expected": expected, "resumed": resumed, "outcome": outcome})
    return out
