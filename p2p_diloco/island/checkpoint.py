"""Island checkpoints: the global state (Theta_p, outer momentum m_p, versions of every fragment) and
the island's inner state (its parameters, the AdamW and schedule ``state_dict()``, counters and
data-sampler position) in one safetensors file, and the :class:`Checkpointer` that takes them.

Files are written atomically (:mod:`p2p_diloco.files`) and carry a hash of every tensor in their
metadata, checked on load: a truncated or corrupted file is reported and skipped in favour of the
previous one, never loaded. The newest ``keep`` files are kept.
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from p2p_diloco.algo.outer import tensors_hash
from p2p_diloco.files import atomic_path

logger = logging.getLogger(__name__)

FORMAT = 2  # 2: the optimizer and schedule as torch state_dicts
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

    ``params`` are keyed by parameter name; ``optimizer`` and ``scheduler`` are torch
    ``state_dict()`` s (tensors on the CPU); ``meta`` holds JSON-serialisable scalars: counters, the
    sampler's bit-generator state, loss figures.
    """

    fingerprint: str
    island: str
    fragments: list[GlobalFragment]
    params: dict[str, torch.Tensor]
    optimizer: dict = field(default_factory=lambda: {"state": {}, "param_groups": []})
    scheduler: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)


def _tensors(checkpoint: IslandCheckpoint) -> tuple[dict[str, torch.Tensor], dict]:
    """The checkpoint's tensors by key, and the optimizer state's other values (JSON)."""
    tensors: dict[str, torch.Tensor] = {}
    for p, fragment in enumerate(checkpoint.fragments):
        for i, (theta, momentum) in enumerate(zip(fragment.theta, fragment.momentum, strict=True)):
            tensors[f"global.{p}.{i}.theta"] = theta
            tensors[f"global.{p}.{i}.momentum"] = momentum
    for name, tensor in checkpoint.params.items():
        tensors[f"param.{name}"] = tensor
    scalars: dict = {}
    for index, state in checkpoint.optimizer["state"].items():
        for key, value in state.items():
            if torch.is_tensor(value):
                tensors[f"optim.{index}.{key}"] = value
            else:
                scalars.setdefault(str(index), {})[key] = value
    return {key: tensor.detach().to("cpu").contiguous() for key, tensor in tensors.items()}, scalars


def save_checkpoint(directory: str | Path, checkpoint: IslandCheckpoint, *, keep: int = 3) -> Path:
    """Write ``checkpoint`` as ``<directory>/ckpt-<ms>-<step>.safetensors`` atomically; keep the
    newest ``keep`` files.

    :returns: the file written
    :raises OSError: if the folder is not writable or the disk is full (no partial file is left)
    """
    from safetensors.torch import save_file

    folder = Path(directory)
    tensors, scalars = _tensors(checkpoint)
    meta = {
        "format": FORMAT,
        "fingerprint": checkpoint.fingerprint,
        "island": checkpoint.island,
        "fragments": [{"count": len(f.theta), "version": f.version, "hash": f.hash, "support": f.support}
                      for f in checkpoint.fragments],
        "optimizer": {"param_groups": checkpoint.optimizer["param_groups"], "scalars": scalars},
        "scheduler": checkpoint.scheduler,
        "payload": tensors_hash(tensors[key] for key in sorted(tensors)),
        "saved": time.time(),
        **checkpoint.meta,
    }
    step = int(checkpoint.meta.get("inner_step", 0))
    target = folder / f"{PREFIX}{int(time.time() * 1000):013d}-{step:09d}{SUFFIX}"
    with atomic_path(target) as tmp:
        save_file(tensors, str(tmp), metadata={META_KEY: json.dumps(meta)})
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
    saved = meta.pop("optimizer")
    state: dict[int, dict] = {int(index): dict(values) for index, values in saved["scalars"].items()}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, index, name = key.split(".", 2)
            state.setdefault(int(index), {})[name] = value
    return IslandCheckpoint(
        fingerprint=meta.pop("fingerprint"), island=meta.pop("island"), fragments=fragments,
        params={key[len("param."):]: value for key, value in tensors.items() if key.startswith("param.")},
        optimizer={"state": state, "param_groups": saved["param_groups"]}, scheduler=meta.pop("scheduler"), meta=meta,
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


class Checkpointer:
    """An island's checkpoints: every ``every`` seconds one is captured at a step boundary (on the
    learner thread) and written in the background (skipped while the previous write still runs),
    and a last one at exit.

    :param directory: the checkpoint folder
    :param every: seconds between two periodic checkpoints
    :param keep: newest files kept
    :param capture: returns a consistent :class:`IslandCheckpoint` (called on the learner thread)
    :param events: takes ``checkpoint`` events (the island's JSONL log)
    """

    def __init__(self, directory: str, *, every: float, keep: int, capture: Callable[[], IslandCheckpoint],
                 events: Callable[[dict], None]):
        self.directory, self.every, self.keep, self.capture, self.events = directory, every, keep, capture, events
        self.last: Optional[str] = None  # the newest file written
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._writing: Optional[Future] = None
        self._next = time.monotonic() + every

    def maybe(self) -> None:
        """Between two inner steps: capture now if a checkpoint is due, write it in the background."""
        if time.monotonic() < self._next or (self._writing is not None and not self._writing.done()):
            return
        self._next = time.monotonic() + self.every
        checkpoint = self.capture()
        self._writing = self._writer.submit(self.save, checkpoint)
        self._writing.add_done_callback(lambda f: f.exception() and logger.error("checkpoint failed: %r", f.exception()))

    def final(self) -> None:
        """The exit checkpoint, after the periodic write in flight (if any) has finished."""
        if self._writing is not None:
            try:
                self._writing.result()
            except Exception as e:
                logger.warning("the periodic checkpoint failed: %r", e)
        self.save(self.capture())

    def save(self, checkpoint: IslandCheckpoint) -> Path:
        """Write one checkpoint now and log its event."""
        started = time.monotonic()
        path = save_checkpoint(self.directory, checkpoint, keep=self.keep)
        self.last = str(path)
        self.events({"event": "checkpoint", "path": str(path), "seconds": time.monotonic() - started,
                     "bytes": path.stat().st_size, "inner_step": checkpoint.meta["inner_step"],
                     "versions": [f.version for f in checkpoint.fragments]})
        return path

    def close(self) -> None:
        """Wait for a write in flight and end the writer thread."""
        self._writer.shutdown(wait=True)
