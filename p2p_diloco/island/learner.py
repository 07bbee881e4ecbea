"""The learner: the inner loop of one island on its device (docs/DESIGN.md, "Learner"; DiLoCo,
arXiv 2311.08105, Alg. 1, inner loop).

It never waits on the network. Between two inner steps it answers the syncer's snapshot requests
(copies of one fragment's parameters) and applies finished rounds; everything else happens in the
syncer's threads and hivemind's processes.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from p2p_diloco.config import InnerConfig
from p2p_diloco.algo.fragments import FragmentLayout
from p2p_diloco.algo.handoff import OuterUpdate, Snapshot
from p2p_diloco.island.boundary import StepBoundary

logger = logging.getLogger(__name__)


def lr_factor(inner: InnerConfig, step: int) -> float:
    """The inner learning rate at inner step ``step`` (0-based) as a fraction of ``inner.lr``: linear
    warm-up over ``warmup_steps``, then constant, or (``schedule="cosine"``) a cosine decay that reaches
    ``min_lr_ratio`` at ``decay_steps`` and stays there (DiLoCo, arXiv 2311.08105, warms its inner
    AdamW up linearly and decays it by a cosine).

    :raises ValueError: for a cosine schedule without ``decay_steps`` (PeerConfig fills it from
        ``max_steps``)
    """
    warmup = inner.warmup_steps
    if warmup and step < warmup:
        return (step + 1) / warmup
    if inner.schedule == "constant":
        return 1.0
    if not inner.decay_steps:
        raise ValueError("a cosine inner schedule needs decay_steps")
    progress = min(1.0, (step - warmup) / max(1, inner.decay_steps - warmup))
    low = inner.min_lr_ratio
    return low + (1.0 - low) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class LearnerStats:
    """Counters read by the progress reporter and the summary (written by the learner thread only).

    Times are seconds; ``first_step_start`` and ``last_step_end`` are wall-clock seconds since the epoch.
    """

    inner_steps: int = 0
    tokens: int = 0
    loss: Optional[float] = None  # last step, nats/token
    loss_ema: Optional[float] = None
    loss_first: Optional[float] = None
    eval_loss: Optional[float] = None
    eval_loss_first: Optional[float] = None
    first_step_start: float = 0.0
    last_step_end: float = 0.0
    inner_time: float = 0.0  # spent inside inner steps
    updates_applied: int = 0
    tokens_resumed: int = 0  # tokens a checkpoint brought (trained by an earlier process)

    @property
    def tokens_this_run(self) -> int:
        """Tokens this process trained (the times above count this process only)."""
        return self.tokens - self.tokens_resumed

    @property
    def wall_time(self) -> float:
        """Seconds from the start of the first inner step to the end of the last."""
        return max(0.0, self.last_step_end - self.first_step_start) if self.first_step_start else 0.0

    @property
    def utilization(self) -> float:
        """Compute utilization: time in inner steps / wall time since the first step (docs/DESIGN.md, "What we measure")."""
        wall = self.wall_time
        return min(1.0, self.inner_time / wall) if wall > 0 else 0.0


class Learner:
    """Inner AdamW training of one model replica.

    :param model: the causal LM, already on ``device``; fp32 parameters
    :param layout: fragment layout over ``model.named_parameters()``
    :param next_batch: returns a (B, T+1) int64 CPU tensor of token windows
    :param eval_data: fixed held-out (B, T+1) int64 batches
    :param device: where the model lives; on CUDA the forward pass runs under bf16 autocast
    :param inner: AdamW settings and warm-up; ``inner.compile`` runs the forward (and so its backward)
        through ``torch.compile``, the parameters staying those of ``model``
    :param events: callable taking an event dict (the JSONL log)
    :param ranks: the island's process group when it has several ranks
        (:class:`~p2p_diloco.island.ranks.IslandRanks`; docs/DESIGN.md, "Islands of many ranks"):
        ``model`` is wrapped in DDP or sharded by FSDP here, each inner step's tokens are summed and
        its loss averaged over the ranks, and the leader's learner drives the followers' (:meth:`follow`)
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        layout: FragmentLayout,
        next_batch: Callable[[], torch.Tensor],
        eval_data: Sequence[torch.Tensor],
        device: torch.device,
        inner: InnerConfig,
        events: Callable[[dict], None] = lambda event: None,
        ranks=None,
    ):
        self.model, self.layout, self.next_batch, self.eval_data = model, layout, next_batch, list(eval_data)
        self.device, self.events, self.ranks = device, events, ranks
        forward = ranks.wrap(model) if ranks is not None else model  # (FSDP: before the parameters are read)
        named = dict(model.named_parameters())
        self.fragment_params = [[named[name] for name in names] for names in layout.fragments]
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": inner.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=inner.lr, betas=(inner.beta1, inner.beta2), eps=1e-8,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: lr_factor(inner, step))
        self.grad_clip, self.grad_accum_steps = inner.grad_clip, inner.grad_accum_steps
        self.autocast = device.type == "cuda"
        self.forward = torch.compile(forward) if inner.compile else forward  # (same parameters, same names)
        self.stats = LearnerStats()
        self.boundary = StepBoundary(self.fragment_params, self.stats, self.optimizer, ranks)
        self.boundary.events = events
        self._step_time_ema = 0.0
        self._throughput = collections.deque(maxlen=64)  # (time, tokens)

    # ------------------------------------------------------------ the syncer's side (any thread)

    def request_snapshot(self, fragment: int, timeout: float) -> Optional[Snapshot]:
        """A copy of fragment ``fragment``'s parameters taken at the next step boundary, or None
        (:meth:`StepBoundary.request_snapshot`)."""
        return self.boundary.request_snapshot(fragment, timeout)

    def deliver(self, update: OuterUpdate) -> None:
        """Queue a round's result; it is applied before the next inner step."""
        self.boundary.deliver(update)

    @property
    def step_time(self) -> float:
        """Smoothed seconds per inner step (0 before the first)."""
        return self._step_time_ema

    def tokens_per_second(self) -> float:
        """Tokens per second over the last (up to 63) inner steps, or since the first step's start
        (0 before the first step ends)."""
        if len(self._throughput) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self._throughput[0], self._throughput[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    # ------------------------------------------------------------ learner thread

    @torch.no_grad()
    def load_global(self, fragment: int, theta: Optional[Sequence[torch.Tensor]]) -> None:
        """Set fragment ``fragment``'s parameters to Theta_p (after downloading it from peers; on
        every rank, the leader sending it: a follower's ``theta`` is None)."""
        params = self.fragment_params[fragment]
        if self.ranks is not None:
            with self.ranks.order("loading global parameters", "load", fragment):
                whole = self.ranks.broadcast(theta, [p.shape for p in params])
            theta = [self.ranks.local(p, t) for p, t in zip(params, whole, strict=True)]
        for param, value in zip(params, theta, strict=True):
            param.copy_(value.to(param.device))

    def read(self, fragment: int) -> list[torch.Tensor]:
        """fp32 CPU copies of fragment ``fragment``'s whole parameters (learner thread; an FSDP
        island's ranks gather them together)."""
        return self.boundary.read(fragment)

    def service(self) -> None:
        """Apply finished rounds, then answer snapshot requests (called between inner steps)."""
        self.boundary.apply_updates()
        self.boundary.answer_snapshots()

    def apply_updates(self, force: bool = False) -> None:
        """Apply every delivered update that is due (``force``: all of them, for a checkpoint)."""
        self.boundary.apply_updates(force=force)

    def close(self) -> None:
        """Stop taking snapshot requests and release any that wait."""
        self.boundary.close()

    def _loss(self, batch: torch.Tensor, forward: Optional[Callable] = None) -> torch.Tensor:
        """Mean next-token cross-entropy (nats/token) of a (B, T+1) batch; fp32 under autocast.
        ``forward``: the module to run (default: the training one, compiled or data-parallel)."""
        batch = batch.to(self.device, non_blocking=True)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            logits = (forward or self.forward)(input_ids=inputs).logits  # (B, T, V)
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def train_step(self) -> float:
        """One inner step: forward and backward of each micro-batch, clip, AdamW. Returns the training
        loss (nats/token, the mean over the micro-batches)."""
        start_wall, start = time.time(), time.perf_counter()
        if not self.stats.first_step_start:
            self.stats.first_step_start = start_wall
        if not self._throughput:  # (the first step's start: tokens/s is known after one step)
            self._throughput.append((start_wall, self.stats.tokens))
        # (an island of ranks: DDP's gradient all-reduce and FSDP's gathers run in backward and the clip)
        with self.ranks.order("taking an inner step", "step") if self.ranks is not None else contextlib.nullcontext():
            value, tokens = self._optimize()
        self.pace(time.perf_counter() - start)
        elapsed = time.perf_counter() - start
        stats = self.stats
        stats.inner_steps += 1
        stats.tokens += tokens
        stats.inner_time += elapsed
        stats.last_step_end = start_wall + elapsed
        stats.loss = value
        if stats.loss_first is None:
            stats.loss_first = value
        if math.isfinite(value):
            stats.loss_ema = value if stats.loss_ema is None else 0.9 * stats.loss_ema + 0.1 * value
        self._step_time_ema = elapsed if not self._step_time_ema else 0.9 * self._step_time_ema + 0.1 * elapsed
        self._throughput.append((stats.last_step_end, stats.tokens))
        self.events({"event": "step", "t": stats.last_step_end, "dt": elapsed, "step": stats.inner_steps,
                     "tokens": stats.tokens, "loss": value})
        return value

    def _optimize(self) -> tuple[float, int]:
        """One inner step on ``grad_accum_steps`` micro-batches of (B, T+1) tokens each: forward and
        backward of each (its loss scaled by 1 / grad_accum_steps, so the summed gradient is the
        mean over all B x grad_accum_steps sequences, the gradient of one batch that large),
        gradient clip, AdamW and scheduler step. Returns (mean loss in nats/token, tokens trained)."""
        total, tokens = 0.0, 0
        for _ in range(self.grad_accum_steps):
            batch = self.next_batch()  # (B, T+1)
            loss = self._loss(batch) / self.grad_accum_steps
            loss.backward()
            total = total + loss.detach()
            tokens += batch.size(0) * (batch.size(1) - 1)
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ranks is not None:  # the island's step: every rank's tokens, the ranks' mean loss
            return self.ranks.totals(total, tokens)
        return float(total), tokens  # the per-step loss is logged; on CUDA this waits for the step

    def pace(self, compute_seconds: float) -> None:
        """Called after each inner step's compute, inside its timing: nothing here. The lab's
        simulated slower devices sleep (``p2p_diloco.lab.faults``)."""

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the fixed held-out batches (nats/token); snapshot requests that arrive
        meanwhile are answered between batches, so an eval never makes a round miss its slot (an
        update applied for such a snapshot changes the parameters mid-eval)."""
        was_training = self.model.training
        self.model.eval()
        started = time.time()
        total = 0.0
        # an island of ranks: DDP's leader evaluates alone, outside the wrapper; FSDP's ranks together
        # (and snapshot requests wait for the end: reading a fragment needs the ranks too)
        collective = self.ranks is not None and self.ranks.collective_reads
        forward = self.model if self.ranks is not None else None
        with self.ranks.order("evaluating", "eval") if collective else contextlib.nullcontext():
            for batch in self.eval_data:
                total += float(self._loss(batch, forward))
                if not collective:
                    self.boundary.answer_snapshots()
        self.model.train(was_training)
        return self._record_eval(total / len(self.eval_data), time.time() - started)

    def _record_eval(self, value: float, seconds: float) -> float:
        """Keep an evaluation's loss (nats/token) in the stats and log its event; returns it."""
        self.stats.eval_loss = value
        if self.stats.eval_loss_first is None:
            self.stats.eval_loss_first = value
        self.events({"event": "eval", "step": self.stats.inner_steps, "tokens": self.stats.tokens, "eval_loss": value,
                     "dt": seconds})
        return value

    def run(self, stop: threading.Event, *, max_steps: int = 0, max_seconds: float = 0.0,
            eval_every: float = 60.0, between_steps: Optional[Callable[[], None]] = None) -> str:
        """Train until ``stop`` is set or a limit is reached.

        :param max_steps: stop after this many inner steps in total (0: no limit)
        :param max_seconds: stop this many seconds after the first step started (0: no limit)
        :param eval_every: seconds between held-out evaluations
        :param between_steps: called at every step boundary (e.g. to take a checkpoint); must be quick
        :returns: why it stopped: ``"signal"``, ``"max_steps"`` or ``"max_minutes"``
        """
        self.model.train()
        last_eval = time.monotonic()
        while True:
            if stop.is_set():
                return "signal"
            if max_steps and self.stats.inner_steps >= max_steps:
                return "max_steps"
            if max_seconds and self.stats.first_step_start and time.time() - self.stats.first_step_start >= max_seconds:
                return "max_minutes"
            self.service()
            if between_steps is not None:
                between_steps()
            if time.monotonic() - last_eval >= eval_every:
                self.evaluate()
                last_eval = time.monotonic()
            self.train_step()

    @torch.no_grad()
    def capture(self) -> dict:
        """CPU copies of the inner state at a step boundary, for checkpoints: ``params`` (fp32, by
        parameter name), ``optimizer`` and ``scheduler`` (torch's own ``state_dict()`` of AdamW and
        the learning-rate schedule, tensors on the CPU) and ``meta`` (the counters a resumed run
        continues from: JSON-serialisable scalars)."""
        params = {name: p.detach().to("cpu", torch.float32, copy=True) for name, p in self.model.named_parameters()}
        optimizer = self.optimizer.state_dict()
        optimizer["state"] = {index: {key: value.detach().to("cpu", copy=True) if torch.is_tensor(value) else value
                                      for key, value in state.items()}
                              for index, state in optimizer["state"].items()}
        stats = self.stats
        meta = {
            "inner_step": stats.inner_steps, "tokens": stats.tokens, "marks": [list(m) for m in self.boundary.marks],
            "loss_first": stats.loss_first, "loss_ema": stats.loss_ema,
            "eval_loss_first": stats.eval_loss_first, "eval_loss": stats.eval_loss,
        }
        return {"params": params, "optimizer": optimizer, "scheduler": self.scheduler.state_dict(), "meta": meta}

    @torch.no_grad()
    def restore(self, params: dict, optimizer: dict, scheduler: dict, meta: dict) -> None:
        """Load what :meth:`capture` returned (from a checkpoint), before training starts. This run's
        inner settings (learning rate, betas, weight decay, schedule) win over the saved ones; the
        moments, the step counts and the schedule's position are the saved ones.

        :raises KeyError: if a parameter of the model is missing
        :raises ValueError: if the optimizer state does not fit this model
        """
        if self.ranks is not None and self.ranks.leader:  # (checkpoints are refused for FSDP islands)
            with self.ranks.order("sending a checkpoint", "restore"):
                self.ranks.broadcast_object((params, optimizer, scheduler, meta))
        for name, param in self.model.named_parameters():
            param.copy_(params[name].to(param.device))
        settings = [{key: value for key, value in group.items() if key != "params"} for group in self.optimizer.param_groups]
        base_lrs = list(self.scheduler.base_lrs)
        self.optimizer.load_state_dict(optimizer)
        self.scheduler.load_state_dict(scheduler)
        self.scheduler.base_lrs = base_lrs
        step = self.scheduler.last_epoch
        for group, setting, base, factor in zip(self.optimizer.param_groups, settings, base_lrs,
                                                self.scheduler.lr_lambdas):
            group.update(setting)
            group["lr"] = base * factor(step)  # what LambdaLR sets at this step with this run's settings
        stats = self.stats
        stats.inner_steps, stats.tokens = int(meta["inner_step"]), int(meta["tokens"])
        stats.tokens_resumed = stats.tokens
        stats.loss_first, stats.loss_ema = meta.get("loss_first"), meta.get("loss_ema")
        stats.eval_loss_first, stats.eval_loss = meta.get("eval_loss_first"), meta.get("eval_loss")
        self.boundary.marks = [tuple(m) for m in meta["marks"]]

    # ------------------------------------------------------------ a follower rank

    def follow(self, on_restore: Callable[[dict], None] = lambda meta: None) -> None:
        """A follower rank's whole run (docs/DESIGN.md, "Islands of many ranks"): do what the leader
        commands, in its order, until it says stop: train an inner step, land an update, load global
        parameters, read a fragment or evaluate with it (FSDP), restore a checkpoint (then
        ``on_restore(meta)``, for the data position).

        :raises RankLost: when the leader (or another rank) is gone
        """
        self.model.train()
        ranks, boundary = self.ranks, self.boundary
        while True:
            kind, *args = ranks.receive()
            if kind == "step":
                self.train_step()
            elif kind == "apply":
                boundary.apply_received(*args)
            elif kind == "load":
                self.load_global(args[0], None)
            elif kind == "read":
                boundary.read(args[0])
            elif kind == "eval":
                self.evaluate()
            elif kind == "restore":
                params, optimizer, scheduler, meta = ranks.broadcast_object(None)
                self.restore(params, optimizer, scheduler, meta)
                on_restore(meta)
            elif kind == "stop":
                return
            else:
                raise ValueError(f"unknown command {kind!r} from the island's leader")
