"""Base repair: an island whose Theta_p is behind the swarm's (a missed round) or a lone fork reloads
fragment p from a peer before its next round, keeping its own inner progress, instead of sending a
pseudo-gradient computed from the wrong base (docs/DESIGN.md, "Joining, lagging and forks").
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import torch

from p2p_diloco.algo import outer
from p2p_diloco.island.quarantine import Quarantine
from p2p_diloco.island.store import FragmentState, FragmentStore, HandOver
from p2p_diloco.island.transfer import StateTransfer, fragment_bases

SwarmBases = Callable[[], list[tuple[str, list[int], list[str]]]]  # (island, fragment versions, fragment hashes)


class BaseRepair:
    """Compares our (version, hash) of each fragment with the other live islands' and reloads.

    :param store: our global states
    :param transfer: state downloads
    :param quarantine: flagged islands, whose word does not count
    :param swarm_bases: (island, fragment versions, fragment hashes) reported by the other live islands
    :param hand_over: hands a reloaded state to the learner, keeping the local progress made since
        our own Theta_p
    :param events: takes ``reload`` events
    :param now: swarm time, seconds (the deadlines it is given are on it)
    :param refresh: reads the others' records soon (the reporter's
        :meth:`~p2p_diloco.island.reporter.Reporter.refresh`): after a download failed, since the
        donors may have moved on to a newer state than the records we read showed
    """

    def __init__(self, *, store: FragmentStore, transfer: StateTransfer, quarantine: Quarantine,
                 swarm_bases: SwarmBases, hand_over: HandOver, events: Callable[[dict], None], now: Callable[[], float],
                 refresh: Callable[[], None] = lambda: None):
        self.store, self.transfer, self.quarantine = store, transfer, quarantine
        self.swarm_bases, self.hand_over, self.events, self.now = swarm_bases, hand_over, events, now
        self.refresh = refresh
        # p -> (saved v_p, saved local params, (tokens, inner steps) at the restore)
        self._resumed: dict[int, tuple[int, list[torch.Tensor], tuple[int, int]]] = {}

    def resumed(self, p: int, version: int, params: Sequence[torch.Tensor], marks: tuple[int, int]) -> None:
        """Fragment p was restored from a checkpoint at ``version`` with the local parameters
        ``params`` (fp32 CPU, fragment order; kept until :meth:`settle`); ``marks``: the learner's
        (tokens, inner steps) totals at the restore.

        The progress the checkpoint holds (``params`` - Theta_p) may already be in the swarm: rounds
        that the island's killed process joined after the checkpoint was taken. So if the swarm holds
        a newer Theta_p, the reload measures the learner's progress from ``params`` instead of from
        Theta_p (a carry update, whatever the run's ``apply``), and the next snapshot claims only the
        tokens and steps trained since the restore: the progress made since the restart is kept, the
        checkpoint's is not sent twice (docs/DESIGN.md, "Resuming from a checkpoint").
        """
        self._resumed[p] = (version, list(params), marks)

    def settle(self, p: int) -> None:
        """Fragment p got a new state (a round's, or a reload's): from now on its progress is
        measured from Theta_p as usual, and the checkpoint's copy is released."""
        self._resumed.pop(p, None)

    def target(self, p: int, state: FragmentState) -> Optional[tuple[int, str]]:
        """The (version, hash) of fragment p to reload, from the other live islands' records, or None.

        Only a clear signal counts: a newer version (we missed a round) that 2 or more other islands
        hold when 2 or more report (one island's word cannot make us load its state:
        docs/SECURITY.md), or, at our version, a fork that strictly more islands hold than ours (we
        forked alone). Ties are left to the next round, whose gathered metadata is the same for
        every member.
        """
        others = [base for island, base in fragment_bases(self.swarm_bases(), p) if island not in self.quarantine]
        newer = [base for base in outer.vouched(others) if base[0] > state.version]
        if newer:
            newest = max(version for version, _ in newer)
            return outer.canonical_base([base for base in newer if base[0] == newest])
        counts: dict[tuple[int, str], int] = {}
        for base in [(state.version, state.hash), *others]:
            counts[base] = counts.get(base, 0) + 1
        best = max((base for base in counts if base[0] == state.version), key=counts.__getitem__)
        return best if counts[best] > counts[(state.version, state.hash)] else None

    def repair(self, p: int, *, deadline: float, why: str) -> bool:
        """If the swarm's Theta_p differs from ours (see :meth:`target`), download it before
        ``deadline`` (swarm time) and hand it to the learner, keeping the local progress made since
        our own Theta_p (or since the checkpoint, see :meth:`resumed`). Returns False only when a
        reload was needed and failed."""
        state = self.store.states[p]
        target = self.target(p, state)
        if target is None:
            return True
        saved = self._resumed.get(p)
        resumed = saved is not None and target[0] > saved[0]
        started = self.now()
        asked = [target]

        def wanted() -> set[tuple[int, str]]:
            # read before each try: after a failed one the donors may hold a newer state than the
            # records showed (groups taking turns move the swarm on every T_outer / G)
            asked[0] = self.target(p, state) or asked[0]
            return {asked[0]}

        fresh = self.transfer.download_until(p, deadline=time.monotonic() + max(0.5, deadline - started),
                                             among=wanted, on_retry=self.refresh)
        target = asked[0]
        if fresh is not None:
            if resumed:
                self.hand_over(p, fresh, saved[1], reason="reload", apply="carry", marks=saved[2])
            else:
                self.hand_over(p, fresh, state.theta, reason="reload")
            self.settle(p)
        self.events({"event": "reload", "why": why, "fragment": p, "t_start": started, "t_end": self.now(),
                     "base_version": state.version, "target_version": target[0], "reloaded": fresh is not None,
                     "new_version": self.store.versions[p], "new_hash": self.store.hashes[p],
                     **({"from_checkpoint": True} if resumed else {})})
        return fresh is not None
