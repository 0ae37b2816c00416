"""The token cache: a text source tokenised once, kept as a memory-mapped array of token ids plus
document offsets, and reused by every later run, by planning and by the Lengths panel.

A *text source* is what the Lengths panel tokenises: a document (``.md``, ``.rst``, ``.text``), a
folder of documents, a JSONL, CSV/TSV or Parquet file whose chosen column holds text, a saved
Hugging Face dataset with a text column, or the embedded ``stdlib`` corpus with a tokenizer
(:func:`text_source` says which, by the same column rules as ``workbench.data.files``). The
tokenizer is a local Hugging Face ``tokenizer.json`` (or its folder), encoded in batches by the
fast tokenizer with its own special tokens (a BOS where it adds one, as the Lengths panel counts);
without one, byte-level (one token per UTF-8 byte, ids 0..255), and said so.

One document is one sequence: no end-of-document token joins documents (the max-context policy
then applies to each document, as for the stdlib corpus). Documents that cannot be trained on are
skipped and counted by reason, with their first places (``line 17: not UTF-8``), never silently:
empty or whitespace-only text, a non-UTF-8 line or file, a line that is not a JSON object or lacks
the field, a null or non-string value. A source with no document left is an error.

Layout, under :func:`cache_root` (``$WORKBENCH_CACHE/tokens``, default ``~/.cache/workbench/tokens``)::

    <key>/tokens.bin    token ids, uint8/uint16/uint32 by vocabulary size, documents back to back
    <key>/offsets.npy   int64 (documents + 1,): document i is tokens[offsets[i]:offsets[i+1]]
    <key>/places.npy    int64 (documents,): its line / row / file number in the source
    <key>/meta.json     what it is (source, format, column, tokenizer, counts, skips), written last
    sources/<h>.json    the source's content hash, remembered by its files' size and mtime

``<key>`` hashes the source's *content*, the format and column, and the tokenizer file's content,
so an edited file or another tokenizer gives a new entry and a renamed copy finds the old one. An
entry is built in a ``.build-*`` folder and renamed into place under a file lock: a build killed
half-way leaves only that folder, which the next build finds, reports and removes; an entry whose
files do not agree with its ``meta.json`` (truncated, edited) is reported and rebuilt.

Pure Python + numpy; ``tokenizers``, ``pyarrow`` and ``datasets`` are imported only when needed.
"""

from __future__ import annotations

import csv
import datetime
import fcntl
import hashlib
import itertools
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from .files import DOCUMENT_SUFFIXES, choose_column, detect_format, require_module

__all__ = [
    "CACHE_VERSION",
    "TextSource",
    "TokenCache",
    "Tokenizer",
    "cache_root",
    "load_tokenizer",
    "text_source",
    "token_cache",
]

CACHE_VERSION = 1
CACHE_ENV = "WORKBENCH_CACHE"
BATCH_DOCS = 512
"""Documents per encode_batch call (the fast tokenizer parallelises inside a batch)."""
BATCH_CHARS = 8_000_000
"""...or fewer when they hold this much text, to keep memory flat."""
_EXAMPLES = 5
"""Places kept per skip reason."""

Progress = Callable[[float, str], None]
"""``progress(fraction done, message)``."""


def cache_root() -> Path:
    """Where token caches live: ``$WORKBENCH_CACHE/tokens``, else ``$XDG_CACHE_HOME/workbench/tokens``,
    else ``~/.cache/workbench/tokens``."""
    base = os.environ.get(CACHE_ENV)
    if base:
        return Path(base).expanduser() / "tokens"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "workbench" / "tokens"


# ------------------------------------------------------------------------------------------------
# the tokenizer
# ------------------------------------------------------------------------------------------------


class Tokenizer:
    """A local Hugging Face tokenizer (``tokenizer.json``), or byte-level when ``path`` is None.

    ``vocab_size`` counts added tokens; ``digest`` identifies the file's content;
    :meth:`encode` turns a batch of texts into one flat id array and the per-text counts."""

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self._tok = None
        if path is None:
            self.path, self.name, self.digest, self.vocab_size = None, "byte-level", "byte-level", 256
            return
        p = Path(os.path.expanduser(os.fspath(path)))
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise ValueError(f"{path}: no tokenizer.json there; give a local tokenizer.json or a folder holding one "
                             f"(nothing is downloaded)")
        tokenizers = require_module("tokenizers", "tokenizers", "a Hugging Face tokenizer")
        try:
            raw = p.read_bytes()
            self._tok = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # noqa: BLE001 - the Rust side raises its own exception type
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(f"{p}: not a readable tokenizer.json ({first})") from None
        p = p.resolve()
        self.path = str(p)
        self.name = f"{p.parent.name}/{p.name}" if p.parent.name else p.name
        self.digest = hashlib.sha256(raw).hexdigest()
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def byte_level(self) -> bool:
        return self._tok is None

    @property
    def dtype(self) -> np.dtype:
        """The smallest unsigned type that holds every id."""
        v = self.vocab_size
        return np.dtype(np.uint8 if v <= 256 else np.uint16 if v <= 65536 else np.uint32)

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, counts)``: the texts' token ids back to back (this tokenizer's dtype) and how many
        each text gave. One batch call of the fast tokenizer, special tokens as it adds them."""
        if self._tok is None:
            blobs = [t.encode("utf-8") for t in texts]
            counts = np.fromiter(map(len, blobs), dtype=np.int64, count=len(blobs))
            return np.frombuffer(b"".join(blobs), dtype=np.uint8), counts
        fast = getattr(self._tok, "encode_batch_fast", None) or self._tok.encode_batch
        ids = [e.ids for e in fast(texts)]
        counts = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=self.dtype, count=int(counts.sum()))
        return flat, counts

    def describe(self) -> str:
        if self.byte_level:
            return "byte-level (1 token per UTF-8 byte, ids 0..255: no tokenizer given)"
        return f"tokenizer {self.path} ({self.vocab_size:,} tokens)"


def load_tokenizer(path: str | os.PathLike | None) -> Tokenizer:
    """The :class:`Tokenizer` at ``path`` (None: byte-level). Raises ValueError naming the path
    when there is no readable ``tokenizer.json``; ImportError naming the package when
    ``tokenizers`` is not installed."""
    return Tokenizer(path)


# ------------------------------------------------------------------------------------------------
# which sources are text, and their documents
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TextSource:
    """A source of documents: ``kind`` (the format: ``stdlib``, ``text``, ``text-dir``, ``jsonl``,
    ``csv``, ``tsv``, ``parquet``, ``hf-dataset``), its ``path`` and the ``column`` holding text."""

    kind: str
    path: str
    column: str | None = None
    split: str | None = None

    @property
    def unit(self) -> str:
        return {"text": "document", "text-dir": "file", "stdlib": "file", "parquet": "row",
                "hf-dataset": "row"}.get(self.kind, "line")


def _first_record(path: Path) -> dict | None:
    """The first line of a JSONL file that parses to an object (None if none within 1,000 lines)."""
    with open(path, "rb") as f:
        for k, raw in enumerate(f):
            if k > 1000:
                return None
            try:
                obj = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                continue
            if isinstance(obj, dict):
                return obj
    return None


def text_source(source: str, *, column: str | None = None, tokenizer: Any = None) -> TextSource | None:
    """The :class:`TextSource` that ``source`` names, or None when it holds lengths rather than
    text (a family, a list, a lengths file, a table whose chosen column is numeric). ``stdlib`` is
    a text source only with a tokenizer (without one it stays the byte-level corpus). Columns are
    chosen as ``workbench.data.files`` does: ``column`` if given, else a length column, else
    ``text``; a string-valued column is text. Raises ValueError for a missing column (listing
    those present) or an unreadable file."""
    key = os.fspath(source).strip()
    if key.lower() == "stdlib":
        if tokenizer is None:
            return None
        from .corpus import stdlib_root

        return TextSource("stdlib", stdlib_root())
    p = Path(os.path.expanduser(key))
    try:
        if not p.exists():
            return None
    except (OSError, ValueError):  # a length list too long to be a file name, say
        return None
    fmt = detect_format(p)
    if fmt in ("text", "text-dir"):
        return TextSource(fmt, str(p.resolve()))
    if fmt == "jsonl":
        obj = _first_record(p)
        if obj is None:
            return None  # the lengths reader reports what is wrong with it
        name, is_text = choose_column(p, list(obj), column)
        if is_text or isinstance(obj.get(name), str):
            return TextSource("jsonl", str(p.resolve()), name)
        return None
    if fmt in ("csv", "tsv"):
        try:
            with open(p, newline="", encoding="utf-8") as f:
                header = next(csv.reader(f, delimiter="," if fmt == "csv" else "\t"), None)
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{p}: cannot read the header ({e})") from None
        if not header:
            return None
        name, is_text = choose_column(p, [h.strip() for h in header], column)
        return TextSource(fmt, str(p.resolve()), name) if is_text else None
    if fmt == "parquet":
        pa = require_module("pyarrow", "pyarrow", "Parquet files")
        import pyarrow.parquet as pq

        try:
            schema = pq.read_schema(p)
        except Exception as e:  # noqa: BLE001 - pyarrow's own errors
            raise ValueError(f"{p}: not a readable Parquet file ({e})") from None
        text_cols = [f.name for f in schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)]
        name, _ = choose_column(p, schema.names, column, text_cols)
        return TextSource("parquet", str(p.resolve()), name) if name in text_cols else None
    if fmt == "hf-dataset":
        ds, split = _open_dataset(p)
        text_cols = [c for c, feat in ds.features.items()
                     if getattr(feat, "dtype", None) in ("string", "large_string")]
        name, _ = choose_column(p, ds.column_names, column, text_cols)
        return TextSource("hf-dataset", str(p.resolve()), name, split) if name in text_cols else None
    return None


def _open_dataset(p: Path):
    datasets = require_module("datasets", "datasets", "a saved Hugging Face dataset")
    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as e:  # noqa: BLE001 - datasets raises several kinds
        raise ValueError(f"{p}: not a readable saved Hugging Face dataset ({e})") from None
    split = None
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds)
        split = "train" if "train" in ds else (splits[0] if len(splits) == 1 else None)
        if split is None:
            raise ValueError(f"{p}: a DatasetDict with splits {', '.join(splits)} and no 'train'; give the path of "
                             f"one split's directory")
        ds = ds[split]
    return ds, split


def _files_of(src: TextSource) -> list[Path]:
    """The files whose content the source's hash covers, in a fixed order."""
    root = Path(src.path)
    if src.kind == "stdlib":
        from .corpus import stdlib_documents

        return [Path(d.path) for d in stdlib_documents()]
    if root.is_file():
        return [root]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if name.startswith("."):
                continue
            if src.kind == "text-dir" and Path(name).suffix.lower() not in DOCUMENT_SUFFIXES:
                continue
            out.append(Path(dirpath) / name)
    return out


# documents: (text or None, place, skip reason or None, bytes or rows consumed)
_Doc = tuple[str | None, int, str | None, int]


def _clean(text: Any) -> tuple[str | None, str | None]:
    if text is None:
        return None, "null value"
    if not isinstance(text, str):
        return None, f"not a string ({type(text).__name__})"
    if not text.strip():
        return None, "empty document"
    return text, None


def _iter_jsonl(src: TextSource) -> Iterator[_Doc]:
    field = src.column
    with open(src.path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            n = len(raw)
            if not raw.strip():
                yield None, lineno, None, n  # a blank line is not a document: no skip to report
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield None, lineno, "not UTF-8", n
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                yield None, lineno, "not valid JSON", n
                continue
            if not isinstance(obj, dict):
                yield None, lineno, "not a JSON object", n
                continue
            if field not in obj:
                yield None, lineno, f"no field {field!r}", n
                continue
            text, why = _clean(obj[field])
            yield text, lineno, why, n


def _iter_csv(src: TextSource) -> Iterator[_Doc]:
    delim = "," if src.kind == "csv" else "\t"
    with open(src.path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f, delimiter=delim)
        header = [h.strip() for h in next(reader)]
        idx = header.index(src.column)
        last = 0
        try:
            for row in reader:  # progress by rows: csv does not expose byte offsets
                if not row or not any(c.strip() for c in row):
                    continue
                text, why = _clean(row[idx] if idx < len(row) else "")
                yield text, reader.line_num, why, 1
                last = reader.line_num
        except UnicodeDecodeError as e:
            raise ValueError(f"{src.path}: not UTF-8 after line {last} ({e.reason}); convert the file to UTF-8") from None
        except csv.Error as e:
            raise ValueError(f"{src.path}, line {reader.line_num}: malformed {src.kind.upper()} ({e})") from None


def _iter_parquet(src: TextSource) -> Iterator[_Doc]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(src.path)
    row = 0
    for batch in pf.iter_batches(batch_size=4096, columns=[src.column]):
        for v in batch.column(0).to_pylist():
            row += 1
            text, why = _clean(v)
            yield text, row, why, 1


def _iter_dataset(src: TextSource) -> Iterator[_Doc]:
    ds, _ = _open_dataset(Path(src.path))
    row = 0
    for batch in ds.select_columns([src.column]).iter(batch_size=4096):
        for v in batch[src.column]:
            row += 1
            text, why = _clean(v)
            yield text, row, why, 1


def _iter_files(src: TextSource, files: list[Path]) -> Iterator[_Doc]:
    for k, f in enumerate(files, 1):
        data = f.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            yield None, k, "not UTF-8", len(data)
            continue
        t, why = _clean(text)
        yield t, k, why, len(data)


def _total(src: TextSource, files: list[Path]) -> tuple[int, str]:
    """How much a build has to read, and in what unit (bytes, or rows of a table)."""
    if src.kind in ("parquet", "hf-dataset"):
        if src.kind == "parquet":
            import pyarrow.parquet as pq

            return int(pq.ParquetFile(src.path).metadata.num_rows), "rows"
        ds, _ = _open_dataset(Path(src.path))
        return len(ds), "rows"
    if src.kind in ("csv", "tsv"):
        with open(src.path, "rb") as f:
            return max(1, sum(1 for _ in f) - 1), "rows"
    return sum(f.stat().st_size for f in files), "bytes"


def _documents(src: TextSource, files: list[Path]) -> Iterator[_Doc]:
    if src.kind == "jsonl":
        return _iter_jsonl(src)
    if src.kind in ("csv", "tsv"):
        return _iter_csv(src)
    if src.kind == "parquet":
        return _iter_parquet(src)
    if src.kind == "hf-dataset":
        return _iter_dataset(src)
    return _iter_files(src, files)


# ------------------------------------------------------------------------------------------------
# content hashes, remembered by stat
# ------------------------------------------------------------------------------------------------


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(1 << 22)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def _source_digest(src: TextSource, files: list[Path], root: Path) -> str:
    """SHA-256 over the source's files (relative name and content). Remembered in
    ``sources/<hash of the path>.json`` by every file's size, mtime and inode, so a second run
    hashes nothing unless a file changed."""
    base = Path(src.path)
    sig = []
    for f in files:
        st = f.stat()
        rel = os.path.relpath(f, base) if base.is_dir() else ""  # one file: its content alone
        sig.append([rel, st.st_size, st.st_mtime_ns, st.st_ino])
    memo = root / "sources" / (hashlib.sha256(f"{src.kind}:{src.path}".encode()).hexdigest()[:32] + ".json")
    try:
        old = json.loads(memo.read_text())
        if old.get("sig") == sig and isinstance(old.get("digest"), str):
            return old["digest"]
    except (OSError, ValueError):
        pass
    h = hashlib.sha256()
    for (rel, *_), f in zip(sig, files):
        h.update(rel.encode("utf-8", "surrogateescape") + b"\0" + _sha256_file(f).encode() + b"\n")
    digest = h.hexdigest()
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f".{memo.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"path": src.path, "kind": src.kind, "sig": sig, "digest": digest}))
        os.replace(tmp, memo)
    except OSError:
        pass  # a read-only cache still works; it only hashes again next time
    return digest


# ------------------------------------------------------------------------------------------------
# the cache
# ------------------------------------------------------------------------------------------------


class TokenCache:
    """One cache entry, memory-mapped: ``tokens`` (all documents back to back), ``offsets``
    (documents + 1), ``places`` and ``meta``. Open with :func:`token_cache`."""

    def __init__(self, path: Path, meta: dict) -> None:
        self.path = path
        self.meta = meta
        n = int(meta["tokens"])
        dtype = np.dtype(meta["dtype"])
        self.tokens = (np.memmap(path / "tokens.bin", dtype=dtype, mode="r", shape=(n,)) if n
                       else np.zeros(0, dtype=dtype))
        self.offsets = np.load(path / "offsets.npy", mmap_mode="r")
        self.places = np.load(path / "places.npy", mmap_mode="r")
        self.lengths = np.diff(np.asarray(self.offsets)).astype(np.int64)  # (documents,)
        self.lengths.flags.writeable = False
        self.reused = False
        """True when an existing entry was opened, False when it was built by this call."""

    def __len__(self) -> int:
        return int(self.lengths.size)

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary (256 byte-level): a model needs at least this many embeddings."""
        return int(self.meta["vocab_size"])

    def document(self, i: int) -> np.ndarray:
        """Token ids of document ``i`` (a read-only view of the memory map)."""
        return self.tokens[int(self.offsets[i]):int(self.offsets[i + 1])]

    def read(self, start: int, n: int) -> np.ndarray:
        """``n`` token ids from position ``start`` of the whole stream, as int64."""
        return np.asarray(self.tokens[int(start):int(start) + int(n)], dtype=np.int64)

    def where(self, i: int) -> str:
        """Where document ``i`` came from, e.g. ``"line 17"``."""
        unit = self.meta.get("unit", "document")
        return f"{unit} {int(self.places[i])}"

    @property
    def skipped(self) -> dict[str, int]:
        return dict(self.meta.get("skipped") or {})

    def describe(self) -> str:
        """One line: documents, tokens, tokenizer, skips, where the cache is."""
        m = self.meta
        tok = ("byte-level, no tokenizer given" if m["tokenizer"]["digest"] == "byte-level"
               else f"tokenizer {m['tokenizer']['name']}, {m['vocab_size']:,} tokens")
        text = f"{m['documents']:,} documents of {Path(m['source']).name} ({tok})"
        if self.skipped:
            text += ", skipped " + ", ".join(f"{v:,} {k}" for k, v in self.skipped.items())
        return text + f", token cache {self.path}{' (reused)' if self.reused else ''}"

    def provenance(self) -> dict:
        """Plain data for a LengthSet's provenance."""
        m = self.meta
        out = {"kind": "file" if m["format"] != "stdlib" else "corpus", "path": m["source"], "format": m["format"],
               "column": m.get("column"), "tokenizer": m["tokenizer"]["path"] or "byte-level",
               "estimate": False, "count": int(m["documents"]), "tokens": int(m["tokens"]),
               "token_cache": str(self.path)}
        if m["tokenizer"]["digest"] == "byte-level":
            out["note"] = ("byte-level tokens (1 per UTF-8 byte, ids 0..255): no tokenizer given; pass --tokenizer PATH "
                           "for your model's tokens")
        if self.skipped:
            out["skipped"] = self.skipped
            out["skipped_examples"] = m.get("skipped_examples", {})
        return out


def _check_entry(path: Path, key: str) -> tuple[dict | None, str | None]:
    """``(meta, None)`` for a complete entry, ``(None, why)`` for a damaged one."""
    try:
        meta = json.loads((path / "meta.json").read_text())
    except FileNotFoundError:
        return None, "no meta.json (not finished)"
    except (OSError, ValueError) as e:
        return None, f"meta.json unreadable ({e})"
    if meta.get("version") != CACHE_VERSION or meta.get("key") != key:
        return None, "written by another version"
    try:
        n, docs = int(meta["tokens"]), int(meta["documents"])
        item = np.dtype(meta["dtype"]).itemsize
        size = (path / "tokens.bin").stat().st_size
        if size != n * item:
            return None, f"tokens.bin holds {size:,} bytes, meta.json says {n * item:,}"
        off = np.load(path / "offsets.npy", mmap_mode="r")
        places = np.load(path / "places.npy", mmap_mode="r")
        if off.shape != (docs + 1,) or int(off[0]) != 0 or int(off[-1]) != n or places.shape != (docs,):
            return None, "offsets.npy does not match meta.json"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"damaged ({type(e).__name__}: {e})"
    return meta, None


def _say_default(msg: str) -> None:
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


def token_cache(source: str, *, column: str | None = None, tokenizer: str | os.PathLike | None = None,
                root: str | os.PathLike | None = None, progress: Progress | None = None,
                say: Callable[[str], None] | None = None) -> TokenCache:
    """The token cache of a text source: opened when it exists and verifies, else built (once,
    under a lock that other processes wait on), with ``progress(fraction, message)`` calls while
    tokenising. ``say`` gets one line for anything a user should know (a half-written build
    removed, a damaged entry rebuilt, waiting for another process); default stderr.

    Raises ValueError when ``source`` is not a text source (see :func:`text_source`), for a missing
    column, an unreadable file or tokenizer, or when no document is left after the skips."""
    say = say or _say_default
    src = text_source(source, column=column, tokenizer=tokenizer)
    if src is None:
        raise ValueError(f"{source!r} holds lengths, not text: there is nothing to tokenise; give a text source (a "
                         f"document, a folder of them, JSONL/CSV/Parquet with a text column, a saved dataset)")
    tok = load_tokenizer(tokenizer)
    root = Path(root) if root is not None else cache_root()
    root.mkdir(parents=True, exist_ok=True)
    files = _files_of(src)
    digest = _source_digest(src, files, root)
    key = hashlib.sha256(json.dumps({"v": CACHE_VERSION, "source": digest, "kind": src.kind, "column": src.column,
                                     "split": src.split, "tokenizer": tok.digest, "special_tokens": True},
                                    sort_keys=True).encode()).hexdigest()[:32]
    entry = root / key
    meta, _ = _check_entry(entry, key)
    if meta is not None:  # the common case: no lock needed to read a finished entry
        cache = TokenCache(entry, meta)
        cache.reused = True
        return cache
    with open(root / f"{key}.lock", "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"token cache: waiting for another process that is tokenising {src.path} ...")
            fcntl.flock(lock, fcntl.LOCK_EX)
        meta, why = _check_entry(entry, key)
        if meta is not None:  # built by the process we waited for
            cache = TokenCache(entry, meta)
            cache.reused = True
            return cache
        if entry.exists():
            say(f"token cache {entry} is incomplete or damaged ({why}); rebuilding it")
            shutil.rmtree(entry)
        for stale in root.glob(f".build-{key}-*"):
            # we hold the lock, so whoever was building this is gone: a killed run
            say(f"token cache: removing {stale.name}, half-written by a run that was killed; tokenising again")
            shutil.rmtree(stale, ignore_errors=True)
        tmp = root / f".build-{key}-{os.getpid()}"
        try:
            meta = _build(src, files, tok, tmp, key, progress)
            os.replace(tmp, entry)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return TokenCache(entry, meta)


def _build(src: TextSource, files: list[Path], tok: Tokenizer, tmp: Path, key: str,
           progress: Progress | None) -> dict:
    """Tokenise ``src`` into the folder ``tmp`` (tokens.bin, offsets.npy, places.npy, meta.json,
    each flushed to disk). Returns the meta. Raises ValueError when no document is left."""
    tmp.mkdir(parents=True)
    t0 = time.perf_counter()
    total, unit = _total(src, files)
    done = 0
    last_report = 0.0
    counts: list[np.ndarray] = []
    places: list[int] = []
    skipped: dict[str, int] = {}
    examples: dict[str, list[int]] = {}
    n_tokens = 0
    max_id = -1
    batch: list[str] = []
    chars = 0

    def flush(out) -> None:
        nonlocal batch, chars, n_tokens, max_id
        if not batch:
            return
        ids, c = tok.encode(batch)
        out.write(ids.tobytes())
        counts.append(c)
        n_tokens += int(ids.size)
        if ids.size:
            max_id = max(max_id, int(ids.max()))
        batch, chars = [], 0

    with open(tmp / "tokens.bin", "wb") as out:
        for text, place, why, consumed in _documents(src, files):
            done += consumed
            if why is not None:
                skipped[why] = skipped.get(why, 0) + 1
                if len(examples.setdefault(why, [])) < _EXAMPLES:
                    examples[why].append(place)
            elif text is not None:
                batch.append(text)
                places.append(place)
                chars += len(text)
                if len(batch) >= BATCH_DOCS or chars >= BATCH_CHARS:
                    flush(out)
                    now = time.perf_counter()
                    if progress is not None and now - last_report > 0.5:
                        last_report = now
                        progress(min(1.0, done / max(1, total)),
                                 f"tokenising {Path(src.path).name}: {len(places):,} documents, {n_tokens:,} tokens")
        flush(out)
        out.flush()
        os.fsync(out.fileno())
    if not places:
        what = ", ".join(f"{v:,} {k}" for k, v in skipped.items()) or "the source is empty"
        raise ValueError(f"{src.path}: no document to train on ({what}); check the file and --column")
    c = np.concatenate(counts) if counts else np.zeros(0, dtype=np.int64)
    zero = np.flatnonzero(c == 0)
    if zero.size:  # text that tokenises to nothing (e.g. only characters the tokenizer drops)
        skipped["no tokens"] = int(zero.size)
        examples["no tokens"] = [places[int(i)] for i in zero[:_EXAMPLES]]
        keep = c > 0
        c = c[keep]
        places = [p for p, k in zip(places, keep) if k]
        if not places:
            raise ValueError(f"{src.path}: no document gives any token with {tok.describe()}")
    offsets = np.concatenate(([0], np.cumsum(c))).astype(np.int64)
    np.save(tmp / "offsets.npy", offsets)
    np.save(tmp / "places.npy", np.asarray(places, dtype=np.int64))
    seconds = time.perf_counter() - t0
    meta = {
        "version": CACHE_VERSION, "key": key, "source": src.path, "format": src.kind, "column": src.column,
        "split": src.split, "unit": src.unit, "documents": len(places), "tokens": int(n_tokens),
        "dtype": tok.dtype.name, "vocab_size": tok.vocab_size, "max_id": max_id,
        "tokenizer": {"path": tok.path, "name": tok.name, "digest": tok.digest, "special_tokens": True},
        "skipped": skipped, "skipped_examples": {k: v for k, v in examples.items()},
        "source_size": total, "source_unit": unit,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "build_seconds": round(seconds, 3),
        "documents_per_s": round(len(places) / max(seconds, 1e-9), 1),
        "tokens_per_s": round(n_tokens / max(seconds, 1e-9), 1),
    }
    mtmp = tmp / "meta.json.tmp"
    mtmp.write_text(json.dumps(meta, indent=1))
    os.replace(mtmp, tmp / "meta.json")  # last: an entry without it is unfinished
    if progress is not None:
        progress(1.0, f"tokenised {Path(src.path).name}: {len(places):,} documents, {n_tokens:,} tokens "
                      f"in {seconds:.1f}s")
    return meta
