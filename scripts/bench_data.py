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
import sys
import time
from pathlib import Path

from p2p_diloco.lab.corpora import peak_rss, word_corpus, word_tokenizer



def _prepare(corpus: Path, tokenizer: Path, out: Path) -> dict:
    started = time.perf_counter()
    done, peak = peak_rss("prepare-data", "--data", str(corpus), "--tokenizer", str(tokenizer), "--out", str(out))
    if done.returncode:
        raise SystemExit(f"prepare-data exited {done.returncode}: {done.stderr[-2000:]}")
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
    word_tokenizer(tokenizer)
    results = {}
    for name, megabytes in (("small", 1), ("big", args.megabytes)):
        word_corpus(out / f"{name}.jsonl", megabytes)
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
