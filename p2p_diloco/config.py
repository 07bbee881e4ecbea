"""Typed, validated configuration for every role, in one place.

Each field has a description (shown by ``--help``) and is settable three ways, later ones winning:
its default, a TOML file (``--config FILE.toml``; sections ``[model]``, ``[data]``, ``[inner]``,
``[outer]``, ``[eval]``, ``[checkpoint]``, ``[progress]``, ``[logging]``) and a command-line flag
(:mod:`p2p_diloco.flags`). Top-level fields map to ``--field-name``; section fields to
``--section-field-name`` (``outer.period`` -> ``--outer-period``), except where a field names its
flags (``logging.summary_json`` -> ``--summary-json``). A few common fields also have short aliases
(``--data``, ``--tokenizer``, ``--preset``).

Invalid values raise :class:`~p2p_diloco.errors.ConfigError` whose message names the field, its flag
and the value given.
"""

from __future__ import annotations

import re
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from p2p_diloco.flags import flags_of

RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


def _check_name(value: str, example: str) -> str:
    if not value:
        raise ValueError(f"is required (e.g. {example})")
    if not RUN_ID_PATTERN.match(value):
        raise ValueError(f"must be 1-64 characters of letters, digits, '_' or '-' (e.g. {example})")
    return value


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, validate_default=True)

    def to_flags(self, prefix: tuple[str, ...] = ()) -> list[str]:
        """The command-line flags that rebuild this configuration: one per field whose value differs
        from its default, sections included (``--outer-period 8``). :func:`parse_flags` reads them back.

        :param prefix: where this section sits in a larger configuration, e.g. ``("inner",)`` for
            ``--inner-lr``
        :raises ValueError: for a value no flag can express (an empty list where the default is not)
        """
        return flags_of(self, prefix)


class ModelConfig(_Section):
    """The model replica every island trains (a causal LM built by transformers: a Llama-style preset or your own)."""

    preset: Literal["tiny", "small", "base"] = Field(
        "tiny", description="model size: tiny (~1M params, CPU), small (~24M), base (~150M); with --model, only "
        "the default sequence length and batch size"
    )
    path: str = Field(
        "", description="a local Hugging Face model folder (config.json; safetensors weights to start from them; "
        "its tokenizer unless --tokenizer) instead of a preset: any causal LM transformers builds",
    )
    hidden_size: Optional[int] = Field(None, gt=0, description="override the preset's hidden size")
    num_layers: Optional[int] = Field(None, gt=0, description="override the preset's number of layers")
    num_heads: Optional[int] = Field(None, gt=0, description="override the preset's attention heads")
    intermediate_size: Optional[int] = Field(None, gt=0, description="override the preset's MLP width")
    vocab_size: Optional[int] = Field(
        None, ge=260, le=65535, description="BPE vocabulary size of the locally trained tokenizer"
    )
    seq_len: Optional[int] = Field(None, gt=1, description="training sequence length in tokens")
    seed: int = Field(0, ge=0, description="initialisation seed; every island of a run must use the same")


class DataConfig(_Section):
    """Where the text comes from and how it is split."""

    path: str = Field(
        "",
        description="a token folder (`p2p-diloco prepare-data`'s, or nanoGPT's train.bin/val.bin), a .txt, "
        ".jsonl, .parquet or .arrow file (a 'text' field), a folder of them, or a datasets folder (save_to_disk) "
        "(default: the embedded Shakespeare corpus)",
    )
    tokenizer: str = Field("", description="a tokenizer.json to use instead of training a byte-level BPE")
    eval_fraction: float = Field(0.05, gt=0.0, lt=0.5, description="held-out tail of each document for eval loss")
    num_shards: int = Field(8, ge=1, description="the training split is cut into this many shards")
    shard_index: int = Field(-1, ge=-1, description="this island's shard (-1: chosen from the island name)")
    token_dtype: Literal["uint16", "uint32"] = Field(
        "uint16", description="the token ids' type in a folder of train.bin/val.bin without meta.json (nanoGPT's)"
    )


LR_SCHEDULES = ("constant", "cosine")  # the inner learning rate after warm-up (learner.lr_factor)


class InnerConfig(_Section):
    """The inner optimizer (AdamW) of each island (arXiv 2311.08105, Alg. 1)."""

    lr: float = Field(3e-3, gt=0.0, description="AdamW peak learning rate")
    weight_decay: float = Field(0.1, ge=0.0, description="AdamW weight decay")
    beta1: float = Field(0.9, ge=0.0, lt=1.0, description="AdamW beta1")
    beta2: float = Field(0.95, ge=0.0, lt=1.0, description="AdamW beta2")
    warmup_steps: int = Field(50, ge=0, description="linear learning-rate warm-up, in inner steps")
    schedule: Literal[LR_SCHEDULES] = Field(
        "constant", description="learning rate after warm-up: constant, or cosine decay to min_lr_ratio x lr at "
        "decay_steps (DiLoCo, arXiv 2311.08105, decays its inner learning rate by a cosine)",
    )
    decay_steps: int = Field(0, ge=0, description="cosine: the inner step at which the decay ends (0: max_steps)")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="cosine: final learning rate / peak")
    batch_size: Optional[int] = Field(None, gt=0, description="sequences per micro-batch (default: the preset's)")
    grad_accum_steps: int = Field(
        1, ge=1, le=1024, description="micro-batches per inner step: one AdamW step on the mean gradient of "
        "grad_accum_steps x batch_size sequences, one micro-batch in memory at a time (nanoGPT's "
        "gradient_accumulation_steps)",
    )
    grad_clip: float = Field(1.0, ge=0.0, description="gradient-norm clip (0 disables)")
    compile: bool = Field(False, description="run the forward and backward through torch.compile (slow to start)")
    activation_checkpointing: bool = Field(
        False, description="recompute activations in the backward pass (less memory, about a third more compute)"
    )


class OuterConfig(_Section):
    """The outer loop: fragments, the swarm-wide round clock and the outer optimizer (docs/DESIGN.md, "The algorithm")."""

    lr: float = Field(0.7, gt=0.0, description="outer SGD learning rate (arXiv 2311.08105: 0.7)")
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="outer SGD momentum (arXiv 2311.08105: 0.9)")
    nesterov: bool = Field(True, description="Nesterov outer momentum (else plain heavy-ball)")
    fragments: int = Field(2, ge=1, le=64, description="P: fragments synced at staggered times (1 = plain DiLoCo)")
    period: float = Field(
        30.0, gt=0.0, description="T_outer: seconds between two rounds of the same fragment (swarm-wide clock)"
    )
    groups: int = Field(
        1, ge=1, le=64, description="G: groups of islands that take turns on each fragment's slots, which come G "
        "times as often (each island still rounds once per T_outer; it reloads the swarm's newest state before its "
        "turn): groups of N / G islands for large swarms (docs/DESIGN.md, \"Groups that take turns\")",
    )
    quorum: int = Field(2, ge=1, description="K: a round waits (up to the grace window) for this many members")
    matchmaking_time: float = Field(3.0, gt=0.0, description="seconds before a round's slot when matchmaking starts")
    grace_window: float = Field(1.5, ge=0.0, description="seconds past the slot a round keeps waiting for quorum")
    allreduce_timeout: float = Field(5.0, gt=0.0, description="seconds an all-reduce may take once the group formed")
    request_timeout: float = Field(1.0, gt=0.0, description="seconds to wait for a peer's matchmaking answer")
    apply: Literal["carry", "mix"] = Field(
        "carry",
        description="how a finished round lands on the island: carry (new global + local progress since the "
        "snapshot) or mix (alpha*local + (1-alpha)*global, arXiv 2501.18512)",
    )
    alpha: float = Field(0.5, ge=0.0, le=1.0, description="mix weight of the local parameters for apply=mix")
    overlap_steps: int = Field(
        0, ge=0, description="tau: a round's result lands no earlier than this many inner steps after its "
        "snapshot (Streaming DiLoCo's overlap, arXiv 2501.18512); 0: as soon as the round ends",
    )
    max_delta: float = Field(
        1.0, gt=0.0, description="largest |pseudo-gradient| element exchanged; larger elements are clipped"
    )
    fallback_defer: int = Field(
        2, ge=0, le=64, description="a round that finds no group leaves Theta_p as it is and carries the island's "
        "pseudo-gradient and its tokens into the next round (which then sends the work of both), up to this many "
        "rounds in a row; then, or with 0, the island steps on its own pseudo-gradient (a fork the swarm's next "
        "round replaces, losing that work: docs/DESIGN.md, \"Syncer\")",
    )
    merge: Literal["mean", "rda"] = Field(
        "mean", description="how a round merges pseudo-gradients: token-weighted mean, or rda (radial-directional "
        "averaging: mean direction rescaled to the mean norm, per tensor; embeddings stay on the mean)",
    )
    codec: Literal["none", "fp16", "bf16", "int8", "int4", "int2"] = Field(
        "none", description="outer gradients on the wire: none (fp32), fp16/bf16 (block floating point: one "
        "exponent per 1024 values, 11/8 significant bits), int8, int4 or int2 (uniform, one power-of-two scale "
        "per 1024 values); errors stay local and go into the next round",
    )
    flag_probation: float = Field(
        120.0, gt=0.0, description="seconds an island caught sending garbage (NaN, Inf, huge) is kept out of "
        "rounds; doubled each time it is caught again",
    )
    aggregator: Literal["mean", "centered_clip"] = Field(
        "centered_clip", description="how a reducer merges its part of the members' pseudo-gradients: the weighted "
        "mean, or centered_clip (a robust mean: one member far from the others moves it by at most its share "
        "times a radius; docs/SECURITY.md)",
    )
    weight_cap: float = Field(
        1.5, ge=1.0, description="no member weighs more in a round than this many times the lower median "
        "member's weight, whatever it claims (docs/SECURITY.md)",
    )
    norm_ratio: float = Field(
        2.0, ge=0.0, description="a round's merged update is halved until it is at most this many times as long "
        "as its contributors' lower median update (of a pair, the shorter one): attackers that are half of a "
        "group or fewer move it by at most that (docs/SECURITY.md); 0: no norm bound (trusted islands of very "
        "different speeds)",
    )
    clip_radius: float = Field(
        2.0, gt=0.0, description="centered_clip's radius, in median distances of the members to their "
        "coordinate-wise median",
    )
    outlier_ratio: float = Field(
        4.0, gt=1.0, description="a member whose pseudo-gradient is farther from the merged one than this many "
        "times the median member's distance is an outlier in that part, and left out of it (with 3 or more members)",
    )
    outlier_rounds: int = Field(
        3, ge=1, le=8, description="flag a member that was an outlier in most of the parts it sent us in this "
        "many of its last 2n-1 rounds with us (probation as for garbage)",
    )

    @field_validator("norm_ratio")
    @classmethod
    def _norm_ratio(cls, value: float) -> float:
        if 0.0 < value < 1.0:
            raise ValueError("must be 0 (no norm bound) or at least 1 (below 1, honest rounds' updates are cut short)")
        return value

    @property
    def fragment_budget(self) -> float:
        """Seconds between two slots on the swarm's clock, available to one round (T_outer / (P G))."""
        return self.period / (self.fragments * self.groups)


class CheckpointConfig(_Section):
    """Periodic checkpoints of the island (global states and its own inner state)."""

    dir: str = Field("", description="save checkpoints here (and resume from the newest valid one at start)")
    every: float = Field(300.0, gt=0.0, description="seconds between checkpoints (one more at exit)")
    keep: int = Field(3, ge=1, description="how many checkpoints to keep")


class EvalConfig(_Section):
    """Held-out evaluation of the island's own parameters."""

    every: float = Field(60.0, gt=0.0, description="seconds between eval-loss measurements")
    batches: int = Field(8, ge=1, description="held-out batches per eval")


class ProgressConfig(_Section):
    """The island's signed progress record on the DHT (what status and the dashboard show)."""

    period: float = Field(2.0, gt=0.0, description="seconds between progress records on the DHT")
    ttl: float = Field(15.0, gt=0.0, description="seconds a progress record lives without refresh")


class LoggingConfig(_Section):
    """What the island writes besides its progress record: summary, event log, W&B, TensorBoard."""

    summary_json: str = Field("", description="write the run summary here on exit",
                              json_schema_extra={"flags": ["--summary-json"]})
    log_jsonl: str = Field("", description="append per-step, per-round and eval events here (JSON lines)",
                           json_schema_extra={"flags": ["--log-jsonl"]})
    wandb_project: str = Field("", description="also log metrics to this Weights & Biases project (extra: wandb)",
                               json_schema_extra={"flags": ["--wandb-project"]})
    wandb_mode: Literal["", "online", "offline"] = Field(
        "", description="W&B mode; offline needs no network (upload later with `wandb sync`); default: WANDB_MODE "
        "or online", json_schema_extra={"flags": ["--wandb-mode"]},
    )
    tensorboard_dir: str = Field("", description="also write TensorBoard logs under DIR/<run-id>/<island>/ "
                                 "(extra: tensorboard)", json_schema_extra={"flags": ["--tensorboard-dir"]})


class AdmissionConfig(_Section):
    """A private run's credentials (docs/DESIGN.md, "Admission"): files only, never keys on the
    command line. Without them the run is open to anyone who knows a peer's address."""

    authority_public_key: str = Field(
        "", description="the run authority's public key file (authority.pub): admit only peers it certified",
        json_schema_extra={"flags": ["--authority-public-key"]})
    certificate: str = Field(
        "", description="this peer's certificate file, from `p2p-diloco authority admit` (needs --identity-path)",
        json_schema_extra={"flags": ["--certificate"]})
    revocations: str = Field(
        "", description="publish this signed revocation list (from `p2p-diloco authority revoke`) and its updates",
        json_schema_extra={"flags": ["--revocations"]})

    @model_validator(mode="after")
    def _check_pair(self) -> "AdmissionConfig":
        if bool(self.authority_public_key) != bool(self.certificate):
            raise ValueError("--authority-public-key and --certificate go together: a private run needs both")
        if self.revocations and not self.authority_public_key:
            raise ValueError("--revocations needs --authority-public-key and --certificate")
        return self

    @property
    def private(self) -> bool:
        return bool(self.authority_public_key)


class PeerConfig(_Section):
    """Everything an island peer needs."""

    run_id: str = Field("", description="name of the training run; islands of one run share it")
    island: str = Field("", description="this island's name (unique within the run)")
    initial_peers: list[str] = Field(
        default_factory=list, description="multiaddrs of live peers (the bootstrap node's INITIAL_PEERS)"
    )
    host_maddrs: list[str] = Field(
        default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"], description="multiaddrs to listen on"
    )
    announce_maddrs: list[str] = Field(default_factory=list, description="public multiaddrs to announce")
    client_mode: Literal["auto", "on", "off"] = Field(
        "auto", description="take part in rounds as a client (send parts, reduce and serve nothing), as a machine "
        "behind NAT must: auto asks the initial peers at start whether they can dial this machine back",
    )
    identity_path: str = Field("", description="private key file: a stable peer id across restarts")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto takes CUDA when present")
    threads: int = Field(0, ge=0, description="torch CPU threads (0: torch's default)")
    nproc_per_node: int = Field(
        1, ge=1, le=64, description="ranks of this island on this machine: starts torchrun --standalone "
        "--nproc-per-node N with the same flags (one island, one learner in the swarm; only rank 0 joins it)",
    )
    max_restarts: int = Field(
        0, ge=0, le=100, description="with --nproc-per-node: times torchrun restarts the island after a rank "
        "fails (torchrun --max-restarts); a restarted island reloads (its checkpoint, else the swarm's state) "
        "and rejoins",
    )
    island_parallel: Literal["ddp", "fsdp"] = Field(
        "ddp", description="how an island's ranks share the inner loop: ddp (every rank holds the model) or fsdp "
        "(FSDP2 shards parameters, gradients and optimizer state; no --checkpoint-dir yet)",
    )
    max_steps: int = Field(0, ge=0, description="stop after this many inner steps (0: no limit)")
    max_minutes: float = Field(0.0, ge=0.0, description="stop after this many minutes of training (0: no limit)")
    join_timeout: float = Field(60.0, gt=0.0, description="seconds to keep trying to reach peers / download state")
    dht_wait_timeout: float = Field(
        3.0, gt=0.0, le=60.0, description="seconds a DHT request waits for a peer's reply (hivemind's wait_timeout); "
        "lower it on a LAN so that a frozen or cut-off peer delays lookups, and so matchmaking, less",
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    inner: InnerConfig = Field(default_factory=InnerConfig)
    outer: OuterConfig = Field(default_factory=OuterConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    progress: ProgressConfig = Field(default_factory=ProgressConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)

    @field_validator("run_id")
    @classmethod
    def _check_run_id(cls, value: str) -> str:
        return _check_name(value, "my_run")

    @field_validator("island")
    @classmethod
    def _check_island(cls, value: str) -> str:
        return _check_name(value, "island-0")

    @model_validator(mode="after")
    def _check_round_budget(self) -> "PeerConfig":
        outer = self.outer
        needed = outer.matchmaking_time + outer.grace_window + outer.allreduce_timeout
        if needed >= outer.fragment_budget:
            raise ValueError(
                f"outer.period / (outer.fragments x outer.groups) = {outer.fragment_budget:.2f} s must exceed "
                f"outer.matchmaking_time + outer.grace_window + outer.allreduce_timeout = {needed:.2f} s: "
                "raise --outer-period or lower the others"
            )
        if outer.request_timeout >= outer.matchmaking_time / 2:
            raise ValueError("outer.request_timeout must be smaller than half of outer.matchmaking_time")
        if outer.groups > 1 and not outer.nesterov:
            # heavy-ball turns would leave Theta_p (and its hash) as it was for G - 1 turns of G, so that two
            # states with other momenta could share one (version, hash) (docs/DESIGN.md, "Groups that take turns")
            raise ValueError("outer.groups > 1 needs the Nesterov outer momentum (outer.nesterov): groups taking "
                             "turns move the momentum once per period")
        if self.progress.ttl <= self.progress.period:
            raise ValueError("progress.ttl (--progress-ttl) must be longer than progress.period (--progress-period)")
        if self.island_parallel == "fsdp" and self.checkpoint.dir:
            raise ValueError("--checkpoint-dir is not supported with --island-parallel fsdp yet: use ddp, or run "
                             "without checkpoints")
        if self.inner.schedule == "cosine":
            horizon = self.inner.decay_steps or self.max_steps
            if not horizon:
                raise ValueError("--inner-schedule cosine needs a horizon: --inner-decay-steps or --max-steps")
            if horizon <= self.inner.warmup_steps:
                raise ValueError(f"--inner-schedule cosine decays over {horizon} inner steps, no more than the "
                                 f"{self.inner.warmup_steps}-step warm-up: raise --inner-decay-steps/--max-steps "
                                 "or lower --inner-warmup-steps")
            if not self.inner.decay_steps:  # a copy: an InnerConfig the caller passed in stays as it was
                self.inner = self.inner.model_copy(update={"decay_steps": horizon})
        return self


class BootstrapConfig(_Section):
    """A DHT-only peer with a persistent identity that others join through."""

    host_maddrs: list[str] = Field(
        default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"], description="multiaddrs to listen on"
    )
    announce_maddrs: list[str] = Field(default_factory=list, description="public multiaddrs to announce")
    identity_path: str = Field(
        "bootstrap.key", description="private key file, created on first run (mode 0600) and reused"
    )
    initial_peers: list[str] = Field(default_factory=list, description="other bootstrap nodes to join")
    run_id: str = Field("", description="also summarise this run's islands in the periodic log line")
    summary_period: float = Field(30.0, gt=0.0, description="seconds between swarm summary lines")
    dashboard_port: Optional[int] = Field(
        None, ge=0, le=65535, description="also serve the run's dashboard on this port (0: a free one; needs --run-id)"
    )
    dashboard_host: str = Field("127.0.0.1", description="address the dashboard listens on (0.0.0.0: every interface)")
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)

    @model_validator(mode="after")
    def _check_dashboard(self) -> "BootstrapConfig":
        if self.dashboard_port is not None and not self.run_id:
            raise ValueError("--dashboard-port needs --run-id: the run whose islands the dashboard shows")
        return self

    @field_validator("run_id")
    @classmethod
    def _check_run_id(cls, value: str) -> str:
        return _check_name(value, "my_run") if value else value


class PrepareDataConfig(_Section):
    """``prepare-data``: tokenize a corpus once into a token folder that islands memory-map."""

    data: str = Field("", description="the corpus: a .txt, .jsonl, .parquet or .arrow file, a folder of them, or a "
                      "datasets folder (save_to_disk) (default: the embedded Shakespeare corpus)")
    out: str = Field(..., description="the token folder to write (must not exist; train it with --data OUT)")
    tokenizer: str = Field("", description="a tokenizer.json to use (default: --model's, else a byte-level BPE "
                           "trained on the corpus first)")
    model: str = Field("", description="a Hugging Face model folder whose tokenizer to use")
    vocab_size: int = Field(8192, ge=260, le=65535, description="vocabulary of the BPE trained when no tokenizer is given")
    eval_fraction: float = Field(0.05, gt=0.0, lt=0.5, description="held-out tail of each document for eval loss")


class _ObserverConfig(_Section):
    """What every observer of a run needs: a live peer to join through and the run's name."""

    initial_peers: list[str] = Field(default_factory=list, description="multiaddrs of live peers")
    run_id: str = Field("", description="the run to show")
    join_timeout: float = Field(30.0, gt=0.0, description="seconds to keep trying to reach the peers")
    identity_path: str = Field("", description="private key file (a private run's certificate binds its key)")
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)

    @field_validator("run_id")
    @classmethod
    def _check_run_id(cls, value: str) -> str:
        return _check_name(value, "my_run")


class StatusConfig(_ObserverConfig):
    """The observer: reads the islands' signed progress records from the DHT."""

    json_output: bool = Field(
        False, description="print machine-readable JSON instead of a table", json_schema_extra={"flags": ["--json"]}
    )
    watch: bool = Field(False, description="refresh until Ctrl+C")
    interval: float = Field(3.0, gt=0.0, description="seconds between refreshes with --watch")


class DashboardConfig(_ObserverConfig):
    """The live web dashboard (page, /api/status, /metrics) of a run, from its signed DHT records."""

    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0: every interface)")
    port: int = Field(8080, ge=0, le=65535, description="TCP port of the page (0: a free one)")
    interval: float = Field(1.0, gt=0.0, description="seconds between two reads of the records")
    history: int = Field(1000, ge=2, description="points kept in memory per island and for the swarm series")
    departed_keep: float = Field(60.0, ge=0.0, description="seconds a departed island stays listed (greyed out)")
