"""Summary statistics of a set of sequence lengths, as plain data for reports and plots."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

__all__ = ["SHARE_THRESHOLDS", "length_histogram", "summarize", "token_share_curve"]

# the thresholds the published figures use: 8K, 32K, 128K
SHARE_THRESHOLDS = (8192, 32768, 131072)


def _lengths(lengths: Any) -> np.ndarray:
    # accept a LengthSet, an array or a list without importing source.py (no cycle)
    arr = np.asarray(getattr(lengths, "lengths", lengths))
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"lengths must be a non-empty 1-D array, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"lengths must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.min() < 1:
        raise ValueError(f"lengths must be >= 1, found {int(arr.min())}")
    return arr


def summarize(lengths: Any) -> dict:
    """Return ``{count, tokens, p50, p90, p99, max, token_share_over}`` for ``lengths``.

    Percentiles are numpy's linear percentiles (floats); ``token_share_over`` maps ``"8192"``,
    ``"32768"`` and ``"131072"`` to the share of all tokens held by sequences strictly longer
    than that (floats in [0, 1]). Raises ValueError for an empty, non-integer or non-positive input.
    """
    arr = _lengths(lengths)
    total = int(arr.sum())
    p50, p90, p99 = np.percentile(arr, [50, 90, 99], method="linear")
    return {
        "count": int(arr.size),
        "tokens": total,
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "max": int(arr.max()),
        "token_share_over": {str(t): float(arr[arr > t].sum() / total) for t in SHARE_THRESHOLDS},
    }


def length_histogram(lengths: Any, bins: int | Sequence[float] | None = None) -> dict:
    """Return a histogram for log axes: ``{edges, counts, token_share, centers}`` as plain lists.

    ``bins=None`` uses powers of two: bin k holds lengths in ``[2**k, 2**(k+1))``, from 1 up to the
    bin holding the maximum. An int gives that many log-spaced bins from 1 to just above the
    maximum; a sequence gives explicit increasing edges (half-open bins, the last one closed), which
    must cover every length. ``centers`` are geometric bin centres; ``token_share`` sums to 1.
    Raises ValueError for bad input or edges that do not cover the lengths.
    """
    arr = _lengths(lengths)
    weights = arr.astype(np.float64)
    total = weights.sum()
    if bins is None:
        # floor(log2(L)), then corrected by one where float rounding near a power of two misled it
        k = np.floor(np.log2(arr)).astype(np.int64)
        k += (np.left_shift(1, k + 1) <= arr).astype(np.int64)
        k -= (np.left_shift(1, k) > arr).astype(np.int64)
        nb = int(k.max()) + 1
        counts = np.bincount(k, minlength=nb)
        tok = np.bincount(k, weights=weights, minlength=nb)
        edges = (2.0 ** np.arange(nb + 1)).tolist()
    else:
        if isinstance(bins, (int, np.integer)) and not isinstance(bins, bool):
            if bins < 1:
                raise ValueError(f"bins must be >= 1, got {bins}")
            edges_arr = np.geomspace(1.0, float(arr.max()) * (1 + 1e-9), int(bins) + 1)
        else:
            edges_arr = np.asarray(bins, dtype=np.float64)
            if edges_arr.ndim != 1 or edges_arr.size < 2 or np.any(np.diff(edges_arr) <= 0):
                raise ValueError("bin edges must be an increasing sequence of at least two values")
            if arr.min() < edges_arr[0] or arr.max() > edges_arr[-1]:
                raise ValueError(
                    f"bin edges [{edges_arr[0]:g}, {edges_arr[-1]:g}] do not cover the lengths "
                    f"[{int(arr.min())}, {int(arr.max())}]"
                )
        counts, _ = np.histogram(arr, bins=edges_arr)
        tok, _ = np.histogram(arr, bins=edges_arr, weights=weights)
        edges = edges_arr.tolist()
    e = np.asarray(edges)
    return {
        "edges": [float(x) for x in edges],
        "counts": [int(c) for c in counts],
        "token_share": [float(t / total) for t in tok],
        "centers": [float(c) for c in np.sqrt(e[:-1] * e[1:])],
    }


def token_share_curve(lengths: Any, max_points: int = 500) -> dict:
    """Return the cumulative token share against length, downsampled for plotting.

    ``{"lengths": [...], "cumulative_token_share": [...], "cumulative_sequence_share": [...]}``:
    lengths sorted ascending; ``cumulative_token_share[i]`` is the share of all tokens held by
    sequences up to and including that rank, ``cumulative_sequence_share[i]`` the share of
    sequences. At most ``max_points`` points, half of
    them spread evenly over ranks and half packed towards the longest sequences (where the tail's
    tokens are), always including the first and last. Raises ValueError for bad input or
    ``max_points`` < 2.
    """
    if max_points < 2:
        raise ValueError(f"max_points must be >= 2, got {max_points}")
    arr = np.sort(_lengths(lengths))
    n = arr.size
    cum = np.cumsum(arr, dtype=np.float64)
    if n <= max_points:
        idx = np.arange(n)
    else:
        half = max_points // 2
        even = np.linspace(0, n - 1, max_points - half)
        tail = (n - 1) - np.geomspace(1, n, half) + 1
        idx = np.unique(np.concatenate([even, tail, [0, n - 1]]).round().astype(np.int64).clip(0, n - 1))
        if idx.size > max_points:
            # rounding can only merge points, but keep the bound strict
            keep = np.linspace(0, idx.size - 1, max_points).round().astype(np.int64)
            idx = idx[np.unique(keep)]
    return {
        "lengths": [int(x) for x in arr[idx]],
        "cumulative_token_share": [float(x) for x in cum[idx] / cum[-1]],
        "cumulative_sequence_share": [float(x) for x in (idx + 1) / n],
    }
