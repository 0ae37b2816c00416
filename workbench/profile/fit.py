"""Fitting a hardware profile from measurements: pure numpy, no torch, no I/O.

What the measuring ranks (``workbench.profile.measure``) hand over is plain data; this module
turns it into the :class:`~workbench.specs.HardwareProfile` the cost model reads, and into the
evidence next to it (residuals, held-out errors):

- **compute**: per-layer forward and backward time of packs of sequences,
  ``t = a * sum(s^2) + b * sum(s) + c``, fitted by non-negative least squares on relative error
  (short packs count as much as long ones), on the ``fit`` points only; when a separate ``a_short``
  for the sequences under a threshold (between the fit's lengths) leaves less than 60% of the
  residual, the curves carry it (``choose_short_len``: attention kernels block short sequences
  differently); the ``heldout`` points (lengths not in the fit) are predicted and their absolute
  percentage errors reported;
- **collectives**: per group size, ``t = latency + bytes / bandwidth`` over several message sizes
  (all-to-all: the bytes a rank sends to the others; all-reduce: the ring's ``2 (n-1)/n`` of the
  buffer; all-gather and reduce-scatter, FSDP's over the world and context parallelism's over its
  sub-groups: ``(n-1)/n`` of the full buffer; point-to-point: the bytes of one ring step);
- **the host link** (``fit_host_link``): pinned host-device copy bandwidth (the median copy's), one
  GPU alone and every rank at once (the node's total: the slowest rank's rate x the GPUs of a node);
- **lines** (``fit_line``): ``t = slope * x + intercept``, non-negative, for the head's time per
  token and the optimizer's per parameter.

Everything is tested in milliseconds against synthetic timings with known coefficients.
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from workbench.specs import ComputeCurve

__all__ = ["nnls", "trimmed_median", "ape", "error_summary", "fit_curve", "fit_pack_curve", "predict_pack", "fit_line",
           "CurveFit", "fit_compute", "heldout_errors", "choose_short_len", "short_len_candidates", "LinkFit", "fit_link",
           "fit_collectives", "COLLECTIVE_KINDS", "wire_bytes", "copy_gbps", "fit_host_link"]

COLLECTIVE_KINDS = ("all_to_all", "allreduce", "p2p", "allgather", "reduce_scatter", "cp_allgather",
                    "cp_reduce_scatter")
"""``cp_*``: context parallelism's K/V all-gather and gradient reduce-scatter on its strided sub-groups
(the same collectives as FSDP's, on other ranks and at other sizes)."""


# ------------------------------------------------------------------------------------------------
# small statistics
# ------------------------------------------------------------------------------------------------


def nnls(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares ``min ||X w - y||`` s.t. ``w >= 0`` for a few columns, exactly:
    every subset of active columns is solved by ordinary least squares and the best non-negative
    solution kept. Returns ``w`` (zeros where a column is dropped). Raises ValueError for more
    than 8 columns or mismatched shapes."""
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if X.ndim != 2 or y.shape != (X.shape[0],):
        raise ValueError(f"nnls needs X (n, k) and y (n,), got {X.shape} and {y.shape}")
    k = X.shape[1]
    if k > 8:
        raise ValueError(f"nnls enumerates column subsets; {k} columns is too many")
    best, best_res = np.zeros(k), float(np.sum(y * y))
    for r in range(1, k + 1):
        for cols in itertools.combinations(range(k), r):
            w_sub, *_ = np.linalg.lstsq(X[:, cols], y, rcond=None)
            if np.any(w_sub < 0):
                continue
            w = np.zeros(k)
            w[list(cols)] = w_sub
            res = float(np.sum((X @ w - y) ** 2))
            if res < best_res - 1e-18 * max(1.0, best_res):
                best, best_res = w, res
    return best


def trimmed_median(values: Sequence[float], trim: float = 0.2) -> float:
    """Median of ``values`` after dropping ``floor(n * trim)`` of the smallest and as many of the
    largest (Galvatron's protocol: the extremes are warm-up stragglers and interruptions). Raises
    ValueError for no values or a trim outside [0, 0.5)."""
    xs = sorted(float(v) for v in values)
    if not xs:
        raise ValueError("trimmed_median of no values")
    if not 0 <= trim < 0.5:
        raise ValueError(f"trim must be in [0, 0.5), got {trim}")
    k = int(math.floor(len(xs) * trim))
    return float(statistics.median(xs[k:len(xs) - k]))


def ape(predicted: float, measured: float) -> float:
    """Absolute percentage error ``100 * |predicted - measured| / measured``."""
    if measured <= 0:
        raise ValueError(f"a measured time must be positive, got {measured}")
    return 100.0 * abs(predicted - measured) / measured


def error_summary(errors: Sequence[float]) -> dict:
    """``{"count", "median_ape", "worst_ape", "mean_ape"}`` of absolute percentage errors (None
    figures for none)."""
    e = [float(x) for x in errors]
    if not e:
        return {"count": 0, "median_ape": None, "worst_ape": None, "mean_ape": None}
    return {"count": len(e), "median_ape": float(statistics.median(e)), "worst_ape": max(e),
            "mean_ape": float(sum(e) / len(e))}


# ------------------------------------------------------------------------------------------------
# compute
# ------------------------------------------------------------------------------------------------


def _pack_features(pack: Sequence[int], short_len: int | None = None) -> tuple[float, ...]:
    """``(sum s^2, sum s, 1)``, or with ``short_len`` ``(sum s^2 of the long, sum s, 1, sum s^2 of
    the short)``."""
    q = float(sum(int(s) * int(s) for s in pack if short_len is None or int(s) >= short_len))
    feats = (q, float(sum(int(s) for s in pack)), 1.0)
    if short_len is None:
        return feats
    return (*feats, float(sum(int(s) * int(s) for s in pack if int(s) < short_len)))


def predict_pack(curve: ComputeCurve, pack: Sequence[int]) -> float:
    """A curve's time (ms) for one packed call: ``a * sum(s^2) + b * sum(s) + c`` (``a_short`` for
    the sequences under ``short_len``)."""
    return float(curve.quadratic([int(s) for s in pack]).sum()) + curve.b * sum(int(s) for s in pack) + curve.c


def fit_curve(packs: Sequence[Sequence[int]], times_ms: Sequence[float]) -> ComputeCurve:
    """Fit ``t = a*sum(s^2) + b*sum(s) + c`` to measured pack times (ms), non-negative, minimising
    relative error. Returns a ComputeCurve. Raises ValueError for fewer than 3 packs, mismatched
    lists or a non-positive time."""
    return fit_pack_curve(packs, times_ms).curve


@dataclass(frozen=True)
class CurveFit:
    """One fitted compute curve with its evidence: the points it was fitted on and what it predicts
    for them (residuals), as plain data."""

    curve: ComputeCurve
    packs: list
    measured_ms: list
    predicted_ms: list

    @property
    def residuals_ms(self) -> list[float]:
        """measured - predicted, per fit point."""
        return [m - p for m, p in zip(self.measured_ms, self.predicted_ms)]

    @property
    def relative_residuals(self) -> list[float]:
        """(measured - predicted) / measured, per fit point."""
        return [(m - p) / m for m, p in zip(self.measured_ms, self.predicted_ms)]

    def errors(self) -> dict:
        """Median and worst absolute percentage error on the fit points."""
        return error_summary([ape(p, m) for p, m in zip(self.predicted_ms, self.measured_ms)])

    def to_dict(self) -> dict:
        return {"a": self.curve.a, "b": self.curve.b, "c": self.curve.c, "a_short": self.curve.a_short,
                "short_len": self.curve.short_len, "packs": self.packs,
                "measured_ms": self.measured_ms, "predicted_ms": self.predicted_ms,
                "residuals_ms": self.residuals_ms, "errors": self.errors()}


def fit_pack_curve(packs: Sequence[Sequence[int]], times_ms: Sequence[float], *,
                   short_len: int | None = None) -> CurveFit:
    """:func:`fit_curve` returning the fit with its points and residuals (a :class:`CurveFit`);
    with ``short_len``, sequences under it get an ``a_short`` of their own."""
    packs = [[int(s) for s in p] for p in packs]
    t = np.asarray(times_ms, dtype=np.float64)
    if len(t) != len(packs):
        raise ValueError(f"{len(packs)} packs but {len(t)} times")
    if len(t) < 3:
        raise ValueError(f"need at least 3 measured packs to fit a, b and c, got {len(t)}")
    if not np.all(np.isfinite(t)) or np.any(t <= 0):
        raise ValueError(f"measured times must be finite and positive, got {t.tolist()}")
    if any(not p or min(p) < 1 for p in packs):
        raise ValueError("every pack needs at least one sequence of positive length")
    X = np.array([_pack_features(p, short_len) for p in packs], dtype=np.float64)
    w = 1.0 / t
    coef = nnls(X * w[:, None], t * w)
    curve = ComputeCurve(a=float(coef[0]), b=float(coef[1]), c=float(coef[2]),
                         **({} if short_len is None else {"a_short": float(coef[3]), "short_len": int(short_len)}))
    pred = (X @ coef).tolist()
    return CurveFit(curve=curve, packs=packs, measured_ms=t.tolist(), predicted_ms=[float(x) for x in pred])


def heldout_errors(curve: ComputeCurve, packs: Sequence[Sequence[int]], measured_ms: Sequence[float]) -> dict:
    """Predict packs that were not used in the fit: ``{"points": [{pack, tokens, measured_ms,
    predicted_ms, ape}], **error_summary}``. Raises ValueError for mismatched lists or a
    non-positive time."""
    if len(packs) != len(measured_ms):
        raise ValueError(f"{len(packs)} held-out packs but {len(measured_ms)} times")
    pts = []
    for p, m in zip(packs, measured_ms):
        pred = predict_pack(curve, p)
        pts.append({"pack": [int(s) for s in p], "tokens": int(sum(p)), "measured_ms": float(m),
                    "predicted_ms": float(pred), "ape": ape(pred, float(m))})
    return {"points": pts, **error_summary([x["ape"] for x in pts])}


SHORT_GAIN = 0.6
"""``short_len`` is kept only when it leaves at most this share of the single-``a`` fit's squared
relative residual (a fourth coefficient must earn its place)."""


def short_len_candidates(packs: Sequence[Sequence[int]]) -> list[int]:
    """Thresholds between the fit's distinct sequence lengths (geometric midpoints) that leave at
    least two distinct lengths above them and two below (both ``a`` need points of their own)."""
    ls = sorted({int(s) for p in packs for s in p})
    return [int(round(math.sqrt(lo * hi))) for i, (lo, hi) in enumerate(zip(ls, ls[1:]))
            if i + 1 >= 2 and len(ls) - (i + 1) >= 2]


def _rel_sse(fit: CurveFit) -> float:
    return float(sum(((p - m) / m) ** 2 for p, m in zip(fit.predicted_ms, fit.measured_ms)))


def choose_short_len(packs: Sequence[Sequence[int]], times_ms: Sequence[float]) -> int | None:
    """The threshold (``short_len_candidates``) whose two-coefficient fit of ``times_ms`` has the
    smallest squared relative residual, when that is at most ``SHORT_GAIN`` of the one-coefficient
    fit's; else None."""
    if len(packs) < 5:
        return None
    base = _rel_sse(fit_pack_curve(packs, times_ms))
    if base <= 1e-20 * len(packs):
        # the one-coefficient fit is exact to rounding: a threshold could only "improve" the rounding
        # (with numpy 2.4 a synthetic profile's fit took a short_len of 181 whose a_short equalled a)
        return None
    best, best_sse = None, SHORT_GAIN * base
    for cand in short_len_candidates(packs):
        sse = _rel_sse(fit_pack_curve(packs, times_ms, short_len=cand))
        if sse < best_sse:
            best, best_sse = cand, sse
    return best


def fit_compute(rows: Sequence[Mapping[str, Any]]) -> dict:
    """Fit forward and backward curves to measured rows ``{"pack", "role": "fit"|"heldout",
    "forward_ms", "backward_ms"}``, with one ``short_len`` for both (``choose_short_len`` on their
    sum). Returns ``{"forward": CurveFit, "backward": CurveFit, "heldout": {"forward": ...,
    "backward": ..., "total": ...}, "short_len"}`` where ``total`` is forward plus backward (what a
    training step pays). Raises ValueError with fewer than 3 fit rows."""
    fit_rows = [r for r in rows if r.get("role", "fit") == "fit"]
    held = [r for r in rows if r.get("role") == "heldout"]
    packs = [r["pack"] for r in fit_rows]
    short = choose_short_len(packs, [r["forward_ms"] + r["backward_ms"] for r in fit_rows])
    fwd = fit_pack_curve(packs, [r["forward_ms"] for r in fit_rows], short_len=short)
    bwd = fit_pack_curve(packs, [r["backward_ms"] for r in fit_rows], short_len=short)
    extra = {} if short is None else {"a_short": fwd.curve.a_short + bwd.curve.a_short, "short_len": short}
    total = ComputeCurve(a=fwd.curve.a + bwd.curve.a, b=fwd.curve.b + bwd.curve.b, c=fwd.curve.c + bwd.curve.c,
                         **extra)
    hp = [r["pack"] for r in held]
    return {
        "forward": fwd, "backward": bwd, "short_len": short,
        "heldout": {
            "forward": heldout_errors(fwd.curve, hp, [r["forward_ms"] for r in held]),
            "backward": heldout_errors(bwd.curve, hp, [r["backward_ms"] for r in held]),
            "total": heldout_errors(total, hp, [r["forward_ms"] + r["backward_ms"] for r in held]),
        },
    }


def fit_line(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """``y = slope * x + intercept`` with both >= 0, minimising relative error (non-negative least
    squares weighted by 1/y). Returns ``(slope, intercept)``; with one distinct x, ``(median y/x,
    0)``. Raises ValueError for no points, mismatched lists or a non-positive value."""
    xs = np.asarray(x, dtype=np.float64)
    ys = np.asarray(y, dtype=np.float64)
    if xs.shape != ys.shape or xs.size == 0:
        raise ValueError(f"fit_line needs as many x as y values (at least one), got {xs.size} and {ys.size}")
    if np.any(xs <= 0) or np.any(ys <= 0) or not np.all(np.isfinite(ys)):
        raise ValueError(f"fit_line needs positive x and y values, got {xs.tolist()} and {ys.tolist()}")
    if len(set(xs.tolist())) < 2:
        return float(np.median(ys / xs)), 0.0
    w = 1.0 / ys
    slope, intercept = nnls(np.stack([xs, np.ones_like(xs)], axis=1) * w[:, None], ys * w)
    return float(slope), float(intercept)


# ------------------------------------------------------------------------------------------------
# collectives
# ------------------------------------------------------------------------------------------------


def wire_bytes(kind: str, message_bytes: float, group_size: int) -> float:
    """Bytes one rank moves in one call, the x of the latency/bandwidth fit: all-to-all sends
    ``(d-1)/d`` of its buffer to others; a ring all-reduce moves ``2 (n-1)/n`` of it (bus
    bandwidth); an all-gather receives, and a reduce-scatter sends, ``(n-1)/n`` of the full
    buffer (``message_bytes``: the gathered output, the scattered input; the same for context
    parallelism's, ``cp_allgather`` and ``cp_reduce_scatter``); a ring step sends the whole message
    once."""
    d = int(group_size)
    if kind in ("all_to_all", "allgather", "reduce_scatter", "cp_allgather", "cp_reduce_scatter"):
        return message_bytes * (d - 1) / d
    if kind == "allreduce":
        return message_bytes * 2 * (d - 1) / d
    if kind == "p2p":
        return float(message_bytes)
    raise ValueError(f"unknown collective {kind!r}; kinds are {', '.join(COLLECTIVE_KINDS)}")


@dataclass(frozen=True)
class LinkFit:
    """``t = latency_ms + wire_bytes / bandwidth`` for one collective and group size."""

    kind: str
    group_size: int
    latency_ms: float
    gbps: float
    """Bandwidth in GB/s (1e9 bytes per second)."""
    message_bytes: list = field(default_factory=list)
    measured_ms: list = field(default_factory=list)
    predicted_ms: list = field(default_factory=list)

    def predict(self, message_bytes: float) -> float:
        return self.latency_ms + wire_bytes(self.kind, message_bytes, self.group_size) / (self.gbps * 1e9) * 1e3

    def errors(self) -> dict:
        return error_summary([ape(p, m) for p, m in zip(self.predicted_ms, self.measured_ms)])

    def to_dict(self) -> dict:
        return {"kind": self.kind, "group_size": self.group_size, "latency_ms": self.latency_ms, "gbps": self.gbps,
                "message_bytes": self.message_bytes, "measured_ms": self.measured_ms,
                "predicted_ms": self.predicted_ms, "errors": self.errors()}


def fit_link(kind: str, group_size: int, message_bytes: Sequence[float], times_ms: Sequence[float]) -> LinkFit:
    """Fit latency and bandwidth of one collective at one group size from calls of several message
    sizes (non-negative least squares on relative error). With one size, or when the times do not
    grow with the size, the latency is 0 and the bandwidth is the best throughput seen. Raises
    ValueError for mismatched lists or non-positive values."""
    m = np.asarray(message_bytes, dtype=np.float64)
    t = np.asarray(times_ms, dtype=np.float64)
    if m.shape != t.shape or m.size == 0:
        raise ValueError(f"{m.size} message sizes but {t.size} times")
    if np.any(m <= 0) or np.any(t <= 0) or not np.all(np.isfinite(t)):
        raise ValueError("message sizes and times must be positive")
    x = np.array([wire_bytes(kind, float(v), group_size) for v in m])
    lat, slope = 0.0, 0.0
    if len(set(m.tolist())) >= 2:
        w = 1.0 / t
        lat, slope = (float(v) for v in nnls(np.stack([np.ones_like(x), x], axis=1) * w[:, None], t * w))
    if slope <= 0:
        # no size dependence could be resolved: all latency would give an infinite bandwidth, which the
        # profile cannot hold; take the best throughput seen instead (an upper bound on the time)
        lat, slope = 0.0, float(np.min(t / x))
    gbps = 1.0 / slope * 1e3 / 1e9  # slope is ms per byte
    fit = LinkFit(kind=kind, group_size=int(group_size), latency_ms=lat, gbps=gbps, message_bytes=m.tolist(),
                  measured_ms=t.tolist(), predicted_ms=[])
    return LinkFit(kind=kind, group_size=int(group_size), latency_ms=lat, gbps=gbps, message_bytes=m.tolist(),
                   measured_ms=t.tolist(), predicted_ms=[fit.predict(v) for v in m.tolist()])


def fit_collectives(points: Sequence[Mapping[str, Any]]) -> dict[str, dict[int, LinkFit]]:
    """Fit every (kind, group size) of measured points ``{"kind", "group_size", "message_bytes",
    "ms"}``. Returns ``{kind: {group size: LinkFit}}``."""
    by: dict[tuple[str, int], list] = {}
    for p in points:
        by.setdefault((str(p["kind"]), int(p["group_size"])), []).append(p)
    out: dict[str, dict[int, LinkFit]] = {}
    for (kind, d), pts in sorted(by.items()):
        out.setdefault(kind, {})[d] = fit_link(kind, d, [p["message_bytes"] for p in pts], [p["ms"] for p in pts])
    return out


# ------------------------------------------------------------------------------------------------
# the host link (pinned host-device copies)
# ------------------------------------------------------------------------------------------------


def copy_gbps(nbytes: float, times_ms: Sequence[float]) -> float:
    """Bandwidth (GB/s, 1e9 bytes a second) of copies of ``nbytes`` bytes taking ``times_ms`` each:
    the median time's. Raises ValueError for no times, a non-positive time or size."""
    ts = [float(t) for t in times_ms]
    if not ts or nbytes <= 0 or any(not (t > 0 and math.isfinite(t)) for t in ts):
        raise ValueError(f"copy_gbps needs a positive size and positive times, got {nbytes} bytes and {ts}")
    return float(nbytes) / (statistics.median(ts) * 1e-3) / 1e9


def fit_host_link(link: Mapping[str, Any]) -> dict:
    """The host link's figures from timed pinned copies (``workbench.profile.measure.measure_host_link``):
    ``link`` is ``{"bytes", "ranks_per_node", "alone": {"h2d_ms": [..], "d2h_ms": [..]} (one GPU
    copying while the others wait), "all": {"h2d_ms": [[..] per rank], "d2h_ms": [[..] per rank]}
    (every rank copying at once)}``. Returns ``{"alone": {"h2d_gbps", "d2h_gbps"}, "all":
    {"h2d_gbps": [per rank], "d2h_gbps": [per rank]}, "ranks_per_node", "host_link_gbps" (one GPU
    alone, the slower direction), "host_link_node_gbps" (a node's total when all its GPUs copy: the
    slowest rank's rate x the GPUs of a node, the slower direction)}``. Raises ValueError when a
    figure is missing or not positive."""
    try:
        nbytes = float(link["bytes"])
        per_node = int(link.get("ranks_per_node") or len(link["all"]["h2d_ms"]))
        alone = {f"{k}_gbps": copy_gbps(nbytes, link["alone"][f"{k}_ms"]) for k in ("h2d", "d2h")}
        every = {f"{k}_gbps": [copy_gbps(nbytes, ts) for ts in link["all"][f"{k}_ms"]] for k in ("h2d", "d2h")}
    except (KeyError, TypeError) as e:
        raise ValueError(f"host link measurements lack {e}") from None
    if per_node < 1 or not every["h2d_gbps"] or not every["d2h_gbps"]:
        raise ValueError(f"host link measurements need at least one rank copying at once, got {per_node}")
    node = min(min(every["h2d_gbps"]), min(every["d2h_gbps"])) * per_node
    return {"alone": alone, "all": every, "ranks_per_node": per_node, "bytes": int(nbytes),
            "host_link_gbps": min(alone.values()), "host_link_node_gbps": node}
