"""Model FLOPs per token and utilization (PaLM, arXiv 2204.02311, App. B)."""

import pytest
import torch

from p2p_diloco.island.model import (PRESETS, build_model, count_parameters, flops_per_token,
                                     model_flops_utilization, peak_flops)


def test_flops_per_token_counts_weights_and_attention():
    spec = PRESETS["tiny"]
    parameters = count_parameters(build_model(spec, spec.vocab_size, seed=0))
    # 6 N, and 12 x layers x hidden x sequence for attention: 4 x 128 x 128 x 12
    assert flops_per_token(parameters, spec) == 6 * parameters + 12 * 4 * 128 * 128


def test_a_matmul_of_a_linear_layer_matches_six_flops_per_weight():
    """A token through a d x d linear layer: 2 d^2 FLOPs forward and 4 d^2 backward, as torch's
    FLOP counter counts them."""
    from torch.utils.flop_counter import FlopCounterMode

    layer = torch.nn.Linear(64, 64, bias=False)
    tokens = torch.randn(10, 64, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        layer(tokens).sum().backward()
    assert counter.get_total_flops() == 10 * 6 * 64 * 64


def test_utilization_needs_a_known_peak_and_stays_in_unit_range():
    assert peak_flops("cpu") is None and peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12 and peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA L40") == 181e12 and peak_flops("NVIDIA L4") == 121e12 and peak_flops("NVIDIA L40S") == 362e12
    assert model_flops_utilization(1e6, 1e8, None) is None
    assert model_flops_utilization(1e6, 1e8, 989e12) == pytest.approx(1e14 / 989e12)
    assert model_flops_utilization(1e9, 1e9, 1e12) == 1.0 and model_flops_utilization(0.0, 1e9, 1e12) == 0.0
