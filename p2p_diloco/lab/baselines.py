"""Comparator learners for the side-by-side benchmark (scripts/bench/compare.py, docs/BENCHMARKS.md).

One process is one learner of one arm, trained on exactly what our islands train on: the same model
(preset, seed), tokenizer, data (``island-<rank>`` samples shard ``rank mod shards``, by default the
whole training split, with the same random windows in the same order), inner AdamW with the same
warm-up and clipping (our :class:`~p2p_diloco.island.learner.Learner` runs every step), and the same
held-out batches. Only the way learners communicate differs:

- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` over gloo, gradients all-reduced every step
  (launched by ``torchrun``; with ``--checkpoint-every`` and ``torchrun --max-restarts`` it survives
  a dead worker the way DDP users do: every worker restarts from the last checkpoint);
- ``hivemind``: ``hivemind.Optimizer`` with ``use_local_updates=True``, its documented collaborative
  setup: local AdamW steps, parameters averaged every epoch of ``target_batch_size`` samples;
- ``torchft``: torchft's ``DiLoCo`` (arXiv 2311.08105) with a ``Manager``, a lighthouse and gloo, one
  replica group of one process per learner.

Every learner writes the event log our islands write (``step``, ``eval``, JSONL), with two more
fields per step: ``comm``, the seconds of that step spent blocked on communication (excluded from
compute time), and ``bytes_sent``, the learner's cumulative bytes on the wire. Its end-of-run
summary (JSON) holds tokens, steps, the final eval loss and bytes sent.

Bytes: ``ddp`` and ``torchft`` count what a ring all-reduce sends per member, ``2 (n - 1) / n`` times
the buffer's bytes (gloo's ring algorithm); ``hivemind`` counts every serialized message its
averager sends (a counting codec), exactly.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable, Optional

import torch

from p2p_diloco.island import data as data_lib
from p2p_diloco.config import InnerConfig, ModelConfig
from p2p_diloco.errors import ConfigError
from p2p_diloco.flags import add_config_arguments, section_from_args
from p2p_diloco.island.events import EventLog
from p2p_diloco.algo.fragments import balanced_layout
from p2p_diloco.island.learner import Learner, lr_factor
from p2p_diloco.island.model import build_model, count_parameters, resolve_spec
from p2p_diloco import files

logger = logging.getLogger("p2p_diloco.lab.baselines")

ARMS = ("ddp", "hivemind", "torchft")


def ring_bytes(numel_bytes: int, members: int) -> int:
    """Bytes one member sends in a ring all-reduce of a buffer of ``numel_bytes`` bytes among
    ``members`` processes: ``2 (n - 1) / n`` of it (reduce-scatter, then all-gather)."""
    return int(2 * (members - 1) * numel_bytes / members) if members > 1 else 0


class Meter:
    """Per-step communication accounting of one learner: seconds blocked and bytes sent.

    The arm adds to it from any thread; the step event takes the blocked seconds accumulated since
    the previous step (``comm``) and the running byte total (``bytes_sent``).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self.blocked = 0.0
        self.bytes_sent = 0

    def add(self, seconds: float = 0.0, sent: int = 0) -> None:
        with self._lock:
            self.blocked += max(0.0, seconds)
            self.bytes_sent += sent

    def annotate(self, event: dict) -> dict:
        """Add ``comm`` and ``bytes_sent`` to a step event (and reset the blocked seconds)."""
        if event.get("event") == "step":
            with self._lock:
                event = event | {"comm": round(min(self.blocked, event.get("dt", 0.0)), 6),
                                 "bytes_sent": self.bytes_sent}
                self.blocked = 0.0
        return event


def make_learner(rank: int, *, preset: str = "tiny", seed: int = ModelConfig().seed, shards: int = 1,
                 eval_batches: int = 16, inner: Optional[InnerConfig] = None,
                 wrap: Callable[[torch.nn.Module], torch.nn.Module] = lambda m: m,
                 events: Callable[[dict], None] = lambda event: None) -> tuple[Learner, int]:
    """Learner ``island-<rank>`` as our islands build it: the preset's model from ``seed``, the
    windows of shard ``rank mod shards`` in the island's order, inner AdamW, the fixed eval batches.

    :param wrap: wraps the model (e.g. in DDP) before the learner sees it
    :returns: (learner, the model's parameter count)
    """
    torch.manual_seed(seed)
    spec = resolve_spec(ModelConfig(preset=preset))
    corpus = data_lib.load_corpus("", "", spec.vocab_size, 0.05)
    model = build_model(spec, corpus.vocab_size, seed)
    params = count_parameters(model)
    model = wrap(model)
    sampler = data_lib.BatchSampler(corpus.shard(rank % shards, shards), spec.batch_size, spec.seq_len, seed,
                                    f"island-{rank}")
    layout = balanced_layout([(name, p.numel()) for name, p in model.named_parameters()], 1)
    learner = Learner(model=model, layout=layout, next_batch=sampler.next_batch,
                      eval_data=data_lib.eval_batches(corpus.eval, eval_batches, spec.batch_size, spec.seq_len),
                      device=torch.device("cpu"), inner=inner or InnerConfig(), events=events)
    return learner, params


def inner_config(args: argparse.Namespace) -> InnerConfig:
    """Every arm's inner AdamW from the islands' ``--inner-*`` flags (a cosine schedule without
    ``--inner-decay-steps`` decays over the learner's ``--steps``, as an island's over ``--max-steps``).

    :raises ConfigError: an invalid value
    """
    inner = section_from_args(InnerConfig, args, ("inner",))
    if inner.grad_accum_steps != 1:  # (the arms' budgets, resumes and all-reduces count one batch a step)
        raise ConfigError("--inner-grad-accum-steps: the baselines train one micro-batch per step (leave it at 1)")
    if inner.schedule == "cosine" and not inner.decay_steps:
        inner = inner.model_copy(update={"decay_steps": args.steps})
    return inner


def build_learner(args: argparse.Namespace, wrap: Callable[[torch.nn.Module], torch.nn.Module] = lambda m: m,
                  meter: Optional[Meter] = None) -> tuple[Learner, EventLog, int]:
    """The learner of ``--rank`` (:func:`make_learner`) with its event log, whose step events carry
    ``meter``'s blocked seconds and bytes.

    :returns: (learner, its event log, the model's parameter count)
    """
    events = EventLog(args.events.format(rank=args.rank), f"island-{args.rank}")
    events({"event": "start", "pid": os.getpid(), "arm": args.arm})
    meter = meter or Meter()
    learner, params = make_learner(args.rank, preset=args.preset, seed=args.seed, shards=args.shards,
                                   eval_batches=args.eval_batches,
                                   inner=inner_config(args),
                                   wrap=wrap, events=lambda e: events(meter.annotate(e)))
    return learner, events, params


def train(learner: Learner, args: argparse.Namespace, stop: threading.Event, *, start_step: int = 0,
          on_step: Callable[[int], None] = lambda step: None) -> str:
    """Train to ``--steps`` inner steps in all (counting from ``start_step``), evaluating every
    ``--eval-every-steps`` steps (at the same step on every learner, so that no learner waits for
    another's evaluation) and at the end. Returns why it stopped: ``"max_steps"`` or ``"signal"``."""
    learner.stats.inner_steps = start_step
    reason = "max_steps"
    while learner.stats.inner_steps < args.steps:
        if stop.is_set():
            reason = "signal"
            break
        if learner.stats.inner_steps % args.eval_every_steps == 0 and learner.stats.inner_steps > start_step:
            learner.evaluate()
        learner.train_step()
        on_step(learner.stats.inner_steps)
    learner.evaluate()
    return reason


def write_summary(args: argparse.Namespace, learner: Learner, meter: Meter, params: int, reason: str,
                  started: float, **extra) -> None:
    """The learner's end-of-run summary (JSON, written atomically) and, with ``--final-params``, its
    final parameters (safetensors, keyed by parameter name, tied weights once)."""
    if args.final_params:
        from safetensors.torch import save_file

        module = getattr(learner.model, "module", learner.model)  # DDP wraps the model
        with files.atomic_path(args.final_params.format(rank=args.rank)) as tmp:
            save_file({name: p.detach().contiguous() for name, p in module.named_parameters()}, str(tmp))
    stats = learner.stats
    summary = {
        "arm": args.arm, "rank": args.rank, "parameters": params, "inner_steps": stats.inner_steps,
        "tokens": stats.tokens, "eval_loss_last": stats.eval_loss, "loss_last": stats.loss,
        "bytes_sent": meter.bytes_sent, "wall_seconds": round(time.time() - started, 3), "stopped": reason,
    } | extra
    files.write_json(args.summary.format(rank=args.rank), summary)


# ------------------------------------------------------------------ ddp


def run_ddp(args: argparse.Namespace, stop) -> None:
    """One DDP worker (``torchrun`` sets RANK, WORLD_SIZE, MASTER_ADDR/PORT).

    Blocked time per step: from the moment the last gradient bucket is ready (backward's compute is
    done) until the last bucket's all-reduce completes, which is when DDP lets backward return.
    Checkpoints (``--checkpoint-every`` steps, rank 0, atomic) let a ``torchrun --max-restarts``
    restart resume where the group last saved.
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    # the group's store keys carry torchrun's restart count: after a restart, the new workers must not
    # read the addresses the dead workers published (gloo then dials a closed port and the restart fails)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and rank == 0  # else torchrun's agent does
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=hosts,
                          timeout=timedelta(seconds=args.timeout))
    store = dist.PrefixStore(f"p2p_diloco_bench/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=args.timeout))
    world = dist.get_world_size()
    args.rank = dist.get_rank()
    meter = Meter()
    timing = {"last_ready": 0.0}

    def hook(state, bucket):
        ready = time.perf_counter()
        timing["last_ready"] = ready
        buffer = bucket.buffer()
        meter.add(sent=ring_bytes(buffer.numel() * buffer.element_size(), world))
        future = dist.all_reduce(buffer.div_(world), async_op=True).get_future()

        def done(fut):
            if timing["last_ready"] == ready:  # the step's last bucket: backward returns after it
                meter.add(seconds=time.perf_counter() - ready)
            return fut.value()[0]

        return future.then(done)

    def wrap(model):
        ddp = DistributedDataParallel(model, forward_sync_buffers=False)
        ddp.register_comm_hook(None, hook)
        return ddp

    learner, events, params = build_learner(args, wrap, meter)
    start_step = 0
    checkpoint = Path(args.checkpoint) if args.checkpoint else None
    if checkpoint and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        learner.model.module.load_state_dict(state["model"])
        learner.optimizer.load_state_dict(state["optimizer"])
        learner.scheduler.load_state_dict(state["scheduler"])
        start_step = state["step"]
        learner.stats.tokens = state["tokens"]
        meter.bytes_sent = state["bytes_sent"]
        for _ in range(start_step):  # the batches the group trained before its checkpoint
            learner.next_batch()
        events({"event": "resume", "step": start_step})

    def save(step: int) -> None:
        if checkpoint is None or args.rank != 0 or step % args.checkpoint_every:
            return
        tmp = checkpoint.with_suffix(".tmp")
        torch.save({"model": learner.model.module.state_dict(), "optimizer": learner.optimizer.state_dict(),
                    "scheduler": learner.scheduler.state_dict(), "step": step, "tokens": learner.stats.tokens,
                    "bytes_sent": meter.bytes_sent}, tmp)
        os.replace(tmp, checkpoint)

    started = time.time()
    try:
        reason = train(learner, args, stop.event, start_step=start_step, on_step=save)
        write_summary(args, learner, meter, params, reason, started, members=world)
    finally:
        events.close()
        dist.destroy_process_group()


# ------------------------------------------------------------------ hivemind


def _counting_compression(counter):
    """hivemind's plain fp32 codec that adds each message's serialized size to ``counter`` (a
    ``multiprocessing.Value``, shared with the averager process forked after this). It is both the
    averager's compression (a member's parts, sent through the instance) and hivemind's table entry
    for ``NONE`` (a reducer's averaged replies, serialized by type, and state downloads), so every
    message this learner sends is counted once."""
    from hivemind.compression import NoCompression, serialization

    class CountingNoCompression(NoCompression):
        def compress(self, tensor, info, allow_inplace=False):
            message = super().compress(tensor, info, allow_inplace)
            with counter.get_lock():
                counter.value += len(message.buffer)
            return message

    codec = CountingNoCompression()
    serialization._BASE_COMPRESSION_TYPES["NONE"] = codec
    return codec


def run_hivemind(args: argparse.Namespace, stop) -> None:
    """One ``hivemind.Optimizer`` peer with local updates (hivemind's documented collaborative setup):
    AdamW steps locally; when the collaboration has processed ``target_batch_size`` samples (``H``
    steps of every learner), peers average their parameters in one all-reduce.

    Blocked time per step: ``Optimizer.step`` minus the wrapped AdamW's own step.
    """
    import multiprocessing as mp
    from functools import partial

    import hivemind

    counter = mp.Value("q", 0)
    meter = Meter()
    learner, events, params = build_learner(args, meter=meter)
    spec = resolve_spec(ModelConfig(preset=args.preset))
    dht = hivemind.DHT(initial_peers=args.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    # the learner's own AdamW groups (weight decay on matrices only) and settings, run by hivemind
    groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in learner.optimizer.param_groups]
    inner = inner_config(args)
    opt = hivemind.Optimizer(
        dht=dht, run_id=args.run_id, params=groups,
        optimizer=partial(torch.optim.AdamW, lr=inner.lr, betas=(inner.beta1, inner.beta2), eps=1e-8),
        batch_size_per_step=spec.batch_size, target_batch_size=args.world * args.h * spec.batch_size,
        use_local_updates=True, matchmaking_time=args.matchmaking_time, averaging_timeout=args.averaging_timeout,
        state_averaging_compression=_counting_compression(counter), verbose=False,
    )
    stop.install()  # hivemind's averager set SIGINT to "ignore" here
    core = {"start": 0.0, "seconds": 0.0}
    torch_opt = opt.state_averager.optimizer
    torch_opt.register_step_pre_hook(lambda *a: core.__setitem__("start", time.perf_counter()))
    torch_opt.register_step_post_hook(lambda *a: core.__setitem__("seconds", time.perf_counter() - core["start"]))

    class Stepper:
        """What the learner calls as its optimizer: hivemind's step, timed; the learning rate set by
        hand (an LR scheduler would step per hivemind epoch, not per inner step)."""

        def __init__(self):
            self.count = 0
            self.param_groups = opt.param_groups

        def step(self):
            for group in opt.param_groups:
                group["lr"] = inner.lr * lr_factor(inner, self.count)
            self.count += 1
            core["seconds"] = 0.0
            began = time.perf_counter()
            opt.step()
            total = time.perf_counter() - began
            meter.add(seconds=total - core["seconds"])
            meter.bytes_sent = counter.value

        def zero_grad(self, set_to_none=True):
            opt.zero_grad(set_to_none=set_to_none)

    class NoScheduler:
        def step(self):
            pass

    learner.optimizer, learner.scheduler = Stepper(), NoScheduler()
    started = time.time()
    try:
        reason = train(learner, args, stop.event)
        write_summary(args, learner, meter, params, reason, started, hivemind_epoch=opt.local_epoch)
    finally:
        events.close()
        opt.shutdown()
        dht.shutdown()


# ------------------------------------------------------------------ torchft


def run_torchft(args: argparse.Namespace, stop) -> None:
    """One torchft replica group of one process: ``Manager`` (synchronous quorum, as DiLoCo requires)
    + ``ProcessGroupGloo`` + ``DiLoCo`` with ``sync_every = H`` and the outer optimizer of our arms.

    Blocked time per step: the time DiLoCo's optimizer hooks take (quorum, all-reduce of the
    pseudo-gradients, outer step), measured by hooks registered around them.
    """
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    meter = Meter()
    learner, events, params = build_learner(args, meter=meter)
    model = learner.model
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def load_state_dict(state):
        model.load_state_dict(state["model"])
        learner.optimizer.load_state_dict(state["optimizer"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=args.timeout)), min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=lambda: {"model": model.state_dict(), "optimizer": learner.optimizer.state_dict()},
        use_async_quorum=False, replica_id=f"island-{args.rank}", store_addr="127.0.0.1", store_port=store.port,
        rank=0, world_size=1, lighthouse_addr=args.lighthouse, hostname="127.0.0.1", port=0,
        timeout=timedelta(seconds=args.timeout), quorum_timeout=timedelta(seconds=max(60.0, args.timeout)),
    )
    allreduce = manager.allreduce

    def counted_allreduce(tensor, *a, **kw):
        meter.add(sent=ring_bytes(tensor.numel() * tensor.element_size(), max(1, manager.num_participants())))
        return allreduce(tensor, *a, **kw)

    manager.allreduce = counted_allreduce
    marks = {}
    optimizer = learner.optimizer

    def mark(name):
        return lambda *a: marks.__setitem__(name, time.perf_counter())

    optimizer.register_step_pre_hook(mark("pre0"))
    optimizer.register_step_post_hook(mark("post0"))
    outer = torch.optim.SGD(model.parameters(), lr=args.outer_lr, momentum=args.outer_momentum,
                            nesterov=args.outer_momentum > 0)
    started = time.time()
    try:
        with DiLoCo(manager, [model], optimizer, outer, sync_every=args.h, backup_device=torch.device("cpu"),
                    pin_memory=False):
            optimizer.register_step_pre_hook(mark("pre1"))

            def after(*a):
                meter.add(seconds=(marks.get("pre1", 0) - marks.get("pre0", 0))
                          + (time.perf_counter() - marks.get("post0", time.perf_counter())))

            optimizer.register_step_post_hook(after)
            reason = train(learner, args, stop.event)
        write_summary(args, learner, meter, params, reason, started, torchft_step=manager.current_step())
    finally:
        events.close()
        manager.shutdown(wait=False)


def run_lighthouse(args: argparse.Namespace, stop) -> None:
    """torchft's lighthouse (the quorum service) on 127.0.0.1 with its default timeouts; prints
    ``LIGHTHOUSE=<address>`` and serves until SIGINT/SIGTERM."""
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    port = server.address().rsplit(":", 1)[1]
    print(f"LIGHTHOUSE=http://127.0.0.1:{port}", flush=True)
    try:
        stop.event.wait()
    finally:
        server.shutdown()


# ------------------------------------------------------------------ entry point


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("arm", choices=(*ARMS, "lighthouse"))
    parser.add_argument("--rank", type=int, default=int(os.environ.get("RANK", 0)))
    parser.add_argument("--world", type=int, default=int(os.environ.get("WORLD_SIZE", 4)),
                        help="learners in the arm")
    parser.add_argument("--steps", type=int, default=0, help="inner steps per learner (the token budget)")
    parser.add_argument("--h", type=int, default=50, help="inner steps between syncs (hivemind, torchft)")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--shards", type=int, default=1,
                        help="the training split is cut into this many shards; learner r trains on shard r mod it "
                        "(1: every learner samples the whole split, i.i.d., as DDP's DistributedSampler does)")
    parser.add_argument("--seed", type=int, default=ModelConfig().seed)
    add_config_arguments(parser.add_argument_group("inner AdamW, as the islands' --inner-* flags"), InnerConfig,
                         ("inner",))
    parser.add_argument("--outer-lr", type=float, default=1.0)
    parser.add_argument("--outer-momentum", type=float, default=0.0)
    parser.add_argument("--eval-every-steps", type=int, default=50)
    parser.add_argument("--eval-batches", type=int, default=16)
    parser.add_argument("--events", default="", help="the learner's event log (JSONL); {rank} is replaced")
    parser.add_argument("--summary", default="", help="the learner's end-of-run summary (JSON); {rank} is replaced")
    parser.add_argument("--final-params", default="", help="save the final parameters here; {rank} is replaced")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds a collective may take")
    parser.add_argument("--checkpoint", default="", help="ddp: checkpoint file for restarts")
    parser.add_argument("--checkpoint-every", type=int, default=30, help="ddp: steps between checkpoints")
    parser.add_argument("--initial-peers", nargs="*", default=[], help="hivemind: DHT initial peers")
    parser.add_argument("--run-id", default="bench", help="hivemind: run id")
    parser.add_argument("--matchmaking-time", type=float, default=3.0,
                        help="hivemind: seconds (its quick start's value)")
    parser.add_argument("--averaging-timeout", type=float, default=10.0,
                        help="hivemind: seconds (its quick start's value)")
    parser.add_argument("--lighthouse", default="", help="torchft: lighthouse address")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    from p2p_diloco.procs import StopSignal, exit_with_parent, install_child_hooks

    args = parse_args(argv)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_child_hooks()
    stop = StopSignal().install()
    if os.environ.get("P2P_DILOCO_EXIT_WITH_PARENT") == "1":
        exit_with_parent(stop)
    run = {"ddp": run_ddp, "hivemind": run_hivemind, "torchft": run_torchft, "lighthouse": run_lighthouse}[args.arm]
    run(args, stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
