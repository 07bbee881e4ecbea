"""Measuring this peer's clock against the swarm's through the DHT (docs/DESIGN.md, "Clocks").

Every hivemind DHT node answers a ping with its wall time (``PingResponse.dht_time``), and hivemind
refuses peers more than ``MAX_DHT_TIME_DISCREPANCY_SECONDS`` (3 s) apart. :class:`ClockProbe` pings
up to 16 of the DHT's neighbours a few times each and turns the replies into a
:class:`~p2p_diloco.algo.clock.ClockEstimate` (the median over the peers, each by its shortest exchange, and
our own clock).
"""

from __future__ import annotations

import logging
import random
import time
from functools import partial
from typing import Optional

from p2p_diloco.algo.clock import MAX_CLOCK_OFFSET, ClockEstimate, ClockSample, SwarmClock, estimate_offset
from p2p_diloco.errors import NetworkError

logger = logging.getLogger(__name__)

WARN_ABOVE = 0.5  # seconds of measured offset worth a warning: rounds allow about matchmaking_time - 1 s


async def _ping_times(_dht, node, *, max_peers: int, repeats: int, timeout: float) -> list[tuple]:
    """In the DHT process: (peer, sent, theirs, received) of each answered ping to up to ``max_peers``
    routing-table neighbours (connected peers if the table is empty), ``repeats`` pings each."""
    import asyncio

    from hivemind.proto import dht_pb2
    from hivemind.utils import get_dht_time

    peers = list(node.protocol.routing_table.peer_id_to_uid) or [info.peer_id for info in await node.p2p.list_peers()]
    peers = random.sample(peers, min(max_peers, len(peers)))

    async def one(peer) -> list[tuple]:
        answers = []
        for _ in range(repeats):
            request = dht_pb2.PingRequest()  # no node info: the peer answers without adding us to its table
            sent = get_dht_time()
            try:
                response = await asyncio.wait_for(node.protocol.get_stub(peer).rpc_ping(request, timeout=timeout),
                                                  timeout)
            except Exception:
                return answers  # not a DHT server (an observer), gone, or refusing us
            received = get_dht_time()
            if response.dht_time > 0:
                answers.append((str(peer), sent, float(response.dht_time), received))
        return answers

    results = await asyncio.gather(*(one(peer) for peer in peers))
    return [answer for answers in results for answer in answers]


def measure_offset(dht, *, max_peers: int = 16, repeats: int = 3, timeout: float = 1.0) -> Optional[ClockEstimate]:
    """Ping the DHT's neighbours and estimate how far this machine's clock is from theirs.

    :param timeout: seconds one ping may take
    :returns: the estimate, or None if no peer answered (alone in the swarm, or the DHT is down)
    """
    try:
        rows = dht.run_coroutine(partial(_ping_times, max_peers=max_peers, repeats=repeats, timeout=timeout))
    except Exception as e:
        logger.debug("could not measure the clock offset: %r", e)
        return None
    return estimate_offset(ClockSample(peer, sent, theirs, received) for peer, sent, theirs, received in rows)


class ClockProbe:
    """Keeps a :class:`SwarmClock` up to date: measures at start, again ``soon`` seconds later (the
    DHT has met more peers by then: of few clocks, the median is close to their mean), then every ``every`` seconds.

    :param dht: a running ``hivemind.DHT``
    :param clock: the clock to update
    :param every: seconds between measurements (wall clocks drift and get stepped by NTP)
    """

    def __init__(self, dht, clock: SwarmClock, every: float = 30.0, soon: float = 5.0):
        self.dht, self.clock, self.every = dht, clock, every
        self._gap = soon  # seconds from the last measurement to the next
        self._last = float("-inf")
        self._warned = False

    def check_at_start(self) -> Optional[ClockEstimate]:
        """Measure once; refuse a clock that most of the measured peers' DHTs would not accept.

        :raises NetworkError: when most measured peers are more than hivemind's tolerance,
            ``MAX_CLOCK_OFFSET``, from our clock (exit code 3)
        """
        estimate = self.measure()
        if estimate is not None and estimate.refused:
            raise NetworkError(
                f"this machine's clock is {estimate.describe()}, more than {MAX_CLOCK_OFFSET:.0f} s from {estimate.far} "
                f"of the {estimate.measured} peer(s) measured; hivemind's DHT accepts peers at most "
                f"{MAX_CLOCK_OFFSET:.0f} s apart: enable NTP (e.g. 'timedatectl set-ntp true' or chrony) and start again")
        return estimate

    def tick(self) -> None:
        """Measure again when it is time (the reporter's chore)."""
        if time.monotonic() - self._last >= self._gap:
            self._gap = self.every
            self.measure()

    def measure(self) -> Optional[ClockEstimate]:
        self._last = time.monotonic()
        estimate = measure_offset(self.dht)
        self.clock.update(estimate)
        if estimate is not None and abs(estimate.offset) > WARN_ABOVE and not self._warned:
            self._warned = True
            logger.warning("this machine's clock is %s: rounds are scheduled on the swarm's time, but "
                           "enable NTP (e.g. 'timedatectl set-ntp true' or chrony) to keep it close", estimate.describe())
        return estimate
