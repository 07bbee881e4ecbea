"""Command-line plumbing shared by the experiment scripts (the logic is in p2p_diloco/experiment.py)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from p2p_diloco.lab.experiment import Arm, run_experiment, run_script  # noqa: E402


def select_arms(parser: argparse.ArgumentParser, arms: Sequence[Arm], names) -> list[Arm]:
    """The arms named on the command line (``--arms``; all when None), in the experiment's order; an
    unknown name is a parser error that lists the experiment's arms."""
    if not names:
        return list(arms)
    unknown = sorted(set(names) - {arm.name for arm in arms})
    if unknown:
        parser.error(f"unknown arm(s) {', '.join(unknown)}; this experiment has {', '.join(a.name for a in arms)}")
    return [arm for arm in arms if arm.name in names]


def main(name: str, title: str, build: Callable[[int], Sequence[Arm]], default_steps: int, doc: str) -> int:
    """Parse ``--steps`` (inner steps per island, the token budget) and ``--out``, then run the arms."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=default_steps, help=f"inner steps per island (default {default_steps})")
    parser.add_argument("--out", default="", help="output folder (default runs/experiments/<name>-<time>)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one arm may take")
    parser.add_argument("--arms", nargs="+", default=None, metavar="ARM", help="run only these arms (by name)")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    arms = select_arms(parser, list(build(args.steps)), args.arms)
    out = Path(args.out or f"runs/experiments/{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    return run_script(lambda: run_experiment(name, title, arms, out, timeout=args.timeout))
