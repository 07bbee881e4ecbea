"""Model presets, construction and the run fingerprint.

Models are Llama-style causal LMs built by ``transformers`` from a config (no weights are downloaded);
every island builds the same initial weights from ``model.seed``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import torch

from p2p_diloco.config import ModelConfig, OuterConfig

PROTOCOL_VERSION = 5  # bump when the wire format of rounds or state downloads changes


@dataclass(frozen=True)
class ModelSpec:
    """Resolved architecture and training shapes of a preset (with the user's overrides applied)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    seq_len: int
    batch_size: int  # sequences per inner step unless inner.batch_size overrides it


PRESETS: dict[str, ModelSpec] = {
    # ~1.07M parameters with tied embeddings: fits a CPU core
    "tiny": ModelSpec(hidden_size=128, num_layers=4, num_heads=4, intermediate_size=352, vocab_size=2048,
                      seq_len=128, batch_size=16),
    # ~24M parameters
    "small": ModelSpec(hidden_size=512, num_layers=6, num_heads=8, intermediate_size=1408, vocab_size=8192,
                       seq_len=256, batch_size=32),
    # ~151M parameters
    "base": ModelSpec(hidden_size=896, num_layers=14, num_heads=14, intermediate_size=2432, vocab_size=16384,
                      seq_len=512, batch_size=32),
}


# dense bf16 tensor-core peaks in FLOP/s, by a substring of torch.cuda.get_device_name (vendors' data
# sheets), the first that matches: model FLOPs utilization is measured against these
PEAK_BF16_FLOPS = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H200": 989e12, "H100": 989e12, "A100": 312e12,
                   "L40S": 362e12, "L40": 181e12, "L4": 121e12, "A10G": 70e12}


def flops_per_token(parameters: int, spec: ModelSpec) -> float:
    """Training FLOPs per token (forward and backward): ``6 N`` for the weights plus ``12 L d T`` for
    attention's scores and weighted values (PaLM, arXiv 2204.02311, App. B), N the parameter count
    (tied embeddings once), L layers, d the hidden size, T the sequence length."""
    return 6.0 * parameters + 12.0 * spec.num_layers * spec.hidden_size * spec.seq_len


def peak_flops(device_name: str) -> float | None:
    """The device's dense bf16 peak in FLOP/s (the first :data:`PEAK_BF16_FLOPS` name that
    ``device_name`` contains, separated by spaces or dashes), or None (a CPU, an unknown GPU)."""
    words = f" {device_name.replace('-', ' ')} "
    for name, peak in PEAK_BF16_FLOPS.items():
        if f" {name} " in words:
            return peak
    return None


def model_flops_utilization(tokens_per_second: float, flops_per_token_: float, peak: float | None) -> float | None:
    """Achieved model FLOP/s (``tokens_per_second x flops_per_token_``) over the device's peak
    ``peak`` (FLOP/s), in [0, 1]; None without a peak."""
    if not peak:
        return None
    return min(1.0, max(0.0, tokens_per_second * flops_per_token_ / peak))


def resolve_spec(config: ModelConfig) -> ModelSpec:
    """The preset named by ``config.preset`` with every non-empty override applied.

    Raises ValueError if hidden_size is not divisible by num_heads.
    """
    base = asdict(PRESETS[config.preset])
    for key in ("hidden_size", "num_layers", "num_heads", "intermediate_size", "vocab_size", "seq_len"):
        value = getattr(config, key)
        if value is not None:
            base[key] = value
    spec = ModelSpec(**base)
    if spec.hidden_size % spec.num_heads:
        raise ValueError(
            f"model.hidden_size ({spec.hidden_size}) must be divisible by model.num_heads ({spec.num_heads})"
        )
    return spec


def llama_config(spec: ModelSpec, vocab_size: int):
    """The transformers ``LlamaConfig`` of a spec; ``vocab_size`` is the tokenizer's actual size."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.seq_len,
        tie_word_embeddings=True,
        attention_dropout=0.0,
        rms_norm_eps=1e-5,
    )


def build_model(spec: ModelSpec, vocab_size: int, seed: int) -> torch.nn.Module:
    """A freshly initialised ``LlamaForCausalLM`` (fp32 parameters, on the CPU).

    The same (spec, vocab_size, seed) gives bitwise identical weights on every island, so islands
    that start together begin from the same Theta without downloading it.
    """
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    config = llama_config(spec, vocab_size)
    config._attn_implementation = "sdpa"
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    return model.float()


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameter elements (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def run_fingerprint(spec: ModelSpec, vocab_size: int, seed: int, tokenizer_sha: str, outer: OuterConfig) -> str:
    """A 16-hex-digit hash of everything islands must share to average together.

    Covers the architecture, the tokenizer (sha256 of its JSON), the init seed and the outer-loop
    fields that decide the global parameters (fragments, period, outer optimizer, delta clip, merge,
    codec, aggregator, weight cap, clip radius, outlier ratio), plus the wire protocol version.
    Inner-loop settings (lr, batch) may differ between islands.
    """
    payload = {
        "protocol": PROTOCOL_VERSION,
        "arch": asdict(spec) | {"vocab_size": vocab_size, "batch_size": None},
        "seed": seed,
        "tokenizer": tokenizer_sha,
        "outer": {
            "fragments": outer.fragments,
            "period": outer.period,
            "lr": outer.lr,
            "momentum": outer.momentum,
            "nesterov": outer.nesterov,
            "max_delta": outer.max_delta,
            "merge": outer.merge,
            "codec": outer.codec,
            "aggregator": outer.aggregator,
            "weight_cap": outer.weight_cap,
            "clip_radius": outer.clip_radius,
            "outlier_ratio": outer.outlier_ratio,
            "norm_ratio": outer.norm_ratio,
        },
    }
    blob = json.dumps(payload, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
