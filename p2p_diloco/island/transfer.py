"""State transfer: serving this island's fragment states to peers that download them, and
downloading them from peers, with donor failover (docs/DESIGN.md, "Joining, lagging and forks").

A download is trusted only as far as it can be checked: the donor's run fingerprint and fragment,
the shapes, finite values, a version at least the one asked for, and a hash computed here.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Callable, Collection, Optional, Sequence

import torch

from p2p_diloco.algo import outer
from p2p_diloco.island.store import FragmentState, FragmentStore
from p2p_diloco.net.averager import next_chunk_timeout
from p2p_diloco.net.channel import FragmentChannel

logger = logging.getLogger(__name__)


class StateTransfer:
    """Donations and downloads of fragment states for one island.

    :param store: the island's global states (what is served, what a download is checked against)
    :param stats: the syncer's counters (state bytes sent and received, reloads)
    :param fingerprint: the run fingerprint; donors must match it
    :param events: takes ``donate`` events (the island's JSONL log)
    :param allreduce_timeout: seconds of a round's all-reduce (a downloader gives up on a donor whose
        first chunk takes longer than hivemind's ``next_chunk_timeout`` of it)
    :param stop: once set, downloads give up
    """

    def __init__(self, store: FragmentStore, stats, *, fingerprint: str, events: Callable[[dict], None],
                 allreduce_timeout: float, stop: threading.Event):
        self.store, self.stats, self.fingerprint, self.events = store, stats, fingerprint, events
        self.allreduce_timeout, self.stop = allreduce_timeout, stop
        self.channels: Sequence[FragmentChannel] = []
        # (peer id, fragment versions, fragment hashes) of the live donors, as their records show
        self.holders: Callable[[], list[tuple[str, list[int], list[str]]]] = list

    def attach(self, channels: Sequence[FragmentChannel]) -> None:
        """Download through these channels, one per fragment (opened after the DHT)."""
        self.channels = channels

    # ---------------------------------------------------------------- serving

    def donate(self, p: int) -> tuple[dict, list[torch.Tensor]]:
        """Fragment p's state for a peer that downloads it (called by hivemind's fetch thread).

        Returns copies: hivemind moves what it sends into shared memory, which must not happen to
        tensors other threads are reading.

        :raises RuntimeError: before the store is initialised
        """
        if self.store.states[p] is None:
            raise RuntimeError("state not ready")
        self.events({"event": "donate", "fragment": p})
        # the downloader gives up when the first chunk takes longer than next_chunk_timeout
        self.before_serving(p, budget=0.8 * next_chunk_timeout(self.allreduce_timeout))
        state = self.store.states[p]
        tensors = [t.clone() for t in state.theta + state.momentum]
        self.stats.add(state_bytes_sent=sum(t.numel() * t.element_size() for t in tensors))
        metadata = dict(fingerprint=self.fingerprint, fragment=p, version=state.version, hash=state.hash,
                        support=state.support)
        return metadata, tensors

    def before_serving(self, p: int, budget: float) -> None:
        """Wait (up to 2 s, within ``budget`` seconds) for a round of fragment p in flight: a donor
        prefers to serve the state after the round. The lab overrides this to make a slow donor."""
        self.store.wait_idle(p, timeout=min(2.0, budget))

    # ---------------------------------------------------------------- downloading

    def download(self, p: int, *, timeout: float, min_version: int = 0,
                 among: Optional[Collection[tuple[int, str]]] = None) -> Optional[FragmentState]:
        """Fragment p's state from the best donor if it is valid and at least ``min_version``; with
        ``among``, only exactly one of those (version, Theta_p hash), asked first of the donors whose
        records show one of them (:attr:`holders`), then of whichever donor hivemind picks.

        :param timeout: seconds for the whole download (up to about 1 s more on a busy machine)
        :returns: None when no donor served a valid state that was asked for
        """
        deadline = time.monotonic() + timeout
        peers = self.holders_of(p, among) if among is not None else []
        if peers:
            state = self._checked(p, self.channels[p].load_state(timeout=max(1.0, timeout - 1.0), peers=peers),
                                  min_version, among)
            if state is not None or deadline - time.monotonic() < 1.0:
                return state
        return self._checked(p, self.channels[p].load_state(timeout=max(1.0, deadline - time.monotonic())),
                             min_version, among)

    def holders_of(self, p: int, among: Collection[tuple[int, str]]) -> list[str]:
        """Peer ids of the live donors whose records show fragment p at one of ``among`` (version,
        hash), in random order (so that one that stalls is not always asked first)."""
        peers = list({peer for peer, base in fragment_bases(self.holders(), p) if base in among})
        random.shuffle(peers)
        return peers

    def _checked(self, p: int, result, min_version: int,
                 among: Optional[Collection[tuple[int, str]]]) -> Optional[FragmentState]:
        """The downloaded (metadata, tensors) as a state, if valid (docs/SECURITY.md); None otherwise."""
        if result is None:
            return None
        metadata, tensors = result
        shapes = self.store.shapes[p]
        n = len(shapes)
        if (
            not isinstance(metadata, dict)
            or metadata.get("fingerprint") != self.fingerprint
            or metadata.get("fragment") != p
            or type(metadata.get("version")) is not int
            or type(metadata.get("support", 1)) is not int
            or len(tensors) != 2 * n
            or any(t.shape != shape for t, shape in zip(tensors, shapes * 2))
        ):
            logger.warning("ignored a malformed state download for fragment %d", p)
            return None
        version = metadata["version"]
        if version < min_version or (among is not None and version not in {v for v, _ in among}):
            logger.debug("donor of fragment %d has version %d, not one asked for", p, version)
            return None
        theta = [t.to(torch.float32).contiguous() for t in tensors[:n]]
        momentum = [t.to(torch.float32).contiguous() for t in tensors[n:]]
        self.stats.add(state_bytes_received=sum(t.numel() * t.element_size() for t in tensors))
        if not outer.all_finite(theta + momentum):
            logger.warning("ignored a state download with NaN/Inf for fragment %d", p)
            return None
        digest = outer.tensors_hash(theta)  # computed here: the donor's word is not enough
        if among is not None and (version, digest) not in among:
            logger.debug("donor of fragment %d holds another fork of version %d", p, version)
            return None
        self.stats.add(reloads=1)
        return FragmentState(theta, momentum, version, digest, max(1, metadata.get("support", 1)))

    def download_until(self, p: int, *, deadline: float, min_version: int = 0,
                       among: Optional[Collection[tuple[int, str]] | Callable[[], Collection[tuple[int, str]]]] = None,
                       stop: Optional[threading.Event] = None,
                       on_retry: Callable[[], None] = lambda: None) -> Optional[FragmentState]:
        """Retry :meth:`download` (another donor may answer, or the first may finish its round) until
        ``deadline`` (time.monotonic() seconds) or ``stop`` (default: the syncer's).

        :param among: the (version, hash) states to take, or a callable that returns them, called
            before each attempt (the swarm may move on while we retry)
        :param on_retry: called after each failed attempt, before the next (e.g. to read the
            others' records again)
        """
        stop = stop or self.stop
        while not stop.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            state = self.download(p, min_version=min_version, among=among() if callable(among) else among,
                                  timeout=min(10.0, max(1.0, remaining)))
            if state is not None:
                return state
            on_retry()
            stop.wait(min(0.5, max(0.0, deadline - time.monotonic())))
        return None

    def load_all(self, *, timeout: float, stop: threading.Event,
                 targets: Optional[Callable[[], list[Optional[Collection[tuple[int, str]]]]]] = None) -> bool:
        """Download Theta_p, m_p and v_p of every fragment from live peers and publish them (a
        joining island).

        :param timeout: seconds for all fragments together
        :param targets: returns, per fragment, the (version, hash) states a joiner may take (see
            :func:`p2p_diloco.island.joining.join_from_peers`), read afresh before each attempt; only
            one of those is taken, so one donor cannot hand a joiner a state of its own making
            (docs/SECURITY.md). None or empty for a fragment: none yet, ask again shortly. targets
            None: any valid state
        :returns: True when every fragment was loaded; False leaves unloaded fragments as they were
        """
        deadline = time.monotonic() + timeout
        for p in range(self.store.num_fragments):
            state = None
            while state is None and not stop.is_set() and time.monotonic() < deadline:
                wanted = targets()[p] if targets is not None else None
                if targets is not None and not wanted:  # nobody vouches yet: ask again shortly
                    stop.wait(0.5)
                    continue
                remaining = deadline - time.monotonic()
                state = (self.download(p, among=wanted, timeout=min(10.0, max(1.0, remaining)))
                         if wanted else
                         self.download_until(p, min_version=0, deadline=deadline, stop=stop))
                if state is None and wanted:
                    stop.wait(min(0.5, max(0.0, deadline - time.monotonic())))
            if state is None:
                return False
            self.store.publish(p, state)
            self.events({"event": "join", "fragment": p, "version": state.version, "hash": state.hash})
        return True


def fragment_bases(records, p: int) -> list[tuple[str, tuple[int, str]]]:
    """(island, (version, hash)) of fragment p from records (island, fragment versions, fragment
    hashes), leaving out those that do not report fragment p."""
    return [(island, (versions[p], hashes[p])) for island, versions, hashes in records
            if len(versions) > p and len(hashes) > p and hashes[p]]


def vouched_bases(bases: list[tuple[list[int], list[str]]], num_fragments: int) -> list[Optional[tuple[int, str]]]:
    """Per fragment, the (version, hash) a joiner may take from the live islands' records (their
    fragment versions and hashes): the newest that 2 or more islands hold when 2 or more report,
    else the only island's; None where none qualifies (docs/SECURITY.md: no one donor decides)."""
    result = []
    for p in range(num_fragments):
        held = outer.vouched([base for _, base in fragment_bases([("", *b) for b in bases], p)])
        result.append(outer.canonical_base(held) if held else None)
    return result


def reported_bases(bases: list[tuple[list[int], list[str]]], num_fragments: int) -> list[frozenset]:
    """Per fragment, every (version, hash) that some record (fragment versions and hashes) reports."""
    return [frozenset(base for _, base in fragment_bases([("", *b) for b in bases], p)) for p in range(num_fragments)]
