"""The island's copy of the global state: Theta_p, the outer momentum m_p, the version v_p and a hash
of every fragment (docs/DESIGN.md, "Syncer"), and the hand-over of a new state to the learner.

States are replaced as a whole, never modified in place, so readers in other threads (a donor
serving a download, the progress reporter, a checkpoint) always see a consistent one.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch

from p2p_diloco.algo import outer
from p2p_diloco.algo.handoff import LearnerLink, OuterUpdate, make_update


@dataclass
class FragmentState:
    """Theta_p and its outer momentum m_p (fp32 CPU, in fragment order), version v_p and the hash of
    Theta_p; ``support``: members of the last round that shared this state's base (donor priority)."""

    theta: list[torch.Tensor]
    momentum: list[torch.Tensor]
    version: int
    hash: str
    support: int = 1

    def stepped(self, merged: Sequence[torch.Tensor], version: int, support: int, *, lr: float, momentum: float,
                nesterov: bool, turn: int = 0, turns: int = 1) -> "FragmentState":
        """A new state after one outer step with the merged pseudo-gradient (arXiv 2311.08105,
        Alg. 1, line 14; with groups taking turns, ``turn`` of ``turns``: :func:`outer.turn_step`);
        this state is left as it is."""
        theta = [t.clone() for t in self.theta]
        buffers = [m.clone() for m in self.momentum]
        outer.turn_step(theta, merged, buffers, lr=lr, momentum=momentum, nesterov=nesterov, turn=turn, turns=turns)
        return FragmentState(theta, buffers, version, outer.tensors_hash(theta), support)


class FragmentStore:
    """The current :class:`FragmentState` of every fragment.

    Threads: fragment p's round thread alone replaces ``states[p]`` (also through a reload), every
    thread may read. :meth:`hand_over` delivers the learner's update and publishes the state under
    one lock, so :meth:`consistent_states` never sees one without the other.

    :param shapes: ``shapes[p]``: the parameter shapes of fragment p, in layout order
    """

    def __init__(self, shapes: Sequence[Sequence[torch.Size]]):
        self.shapes = [list(s) for s in shapes]
        self.states: list[Optional[FragmentState]] = [None] * len(self.shapes)
        self._listeners: list[Callable[[int, FragmentState], None]] = []
        self._commit = threading.Lock()
        self._idle = [threading.Event() for _ in self.shapes]  # no round of p in flight
        for event in self._idle:
            event.set()

    @property
    def num_fragments(self) -> int:
        """P."""
        return len(self.shapes)

    @property
    def versions(self) -> list[int]:
        """v_p of every fragment (0 before initialisation)."""
        return [state.version if state else 0 for state in self.states]

    @property
    def hashes(self) -> list[str]:
        """Hash of Theta_p of every fragment ("" before initialisation)."""
        return [state.hash if state else "" for state in self.states]

    def global_params(self, fragment: int) -> list[torch.Tensor]:
        """Theta_p as last published (do not modify)."""
        state = self.states[fragment]
        assert state is not None, "the store is not initialised"
        return state.theta

    def on_publish(self, listener: Callable[[int, FragmentState], None]) -> None:
        """Call ``listener(p, state)`` whenever fragment p gets a new state (e.g. a donor priority)."""
        self._listeners.append(listener)
        for p, state in enumerate(self.states):
            if state is not None:
                listener(p, state)

    def publish(self, p: int, state: FragmentState) -> None:
        """Make ``state`` fragment p's current state."""
        self.states[p] = state
        for listener in self._listeners:
            listener(p, state)

    def initialize(self, params: Sequence[Sequence[torch.Tensor]]) -> None:
        """Start from the island's own (seeded) initial parameters at version 0."""
        for p, fragment in enumerate(params):
            theta = [t.detach().to("cpu", torch.float32, copy=True) for t in fragment]
            self.publish(p, FragmentState(theta, [torch.zeros_like(t) for t in theta], 0, outer.tensors_hash(theta)))

    def restore(self, fragments: Sequence) -> None:
        """Start from saved global states (``checkpoint.GlobalFragment``: theta, momentum, version,
        hash, support), e.g. after a whole swarm restarted.

        :raises ValueError: if the number of fragments, a fragment's shapes or its hash do not match
        """
        if len(fragments) != self.num_fragments:
            raise ValueError(f"{len(fragments)} saved fragments, the layout has {self.num_fragments}")
        for p, saved in enumerate(fragments):
            if [t.shape for t in saved.theta] != self.shapes[p] or [t.shape for t in saved.momentum] != self.shapes[p]:
                raise ValueError(f"saved fragment {p} has other shapes than this model")
            theta = [t.to(torch.float32).contiguous() for t in saved.theta]
            if outer.tensors_hash(theta) != saved.hash:
                raise ValueError(f"saved fragment {p} does not match its hash")
            momentum = [t.to(torch.float32).contiguous() for t in saved.momentum]
            self.publish(p, FragmentState(theta, momentum, saved.version, saved.hash, saved.support))

    def hand_over(self, p: int, state: FragmentState, update: OuterUpdate, learner: LearnerLink) -> None:
        """Deliver ``update`` (which makes ``state`` the learner's Theta_p) and publish ``state``,
        together."""
        with self._commit:
            learner.deliver(update)
            if self.states[p] is not state:
                self.publish(p, state)

    def consistent_states(self, apply_updates: Callable[[], None]) -> list[FragmentState]:
        """The current states, with ``apply_updates`` (the learner's, applying every delivered update)
        run under the same lock: the local parameters then include exactly the updates of the states
        returned (checkpoints)."""
        with self._commit:
            apply_updates()
            return list(self.states)

    @contextlib.contextmanager
    def round_in_flight(self, p: int) -> Iterator[None]:
        """Mark fragment p as being updated by a round (donors wait for the result, see :meth:`wait_idle`)."""
        self._idle[p].clear()
        try:
            yield
        finally:
            self._idle[p].set()

    def wait_idle(self, p: int, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until no round of fragment p is in flight."""
        return self._idle[p].wait(timeout=max(0.0, timeout))


class HandOver:
    """Makes a new state the learner's Theta_p: builds the learner's update as the run's ``apply``
    setting says (:func:`p2p_diloco.algo.handoff.make_update`) and delivers it with the state's
    publication (:meth:`FragmentStore.hand_over`).

    :param apply: ``carry`` or ``mix`` (``outer.apply``)
    :param alpha: the mix weight of the local parameters (``outer.alpha``)
    """

    def __init__(self, store: FragmentStore, learner: LearnerLink, *, apply: str, alpha: float):
        self.store, self.learner, self.apply, self.alpha = store, learner, apply, alpha

    def __call__(self, p: int, state: FragmentState, base: Optional[Sequence[torch.Tensor]], *, reason: str,
                 reset_optimizer: bool = False, not_before: int = 0, apply: Optional[str] = None,
                 marks: Optional[tuple[int, int]] = None) -> None:
        """Hand ``state`` over; ``base`` is what the learner's progress is measured from (None:
        replace the local parameters outright); ``not_before``: the inner step before which the
        learner keeps training without it (overlap); ``apply``: this update's mode instead of the
        run's; ``marks``: the fragment's (tokens, inner steps) marks once it lands
        (:class:`~p2p_diloco.algo.handoff.OuterUpdate`)."""
        update = make_update(p, state.theta, state.version, base=base, apply=apply or self.apply, alpha=self.alpha,
                             reason=reason, reset_optimizer=reset_optimizer, not_before=not_before, marks=marks)
        self.store.hand_over(p, state, update, self.learner)
