"""The lab's lightweight islands and swarm-scale figures (p2p_diloco/lab/faults.py SyntheticLearner,
p2p_diloco/lab/scale.py), without a network."""

import math

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from p2p_diloco.algo.fragments import balanced_layout
from p2p_diloco.config import InnerConfig
from p2p_diloco.island.data import BatchSampler
from p2p_diloco.island.model import ModelSpec, build_model
from p2p_diloco.lab.faults import SYNTHETIC_STEP, DebugConfig, SyntheticLearner
from p2p_diloco.lab.scale import island_flags, parse_args, round_figures

SPEC = ModelSpec(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, vocab_size=64, seq_len=8,
                 batch_size=2)


def _synthetic(seed: int = 0) -> SyntheticLearner:
    model = build_model(SPEC, 64, seed=0)
    layout = balanced_layout([(n, p.numel()) for n, p in model.named_parameters()], 2)
    sampler = BatchSampler(np.arange(1000) % 64, 2, 8, seed=seed, island=f"t{seed}")
    return SyntheticLearner(step_s=0.0, model=model, layout=layout, next_batch=sampler.next_batch,
                            eval_data=[sampler.next_batch()], device=torch.device("cpu"),
                            inner=InnerConfig(warmup_steps=0))


def test_a_synthetic_step_counts_its_tokens_and_moves_every_island_the_same_way_without_gradients():
    first, second = _synthetic(0), _synthetic(1)
    start = [p.detach().clone() for p in first.model.parameters()]
    for learner in (first, second):
        for _ in range(4):
            learner.train_step()
    assert first.stats.inner_steps == 4 and first.stats.tokens == 4 * 2 * 8
    assert first.stats.loss == pytest.approx(math.log(64))  # the uniform model's loss over 64 tokens
    assert all(p.grad is None for p in first.model.parameters())  # no backward pass
    moved = [torch.cat([(p.detach() - s).flatten() for p, s in zip(learner.model.parameters(), start)])
             for learner in (first, second)]
    # 4 steps of the shared direction (1e-4 per element per step) plus each island's own noise (half as large)
    assert moved[0].std().item() == pytest.approx(4 * SYNTHETIC_STEP * math.sqrt(1 + 0.25 / 4), rel=0.1)
    assert torch.nn.functional.cosine_similarity(moved[0], moved[1], dim=0).item() > 0.85
    assert first.evaluate() == pytest.approx(math.log(64))


def test_a_synthetic_step_sets_its_own_time():
    with pytest.raises(ValidationError, match="drop --slowdown"):
        DebugConfig(synthetic_step_s=1.0, slowdown=2.0)


def _round(island, slot, outcome="ok", size=3, formed=0.2, merged=1.0, new_hash="a"):
    return {"event": "round", "fragment": 0, "slot": slot, "slot_time": 100.0 + 10 * slot, "outcome": outcome,
            "group_size": size, "t_formed": 100.0 + 10 * slot + formed, "t_merged": 100.0 + 10 * slot + merged,
            "new_hash": new_hash, "island": island}


def test_round_figures_count_the_window_and_the_states_each_slot_ended_with():
    events = {"a": [_round("a", 0), _round("a", 1), _round("a", 2, new_hash="b"), _round("a", 9)],
              "b": [_round("b", 0), _round("b", 1, outcome="fallback"), _round("b", 2, new_hash="c", merged=3.0)]}
    figures = round_figures(events, start=100.0, end=125.0, period=20.0, fragments=2)  # slots 0, 1, 2
    assert figures["outcomes"] == {"ok": 5, "fallback": 1} and figures["slots"] == 3
    assert figures["round_s"]["max"] == 3.0 and figures["round_share"]["max"] == pytest.approx(0.3)
    assert figures["formation_s"]["median"] == pytest.approx(0.2)
    # slot 0: both ended on "a"; slot 1: one ok round; slot 2: "b" and "c" (two groups, or forked bases)
    assert figures["states_per_slot"]["max"] == 2 and figures["states_per_slot"]["median"] == 1


def test_the_fork_hook_freezes_the_collectors_objects_when_asked(monkeypatch):
    import gc

    from p2p_diloco import procs

    gc.unfreeze()
    try:
        procs._before_fork()  # (what os.fork runs first once install_child_hooks registered it)
        assert gc.get_freeze_count() == 0  # not by default
        monkeypatch.setenv("P2P_DILOCO_GC_FREEZE", "1")
        procs._before_fork()
        assert gc.get_freeze_count() > 0  # a forked child's collections leave the parent's objects alone
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("flags", [["--islands", "4", "--client-islands", "4"], ["--client-islands", "-1"],
                                   ["--period", "4", "--matchmaking-time", "3"], ["--islands", "1"],
                                   ["--period", "8", "--groups", "2", "--matchmaking-time", "3"], ["--groups", "0"]])
def test_scale_flags_that_cannot_make_a_swarm_exit_2(flags, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(flags)
    assert exit_.value.code == 2 and "error:" in capsys.readouterr().err


def test_the_all_reduce_timeout_fits_the_period_and_no_island_is_client_mode_by_default():
    args = parse_args(["--islands", "16", "--client-islands", "12", "--period", "8", "--matchmaking-time", "2"])
    flags = island_flags(args)
    assert flags[flags.index("--outer-allreduce-timeout") + 1] == "4.5"  # 8 - 2 - 1.5 s
    assert parse_args([]).client_islands == 0
    # two groups taking turns: a slot every 6 s of a 12 s period
    flags = island_flags(parse_args(["--period", "12", "--groups", "2", "--matchmaking-time", "2"]))
    assert flags[flags.index("--outer-groups") + 1] == "2"
    assert flags[flags.index("--outer-allreduce-timeout") + 1] == "2.5"  # 6 - 2 - 1.5 s
