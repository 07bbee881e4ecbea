"""How an island gets its global state before it trains (docs/DESIGN.md, "Joining, lagging and
forks"): it refuses a run of another fingerprint, downloads Theta, the outer momentum and the
versions from live islands (or starts from the seeded weights), or resumes from its own checkpoint.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from p2p_diloco.errors import ConfigError, FingerprintMismatch, Interrupted
from p2p_diloco.island import checkpoint as ckpt
from p2p_diloco.island.repair import BaseRepair
from p2p_diloco.island.store import FragmentStore
from p2p_diloco.island.transfer import StateTransfer, reported_bases, vouched_bases
from p2p_diloco.net.records import IslandProgress

logger = logging.getLogger(__name__)


def check_fingerprint(others: list[IslandProgress], fingerprint: str, run_id: str) -> None:
    """Refuse to join a run whose training islands all have another fingerprint.

    :raises FingerprintMismatch: naming both fingerprints and what to change
    """
    training = [r for r in others if r.state == "training"]
    if training and all(r.fingerprint != fingerprint for r in training):
        theirs = ", ".join(sorted({r.fingerprint for r in training}))
        raise FingerprintMismatch(
            f"run {run_id!r} trains fingerprint {theirs} but this island has {fingerprint}: use the same "
            "--preset/--config/--tokenizer/--data and outer settings as the swarm, or another --run-id"
        )


def join_from_peers(donors: list[IslandProgress], *, transfer: StateTransfer, store: FragmentStore, learner,
                    events: Callable[[dict], None], timeout: float, stop: threading.Event,
                    read_donors: Optional[Callable[[], list[IslandProgress]]] = None,
                    distrusted: Callable[[str], bool] = lambda island: False, patience: float = math.inf) -> None:
    """Download the global parameters from the live ``donors`` and load them into ``learner``, or
    start from the seeded initial weights (the same on every island) when there are none or the
    download fails (the first round's base check reloads them then).

    With ``read_donors`` (their records, read afresh), only the state that the records of trusted
    donors vouch for is taken (:func:`p2p_diloco.island.transfer.vouched_bases`). When they vouch
    for none of a fragment's states for ``patience`` seconds (islands on forks that no round has
    healed, or the only trusted donor died mid-download), any state that a trusted donor's record
    shows, or, when no trusted donor reports the fragment, any that a record shows: whichever the
    first donor to answer serves. A joiner is never held off for good (docs/SECURITY.md, "Joiners
    among forks").

    :param timeout: seconds for the whole download
    :param distrusted: whether an island's record does not count at first (flagged islands)
    :param patience: seconds to wait for the trusted records to agree, from the start of the download
    :raises Interrupted: ``stop`` was set while downloading
    """
    num_fragments = store.num_fragments

    def targets() -> list[Optional[frozenset]]:
        records = [(r.island, r.fragment_versions, r.fragment_hashes) for r in read_donors()]
        trusted = [(v, h) for island, v, h in records if not distrusted(island)]
        chosen = [frozenset([base]) if base else None for base in vouched_bases(trusted, num_fragments)]
        if time.monotonic() - started >= patience:
            shown, anyone = reported_bases(trusted, num_fragments), reported_bases([(v, h) for _, v, h in records],
                                                                                   num_fragments)
            chosen = [mine or theirs or everyone or None for mine, theirs, everyone in zip(chosen, shown, anyone)]
        return chosen

    if donors:
        logger.info("joining: downloading global parameters from %d live island(s)", len(donors))
        events({"event": "join_start", "donors": sorted(r.island for r in donors)})
        started = time.monotonic()
        if transfer.load_all(timeout=timeout, stop=stop, targets=targets if read_donors else None):
            for p in range(store.num_fragments):
                learner.load_global(p, store.global_params(p))
            logger.info("joined at fragment versions %s", store.versions)
            return
        if stop.is_set():
            raise Interrupted("interrupted while downloading the global parameters")
        logger.warning("could not download the global parameters; starting from the initial weights "
                       "(the first round's base check reloads them)")
    store.initialize([learner.read(p) for p in range(store.num_fragments)])


def find_checkpoint(directory: str, fingerprint: str) -> tuple[Optional[ckpt.IslandCheckpoint], Optional[Path]]:
    """The newest valid checkpoint of this run in ``directory`` (None, None if there is none).

    :raises ConfigError: the folder's newest checkpoint belongs to another configuration
    """
    try:
        saved, path = ckpt.load_newest(directory, fingerprint=fingerprint)
    except ckpt.CheckpointMismatch as e:
        raise ConfigError(f"--checkpoint-dir: {e}; use another folder for this configuration") from None
    if saved is not None:
        logger.info("resuming from %s (inner step %d, fragment versions %s)", path, saved.meta["inner_step"],
                    [f.version for f in saved.fragments])
    return saved, path


def restore_from_checkpoint(saved: ckpt.IslandCheckpoint, path: Path, *, store: FragmentStore, learner, sampler,
                            repair: BaseRepair, events: Callable[[dict], None]) -> None:
    """Continue from a checkpoint: global states, then the inner state and the data position. A swarm
    that moved on meanwhile is caught up by the first round's base check, which keeps the progress
    made since the restart but not the checkpoint's, which may be in the swarm already
    (:meth:`BaseRepair.resumed`).

    :raises ConfigError: the checkpoint does not fit this model
    """
    try:
        store.restore(saved.fragments)
        learner.restore(saved.params, saved.optimizer, saved.scheduler, saved.meta)
    except (ValueError, KeyError) as e:
        raise ConfigError(f"--checkpoint-dir: {path} does not fit this model ({e})") from None
    if saved.meta.get("sampler"):
        sampler.seek(saved.meta["sampler"])
    for p, version in enumerate(store.versions):
        repair.resumed(p, version, learner.read(p), (learner.stats.tokens, learner.stats.inner_steps))
    events({"event": "resume", "path": str(path), "inner_step": saved.meta["inner_step"], "versions": store.versions,
            "batches_drawn": sampler.batches_drawn})
