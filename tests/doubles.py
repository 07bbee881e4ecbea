"""Test doubles of the interfaces the syncer uses (a channel with no peers, a learner that hands out
fixed snapshots), and one island's syncer parts wired as the product wires them, over either a
double or a real channel."""

from __future__ import annotations

import contextlib
import threading
from typing import Callable

import torch

from p2p_diloco.algo.clock import SwarmClock
from p2p_diloco.algo.handoff import Snapshot
from p2p_diloco.config import OuterConfig
from p2p_diloco.island.contribution import RoundFormat
from p2p_diloco.island.quarantine import Quarantine
from p2p_diloco.island.store import FragmentStore
from p2p_diloco.island.syncer import SyncerStats, wire_syncer
from p2p_diloco.island.transfer import StateTransfer
from p2p_diloco.net.channel import RoundReport


class ChannelDouble:
    """A FragmentChannel with no peers: ``result`` is what all_reduce returns (None: no group), and
    ``donor`` (a StateTransfer) what a download gets."""

    def __init__(self, shapes, result=None, donor=None, block=False):
        self.buffers = [torch.zeros(shape) for shape in shapes]
        self.result, self.donor, self.block = result, donor, block
        self.gathers, self.bits, self.asked = [], None, []
        self.serves = True

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

    def load_state(self, timeout, peers=None):
        self.asked.append(peers)
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



class IslandParts:
    """One island's syncer for fragment 0 of a one-fragment model, wired as the product wires it
    (:func:`~p2p_diloco.island.syncer.wire_syncer`), over the channel ``open_channel(self)`` returns
    (a :class:`ChannelDouble`, or a real channel that serves ``self.transfer.donate``)."""

    def __init__(self, name: str, theta, local, *, shapes, names, config: OuterConfig,
                 open_channel: Callable[["IslandParts"], object], bases=lambda: [], wire=None, tokens=4096, steps=2):
        self.name, self.events, self.stop = name, [], threading.Event()
        self.learner = LearnerDouble(local, tokens, steps)
        self.store, self.stats = FragmentStore([shapes]), SyncerStats()
        self.store.initialize([theta])
        self.quarantine = Quarantine(island=name, probation=config.flag_probation, slot_spacing=config.fragment_budget,
                                     check_lead=config.matchmaking_time, events=self.events.append,
                                     outlier_rounds=config.outlier_rounds)
        self.transfer = StateTransfer(self.store, self.stats, fingerprint="f" * 16, events=self.events.append,
                                      allreduce_timeout=config.allreduce_timeout, stop=self.stop)
        self.wire = wire or RoundFormat(config, names, shapes)
        self.channel = open_channel(self)
        self.syncer = wire_syncer(island=name, config=config, store=self.store, stats=self.stats,
                                  quarantine=self.quarantine, transfer=self.transfer, formats=[self.wire],
                                  channels=[self.channel], learner=self.learner, swarm_bases=bases,
                                  events=self.events.append, stop=self.stop, swarm_clock=SwarmClock())

    @property
    def last(self) -> dict:
        """The last round event."""
        return [e for e in self.events if e["event"] == "round"][-1]

    @property
    def theta(self) -> list[torch.Tensor]:
        """Theta of fragment 0 as published."""
        return self.store.states[0].theta
