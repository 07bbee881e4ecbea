"""Faults injected into an island by the lab, never reachable from the product's ``p2p-diloco peer``:
a slower (or jittering) device, a faulty island that sends NaN, Inf or 1e30 pseudo-gradients
(for good, or toggled by SIGUSR2), an attacker whose pseudo-gradients stay within the protocol's
bounds (docs/SECURITY.md: inflated weights, sign flips at the bound, noise, a small consistent bias,
stale replays), a slow donor (so chaos runs can kill it mid-download), and a synthetic learner
that skips training (lightweight islands for swarm-scale runs, docs/SCALE.md).

``python -m p2p_diloco.lab.faults peer ...`` is ``p2p-diloco peer ...`` with the ``[debug]`` flags of
:class:`LabPeerConfig`; it runs the product's island, assembled by :class:`FaultyIslandBuilder`, which
swaps in subclasses of the parts the product designed for it (the learner's ``pace``, the round
format's ``encode``, the state transfer's ``before_serving``). Local swarms start islands this way
only when a fault is asked for (:class:`p2p_diloco.lab.localswarm.LocalSwarm`).
"""

from __future__ import annotations

import logging
import math
import queue
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, fields
from typing import Literal, Sequence

import torch
from pydantic import Field, model_validator

from p2p_diloco.algo import outer, wire
from p2p_diloco.config import PeerConfig, _Section
from p2p_diloco.net.reducer import MergeRule
from p2p_diloco.island.contribution import WEIGHT_UNIT, Contribution, RoundFormat
from p2p_diloco.island.learner import Learner
from p2p_diloco.island.builder import IslandBuilder
from p2p_diloco.island.transfer import StateTransfer

logger = logging.getLogger(__name__)

GARBAGE = {"nan": float("nan"), "inf": float("inf"), "huge": 1e30}
# attacks that stay within the protocol's bounds (AttackingFormat)
ATTACKS = ("inflate", "flip", "noise", "bias", "replay", "lying_reducer")
INFLATION = 1e6  # "inflate": the weight claimed, times the honest one
NOISE_SCALE = 10.0  # "noise": Gaussian noise of this many standard deviations of the honest update
BIAS_SCALE = 1.0  # "bias": a fixed direction of this many standard deviations of the honest update


class DebugConfig(_Section):
    """Testing only: faults the lab injects into this island."""

    corrupt_outer: Literal["", "nan", "inf", "huge"] = Field(
        "", description="send NaN, Inf or 1e30 pseudo-gradients, as a faulty island would"
    )
    corrupt_on_signal: bool = Field(
        False, description="with --debug-corrupt-outer or --debug-attack, misbehave only between SIGUSR2s (the "
        "first turns the island faulty, the next one heals it, and so on)",
    )
    attack: str = Field(
        "", description="send pseudo-gradients within the protocol's bounds that hurt the swarm: one or more of "
        + ", ".join(ATTACKS) + " joined by '+' (e.g. flip+inflate; docs/SECURITY.md)",
    )
    donate_delay: float = Field(
        0.0, ge=0.0, le=10.0, description="seconds a donor waits before serving a state download (a slow donor; "
        "chaos runs kill it meanwhile)",
    )
    slowdown: float = Field(1.0, ge=1.0, description="simulate a slower device: each inner step takes this many "
                            "times longer", json_schema_extra={"flags": ["--slowdown"]})
    slowdown_jitter: float = Field(
        0.0, ge=0.0, lt=1.0, description="vary each step's slowdown uniformly by this fraction (a device whose "
        "speed jitters; steps never get faster than the device)", json_schema_extra={"flags": ["--slowdown-jitter"]},
    )

    synthetic_step_s: float = Field(
        0.0, ge=0.0, le=60.0, description="skip training: each inner step waits this many seconds and moves the "
        "parameters by a synthetic update of the model's size instead (a lightweight island for swarm-scale runs: "
        "the real DHT, syncer and averagers; 0: train)",
    )

    @model_validator(mode="after")
    def _check_signal(self) -> "DebugConfig":
        if self.synthetic_step_s > 0 and (self.slowdown > 1.0 or self.slowdown_jitter > 0):
            raise ValueError("debug.synthetic_step_s sets the step time itself: drop --slowdown and --slowdown-jitter")
        if self.corrupt_on_signal and not (self.corrupt_outer or self.attack):
            raise ValueError("debug.corrupt_on_signal needs debug.corrupt_outer or debug.attack (what to send once "
                             "faulty)")
        if self.corrupt_on_signal and "lying_reducer" in self.attacks:
            raise ValueError("debug.corrupt_on_signal: a lying reducer cannot be toggled (its merge rule is set at start)")
        unknown = [kind for kind in self.attacks if kind not in ATTACKS]
        if unknown:
            raise ValueError(f"debug.attack: unknown {', '.join(unknown)}; use {', '.join(ATTACKS)} joined by '+'")
        if "lying_reducer" in self.attacks and len(self.attacks) > 1:
            raise ValueError("debug.attack: lying_reducer cannot be combined with other attacks")
        return self

    @property
    def attacks(self) -> list[str]:
        """The attacks asked for (``debug.attack`` split at '+')."""
        return [kind for kind in self.attack.split("+") if kind]

    @property
    def any(self) -> bool:
        """Whether any fault is asked for."""
        return self != DebugConfig()


class LabPeerConfig(PeerConfig):
    """An island's configuration with the lab's faults (``[debug]``)."""

    debug: DebugConfig = Field(default_factory=DebugConfig)


class SlowLearner(Learner):
    """A learner on a slower device: each inner step is stretched to ``slowdown`` (drawn from
    slowdown x (1 +- jitter) per step, never below 1) times its compute time."""

    def __init__(self, *, slowdown: float, jitter: float, **kwargs):
        super().__init__(**kwargs)
        self.slowdown, self.jitter, self._rng = slowdown, jitter, random.Random()
        self._pause = threading.Event()  # never set

    def pace(self, compute_seconds: float) -> None:
        stretch = self.slowdown
        if self.jitter > 0:
            stretch *= 1.0 + self._rng.uniform(-self.jitter, self.jitter)
        if stretch > 1.0:  # (an Event's wait: under libfaketime, time.sleep fails with EINVAL)
            self._pause.wait((stretch - 1.0) * compute_seconds)


SYNTHETIC_STEP = 1e-4  # a synthetic inner step's shared direction, per element (its noise: half as large)
SYNTHETIC_SEED = 18  # the shared direction's seed: every island's updates agree, as real ones roughly do
NOISE_DRAWS = 4  # noise draws per island, one picked at random per step


class SyntheticLearner(Learner):
    """A learner that skips the forward and backward pass: each inner step reads its batches (the
    tokens count as trained), adds ``SYNTHETIC_STEP`` x a direction shared by every island plus
    noise of its own to every parameter, and waits ``step_s`` seconds. Its pseudo-gradients have the
    model's real size and agree across islands (cosine about 0.9), so rounds, checks and outlier
    detection see honest members; its losses are the uniform model's, ln(vocabulary)."""

    def __init__(self, *, step_s: float, **kwargs):
        super().__init__(**kwargs)
        if self.ranks is not None:
            raise ValueError("a synthetic learner runs on one rank")
        self.step_s = step_s
        shared = torch.Generator().manual_seed(SYNTHETIC_SEED)
        params = list(self.model.parameters())
        self._direction = [SYNTHETIC_STEP * torch.randn(p.shape, generator=shared).to(p.device) for p in params]
        # a few noise draws, one picked per step: drawing a model's worth of normals every step cost
        # each lightweight island a tenth of a core of its own
        noise = torch.Generator().manual_seed(random.randrange(2**31))
        self._noises = [[SYNTHETIC_STEP / 2 * torch.randn(p.shape, generator=noise).to(p.device) for p in params]
                        for _ in range(NOISE_DRAWS)]
        self._pick = random.Random(random.randrange(2**31))
        self._loss_value = math.log(self.model.get_output_embeddings().weight.shape[0])
        self._pause = threading.Event()  # never set

    def _optimize(self) -> tuple[float, int]:
        tokens = 0
        for _ in range(self.grad_accum_steps):
            batch = self.next_batch()  # (B, T+1)
            tokens += batch.size(0) * (batch.size(1) - 1)
        noises = self._noises[self._pick.randrange(NOISE_DRAWS)]
        with torch.no_grad():
            for param, direction, noise in zip(self.model.parameters(), self._direction, noises):
                param.add_(direction).add_(noise)
        self._pause.wait(self.step_s)  # (an Event's wait: under libfaketime, time.sleep fails with EINVAL)
        return self._loss_value, tokens

    def evaluate(self) -> float:
        return self._record_eval(self._loss_value, 0.0)


class Garbage:
    """What a faulty island sends (a garbage value, or the attacks it makes), shared by its fragments'
    formats; SIGUSR2 may toggle it."""

    def __init__(self, value: str, faulty: bool):
        self.value, self.faulty = value, faulty


class CorruptingFormat(RoundFormat):
    """A round format that, while ``garbage.faulty``, overwrites what goes on the wire with NaN, Inf
    or 1e30 (its metadata then honestly reports it, as a buggy island's would)."""

    def __init__(self, *args, garbage: Garbage, **kwargs):
        super().__init__(*args, **kwargs)
        self.garbage = garbage

    def encode(self, values: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]) -> None:
        super().encode(values, buffers)
        if self.garbage.faulty:  # read once per round: SIGUSR2 may toggle it meanwhile
            for buffer in buffers:
                buffer.fill_(GARBAGE[self.garbage.value])


class AttackingFormat(RoundFormat):
    """A round format whose member attacks the swarm with values every check lets through: each
    element within +-max_delta, the metadata true to what is sent. ``attacks`` (applied in order):

    - ``inflate``: claims INFLATION x its weight (a token count sqrt(INFLATION) x its own, the weight
      consistent with it: what the swarm cannot check);
    - ``flip``: sends -max_delta * sign(Delta), the honest update reversed and pushed to the bound;
    - ``noise``: adds Gaussian noise of NOISE_SCALE standard deviations of its update;
    - ``bias``: adds BIAS_SCALE standard deviations along one fixed random direction, every round
      (small and consistent: "A Little Is Enough", Baruch et al., arXiv 1902.06156);
    - ``replay``: sends its first update again in every later round (a stale contribution).

    (``lying_reducer``, the attack on the parts it reduces, is :class:`LyingReducerFormat`.)
    """

    def __init__(self, *args, attacks: Sequence[str], seed: int = 0, active: Garbage | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.attacks, self._first, self.active = list(attacks), None, active
        self._rng = torch.Generator().manual_seed(seed)
        self._direction = [torch.sign(torch.randn(s, generator=self._rng)) for s in self.shapes]

    def contribution(self, delta, tokens: int, steps: int):
        honest = super().contribution(delta, tokens, steps)  # clipped in place
        if self.active is not None and not self.active.faulty:  # toggled off by SIGUSR2 (chaos runs)
            return honest
        attacked = [d.clone() for d in honest.delta]
        for kind in self.attacks:
            if kind == "flip":
                attacked = [-self.max_delta * torch.sign(d) for d in attacked]
            elif kind == "noise":
                attacked = [d + NOISE_SCALE * float(d.std()) * torch.randn(d.shape, generator=self._rng) for d in attacked]
            elif kind == "bias":
                attacked = [d + BIAS_SCALE * float(d.std()) * s for d, s in zip(attacked, self._direction)]
            elif kind == "replay":
                self._first = self._first or [d.clone() for d in attacked]
                attacked = [d.clone() for d in self._first]
        attacked = [d.clamp(-self.max_delta, self.max_delta) for d in attacked]
        values, norms = outer.wire_values(attacked, self.rda)
        # "inflate" claims INFLATION x the weight, consistently: sqrt(INFLATION) x the tokens
        claimed = int(round(tokens * math.sqrt(INFLATION))) if "inflate" in self.attacks else tokens
        return Contribution(attacked, values, norms, outer.token_weight(claimed, steps) / WEIGHT_UNIT, honest.clipped,
                            claimed, steps)


@dataclass(frozen=True)
class LyingMergeRule(MergeRule):
    """A reducer that returns every part it reduces reversed: ``2 C - A`` on the fp32 wire, whose
    values are ``C + Delta`` (:func:`p2p_diloco.algo.wire.encode_for_wire`), so the members apply
    ``-mean(Delta)`` there. Within the bounds, the same on every member (no check of the result's
    range can catch it). Plain fp32 rounds with the mean merge only (``offset`` is C)."""

    offset: float = 0.0

    def finish(self, merged: torch.Tensor) -> torch.Tensor:
        return (2.0 * self.offset - merged.to(torch.float64)).to(torch.float32)


class LyingReducerFormat(RoundFormat):
    """A round format whose member is honest in what it sends and lies as a reducer (:class:`LyingMergeRule`)."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        if self.levels or any(self.rda):
            raise ValueError("the lab's lying reducer needs --outer-codec none and --outer-merge mean")
        self.merge_rule = LyingMergeRule(**{f.name: getattr(self.merge_rule, f.name) for f in fields(MergeRule)},
                                         offset=wire.wire_offset(config.max_delta))


class SlowDonorTransfer(StateTransfer):
    """A donor that waits ``delay`` seconds (within the downloader's patience) before serving."""

    def __init__(self, *args, delay: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.delay = delay

    def before_serving(self, p: int, budget: float) -> None:
        delay = min(self.delay, budget)
        time.sleep(delay)
        super().before_serving(p, budget - delay)


class FaultyIslandBuilder(IslandBuilder):
    """Assembles the product's island with the faults of ``config.debug`` (a :class:`LabPeerConfig`)."""

    def __init__(self, config: LabPeerConfig, stop):
        super().__init__(config, stop)
        self._events = None  # the island's event log, once built
        debug = config.debug
        what = debug.corrupt_outer or debug.attack
        self.garbage = Garbage(what, bool(what) and not debug.corrupt_on_signal)
        if what and debug.corrupt_on_signal:
            self._toggle_on_signal()
        elif debug.corrupt_outer:
            logger.warning("testing mode: this island sends %s pseudo-gradients", debug.corrupt_outer)
        elif debug.attacks:
            logger.warning("testing mode: this island attacks the swarm (%s)", debug.attack)

    def learner(self, **kwargs) -> Learner:
        debug = self.config.debug
        if debug.synthetic_step_s > 0:
            return SyntheticLearner(step_s=debug.synthetic_step_s, **kwargs)
        if debug.slowdown > 1.0 or debug.slowdown_jitter > 0:
            return SlowLearner(slowdown=debug.slowdown, jitter=debug.slowdown_jitter, **kwargs)
        return super().learner(**kwargs)

    def round_format(self, config, names, shapes) -> RoundFormat:
        if self.config.debug.corrupt_outer:
            return CorruptingFormat(config, names, shapes, garbage=self.garbage)
        attacks = self.config.debug.attacks
        if attacks == ["lying_reducer"]:
            return LyingReducerFormat(config, names, shapes)
        if attacks:
            return AttackingFormat(config, names, shapes, attacks=attacks, active=self.garbage)
        return super().round_format(config, names, shapes)

    def state_transfer(self, store, stats, **kwargs) -> StateTransfer:
        if self.config.debug.donate_delay > 0:
            return SlowDonorTransfer(store, stats, delay=self.config.debug.donate_delay, **kwargs)
        return super().state_transfer(store, stats, **kwargs)

    def build(self):
        island = super().build()
        self._events = island.events
        return island

    def _toggle_on_signal(self) -> None:
        """SIGUSR2 turns the island faulty, or healthy again (installed before the island starts, so
        before its ``start`` event, which chaos runs wait for). The note is logged by a thread of its
        own: in the handler, the main thread may hold the event log's or the logging module's lock."""
        notes: queue.SimpleQueue = queue.SimpleQueue()

        def toggle(_signum, _frame) -> None:
            self.garbage.faulty = not self.garbage.faulty
            notes.put({"event": "corrupt", "value": self.garbage.value if self.garbage.faulty else ""})

        def log() -> None:
            while True:
                note = notes.get()
                if self._events is not None:
                    self._events(note)
                logger.warning("testing mode: this island now sends %s pseudo-gradients", note["value"] or "honest")

        threading.Thread(target=log, name="corrupt-notes", daemon=True).start()
        signal.signal(signal.SIGUSR2, toggle)
        logger.warning("testing mode: SIGUSR2 makes this island send %s pseudo-gradients", self.garbage.value)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m p2p_diloco.lab.faults peer ...``: an island with the lab's faults."""
    from p2p_diloco.cli import run

    run(argv, peer_config=LabPeerConfig, builder=FaultyIslandBuilder, entry="p2p_diloco.lab.faults")


if __name__ == "__main__":
    main(sys.argv[1:])
