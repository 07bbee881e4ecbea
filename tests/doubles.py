"""Test doubles of the interfaces the syncer uses (a channel with no peers, a learner that hands out
fixed snapshots), for pure-logic tests; they implement the same methods as the real objects."""

from __future__ import annotations

import contextlib

import torch

from p2p_diloco.algo.handoff import Snapshot
from p2p_diloco.net.channel import RoundReport


class ChannelDouble:
    """A FragmentChannel with no peers: ``result`` is what all_reduce returns (None: no group), and
    ``donor`` (a StateTransfer) what a download gets."""

    def __init__(self, shapes, result=None, donor=None, block=False):
        self.buffers = [torch.zeros(shape) for shape in shapes]
        self.result, self.donor, self.block = result, donor, block
        self.gathers, self.bits = [], None

    @contextlib.contextmanager
    def tensors(self):
        yield self.buffers

    def all_reduce(self, *, gather, weight, scheduled_time, deadline, stop):
        self.gathers.append(gather)
        if self.block:  # a group that never completes: only stopping ends the wait
            stop.wait(10)
        return self.result

    def report(self):
        return RoundReport(None, 0, torch.zeros(sum(b.numel() for b in self.buffers), dtype=torch.uint8))

    def traffic(self):
        return 0, 0

    def set_group_bits(self, bits):
        self.bits = bits

    def set_donor_priority(self, priority):
        pass

    def share_state(self):
        pass

    def load_state(self, timeout):
        return None if self.donor is None else self.donor.donate(0)

    def is_alive(self):
        return True

    def close(self, timeout=5.0):
        pass


class LearnerDouble:
    def __init__(self, params, tokens=4096, steps=2):
        self.params, self.tokens, self.steps, self.updates, self.step_time = params, tokens, steps, [], 0.0

    def request_snapshot(self, fragment, timeout):
        return Snapshot(fragment, [p.clone() for p in self.params], tokens=self.tokens, steps=self.steps)

    def deliver(self, update):
        self.updates.append(update)
