"""Planners that the plan-ahead tests load in the spawned worker by ``"module:function"`` path
(``tests/`` is on ``sys.path`` under pytest, and a spawned worker inherits the parent's path)."""

from __future__ import annotations

import time

from workbench.solve.baselines import plan_greedy


def plan_slow(lengths, cost, opts):
    """Greedy, after a pause that is longer for smaller batches (so a naive queue that pairs plans
    with batches by finishing order would mix them up)."""
    time.sleep(0.05 + 2.0 / (10 + len(lengths)))
    return plan_greedy(lengths, cost, opts)


def plan_fail(lengths, cost, opts):
    """Always fails, naming the batch size."""
    raise RuntimeError(f"deliberate planner failure on {len(lengths)} sequences")


class _OddError(Exception):
    def __init__(self, a, b):  # not picklable by default: two required arguments
        super().__init__(f"odd failure {a}/{b}")


def plan_odd_error(lengths, cost, opts):
    """Fails with an exception that cannot be pickled back as is."""
    raise _OddError(1, len(lengths))


def plan_reversed(lengths, cost, opts):
    """A buggy planner: plans the batch in reverse order (the lengths no longer match)."""
    return plan_greedy(lengths[::-1].copy(), cost, opts)


def plan_until_cancelled(lengths, cost, opts):
    """Runs for up to a minute, stopping as soon as the cancel token is set."""
    for _ in range(1200):
        opts.check_cancel()
        time.sleep(0.05)
    return plan_greedy(lengths, cost, opts)
