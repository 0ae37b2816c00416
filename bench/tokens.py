"""The token cache: tokenising throughput, re-open time, read throughput, and training tokens/s
with the cache against the stdlib byte path.

Sources: the embedded stdlib corpus, and a generated JSONL file (``--jsonl-mb``, default 200 MB:
documents of lognormal length made of words drawn from the stdlib's own text, so the tokenizer
sees real subwords). The tokenizer is a byte-level BPE (``--vocab``, default 8,192) trained here on
a few MB of stdlib text (nothing downloaded); ``--tokenizer PATH`` uses yours instead.

Tables:

1. per source, the first build (tokenise + write the cache; the fast tokenizer's batch encoding)
   in documents/s, tokens/s and MB/s, then the second open (what every later run, plan or panel
   pays: the stat check of the source and the memory maps) in seconds and seconds per 100 M tokens;
2. reading sequences out (``TokenData.tokens`` over random global batches): tokens/s from the
   cache and from the stdlib byte path;
3. with ``--train-steps K`` (default 8; 0 skips it): real ``workbench train`` runs of the tiny model
   on ``--nproc`` ranks through each path, alternating ``--train-repeats`` times: ``--lengths
   stdlib`` (the byte path) and the stdlib's UTF-8 files as a JSONL read byte-level from the token
   cache (the same text but for the few non-UTF-8 files, so the shuffled batches differ); the
   median tokens/s of each run's steps after the first.

The machine is shared: figures are of one run at that moment; the spread of the repeated training
runs shows how much of a difference is noise.

Usage: python bench/tokens.py [--jsonl-mb 200] [--vocab 8192] [--tokenizer PATH] [--train-steps 8]
[--nproc 2] [--keep DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jsonl-mb", type=float, default=200.0, help="size of the generated JSONL (MB)")
    ap.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary trained here")
    ap.add_argument("--tokenizer", default=None, help="use this tokenizer.json instead of training one")
    ap.add_argument("--train-steps", type=int, default=8)
    ap.add_argument("--train-repeats", type=int, default=2, help="runs of each path, alternating (A B A B ...)")
    ap.add_argument("--sections", default="build,read,train", help="which tables to make (build, read, train)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", default=None, help="work in this folder (kept) instead of a temporary one")
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def _stdlib_texts(limit_bytes: int | None = None) -> list[str]:
    from workbench.data.corpus import stdlib_documents

    out, size = [], 0
    for d in stdlib_documents():
        try:
            t = Path(d.path).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        out.append(t)
        size += len(t)
        if limit_bytes and size >= limit_bytes:
            break
    return out


def _train_tokenizer(path: Path, vocab: int) -> float:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t0 = time.perf_counter()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_stdlib_texts(8_000_000), tr)
    tok.save(str(path))
    return time.perf_counter() - t0


def _make_jsonl(path: Path, mb: float, seed: int) -> tuple[int, float]:
    """Documents of lognormal word counts over the stdlib's words until ``mb`` MB are written."""
    import re

    rng = np.random.default_rng(seed)
    words = np.array(sorted(set(re.findall(r"[A-Za-z_]{2,20}", " ".join(_stdlib_texts(4_000_000))))))
    target = int(mb * 1e6)
    written = docs = 0
    t0 = time.perf_counter()
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            counts = np.minimum(rng.lognormal(5.0, 1.3, size=2000).astype(int) + 1, 60_000)
            picks = rng.choice(words, size=int(counts.sum()))
            pos = 0
            lines = []
            for c in counts:
                lines.append(json.dumps({"id": docs, "text": " ".join(picks[pos:pos + c])}))
                pos += c
                docs += 1
            blob = "\n".join(lines) + "\n"
            f.write(blob)
            written += len(blob)
    return docs, time.perf_counter() - t0


def _stdlib_jsonl(path: Path) -> int:
    texts = _stdlib_texts()
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    return len(texts)


def _build_and_reopen(source: str, tokenizer: str | None) -> dict:
    from workbench.data.tokens import token_cache

    t0 = time.perf_counter()
    c = token_cache(source, tokenizer=tokenizer, say=lambda m: None)  # under $WORKBENCH_CACHE, set in main
    build = time.perf_counter() - t0
    assert not c.reused
    src_bytes = c.meta["source_size"] if c.meta["source_unit"] == "bytes" else None
    opens = []
    for _ in range(3):
        t0 = time.perf_counter()
        again = token_cache(source, tokenizer=tokenizer, say=lambda m: None)
        n = int(again.lengths.sum())  # touch the offsets: what a reader needs
        opens.append(time.perf_counter() - t0)
        assert again.reused and n == c.meta["tokens"]
    reopen = statistics.median(opens)
    m = c.meta
    return {"source": Path(source).name if source != "stdlib" else "stdlib", "documents": m["documents"],
            "tokens": m["tokens"], "source_mb": (src_bytes or 0) / 1e6, "build_s": build,
            "docs_per_s": m["documents"] / build, "tokens_per_s": m["tokens"] / build,
            "mb_per_s": (src_bytes or 0) / 1e6 / build, "reopen_s": reopen,
            "reopen_s_per_100m": reopen / max(1, m["tokens"]) * 1e8, "skipped": m["skipped"],
            "cache_mb": (c.path / "tokens.bin").stat().st_size / 1e6}


def _read_rate(td, seed: int, batches: int = 30) -> float:
    from workbench.data import GlobalBatchSampler

    sampler = GlobalBatchSampler(td, batch_tokens=65536, seed=seed)
    n = 0
    t0 = time.perf_counter()
    for b in sampler.take(batches):
        for i in b.indices:
            n += td.tokens(int(i)).size
    return n / (time.perf_counter() - t0)


def _train(work: Path, name: str, lengths: str, steps: int, nproc: int) -> dict:
    exe = Path(sys.executable).with_name("workbench")
    cmd = [str(exe), "train", "--lengths", lengths, "--model", "tiny", "--nproc", str(nproc), "--steps", str(steps),
           "--max-len", "1024", "--batch-tokens", "16384", "--planner", "greedy", "--checkpoint-every", "0",
           "--run-root", str(work / "runs"), "--name", name, "--quiet"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {p.stderr[-2000:]}")
    rows = [json.loads(x) for x in (work / "runs" / name / "metrics.jsonl").read_text().splitlines() if x.strip()]
    r0 = sorted((r for r in rows if r["rank"] == 0), key=lambda r: r["step"])[1:]  # the first step pays start-up
    rates = [r["batch_tokens"] / (r["measured_ms"] / 1e3) for r in r0]
    return {"median_tokens_per_s": statistics.median(rates), "steps": len(rates)}


def main(argv=None) -> int:
    args = _args(argv)
    tmp = None
    if args.keep:
        work = Path(args.keep)
        work.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="bench-tokens-")
        work = Path(tmp.name)
    cache = work / "cache"
    os.environ["WORKBENCH_CACHE"] = str(cache)  # the trainer runs below find the same caches
    out: dict = {"cores": os.cpu_count(), "note": "shared machine: figures of one run"}
    if args.tokenizer:
        tok = str(Path(args.tokenizer).resolve())
    else:
        tok = str(work / "tokenizer.json")
        out["tokenizer_train_s"] = _train_tokenizer(Path(tok), args.vocab)
    from workbench.data.tokens import load_tokenizer

    out["tokenizer"] = load_tokenizer(tok).describe()
    sections = set(args.sections.split(","))
    jsonl = work / "generated.jsonl"
    if sections & {"build", "read"}:
        docs, gen_s = _make_jsonl(jsonl, args.jsonl_mb, args.seed)
        out["generated"] = {"documents": docs, "mb": jsonl.stat().st_size / 1e6, "seconds": gen_s}
    print(f"token cache on {out['cores']} cores ({out['note']}); {out['tokenizer']}")
    if "build" in sections:
        _build_table(out, tok, jsonl)
    if "read" in sections:
        _read_table(out, tok, jsonl, args.seed)
    if "train" in sections and args.train_steps > 0:
        _train_table(out, work, args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    if tmp is not None:
        tmp.cleanup()
    return 0


def _build_table(out: dict, tok: str, jsonl: Path) -> None:
    rows = [_build_and_reopen("stdlib", tok), _build_and_reopen(str(jsonl), tok)]
    out["build"] = rows
    print(f"{'source':<16} {'docs':>9} {'tokens':>13} {'MB':>8} {'build s':>8} {'docs/s':>9} {'tokens/s':>12} "
          f"{'MB/s':>6} {'reopen s':>9} {'s/100M tok':>10} {'cache MB':>9}  skipped")
    for r in rows:
        sk = ", ".join(f"{v} {k}" for k, v in r["skipped"].items()) or "-"
        print(f"{r['source']:<16} {r['documents']:>9,} {r['tokens']:>13,} {r['source_mb']:>8.1f} {r['build_s']:>8.1f} "
              f"{r['docs_per_s']:>9,.0f} {r['tokens_per_s']:>12,.0f} {r['mb_per_s']:>6.1f} {r['reopen_s']:>9.4f} "
              f"{r['reopen_s_per_100m']:>10.4f} {r['cache_mb']:>9.1f}  {sk}")


def _read_table(out: dict, tok: str, jsonl: Path, seed: int) -> None:
    from workbench.data.sequences import TokenData

    cached = TokenData(str(jsonl), max_len=4096, policy="split", seed=seed, tokenizer=tok)
    byte = TokenData("stdlib", max_len=4096, policy="split", seed=seed)
    out["read"] = {"cache_tokens_per_s": _read_rate(cached, seed), "stdlib_tokens_per_s": _read_rate(byte, seed)}
    print(f"\nreading sequences (TokenData.tokens, 30 batches of 65,536 tokens): token cache "
          f"{out['read']['cache_tokens_per_s']:,.0f} tokens/s, stdlib bytes {out['read']['stdlib_tokens_per_s']:,.0f} tokens/s")


def _train_table(out: dict, work: Path, args) -> None:
    sj = work / "stdlib.jsonl"
    n = _stdlib_jsonl(sj)
    a, b = [], []
    for k in range(args.train_repeats):
        a.append(_train(work, f"stdlib-{k}", "stdlib", args.train_steps, args.nproc)["median_tokens_per_s"])
        b.append(_train(work, f"cache-{k}", str(sj), args.train_steps, args.nproc)["median_tokens_per_s"])
    out["train"] = {"stdlib_tokens_per_s": a, "token_cache_tokens_per_s": b, "documents": n}
    print(f"\ntraining the tiny model, {args.nproc} ranks, greedy, {args.train_steps} steps of 16,384 tokens, "
          f"{args.train_repeats} runs per path alternating (median tokens/s of each run's steps after the first):")
    print(f"  {'stdlib byte path':<34} " + "  ".join(f"{x:>9,.0f}" for x in a))
    print(f"  {'stdlib text via the token cache':<34} " + "  ".join(f"{x:>9,.0f}" for x in b)
          + f"   (median {statistics.median(b) / statistics.median(a):.2f}x)")


if __name__ == "__main__":
    sys.exit(main())
