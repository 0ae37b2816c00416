"""The embedded real-text corpus: the Python standard library's own ``.py`` sources.

Every Python installation carries it, so the project always has a real, long-tailed set of
documents without downloading anything. Tokenisation is byte-level: one token per UTF-8 byte,
token ids 0..255, so a document's token count is its file size. (A BPE tokenizer would give
roughly 4x fewer tokens; the shape of the distribution is what matters here.)

The listing walks ``sysconfig.get_paths()["stdlib"]`` in sorted order, skipping
``site-packages``/``dist-packages`` (installed third-party code, which varies between machines),
``__pycache__`` and empty files (a length must be >= 1), so it is deterministic for a given Python
installation. It is cached: the walk happens once per process.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["Document", "document_tokens", "stdlib_documents", "stdlib_lengths", "stdlib_root"]

# third-party and generated directories: not part of the standard library's own text
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True, kw_only=True, slots=True)
class Document:
    """One corpus document: its absolute ``path``, ``relpath`` under the stdlib root and its
    byte-level token count ``n_tokens`` (its size in bytes)."""

    path: str
    relpath: str
    n_tokens: int


def stdlib_root() -> str:
    """Return the directory of the running interpreter's standard library."""
    return sysconfig.get_paths()["stdlib"]


@functools.lru_cache(maxsize=1)
def _listing() -> tuple[Document, ...]:
    root = stdlib_root()
    docs: list[Document] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # sorting in place makes os.walk visit directories in a fixed order
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            try:
                size = os.path.getsize(path)
            except OSError:
                # a dangling link or a file removed while walking: not a document
                continue
            if size > 0:
                docs.append(Document(path=path, relpath=os.path.relpath(path, root), n_tokens=size))
    return tuple(docs)


def stdlib_documents(limit: int | None = None) -> list[Document]:
    """Return the standard library's ``.py`` files as :class:`Document` records, sorted by path.

    ``limit`` keeps the first ``limit`` documents. Raises ValueError if ``limit`` is negative, or
    if no document is found (a Python installation without its sources).
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be None or a non-negative integer, got {limit!r}")
    docs = _listing()
    if not docs:
        raise ValueError(
            f"no .py files found under the standard library directory {stdlib_root()!r}; "
            "this Python installation ships without its sources: use a synthetic family instead"
        )
    return list(docs if limit is None else docs[:limit])


def stdlib_lengths() -> np.ndarray:
    """Return the byte-level token counts of :func:`stdlib_documents` as a new int64 array.

    Raises ValueError if the standard library has no ``.py`` sources.
    """
    return np.fromiter((d.n_tokens for d in stdlib_documents()), dtype=np.int64)


def document_tokens(doc: Document | str | os.PathLike) -> np.ndarray:
    """Return the byte-level tokens (uint8, ids 0..255) of a document or a file path.

    Raises ValueError if the file cannot be read, or if a :class:`Document` no longer has the size
    recorded in the listing (the file changed since it was listed).
    """
    path = Path(doc.path if isinstance(doc, Document) else doc)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the document ({exc.strerror or exc})") from None
    if isinstance(doc, Document) and len(data) != doc.n_tokens:
        raise ValueError(
            f"{path}: now {len(data)} bytes but listed with {doc.n_tokens}; the file changed since "
            "it was listed (clear the cache with workbench.data.corpus._listing.cache_clear())"
        )
    # a copy, so the caller gets a writable array that does not pin the bytes object
    return np.frombuffer(data, dtype=np.uint8).copy()
