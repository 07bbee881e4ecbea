"""Island checkpoints: the global state (Theta_p, outer momentum m_p, versions of every fragment) and
the island's inner state (its parameters, AdamW moments, learning-rate schedule position, counters
and data-sampler position) in one safetensors file.

Files are written atomically (a temporary file in the same folder, fsync, rename) and carry a hash of
every tensor in their metadata, checked on load: a truncated or corrupted file is reported and
skipped in favour of the previous one, never loaded. The newest ``keep`` files are kept.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from p2p_diloco.outer import tensors_hash

logger = logging.getLogger(__name__)

FORMAT = 1
PREFIX, SUFFIX = "ckpt-", ".safetensors"
META_KEY = "p2p_diloco"


class CheckpointError(Exception):
    """A checkpoint file that cannot be used: unreadable, truncated, corrupted or from another run."""


class CheckpointMismatch(CheckpointError):
    """A valid checkpoint of another run (another fingerprint)."""


@dataclass
class GlobalFragment:
    """One fragment's global state as saved: Theta_p and m_p (fp32 CPU), version, hash, support."""

    theta: list[torch.Tensor]
    momentum: list[torch.Tensor]
    version: int
    hash: str
    support: int = 1


@dataclass
class IslandCheckpoint:
    """Everything an island needs to resume where it stopped.

    ``params`` and the optimizer moments are keyed by parameter name; tensors are CPU copies.
    ``meta`` holds JSON-serialisable scalars: counters, the scheduler step, the sampler's bit-generator
    state, loss figures.
    """

    fingerprint: str
    island: str
    fragments: list[GlobalFragment]
    params: dict[str, torch.Tensor]
    exp_avg: dict[str, torch.Tensor] = field(default_factory=dict)
    exp_avg_sq: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)


def _tensors(checkpoint: IslandCheckpoint) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for p, fragment in enumerate(checkpoint.fragments):
        for i, (theta, momentum) in enumerate(zip(fragment.theta, fragment.momentum, strict=True)):
            tensors[f"global.{p}.{i}.theta"] = theta
            tensors[f"global.{p}.{i}.momentum"] = momentum
    for name, tensor in checkpoint.params.items():
        tensors[f"param.{name}"] = tensor
    for name, tensor in checkpoint.exp_avg.items():
        tensors[f"exp_avg.{name}"] = tensor
    for name, tensor in checkpoint.exp_avg_sq.items():
        tensors[f"exp_avg_sq.{name}"] = tensor
    return {key: tensor.detach().to("cpu").contiguous() for key, tensor in tensors.items()}


def save_checkpoint(directory: str | Path, checkpoint: IslandCheckpoint, *, keep: int = 3) -> Path:
    """Write ``checkpoint`` as ``<directory>/ckpt-<ms>-<step>.safetensors`` atomically; keep the
    newest ``keep`` files.

    :returns: the file written
    :raises OSError: if the folder is not writable or the disk is full (no partial file is left)
    """
    from safetensors.torch import save_file

    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = _tensors(checkpoint)
    meta = {
        "format": FORMAT,
        "fingerprint": checkpoint.fingerprint,
        "island": checkpoint.island,
        "fragments": [{"count": len(f.theta), "version": f.version, "hash": f.hash, "support": f.support}
                      for f in checkpoint.fragments],
        "payload": tensors_hash(tensors[key] for key in sorted(tensors)),
        "saved": time.time(),
        **checkpoint.meta,
    }
    step = int(checkpoint.meta.get("inner_step", 0))
    target = folder / f"{PREFIX}{int(time.time() * 1000):013d}-{step:09d}{SUFFIX}"
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=SUFFIX)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={META_KEY: json.dumps(meta)})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    for old in list_checkpoints(folder)[keep:]:
        try:
            old.unlink()
        except OSError as e:
            logger.warning("could not remove old checkpoint %s: %s", old, e)
    return target


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Checkpoint files in ``directory``, newest first (by the time in their names)."""
    folder = Path(directory)
    if not folder.is_dir():
        return []
    return sorted((f for f in folder.glob(f"{PREFIX}*{SUFFIX}") if f.is_file()), key=lambda f: f.name, reverse=True)


def load_checkpoint(path: str | Path, *, fingerprint: Optional[str] = None) -> IslandCheckpoint:
    """Read and verify one checkpoint.

    :param fingerprint: if given, the checkpoint must come from a run with this fingerprint
    :raises CheckpointError: unreadable, truncated or corrupted file (tensor hash mismatch), an
        unknown format, or another fingerprint
    """
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {})[META_KEY])
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except CheckpointError:
        raise
    except Exception as e:  # safetensors raises its own errors on truncated or malformed files
        raise CheckpointError(f"{path} is unreadable or truncated ({type(e).__name__}: {e})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {meta.get('format')!r}, expected {FORMAT}")
    if tensors_hash(tensors[key] for key in sorted(tensors)) != meta.get("payload"):
        raise CheckpointError(f"{path} is corrupted: its tensors do not match the hash saved with them")
    if fingerprint is not None and meta.get("fingerprint") != fingerprint:
        raise CheckpointMismatch(
            f"{path} belongs to a run with fingerprint {meta.get('fingerprint')}, not {fingerprint} "
            "(another model, tokenizer or outer setting)"
        )
    fragments = []
    for p, info in enumerate(meta.pop("fragments")):
        fragments.append(GlobalFragment(
            theta=[tensors[f"global.{p}.{i}.theta"] for i in range(info["count"])],
            momentum=[tensors[f"global.{p}.{i}.momentum"] for i in range(info["count"])],
            version=info["version"], hash=info["hash"], support=info.get("support", 1),
        ))

    def section(prefix: str) -> dict[str, torch.Tensor]:
        return {key[len(prefix):]: value for key, value in tensors.items() if key.startswith(prefix)}

    return IslandCheckpoint(
        fingerprint=meta.pop("fingerprint"), island=meta.pop("island"), fragments=fragments,
        params=section("param."), exp_avg=section("exp_avg."), exp_avg_sq=section("exp_avg_sq."), meta=meta,
    )


def load_newest(directory: str | Path, *, fingerprint: str) -> tuple[Optional[IslandCheckpoint], Optional[Path]]:
    """The newest usable checkpoint in ``directory``; unusable ones are logged and skipped.

    :returns: (checkpoint, its path), or (None, None) when there is none
    :raises CheckpointMismatch: when the newest readable checkpoint belongs to another run
        (resuming from an older one of this run would silently go back in time)
    """
    for path in list_checkpoints(directory):
        try:
            return load_checkpoint(path, fingerprint=fingerprint), path
        except CheckpointMismatch:
            raise
        except CheckpointError as e:
            logger.error("skipping checkpoint: %s", e)
    return None, None
