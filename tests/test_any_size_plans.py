"""Groups of any size (issue 35), the planning side: where groups are placed, the bounds against
exhaustive search with shapes that are not powers of two, the idle share by hand, and plans written
before (power-of-two groups) loading and validating unchanged."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from conftest import free_cost
from test_packing_bound import _least_max_load

from workbench.cost import CostModel
from workbench.models import get_model
from workbench.solve import plan_from_dict, run_planner, validate
from workbench.solve.bound import lower_bound_ms, pair_bound_ms, step_bound_ms
from workbench.solve.plan import build_plan, pass_loads
from workbench.specs import ClusterSpec, candidate_degrees, degree_chains, load_profile


def _lockstep(n, per_node, degrees=(), model="1b", mem=24.0):
    return CostModel(load_profile("a100-40g-flexsp"), get_model(model),
                     ClusterSpec(num_gpus=n, gpus_per_node=per_node, gpu_memory_gb=mem, degrees=degrees), strategy="auto")


# ---- placement ------------------------------------------------------------------------------------


def _node(r, g):
    return r // g


@pytest.mark.parametrize("n, g", [(4, 4), (6, 6), (8, 4), (12, 4), (12, 6), (6, 3), (12, 3), (10, 5)])
def test_every_group_the_planners_can_place_is_contiguous_and_inside_a_node_where_it_is_costed_so(n, g):
    """Brute force over every shape a plan can use on a small cluster: every divisibility chain of the
    candidate degrees, every aligned block of each of its degrees (ranks ``[k*d, (k+1)*d)``), every
    split ``u x c`` the cost model allows. Each group is a contiguous range inside the cluster; where
    the cost model prices a group within a node it lies in one node; where it prices its Ulysses
    all-to-all within a node every Ulysses sub-group (``u`` consecutive ranks from the group's start,
    computed here) lies in one node."""
    cost = _lockstep(n, g)
    assert cost.cluster.degrees == candidate_degrees(n, g)
    seen = 0
    for chain in degree_chains(cost.degrees):
        for d in chain:
            for k in range(n // d):
                ranks = list(range(k * d, (k + 1) * d))
                assert ranks == list(range(ranks[0], ranks[0] + d)) and ranks[-1] < n
                if not cost.crosses_nodes(d):
                    assert len({_node(r, g) for r in ranks}) == 1, (d, ranks)
                for c in cost.splits(d):
                    u = d // c
                    subs = [ranks[j * u:(j + 1) * u] for j in range(c)]
                    assert sorted(r for sub in subs for r in sub) == ranks
                    if not cost.crosses_nodes(u):
                        assert all(len({_node(r, g) for r in sub}) == 1 for sub in subs), (d, c, ranks)
                    seen += 1
    assert seen > 0


@pytest.mark.parametrize("n, g, zero", [(6, 6, 3), (12, 4, 2), (12, 6, 3), (6, 3, 2)])
def test_plans_on_small_clusters_place_groups_as_the_rule_says(n, g, zero):
    """Plans of random batches on clusters that are not powers of two: they validate, every group is
    a contiguous aligned range of a candidate degree, the groups of one plan use one divisibility
    chain, and under free execution no rank is in two groups of a micro-step."""
    rng = np.random.default_rng(n * 10 + zero)
    for planner in ("flexsp", "greedy"):
        for _ in range(3):
            scen = free_cost("1b", n, mem=24, per_node=g, strategy="auto") if zero < 3 else _lockstep(n, g)
            tpg = scen.tokens_per_gpu()
            s = (rng.uniform(0.05, 1.5, size=int(rng.integers(3, 12))) * tpg).astype(np.int64)
            p = run_planner(planner, s, scen, seed=0, effort=0.2)
            validate(p, s, scen.cluster, scen)
            degs = set()
            for ms in p.micro_steps:
                used: list[int] = []
                for grp in ms.groups:
                    r = list(grp.ranks)
                    assert r == list(range(r[0], r[0] + grp.degree)) and r[0] % grp.degree == 0 and r[-1] < n
                    assert grp.degree in scen.cluster.degrees
                    degs.add(grp.degree)
                    used += r
                if p.execution == "free":
                    assert len(used) == len(set(used))
            assert any(set(degs) <= set(c) for c in degree_chains(scen.cluster.degrees)), degs


# ---- bounds against exhaustive search ----------------------------------------------------------------


@pytest.mark.parametrize("n, degrees, seed", [(3, (1, 2, 3), 0), (4, (1, 2, 3, 4), 1), (3, (1, 3), 2)])
def test_free_bounds_never_above_the_exhaustive_optimum_with_shapes_of_any_size(n, degrees, seed):
    """Free execution on 3 and 4 GPUs with groups of 3 (not a power of two; 3 and 4 in one set are no
    chain): ``lower_bound_ms`` (now with the pair bound), ``pair_bound_ms`` and ``step_bound_ms``
    never above the least busiest-rank load of every plan on any rank sets of the candidate sizes
    (``test_packing_bound._least_max_load``: every partition into groups, every placement); the
    planner's plan never below them."""
    cost = free_cost("1b", n, mem=24, per_node=n, degrees=degrees, strategy="auto")
    tpg = cost.tokens_per_gpu()
    rng = np.random.default_rng(seed)
    done = 0
    while done < 6:
        s = (rng.uniform(0.2, 2.2, size=int(rng.integers(2, 5))) * tpg).astype(np.int64)
        if (cost.min_degree(s) == 0).any():
            continue
        opt = _least_max_load(s, cost)
        plan = run_planner("flexsp", s, cost, seed=0, effort=0.2)
        for name, b in (("lower", lower_bound_ms(s, cost)), ("pair", pair_bound_ms(s, cost)),
                        ("step", step_bound_ms(s, cost, [plan]))):
            assert b <= opt * (1 + 1e-9), (name, s.tolist(), b, opt)
            assert b <= plan.makespan_ms * (1 + 1e-9), (name, b, plan.makespan_ms)
        assert plan.lower_bound_ms <= opt * (1 + 1e-9)
        done += 1


def _lockstep_optimum(s, cost, passes=2):
    """The least makespan of every lockstep plan with at most ``passes`` passes on contiguous rank
    ranges: each sequence picks a shape ``(d, c)``, a start ``r`` (ranks ``[r, r+d)``, any ``r``, not
    only aligned ones) and a pass; sequences with the same three share a group. A pass lasts its
    busiest rank's load (its groups' times less the packed call's constant for every group after its
    first) or the pass's collectives, whichever is longer, plus the pass's constant; a rank holds the
    activations of all its groups in a pass. Written from the cost model's primitives alone."""
    n = cost.cluster.num_gpus
    shapes = list(cost.shapes)
    places = [(d, c, r) for d, c in shapes for r in range(n - d + 1)]
    C, comm, ovh = cost.call_overhead_ms(), cost.pass_comm_ms(), cost.pass_overhead_ms()
    best = math.inf
    priced: dict[tuple[int, tuple[int, ...]], tuple[float, float]] = {}  # (place, members) -> (memory, time)
    for choice in itertools.product(range(len(places)), range(passes), repeat=len(s)):
        pick = list(zip(choice[0::2], choice[1::2]))
        groups: dict[tuple[int, int], list[int]] = {}
        for i, key in enumerate(pick):
            groups.setdefault(key, []).append(i)
        total, ok = 0.0, True
        for p in range(passes):
            load, count, mem = np.zeros(n), np.zeros(n), np.zeros(n)
            for (k, q), members in groups.items():
                if q != p:
                    continue
                d, c, r = places[k]
                if (k, tuple(members)) not in priced:  # the same group recurs in many choices: priced once
                    x = s[members]
                    priced[k, tuple(members)] = (float(cost.memory(x, d, c).sum()),
                                                 float(cost.time(x, d, c).sum()) + cost.group_overhead_ms(d, c))
                m, g_ms = priced[k, tuple(members)]
                if m > cost.memory_budget_gb:
                    ok = False
                    break
                load[r:r + d] += g_ms
                count[r:r + d] += 1
                mem[r:r + d] += m
            if not ok or (mem > cost.memory_budget_gb * (1 + 1e-9)).any():
                ok = False
                break
            if count.any():
                total += max(float((load - C * np.maximum(count - 1, 0)).max()), comm) + ovh
        if ok:
            best = min(best, total)
    return best + cost.step_end_ms()


@pytest.mark.parametrize("n, count, seed", [(3, 3, 0), (4, 2, 1)])
def test_lockstep_bounds_never_above_the_exhaustive_optimum_with_shapes_of_any_size(n, count, seed):
    """ZeRO-3 on 3 and 4 GPUs (one node), every degree 1..n: the bounds (the lockstep bound with the
    pair bound, the packing and pass bounds of ``step_bound_ms``) never above the least makespan of
    every plan on any contiguous ranges (``_lockstep_optimum`` with as many passes as sequences: every
    plan), and the planner's plan never below them."""
    cost = _lockstep(n, n)
    assert cost.degrees == tuple(range(1, n + 1))
    tpg = cost.tokens_per_gpu()
    rng = np.random.default_rng(seed)
    done = 0
    while done < 4:
        s = np.sort((rng.uniform(0.3, 2.5, size=count) * tpg).astype(np.int64))[::-1]
        if (cost.min_degree(s) == 0).any():
            continue
        opt = _lockstep_optimum(s, cost, passes=count)
        plan = run_planner("flexsp", s, cost, seed=0, effort=0.2)
        lb = lower_bound_ms(s, cost)
        for name, b in (("lower", lb), ("pair", pair_bound_ms(s, cost)), ("step", step_bound_ms(s, cost, [plan]))):
            assert b <= opt * (1 + 1e-9), (name, s.tolist(), b, opt)
        assert opt >= lb * (1 - 1e-9) and plan.makespan_ms >= opt * (1 - 1e-9)
        done += 1


def test_the_pair_bound_by_hand():
    """Two sequences that only the whole cluster's degree holds (each over what a group of half the
    GPUs holds): they cannot sit side by side, so a rank runs both: the bound is both single-group
    times less the one constant they share if they are one group, plus the pass's constant and the
    step's end; with room for both side by side it is the longer of the two alone."""
    cost = _lockstep(6, 6)
    tpg = cost.tokens_per_gpu()
    big = int(4.2 * tpg)  # needs more than 3 GPUs' budget
    s = np.array([big, big])
    ok = [(d, c) for d, c in cost.shapes if cost.memory(s[:1], d, c)[0] <= cost.memory_budget_gb]
    assert ok and all(d > 3 for d, _ in ok)
    single = {(d, c): float(cost.time(s[:1], d, c)[0]) + cost.group_overhead_ms(d, c) for d, c in ok}
    both = min(2 * t - max(cost.group_overhead_ms(d, c), cost.call_overhead_ms()) for (d, c), t in single.items())
    cross = min(a + b - cost.call_overhead_ms() for (k1, a), (k2, b) in itertools.product(single.items(), repeat=2) if k1 != k2)
    hand = max(min(both, cross), cost.pass_comm_ms()) + cost.pass_overhead_ms() + cost.step_end_ms()
    assert pair_bound_ms(s, cost) == pytest.approx(hand, rel=1e-9)
    small = np.array([int(0.5 * tpg), int(0.4 * tpg)])  # each fits one GPU: side by side
    fits = [(d, c) for d, c in cost.shapes if d <= 3]
    a = min(float(cost.time(small[:1], d, c)[0]) + cost.group_overhead_ms(d, c) for d, c in fits)
    assert pair_bound_ms(small, cost) <= max(a, cost.pass_comm_ms()) + cost.pass_overhead_ms() + cost.step_end_ms() + 1e-9


# ---- the idle share, old plans -------------------------------------------------------------------------


def test_idle_share_by_hand():
    """Four GPUs, ZeRO-3, one pass: a group of 2 on ranks 0-1 and a group of 1 on rank 2, rank 3 in no
    group. Each rank waits for the busiest one (its load against the largest), rank 3 throughout: the
    idle share is that waiting over four GPUs times the makespan."""
    cost = _lockstep(4, 4, degrees=(1, 2, 4))
    s = np.array([3000, 1000])
    p = build_plan("hand", [[(2, [0]), (1, [1])]], s, cost, blocks=[[0, 2]])
    (load,) = pass_loads(p)
    t2, t1 = p.micro_steps[0].groups[0].time_ms, p.micro_steps[0].groups[1].time_ms
    assert list(load) == pytest.approx([t2, t2, t1, 0.0])
    top = max(t2, t1)
    hand = ((top - t2) * 2 + (top - t1) + top) / (4 * p.makespan_ms)
    assert p.idle_share == pytest.approx(hand, rel=1e-12) and p.to_dict()["idle_share"] == p.idle_share
    free = free_cost("1b", 4, mem=24, per_node=4, degrees=(1, 2, 4), strategy="auto")
    q = build_plan("hand", [[(2, [0]), (1, [1])]], s, free)
    busy = {}
    for g in q.micro_steps[0].groups:
        for r in g.ranks:
            busy[r] = busy.get(r, 0.0) + g.time_ms
    end = max(busy.values())
    assert q.idle_share == pytest.approx(sum(end - busy.get(r, 0.0) for r in range(4)) / (4 * q.makespan_ms), rel=1e-12)


OLD_PLAN = {  # the shape `workbench plan --json` wrote before groups of any size (no cp, offload, idle_share)
    "planner": "greedy", "status": "heuristic", "makespan_ms": 1.0, "lower_bound_ms": 0.5, "gap": 1.0,
    "solve_seconds": 0.01, "num_gpus": 8, "grad_sync_ms": 0.0, "memory_budget_gb": 20.0, "batch_id": None,
    "reason": "", "stats": {}, "execution": "lockstep", "zero_stage": 3, "precision": "bf16", "recompute": False,
    "micro_steps": [{"groups": [
        {"degree": 4, "ranks": [0, 1, 2, 3], "sequences": [0], "lengths": [6000], "time_ms": 0.5, "memory_gb": 1.0},
        {"degree": 2, "ranks": [4, 5], "sequences": [1], "lengths": [3000], "time_ms": 0.5, "memory_gb": 1.0},
        {"degree": 1, "ranks": [6], "sequences": [2, 3], "lengths": [500, 700], "time_ms": 0.5, "memory_gb": 1.0},
    ], "time_ms": 0.5}],
}


def test_an_old_power_of_two_plan_loads_and_validates_unchanged():
    """A plan file written before (power-of-two groups, none of the newer fields) reads back with its
    groups as they were, Ulysses-only, and passes ``validate``'s structure checks on today's default
    8-GPU cluster (every degree up to the node now; the old plan's degrees are among them)."""
    p = plan_from_dict(OLD_PLAN)
    groups = p.micro_steps[0].groups
    assert [(g.degree, g.ranks, g.cp) for g in groups] == [(4, (0, 1, 2, 3), 1), (2, (4, 5), 1), (1, (6,), 1)]
    cluster = ClusterSpec(num_gpus=8, gpus_per_node=8)
    assert {4, 2, 1} <= set(cluster.degrees)
    validate(p, np.array([6000, 3000, 500, 700]), cluster)
    assert 0.0 <= p.idle_share < 1.0


def test_a_cap_that_ends_only_another_chains_search_is_said(monkeypatch):
    """48 GPUs, the 1M-token batch: the first chain is searched on the plan's clock, another on a clock
    of its own. When only that one's wall-clock cap passes, the plan says it depends on the machine
    (its stats and reason), as when the plan's own cap passes."""
    import workbench.solve as ws

    cost = CostModel(load_profile("h100-80g"), get_model("llama3-8b"),
                     ClusterSpec(num_gpus=48, gpus_per_node=8, gpu_memory_gb=80, usable_memory_fraction=0.9),
                     strategy="auto", recompute=True)
    s = np.array([1048576, 204800, 51200, 8192])
    calm = run_planner("flexsp", s, cost)
    assert not calm.stats["effort"]["capped"] and "wall-clock cap" not in calm.reason
    assert sum(c["makespan_ms"] is not None for c in calm.stats["chains"]) >= 2  # another chain was searched
    start = ws.PlanOptions.start

    def tiny_cap_for_other_chains(self):
        opts, clock = start(self)
        if self.effort < 1.0:  # the other chains' share of the effort
            clock.cap_s = 1e-6
        return opts, clock

    monkeypatch.setattr(ws.PlanOptions, "start", tiny_cap_for_other_chains)
    p = run_planner("flexsp", s, cost)
    assert p.stats["effort"]["capped"] and "another divisibility chain" in p.reason and "depends on the machine" in p.reason
