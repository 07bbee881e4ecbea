"""Balanced, deterministic split of a model's parameters into P fragments.

Each fragment is a set of whole tensors. Layout is derived from parameter names and sizes alone,
so every island computes the same one (Decoupled DiLoCo, arXiv 2604.21428, balanced fragments;
Streaming DiLoCo, arXiv 2501.18512, Sec. 2.1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class FragmentLayout:
    """``fragments[p]`` lists the parameter names of fragment p, in model order."""

    fragments: tuple[tuple[str, ...], ...]
    sizes: tuple[int, ...]  # elements per fragment

    @property
    def num_fragments(self) -> int:
        """P, the number of fragments."""
        return len(self.fragments)


def balanced_layout(named_sizes: Sequence[tuple[str, int]], num_fragments: int) -> FragmentLayout:
    """Longest-processing-time bin packing of tensors into ``num_fragments`` fragments.

    Tensors are placed largest first (ties broken by name) into the currently smallest fragment
    (ties broken by index). The largest fragment is within 4/3 of the best possible split
    (Graham 1969); on transformer layouts that means within 4/3 of the ideal share total/P, or the
    largest tensor when one tensor alone exceeds that.

    :param named_sizes: (parameter name, number of elements) in model order; names must be unique
    :param num_fragments: P >= 1; at most the number of tensors
    :raises ValueError: on P < 1, P larger than the number of tensors, or duplicate names
    """
    names = [name for name, _ in named_sizes]
    if num_fragments < 1:
        raise ValueError(f"number of fragments must be >= 1, got {num_fragments}")
    if num_fragments > len(named_sizes):
        raise ValueError(
            f"cannot split {len(named_sizes)} tensors into {num_fragments} fragments: lower outer.fragments"
        )
    if len(set(names)) != len(names):
        raise ValueError("parameter names must be unique")
    order = {name: index for index, name in enumerate(names)}
    bins: list[list[str]] = [[] for _ in range(num_fragments)]
    loads = [0] * num_fragments
    for name, size in sorted(named_sizes, key=lambda item: (-item[1], item[0])):
        target = min(range(num_fragments), key=lambda p: (loads[p], p))
        bins[target].append(name)
        loads[target] += size
    fragments = tuple(tuple(sorted(b, key=order.__getitem__)) for b in bins)
    return FragmentLayout(fragments=fragments, sizes=tuple(loads))
