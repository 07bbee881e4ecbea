"""An island peer from start to finish: data, model, DHT, averagers, join, train, report, shut down."""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Optional

import torch

from concurrent.futures import Future, ThreadPoolExecutor

from p2p_diloco import checkpoint as ckpt
from p2p_diloco import data as data_lib
from p2p_diloco import transport
from p2p_diloco.config import PeerConfig
from p2p_diloco.errors import ConfigError, FingerprintMismatch, Interrupted
from p2p_diloco.events import EventLog
from p2p_diloco.explog import ExperimentLog
from p2p_diloco.fragments import balanced_layout
from p2p_diloco.learner import Learner
from p2p_diloco.model import build_model, count_parameters, resolve_spec, run_fingerprint
from p2p_diloco.procs import StopSignal
from p2p_diloco.records import IslandProgress, ProgressBoard, finite_or_none, make_validators
from p2p_diloco.syncer import Syncer

logger = logging.getLogger(__name__)


def resolve_device(choice: str) -> torch.device:
    """``auto`` takes CUDA when present; ``cuda`` without a GPU is a ConfigError."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available (use --device cpu or auto)")
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


class Reporter:
    """Every ``period`` seconds: checks the island's helper processes, publishes its progress record,
    reads the other islands' records and shows a status line.

    :param build_record: returns this island's :class:`IslandProgress` for a state name
    :param show: takes (other islands' records, tick) and displays a status line
    :param health: returns None, or why the island cannot go on (a dead helper process)
    :param on_failure: called once when ``health`` reports a problem
    :param reconnect: takes {peer id: multiaddrs} of peers to dial again and returns a future (or
        None); called every ``heal_every`` seconds for islands this one knew but no longer sees, and
        for the initial peers while it sees nobody (see :func:`transport.reconnect_peers`)
    :param initial: the initial peers, {peer id: multiaddrs}
    :param on_records: takes the other islands' records after each read
    """

    def __init__(self, board: ProgressBoard, build_record: Callable[[str], IslandProgress], *, period: float,
                 ttl: float, fingerprint: str, island: str, show: Callable[[list, int], None],
                 health: Callable[[], Optional[str]], on_failure: Callable[[], None],
                 reconnect: Optional[Callable[[dict], object]] = None, initial: Optional[dict] = None,
                 heal_every: float = 5.0, forget_after: float = 600.0,
                 on_records: Optional[Callable[[list], None]] = None):
        self.board, self.build_record, self.period, self.ttl = board, build_record, period, ttl
        self.fingerprint, self.island, self.show = fingerprint, island, show
        self.health, self.on_failure = health, on_failure
        self.reconnect, self.initial = reconnect, dict(initial or {})
        self.heal_every, self.forget_after = heal_every, forget_after
        self.on_records = on_records
        self.known: dict[str, tuple[list[str], float]] = {}  # peer id -> (multiaddrs, last seen)
        self._healing = None
        self._alone = False
        self._last_heal = 0.0
        self.others: list[IslandProgress] = []
        self.state = "loading"
        self.failure: Optional[str] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="reporter", daemon=True)

    def start(self) -> None:
        """Start the background thread."""
        self._thread.start()

    def swarm_bases(self) -> list[tuple[str, list[int], list[str]]]:
        """(island, fragment versions, fragment hashes) of the other live, training islands of this run."""
        return [(r.island, r.fragment_versions, r.fragment_hashes) for r in self.others
                if r.state == "training" and r.fingerprint == self.fingerprint]

    def _loop(self) -> None:
        tick = 0
        while not self._stop.is_set():
            try:
                self.failure = self.health()
                if self.failure:
                    logger.error("%s: stopping the island", self.failure)
                    self.on_failure()
                    return
                self.board.publish(self.build_record(self.state), self.ttl)
                self.others = [r for r in self.board.read() if r.island != self.island]
                if self.on_records is not None:
                    self.on_records(self.others)
                self._heal()
                self.show(self.others, tick)
            except Exception as e:  # a display or record bug must not silence the island
                logger.warning("progress report failed: %r", e)
            tick += 1
            self._stop.wait(self.period)

    def _heal(self) -> None:
        """Dial again the islands we knew but no longer see (their records expired: dead, frozen or
        cut off), so that a partition heals even after the bootstrap node is gone."""
        now = time.time()
        for record in self.others:
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
            if self._alone and answered:
                logger.info("reconnect: %d peer(s) answered", answered)
            self._healing = None
        visible = {record.peer_id for record in self.others}
        if not visible and self.known and not self._alone:
            logger.warning("no other island is visible any more; dialling the %d peer(s) we knew", len(self.known))
        self._alone = not visible
        missing = {peer: maddrs for peer, (maddrs, seen) in self.known.items()
                   if peer not in visible and now - seen < self.forget_after}
        if not visible:
            missing |= {peer: maddrs for peer, maddrs in self.initial.items() if peer not in missing}
        self._last_heal = now
        if missing:
            logger.debug("reconnecting to %d peer(s) we no longer see", len(missing))
            self._healing = self.reconnect(missing)

    def stop(self) -> None:
        """Stop the thread (waits for a DHT call in flight, bounded by the board's timeout)."""
        self._stop.set()
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


class Island:
    """One island of a run: everything that needs no network is prepared in ``__init__`` (so bad
    input fails before the swarm is touched); :meth:`run` joins the swarm, trains and shuts down.

    :param config: the validated peer configuration
    :param stop: set by SIGINT/SIGTERM (or a dead helper process) to end the run
    :raises UserError: for bad data, model or output settings
    """

    def __init__(self, config: PeerConfig, stop: StopSignal):
        self.config, self.stop, self.launched = config, stop, time.time()
        if config.threads:
            torch.set_num_threads(config.threads)
        self.device = resolve_device(config.device)
        self.peers = transport.parse_maddrs(config.initial_peers, what="--initial-peers", need_peer_id=True)
        transport.parse_maddrs(config.host_maddrs, what="--host-maddrs", need_peer_id=False)
        transport.parse_maddrs(config.announce_maddrs, what="--announce-maddrs", need_peer_id=False)
        transport.check_listen_ports(config.host_maddrs)
        self.identity = transport.ensure_identity(config.identity_path) if config.identity_path else ""
        if config.summary_json:
            _check_writable(config.summary_json, "--summary-json")
        if config.checkpoint_dir:
            _check_writable(os.path.join(config.checkpoint_dir, "x"), "--checkpoint-dir")
        try:
            spec = resolve_spec(config.model)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        corpus = data_lib.load_corpus(config.data.path, config.data.tokenizer, spec.vocab_size,
                                      config.data.eval_fraction)
        self.model = build_model(spec, corpus.vocab_size, config.model.seed).to(self.device)
        named = dict(self.model.named_parameters())
        try:
            self.layout = balanced_layout([(name, p.numel()) for name, p in named.items()], config.outer.fragments)
        except ValueError as e:
            raise ConfigError(f"outer.fragments (--outer-fragments): {e}") from None
        self.shapes = [[named[name].shape for name in names] for names in self.layout.fragments]
        self.fingerprint = run_fingerprint(spec, corpus.vocab_size, config.model.seed, corpus.tokenizer_sha,
                                           config.outer)
        shard = config.data.shard_index
        if shard < 0:
            shard = data_lib.default_shard_index(config.island, config.data.num_shards)
        if shard >= config.data.num_shards:
            raise ConfigError(f"data.shard_index (--data-shard-index) {shard} must be below data.num_shards "
                              f"({config.data.num_shards})")
        batch_size = config.inner.batch_size or spec.batch_size
        self.tokens_per_step = batch_size * spec.seq_len
        sampler = data_lib.BatchSampler(corpus.shard(shard, config.data.num_shards), batch_size, spec.seq_len,
                                        config.model.seed, config.island)
        eval_data = data_lib.eval_batches(corpus.eval, config.eval_batches, batch_size, spec.seq_len)
        try:
            self.events = EventLog(config.log_jsonl, config.island)
        except OSError as e:
            raise ConfigError(f"--log-jsonl {config.log_jsonl}: cannot write ({e.strerror or e})") from None
        self.learner = Learner(model=self.model, layout=self.layout, next_batch=sampler.next_batch,
                               eval_data=eval_data, device=self.device, inner=config.inner,
                               slowdown=config.slowdown, slowdown_jitter=config.slowdown_jitter,
                               events=self.events)
        self.device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        logger.info(
            "island %s: %s model, %.2fM parameters, %d fragments, device %s, shard %d/%d (%d tokens), fingerprint %s",
            config.island, config.model.preset, count_parameters(self.model) / 1e6, self.layout.num_fragments,
            self.device, shard, config.data.num_shards, len(sampler.tokens), self.fingerprint,
        )
        self.shard, self.sampler = shard, sampler
        self.resume, self.resumed_from, self.last_checkpoint = None, None, None
        if config.checkpoint_dir:
            try:
                self.resume, self.resumed_from = ckpt.load_newest(config.checkpoint_dir, fingerprint=self.fingerprint)
            except ckpt.CheckpointMismatch as e:
                raise ConfigError(f"--checkpoint-dir: {e}; use another folder for this configuration") from None
            if self.resume is not None:
                logger.info("resuming from %s (inner step %d, fragment versions %s)", self.resumed_from,
                            self.resume.meta["inner_step"], [f.version for f in self.resume.fragments])
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._writing: Optional[Future] = None
        self._next_checkpoint = time.monotonic() + config.checkpoint_every
        self.dht = None
        self.syncer: Optional[Syncer] = None
        self.reporter: Optional[Reporter] = None
        self.explog: Optional[ExperimentLog] = None
        self.status_line: Optional[StatusLine] = None
        self.peer_id, self.maddrs = "", []

    # ------------------------------------------------------------------ phases

    def run(self) -> Optional[dict]:
        """Join, train until a limit or a signal, shut down; returns the summary (None if the island
        never trained), also written to ``--summary-json``.

        :raises UserError: unreachable peers, a refused fingerprint, an interruption while connecting
        """
        config = self.config
        if self.stop.event.is_set():
            raise Interrupted("interrupted before joining the swarm")
        self.corrupting = "" if config.debug_corrupt_on_signal else config.debug_corrupt_outer
        self._notes: queue.SimpleQueue = queue.SimpleQueue()  # put() is safe in a signal handler
        if config.debug_corrupt_outer and config.debug_corrupt_on_signal:  # before the start event
            signal.signal(signal.SIGUSR2, self._toggle_corrupt)
            logger.warning("testing mode: SIGUSR2 makes this island send %s pseudo-gradients",
                           config.debug_corrupt_outer)
        # before joining: a W&B or TensorBoard mistake shows at once
        self.explog = ExperimentLog(run_id=config.run_id, island=config.island, config=config.model_dump(),
                                    wandb_project=config.wandb_project, wandb_mode=config.wandb_mode,
                                    tensorboard_dir=config.tensorboard_dir)
        validators, public_key = make_validators(config.run_id)
        try:
            self.dht = transport.start_dht(
                initial_peers=self.peers, host_maddrs=config.host_maddrs, announce_maddrs=config.announce_maddrs,
                identity_path=self.identity, record_validators=validators, join_timeout=config.join_timeout,
                stop_event=self.stop.event, wait_timeout=config.dht_wait_timeout,
            )
        except BaseException:
            self.explog.close()
            raise
        summary, stop_reason = None, "error"
        try:
            self.peer_id, self.maddrs = str(self.dht.peer_id), transport.visible_maddrs(self.dht)
            board = ProgressBoard(self.dht, config.run_id, public_key)
            others = [r for r in board.read() if r.island != config.island]
            self._check_fingerprint(others)
            logger.info("island %s (peer %s) listening at %s", config.island, self.peer_id, " ".join(self.maddrs))
            self.events({"event": "start", "peer_id": self.peer_id, "fingerprint": self.fingerprint,
                         "maddrs": self.maddrs, "device": str(self.device), "shard": self.shard})
            self.syncer = Syncer(
                run_id=config.run_id, fingerprint=self.fingerprint, island=config.island, config=config.outer,
                layout=self.layout, shapes=self.shapes, learner=self.learner, events=self.events,
                swarm_bases=lambda: self.reporter.swarm_bases(),
                corrupt=self.corrupting,
                donate_delay=config.debug_donate_delay,
            )
            self.syncer.corrupt = self.corrupting  # (a SIGUSR2 may have come in while it was built)
            if config.debug_corrupt_outer and not config.debug_corrupt_on_signal:
                logger.warning("testing mode: this island sends %s pseudo-gradients", config.debug_corrupt_outer)
            try:
                self.syncer.create_averagers(self.dht)  # processes forked from the main thread
            finally:
                self.stop.install()  # hivemind's averager turned SIGINT off in this process
            self.status_line = StatusLine()
            self.reporter = Reporter(board, self._published_record, period=config.progress_period, ttl=config.progress_ttl,
                                     fingerprint=self.fingerprint, island=config.island, show=self._show,
                                     health=self._health, on_failure=self.stop.event.set,
                                     reconnect=lambda peers: transport.reconnect_peers(self.dht, peers),
                                     initial=transport.peers_by_id(self.peers),
                                     # learn which islands the swarm caught sending garbage (a restart forgets)
                                     on_records=lambda others: self.syncer.adopt_flags(
                                         [(r.island, r.flagged) for r in others if r.fingerprint == self.fingerprint]))
            self.reporter.start()
            if self.resume is not None:
                self._restore()
            else:
                self._join([r for r in others if r.state == "training" and r.fingerprint == self.fingerprint])
            self.syncer.start()
            self.reporter.state = "training"
            self.learner.evaluate()
            stop_reason = self.learner.run(self.stop.event, max_steps=config.max_steps,
                                           max_seconds=config.max_minutes * 60, eval_every=config.eval_every,
                                           between_steps=self._maybe_checkpoint if config.checkpoint_dir else None)
            if self.reporter.failure:
                stop_reason = "helper_died"
            logger.info("stopping (%s)", stop_reason)
        except KeyboardInterrupt:
            stop_reason = "signal"
        finally:
            summary = self._finish(stop_reason)
        return summary

    def _check_fingerprint(self, others: list[IslandProgress]) -> None:
        """Refuse to join a run whose training islands all have another fingerprint."""
        training = [r for r in others if r.state == "training"]
        if training and all(r.fingerprint != self.fingerprint for r in training):
            theirs = ", ".join(sorted({r.fingerprint for r in training}))
            raise FingerprintMismatch(
                f"run {self.config.run_id!r} trains fingerprint {theirs} but this island has {self.fingerprint}: "
                "use the same --preset/--config/--tokenizer/--data and outer settings as the swarm, or another --run-id"
            )

    def _join(self, donors: list[IslandProgress]) -> None:
        """Download the global parameters from live islands, or start from the seeded initial weights."""
        syncer = self.syncer
        if donors:
            logger.info("joining: downloading global parameters from %d live island(s)", len(donors))
            self.events({"event": "join_start", "donors": sorted(r.island for r in donors)})
            if syncer.load_from_peers(timeout=self.config.join_timeout, stop=self.stop.event):
                for p in range(self.layout.num_fragments):
                    self.learner.load_global(p, syncer.global_params(p))
                logger.info("joined at fragment versions %s", syncer.versions)
                return
            if self.stop.event.is_set():
                raise Interrupted("interrupted while downloading the global parameters")
            logger.warning("could not download the global parameters; starting from the initial weights "
                           "(the first round's base check reloads them)")
        syncer.initialize(self.learner.fragment_params)

    def _restore(self) -> None:
        """Continue from the checkpoint found at start: global states, then the inner state. A swarm
        that moved on meanwhile is caught up by the first round's base check (keeping local progress)."""
        saved = self.resume
        try:
            self.syncer.restore(saved.fragments)
            self.learner.restore(saved.params, saved.exp_avg, saved.exp_avg_sq, saved.meta)
        except (ValueError, KeyError) as e:
            raise ConfigError(f"--checkpoint-dir: {self.resumed_from} does not fit this model ({e})") from None
        if saved.meta.get("sampler"):
            self.sampler.rng.bit_generator.state = saved.meta["sampler"]
        self.events({"event": "resume", "path": str(self.resumed_from), "inner_step": saved.meta["inner_step"],
                     "versions": self.syncer.versions})
        self.resume = None  # release the tensors

    def _capture(self) -> ckpt.IslandCheckpoint:
        """A consistent checkpoint of this island, taken on the learner thread at a step boundary."""
        states = self.syncer.consistent_states(lambda: self.learner.apply_updates(force=True))
        inner = self.learner.capture()
        fragments = [ckpt.GlobalFragment(s.theta, s.momentum, s.version, s.hash, s.support) for s in states]
        meta = inner["meta"] | {"sampler": self.sampler.rng.bit_generator.state}
        return ckpt.IslandCheckpoint(self.fingerprint, self.config.island, fragments, inner["params"],
                                     inner["exp_avg"], inner["exp_avg_sq"], meta)

    def _save(self, checkpoint: ckpt.IslandCheckpoint) -> None:
        started = time.monotonic()
        path = ckpt.save_checkpoint(self.config.checkpoint_dir, checkpoint, keep=self.config.checkpoint_keep)
        self.last_checkpoint = str(path)
        self.events({"event": "checkpoint", "path": str(path), "seconds": time.monotonic() - started,
                     "bytes": path.stat().st_size, "inner_step": checkpoint.meta["inner_step"],
                     "versions": [f.version for f in checkpoint.fragments]})

    def _maybe_checkpoint(self) -> None:
        """Every ``checkpoint_every`` seconds: capture now, write in the background (skipped while the
        previous write is still running)."""
        if time.monotonic() < self._next_checkpoint or (self._writing is not None and not self._writing.done()):
            return
        self._next_checkpoint = time.monotonic() + self.config.checkpoint_every
        checkpoint = self._capture()
        self._writing = self._writer.submit(self._save, checkpoint)
        self._writing.add_done_callback(
            lambda f: f.exception() and logger.error("checkpoint failed: %r", f.exception()))

    def _finish(self, stop_reason: str) -> Optional[dict]:
        """Stop rounds, evaluate, write the summary, then shut down; each step runs even if one fails."""
        learner, syncer, reporter = self.learner, self.syncer, self.reporter
        if reporter is not None:
            reporter.state = "stopping"
        _quietly(learner.close, "closing the learner")
        summary: Optional[dict] = None
        if syncer is not None:
            outer_cfg = self.config.outer
            _quietly(lambda: syncer.stop(timeout=outer_cfg.allreduce_timeout + outer_cfg.grace_window + 2.0),
                     "stopping rounds")
            if learner.stats.inner_steps:  # the run trained: its figures are kept, whatever ended it
                if stop_reason != "error":
                    _quietly(learner.evaluate, "final evaluation")
                    if self.config.checkpoint_dir:  # after the last round: no completed round is lost
                        if self._writing is not None:
                            _quietly(self._writing.result, "waiting for the periodic checkpoint")
                        _quietly(lambda: self._save(self._capture()), "the final checkpoint")
                if self.explog is not None:  # the final figures (after the last eval)
                    _quietly(lambda: self.explog.log(self._record("stopping")), "logging the final metrics")
                try:
                    summary = make_summary(self, stop_reason)
                    if self.config.summary_json:
                        write_json_atomic(self.config.summary_json, summary)
                except Exception as e:
                    logger.warning("writing the summary failed: %r", e)
        if reporter is not None:
            _quietly(reporter.stop, "stopping the reporter")
            if self.dht.is_alive():
                _quietly(reporter.board.withdraw, "withdrawing the progress record")
        if self.explog is not None:
            _quietly(self.explog.close, "closing the experiment log")
        if self.status_line is not None:
            _quietly(self.status_line.close, "closing the status line")
        _quietly(lambda: self.events({"event": "stop", "reason": stop_reason}), "logging the stop")
        _quietly(self.events.close, "closing the event log")
        if self.dht is not None and self.dht.is_alive():
            _quietly(self.dht.shutdown, "shutting down the DHT")
        if syncer is not None:
            _quietly(syncer.close, "ending the averagers")
        self._writer.shutdown(wait=True)
        return summary

    # ------------------------------------------------------------------ reporting

    def _toggle_corrupt(self, _signum, _frame) -> None:
        """SIGUSR2 (testing only, ``--debug-corrupt-on-signal``): turn faulty, or healthy again."""
        faulty = "" if self.corrupting else self.config.debug_corrupt_outer
        self.corrupting = faulty
        if self.syncer is not None:
            self.syncer.corrupt = faulty  # read by the round threads at their next round
        # logged by the reporter's thread: here the main thread may hold the event log's lock
        self._notes.put({"event": "corrupt", "value": faulty})

    def _record(self, state: str) -> IslandProgress:
        while not self._notes.empty():  # events noted by signal handlers
            note = self._notes.get_nowait()
            self.events(note)
            logger.warning("testing mode: this island now sends %s pseudo-gradients", note["value"] or "honest")
        stats, sync, learner = self.learner.stats, self.syncer.stats, self.learner
        return IslandProgress(
            island=self.config.island, peer_id=self.peer_id, fingerprint=self.fingerprint, device=self.device_name,
            state=state, maddrs=self.maddrs, inner_step=stats.inner_steps, tokens=stats.tokens,
            tokens_per_second=float(learner.tokens_per_second()),
            loss=finite_or_none(stats.loss_ema), eval_loss=finite_or_none(stats.eval_loss),
            fragment_versions=self.syncer.versions, fragment_hashes=self.syncer.hashes,
            rounds_ok=sync.rounds_ok, rounds_failed=sync.rounds_failed, rounds_rejected=sync.rounds_rejected,
            flagged=sorted(list(self.syncer.flagged)),
            bytes_sent=sync.bytes_sent, bytes_received=sync.bytes_received,
            peak_bytes_per_step=sync.peak_bytes_per_step,
            utilization=float(stats.utilization),
            goodput=float(min(1.0, stats.inner_time / max(1e-9, time.time() - self.launched))),
            started=float(stats.first_step_start), time=time.time(),
        )

    def _published_record(self, state: str) -> IslandProgress:
        """The record the reporter publishes, also logged to W&B / TensorBoard when asked for."""
        record = self._record(state)
        self.explog.log(record)
        return record

    def _show(self, others: list[IslandProgress], tick: int) -> None:
        stats, sync = self.learner.stats, self.syncer.stats
        loss = f"{stats.loss_ema:.3f}" if stats.loss_ema is not None else "-"
        eval_loss = f"{stats.eval_loss:.3f}" if stats.eval_loss is not None else "-"
        self.status_line.update(
            f"{self.config.island}: step {stats.inner_steps} | {stats.tokens / 1e6:.2f}M tok | "
            f"{self.learner.tokens_per_second():,.0f} tok/s | loss {loss} | eval {eval_loss} | "
            f"v{self.syncer.versions} | rounds {sync.rounds_ok} ok/{sync.rounds_failed} failed | "
            f"util {stats.utilization:.3f} | {len(others)} other islands", tick)

    def _health(self) -> Optional[str]:
        """hivemind's helper processes must live as long as the island; a dead one is fatal."""
        if not self.dht.is_alive():
            return f"the DHT process died (exit code {self.dht.exitcode})"
        for p, averager in enumerate(self.syncer.averagers):
            if not averager.is_alive():
                return f"the averager of fragment {p} died (exit code {averager.exitcode})"
        return None


def make_summary(island: Island, stop_reason: str) -> dict:
    """The island's end-of-run figures (what ``--summary-json`` holds; times in seconds, traffic in bytes)."""
    config, stats, sync = island.config, island.learner.stats, island.syncer.stats
    outer_periods = stats.wall_time / config.outer.period if stats.wall_time else 0.0
    return {
        "island": config.island,
        "run_id": config.run_id,
        "peer_id": island.peer_id,
        "fingerprint": island.fingerprint,
        "device": str(island.device),
        "preset": config.model.preset,
        "parameters": count_parameters(island.model),
        "stop_reason": stop_reason,
        "wall_seconds": round(stats.wall_time, 3),
        "inner_steps": stats.inner_steps,
        "tokens": stats.tokens,
        "tokens_per_second": round(stats.tokens / stats.wall_time, 2) if stats.wall_time else 0.0,
        "inner_steps_per_outer_period": round(stats.inner_steps / outer_periods, 2) if outer_periods else None,
        "outer_rounds_ok": sync.rounds_ok,
        "outer_rounds_failed": sync.rounds_failed,
        "outer_rounds_skipped": sync.rounds_skipped,
        "outer_rounds_rejected": sync.rounds_rejected,
        "flagged_islands": sorted(list(island.syncer.flagged)),
        "group_sizes": {str(k): v for k, v in sorted(Counter(sync.group_sizes).items())},
        "state_downloads": sync.reloads,
        "fragment_versions": island.syncer.versions,
        "loss_first": stats.loss_first,
        "loss_last": stats.loss,
        "eval_loss_first": stats.eval_loss_first,
        "eval_loss_last": stats.eval_loss,
        "compute_utilization": round(stats.utilization, 4),
        "bytes_sent": sync.bytes_sent,
        "bytes_received": sync.bytes_received,
        **bandwidth_figures(sync, stats.tokens, count_parameters(island.model), island.tokens_per_step),
        "elements_clipped": sync.clipped,
        "resumed_from": str(island.resumed_from) if island.resumed_from else None,
        "checkpoint": island.last_checkpoint,
    }


def bandwidth_figures(sync, tokens: int, parameters: int, tokens_per_step: int) -> dict:
    """Traffic per token, next to what data-parallel training of the same model would send.

    A ring all-reduce of fp32 gradients sends 2 x parameters x 4 bytes per worker and inner step
    (2 (n-1)/n of the gradient, rounded up to 2), which for this island's batch is
    ``8 * parameters / tokens_per_step`` bytes per token. Ours: the bytes this island sent, rounds
    and state downloads served together, per token it trained.

    :param sync: the syncer's stats (bytes counted by the codecs and the state transfers)
    :param tokens: tokens this island trained
    :param parameters: model parameters
    :param tokens_per_step: tokens per inner step (batch x sequence length)
    :returns: bytes_per_token (sent), round_bytes_per_token (rounds only, sent), dp_bytes_per_token,
        reduction_vs_dp (dp / ours; None when nothing was sent), peak_bytes_per_inner_step
    """
    dp = 2.0 * parameters * 4 / max(1, tokens_per_step)
    ours = sync.bytes_sent / tokens if tokens else None
    return {
        "bytes_per_token": round(ours, 3) if ours is not None else None,
        "round_bytes_per_token": round(sync.round_bytes_sent / tokens, 3) if tokens else None,
        "dp_bytes_per_token": round(dp, 3),
        "reduction_vs_dp": round(dp / ours, 1) if ours else None,
        "peak_bytes_per_inner_step": sync.peak_bytes_per_step,
    }


def run_peer(config: PeerConfig, stop: StopSignal) -> Optional[dict]:
    """Run one island until a limit or a signal; returns its summary (see :class:`Island`)."""
    return Island(config, stop).run()


def write_json_atomic(path: str, payload: dict) -> None:
    """Write JSON through a temporary file and a rename, so readers never see half a file."""
    target = Path(path).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, target)


def _check_writable(path: str, flag: str) -> None:
    """Fail at startup, not after the run, when an output file cannot be written."""
    folder = Path(path).expanduser().absolute().parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".p2p_diloco_check"):
            pass
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot write in {folder} ({e.strerror or e})") from None


def _quietly(action: Callable[[], object], what: str) -> None:
    try:
        action()
    except Exception as e:
        logger.warning("%s failed: %r", what, e)
