"""The syncer: the island's copy of the global parameters Theta, the outer optimizer state and the
fragment versions, and the outer rounds that update them (DESIGN.md, "Syncer"; Decoupled DiLoCo,
arXiv 2604.21428; Streaming DiLoCo, arXiv 2501.18512, Alg. 1).

One background thread per fragment waits for that fragment's slot on the swarm-wide clock, takes a
snapshot of the island's parameters from the learner (at a step boundary, without waiting), runs the
averaging round through hivemind, applies the outer step and hands the result back. Nothing here
blocks the inner loop: a round that fails or finds nobody falls back to the island's own
pseudo-gradient (a group of one), and a round that is late only delivers its result later.

Threads: the main thread calls everything up to :meth:`Syncer.start` and then :meth:`Syncer.stop`
and :meth:`Syncer.close`; fragment p's thread alone replaces ``states[p]`` (a reference swap, read
anywhere); hivemind's fetch thread calls :meth:`Syncer._donate` when a peer downloads a fragment.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence

import numpy as np
import torch

from p2p_diloco import outer, transport, wire
from p2p_diloco.config import OuterConfig
from p2p_diloco.fragments import FragmentLayout
from p2p_diloco.schedule import RoundClock, RoundSlot

logger = logging.getLogger(__name__)

WEIGHT_UNIT = 1e6  # token weights are sent in units of 10^6 (tokens^2 / step) to stay well inside fp32
LISTENER_WEIGHT = 1e-12  # weight of a member with nothing to contribute: it only receives the result
MIN_OTHERS_SHARE = 1e-3  # below this share of the others' weight, a round's result is not checked for failed parts


@dataclass
class Snapshot:
    """The island's parameters of one fragment at a step boundary, and what produced them."""

    fragment: int
    params: list[torch.Tensor]  # fp32 CPU copies in fragment order, shapes as the parameters
    tokens: int  # tokens trained since this fragment's previous snapshot
    steps: int  # inner steps in that time
    step: int = 0  # the learner's inner step count when the snapshot was taken


@dataclass
class OuterUpdate:
    """A new Theta_p for the learner to apply at its next step boundary (fp32 CPU tensors, not to be
    modified).

    ``mode == "carry"``: add ``tensors`` (Theta_new - base) to the live parameters.
    ``mode == "mix"``: theta <- alpha * theta + (1 - alpha) * ``tensors`` (Theta_new).
    ``mode == "replace"``: theta <- ``tensors`` (Theta_new); with ``reset_optimizer`` the inner
    optimizer's state of these parameters is cleared too (after NaN/Inf).
    """

    fragment: int
    mode: str
    tensors: list[torch.Tensor]
    alpha: float
    version: int
    reason: str  # the round outcome that produced it, or "reload"
    reset_optimizer: bool = False
    not_before_step: int = 0  # land no earlier than this inner step (overlap tau); 0: at once


class LearnerLink(Protocol):
    """What the syncer needs from the learner; every member is safe to call from any thread."""

    def request_snapshot(self, fragment: int, timeout: float) -> Optional[Snapshot]:
        """A snapshot taken at the learner's next step boundary, or None after ``timeout`` seconds."""

    def deliver(self, update: OuterUpdate) -> None:
        """Queue an update for the learner's next step boundary."""

    @property
    def step_time(self) -> float:
        """Smoothed seconds per inner step."""


@dataclass
class FragmentState:
    """Theta_p, its outer momentum m_p (fp32 CPU), version v_p and hash; replaced as a whole, never
    modified in place, so readers in other threads always see a consistent state."""

    theta: list[torch.Tensor]
    momentum: list[torch.Tensor]
    version: int
    hash: str
    support: int = 1  # members of the last round that shared this state's base (donor priority)


@dataclass
class SyncerStats:
    """Round counters and traffic of one island (read by the progress record and the summary)."""

    rounds_ok: int = 0  # rounds that formed a group of 2+ and averaged
    rounds_failed: int = 0  # rounds that fell back to the island's own pseudo-gradient
    rounds_skipped: int = 0  # slots missed: no snapshot in time, NaN/Inf
    rounds_rejected: int = 0  # rounds whose result was invalid (a member sent garbage): not applied
    reloads: int = 0  # fragments downloaded from peers
    state_bytes_sent: int = 0  # fragment states served to peers (payload), bytes
    state_bytes_received: int = 0  # fragment states downloaded (payload), bytes
    peak_bytes_per_step: int = 0  # largest round's bytes (sent + received) per inner step it lasted
    clipped: int = 0  # pseudo-gradient elements clipped to +-max_delta
    group_sizes: list[int] = field(default_factory=list)
    traffic: Optional[torch.Tensor] = None  # int64 (fragments, 3): round bytes sent, received (codecs), failed elements

    @property
    def round_bytes_sent(self) -> int:
        """Bytes of round messages (tensor parts and averaged replies) this island sent."""
        return int(self.traffic[:, 0].sum()) if self.traffic is not None else 0

    @property
    def round_bytes_received(self) -> int:
        """Bytes of round messages this island received."""
        return int(self.traffic[:, 1].sum()) if self.traffic is not None else 0

    @property
    def bytes_sent(self) -> int:
        """All bytes sent: rounds and state served."""
        return self.round_bytes_sent + self.state_bytes_sent

    @property
    def bytes_received(self) -> int:
        """All bytes received: rounds and state downloaded."""
        return self.round_bytes_received + self.state_bytes_received


SwarmBases = Callable[[], list[tuple[str, list[int], list[str]]]]  # (island, versions, hashes)


class Syncer:
    """Outer rounds of one island, one background thread per fragment.

    :param run_id: the run; with ``fingerprint`` it names the fragments' averaging groups
    :param fingerprint: the run fingerprint (model, tokenizer, outer settings); donors must match it
    :param island: this island's name, sent with every round
    :param config: the outer-loop settings
    :param layout: fragment layout (parameter names per fragment)
    :param shapes: ``shapes[p]`` are the parameter shapes of fragment p, in layout order
    :param learner: gives snapshots and takes updates
    :param events: callable taking an event dict (the island's JSONL log)
    :param swarm_bases: (island, fragment versions, fragment hashes) reported by the other live islands
    :param corrupt: testing only: "nan", "inf" or "huge" makes this island send garbage, as a faulty
        island would, to check that the others reject it
    :param donate_delay: testing only: seconds to wait before serving a state download (a slow donor)
    """

    def __init__(
        self,
        *,
        run_id: str,
        fingerprint: str,
        island: str,
        config: OuterConfig,
        layout: FragmentLayout,
        shapes: Sequence[Sequence[torch.Size]],
        learner: LearnerLink,
        events: Callable[[dict], None],
        swarm_bases: SwarmBases,
        corrupt: str = "",
        donate_delay: float = 0.0,
    ):
        self.run_id, self.fingerprint, self.island, self.config = run_id, fingerprint, island, config
        self.layout, self.shapes, self.learner = layout, [list(s) for s in shapes], learner
        self.events, self.swarm_bases, self.corrupt = events, swarm_bases, corrupt
        self.donate_delay = donate_delay
        self.clock = RoundClock(config.period, layout.num_fragments)
        self.offset = outer.wire_offset(config.max_delta)
        self.bound = outer.wire_bound(config.max_delta, self.offset)
        self.levels = wire.levels_of(config.codec)  # 0: plain fp32 rounds
        # RDA merges unit directions per tensor; embeddings stay on the plain mean (arXiv 2604.21428)
        self.rda = [[config.merge == "rda" and "embed" not in name for name in names] for names in layout.fragments]
        unit_offset = outer.wire_offset(1.0)
        self.offsets = [[unit_offset if rda else self.offset for rda in flags] for flags in self.rda]
        self.bounds = [[outer.wire_bound(1.0, unit_offset) if rda else self.bound for rda in flags] for flags in self.rda]
        if self.levels:  # grid values carry at most half a step of rounding on top
            self.bounds = [[2.0 * b for b in bounds] for bounds in self.bounds]
        self.flagged: dict[str, float] = {}  # islands caught sending garbage -> until when (wall clock)
        self.strikes: dict[str, int] = {}  # times each island was flagged (its probation doubles each time)
        # per fragment, shared with its averager process: bytes sent, bytes received (counted by the
        # codec), elements whose reducer failed in the last all-reduce (-1: unknown)
        self.traffic = torch.zeros((layout.num_fragments, 3), dtype=torch.int64).share_memory_()
        self.stats = SyncerStats(traffic=self.traffic)
        # written by each fragment's averager process after its all-reduce (transport.make_fragment_averager)
        self.chunks = [wire.num_chunks(shapes) for shapes in self.shapes]
        self.shared = [{"grid": torch.zeros(self.chunks[p], dtype=torch.int16).share_memory_(),
                        "failed_mask": torch.zeros(sum(s.numel() for s in self.shapes[p]), dtype=torch.uint8).share_memory_(),
                        "failed": self.traffic[p, 2:]} for p in range(layout.num_fragments)]
        self._grids: list[list[torch.Tensor]] = [[] for _ in range(layout.num_fragments)]
        # the largest grid exponent and RDA norm an honest member can have (values clipped to max_delta)
        self.ceilings = [[wire.ceiling_exponent(1.0 if rda else config.max_delta, self.levels) if self.levels else 0
                          for rda in flags] for flags in self.rda]
        self.norm_limits = [[config.max_delta * math.sqrt(s.numel()) * (1 + 1e-6) + 1e-30 for s in shapes]
                            for shapes in self.shapes]
        self.states: list[Optional[FragmentState]] = [None] * layout.num_fragments
        self.averagers: list = []
        self.buffers = [[torch.zeros(shape) for shape in fragment] for fragment in self.shapes]
        self._idle = [threading.Event() for _ in range(layout.num_fragments)]  # no round of p in flight
        for event in self._idle:
            event.set()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._stats_lock = threading.Lock()
        self._commit_lock = threading.Lock()
        self._flags_lock = threading.Lock()

    # ---------------------------------------------------------------- setup (main thread)

    @property
    def report_bound(self) -> float:
        """The largest |value| an honest member reports having sent (``delta_max``)."""
        return max(max(bounds) for bounds in self.bounds)

    def prefix(self, fragment: int) -> str:
        """Group-key prefix of one fragment's rounds: islands of another fingerprint never meet ours."""
        return f"{self.run_id}_{self.fingerprint[:12]}_f{fragment}of{self.layout.num_fragments}"

    def create_averagers(self, dht) -> None:
        """Start one averager process per fragment (from the main thread: see procs.py)."""
        for p in range(self.layout.num_fragments):
            codec = wire.make_codec(self.config.codec, self.traffic[p, :2])
            wire.install(codec)  # in the averager forked next: decodes and encodes the round's messages
            self.averagers.append(
                transport.make_fragment_averager(
                    self.buffers[p],
                    dht,
                    codec=codec,
                    levels=self.levels,
                    shared=self.shared[p],
                    ceilings=self.ceilings[p],
                    prefix=self.prefix(p),
                    quorum=self.config.quorum,
                    matchmaking_time=self.config.matchmaking_time / 2,
                    request_timeout=self.config.request_timeout,
                    allreduce_timeout=self.config.allreduce_timeout,
                    state_provider=lambda p=p: self._donate(p),
                )
            )

    def initialize(self, params: Sequence[Sequence[torch.Tensor]]) -> None:
        """Start from the island's own (seeded) initial parameters at version 0."""
        for p, fragment in enumerate(params):
            theta = [t.detach().to("cpu", torch.float32, copy=True) for t in fragment]
            self._publish(p, FragmentState(theta, [torch.zeros_like(t) for t in theta], 0, outer.tensors_hash(theta)))

    def restore(self, fragments: Sequence) -> None:
        """Start from saved global states (``checkpoint.GlobalFragment``: theta, momentum, version,
        hash, support), e.g. after a whole swarm restarted.

        :raises ValueError: if a fragment's shapes or hash do not match this layout
        """
        if len(fragments) != self.layout.num_fragments:
            raise ValueError(f"{len(fragments)} saved fragments, the layout has {self.layout.num_fragments}")
        for p, saved in enumerate(fragments):
            if [t.shape for t in saved.theta] != self.shapes[p] or [t.shape for t in saved.momentum] != self.shapes[p]:
                raise ValueError(f"saved fragment {p} has other shapes than this model")
            theta = [t.to(torch.float32).contiguous() for t in saved.theta]
            if outer.tensors_hash(theta) != saved.hash:
                raise ValueError(f"saved fragment {p} does not match its hash")
            momentum = [t.to(torch.float32).contiguous() for t in saved.momentum]
            self._publish(p, FragmentState(theta, momentum, saved.version, saved.hash, saved.support))

    def load_from_peers(self, *, timeout: float, stop: threading.Event) -> bool:
        """Download Theta_p, m_p and v_p of every fragment from live peers (with donor failover).

        :param timeout: seconds for all fragments together
        :returns: True when every fragment was loaded; False leaves unloaded fragments as they were
        """
        deadline = time.monotonic() + timeout
        for p in range(self.layout.num_fragments):
            state = self._download_until(p, min_version=0, deadline=deadline, stop=stop)
            if state is None:
                return False
            self._publish(p, state)
            self.events({"event": "join", "fragment": p, "version": state.version, "hash": state.hash})
        return True

    def start(self) -> None:
        """Share state with others and start the fragment threads."""
        for averager in self.averagers:
            averager.allow_state_sharing = True
        for p in range(self.layout.num_fragments):
            thread = threading.Thread(target=self._fragment_loop, args=(p,), name=f"syncer-f{p}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop scheduling rounds; a round in flight is abandoned without an outer step (bounded wait)."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def close(self, timeout: float = 5.0) -> None:
        """End the averager processes; call after the DHT (and with it p2pd) is shut down.

        Order matters: an averager that exits while one of its DHT requests is still queued crashes
        hivemind's DHT process (the request's reply pipe can no longer be fetched from the dead
        sender), so the DHT goes first. With p2pd gone, an averager's graceful shutdown (which
        unregisters its handlers from p2pd) can only fail, so the averagers get SIGTERM: rounds have
        stopped and they hold no state of their own. For the same reason there is no
        ``allow_state_sharing = False`` here: donor entries simply expire.
        """
        for averager in self.averagers:
            if averager.is_alive():
                averager.terminate()
        for averager in self.averagers:
            averager.join(timeout)
            if averager.is_alive():
                averager.kill()
                averager.join(timeout)
        self.averagers = []

    # ---------------------------------------------------------------- views

    @property
    def versions(self) -> list[int]:
        """v_p of every fragment (0 before initialisation)."""
        return [state.version if state else 0 for state in self.states]

    @property
    def hashes(self) -> list[str]:
        """Hash of Theta_p of every fragment ("" before initialisation)."""
        return [state.hash if state else "" for state in self.states]

    def global_params(self, fragment: int) -> list[torch.Tensor]:
        """Theta_p as last published (do not modify)."""
        state = self.states[fragment]
        assert state is not None, "syncer not initialised"
        return state.theta

    # ---------------------------------------------------------------- state sharing

    def _publish(self, p: int, state: FragmentState) -> None:
        self.states[p] = state
        if p < len(self.averagers):
            try:
                # donors of the newest version and largest agreement are asked first
                self.averagers[p].state_sharing_priority = state.version + min(state.support, 999) / 1000
            except Exception as e:
                logger.debug("could not update donor priority: %r", e)

    def _donate(self, p: int) -> tuple[dict, list[torch.Tensor]]:
        """Called by hivemind's fetch thread in this process when a peer downloads fragment p.

        Returns copies: hivemind moves what it sends into shared memory, which must not happen to
        tensors other threads are reading.
        """
        if self.states[p] is None:
            raise RuntimeError("state not ready")
        self.events({"event": "donate", "fragment": p})
        # the downloader gives up when the first chunk takes longer than next_chunk_timeout
        budget = 0.8 * transport.next_chunk_timeout(self.config.allreduce_timeout)
        delay = min(self.donate_delay, budget)
        if delay > 0:
            time.sleep(delay)
        self._idle[p].wait(timeout=min(2.0, budget - delay))  # prefer the state after a round
        state = self.states[p]
        tensors = [t.clone() for t in state.theta + state.momentum]
        with self._stats_lock:
            self.stats.state_bytes_sent += sum(t.numel() * t.element_size() for t in tensors)
        metadata = dict(
            fingerprint=self.fingerprint, fragment=p, version=state.version, hash=state.hash, support=state.support
        )
        return metadata, tensors

    def _download(self, p: int, *, min_version: int, want_hash: str = "", timeout: float) -> Optional[FragmentState]:
        """Fragment p's state from the best donor if it is valid, at least ``min_version`` and, when
        ``want_hash`` is given and the version is exactly ``min_version``, that exact Theta_p."""
        try:
            result = self.averagers[p].load_state_from_peers(wait=True, timeout=timeout)
        except Exception as e:
            logger.debug("state download of fragment %d failed: %r", p, e)
            return None
        if result is None:
            return None
        metadata, tensors = result
        n = len(self.shapes[p])
        if (
            not isinstance(metadata, dict)
            or metadata.get("fingerprint") != self.fingerprint
            or metadata.get("fragment") != p
            or len(tensors) != 2 * n
            or any(t.shape != shape for t, shape in zip(tensors, self.shapes[p] * 2))
        ):
            logger.warning("ignored a malformed state download for fragment %d", p)
            return None
        version = int(metadata.get("version", -1))
        if version < min_version:
            logger.debug("donor of fragment %d has version %d < %d", p, version, min_version)
            return None
        theta = [t.to(torch.float32).contiguous() for t in tensors[:n]]
        momentum = [t.to(torch.float32).contiguous() for t in tensors[n:]]
        with self._stats_lock:
            self.stats.state_bytes_received += sum(t.numel() * t.element_size() for t in tensors)
        if not outer.all_finite(theta + momentum):
            logger.warning("ignored a state download with NaN/Inf for fragment %d", p)
            return None
        digest = outer.tensors_hash(theta)  # computed here: the donor's word is not enough
        if want_hash and version == min_version and digest != want_hash:
            logger.debug("donor of fragment %d holds another fork of version %d", p, version)
            return None
        with self._stats_lock:
            self.stats.reloads += 1
        return FragmentState(theta, momentum, version, digest, int(metadata.get("support", 1)))

    def _download_until(self, p: int, *, min_version: int, deadline: float, want_hash: str = "",
                        stop: Optional[threading.Event] = None) -> Optional[FragmentState]:
        """Retry :meth:`_download` (another donor may answer, or the first may finish its round) until
        ``deadline`` (time.monotonic() seconds)."""
        stop = stop or self._stop
        while not stop.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            state = self._download(p, min_version=min_version, want_hash=want_hash,
                                   timeout=min(10.0, max(1.0, remaining)))
            if state is not None:
                return state
            stop.wait(min(0.5, max(0.0, deadline - time.monotonic())))
        return None

    # ---------------------------------------------------------------- rounds

    def _fragment_loop(self, p: int) -> None:
        lead = self.config.matchmaking_time
        budget = self.clock.period / self.clock.num_fragments
        while not self._stop.is_set():
            slot = self.clock.next_slot(p, time.time() + lead + min(1.0, budget / 4))
            try:
                # halfway between two rounds of p: repair the base if the swarm moved on without us,
                # so that the next round starts from the swarm's Theta_p and we can take part in it
                if self._sleep_until(slot.time - self.clock.period / 2):
                    self._repair_base(p, deadline=slot.time - lead - budget / 4, why="repair")
                # wake early enough for the learner to reach a step boundary before matchmaking starts
                while not self._stop.is_set():
                    prepare = lead + min(2.0 * self.learner.step_time, budget / 4)
                    if not self._sleep_until(slot.time - prepare, at_most=1.0):
                        break
                if not self._stop.is_set():
                    self._run_round(p, slot)
            except Exception as e:  # a bug must not kill the island's outer loop
                logger.exception("round of fragment %d failed unexpectedly: %r", p, e)
                self._idle[p].set()

    def _sleep_until(self, moment: float, at_most: float = float("inf")) -> bool:
        """Wait until wall-clock ``moment`` (or ``at_most`` seconds); False if it has passed already
        or the syncer stops."""
        remaining = moment - time.time()
        if remaining <= 0:
            return False
        return not self._stop.wait(min(remaining, at_most))

    def _repair_target(self, p: int, state: FragmentState) -> Optional[tuple[int, str]]:
        """The (version, hash) of fragment p to reload, from the other live islands' records, or None.

        Only a clear signal counts: a newer version (we missed a round), or, at our version, a fork
        that strictly more islands hold than ours (we forked alone). Ties are left to the next round,
        whose gathered metadata is the same for every member.
        """
        bases = [(state.version, state.hash)]
        for island, versions, hashes in self.swarm_bases():
            if island not in self.flagged and len(versions) > p and len(hashes) > p and hashes[p]:
                bases.append((versions[p], hashes[p]))
        newest = max(version for version, _ in bases)
        counts: dict[tuple[int, str], int] = {}
        for base in bases:
            counts[base] = counts.get(base, 0) + 1
        if newest > state.version:
            return outer.canonical_base([base for base in bases if base[0] == newest])
        best = max((base for base in counts if base[0] == state.version), key=counts.__getitem__)
        return best if counts[best] > counts[(state.version, state.hash)] else None

    def _repair_base(self, p: int, *, deadline: float, why: str) -> bool:
        """If the swarm's Theta_p differs from ours (see :meth:`_repair_target`), download it before
        ``deadline`` (wall clock) and hand it to the learner, keeping the local progress made since
        our own Theta_p. Returns False only when a reload was needed and failed."""
        state = self.states[p]
        target = self._repair_target(p, state)
        if target is None:
            return True
        started = time.time()
        fresh = self._download_until(p, min_version=target[0], want_hash=target[1],
                                     deadline=time.monotonic() + max(0.5, deadline - started))
        if fresh is not None:
            self._hand_over(p, fresh, base=state.theta, reason="reload")
        self.events({"event": "reload", "why": why, "fragment": p, "t_start": started, "t_end": time.time(),
                     "base_version": state.version, "target_version": target[0], "reloaded": fresh is not None,
                     "new_version": self.versions[p], "new_hash": self.hashes[p]})
        return fresh is not None

    def _run_round(self, p: int, slot: RoundSlot) -> None:
        cfg = self.config
        event = {"event": "round", "fragment": p, "slot": slot.index, "slot_time": slot.time, "t_start": time.time()}
        # behind the swarm (a missed round) or on a lone fork: reload rather than send a pseudo-gradient
        # computed from the wrong base. If no donor answers, take part anyway: the round's gathered
        # metadata decides, and a member on the wrong base reloads after it (never skipping forever).
        if not self._repair_base(p, deadline=slot.time - cfg.matchmaking_time / 2, why="behind"):
            logger.warning("fragment %d: could not reload the swarm's newer state; rounding from our own", p)
        state = self.states[p]
        timeout = max(0.05, slot.time - time.time() - cfg.matchmaking_time / 4)
        snapshot = self.learner.request_snapshot(p, timeout=timeout)
        if snapshot is None:
            self._bump("rounds_skipped")
            self.events(event | {"outcome": "no_snapshot", "t_end": time.time()})
            return
        self._idle[p].clear()
        try:
            self._average_and_apply(p, slot, state, snapshot, event)
        finally:
            self._idle[p].set()

    def _average_and_apply(self, p: int, slot: RoundSlot, state: FragmentState, snapshot: Snapshot, event: dict):
        cfg = self.config
        delta = outer.pseudo_gradient(state.theta, snapshot.params)
        if not outer.all_finite(delta):
            self._recover_from_nonfinite(p, state, event)
            return
        clipped = outer.clip_(delta, cfg.max_delta)
        weight = outer.token_weight(snapshot.tokens, snapshot.steps) / WEIGHT_UNIT
        # RDA sends unit directions (their norms travel in the gathered metadata), the mean sends Delta
        values, norms = outer.wire_values(delta, self.rda[p])
        averager = self.averagers[p]
        with averager.get_tensors() as buffers:
            if self.levels:  # raw values: the averager puts them on the round's shared grid (wire.py)
                for value, buffer in zip(values, buffers):
                    buffer.copy_(value)
            else:
                outer.encode_for_wire(values, buffers, self.offsets[p])
            corrupt = self.corrupt  # read once: SIGUSR2 may toggle it meanwhile (testing only)
            if corrupt:
                outer.corrupt_(buffers, corrupt)
            sent_max = outer.max_abs_sent(buffers, 0.0 if self.levels else self.offsets[p])
            extra = {"exponents": wire.exponents_report(buffers, self.levels)} if self.levels else {}
        gather = dict(island=self.island, version=state.version, hash=state.hash, weight=weight,
                      tokens=snapshot.tokens, steps=snapshot.steps, delta_max=sent_max, norms=norms, **extra)
        self._keep_away_from_flagged(averager)
        # past the slot, keep looking for members (up to K, hivemind's min_group_size) for the grace window
        deadline = slot.time + max(cfg.grace_window, cfg.request_timeout)
        self.traffic[p, 2] = -1  # unknown until the averager tells
        self.shared[p]["grid"].fill_(wire.TOP_EXPONENT)  # (a grid that carries nothing, until it tells)
        traffic_before = self.traffic[p, :2].clone()
        gathered = self._all_reduce(averager, gather, weight, slot.time, deadline)
        self._count_round_traffic(p, traffic_before, time.time() - slot.time, event)
        event |= {"base_version": state.version, "base_hash": state.hash, "weight": weight,
                  "tokens": snapshot.tokens, "steps": snapshot.steps, "clipped": clipped,
                  "contributed": snapshot.steps > 0}
        with self._stats_lock:
            self.stats.clipped += clipped
        if self._stop.is_set():  # shutting down: the round is abandoned, not failed
            self.events(event | {"outcome": "cancelled", "t_end": time.time()})
            return

        members = [m for m in (gathered or {}).values() if _valid_member(m)]
        base = snapshot.params  # what the learner's progress is measured from when the result lands
        event["unaveraged"] = 0.0  # share of the fragment no reducer averaged (zeroed): a dropped member
        if gathered is not None and len(members) >= 2:
            merged, sent = self._read_result(p, averager, values)
            culprits = self._misreporting(p, members)
            if culprits or not self._valid_result(p, merged):
                self._reject(members, event, culprits)
                return
            masks = self._unaveraged_masks(p, merged, sent, members, weight)
            if masks is not None:
                for tensor, value, mask, use_rda in zip(merged, sent, masks, self.rda[p]):
                    if use_rda and bool(mask.any()):
                        mask.fill_(True)  # a direction with a hole has no norm to rescale to: drop it all
                    tensor.masked_fill_(mask, 0.0)  # +0.0: the same bits on every member
                    value.masked_fill_(mask, 0.0)  # not averaged: as if not sent
                event["unaveraged"] = sum(int(mask.sum()) for mask in masks) / max(1, sum(t.numel() for t in merged))
            merged = outer.merge_result(merged, self.rda[p], _member_norms(members, len(merged)),
                                        [max(m["weight"], LISTENER_WEIGHT) for m in members])
            if not outer.all_finite(merged):
                self._reject(members, event, [])
                return
            # what we could not send (quantization error, parts no reducer averaged; everything for a
            # listener) stays in our local parameters and goes into our next round (error feedback
            # through the carry base). An RDA tensor lands as our norm along our (rounded) direction.
            if weight <= 0.0:
                sent = [torch.zeros_like(d) for d in delta]
            else:
                sent = [outer.rescale(s, n) if rda else s for s, n, rda in zip(sent, norms, self.rda[p])]
            base = [local + (d - s) for local, d, s in zip(snapshot.params, delta, sent)]
        if gathered is not None and len(members) >= 2 and event["unaveraged"] < 1.0:
            new_state = self._apply_group_result(p, state, members, merged, event)
        else:
            new_state = self._stepped(state, delta, state.version + 1, 1)
            self._bump("rounds_failed")
            event |= {"outcome": "fallback", "group_size": 1 if gathered is None else len(members)}
        if new_state is not state:
            self._hand_over(p, new_state, base=base if event["outcome"] == "ok" else snapshot.params,
                            reason=event["outcome"],
                            not_before=snapshot.step + cfg.overlap_steps if cfg.overlap_steps else 0)
        self.events(event | {"new_version": new_state.version, "new_hash": new_state.hash, "t_end": time.time()})

    def _read_result(self, p: int, averager, values: list[torch.Tensor]):
        """The round's merged wire values (mean Delta, or mean unit direction for RDA tensors) and the
        values this member actually sent, both in value space (fp32, shapes of the fragment); with a
        low-bit codec, on the grid the averager process used (its word, from shared memory)."""
        with averager.get_tensors() as buffers:
            received = [t.clone() for t in buffers]
        if not self.levels:
            return outer.decode_from_wire(received, self.offsets[p]), outer.wire_roundtrip(values, self.offsets[p])
        grid = wire.split_grid(self.shared[p]["grid"], self.shapes[p])
        self._grids[p] = grid
        sent = [wire.quantize(v, e, self.levels) for v, e in zip(values, grid)]
        return [wire.from_wire(r, e) for r, e in zip(received, grid)], sent

    def _valid_result(self, p: int, merged: list[torch.Tensor]) -> bool:
        """The averaged values are what honest members can produce: finite, within the bounds, and on
        a low-bit grid within its range (else some member sent garbage or values off the grid)."""
        if not outer.within_bound(merged, self.bounds[p]):
            return False
        if self.levels:
            return all(wire.within_grid(t, e, self.levels) for t, e in zip(merged, self._grids[p]))
        return True

    def _misreporting(self, p: int, members: list[dict]) -> list[str]:
        """Members whose gathered metadata no honest member would send: a largest sent value out of
        bounds (NaN, Inf, huge), grid exponents beyond what that value needs, or RDA norms that no
        clipped pseudo-gradient can have. Their round is rejected and they are flagged."""
        culprits = []
        for m in members:
            honest = _reported_within(m.get("delta_max"), self.report_bound)
            if honest and self.levels:
                report = m.get("exponents")
                needed = wire.ceiling_exponent(max(float(m["delta_max"]), 0.0), self.levels)
                honest = (isinstance(report, (bytes, bytearray)) and len(report) == 2 * self.chunks[p]
                          and int(np.frombuffer(report, dtype="<i2").max(initial=wire.EMPTY_EXPONENT)) <= needed)
            if honest and any(self.rda[p]):
                norms = m.get("norms")
                honest = isinstance(norms, list) and len(norms) == len(self.rda[p]) and all(
                    isinstance(n, (int, float)) and 0.0 <= n <= limit for n, limit in zip(norms, self.norm_limits[p]))
            if not honest:
                culprits.append(m["island"])
        return sorted(c for c in culprits if c != self.island)

    def _unaveraged_masks(self, p: int, merged: list[torch.Tensor], sent: list[torch.Tensor], members: list[dict],
                          weight: float) -> Optional[list[torch.Tensor]]:
        """Where hivemind dropped a member that stopped answering mid-round: the parts it was to
        reduce kept each member's own values. They get a zero merged pseudo-gradient (alike on every
        member that saw the same failure) and the island keeps its local progress there.

        The averager records those elements exactly (``shared["failed_mask"]``); only if it could not
        (``failed == -1``) are they guessed from the result (:func:`outer.find_unaveraged`)."""
        failed = int(self.traffic[p, 2])
        if failed == 0:
            return None
        if failed > 0:
            mask = self.shared[p]["failed_mask"].to(torch.bool)
            return [part.view(t.shape).clone() for part, t in zip(torch.split(mask, [t.numel() for t in merged]), merged)]
        total = sum(max(m["weight"], LISTENER_WEIGHT) for m in members)
        if total <= 0 or 1.0 - max(weight, LISTENER_WEIGHT) / total < MIN_OTHERS_SHARE:
            return None  # the others weigh next to nothing (listeners): nothing to tell apart
        size = sum(t.numel() for t in merged)
        return outer.find_unaveraged(merged, sent, min_run=min(1024, max(2, size // 64)))

    def _count_round_traffic(self, p: int, before: torch.Tensor, seconds: float, event: dict) -> None:
        """Bytes the fragment's averager moved during the round (counted by its codec), and the peak
        bytes per inner step: a round's bytes spread over the inner steps it lasted (at least one)."""
        sent, received = (int(v) for v in (self.traffic[p, :2] - before).tolist())
        event |= {"bytes_sent": sent, "bytes_received": received}
        steps = max(1.0, max(0.0, seconds) / max(1e-6, self.learner.step_time))
        with self._stats_lock:
            self.stats.peak_bytes_per_step = max(self.stats.peak_bytes_per_step, int((sent + received) / steps))

    def _apply_group_result(self, p: int, state: FragmentState, members: list[dict], merged: list[torch.Tensor],
                            event: dict) -> FragmentState:
        """The new state after a round of 2+ members: the outer step on the canonical base, or the
        result downloaded from a member that holds it when our base was older or a fork."""
        base = (state.version, state.hash)
        canonical = outer.canonical_base([(m["version"], m["hash"]) for m in members])
        new_version = max(m["version"] for m in members) + 1
        support = sum((m["version"], m["hash"]) == canonical for m in members)
        with self._stats_lock:
            self.stats.rounds_ok += 1
            self.stats.group_sizes.append(len(members))
        event |= {"outcome": "ok", "group_size": len(members), "members": sorted(m["island"] for m in members),
                  "group_max_version": new_version - 1, "canonical": base == canonical}
        if sum(m["weight"] for m in members) <= 0.0:
            event["outcome"] = "empty"  # nobody trained anything since the last round: nothing to apply
            return state
        if base == canonical:
            return self._stepped(state, merged, new_version, support)
        budget = self.config.allreduce_timeout + self.config.grace_window
        fresh = self._download_until(p, min_version=new_version, deadline=time.monotonic() + budget)
        event["reloaded"] = fresh is not None
        # without a donor, keep training on our own fork: the next round's base check heals it
        return fresh if fresh is not None else self._stepped(state, merged, new_version, 1)

    def _reject(self, members: list[dict], event: dict, culprits: Optional[list[str]] = None) -> None:
        """A member sent NaN, Inf, unclipped values or lied in its metadata: the round's result is not
        applied by anyone (every member sees the same result and metadata and decides alike, so their
        Theta stay identical and no inner progress is lost: it goes into the next round). Members whose
        own report of what they sent is out of bounds (or ``culprits`` found otherwise) are flagged and
        kept out of our later rounds."""
        culprits = sorted(set(culprits or []) | {
            m["island"] for m in members if m["island"] != self.island
            and not _reported_within(m.get("delta_max"), self.report_bound)})
        for island in culprits:
            seconds = self._flag(island, "caught")
            if seconds:
                logger.error("island %s sent an invalid pseudo-gradient: flagged, its rounds are avoided for %.0f s",
                             island, seconds)
        self._bump("rounds_rejected")
        self.events(event | {"outcome": "rejected", "group_size": len(members), "culprits": culprits,
                             "members": sorted(m["island"] for m in members), "t_end": time.time()})

    def adopt_flags(self, reports: Sequence[tuple[str, Sequence[str]]]) -> list[str]:
        """Flag the islands that a strict majority of the other live islands flagged (their records'
        ``flagged``), so that a restarted island keeps away from a faulty one at once instead of
        meeting it under the default group key first. Only islands this one never flagged: otherwise
        islands would re-adopt each other's flags and no probation would ever end. ``reports``:
        (island, islands it flagged) of the other live islands. Returns the islands newly flagged."""
        adopted = []
        for culprit in sorted({c for _, flags in reports for c in flags}):
            if culprit == self.island or culprit in self.strikes:
                continue  # ours to judge: we caught it (or adopted it) before, and its probation is ours
            voters = [flags for island, flags in reports if island != culprit]
            if voters and 2 * sum(culprit in flags for flags in voters) > len(voters) and self._flag(culprit, "adopted"):
                logger.warning("island %s was flagged by %d of %d other islands: its rounds are avoided",
                               culprit, sum(culprit in flags for flags in voters), len(voters))
                adopted.append(culprit)
        return adopted

    def _flag(self, island: str, how: str) -> float:
        """Keep ``island`` out of our rounds for its probation (``flag_probation``, doubled with each
        strike: a transient fault costs little, a persistent one is retried ever more rarely, and a
        retry costs one rejected round, no inner progress). The probation ends halfway between two
        rounds on the swarm-wide clock, so islands that caught it in the same round free it alike.
        Returns the probation in seconds, or 0 if the island is flagged already."""
        with self._flags_lock:  # round threads catch, the reporter's thread adopts
            if island in self.flagged:
                return 0.0
            self.strikes[island] = self.strikes.get(island, 0) + 1
            seconds = self.config.flag_probation * 2.0 ** min(self.strikes[island] - 1, 16)
            # halfway between two rounds' checks (made about matchmaking_time before each slot)
            step = self.clock.period / self.clock.num_fragments
            shift = self.config.matchmaking_time - step / 2
            self.flagged[island] = math.ceil((time.time() + seconds + shift) / step) * step - shift
        self.events({"event": "flag", "culprit": island, "how": how, "seconds": seconds})
        return seconds

    def _expire_flags(self) -> None:
        """End the probations that are over: those islands may join our rounds again."""
        now = time.time()
        with self._flags_lock:
            over = [island for island, until in self.flagged.items() if until <= now]
            for island in over:
                del self.flagged[island]
        for island in over:
            logger.warning("island %s: probation over, its rounds are no longer avoided", island)
            self.events({"event": "unflag", "culprit": island})

    def _keep_away_from_flagged(self, averager) -> None:
        """Meet only islands that flagged the same ones: the group key gets bits derived from the
        flagged names (hivemind changes non-empty bits after each round, so they are set every time),
        and no bits once no island is flagged any more."""
        self._expire_flags()
        flagged = sorted(list(self.flagged))
        if not flagged and not self.strikes:
            return  # never flagged anyone: the default key, untouched
        bits = format(hashlib.sha256("|".join(flagged).encode()).digest()[0], "08b") if flagged else ""
        try:
            averager.set_group_bits(bits)
        except Exception as e:
            logger.debug("could not set group bits: %r", e)

    def _recover_from_nonfinite(self, p: int, state: FragmentState, event: dict) -> None:
        """The island's own parameters went NaN/Inf: never send them; replace them by the global ones
        (from peers if they have newer, else our own Theta_p) and clear the inner optimizer's state."""
        logger.error("fragment %d: local parameters have NaN/Inf; not contributing, resetting them", p)
        fresh = self._download_until(p, min_version=state.version, deadline=time.monotonic() + 2.0)
        self._hand_over(p, fresh or state, base=None, reason="reload", reset_optimizer=True)
        self._bump("rounds_skipped")
        self.events(event | {"outcome": "nonfinite", "reloaded": fresh is not None, "t_end": time.time()})

    def _all_reduce(self, averager, gather: dict, weight: float, scheduled: float, deadline: float):
        """One hivemind averaging round; returns {peer: gathered metadata}, or None if it failed or
        the syncer is stopping. A slot is one-shot (no retries: a retry would average buffers that the
        failed attempt already changed)."""
        if not averager.is_alive():  # step() would wait forever for a dead process; the island's watchdog stops us
            return None
        control = None
        try:
            control = averager.step(
                gather=gather, weight=max(weight, LISTENER_WEIGHT), scheduled_time=scheduled,
                timeout=max(0.5, deadline - time.time()), allow_retries=False, wait=False,
            )
            # hivemind bounds the all-reduce by allreduce_timeout once the group formed; on a loaded
            # machine its event loop may report late, so allow as much again before giving up
            budget = deadline - time.time() + 2.0 * self.config.allreduce_timeout + 1.0
            while budget > 0 and not self._stop.is_set():
                try:
                    return control.result(timeout=min(0.5, budget))
                except FutureTimeout:
                    budget -= 0.5
            control.cancel()
            return None
        except Exception as e:  # no group, a peer vanished mid-round, a timeout
            logger.debug("round failed: %r", e)
            if control is not None and not control.done():
                control.cancel()
            # the future keeps the exception, whose traceback holds this frame and its callers' (the
            # snapshot, the pseudo-gradient): a reference cycle that only a full GC would free, so
            # the island's memory grew by a fragment or two per failed round (scripts/bench_rss.py)
            e.__traceback__ = None
            return None
        finally:
            control = None

    def _stepped(self, state: FragmentState, merged: list[torch.Tensor], version: int, support: int) -> FragmentState:
        theta = [t.clone() for t in state.theta]
        momentum = [m.clone() for m in state.momentum]
        outer.outer_step(theta, merged, momentum, lr=self.config.lr, momentum=self.config.momentum,
                         nesterov=self.config.nesterov)
        return FragmentState(theta, momentum, version, outer.tensors_hash(theta), support)

    def _hand_over(self, p: int, state: FragmentState, *, base: Optional[list[torch.Tensor]], reason: str,
                   reset_optimizer: bool = False, not_before: int = 0) -> None:
        """Make ``state`` the island's Theta_p and send it to the learner; ``base`` is what the
        learner's progress is measured from (None: replace the local parameters outright);
        ``not_before``: the inner step before which the learner keeps training without it (overlap).
        Delivery and publication happen together under a lock, so :meth:`consistent_states` never
        sees one without the other."""
        if base is None:
            update = OuterUpdate(p, "replace", state.theta, 0.0, state.version, reason, reset_optimizer)
        elif self.config.apply == "mix":
            update = OuterUpdate(p, "mix", state.theta, self.config.alpha, state.version, reason,
                                 not_before_step=not_before)
        else:
            update = OuterUpdate(p, "carry", outer.carry_correction(state.theta, base), 0.0, state.version, reason,
                                 not_before_step=not_before)
        with self._commit_lock:
            self.learner.deliver(update)
            if self.states[p] is not state:
                self._publish(p, state)

    def consistent_states(self, apply_updates: Callable[[], None]) -> list[FragmentState]:
        """The current Theta states, with ``apply_updates`` (the learner's, applying every delivered
        update) run under the same lock: the local parameters then include exactly the updates of the
        states returned (checkpoints)."""
        with self._commit_lock:
            apply_updates()
            return list(self.states)

    def _bump(self, counter: str) -> None:
        with self._stats_lock:
            setattr(self.stats, counter, getattr(self.stats, counter) + 1)


def _reported_within(value, bound: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and abs(value) <= bound


def _member_norms(members: list[dict], count: int) -> list[list[float]]:
    """Each member's per-tensor norms from its gathered metadata (zeros where malformed)."""
    norms = []
    for member in members:
        values = member.get("norms")
        ok = isinstance(values, list) and len(values) == count and all(
            isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in values)
        norms.append([float(v) for v in values] if ok else [0.0] * count)
    return norms


def _valid_member(member) -> bool:
    return (
        isinstance(member, dict)
        and isinstance(member.get("version"), int)
        and isinstance(member.get("hash"), str)
        and isinstance(member.get("weight"), (int, float))
        and math.isfinite(member["weight"])
        and member["weight"] >= 0
        and isinstance(member.get("island"), str)
    )
