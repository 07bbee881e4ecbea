"""Corpora, tokenizer, split, shards and batches."""

import json

import numpy as np
import pytest
import torch

from p2p_diloco.island import data, tokens
from p2p_diloco.errors import UserError

TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. " * 40


def test_embedded_corpus_is_the_shakespeare_plays():
    docs = data.load_documents("")
    assert len(docs) == 42
    assert any(doc.startswith("HAMLET, PRINCE OF DENMARK") for doc in docs)


def test_txt_folder_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("first " * 50)
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "b.txt").write_text("second " * 50)
    assert data.load_documents(str(tmp_path / "a.txt")) == ["first " * 50]
    assert data.load_documents(str(tmp_path)) == ["first " * 50, "second " * 50]
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text(json.dumps({"text": "x y z"}) + "\n\n" + json.dumps({"text": "u v"}) + "\n")
    assert data.load_documents(str(jsonl)) == ["x y z", "u v"]


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "no such file"),
        ("{not json}\n", "line 1 is not valid JSON"),
        (json.dumps({"body": "x"}) + "\n", "no string field 'text'"),
        ("\n\n", "no text found"),
    ],
)
def test_bad_data_paths(tmp_path, content, message):
    path = tmp_path / "corpus.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UserError, match=message):
        data.load_documents(str(path))


def test_folder_without_txt(tmp_path):
    with pytest.raises(UserError, match="holds no .txt, .jsonl, .parquet or .arrow files"):
        data.load_documents(str(tmp_path))


def test_tokenizer_is_deterministic_and_cached(tmp_path, monkeypatch):
    docs = [TEXT, TEXT.upper()]
    first = data.train_bpe_tokenizer(docs, 300).to_str()
    second = data.train_bpe_tokenizer(docs, 300).to_str()
    assert first == second
    monkeypatch.setenv("P2P_DILOCO_CACHE", str(tmp_path))
    tokenizer, sha, eos = data.get_tokenizer(docs, "", 300, data.corpus_sha(docs))
    assert list(tmp_path.glob("bpe-300-*.json")) and eos == tokenizer.token_to_id(data.EOS_TOKEN)
    again, sha_again, _ = data.get_tokenizer(docs, "", 300, data.corpus_sha(docs))
    assert sha == sha_again and tokenizer.get_vocab_size() == 300


def test_explicit_tokenizer_errors(tmp_path):
    bad = tmp_path / "tok.json"
    bad.write_text("{}")
    with pytest.raises(UserError, match="not a tokenizers JSON"):
        data.get_tokenizer(["x"], str(bad), 300, "0" * 64)
    with pytest.raises(UserError, match="no such file"):
        data.get_tokenizer(["x"], str(tmp_path / "missing.json"), 300, "0" * 64)


def test_split_keeps_eval_text_out_of_training(tmp_path, monkeypatch):
    monkeypatch.setenv("P2P_DILOCO_CACHE", str(tmp_path / "cache"))
    corpus_file = tmp_path / "c.jsonl"
    docs = [" ".join(f"w{doc}_{i}" for i in range(400)) for doc in range(3)]
    corpus_file.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    corpus = data.load_corpus(str(corpus_file), "", 400, eval_fraction=0.1)
    assert len(corpus.eval) > 0 and len(corpus.train) > 5 * len(corpus.eval)
    tokenizer, _, _ = data.get_tokenizer(docs, "", 400, corpus.docs_sha)
    eval_text = tokenizer.decode(corpus.eval.tolist())
    train_text = tokenizer.decode(corpus.train.tolist())
    assert "w0_399" in eval_text and "w0_399" not in train_text  # tails are held out
    assert "w0_0 " in train_text and "w0_0 " not in eval_text


def test_shards_partition_the_training_stream():
    corpus = data.Corpus(train=np.arange(1000), eval=np.arange(10), vocab_size=5, tokenizer_sha="", docs_sha="",
                         num_docs=1)
    shards = [corpus.shard(i, 7) for i in range(7)]
    assert np.array_equal(np.concatenate(shards), corpus.train)
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    with pytest.raises(ValueError):
        corpus.shard(7, 7)
    assert data.default_shard_index("island-0", 8) == data.default_shard_index("island-0", 8)


def test_batches_are_deterministic_per_island():
    tokens = np.arange(5000)
    a1 = data.BatchSampler(tokens, 4, 16, seed=0, island="a").next_batch()
    a2 = data.BatchSampler(tokens, 4, 16, seed=0, island="a").next_batch()
    b = data.BatchSampler(tokens, 4, 16, seed=0, island="b").next_batch()
    assert a1.shape == (4, 17) and a1.dtype == torch.int64
    assert torch.equal(a1, a2) and not torch.equal(a1, b)
    assert torch.equal(a1[:, 1:] - a1[:, :-1], torch.ones(4, 16, dtype=torch.int64))  # contiguous windows
    with pytest.raises(UserError):
        data.BatchSampler(np.arange(10), 4, 16, seed=0, island="a")


def test_eval_batches_are_fixed():
    batches = data.eval_batches(np.arange(3000), num_batches=3, batch_size=4, seq_len=32)
    again = data.eval_batches(np.arange(3000), num_batches=3, batch_size=4, seq_len=32)
    assert len(batches) == 3 and all(b.shape == (4, 33) for b in batches)
    assert all(torch.equal(x, y) for x, y in zip(batches, again))
    with pytest.raises(UserError):
        data.eval_batches(np.arange(10), 1, 1, 32)


def test_parquet_arrow_and_datasets_folders_stream_their_text_column(tmp_path):
    import datasets  # the data extra, which ./scripts/test.sh installs
    texts = [f"document {i} " * 20 for i in range(5)]
    dataset = datasets.Dataset.from_dict({"text": texts, "id": list(range(5))})
    dataset.to_parquet(str(tmp_path / "c.parquet"))
    dataset.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": dataset}).save_to_disk(str(tmp_path / "saved_dict"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    for source in (tmp_path / "c.parquet", tmp_path / "saved", tmp_path / "saved_dict", arrow):
        assert data.load_documents(str(source)) == texts, source
    datasets.Dataset.from_dict({"body": texts}).to_parquet(str(tmp_path / "bad.parquet"))
    with pytest.raises(UserError, match="no column 'text'"):
        data.load_documents(str(tmp_path / "bad.parquet"))


def test_long_txt_files_are_read_in_pieces_cut_at_line_ends(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "TXT_PIECE", 100)
    lines = [f"line {i:04d} of the corpus" for i in range(40)]
    (tmp_path / "long.txt").write_text("\n".join(lines) + "\n")
    pieces = data.load_documents(str(tmp_path / "long.txt"))
    assert len(pieces) > 5 and "".join(pieces) == "\n".join(lines) + "\n"
    assert all(piece.endswith("\n") for piece in pieces)


def test_a_token_folder_holds_the_same_split_as_the_documents(tmp_path, monkeypatch):
    monkeypatch.setenv("P2P_DILOCO_CACHE", str(tmp_path / "cache"))
    docs = [" ".join(f"w{doc}_{i}" for i in range(300)) for doc in range(4)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    meta = data.prepare_corpus(str(tmp_path / "c.jsonl"), str(tmp_path / "tokens"), vocab_size=400, eval_fraction=0.1)
    assert sorted(p.name for p in (tmp_path / "tokens").iterdir()) == ["eval.bin", "meta.json", "tokenizer.json",
                                                                       "train.bin"]
    assert meta["dtype"] == "uint16" and meta["num_docs"] == 4
    folder = data.load_corpus(str(tmp_path / "tokens"), "", 0, 0.1)
    text = data.load_corpus(str(tmp_path / "c.jsonl"), "", 400, 0.1)
    assert isinstance(folder.train, tokens.TokenFile) and np.array_equal(folder.train, text.train)
    assert np.array_equal(folder.eval, text.eval) and folder.tokenizer_sha == text.tokenizer_sha
    assert meta["train_tokens"] == len(folder.train)
    with pytest.raises(UserError, match="already exists"):
        data.prepare_corpus(str(tmp_path / "c.jsonl"), str(tmp_path / "tokens"), vocab_size=400)
    other = tmp_path / "other.json"
    other.write_text(data.train_bpe_tokenizer(docs, 300).to_str())
    with pytest.raises(UserError, match="made with another tokenizer"):
        data.load_corpus(str(tmp_path / "tokens"), str(other), 0, 0.1)


def test_a_nanogpt_folder_is_memory_mapped_and_its_ids_checked(tmp_path, monkeypatch):
    monkeypatch.setenv("P2P_DILOCO_CACHE", str(tmp_path / "cache"))
    tokenizer = tmp_path / "tok.json"
    tokenizer.write_text(data.train_bpe_tokenizer([TEXT], 300).to_str())
    (tmp_path / "nano").mkdir()
    np.arange(5000, dtype=np.uint16).__mod__(300).tofile(tmp_path / "nano" / "train.bin")
    np.arange(500, dtype=np.uint16).tofile(tmp_path / "nano" / "val.bin")
    with pytest.raises(UserError, match="needs the tokenizer"):
        data.load_corpus(str(tmp_path / "nano"), "", 0, 0.05)
    with pytest.raises(UserError, match="token id 499"):  # val.bin goes past the vocabulary
        data.load_corpus(str(tmp_path / "nano"), str(tokenizer), 0, 0.05)
    (np.arange(500, dtype=np.uint16) % 300).tofile(tmp_path / "nano" / "val.bin")
    corpus = data.load_corpus(str(tmp_path / "nano"), str(tokenizer), 0, 0.05)
    assert len(corpus.train) == 5000 and len(corpus.eval) == 500
    (tmp_path / "nano" / "val.bin").write_bytes(b"\x00")
    with pytest.raises(UserError, match="not a whole number"):
        data.load_corpus(str(tmp_path / "nano"), str(tokenizer), 0, 0.05)


def test_the_sampler_resumes_at_its_position_on_a_token_file(tmp_path):
    np.arange(20000, dtype=np.uint32).tofile(tmp_path / "t.bin")
    stream = tokens.TokenFile(tmp_path / "t.bin", np.uint32)[1000:]
    sampler = data.BatchSampler(stream, 4, 16, seed=0, island="a")
    for _ in range(3):
        sampler.next_batch()
    saved = json.loads(json.dumps(sampler.position()))  # through a checkpoint's JSON
    expected = sampler.next_batch()
    resumed = data.BatchSampler(stream, 4, 16, seed=0, island="a")
    resumed.seek(saved)
    assert resumed.batches_drawn == 3 and torch.equal(resumed.next_batch(), expected)
    assert expected.dtype == torch.int64 and int(expected.min()) >= 1000
    assert torch.equal(expected[:, 1:] - expected[:, :-1], torch.ones(4, 16, dtype=torch.int64))
    assert np.array_equal(np.asarray(stream[5:9]), [1005, 1006, 1007, 1008]) and len(stream) == 19000
