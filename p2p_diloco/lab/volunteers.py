"""A volunteer swarm simulated (docs/SCALE.md, "Volunteer swarms"): islands of different speeds that
come and go, and the share of their compute that reaches the global model.

The model (seconds and relative speeds throughout; every part of it an assumption, stated in
docs/SCALE.md with the figures):

- Islands arrive as a Poisson process of rate ``islands / stay_mean_s``, so that ``islands`` are
  present on average, and each stays a Weibull time of mean ``stay_mean_s`` and shape
  ``stay_shape`` (1: exponential; below 1: many short stays and a few long ones, as volunteer
  hosts behave). Its speed (tokens per second, relative) is log-normal with median 1 and
  ``speed_sd`` in log space.
- A newcomer trains ``startup_s`` plus its state download (``state_bytes`` at ``bandwidth_Bps``)
  after it arrives; before that it contributes nothing (the start-up loss).
- Fragment p's rounds are at the product's slots (:class:`p2p_diloco.algo.schedule.RoundClock`). A
  round with at least ``quorum`` training islands (and never fewer than 2; those ready by the end
  of ``grace_s`` count too) takes every member's work on fragment p since its last contribution
  (1/P of its work). Below it, a member carries its work into its next round
  (``fallback_defer`` rounds in a row, as the islands do: ``outer.fallback_defer``) and then steps
  alone. Islands that step alone at one slot make forks of one version, of which the swarm keeps
  one (here the one with the most work): the others' work is the alone loss.
- An island that leaves loses its work since each fragment's last contribution (the departure loss).

Goodput is the work contributed over the work the islands present could do (their speed times the
time they were present), measured over ``hours`` from a swarm in its long-run state (the islands
present at the start have the stationary ages of their stays) after two outer periods of warm-up;
work still waiting for a round at the end counts as contributed (it goes into the next round). Contributed work and the three losses add up to that capacity. Deterministic under ``seed``.

What it leaves out, and docs/SCALE.md discusses: the DHT's and the averaging group's limits as the
swarm grows, donors' upload shared among simultaneous joiners, stale updates of slow islands and
how much a token of a slow island is worth to the model.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field
from typing import Callable, Optional

from pydantic import BaseModel, ConfigDict, Field

from p2p_diloco.algo.schedule import RoundClock

HOUR = 3600.0


class VolunteerConfig(BaseModel):
    """One simulated volunteer swarm (seconds, bytes)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    islands: int = Field(gt=0, description="islands present on average")
    stay_mean_s: float = Field(default=4 * HOUR, gt=0)
    stay_shape: float = Field(default=0.5, gt=0.05, le=20, description="Weibull shape of the stays (1: exponential)")
    speed_sd: float = Field(default=0.5, ge=0, le=5, description="log-normal sigma of the islands' speeds")
    startup_s: float = Field(default=60.0, ge=0, description="start to the first step, without the download")
    state_bytes: float = Field(default=8.6e6, ge=0, description="the state a newcomer downloads (Theta and momentum)")
    bandwidth_Bps: float = Field(default=12.5e6, gt=0, description="a newcomer's download rate, bytes/s")
    outer_period_s: float = Field(default=600.0, gt=0)
    fragments: int = Field(default=1, ge=1)
    quorum: int = Field(default=2, ge=1)
    grace_s: float = Field(default=0.0, ge=0)
    fallback_defer: int = Field(default=2, ge=0)
    hours: float = Field(default=24.0, gt=0)
    seed: int = 0

    @property
    def warmup_s(self) -> float:
        """Seconds simulated before the window: two outer periods, so that every island's work waits
        since its last round when the window opens."""
        return 2 * self.outer_period_s

    @property
    def download_s(self) -> float:
        return self.state_bytes / self.bandwidth_Bps


@dataclass
class VolunteerResult:
    """What one volunteer simulation measured (shares of the capacity, which they sum to)."""

    goodput: float  # contributed work / capacity
    startup: float  # share lost before newcomers trained
    departure: float  # share lost by islands that left before their next round
    alone: float  # share stepped alone while others trained (never merged)
    present: float  # islands present, time-averaged over the window
    joins: int
    rounds_ok: int
    rounds_fallback: int
    members: float  # training islands per ok round, on average


@dataclass
class _Island:
    speed: float
    arrive: float
    ready: float
    leave: float
    last: list = field(default_factory=list)  # per fragment: since when its work waits for a round
    deferred: list = field(default_factory=list)  # per fragment: fallbacks carried over in a row

    def training(self, t: float) -> bool:
        return self.ready <= t < self.leave


class VolunteerSwarm:
    """One run of :class:`VolunteerConfig`; :meth:`run` returns a :class:`VolunteerResult`.

    :param progress: called with the share of simulated time done, now and then
    """

    def __init__(self, config: VolunteerConfig, progress: Callable[[float], None] = lambda done: None):
        self.config, self.progress = config, progress
        self.rng = random.Random(config.seed)
        self.start, self.end = -config.warmup_s, config.hours * HOUR
        self.clock = RoundClock(config.outer_period_s, config.fragments)
        self.islands: dict[int, _Island] = {}
        self.queue: list = []
        self._seq = 0
        self.capacity = self.contributed = self.startup = self.departure = self.alone = 0.0  # speed x seconds
        self.capacity_seconds = 0.0  # island-seconds present in the window
        self.joins = self.rounds_ok = self.rounds_fallback = self.member_rounds = 0
        self.scale = config.stay_mean_s / math.gamma(1 + 1 / config.stay_shape)  # Weibull scale for the mean

    def _push(self, t: float, kind: str, *payload) -> None:
        self._seq += 1
        heapq.heappush(self.queue, (t, self._seq, kind, payload))

    def _window(self, a: float, b: float) -> float:
        """Seconds of [a, b] inside the measured window [0, end]."""
        return max(0.0, min(b, self.end) - max(a, 0.0))

    def run(self) -> VolunteerResult:
        config = self.config
        for _ in range(config.islands):  # the swarm as it is in the long run (its stationary ages)
            self._arrive(self.start, stationary=True)
        self._push(self.start + self.rng.expovariate(config.islands / config.stay_mean_s), "arrival")
        for p in range(config.fragments):
            slot = self.clock.next_slot(p, self.start)
            self._push(slot.time, "slot", p, slot.index)
        processed = 0
        while self.queue and self.queue[0][0] < self.end:
            t, _, kind, payload = heapq.heappop(self.queue)
            getattr(self, f"_on_{kind}")(t, *payload)
            processed += 1
            if processed % 5000 == 0:
                self.progress((t - self.start) / (self.end - self.start))
        for island in self.islands.values():  # still here: what waits goes into its next round
            if island.ready < self.end:
                self.contributed += sum(self._window(last, self.end) for last in island.last) * island.speed / config.fragments
        self.progress(1.0)
        capacity = self.capacity or 1.0
        return VolunteerResult(goodput=self.contributed / capacity, startup=self.startup / capacity,
                               departure=self.departure / capacity, alone=self.alone / capacity,
                               present=self.capacity_seconds / (self.end or 1.0), joins=self.joins,
                               rounds_ok=self.rounds_ok, rounds_fallback=self.rounds_fallback,
                               members=self.member_rounds / self.rounds_ok if self.rounds_ok else 0.0)

    def _arrive(self, t: float, stationary: bool = False) -> None:
        """A newcomer at ``t``, or with ``stationary`` one present at ``t`` in the long run: its whole
        stay drawn length-biased (a stay of x is present x / mean of the time: for a Weibull stay of
        scale s and shape k, s G^(1/k) with G ~ Gamma(1 + 1/k)), and ``t`` a uniform point of it."""
        config = self.config
        if stationary:
            stay = self.scale * self.rng.gammavariate(1 + 1 / config.stay_shape, 1.0) ** (1 / config.stay_shape)
            t -= self.rng.uniform(0.0, stay)
        else:
            stay = self.scale * self.rng.weibullvariate(1.0, config.stay_shape)
        speed = math.exp(self.rng.gauss(0.0, config.speed_sd)) if config.speed_sd else 1.0
        ready = t + config.startup_s + config.download_s
        island = _Island(speed, t, ready, t + stay, [ready] * config.fragments, [0] * config.fragments)
        key = self._seq
        self.islands[key] = island
        self.joins += t >= 0
        present = self._window(t, t + stay)
        self.capacity += speed * present
        self.capacity_seconds += present
        self.startup += speed * self._window(t, min(ready, t + stay))
        self._push(t + stay, "leave", key)

    def _on_arrival(self, t: float) -> None:
        self._arrive(t)
        self._push(t + self.rng.expovariate(self.config.islands / self.config.stay_mean_s), "arrival")

    def _on_leave(self, t: float, key: int) -> None:
        island = self.islands.pop(key)
        if island.ready < t:
            self.departure += sum(self._window(last, t) for last in island.last) * island.speed / self.config.fragments

    def _on_slot(self, t: float, p: int, index: int) -> None:
        config = self.config
        self._push(self.clock.slot_time(p, index + 1), "slot", p, index + 1)
        training = [island for island in self.islands.values() if island.training(t)]
        members = training
        if len(members) < max(config.quorum, 2) and config.grace_s > 0:  # latecomers of the grace window
            members = [i for i in self.islands.values() if i.ready <= t + config.grace_s and i.leave > t + config.grace_s]
        counted = t >= 0
        if len(members) >= max(config.quorum, 2):
            self.rounds_ok += counted
            self.member_rounds += len(members) * counted
            for island in members:
                self.contributed += self._window(island.last[p], t) * island.speed / config.fragments
                island.last[p], island.deferred[p] = max(t, island.last[p]), 0
            return
        self.rounds_fallback += counted
        stepping = []
        for island in training:
            if island.deferred[p] < config.fallback_defer:
                island.deferred[p] += 1  # its work waits for the next round
            else:
                stepping.append((self._window(island.last[p], t) * island.speed / config.fragments, island))
                island.last[p], island.deferred[p] = t, 0
        # islands that step alone make forks of one version: the swarm keeps one (newcomers download it,
        # the base repair moves the others to it), here the one with the most work; the others' is lost
        stepping.sort(key=lambda pair: pair[0], reverse=True)
        for rank, (work, _) in enumerate(stepping):
            if rank == 0:
                self.contributed += work
            else:
                self.alone += work


def simulate_volunteers(config: VolunteerConfig, **kwargs) -> VolunteerResult:
    """Run one :class:`VolunteerConfig` (``progress`` as for :class:`VolunteerSwarm`)."""
    return VolunteerSwarm(config, **kwargs).run()
