"""The learner's side of the hand-off with the syncer (docs/DESIGN.md, "One round"): snapshot requests
that the syncer's threads queue and the learner answers at its next step boundary, and the outer
updates they deliver, which the learner applies there. Nothing here waits on the network; the
syncer's side waits at most its timeout.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from p2p_diloco.algo import outer
from p2p_diloco.algo.handoff import OuterUpdate, Snapshot


@dataclass
class _SnapshotRequest:
    fragment: int
    done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    cancelled: bool = False
    result: Optional[Snapshot] = None


class StepBoundary:
    """Snapshot requests and outer updates of one learner.

    :param fragment_params: per fragment, the model's live parameters in layout order
    :param stats: the learner's counters (``inner_steps``, ``tokens`` read; ``updates_applied`` written)
    :param optimizer: the inner optimizer (a replacing update may clear its state of the parameters)
    :param ranks: the island's process group when it has several ranks
        (:class:`~p2p_diloco.island.ranks.IslandRanks`): the leader's boundary then sends each
        update to the followers, which land it at the same inner step, and checks that the ranks
        agree afterwards; FSDP snapshots are gathered by every rank
    """

    def __init__(self, fragment_params: Sequence[Sequence[torch.nn.Parameter]], stats, optimizer: torch.optim.Optimizer,
                 ranks=None):
        self.fragment_params, self.stats, self.optimizer, self.ranks = fragment_params, stats, optimizer, ranks
        self.events = lambda event: None  # (the learner sets its event log)
        # (tokens, steps) totals at each fragment's last snapshot: what a snapshot reports is the difference
        self.marks = [(0, 0)] * len(fragment_params)
        self._requests: "queue.SimpleQueue[_SnapshotRequest]" = queue.SimpleQueue()
        self._updates: "queue.SimpleQueue[OuterUpdate]" = queue.SimpleQueue()
        self._held: list[OuterUpdate] = []  # delivered, waiting for their not_before_step (learner thread)
        self._accepting = True

    # ------------------------------------------------------------ the syncer's side (any thread)

    def request_snapshot(self, fragment: int, timeout: float) -> Optional[Snapshot]:
        """Ask for a copy of fragment ``fragment``'s parameters, taken at the next step boundary.

        Resets that fragment's token/step counters. Returns None if the learner has stopped or does
        not reach a step boundary within ``timeout`` seconds (the request is then dropped).
        """
        if not self._accepting:
            return None
        request = _SnapshotRequest(fragment)
        self._requests.put(request)
        request.done.wait(timeout)
        with request.lock:
            request.cancelled = not request.done.is_set()  # too late: the learner will skip it
            return request.result

    def deliver(self, update: OuterUpdate) -> None:
        """Queue a round's result; it is applied before the next inner step."""
        self._updates.put(update)

    @torch.no_grad()
    def apply_updates(self, force: bool = False, fragment: Optional[int] = None) -> None:
        """Apply the queued :class:`OuterUpdate` s to the live parameters, each fragment's in order; an
        update whose ``not_before_step`` is still ahead (``outer.overlap_steps``) waits, with the later
        ones of its fragment, unless ``force`` (checkpoints must see every delivered update) or it is
        of ``fragment`` (a snapshot of that fragment must see its updates)."""
        self._held.extend(_drain(self._updates))
        waiting, blocked = [], set()
        for update in self._held:
            ready = force or update.fragment == fragment or update.not_before_step <= self.stats.inner_steps
            if update.fragment in blocked or not ready:
                blocked.add(update.fragment)
                waiting.append(update)
                continue
            self._apply(update)
        self._held = waiting

    def _apply(self, update: OuterUpdate) -> None:
        """Land one update on its fragment's live parameters (on every rank of the island, the
        leader sending its tensors: a follower's ``update.tensors`` is None)."""
        if self.ranks is None:
            self._land(update)
            return
        with self.ranks.order("landing an update", "apply", update.fragment, update.mode, update.alpha,
                              update.reset_optimizer):
            self._land(update)

    @torch.no_grad()
    def _land(self, update: OuterUpdate) -> None:
        params = self.fragment_params[update.fragment]
        tensors = update.tensors
        ranks = self.ranks
        if ranks is not None:
            whole = ranks.broadcast(tensors, [p.shape for p in params])
            tensors = [ranks.local(p, t) for p, t in zip(params, whole, strict=True)]
        if update.mode == "carry":
            outer.apply_carry(params, tensors)
        elif update.mode == "mix":
            outer.apply_mix(params, tensors, update.alpha)
        else:  # replace
            for param, theta in zip(params, tensors, strict=True):
                param.copy_(theta)
                if update.reset_optimizer:
                    self.optimizer.state.pop(param, None)  # AdamW starts these moments afresh
        if update.marks is not None:
            self.marks[update.fragment] = update.marks
        self.stats.updates_applied += 1
        if ranks is not None and not ranks.collective_reads:  # (FSDP's ranks hold disjoint shards)
            checksum = ranks.agree(params)
            if ranks.leader:
                self.events({"event": "ranks_agree", "fragment": update.fragment, "version": update.version,
                             "ranks": ranks.world, "checksum": checksum, "step": self.stats.inner_steps})

    def apply_received(self, fragment: int, mode: str, alpha: float, reset_optimizer: bool) -> None:
        """Follower: land the update the leader is sending (its ``apply`` command's arguments)."""
        self._apply(OuterUpdate(fragment, mode, None, alpha, 0, "leader", reset_optimizer))

    @torch.no_grad()
    def answer_snapshots(self) -> None:
        """Copy the requested fragments to CPU fp32 and report the tokens/steps since their last copy.

        The syncer delivers an update (a reload, say) before it asks for the snapshot that must see
        it, so updates queued by then are applied first: a snapshot always matches the base the
        syncer reports in its round.
        """
        for request in _drain(self._requests):
            self.apply_updates(fragment=request.fragment)
            with request.lock:
                if request.cancelled:
                    continue  # the syncer gave up waiting
                p = request.fragment
                copies = self.read(p)
                tokens, steps = self.stats.tokens, self.stats.inner_steps
                request.result = Snapshot(p, copies, tokens - self.marks[p][0], steps - self.marks[p][1], steps)
                self.marks[p] = (tokens, steps)
                request.done.set()

    def read(self, fragment: int) -> list[torch.Tensor]:
        """fp32 CPU copies of a fragment's whole parameters (FSDP: the leader asks every rank to gather)."""
        params = self.fragment_params[fragment]
        if self.ranks is None:
            return [param.detach().to("cpu", torch.float32, copy=True) for param in params]
        with self.ranks.order("gathering parameters", "read", fragment, send=self.ranks.collective_reads):
            return self.ranks.whole(params)

    def close(self) -> None:
        """Stop taking snapshot requests and release any that wait."""
        self._accepting = False
        for request in _drain(self._requests):
            with request.lock:
                request.cancelled = True
                request.done.set()


def _drain(items: queue.SimpleQueue):
    """Yield what a queue holds now, without blocking."""
    while True:
        try:
            yield items.get_nowait()
        except queue.Empty:
            return
