"""Atomic file writes: every file the project writes for others to read (checkpoints, summaries,
reports, downloaded assets) goes through a temporary file in the same folder, fsync, and a rename,
so a reader or a crash never sees half a file."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Iterator, Union

PathLike = Union[str, "os.PathLike[str]"]


@contextlib.contextmanager
def atomic_path(path: PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path`` for a writer that takes a file name (e.g. safetensors);
    on success it is fsynced and renamed over ``path`` (the folder fsynced too), on failure removed.

    :raises OSError: if the folder is not writable or the disk is full (nothing partial is left)
    """
    target = Path(path).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
        folder = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_bytes(path: PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically; returns the path."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_text(path: PathLike, text: str) -> Path:
    """Write UTF-8 ``text`` to ``path`` atomically; returns the path."""
    return write_bytes(path, text.encode("utf-8"))


def write_json(path: PathLike, payload) -> Path:
    """Write ``payload`` as indented JSON (with a final newline) to ``path`` atomically."""
    return write_text(path, json.dumps(payload, indent=2) + "\n")
