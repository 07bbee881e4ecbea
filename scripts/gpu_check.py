#!/usr/bin/env python3
"""The GPU check (docs/GPU.md): one prepared run on a single CUDA device that writes every figure to
one JSON file. Run it through ./scripts/gpu_check.sh, which bounds it to 8 minutes.

Parts, each bounded and recorded with its own status (``ok`` or ``failed``):

1. ``step``: the tiny model's loss and gradients on one batch in fp32 on CUDA equal the CPU's
   (within 1e-3, relative), and bf16 autocast's loss is within 2% (gradients within 10%);
2. ``throughput`` (and ``throughput_base``): the small (base) preset's inner loop under bf16 autocast,
   tokens/s and model FLOPs utilization (PaLM's 6N + 12 L d T FLOPs per token over the device's dense
   bf16 peak);
3. ``unit_tests``: the unit tests, on this machine;
4. ``swarm``: a local swarm of 2 islands on the GPU (small preset, bf16) for 3 minutes, from the
   demo: each island's eval loss falls below its first value and its rounds succeed;
5. ``island_ranks``: a 2-rank DDP island (NCCL on two GPUs, gloo ranks sharing one GPU otherwise) and a
   one-process island, both on CUDA, for a minute of training: both exit 0, their rounds succeed, the
   ranks agree after every landed update and the island's tokens count both ranks.

Exit code 0 when every part is ok, 1 when one failed, 2 without a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _learner(preset: str, device: str, next_batch):
    """A learner of ``preset``'s model (seed 0, 2 fragments, no warm-up) on ``device``."""
    import torch

    from p2p_diloco.algo.fragments import balanced_layout
    from p2p_diloco.config import InnerConfig
    from p2p_diloco.island.learner import Learner
    from p2p_diloco.island.model import PRESETS, build_model

    spec = PRESETS[preset]
    model = build_model(spec, spec.vocab_size, seed=0).to(device)
    layout = balanced_layout([(n, p.numel()) for n, p in model.named_parameters()], 2)
    return Learner(model=model, layout=layout, next_batch=next_batch, eval_data=[], device=torch.device(device),
                   inner=InnerConfig(warmup_steps=0))


def step_check() -> dict:
    """fp32 CPU vs fp32 CUDA vs bf16 CUDA: the tiny model's loss and gradients on one batch (the
    gradients, not the parameters after an AdamW step: an element whose gradient is near 0 may step
    either way, by the learning rate)."""
    import numpy as np
    import torch

    from p2p_diloco.island.model import PRESETS

    spec = PRESETS["tiny"]
    batch = torch.from_numpy(np.random.default_rng(0).integers(0, spec.vocab_size, (8, spec.seq_len + 1)))

    def gradients(device: str, autocast: bool) -> tuple[float, list]:
        learner = _learner("tiny", device, lambda: batch)
        learner.autocast = autocast
        loss = learner._loss(batch)
        loss.backward()
        return float(loss.detach()), [p.grad.detach().float().cpu() for p in learner.model.parameters()]

    cpu_loss, cpu_grads = gradients("cpu", False)
    cuda_loss, cuda_grads = gradients("cuda", False)
    bf16_loss, bf16_grads = gradients("cuda", True)

    def worst(grads) -> float:  # the largest difference, relative to each tensor's largest gradient
        return max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) for a, b in zip(grads, cpu_grads))

    fp32, bf16 = worst(cuda_grads), worst(bf16_grads)
    ok = (abs(cuda_loss - cpu_loss) <= 1e-3 * abs(cpu_loss) and fp32 <= 1e-3
          and abs(bf16_loss - cpu_loss) <= 0.02 * cpu_loss and bf16 <= 0.1)
    return {"status": "ok" if ok else "failed", "loss_cpu_fp32": cpu_loss, "loss_cuda_fp32": cuda_loss,
            "loss_cuda_bf16": bf16_loss, "gradient_difference_fp32": fp32, "gradient_difference_bf16": bf16}


def throughput(preset: str = "small", steps: int = 40, warmup: int = 5) -> dict:
    """tokens/s and MFU of ``preset``'s inner steps (bf16 autocast), after ``warmup`` steps."""
    import numpy as np
    import torch

    from p2p_diloco.island.model import (PRESETS, count_parameters, flops_per_token, model_flops_utilization,
                                         peak_flops)

    spec = PRESETS[preset]
    rng = np.random.default_rng(0)
    learner = _learner(preset, "cuda", lambda: torch.from_numpy(
        rng.integers(0, spec.vocab_size, (spec.batch_size, spec.seq_len + 1))))
    model = learner.model
    for _ in range(warmup):
        learner.train_step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        learner.train_step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    tokens_per_second = steps * spec.batch_size * spec.seq_len / seconds
    per_token = flops_per_token(count_parameters(model), spec)
    name = torch.cuda.get_device_name()
    return {"status": "ok", "device": name, "preset": preset, "steps": steps, "seconds": round(seconds, 3),
            "tokens_per_second": round(tokens_per_second, 1), "model_flops_per_token": per_token,
            "peak_bf16_flops": peak_flops(name),
            "mfu": model_flops_utilization(tokens_per_second, per_token, peak_flops(name))}


def unit_tests(timeout: float) -> dict:
    """The unit tests, all of them (no -x), but those of the wandb extra where it is not installed (its
    wheels and their needs are too large to carry; CI runs them)."""
    import importlib.util

    started = time.monotonic()
    deselect = [] if importlib.util.find_spec("wandb") else ["-k", "not wandb"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/unit", "-p", "no:cacheprovider", *deselect],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    lines = done.stdout.strip().splitlines()
    failed = [line.split()[1] for line in lines if line.startswith(("FAILED ", "ERROR "))]
    return {"status": "ok" if done.returncode == 0 else "failed", "summary": (lines[-1:] or [""])[0], "failed": failed,
            "deselected": " ".join(deselect[1:]),
            "seconds": round(time.monotonic() - started, 1), "output_tail": done.stdout[-2000:] + done.stderr[-1000:]}


def swarm(out: Path, minutes: float, timeout: float, preset: str = "small", device: str = "cuda") -> dict:
    """The demo's swarm of 2 islands on the GPU; each island's summary figures and eval curve.

    The eval loss must fall below its first value at some eval, not at the last: on an H200 an island
    of the small preset trains on its half of the embedded corpus (about 0.6M tokens) once every 2-3 s,
    so after its first minute it memorizes it and the held-out loss rises (measured, docs/GPU.md)."""
    from p2p_diloco.island.events import read_events

    folder = out / "swarm"
    demo = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "demo.py"), "--islands", "2", "--minutes",
                             f"{minutes:.2f}", "--preset", preset, "--device", device, "--period", "10",
                             "--eval-every", "5", "--dashboard-port", "0", "--out", str(folder)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = demo.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # Ctrl+C, as a user would: the demo stops every process it started
        demo.send_signal(signal.SIGINT)
        stdout, stderr = demo.communicate(timeout=60)
    done = subprocess.CompletedProcess(demo.args, demo.returncode, stdout, stderr)
    islands = {}
    for path in sorted(folder.glob("*.summary.json")):
        summary = json.loads(path.read_text())
        islands[summary["island"]] = {key: summary.get(key) for key in (
            "device", "inner_steps", "tokens", "tokens_per_second", "mfu", "eval_loss_first", "eval_loss_last",
            "outer_rounds_ok", "outer_rounds_failed", "compute_utilization")}
        events = folder / f"{summary['island']}.events.jsonl"
        curve = [(e["step"], round(e["eval_loss"], 3)) for e in (read_events(str(events)) if events.exists() else [])
                 if e.get("event") == "eval" and e.get("eval_loss") is not None]
        islands[summary["island"]]["eval_curve"] = curve  # (inner step, held-out loss)
        islands[summary["island"]]["eval_loss_best"] = min((loss for _, loss in curve), default=None)
    ok = (done.returncode == 0 and len(islands) == 2 and all(
        i["eval_loss_best"] is not None and i["eval_loss_first"] is not None and i["eval_loss_best"] < i["eval_loss_first"]
        and i["outer_rounds_ok"] > 0 and i["outer_rounds_ok"] >= i["outer_rounds_failed"] for i in islands.values()))
    return {"status": "ok" if ok else "failed", "minutes": minutes, "islands": islands,
            "returncode": done.returncode, "output_tail": "" if ok else done.stdout[-2000:] + done.stderr[-2000:]}


def island_ranks(out: Path, timeout: float, device: str = "cuda") -> dict:
    """An island of 2 DDP ranks and a one-process island on ``device`` (tiny preset, a minute of
    training, a round every 5 s): their summaries and the ranks' agreement events."""
    from p2p_diloco.island.events import read_events
    from p2p_diloco.lab.localswarm import LocalSwarm

    flags = ["--preset", "tiny", "--device", device, "--max-minutes", "1", "--outer-fragments", "1",
             "--outer-period", "5", "--outer-matchmaking-time", "1.5", "--outer-grace-window", "0.5",
             "--outer-allreduce-timeout", "1.5", "--outer-request-timeout", "0.5", "--progress-period", "1",
             "--eval-every", "20"]
    swarm = LocalSwarm(out / "ranks", run_id="gpu-ranks")
    try:
        swarm.start_bootstrap()
        swarm.start_island("ranks", *flags, "--nproc-per-node", "2", "--data-shard-index", "0")
        swarm.start_island("solo", *flags, "--data-shard-index", "1")
        codes = swarm.wait_islands(timeout)
    finally:
        swarm.close()
    islands = {name: swarm.summary(name) or {} for name in ("ranks", "solo")}
    path = swarm.events_path("ranks")
    agreed = [e for e in (read_events(str(path)) if path.exists() else []) if e.get("event") == "ranks_agree"]
    ranks, solo = islands["ranks"], islands["solo"]
    ok = (codes == {"ranks": 0, "solo": 0} and ranks.get("ranks") == 2 and (ranks.get("outer_rounds_ok") or 0) > 0
          and len(agreed) >= ranks["outer_rounds_ok"] - 1 and solo.get("inner_steps")
          and ranks["tokens"] == 2 * ranks["inner_steps"] * solo["tokens"] // solo["inner_steps"])
    keep = ("device", "ranks", "inner_steps", "tokens", "tokens_per_second", "mfu", "eval_loss_first",
            "eval_loss_last", "outer_rounds_ok", "outer_rounds_failed")
    return {"status": "ok" if ok else "failed", "codes": codes, "ranks_agree": len(agreed),
            "islands": {name: {key: summary.get(key) for key in keep} for name, summary in islands.items()},
            "log_tail": "" if ok or not (out / "ranks" / "ranks.log").exists() else
            (out / "ranks" / "ranks.log").read_text(errors="replace")[-3000:]}


PARTS = ("step", "throughput", "throughput_base", "unit_tests", "island_ranks", "swarm")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/gpu-check", help="folder of gpu_check.json and the swarm's files")
    parser.add_argument("--swarm-minutes", type=float, default=3.0, help="training minutes of the swarm (default: 3)")
    parser.add_argument("--budget", type=float, default=450.0,
                        help="seconds for every part together (default 450; the swarm gets what is left, up to "
                        "--swarm-minutes)")
    parser.add_argument("--swarm-preset", default="small", choices=("tiny", "small", "base"),
                        help="model of the swarm's islands (default: small)")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS, metavar="PART",
                        help=f"the parts to run, in this order (default: all of {', '.join(PARTS)})")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False): run this on a machine with a GPU",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    figures = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": commit or None,
               "torch": torch.__version__, "device": torch.cuda.get_device_name()}
    deadline = time.monotonic() + args.budget

    def left(most: float) -> float:  # seconds a part may take: at most ``most``, within the budget
        return max(10.0, min(most, deadline - time.monotonic() - 10.0))

    parts = {"step": step_check, "throughput": lambda: throughput("small"),
             "throughput_base": lambda: throughput("base"), "unit_tests": lambda: unit_tests(left(120)),
             "island_ranks": lambda: island_ranks(out, left(100)),
             "swarm": lambda: swarm(out, min(args.swarm_minutes, (left(1e9) - 90) / 60),
                                    left(60 * args.swarm_minutes + 150), args.swarm_preset)}
    for name, part in ((name, parts[name]) for name in args.parts):
        started = time.monotonic()
        try:
            figures[name] = part()
        except (Exception, KeyboardInterrupt) as e:  # a part that breaks or runs out of time is recorded
            figures[name] = {"status": "failed", "error": repr(e)}
        figures[name]["wall_seconds"] = round(time.monotonic() - started, 1)
        print(f"gpu_check: {name}: {figures[name]['status']}", flush=True)
        (out / "gpu_check.json").write_text(json.dumps(figures, indent=2))
    print(f"gpu_check: figures in {out / 'gpu_check.json'}")
    return 1 if any(isinstance(v, dict) and v.get("status") == "failed" for v in figures.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
