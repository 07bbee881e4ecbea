"""Generated corpora for the streaming-data test and benchmark (docs/BENCHMARKS.md, "Data"): random
words of a vocabulary past 65,536 (so ids are stored as uint32) with a word-level tokenizer, so that
tokenizing is fast and the figures measure our streaming, not BPE; and a command's peak memory."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from p2p_diloco.island.data import EOS_TOKEN

WORDS = 70_000


def word_tokenizer(path: Path) -> None:
    """Write a word-level ``tokenizer.json`` for ``word00000`` .. ``word69999`` (and EOS, UNK)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"word{i:05d}": i for i in range(WORDS)} | {EOS_TOKEN: WORDS, "[UNK]": WORDS + 1}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path.write_text(tokenizer.to_str())


def word_corpus(path: Path, megabytes: int) -> int:
    """Write a ``.jsonl`` file of about ``megabytes`` MiB of random words, 2,000 a line (seed 0);
    returns how many words it holds."""
    rng, words, written = np.random.default_rng(0), np.array([f"word{i:05d}" for i in range(WORDS)]), 0
    with open(path, "w") as handle:
        while handle.tell() < megabytes << 20:
            lines = words[rng.integers(0, WORDS, size=(50, 2000))]
            handle.write("".join(json.dumps({"text": " ".join(line)}) + "\n" for line in lines))
            written += lines.size
    return written


def peak_rss(*args: str) -> tuple[subprocess.CompletedProcess, int]:
    """Run ``p2p-diloco ARGS``; returns its completed process (text output) and its peak resident
    memory in bytes, sampled every 20 ms."""
    import psutil

    popen = subprocess.Popen([sys.executable, "-m", "p2p_diloco", *args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    process, peak = psutil.Process(popen.pid), 0
    while popen.poll() is None:
        try:
            peak = max(peak, process.memory_info().rss)
        except psutil.NoSuchProcess:
            break
        time.sleep(0.02)
    out, err = popen.communicate()
    return subprocess.CompletedProcess(popen.args, popen.returncode, out, err), peak
