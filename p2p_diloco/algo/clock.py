"""Swarm time: one island's estimate of how far its wall clock is from its peers' (docs/DESIGN.md, "Clocks").

Rounds happen at swarm-wide wall-clock slots (:mod:`p2p_diloco.algo.schedule`). Islands whose clocks
disagree by a second or two would miss each other's matchmaking, so each island measures its offset
to the peers it talks to, NTP-style (RFC 5905, Sec. 8: the offset of one exchange is the peer's time
minus the midpoint of our send and receive times, good to half the round-trip time), and schedules on
swarm time: its own clock minus that offset. Per peer the sample with the shortest round trip is kept
(NTP's clock filter); the swarm's time is the median over the peers and our own clock, so one peer
with a wrong or lying clock cannot move it, and members that see the same peers compute the same
swarm time.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

MAX_CLOCK_OFFSET = 3.0  # seconds: hivemind's DHT refuses peers further apart (MAX_DHT_TIME_DISCREPANCY_SECONDS)


@dataclass(frozen=True)
class ClockSample:
    """One exchange with a peer: our wall time when we sent ``sent`` and when the reply arrived
    ``received``, and the peer's wall time ``theirs`` in its reply (all seconds since the epoch)."""

    peer: str
    sent: float
    theirs: float
    received: float

    @property
    def rtt(self) -> float:
        """Round-trip time, seconds."""
        return max(0.0, self.received - self.sent)

    @property
    def offset(self) -> float:
        """How far our clock is ahead of the peer's, seconds (negative: behind)."""
        return (self.sent + self.received) / 2.0 - self.theirs


@dataclass(frozen=True)
class ClockEstimate:
    """Our clock's offset to the swarm: ``offset`` seconds ahead (negative: behind), the median over
    ``peers`` peers and our own clock, each peer measured to within ``error`` seconds (half its round
    trip, the largest); ``far`` of the ``measured`` peers are more than :data:`MAX_CLOCK_OFFSET` from
    our clock (those that hivemind's DHT would refuse us)."""

    offset: float
    peers: int
    error: float
    measured: int = 0
    far: int = 0

    @property
    def refused(self) -> bool:
        """Most of the measured peers are too far from our clock for hivemind's DHT to accept us."""
        return 2 * self.far > self.measured

    def describe(self) -> str:
        """E.g. ``2.03 s ahead of the swarm (median of 3 peer(s) and ours, +-0.002 s)``."""
        way = "ahead of" if self.offset >= 0 else "behind"
        return f"{abs(self.offset):.2f} s {way} the swarm (median of {self.peers} peer(s) and ours, +-{self.error:.3f} s)"


def estimate_offset(samples: Iterable[ClockSample]) -> Optional[ClockEstimate]:
    """The median offset over the peers and our own clock (offset 0), each peer's sample with the
    shortest round trip, after dropping clocks more than :data:`MAX_CLOCK_OFFSET` from the first
    median (a peer the DHT would refuse, e.g. a newcomer whose clock is far off, for as long as it is
    in our routing table: of few peers, it would move the median); None without samples.

    Our own clock counts so that members that see the same peers take the median of the same clocks,
    and agree on the swarm's time: without it, of an island on time, one 2 s ahead and a bootstrap
    node on time, each island took the mean of the other two clocks, and the two stayed 1 s apart
    (docs/DESIGN.md, "Clocks")."""
    best: dict[str, ClockSample] = {}
    for sample in samples:
        if sample.peer not in best or sample.rtt < best[sample.peer].rtt:
            best[sample.peer] = sample
    if not best:
        return None
    offsets = [s.offset for s in best.values()]
    middle = statistics.median([0.0, *offsets])  # our own clock is the 0.0
    chosen = [s for s in best.values() if abs(s.offset - middle) <= MAX_CLOCK_OFFSET]
    clocks = [o for o in [0.0, *offsets] if abs(o - middle) <= MAX_CLOCK_OFFSET] or [middle]
    return ClockEstimate(offset=float(statistics.median(clocks)), peers=len(chosen),
                         error=max((s.rtt for s in chosen), default=0.0) / 2.0, measured=len(offsets),
                         far=sum(abs(o) > MAX_CLOCK_OFFSET for o in offsets))


class SwarmClock:
    """Swarm time for one island: its wall clock minus its measured offset (thread-safe).

    :param wall: the local wall clock (seconds since the epoch); tests pass their own
    """

    def __init__(self, wall: Callable[[], float] = time.time):
        self._wall, self._lock = wall, threading.Lock()
        self._estimate = ClockEstimate(0.0, 0, 0.0)

    @property
    def estimate(self) -> ClockEstimate:
        with self._lock:
            return self._estimate

    @property
    def offset(self) -> float:
        """Seconds our clock is ahead of the swarm's (0 until measured)."""
        return self.estimate.offset

    def update(self, estimate: Optional[ClockEstimate]) -> None:
        """Take a new measurement (None, no peer answered: keep the last one)."""
        if estimate is not None:
            with self._lock:
                self._estimate = estimate

    def now(self) -> float:
        """Swarm time, seconds since the epoch."""
        return self._wall() - self.offset


def matchmaking_lead(base: float, offsets: Iterable[float], tolerance: float) -> float:
    """Seconds before a slot at which an island starts matchmaking: ``base`` plus the spread of the
    swarm's clock offsets (``offsets``: those the live islands publish, ours included; seconds ahead
    of the swarm's time, each clipped to +-``tolerance``; the swarm's own time, 0, counts as one).

    hivemind's matchmaking compares the expiration times that members declare on the DHT (their local
    wall-clock times of the slot) with its own wall clock: an island y s ahead of the swarm sees the
    declaration of an island x s behind expire x + y s before the slot. Starting that much earlier
    gives every pair the ``base`` seconds to meet that a swarm of equal clocks has
    (docs/DESIGN.md, "Clocks"). A swarm of equal clocks gets ``base``.
    """
    clipped = [min(tolerance, max(-tolerance, float(o))) for o in offsets if math.isfinite(o)] + [0.0]
    return base + max(clipped) - min(clipped)
