"""Which islands this one keeps out of its rounds, and until when (docs/DESIGN.md, "What is
validated where"): an island caught sending garbage (NaN, Inf, values out of bounds, lying metadata),
or an outlier in most of its recent rounds with us (docs/SECURITY.md), is flagged for a probation that
doubles with each strike, and islands that flagged the same ones meet under the same group key. Pure
logic: the wall clock is an argument, never read here.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
from collections import deque
from typing import Callable, Mapping, Optional, Sequence

logger = logging.getLogger(__name__)

MAX_WATCHED = 1024  # (island, kind) windows kept at most (an open run's names are not authenticated)
RELEASE_READS = 2  # reads of the records in a row without a majority that lift an adopted flag


class Quarantine:
    """Flags and probations of one island.

    A transient fault costs little, a persistent one is retried ever more rarely, and a retry costs
    one rejected round, no inner progress. A probation ends halfway between two rounds on the
    swarm-wide clock, so islands that caught the same member in the same round free it alike.

    :param island: this island's name (it never flags itself)
    :param probation: seconds of the first probation (``outer.flag_probation``); doubled per strike
    :param slot_spacing: seconds between two rounds on the clock (T_outer / P)
    :param check_lead: seconds before a slot at which its round checks the flags (matchmaking time)
    :param events: takes ``flag`` and ``unflag`` events (the island's JSONL log)
    :param outlier_rounds: n: an island that was an outlier in n of its last 2n - 1 rounds with us is
        flagged (:meth:`note_outlier`)
    """

    def __init__(self, *, island: str, probation: float, slot_spacing: float, check_lead: float,
                 events: Callable[[dict], None] = lambda event: None, outlier_rounds: int = 3):
        self.island, self.probation, self.events = island, probation, events
        self.slot_spacing, self.check_lead = slot_spacing, check_lead
        self.flagged: dict[str, float] = {}  # island -> end of its probation (wall clock)
        self.reasons: dict[str, str] = {}  # island -> why it was flagged last
        self.strikes: dict[str, int] = {}  # times we caught each island (adopted flags are no strikes)
        self._adopted: set[str] = set()  # islands whose flag we adopted at least once
        self.outlier_rounds = outlier_rounds
        self._outliers: dict[tuple, deque] = {}  # (island, kind) -> its last 2n - 1 rounds with us: outlier or not
        self._unheld: dict[str, int] = {}  # adopted flag -> reads in a row without a majority holding it
        self._lock = threading.Lock()  # round threads catch, the reporter's thread adopts

    def __contains__(self, island: str) -> bool:
        return island in self.flagged

    def names(self) -> list[str]:
        """The islands flagged now, sorted."""
        with self._lock:
            return sorted(self.flagged)

    def flagged_reasons(self) -> dict[str, str]:
        """The islands flagged now -> why (``garbage``, ``outlier``, ``reducer``, ``adopted``)."""
        with self._lock:
            return {island: self.reasons.get(island, "garbage") for island in sorted(self.flagged)}

    def flag(self, island: str, how: str, now: float, reason: str = "garbage") -> float:
        """Keep ``island`` out of our rounds for its probation, from wall-clock time ``now``.

        :param how: ``caught`` (by one of our rounds) or ``adopted`` (from the other islands' word)
        :param reason: what it was caught doing: ``garbage`` (NaN, Inf, out of bounds, lying metadata),
            ``outlier`` or ``reducer`` (:meth:`note_outlier`); adopted flags say ``adopted``
        :returns: the probation in seconds, or 0 if it is flagged already
        """
        with self._lock:
            if island in self.flagged:
                return 0.0
            self.reasons[island] = reason if how == "caught" else "adopted"
            for kind in ("outlier", "reducer"):  # a fresh record after its probation
                self._outliers.pop((island, kind), None)
            if how == "caught":
                self.strikes[island] = self.strikes.get(island, 0) + 1
                seconds = self.probation * 2.0 ** min(self.strikes[island] - 1, 16)
            else:  # a cap only (it lasts while a majority holds it): one strike more than we saw
                self._adopted.add(island)
                seconds = self.probation * 2.0 ** min(self.strikes.get(island, 0), 16)
            # halfway between two rounds' checks (made check_lead before each slot)
            step, shift = self.slot_spacing, self.check_lead - self.slot_spacing / 2
            self.flagged[island] = math.ceil((now + seconds + shift) / step) * step - shift
        self.events({"event": "flag", "culprit": island, "how": how, "seconds": seconds,
                     "reason": self.reasons[island]})
        return seconds

    def note_outlier(self, island: str, outlier: bool, now: float, kind: str = "outlier") -> float:
        """One more round of ``island`` with us: whether it was an outlier. ``kind`` ``outlier``: in
        most of the parts we reduced, its update was far from the others'
        (:class:`p2p_diloco.net.reducer.OutlierBook`); ``reducer``: the parts it reduced for us
        disagreed with what we sent far more than the other reducers' did
        (:func:`p2p_diloco.algo.robust.disagreeing`). An outlier of a kind in n of its last 2n - 1
        rounds is flagged with that kind as its reason: one odd round (a fresh joiner's first
        update, a spike in the loss) is not enough, a member that does it round after round is.

        :returns: the probation in seconds if this flagged it, else 0
        """
        if island == self.island:
            return 0.0
        with self._lock:
            if island in self.flagged:
                return 0.0
            if (island, kind) not in self._outliers and len(self._outliers) >= MAX_WATCHED:
                del self._outliers[next(iter(self._outliers))]  # names that churn: forget the oldest
            window = self._outliers.setdefault((island, kind), deque(maxlen=2 * self.outlier_rounds - 1))
            window.append(bool(outlier))
            caught = sum(window) >= self.outlier_rounds
        return self.flag(island, "caught", now, reason=kind) if caught else 0.0

    def expire(self, now: float) -> list[str]:
        """End the probations that are over at ``now``; returns those islands (they may join again)."""
        with self._lock:
            over = [island for island, until in self.flagged.items() if until <= now]
            for island in over:
                del self.flagged[island]
        for island in over:
            logger.warning("island %s: probation over, its rounds are no longer avoided", island)
            self.events({"event": "unflag", "culprit": island})
        return over

    def group_bits(self, now: float) -> Optional[str]:
        """The group-key bits that keep us away from the flagged islands at ``now``: 8 bits derived
        from their names (islands that flagged the same ones meet), "" once nobody is flagged any
        more, and None while we never flagged anyone (the default key, left untouched)."""
        self.expire(now)
        with self._lock:
            flagged, ever = sorted(self.flagged), bool(self.strikes or self._adopted)
        if not flagged:
            return "" if ever else None
        return format(hashlib.sha256("|".join(flagged).encode()).digest()[0], "08b")

    def adopt(self, reports: Sequence[tuple[str, Sequence[str]]], now: float) -> list[str]:
        """Flag the islands that a strict majority of the other live islands caught (their records'
        flags that are not adopted ones, :func:`caught_flags`) and that we do not flag now, so that
        a restarted island keeps away from a faulty one at once instead of meeting it under the
        default group key first. An island we caught ourselves before is adopted again whenever
        such a majority catches it again, so that the islands that did not meet it this time do not
        stay under another group key than those that caught it: two groups of one slot step two
        forks of one version (docs/CHAOS.md, run H3: the last 3 minutes as groups of 2 and 3). Any
        other island is adopted once per life: in a small swarm a strict majority of the others can
        be one liar, whose word must not keep an honest island out for more than one probation.
        Adopted flags have no vote, so islands cannot keep one another's flags alive: every vote
        ends with its catcher's probation. Adopting is no strike: our own catches alone double the
        probations we set (an adopted flag's cap is one doubling more than our own count).

        An adopted flag lasts while a strict majority still holds a caught one (and at most its own
        probation): the others' probations began before ours, and the flag changes our group key,
        so holding it alone after they lifted theirs kept a restarted island out of every round
        for up to a whole probation (docs/CHAOS.md, run E: 2 minutes, all of its rounds alone). It
        is lifted after :data:`RELEASE_READS` reads in a row without such a majority, so that one
        read that missed the holders' records lifts nothing.

        :param reports: (island, islands it caught) of the other live islands
        :returns: the islands newly flagged
        """
        adopted = []
        for culprit in sorted({c for _, flags in reports for c in flags}):
            if culprit == self.island or culprit in self.flagged:
                continue  # never ourselves; flagged already (caught or adopted)
            if culprit in self._adopted and culprit not in self.strikes:
                continue  # adopted once on the others' word alone: not again in this life
            votes, voters = self._votes(reports, culprit)
            if voters and 2 * votes > voters and self.flag(culprit, "adopted", now):
                logger.warning("island %s was flagged by %d of %d other islands: its rounds are avoided",
                               culprit, votes, voters)
                adopted.append(culprit)
        with self._lock:
            held = [island for island in self.flagged if self.reasons.get(island) == "adopted"]
        for culprit in held:
            votes, voters = self._votes(reports, culprit)
            if not voters:
                continue  # (no record read: no word either way)
            if 2 * votes > voters:
                self._unheld.pop(culprit, None)
                continue
            self._unheld[culprit] = self._unheld.get(culprit, 0) + 1
            if self._unheld[culprit] >= RELEASE_READS:
                self._release(culprit, f"{votes} of {voters} other islands still flag it")
        return adopted

    @staticmethod
    def _votes(reports: Sequence[tuple[str, Sequence[str]]], culprit: str) -> tuple[int, int]:
        """(islands that flag ``culprit``, islands with a say: every reporter but the culprit)."""
        voters = [flags for island, flags in reports if island != culprit]
        return sum(culprit in flags for flags in voters), len(voters)

    def _release(self, island: str, why: str) -> None:
        with self._lock:  # (a round thread may have ended its probation and caught it since: not ours to lift)
            self._unheld.pop(island, None)
            if island not in self.flagged or self.reasons.get(island) != "adopted":
                return
            del self.flagged[island]
        logger.warning("island %s: its adopted flag is lifted (%s): its rounds are no longer avoided", island, why)
        self.events({"event": "unflag", "culprit": island, "how": "released"})


def caught_flags(flagged: Sequence[str], reasons: Mapping[str, str]) -> list[str]:
    """The islands of a progress record's ``flagged`` that its writer caught itself, not adopted
    (``reasons``: the record's ``flag_reasons``; a record without one counts as caught). Only these
    vote in :meth:`Quarantine.adopt`."""
    return [island for island in flagged if reasons.get(island) != "adopted"]
