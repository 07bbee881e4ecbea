"""An island peer from start to finish (docs/DESIGN.md, "Threads and processes").

:class:`~p2p_diloco.island.builder.IslandBuilder` assembles an :class:`Island`'s parts that need no
network; :meth:`Island.run` adds the DHT, the channels, the syncer and the reporter, trains until a
limit or a signal, and tears every part down through one ``contextlib.ExitStack``, in the reverse
order of creation, each step even if another failed.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import torch

from p2p_diloco import files
from p2p_diloco.algo.clock import SwarmClock
from p2p_diloco.algo.fragments import FragmentLayout
from p2p_diloco.config import PeerConfig
from p2p_diloco.errors import Interrupted
from p2p_diloco.island import checkpoint as ckpt
from p2p_diloco.island import data as data_lib
from p2p_diloco.island import joining
from p2p_diloco.island.events import EventLog
from p2p_diloco.island.explog import ExperimentLog
from p2p_diloco.island.learner import Learner
from p2p_diloco.island.quarantine import Quarantine, caught_flags
from p2p_diloco.island.ranks import IslandRanks
from p2p_diloco.island.reporter import Reporter, StatusLine
from p2p_diloco.island.store import FragmentStore
from p2p_diloco.island.summary import make_summary, progress_record, status_text
from p2p_diloco.island.syncer import Syncer, SyncerStats, wire_syncer
from p2p_diloco.island.transfer import StateTransfer
from p2p_diloco.net.clock import ClockProbe
from p2p_diloco.net.gate import Admission, dht_refusals
from p2p_diloco.net.dht import peers_by_id, reconnect_peers, start_dht, visible_maddrs
from p2p_diloco.net.reachability import decide_client_mode, serve_dial_back
from p2p_diloco.net.records import IslandProgress, ProgressBoard, is_client, make_validators
from p2p_diloco.procs import StopSignal

if TYPE_CHECKING:
    from p2p_diloco.island.builder import IslandBuilder

logger = logging.getLogger(__name__)


def join_patience(period: float, join_timeout: float) -> float:
    """Seconds a joiner waits for the trusted records to agree on a state before it takes one that a
    single record shows (docs/SECURITY.md, "Joiners among forks"): a quarter of the outer period
    (at least 2 s), at most half the join timeout. Records that disagree for longer are forks,
    which the next shared round or the base repair merges; in the 100-fault chaos run, joiners that
    waited a whole period (20 s) found no agreement at its end either (docs/CHAOS.md)."""
    return min(max(2.0, period / 4), join_timeout / 2)


def averager_prefix(run_id: str, fingerprint: str, fragment: int, num_fragments: int) -> str:
    """The name of fragment ``fragment``'s averager (its DHT keys and RPC namespace): islands of
    another run or fingerprint never meet ours."""
    return f"{run_id}_{fingerprint[:12]}_f{fragment}of{num_fragments}"


@dataclass(eq=False)
class Island:
    """One island of a run. Built by :class:`IslandBuilder` (the parts up to ``checkpointer``);
    :meth:`run` adds the network parts, trains and shuts down."""

    config: PeerConfig
    stop: StopSignal
    builder: IslandBuilder
    device: torch.device
    peers: list  # --initial-peers, checked
    identity: str  # the identity key file ("" for a fresh identity)
    launched: float  # wall clock when the island was started (goodput counts from it)
    admission: Optional[Admission] = None  # a private run's credentials (None: an open run)
    ranks: Optional[IslandRanks] = None  # the process group of an island of several ranks
    # data, model and the inner loop
    model: torch.nn.Module = None
    parameters: int = 0
    layout: FragmentLayout = None
    shapes: list = None  # shapes[p]: parameter shapes of fragment p
    fingerprint: str = ""
    shard: int = 0
    sampler: data_lib.BatchSampler = None
    tokens_per_step: int = 0
    events: EventLog = None
    learner: Learner = None
    device_name: str = "cpu"
    flops_per_token: float = 0.0  # training FLOPs per token (model.flops_per_token)
    peak_flops: Optional[float] = None  # the device's bf16 peak, FLOP/s (None: a CPU or an unknown GPU)
    # the syncer's parts that need no network
    store: FragmentStore = None
    sync_stats: SyncerStats = None
    rounds_stop: threading.Event = None
    quarantine: Quarantine = None
    clock: SwarmClock = None  # swarm time (docs/DESIGN.md, "Clocks")
    transfer: StateTransfer = None
    formats: list = None  # one RoundFormat per fragment
    checkpointer: Optional[ckpt.Checkpointer] = None
    resume: Optional[ckpt.IslandCheckpoint] = None
    resumed_from: Optional[Path] = None
    # made by run()
    explog: Optional[ExperimentLog] = None
    dht: object = None
    peer_id: str = ""
    maddrs: list = None
    board: Optional[ProgressBoard] = None
    clock_probe: Optional[ClockProbe] = None
    reachability: str = "unknown"  # public | nat | client (set by --client-mode on) | unknown
    _no_full_member: bool = False  # a client that sees no full member (said once)
    _donor_records: list = field(default_factory=list)  # the donors' records a joiner read last
    channels: list = None
    syncer: Optional[Syncer] = None
    status_line: Optional[StatusLine] = None
    reporter: Optional[Reporter] = None
    stop_reason: str = "error"
    summary: Optional[dict] = None

    def run(self) -> Optional[dict]:
        """Join, train until a limit or a signal, shut down; returns the summary (None if the island
        never trained), also written to ``--summary-json``. The leader of an island of several ranks
        releases its followers last, after the final evaluation and checkpoint.

        :raises UserError: unreachable peers, a refused fingerprint, an interruption while connecting
        :raises RankLost: another rank of the island died
        """
        try:
            summary = self._run()
        except BaseException:
            if self.ranks is not None:
                _quietly(self.ranks.release, "releasing the island's other ranks")
            raise
        if self.ranks is not None:
            self.ranks.release()  # a rank lost by now is the island's failure too
        return summary

    def follow(self) -> None:
        """A follower rank's run: the leader's commands until it stops (docs/DESIGN.md, "Islands of
        many ranks"); a resumed checkpoint's data position is this rank's stream after as many batches.

        :raises RankLost: the leader (or another rank) died
        """
        def on_restore(meta: dict) -> None:
            position = meta.get("sampler") or {}
            self.sampler.skip(int(position.get("batches_drawn", 0)) if isinstance(position, dict) else 0)

        try:
            self.learner.follow(on_restore)
        finally:
            self.ranks.close()

    def _run(self) -> Optional[dict]:
        if self.stop.event.is_set():
            raise Interrupted("interrupted before joining the swarm")
        with contextlib.ExitStack() as stack:
            def teardown(action: Callable[[], object], what: str) -> None:
                stack.callback(_quietly, action, what)

            teardown(self._close_events, "closing the event log")
            if self.checkpointer is not None:
                teardown(self.checkpointer.close, "ending the checkpoint writer")
            others = self._connect(teardown)
            self._open_syncer(teardown)
            self._start_reporter(teardown)
            teardown(self._finish, "finishing the run")  # after the rounds and the learner stopped
            outer = self.config.outer
            teardown(lambda: self.syncer.stop(timeout=outer.allreduce_timeout + outer.grace_window + 2.0),
                     "stopping rounds")
            teardown(self.learner.close, "closing the learner")
            teardown(lambda: setattr(self.reporter, "state", "stopping"), "reporting the stop")
            self.stop_reason = self._train(others)
        return self.summary

    # ------------------------------------------------------------------ phases

    def _connect(self, teardown) -> list[IslandProgress]:
        """Start the DHT and read the other islands' records; refuse a run of another fingerprint."""
        config = self.config
        # before joining: a W&B or TensorBoard mistake shows at once
        self.explog = ExperimentLog(run_id=config.run_id, island=config.island, config=config.model_dump(),
                                    wandb_project=config.logging.wandb_project, wandb_mode=config.logging.wandb_mode,
                                    tensorboard_dir=config.logging.tensorboard_dir)
        teardown(self.explog.close, "closing the experiment log")
        self.channels = []
        teardown(self._close_channels, "ending the averagers")  # after the DHT: see HivemindChannel.close
        validators, public_key = make_validators(config.run_id)
        self.reachability = decide_client_mode(config.client_mode, self.peers, config.host_maddrs,
                                               config.announce_maddrs)
        self.dht = start_dht(initial_peers=self.peers, host_maddrs=config.host_maddrs,
                             announce_maddrs=config.announce_maddrs, identity_path=self.identity,
                             record_validators=validators, join_timeout=config.join_timeout,
                             stop_event=self.stop.event, wait_timeout=config.dht_wait_timeout,
                             authorizer=self.admission.authorizer() if self.admission else None,
                             client_mode=self.client_mode)
        teardown(lambda: self.dht.is_alive() and self.dht.shutdown(), "shutting down the DHT")
        if not self.client_mode:
            serve_dial_back(self.dht)  # newcomers may ask whether they can be dialled
        self.peer_id, self.maddrs = str(self.dht.peer_id), visible_maddrs(self.dht)
        self.clock_probe = ClockProbe(self.dht, self.clock)
        self.clock_probe.check_at_start()  # a clock the DHT would refuse ends the start here (exit code 3)
        if self.admission is not None:  # before any donor may look for our certificate
            self.admission.tick(self.dht, config.progress.ttl, self.clock.now)
        # (records, certificates and revocation lists expire on the swarm's time: docs/DESIGN.md, "Clocks")
        self.board = ProgressBoard(self.dht, config.run_id, public_key, now=self.clock.now)
        teardown(lambda: self.dht.is_alive() and self.board.withdraw(), "withdrawing the progress record")
        others = [r for r in self._first_read() if r.island != config.island]
        self._donor_records = self._donors(others)
        self.transfer.holders = self._holders
        joining.check_fingerprint(others, self.fingerprint, config.run_id)
        logger.info("island %s (peer %s) listening at %s", config.island, self.peer_id, " ".join(self.maddrs))
        self.events({"event": "start", "peer_id": self.peer_id, "fingerprint": self.fingerprint,
                     "maddrs": self.maddrs, "device": str(self.device), "shard": self.shard})
        return others

    def _open_syncer(self, teardown) -> None:
        """One channel per fragment (averager processes forked from the main thread), then the syncer."""
        config, outer, layout = self.config, self.config.outer, self.layout
        try:
            for p, (fmt, shapes) in enumerate(zip(self.formats, self.shapes)):
                self.channels.append(self.builder.channel(
                    self.dht, shapes=shapes, codec=outer.codec, ceilings=fmt.ceilings,
                    state_provider=lambda p=p: self.transfer.donate(p), allreduce_timeout=outer.allreduce_timeout,
                    prefix=averager_prefix(config.run_id, self.fingerprint, p, layout.num_fragments),
                    quorum=outer.quorum, matchmaking_time=outer.matchmaking_time / 2,
                    request_timeout=outer.request_timeout, admission=self.admission, clock=self.clock,
                    merge_rule=fmt.merge_rule))
        finally:
            self.stop.install()  # hivemind's averager turned SIGINT off in this process
        self.syncer = wire_syncer(island=config.island, config=outer, store=self.store, stats=self.sync_stats,
                                  quarantine=self.quarantine, transfer=self.transfer, formats=self.formats,
                                  channels=self.channels, learner=self.learner, events=self.events,
                                  swarm_bases=lambda: self.reporter.swarm_bases(), stop=self.rounds_stop,
                                  swarm_clock=self.clock, swarm_offsets=lambda: self.reporter.clock_offsets(),
                                  nudge=lambda: self.reporter is not None and self.reporter.nudge(),
                                  refresh=lambda: self.reporter is not None and self.reporter.refresh())

    def _first_read(self, attempts: int = 3, pause: float = 1.0) -> list[IslandProgress]:
        """The others' records at start. A DHT node that has just joined may not have met the nodes
        that hold them yet (or may get no answer on a loaded machine): an island that reads nobody
        would start from the seed instead of downloading the swarm's state, so ask up to ``attempts``
        times, ``pause`` seconds apart, before believing that it is the first."""
        for attempt in range(attempts):
            found = self.board.try_read()
            if found or self.stop.event.wait(pause) or attempt == attempts - 1:
                return found or []
        return []

    def _start_reporter(self, teardown) -> None:
        config = self.config
        self.status_line = StatusLine()
        teardown(self.status_line.close, "closing the status line")
        self.reporter = Reporter(
            self.board, self._published_record, period=config.progress.period, ttl=config.progress.ttl,
            fingerprint=self.fingerprint, island=config.island,
            show=lambda others, tick: self.status_line.update(status_text(self, others), tick),
            health=self._health, on_failure=self.stop.event.set,
            reconnect=lambda peers: reconnect_peers(self.dht, peers), initial=peers_by_id(self.peers),
            chores=[self.clock_probe.tick] + ([lambda: self.admission.tick(self.dht, config.progress.ttl, self.clock.now)]
                                              if self.admission else []),
            on_records=self._on_records)
        self.reporter.start()
        teardown(self.reporter.stop, "stopping the reporter")

    def _on_records(self, others: list[IslandProgress]) -> None:
        """After each read of the others' records: learn which islands the swarm caught sending
        garbage (a restart forgets), and tell a client when no full member is left to meet."""
        ours = [r for r in others if r.fingerprint == self.fingerprint]
        self.quarantine.adopt([(r.island, caught_flags(r.flagged, r.flag_reasons)) for r in ours], self.clock.now())
        if self.client_mode:
            full = any(not is_client(r.reachability) for r in ours)
            if not full and not self._no_full_member:
                logger.warning("no full member is live (the other islands, if any, are clients too): this "
                               "island's rounds fall back to its own update until a public island joins")
            elif full and self._no_full_member:
                logger.info("a full member is live again: rounds can form")
            self._no_full_member = not full

    def _donors(self, records: list[IslandProgress]) -> list[IslandProgress]:
        """The islands that may serve us the global state: training, of our fingerprint, full members
        (clients behind NAT serve no state), not us."""
        return [r for r in records if r.state == "training" and r.fingerprint == self.fingerprint
                and not is_client(r.reachability) and r.island != self.config.island]

    def _read_donors(self) -> list[IslandProgress]:
        """The donors' records read afresh (a joiner's), remembered for :meth:`_holders`."""
        self._donor_records = self._donors(self.board.read())
        return self._donor_records

    def _holders(self) -> list[tuple[str, list[int], list[str]]]:
        """(peer id, fragment versions, fragment hashes) of the donors, from the reporter's last read
        and a joiner's (:attr:`StateTransfer.holders`: a download asks those whose records show the
        state it wants)."""
        records = self._donor_records + (self._donors(self.reporter.others) if self.reporter is not None else [])
        return [(r.peer_id, r.fragment_versions, r.fragment_hashes) for r in records]

    def _train(self, others: list[IslandProgress]) -> str:
        """Load the global state (a checkpoint, or live peers), start the rounds and train; returns
        why it stopped (``signal``, ``max_steps``, ``max_minutes``, ``helper_died``)."""
        config = self.config
        try:
            if self.resume is not None:
                joining.restore_from_checkpoint(self.resume, self.resumed_from, store=self.store, learner=self.learner,
                                                sampler=self.sampler, repair=self.syncer.repair,
                                                events=self.events)
                self.resume = None  # release the tensors
            else:
                joining.join_from_peers(self._donors(others),
                                        transfer=self.transfer, store=self.store, learner=self.learner,
                                        events=self.events, timeout=config.join_timeout, stop=self.stop.event,
                                        read_donors=self._read_donors,
                                        distrusted=self.quarantine.__contains__,
                                        patience=join_patience(config.outer.period, config.join_timeout))
            self._donor_records = []  # from now on the reporter's reads are the fresher ones
            for channel in self.channels if not self.client_mode else ():  # nobody could reach a client
                channel.share_state()
            self.syncer.start()
            self.reporter.state = "training"
            self.learner.evaluate()
            reason = self.learner.run(self.stop.event, max_steps=config.max_steps, max_seconds=config.max_minutes * 60,
                                      eval_every=config.eval.every,
                                      between_steps=self.checkpointer.maybe if self.checkpointer else None)
        except KeyboardInterrupt:
            return "signal"
        if self.reporter.failure:
            reason = "helper_died"
        logger.info("stopping (%s)", reason)
        return reason

    def _finish(self) -> None:
        """Once rounds have stopped: the final evaluation and checkpoint (no completed round is lost)
        and the summary. Skipped when the island never trained."""
        if not self.learner.stats.inner_steps:
            return
        if self.stop_reason != "error":
            _quietly(self.learner.evaluate, "final evaluation")
            if self.checkpointer is not None:
                _quietly(self.checkpointer.final, "the final checkpoint")
        _quietly(lambda: self.explog.log(progress_record(self, "stopping")), "logging the final metrics")
        self.summary = make_summary(self, self.stop_reason)
        if self.config.logging.summary_json:
            files.write_json(self.config.logging.summary_json, self.summary)

    def _close_channels(self) -> None:
        for channel in self.channels:
            _quietly(channel.close, "ending an averager")

    def _close_events(self) -> None:
        self.events({"event": "stop", "reason": self.stop_reason})
        self.events.close()

    # ------------------------------------------------------------------ joining, resuming, checkpoints

    def capture(self) -> ckpt.IslandCheckpoint:
        """A consistent checkpoint of this island, taken on the learner thread at a step boundary."""
        states = self.store.consistent_states(lambda: self.learner.apply_updates(force=True))
        inner = self.learner.capture()
        fragments = [ckpt.GlobalFragment(s.theta, s.momentum, s.version, s.hash, s.support) for s in states]
        meta = inner["meta"] | {"sampler": self.sampler.position()}
        return ckpt.IslandCheckpoint(self.fingerprint, self.config.island, fragments, inner["params"],
                                     inner["optimizer"], inner["scheduler"], meta)

    # ------------------------------------------------------------------ reporting

    def _published_record(self, state: str) -> IslandProgress:
        """The record the reporter publishes, also logged to W&B / TensorBoard when asked for."""
        record = progress_record(self, state)
        self.explog.log(record)
        return record

    @property
    def client_mode(self) -> bool:
        """True when this island takes part in rounds as a client: it sends its parts and receives the
        averages, reduces nothing and serves no state (docs/DESIGN.md, "Islands behind NAT")."""
        return is_client(self.reachability)

    def refused_peers(self) -> list[str]:
        """Peers this island refused (a private run): at its DHT and at its averagers."""
        if self.admission is None:
            return []
        refused = set(dht_refusals(self.dht)) | {peer for channel in self.channels for peer in channel.refused()}
        return sorted(refused)[:64]

    def _health(self) -> Optional[str]:
        """hivemind's helper processes must live as long as the island; a dead one is fatal."""
        if not self.dht.is_alive():
            return f"the DHT process died (exit code {self.dht.exitcode})"
        for p, channel in enumerate(self.channels):
            if not channel.is_alive():
                return f"the averager of fragment {p} died (exit code {getattr(channel, 'exitcode', None)})"
        return None


def _quietly(action: Callable[[], object], what: str) -> None:
    try:
        action()
    except Exception as e:
        logger.warning("%s failed: %r", what, e)
