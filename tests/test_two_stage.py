"""The two-stage planner: layouts, stage-1 dispatch by hand, stage-2 packing against brute force,
and whole plans on every length family."""

import itertools
import threading

import numpy as np
import pytest

from workbench.data import synthetic_lengths
from workbench.solve import Cancelled, lower_bound_ms, planner_names, run_planner, validate
from workbench.solve.baselines import pack_best_fit
from workbench.solve.two_stage import (candidate_layouts, dispatch, layout_blocks, layout_name,
                                       microbatch_lower_bound, pack_min_microbatches, plan_two_stage)
from workbench.solve.options import PlanOptions

FAMILIES = ["wikipedia", "commoncrawl", "github", "byted"]


def _family(name, n=512, seed=0):
    # byted reaches 371K tokens, more than 7B on 64 A100-40G can hold; cap at 128K like a max context
    return np.minimum(synthetic_lengths(name, n, seed=seed), 131072)


def _brute_min_bins(sizes, cap):
    """Fewest bins by trying every assignment of items to bins (item i only to bins 0..i)."""
    k = len(sizes)
    best = k
    loads = []

    def go(i):
        nonlocal best
        if len(loads) >= best:
            return
        if i == k:
            best = len(loads)
            return
        for b in range(len(loads)):
            if loads[b] + sizes[i] <= cap * (1 + 1e-9):
                loads[b] += sizes[i]
                go(i + 1)
                loads[b] -= sizes[i]
        loads.append(sizes[i])
        go(i + 1)
        loads.pop()

    go(0)
    return best


def _replicas(plan):
    """{rank block: [micro-batches as sequence tuples]}; asserts blocks are fixed and disjoint."""
    out = {}
    for m in plan.micro_steps:
        for g in m.groups:
            out.setdefault(g.ranks, []).append(g.sequences)
    blocks = list(out)
    for a, b in itertools.combinations(blocks, 2):
        assert not set(a) & set(b), f"replicas {a[0]}.. and {b[0]}.. share ranks: the layout is not fixed"
    return out


def _same(a, b):
    da, db = a.to_dict(), b.to_dict()
    da.pop("solve_seconds")
    db.pop("solve_seconds")
    return da == db


# ---- registration -----------------------------------------------------------------------------


def test_registered():
    assert "two-stage" in planner_names()


# ---- layouts -----------------------------------------------------------------------------------


def test_layout_names_and_blocks():
    assert layout_name([32, 2, 2, 8]) == "1x32+1x8+2x2"
    assert layout_blocks([32, 8, 2, 2, 1]) == [0, 4, 20, 21, 44]
    with pytest.raises(ValueError, match="larger degrees first"):
        layout_blocks([1, 2])


@pytest.mark.parametrize("family", FAMILIES)
def test_candidate_layouts_are_aligned_and_hold_the_longest(free_7b_64, family):
    s = _family(family)
    need = int(free_7b_64.min_degree([s.max()])[0])
    layouts = candidate_layouts(s, free_7b_64)
    names = [n for n, _ in layouts]
    assert len(set(names)) == len(names) > 1
    assert names[0] == f"{64 // need}x{need}"  # the static-max layout first
    for name, reps in layouts:
        assert list(reps) == sorted(reps, reverse=True) and layout_name(reps) == name
        assert reps[0] >= need and sum(reps) <= 64
        assert all(d in free_7b_64.degrees for d in reps)
        layout_blocks(reps)  # aligned
    assert any(len(set(r)) > 1 for _, r in layouts) or need == max(free_7b_64.degrees)


# ---- stage 1: dispatch by hand -----------------------------------------------------------------


class _HandCost:
    """time = s/d ms, memory = s/d/1000 GB, 100 ms per micro-batch, a 1 GB budget."""

    memory_budget_gb = 1.0

    def time(self, s, d):
        return np.asarray(s, dtype=float) / d

    def memory(self, s, d):
        return np.asarray(s, dtype=float) / d / 1000

    def group_overhead_ms(self, d):
        return 100.0


def test_dispatch_by_hand():
    # layout: replica 0 of degree 2, replicas 1 and 2 of degree 1. Costs ((time, memory) -> est):
    #  1800 fits only replica 0 (1.8 GB on one GPU): r0 = 900 + 100 = 1000
    #   900: r0 would be 1350 + 2 micro-batches = 1550; r1 = r2 = 1000 -> tie, lower index: r1
    #   800: r0 1300+200 = 1500, r1 1700+200 = 1900, r2 800+100 = 900 (max stays 1000) -> r2
    #   700: r0 1250+200 = 1450, r1 1600+200 = 1800, r2 1500+200 = 1700 -> r0 (max 1450)
    #   100: r0 1300+200 = 1500; r1 1000+100 = 1100 and r2 900+100 = 1000 both keep the max at
    #        1450 -> the one ending lower: r2
    s = np.array([900, 100, 1800, 700, 800])
    share = dispatch(s, _HandCost(), [2, 1, 1])
    assert [sorted(x) for x in share] == [[2, 3], [0], [1, 4]]


def test_dispatch_only_the_largest_replica_holds_the_long_ones():
    # the three sequences only the degree-2 replica holds go there first, longest first (its
    # estimate becomes 2400 + 3 micro-batches = 2700); then 100 ties on r1/r2 (200 each) -> r1,
    # and 50 ends lowest on r2 (150)
    s = np.array([100, 1500, 1600, 1700, 50])
    assert dispatch(s, _HandCost(), [2, 1, 1]) == [[3, 2, 1], [0], [4]]


def test_dispatch_restarts_are_seeded(small_cost):
    s = synthetic_lengths("commoncrawl", 60, seed=4)
    s = np.minimum(s, 20000)
    a = dispatch(s, small_cost, [4, 2, 1, 1], rng=np.random.default_rng([7, 1]))
    b = dispatch(s, small_cost, [4, 2, 1, 1], rng=np.random.default_rng([7, 1]))
    assert a == b
    assert sorted(i for x in a for i in x) == list(range(s.size))


# ---- stage 2: micro-batches ---------------------------------------------------------------------


def test_pack_beats_best_fit_where_best_fit_is_not_minimal():
    sizes = np.array([4.0, 4.0, 3.0, 3.0, 3.0, 3.0])
    assert len(pack_best_fit(sizes, 10.0)) == 3  # best fit decreasing: {4,4} {3,3,3} {3}
    bins, proven = pack_min_microbatches(sizes, 10.0)
    assert proven and len(bins) == 2
    assert sorted(i for b in bins for i in b) == list(range(6))
    assert all(sizes[b].sum() <= 10.0 + 1e-9 for b in bins)


@pytest.mark.parametrize("seed", range(12))
def test_pack_equals_brute_force_on_tiny_instances(seed):
    rng = np.random.default_rng(seed)
    k = int(rng.integers(3, 9))
    sizes = rng.uniform(0.15, 0.7, size=k)
    bins, proven = pack_min_microbatches(sizes, 1.0)
    assert proven
    assert len(bins) == _brute_min_bins(list(sizes), 1.0)
    assert sorted(i for b in bins for i in b) == list(range(k))
    assert all(sizes[b].sum() <= 1.0 + 1e-9 for b in bins)
    assert microbatch_lower_bound(sizes, 1.0) <= len(bins)


@pytest.mark.parametrize("seed", range(6))
def test_plan_micro_batches_are_minimal_per_replica(small_cost, seed):
    # tiny batches where memory binds: every replica's micro-batch count is the brute-force minimum
    rng = np.random.default_rng(100 + seed)
    s = rng.integers(800, 9000, size=int(rng.integers(5, 10)))
    p = run_planner("two-stage", s, small_cost, seed=seed, effort=5.0)
    validate(p, s, small_cost.cluster, small_cost)
    assert p.stats["packing_proven"]
    for ranks, mbs in _replicas(p).items():
        seqs = [i for mb in mbs for i in mb]
        sizes = list(small_cost.memory(s[seqs], len(ranks)))
        assert len(mbs) == _brute_min_bins(sizes, small_cost.memory_budget_gb), (ranks, seqs)


@pytest.fixture(scope="module")
def one_replica_cost():
    """7B on 8 GPUs (free execution, the budget of 8 A100-40G under FlexSP's ZeRO-3 formula) that may
    only use degree 8: one replica, so stage 2 packs the whole batch."""
    from conftest import free_cost

    return free_cost("7b", 8, degrees=(8,))


def test_plan_packs_below_best_fit(one_replica_cost):
    # memory 0.4, 0.4, 0.3 x 4 of the budget (a hair under): best fit needs 3 micro-batches, 2 do
    cap = one_replica_cost.tokens_per_gpu() * 8
    s = np.array([int(cap * f) - 8 for f in (0.4, 0.4, 0.3, 0.3, 0.3, 0.3)])
    static = run_planner("static:8", s, one_replica_cost)
    p = run_planner("two-stage", s, one_replica_cost, effort=5.0)
    validate(p, s, one_replica_cost.cluster, one_replica_cost)
    assert len(static.micro_steps) == 3 and len(p.micro_steps) == 2
    assert p.stats["exact_packings"] == 1 and p.stats["packing_proven"]
    assert p.makespan_ms == pytest.approx(static.makespan_ms - one_replica_cost.group_overhead_ms(8))


@pytest.mark.parametrize("seed", range(8))
def test_one_replica_micro_batches_equal_brute_force(one_replica_cost, seed):
    rng = np.random.default_rng(200 + seed)
    cap = one_replica_cost.tokens_per_gpu() * 8
    s = (cap * rng.uniform(0.15, 0.7, size=int(rng.integers(3, 9)))).astype(np.int64)
    p = run_planner("two-stage", s, one_replica_cost, seed=seed, effort=5.0)
    validate(p, s, one_replica_cost.cluster, one_replica_cost)
    sizes = list(one_replica_cost.memory(s, 8))
    assert len(p.micro_steps) == _brute_min_bins(sizes, one_replica_cost.memory_budget_gb)


# ---- whole plans ---------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_plans_validate_on_every_family(free_7b_64, family):
    s = _family(family)
    p = run_planner("two-stage", s, free_7b_64, seed=0, effort=10.0, batch_id="b1")
    validate(p, s, free_7b_64.cluster, free_7b_64)
    assert p.planner == "two-stage" and p.batch_id == "b1" and p.status == "heuristic"
    assert p.lower_bound_ms == pytest.approx(lower_bound_ms(s, free_7b_64))
    assert p.lower_bound_ms <= p.makespan_ms
    st = p.stats
    assert not st["truncated"]
    assert st["layout"] == layout_name(st["degrees"]) and st["layout"] in st["candidates"]
    reps = _replicas(p)
    assert len(reps) <= len(st["degrees"])
    # fixed replicas: the makespan is the slowest replica's sum of micro-batches plus the sync
    per_replica = {r: sum(g.time_ms for m in p.micro_steps for g in m.groups if g.ranks == r) for r in reps}
    assert p.makespan_ms == pytest.approx(max(per_replica.values()) + p.grad_sync_ms)
    assert st["candidates"][st["layout"]] == pytest.approx(p.makespan_ms - p.grad_sync_ms, abs=1e-3)
    # the homogeneous layouts are candidates, dispatched as the static planner does
    assert p.makespan_ms <= run_planner("best-static", s, free_7b_64).makespan_ms * (1 + 1e-9)


def test_deterministic_for_a_seed(free_7b_64):
    s = _family("github", 300, seed=5)
    a = run_planner("two-stage", s, free_7b_64, seed=3, effort=10.0)
    b = run_planner("two-stage", s, free_7b_64, seed=3, effort=10.0)
    assert _same(a, b)
    c = run_planner("two-stage", s, free_7b_64, seed=4, effort=10.0)
    validate(c, s, free_7b_64.cluster, free_7b_64)


def test_a_negligible_effort_still_plans(free_7b_64):
    s = _family("commoncrawl", 512, seed=1)
    p = run_planner("two-stage", s, free_7b_64, effort=1e-9)
    validate(p, s, free_7b_64.cluster, free_7b_64)
    assert p.stats["truncated"] and p.stats["layouts"] == 1


def test_progress_and_cancel(small_cost):
    s = synthetic_lengths("wikipedia", 64, seed=2)
    seen = []
    plan_two_stage(s, small_cost, PlanOptions(progress=lambda f, m: seen.append((f, m))))
    fr = [f for f, _ in seen]
    assert fr == sorted(fr) and len(fr) > 2 and any("layout" in m for _, m in seen)
    ev = threading.Event()
    ev.set()
    with pytest.raises(Cancelled):
        plan_two_stage(s, small_cost, PlanOptions(cancel=ev))


def test_single_sequence_and_infeasible(small_cost):
    p = run_planner("two-stage", [5000], small_cost)
    validate(p, [5000], small_cost.cluster, small_cost)
    assert p.num_sequences == 1
    from workbench.cost import InfeasibleError

    with pytest.raises(InfeasibleError):
        plan_two_stage(np.array([10_000_000]), small_cost, PlanOptions())
