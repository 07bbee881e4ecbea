"""Fragment layout: deterministic, complete and balanced."""

import itertools
import random

import pytest
import torch

from p2p_diloco.algo.fragments import balanced_layout
from p2p_diloco.island.model import PRESETS, build_model


def _preset_sizes(name):
    spec = PRESETS[name]
    with torch.device("meta"):
        model = build_model(spec, spec.vocab_size, seed=0)
    return [(n, p.numel()) for n, p in model.named_parameters()]


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_layouts_are_balanced(preset):
    sizes = _preset_sizes(preset)
    total, largest = sum(s for _, s in sizes), max(s for _, s in sizes)
    for num_fragments in range(1, 9):
        layout = balanced_layout(sizes, num_fragments)
        assert max(layout.sizes) <= max(4 / 3 * total / num_fragments, largest), (num_fragments, layout.sizes)
        assert sum(layout.sizes) == total


def test_layout_is_deterministic_and_covers_every_tensor_once():
    sizes = _preset_sizes("tiny")
    layout = balanced_layout(sizes, 3)
    shuffled = sizes[:]
    random.Random(0).shuffle(shuffled)
    assert balanced_layout(list(sizes), 3) == layout
    names = [name for fragment in layout.fragments for name in fragment]
    assert sorted(names) == sorted(n for n, _ in sizes)
    # the layout depends on names and sizes, not on the order they were listed in
    assert {frozenset(f) for f in balanced_layout(shuffled, 3).fragments} == {frozenset(f) for f in layout.fragments}
    for fragment in layout.fragments:  # tensors keep model order inside a fragment
        order = [n for n, _ in sizes if n in fragment]
        assert list(fragment) == order


def _optimal_makespan(sizes, bins):
    best = float("inf")
    for assignment in itertools.product(range(bins), repeat=len(sizes)):
        loads = [0] * bins
        for size, target in zip(sizes, assignment):
            loads[target] += size
        best = min(best, max(loads))
    return best


def test_within_graham_bound_of_the_best_split():
    rng = random.Random(1)
    for _ in range(150):
        count, bins = rng.randint(2, 7), rng.randint(2, 3)
        bins = min(bins, count)
        sizes = [rng.randint(1, 100) for _ in range(count)]
        layout = balanced_layout([(f"t{i}", s) for i, s in enumerate(sizes)], bins)
        assert max(layout.sizes) <= (4 / 3 - 1 / (3 * bins)) * _optimal_makespan(sizes, bins) + 1e-9


def test_layout_errors():
    with pytest.raises(ValueError, match="fragments"):
        balanced_layout([("a", 1), ("b", 2)], 3)
    with pytest.raises(ValueError):
        balanced_layout([("a", 1)], 0)
    with pytest.raises(ValueError, match="unique"):
        balanced_layout([("a", 1), ("a", 2)], 1)
