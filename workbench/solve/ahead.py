"""Planning ahead: plan step k+1 in a worker process while step k trains.

FlexSP overlaps the planning of the next step with the current one, and notes that pairing plans
with batches was a source of bugs. Here every plan is keyed by the id of the batch it was made
for and checked against that batch when it is handed out, so it can never be applied to another::

    with PlanAhead("flexsp", cost, seed=0, effort=5.0) as ahead:
        ahead.submit(sampler.batch(0))
        for step in range(steps):
            batch = sampler.batch(step)
            ahead.submit(sampler.batch(step + 1))  # planned while this step runs
            plan = ahead.get(batch)  # the plan made for exactly this batch
            ...

or, for a loop over batches, ``for batch, plan in plan_ahead(sampler, "greedy", cost, steps=10)``.

Planning runs in one worker process started with the ``spawn`` method (no fork of a process with
threads, CUDA or a running OR-Tools solver), so neither the GIL nor the solver's threads stall the
training loop. When that process dies (killed, out of memory, a crash in native code), ``submit``,
``get`` and ``warm_up`` raise ``WorkerDied``, saying how it ended; the batches it held are lost, and
a caller that wants to go on plans them itself (the trainer does: ``runtime.train.RankZeroPlanner``).
The cost model is sent once when the worker starts; each task sends only the lengths. ``planner``
is a registered name (``run_planner``) or an importable ``"module:function"`` with the planner
signature ``(lengths, cost, opts) -> Plan``.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import pickle
import sys
from collections import deque
from concurrent.futures import CancelledError, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Iterable, Iterator

import numpy as np

from workbench.cost import CostModel
from workbench.solve.effort import DEFAULT_EFFORT
from workbench.solve.plan import Plan

__all__ = ["PlanAhead", "PlanMismatchError", "UnknownBatchError", "WorkerDied", "check_pairing", "plan_ahead",
           "plan_lengths", "resolve_planner"]


@contextlib.contextmanager
def _main_not_reimported():
    """While it lasts, a process started with ``spawn`` does not import the parent's ``__main__``.

    ``multiprocessing.spawn`` re-imports the parent's main module in the child (by name when it was
    run with ``-m``, by path otherwise). In a training rank that is ``workbench.runtime.train``,
    which imports torch: about a second of CPU and a few hundred MB for a worker that only plans.
    The planning worker needs nothing from ``__main__`` (its functions live in this module), so the
    main module's ``__spec__`` and ``__file__`` are hidden while the pool starts its process."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {k: main.__dict__[k] for k in ("__spec__", "__file__") if k in main.__dict__}
    main.__spec__ = None
    main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        main.__dict__.update(saved)
        if "__spec__" not in saved:
            main.__dict__.pop("__spec__", None)


class UnknownBatchError(KeyError):
    """A plan was asked for a batch that was never submitted (or was already handed out)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class PlanMismatchError(ValueError):
    """A plan or a request does not match the batch it is paired with."""


class WorkerDied(RuntimeError):
    """The planning worker process has died; this PlanAhead cannot plan any more (its message says
    how the worker ended, e.g. ``killed by SIGKILL``)."""


# ------------------------------------------------------------------------------------------------
# planner names
# ------------------------------------------------------------------------------------------------


def _is_import_path(name: str) -> bool:
    if ":" not in name or name.startswith("static:"):
        return False
    mod, fn = name.split(":", 1)
    return bool(mod) and bool(fn) and all(p.isidentifier() for p in mod.split(".")) and fn.isidentifier()


def resolve_planner(planner: str) -> str:
    """Check that ``planner`` names a planner and make it known to ``run_planner``; returns the
    name to pass to ``run_planner``. A ``"module:function"`` path is imported and registered under
    that path. Raises ValueError for an unknown name or a path that does not import."""
    from workbench.solve import get_planner, register_planner

    if not isinstance(planner, str) or not planner:
        raise ValueError(f"planner must be a planner name or 'module:function', got {planner!r}")
    if _is_import_path(planner):
        mod, fn = planner.split(":", 1)
        try:
            obj = getattr(importlib.import_module(mod), fn)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"planner {planner!r}: cannot import {fn} from module {mod}: {e}") from None
        if not callable(obj):
            raise ValueError(f"planner {planner!r}: {mod}.{fn} is not callable")
        register_planner(planner, obj)
        return planner
    get_planner(planner)  # raises ValueError listing the known names
    return planner


# ------------------------------------------------------------------------------------------------
# the worker process
# ------------------------------------------------------------------------------------------------

_W: dict[str, Any] = {}


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this worker when the process that started it dies (even by SIGKILL,
    which leaves no chance to clean up): a planner must never outlive its run."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the parent's own cleanup still applies
        pass


def _worker_init(cost_blob: bytes, planner: str, cancel, parent_pid: int | None = None) -> None:
    _die_with_parent()
    import os

    if parent_pid is not None and os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
    _W["cost"] = pickle.loads(cost_blob)
    _W["planner"] = resolve_planner(planner)
    _W["cancel"] = cancel
    if _W["planner"] == "flexsp":
        from workbench.solve.cpsat import warm_up

        warm_up()  # the one-time OR-Tools import happens before the first batch arrives


def _worker_plan(batch_id, lengths: np.ndarray, seed: int, effort: float, time_limit: float | None,
                 max_len: int | None) -> Plan:
    from workbench.solve import run_planner

    try:
        return run_planner(_W["planner"], lengths, _W["cost"], seed=seed, effort=effort, time_limit=time_limit,
                           max_len=max_len, cancel=_W["cancel"], batch_id=batch_id)
    except Exception as e:
        try:  # the exception travels back by pickle: make sure it can
            pickle.loads(pickle.dumps(e))
        except Exception:
            raise RuntimeError(f"{type(e).__name__}: {e}") from None
        raise


def _worker_ping() -> bool:
    return "cost" in _W


# ------------------------------------------------------------------------------------------------
# the parent side
# ------------------------------------------------------------------------------------------------


def _as_batch(batch) -> tuple[Any, np.ndarray | None]:
    """(batch_id, lengths or None) of a Batch-like object, a (batch_id, lengths) pair, or a bare id."""
    if hasattr(batch, "batch_id") and hasattr(batch, "lengths"):
        bid, lens = batch.batch_id, batch.lengths
    elif isinstance(batch, tuple) and len(batch) == 2:
        bid, lens = batch
    elif isinstance(batch, (str, int, np.integer)) and not isinstance(batch, bool):
        return (int(batch) if isinstance(batch, np.integer) else batch), None
    else:
        raise TypeError(f"expected a batch (with .batch_id and .lengths), a (batch_id, lengths) pair or a batch id; "
                        f"got {type(batch).__name__}")
    if bid is None:
        raise ValueError("a batch needs a batch_id to be planned ahead: the id is what pairs it with its plan")
    arr = np.array(lens, copy=True)
    if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iu":
        raise ValueError(f"batch {bid!r}: lengths must be a non-empty 1-D integer array, got shape {arr.shape} "
                         f"dtype {arr.dtype}")
    return bid, arr.astype(np.int64)


def plan_lengths(plan: Plan) -> np.ndarray:
    """The batch lengths a plan was made for, read back from its groups (-1 where a sequence
    index is in no group)."""
    n = 1 + max((i for m in plan.micro_steps for g in m.groups for i in g.sequences), default=-1)
    out = np.full(n, -1, dtype=np.int64)
    for m in plan.micro_steps:
        for g in m.groups:
            out[list(g.sequences)] = g.lengths
    return out


def check_pairing(plan: Plan, batch_id, lengths) -> None:
    """Raise PlanMismatchError unless ``plan`` was made for batch ``batch_id`` with ``lengths``."""
    if plan.batch_id != batch_id:
        raise PlanMismatchError(f"the plan is for batch {plan.batch_id!r}, not batch {batch_id!r}; refusing to pair "
                                f"them")
    s = np.asarray(lengths, dtype=np.int64)
    got = plan_lengths(plan)
    if got.size != s.size or not np.array_equal(got, s):
        if got.size != s.size:
            what = f"{got.size} sequences in the plan, {s.size} in the batch"
        else:
            i = int(np.flatnonzero(got != s)[0])
            what = f"sequence {i} is {int(got[i])} tokens in the plan but {int(s[i])} in the batch"
        raise PlanMismatchError(f"the plan tagged for batch {batch_id!r} does not match its lengths ({what})")


class PlanAhead:
    """Plans batches in a background worker process and hands out each plan only for its batch.

    ``planner``: a registered planner name or ``"module:function"``; ``cost``: the CostModel (sent
    to the worker once); ``seed``, ``effort``, ``time_limit``, ``max_len``: as ``run_planner``; ``depth``: how
    many batches ``iterate`` plans ahead of the one it hands out (``submit`` itself queues any
    number). Raises ValueError at once for an unknown planner.

    ``submit(batch)`` queues a batch (a ``Batch``, anything with ``.batch_id`` and ``.lengths``, or
    a ``(batch_id, lengths)`` pair); submitting the same id again with the same lengths is a no-op,
    with other lengths a PlanMismatchError. ``get(batch)`` waits for and returns the plan made for
    exactly that batch and forgets it; it raises UnknownBatchError (a KeyError) for a batch never
    submitted, PlanMismatchError when the plan's id or lengths do not match the batch, the
    planner's own exception (e.g. InfeasibleError) when planning failed, and TimeoutError when
    ``timeout`` passes (the plan stays queued).
    """

    def __init__(self, planner: str, cost: CostModel, *, seed: int = 0, effort: float = DEFAULT_EFFORT,
                 time_limit: float | None = None, max_len: int | None = None, depth: int = 1,
                 close_timeout: float = 5.0) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be a positive integer, got {depth!r}")
        if not isinstance(cost, CostModel):
            raise TypeError(f"cost must be a CostModel, got {type(cost).__name__}")
        self.planner = resolve_planner(planner)
        self.cost = cost
        self.seed = int(seed)
        self.effort = float(effort)
        self.time_limit = None if time_limit is None else float(time_limit)
        self.max_len = None if max_len is None else int(max_len)
        self.depth = depth
        self.close_timeout = float(close_timeout)
        ctx = multiprocessing.get_context("spawn")
        self._cancel = ctx.Event()
        self._pool: ProcessPoolExecutor | None = ProcessPoolExecutor(
            max_workers=1, mp_context=ctx, initializer=_worker_init,
            initargs=(pickle.dumps(cost), self.planner, self._cancel, os.getpid()))
        self._pending: dict[Any, tuple[np.ndarray, Any]] = {}
        self._done: deque = deque(maxlen=64)  # ids already handed out, for a clearer error
        self._procs: dict[int, Any] = {}  # the worker processes started, kept to say how one ended

    # ---- context manager ----------------------------------------------------------------------
    def __enter__(self) -> "PlanAhead":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close(wait=False)
        except Exception:
            pass

    # ---- queueing ------------------------------------------------------------------------------
    @property
    def pending(self) -> list:
        """Ids of the batches submitted and not yet handed out, in submission order."""
        return list(self._pending)

    def submit(self, batch) -> Any:
        """Queue ``batch`` for planning; returns its batch id."""
        if self._pool is None:
            raise RuntimeError("PlanAhead is closed")
        bid, lens = _as_batch(batch)
        if lens is None:
            raise TypeError(f"submit needs the batch's lengths, not only its id {bid!r}: pass the Batch or "
                            f"(batch_id, lengths)")
        if bid in self._pending:
            if np.array_equal(self._pending[bid][0], lens):
                return bid
            raise PlanMismatchError(f"batch {bid!r} was already submitted with other lengths; batch ids must be "
                                    f"unique")
        fut = self._submit(_worker_plan, bid, lens, self.seed, self.effort, self.time_limit, self.max_len)
        self._pending[bid] = (lens, fut)
        return bid

    def _submit(self, fn, *args):
        try:
            with _main_not_reimported():  # the worker process starts in the pool's first submit
                fut = self._pool.submit(fn, *args)
        except BrokenProcessPool:  # it died between two tasks
            raise WorkerDied(self._died("before this batch was submitted")) from None
        self._procs.update(getattr(self._pool, "_processes", None) or {})
        return fut

    def _died(self, when: str) -> str:
        """One line: the worker died, how it ended (pid, signal or exit status) and ``when``."""
        import signal
        import time

        how = []
        for pid, proc in self._procs.items():
            code = proc.exitcode
            # the pool's own thread may be reaping it right now (our poll then sees no child): its
            # exit status is there a moment later
            for _ in range(40):
                if code is not None:
                    break
                time.sleep(0.025)
                code = proc.exitcode
            if code is None:
                continue
            if code < 0:
                try:
                    how.append(f"pid {pid} killed by {signal.Signals(-code).name}")
                except ValueError:
                    how.append(f"pid {pid} killed by signal {-code}")
            else:
                how.append(f"pid {pid} exited with status {code}")
        return f"the planning worker process died {when} ({'; '.join(how) or 'how it ended is unknown'})"

    def ready(self, batch) -> bool:
        """Whether the plan for ``batch`` (a batch or its id) is finished (or failed)."""
        bid, _ = _as_batch(batch)
        return bid in self._pending and self._pending[bid][1].done()

    def get(self, batch, timeout: float | None = None) -> Plan:
        """The plan made for exactly ``batch``, waiting up to ``timeout`` seconds (None: no limit).
        ``batch`` may be the batch, a ``(batch_id, lengths)`` pair, or its id alone (then the plan
        is still checked against the lengths it was submitted with)."""
        bid, lens = _as_batch(batch)
        if bid not in self._pending:
            if bid in self._done:
                raise UnknownBatchError(f"the plan for batch {bid!r} was already handed out; each plan is handed "
                                        f"out once")
            known = ", ".join(repr(b) for b in list(self._pending)[:8]) or "none"
            raise UnknownBatchError(f"batch {bid!r} was never submitted for planning (pending: {known}); submit it "
                                    f"first")
        sub_lens, fut = self._pending[bid]
        if lens is not None and not np.array_equal(lens, sub_lens):
            raise PlanMismatchError(f"batch {bid!r} has other lengths than the batch submitted under that id "
                                    f"({lens.size} vs {sub_lens.size} sequences"
                                    f"{'' if lens.size != sub_lens.size else ', different values'})")
        wait([fut], timeout=timeout)
        if not fut.done():
            raise TimeoutError(f"the plan for batch {bid!r} was not ready within {timeout} s")
        try:
            plan = fut.result()
        except BrokenProcessPool:
            del self._pending[bid]
            raise WorkerDied(self._died(f"while batch {bid!r} was queued or being planned")) from None
        except CancelledError:
            del self._pending[bid]
            raise RuntimeError(f"planning batch {bid!r} was cancelled (the PlanAhead is closing)") from None
        except Exception as e:
            del self._pending[bid]
            self._done.append(bid)
            if hasattr(e, "add_note"):
                e.add_note(f"(while planning batch {bid!r} with {self.planner} in the plan-ahead worker)")
            raise
        del self._pending[bid]
        self._done.append(bid)
        check_pairing(plan, bid, sub_lens)
        return plan

    def discard(self, batch) -> None:
        """Forget a submitted batch (cancelling its planning if it has not started)."""
        bid, _ = _as_batch(batch)
        item = self._pending.pop(bid, None)
        if item is not None:
            item[1].cancel()

    def warm_up(self, timeout: float | None = 60.0) -> None:
        """Start the worker now and wait until it has loaded the cost model (otherwise the first
        plan pays the start-up: a fresh interpreter importing numpy and the planners). Call it before
        submitting: it waits behind any batch already queued."""
        if self._pool is None:
            raise RuntimeError("PlanAhead is closed")
        try:
            self._submit(_worker_ping).result(timeout=timeout)
        except BrokenProcessPool:
            raise WorkerDied(self._died("while starting")) from None

    def worker_pids(self) -> list[int]:
        """Pids of the worker process (once started: see :meth:`warm_up`) and of multiprocessing's
        resource tracker, which the spawn method starts beside it."""
        pids = [p.pid for p in getattr(self._pool, "_processes", {}).values() if p.pid] if self._pool else []
        try:
            from multiprocessing import resource_tracker

            tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
            if tracker:
                pids.append(int(tracker))
        except (ImportError, AttributeError):
            pass
        return pids

    # ---- lifetime -------------------------------------------------------------------------------
    def close(self, wait: bool = True) -> None:
        """Stop the worker: queued batches are dropped, a plan in progress is cancelled (planners
        that check the cancel token stop at once; the worker is terminated if it has not stopped
        within ``close_timeout`` seconds). Idempotent."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        self._cancel.set()
        for _, fut in self._pending.values():
            fut.cancel()
        self._pending.clear()
        procs = list(getattr(pool, "_processes", {}).values())  # the one worker this object started
        pool.shutdown(wait=False, cancel_futures=True)
        if not wait:
            return
        for p in procs:
            p.join(self.close_timeout)
            if p.is_alive():
                p.terminate()
                p.join(1.0)

    @property
    def closed(self) -> bool:
        return self._pool is None

    # ---- loops ----------------------------------------------------------------------------------
    def iterate(self, batches: Iterable) -> Iterator[tuple[Any, Plan]]:
        """Yield ``(batch, plan)`` for each batch in order, keeping ``depth`` batches submitted
        beyond the one handed out (so they are planned while the caller trains on it). Stops when
        ``batches`` ends; an endless sampler runs until the caller stops iterating (the batches
        planned ahead are then discarded)."""
        it = iter(batches)
        window: deque = deque()

        def fill(n: int) -> None:
            while len(window) < n:
                try:
                    b = next(it)
                except StopIteration:
                    return
                self.submit(b)
                window.append(b)

        try:
            fill(self.depth + 1)
            while window:
                b = window.popleft()
                plan = self.get(b)
                fill(self.depth)  # the next `depth` batches are planning before this one is handed out
                yield b, plan
        finally:  # the caller stopped early: drop what was planned ahead
            if not self.closed:
                for b in window:
                    self.discard(b)


def plan_ahead(batches: Iterable, planner: str, cost: CostModel, *, steps: int | None = None, seed: int = 0,
               effort: float = DEFAULT_EFFORT, time_limit: float | None = None, max_len: int | None = None,
               depth: int = 1) -> Iterator[tuple[Any, Plan]]:
    """Yield ``(batch, plan)`` pairs over ``batches`` (a GlobalBatchSampler, a list of batches or
    ``(batch_id, lengths)`` pairs), planning the next ``depth`` batches in a worker process while
    the caller works on the current one. ``steps`` stops after that many batches (needed for an
    endless sampler unless the caller breaks). The worker stops when the generator ends or is
    closed."""
    if steps is not None:
        import itertools

        batches = itertools.islice(batches, int(steps))
    with PlanAhead(planner, cost, seed=seed, effort=effort, time_limit=time_limit, max_len=max_len, depth=depth) as ahead:
        yield from ahead.iterate(batches)
