"""The packing lower bound (``workbench.solve.bound``) against exhaustive search and by hand."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from workbench.solve import lower_bound_ms, run_planner
from workbench.solve.bound import packing_bound_ms, step_bound_ms
from workbench.specs import load_profile
from conftest import free_cost, set_partitions

PROFILE = load_profile("a100-40g-flexsp")


def _cost(n, degrees, model="1b", mem=24):
    """Free execution (ZeRO-2) with the budget of ``n`` GPUs of ``mem`` GB under FlexSP's ZeRO-3 formula."""
    return free_cost(model, n, mem=mem, per_node=n, degrees=degrees)


def _least_max_load(s, cost):
    """Least busiest-rank load (plus the gradient sync) over every plan: every set partition of the
    sequences into groups, each group on any set of ranks of a size among the degrees, within
    memory. A rank is busy at least its groups' summed time, so no plan is faster; on 2 GPUs (and
    on aligned blocks, larger degrees first) this is the optimum itself."""
    n = cost.cluster.num_gpus
    degs = [d for d in cost.degrees if d <= n]
    t = {d: cost.time(s, d) for d in degs}
    m = {d: cost.memory(s, d) for d in degs}
    places = [(d, r) for d in degs for r in itertools.combinations(range(n), d)]
    best = math.inf
    for part in set_partitions(list(range(len(s)))):
        opts = []
        for grp in part:
            opts.append([(d, r, cost.group_overhead_ms(d) + float(t[d][grp].sum())) for d, r in places
                         if m[d][grp].sum() <= cost.memory_budget_gb])
        for choice in itertools.product(*opts):
            load = np.zeros(n)
            for _, r, g in choice:
                load[list(r)] += g
            best = min(best, float(load.max()))
    return best + cost.grad_sync_ms()


@pytest.mark.parametrize("n,degrees,sizes,count,seed,tighter_at_least",
                         [(2, (1, 2), (2, 6), 25, 0, 1), (4, (1, 2, 4), (2, 4), 12, 1, 0)])
def test_never_above_the_exhaustive_optimum(n, degrees, sizes, count, seed, tighter_at_least):
    """On random tight-memory batches: below the least busiest-rank load of every plan (with and
    without ``upper_ms`` set to that plan's compute time); on 2 GPUs also tighter than
    ``lower_bound_ms`` on some of them (sequences over half a group cannot share it)."""
    cost = _cost(n, degrees)
    tpg = cost.tokens_per_gpu()
    rng = np.random.default_rng(seed)
    tighter = total = 0
    while total < count:
        s = (rng.uniform(0.2, 1.6, size=int(rng.integers(*sizes))) * tpg).astype(np.int64)
        if (cost.min_degree(s) == 0).any():
            continue
        opt = _least_max_load(s, cost)
        b = packing_bound_ms(s, cost)
        bu = packing_bound_ms(s, cost, upper_ms=opt - cost.grad_sync_ms())
        assert b <= opt * (1 + 1e-9) and bu <= opt * (1 + 1e-9), (s.tolist(), b, bu, opt)
        assert bu >= b * (1 - 1e-9)  # fewer degrees to choose from never loosens it
        total += 1
        tighter += b > lower_bound_ms(s, cost) * (1 + 1e-6)
    assert tighter >= tighter_at_least


def test_sequences_over_half_a_group_each_pay_a_group_by_hand():
    """One GPU, three sequences each needing 60% of a group: three groups whatever the plan, so
    the bound is 3 overheads + their times (the optimum), where counting memory alone says 1.8."""
    cost = _cost(1, (1,), mem=80)
    x = int(0.6 * cost.tokens_per_gpu())
    s = np.array([x, x, x])
    assert 0.5 < cost.memory(s[:1], 1)[0] / cost.memory_budget_gb < 2 / 3
    c = cost.group_overhead_ms(1)
    hand = 3 * c + 3 * float(cost.time(s[:1], 1)[0]) + cost.grad_sync_ms()
    assert packing_bound_ms(s, cost) == pytest.approx(hand, rel=1e-6)
    assert packing_bound_ms(s, cost) <= hand
    assert lower_bound_ms(s, cost) < hand * (1 - 1e-3)
    assert _least_max_load(s, cost) == pytest.approx(hand, rel=1e-9)


def test_a_long_sequence_pays_its_wide_group_by_hand():
    """Two GPUs, one sequence that only degree 2 holds and that fills 60% of it: its group's two
    overhead slots are paid in full (or its spare memory filled at degree 2's cost)."""
    cost = _cost(2, (1, 2))
    tpg = cost.tokens_per_gpu()
    s = np.array([int(1.2 * tpg)])
    assert cost.min_degree(s)[0] == 2
    hand = cost.group_overhead_ms(2) + float(cost.time(s, 2)[0]) + cost.grad_sync_ms()
    assert packing_bound_ms(s, cost) == pytest.approx(hand, rel=1e-6)


def test_step_bound_is_the_tighter_bound_below_the_optimum():
    """``step_bound_ms`` (what the Solver panel and ``workbench plan`` report as the packing
    bound): on random tight-memory batches on 2 GPUs, given the planners' plans, never above the
    exhaustive optimum nor below ``lower_bound_ms``, and restricted by the fastest plan given; on
    the three-sequences case by hand, exactly the optimum where ``lower_bound_ms`` is below it."""
    cost = _cost(2, (1, 2))
    tpg = cost.tokens_per_gpu()
    rng = np.random.default_rng(3)
    done = tighter = 0
    while done < 8:
        s = (rng.uniform(0.2, 1.6, size=int(rng.integers(2, 6))) * tpg).astype(np.int64)
        if (cost.min_degree(s) == 0).any():
            continue
        opt = _least_max_load(s, cost)
        plans = [run_planner(name, s, cost, seed=0, effort=2) for name in ("greedy", "flexsp")]
        b = step_bound_ms(s, cost, plans)
        assert lower_bound_ms(s, cost) * (1 - 1e-9) <= b <= opt * (1 + 1e-9), (s.tolist(), b, opt)
        assert b <= min(p.makespan_ms for p in plans) * (1 + 1e-9)
        fastest = min(p.makespan_ms for p in plans) - cost.grad_sync_ms()
        assert b >= packing_bound_ms(s, cost, upper_ms=fastest) * (1 - 1e-9)
        assert step_bound_ms(s, cost) <= b * (1 + 1e-9)  # without plans: no restriction, never tighter
        tighter += b > lower_bound_ms(s, cost) * (1 + 1e-6)
        done += 1
    assert tighter >= 1
    one = _cost(1, (1,), mem=80)
    x = int(0.6 * one.tokens_per_gpu())
    s = np.array([x, x, x])
    hand = 3 * one.group_overhead_ms(1) + 3 * float(one.time(s[:1], 1)[0]) + one.grad_sync_ms()
    plan = run_planner("flexsp", s, one, seed=0, effort=2)
    assert plan.makespan_ms == pytest.approx(hand, rel=1e-9)
    assert step_bound_ms(s, one, [plan]) == pytest.approx(hand, rel=1e-6)
    assert lower_bound_ms(s, one) < hand * (1 - 1e-3)
