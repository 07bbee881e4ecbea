"""Your own model: Hugging Face model folders (GPT-2 and Llama style, fresh and from weights) build,
train and enter the run fingerprint."""

import pytest
import torch

from p2p_diloco.config import InnerConfig, ModelConfig, OuterConfig
from p2p_diloco.algo.fragments import balanced_layout
from p2p_diloco.errors import UserError
from p2p_diloco.island.data import BatchSampler
from p2p_diloco.island.learner import Learner
import transformers

from p2p_diloco.island.model import build_model, model_config_sha, resolve_spec, run_fingerprint, weights_hash


def _gpt2(path, with_weights: bool):
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=300, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    if with_weights:
        torch.manual_seed(5)
        transformers.GPT2LMHeadModel(config).save_pretrained(path)
    else:
        config.save_pretrained(path)
    return path


def _llama(path, with_weights: bool, seed: int = 5):
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=2, vocab_size=300, max_position_embeddings=64,
                                      bos_token_id=0, eos_token_id=0)
    if with_weights:
        torch.manual_seed(seed)
        transformers.LlamaForCausalLM(config).save_pretrained(path)
    else:
        config.save_pretrained(path)
    return path


@pytest.mark.parametrize("make", [_gpt2, _llama])
@pytest.mark.parametrize("with_weights", [False, True])
def test_a_model_folder_builds_and_trains(tmp_path, make, with_weights):
    folder = str(make(tmp_path / "model", with_weights))
    spec = resolve_spec(ModelConfig(path=folder, seq_len=32))
    assert (spec.hidden_size, spec.num_layers, spec.num_heads, spec.vocab_size) == (32, 2, 2, 300)
    first, second = build_model(spec, 290, seed=1, model_dir=folder), build_model(spec, 290, seed=1, model_dir=folder)
    assert weights_hash(first) == weights_hash(second)  # every island starts from the same weights
    if with_weights:  # the saved weights, not a fresh initialisation
        assert weights_hash(first) == weights_hash(build_model(spec, 290, seed=2, model_dir=folder))
        saved = transformers.AutoModelForCausalLM.from_pretrained(folder)
        assert all(torch.equal(a, b) for a, b in zip(first.parameters(), saved.parameters()))
    else:
        assert weights_hash(first) != weights_hash(build_model(spec, 290, seed=2, model_dir=folder))
    named = [(n, p.numel()) for n, p in first.named_parameters()]
    sampler = BatchSampler(torch.arange(4000).remainder(290).numpy(), 4, 32, seed=0, island="m")
    learner = Learner(model=first, layout=balanced_layout(named, 2), next_batch=sampler.next_batch,
                      eval_data=[sampler.next_batch()], device=torch.device("cpu"),
                      inner=InnerConfig(lr=1e-2, warmup_steps=0))
    before = learner.evaluate()
    for _ in range(8):
        learner.train_step()
    assert learner.evaluate() < before


def test_the_fingerprint_covers_the_models_config_and_initial_weights(tmp_path):
    a, b = str(_llama(tmp_path / "a", True, seed=1)), str(_llama(tmp_path / "b", True, seed=2))
    c = str(_gpt2(tmp_path / "c", False))
    spec = resolve_spec(ModelConfig(path=a))

    def fingerprint(folder):
        model = build_model(spec, 300, seed=0, model_dir=folder)
        return run_fingerprint(spec, 300, 0, "tok", OuterConfig(), initial_weights=weights_hash(model),
                               model_config=model_config_sha(folder))

    assert model_config_sha(a) == model_config_sha(b) != model_config_sha(c)
    assert fingerprint(a) == fingerprint(a) != fingerprint(b)  # same config, other weights: refused
    # islands of other group counts take other slots: refused; G = 1 keeps the fingerprints of before
    base = run_fingerprint(spec, 300, 0, "tok", OuterConfig())
    assert base == run_fingerprint(spec, 300, 0, "tok", OuterConfig(groups=1)) != \
        run_fingerprint(spec, 300, 0, "tok", OuterConfig(groups=2))


def test_bad_model_folders_are_clear_errors(tmp_path):
    with pytest.raises(UserError, match="no config.json"):
        resolve_spec(ModelConfig(path=str(tmp_path)))
    (tmp_path / "config.json").write_text('{"model_type": "no-such-architecture"}')
    with pytest.raises(UserError, match="cannot be read by transformers"):
        resolve_spec(ModelConfig(path=str(tmp_path)))
    folder = str(_gpt2(tmp_path / "g", False))
    with pytest.raises(UserError, match="cannot change the architecture"):
        resolve_spec(ModelConfig(path=folder, hidden_size=64))
    with pytest.raises(UserError, match="longer than"):
        resolve_spec(ModelConfig(path=folder, seq_len=128))
    with pytest.raises(UserError, match="smaller than the tokenizer"):
        build_model(resolve_spec(ModelConfig(path=folder)), 400, seed=0, model_dir=folder)
