"""Which state a joiner takes from the live islands' records (pure logic: a fake transfer records
what the joiner asks for)."""

import threading
from types import SimpleNamespace

from p2p_diloco.island import joining


def _record(island, versions, hashes):
    return SimpleNamespace(island=island, fragment_versions=versions, fragment_hashes=hashes)


def _asked(records, *, patience, distrusted=()):
    """What the joiner's download asks for, per fragment, on its first attempt."""
    asked = []
    transfer = SimpleNamespace(load_all=lambda timeout, stop, targets: asked.append(targets()) or False)
    store = SimpleNamespace(num_fragments=2, initialize=lambda params: None)
    joining.join_from_peers(records, transfer=transfer, store=store, learner=SimpleNamespace(fragment_params=[]),
                            events=lambda e: None, timeout=1.0, stop=threading.Event(),
                            read_donors=lambda: records, distrusted=lambda island: island in distrusted,
                            patience=patience)
    return asked[0]


def test_a_joiner_takes_what_trusted_records_vouch_for_then_the_oldest_fork_then_a_flagged_islands():
    forks = [_record("a", [7, 3], ["x", "q"]), _record("b", [9, 3], ["y", "q"])]
    assert _asked(forks, patience=60) == [None, (3, "q")]  # fragment 0 on forks: wait for a round to heal them
    assert _asked(forks, patience=0) == [(7, "x"), (3, "q")]  # waited long enough: the oldest fork
    # a flagged island's record does not count while a trusted one reports...
    faulty = [_record("bad", [50, 3], ["z", "q"]), _record("b", [9, 3], ["y", "q"])]
    assert _asked(faulty, patience=60, distrusted={"bad"}) == [(9, "y"), (3, "q")]
    # ...but when it is the only live donor, the joiner takes its state rather than none
    alone = [_record("bad", [50, 3], ["z", "q"])]
    assert _asked(alone, patience=60, distrusted={"bad"}) == [None, None]
    assert _asked(alone, patience=0, distrusted={"bad"}) == [(50, "z"), (3, "q")]
