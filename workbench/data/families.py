"""Seeded synthetic sequence-length families fitted to published figures.

Each long-tailed family (``wikipedia``, ``github``, ``byted``, ``commoncrawl``) is a piecewise
quantile function (inverse CDF) through knots ``(probability, length)``. Between two knots,
log(length) is linear in log(1 - p): every segment is a truncated Pareto piece, so the tail is
heavy where the knots say so and the integrals that give token shares have a closed form. In the
body, where knots are close together, this is indistinguishable from interpolating in p. Above the
last knot the length is held at the last knot's value (the family's cap), so a family never makes a
sequence longer than its cap.

Sampling is by inverse transform from ``numpy.random.default_rng(seed)``: the same seed and count
give the same lengths. Lengths are int64 and at least 1.

The knots of ``wikipedia`` come from the quantiles of the lengths released with FlexSP, rounded,
with the extreme-tail knots tuned so the token shares over 8K and 32K match the paper. The others
are fitted to the published token shares with percentiles chosen by us where no figure was
published; each family's ``targets["assumed"]`` lists which figures are ours, not published.

Each family carries ``targets``: plain JSON-able data (a ``source`` string, ``percentiles``,
``fraction_over``/``token_share_over`` keyed by the threshold as a string...). Keys ending in
``_at_least``/``_at_most`` use >= / <= thresholds as the source states them; ``_over`` means
strictly greater.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

__all__ = [
    "FAMILIES",
    "LengthFamily",
    "LognormalFamily",
    "QuantileFamily",
    "UniformFamily",
    "get_family",
    "synthetic_lengths",
]


class LengthFamily(Protocol):
    """What every family offers: a name, a description, its targets and a seeded sampler."""

    name: str
    description: str
    targets: dict

    def sample(self, n: int, *, seed: int = 0) -> np.ndarray: ...


def _check_count(n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"the number of samples must be a positive integer, got {n!r}")
    return int(n)


@dataclass(frozen=True, kw_only=True, slots=True)
class QuantileFamily:
    """A length distribution given by its quantile function through ``knots``.

    ``knots`` are ``(p, length)`` pairs, p strictly increasing from 0 and below 1, lengths
    non-decreasing and >= 1. ``targets`` is plain data to treat as read-only (use
    :meth:`targets_copy` to hand it on).
    """

    name: str
    description: str
    knots: tuple[tuple[float, float], ...]
    targets: dict = field(default_factory=dict)
    # derived arrays: x = -log(1 - p), y = log(length); kept so sampling does no set-up work
    _x: np.ndarray = field(init=False, repr=False, compare=False)
    _y: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.knots) < 2:
            raise ValueError(f"family {self.name!r}: at least two knots are needed")
        ps = np.array([float(p) for p, _ in self.knots])
        ls = np.array([float(v) for _, v in self.knots])
        if ps[0] != 0.0 or np.any(np.diff(ps) <= 0) or ps[-1] >= 1.0:
            raise ValueError(
                f"family {self.name!r}: knot probabilities must start at 0, increase strictly "
                f"and stay below 1; got {ps.tolist()}"
            )
        if np.any(ls < 1) or np.any(np.diff(ls) < 0):
            raise ValueError(
                f"family {self.name!r}: knot lengths must be >= 1 and non-decreasing; got {ls.tolist()}"
            )
        x = -np.log1p(-ps)
        y = np.log(ls)
        x.flags.writeable = False
        y.flags.writeable = False
        # frozen dataclass: set the derived fields through object.__setattr__
        object.__setattr__(self, "_x", x)
        object.__setattr__(self, "_y", y)

    @property
    def cap(self) -> int:
        """The largest length this family can produce (the last knot)."""
        return int(round(self.knots[-1][1]))

    def quantile(self, p: Any) -> np.ndarray:
        """Length (float, before rounding) at probability ``p`` (scalar or array in [0, 1))."""
        p = np.asarray(p, dtype=np.float64)
        if np.any((p < 0) | (p >= 1)):
            raise ValueError("probabilities must lie in [0, 1)")
        # np.interp holds the last value beyond the last knot: that is the cap
        return np.exp(np.interp(-np.log1p(-p), self._x, self._y))

    def sample(self, n: int, *, seed: int = 0) -> np.ndarray:
        """Return ``n`` int64 lengths (>= 1) drawn by inverse transform with ``default_rng(seed)``.

        Raises ValueError if ``n`` is not a positive integer.
        """
        n = _check_count(n)
        u = np.random.default_rng(seed).random(n)
        lengths = np.rint(self.quantile(u)).astype(np.int64)
        np.maximum(lengths, 1, out=lengths)
        return lengths

    # --- exact figures of the continuous distribution (no sampling noise) ---------------------

    def _x_at(self, length: float) -> float:
        """x = -log(1 - F(length)): where the quantile function reaches ``length``."""
        ly = math.log(length)
        x, y = self._x, self._y
        if ly <= y[0]:
            return 0.0
        if ly >= y[-1]:
            return math.inf
        i = int(np.searchsorted(y, ly, side="right")) - 1
        return float(x[i] + (ly - y[i]) * (x[i + 1] - x[i]) / (y[i + 1] - y[i]))

    def _mass_above(self, xa: float) -> float:
        """Integral of length dp over p >= 1 - exp(-xa), in closed form segment by segment."""
        x, y = self._x, self._y
        total = 0.0
        for i in range(len(x) - 1):
            a, b = max(float(x[i]), xa), float(x[i + 1])
            if b <= a:
                continue
            slope = (y[i + 1] - y[i]) / (x[i + 1] - x[i])
            ya = y[i] + slope * (a - x[i])
            c, d = slope - 1.0, b - a
            # length * dp = exp(y(x)) * exp(-x) dx, and y is linear in x on the segment
            seg = math.expm1(c * d) / c if abs(c) > 1e-12 else d
            total += math.exp(ya - a) * seg
        # the atom at the cap: probability exp(-x_last) of exactly the last length
        total += math.exp(float(y[-1]) - max(xa, float(x[-1])))
        return total

    def mean(self) -> float:
        """Mean length of the continuous distribution (tokens per sequence)."""
        return self._mass_above(0.0)

    def fraction_over(self, threshold: float) -> float:
        """Fraction of sequences longer than ``threshold`` (continuous distribution)."""
        return math.exp(-self._x_at(threshold))

    def token_share_over(self, threshold: float) -> float:
        """Share of all tokens held by sequences longer than ``threshold``."""
        xa = self._x_at(threshold)
        if math.isinf(xa):
            return 0.0
        return self._mass_above(xa) / self.mean()

    def expected(self, thresholds: tuple[int, ...] = (4096, 8192, 32768, 131072, 262144, 2097152)) -> dict:
        """Return the figures the knots imply, without sampling noise: mean, percentiles,
        fraction of sequences and share of tokens over each threshold (keys are strings)."""
        return {
            "mean": self.mean(),
            "percentiles": {
                f"p{q:g}": float(self.quantile(q / 100.0)) for q in (50, 80, 90, 99, 99.9, 99.95)
            },
            "fraction_over": {str(t): self.fraction_over(t) for t in thresholds},
            "token_share_over": {str(t): self.token_share_over(t) for t in thresholds},
            "cap": self.cap,
        }

    def targets_copy(self) -> dict:
        """A deep copy of ``targets`` that callers may change freely."""
        return copy.deepcopy(self.targets)


@dataclass(frozen=True, kw_only=True, slots=True)
class UniformFamily:
    """Uniform integer lengths in ``[low, high]`` (both included), for teaching."""

    name: str = "uniform"
    low: int = 128
    high: int = 8192
    description: str = "uniform integer lengths between two bounds (teaching family)"
    targets: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (1 <= self.low <= self.high):
            raise ValueError(f"uniform family needs 1 <= low <= high, got low={self.low}, high={self.high}")
        if not self.targets:
            span = self.high - self.low
            object.__setattr__(
                self,
                "targets",
                {
                    "source": "analytic: uniform distribution (teaching family, no published figure)",
                    "assumed": ["all"],
                    "low": self.low,
                    "high": self.high,
                    "percentiles": {f"p{q}": self.low + span * q / 100 for q in (50, 90, 99)},
                    "mean": (self.low + self.high) / 2,
                },
            )

    def sample(self, n: int, *, seed: int = 0) -> np.ndarray:
        """Return ``n`` int64 lengths uniform in [low, high] from ``default_rng(seed)``.

        Raises ValueError if ``n`` is not a positive integer.
        """
        n = _check_count(n)
        return np.random.default_rng(seed).integers(self.low, self.high, size=n, endpoint=True, dtype=np.int64)

    def targets_copy(self) -> dict:
        """A deep copy of ``targets``."""
        return copy.deepcopy(self.targets)


@dataclass(frozen=True, kw_only=True, slots=True)
class LognormalFamily:
    """Log-normal lengths with the given median and sigma (of log length), for teaching."""

    name: str = "lognormal"
    median: float = 1024.0
    sigma: float = 1.0
    description: str = "log-normal lengths (teaching family)"
    targets: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (self.median >= 1 and self.sigma > 0 and math.isfinite(self.median) and math.isfinite(self.sigma)):
            raise ValueError(
                f"lognormal family needs median >= 1 and sigma > 0, got median={self.median}, sigma={self.sigma}"
            )
        if not self.targets:
            # z-scores of the standard normal at 0.9 and 0.99
            z = {"p50": 0.0, "p90": 1.2815515655446004, "p99": 2.3263478740408408}
            object.__setattr__(
                self,
                "targets",
                {
                    "source": "analytic: log-normal distribution (teaching family, no published figure)",
                    "assumed": ["all"],
                    "median": self.median,
                    "sigma": self.sigma,
                    "percentiles": {k: self.median * math.exp(self.sigma * v) for k, v in z.items()},
                    "mean": self.median * math.exp(self.sigma**2 / 2),
                },
            )

    def sample(self, n: int, *, seed: int = 0) -> np.ndarray:
        """Return ``n`` int64 lengths (>= 1) from a log-normal with ``default_rng(seed)``.

        Raises ValueError if ``n`` is not a positive integer.
        """
        n = _check_count(n)
        draws = np.random.default_rng(seed).lognormal(math.log(self.median), self.sigma, size=n)
        lengths = np.rint(draws).astype(np.int64)
        np.maximum(lengths, 1, out=lengths)
        return lengths

    def targets_copy(self) -> dict:
        """A deep copy of ``targets``."""
        return copy.deepcopy(self.targets)


# --- the fitted families ---------------------------------------------------------------------

_WIKIPEDIA = QuantileFamily(
    name="wikipedia",
    description=(
        "Wikipedia documents (FlexSP's released lengths): median 347 tokens, 1.6% over 8K hold "
        "27.5% of the tokens"
    ),
    # body knots: quantiles of the released 1M lengths, rounded; p50/p90/p99/p99.9 as published;
    # 0.9999 and 0.99999 tuned so the token shares over 8K and 32K match; the last knot puts the
    # largest of ~1M samples near the released maximum (1.82M)
    knots=(
        (0.0, 1), (0.001, 17), (0.01, 39), (0.05, 67), (0.1, 87), (0.2, 122), (0.3, 171),
        (0.4, 243), (0.5, 347), (0.6, 472), (0.7, 685), (0.8, 1092), (0.9, 2112), (0.95, 3720),
        (0.98, 7087), (0.99, 10900), (0.995, 15986), (0.999, 37400), (0.9999, 105000),
        (0.99999, 240000), (0.999999, 1820000),
    ),
    targets={
        "source": (
            "FlexSP (ASPLOS'25) released Wikipedia lengths, 1M documents "
            "(PKU-DAIR/Hetu-Galvatron, branch flexsp, galvatron/datasets/wikipedia.txt)"
        ),
        "percentiles": {"p50": 347, "p90": 2112, "p99": 10900, "p99.9": 37400},
        "fraction_over": {"8192": 0.016, "32768": 0.0013},
        "token_share_over": {"8192": 0.275, "32768": 0.076},
        "max_at_1m_samples": 1820000,
        "assumed": [],
    },
)

_GITHUB = QuantileFamily(
    name="github",
    description=(
        "GitHub code (ByteScale): 16.2% of tokens from sequences over 128K, 9.8% over 256K; "
        "body percentiles are our assumption"
    ),
    # p50..p99 are our assumption for code files (median 900 tokens); 0.995..0.99999 fitted to
    # the two published token shares with a 2M cap (repository-level concatenations)
    knots=(
        (0.0, 8), (0.1, 110), (0.25, 320), (0.5, 900), (0.75, 2400), (0.9, 6500), (0.95, 12000),
        (0.99, 45000), (0.995, 67000), (0.999, 208000), (0.9999, 812000), (0.99999, 1430000),
        (0.999999, 2097152),
    ),
    targets={
        "source": "ByteScale (arXiv 2502.21231), GitHub code: token shares over 128K and 256K",
        "token_share_over": {"131072": 0.162, "262144": 0.098},
        # our assumption, not published: code files have a median of a few hundred to ~1.5K
        # tokens; p99.9 and the 2M cap follow from fitting the published shares
        "percentiles": {"p50": 900, "p90": 6500, "p99": 45000, "p99.9": 208000},
        "cap": 2097152,
        "assumed": ["percentiles", "cap"],
    },
)

_BYTED = QuantileFamily(
    name="byted",
    description=(
        "ByteScale's production mix: ~80% of sequences at most 4K; the 1% at or above 128K hold "
        "44.3% of tokens, the 0.05% at or above 2M hold 12.1%"
    ),
    # 0.8 -> 4K, 0.99 -> 128K and 0.9995 -> 2M are the published fractions; 0.9..0.98 and
    # 0.995/0.999 fitted to the two token shares; p50 1,000 and the 4M cap are our assumption
    knots=(
        (0.0, 16), (0.1, 130), (0.3, 420), (0.5, 1000), (0.7, 2300), (0.8, 4096), (0.9, 15500),
        (0.95, 40000), (0.98, 86000), (0.99, 131072), (0.995, 196000), (0.999, 1140000),
        (0.9995, 2097152), (0.99999, 3540000), (0.999999, 4194304),
    ),
    targets={
        "source": "ByteScale (arXiv 2502.21231), production data mix ('Byted')",
        "fraction_at_most": {"4096": 0.80},
        "fraction_at_least": {"131072": 0.01, "2097152": 0.0005},
        "token_share_at_least": {"131072": 0.443, "2097152": 0.121},
        # our assumption, not published
        "percentiles": {"p50": 1000, "p80": 4096, "p90": 15500, "p99": 131072, "p99.95": 2097152},
        "cap": 4194304,
        "assumed": ["percentiles.p50", "percentiles.p90", "cap"],
    },
)

_COMMONCRAWL = QuantileFamily(
    name="commoncrawl",
    description=(
        "CommonCrawl web text: long-tailed, between Wikipedia and GitHub (targets are our "
        "assumption; FlexSP and Hydraulis publish no figures)"
    ),
    # all targets are ours: a web page median a little above Wikipedia's, token shares over 8K and
    # 32K between Wikipedia's (27.5% / 7.6%) and GitHub's (~64% / ~37% for our github family)
    knots=(
        (0.0, 1), (0.001, 20), (0.01, 48), (0.05, 85), (0.1, 112), (0.2, 160), (0.3, 225),
        (0.4, 320), (0.5, 450), (0.6, 620), (0.7, 900), (0.8, 1450), (0.9, 2800), (0.95, 5450),
        (0.98, 10850), (0.99, 16000), (0.995, 26700), (0.999, 64000), (0.9999, 178000),
        (0.99999, 444000), (0.999999, 1048576),
    ),
    targets={
        "source": (
            "assumption: FlexSP (ASPLOS'25) and Hydraulis describe CommonCrawl only as long-tailed, "
            "between Wikipedia and GitHub; these figures are ours"
        ),
        "percentiles": {"p50": 450, "p90": 2800, "p99": 16000, "p99.9": 64000},
        "token_share_over": {"8192": 0.40, "32768": 0.15, "131072": 0.03},
        "cap": 1048576,
        "assumed": ["all"],
    },
)

_LONGCTX = QuantileFamily(
    name="longctx",
    description=(
        "Long-context continued training (ProLong's recipe): short web text beside long documents "
        "(code repositories, books) that hold 60% of the tokens, up to 1M tokens each"
    ),
    # the body is commoncrawl's; the long part starts at 64K at the fraction that gives documents of
    # 64K and more 60% of the tokens (ProLong's long share) and runs to a 1M cap, about log-uniform
    knots=(
        (0.0, 1), (0.01, 40), (0.1, 110), (0.3, 230), (0.5, 450), (0.7, 900), (0.8, 1450), (0.9, 2800),
        (0.95, 5450), (0.98, 10850), (0.99, 16000), (0.9934, 65536), (0.997, 230000), (0.999, 560000),
        (0.9998, 1000000), (0.999999, 1048576),
    ),
    targets={
        "source": (
            "Gao et al., How to Train Long-Context Language Models (Effectively), arXiv 2410.02660 (ProLong): "
            "long documents (code repositories, books) are 60% of the continued-training tokens, high-quality "
            "short data the rest; its longest training sequences are 512K, the 1M cap is the long-context "
            "regime of MEMO and ByteScale"
        ),
        "token_share_at_least": {"65536": 0.60},
        # our assumption, not published: the short part's percentiles (commoncrawl's) and the long
        # documents' spread between 64K and 1M
        "percentiles": {"p50": 450, "p90": 2800, "p99": 16000},
        "cap": 1048576,
        "assumed": ["percentiles", "cap", "the long part's shape"],
    },
)

FAMILIES: dict[str, Any] = {
    f.name: f
    for f in (_WIKIPEDIA, _GITHUB, _BYTED, _COMMONCRAWL, _LONGCTX, UniformFamily(), LognormalFamily())
}


def get_family(spec: str) -> Any:
    """Return the family named by ``spec``.

    ``spec`` is a name in :data:`FAMILIES`, or a parametrised teaching family:
    ``"uniform:LOW:HIGH"`` or ``"lognormal:MEDIAN:SIGMA"``. Raises ValueError for an unknown name
    (listing the known ones) or bad parameters.
    """
    if not isinstance(spec, str):
        raise ValueError(f"a family is named by a string, got {type(spec).__name__}")
    key = spec.strip().lower()
    if key in FAMILIES:
        return FAMILIES[key]
    head, _, rest = key.partition(":")
    if rest and head in ("uniform", "lognormal"):
        parts = rest.split(":")
        try:
            if head == "uniform" and len(parts) == 2:
                low, high = int(parts[0]), int(parts[1])
                return UniformFamily(name=f"uniform:{low}:{high}", low=low, high=high)
            if head == "lognormal" and len(parts) == 2:
                median, sigma = float(parts[0]), float(parts[1])
                return LognormalFamily(name=f"lognormal:{median:g}:{sigma:g}", median=median, sigma=sigma)
        except ValueError as exc:
            raise ValueError(f"bad parameters in family {spec!r}: {exc}") from None
        raise ValueError(
            f"bad family spec {spec!r}: use 'uniform:LOW:HIGH' (e.g. uniform:128:8192) or "
            "'lognormal:MEDIAN:SIGMA' (e.g. lognormal:1024:1.0)"
        )
    known = ", ".join(sorted(FAMILIES))
    raise ValueError(
        f"unknown length family {spec!r}; known families: {known} "
        "(also 'uniform:LOW:HIGH', 'lognormal:MEDIAN:SIGMA'; the real 'stdlib' corpus is loaded "
        "with workbench.data.load_lengths('stdlib'))"
    )


def synthetic_lengths(family: str, n: int, *, seed: int = 0) -> np.ndarray:
    """Return ``n`` int64 sequence lengths (>= 1) from the named family, reproducible per seed.

    Raises ValueError for an unknown family (the message lists the known ones) or a count that is
    not a positive integer.
    """
    return get_family(family).sample(n, seed=seed)
