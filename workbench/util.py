"""Small helpers shared by the CLI, the run store and the profiler: atomic JSON writes, strict
JSON, and argparse types for positive numbers. (JSON lines: ``workbench.runs.append_jsonl``.)"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping


def _json_default(o: Any):
    # numpy scalars and arrays appear in results; keep the files plain JSON
    if hasattr(o, "tolist"):
        return o.tolist()
    if hasattr(o, "to_dict"):
        return o.to_dict()
    raise TypeError(f"not JSON-serialisable: {type(o).__name__}")


def json_safe(obj: Any) -> Any:
    """``obj`` as plain JSON data: numpy values converted, objects with ``to_dict`` expanded, and
    non-finite floats (inf, nan) replaced by None, since strict JSON parsers reject them."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k) if not isinstance(k, str) else k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    if hasattr(obj, "tolist"):
        return json_safe(obj.tolist())
    if hasattr(obj, "to_dict"):
        return json_safe(obj.to_dict())
    return obj


def dumps(obj: Any, **kw) -> str:
    """Strict JSON text of ``obj`` (see :func:`json_safe`): never ``Infinity`` or ``NaN``."""
    return json.dumps(json_safe(obj), default=_json_default, allow_nan=False, **kw)


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file and a rename, so readers never see a
    half-written file. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def write_json_atomic(path: str | Path, obj: Any, indent: int | None = 2) -> Path:
    """Write ``obj`` as JSON atomically; returns the path."""
    return write_text_atomic(path, dumps(obj, indent=indent) + "\n")


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1 (the message says what was given)."""
    import argparse

    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    import argparse

    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (0 < v < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return v


def flush_std_streams() -> None:
    """Flush ``sys.stdout`` and ``sys.stderr``, ignoring a stream already closed or gone."""
    import sys

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


EXIT_BY_RAISING = False
"""True in a rank forked by the supervisor (``workbench.launch.forked``): there ``exit_process``
raises ``SystemExit(code)`` once it has flushed, so torchrun's agent receives the rank's result, and
multiprocessing ends the process with ``os._exit`` itself (no finalization either)."""


def exit_process(code: int | None) -> None:
    """End a distributed rank's process with ``code`` once its work is done and its process group
    destroyed: output flushed and garbage collected while the interpreter is whole, then
    ``os._exit``, skipping interpreter finalization. Objects still holding a gloo process group
    (a ZeroRedundancyOptimizer's, a subgroup handle) would otherwise be torn down during
    finalization, where gloo's worker threads can abort the process (``terminate called without an
    active exception``, SIGABRT) after a run that finished: seen once in CI on a ZeRO-1 rank."""
    import gc
    import logging

    try:
        gc.collect()
        logging.shutdown()
        flush_std_streams()
    finally:
        if not EXIT_BY_RAISING:
            os._exit(0 if code is None else int(code))
    raise SystemExit(0 if code is None else int(code))
