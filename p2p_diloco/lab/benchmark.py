"""Side-by-side benchmark: our islands against data-parallel, hivemind.Optimizer and torchft DiLoCo
(scripts/bench/compare.py, docs/BENCHMARKS.md).

Every arm is ``learners`` processes on 127.0.0.1 training the same model on the same shards with the
same inner AdamW for the same number of inner steps each (the token budget); only how they
communicate differs (:mod:`p2p_diloco.lab.baselines` for the comparators; our islands are
``p2p-diloco peer`` processes). A second pass kills one learner (its whole process tree, SIGKILL)
when it is halfway through its steps and restarts it ``restart_after`` seconds later where the arm
can rejoin (DDP restarts through ``torchrun --max-restarts`` from its last checkpoint instead).

Figures come from the learners' own event logs (definitions: docs/DESIGN.md, "What we measure"):

- **eval loss**: mean over learners of the final held-out loss of each learner's own parameters;
- **eval loss (mean model)**: the held-out loss of the mean of the learners' final parameters, what
  the swarm delivers after one last average (DiLoCo evaluates its outer, averaged model; for DDP
  every learner holds the same parameters, so both figures are the same);
- **wall**: first inner step started to last inner step ended, in seconds (start-up excluded);
- **tokens/s**: tokens of all inner steps done (redone work included) / wall;
- **utilization**: per learner, compute seconds (inner steps minus the time a step was blocked on
  communication) / its span from first to last step minus its evaluations; the mean over learners;
- **bytes/token**: bytes a learner sent / tokens it trained, all learners together;
- **stall per failure**: the mean over the survivors of the time their inner loops lost, from the
  kill to their end, beyond their usual gap between steps (replayed steps count as lost), minus
  the mean of what the same learners lost in the same stretch of the pass without a failure (so an
  arm's own waits, e.g. at the end of the run, do not count);
- **global downtime**: time in the failure pass during which no learner was computing or evaluating
  (gaps of 1 s or more).
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from p2p_diloco.config import InnerConfig
from p2p_diloco.island.events import read_events
from p2p_diloco.lab.experiment import table
from p2p_diloco.lab.figures import _gaps, eval_intervals, global_downtime, merge, typical_gap
from p2p_diloco.lab.chaos import EventTail
from p2p_diloco.lab.localswarm import LocalSwarm, read_line
from p2p_diloco.lab.plots import plot_compare
from p2p_diloco.procs import descendants
from p2p_diloco import files
from p2p_diloco.lab.arms import ARMS  # noqa: F401  (re-exported)

TOKENS_PER_STEP = 16 * 128  # the tiny preset's batch x sequence length


@dataclass
class Bench:
    """One benchmark invocation.

    :param out: output folder (``clean/<arm>/``, ``failure/<arm>/``, results, table, plot)
    :param learners: learners per arm
    :param steps: inner steps per learner (the token budget: learners x steps x 2048 tokens)
    :param h: inner steps between two syncs of the same parameters (hivemind's epoch, torchft's
        ``sync_every``, our outer period through ``ours_period``)
    :param eval_every_steps: comparators evaluate every this many steps (ours every ``eval_seconds``)
    :param restart_after: seconds between a kill and the restart, for arms that can rejoin
    :param ours_period: our outer period T_outer in seconds (0: ``h`` x the ddp arm's median step
        cadence, or ``h`` x 0.5 s without it)
    """

    out: Path
    learners: int = 4
    steps: int = 200
    h: int = 50
    eval_every_steps: int = 50
    eval_seconds: float = 45.0
    restart_after: float = 20.0
    ours_period: float = 0.0
    timeout: float = 1800.0
    step_seconds: Optional[float] = None  # measured in the ddp arm
    env: dict = field(default_factory=dict)
    eval_batches: int = 16  # held-out batches per evaluation (every arm)
    shards: int = 1  # 1: every learner samples the whole training split (i.i.d.); N: learner r gets shard r mod N
    outer_lr: float = 1.0  # outer SGD of torchft and our islands (hivemind averages: lr 1, no momentum)
    outer_momentum: float = 0.0
    inner_lr: float = InnerConfig().lr  # every arm's inner AdamW peak learning rate
    schedule: str = "constant"  # every arm's inner learning rate after warm-up: constant or cosine (over its steps)
    rate: str = ""  # tc rate of every learner's link (e.g. "50mbit"): each learner in its own namespace

    def __post_init__(self):
        self.out = Path(self.out).resolve()  # processes run in their arm's folder

    def inner(self) -> InnerConfig:
        """Every arm's inner AdamW (our islands and the comparators take the same ``--inner-*`` flags):
        the peak learning rate, a 20-step warm-up and the schedule."""
        return InnerConfig(lr=self.inner_lr, warmup_steps=20, schedule=self.schedule)

    def period(self) -> float:
        if self.ours_period:
            return self.ours_period
        return round(self.h * (self.step_seconds or 0.5), 1)

    def fast_rounds(self) -> bool:
        """Syncs every few seconds (the smoke tests' tiny budgets): the learners that average through
        hivemind (ours, hivemind.Optimizer) then use short matchmaking and round timeouts."""
        return self.period() < 24.0


# ------------------------------------------------------------------ processes


class Arm(LocalSwarm):
    """The processes of one arm run: a :class:`~p2p_diloco.lab.localswarm.LocalSwarm` whose ``islands``
    are the learners (or, for DDP on one host, its ``torchrun``) and whose ``bootstrap`` is the
    bootstrap node or torchft's lighthouse; ``close()`` ends every one of them (by PID).

    :param lab: with ``bench.rate``, the network namespaces (one per learner); closed with the arm
    """

    def __init__(self, name: str, bench: Bench, folder: Path, lab=None):
        env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1",
               "TORCHFT_LIGHTHOUSE": ""} | bench.env
        super().__init__(folder, run_id=name.replace("-", "_"), env=env,
                         host=lab.host if lab is not None else "127.0.0.1")
        self.name, self.bench, self.folder, self.lab = name, bench, folder, lab
        self.faults: list[dict] = []

    def learner_host(self, rank: int) -> str:
        return self.lab.address(rank) if self.lab is not None else self.host

    def prefix(self, rank: int) -> list[str]:
        return self.lab.prefix(rank) if self.lab is not None else []

    def start_lighthouse(self) -> str:
        """Start torchft's lighthouse (:func:`p2p_diloco.lab.baselines.run_lighthouse`); returns its address."""
        self.bootstrap = self._spawn("lighthouse", ["lighthouse"], stdout=subprocess.PIPE,
                                     module="p2p_diloco.lab.baselines")
        line = read_line(self.bootstrap.popen, 60.0)
        if not line.startswith("LIGHTHOUSE="):
            raise RuntimeError(f"{self.name}: the lighthouse did not start ({line!r}); see {self.bootstrap.log_path}")
        return line.split("=", 1)[1].strip()

    def close(self, timeout: float = 30.0) -> list[int]:
        leftovers = super().close(timeout)
        if self.lab is not None:
            self.lab.close()
        return leftovers

    def kill(self, learner: str) -> None:
        """SIGKILL a learner's whole process tree (DDP: the torchrun worker, found by its pid)."""
        if self.name == "ddp":
            starts = [e for e in read_events(str(self.events_path(learner))) if e.get("event") == "start"]
            pids = [starts[-1]["pid"]] if starts else []
        else:
            pids = [self.islands[learner].pid]
        for pid in list(pids):
            pids += descendants(pid)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if self.name != "ddp":
            try:
                self.islands[learner].popen.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.faults.append({"t": time.time(), "kind": "kill", "island": learner})


def start_arm(arm: Arm, *, restart: Optional[str] = None, steps: Optional[int] = None) -> None:
    """Start every learner of the arm (or restart ``restart`` with ``steps`` steps left)."""
    bench = arm.bench
    names = [f"island-{rank}" for rank in range(bench.learners)] if restart is None else [restart]
    if arm.name == "ddp":
        worker = ["-m", "p2p_diloco.lab.baselines", "ddp", *_common(arm, bench.steps),
                  "--events", str(arm.folder / "island-{rank}.events.jsonl"),
                  "--summary", str(arm.folder / "island-{rank}.summary.json"),
                  "--final-params", str(arm.folder / "island-{rank}.final.safetensors"),
                  "--checkpoint", str(arm.folder / "checkpoint.pt")]
        if arm.lab is None:  # one torchrun for all workers; it restarts them all when one dies
            arm.islands["torchrun"] = arm._spawn(
                "torchrun", ["--standalone", "--nnodes", "1", "--nproc-per-node", str(bench.learners),
                             "--max-restarts", "1", "--monitor-interval", "0.5", *worker],
                module="torch.distributed.run")
            return
        for rank in range(bench.learners):  # one node per namespace, static rendezvous at node 0
            arm.islands[f"island-{rank}"] = arm._spawn(
                f"torchrun-{rank}", ["--nnodes", str(bench.learners), "--nproc-per-node", "1", "--node-rank", str(rank),
                                     "--master-addr", arm.learner_host(0), "--master-port", "29500", *worker],
                prefix=[*arm.prefix(rank), "env", "GLOO_SOCKET_IFNAME=eth0"], module="torch.distributed.run")
        return
    if arm.name in ("hivemind", "ours-sync", "ours") and arm.bootstrap is None:
        arm.start_bootstrap()
    if arm.name == "torchft" and arm.bootstrap is None:
        arm.initial_peers = [arm.start_lighthouse()]
    for name in names:
        rank = int(name.rsplit("-", 1)[1])
        left = steps if steps is not None else bench.steps
        if arm.name in ("hivemind", "torchft"):
            args = [arm.name, "--rank", str(rank), *_common(arm, left), "--events", str(arm.events_path(name)),
                    "--summary", str(arm.summary_path(name)),
                    "--final-params", str(arm.folder / f"{name}.final.safetensors")]
            if arm.name == "hivemind":
                args += ["--initial-peers", *arm.initial_peers, "--run-id", "bench"]
                if bench.fast_rounds():  # a lone restarted peer must not wait 10 s per failed round
                    args += ["--matchmaking-time", "1.0", "--averaging-timeout", "2"]
            else:
                args += ["--lighthouse", arm.initial_peers[0]]
            arm.islands[name] = arm._spawn(name, args, module="p2p_diloco.lab.baselines")
        else:
            arm.start_island(name, "--data-num-shards", str(bench.shards),
                             "--data-shard-index", str(rank % bench.shards), "--max-steps", str(left), "--checkpoint-dir", str(arm.folder / "checkpoints" / name),
                             "--checkpoint-every", "86400",  # only the exit checkpoint: a restart joins from peers
                             *ours_args(arm.name, bench), host=arm.learner_host(rank), prefix=arm.prefix(rank))


def _common(arm: Arm, steps: int) -> list[str]:
    bench = arm.bench
    return ["--world", str(bench.learners), "--shards", str(bench.shards), "--steps", str(steps), "--h", str(bench.h),
            "--eval-every-steps", str(bench.eval_every_steps), "--eval-batches", str(bench.eval_batches),
            *bench.inner().to_flags(("inner",)),
            "--outer-lr", str(bench.outer_lr), "--outer-momentum", str(bench.outer_momentum)]


def ours_args(name: str, bench: Bench) -> list[str]:
    """Our islands' flags: the comparators' inner settings (tiny preset, warm-up 20, 16 eval batches,
    one torch thread) and outer step (plain averaging: lr 1, no momentum), and the period that gives
    H inner steps per outer period.

    - ``ours``: our defaults for everything else (2 fragments on staggered slots, quorum 2, grace
      window 1.5 s), rounds in the background, and int4 outer gradients with error feedback;
    - ``ours-sync``: one fragment, quorum = every learner (a longer grace window so rounds wait for
      all), fp32 on the wire: synchronous DiLoCo on our stack (rounds still run in the background).
    """
    period = bench.period()
    common = ["--preset", "tiny", "--device", "cpu", "--threads", "1", *bench.inner().to_flags(("inner",)),
              "--eval-batches", str(bench.eval_batches), "--eval-every", str(bench.eval_seconds),
              "--outer-lr", str(bench.outer_lr), "--outer-momentum", str(bench.outer_momentum),
              "--outer-period", str(period), "--progress-period", "2", "--progress-ttl", "10", "--join-timeout", "60"]
    fast = bench.fast_rounds()  # rounds every few seconds (smoke tests): the experiments' round timings
    if fast:
        common += ["--outer-matchmaking-time", "1.5", "--outer-allreduce-timeout", "2",
                   "--outer-request-timeout", "0.5"]
    if name == "ours-sync":
        return [*common, "--outer-fragments", "1", "--outer-quorum", str(bench.learners),
                "--outer-grace-window", "1" if fast else "3", "--outer-codec", "none"]
    return [*common, "--outer-codec", "int4", *(["--outer-grace-window", "0.5"] if fast else [])]


def _steps_done(arm: Arm, tail: EventTail) -> int:
    """Inner steps of the learner's current life, from its event log (read incrementally)."""
    tail.read()
    events = tail.seen
    starts = [i for i, e in enumerate(events) if e.get("event") in ("start", "resume")]
    begin = starts[-1] if starts and arm.name != "ddp" else 0
    return max((e.get("step", 0) for e in events[begin:] if e.get("event") == "step"), default=0)


def run_pass(name: str, bench: Bench, *, failure: bool, victim: str = "island-1") -> dict:
    """Run one arm to its token budget; with ``failure``, SIGKILL ``victim`` halfway through its
    steps and restart it ``restart_after`` s later with the steps it has left (DDP: torchrun
    restarts every worker from the checkpoint). Returns the arm's figures (:func:`arm_figures`)."""
    folder = bench.out / ("failure" if failure else "clean") / name
    lab = None
    if bench.rate:
        from p2p_diloco.lab.netns import Lab

        lab = Lab(bench.learners)
    arm = Arm(name, bench, folder, lab)
    tail = EventTail(arm.events_path(victim))
    started = time.time()
    mid: Optional[float] = None
    try:
        for rank in range(bench.learners if lab is not None else 0):
            lab.throttle(rank, bench.rate)
        start_arm(arm)
        deadline = time.monotonic() + bench.timeout
        restart_at, left = None, 0
        while time.monotonic() < deadline:
            if not any(m.alive() for m in arm.islands.values()) and restart_at is None:
                break
            if mid is None and _steps_done(arm, tail) >= bench.steps // 2:
                mid = time.time()
                if failure:
                    left = bench.steps - _steps_done(arm, tail)
                    arm.kill(victim)
                    if name != "ddp":
                        restart_at = time.monotonic() + bench.restart_after
            if restart_at is not None and time.monotonic() >= restart_at:
                start_arm(arm, restart=victim, steps=left)
                arm.faults.append({"t": time.time(), "kind": "restart", "island": victim})
                restart_at = None
            time.sleep(0.2)
        else:
            print(f"[{name}] timed out after {bench.timeout:.0f} s: stopping it", flush=True)
    finally:
        arm.close()
    events = {f"island-{r}": read_events(str(arm.events_path(f"island-{r}")))
              for r in range(bench.learners) if arm.events_path(f"island-{r}").exists()}
    summaries = {n: json.loads(arm.summary_path(n).read_text()) for n in events if arm.summary_path(n).exists()}
    figures = arm_figures(name, events, summaries, mid=mid, faults=arm.faults, victim=victim)
    figures["eval_loss_mean_model"] = mean_model_eval(folder, bench)
    figures["seconds"] = round(time.time() - started, 1)
    files.write_json(folder / "figures.json", figures)
    return figures


# ------------------------------------------------------------------ figures


def final_params(folder: Path, learner: str) -> Optional[dict]:
    """A learner's final parameters: a comparator's ``<learner>.final.safetensors``, or the newest
    checkpoint our island wrote at exit (``checkpoints/<learner>/``); None if there is neither."""
    from safetensors.torch import load_file

    from p2p_diloco.island.checkpoint import CheckpointError, list_checkpoints, load_checkpoint

    path = folder / f"{learner}.final.safetensors"
    if path.exists():
        return load_file(str(path))
    for candidate in reversed(list_checkpoints(folder / "checkpoints" / learner)):
        try:
            return load_checkpoint(candidate).params
        except CheckpointError:
            continue
    return None


def mean_model_eval(folder: Path, bench: Bench) -> Optional[float]:
    """Held-out loss (nats/token) of the element-wise mean of the learners' final parameters, on
    the learners' own eval batches (:meth:`Learner.evaluate`); None if no learner left its parameters."""
    import torch

    from p2p_diloco.lab.baselines import make_learner

    found = [p for p in (final_params(folder, f"island-{r}") for r in range(bench.learners)) if p]
    if len(found) < bench.learners:
        print(f"[compare] {folder.name}: the mean model averages {len(found)} of {bench.learners} learners "
              "(the others left no final parameters)", flush=True)
    if not found:
        return None
    learner, _ = make_learner(0, eval_batches=bench.eval_batches)
    with torch.no_grad():
        for name, param in learner.model.named_parameters():
            param.copy_(torch.stack([p[name].double() for p in found]).mean(0).to(param.dtype))
    return round(learner.evaluate(), 4)


def compute_intervals(events: Sequence[dict]) -> list[tuple[float, float]]:
    """A learner's compute intervals: each inner step minus the seconds it was blocked on
    communication (``comm``, comparators only; our islands' steps never block)."""
    return [(e["t"] - max(0.0, e["dt"] - e.get("comm", 0.0)), e["t"]) for e in events if e.get("event") == "step"]


def lost_after(events: Sequence[dict], at: float) -> Optional[float]:
    """Seconds a learner's inner loop lost from ``at`` to its end: gaps between compute intervals
    (evaluations excluded) beyond its usual gap, plus the compute time of steps it did again (a step
    number it had already passed: DDP's workers replay from their checkpoint). The usual gap comes from
    the steps before ``at``, or from the whole run where fewer than 5 came before (a learner that
    started late); a learner that had finished by ``at`` lost 0 s. None with fewer than 3 steps."""
    steps = compute_intervals(events)
    evals = eval_intervals(events)
    if len(steps) < 3:
        return None
    before = [s for s in steps if s[1] <= at]
    after = [s for s in steps if s[1] > at]
    usual = typical_gap(before if len(before) >= 5 else steps, evals)
    window = [*before[-1:], *after]
    lost = sum(max(0.0, gap - usual) for gap in _gaps(window, evals))
    reached = 0
    for event in (e for e in events if e.get("event") == "step"):
        if event["t"] > at and event.get("step", 0) <= reached:
            lost += max(0.0, event["dt"] - event.get("comm", 0.0))
        reached = max(reached, event.get("step", 0))
    return lost


def learner_utilization(events: Sequence[dict]) -> Optional[float]:
    """Compute seconds / (first step start to last step end, minus evaluations)."""
    steps = compute_intervals(events)
    if not steps:
        return None
    raw = [e for e in events if e.get("event") == "step"]
    span = (raw[0]["t"] - raw[0]["dt"], raw[-1]["t"])
    evals = sum(b - a for a, b in merge(eval_intervals(events)) if a >= span[0] and b <= span[1])
    busy = sum(b - a for a, b in steps)
    return busy / max(1e-9, span[1] - span[0] - evals)


def final_eval(events: Sequence[dict]) -> Optional[float]:
    evals = [e for e in events if e.get("event") == "eval"]
    return evals[-1]["eval_loss"] if evals else None


def arm_figures(name: str, events: dict[str, list[dict]], summaries: dict[str, dict], *, mid: Optional[float],
                faults: Sequence[dict] = (), victim: str = "island-1") -> dict:
    """An arm's figures from its learners' events and summaries (see the module docstring).
    ``lost_after_mid`` (per survivor) is what :func:`stall_per_failure` compares between passes."""
    steps = {n: [e for e in evs if e.get("event") == "step"] for n, evs in events.items()}
    starts = [s[0]["t"] - s[0]["dt"] for s in steps.values() if s]
    ends = [s[-1]["t"] for s in steps.values() if s]
    wall = max(ends) - min(starts) if starts else None
    tokens = sum(len(s) for s in steps.values()) * TOKENS_PER_STEP
    evals = [v for v in (final_eval(evs) for evs in events.values()) if v is not None]
    utils = [u for u in (learner_utilization(evs) for evs in events.values()) if u is not None]
    sent = sum(s.get("bytes_sent", 0) for s in summaries.values())
    trained = sum(s.get("tokens", 0) for s in summaries.values())
    # an evaluation is work, not downtime (every learner evaluates at about the same time)
    compute = {n: compute_intervals(evs) + eval_intervals(evs) for n, evs in events.items()}
    downtime, _ = (global_downtime(compute, {"arm": [(min(starts), max(ends))]}, min(starts), max(ends))
                   if starts else (None, []))
    lost = {n: lost_after(evs, mid) for n, evs in events.items() if n != victim} if mid else {}
    h = [s.get("inner_steps_per_outer_period") for s in summaries.values() if s.get("inner_steps_per_outer_period")]
    curve = _curve(events, min(starts) if starts else 0.0)
    return {
        "arm": name,
        "learners": len(events),
        "eval_loss": round(statistics.fmean(evals), 4) if evals else None,
        "eval_loss_spread": round(max(evals) - min(evals), 4) if evals else None,
        "tokens": tokens,
        "wall_seconds": round(wall, 1) if wall else None,
        "tokens_per_second": round(tokens / wall, 1) if wall else None,
        "utilization": round(statistics.fmean(utils), 4) if utils else None,
        "bytes_per_token": round(sent / trained, 2) if trained else None,
        "h": round(statistics.fmean(h), 1) if h else None,
        "global_downtime_seconds": round(downtime, 2) if downtime is not None else None,
        "mid": mid,
        "lost_after_mid": {n: (round(v, 3) if v is not None else None) for n, v in lost.items()},
        "faults": list(faults),
        "curve": curve,
    }


def _curve(events: dict[str, list[dict]], t0: float) -> list[tuple[float, float, float]]:
    """(swarm tokens, seconds since the arm's first step, mean eval loss) at each evaluation index."""
    lists = [[e for e in evs if e.get("event") == "eval"] for evs in events.values()]
    lists = [evals for evals in lists if evals]
    points = []
    for index in range(min((len(evals) for evals in lists), default=0)):
        row = [evals[index] for evals in lists]
        tokens = statistics.fmean(e["tokens"] for e in row) * len(events)
        seconds = round(max(e["t"] for e in row) - t0, 2)
        points.append((tokens, seconds, round(statistics.fmean(e["eval_loss"] for e in row), 4)))
    return points


def stall_per_failure(clean: dict, failed: dict) -> Optional[float]:
    """Mean over the survivors of the time they lost after the kill, minus the mean of what the same
    learners lost after the same point of the clean pass (seconds; near 0 it can come out slightly
    negative: run-to-run noise)."""
    names = [n for n, v in failed.get("lost_after_mid", {}).items()
             if v is not None and clean.get("lost_after_mid", {}).get(n) is not None]
    if not names:
        return None
    failed_mean = statistics.fmean(failed["lost_after_mid"][n] for n in names)
    clean_mean = statistics.fmean(clean["lost_after_mid"][n] for n in names)
    return round(failed_mean - clean_mean, 3)


# ------------------------------------------------------------------ table and plot

COLUMNS = [
    ("arm", "arm"), ("eval_loss", "eval loss"), ("eval_vs_ddp", "vs ddp"),
    ("eval_loss_mean_model", "eval loss, mean model"), ("mean_model_vs_ddp", "vs ddp"), ("wall_seconds", "wall s"),
    ("tokens_per_second", "tokens/s"), ("utilization", "utilization"), ("bytes_per_token", "bytes/token"),
    ("fewer_bytes_than_ddp", "x fewer bytes than ddp"), ("stall_per_failure", "stall/failure s"),
    ("global_downtime_seconds_failure", "downtime s"), ("eval_loss_failure", "eval loss (failure)"),
    ("ratios", "ratio to ddp (loss, wall, tokens/s)"),
]


def combine(rows: Sequence[dict], failure_rows: Sequence[dict]) -> list[dict]:
    """One table row per arm: the clean pass's figures, the failure pass's, and ratios to ddp."""
    failure = {r["arm"]: r for r in failure_rows}
    ddp = next((r for r in rows if r["arm"] == "ddp"), None)
    out_rows = []
    for row in rows:
        out = dict(row)
        if row["arm"] in failure:
            f = failure[row["arm"]]
            out["stall_per_failure"] = stall_per_failure(row, f)
            out["global_downtime_seconds_failure"] = f["global_downtime_seconds"]
            out["eval_loss_failure"] = f["eval_loss"]
        if ddp and ddp.get("eval_loss_mean_model") and row.get("eval_loss_mean_model"):
            out["mean_model_vs_ddp"] = f"{100 * (row['eval_loss_mean_model'] / ddp['eval_loss_mean_model'] - 1):+.1f}%"
        if ddp and ddp.get("eval_loss") and row.get("eval_loss"):
            out["eval_vs_ddp"] = f"{100 * (row['eval_loss'] / ddp['eval_loss'] - 1):+.1f}%"
            ratios = [row["eval_loss"] / ddp["eval_loss"]]
            for key in ("wall_seconds", "tokens_per_second"):
                ratios.append(row[key] / ddp[key] if row.get(key) and ddp.get(key) else math.nan)
            out["ratios"] = ", ".join(f"{r:.3f}" for r in ratios)
        if ddp and ddp.get("bytes_per_token") and row.get("bytes_per_token"):
            out["fewer_bytes_than_ddp"] = round(ddp["bytes_per_token"] / row["bytes_per_token"], 1)
        out_rows.append(out)
    return out_rows


def run_bench(bench: Bench, arms: Sequence[str], *, failure_arms: Optional[Sequence[str]] = None) -> list[dict]:
    """Run the clean pass of every arm, then the failure pass of ``failure_arms`` (default: every
    arm), then write ``results.json``, ``table.md`` and ``compare.png`` under ``bench.out``; returns
    the table rows."""
    bench.out.mkdir(parents=True, exist_ok=True)
    clean, failed = [], []
    for name in arms:
        print(f"[compare] {name}: {bench.learners} learners x {bench.steps} steps"
              + (f" (outer period {bench.period()} s)" if name.startswith("ours") else ""), flush=True)
        clean.append(run_pass(name, bench, failure=False))
        if name == "ddp" and not bench.ours_period:
            bench.step_seconds = median_step_seconds(bench.out / "clean" / "ddp", bench.learners)
        print(f"[compare]   eval loss {clean[-1]['eval_loss']}, wall {clean[-1]['wall_seconds']} s, "
              f"utilization {clean[-1]['utilization']}, bytes/token {clean[-1]['bytes_per_token']}", flush=True)
    for name in arms if failure_arms is None else [arm for arm in arms if arm in failure_arms]:
        print(f"[compare] {name}, failure pass: learner island-1 SIGKILLed halfway", flush=True)
        failed.append(run_pass(name, bench, failure=True))
        print(f"[compare]   eval loss {failed[-1]['eval_loss']}, downtime "
              f"{failed[-1]['global_downtime_seconds']} s", flush=True)
    rows = combine(clean, failed)
    files.write_json(bench.out / "results.json", {"clean": clean, "failure": failed, "table": rows,
                                                  "period": bench.period()})
    text = table(rows, COLUMNS)
    files.write_text(bench.out / "table.md", text + "\n")
    plot_compare(clean, bench.out / "compare.png", f"{bench.learners} learners x {bench.steps} steps, tiny preset, same data")
    print(f"\n{text}\n\nplot: {bench.out / 'compare.png'}", flush=True)
    return rows


def median_step_seconds(folder: Path, learners: int) -> Optional[float]:
    """Median seconds from one inner step's end to the next over the learners of an arm (its step
    cadence, communication included), to set our period to H steps of the same machine load."""
    cadence = []
    for rank in range(learners):
        path = folder / f"island-{rank}.events.jsonl"
        if path.exists():
            ends = [e["t"] for e in read_events(str(path)) if e.get("event") == "step"]
            cadence += [b - a for a, b in zip(ends, ends[1:])]
    return statistics.median(cadence) if cadence else None
