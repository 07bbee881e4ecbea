"""One fragment's rounds and state downloads behind a small interface, :class:`FragmentChannel`
(docs/DESIGN.md, "One round"). :class:`HivemindChannel` implements it over one hivemind averager
process (:mod:`p2p_diloco.net.averager`), reading what that process reports through shared memory.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Optional, Protocol, Sequence

import torch

from p2p_diloco.algo import grid
from p2p_diloco.net.averager import make_fragment_averager
from p2p_diloco.net.gate import CERTIFICATE_FIELD
from p2p_diloco.net.reducer import MergeRule, OutlierBook

logger = logging.getLogger(__name__)


def _without_certificate(member):
    """A member's gathered metadata as the island reads it (the certificate was for the gate)."""
    if isinstance(member, dict):
        member = {k: v for k, v in member.items() if k != CERTIFICATE_FIELD}
    return member


@dataclass
class RoundReport:
    """What the averager process said about a channel's last all-reduce.

    :param grid: int16 chunk exponents of the shared grid it used (every tensor's in sequence), or
        None for plain fp32 rounds
    :param failed: elements whose reducer failed (they kept this member's own values); -1 when they
        could not be recorded exactly
    :param failed_mask: uint8 per element (fragment order), 1 where the reducer failed (valid when
        ``failed > 0``)
    :param outliers: peer id -> (parts this member reduced with that peer, parts in which the peer
        was an outlier) (:class:`p2p_diloco.net.reducer.OutlierBook`); empty without a merge rule
    :param reducers: int16 per element (fragment order): the index in ``peers`` of the member that
        reduced it (-1: unknown); None when not recorded. Shared memory, valid until the next round
    :param peers: the round's members (peer ids) in the group's order
    :param formed_at: when the group was formed and its all-reduce began (swarm time, seconds, as the
        averager process saw it), or None if it never was
    """

    grid: Optional[torch.Tensor]
    failed: int
    failed_mask: torch.Tensor
    outliers: dict = field(default_factory=dict)
    reducers: Optional[torch.Tensor] = None
    peers: list = field(default_factory=list)
    formed_at: Optional[float] = None


class FragmentChannel(Protocol):
    """One fragment's averaging rounds and state transfers, as the island's rounds use them. A real
    averager (:class:`HivemindChannel`) and a test double implement the same methods."""

    def tensors(self) -> ContextManager[list[torch.Tensor]]:
        """The buffers a round averages in place (fp32, the fragment's shapes), locked while held."""

    def all_reduce(self, *, gather: dict, weight: float, scheduled_time: float, deadline: float,
                   stop) -> Optional[dict]:
        """One round: meet the members that show up at ``scheduled_time`` (swarm time, seconds since the
        epoch), looking for a quorum until ``deadline``, and average the buffers with them (weight > 0). Returns
        {peer: gathered metadata} of the group, or None if the round failed or ``stop`` was set."""

    def report(self) -> RoundReport:
        """The grid and failed parts of the last :meth:`all_reduce`."""

    def traffic(self) -> tuple[int, int]:
        """Bytes of round messages sent and received so far."""

    @property
    def serves(self) -> bool:
        """Whether others can dial us for parts and state (False for a client-mode member)."""

    def refused(self) -> list[str]:
        """Peer ids the channel's gate refused (a private run; empty otherwise)."""

    def set_group_bits(self, bits: str) -> None:
        """Meet only members whose group key carries these bits ("" for the default key)."""

    def set_donor_priority(self, priority: float) -> None:
        """Donors of higher priority are asked first by downloaders."""

    def share_state(self) -> None:
        """Start serving the fragment's state to downloaders."""

    def load_state(self, timeout: float, peers: Optional[Sequence[str]] = None
                   ) -> Optional[tuple[dict, list[torch.Tensor]]]:
        """(metadata, tensors) downloaded from the best donor, or with ``peers`` (peer ids) from the
        first of those that serves one; None: nobody, a timeout."""

    def is_alive(self) -> bool:
        """False once the channel's helper process died."""

    def close(self, timeout: float = 5.0) -> None:
        """End the channel (after the DHT is shut down)."""


class HivemindChannel:
    """A :class:`FragmentChannel` over one hivemind averager process (forked by the constructor:
    create it from the main thread, see :mod:`p2p_diloco.procs`).

    :param dht: a running ``hivemind.DHT``
    :param shapes: the fragment's parameter shapes
    :param codec: the run's ``outer.codec`` (``none``, ``fp16``, ..., ``int2``)
    :param ceilings: per tensor, the largest grid exponent an honest member needs (low-bit codecs)
    :param state_provider: returns (metadata, tensors) served to peers that download the fragment
    :param allreduce_timeout: seconds an all-reduce may take once the group formed
    :param admission: a private run's :class:`p2p_diloco.net.gate.Admission` (None: an open run)
    :param clock: the island's :class:`p2p_diloco.algo.clock.SwarmClock`: the averager process then runs
        on swarm time, and :meth:`all_reduce` takes swarm times (None: this machine's wall clock)
    :param merge_rule: how this member reduces its parts (:class:`p2p_diloco.net.reducer.MergeRule`;
        None: hivemind's weighted mean of the senders' own weights)
    :param kwargs: ``prefix``, ``quorum``, ``matchmaking_time``, ``request_timeout`` of
        :func:`make_fragment_averager`
    """

    clock = None

    def __init__(self, dht, *, shapes: Sequence[torch.Size], codec: str, ceilings: Sequence[int],
                 state_provider: Callable[[], tuple[dict, list[torch.Tensor]]], allreduce_timeout: float,
                 admission=None, clock=None, merge_rule: Optional[MergeRule] = None, **kwargs):
        from p2p_diloco.net import codec as codecs

        self.allreduce_timeout = allreduce_timeout
        self.clock = clock
        # seconds this machine's clock is ahead of the swarm's, read by the averager process on every
        # time it takes (docs/DESIGN.md, "Clocks")
        self._clock_offset = torch.zeros(1, dtype=torch.float64).share_memory_()
        if clock is not None:  # (measured at start: state declarations before the first round use it)
            self._clock_offset[0] = clock.offset
        self.levels = grid.levels_of(codec)
        numel = sum(int(torch.Size(shape).numel()) for shape in shapes)
        # Theta_p and m_p in fp32, and room for the messages' headers and metadata: a donor that streams
        # more, or more tensors, is dropped (a download by peer id)
        # (hivemind streams 64 KiB parts; download_state counts 64 bytes more per message)
        self._state_bytes = 2 * 4 * numel + 4096 * (2 * len(shapes) + 1) + numel // 64
        self._state_tensors = 2 * len(shapes)
        # bytes sent, bytes received (counted by the codec), elements whose reducer failed (-1: unknown)
        self._traffic = torch.zeros(3, dtype=torch.int64).share_memory_()
        self._shared = {"grid": torch.zeros(grid.num_chunks(shapes), dtype=torch.int16).share_memory_(),
                        "failed_mask": torch.zeros(numel, dtype=torch.uint8).share_memory_(),
                        "failed": self._traffic[2:], "outliers": OutlierBook.allocate(),
                        "formed_at": torch.zeros(1, dtype=torch.float64).share_memory_(),
                        "reducers": torch.full((numel,), -1, dtype=torch.int16).share_memory_()}
        self._peers: list = []  # the last round's members in the group's order (rows of "outliers")
        # a private run: the certificate goes with every join request; refused peer ids come back here
        self._certificate = {CERTIFICATE_FIELD: admission.certificate.to_bytes()} if admission is not None else {}
        self._refused = torch.zeros(16, 64, dtype=torch.uint8).share_memory_()
        gate = admission.averager_gate(self._refused) if admission is not None else None
        wire_codec = codecs.make_codec(codec, self._traffic[:2])
        codecs.install(wire_codec)  # in the averager forked next: decodes and encodes the round's messages
        self.averager = make_fragment_averager(
            [torch.zeros(shape) for shape in shapes], dht, codec=wire_codec, levels=self.levels,
            shared=self._shared, ceilings=ceilings, state_provider=state_provider,
            allreduce_timeout=allreduce_timeout, gate=gate, clock_offset=self._clock_offset, merge_rule=merge_rule,
            **kwargs)

    def tensors(self) -> ContextManager[list[torch.Tensor]]:
        return self.averager.get_tensors()

    def all_reduce(self, *, gather: dict, weight: float, scheduled_time: float, deadline: float,
                   stop) -> Optional[dict]:
        """See :class:`FragmentChannel`. A slot is one-shot (no retries: a retry would average buffers
        that the failed attempt already changed)."""
        self._traffic[2] = -1  # unknown until the averager tells
        self._peers = []
        formed = self._shared.get("formed_at")  # (set by the averager process once the group formed)
        if formed is not None:
            formed.fill_(0.0)
        self._shared["grid"].fill_(grid.TOP_EXPONENT)  # (a grid that carries nothing, until it tells)
        if not self.averager.is_alive():  # step() would wait forever for a dead process
            return None
        if self.clock is not None:
            self._clock_offset[0] = self.clock.offset
        now = self.clock.now if self.clock is not None else time.time
        if self.averager.client_mode:
            # a client can only join a full member's group, and that leader refuses a request that
            # expires before its own declared expiration (hivemind's BAD_EXPIRATION_TIME): a leader that
            # started late, or whose clock estimate puts the slot a few ms later than ours, would refuse
            # us, and no other leader can take us. Offer the latest moment we still wait for instead.
            # (a hair before it: hivemind asserts that the scheduled time comes before the step's deadline)
            scheduled_time = max(scheduled_time, deadline - 0.05)
        control = None
        try:
            # step() runs here and adds the timeout to this machine's wall clock: this timeout makes
            # its deadline the swarm-time one, which the averager process reads on swarm time
            control = self.averager.step(gather=gather | self._certificate, weight=weight, scheduled_time=scheduled_time,
                                         timeout=max(deadline, now() + 0.5) - time.time(), allow_retries=False,
                                         wait=False)
            # hivemind bounds the all-reduce by allreduce_timeout once the group formed; on a loaded
            # machine its event loop may report late, so allow as much again before giving up
            budget = deadline - now() + 2.0 * self.allreduce_timeout + 1.0
            while budget > 0 and not stop.is_set():
                try:
                    gathered = control.result(timeout=min(0.5, budget))
                    self._peers = list(gathered)
                    return {peer: _without_certificate(m) for peer, m in gathered.items()}
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

    def report(self) -> RoundReport:
        formed = self._shared.get("formed_at")
        return RoundReport(self._shared["grid"].clone() if self.levels else None, int(self._traffic[2]),
                           self._shared["failed_mask"], OutlierBook.read(self._shared["outliers"], self._peers),
                           self._shared["reducers"], list(self._peers),
                           (float(formed[0]) or None) if formed is not None else None)

    @property
    def serves(self) -> bool:
        """False for a client-mode averager (behind NAT: nobody can dial it)."""
        return not self.averager.client_mode

    def traffic(self) -> tuple[int, int]:
        sent, received = self._traffic[:2].tolist()
        return int(sent), int(received)

    def refused(self) -> list[str]:
        return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in self._refused.tolist() if row[0]]

    def set_group_bits(self, bits: str) -> None:
        try:
            self.averager.set_group_bits(bits)
        except Exception as e:
            logger.debug("could not set group bits: %r", e)

    def set_donor_priority(self, priority: float) -> None:
        try:
            self.averager.state_sharing_priority = priority
        except Exception as e:
            logger.debug("could not update donor priority: %r", e)

    def share_state(self) -> None:
        self.averager.allow_state_sharing = True

    def load_state(self, timeout: float, peers: Optional[Sequence[str]] = None
                   ) -> Optional[tuple[dict, list[torch.Tensor]]]:
        try:
            if peers is not None:
                return self.averager.load_state_from(peers, timeout=timeout, max_bytes=self._state_bytes,
                                                     max_tensors=self._state_tensors)
            return self.averager.load_state_from_peers(wait=True, timeout=timeout)
        except Exception as e:
            logger.debug("state download failed: %r", e)
            return None

    def is_alive(self) -> bool:
        return self.averager.is_alive()

    @property
    def exitcode(self) -> Optional[int]:
        """The averager process's exit code (None while it runs)."""
        return self.averager.exitcode

    def close(self, timeout: float = 5.0) -> None:
        """End the averager process; call after the DHT (and with it p2pd) is shut down.

        Order matters: an averager that exits while one of its DHT requests is still queued crashes
        hivemind's DHT process (the request's reply pipe can no longer be fetched from the dead
        sender), so the DHT goes first. With p2pd gone, an averager's graceful shutdown (which
        unregisters its handlers from p2pd) can only fail, so the averager gets SIGTERM: rounds have
        stopped and it holds no state of its own. For the same reason there is no
        ``allow_state_sharing = False`` here: donor entries simply expire.
        """
        if self.averager.is_alive():
            self.averager.terminate()
        self.averager.join(timeout)
        if self.averager.is_alive():
            self.averager.kill()
            self.averager.join(timeout)
