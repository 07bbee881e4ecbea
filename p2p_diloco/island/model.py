"""Model presets, Hugging Face model folders, construction and the run fingerprint.

Models are causal LMs built by ``transformers``: a Llama-style preset from its config, or any
architecture ``AutoModelForCausalLM`` builds from a local model folder (``--model DIR``: its
``config.json``, and its safetensors weights when it has them). Nothing is downloaded; without
weights every island builds the same initial weights from ``model.seed``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from pathlib import Path
from typing import Optional

import torch

from p2p_diloco.algo.outer import tensors_hash
from p2p_diloco.config import ModelConfig, OuterConfig
from p2p_diloco.errors import ConfigError, UserError

PROTOCOL_VERSION = 6  # bump when the wire format of rounds or state downloads, or the fingerprint, changes


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
    """The preset named by ``config.preset`` with every non-empty override applied, or the shapes of
    the model folder ``config.path`` (:func:`model_folder_spec`).

    :raises ValueError: if hidden_size is not divisible by num_heads
    :raises UserError: for a model folder that cannot be read, or overrides of its architecture
    """
    if config.path:
        return model_folder_spec(config)
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


# a config's field for each shape, by the names transformers' architectures use (Llama, GPT-2, OPT...)
_HF_FIELDS = {"hidden_size": ("hidden_size", "n_embd", "d_model"),
              "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
              "num_heads": ("num_attention_heads", "n_head", "num_heads"),
              "intermediate_size": ("intermediate_size", "n_inner", "ffn_dim"),
              "max_positions": ("max_position_embeddings", "n_positions")}
_VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path", "dtype", "torch_dtype", "_attn_implementation")


def load_model_config(model_dir: str):
    """The ``transformers`` config of a local model folder (``AutoConfig``, local files only, no remote code).

    :raises UserError: no config.json, or one transformers cannot read
    """
    folder = Path(model_dir).expanduser()
    if not (folder / "config.json").is_file():
        raise UserError(f"--model {model_dir}: no config.json there (a Hugging Face model folder, written by "
                        "model.save_pretrained(DIR) or config.save_pretrained(DIR))")
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        return AutoConfig.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except Exception as e:  # ValueError (unknown model_type), OSError, JSON errors
        raise UserError(f"--model {model_dir}: config.json cannot be read by transformers ({e})") from None


def model_config_sha(model_dir: str) -> str:
    """sha256 of a model folder's config (sorted JSON, without the fields that name the library
    version, the dtype or the attention kernel)."""
    payload = {k: v for k, v in load_model_config(model_dir).to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def has_weights(model_dir: str) -> bool:
    """True when the folder holds safetensors weights (one file or an index of shards)."""
    folder = Path(model_dir).expanduser()
    return (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file()


def model_folder_spec(config: ModelConfig) -> ModelSpec:
    """The shapes of the model folder ``config.path`` (for FLOPs and batches): its config's sizes, the
    training sequence length ``config.seq_len`` (default: the preset's, at most the model's positions)
    and the preset's batch size.

    :raises UserError: an unreadable folder; ``--model-hidden-size`` and the other architecture
        overrides, which cannot change a folder's model; a sequence longer than its positions
    """
    for key in ("hidden_size", "num_layers", "num_heads", "intermediate_size", "vocab_size"):
        if getattr(config, key) is not None:
            raise ConfigError(f"model.{key} (--model-{key.replace('_', '-')}) cannot change the architecture of "
                              f"--model {config.path}: edit its config.json instead")
    hf = load_model_config(config.path)
    sizes = {key: next((getattr(hf, name) for name in names if getattr(hf, name, None)), None)
             for key, names in _HF_FIELDS.items()}
    if not sizes["hidden_size"] or not sizes["num_layers"] or not sizes["num_heads"]:
        raise UserError(f"--model {config.path}: config.json does not say the hidden size, layers and heads in "
                        "fields transformers' causal LMs use")
    preset, positions = PRESETS[config.preset], sizes["max_positions"]
    seq_len = config.seq_len or (min(preset.seq_len, positions) if positions else preset.seq_len)
    if positions and seq_len > positions:
        raise ConfigError(f"model.seq_len (--model-seq-len) {seq_len} is longer than --model {config.path}'s "
                          f"{positions} positions")
    return ModelSpec(hidden_size=sizes["hidden_size"], num_layers=sizes["num_layers"], num_heads=sizes["num_heads"],
                     intermediate_size=sizes["intermediate_size"] or 4 * sizes["hidden_size"],
                     vocab_size=hf.vocab_size, seq_len=seq_len, batch_size=preset.batch_size)


def _model_from_folder(model_dir: str, vocab_size: int) -> torch.nn.Module:
    """``AutoModelForCausalLM`` from the folder's weights, or from its config (under the caller's seed)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    config = load_model_config(model_dir)
    if config.vocab_size < vocab_size:
        raise ConfigError(f"--model {model_dir}: its vocab_size ({config.vocab_size}) is smaller than the "
                          f"tokenizer's {vocab_size} tokens: use a model with a larger vocabulary or another tokenizer")
    weights = has_weights(model_dir)
    last: Optional[Exception] = None
    for attention in ("sdpa", "eager"):  # (sdpa where the architecture has it)
        try:
            if weights:
                return AutoModelForCausalLM.from_pretrained(str(Path(model_dir).expanduser()), local_files_only=True,
                                                            use_safetensors=True, dtype=torch.float32,
                                                            trust_remote_code=False, attn_implementation=attention)
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attention)
        except Exception as e:  # ValueError: not a causal LM, no sdpa; OSError: bad weights
            last = e
    raise UserError(f"--model {model_dir}: transformers cannot build a causal LM from it ({last})") from None


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


def build_model(spec: ModelSpec, vocab_size: int, seed: int, model_dir: str = "") -> torch.nn.Module:
    """A causal LM with fp32 parameters on the CPU: a freshly initialised ``LlamaForCausalLM`` of the
    spec, or the model of the folder ``model_dir`` (its weights, or its config initialised).

    The same (spec or folder, vocab_size, seed) gives bitwise identical weights on every island, so
    islands that start together begin from the same Theta without downloading it.

    :param vocab_size: the tokenizer's size (a folder's model must have at least as many embeddings)
    :raises UserError: for a folder transformers cannot build a causal LM from
    """
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        if model_dir:
            model = _model_from_folder(model_dir, vocab_size)
        else:
            config = llama_config(spec, vocab_size)
            config._attn_implementation = "sdpa"
            model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    return model.float()


def weights_hash(model: torch.nn.Module) -> str:
    """A 16-hex-digit hash of a model's parameters (in ``named_parameters`` order, tied ones once)."""
    return tensors_hash(p.detach() for p in model.parameters())


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameter elements (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def run_fingerprint(spec: ModelSpec, vocab_size: int, seed: int, tokenizer_sha: str, outer: OuterConfig, *,
                    initial_weights: str = "", model_config: str = "") -> str:
    """A 16-hex-digit hash of everything islands must share to average together.

    Covers the architecture (and ``model_config``, the sha256 of a model folder's config, see
    :func:`model_config_sha`), the initial weights' hash (:func:`weights_hash`), the tokenizer
    (sha256 of its JSON), the init seed and the outer-loop
    fields that decide the global parameters (fragments, period, groups, outer optimizer, delta clip,
    merge, codec, aggregator, weight cap, clip radius, outlier ratio), plus the wire protocol version.
    Inner-loop settings (lr, batch) may differ between islands.
    """
    payload = {
        "protocol": PROTOCOL_VERSION,
        "arch": asdict(spec) | {"vocab_size": vocab_size, "batch_size": None},
        "seed": seed,
        "tokenizer": tokenizer_sha,
        "initial_weights": initial_weights,
        "model_config": model_config,
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
            # G only when set, so that the runs and checkpoints of one group keep their fingerprints
            **({"groups": outer.groups} if outer.groups > 1 else {}),
        },
    }
    blob = json.dumps(payload, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
