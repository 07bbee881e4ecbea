"""The learner: the inner loop of one island on its device (DESIGN.md, "Learner"; DiLoCo,
arXiv 2311.08105, Alg. 1, inner loop).

It never waits on the network. Between two inner steps it answers the syncer's snapshot requests
(copies of one fragment's parameters) and applies finished rounds; everything else happens in the
syncer's threads and hivemind's processes.
"""

from __future__ import annotations

import collections
import logging
import math
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from p2p_diloco import outer
from p2p_diloco.config import InnerConfig
from p2p_diloco.fragments import FragmentLayout
from p2p_diloco.syncer import OuterUpdate, Snapshot

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
class _SnapshotRequest:
    fragment: int
    done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    cancelled: bool = False
    result: Optional[Snapshot] = None


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

    @property
    def wall_time(self) -> float:
        """Seconds from the start of the first inner step to the end of the last."""
        return max(0.0, self.last_step_end - self.first_step_start) if self.first_step_start else 0.0

    @property
    def utilization(self) -> float:
        """Compute utilization: time in inner steps / wall time since the first step (DESIGN.md)."""
        wall = self.wall_time
        return min(1.0, self.inner_time / wall) if wall > 0 else 0.0


class Learner:
    """Inner AdamW training of one model replica.

    :param model: the causal LM, already on ``device``; fp32 parameters
    :param layout: fragment layout over ``model.named_parameters()``
    :param next_batch: returns a (B, T+1) int64 CPU tensor of token windows
    :param eval_data: fixed held-out (B, T+1) int64 batches
    :param device: where the model lives; on CUDA the forward pass runs under bf16 autocast
    :param inner: AdamW settings and warm-up
    :param slowdown: each inner step is stretched to this many times its compute time (>= 1), to
        simulate a slower device
    :param slowdown_jitter: each step's stretch is drawn uniformly from slowdown * (1 +- jitter)
        (never below 1): a device whose speed varies
    :param events: callable taking an event dict (the JSONL log)
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
        slowdown: float = 1.0,
        slowdown_jitter: float = 0.0,
        events: Callable[[dict], None] = lambda event: None,
    ):
        self.model, self.layout, self.next_batch, self.eval_data = model, layout, next_batch, list(eval_data)
        self.device, self.slowdown, self.events = device, slowdown, events
        self.slowdown_jitter = slowdown_jitter
        self._jitter_rng = random.Random()
        named = dict(model.named_parameters())
        self.fragment_params = [[named[name] for name in names] for names in layout.fragments]
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": inner.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=inner.lr, betas=(inner.beta1, inner.beta2), eps=1e-8,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: lr_factor(inner, step))
        self.grad_clip = inner.grad_clip
        self.autocast = device.type == "cuda"
        self.stats = LearnerStats()
        # (tokens, steps) totals at each fragment's last snapshot: what a snapshot reports is the difference
        self.marks = [(0, 0)] * layout.num_fragments
        self._requests: "queue.SimpleQueue[_SnapshotRequest]" = queue.SimpleQueue()
        self._updates: "queue.SimpleQueue[OuterUpdate]" = queue.SimpleQueue()
        self._held: list[OuterUpdate] = []  # delivered, waiting for their not_before_step (learner thread)
        self._accepting = True
        self._step_time_ema = 0.0
        self._throughput = collections.deque(maxlen=64)  # (time, tokens)

    # ------------------------------------------------------------ syncer side (any thread)

    def request_snapshot(self, fragment: int, timeout: float) -> Optional[Snapshot]:
        """Ask for a copy of fragment ``fragment``'s parameters, taken at the next step boundary.

        Resets that fragment's token/step counters. Returns None if the learner has stopped or does
        not reach a step boundary within ``timeout`` seconds (the request is then dropped).
        """
        if not self._accepting:
            return None
        request = _SnapshotRequest(fragment)
        self._requests.put(request)
        request.done.wait(timeout)
        with request.lock:
            request.cancelled = not request.done.is_set()  # too late: the learner will skip it
            return request.result

    def deliver(self, update: OuterUpdate) -> None:
        """Queue a round's result; it is applied before the next inner step."""
        self._updates.put(update)

    @property
    def step_time(self) -> float:
        """Smoothed seconds per inner step (0 before the first)."""
        return self._step_time_ema

    def tokens_per_second(self) -> float:
        """Tokens per second over the last (up to 64) inner steps."""
        if len(self._throughput) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self._throughput[0], self._throughput[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    # ------------------------------------------------------------ learner thread

    @torch.no_grad()
    def load_global(self, fragment: int, theta: Sequence[torch.Tensor]) -> None:
        """Set fragment ``fragment``'s parameters to Theta_p (after downloading it from peers)."""
        for param, value in zip(self.fragment_params[fragment], theta, strict=True):
            param.copy_(value.to(param.device))

    def service(self) -> None:
        """Apply finished rounds, then answer snapshot requests (called between inner steps)."""
        self.apply_updates()
        self.answer_snapshots()

    @torch.no_grad()
    def apply_updates(self, force: bool = False, fragment: Optional[int] = None) -> None:
        """Apply the queued :class:`OuterUpdate` s to the live parameters, each fragment's in order; an
        update whose ``not_before_step`` is still ahead (``outer.overlap_steps``) waits, with the later
        ones of its fragment, unless ``force`` (checkpoints must see every delivered update) or it is
        of ``fragment`` (a snapshot of that fragment must see its updates)."""
        self._held.extend(_drain(self._updates))
        waiting, blocked = [], set()
        for update in self._held:
            ready = force or update.fragment == fragment or update.not_before_step <= self.stats.inner_steps
            if update.fragment in blocked or not ready:
                blocked.add(update.fragment)
                waiting.append(update)
                continue
            self._apply(update)
        self._held = waiting

    @torch.no_grad()
    def _apply(self, update: OuterUpdate) -> None:
        """Land one update on its fragment's live parameters."""
        params = self.fragment_params[update.fragment]
        if update.mode == "carry":
            outer.apply_carry(params, update.tensors)
        elif update.mode == "mix":
            outer.apply_mix(params, update.tensors, update.alpha)
        else:  # replace
            for param, theta in zip(params, update.tensors, strict=True):
                param.copy_(theta)
                if update.reset_optimizer:
                    self.optimizer.state.pop(param, None)  # AdamW starts these moments afresh
        self.stats.updates_applied += 1

    @torch.no_grad()
    def answer_snapshots(self) -> None:
        """Copy the requested fragments to CPU fp32 and report the tokens/steps since their last copy.

        The syncer delivers an update (a reload, say) before it asks for the snapshot that must see
        it, so updates queued by then are applied first: a snapshot always matches the base the
        syncer reports in its round.
        """
        for request in _drain(self._requests):
            self.apply_updates(fragment=request.fragment)
            with request.lock:
                if request.cancelled:
                    continue  # the syncer gave up waiting
                p = request.fragment
                copies = [param.detach().to("cpu", torch.float32, copy=True) for param in self.fragment_params[p]]
                tokens, steps = self.stats.tokens, self.stats.inner_steps
                request.result = Snapshot(p, copies, tokens - self.marks[p][0], steps - self.marks[p][1], steps)
                self.marks[p] = (tokens, steps)
                request.done.set()

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (nats/token) of a (B, T+1) batch; fp32 under autocast."""
        batch = batch.to(self.device, non_blocking=True)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            logits = self.model(input_ids=inputs).logits  # (B, T, V)
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def train_step(self) -> float:
        """One inner step: forward, backward, clip, AdamW. Returns the training loss (nats/token)."""
        start_wall, start = time.time(), time.perf_counter()
        if not self.stats.first_step_start:
            self.stats.first_step_start = start_wall
        batch = self.next_batch()
        loss = self._loss(batch)
        loss.backward()
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        value = float(loss.item())  # the per-step loss is logged; on CUDA this waits for the step
        stretch = self.slowdown
        if self.slowdown_jitter > 0:
            stretch *= 1.0 + self._jitter_rng.uniform(-self.slowdown_jitter, self.slowdown_jitter)
        if stretch > 1.0:
            time.sleep((stretch - 1.0) * (time.perf_counter() - start))
        elapsed = time.perf_counter() - start
        stats = self.stats
        stats.inner_steps += 1
        stats.tokens += batch.size(0) * (batch.size(1) - 1)
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

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the fixed held-out batches (nats/token); snapshot requests that arrive
        meanwhile are answered between batches, so an eval never makes a round miss its slot (an
        update applied for such a snapshot changes the parameters mid-eval)."""
        was_training = self.model.training
        self.model.eval()
        started = time.time()
        total = 0.0
        for batch in self.eval_data:
            total += float(self._loss(batch))
            self.answer_snapshots()
        self.model.train(was_training)
        value = total / len(self.eval_data)
        self.stats.eval_loss = value
        if self.stats.eval_loss_first is None:
            self.stats.eval_loss_first = value
        self.events({"event": "eval", "step": self.stats.inner_steps, "tokens": self.stats.tokens, "eval_loss": value,
                     "dt": time.time() - started})
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
        """CPU copies of the inner state at a step boundary: parameters and AdamW moments (by
        parameter name) and the counters a resumed run continues from (for checkpoints)."""
        params, exp_avg, exp_avg_sq, adam_steps = {}, {}, {}, {}
        for name, param in self.model.named_parameters():
            params[name] = param.detach().to("cpu", torch.float32, copy=True)
            state = self.optimizer.state.get(param)
            if state:
                exp_avg[name] = state["exp_avg"].detach().to("cpu", copy=True)
                exp_avg_sq[name] = state["exp_avg_sq"].detach().to("cpu", copy=True)
                adam_steps[name] = float(state["step"])
        stats = self.stats
        meta = {
            "inner_step": stats.inner_steps, "tokens": stats.tokens, "marks": [list(m) for m in self.marks],
            "scheduler_step": self.scheduler.last_epoch, "adam_steps": adam_steps,
            "loss_first": stats.loss_first, "loss_ema": stats.loss_ema,
            "eval_loss_first": stats.eval_loss_first, "eval_loss": stats.eval_loss,
        }
        return {"params": params, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "meta": meta}

    @torch.no_grad()
    def restore(self, params: dict, exp_avg: dict, exp_avg_sq: dict, meta: dict) -> None:
        """Load what :meth:`capture` returned (from a checkpoint), before training starts.

        :raises KeyError: if a parameter of the model is missing
        """
        for name, param in self.model.named_parameters():
            param.copy_(params[name].to(param.device))
            if name in exp_avg:
                self.optimizer.state[param] = {
                    "step": torch.tensor(meta["adam_steps"][name], dtype=torch.float32),
                    "exp_avg": exp_avg[name].to(param.device).clone(),
                    "exp_avg_sq": exp_avg_sq[name].to(param.device).clone(),
                }
        step = self.scheduler.last_epoch = int(meta["scheduler_step"])
        for group, base, factor in zip(self.optimizer.param_groups, self.scheduler.base_lrs,
                                       self.scheduler.lr_lambdas):
            group["lr"] = base * factor(step)  # what LambdaLR would have set at this step
        stats = self.stats
        stats.inner_steps, stats.tokens = int(meta["inner_step"]), int(meta["tokens"])
        stats.loss_first, stats.loss_ema = meta.get("loss_first"), meta.get("loss_ema")
        stats.eval_loss_first, stats.eval_loss = meta.get("eval_loss_first"), meta.get("eval_loss")
        self.marks = [tuple(m) for m in meta["marks"]]

    def close(self) -> None:
        """Stop taking snapshot requests and release any that wait."""
        self._accepting = False
        for request in _drain(self._requests):
            with request.lock:
                request.cancelled = True
                request.done.set()


def _drain(items: queue.SimpleQueue):
    """Yield what a queue holds now, without blocking."""
    while True:
        try:
            yield items.get_nowait()
        except queue.Empty:
            return
