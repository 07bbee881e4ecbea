"""Token folders: a corpus tokenized once into flat, memory-mapped token files (docs/DESIGN.md, "Data").

A *token folder* holds ``train.bin`` and ``eval.bin`` (flat little-endian ``uint16`` token ids, or
``uint32`` when the vocabulary exceeds 65,536), the ``tokenizer.json`` that made them and
``meta.json`` (:data:`FORMAT`, dtype, counts, the tokenizer's and documents' sha256). It is written
by :func:`write_token_folder` (``p2p-diloco prepare-data``, or the cache of a text corpus) with
memory bounded by one batch of documents, never by the corpus, and read by
:func:`open_token_folder` as :class:`TokenFile` s: training reads the bytes of the windows it draws,
nothing more. nanoGPT's layout (``train.bin`` and ``val.bin`` of ``uint16``, no ``meta.json``) is read too.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

import numpy as np

from p2p_diloco.errors import UserError

FORMAT = "p2p_diloco.tokens/1"
BATCH_CHARS = 1 << 20  # characters of text tokenized at once: bounds the memory of preparing
BATCH_DOCS = 1024
CHECK_CHUNK = 1 << 24  # tokens read at a time when checking a foreign folder's ids


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id of a ``vocab_size`` vocabulary fits, else ``uint32``."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class TokenFile:
    """A read-only range of a flat token file, read on demand with ``os.pread``: drawing windows
    reads their bytes only, and nothing of the file stays resident in this process (a ``numpy.memmap``
    would map the pages around every fault, and count them in its resident memory).

    Supports ``len``, slicing (a view of the same file), :meth:`windows`, :meth:`read` and
    ``numpy.asarray`` (the whole range in memory: for small files and tests).
    """

    def __init__(self, path: Path, dtype: np.dtype, start: int = 0, stop: Optional[int] = None):
        self.path, self.dtype = Path(path), np.dtype(dtype)
        self._fd = os.open(self.path, os.O_RDONLY)
        total = os.fstat(self._fd).st_size // self.dtype.itemsize
        self.start, self.stop = start, total if stop is None else stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: slice) -> "TokenFile":
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("a TokenFile takes contiguous slices only; use windows() to gather")
        start, stop, _ = index.indices(len(self))
        view = TokenFile.__new__(TokenFile)
        view.path, view.dtype, view._fd = self.path, self.dtype, self._fd
        view.start, view.stop = self.start + start, self.start + max(start, stop)
        return view

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of this range as an array of the file's dtype."""
        start, stop = max(0, start), min(len(self), stop)
        if stop <= start:
            return np.empty(0, dtype=self.dtype)
        size = self.dtype.itemsize
        raw = os.pread(self._fd, (stop - start) * size, (self.start + start) * size)
        return np.frombuffer(raw, dtype=self.dtype)

    def windows(self, starts: np.ndarray, width: int) -> np.ndarray:
        """A (len(starts), width) array: row i is tokens ``[starts[i], starts[i] + width)``.

        :raises ValueError: if a window leaves the range
        """
        rows = [self.read(int(s), int(s) + width) for s in starts]
        if any(len(row) != width for row in rows):
            raise ValueError(f"a window of {width} tokens leaves the range of {len(self)}")
        return np.stack(rows) if rows else np.empty((0, width), dtype=self.dtype)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        array = self.read(0, len(self))
        return array if dtype is None else array.astype(dtype)

    def tolist(self) -> list[int]:
        return np.asarray(self).tolist()


@dataclass
class TokenFolder:
    """An opened token folder: ``train`` and ``eval`` are read-only :class:`TokenFile` s."""

    train: TokenFile  # (N_train,) uint16 or uint32
    eval: TokenFile  # (N_eval,)
    meta: dict


def is_token_folder(path: Path) -> bool:
    """True for a folder with a ``train.bin`` (ours with ``meta.json``, or nanoGPT's)."""
    return path.is_dir() and (path / "train.bin").is_file()


def write_token_folder(docs: Iterable[str], tokenizer, eos_id: int, folder: str | os.PathLike, eval_fraction: float,
                       *, progress: Optional[Callable[[int], None]] = None) -> dict:
    """Tokenize ``docs`` into a token folder: each document's first ``1 - eval_fraction`` of tokens go
    to ``train.bin``, its tail to ``eval.bin``, each part followed by ``eos_id``, so held-out text is
    never trained on. Batches of about :data:`BATCH_CHARS` characters are encoded on the tokenizers
    library's threads and appended to the files; the folder appears (renamed from ``FOLDER.partial-*``)
    only when complete, so an interrupted run leaves no half folder behind.

    :param docs: the documents, read once, in order
    :param tokenizer: a ``tokenizers.Tokenizer``
    :param progress: called with the characters done since the previous call
    :returns: the folder's ``meta.json`` content
    :raises UserError: if the folder exists, cannot be written, or no document has text
    """
    target = Path(folder).expanduser()
    if target.exists():
        raise UserError(f"{target} already exists: choose another output folder or remove it")
    try:  # a folder of its own (islands sharing a cache may race): renamed into place when complete
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f"{target.name}.partial-", dir=target.parent))
    except OSError as e:
        raise UserError(f"cannot create a folder beside {target}: {e.strerror or e}") from None
    dtype = token_dtype(tokenizer.get_vocab_size())
    digest, counts = hashlib.sha256(), {"train": 0, "eval": 0, "docs": 0}
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # (fast: without offsets)
    eos = np.array([eos_id], dtype=dtype)
    try:
        with open(partial / "train.bin", "wb") as train, open(partial / "eval.bin", "wb") as held_out:
            def flush(batch: list[str]) -> None:
                for encoding in encode(batch):
                    ids = np.asarray(encoding.ids, dtype=dtype)
                    cut = len(ids) - max(1, int(round(len(ids) * eval_fraction)))
                    for handle, part, key in ((train, ids[:cut], "train"), (held_out, ids[cut:], "eval")):
                        handle.write(part.tobytes())
                        handle.write(eos.tobytes())
                        counts[key] += len(part) + 1
                counts["docs"] += len(batch)
                if progress:
                    progress(sum(map(len, batch)))

            batch, chars = [], 0
            for doc in docs:
                encoded = doc.encode("utf-8", errors="replace")
                digest.update(len(encoded).to_bytes(8, "little"))
                digest.update(encoded)
                batch.append(doc)
                chars += len(doc)
                if chars >= BATCH_CHARS or len(batch) >= BATCH_DOCS:
                    flush(batch)
                    batch, chars = [], 0
            if batch:
                flush(batch)
        if not counts["docs"]:
            raise UserError("no text found to tokenize")
        serialized = tokenizer.to_str()
        (partial / "tokenizer.json").write_text(serialized, encoding="utf-8")
        meta = {"format": FORMAT, "dtype": dtype.name, "eos_id": int(eos_id), "eval_fraction": eval_fraction,
                "vocab_size": tokenizer.get_vocab_size(), "train_tokens": counts["train"],
                "eval_tokens": counts["eval"], "num_docs": counts["docs"], "docs_sha": digest.hexdigest(),
                "tokenizer_sha": hashlib.sha256(serialized.encode("utf-8")).hexdigest()}
        (partial / "meta.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
        os.replace(partial, target)
    except OSError as e:
        shutil.rmtree(partial, ignore_errors=True)
        raise UserError(f"cannot write {partial}: {e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return meta


def _memmap(path: Path, dtype: np.dtype, what: str) -> TokenFile:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise UserError(f"--data {path.parent}: {path.name} is missing ({what})") from None
    if size == 0 or size % dtype.itemsize:
        raise UserError(f"--data {path.parent}: {path.name} holds {size} bytes, not a whole number of "
                        f"{dtype.name} tokens ({what})")
    return TokenFile(path, dtype)


def open_token_folder(folder: str | os.PathLike, *, vocab_size: int, tokenizer_sha: str = "",
                      dtype: str = "uint16") -> TokenFolder:
    """Open a token folder's ``train.bin`` and ``eval.bin`` (nanoGPT's ``val.bin``) for reading on demand.

    Our folders say their dtype and vocabulary in ``meta.json``; a folder without one (nanoGPT's) is
    read as ``dtype`` and its ids are checked once against ``vocab_size``, a chunk at a time.

    :param vocab_size: the run's tokenizer's vocabulary: every id must be below it
    :param tokenizer_sha: the run's tokenizer (sha256 of its JSON): one of our folders must have been
        made with it
    :raises UserError: missing or malformed files, ids outside the vocabulary, a tokenizer mismatch
    """
    path = Path(folder).expanduser()
    meta_path = path / "meta.json"
    if meta_path.exists():
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise UserError(f"--data {folder}: meta.json is unreadable ({e})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise UserError(f"--data {folder}: meta.json is not a {FORMAT} token folder (format "
                            f"{meta.get('format') if isinstance(meta, dict) else None!r}); prepare it again with "
                            "`p2p-diloco prepare-data`")
        made_with = meta.get("tokenizer_sha")
        if tokenizer_sha and made_with != tokenizer_sha:
            raise UserError(f"--data {folder}: its tokens were made with another tokenizer (sha {str(made_with)[:12]}, "
                            f"not {tokenizer_sha[:12]}): drop --tokenizer/--model's tokenizer or prepare it again")
        if int(meta.get("vocab_size", 0)) > vocab_size:
            raise UserError(f"--data {folder}: its tokens come from a vocabulary of {meta['vocab_size']}, larger than "
                            f"this run's {vocab_size}: use the folder's tokenizer.json (--tokenizer)")
        missing = [key for key in ("dtype", "train_tokens", "eval_tokens", "num_docs", "docs_sha") if key not in meta]
        if missing or meta["dtype"] not in ("uint16", "uint32"):
            raise UserError(f"--data {folder}: meta.json lacks {', '.join(missing) or 'a uint16/uint32 dtype'}: "
                            "prepare it again with `p2p-diloco prepare-data`")
        dtype_ = np.dtype(meta["dtype"])
        train, held_out = _memmap(path / "train.bin", dtype_, "the training tokens"), _memmap(
            path / "eval.bin", dtype_, "the held-out tokens")
        if (len(train), len(held_out)) != (meta["train_tokens"], meta["eval_tokens"]):
            raise UserError(f"--data {folder}: train.bin/eval.bin hold {len(train)}/{len(held_out)} tokens, meta.json "
                            f"says {meta['train_tokens']}/{meta['eval_tokens']}: truncated? prepare it again")
        return TokenFolder(train=train, eval=held_out, meta=meta)
    dtype_ = np.dtype(dtype)
    eval_name = "val.bin" if (path / "val.bin").exists() else "eval.bin"
    train = _memmap(path / "train.bin", dtype_, "the training tokens")
    held_out = _memmap(path / eval_name, dtype_, "the held-out tokens (nanoGPT's val.bin)")
    for name, tokens in (("train.bin", train), (eval_name, held_out)):
        for start in range(0, len(tokens), CHECK_CHUNK):
            top = int(tokens.read(start, start + CHECK_CHUNK).max())
            if top >= vocab_size:
                raise UserError(f"--data {folder}: {name} holds token id {top}, outside this run's vocabulary of "
                                f"{vocab_size}: pass the tokenizer the files were made with (--tokenizer or --model)")
    meta = {"format": "nanogpt", "dtype": dtype_.name, "train_tokens": len(train), "eval_tokens": len(held_out),
            "num_docs": 0, "docs_sha": f"nanogpt-{len(train)}-{len(held_out)}"}
    return TokenFolder(train=train, eval=held_out, meta=meta)
