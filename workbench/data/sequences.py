"""The token ids of every training sequence of a run's data source (what the trainer feeds the
model), with the lengths the planner sees.

Three kinds, chosen by the source:

* ``cache``: a text source (a document, a folder of them, JSONL/CSV/Parquet/dataset with a text
  column, or ``stdlib`` with a tokenizer), tokenised once into the token cache
  (:mod:`workbench.data.tokens`); sequence ``i`` is a document, or a piece of one under the
  max-context policy ``split`` / ``clip``.
* ``corpus``: ``stdlib`` without a tokenizer: the standard library's files, one byte per token.
* ``windows``: a lengths-only source (a family, a lengths file, a list): sequence ``i`` is a
  contiguous window of the stdlib byte stream, starting where ``(seed, i)`` says.

Pure numpy: the trainer turns the arrays into tensors.
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

import numpy as np

__all__ = ["TokenData"]


@functools.lru_cache(maxsize=512)
def _file_bytes(path: str) -> bytes:
    return Path(path).read_bytes()


def _line_progress(prefix: str):
    """A progress callback that writes a line at most every 5 s (for logs, not terminals)."""
    last = [0.0]

    def show(frac: float, msg: str) -> None:
        now = time.monotonic()
        if now - last[0] >= 5.0 or frac >= 1.0:
            last[0] = now
            sys.stderr.write(f"{prefix}[{100 * frac:5.1f}%] {msg}\n")
            sys.stderr.flush()

    return show


class TokenData:
    """Every sequence of a run's length source: ``lengths`` (after the max-context policy) and
    ``tokens(i)``, its token ids (int64).

    For a text source (see the module) sequence ``i`` is (a piece of) one document of the token
    cache; for ``stdlib`` without a tokenizer, (a piece of) one standard-library file, one token
    per byte; for any other source (family, lengths file, list) a contiguous window of the
    concatenated stdlib byte stream starting at a place drawn from ``(seed, i)``. Has ``lengths``,
    ``ordered`` and ``report`` (the ``MaxContextReport``), so it can be handed to
    ``GlobalBatchSampler`` directly; ``vocab_size`` (the ids it can produce: the tokenizer's, or
    256) and ``fingerprint`` (what a checkpoint records to resume on the same data).

    Raises ValueError for a bad source or column, a tokenizer that cannot be read, a tokenizer
    whose vocabulary is larger than ``vocab`` (the model's), or a sequence over ``max_len`` under
    policy ``error``.
    """

    def __init__(self, source: str, *, max_len: int, policy: str, seed: int, samples: int | None = None,
                 column: str | None = None, tokenizer: str | None = None, vocab: int | None = None,
                 progress=None) -> None:
        from workbench.data import load_lengths
        from workbench.data.corpus import stdlib_documents
        from workbench.data.source import apply_max_context, draw_indices
        from workbench.data.tokens import text_source, token_cache

        self.source = source
        self.seed = int(seed)
        self.ordered = False
        self.cache = None
        self._docs = self._paths = None
        text = text_source(source, column=column, tokenizer=tokenizer)
        if text is not None:
            self.kind = "cache"
            self.cache = token_cache(source, column=column, tokenizer=tokenizer,
                                     progress=progress or _line_progress("workbench train: "))
            sizes = np.asarray(self.cache.lengths, dtype=np.int64)
            self._starts = np.asarray(self.cache.offsets, dtype=np.int64)
            self.vocab_size = self.cache.vocab_size
            self.fingerprint = f"cache:{self.cache.meta['key']}"
            origin = f"{source} (token cache)"
        elif source.strip().lower() == "stdlib":
            self.kind = "corpus"
            self._docs = stdlib_documents()
            self._paths = [d.path for d in self._docs]
            sizes = np.array([d.n_tokens for d in self._docs], dtype=np.int64)
            self._starts = np.concatenate(([0], np.cumsum(sizes)))  # offsets of the docs in the byte stream
            self.vocab_size = 256
            self.fingerprint = "stdlib-bytes"
            origin = "stdlib corpus"
        else:
            self.kind = "windows"
            self._docs = stdlib_documents()
            self._paths = [d.path for d in self._docs]
            sizes = np.array([d.n_tokens for d in self._docs], dtype=np.int64)
            self._starts = np.concatenate(([0], np.cumsum(sizes)))
            self.vocab_size = 256
            self.fingerprint = "stdlib-windows"
            ls = load_lengths(source, samples=samples, seed=seed, max_len=max_len, policy=policy, column=column,
                              tokenizer=tokenizer)
            lengths, self.report, self.ordered = ls.lengths, ls.policy_report, ls.ordered
            self._seq_start = None
        if vocab is not None and self.vocab_size > vocab:
            what = (f"tokenizer {tokenizer}" if self.kind == "cache" and tokenizer
                    else "byte-level tokens (no --tokenizer)")
            raise ValueError(f"{what} has a vocabulary of {self.vocab_size:,} tokens but the model has {vocab:,} "
                             f"embeddings; use a model whose vocab_size is at least {self.vocab_size:,} (or the "
                             f"tokenizer the model was made for)")
        if self.kind != "windows":
            idx = np.arange(sizes.size, dtype=np.int64)
            if samples is not None:  # the same draw as load_lengths(source, samples=..., seed=...)
                idx = draw_indices(idx.size, samples, seed)
            raw = sizes[idx]
            where = self.cache.where if self.cache is not None and samples is None else None
            lengths, self.report = apply_max_context(raw, max_len, policy, origin=origin, where=where)
            if policy == "split":
                pieces = -(-raw // max_len)
                doc = np.repeat(idx, pieces)
                first = np.repeat(np.cumsum(pieces) - pieces, pieces)
                offset = (np.arange(doc.size, dtype=np.int64) - first) * max_len
            elif policy == "drop":
                doc, offset = idx[raw <= max_len], np.zeros(int((raw <= max_len).sum()), dtype=np.int64)
            else:  # clip, or error with nothing longer
                doc, offset = idx, np.zeros(idx.size, dtype=np.int64)
            # absolute start of every sequence in the token stream
            self._seq_start = self._starts[doc] + offset
        self.lengths = np.ascontiguousarray(lengths, dtype=np.int64)
        self.lengths.flags.writeable = False

    def __len__(self) -> int:
        return int(self.lengths.size)

    @property
    def stream_tokens(self) -> int:
        """Tokens in the concatenated stream (bytes of the stdlib, or the token cache's)."""
        return int(self._starts[-1])

    def start(self, i: int) -> int:
        """Where sequence ``i`` starts in the token stream."""
        if self._seq_start is not None:
            return int(self._seq_start[i])
        n = int(self.lengths[i])
        span = max(1, self.stream_tokens - n + 1)
        return int(np.random.default_rng([self.seed, 0x70C5, int(i)]).integers(0, span))

    def tokens(self, i: int) -> np.ndarray:
        """Token ids (int64) of sequence ``i``: ``lengths[i]`` ids from ``start(i)`` (a window of
        the byte stream wraps around its end)."""
        need = int(self.lengths[i])
        if self.cache is not None:
            return self.cache.read(self.start(i), need)
        pos = self.start(i) % self.stream_tokens
        parts: list[np.ndarray] = []
        while need > 0:
            k = int(np.searchsorted(self._starts, pos, side="right")) - 1
            data = _file_bytes(self._paths[k])
            lo = pos - int(self._starts[k])
            chunk = np.frombuffer(data, dtype=np.uint8, count=min(need, len(data) - lo), offset=lo)
            parts.append(chunk)
            need -= chunk.size
            pos = (pos + chunk.size) % self.stream_tokens
        return np.concatenate(parts).astype(np.int64)

    def describe(self) -> str:
        """One line: how many sequences, how their tokens are made, what the policy did."""
        if self.kind == "cache":
            what = "from " + self.cache.describe()
        elif self.kind == "corpus":
            what = "stdlib documents, 1 token per byte"
        else:
            what = f"{self.source!r} lengths over windows of the stdlib byte stream"
        text = f"{len(self):,} sequences, {int(self.lengths.sum()):,} tokens ({what})"
        if self.report is not None:
            text += "; max context: " + self.report.describe()
        return text
