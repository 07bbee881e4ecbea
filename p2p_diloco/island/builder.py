"""The factory of an island (docs/DESIGN.md, "Role objects"): :class:`IslandBuilder` assembles an
:class:`~p2p_diloco.island.peer.Island` from its :class:`~p2p_diloco.config.PeerConfig`, everything
that needs no network first (so bad input fails before the swarm is touched). Its methods below
:meth:`IslandBuilder.build` make one part each; the lab overrides them to inject faults
(``p2p_diloco.lab.faults``).
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import torch

from p2p_diloco.algo.clock import SwarmClock
from p2p_diloco.algo.fragments import balanced_layout
from p2p_diloco.config import OuterConfig, PeerConfig
from p2p_diloco.errors import ConfigError
from p2p_diloco.island import checkpoint as ckpt
from p2p_diloco.island import data as data_lib
from p2p_diloco.island import joining
from p2p_diloco.island.contribution import RoundFormat
from p2p_diloco.island.events import EventLog
from p2p_diloco.island.learner import Learner
from p2p_diloco.island.model import (build_model, count_parameters, flops_per_token, model_config_sha, peak_flops,
                                     resolve_spec, run_fingerprint, weights_hash)
from p2p_diloco.island.peer import Island
from p2p_diloco.island.quarantine import Quarantine
from p2p_diloco.island.ranks import start_ranks
from p2p_diloco.island.store import FragmentStore
from p2p_diloco.island.syncer import SyncerStats
from p2p_diloco.island.transfer import StateTransfer
from p2p_diloco.net.channel import FragmentChannel, HivemindChannel
from p2p_diloco.net.gate import load_admission
from p2p_diloco.net.dht import check_listen_ports, ensure_identity, parse_maddrs
from p2p_diloco.procs import StopSignal

logger = logging.getLogger(__name__)


def resolve_device(choice: str) -> torch.device:
    """``auto`` takes CUDA when present; ``cuda`` without a GPU is a ConfigError."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available (use --device cpu or auto)")
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def run_peer(config: PeerConfig, stop: StopSignal, builder: Optional[type["IslandBuilder"]] = None) -> Optional[dict]:
    """Run one island until a limit or a signal; returns its summary (see :meth:`Island.run`).

    :param builder: the :class:`IslandBuilder` class to assemble it with (the lab passes its own)
    :raises UserError: bad input, unreachable peers, a refused fingerprint, an early interruption
    """
    island = (builder or IslandBuilder)(config, stop).build()
    return island.run() if island.ranks is None or island.ranks.leader else island.follow()


class IslandBuilder:
    """Assembles an :class:`Island` from a validated configuration: the factory. The methods below
    :meth:`build` make one part each; the lab overrides them to inject faults.

    :param config: the validated peer configuration
    :param stop: set by SIGINT/SIGTERM (or a dead helper process) to end the run
    """

    def __init__(self, config: PeerConfig, stop: StopSignal):
        self.config, self.stop = config, stop

    def build(self) -> Island:
        """Every part that needs no network (data, model, learner, the syncer's offline parts).

        :raises UserError: for bad data, model, address or output settings
        """
        config, launched = self.config, time.time()
        if config.threads:
            torch.set_num_threads(config.threads)
        device = resolve_device(config.device)
        ranks = start_ranks(config.island_parallel, device, config.nproc_per_node, leader_work=config.join_timeout)
        if ranks is not None:
            device = ranks.device  # (FSDP with --checkpoint-dir is refused by the configuration)
            if not ranks.leader:
                return self._follower(ranks, device, launched)
        peers = parse_maddrs(config.initial_peers, what="--initial-peers", need_peer_id=True)
        parse_maddrs(config.host_maddrs, what="--host-maddrs", need_peer_id=False)
        parse_maddrs(config.announce_maddrs, what="--announce-maddrs", need_peer_id=False)
        check_listen_ports(config.host_maddrs)
        identity = ensure_identity(config.identity_path) if config.identity_path else ""
        for path, flag in ((config.logging.summary_json, "--summary-json"),
                           (os.path.join(config.checkpoint.dir, "x") if config.checkpoint.dir else "", "--checkpoint-dir")):
            if path:
                _check_writable(path, flag)
        admission = load_admission(config.admission, identity_path=identity, run_id=config.run_id, role="island",
                                   where=f"island {config.island}")
        island = Island(config=config, stop=self.stop, builder=self, device=device, peers=peers, identity=identity,
                        launched=launched, admission=admission, ranks=ranks)
        self._model_and_data(island)
        self._offline_syncer_parts(island)
        if config.checkpoint.dir:
            island.resume, island.resumed_from = joining.find_checkpoint(config.checkpoint.dir, island.fingerprint)
            island.checkpointer = ckpt.Checkpointer(config.checkpoint.dir, every=config.checkpoint.every,
                                                    keep=config.checkpoint.keep, capture=island.capture,
                                                    events=island.events)
        return island

    def _follower(self, ranks, device: torch.device, launched: float) -> Island:
        """A follower rank of a multi-rank island: its model, data and learner, nothing of the network
        and no files of its own (docs/DESIGN.md, "Islands of many ranks")."""
        config = self.config.model_copy(update={
            "logging": self.config.logging.model_copy(update={"log_jsonl": "", "summary_json": ""}),
            "checkpoint": self.config.checkpoint.model_copy(update={"dir": ""})})
        island = Island(config=config, stop=self.stop, builder=self, device=device, peers=[], identity="",
                        launched=launched, ranks=ranks)
        self._model_and_data(island)
        return island

    def _model_and_data(self, island: Island) -> None:
        config, ranks = island.config, island.ranks
        try:
            spec = resolve_spec(config.model)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        model_dir = config.model.path
        if ranks is not None and not ranks.leader:
            ranks.barrier()  # the leader tokenizes a text corpus into the cache first (one writer)
        corpus = data_lib.load_corpus(config.data.path, config.data.tokenizer, spec.vocab_size, config.data.eval_fraction,
                                      model_dir=model_dir, token_dtype=config.data.token_dtype)
        if ranks is not None and ranks.leader:
            ranks.barrier()
        model = build_model(spec, corpus.vocab_size, config.model.seed, model_dir=model_dir)
        initial_weights = weights_hash(model)
        if config.inner.activation_checkpointing:
            try:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            except ValueError as e:
                raise ConfigError(f"--inner-activation-checkpointing: {e}") from None
        island.model = model.to(island.device)
        island.parameters = count_parameters(island.model)
        named = dict(island.model.named_parameters())
        try:
            island.layout = balanced_layout([(name, p.numel()) for name, p in named.items()], config.outer.fragments)
        except ValueError as e:
            raise ConfigError(f"outer.fragments (--outer-fragments): {e}") from None
        island.shapes = [[named[name].shape for name in names] for names in island.layout.fragments]
        island.fingerprint = run_fingerprint(spec, corpus.vocab_size, config.model.seed, corpus.tokenizer_sha, config.outer,
                                             initial_weights=initial_weights,
                                             model_config=model_config_sha(model_dir) if model_dir else "")
        shard = config.data.shard_index
        if shard < 0:
            shard = data_lib.default_shard_index(config.island, config.data.num_shards)
        if shard >= config.data.num_shards:
            raise ConfigError(f"data.shard_index (--data-shard-index) {shard} must be below data.num_shards "
                              f"({config.data.num_shards})")
        batch_size = config.inner.batch_size or spec.batch_size
        world = ranks.world if ranks is not None else 1
        island.tokens_per_step, island.shard = batch_size * spec.seq_len * config.inner.grad_accum_steps * world, shard
        # each rank its own stream of the island's shard (rank 0's is a one-rank island's)
        stream = config.island if ranks is None or ranks.leader else f"{config.island}#rank{ranks.rank}"
        island.sampler = data_lib.BatchSampler(corpus.shard(shard, config.data.num_shards), batch_size, spec.seq_len,
                                               config.model.seed, stream)
        try:
            island.events = EventLog(config.logging.log_jsonl, config.island)
        except OSError as e:
            raise ConfigError(f"--log-jsonl {config.logging.log_jsonl}: cannot write ({e.strerror or e})") from None
        island.learner = self.learner(
            model=island.model, layout=island.layout, next_batch=island.sampler.next_batch, device=island.device,
            eval_data=data_lib.eval_batches(corpus.eval, config.eval.batches, batch_size, spec.seq_len),
            inner=config.inner, events=island.events, ranks=ranks)
        island.device_name = torch.cuda.get_device_name(island.device) if island.device.type == "cuda" else "cpu"
        peak = peak_flops(island.device_name)
        island.flops_per_token = flops_per_token(island.parameters, spec)
        # the island's devices together (ranks that share a GPU share its peak)
        devices = min(world, torch.cuda.device_count()) if island.device.type == "cuda" else world
        island.peak_flops = peak * devices if peak else peak
        logger.info("island %s: %s model, %.2fM parameters, %d fragments, device %s%s, shard %d/%d (%d tokens), "
                    "fingerprint %s", config.island, model_dir or config.model.preset, island.parameters / 1e6,
                    island.layout.num_fragments, island.device,
                    f" x {world} ranks ({ranks.parallel}, this is rank {ranks.rank})" if ranks else "", shard,
                    config.data.num_shards, len(island.sampler.tokens), island.fingerprint)

    def _offline_syncer_parts(self, island: Island) -> None:
        outer, layout = self.config.outer, island.layout
        island.store = FragmentStore(island.shapes)
        island.sync_stats = SyncerStats()
        island.clock = SwarmClock()
        island.rounds_stop = threading.Event()
        island.quarantine = Quarantine(island=self.config.island, probation=outer.flag_probation,
                                       slot_spacing=outer.fragment_budget, check_lead=outer.matchmaking_time,
                                       events=island.events, outlier_rounds=outer.outlier_rounds)
        island.transfer = self.state_transfer(island.store, island.sync_stats, fingerprint=island.fingerprint,
                                              events=island.events, allreduce_timeout=outer.allreduce_timeout,
                                              stop=island.rounds_stop)
        island.formats = [self.round_format(outer, names, shapes) for names, shapes in zip(layout.fragments, island.shapes)]

    # ------------------------------------------------------------------ parts the lab may replace

    def learner(self, **kwargs) -> Learner:
        """The island's :class:`~p2p_diloco.island.learner.Learner` (keyword arguments as its own)."""
        return Learner(**kwargs)

    def round_format(self, config: OuterConfig, names, shapes) -> RoundFormat:
        """The wire format and checks of one fragment's rounds."""
        return RoundFormat(config, names, shapes)

    def state_transfer(self, store: FragmentStore, stats: SyncerStats, **kwargs) -> StateTransfer:
        """The island's state donations and downloads."""
        return StateTransfer(store, stats, **kwargs)

    def channel(self, dht, **kwargs) -> FragmentChannel:
        """One fragment's channel (a hivemind averager process, forked from the main thread)."""
        return HivemindChannel(dht, **kwargs)


def _check_writable(path: str, flag: str) -> None:
    """Fail at startup, not after the run, when an output file cannot be written."""
    folder = Path(path).expanduser().absolute().parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".p2p_diloco_check"):
            pass
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot write in {folder} ({e.strerror or e})") from None
