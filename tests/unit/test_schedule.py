"""The swarm-wide round clock."""

import pytest

from p2p_diloco.algo.schedule import RoundClock


def test_slots_are_staggered_by_period_over_fragments():
    clock = RoundClock(period=20.0, num_fragments=4)
    times = [clock.slot_time(p, 10) for p in range(4)]
    assert times == [200.0, 205.0, 210.0, 215.0]


@pytest.mark.parametrize("after", [0.0, 4.999, 5.0, 17.3, 1e9 + 0.5])
def test_next_slot_is_the_first_strictly_later(after):
    clock = RoundClock(period=10.0, num_fragments=2)
    for fragment in range(2):
        slot = clock.next_slot(fragment, after)
        assert slot.time > after
        assert clock.slot_time(fragment, slot.index - 1) <= after
        assert slot.time == clock.slot_time(fragment, slot.index)


def test_islands_of_any_speed_agree_on_slots():
    """Slots depend only on the wall clock: two islands asking at different moments of the same
    period get the same next round."""
    clock = RoundClock(period=8.0, num_fragments=2)
    assert clock.next_slot(1, 100.2) == clock.next_slot(1, 103.9)
    assert clock.next_slot(1, 105.0).time < clock.next_slot(0, 105.0).time  # fragment 1's turn comes first


def test_bad_clock():
    with pytest.raises(ValueError):
        RoundClock(period=0.0, num_fragments=2)
