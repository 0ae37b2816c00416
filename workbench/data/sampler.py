"""Global-batch sampling from a set of sequence lengths.

A :class:`GlobalBatchSampler` cuts each epoch's order (a seeded shuffle, or the given order) into
global batches, either ``batch_size`` sequences at a time or greedily by a token budget
``batch_tokens``: sequences are added while the next one still fits. A sequence longer than the
whole budget forms a batch on its own; such sequences are counted (``oversized_count``) and their
batches flagged (``Batch.oversized``), never silently dropped or clipped.

Epochs wrap around with a fresh shuffle. Epoch ``e`` is shuffled by
``numpy.random.default_rng([seed, e])``, so any batch can be rebuilt directly from its step
without replaying earlier epochs, and the same seed always gives the same batches. Iteration is
endless (a training loop takes steps); use :meth:`GlobalBatchSampler.take` or
:meth:`GlobalBatchSampler.epoch` for a finite list.

An ordered length set (an explicit list, ``LengthSet.ordered``) is one batch, in the given order,
every step.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

__all__ = ["Batch", "GlobalBatchSampler"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Batch:
    """One global batch: ``step`` (0-based, across epochs), ``batch_id`` (``"b000017"``),
    ``epoch``, ``indices`` into the source lengths, their ``lengths``, and ``oversized`` (True for
    a lone sequence longer than the token budget)."""

    batch_id: str
    step: int
    epoch: int
    indices: np.ndarray
    lengths: np.ndarray
    oversized: bool = False

    @property
    def tokens(self) -> int:
        """Total tokens in the batch."""
        return int(self.lengths.sum())

    def __len__(self) -> int:
        return int(self.indices.size)


def _positive_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return int(v)


class GlobalBatchSampler:
    """Deterministic global batches over ``lengths`` (an int array, a list, or a ``LengthSet``).

    Give exactly one of ``batch_size`` (sequences per batch; the last batch of an epoch may be
    smaller, so every index appears exactly once per epoch) or ``batch_tokens`` (token budget per
    batch). For an ordered ``LengthSet`` both may be left out: the whole list is the one batch.
    ``shuffle=False`` keeps the source order in every epoch.

    Raises ValueError if both or neither of ``batch_size``/``batch_tokens`` is given (for an
    unordered source), if either is not a positive integer, if ``seed`` is negative, or if the
    lengths are empty, not integers or not >= 1.
    """

    # epoch layouts kept in memory: a few suffice for sequential and nearby random access
    _CACHE_EPOCHS = 4

    def __init__(
        self,
        lengths: Any,
        *,
        batch_size: int | None = None,
        batch_tokens: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        self.ordered = bool(getattr(lengths, "ordered", False))
        arr = np.asarray(getattr(lengths, "lengths", lengths))
        if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iu":
            raise ValueError(
                f"lengths must be a non-empty 1-D integer array, got shape {arr.shape} dtype {arr.dtype}"
            )
        if arr.min() < 1:
            raise ValueError(f"lengths must be >= 1; index {int(np.argmin(arr))} holds {int(arr.min())}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        given = (batch_size is not None) + (batch_tokens is not None)
        if given == 2 or (given == 0 and not self.ordered):
            raise ValueError(
                "give exactly one of batch_size (sequences per batch) or batch_tokens (token budget "
                f"per batch); got batch_size={batch_size!r}, batch_tokens={batch_tokens!r}"
            )
        self.batch_size = None if batch_size is None else _positive_int("batch_size", batch_size)
        self.batch_tokens = None if batch_tokens is None else _positive_int("batch_tokens", batch_tokens)
        self.seed = int(seed)
        self.shuffle = bool(shuffle) and not self.ordered
        self.lengths = arr.astype(np.int64)
        self.lengths.flags.writeable = False
        self.n = int(arr.size)
        if self.batch_tokens is not None and not self.ordered:
            over = np.flatnonzero(self.lengths > self.batch_tokens)
        else:
            over = np.empty(0, dtype=np.int64)
        #: sequences longer than batch_tokens; each forms a batch of its own, once per epoch
        self.oversized_indices = over
        self.oversized_count = int(over.size)
        self._layouts: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        # first step of each epoch computed so far: _epoch_starts[e] = step where epoch e begins
        self._epoch_starts = [0]

    # --- layout of one epoch ----------------------------------------------------------------

    def _layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(order, bounds): the epoch's sequence order and batch boundaries (positions in order)."""
        hit = self._layouts.get(epoch)
        if hit is not None:
            self._layouts.move_to_end(epoch)
            return hit
        n = self.n
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(n)
        else:
            order = np.arange(n, dtype=np.int64)
        order.flags.writeable = False  # batches hand out views of it
        if self.ordered:
            bounds = np.array([0, n], dtype=np.int64)
        elif self.batch_size is not None:
            bounds = np.append(np.arange(0, n, self.batch_size, dtype=np.int64), n)
        else:
            bounds = self._pack(self.lengths[order], self.batch_tokens)
        self._layouts[epoch] = (order, bounds)
        if len(self._layouts) > self._CACHE_EPOCHS:
            self._layouts.popitem(last=False)
        return order, bounds

    @staticmethod
    def _pack(seq: np.ndarray, budget: int) -> np.ndarray:
        """Greedy boundaries: each batch is the longest run from its start whose tokens fit."""
        cs = np.concatenate(([0], np.cumsum(seq, dtype=np.int64)))
        n = seq.size
        bounds = [0]
        i = 0
        # one searchsorted per batch, not one Python step per sequence
        while i < n:
            j = int(np.searchsorted(cs, cs[i] + budget, side="right")) - 1
            if j <= i:
                j = i + 1  # a single sequence over the budget: a batch of its own
            bounds.append(j)
            i = j
        return np.array(bounds, dtype=np.int64)

    def batches_in_epoch(self, epoch: int = 0) -> int:
        """Return how many batches epoch ``epoch`` has (constant unless batching by tokens)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        return int(self._layout(epoch)[1].size - 1)

    def _locate(self, step: int) -> tuple[int, int]:
        """(epoch, batch number within it) of a global step."""
        if self.ordered:
            return step, 0
        if self.batch_tokens is None:
            per = -(-self.n // self.batch_size)
            return divmod(step, per)
        while self._epoch_starts[-1] <= step:
            self._first_step(len(self._epoch_starts))
        e = int(np.searchsorted(self._epoch_starts, step, side="right")) - 1
        return e, step - self._epoch_starts[e]

    def _make(self, step: int, epoch: int, k: int) -> Batch:
        order, bounds = self._layout(epoch)
        idx = order[bounds[k]:bounds[k + 1]]
        lens = self.lengths[idx]
        oversized = self.batch_tokens is not None and idx.size == 1 and int(lens[0]) > self.batch_tokens
        return Batch(batch_id=f"b{step:06d}", step=step, epoch=epoch, indices=idx, lengths=lens,
                     oversized=oversized)

    # --- access -----------------------------------------------------------------------------

    def batch(self, step: int) -> Batch:
        """Return the batch at global ``step`` (0-based; epochs wrap around). Raises ValueError
        for a negative step."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        epoch, k = self._locate(int(step))
        return self._make(int(step), epoch, k)

    def take(self, k: int, *, start: int = 0) -> list[Batch]:
        """Return ``k`` consecutive batches from step ``start``, wrapping across epochs. Raises
        ValueError for a negative ``k`` or ``start``."""
        if k < 0 or start < 0:
            raise ValueError(f"k and start must be >= 0, got k={k}, start={start}")
        return [self.batch(s) for s in range(start, start + k)]

    def epoch(self, e: int) -> list[Batch]:
        """Return every batch of epoch ``e`` (each index appears exactly once). Raises ValueError
        for a negative epoch."""
        if e < 0:
            raise ValueError(f"epoch must be >= 0, got {e}")
        first = e if self.ordered else (
            e * -(-self.n // self.batch_size) if self.batch_tokens is None else self._first_step(e)
        )
        return [self._make(first + k, e, k) for k in range(self.batches_in_epoch(e))]

    def _first_step(self, e: int) -> int:
        """Global step where epoch ``e`` begins (batching by tokens: epochs differ in length)."""
        while len(self._epoch_starts) <= e:
            i = len(self._epoch_starts) - 1
            self._epoch_starts.append(self._epoch_starts[-1] + self.batches_in_epoch(i))
        return self._epoch_starts[e]

    def __iter__(self) -> Iterator[Batch]:
        """Endless stream of batches from step 0; wrap to a fresh shuffle at each epoch end."""
        step = 0
        epoch = 0
        while True:
            for k in range(self.batches_in_epoch(epoch)):
                yield self._make(step, epoch, k)
                step += 1
            epoch += 1

    def describe(self) -> str:
        """Return one human line: the batching rule, batches per epoch and oversized sequences."""
        if self.ordered:
            return f"one ordered batch of {self.n:,} sequences ({int(self.lengths.sum()):,} tokens) every step"
        rule = (f"{self.batch_size:,} sequences per batch" if self.batch_tokens is None
                else f"up to {self.batch_tokens:,} tokens per batch")
        text = (f"{self.n:,} sequences, {rule}, {self.batches_in_epoch(0):,} batches in epoch 0, "
                f"{'shuffled' if self.shuffle else 'in order'} (seed {self.seed})")
        if self.oversized_count:
            text += (f"; {self.oversized_count:,} sequence(s) longer than the budget form batches of "
                     "their own")
        return text
