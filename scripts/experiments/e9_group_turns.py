#!/usr/bin/env python3
"""E9: rounds of several groups that take turns, emulated in one process (issue 18; docs/SCALE.md,
"A plan for 1,000 islands").

One group of everybody stops scaling with the swarm (its all-reduce needs N - 1 connections per
member). The plan weighed there lets G groups take turns on a fragment's slots: group g averages at
the slots k = g mod G, every island keeps its own period T_outer, and before its turn an island
reloads the swarm's newest Theta_p and carries its progress (as a lagging island does today), so each
slot steps the one global state and the fragment versions agree by construction. The question this
experiment answers is the algorithm's: the global state then takes G outer steps per period, each from
1/G of the islands, whose pseudo-gradients span a whole period and were measured from a base up to
G - 1 steps old. Does that keep the quality of one group, and how must the outer step be scaled?

No network and no syncer: N replicas of the product's model and learner (its inner AdamW, data
shards and eval batches) train in turn in this process, and the global state steps with the product's
``outer_step``. Every arm trains each replica for the same inner steps on the same shards, so the
arms differ only in how the outer steps are taken:

  one-group          every period, the mean pseudo-gradient of all N islands (today's round): Nesterov
                     m <- 0.9 m + g, Theta <- Theta - lr (g + 0.9 m)
  turns-G-scaled     G groups in turn, each step Nesterov on the group's mean scaled by 1/G (a group is
                     1/G of the islands), the momentum 0.9 per step
  turns-G-momentum   the same with the momentum 0.9^(1/G) per step (the same decay per period)
  turns-G-delayed    the product's step (p2p_diloco.algo.outer.turn_step): each turn
                     m <- m + g_k / G (decayed by 0.9 first at the period's first turn) and
                     Theta <- Theta - lr g_k / G, the last turn also Theta <- Theta - lr 0.9 m: over a
                     period the one group's step exactly when the bases are fresh (delayed Nesterov
                     momentum, arXiv 2401.09135: the momentum moves once per G updates)

The figure is the held-out loss of the global state at the end (nats/token), and its curve.

    .venv/bin/python scripts/experiments/e9_group_turns.py [--islands 8] [--groups 2 4] [--periods 10] [--inner-steps 16] [--seed 0]

about 25 minutes on 2 cores; figures in docs/SCALE.md, "Groups that take turns, emulated (E9)"
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1].parent))

from p2p_diloco.algo import outer  # noqa: E402
from p2p_diloco.algo.fragments import balanced_layout  # noqa: E402
from p2p_diloco.config import InnerConfig, ModelConfig  # noqa: E402
from p2p_diloco.island import data as data_lib  # noqa: E402
from p2p_diloco.island.learner import Learner  # noqa: E402
from p2p_diloco.island.model import build_model, resolve_spec  # noqa: E402


class Replicas:
    """N learners on their own shards and one global state (Theta, outer momentum) of the whole model."""

    def __init__(self, islands: int, seed: int):
        spec = resolve_spec(ModelConfig())
        corpus = data_lib.load_corpus("", "", spec.vocab_size, 0.05)
        self.learners = []
        for i in range(islands):
            model = build_model(spec, corpus.vocab_size, seed)
            layout = balanced_layout([(n, p.numel()) for n, p in model.named_parameters()], 1)
            sampler = data_lib.BatchSampler(corpus.shard(i, islands), spec.batch_size, spec.seq_len, seed, f"island-{i}")
            self.learners.append(Learner(model=model, layout=layout, next_batch=sampler.next_batch,
                                         eval_data=data_lib.eval_batches(corpus.eval, 8, spec.batch_size, spec.seq_len),
                                         device=torch.device("cpu"), inner=InnerConfig()))
        self.theta = [p.detach().clone() for p in self.learners[0].fragment_params[0]]
        self.momentum = [torch.zeros_like(t) for t in self.theta]
        self.bases = [[t.clone() for t in self.theta] for _ in self.learners]  # each island's last landed Theta

    def params(self, i: int) -> list[torch.Tensor]:
        return self.learners[i].fragment_params[0]

    def train(self, steps: int) -> None:
        for learner in self.learners:
            for _ in range(steps):
                learner.train_step()

    @torch.no_grad()
    def round(self, members: list[int], arm: str, groups: int, turn: int, lr: float) -> None:
        """One turn: the members' mean pseudo-gradient (each measured from the member's own base, as a
        member that reloaded and carried its progress sends it) steps the global state as ``arm``
        says, then the members take the new state."""
        deltas = [outer.pseudo_gradient(self.bases[i], self.params(i)) for i in members]
        mean = [torch.stack(parts).mean(0) for parts in zip(*deltas)]
        if arm.endswith("-delayed") or groups == 1:
            outer.turn_step(self.theta, mean, self.momentum, lr=lr, momentum=0.9, nesterov=True, turn=turn, turns=groups)
        else:
            momentum = 0.9 ** (1.0 / groups) if arm.endswith("-momentum") else 0.9
            outer.outer_step(self.theta, [t / groups for t in mean], self.momentum, lr=lr, momentum=momentum,
                             nesterov=True)
        for i in members:
            for param, new in zip(self.params(i), self.theta):
                param.copy_(new)
            self.bases[i] = [t.clone() for t in self.theta]

    @torch.no_grad()
    def eval_global(self) -> float:
        """Held-out loss of the global state (on a scratch copy: the replicas are left as they are)."""
        learner = self.learners[0]
        saved = [p.clone() for p in self.params(0)]
        for param, new in zip(self.params(0), self.theta):
            param.copy_(new)
        loss = learner.evaluate()
        for param, old in zip(self.params(0), saved):
            param.copy_(old)
        return loss


def run_arm(name: str, groups: int, args) -> dict:
    torch.manual_seed(args.seed)
    replicas = Replicas(args.islands, args.seed)
    started, curve = time.time(), []
    sub = args.inner_steps // groups  # each group's turn comes every inner_steps / G steps of the swarm
    for k in range(args.periods * groups):
        replicas.train(sub)
        g = k % groups
        replicas.round([i for i in range(args.islands) if i % groups == g], name, groups, g, args.outer_lr)
        if (k + 1) % groups == 0:
            curve.append(round(replicas.eval_global(), 4))
    row = {"arm": name, "groups": groups, "eval_loss": curve[-1],
           "curve": curve, "seconds": round(time.time() - started, 1)}
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--islands", type=int, default=8)
    parser.add_argument("--groups", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--periods", type=int, default=10, help="outer periods (each island's rounds)")
    parser.add_argument("--inner-steps", type=int, default=16, help="inner steps per period (H)")
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arms", nargs="+", default=None, metavar="ARM",
                        help="run only these arms (one-group, turns-G-scaled, turns-G-momentum, turns-G-delayed)")
    parser.add_argument("--out", default="runs/experiments/e9-group-turns.json")
    args = parser.parse_args()
    if any(g < 2 or args.islands % g or args.inner_steps % g for g in args.groups):
        parser.error("every --groups G must be at least 2 and divide --islands and --inner-steps")
    torch.set_num_threads(2)
    arms = [("one-group", 1)] + [(f"turns-{g}-{kind}", g) for g in args.groups for kind in ("scaled", "momentum", "delayed")]
    unknown = set(args.arms or ()) - {name for name, _ in arms}
    if unknown:
        parser.error(f"unknown arm(s) {', '.join(sorted(unknown))}; this run has {', '.join(name for name, _ in arms)}")
    rows = [run_arm(name, g, args) for name, g in arms if not args.arms or name in args.arms]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print("| arm | eval loss | vs one group |\n|---|---|---|")
    for row in rows:
        print(f"| {row['arm']} | {row['eval_loss']:.3f} | {row['eval_loss'] / rows[0]['eval_loss']:.3f}x |"
              if rows[0]["arm"] == "one-group" else f"| {row['arm']} | {row['eval_loss']:.3f} | - |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
