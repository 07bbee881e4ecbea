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
  checkpoint (every ``checkpoint_s`` seconds of training; 0: none lost). A failure during the
  restart is taken in by it (``restart_absorbs``: the restart ends once that slice is back too) or
  starts it over.
- **elastic data-parallel** (``elastic``): one job that drops a failed slice and takes a repaired
  one back, each change pausing everyone for ``resize_s`` (changes during a pause are applied by
  it); between pauses it trains on the slices that are up.
- **M learners** (``learners``): the slices split into M learners, each an elastic job of its own
  (``learner_mode="elastic"``) or a rigid one that restarts like data-parallel (``"rigid"``). A
  learner's failure costs only its own slices: no learner ever waits for another, and the outer
  rounds run on the product's round clock (:class:`p2p_diloco.algo.schedule.RoundClock`): a round
  at its slot is ``ok`` with at least ``quorum`` training learners, and never fewer than 2, as the
  islands' (below it, those training at the end of the grace window count too), else each learner
  steps on its own update (``fallback``). Rounds never cost goodput: no learner waits for one.

Goodput is useful chip-seconds over chips x wall time (docs/DESIGN.md, "Metrics"); stragglers cost
each job the ratio of the mean step to the expected slowest of its slices' steps (independent
normal step times of ``step_sd_s``). Uptime is the share of wall time in which some chip trains.
"""

from __future__ import annotations

import heapq
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
    restart_absorbs: bool = True
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
    useful: float = 0.0  # chip-seconds
    run_since_checkpoint: float = 0.0  # seconds of training since the last checkpoint (rigid)
    training_intervals: list = field(default_factory=list)

    def training(self) -> bool:
        return self.state == "running" and self.up > 0

    def advance(self, now: float) -> None:
        """Account the time since the last change."""
        if self.training():
            seconds = now - self.since
            self.useful += seconds * self.up * self.chips_per_slice * self.efficiency
            self.run_since_checkpoint += seconds
            self.training_intervals.append((self.since, now))
        self.since = now


class Simulation:
    """One run of :class:`SimConfig`. :meth:`run` returns a :class:`SimResult`.

    :param failures: explicit (time, slice) failures instead of random ones (tests: closed forms)
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
        self.jobs = [_Job(per, config.slice_chips, elastic, efficiency, up=per) for _ in range(groups)]
        self.slices_per_job = per  # slice s is job s // per's
        self.clock = RoundClock(config.outer_period_s, config.fragments)
        self.queue: list = []
        self._seq = 0
        self.failures = 0
        self.explicit = sorted(failures) if failures is not None else None
        self.rounds_ok = self.rounds_fallback = 0

    def _push(self, t: float, kind: str, *payload) -> None:
        self._seq += 1
        heapq.heappush(self.queue, (t, self._seq, kind, payload))

    def _next_failure(self, now: float) -> None:
        if self.explicit is not None:
            if self.explicit:
                t, s = self.explicit.pop(0)
                self._push(t, "fail", s)
            return
        rate = self.config.chips / self.config.chip_mtbi_s  # every chip's, superposed
        self._push(now + self.rng.expovariate(rate), "fail", self.rng.randrange(self.slices))

    def run(self) -> SimResult:
        """Simulate ``hours`` of wall time."""
        config = self.config
        self._next_failure(0.0)
        if config.arm == "learners":
            for fragment in range(config.fragments):
                slot = self.clock.next_slot(fragment, 0.0)
                self._push(slot.time, "slot", fragment, slot.index)
        processed = 0
        while self.queue and self.queue[0][0] < self.horizon:
            t, _, kind, payload = heapq.heappop(self.queue)
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

    def _on_fail(self, t: float, s: int) -> None:
        self._next_failure(t)
        if self.down[s]:
            return  # down already: its repair is under way
        self.failures += 1
        self.down[s] = True
        self._push(t + self.config.repair_s, "repair", s)
        index = s // self.slices_per_job
        job = self.jobs[index]
        job.advance(t)
        job.up -= 1
        if job.elastic:
            self._pause(index, t)
        else:
            if job.state == "running" and self.config.checkpoint_s > 0:  # back to its last checkpoint
                lost = job.run_since_checkpoint % self.config.checkpoint_s
                job.useful -= lost * job.slices * job.chips_per_slice * job.efficiency
            job.run_since_checkpoint = 0.0
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
        job.state = "paused"
        self._push(t + self.config.resize_s, "resized", index)

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
# of 125 chips (every size splits into 16 learners of whole slices), a failed slice swapped back in
# 10 minutes (data-parallel restarts on spares at once: repair 0), 77 s per data-parallel restart,
# 11 s per elastic resize
PAPER_ASSUMPTIONS = {"slice_chips": 125, "repair_s": 600.0, "dp_repair_s": 0.0, "restart_s": 77.0, "resize_s": 11.0}


def arm_label(arm: str, learners: int) -> str:
    return {"dp": "data-parallel", "elastic": "elastic data-parallel"}.get(arm, f"M = {learners}")


def paper_config(arm: str, chips: int, learners: int = 1, **overrides) -> SimConfig:
    """A :class:`SimConfig` with the paper fit's assumptions (:data:`PAPER_ASSUMPTIONS`; data-parallel
    restarts on spares: ``dp_repair_s``), ``overrides`` on top (any SimConfig field)."""
    values = {**PAPER_ASSUMPTIONS, **overrides}
    dp_repair = values.pop("dp_repair_s")
    if arm == "dp" and "repair_s" not in overrides:
        values["repair_s"] = dp_repair
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
