"""The island's progress reports: every few seconds its signed record goes to the DHT, the other
islands' records are read (for the syncer's base repair and adopted flags), lost peers are dialled
again, and a status line is shown (docs/DESIGN.md, "Threads and processes")."""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Callable, Optional, Sequence

from p2p_diloco.net.records import IslandProgress, ProgressBoard, is_client

logger = logging.getLogger(__name__)


NUDGE_SPACING = 0.5  # seconds: nudged reports come at most this often (each a DHT read, and a store after a nudge)


class Reporter:
    """Every ``period`` seconds: checks the island's helper processes, publishes its progress record,
    reads the other islands' records and shows a status line.

    :param build_record: returns this island's :class:`IslandProgress` for a state name
    :param show: takes (other islands' records, tick) and displays a status line
    :param health: returns None, or why the island cannot go on (a dead helper process)
    :param on_failure: called once when ``health`` reports a problem
    :param reconnect: takes {peer id: multiaddrs} of peers to dial again and returns a future (or
        None); called every ``heal_every`` seconds for islands this one knew but no longer sees, and
        for the initial peers while it sees nobody and every ``initial_every`` seconds anyway (see
        :func:`reconnect_peers`)
    :param initial: the initial peers, {peer id: multiaddrs}
    :param on_records: takes the other islands' records after each read
    :param chores: called after each publish (a private run's certificate and revocations)
    """

    def __init__(self, board: ProgressBoard, build_record: Callable[[str], IslandProgress], *, period: float,
                 ttl: float, fingerprint: str, island: str, show: Callable[[list, int], None],
                 health: Callable[[], Optional[str]], on_failure: Callable[[], None],
                 reconnect: Optional[Callable[[dict], object]] = None, initial: Optional[dict] = None,
                 heal_every: float = 5.0, forget_after: float = 600.0, initial_every: float = 10.0,
                 on_records: Optional[Callable[[list], None]] = None, chores: Sequence[Callable[[], None]] = ()):
        self.board, self.build_record, self.period, self.ttl = board, build_record, period, ttl
        self.fingerprint, self.island, self.show = fingerprint, island, show
        self.health, self.on_failure = health, on_failure
        self.reconnect, self.initial = reconnect, dict(initial or {})
        self.heal_every, self.forget_after, self.initial_every = heal_every, forget_after, initial_every
        self.on_records, self.chores = on_records, list(chores)
        self.known: dict[str, tuple[list[str], float]] = {}  # peer id -> (multiaddrs, last seen)
        self._healing = None
        self._alone = False
        self._last_heal = self._last_initial = 0.0
        self._answered: Optional[int] = None
        self.others: list[IslandProgress] = []
        self.state = "loading"
        self.failure: Optional[str] = None
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by stop(), nudge() and refresh(): the next report at once
        # set by nudge(): the next report publishes our record too. A DHT store costs far more than a
        # read (a beam search for the nearest nodes, each answer listing its neighbours): at 16 islands
        # on 2 cores, stores made the DHT processes the machine's load (docs/SCALE.md)
        self._publish_due = False
        self._thread = threading.Thread(target=self._loop, name="reporter", daemon=True)

    def start(self) -> None:
        """Start the background thread."""
        self._thread.start()

    def swarm_bases(self) -> list[tuple[str, list[int], list[str]]]:
        """(island, fragment versions, fragment hashes) of the other live, training islands of this run."""
        return [(r.island, r.fragment_versions, r.fragment_hashes) for r in self.others
                if r.state == "training" and r.fingerprint == self.fingerprint]

    def clock_offsets(self) -> list[float]:
        """The clock offsets (seconds ahead of the swarm) that the other live islands of this run publish."""
        return [r.clock_offset for r in self.others if r.fingerprint == self.fingerprint]

    def _loop(self) -> None:
        tick = 0
        due = 0.0  # time.monotonic() of the next periodic report
        while not self._stop.is_set():
            began = time.monotonic()
            periodic = began >= due
            try:
                self.failure = self.health()
                if self.failure:
                    logger.error("%s: stopping the island", self.failure)
                    self.on_failure()
                    return
                if periodic or self._publish_due:
                    self._publish_due = False  # (before the store: a nudge meanwhile asks for another)
                    self.board.publish(self.build_record(self.state), self.ttl)
                if periodic:  # (a nudge publishes and reads; the chores keep their period)
                    for chore in self.chores:
                        chore()
                self.others = [r for r in self.board.read() if r.island != self.island]
                if self.on_records is not None:
                    self.on_records(self.others)
                self._heal()
                if periodic:
                    self.show(self.others, tick)
            except Exception as e:  # a display or record bug must not silence the island
                logger.warning("progress report failed: %r", e)
            if periodic:
                tick += 1
                due = began + self.period
            if self._wake.wait(max(0.0, due - time.monotonic())):  # nudged: not more often than NUDGE_SPACING
                self._stop.wait(max(0.0, began + NUDGE_SPACING - time.monotonic()))
            self._wake.clear()

    def _heal(self) -> None:
        """Dial again the islands we knew but no longer see (their records expired: dead, frozen or
        cut off), so that a partition heals even after the bootstrap node is gone, and now and then
        the initial peers, so that a restarted bootstrap node finds the swarm again."""
        now = time.time()
        for record in self.others:
            if not is_client(record.reachability):  # nobody can dial an island behind NAT
                self.known[record.peer_id] = (list(record.maddrs), now)
        if self.reconnect is None or now - self._last_heal < self.heal_every:
            return
        if self._healing is not None and not self._healing.done():
            return  # the previous attempt is still dialling
        if self._healing is not None:
            try:
                answered = self._healing.result(timeout=0)
            except Exception as e:
                answered = None
                logger.info("reconnecting failed: %r", e)
            if self._alone and answered and answered != self._answered:
                logger.info("reconnect: %d peer(s) answered", answered)
            self._answered = answered
            self._healing = None
        visible = {record.peer_id for record in self.others}
        if not visible and self.known and not self._alone:
            logger.warning("no other island is visible any more; dialling the %d peer(s) we knew", len(self.known))
        self._alone = not visible
        missing = {peer: maddrs for peer, (maddrs, seen) in self.known.items()
                   if peer not in visible and now - seen < self.forget_after}
        # the initial peers too: at once when alone, and every initial_every seconds anyway, so that a
        # restarted bootstrap node (which forgot everyone) learns the swarm again and newcomers that
        # join through it find it (a ping asks the pinged node to add us)
        if not visible or now - self._last_initial >= self.initial_every:
            missing |= {peer: maddrs for peer, maddrs in self.initial.items() if peer not in missing}
            self._last_initial = now
        self._last_heal = now
        if missing:
            logger.debug("reconnecting to %d peer(s) we no longer see", len(missing))
            self._healing = self.reconnect(missing)

    def nudge(self) -> None:
        """Publish our record and read the others' soon (at most every :data:`NUDGE_SPACING` seconds)
        rather than at the next period: after a round changed our state (members that missed its
        result wait for our record to show its hash)."""
        self._publish_due = True
        self._wake.set()

    def refresh(self) -> None:
        """Read the others' records soon (at most every :data:`NUDGE_SPACING` seconds), without
        publishing ours: while we wait for theirs to show a round's result."""
        self._wake.set()

    def stop(self) -> None:
        """Stop the thread (waits for a DHT call in flight, bounded by the board's timeout)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=self.board.timeout + self.period)


class StatusLine:
    """One line of progress: rich's live line on a TTY, a log line every ``every`` ticks elsewhere."""

    def __init__(self, every: int = 5):
        self.every = every
        self.live = None
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.live import Live

            self.live = Live(console=Console(stderr=True), refresh_per_second=2, transient=True)
            self.live.start()

    def update(self, text: str, tick: int) -> None:
        """Show ``text`` (tick counts reports, for the non-TTY rate limit)."""
        if self.live is not None:
            self.live.update(text)
        elif tick % self.every == 0:
            logger.info(text)

    def close(self) -> None:
        """Remove the live line."""
        if self.live is not None:
            self.live.stop()
