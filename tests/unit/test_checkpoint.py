"""Checkpoints: exact round trip, atomic files, corruption and truncation detected, old ones pruned."""

import os
import threading

import numpy as np
import pytest
import torch

from p2p_diloco.island import checkpoint as ckpt
from p2p_diloco.config import InnerConfig
from p2p_diloco.island.data import BatchSampler
from p2p_diloco.algo.fragments import balanced_layout
from p2p_diloco.island.learner import Learner
from p2p_diloco.island.model import ModelSpec, build_model
from p2p_diloco.algo.outer import tensors_hash

SPEC = ModelSpec(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, vocab_size=64, seq_len=8,
                 batch_size=2)


def _learner(steps=3):
    model = build_model(SPEC, 64, seed=0)
    layout = balanced_layout([(n, p.numel()) for n, p in model.named_parameters()], 2)
    sampler = BatchSampler(np.arange(1000) % 64, 2, 8, seed=0, island="t")
    learner = Learner(model=model, layout=layout, next_batch=sampler.next_batch, eval_data=[sampler.next_batch()],
                      device=torch.device("cpu"), inner=InnerConfig(warmup_steps=5))
    learner.run(threading.Event(), max_steps=steps, eval_every=1e9)
    return learner


def _checkpoint(learner, version=4):
    inner = learner.capture()
    fragments = []
    for params in learner.fragment_params:
        theta = [p.detach().clone() for p in params]
        fragments.append(ckpt.GlobalFragment(theta, [t * 0.1 for t in theta], version, tensors_hash(theta), 2))
    return ckpt.IslandCheckpoint("fp", "isl", fragments, inner["params"], inner["optimizer"], inner["scheduler"],
                                 inner["meta"] | {"sampler": {"x": 1}})


def test_round_trip_restores_a_learner_exactly(tmp_path):
    source = _learner()
    path = ckpt.save_checkpoint(tmp_path, _checkpoint(source))
    loaded = ckpt.load_checkpoint(path, fingerprint="fp")
    assert [f.version for f in loaded.fragments] == [4, 4] and loaded.meta["sampler"] == {"x": 1}
    target = _learner(steps=1)
    target.restore(loaded.params, loaded.optimizer, loaded.scheduler, loaded.meta)
    assert target.stats.inner_steps == 3 and target.boundary.marks == source.boundary.marks
    for (name, a), b in zip(source.model.named_parameters(), target.model.parameters()):
        assert torch.equal(a, b), name
    # both continue identically: same moments, same step counts, same learning rate
    fixed = source.next_batch()
    source.next_batch = target.next_batch = lambda: fixed
    source.train_step(), target.train_step()
    for a, b in zip(source.model.parameters(), target.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert source.optimizer.param_groups[0]["lr"] == target.optimizer.param_groups[0]["lr"]
    assert source.scheduler.last_epoch == target.scheduler.last_epoch == 4


def test_a_resumed_learner_takes_this_runs_inner_settings(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, _checkpoint(_learner()))
    loaded = ckpt.load_checkpoint(path)
    model = build_model(SPEC, 64, seed=0)
    layout = balanced_layout([(n, p.numel()) for n, p in model.named_parameters()], 2)
    target = Learner(model=model, layout=layout, next_batch=lambda: None, eval_data=[], device=torch.device("cpu"),
                     inner=InnerConfig(warmup_steps=5, lr=1e-3, weight_decay=0.0))
    target.restore(loaded.params, loaded.optimizer, loaded.scheduler, loaded.meta)
    group = target.optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(1e-3 * 4 / 5) and group["weight_decay"] == 0.0  # step 3 of a 5-step warm-up
    assert target.scheduler.base_lrs == [1e-3, 1e-3]
    assert int(target.optimizer.state[next(model.parameters())]["step"]) == 3


def test_no_partial_file_and_old_ones_pruned(tmp_path):
    learner = _learner()
    paths = [ckpt.save_checkpoint(tmp_path, _checkpoint(learner, version=v), keep=2) for v in range(4)]
    assert ckpt.list_checkpoints(tmp_path) == paths[:1:-1]  # the two newest, newest first
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_corrupted_and_truncated_files_are_skipped_for_the_previous_one(tmp_path, caplog):
    learner = _learner()
    good = ckpt.save_checkpoint(tmp_path, _checkpoint(learner, version=1))
    flipped = ckpt.save_checkpoint(tmp_path, _checkpoint(learner, version=2))
    raw = bytearray(flipped.read_bytes())
    raw[-3] ^= 0xFF  # a bit flip inside the last tensor
    flipped.write_bytes(bytes(raw))
    with pytest.raises(ckpt.CheckpointError, match="corrupted"):
        ckpt.load_checkpoint(flipped)
    truncated = ckpt.save_checkpoint(tmp_path, _checkpoint(learner, version=3))
    truncated.write_bytes(truncated.read_bytes()[:-100])
    with pytest.raises(ckpt.CheckpointError, match="unreadable or truncated"):
        ckpt.load_checkpoint(truncated)
    loaded, path = ckpt.load_newest(tmp_path, fingerprint="fp")
    assert path == good and loaded.fragments[0].version == 1
    assert "skipping checkpoint" in caplog.text


def test_a_checkpoint_of_another_run_is_refused(tmp_path):
    ckpt.save_checkpoint(tmp_path, _checkpoint(_learner()))
    with pytest.raises(ckpt.CheckpointMismatch, match="fingerprint"):
        ckpt.load_newest(tmp_path, fingerprint="other")
    assert ckpt.load_newest(tmp_path / "empty", fingerprint="fp") == (None, None)
