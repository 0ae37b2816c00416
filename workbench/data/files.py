"""Sequence lengths from files, each with its provenance.

Formats, chosen by suffix (or ``fmt=``):

* ``lines`` (``.txt``, ``.lengths``, no suffix): one positive integer per line; blank lines are
  skipped and ``#`` starts a comment.
* ``csv`` / ``tsv`` (``.csv``, ``.tsv``) and ``parquet`` (``.parquet``): a column, named by
  ``column=`` or found among :data:`LENGTH_COLUMNS`; failing those a ``text`` column is tokenised.
  In Parquet a string-typed column is always tokenised.
* ``npy`` (``.npy``): a 1-D integer array.
* ``jsonl`` (``.jsonl``): one object per line with a length field (same names) or a ``text`` field.
* ``json`` (``.json``): a list of integers, or an object with a ``lengths`` list.
* ``text`` (``.md``, ``.rst``, ``.text``): one document, tokenised; a directory of such files (and
  ``.txt``) gives one length per document.
* ``hf-dataset``: a directory written by ``datasets.Dataset.save_to_disk`` (it holds
  ``state.json``/``dataset_info.json``, or ``dataset_dict.json`` for a DatasetDict), reading a
  length column or tokenising ``text``.

Tokenising uses a Hugging Face tokenizer from a local ``tokenizer.json`` when ``tokenizer=`` is
given; otherwise it counts UTF-8 bytes (one token per byte) and marks the result as an estimate in
the provenance, since a BPE tokenizer gives roughly 4x fewer tokens.

Every problem raises ValueError naming the file, the place (1-based line for line formats, row
for tables, element for arrays), the offending value and how to fix it. pyarrow, datasets and
tokenizers are imported only by the readers that need them.
"""

from __future__ import annotations

import csv
import importlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

__all__ = [
    "DOCUMENT_SUFFIXES",
    "FORMATS",
    "FileLengths",
    "LENGTH_COLUMNS",
    "choose_column",
    "detect_format",
    "read_lengths_file",
    "require_module",
]

LENGTH_COLUMNS = ("length", "num_tokens", "n_tokens", "len", "tokens")
TEXT_COLUMN = "text"
# files taken as documents inside a directory of text
DOCUMENT_SUFFIXES = (".md", ".rst", ".text", ".txt")
FORMATS = ("lines", "csv", "tsv", "parquet", "npy", "jsonl", "json", "text", "text-dir", "hf-dataset")

_SUFFIX_FORMATS = {
    ".txt": "lines",
    ".lengths": "lines",
    "": "lines",
    ".csv": "csv",
    ".tsv": "tsv",
    ".parquet": "parquet",
    ".npy": "npy",
    ".jsonl": "jsonl",
    ".json": "json",
    ".md": "text",
    ".rst": "text",
    ".text": "text",
}
_HF_MARKERS = ("state.json", "dataset_info.json", "dataset_dict.json")
# lengths beyond this cannot be real sequences and would overflow sums of int64
_MAX_LENGTH = 2**53

_BYTE_NOTE = (
    "byte-level count (1 token per UTF-8 byte): an estimate; a BPE tokenizer gives roughly 4x "
    "fewer tokens. Pass tokenizer=PATH (a tokenizer.json or a directory holding one) for exact counts."
)


@dataclass(frozen=True, kw_only=True, slots=True)
class FileLengths:
    """Lengths read from a file: ``lengths`` (int64, >= 1), ``provenance`` (plain JSON-able dict),
    and where each length came from: ``locations`` (1-based line/row numbers, or 0-based element
    indices, per ``location_unit``) or ``documents`` (paths of a directory's documents)."""

    lengths: np.ndarray
    provenance: dict
    location_unit: str = "element"
    locations: np.ndarray | None = None
    documents: tuple[str, ...] | None = None

    def where(self, i: int) -> str:
        """Return a human description of where length ``i`` came from, e.g. ``"line 17"``."""
        if self.documents is not None:
            return f"document {self.documents[i]}"
        if self.locations is not None:
            return f"{self.location_unit} {int(self.locations[i])}"
        return f"{self.location_unit} {i}"


# --- helpers ---------------------------------------------------------------------------------


def require_module(module: str, package: str, what: str) -> Any:
    """Return the imported ``module``; raises ImportError naming the ``package`` to install and
    ``what`` it is needed for (the readers here and the token cache share it)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(
            f"reading {what} needs the {package!r} package, which is not installed: "
            f"pip install {package}"
        ) from None


def _parse_int(text: str) -> int | None:
    """An integer from ``text`` ("1024", "1_024", "1024.0", "1e3"), or None if it is not one."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        f = float(text)
    except ValueError:
        return None
    if math.isfinite(f) and f.is_integer():
        return int(f)
    return None


def _bad_length(path: Path, where: str, value: Any, fix: str) -> ValueError:
    return ValueError(f"{path}, {where}: {value!r} is not a positive integer length; {fix}")


def _range_error(path: Path, where: str, v: int, fix: str, how_many: int = 1) -> ValueError:
    why = "lengths must be >= 1" if v < 1 else f"lengths above {_MAX_LENGTH} are not sequence lengths"
    more = f"; {how_many} such values in the file" if how_many > 1 else ""
    return ValueError(f"{path}, {where}: {v!r} is not a positive integer length ({why}{more}); {fix}")


def _check_values(path: Path, values: np.ndarray, locate, fix: str) -> None:
    """Raise for the first length < 1 or absurdly large; ``locate(i)`` names its place."""
    bad = np.flatnonzero((values < 1) | (values > _MAX_LENGTH))
    if bad.size:
        i = int(bad[0])
        raise _range_error(path, locate(i), int(values[i]), fix, bad.size)


def _to_int64(path: Path, values: list[int], locate, fix: str) -> np.ndarray:
    """int64 array from Python ints, checking the range first so no value can wrap around."""
    for i, v in enumerate(values):
        if not 1 <= v <= _MAX_LENGTH:
            raise _range_error(path, locate(i), v, fix, sum(1 for w in values if not 1 <= w <= _MAX_LENGTH))
    return np.array(values, dtype=np.int64)


def _empty(path: Path, what: str) -> ValueError:
    return ValueError(f"{path}: no lengths found ({what}); {_fix_hint(path)}")


def _fix_hint(path: Path) -> str:
    fmt = _SUFFIX_FORMATS.get(path.suffix.lower(), "lines")
    return {
        "lines": "put one positive integer per line ('#' starts a comment)",
        "csv": "give a header row and a column of positive integers (or a 'text' column)",
        "tsv": "give a header row and a column of positive integers (or a 'text' column)",
        "jsonl": 'write one object per line, e.g. {"length": 1024} or {"text": "..."}',
        "json": "write a list of positive integers, or {\"lengths\": [...]}",
        "npy": "save a 1-D array of positive integers, e.g. np.save(path, lengths.astype(np.int64))",
        "parquet": "give a column of positive integers (or a string 'text' column)",
        "text": "give a non-empty UTF-8 text file",
    }.get(fmt, "see workbench.data.files for the supported formats")


def _read_text(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the file ({exc.strerror or exc})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ValueError(
            f"{path}, line {line}: byte {data[exc.start:exc.start + 1]!r} at offset {exc.start} is "
            "not UTF-8; convert the file to UTF-8"
        ) from None


def choose_column(
    path: Path, columns: Sequence[str], column: str | None, text_columns: Iterable[str] = ()
) -> tuple[str, bool]:
    """Pick the column to read; returns (name, is_text). ``text_columns`` are columns known to
    hold strings (typed formats), which are tokenised rather than read as lengths. Raises
    ValueError naming ``path`` and the columns present when ``column`` is not among them, or when
    none is given and no length or text column is found (the readers here and the token cache
    share it)."""
    columns = list(columns)
    text_columns = set(text_columns)
    present = ", ".join(repr(c) for c in columns) or "(none)"
    if column is not None:
        if column not in columns:
            raise ValueError(
                f"{path}: no column {column!r}; columns present: {present}; pass one of them as column="
            )
        return column, column in text_columns or column == TEXT_COLUMN
    lowered = {c.lower(): c for c in columns}
    for name in LENGTH_COLUMNS:
        if name in columns:
            return name, name in text_columns
        if name in lowered:
            return lowered[name], lowered[name] in text_columns
    if TEXT_COLUMN in lowered:
        return lowered[TEXT_COLUMN], True
    raise ValueError(
        f"{path}: no length column found; columns present: {present}; pass column=NAME, or name the "
        f"column one of {', '.join(LENGTH_COLUMNS)} (or 'text' to tokenise it)"
    )


class _Counter:
    """Counts tokens of texts: a Hugging Face tokenizer, or UTF-8 bytes as an estimate."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = None
        if tokenizer is None:
            self.provenance = {"tokenizer": "byte-level", "estimate": True, "note": _BYTE_NOTE}
            return
        if hasattr(tokenizer, "encode_batch"):
            # an already-built tokenizers.Tokenizer
            self._tok = tokenizer
            self.provenance = {"tokenizer": type(tokenizer).__name__, "estimate": False}
            return
        tpath = Path(tokenizer)
        if tpath.is_dir():
            tpath = tpath / "tokenizer.json"
        if not tpath.is_file():
            raise ValueError(
                f"{tokenizer}: no tokenizer file found (expected a tokenizer.json or a directory "
                "holding one, on local disk; nothing is downloaded)"
            )
        tokenizers = require_module("tokenizers", "tokenizers", "a Hugging Face tokenizer")
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(tpath))
        except Exception as exc:  # the Rust side raises its own exception type
            raise ValueError(f"{tpath}: not a readable tokenizer.json ({exc})") from None
        self.provenance = {"tokenizer": str(tpath.resolve()), "estimate": False}

    def count(self, texts: Sequence[str]) -> np.ndarray:
        if self._tok is None:
            return np.fromiter((len(t.encode("utf-8")) for t in texts), dtype=np.int64, count=len(texts))
        out = np.empty(len(texts), dtype=np.int64)
        step = 1024  # bounded batches keep memory flat on large columns
        for start in range(0, len(texts), step):
            encs = self._tok.encode_batch(list(texts[start:start + step]))
            out[start:start + len(encs)] = [len(e.ids) for e in encs]
        return out


def _tokenised(path: Path, texts: list, places: list, unit: str, counter: _Counter) -> np.ndarray:
    """Token counts of ``texts``; a non-string or empty text raises naming its place."""
    for t, place in zip(texts, places, strict=True):
        if not isinstance(t, str):
            raise ValueError(f"{path}, {unit} {place}: text value {t!r} is not a string; fix or drop that {unit}")
    counts = counter.count(texts)
    zero = np.flatnonzero(counts < 1)
    if zero.size:
        i = int(zero[0])
        raise ValueError(
            f"{path}, {unit} {places[i]}: text {texts[i]!r} gives 0 tokens, and lengths must be >= 1; "
            f"drop the empty {unit}s ({zero.size} in the file)"
        )
    return counts


# --- readers ---------------------------------------------------------------------------------


def _read_lines(path: Path) -> FileLengths:
    text = _read_text(path)
    values: list[int] = []
    linenos: list[int] = []
    fix = "put one positive integer per line ('#' starts a comment)"
    # one pass in plain Python: about 0.3 s per million lines, and it knows every line number.
    # split("\n"), not splitlines(): form feeds and other separators must not shift line numbers
    for lineno, raw in enumerate(text.split("\n"), 1):
        if "#" in raw:
            raw = raw[: raw.index("#")]
        s = raw.strip()
        if not s:
            continue
        try:
            v = int(s)
        except ValueError:
            v = _parse_int(s)
            if v is None:
                raise _bad_length(path, f"line {lineno}", s, fix) from None
        values.append(v)
        linenos.append(lineno)
    if not values:
        raise _empty(path, "the file is empty or holds only blank lines and comments")
    lines = np.array(linenos, dtype=np.int64)
    try:
        arr = np.array(values, dtype=np.int64)
    except OverflowError:
        # a value beyond int64: the exact check finds and names it
        arr = _to_int64(path, values, lambda i: f"line {int(lines[i])}", fix)
    _check_values(path, arr, lambda i: f"line {int(lines[i])}", fix)
    return FileLengths(
        lengths=arr,
        provenance={"format": "lines", "estimate": False},
        location_unit="line",
        locations=lines,
    )


def _read_csv(path: Path, column: str | None, counter_factory, delimiter: str) -> FileLengths:
    fmt = "csv" if delimiter == "," else "tsv"
    try:
        f = open(path, newline="", encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the file ({exc.strerror or exc})") from None
    with f:
        reader = csv.reader(f, delimiter=delimiter)
        try:
            header = next(reader, None)
            while header is not None and not any(h.strip() for h in header):
                header = next(reader, None)
            if header is None:
                raise _empty(path, "the file is empty")
            header = [h.strip() for h in header]
            name, is_text = choose_column(path, header, column)
            idx = header.index(name)
            cells: list[str] = []
            linenos: list[int] = []
            for row in reader:
                if not row or not any(c.strip() for c in row):
                    continue
                # reader.line_num is the physical line just read: right even with quoted newlines
                linenos.append(reader.line_num)
                cells.append(row[idx] if idx < len(row) else "")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}: not UTF-8 ({exc.reason}); convert the file to UTF-8") from None
        except csv.Error as exc:
            raise ValueError(f"{path}, line {reader.line_num}: malformed {fmt.upper()} ({exc})") from None
    if not cells:
        raise _empty(path, f"the header names column {name!r} but no rows follow")
    prov = {"format": fmt, "column": name}
    if is_text:
        counter = counter_factory()
        arr = _tokenised(path, cells, linenos, "line", counter)
        prov.update(counter.provenance)
    else:
        fix = f"column {name!r} must hold positive integers (pass column= to read another)"
        vals = []
        for cell, lineno in zip(cells, linenos, strict=True):
            v = _parse_int(cell.strip())
            if v is None:
                raise _bad_length(path, f"line {lineno}", cell, fix)
            vals.append(v)
        arr = _to_int64(path, vals, lambda i: f"line {linenos[i]}", fix)
        prov["estimate"] = False
    return FileLengths(
        lengths=arr, provenance=prov, location_unit="line", locations=np.array(linenos, dtype=np.int64)
    )


def _read_npy(path: Path) -> FileLengths:
    try:
        arr = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise ValueError(
            f"{path}: not a readable .npy array ({exc}); save one with np.save(path, lengths)"
        ) from None
    if not isinstance(arr, np.ndarray) or arr.ndim != 1:
        shape = getattr(arr, "shape", None)
        raise ValueError(f"{path}: expected a 1-D array of lengths, got shape {shape}; save lengths.ravel()")
    if arr.dtype.kind not in "iu":
        raise ValueError(
            f"{path}: dtype {arr.dtype} is not an integer type; lengths must be integers: "
            "save lengths.astype(np.int64)"
        )
    if arr.size == 0:
        raise _empty(path, "the array is empty")
    fix = "save a 1-D array of positive integers"
    if arr.dtype == np.uint64 and np.any(arr > _MAX_LENGTH):
        i = int(np.flatnonzero(arr > _MAX_LENGTH)[0])
        raise _bad_length(path, f"element {i} (0-based)", int(arr[i]), fix)
    out = arr.astype(np.int64)
    _check_values(path, out, lambda i: f"element {i} (0-based)", fix)
    return FileLengths(lengths=out, provenance={"format": "npy", "estimate": False}, location_unit="element")


def _read_jsonl(path: Path, column: str | None, counter_factory) -> FileLengths:
    text = _read_text(path)
    field: str | None = column
    is_text = column == TEXT_COLUMN
    values: list = []
    linenos: list[int] = []
    for lineno, raw in enumerate(text.split("\n"), 1):
        s = raw.strip()
        if not s:
            continue
        try:
            obj = json.loads(s)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{path}, line {lineno}: not valid JSON ({exc.msg}): {s[:80]!r}; write one JSON object per line"
            ) from None
        if not isinstance(obj, dict):
            raise ValueError(
                f"{path}, line {lineno}: {s[:80]!r} is not a JSON object; write e.g. {{\"length\": 1024}}"
            )
        if field is None:
            # the first record decides the field; every later record must carry the same one
            field, is_text = choose_column(path, list(obj), None)
        if field not in obj:
            raise ValueError(
                f"{path}, line {lineno}: no field {field!r} (keys present: {', '.join(map(repr, obj)) or 'none'}); "
                "every line needs the same length or text field"
            )
        values.append(obj[field])
        linenos.append(lineno)
    if not values:
        raise _empty(path, "the file is empty or holds only blank lines")
    prov = {"format": "jsonl", "column": field}
    if is_text:
        counter = counter_factory()
        arr = _tokenised(path, values, linenos, "line", counter)
        prov.update(counter.provenance)
    else:
        fix = f"field {field!r} must hold positive integers"
        ints = []
        for v, lineno in zip(values, linenos, strict=True):
            ok = isinstance(v, int) and not isinstance(v, bool)
            if not ok and isinstance(v, float) and math.isfinite(v) and v.is_integer():
                v, ok = int(v), True
            if not ok:
                raise _bad_length(path, f"line {lineno}", v, fix)
            ints.append(v)
        arr = _to_int64(path, ints, lambda i: f"line {linenos[i]}", fix)
        prov["estimate"] = False
    return FileLengths(
        lengths=arr, provenance=prov, location_unit="line", locations=np.array(linenos, dtype=np.int64)
    )


def _read_json(path: Path) -> FileLengths:
    try:
        obj = json.loads(_read_text(path))
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{path}, line {exc.lineno}: not valid JSON ({exc.msg}); write a list of integers"
        ) from None
    if isinstance(obj, dict) and "lengths" in obj:
        obj = obj["lengths"]
    if not isinstance(obj, list):
        raise ValueError(f"{path}: expected a JSON list of lengths or {{\"lengths\": [...]}}, got {type(obj).__name__}")
    if not obj:
        raise _empty(path, "the list is empty")
    fix = "the list must hold positive integers"
    for i, v in enumerate(obj):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or _parse_int(str(v)) is None:
            raise _bad_length(path, f"element {i} (0-based)", v, fix)
    arr = _to_int64(path, [int(v) for v in obj], lambda i: f"element {i} (0-based)", fix)
    return FileLengths(lengths=arr, provenance={"format": "json", "estimate": False}, location_unit="element")


def _read_text_file(path: Path, counter_factory) -> FileLengths:
    counter = counter_factory()
    if counter._tok is None:
        # byte-level: the count is the size; no need to decode
        n = path.stat().st_size
    else:
        n = int(counter.count([_read_text(path)])[0])
    if n < 1:
        raise _empty(path, "the document is empty")
    prov = {"format": "text", **counter.provenance}
    return FileLengths(
        lengths=np.array([n], dtype=np.int64), provenance=prov, location_unit="document", documents=(path.name,)
    )


def _read_text_dir(path: Path, counter_factory) -> FileLengths:
    files = []
    for dirpath, dirnames, filenames in os.walk(path):
        # sorted, hidden entries skipped: the same directory always gives the same order
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if not name.startswith(".") and Path(name).suffix.lower() in DOCUMENT_SUFFIXES:
                files.append(Path(dirpath) / name)
    if not files:
        raise ValueError(
            f"{path}: the directory holds no documents (files ending {', '.join(DOCUMENT_SUFFIXES)}) and "
            "is not a saved Hugging Face dataset (no state.json / dataset_info.json)"
        )
    counter = counter_factory()
    if counter._tok is None:
        counts = np.array([f.stat().st_size for f in files], dtype=np.int64)
    else:
        counts = counter.count([_read_text(f) for f in files])
    rel = [str(f.relative_to(path)) for f in files]
    keep = counts >= 1
    skipped = [r for r, k in zip(rel, keep, strict=True) if not k]
    if not keep.any():
        raise _empty(path, "every document in the directory is empty")
    prov = {"format": "text-dir", "documents": int(keep.sum()), **counter.provenance}
    if skipped:
        # never silent: empty documents are left out, and said so
        prov["skipped_empty_documents"] = skipped
    return FileLengths(
        lengths=counts[keep],
        provenance=prov,
        location_unit="document",
        documents=tuple(r for r, k in zip(rel, keep, strict=True) if k),
    )


def _arrow_lengths(path: Path, col: Any, name: str, unit: str, counter_factory) -> tuple[np.ndarray, dict]:
    """Lengths from a pyarrow (Chunked)Array: integers read, strings tokenised; (array, provenance)."""
    pa = require_module("pyarrow", "pyarrow", "Parquet files and Hugging Face datasets")
    typ = col.type
    if pa.types.is_string(typ) or pa.types.is_large_string(typ):
        texts = col.to_pylist()
        counter = counter_factory()
        places = list(range(1, len(texts) + 1))
        arr = _tokenised(path, texts, places, unit, counter)
        return arr, {"column": name, **counter.provenance}
    fix = f"column {name!r} must hold positive integers (pass column= to read another)"
    if col.null_count:
        mask = np.asarray(col.is_null().to_numpy(zero_copy_only=False))
        i = int(np.flatnonzero(mask)[0])
        raise _bad_length(path, f"{unit} {i + 1}", None, fix + "; drop or fill the empty rows")
    if pa.types.is_integer(typ):
        vals = np.asarray(col.to_numpy(), dtype=np.int64) if not pa.types.is_uint64(typ) else None
        if vals is None:
            raw = np.asarray(col.to_numpy())
            big = np.flatnonzero(raw > _MAX_LENGTH)
            if big.size:
                raise _bad_length(path, f"{unit} {int(big[0]) + 1}", int(raw[big[0]]), fix)
            vals = raw.astype(np.int64)
    elif pa.types.is_floating(typ):
        raw = np.asarray(col.to_numpy(), dtype=np.float64)
        bad = np.flatnonzero(~np.isfinite(raw) | (raw != np.round(raw)))
        if bad.size:
            raise _bad_length(path, f"{unit} {int(bad[0]) + 1}", float(raw[bad[0]]), fix)
        vals = raw.astype(np.int64)
    else:
        raise ValueError(f"{path}: column {name!r} has type {typ}, neither integers nor text; {fix}")
    _check_values(path, vals, lambda i: f"{unit} {i + 1}", fix)
    return vals, {"column": name, "estimate": False}


def _read_parquet(path: Path, column: str | None, counter_factory) -> FileLengths:
    require_module("pyarrow", "pyarrow", "Parquet files")
    import pyarrow.parquet as pq  # noqa: PLC0415 (lazy: pyarrow is optional)

    try:
        schema = pq.read_schema(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid and friends
        raise ValueError(f"{path}: not a readable Parquet file ({exc})") from None
    pa = require_module("pyarrow", "pyarrow", "Parquet files")
    text_cols = [f.name for f in schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)]
    name, _ = choose_column(path, schema.names, column, text_cols)
    col = pq.read_table(path, columns=[name]).column(name)
    if len(col) == 0:
        raise _empty(path, "the table has no rows")
    arr, prov = _arrow_lengths(path, col, name, "row", counter_factory)
    return FileLengths(lengths=arr, provenance={"format": "parquet", **prov}, location_unit="row",
                       locations=np.arange(1, len(arr) + 1, dtype=np.int64))


def _read_hf_dataset(path: Path, column: str | None, counter_factory) -> FileLengths:
    datasets = require_module("datasets", "datasets", "a saved Hugging Face dataset")
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets raises FileNotFoundError, ValueError, its own errors
        raise ValueError(f"{path}: not a readable saved Hugging Face dataset ({exc})") from None
    split = None
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds)
        split = "train" if "train" in ds else (splits[0] if len(splits) == 1 else None)
        if split is None:
            raise ValueError(
                f"{path}: a DatasetDict with splits {', '.join(splits)} and no 'train'; give the path "
                "of one split's directory"
            )
        ds = ds[split]
    text_cols = [
        c for c, feat in ds.features.items() if getattr(feat, "dtype", None) in ("string", "large_string")
    ]
    name, _ = choose_column(path, ds.column_names, column, text_cols)
    if len(ds) == 0:
        raise _empty(path, "the dataset has no rows")
    col = ds.with_format("arrow")[name]
    arr, prov = _arrow_lengths(path, col, name, "row", counter_factory)
    prov = {"format": "hf-dataset", **prov}
    if split is not None:
        prov["split"] = split
    return FileLengths(lengths=arr, provenance=prov, location_unit="row",
                       locations=np.arange(1, len(arr) + 1, dtype=np.int64))


# --- entry points ----------------------------------------------------------------------------


def detect_format(path: str | os.PathLike) -> str:
    """Return the format name (one of :data:`FORMATS`) that ``path`` will be read as.

    Raises ValueError if the path does not exist or its suffix is not a supported one.
    """
    p = Path(path)
    if p.is_dir():
        return "hf-dataset" if any((p / m).is_file() for m in _HF_MARKERS) else "text-dir"
    if not p.exists():
        raise ValueError(
            f"{p}: no such file or directory; give an existing lengths file, document, directory or "
            "saved dataset"
        )
    fmt = _SUFFIX_FORMATS.get(p.suffix.lower())
    if fmt is None:
        raise ValueError(
            f"{p}: unsupported suffix {p.suffix!r}; supported: "
            f"{', '.join(repr(s) if s else 'no suffix' for s in _SUFFIX_FORMATS)}, a directory of documents, "
            f"or a saved dataset; or pass fmt= one of {', '.join(FORMATS)}"
        )
    return fmt


def read_lengths_file(
    path: str | os.PathLike,
    *,
    column: str | None = None,
    tokenizer: Any = None,
    fmt: str | None = None,
) -> FileLengths:
    """Read sequence lengths from ``path`` (a file or directory; format by suffix, or ``fmt``).

    ``column`` names the column or field of a table (CSV/TSV/Parquet/JSONL/dataset); ``tokenizer``
    is a local ``tokenizer.json`` path, a directory holding one, or a ``tokenizers.Tokenizer``,
    used wherever text is tokenised (without it, UTF-8 bytes are counted and the provenance says
    ``estimate: True``).

    Returns a :class:`FileLengths` whose provenance holds ``kind``, ``path``, ``format``,
    ``count``, ``tokens``, ``estimate`` and, as they apply, ``column``, ``tokenizer``, ``note``.

    Raises ValueError naming the file, the line/row/element and the offending value for: a missing
    file, an empty file, a non-numeric or non-integer value, a length < 1, a non-integer ``.npy``
    dtype, a missing column (listing those present), non-UTF-8 text or an unreadable tokenizer.
    Raises ImportError naming the package to install when pyarrow, datasets or tokenizers is
    needed and missing.
    """
    p = Path(path)
    if fmt is None:
        fmt = detect_format(p)
    elif fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
    elif not p.exists():
        detect_format(p)  # raises the missing-file error
    if isinstance(tokenizer, (str, os.PathLike)) and not Path(tokenizer).exists():
        # checked up front: a mistyped tokenizer path must not pass unnoticed on a length column
        raise ValueError(
            f"{tokenizer}: tokenizer path not found; give a local tokenizer.json or a directory holding one"
        )
    if fmt not in ("text-dir", "hf-dataset") and p.is_dir():
        raise ValueError(f"{p}: is a directory, but format {fmt!r} reads a file")

    # the tokenizer is built only when some text is actually tokenised
    def counter_factory() -> _Counter:
        return _Counter(tokenizer)

    if fmt == "lines":
        res = _read_lines(p)
    elif fmt in ("csv", "tsv"):
        res = _read_csv(p, column, counter_factory, "," if fmt == "csv" else "\t")
    elif fmt == "npy":
        res = _read_npy(p)
    elif fmt == "jsonl":
        res = _read_jsonl(p, column, counter_factory)
    elif fmt == "json":
        res = _read_json(p)
    elif fmt == "parquet":
        res = _read_parquet(p, column, counter_factory)
    elif fmt == "text":
        res = _read_text_file(p, counter_factory)
    elif fmt == "text-dir":
        res = _read_text_dir(p, counter_factory)
    else:
        res = _read_hf_dataset(p, column, counter_factory)

    prov = {
        "kind": "file",
        "path": str(p.resolve()),
        **res.provenance,
        "count": int(res.lengths.size),
        "tokens": int(res.lengths.sum()),
    }
    prov.setdefault("estimate", False)
    return FileLengths(
        lengths=res.lengths,
        provenance=prov,
        location_unit=res.location_unit,
        locations=res.locations,
        documents=res.documents,
    )
