"""One entry point for sequence lengths, and the max-context policy.

``load_lengths(source)`` takes a family name (``wikipedia``, ``github``, ``byted``,
``commoncrawl``, ``uniform``, ``lognormal``, parametrised ``uniform:LOW:HIGH`` /
``lognormal:MEDIAN:SIGMA``), the real corpus ``stdlib``, a file or directory path, or an explicit
comma-separated list of integers (``"1024,65536,300"``, with optional binary ``K``/``M``/``G``
suffixes: ``"64K,2M"``). A name wins over a file of the same name; write ``./wikipedia`` to mean
the file.

Sequences longer than the model's maximum context are handled by a named policy, and the result
is always reported (:class:`MaxContextReport`), never silent.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .corpus import stdlib_lengths, stdlib_root
from .families import FAMILIES, get_family
from .files import read_lengths_file
from .tokens import text_source, token_cache

__all__ = [
    "DEFAULT_SAMPLES",
    "POLICIES",
    "SOURCE_NAMES",
    "LengthSet",
    "MaxContextReport",
    "apply_max_context",
    "draw_indices",
    "is_length_list",
    "load_lengths",
    "parse_length_list",
]

POLICIES = ("clip", "split", "drop", "error")
DEFAULT_SAMPLES = 100_000
# every name load_lengths accepts besides paths and lists
SOURCE_NAMES = (*sorted(FAMILIES), "stdlib")

_SUFFIX = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}
_LIST_ITEM = re.compile(r"^([+-]?\d+)\s*([kmgKMG]?)$")
# what a length list can look like: digits, signs, suffixes, commas, spaces (no path separators)
_LIST_SHAPE = re.compile(r"^[\s\d,+\-kmgKMG]+$")


@dataclass(frozen=True, kw_only=True, slots=True)
class MaxContextReport:
    """What a max-context policy did: sequence and token counts before and after, and how many
    sequences were longer than ``max_len`` (``affected_sequences``)."""

    policy: str
    max_len: int
    sequences_before: int
    sequences_after: int
    tokens_before: int
    tokens_after: int
    affected_sequences: int

    @property
    def tokens_removed(self) -> int:
        """Tokens lost (clip and drop; 0 for split and error)."""
        return self.tokens_before - self.tokens_after

    def describe(self) -> str:
        """Return one human line, e.g. ``"clip at 131,072: 412 sequences (0.41%) cut, 9.3% of
        tokens removed"``."""
        head = f"{self.policy} at {self.max_len:,}"
        if self.affected_sequences == 0:
            return f"{head}: no sequence longer than {self.max_len:,}; nothing changed"
        frac = self.affected_sequences / self.sequences_before
        who = f"{self.affected_sequences:,} sequence{'s' if self.affected_sequences != 1 else ''} ({frac:.2%})"
        removed = self.tokens_removed / self.tokens_before
        if self.policy == "clip":
            return f"{head}: {who} cut, {removed:.1%} of tokens removed"
        if self.policy == "drop":
            return f"{head}: {who} dropped, {removed:.1%} of tokens removed"
        if self.policy == "split":
            pieces = self.sequences_after - self.sequences_before + self.affected_sequences
            return (
                f"{head}: {who} split into {pieces:,} pieces; all tokens kept, "
                f"{self.sequences_before:,} -> {self.sequences_after:,} sequences"
            )
        return f"{head}: {who} longer"  # "error" raises before a report with affected > 0 exists

    def to_dict(self) -> dict:
        """The report as a plain dict (JSON-able), with ``describe`` under ``"text"``."""
        return {**asdict(self), "text": self.describe()}


@dataclass(frozen=True, kw_only=True, slots=True)
class LengthSet:
    """A set of sequence lengths and where they came from.

    ``lengths`` is a read-only int64 array (>= 1); ``source`` the string it was loaded from;
    ``provenance`` plain JSON-able data (``kind``: family / corpus / file / list, and details);
    ``policy_report`` the :class:`MaxContextReport` when a ``max_len`` was applied, else None;
    ``ordered`` is True for an explicit list, whose order is meaningful (one batch, as given).
    """

    lengths: np.ndarray
    source: str
    provenance: dict = field(default_factory=dict)
    policy_report: MaxContextReport | None = None
    ordered: bool = False

    def __len__(self) -> int:
        return int(self.lengths.size)

    @property
    def tokens(self) -> int:
        """Total tokens over all sequences."""
        return int(self.lengths.sum())

    def describe(self) -> str:
        """Return one human line: count, tokens, source kind, estimate flag and the policy line."""
        kind = self.provenance.get("kind", "?")
        text = f"{len(self):,} sequences, {self.tokens:,} tokens from {kind} {self.source!r}"
        if self.provenance.get("estimate"):
            text += " (byte-level token estimate)"
        if self.policy_report is not None:
            text += "; " + self.policy_report.describe()
        return text


def _check_policy(max_len: Any, policy: Any) -> None:
    if policy not in POLICIES:
        raise ValueError(f"unknown max-context policy {policy!r}; allowed: {', '.join(POLICIES)}")
    if max_len is not None and (
        isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) or max_len <= 0
    ):
        raise ValueError(f"max_len must be None or a positive integer (tokens), got {max_len!r}")


def _as_lengths(lengths: Any) -> np.ndarray:
    arr = np.asarray(lengths)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"lengths must be a non-empty 1-D array, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"lengths must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.min() < 1:
        i = int(np.argmin(arr))
        raise ValueError(f"lengths must be >= 1; index {i} holds {int(arr[i])}")
    return arr


def apply_max_context(
    lengths: Any,
    max_len: int,
    policy: str = "clip",
    *,
    origin: str | None = None,
    where: Any = None,
) -> tuple[np.ndarray, MaxContextReport]:
    """Apply a max-context policy to ``lengths``; return ``(new_lengths, report)``.

    * ``clip``: each sequence longer than ``max_len`` is truncated to ``max_len``.
    * ``split``: each such sequence becomes ``ceil(len / max_len)`` pieces in its place, full
      ``max_len`` pieces first and the remainder last (``[1000]`` at 256 -> ``[256, 256, 256, 232]``);
      all tokens are kept and the order is otherwise unchanged.
    * ``drop``: such sequences are removed; the others keep their order.
    * ``error``: raise if any sequence is longer.

    ``origin`` (e.g. a file path) and ``where`` (a function from index to a place such as
    ``"line 17"``) only make the ``error`` message more precise.

    Raises ValueError for an unknown policy or ``max_len`` <= 0 (naming the allowed values), for
    ``error`` when a sequence is longer (naming its index, place, length and ``max_len``), and for
    ``drop`` when every sequence would be removed.
    """
    _check_policy(max_len, policy)
    if max_len is None:
        raise ValueError("max_len must be a positive integer (tokens), got None")
    max_len = int(max_len)
    arr = _as_lengths(lengths)
    over = arr > max_len
    n_over = int(over.sum())
    if policy == "error" and n_over:
        i = int(np.flatnonzero(over)[0])
        place = ""
        if origin is not None or where is not None:
            bits = [b for b in (origin, where(i) if where is not None else None) if b]
            place = f" ({', '.join(bits)})"
        raise ValueError(
            f"sequence at index {i}{place} has length {int(arr[i]):,} > max_len {max_len:,} "
            f"({n_over:,} of {arr.size:,} sequences are longer); raise max_len or choose policy "
            "'clip' (truncate), 'split' (cut into max_len pieces) or 'drop' (remove them)"
        )
    if policy == "clip":
        out = np.minimum(arr, max_len)
    elif policy == "drop":
        out = arr[~over]
        if out.size == 0:
            raise ValueError(
                f"drop at {max_len:,} removes all {arr.size:,} sequences; raise max_len or use 'clip' or 'split'"
            )
    elif policy == "split":
        pieces = -(-arr // max_len)  # ceil division
        out = np.repeat(arr, pieces)
        # k = index of each piece within its sequence; piece length = min(max_len, rest)
        starts = np.repeat(np.cumsum(pieces) - pieces, pieces)
        k = np.arange(out.size, dtype=np.int64) - starts
        out = np.minimum(max_len, out - k * max_len)
    else:  # error, nothing longer
        out = arr.copy()
    report = MaxContextReport(
        policy=policy,
        max_len=max_len,
        sequences_before=int(arr.size),
        sequences_after=int(out.size),
        tokens_before=int(arr.sum()),
        tokens_after=int(out.sum()),
        affected_sequences=n_over,
    )
    return out.astype(np.int64, copy=False), report


def parse_length_list(text: str) -> np.ndarray:
    """Parse ``"1024,65536,300"`` (optional binary suffixes: ``"64K,2M"``) into an int64 array,
    keeping the order.

    Raises ValueError naming the 1-based item and its text for an empty, non-integer or
    non-positive item.
    """
    items = text.split(",")
    out = []
    for k, raw in enumerate(items, 1):
        s = raw.strip()
        m = _LIST_ITEM.match(s)
        if not m:
            what = "is empty" if not s else "is not an integer (suffixes K, M, G allowed)"
            raise ValueError(f"length list {text!r}: item {k} {s!r} {what}; write e.g. '1024,65536,300'")
        v = int(m.group(1)) * _SUFFIX[m.group(2).lower()]
        if v < 1:
            raise ValueError(f"length list {text!r}: item {k} {s!r} is not a positive length; lengths must be >= 1")
        out.append(v)
    return np.array(out, dtype=np.int64)


def is_length_list(source: str) -> bool:
    """Whether ``source`` is an explicit comma-separated batch (``"1024,65536,300"``), which is
    planned as given: one batch, in order, never clipped by a default max context."""
    key = source.strip()
    return bool(key) and bool(_LIST_SHAPE.match(key)) and any(c.isdigit() for c in key)


def _looks_like_list(key: str) -> bool:
    # "1024", "64K,2M", "1024, abc" (a list with a bad item, reported as such), never a path
    has_sep = "/" in key or os.sep in key
    return bool(_LIST_SHAPE.match(key)) or ("," in key and not has_sep)


def _exists(key: str) -> bool:
    try:
        return Path(key).exists()
    except (OSError, ValueError):  # a name too long for the file system is not a file
        return False


def _looks_like_path(key: str) -> bool:
    return "/" in key or os.sep in key or bool(Path(key).suffix)


def draw_indices(n: int, samples: int, seed: int) -> np.ndarray:
    """Indices of ``samples`` of ``n`` items drawn with ``default_rng(seed)``: without replacement
    when there are enough (sorted: source order kept), else with replacement. The one rule every
    draw from a file, the corpus or a token cache follows, so planning and training see the same
    sequences."""
    rng = np.random.default_rng(seed)
    if samples <= n:
        return np.sort(rng.choice(n, size=samples, replace=False))
    return rng.integers(0, n, size=samples)


def _draw(lengths: np.ndarray, samples: int, seed: int) -> tuple[np.ndarray, dict]:
    """``samples`` lengths drawn by :func:`draw_indices`, and notes saying how."""
    n = lengths.size
    idx = draw_indices(n, samples, seed)
    if samples <= n:
        return lengths[idx], {"samples": samples, "seed": seed, "replace": False, "available": n}
    return lengths[idx], {"samples": samples, "seed": seed, "replace": True, "available": n,
                          "note": f"{samples:,} samples asked from {n:,} sequences: drawn with replacement"}


def _cacheable(tokenizer: Any) -> bool:
    # the token cache keys tokenizers by their file; an in-memory Tokenizer object is only counted
    return tokenizer is None or isinstance(tokenizer, (str, os.PathLike))


def load_lengths(
    source: str | os.PathLike,
    *,
    samples: int | None = None,
    seed: int = 0,
    max_len: int | None = None,
    policy: str = "clip",
    column: str | None = None,
    tokenizer: Any = None,
    fmt: str | None = None,
) -> LengthSet:
    """Load sequence lengths from ``source`` and apply the max-context policy.

    ``source``: a family name (see :data:`SOURCE_NAMES`; ``samples`` lengths are generated,
    default 100,000, from ``seed``), ``stdlib`` (the real corpus; all documents, or ``samples``
    drawn), a file or directory (see :func:`workbench.data.files.read_lengths_file`; ``samples``
    draws that many with ``default_rng(seed)``, without replacement when possible, kept in file
    order), or a comma-separated list of integers (taken exactly and in order as the whole batch:
    ``ordered=True``; ``samples`` does not apply and is noted in the provenance if given).
    ``max_len`` and ``policy`` (clip / split / drop / error) are applied last; the report is kept
    on the result. A text source (a document, a folder of them, JSONL/CSV/Parquet/dataset with a
    text column, or ``stdlib`` with a ``tokenizer`` path) is tokenised into the token cache
    (:mod:`workbench.data.tokens`) on first use and its document lengths read from there, so
    planning sees exactly what training reads (skipped documents are counted in the provenance).

    Returns a :class:`LengthSet`. Raises ValueError for an unknown source (listing the names),
    bad input in a file (naming file, line and value), a bad list item, a bad policy or
    ``max_len``, ``samples`` < 1, or a sequence longer than ``max_len`` under policy ``error``.
    """
    _check_policy(max_len, policy)
    if samples is not None and (isinstance(samples, bool) or not isinstance(samples, (int, np.integer)) or samples < 1):
        raise ValueError(f"samples must be None or a positive integer, got {samples!r}")
    text = os.fspath(source)
    if not isinstance(text, str):
        raise ValueError(f"source must be a string or path, got {type(source).__name__}")
    key = text.strip()
    if not key:
        raise ValueError(
            f"empty length source; give one of {', '.join(SOURCE_NAMES)}, a path or a list like '1024,4096'"
        )
    lowered = key.lower()
    ordered = False
    origin: str | None = None
    where = None

    if lowered in FAMILIES or lowered.startswith(("uniform:", "lognormal:")):
        fam = get_family(lowered)
        n = DEFAULT_SAMPLES if samples is None else int(samples)
        lengths = fam.sample(n, seed=seed)
        provenance: dict[str, Any] = {
            "kind": "family",
            "family": fam.name,
            "description": fam.description,
            "samples": n,
            "seed": seed,
            "estimate": False,
            "targets": fam.targets_copy(),
        }
    elif lowered == "stdlib" and tokenizer is not None and _cacheable(tokenizer):
        cache = token_cache("stdlib", tokenizer=tokenizer)
        lengths = np.array(cache.lengths)
        provenance = {**cache.provenance(), "corpus": "stdlib"}
        origin, where = "stdlib corpus", cache.where
        if samples is not None:
            lengths, notes = _draw(lengths, int(samples), seed)
            provenance.update(notes)
            where = None
    elif lowered == "stdlib":
        lengths = stdlib_lengths()
        provenance = {
            "kind": "corpus",
            "corpus": "stdlib",
            "path": stdlib_root(),
            "documents": int(lengths.size),
            "tokenizer": "byte-level",
            "estimate": False,
            "note": "the Python standard library's .py files, 1 token per UTF-8 byte "
            "(a BPE tokenizer gives roughly 4x fewer tokens)",
        }
        if samples is not None:
            lengths, notes = _draw(lengths, int(samples), seed)
            provenance.update(notes)
    elif not _looks_like_list(key) and (_exists(key) or _looks_like_path(key)):
        tsrc = text_source(key, column=column, tokenizer=tokenizer) if fmt is None and _cacheable(tokenizer) else None
        if tsrc is not None:
            # text is tokenised once into the token cache, which training reads too: the lengths
            # planned are the lengths trained (documents that cannot be trained on are skipped there,
            # and counted in the provenance)
            cache = token_cache(key, column=column, tokenizer=tokenizer)
            lengths = np.array(cache.lengths)
            provenance = cache.provenance()
            origin, where = str(key), cache.where
        else:
            fl = read_lengths_file(key, column=column, tokenizer=tokenizer, fmt=fmt)
            lengths = fl.lengths
            provenance = dict(fl.provenance)
            origin, where = str(key), fl.where
        if samples is not None:
            lengths, notes = _draw(lengths, int(samples), seed)
            provenance.update(notes)
            where = None  # indices no longer match file lines after a draw
    elif not _looks_like_list(key):
        raise ValueError(
            f"unknown length source {key!r}: not a known name ({', '.join(SOURCE_NAMES)}), not an "
            "existing file or directory, and not a comma-separated list of integers"
        )
    else:
        lengths = parse_length_list(key)
        ordered = True
        provenance = {"kind": "list", "count": int(lengths.size), "estimate": False}
        if samples is not None:
            provenance["note"] = "samples does not apply to an explicit list: all values used, in order"

    report = None
    if max_len is not None:
        lengths, report = apply_max_context(lengths, max_len, policy, origin=origin, where=where)
        provenance["max_context"] = report.to_dict()
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    # frozen record, frozen data: a consumer cannot change the lengths under another's feet
    lengths.flags.writeable = False
    return LengthSet(
        lengths=lengths, source=text, provenance=provenance, policy_report=report, ordered=ordered
    )
