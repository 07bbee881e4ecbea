"""The swarm-wide round clock."""

import pytest

from p2p_diloco.algo.schedule import RoundClock, turn_group


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


def test_groups_take_turns_on_slots_g_times_as_often():
    """With G groups, fragment p's slots come every T_outer / G and slot k is group k mod G's: each
    group's slots are one period apart, and the groups' slots interleave (docs/DESIGN.md, "Groups
    that take turns")."""
    clock = RoundClock(period=20.0, num_fragments=2, groups=4)
    assert clock.spacing == 5.0
    assert [clock.slot_time(1, k) for k in (8, 9)] == [42.5, 47.5]
    for after in (0.0, 41.0, 42.5, 99.9):
        slots = [clock.next_slot(1, after, group) for group in range(4)]
        assert [slot.index % 4 for slot in slots] == [0, 1, 2, 3]
        assert all(after < slot.time <= after + 20.0 for slot in slots)
        first = clock.next_slot(1, after)  # the swarm's next slot, whichever group's
        assert sorted(slot.time for slot in slots) == [first.time + 5.0 * i for i in range(4)]
    one = RoundClock(period=20.0, num_fragments=2)
    assert one.next_slot(1, 41.0) == one.next_slot(1, 41.0, 0)


def test_turn_groups_are_balanced_and_every_island_agrees_on_the_same_live_set():
    names = [f"island-{i}" for i in range(10)]
    groups = {name: turn_group(name, [n for n in names if n != name], 3) for name in names}
    sizes = sorted(list(groups.values()).count(g) for g in range(3))
    assert sizes == [3, 3, 4]
    assert turn_group("island-0", [], 3) == 0  # alone (no records read yet): group 0
    assert turn_group("island-5", names, 1) == 0
