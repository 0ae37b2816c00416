"""Time and peak memory of GPU work, measured the way CUDA needs it: one small module the profiler,
the doctor and the trainer share.

- :class:`Clock`: intervals between marks. On a GPU, CUDA events recorded on the current stream
  (``torch.cuda.Event(enable_timing=True)``), read with ``elapsed_time`` after one
  ``torch.cuda.synchronize``: kernels run asynchronously, so a host clock read without a sync
  times the launches, not the work. Elsewhere ``time.perf_counter``.
- :class:`PeakMemory`: the caching allocator's peak over one step. ``torch.cuda.max_memory_allocated``
  is a high-water mark since the last ``reset_peak_memory_stats``, so it is reset at the start of
  every step, else every step reports the largest one before it. On CPU there is no allocator
  peak to reset (``ru_maxrss`` only ever grows): None.
- :class:`StepStats`: per-step time and peak; its summary leaves the first step out (it pays
  CUDA context and allocator warm-up, cuDNN/NCCL set-up and the optimizer's lazily created states).

Every ``torch.cuda`` function is looked up when called, so tests can stand in for them on a
machine without a GPU (``tests/test_gpu_paths.py``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

__all__ = ["Clock", "PeakMemory", "StepStats"]


class Clock:
    """Intervals between marks, in ms: CUDA events on a GPU (recorded on the current stream and
    read after one synchronisation), a monotonic clock with synchronisation elsewhere."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._marks: list = []

    def mark(self) -> None:
        """Record a point in time (on a GPU: an event on the current stream, after the work queued so far)."""
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._marks.append(ev)
        else:
            self._marks.append(time.perf_counter())

    def reset(self) -> None:
        """Forget the marks so far (a step that failed half-way leaves its first mark behind)."""
        self._marks = []

    def intervals(self) -> list[float]:
        """The ms between consecutive marks (then the marks are cleared). Synchronises the device."""
        marks, self._marks = self._marks, []
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return [float(a.elapsed_time(b)) for a, b in zip(marks, marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(marks, marks[1:])]


class PeakMemory:
    """The allocator's peak bytes over one step on a CUDA device: :meth:`start` before the step
    (resets the high-water mark), :meth:`peak` after it. On other devices both are no-ops and
    :meth:`peak` is None."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.base: int | None = None
        """Bytes allocated when the step started (model states and whatever else lives on)."""

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = int(torch.cuda.memory_allocated(self.device))

    def peak(self) -> int | None:
        """Peak bytes allocated since :meth:`start` (None off CUDA)."""
        if not self.cuda:
            return None
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device))


@dataclass
class StepStats:
    """Per-step time (ms) and peak bytes; :meth:`summary` leaves out the first ``warmup`` steps."""

    warmup: int = 1
    ms: list[float] = field(default_factory=list)
    peaks: list[int | None] = field(default_factory=list)

    def add(self, ms: float, peak: int | None) -> None:
        self.ms.append(float(ms))
        self.peaks.append(peak)

    def summary(self) -> dict:
        """``{steps, used, median_ms, min_ms, peak_bytes, first_ms, first_peak_bytes}``: the median
        and minimum time and the largest peak of the steps after the warm-up (all of them when
        there are no more)."""
        n = len(self.ms)
        skip = self.warmup if n > self.warmup else 0
        ms, peaks = self.ms[skip:], [p for p in self.peaks[skip:] if p is not None]
        return {"steps": n, "used": len(ms), "median_ms": statistics.median(ms) if ms else None,
                "min_ms": min(ms) if ms else None, "peak_bytes": max(peaks) if peaks else None,
                "first_ms": self.ms[0] if n else None, "first_peak_bytes": self.peaks[0] if n else None}
