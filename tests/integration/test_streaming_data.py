"""Data larger than memory: `p2p-diloco prepare-data` streams a 160 MB corpus generated here into
a token folder, and neither preparing it nor drawing batches from it holds the corpus in memory.
(The 1 GB measurement is a benchmark: scripts/bench_data.py, docs/BENCHMARKS.md.)"""

from __future__ import annotations

import json

import psutil
import pytest

from p2p_diloco.island import data
from p2p_diloco.lab.corpora import WORDS, peak_rss, word_corpus, word_tokenizer

pytestmark = pytest.mark.integration


def _peak_rss(*args: str) -> int:
    done, peak = peak_rss(*args)
    assert done.returncode == 0, done.stderr[-2000:]
    return peak


def test_a_corpus_larger_than_the_memory_bound_is_prepared_and_sampled_in_bounded_memory(tmp_path):
    tokenizer = tmp_path / "words.json"
    word_tokenizer(tokenizer)
    small_words, big_words = word_corpus(tmp_path / "small.jsonl", 1), word_corpus(tmp_path / "big.jsonl", 160)
    big_bytes = (tmp_path / "big.jsonl").stat().st_size
    small = _peak_rss("prepare-data", "--data", str(tmp_path / "small.jsonl"), "--tokenizer", str(tokenizer),
                      "--out", str(tmp_path / "small.tokens"))
    big = _peak_rss("prepare-data", "--data", str(tmp_path / "big.jsonl"), "--tokenizer", str(tokenizer),
                    "--out", str(tmp_path / "big.tokens"))
    print(f"prepare-data peak RSS: {small / 2**20:.0f} MiB for 1 MB, {big / 2**20:.0f} MiB for "
          f"{big_bytes / 2**20:.0f} MiB of text")
    assert big - small < big_bytes / 8  # memory does not grow with the corpus (20 MB of 160)
    meta = json.loads((tmp_path / "big.tokens" / "meta.json").read_text())
    lines = meta["num_docs"]
    assert meta["dtype"] == "uint32" and meta["train_tokens"] + meta["eval_tokens"] == big_words + 2 * lines
    train_bytes = (tmp_path / "big.tokens" / "train.bin").stat().st_size
    assert train_bytes == 4 * meta["train_tokens"] > 48 << 20

    corpus = data.load_corpus(str(tmp_path / "big.tokens"), "", 0, 0.05)
    sampler = data.BatchSampler(corpus.shard(0, 1), 16, 256, seed=0, island="s")
    sampler.next_batch()
    this = psutil.Process()
    before = this.memory_info().rss
    for _ in range(500):
        batch = sampler.next_batch()
    grown = this.memory_info().rss - before
    print(f"sampling 500 batches: RSS +{grown / 2**20:.1f} MiB over a {train_bytes / 2**20:.0f} MiB train.bin")
    assert grown < train_bytes / 16 and int(batch.max()) < WORDS + 1  # (4 MB of 64)
    assert small_words > 0
