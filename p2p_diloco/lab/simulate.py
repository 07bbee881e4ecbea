"""A discrete-event simulator of a training job under hardware failures (docs/SCALE.md): the
goodput of data-parallel training, of elastic data-parallel training and of M independent learners
(Decoupled DiLoCo, arXiv 2604.21428, Sec. 5: "chaos engineering" at millions of simulated chips).

The model, every part of it an assumption the paper leaves open (docs/SCALE.md states the fitted
values):

- ``chips`` chips form slices of ``slice_chips``; a chip fails after an exponential time of mean
  ``chip_mtbi_s`` and takes its slice down for ``repair_s`` seconds (repaired or swapped for a spare).
  A failure of a slice that is down already changes nothing.
- **data-parallel** (``dp``): one rigid job of every slice. Any failure stops everyone; the job
  runs again ``restart_s`` after its last failed slice is back, and loses the work since its last
  completed checkpoint (one after every ``checkpoint_s`` seconds of training, each pausing the job
  ``checkpoint_save_s``; 0: none lost, as with recovery from replicas). :func:`young_interval`
  gives the interval that loses least (Young 1974). A failure during the restart is taken in by it
  (``restart_absorbs``: the restart ends once that slice is back too) or starts it over.
- **elastic data-parallel** (``elastic``): one job that drops a failed slice and takes a repaired
  one back, each change pausing everyone for ``resize_s`` (changes during a pause are applied by
  it); between pauses it trains on the slices that are up. A repaired slice waits up to
  ``rejoin_wait_s`` for the next pause (a failure's) before it pauses the job for itself (0: at
  once); a job with no slice up takes it at once.
- **time steps** (``tick_s``; 0: continuous time): every event takes effect at the end of the step
  of ``tick_s`` seconds in which it falls, the step's failures before its other events, as in a
  simulation that advances a training step at a time. So the failures of one step cost one restart
  or one pause, a failure in a restart's or a pause's last step is taken in by it, and every
  duration is rounded up to whole steps.
- **M learners** (``learners``): the slices split into M learners, each an elastic job of its own
  (``learner_mode="elastic"``) or a rigid one that restarts like data-parallel (``"rigid"``). A
  learner's failure costs only its own slices: no learner ever waits for another, and the outer
  rounds run on the product's round clock (:class:`p2p_diloco.algo.schedule.RoundClock`): a round
  at its slot is ``ok`` with at least ``quorum`` training learners, and never fewer than 2, as the
  islands' (below it, those training at the end of the grace window count too), else each learner
  steps on its own update (``fallback``). Rounds never cost goodput: no learner waits for one.

:func:`predict_chaos` sets the learners arm up like one of our chaos runs (docs/CHAOS.md): its
islands, the outages its schedule forces, its round clock.

Goodput is useful chip-seconds over chips x wall time (docs/DESIGN.md, "Metrics"); stragglers cost
each job the ratio of the mean step to the expected slowest of its slices' steps (independent
normal step times of ``step_sd_s``). Uptime is the share of wall time in which some chip trains.
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from dataclasses import dataclass, field
from typing import Callable, Literal, Optional, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from p2p_diloco.algo.schedule import RoundClock
from p2p_diloco.lab.figures import length

YEAR_S = 365.0 * 24 * 3600


class SimConfig(BaseModel):
    """One simulated job (seconds throughout)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    chips: int = Field(gt=0)
    arm: Literal["dp", "elastic", "learners"]
    learners: int = Field(default=1, ge=1, description="M, for the learners arm")
    learner_mode: Literal["elastic", "rigid"] = "elastic"
    slice_chips: int = Field(default=256, gt=0)
    chip_mtbi_s: float = Field(default=YEAR_S, gt=0)
    repair_s: float = Field(default=3600.0, ge=0)
    restart_s: float = Field(default=600.0, ge=0)
    resize_s: float = Field(default=60.0, ge=0)
    checkpoint_s: float = Field(default=0.0, ge=0)
    checkpoint_save_s: float = Field(default=0.0, ge=0)
    rejoin_wait_s: float = Field(default=0.0, ge=0)
    restart_absorbs: bool = True
    tick_s: float = Field(default=0.0, ge=0, description="time steps; 0: continuous time")
    step_s: float = Field(default=1.0, gt=0)
    step_sd_s: float = Field(default=0.0, ge=0)
    outer_period_s: float = Field(default=600.0, gt=0)
    fragments: int = Field(default=1, ge=1)
    quorum: int = Field(default=2, ge=1, description="K; a round needs at least 2 members in any case")
    grace_s: float = Field(default=0.0, ge=0)
    hours: float = Field(default=24.0 * 7, gt=0)
    seed: int = 0

    @model_validator(mode="after")
    def _fits(self) -> "SimConfig":
        if self.chips % self.slice_chips:
            raise ValueError(f"chips ({self.chips}) must be a multiple of slice_chips ({self.slice_chips})")
        slices = self.chips // self.slice_chips
        if self.arm == "learners" and slices % self.learners:
            raise ValueError(f"{slices} slices do not split evenly into {self.learners} learners")
        return self


@dataclass
class SimResult:
    """What one simulation measured."""

    goodput: float  # useful chip-seconds / (chips x wall seconds)
    uptime: float  # share of wall time in which some chip trained
    failures: int  # slice failures (of slices that were up)
    rounds_ok: int = 0
    rounds_fallback: int = 0
    downtime_s: float = 0.0  # wall seconds in which no chip trained


def young_interval(save_s: float, failures_per_s: float) -> float:
    """Seconds of training between two checkpoints that waste least, sqrt(2 x save x MTBF), for a
    job that fails ``failures_per_s`` times a second and pauses ``save_s`` per checkpoint (J. W.
    Young, "A first order approximation to the optimum checkpoint interval", CACM 17(9), 1974).
    The waste is then about sqrt(2 x save x rate) + rate x restart, per second of training."""
    if save_s <= 0 or failures_per_s <= 0:
        raise ValueError("young_interval: the save time and the failure rate must be positive")
    return (2.0 * save_s / failures_per_s) ** 0.5


def trained_seconds(run_s: float, checkpoint_s: float, save_s: float) -> float:
    """Seconds of training in the first ``run_s`` seconds of a run that trains ``checkpoint_s``, then
    saves ``save_s``, and so on (all of it without checkpoints or without a save time)."""
    if checkpoint_s <= 0 or save_s <= 0:
        return run_s
    cycles, phase = divmod(run_s, checkpoint_s + save_s)
    return cycles * checkpoint_s + min(phase, checkpoint_s)


def straggler_efficiency(slices: int, step_s: float, step_sd_s: float) -> float:
    """Mean step over the expected slowest of ``slices`` independent normal step times (Blom's
    approximation of the expected maximum of n standard normals); 1.0 without variance."""
    if step_sd_s == 0 or slices <= 1:
        return 1.0
    z = statistics.NormalDist().inv_cdf((slices - 0.375) / (slices + 0.25))
    return step_s / (step_s + step_sd_s * z)


@dataclass
class _Job:
    """A group of slices that trains together: the whole job (dp, elastic) or one learner."""

    slices: int
    chips_per_slice: int
    elastic: bool
    efficiency: float
    up: int = 0  # its slices that are up
    state: str = "running"  # running, paused (elastic resize), down, restarting (rigid)
    since: float = 0.0  # when the state (or the up count) last changed
    token: int = 0  # invalidates a restart that a failure interrupted or postponed
    restart_end: float = 0.0
    checkpoint_s: float = 0.0
    save_s: float = 0.0
    useful: float = 0.0  # chip-seconds
    run_s: float = 0.0  # seconds running since the last restart (training and saving checkpoints)
    pending: dict = field(default_factory=dict)  # slice -> when it was back, of repaired slices waiting to rejoin
    training_intervals: list = field(default_factory=list)  # running, saving checkpoints included

    def training(self) -> bool:
        return self.state == "running" and self.up > 0

    def advance(self, now: float) -> None:
        """Account the time since the last change."""
        if self.training():
            seconds = now - self.since
            trained = (trained_seconds(self.run_s + seconds, self.checkpoint_s, self.save_s)
                       - trained_seconds(self.run_s, self.checkpoint_s, self.save_s))
            self.useful += trained * self.up * self.chips_per_slice * self.efficiency
            self.run_s += seconds
            self.training_intervals.append((self.since, now))
        self.since = now

    def lost_seconds(self) -> float:
        """Training seconds since the last completed checkpoint (0 without checkpoints)."""
        if self.checkpoint_s <= 0:
            return 0.0
        return min(self.run_s % (self.checkpoint_s + self.save_s), self.checkpoint_s)


class Simulation:
    """One run of :class:`SimConfig`. :meth:`run` returns a :class:`SimResult`.

    :param failures: explicit (time, slice) failures instead of random ones (tests: closed forms), or
        (time, slice, seconds until it is back) for a repair time of its own
    :param progress: called with the share of simulated time done, now and then
    """

    def __init__(self, config: SimConfig, failures: Optional[Sequence[tuple[float, int]]] = None,
                 progress: Callable[[float], None] = lambda done: None):
        self.config, self.progress = config, progress
        self.rng = random.Random(config.seed)
        self.horizon = config.hours * 3600.0
        self.slices = config.chips // config.slice_chips
        self.down = [False] * self.slices
        groups = 1 if config.arm in ("dp", "elastic") else config.learners
        per = self.slices // groups
        elastic = config.arm == "elastic" or (config.arm == "learners" and config.learner_mode == "elastic")
        efficiency = straggler_efficiency(per, config.step_s, config.step_sd_s)
        self.jobs = [_Job(per, config.slice_chips, elastic, efficiency, up=per, checkpoint_s=config.checkpoint_s,
                          save_s=config.checkpoint_save_s) for _ in range(groups)]
        self.slices_per_job = per  # slice s is job s // per's
        self.clock = RoundClock(config.outer_period_s, config.fragments)
        self.queue: list = []
        self._seq = 0
        self.failures = 0
        self.explicit = sorted(failures) if failures is not None else None
        self.rounds_ok = self.rounds_fallback = 0
        self._drawn = 0.0  # when the last random failure happened

    def _at_step(self, t: float) -> float:
        """When something due at ``t`` takes effect: then, or time-stepped at the end of its step
        (1e-9: a time on a step's end stays there)."""
        tick = self.config.tick_s
        return math.ceil(t / tick - 1e-9) * tick if tick > 0 else t

    def _push(self, t: float, kind: str, *payload) -> None:
        self._seq += 1
        first = 0 if self.config.tick_s > 0 and kind == "fail" else 1  # a step's failures before its other events
        heapq.heappush(self.queue, (self._at_step(t), first, self._seq, kind, payload))

    def _next_failure(self) -> None:
        if self.explicit is not None:
            if self.explicit:
                t, s, *repair = self.explicit.pop(0)
                self._push(t, "fail", s, *repair)
            return
        rate = self.config.chips / self.config.chip_mtbi_s  # every chip's, superposed
        self._drawn += self.rng.expovariate(rate)  # (when it happens; time-stepped, it acts at its step's end)
        self._push(self._drawn, "fail", self.rng.randrange(self.slices))

    def run(self) -> SimResult:
        """Simulate ``hours`` of wall time."""
        config = self.config
        self._next_failure()
        if config.arm == "learners":
            for fragment in range(config.fragments):
                slot = self.clock.next_slot(fragment, 0.0)
                self._push(slot.time, "slot", fragment, slot.index)
        processed = 0
        while self.queue and self.queue[0][0] < self.horizon:
            t, _, _, kind, payload = heapq.heappop(self.queue)
            getattr(self, f"_on_{kind}")(t, *payload)
            processed += 1
            if processed % 20000 == 0:
                self.progress(t / self.horizon)
        for job in self.jobs:
            job.advance(self.horizon)
        self.progress(1.0)
        useful = sum(job.useful for job in self.jobs)
        training = length(i for job in self.jobs for i in job.training_intervals)
        return SimResult(goodput=useful / (config.chips * self.horizon), uptime=training / self.horizon,
                         failures=self.failures, rounds_ok=self.rounds_ok, rounds_fallback=self.rounds_fallback,
                         downtime_s=self.horizon - training)

    # events

    def _on_fail(self, t: float, s: int, repair_s: Optional[float] = None) -> None:
        self._next_failure()
        if self.down[s]:
            return  # down already: its repair is under way
        self.failures += 1
        self.down[s] = True
        self._push(t + (self.config.repair_s if repair_s is None else repair_s), "repair", s)
        index = s // self.slices_per_job
        job = self.jobs[index]
        if job.pending.pop(s, None) is not None:
            return  # it failed again while waiting to rejoin: the job never had it back
        job.advance(t)
        job.up -= 1
        if job.elastic:
            self._pause(index, t)
        else:
            if job.state == "running":  # back to its last checkpoint
                job.useful -= job.lost_seconds() * job.slices * job.chips_per_slice * job.efficiency
            job.run_s = 0.0
            if job.state == "restarting" and self.config.restart_absorbs:
                end = max(job.restart_end, t + self.config.repair_s)
                if end > job.restart_end:  # it waits for this slice too
                    job.restart_end, job.token = end, job.token + 1
                    self._push(end, "restarted", index, job.token)
                return
            job.state, job.token = "down", job.token + 1

    def _on_repair(self, t: float, s: int) -> None:
        self.down[s] = False
        index = s // self.slices_per_job
        job = self.jobs[index]
        job.advance(t)
        if job.elastic and job.state == "running" and job.up > 0 and self.config.rejoin_wait_s > 0:
            job.pending[s] = t  # it waits for the next pause, at most rejoin_wait_s
            self._push(t + self.config.rejoin_wait_s, "rejoin_due", index)
            return
        job.up += 1
        if job.elastic:
            self._pause(index, t)
        elif job.up == job.slices and job.state == "down":
            job.state, job.token = "restarting", job.token + 1
            job.restart_end = t + self.config.restart_s
            self._push(job.restart_end, "restarted", index, job.token)

    def _pause(self, index: int, t: float) -> None:
        job = self.jobs[index]
        if job.state == "paused":
            return  # the resize under way applies this change too
        job.up += len(job.pending)  # the repaired slices waiting to rejoin come with it
        job.pending.clear()
        job.state = "paused"
        self._push(t + self.config.resize_s, "resized", index)

    def _on_rejoin_due(self, t: float, index: int) -> None:
        job = self.jobs[index]
        if job.pending and self._at_step(min(job.pending.values()) + self.config.rejoin_wait_s) <= t:  # (not taken since)
            job.advance(t)
            self._pause(index, t)

    def _on_resized(self, t: float, index: int) -> None:
        job = self.jobs[index]
        job.advance(t)
        job.state = "running"

    def _on_restarted(self, t: float, index: int, token: int) -> None:
        job = self.jobs[index]
        if job.token != token:
            return  # a failure interrupted or postponed this restart
        job.advance(t)
        job.state = "running"

    def _on_slot(self, t: float, fragment: int, index: int) -> None:
        config = self.config
        self._push(self.clock.slot_time(fragment, index + 1), "slot", fragment, index + 1)
        members = frozenset(i for i, job in enumerate(self.jobs) if job.training())
        if len(members) < max(config.quorum, 2) and config.grace_s > 0:
            self._push(t + config.grace_s, "grace_end", members)  # those training at its end count too
        else:
            self._count_round(len(members))

    def _on_grace_end(self, t: float, members: frozenset) -> None:
        self._count_round(len(members | {i for i, job in enumerate(self.jobs) if job.training()}))

    def _count_round(self, members: int) -> None:
        if members >= max(self.config.quorum, 2):  # (a lone learner's round falls back, as an island's)
            self.rounds_ok += 1
        else:
            self.rounds_fallback += 1


def simulate(config: SimConfig, **kwargs) -> SimResult:
    """Run one :class:`SimConfig` (see :class:`Simulation` for ``failures`` and ``progress``)."""
    return Simulation(config, **kwargs).run()


# Decoupled DiLoCo, arXiv 2604.21428: goodput (%) at a mean time between interruptions of one year
# per chip (issue 18 quotes the table; docs/SCALE.md sets ours beside it)
PAPER_CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
PAPER_GOODPUT = {
    ("dp", 1): (72, 57, 38, 27, 18),
    ("elastic", 1): (88, 80, 69, 58, 40),
    ("learners", 2): (94, 88, 80, 70, 54),
    ("learners", 4): (96, 93, 89, 82, 73),
    ("learners", 8): (98, 96, 94, 88, 80),
    ("learners", 16): (99, 98, 96, 93, 86),
}
# what the paper leaves open, fitted once to its table (docs/SCALE.md, "The paper's table"): slices
# of 125 chips (every size splits into 16 learners of whole slices), time steps of 2 s (a step's
# failures cost one restart or pause). Data-parallel restarts on spares (repair 0) in 78 s and loses
# no work (in-memory recovery); elastic jobs and learners pause 22 s per change, get a failed slice
# back in 10 minutes and take it back with their next pause, at most 3 minutes later
PAPER_ASSUMPTIONS = {
    "dp": {"slice_chips": 125, "tick_s": 2.0, "repair_s": 0.0, "restart_s": 78.0},
    "elastic": {"slice_chips": 125, "tick_s": 2.0, "repair_s": 600.0, "resize_s": 22.0, "rejoin_wait_s": 180.0},
}


def arm_label(arm: str, learners: int) -> str:
    return {"dp": "data-parallel", "elastic": "elastic data-parallel"}.get(arm, f"M = {learners}")


def paper_config(arm: str, chips: int, learners: int = 1, **overrides) -> SimConfig:
    """A :class:`SimConfig` with the paper fit's assumptions (:data:`PAPER_ASSUMPTIONS`, the
    elastic ones for learners too), ``overrides`` on top (any SimConfig field). A data-parallel job
    with a checkpoint save time checkpoints at :func:`young_interval` of its failure rate unless
    ``checkpoint_s`` is given."""
    values = {**PAPER_ASSUMPTIONS["dp" if arm == "dp" else "elastic"], **overrides}
    if arm == "dp" and values.get("checkpoint_save_s", 0) > 0 and "checkpoint_s" not in values:
        values["checkpoint_s"] = young_interval(values["checkpoint_save_s"],
                                                chips / values.get("chip_mtbi_s", YEAR_S))
    return SimConfig(arm=arm, chips=chips, learners=learners, **values)


def paper_cells(**overrides) -> list[tuple[SimConfig, int]]:
    """Every cell of the paper's table as (its configuration, the paper's goodput in percent), all
    built (so checked) before any runs. ``overrides`` as for :func:`paper_config`.

    :raises pydantic.ValidationError: overrides the simulator refuses
    """
    return [(paper_config(arm, chips, m, **overrides), paper)
            for (arm, m), row in PAPER_GOODPUT.items() for chips, paper in zip(PAPER_CHIPS, row)]


def paper_table(cells: Sequence[tuple[SimConfig, int]],
                progress: Callable[[float], None] = lambda done: None) -> list[dict]:
    """:func:`paper_cells` simulated: rows of {arm, learners, label, chips, ours, paper, failures}
    (goodput in percent)."""
    rows = []
    for index, (config, paper) in enumerate(cells):
        result = simulate(config, progress=lambda done: progress((index + done) / len(cells)))
        rows.append({"arm": config.arm, "learners": config.learners, "label": arm_label(config.arm, config.learners),
                     "chips": config.chips, "ours": round(100 * result.goodput, 1), "paper": paper,
                     "failures": result.failures})
    return rows


def chaos_failures(schedule, startup_s: float) -> list[tuple[float, int, float]]:
    """The outages a chaos schedule (:class:`p2p_diloco.lab.chaos.ChaosConfig`) forces, as the
    simulator's explicit failures (time, island index, seconds down), in seconds after every island
    trains: a kill is down until its restart plus ``startup_s`` (start-up to the first inner step;
    for good without a restart), a freeze for its duration; ``kill_donor`` restarts the joiner (down
    ``startup_s``) and kills its donor, here the next island, until ``restart_after`` plus
    ``startup_s``. Link cuts, throttles, attacks and the bootstrap node's death stop no island's
    inner steps: none."""
    names = [f"island-{i}" for i in range(schedule.islands)]
    horizon = schedule.minutes * 60.0
    outages = []
    for fault in schedule.faults:
        index = names.index(fault.island) if fault.island in names else None
        if fault.kind == "kill":
            down = fault.restart_after + startup_s if fault.restart_after else horizon
            outages.append((fault.at, index, down))
        elif fault.kind == "freeze":
            outages.append((fault.at, index, fault.duration))
        elif fault.kind == "kill_donor":
            outages.append((fault.at, index, startup_s))
            donor = (index + 1) % schedule.islands
            outages.append((fault.at + startup_s / 2, donor, (fault.restart_after or horizon) + startup_s))
    return sorted(outages)


def predict_chaos(schedule, *, startup_s: float, utilization: float, quorum: int = 2) -> tuple[SimConfig, SimResult]:
    """The goodput a chaos schedule should measure (docs/SCALE.md, "Our chaos runs, predicted"): its
    islands as learners of one chip each that never wait for one another (a resize of 0 s: the
    measured stall per failure), down for the outages of :func:`chaos_failures`, on the schedule's
    round clock; the simulated goodput times ``utilization``, the share of a running island's time in
    inner steps (measured without faults: evaluations and bookkeeping are the rest).

    :returns: (the simulated configuration, its result with ``goodput`` already scaled)
    """
    config = SimConfig(arm="learners", chips=schedule.islands, slice_chips=1, learners=schedule.islands,
                       repair_s=0.0, resize_s=0.0, outer_period_s=schedule.period, fragments=schedule.fragments,
                       quorum=quorum, hours=schedule.minutes / 60.0)
    result = simulate(config, failures=chaos_failures(schedule, startup_s))
    result.goodput *= utilization
    return config, result
