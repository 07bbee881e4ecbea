"""What the learner and the syncer hand each other (docs/DESIGN.md, "One round"): a snapshot of one
fragment's parameters at a step boundary, and an outer update for the learner to land at its next
step boundary. Neither side imports the other; both use these types.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch

from p2p_diloco.algo.outer import carry_correction

@dataclass
class Snapshot:
    """The island's parameters of one fragment at a step boundary, and what produced them."""

    fragment: int
    params: list[torch.Tensor]  # fp32 CPU copies in fragment order, shapes as the parameters
    tokens: int  # tokens trained since this fragment's previous snapshot
    steps: int  # inner steps in that time
    step: int = 0  # the learner's inner step count when the snapshot was taken


@dataclass
class OuterUpdate:
    """A new Theta_p for the learner to apply at its next step boundary (fp32 CPU tensors, not to be
    modified).

    ``mode == "carry"``: add ``tensors`` (Theta_new - base) to the live parameters.
    ``mode == "mix"``: theta <- alpha * theta + (1 - alpha) * ``tensors`` (Theta_new).
    ``mode == "replace"``: theta <- ``tensors`` (Theta_new); with ``reset_optimizer`` the inner
    optimizer's state of these parameters is cleared too (after NaN/Inf).
    """

    fragment: int
    mode: str
    tensors: list[torch.Tensor]
    alpha: float
    version: int
    reason: str  # the round outcome that produced it, or "reload"
    reset_optimizer: bool = False
    not_before_step: int = 0  # land no earlier than this inner step (overlap tau); 0: at once
    # when it lands, the fragment's (tokens, inner steps) marks become these: the next snapshot then
    # claims only the work since (a resumed island whose checkpoint's progress was dropped); None: kept
    marks: Optional[tuple[int, int]] = None


def make_update(fragment: int, theta: Sequence[torch.Tensor], version: int, *, base: Optional[Sequence[torch.Tensor]],
                apply: str, alpha: float, reason: str, reset_optimizer: bool = False,
                not_before: int = 0, marks: Optional[tuple[int, int]] = None) -> OuterUpdate:
    """The update that makes ``theta`` (the new Theta_p, fp32) the learner's global parameters.

    :param base: what the learner's progress is measured from (the snapshot that went into the
        round, plus what it could not send); None replaces the local parameters outright
    :param apply: ``carry`` keeps the inner progress made since ``base`` on top of Theta_new
        (Streaming DiLoCo's overlap, arXiv 2501.18512, Sec. 2.3, and eager updates, arXiv
        2502.12996), ``mix`` mixes theta <- alpha * theta + (1 - alpha) * Theta_new
    :param not_before: the inner step before which the learner keeps training without it (tau)
    :param marks: the fragment's (tokens, inner steps) marks once it lands (``OuterUpdate.marks``)
    """
    if base is None:
        return OuterUpdate(fragment, "replace", list(theta), 0.0, version, reason, reset_optimizer, marks=marks)
    if apply == "mix":
        return OuterUpdate(fragment, "mix", list(theta), alpha, version, reason, not_before_step=not_before, marks=marks)
    return OuterUpdate(fragment, "carry", carry_correction(theta, base), 0.0, version, reason,
                       not_before_step=not_before, marks=marks)


class LearnerLink(Protocol):
    """What the syncer needs from the learner; every member is safe to call from any thread."""

    def request_snapshot(self, fragment: int, timeout: float) -> Optional[Snapshot]:
        """A snapshot taken at the learner's next step boundary, or None after ``timeout`` seconds."""

    def deliver(self, update: OuterUpdate) -> None:
        """Queue an update for the learner's next step boundary."""

    @property
    def step_time(self) -> float:
        """Smoothed seconds per inner step."""
