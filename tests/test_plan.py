"""Plan timing, validate, the lower bound and the baseline planners."""

import dataclasses
import itertools
import subprocess
import sys

import numpy as np
import pytest

from workbench.solve import PlanError, build_plan, lower_bound_ms, run_planner, timeline, validate
from workbench.solve.plan import Group, MicroStep, Plan
from conftest import set_partitions


def _plan(groups_per_step, n=4, grad=0.0):
    ms = tuple(MicroStep(groups=tuple(Group(degree=d, ranks=tuple(r), sequences=tuple(s), lengths=tuple(ln),
                                            time_ms=t, memory_gb=0.0) for d, r, s, ln, t in g))
               for g in groups_per_step)
    return Plan(planner="hand", status="heuristic", makespan_ms=0.0, lower_bound_ms=0.0, solve_seconds=0.0,
                micro_steps=ms, num_gpus=n, grad_sync_ms=grad)


def test_timeline_by_hand():
    # micro-step 0: ranks 0-1 busy 10, rank 2 busy 5, rank 3 busy 1; micro-step 1: all four, 3 ms
    p = _plan([[(2, [0, 1], [0], [10], 10.0), (1, [2], [1], [5], 5.0), (1, [3], [2], [1], 1.0)],
               [(4, [0, 1, 2, 3], [3], [3], 3.0)]], grad=2.0)
    tl = timeline(p)
    assert tl["rank_finish_ms"] == [13.0, 13.0, 13.0, 13.0]
    assert tl["rank_busy_ms"] == [13.0, 13.0, 8.0, 4.0]
    assert tl["makespan_ms"] == 15.0
    # no barrier: ranks 2-3 run their second group as soon as both are free
    p2 = _plan([[(2, [0, 1], [0], [10], 10.0), (1, [2], [1], [5], 5.0), (1, [3], [2], [1], 1.0)],
                [(2, [2, 3], [3], [3], 3.0)]])
    assert timeline(p2)["rank_finish_ms"] == [10.0, 10.0, 8.0, 8.0]


def test_build_plan_places_heavy_groups_on_ranks_free_first(small_cost):
    s = np.array([4000, 100, 100, 100])
    # micro-step 0: a heavy degree-1 group on one rank; micro-step 1: a single degree-1 group
    p = build_plan("x", [[(1, [0]), (1, [1])], [(1, [2, 3])]], s, small_cost)
    first = {g.sequences: g.ranks for g in p.micro_steps[0].groups}
    second = p.micro_steps[1].groups[0]
    assert second.ranks != first[(0,)]  # it goes to a rank that is already free
    t = lambda seqs, d=1: small_cost.group_overhead_ms(d) + small_cost.time(s[list(seqs)], d).sum()
    expect = max(t([0]), t([1]) + t([2, 3])) + small_cost.grad_sync_ms()
    assert p.makespan_ms == pytest.approx(expect)


def _valid(small_cost):
    s = np.array([3000, 2000, 500, 500, 9000])
    p = build_plan("x", [[(1, [0]), (1, [1, 2]), (4, [4])], [(4, [3])]], s, small_cost)
    validate(p, s, small_cost.cluster, small_cost)
    return s, p


def _replace_group(plan, m, k, **kw):
    ms = list(plan.micro_steps)
    gs = list(ms[m].groups)
    gs[k] = dataclasses.replace(gs[k], **kw)
    ms[m] = MicroStep(groups=tuple(gs))
    return dataclasses.replace(plan, micro_steps=tuple(ms))


def test_validate_rejects_every_kind_of_broken_plan(small_cost):
    s, p = _valid(small_cost)
    c = small_cost.cluster
    g0 = p.micro_steps[0].groups
    big = next(k for k, g in enumerate(g0) if g.degree == 4)
    one = [k for k, g in enumerate(g0) if g.degree == 1]
    two_seq = next(k for k in one if len(g0[k].sequences) == 2)
    cases = [
        # overlap: two groups share a rank
        (_replace_group(p, 0, one[0], ranks=g0[one[1]].ranks), "also in group"),
        # missing sequence
        (_replace_group(p, 0, two_seq, sequences=(1,), lengths=(2000,)), r"sequence\(s\) \[2\] are in no group"),
        # duplicate
        (_replace_group(p, 1, 0, sequences=(3, 0), lengths=(500, 3000)), "runs 2 times"),
        # misaligned block
        (_replace_group(p, 0, big, ranks=(2, 3, 4, 5)), "not an aligned block"),
        # wrong size
        (_replace_group(p, 0, big, ranks=(0, 1, 2)), "has 3 ranks, not 4"),
        # degree 3 is a candidate on one node of 8 (every degree up to the node), but Ulysses over 3 splits no 32 heads
        (_replace_group(p, 1, 0, degree=3, ranks=(0, 1, 2)), "not one of the cost model's shapes"),
        # length mismatch
        (_replace_group(p, 1, 0, lengths=(501,)), "has length 500 in the batch but 501"),
        # empty group
        (_replace_group(p, 1, 0, sequences=(), lengths=()), "has no sequences"),
        # index outside the batch
        (_replace_group(p, 1, 0, sequences=(9,), lengths=(500,)), "outside the batch"),
        # wrong world size
        (dataclasses.replace(p, num_gpus=16), "plan is for 16 ranks but the cluster has 8"),
        # lower bound above makespan
        (dataclasses.replace(p, lower_bound_ms=p.makespan_ms * 2), "exceeds the makespan"),
    ]
    for bad, match in cases:
        with pytest.raises(PlanError, match=match):
            validate(bad, s, c, small_cost)
    # a degree the cluster was not given
    with pytest.raises(PlanError, match="not a candidate degree"):
        validate(_replace_group(p, 1, 0, degree=3, ranks=(0, 1, 2)), s, dataclasses.replace(c, degrees=(1, 2, 4, 8)),
                 small_cost)
    # memory overflow: 9000 tokens at degree 1 need ~40 GB of activations
    over = build_plan("x", [[(2, [4]), (1, [0]), (1, [1, 2, 3])]], s, small_cost)
    with pytest.raises(PlanError, match="GB per GPU of activations but the budget"):
        validate(over, s, c, small_cost)


def _brute_force_single_step(s, cost):
    """Exhaustive optimum over one micro-step: every multiset of degrees that fits the ranks and
    every assignment of sequences to its groups (empty groups cost nothing)."""
    n = cost.cluster.num_gpus
    degs = cost.degrees
    best = np.inf
    layouts = []

    def rec(i, left, cur):
        if i == len(degs):
            if cur:
                layouts.append(tuple(cur))
            return
        d = degs[i]
        for k in range(left // d + 1):
            rec(i + 1, left - k * d, cur + [d] * k)

    rec(0, n, [])
    c = {d: cost.group_overhead_ms(d) for d in degs}
    t = {d: cost.time(s, d) for d in degs}
    mem = {d: cost.memory(s, d) for d in degs}
    for lay in layouts:
        if len(lay) > len(s):
            continue
        for assign in itertools.product(range(len(lay)), repeat=len(s)):
            loads, mems = [0.0] * len(lay), [0.0] * len(lay)
            for i, g in enumerate(assign):
                loads[g] += t[lay[g]][i]
                mems[g] += mem[lay[g]][i]
            if max(mems) > cost.memory_budget_gb:
                continue
            span = max(loads[g] + c[lay[g]] for g in range(len(lay)) if g in assign)
            best = min(best, span)
    return best + cost.grad_sync_ms()


def test_lower_bound_never_exceeds_brute_force_optimum():
    from conftest import free_cost

    cost = free_cost("7b", 4)
    rng = np.random.default_rng(1)
    for _ in range(25):
        k = int(rng.integers(1, 6))
        s = rng.integers(200, 6000, size=k)
        if (cost.min_degree(s) == 0).any():
            continue
        opt = _brute_force_single_step(s, cost)
        if not np.isfinite(opt):
            continue
        assert lower_bound_ms(s, cost) <= opt * (1 + 1e-9)


def _classic_bound(s, cost):
    """max(perfectly divided work at each sequence's cheapest degree, longest sequence alone), by hand."""
    n = cost.cluster.num_gpus
    work, alone = [], []
    for x in s:
        ok = [d for d in cost.degrees if cost.memory([x], d)[0] <= cost.memory_budget_gb]
        work.append(min(d * cost.time([x], d)[0] for d in ok))
        alone.append(min(cost.time([x], d)[0] + cost.group_overhead_ms(d) for d in ok))
    slots = max(1.0, float(cost.memory(s, 1).sum()) / cost.memory_budget_gb)
    c = min(cost.group_overhead_ms(d) for d in cost.degrees)
    return max((sum(work) + slots * c) / n, max(alone)) + cost.grad_sync_ms()


def test_lower_bound_is_tighter_than_divided_work_and_still_below_the_optimum():
    # one long sequence must take a wide (less efficient) group to finish in time: the bound
    # charges it that group's GPU-time, not its cheapest degree's
    from conftest import free_cost

    cost = free_cost("1b", 4)
    rng = np.random.default_rng(1)
    checked = tighter = 0
    for _ in range(40):
        s = np.sort(rng.integers(200, 6000, size=int(rng.integers(1, 6))))
        s[-1] = int(rng.integers(6000, 40000))
        opt = _brute_force_single_step(s, cost)
        if not np.isfinite(opt):
            continue
        lb, classic = lower_bound_ms(s, cost), _classic_bound(s, cost)
        assert classic * (1 - 1e-12) <= lb <= opt * (1 + 1e-9), (s.tolist(), classic, lb, opt)
        checked += 1
        tighter += lb > classic * (1 + 1e-6)
    assert checked >= 30 and tighter >= 1


def test_lower_bound_of_one_sequence_by_hand(free_7b_64):
    s = 131072  # needs degree 32 on 64 A100s; alone it is the bound
    t = free_7b_64.time([s], 32)[0] + free_7b_64.group_overhead_ms(32)
    assert lower_bound_ms([s], free_7b_64) == pytest.approx(t + free_7b_64.grad_sync_ms())


def test_static_plan_by_hand(small_cost):
    # static:2 on 8 GPUs = 4 replicas; four equal sequences: one per replica, one micro-step
    s = np.array([2000, 2000, 2000, 2000])
    p = run_planner("static:2", s, small_cost)
    validate(p, s, small_cost.cluster, small_cost)
    assert len(p.micro_steps) == 1 and all(g.degree == 2 and len(g.sequences) == 1 for g in p.micro_steps[0].groups)
    expect = small_cost.group_overhead_ms(2) + small_cost.time([2000], 2)[0] + small_cost.grad_sync_ms()
    assert p.makespan_ms == pytest.approx(expect)


@pytest.mark.parametrize("planner", ["static:4", "static-max", "best-static", "min-degree", "greedy"])
def test_baselines_validate_and_respect_the_bound(planner, a100_7b_64):
    rng = np.random.default_rng(7)
    for k in range(4):
        s = np.minimum(np.exp(rng.normal(6.5, 1.6, 300)).astype(np.int64) + 1, 131072)
        if planner == "static:4":
            s = np.minimum(s, 20000)
        p = run_planner(planner, s, a100_7b_64, max_len=131072, seed=k)
        validate(p, s, a100_7b_64.cluster, a100_7b_64)
        assert p.lower_bound_ms <= p.makespan_ms


def test_best_static_is_the_best_static_degree(a100_7b_64):
    rng = np.random.default_rng(3)
    s = np.minimum(np.exp(rng.normal(7, 1.5, 200)).astype(np.int64) + 1, 40000)
    best = run_planner("best-static", s, a100_7b_64)
    each = [run_planner(f"static:{d}", s, a100_7b_64).makespan_ms for d in (8, 16, 32)]
    assert best.makespan_ms == pytest.approx(min(each))


def test_static_too_small_is_a_clear_error(small_cost):
    with pytest.raises(ValueError, match=r"static:1: sequence 1 \(9,000 tokens\) .* it needs degree 4"):
        run_planner("static:1", [100, 9000], small_cost)


def test_unknown_planner_lists_known_ones(small_cost):
    with pytest.raises(ValueError, match="known planners: static:D, static-max"):
        run_planner("magic", [100], small_cost)
    with pytest.raises(ValueError, match="positive integers; sequence 1"):
        run_planner("greedy", [100, 0], small_cost)


def test_planning_leaves_torch_and_ipywidgets_out():
    code = ("import sys, workbench.solve, workbench.simulate, workbench.cost, workbench.specs, workbench.data;"
            "import workbench.solve; workbench.solve.planner_names();"
            "bad = [m for m in ('torch', 'ipywidgets', 'IPython') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_progress_and_cancel(a100_7b_64):
    import threading

    from workbench.solve import Cancelled

    seen = []
    run_planner("greedy", [1000, 2000, 50000], a100_7b_64, progress=lambda f, m: seen.append(f))
    assert seen[0] == 0.0 and seen[-1] == 1.0
    ev = threading.Event()
    ev.set()
    with pytest.raises(Cancelled):
        run_planner("best-static", [1000, 2000, 50000], a100_7b_64, cancel=ev)


def _brute_force_any_micro_steps(s, cost):
    """Optimum over every plan on 2 GPUs with degrees {1, 2}, any number of groups per GPU:
    every set partition of the sequences into groups, every placement of each group (rank 0,
    rank 1, or both). Groups of degree 2 first, then each rank's own: no rank waits, so the
    compute time is the busiest rank's load."""
    assert cost.cluster.num_gpus == 2 and tuple(cost.degrees) == (1, 2)
    k = len(s)
    t = {d: cost.time(s, d) for d in (1, 2)}
    mem = {d: cost.memory(s, d) for d in (1, 2)}
    c = {d: cost.group_overhead_ms(d) for d in (1, 2)}
    best = np.inf

    for part in set_partitions(list(range(k))):
        for place in itertools.product((0, 1, 2), repeat=len(part)):  # rank 0, rank 1, both
            load = [0.0, 0.0]
            ok = True
            for grp, where in zip(part, place):
                d = 2 if where == 2 else 1
                if sum(mem[d][i] for i in grp) > cost.memory_budget_gb:
                    ok = False
                    break
                g_time = c[d] + sum(t[d][i] for i in grp)
                for r in ((0, 1) if where == 2 else (where,)):
                    load[r] += g_time
            if ok:
                best = min(best, max(load))
    return best + cost.grad_sync_ms()


def test_lower_bound_counts_whole_groups_per_gpu_against_brute_force():
    # small memory and a large per-group overhead (1B): GPUs must run several groups, and how many
    # is a whole number; the bound may not exceed the optimum over every multi-group plan, and it
    # must be tighter than the classic one somewhere
    from workbench.cost import CostModel
    from workbench.models import get_model
    from workbench.specs import ClusterSpec, load_profile

    cost = CostModel(load_profile("a100-40g-flexsp"), get_model("1b"),
                     ClusterSpec(num_gpus=2, gpus_per_node=2, gpu_memory_gb=25.75, degrees=(1, 2)))
    # (1B on this profile: the formula's activations and the whole logits' backward, 3.3 MB a token;
    # 1.2 K tokens per GPU, as at 24 GB before the backward was charged)
    rng = np.random.default_rng(3)
    tighter = 0
    for _ in range(12):
        s = rng.integers(300, 2400, size=int(rng.integers(3, 7)))
        opt = _brute_force_any_micro_steps(s, cost)
        lb, classic = lower_bound_ms(s, cost), _classic_bound(s, cost)
        assert classic * (1 - 1e-12) <= lb <= opt * (1 + 1e-9), (s.tolist(), classic, lb, opt)
        tighter += lb > classic * (1 + 1e-6)
    assert tighter >= 1


def test_group_split_round_trips_and_old_plans_read_as_ulysses():
    from workbench.solve import plan_from_dict

    g = Group(degree=4, cp=2, ranks=(0, 1, 2, 3), sequences=(0,), lengths=(100,), time_ms=1.0, memory_gb=0.1)
    assert (g.ulysses, g.cp, g.split) == (2, 2, "2x2")
    plan = Plan(planner="x", status="heuristic", makespan_ms=1.0, lower_bound_ms=1.0, solve_seconds=0.0,
                micro_steps=(MicroStep(groups=(g,)),), num_gpus=4)
    d = plan.to_dict()
    assert d["micro_steps"][0]["groups"][0]["ulysses"] == 2 and d["micro_steps"][0]["groups"][0]["cp"] == 2
    assert plan_from_dict(d) == plan
    # a plan file written before splits existed: no ulysses/cp -> Ulysses over the whole group
    for key in ("ulysses", "cp"):
        del d["micro_steps"][0]["groups"][0][key]
    old = plan_from_dict(d).micro_steps[0].groups[0]
    assert (old.ulysses, old.cp) == (4, 1)
    d["micro_steps"][0]["groups"][0].update(ulysses=4, cp=2)
    with pytest.raises(PlanError, match="ulysses x cp must be the degree"):
        plan_from_dict(d)
    with pytest.raises(PlanError, match="does not divide its degree 4"):
        Group(degree=4, cp=3, ranks=(0, 1, 2, 3), sequences=(0,), lengths=(1,), time_ms=1.0, memory_gb=0.1)
