#!/usr/bin/env python
"""Streaming data at 1 GB: `p2p-diloco prepare-data` on a generated corpus of --megabytes of text
(beside the same on 1 MB, so the difference is what the corpus costs), then batches drawn from the
token folder; prints one JSON line (peak resident memory in MiB, MB/s, tokens) and writes it to --out.

    .venv/bin/python scripts/bench_data.py --megabytes 1024 --out /tmp/bench_data

The corpus is random words of a 70,000-word vocabulary (uint32 ids) and a word-level tokenizer, so
tokenizing is fast and the figures measure our streaming, not BPE (docs/BENCHMARKS.md, "Data").
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

WORDS = 70_000


def _tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"word{i:05d}": i for i in range(WORDS)} | {"<|endoftext|>": WORDS, "[UNK]": WORDS + 1}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path.write_text(tokenizer.to_str())


def _corpus(path: Path, megabytes: int) -> None:
    import numpy as np

    rng, words = np.random.default_rng(0), np.array([f"word{i:05d}" for i in range(WORDS)])
    with open(path, "w") as handle:
        while handle.tell() < megabytes << 20:
            lines = words[rng.integers(0, WORDS, size=(50, 2000))]
            handle.write("".join(json.dumps({"text": " ".join(line)}) + "\n" for line in lines))


def _prepare(corpus: Path, tokenizer: Path, out: Path) -> dict:
    import psutil

    started = time.perf_counter()
    popen = subprocess.Popen([sys.executable, "-m", "p2p_diloco", "prepare-data", "--data", str(corpus),
                              "--tokenizer", str(tokenizer), "--out", str(out)], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    process, peak = psutil.Process(popen.pid), 0
    while popen.poll() is None:
        try:
            peak = max(peak, process.memory_info().rss)
        except psutil.NoSuchProcess:
            break
        time.sleep(0.02)
    popen.communicate()
    if popen.returncode:
        raise SystemExit(f"prepare-data exited {popen.returncode}")
    seconds = time.perf_counter() - started
    return {"text_mib": corpus.stat().st_size / 2**20, "peak_rss_mib": peak / 2**20, "seconds": seconds,
            "mb_per_second": corpus.stat().st_size / 1e6 / seconds,
            "train_tokens": json.loads((out / "meta.json").read_text())["train_tokens"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=int, default=1024, help="size of the generated corpus (default 1024)")
    parser.add_argument("--batches", type=int, default=2000, help="batches of 16 x 257 tokens to draw (default 2000)")
    parser.add_argument("--out", required=True, help="a folder for the corpus, the token folders and results.json")
    args = parser.parse_args()
    if args.megabytes < 2:
        parser.error("--megabytes must be at least 2")
    import psutil

    from p2p_diloco.island import data

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = out / "words.json"
    _tokenizer(tokenizer)
    results = {}
    for name, megabytes in (("small", 1), ("big", args.megabytes)):
        _corpus(out / f"{name}.jsonl", megabytes)
        results[name] = _prepare(out / f"{name}.jsonl", tokenizer, out / f"{name}.tokens")
    corpus = data.load_corpus(str(out / "big.tokens"), "", 0, 0.05)
    sampler = data.BatchSampler(corpus.shard(0, 1), 16, 256, seed=0, island="bench")
    sampler.next_batch()
    before, started = psutil.Process().memory_info().rss, time.perf_counter()
    for _ in range(args.batches):
        sampler.next_batch()
    results["sampling"] = {"batches": args.batches, "rss_growth_mib": (psutil.Process().memory_info().rss - before) / 2**20,
                           "batches_per_second": args.batches / (time.perf_counter() - started),
                           "train_bin_mib": (out / "big.tokens" / "train.bin").stat().st_size / 2**20}
    results["prepare_rss_growth_mib"] = results["big"]["peak_rss_mib"] - results["small"]["peak_rss_mib"]
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
