"""An island peer from start to finish: data, model, DHT, averagers, join, train, report, shut down."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Optional

import torch

from p2p_diloco import data as data_lib
from p2p_diloco.config import PeerConfig
from p2p_diloco.errors import ConfigError, FingerprintMismatch
from p2p_diloco.events import EventLog
from p2p_diloco.fragments import balanced_layout
from p2p_diloco.learner import Learner
from p2p_diloco.model import build_model, count_parameters, resolve_spec, run_fingerprint
from p2p_diloco.procs import StopSignal
from p2p_diloco.records import IslandProgress, ProgressBoard, make_validators
from p2p_diloco.syncer import Syncer
from p2p_diloco import transport

logger = logging.getLogger(__name__)


def resolve_device(choice: str) -> torch.device:
    """``auto`` takes CUDA when present; ``cuda`` without a GPU is a ConfigError."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available (use --device cpu or auto)")
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


class Reporter:
    """Publishes this island's progress record every ``period`` seconds, reads the others', and shows
    a status line (a live line on a TTY, a log line every few periods otherwise)."""

    def __init__(self, board: ProgressBoard, build_record, *, period: float, ttl: float, fingerprint: str,
                 island: str, show, health, on_failure):
        self.board, self.build_record, self.period, self.ttl = board, build_record, period, ttl
        self.fingerprint, self.island, self.show = fingerprint, island, show
        self.health, self.on_failure = health, on_failure
        self.others: list[IslandProgress] = []
        self.state = "loading"
        self.failure: Optional[str] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="reporter", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def swarm_versions(self) -> list[list[int]]:
        """Fragment versions reported by the other live, training islands of this run."""
        return [r.fragment_versions for r in self.others if r.state == "training" and r.fingerprint == self.fingerprint]

    def _loop(self) -> None:
        ticks = 0
        while not self._stop.is_set():
            self.failure = self.health()
            if self.failure:
                logger.error("%s: stopping the island", self.failure)
                self.on_failure()
                return
            self.board.publish(self.build_record(self.state), self.ttl)
            self.others = [r for r in self.board.read() if r.island != self.island]
            self.show(self.others, ticks)
            ticks += 1
            self._stop.wait(self.period)

    def stop(self) -> None:
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
        if self.live is not None:
            self.live.update(text)
        elif tick % self.every == 0:
            logger.info(text)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()


def run_peer(config: PeerConfig, stop: StopSignal) -> dict:
    """Run one island until a limit or a signal; returns its summary (also written to --summary-json).

    :raises UserError: for bad input (data, peers, fingerprint); nothing of the swarm is touched then
    """
    launched = time.time()
    if config.threads:
        torch.set_num_threads(config.threads)
    torch.set_flush_denormal(True)  # outer updates leave tiny values; denormal maths is slow on CPUs
    device = resolve_device(config.device)
    peers = transport.parse_maddrs(config.initial_peers, what="--initial-peers", need_peer_id=True)
    transport.parse_maddrs(config.host_maddrs, what="--host-maddrs", need_peer_id=False)
    transport.parse_maddrs(config.announce_maddrs, what="--announce-maddrs", need_peer_id=False)
    transport.check_listen_ports(config.host_maddrs)
    identity = transport.ensure_identity(config.identity_path) if config.identity_path else ""

    try:
        spec = resolve_spec(config.model)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    corpus = data_lib.load_corpus(config.data.path, config.data.tokenizer, spec.vocab_size, config.data.eval_fraction)
    model = build_model(spec, corpus.vocab_size, config.model.seed).to(device)
    named = list(model.named_parameters())
    try:
        layout = balanced_layout([(name, p.numel()) for name, p in named], config.outer.fragments)
    except ValueError as e:
        raise ConfigError(f"outer.fragments (--outer-fragments): {e}") from None
    shapes = [[dict(named)[name].shape for name in names] for names in layout.fragments]
    fingerprint = run_fingerprint(spec, corpus.vocab_size, config.model.seed, corpus.tokenizer_sha, config.outer)
    shard_index = config.data.shard_index if config.data.shard_index >= 0 else data_lib.default_shard_index(
        config.island, config.data.num_shards)
    if shard_index >= config.data.num_shards:
        raise ConfigError(f"data.shard_index (--data-shard-index) {shard_index} must be below data.num_shards "
                          f"({config.data.num_shards})")
    batch_size = config.inner.batch_size or spec.batch_size
    sampler = data_lib.BatchSampler(corpus.shard(shard_index, config.data.num_shards), batch_size, spec.seq_len,
                                    config.model.seed, config.island)
    eval_data = data_lib.eval_batches(corpus.eval, config.eval_batches, batch_size, spec.seq_len)
    logger.info(
        "island %s: %s model, %.2fM parameters, %d fragments, device %s, shard %d/%d (%d tokens), fingerprint %s",
        config.island, config.model.preset, count_parameters(model) / 1e6, layout.num_fragments, device,
        shard_index, config.data.num_shards, len(sampler.tokens), fingerprint,
    )

    events = EventLog(config.log_jsonl, config.island)
    validators, public_key = make_validators(config.run_id)
    dht = transport.start_dht(
        initial_peers=peers, host_maddrs=config.host_maddrs, announce_maddrs=config.announce_maddrs,
        identity_path=identity, record_validators=validators, join_timeout=config.join_timeout, stop_event=stop.event,
    )
    learner: Optional[Learner] = None
    syncer: Optional[Syncer] = None
    reporter: Optional[Reporter] = None
    status_line: Optional[StatusLine] = None
    stop_reason = "error"
    maddrs = transport.visible_maddrs(dht)
    peer_id = str(dht.peer_id)
    try:
        board = ProgressBoard(dht, config.run_id, public_key)
        others = [r for r in board.read() if r.island != config.island]
        foreign = sorted({r.fingerprint for r in others if r.fingerprint != fingerprint})
        if foreign:
            raise FingerprintMismatch(
                f"run {config.run_id!r} trains fingerprint {', '.join(foreign)} but this island has {fingerprint}: "
                "use the same --preset/--config/--tokenizer/--data and outer settings as the swarm, or another --run-id"
            )
        logger.info("island %s (peer %s) listening at %s", config.island, peer_id, " ".join(maddrs))
        events({"event": "start", "peer_id": peer_id, "fingerprint": fingerprint, "maddrs": maddrs,
                "device": str(device), "shard": shard_index})

        learner = Learner(model=model, layout=layout, next_batch=sampler.next_batch, eval_data=eval_data,
                          device=device, inner=config.inner, slowdown=config.slowdown, events=events)
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"

        def build_record(state: str) -> IslandProgress:
            stats, sync = learner.stats, syncer.stats
            return IslandProgress(
                island=config.island, peer_id=peer_id, fingerprint=fingerprint, device=device_name, state=state,
                maddrs=maddrs, inner_step=stats.inner_steps, tokens=stats.tokens,
                tokens_per_second=float(learner.tokens_per_second()),
                loss=_finite_or_none(stats.loss_ema), eval_loss=_finite_or_none(stats.eval_loss),
                fragment_versions=syncer.versions, fragment_hashes=syncer.hashes,
                rounds_ok=sync.rounds_ok, rounds_failed=sync.rounds_failed,
                bytes_sent=sync.bytes_sent, bytes_received=sync.bytes_received,
                utilization=float(stats.utilization),
                goodput=float(min(1.0, stats.inner_time / max(1e-9, time.time() - launched))),
                started=float(stats.first_step_start), time=time.time(),
            )

        status_line = StatusLine()

        def show(others_now: list[IslandProgress], tick: int) -> None:
            stats, sync = learner.stats, syncer.stats
            loss = f"{stats.loss_ema:.3f}" if stats.loss_ema is not None else "-"
            eval_loss = f"{stats.eval_loss:.3f}" if stats.eval_loss is not None else "-"
            status_line.update(
                f"{config.island}: step {stats.inner_steps} | {stats.tokens / 1e6:.2f}M tok | "
                f"{learner.tokens_per_second():,.0f} tok/s | loss {loss} | eval {eval_loss} | "
                f"v{syncer.versions} | rounds {sync.rounds_ok} ok/{sync.rounds_failed} failed | "
                f"util {stats.utilization:.3f} | {len(others_now)} other islands", tick)

        syncer = Syncer(
            run_id=config.run_id, fingerprint=fingerprint, island=config.island, config=config.outer, layout=layout,
            shapes=shapes, learner=learner, events=events, swarm_versions=lambda: reporter.swarm_versions(),
        )
        syncer.create_averagers(dht)  # processes forked from the main thread
        stop.install()  # hivemind's averager turned SIGINT off in this process
        def health() -> Optional[str]:
            """hivemind's helper processes must live as long as the island; a dead one is fatal."""
            if not dht.is_alive():
                return f"the DHT process died (exit code {dht.exitcode})"
            for p, averager in enumerate(syncer.averagers):
                if not averager.is_alive():
                    return f"the averager of fragment {p} died (exit code {averager.exitcode})"
            return None

        reporter = Reporter(board, build_record, period=config.progress_period, ttl=config.progress_ttl,
                            fingerprint=fingerprint, island=config.island, show=show, health=health,
                            on_failure=stop.event.set)
        reporter.start()

        donors = [r for r in others if r.state == "training" and r.fingerprint == fingerprint]
        if donors:
            logger.info("joining: downloading global parameters from %d live island(s)", len(donors))
            if syncer.load_from_peers(timeout=config.join_timeout, stop=stop.event):
                for p in range(layout.num_fragments):
                    learner.load_global(p, syncer.global_params(p))
                logger.info("joined at fragment versions %s", syncer.versions)
            elif stop.event.is_set():
                raise KeyboardInterrupt
            else:
                logger.warning("could not download the global parameters; starting from the initial weights "
                               "(the first shared round will reload them)")
                syncer.initialize(learner.fragment_params)
        else:
            syncer.initialize(learner.fragment_params)
        syncer.start()
        reporter.state = "training"
        learner.evaluate()
        stop_reason = learner.run(stop.event, max_steps=config.max_steps, max_seconds=config.max_minutes * 60,
                                  eval_every=config.eval_every)
        if reporter.failure:
            stop_reason = "helper_died"
        logger.info("stopping (%s)", stop_reason)
    except KeyboardInterrupt:
        stop_reason = "signal"
    finally:
        if reporter is not None:
            reporter.state = "stopping"
        if learner is not None:
            learner.close()
        if syncer is not None:
            syncer.stop(timeout=config.outer.allreduce_timeout + config.outer.grace_window + 2.0)
        summary = None
        if learner is not None and syncer is not None and stop_reason != "error":
            if learner.stats.inner_steps:
                learner.evaluate()
            summary = make_summary(config, learner, syncer, peer_id, fingerprint, str(device), stop_reason,
                                   count_parameters(model))
        if reporter is not None:
            reporter.stop()
            if dht.is_alive():
                reporter.board.withdraw()
        if status_line is not None:
            status_line.close()
        events({"event": "stop", "reason": stop_reason})
        events.close()
        try:
            if dht.is_alive():
                dht.shutdown()
        except Exception as e:
            logger.debug("dht shutdown: %r", e)
        if syncer is not None:
            syncer.close()
    if summary is not None and config.summary_json:
        write_json_atomic(config.summary_json, summary)
    return summary


def make_summary(config: PeerConfig, learner: Learner, syncer: Syncer, peer_id: str, fingerprint: str,
                 device: str, stop_reason: str, parameters: int) -> dict:
    """The island's end-of-run figures (what ``--summary-json`` holds)."""
    stats, sync = learner.stats, syncer.stats
    outer_periods = stats.wall_time / config.outer.period if stats.wall_time else 0.0
    return {
        "island": config.island,
        "run_id": config.run_id,
        "peer_id": peer_id,
        "fingerprint": fingerprint,
        "device": device,
        "preset": config.model.preset,
        "parameters": parameters,
        "stop_reason": stop_reason,
        "wall_seconds": round(stats.wall_time, 3),
        "inner_steps": stats.inner_steps,
        "tokens": stats.tokens,
        "tokens_per_second": round(stats.tokens / stats.wall_time, 2) if stats.wall_time else 0.0,
        "inner_steps_per_outer_period": round(stats.inner_steps / outer_periods, 2) if outer_periods else None,
        "outer_rounds_ok": sync.rounds_ok,
        "outer_rounds_failed": sync.rounds_failed,
        "outer_rounds_skipped": sync.rounds_skipped,
        "group_sizes": {str(k): v for k, v in sorted(Counter(sync.group_sizes).items())},
        "state_downloads": sync.reloads,
        "fragment_versions": syncer.versions,
        "loss_first": stats.loss_first,
        "loss_last": stats.loss,
        "eval_loss_first": stats.eval_loss_first,
        "eval_loss_last": stats.eval_loss,
        "compute_utilization": round(stats.utilization, 4),
        "bytes_sent": sync.bytes_sent,
        "bytes_received": sync.bytes_received,
        "elements_clipped": sync.clipped,
    }


def write_json_atomic(path: str, payload: dict) -> None:
    """Write JSON through a temporary file and a rename, so readers never see half a file."""
    target = Path(path).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, target)


def _finite_or_none(value: Optional[float]) -> Optional[float]:
    import math

    return float(value) if value is not None and math.isfinite(value) else None
