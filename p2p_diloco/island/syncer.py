"""The syncer: the threads and the clock of an island's outer rounds (docs/DESIGN.md, "Syncer" and
"Threads and processes"; Decoupled DiLoCo, arXiv 2604.21428; Streaming DiLoCo, arXiv 2501.18512,
Alg. 1).

One background thread per fragment waits for that fragment's slot on the swarm-wide clock, repairs
its base if the swarm moved on without it, takes a snapshot from the learner (at a step boundary,
without waiting), runs the round (:class:`~p2p_diloco.island.rounds.OuterRound`) and commits its
outcome: the new state to the learner and the store, the counters, the event. Nothing here blocks
the inner loop: a round that fails or finds nobody carries the island's work into its next round
(or, after ``outer.fallback_defer`` such rounds in a row, steps on its own pseudo-gradient), and a
round that is late only delivers its result later.

Threads: the main thread calls :meth:`Syncer.start` and :meth:`Syncer.stop`; fragment p's thread
alone replaces ``store.states[p]``; hivemind's fetch thread serves donations
(:class:`~p2p_diloco.island.transfer.StateTransfer`); the reporter's thread reads.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from p2p_diloco.algo.clock import MAX_CLOCK_OFFSET, SwarmClock, matchmaking_lead
from p2p_diloco.algo.handoff import LearnerLink, Snapshot
from p2p_diloco.algo.schedule import RoundClock, RoundSlot, turn_group
from p2p_diloco.config import OuterConfig
from p2p_diloco.island.contribution import RoundFormat
from p2p_diloco.island.quarantine import Quarantine
from p2p_diloco.island.repair import BaseRepair, SwarmBases
from p2p_diloco.island.rounds import OuterRound, RoundOutcome
from p2p_diloco.island.store import FragmentState, FragmentStore, HandOver
from p2p_diloco.island.transfer import StateTransfer
from p2p_diloco.net.channel import FragmentChannel

logger = logging.getLogger(__name__)

_COUNTERS = {"fallback": "rounds_failed", "rejected": "rounds_rejected", "nonfinite": "rounds_skipped",
             "no_snapshot": "rounds_skipped"}


@dataclass
class SyncerStats:
    """Round counters and traffic of one island (read by the progress record and the summary).
    Bytes are counted by the channels' codecs (rounds) and the state transfer (downloads served and
    received); :meth:`add` is safe from any thread."""

    rounds_ok: int = 0  # rounds that formed a group of 2+ and averaged (or had nothing to apply)
    rounds_failed: int = 0  # rounds that fell back to the island's own pseudo-gradient
    rounds_skipped: int = 0  # slots missed: no snapshot in time, NaN/Inf
    rounds_rejected: int = 0  # rounds whose result was invalid (a member sent garbage): not applied
    reloads: int = 0  # fragments downloaded from peers
    state_bytes_sent: int = 0  # fragment states served to peers (payload), bytes
    state_bytes_received: int = 0  # fragment states downloaded (payload), bytes
    peak_bytes_per_step: int = 0  # largest round's bytes (sent + received) per inner step it lasted
    clipped: int = 0  # pseudo-gradient elements clipped to +-max_delta
    group_sizes: list[int] = field(default_factory=list)
    round_traffic: Callable[[], tuple[int, int]] = lambda: (0, 0)  # round bytes sent, received so far
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        """Add to counters, e.g. ``add(reloads=1)``."""
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    @property
    def round_bytes_sent(self) -> int:
        """Bytes of round messages (tensor parts and averaged replies) this island sent."""
        return self.round_traffic()[0]

    @property
    def round_bytes_received(self) -> int:
        """Bytes of round messages this island received."""
        return self.round_traffic()[1]

    @property
    def bytes_sent(self) -> int:
        """All bytes sent: rounds and state served."""
        return self.round_bytes_sent + self.state_bytes_sent

    @property
    def bytes_received(self) -> int:
        """All bytes received: rounds and state downloaded."""
        return self.round_bytes_received + self.state_bytes_received

    def count(self, outcome: RoundOutcome, step_time: float) -> None:
        """Count a finished round: its outcome, clipped elements, and its bytes per inner step it
        lasted (a round's bytes spread over at least one inner step of ``step_time`` seconds)."""
        with self._lock:
            if outcome.outcome in ("ok", "empty"):
                self.rounds_ok += 1
                self.group_sizes.append(outcome.group_size)
            elif outcome.outcome in _COUNTERS:
                setattr(self, _COUNTERS[outcome.outcome], getattr(self, _COUNTERS[outcome.outcome]) + 1)
            self.clipped += outcome.clipped
            moved = outcome.figures.get("bytes_sent", 0) + outcome.figures.get("bytes_received", 0)
            steps = max(1.0, max(0.0, outcome.seconds) / max(1e-6, step_time))
            self.peak_bytes_per_step = max(self.peak_bytes_per_step, int(moved / steps))


class Syncer:
    """Outer rounds of one island, one background thread per fragment.

    :param config: the outer settings (period, matchmaking time, apply mode, overlap)
    :param store: the island's global states
    :param rounds: one :class:`OuterRound` per fragment
    :param repair: the base repair before each round (and halfway between two)
    :param learner: gives snapshots
    :param hand_over: makes a round's new state the learner's Theta_p
    :param stats: the counters this syncer keeps
    :param events: takes ``round`` events (the island's JSONL log)
    :param stop: set by :meth:`stop`; the rounds and transfers share it
    :param swarm_clock: swarm time, on which slots are scheduled
    :param swarm_offsets: the clock offsets the other live islands publish (seconds)
    :param group: our group of the G that take turns (0 to G - 1; read at each wake), see
        :func:`~p2p_diloco.algo.schedule.turn_group`
    :param refresh: reads the others' records soon (the reporter's
        :meth:`~p2p_diloco.island.reporter.Reporter.refresh`)
    """

    def __init__(self, *, config: OuterConfig, store: FragmentStore, rounds: Sequence[OuterRound], repair: BaseRepair,
                 learner: LearnerLink, hand_over: HandOver, stats: SyncerStats, events: Callable[[dict], None],
                 stop: threading.Event, swarm_clock: SwarmClock, swarm_offsets: Callable[[], Sequence[float]],
                 group: Callable[[], int] = lambda: 0, refresh: Callable[[], None] = lambda: None):
        self.config, self.store, self.rounds, self.repair = config, store, list(rounds), repair
        self.learner, self.hand_over, self.stats, self.events, self._stop = learner, hand_over, stats, events, stop
        self.swarm_clock, self.swarm_offsets, self.group, self.refresh = swarm_clock, swarm_offsets, group, refresh
        self.now = self.swarm_clock.now
        self.clock = RoundClock(config.period, store.num_fragments, config.groups)
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Start the fragment threads."""
        for p in range(self.store.num_fragments):
            thread = threading.Thread(target=self._fragment_loop, args=(p,), name=f"syncer-f{p}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop scheduling rounds; a round in flight is abandoned without an outer step (bounded wait)."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = [thread.name for thread in self._threads if thread.is_alive()]
        if alive:
            logger.warning("round threads still running after %.0f s: %s", timeout, ", ".join(alive))

    # ---------------------------------------------------------------- fragment threads

    def _fragment_loop(self, p: int) -> None:
        budget = self.config.fragment_budget
        while not self._stop.is_set():
            try:
                lead = self._lead()
                slot = self.clock.next_slot(p, self.now() + lead + min(1.0, budget / 4), self.group())
                # halfway between the swarm's previous slot of p and ours (or earlier, when skewed clocks
                # make matchmaking start early): repair the base if the swarm moved on without us, so
                # that the next round starts from the swarm's Theta_p and we can take part in it. With
                # groups taking turns it always has: wait for the records to show the other group's new
                # state first (docs/DESIGN.md, "Groups that take turns")
                if self._sleep_until(slot.time - max(self.clock.spacing / 2, lead + budget / 4 + 1.0)):
                    if self.clock.groups > 1:
                        self._await_newer(p, deadline=slot.time - lead - budget / 4)
                    self.repair.repair(p, deadline=slot.time - lead - budget / 4, why="repair")
                # wake early enough for the learner to reach a step boundary before matchmaking starts
                while not self._stop.is_set():
                    prepare = lead + min(2.0 * self.learner.step_time, budget / 4)
                    if not self._sleep_until(slot.time - prepare, at_most=1.0):
                        break
                if not self._stop.is_set():
                    self._run_round(p, slot)
            except Exception as e:  # a bug must not kill the island's outer loop
                logger.exception("round of fragment %d failed unexpectedly: %r", p, e)
                self._stop.wait(1.0)

    def _lead(self) -> float:
        """Seconds before a slot at which matchmaking starts (see :func:`matchmaking_lead`), at most what
        leaves the fragment's previous round its grace window and all-reduce."""
        config = self.config
        lead = matchmaking_lead(config.matchmaking_time, [self.swarm_clock.offset, *self.swarm_offsets()],
                                tolerance=MAX_CLOCK_OFFSET)
        return max(config.matchmaking_time,
                   min(lead, self.clock.spacing - config.grace_window - config.allreduce_timeout - 1.0))

    def _await_newer(self, p: int, deadline: float) -> None:
        """With groups taking turns, the swarm's previous slot of fragment p was another group's: read
        the others' records again every 0.5 s until they show a newer state of p than ours (which the
        repair then loads) or swarm time ``deadline`` (that group's round failed, or is late)."""
        while self.repair.target(p, self.store.states[p]) is None:
            self.refresh()
            if not self._sleep_until(deadline, at_most=0.5):
                return

    def _sleep_until(self, moment: float, at_most: float = float("inf")) -> bool:
        """Wait until swarm time ``moment`` (or ``at_most`` seconds); False if it has passed already
        or the syncer stops."""
        remaining = moment - self.now()
        if remaining <= 0:
            return False
        return not self._stop.wait(min(remaining, at_most))

    def _run_round(self, p: int, slot: RoundSlot) -> None:
        started = self.now()
        # behind the swarm (a missed round) or on a lone fork: reload rather than send a pseudo-gradient
        # computed from the wrong base. If no donor answers, take part anyway: the round's gathered
        # metadata decides, and a member on the wrong base reloads after it (never skipping forever).
        if not self.repair.repair(p, deadline=slot.time - self.config.matchmaking_time / 2, why="behind"):
            logger.warning("fragment %d: could not reload the swarm's newer state; rounding from our own", p)
        state = self.store.states[p]
        timeout = max(0.05, slot.time - self.now() - self.config.matchmaking_time / 4)
        snapshot = self.learner.request_snapshot(p, timeout=timeout)
        if snapshot is None:
            self._commit(p, slot, started, state, None, RoundOutcome("no_snapshot"))
            return
        with self.store.round_in_flight(p):
            outcome = self.rounds[p].run(p, slot, state, snapshot)
            self._commit(p, slot, started, state, snapshot, outcome)

    def _commit(self, p: int, slot: RoundSlot, started: float, state: FragmentState, snapshot: Optional[Snapshot],
                outcome: RoundOutcome) -> None:
        """Count the round, hand its new state to the learner and log its event."""
        self.stats.count(outcome, self.learner.step_time)
        if outcome.state is not None:
            overlap = self.config.overlap_steps
            self.hand_over(p, outcome.state, outcome.base, reason="reload" if outcome.outcome == "nonfinite"
                           else outcome.outcome, reset_optimizer=outcome.reset_optimizer,
                           not_before=snapshot.step + overlap if overlap and snapshot is not None else 0)
            self.repair.settle(p)  # a resumed island's checkpoint progress went into it (docs/DESIGN.md)
        event = {"event": "round", "fragment": p, "slot": slot.index, "slot_time": slot.time, "t_start": started,
                 **outcome.figures, "outcome": outcome.outcome}
        if self.clock.groups > 1:
            event["turn"] = slot.index % self.clock.groups  # the group whose slot it was (groups taking turns)
        if outcome.outcome in ("ok", "empty", "fallback"):
            new = outcome.state or state
            event |= {"new_version": new.version, "new_hash": new.hash}
        self.events(event | {"t_end": self.now()})


def wire_syncer(*, island: str, config: OuterConfig, store: FragmentStore, stats: SyncerStats, quarantine: Quarantine,
                transfer: StateTransfer, formats: Sequence[RoundFormat], channels: Sequence[FragmentChannel],
                learner: LearnerLink, swarm_bases: SwarmBases, events: Callable[[dict], None],
                stop: threading.Event, swarm_clock: SwarmClock,
                swarm_offsets: Callable[[], Sequence[float]] = list,
                nudge: Callable[[], None] = lambda: None, refresh: Callable[[], None] = lambda: None) -> Syncer:
    """Connect an island's syncer parts once its channels are open (one per fragment): downloads
    through the channels, donor priorities from the published states (the newest version and the
    largest agreement are asked first), round traffic from the channels' codecs, one
    :class:`OuterRound` per fragment, the base repair and the hand-over to the learner.

    :param swarm_bases: (island, fragment versions, fragment hashes) of the other live islands
    :param swarm_clock: swarm time (docs/DESIGN.md, "Clocks")
    :param swarm_offsets: the clock offsets the other live islands publish (seconds)
    :param nudge: publishes our progress record and reads the others' soon (the reporter's
        :meth:`~p2p_diloco.island.reporter.Reporter.nudge`): after each new state, since members that
        missed a round's result wait for our record to show its hash
    :param refresh: reads the others' records soon (:meth:`~p2p_diloco.island.reporter.Reporter.refresh`),
        while we wait for theirs
    """
    transfer.attach(channels)
    store.on_publish(lambda p, state: channels[p].set_donor_priority(state.version + min(state.support, 999) / 1000))
    store.on_publish(lambda p, state: nudge())
    stats.round_traffic = lambda: tuple(sum(moved) for moved in zip(*(channel.traffic() for channel in channels)))
    rounds = [OuterRound(island=island, config=config, wire=wire, channel=channel, transfer=transfer,
                         quarantine=quarantine, clock=swarm_clock, stop=stop, records=swarm_bases, refresh=refresh)
              for wire, channel in zip(formats, channels)]
    hand_over = HandOver(store, learner, apply=config.apply, alpha=config.alpha)
    repair = BaseRepair(store=store, transfer=transfer, quarantine=quarantine, swarm_bases=swarm_bases,
                        hand_over=hand_over, events=events, now=swarm_clock.now, refresh=refresh)

    def group() -> int:
        live = [name for name, _, _ in swarm_bases() if name not in quarantine]
        return turn_group(island, live, config.groups)

    return Syncer(config=config, store=store, rounds=rounds, repair=repair, learner=learner, hand_over=hand_over,
                  stats=stats, events=events, stop=stop, swarm_clock=swarm_clock,
                  swarm_offsets=swarm_offsets, group=group, refresh=refresh)
