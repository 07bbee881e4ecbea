"""One outer round of one fragment, from a snapshot to a new global state (docs/DESIGN.md, "One
round"; Decoupled DiLoCo, arXiv 2604.21428; DiLoCo, arXiv 2311.08105, Alg. 1, lines 12-14).

:meth:`OuterRound.run` computes the pseudo-gradient, averages it through the fragment's channel with
whoever shows up, checks what came back, merges, applies the outer step and returns a
:class:`RoundOutcome`: what to hand to the learner and the figures of the round's event. It does not
touch the syncer's counters or the learner; the syncer does, from the outcome.
"""

from __future__ import annotations

import collections
import logging
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from p2p_diloco.algo import outer, robust
from p2p_diloco.algo.clock import SwarmClock
from p2p_diloco.algo.handoff import Snapshot
from p2p_diloco.algo.schedule import RoundSlot
from p2p_diloco.config import OuterConfig
from p2p_diloco.island.contribution import LISTENER_WEIGHT, Contribution, RoundFormat
from p2p_diloco.island.quarantine import Quarantine
from p2p_diloco.island.store import FragmentState
from p2p_diloco.island.transfer import StateTransfer, fragment_bases, vouched_bases
from p2p_diloco.net.channel import FragmentChannel

logger = logging.getLogger(__name__)

OUTCOMES = ("ok", "empty", "fallback", "rejected", "nonfinite", "cancelled", "no_snapshot")


@dataclass
class RoundOutcome:
    """What a round produced.

    :param outcome: ``ok`` (a group of 2+ averaged), ``empty`` (a group whose members all had
        nothing to contribute: nothing to apply), ``fallback`` (no group: the island's own
        pseudo-gradient, or, deferred, nothing yet: its work goes into the next round), ``rejected`` (a member sent garbage: nothing applied), ``nonfinite`` (our
        own parameters went NaN/Inf), ``cancelled`` (the syncer stopped), ``no_snapshot``
    :param state: the new Theta_p to hand to the learner (None: nothing changes)
    :param base: what the learner's progress is measured from when ``state`` lands; None with a
        state replaces the local parameters outright
    :param reset_optimizer: with a replacement, clear the inner optimizer's state too (after NaN/Inf)
    :param group_size: members of the group (ok/empty/fallback/rejected)
    :param clipped: pseudo-gradient elements clipped to +-max_delta
    :param seconds: from the slot to the end of the all-reduce (its bytes per inner step)
    :param figures: the round event's fields (members, weights, bytes, versions, ...)
    """

    outcome: str
    state: Optional[FragmentState] = None
    base: Optional[list[torch.Tensor]] = None
    reset_optimizer: bool = False
    group_size: int = 0
    clipped: int = 0
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)


def _points_against(merged: Sequence[torch.Tensor], sent: Sequence[torch.Tensor]) -> bool:
    """Whether the merged update and what we sent have a negative dot product (fp64 sums)."""
    return sum(float((a.to(torch.float64) * b.to(torch.float64)).sum()) for a, b in zip(merged, sent)) < 0


def _island_at(index: int, peers: Sequence, gathered: dict) -> Optional[str]:
    """The island name that the member at group ``index`` gave in its gathered metadata, or None
    (an index past the group, metadata that is not a dict or has no string name)."""
    member = gathered.get(peers[index]) if 0 <= index < len(peers) else None
    island = member.get("island") if isinstance(member, dict) else None
    return island if isinstance(island, str) else None


class OuterRound:
    """The rounds of one fragment.

    :param island: this island's name (sent with every round)
    :param config: the outer settings
    :param wire: the fragment's wire format and checks
    :param channel: the fragment's averaging channel
    :param transfer: state downloads (an island whose own parameters went NaN/Inf reloads)
    :param quarantine: the islands we keep out of our rounds (and flag when caught)
    :param clock: swarm time (slots are on it; hivemind's matchmaking takes local wall-clock times)
    :param stop: set when the syncer stops: a round in flight is abandoned
    :param records: (island, fragment versions, fragment hashes) of the other live islands, from
        their progress records (which hash a round's result has, before we download it)
    :param refresh: asks for the records to be read again soon (while we wait for them to show a
        round's result)
    """

    def __init__(self, *, island: str, config: OuterConfig, wire: RoundFormat, channel: FragmentChannel,
                 transfer: StateTransfer, quarantine: Quarantine, clock: SwarmClock, stop: threading.Event,
                 records: Callable[[], Sequence[tuple[str, list[int], list[str]]]] = list,
                 refresh: Callable[[], None] = lambda: None):
        self.island, self.config, self.wire, self.channel = island, config, wire, channel
        self.transfer, self.quarantine, self.clock, self.stop = transfer, quarantine, clock, stop
        self.records, self.refresh = records, refresh
        # the work of the rounds since our last landed state that no group took (a deferred fallback, a
        # rejected round): its tokens and steps join the next round's claim, as its progress joins the
        # next pseudo-gradient; and how many fallbacks in a row were deferred
        self.carried_tokens = self.carried_steps = self.deferred = 0
        self._turn = 0

    def run(self, p: int, slot: RoundSlot, state: FragmentState, snapshot: Snapshot) -> RoundOutcome:
        """Average fragment p's pseudo-gradient ``Theta_p - snapshot`` at ``slot`` and step ``state``.

        The pseudo-gradient covers everything trained since ``state`` landed, so after rounds whose
        work no group took (deferred fallbacks, rejected rounds) it covers theirs too, and the claim
        counts their tokens and steps (:attr:`carried_tokens`)."""
        self._turn = slot.index % self.config.groups  # the slot's place in its period (groups taking turns)
        outcome = self._run(p, slot, state, snapshot)
        if outcome.state is not None or outcome.outcome in ("cancelled", "empty"):
            self.carried_tokens = self.carried_steps = 0  # landed (or nobody trained): nothing left to carry
        elif outcome.outcome in ("fallback", "rejected"):  # our progress stays local: it goes into the next round
            self.carried_tokens += snapshot.tokens
            self.carried_steps += snapshot.steps
        self.deferred = self.deferred + 1 if outcome.figures.get("deferred") else 0
        return outcome

    def _run(self, p: int, slot: RoundSlot, state: FragmentState, snapshot: Snapshot) -> RoundOutcome:
        delta = outer.pseudo_gradient(state.theta, snapshot.params)
        if not outer.all_finite(delta):
            return self._recover_from_nonfinite(p, state)
        mine = self.wire.contribution(delta, snapshot.tokens + self.carried_tokens, snapshot.steps + self.carried_steps)
        with self.channel.tensors() as buffers:
            report = self.wire.write(mine, buffers)
        gather = dict(island=self.island, version=state.version, hash=state.hash, weight=mine.weight,
                      tokens=mine.tokens, steps=mine.steps, serves=bool(self.channel.serves), **report)
        bits = self.quarantine.group_bits(self.clock.now())
        if bits is not None:  # meet only islands that flagged the same ones
            self.channel.set_group_bits(bits)
        before = self.channel.traffic()
        # past the slot, keep looking for members (up to K, hivemind's min_group_size) for the grace window
        deadline = slot.time + max(self.config.grace_window, self.config.request_timeout)
        gathered = self.channel.all_reduce(gather=gather, weight=max(mine.weight, LISTENER_WEIGHT),
                                           scheduled_time=slot.time, deadline=deadline, stop=self.stop)
        merged_at = self.clock.now()
        after, seconds = self.channel.traffic(), merged_at - slot.time
        # t_merged: when the all-reduce returned (the others had our contribution); a member that
        # missed the base then waits for the result's hash before the round ends (t_end)
        figures = {"t_merged": merged_at, "bytes_sent": after[0] - before[0], "bytes_received": after[1] - before[1],
                   "base_version": state.version, "base_hash": state.hash, "weight": mine.weight,
                   "tokens": snapshot.tokens, "steps": snapshot.steps, "clipped": mine.clipped,
                   "contributed": snapshot.steps > 0}
        if self.stop.is_set():  # shutting down: the round is abandoned, not failed
            return RoundOutcome("cancelled", clipped=mine.clipped, seconds=seconds, figures=figures)
        members = self.wire.members(gathered)
        if gathered is not None and len(members) >= 2:
            outcome = self._merge(p, state, snapshot, mine, members, figures, gathered)
            if outcome is not None:
                outcome.seconds = seconds
                return outcome
        else:
            figures["unaveraged"] = 0.0
        figures["group_size"] = 1 if gathered is None else len(members)
        done = dict(group_size=figures["group_size"], clipped=mine.clipped, seconds=seconds, figures=figures)
        if self.deferred < self.config.fallback_defer:
            # no group: keep Theta_p and our progress for the next round, which sends both. Stepping on
            # our own pseudo-gradient would make a fork that the swarm's next round replaces (the base
            # repair reloads the state the others hold), and this round's work would be lost to everyone
            figures["deferred"] = True
            return RoundOutcome("fallback", **done)
        new_state = state.stepped(delta, state.version + 1, 1, **self._optimizer())
        return RoundOutcome("fallback", new_state, snapshot.params, **done)

    def _merge(self, p: int, state: FragmentState, snapshot: Snapshot, mine: Contribution, members: list[dict],
               figures: dict, gathered: dict) -> Optional[RoundOutcome]:
        """The outcome of a group of 2+ members, or None when no part of the fragment was averaged
        (the round then falls back to our own pseudo-gradient)."""
        report = self.channel.report()
        if report.formed_at is not None:  # (a round's group formation time: t_formed - slot_time)
            figures["t_formed"] = report.formed_at
        self._weigh_outliers(report.outliers, gathered, figures)
        with self.channel.tensors() as buffers:
            merged, sent, exponents = self.wire.read(buffers, mine.values, report.grid)
        figures["unaveraged"] = 0.0  # share of the fragment no reducer averaged (zeroed): a dropped member
        culprits = self.wire.misreporting(members, self.island)
        if culprits or not self.wire.valid_result(merged, exponents):
            return self._reject(members, culprits, mine, figures)
        against = self._against_momentum(merged, state, report, gathered, figures)
        if mine.weight > 0:  # a listener sent nothing to compare with
            self._weigh_reducers(merged, sent, report, gathered, figures, also=against)
        masks = self.wire.unaveraged(merged, sent, members, mine.weight, report.failed, report.failed_mask)
        if against:  # not applied, as if they had stopped answering: the same bits on every member on our base
            masks = self.wire.reduced_by(merged, report.reducers, against, masks)
        if masks is not None:
            figures["unaveraged"] = self.wire.drop_unaveraged(merged, sent, masks)
        merged = self.wire.merge(merged, members)
        if not outer.all_finite(merged):
            return self._reject(members, [], mine, figures)
        against = mine.weight > 0 and _points_against(merged, sent)
        self._weigh_pair(against, members, figures)
        if against:
            return self._veto(p, members, mine, figures)
        halvings = self.wire.halvings(merged, members)
        if halvings is None:
            return self._reject(members, [], mine, figures)
        if halvings:
            # a result longer than the bound: members that are half of the group or fewer may have
            # steered it, and no median tells which (docs/SECURITY.md, "The norm bound"); exact, the
            # same bits everywhere
            merged = [torch.ldexp(t, torch.tensor(-halvings, dtype=torch.int32)) for t in merged]
            figures["halvings"] = halvings
            logger.info("fragment %d: the round with %s gave an update longer than %gx their median one: "
                        "halved %d time(s)", p, ", ".join(sorted(m["island"] for m in members if m["island"] != self.island)),
                        self.config.norm_ratio, halvings)
        if figures["unaveraged"] >= 1.0:
            return None
        base = self.wire.carry_base(snapshot.params, mine, sent)
        return self._apply_group_result(p, state, members, merged, base, mine, figures)

    def _apply_group_result(self, p: int, state: FragmentState, members: list[dict], merged: list[torch.Tensor],
                            base: list[torch.Tensor], mine: Contribution, figures: dict) -> RoundOutcome:
        """The new state after a round of 2+ members: the outer step on the canonical base, or, when
        our base was older or a fork, the round's result downloaded once the records of the members
        that held the canonical base show its hash (:meth:`_reload_result`); without it, the same
        step on our own base, a fork that the base repair heals later."""
        ours = (state.version, state.hash)
        canonical = outer.canonical_base([(m["version"], m["hash"]) for m in members],
                                         serving=[m.get("serves") is not False for m in members])
        new_version = canonical[0] + 1  # never from a lone claim (docs/SECURITY.md)
        support = sum((m["version"], m["hash"]) == canonical for m in members)
        figures.update(group_size=len(members), members=sorted(m["island"] for m in members),
                       group_max_version=new_version - 1, canonical=ours == canonical)
        done = dict(group_size=len(members), clipped=mine.clipped, figures=figures)
        if sum(m["weight"] for m in members) <= 0.0:
            return RoundOutcome("empty", **done)  # nobody trained anything since the last round
        if ours == canonical:
            return RoundOutcome("ok", state.stepped(merged, new_version, support, **self._optimizer()), base, **done)
        holders = {m["island"] for m in members if (m["version"], m["hash"]) == canonical} - {self.island}
        fresh = self._reload_result(p, holders, new_version)
        figures["reloaded"] = fresh is not None
        new_state = fresh if fresh is not None else state.stepped(merged, new_version, 1, **self._optimizer())
        return RoundOutcome("ok", new_state, base, **done)

    def _reload_result(self, p: int, holders: set, version: int) -> Optional[FragmentState]:
        """The round's result (fragment p at ``version``), taken only with the hash that the records of
        ``holders`` (the members that held the canonical base) show, 2 of them agreeing when 2 or
        more held it. The first donor to answer is not trusted: one that served a fork of its own
        at a newer version once sent an 8-island swarm's eval loss from 6 to 30 (docs/SECURITY.md).
        None when the records do not show it within the round's budget, or no donor serves it."""
        deadline = time.monotonic() + self.config.allreduce_timeout + self.config.grace_window
        needed = 2 if len(holders) >= 2 else 1
        while not self.stop.is_set() and time.monotonic() < deadline:
            counts = collections.Counter(digest for island, (held, digest) in fragment_bases(self.records(), p)
                                         if island in holders and held == version)
            if counts and counts.most_common(1)[0][1] >= needed:
                want = counts.most_common(1)[0][0]
                return self.transfer.download_until(p, among={(version, want)},
                                                    deadline=deadline)
            self.refresh()
            self.stop.wait(0.25)
        return None

    def _weigh_outliers(self, outliers: dict, gathered: dict, figures: dict) -> None:
        """Note, for each member we reduced parts with, whether it was an outlier in most of them (its
        pseudo-gradient far from the robust center: docs/SECURITY.md); one that is, round after round,
        is flagged (:meth:`p2p_diloco.island.quarantine.Quarantine.note_outlier`)."""
        far = []
        for peer, (seen, out) in outliers.items():
            member = gathered.get(peer)
            island = member.get("island") if isinstance(member, dict) else None
            if not isinstance(island, str) or island == self.island:
                continue
            if 2 * out > seen:
                far.append(island)
            seconds = self.quarantine.note_outlier(island, 2 * out > seen, self.clock.now())
            if seconds:
                logger.error("island %s sent pseudo-gradients far from the others' round after round: flagged, its "
                             "rounds are avoided for %.0f s", island, seconds)
        figures["outliers"] = sorted(far)

    def _against_momentum(self, merged: list[torch.Tensor], state: FragmentState, report, gathered: dict,
                          figures: dict) -> list[int]:
        """The group indices of the reducers whose share of the result points against the outer
        momentum of our base while the other reducers' shares point along it
        (:func:`p2p_diloco.algo.robust.against_momentum`). The caller does not apply their shares:
        every member on our base holds the same momentum (from honest donors: the hash covers Theta_p
        alone) and got the same shares, so all of them leave out the same parts and end on one
        state (docs/SECURITY.md, "Lying reducers"). The elements whose reducer failed kept each
        member's own values and are left out of the comparison. No check (``momentum_check`` False
        in the round's figures) when the averager could not record who reduced what or which parts
        failed, or under RDA merges (the merged values are mean unit directions, not updates)."""
        if report.reducers is None or not report.peers or report.failed < 0 or any(self.wire.rda):
            figures["momentum_check"] = False
            return []
        reducer_of = report.reducers
        if report.failed > 0:
            reducer_of = reducer_of.masked_fill(report.failed_mask.to(torch.bool), -1)
        agreement = robust.reducer_agreement(merged, state.momentum, reducer_of)
        if agreement:
            figures["momentum_agreement"] = round(statistics.median(agreement.values()), 4)
        against = robust.against_momentum(agreement)
        if against:
            figures["dropped_reducers"] = sorted(_island_at(i, report.peers, gathered) or "?" for i in against)
            logger.warning("the shares of the round's result reduced by %s point against the outer momentum while "
                           "the others' point along it: not applied", ", ".join(figures["dropped_reducers"]))
        return against

    def _weigh_reducers(self, merged: list[torch.Tensor], sent: list[torch.Tensor], report, gathered: dict,
                        figures: dict, also: Sequence[int] = ()) -> None:
        """Note, for each member that reduced parts for us, whether the merged values it returned
        agree with what we sent far less than the other reducers' do (a reducer that reverses or
        replaces the average: docs/SECURITY.md), or are among ``also`` (group indices: those whose
        share points against the outer momentum); one that does, round after round, is flagged."""
        if report.reducers is None or not report.peers:
            return
        agreement = robust.reducer_agreement(merged, sent, report.reducers)
        suspects = set(robust.disagreeing(agreement)) | set(also)
        far = []
        for index in agreement:
            island = _island_at(index, report.peers, gathered)
            if island is None or island == self.island:
                continue
            if index in suspects:
                far.append(island)
            seconds = self.quarantine.note_outlier(island, index in suspects, self.clock.now(), kind="reducer")
            if seconds:
                logger.error("island %s returned averages that disagree with what the members sent, round after "
                             "round: flagged, its rounds are avoided for %.0f s", island, seconds)
        figures["suspect_reducers"] = sorted(far)

    def _weigh_pair(self, against: bool, members: list[dict], figures: dict) -> None:
        """In a round of 2 contributors, of which we are one, note whether the merged update points
        ``against`` the one we sent (a negative dot product): the reducers cannot tell the two apart,
        but we know ours is honest, and an honest partner's update does not outweigh and oppose ours
        round after round. A partner that does in n of its last 2n - 1 rounds with us is flagged
        ("outlier"), so an attacker that keeps meeting islands alone is avoided (docs/SECURITY.md,
        "The norm bound")."""
        partner = self.wire.pair_partner(members, self.island)
        if partner is None:
            return
        figures["pair_against"] = against
        seconds = self.quarantine.note_outlier(partner, against, self.clock.now())
        if seconds:
            logger.error("island %s steered our pair rounds against our own updates round after round: flagged, its "
                         "rounds are avoided for %.0f s", partner, seconds)

    def _veto(self, p: int, members: list[dict], mine: Contribution, figures: dict) -> RoundOutcome:
        """The merged update points against our own (a negative dot product): we do not apply it, and
        keep our state and progress for the next round, as for a rejected round (docs/SECURITY.md,
        "Updates against our own"). An honest group's result comes back anyway: when 2 or more
        islands hold it, the base repair reloads it and keeps our progress, which is what applying it
        would have done. An attacker that outweighs us in a round of 2 (or of 3 whose third member
        dropped out) holds its result alone, and nobody loads a state on one island's word."""
        figures.update(vetoed=True, members=sorted(m["island"] for m in members), group_size=len(members))
        logger.warning("fragment %d: the round with %s merged an update that points against ours: not applied", p,
                       ", ".join(sorted(m["island"] for m in members if m["island"] != self.island)))
        return RoundOutcome("rejected", group_size=len(members), clipped=mine.clipped, figures=figures)

    def _reject(self, members: list[dict], culprits: list[str], mine: Contribution, figures: dict) -> RoundOutcome:
        """A member sent NaN, Inf, unclipped values or lied in its metadata: the round's result is not
        applied by anyone (every member sees the same result and metadata and decides alike, so their
        Theta stay identical and no inner progress is lost: it goes into the next round). Members
        whose own report of what they sent is out of bounds (or ``culprits`` found otherwise) are
        flagged and kept out of our later rounds."""
        culprits = sorted(set(culprits) | set(self.wire.out_of_bounds(members, self.island)))
        for island in culprits:
            seconds = self.quarantine.flag(island, "caught", self.clock.now())
            if seconds:
                logger.error("island %s sent an invalid pseudo-gradient: flagged, its rounds are avoided for %.0f s",
                             island, seconds)
        figures.update(culprits=culprits, members=sorted(m["island"] for m in members), group_size=len(members))
        return RoundOutcome("rejected", group_size=len(members), clipped=mine.clipped, figures=figures)

    def _recover_from_nonfinite(self, p: int, state: FragmentState) -> RoundOutcome:
        """The island's own parameters went NaN/Inf: never send them; replace them by the global ones
        (from peers if they hold a newer state that the records vouch for, as a joiner takes it, else
        our own Theta_p) and clear the inner optimizer's state."""
        logger.error("fragment %d: local parameters have NaN/Inf; not contributing, resetting them", p)
        target = vouched_bases([(versions, hashes) for island, versions, hashes in self.records()
                                if island not in self.quarantine], p + 1)[p]
        fresh = None
        if target is not None and target[0] >= state.version and target != (state.version, state.hash):
            fresh = self.transfer.download_until(p, among={target},
                                                 deadline=time.monotonic() + 2.0)
        return RoundOutcome("nonfinite", fresh or state, None, reset_optimizer=True,
                            figures={"reloaded": fresh is not None})

    def _optimizer(self) -> dict:
        cfg = self.config
        return dict(lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, turn=self._turn, turns=cfg.groups)
