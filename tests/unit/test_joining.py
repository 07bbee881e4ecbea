"""Which state a joiner takes from the live islands' records, through the real StateTransfer and
a fake channel that, as hivemind's ``load_state_from_peers``, serves the donor of the highest
declared priority first (pure logic: no network)."""

import threading
import time
from types import SimpleNamespace

import torch

from p2p_diloco.algo import outer
from p2p_diloco.island import joining
from p2p_diloco.island.store import FragmentStore
from p2p_diloco.island.transfer import StateTransfer

SHAPES = [[torch.Size([3])]]  # one fragment of one tensor
FINGERPRINT = "f"


class Donor:
    """A live island: its record (versions, hashes) and the state it serves at its priority."""

    def __init__(self, island, version, seed, priority):
        self.theta = [torch.full((3,), float(seed))]
        self.island, self.version, self.priority = island, version, priority
        self.hash = outer.tensors_hash(self.theta)
        self.record = SimpleNamespace(island=island, fragment_versions=[version], fragment_hashes=[self.hash])


class Channel:
    """hivemind asks the donor that declared the highest priority; this one always answers."""

    def __init__(self, donors):
        self.donors = donors

    def load_state(self, timeout):
        best = max(self.donors, key=lambda d: d.priority)
        metadata = dict(fingerprint=FINGERPRINT, fragment=0, version=best.version, hash=best.hash)
        return metadata, [*best.theta, torch.zeros(3)]


def _join(donors, *, patience, distrusted=(), timeout=0.6):
    """The (version, hash) the joiner ends with (version 0: the seeded weights)."""
    store = FragmentStore(SHAPES)
    stats = SimpleNamespace(add=lambda **kw: None)
    transfer = StateTransfer(store, stats, fingerprint=FINGERPRINT, events=lambda e: None, allreduce_timeout=5.0,
                             stop=threading.Event())
    transfer.attach([Channel(donors)])
    learner = SimpleNamespace(read=lambda p: [torch.zeros(3)], load_global=lambda p, params: None)
    joining.join_from_peers([d.record for d in donors], transfer=transfer, store=store, learner=learner,
                            events=lambda e: None, timeout=timeout, stop=threading.Event(),
                            read_donors=lambda: [d.record for d in donors],
                            distrusted=lambda island: island in distrusted, patience=patience)
    return store.versions[0], store.hashes[0]


def test_a_joiner_takes_only_what_trusted_records_show_whichever_donor_hivemind_asks_first():
    # two islands on forks, the newer one declaring the highest priority
    older, newer = Donor("a", 7, 1, priority=7.0), Donor("b", 9, 2, priority=9.0)
    assert _join([older, newer], patience=60)[0] == 0  # no agreement within the join: the seeded weights
    assert _join([older, newer], patience=0) == (9, newer.hash)  # waited: a state a record shows
    # a third donor serves a fork nobody's record shows, at the top priority: never taken
    rogue = Donor("c", 50, 3, priority=1e9)
    rogue.record = older.record
    assert _join([older, newer, rogue], patience=0)[0] == 0
    # two trusted records agree: their state, at once; a flagged island's record does not count...
    twin = Donor("d", 9, 2, priority=8.0)
    flagged = Donor("x", 12, 4, priority=12.0)
    assert _join([twin, newer, flagged], patience=60, distrusted={"x"})[0] == 0  # (x answers first)
    flagged.priority = 1.0
    assert _join([twin, newer, flagged], patience=60, distrusted={"x"}) == (9, newer.hash)
    # ...unless it is the only island left: after the wait, its state rather than the seed
    assert _join([flagged], patience=60, distrusted={"x"})[0] == 0
    assert _join([flagged], patience=0, distrusted={"x"}) == (12, flagged.hash)


def test_a_retried_download_asks_for_what_the_records_show_before_each_try():
    """``StateTransfer.download_until`` with the states to take as a callable (as ``BaseRepair`` asks
    while groups take turns): the donor has moved on past the state first asked for; after the failed
    try the caller's ``on_retry`` reads the records again, and the next try takes the newer state."""
    store = FragmentStore(SHAPES)
    transfer = StateTransfer(store, SimpleNamespace(add=lambda **kw: None), fingerprint=FINGERPRINT,
                             events=lambda e: None, allreduce_timeout=5.0, stop=threading.Event())
    old, new = Donor("a", 7, 1, priority=1.0), Donor("a", 8, 2, priority=1.0)
    transfer.attach([Channel([new])])  # the donor serves only its newest state
    records = [(7, old.hash)]  # what the records showed when the download began
    asked, retries = [], []

    def wanted():
        asked.append(records[-1])
        return {records[-1]}

    def on_retry():
        retries.append(len(asked))
        records.append((8, new.hash))  # the records, read again, show the donor's new state

    state = transfer.download_until(0, deadline=time.monotonic() + 5.0, among=wanted, on_retry=on_retry)
    assert (state.version, state.hash) == (8, new.hash)
    assert asked == [(7, old.hash), (8, new.hash)] and retries == [1]
    # a fixed collection is asked for as it is: a state nobody serves is never taken
    assert transfer.download_until(0, deadline=time.monotonic() + 1.2, among={(7, old.hash)}) is None
