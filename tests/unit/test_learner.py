"""The learner's step-boundary handshake with the syncer (no network)."""

import threading

import numpy as np
import pytest
import torch

from p2p_diloco.config import InnerConfig
from p2p_diloco.island.data import BatchSampler
from p2p_diloco.algo.fragments import balanced_layout
from p2p_diloco.island.learner import Learner, lr_factor
from p2p_diloco.island.model import ModelSpec, build_model
from p2p_diloco.algo.handoff import OuterUpdate

SPEC = ModelSpec(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, vocab_size=64, seq_len=8,
                 batch_size=2)


def _learner(inner=InnerConfig(warmup_steps=0)):
    model = build_model(SPEC, 64, seed=0)
    layout = balanced_layout([(n, p.numel()) for n, p in model.named_parameters()], 2)
    sampler = BatchSampler(np.arange(1000) % 64, 2, 8, seed=0, island="t")
    return Learner(model=model, layout=layout, next_batch=sampler.next_batch, eval_data=[sampler.next_batch()],
                   device=torch.device("cpu"), inner=inner)


def _request_in_background(learner, fragment, timeout=5.0):
    result = {}
    thread = threading.Thread(target=lambda: result.update(snap=learner.request_snapshot(fragment, timeout)))
    thread.start()
    return thread, result


def test_snapshot_copies_the_fragment_and_resets_its_counters():
    learner = _learner()
    for _ in range(3):
        learner.train_step()
    thread, result = _request_in_background(learner, 1)
    while not learner.boundary._requests.qsize():
        pass
    learner.service()
    thread.join()
    snap = result["snap"]
    assert snap.fragment == 1 and snap.steps == 3 and snap.tokens == 3 * 2 * 8
    for copy, param in zip(snap.params, learner.fragment_params[1]):
        assert torch.equal(copy, param) and copy.data_ptr() != param.data_ptr()
    assert learner.boundary.marks == [(0, 0), (3 * 2 * 8, 3)]  # fragment 0 was not copied: its counters run on


def test_late_or_closed_requests_return_none_and_keep_counters():
    learner = _learner()
    learner.train_step()
    assert learner.request_snapshot(0, timeout=0.05) is None  # nobody served it in time
    learner.service()  # the cancelled request is skipped
    assert learner.boundary.marks == [(0, 0), (0, 0)]
    learner.close()
    assert learner.request_snapshot(0, timeout=1.0) is None


def test_updates_carry_mix_and_replace():
    learner = _learner()
    params = learner.fragment_params[0]
    before = [p.detach().clone() for p in params]
    base = [t - 0.5 for t in before]
    new_global = [torch.full_like(t, 2.0) for t in before]
    learner.deliver(OuterUpdate(0, "carry", [n - b for n, b in zip(new_global, base)], 0.0, 1, "round"))
    learner.service()
    for param, old in zip(params, before):  # Theta_new + (theta - base) = 2 + 0.5
        torch.testing.assert_close(param.detach(), torch.full_like(old, 2.5))
    learner.deliver(OuterUpdate(0, "mix", new_global, 0.5, 2, "round"))
    learner.service()
    for param in params:
        torch.testing.assert_close(param.detach(), torch.full_like(param, 2.25))
    learner.deliver(OuterUpdate(0, "replace", [torch.zeros_like(t) for t in before], 0.0, 3, "reload"))
    learner.service()
    assert all(torch.equal(p.detach(), torch.zeros_like(p)) for p in params)
    assert learner.stats.updates_applied == 3


def test_training_lowers_the_loss_and_times_the_steps():
    learner = _learner()
    first = learner.evaluate()
    stop = threading.Event()
    assert learner.run(stop, max_steps=60, eval_every=1e9) == "max_steps"
    assert learner.evaluate() < first
    assert 0.0 < learner.stats.utilization <= 1.0 and learner.stats.inner_steps == 60


def test_tokens_per_second_is_known_after_the_first_step():
    learner = _learner()
    assert learner.tokens_per_second() == 0.0
    learner.train_step()
    first = learner.tokens_per_second()
    assert 0.0 < first < float("inf")
    learner.train_step()
    assert learner.tokens_per_second() > 0.0 and learner.stats.tokens == 2 * 2 * 8


def test_gradient_accumulation_gives_the_update_of_the_larger_batch():
    """3 micro-batches of 2 sequences, accumulated, give the gradient and the AdamW step of one batch
    of those 6 (fp32; they differ by rounding only). Without the clip, so that a wrong scale of the
    summed gradient shows (AdamW's first steps hardly depend on it)."""
    torch.manual_seed(0)
    batches = [torch.randint(0, 64, (2, 9)) for _ in range(6)]

    def learner(accum, next_batch):
        model = build_model(SPEC, 64, seed=0)
        layout = balanced_layout([(n, p.numel()) for n, p in model.named_parameters()], 2)
        learner = Learner(model=model, layout=layout, next_batch=next_batch, eval_data=[batches[0]],
                          device=torch.device("cpu"),
                          inner=InnerConfig(warmup_steps=0, grad_clip=0.0, grad_accum_steps=accum))
        learner.grads = []
        step = learner.optimizer.step

        def step_recording_grads(*args, **kwargs):
            learner.grads.append([p.grad.clone() for p in model.parameters()])
            return step(*args, **kwargs)

        learner.optimizer.step = step_recording_grads
        return learner

    small = iter(batches)
    accumulated = learner(3, lambda: next(small))
    large = iter([torch.cat(batches[i:i + 3]) for i in (0, 3)])
    whole = learner(1, lambda: next(large))
    for _ in range(2):
        loss_accumulated, loss_whole = accumulated.train_step(), whole.train_step()
        assert loss_accumulated == pytest.approx(loss_whole, rel=1e-5)
    assert accumulated.stats.tokens == whole.stats.tokens == 2 * 6 * 8 and accumulated.stats.inner_steps == 2
    for grads_accumulated, grads_whole in zip(accumulated.grads, whole.grads, strict=True):
        for a, b in zip(grads_accumulated, grads_whole):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    assert any(float(g.abs().max()) > 1e-3 for g in whole.grads[0])  # (gradients worth comparing)
    for a, b in zip(accumulated.model.parameters(), whole.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_updates_wait_for_their_overlap_step_unless_forced():
    learner = _learner()
    learner.train_step()
    params = learner.fragment_params[0]
    before = [p.detach().clone() for p in params]
    ones = [torch.ones_like(p) for p in params]
    learner.deliver(OuterUpdate(0, "carry", ones, 0.0, 1, "ok", not_before_step=3))  # snapshot at step 1, tau 2
    learner.deliver(OuterUpdate(0, "carry", ones, 0.0, 2, "ok"))  # queued behind it: order is kept
    learner.service()
    assert learner.stats.updates_applied == 0 and all(torch.equal(p, b) for p, b in zip(params, before))
    learner.train_step()
    learner.train_step()  # step 3
    learner.service()
    assert learner.stats.updates_applied == 2
    learner.deliver(OuterUpdate(0, "carry", ones, 0.0, 3, "ok", not_before_step=100))
    learner.apply_updates(force=True)  # snapshots and checkpoints see every delivered update
    assert learner.stats.updates_applied == 3


def test_a_snapshot_forces_only_its_own_fragments_held_updates():
    learner = _learner()
    learner.train_step()
    ones = [[torch.ones_like(p) for p in params] for params in learner.fragment_params]
    learner.deliver(OuterUpdate(0, "carry", ones[0], 0.0, 1, "ok", not_before_step=50))
    learner.deliver(OuterUpdate(1, "carry", ones[1], 0.0, 1, "ok", not_before_step=50))
    learner.deliver(OuterUpdate(1, "replace", [torch.zeros_like(p) for p in learner.fragment_params[1]], 0.0, 1,
                                "reload"))  # behind fragment 1's held update: waits with it
    learner.apply_updates()
    assert learner.stats.updates_applied == 0
    learner.boundary.apply_updates(fragment=1)  # a snapshot of fragment 1 is asked for
    assert learner.stats.updates_applied == 2 and len(learner.boundary._held) == 1
    assert all(torch.equal(p.detach(), torch.zeros_like(p)) for p in learner.fragment_params[1])


def test_lr_factor_warms_up_then_holds_or_decays_by_cosine():
    constant = InnerConfig(warmup_steps=10)
    assert [lr_factor(constant, s) for s in (0, 4, 9, 10, 10_000)] == [0.1, 0.5, 1.0, 1.0, 1.0]
    cosine = InnerConfig(warmup_steps=10, schedule="cosine", decay_steps=110, min_lr_ratio=0.2)
    assert lr_factor(cosine, 9) == 1.0 and lr_factor(cosine, 10) == 1.0
    assert lr_factor(cosine, 60) == pytest.approx(0.6)  # halfway: (1 + 0.2) / 2
    assert lr_factor(cosine, 110) == pytest.approx(0.2) and lr_factor(cosine, 500) == pytest.approx(0.2)
    factors = [lr_factor(cosine, s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(factors, factors[1:]))
    with pytest.raises(ValueError, match="decay_steps"):
        lr_factor(InnerConfig(warmup_steps=0, schedule="cosine"), 5)
    learner = _learner(InnerConfig(warmup_steps=0, schedule="cosine", decay_steps=4, min_lr_ratio=0.5))
    stop = threading.Event()
    learner.run(stop, max_steps=4)
    assert learner.optimizer.param_groups[0]["lr"] == pytest.approx(learner.optimizer.defaults["lr"] * 0.5)
