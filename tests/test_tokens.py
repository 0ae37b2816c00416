"""The token cache and the training data read from it: the user's text (JSONL, CSV, Parquet, a saved
dataset, documents) tokenised once with their tokenizer, reused, and read back exactly.

References are independent: the tokenizer's own per-document ``encode`` (not the batched cache
build), the UTF-8 bytes of each text, and the JSON lines themselves. Skips are counted and placed;
a build killed half-way (a real process, SIGKILL) and a damaged entry are found and rebuilt.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from workbench.data import load_lengths
from workbench.data.sequences import TokenData
from workbench.data.tokens import text_source, token_cache

ROOT = Path(__file__).resolve().parents[1]
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def make_texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 60)))) + (" ünï" if i % 7 == 0 else "")
            for i in range(n)]


@pytest.fixture(scope="module")
def tok_file(tmp_path_factory) -> Path:
    """A real BPE tokenizer (byte-level pre-tokenizer, a BOS added by its post-processor) trained here."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    d = tmp_path_factory.mktemp("tok")
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(make_texts(300, seed=9), tr)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(d / "tokenizer.json"))
    return d / "tokenizer.json"


def reference_ids(tok_file: Path | None, text: str) -> list[int]:
    if tok_file is None:
        return list(text.encode("utf-8"))
    from tokenizers import Tokenizer as HFTok

    return HFTok.from_file(str(tok_file)).encode(text).ids


def write_jsonl(path: Path, rows: list) -> Path:
    with open(path, "wb") as f:
        for r in rows:
            f.write(r if isinstance(r, bytes) else (json.dumps(r) + "\n").encode())
    return path


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("WORKBENCH_CACHE", str(d))
    return d


# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_tok", [True, False])
def test_jsonl_tokens_equal_the_tokenizer_per_document_and_are_reused(tmp_path, cache_dir, tok_file, use_tok):
    texts = make_texts(700)
    src = write_jsonl(tmp_path / "corpus.jsonl", [{"id": i, "text": t} for i, t in enumerate(texts)])
    tok = tok_file if use_tok else None
    seen = []
    c = token_cache(str(src), tokenizer=tok, progress=lambda f, m: seen.append(f))
    assert not c.reused and len(c) == 700 and seen[-1] == 1.0
    for i in (0, 1, 7, 350, 699):
        assert c.document(i).tolist() == reference_ids(tok, texts[i])
    assert c.meta["tokens"] == sum(len(reference_ids(tok, t)) for t in texts)
    assert c.tokens.dtype == (np.uint16 if use_tok else np.uint8) and c.skipped == {}
    # a second open reuses the entry (no tokenising), and a copy of the file finds it by content
    again = token_cache(str(src), tokenizer=tok)
    assert again.reused and again.path == c.path
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(src.read_bytes())
    assert token_cache(str(copy), tokenizer=tok).path == c.path
    # planning reads the same lengths
    ls = load_lengths(str(src), tokenizer=str(tok) if tok else None)
    assert ls.lengths.tolist() == c.lengths.tolist() and ls.provenance["token_cache"] == str(c.path)
    assert ls.provenance["tokenizer"] == (str(tok_file.resolve()) if use_tok else "byte-level")


def test_an_edited_file_or_another_tokenizer_is_a_new_entry(tmp_path, cache_dir, tok_file):
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in make_texts(50)])
    a = token_cache(str(src), tokenizer=tok_file)
    b = token_cache(str(src))
    assert a.path != b.path and b.meta["tokenizer"]["digest"] == "byte-level"
    time.sleep(0.01)
    write_jsonl(src, [{"text": t} for t in make_texts(51)])
    c = token_cache(str(src), tokenizer=tok_file)
    assert c.path != a.path and len(c) == 51 and not c.reused


def test_skips_are_counted_with_their_places(tmp_path, cache_dir):
    rows = [{"text": "good one"}, {"text": ""}, b'{"text": "caf\xe9"}\n', b"not json\n", b"\n", [1, 2],
            {"other": "x"}, {"text": None}, {"text": 7}, {"text": "   "}, {"text": "good two"}]
    src = write_jsonl(tmp_path / "mixed.jsonl", rows)
    c = token_cache(str(src))
    assert len(c) == 2 and [bytes(c.document(i)).decode() for i in range(2)] == ["good one", "good two"]
    assert c.skipped == {"empty document": 2, "not UTF-8": 1, "not valid JSON": 1, "not a JSON object": 1,
                         "no field 'text'": 1, "null value": 1, "not a string (int)": 1}
    ex = c.meta["skipped_examples"]
    assert ex["not UTF-8"] == [3] and ex["empty document"] == [2, 10] and c.where(1) == "line 11"
    ls = load_lengths(str(src))
    assert ls.provenance["skipped"]["not UTF-8"] == 1  # planning reports them too
    # nothing left: one clear line
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": ""}, b"\xff\xfe\n"])
    with pytest.raises(ValueError, match=r"no document to train on \(1 empty document, 1 not UTF-8\)"):
        token_cache(str(bad))


def test_no_text_column_is_one_line(tmp_path, cache_dir):
    src = write_jsonl(tmp_path / "x.jsonl", [{"body": "hello", "id": 1}])
    with pytest.raises(ValueError, match=r"no length column found; columns present: 'body', 'id'; pass column=NAME"):
        token_cache(str(src))
    c = token_cache(str(src), column="body")  # a string column by another name is text
    assert bytes(c.document(0)).decode() == "hello"
    with pytest.raises(ValueError, match="no column 'txt'; columns present"):
        token_cache(str(src), column="txt")
    # a lengths file is not text
    lens = write_jsonl(tmp_path / "l.jsonl", [{"length": 5}])
    assert text_source(str(lens)) is None
    with pytest.raises(ValueError, match="holds lengths, not text"):
        token_cache(str(lens))


def test_parquet_csv_dataset_and_documents(tmp_path, cache_dir, tok_file):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = make_texts(40, seed=3)
    pq.write_table(pa.table({"n": list(range(40)), "content": texts}), tmp_path / "t.parquet")
    with open(tmp_path / "t.csv", "w", newline="", encoding="utf-8") as f:
        import csv

        w = csv.writer(f)
        w.writerow(["id", "text"])
        w.writerows([i, t] for i, t in enumerate(texts))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts})}).save_to_disk(str(tmp_path / "ds"))
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    for i, t in enumerate(texts[:5]):
        (docs / ("sub" if i % 2 else ".") / f"{i}.md").write_text(t)
    (docs / "empty.md").write_text("")
    want = [reference_ids(tok_file, t) for t in texts]
    for source, column in ((tmp_path / "t.parquet", "content"), (tmp_path / "t.csv", None), (tmp_path / "ds", None)):
        c = token_cache(str(source), column=column, tokenizer=tok_file)
        assert [c.document(i).tolist() for i in range(len(c))] == want, source
    c = token_cache(str(docs), tokenizer=tok_file)
    order = [0, 2, 4, 1, 3]  # walk order: files of the folder, then of sub/
    assert [c.document(i).tolist() for i in range(5)] == [want[i] for i in order]
    assert c.skipped == {"empty document": 1}


def test_token_data_reads_documents_under_the_max_context_policy(tmp_path, cache_dir, tok_file):
    texts = make_texts(200, seed=4)
    src = str(write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts]))
    docs = [reference_ids(tok_file, t) for t in texts]
    td = TokenData(src, max_len=16, policy="split", seed=0, tokenizer=str(tok_file), vocab=300)
    assert td.kind == "cache" and td.lengths.max() <= 16 and td.fingerprint.startswith("cache:")
    # the pieces, in order, are the documents cut into 16-token pieces: every token kept, none across documents
    got, k = [], 0
    for d in docs:
        need, doc = len(d), []
        while need > 0:
            doc += td.tokens(k).tolist()
            need -= int(td.lengths[k])
            k += 1
        got.append(doc)
    assert got == docs and k == len(td)
    clip = TokenData(src, max_len=16, policy="clip", seed=0, tokenizer=str(tok_file))
    assert [clip.tokens(i).tolist() for i in range(200)] == [d[:16] for d in docs]
    # samples: the same documents planning draws
    s = TokenData(src, max_len=4096, policy="clip", seed=3, samples=50, tokenizer=str(tok_file))
    assert s.lengths.tolist() == load_lengths(src, samples=50, seed=3, tokenizer=str(tok_file), max_len=4096).lengths.tolist()
    # a tokenizer larger than the model: one line
    with pytest.raises(ValueError, match="vocabulary of 300 tokens but the model has 256 embeddings"):
        TokenData(src, max_len=64, policy="clip", seed=0, tokenizer=str(tok_file), vocab=256)
    with pytest.raises(ValueError, match=r"c.jsonl \(token cache\), line 1\) has length \d+ > max_len 8"):
        TokenData(src, max_len=8, policy="error", seed=0, tokenizer=str(tok_file))


def test_stdlib_with_a_tokenizer_is_cached(cache_dir, tok_file, monkeypatch):
    """``stdlib`` with a tokenizer is a text source of the standard library's files, tokenised into the
    cache in listing order, the files that cannot be trained on counted as skips. Tokenising all of it
    (~30 MB) takes most of a minute, so the listing the cache reads is narrowed to its first 60 files
    and every file that is not UTF-8 (the skips); each document's tokens equal the tokenizer's own."""
    from workbench.data import corpus

    every = corpus.stdlib_documents()

    def not_utf8(d):
        try:
            Path(d.path).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            return True
        return False

    bad = [d for d in every if not_utf8(d)]
    docs = list(every[:60]) + [d for d in bad if d not in every[:60]]
    monkeypatch.setattr(corpus, "stdlib_documents", lambda limit=None: docs if limit is None else docs[:limit])

    c = token_cache("stdlib", tokenizer=tok_file)
    assert len(c) + sum(c.skipped.values()) == len(docs)
    assert c.skipped.get("not UTF-8", 0) == len(bad), c.skipped
    first = docs[int(c.places[0]) - 1]
    assert c.document(0).tolist() == reference_ids(tok_file, Path(first.path).read_text(encoding="utf-8"))
    last = docs[int(c.places[-1]) - 1]
    assert c.document(len(c) - 1).tolist() == reference_ids(tok_file, Path(last.path).read_text(encoding="utf-8"))
    assert text_source("stdlib") is None  # without a tokenizer stdlib stays the byte corpus


def test_a_damaged_entry_is_rebuilt(tmp_path, cache_dir):
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in make_texts(100)])
    c = token_cache(str(src))
    want = [c.document(i).tolist() for i in range(len(c))]
    with open(c.path / "tokens.bin", "r+b") as f:
        f.truncate(10)
    said = []
    again = token_cache(str(src), say=said.append)
    assert not again.reused and [again.document(i).tolist() for i in range(len(again))] == want
    assert len(said) == 1 and "incomplete or damaged" in said[0] and "rebuilding" in said[0]


BUILDER = """
import sys
from workbench.data.tokens import token_cache
token_cache(sys.argv[1], progress=lambda f, m: print(f, flush=True))
"""


def test_a_build_killed_half_way_is_found_and_rebuilt(tmp_path, cache_dir):
    """A real builder process killed with SIGKILL in the middle of tokenising: nothing half-written
    is ever read as a cache; the next build reports and removes the leftover and tokenises again."""
    rng = np.random.default_rng(0)
    # 60,000 rows of 200 words (~67 MB of JSON: a build past its first progress report, 0.5 s in), drawn at
    # once (joining numpy's strings row by row took 3 s)
    words = np.array(WORDS, dtype=object)[rng.integers(len(WORDS), size=(60_000, 200))].tolist()
    rows = [{"text": " ".join(w)} for w in words]
    src = write_jsonl(tmp_path / "big.jsonl", rows)
    proc = subprocess.Popen([sys.executable, "-c", BUILDER, str(src)], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, WORKBENCH_CACHE=str(cache_dir)), cwd=ROOT)
    first = proc.stdout.readline()  # a progress line: it is tokenising
    assert first.strip(), "the builder printed no progress"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    tokens_dir = cache_dir / "tokens"
    left = list(tokens_dir.glob(".build-*"))
    assert len(left) == 1 and (left[0] / "tokens.bin").stat().st_size > 0 and not (left[0] / "meta.json").exists()
    assert not [p for p in tokens_dir.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name != "sources"]
    said = []
    c = token_cache(str(src), say=said.append)
    assert any("half-written by a run that was killed" in s for s in said), said
    assert not list(tokens_dir.glob(".build-*")) and len(c) == 60_000
    assert bytes(c.document(59_999)).decode() == rows[-1]["text"]
