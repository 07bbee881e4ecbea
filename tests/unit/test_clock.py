"""Swarm time: offset estimates from ping exchanges, the swarm clock, the matchmaking lead."""

import pytest

from p2p_diloco.algo.clock import (MAX_CLOCK_OFFSET, ClockEstimate, ClockSample, SwarmClock, estimate_offset,
                                   matchmaking_lead)


def test_one_exchange_gives_the_offset_to_within_half_its_round_trip():
    # we send at 100.0 (our clock), the peer answers 97.9 (its clock), the reply arrives at 100.2
    sample = ClockSample("peer", sent=100.0, theirs=97.9, received=100.2)
    assert sample.rtt == pytest.approx(0.2)
    assert sample.offset == pytest.approx(2.2)  # midpoint 100.1 - 97.9: we are 2.2 s ahead


def test_each_peer_counts_once_with_its_shortest_exchange_and_the_median_wins():
    samples = [
        ClockSample("a", 10.0, 8.0, 10.0),  # a: 2.0 ahead, exact
        ClockSample("a", 10.0, 9.0, 12.0),  # a again, slow exchange (offset 2.0 too, rtt 2): not chosen
        ClockSample("b", 10.0, 8.1, 10.0),  # b: 1.9
        ClockSample("liar", 10.0, 1000.0, 10.0),  # a wild clock: it cannot move the median, and is left out
        ClockSample("c", 10.0, 7.5, 10.0),  # c: 2.5
    ]
    estimate = estimate_offset(samples)
    assert estimate.peers == 3 and estimate.measured == 4 and estimate.far == 1 and not estimate.refused
    assert estimate.offset == pytest.approx(1.95)  # the median of 2.0, 1.9, 2.5 and our own clock's 0
    assert estimate.error == pytest.approx(0.0)
    assert estimate_offset([]) is None


def test_a_peer_further_than_the_dht_accepts_from_the_median_is_left_out():
    # 2 s behind two peers and 4 s behind a third; a newcomer 5 s ahead of the swarm (7 s from us)
    # would make the median of four -3.0
    samples = [ClockSample(p, 10.0, 10.0 + ahead, 10.0) for p, ahead in
               (("boot", 2.0), ("island-0", 2.0), ("ahead", 4.0), ("far", 7.0))]
    estimate = estimate_offset(samples)
    assert estimate.offset == -2.0 and estimate.peers == 3
    # the far-off newcomer itself sees everyone 5 s away, consistently: it is not talked out of it
    far = estimate_offset([ClockSample(p, 10.0, 10.0 - behind, 10.0) for p, behind in
                           (("boot", 5.0), ("island-0", 5.0), ("ahead", 3.0), ("behind", 7.0))])
    assert far.offset == 5.0 and far.peers == 4 and far.refused  # 3 of the 4 are more than 3 s away


def test_members_that_see_the_same_peers_agree_on_the_swarms_time_and_one_skewed_peer_refuses_nobody():
    # a bootstrap node and island-0 on time, "ahead" 2 s ahead, "behind" 2 s behind; behind's DHT
    # has met only the bootstrap node and ahead yet: the mean of those two, 3 s, is past the DHT's
    # bound, but one of its two peers accepts it
    def sees(own: float, **clocks: float):
        return estimate_offset([ClockSample(p, 10.0 + own, 10.0 + clock, 10.0 + own) for p, clock in clocks.items()])

    behind = sees(-2.0, boot=0.0, ahead=2.0)
    assert behind.offset == -2.0 and behind.far == 1 and not behind.refused
    island_0, ahead = sees(0.0, boot=0.0, ahead=2.0), sees(2.0, boot=0.0, island_0=0.0)
    # swarm time (our clock minus the offset) is the same for all three: the median clock, on time
    assert [0.0 - island_0.offset, 2.0 - ahead.offset, -2.0 - behind.offset] == [0.0, 0.0, 0.0]
    # of a bootstrap node and ourselves, nobody can tell which clock is right: the swarm's time is
    # between the two, and 5 s from our only peer is refused
    lone = sees(5.0, boot=0.0)
    assert lone.offset == 2.5 and lone.refused


def test_describe_names_the_direction():
    assert "2.03 s ahead of the swarm" in ClockEstimate(2.03, 3, 0.001).describe()
    assert "0.50 s behind the swarm" in ClockEstimate(-0.5, 1, 0.001).describe()


def test_swarm_clock_is_the_local_clock_minus_the_offset():
    local = [1000.0]
    clock = SwarmClock(wall=lambda: local[0])
    assert clock.now() == 1000.0 and clock.offset == 0.0
    clock.update(ClockEstimate(2.0, 3, 0.01))  # we are 2 s ahead
    assert clock.now() == 998.0
    clock.update(None)  # nobody answered: keep the last estimate
    assert clock.offset == 2.0


def test_the_lead_grows_with_the_spread_of_the_swarms_clocks_and_is_bounded():
    assert matchmaking_lead(3.0, [], MAX_CLOCK_OFFSET) == 3.0
    assert matchmaking_lead(3.0, [0.001, -0.002], MAX_CLOCK_OFFSET) == pytest.approx(3.003)
    assert matchmaking_lead(3.0, [2.0, -2.0, 0.0], MAX_CLOCK_OFFSET) == pytest.approx(7.0)
    assert matchmaking_lead(3.0, [1.5], MAX_CLOCK_OFFSET) == pytest.approx(4.5)  # the swarm's time counts
    # a record claiming a wild offset is clipped to what the DHT accepts
    assert matchmaking_lead(3.0, [1e9, -1e9, float("nan")], MAX_CLOCK_OFFSET) == pytest.approx(9.0)


def test_our_tolerance_is_hivemind_s():
    from hivemind.utils import MAX_DHT_TIME_DISCREPANCY_SECONDS

    assert MAX_CLOCK_OFFSET == MAX_DHT_TIME_DISCREPANCY_SECONDS
