"""The FlexSP planner against an independent exhaustive search, the baselines and the lower bound.

The brute force below uses only the cost model (time, memory, group_overhead_ms, degrees): a
dynamic programme over subsets of sequences x GPUs left, each step taking the group that holds the
lowest remaining sequence (any degree, any subset of the others that fits its memory).
"""

from __future__ import annotations

import json
import math
import threading

import numpy as np
import pytest

from workbench.cost import CostModel, InfeasibleError
from workbench.solve import Cancelled, PlanOptions, planner_names, run_planner, validate
from workbench.solve.baselines import plan_best_static, plan_greedy
from workbench.solve.flexsp import plan_flexsp
from workbench.solve.microstep import Table, bucketize, min_micro_steps, solve_one_step
from conftest import free_cost
from workbench.specs import load_profile

PROFILE = load_profile("a100-40g-flexsp")


# ------------------------------------------------------------------------------------------------
# the independent exhaustive search
# ------------------------------------------------------------------------------------------------


def brute_force_one_step(lengths, cost: CostModel) -> float:
    """Least makespan (slowest group's time, no gradient sync) of one micro-step, or inf."""
    s = np.asarray(lengths, dtype=np.int64)
    n = s.size
    N = cost.cluster.num_gpus
    degrees = [d for d in cost.degrees if d <= N]
    budget = cost.memory_budget_gb
    full = (1 << n) - 1
    # time and memory of every subset on every degree
    t = {d: cost.time(s, d) for d in degrees}
    m = {d: cost.memory(s, d) for d in degrees}
    sub_t = {d: np.zeros(1 << n) for d in degrees}
    sub_m = {d: np.zeros(1 << n) for d in degrees}
    for mask in range(1, 1 << n):
        low = (mask & -mask).bit_length() - 1
        rest = mask & (mask - 1)
        for d in degrees:
            sub_t[d][mask] = sub_t[d][rest] + t[d][low]
            sub_m[d][mask] = sub_m[d][rest] + m[d][low]
    over = {d: cost.group_overhead_ms(d) for d in degrees}
    group = {}  # mask -> list of (degree, time) that hold it

    def options(mask):
        if mask not in group:
            group[mask] = [(d, over[d] + sub_t[d][mask]) for d in degrees if sub_m[d][mask] <= budget]
        return group[mask]

    memo: dict[int, np.ndarray] = {0: np.zeros(N + 1)}  # mask -> best makespan with g GPUs left

    def best(mask):
        if mask in memo:
            return memo[mask]
        out = np.full(N + 1, math.inf)
        low = mask & -mask
        rest = mask ^ low
        sub = rest
        while True:
            grp = sub | low
            for d, tt in options(grp):
                other = memo.get(mask ^ grp)
                if other is None:
                    other = best(mask ^ grp)
                # with fewer than d GPUs left the group does not run: only out[d:] can improve
                np.minimum(out[d:], np.maximum(tt, other[: N + 1 - d]), out=out[d:])
            if sub == 0:
                break
            sub = (sub - 1) & rest
        memo[mask] = out
        return out

    return float(best(full)[N])


_COSTS: dict = {}


def _config_cost(name, N, mem):
    """``free_cost`` of one of the ten configurations, built once and shared by its instances (a cost
    model's figures are a function of its settings; the planners never change it)."""
    if (name, N, mem) not in _COSTS:
        _COSTS[name, N, mem] = free_cost(name, N, mem=mem, per_node=8)
    return _COSTS[name, N, mem]


def _random_instance(rng):
    """A small random cluster (1-8 GPUs, tight or loose memory) and up to 10 mixed lengths."""
    configs = [("1b", 1, 40), ("1b", 2, 40), ("1b", 4, 40), ("1b", 8, 40), ("1b", 2, 24), ("1b", 4, 80),
               ("7b", 8, 40), ("7b", 4, 80), ("7b", 8, 80), ("1b", 8, 24)]
    name, N, mem = configs[rng.integers(len(configs))]
    cost = _config_cost(name, N, mem)
    tpg = cost.tokens_per_gpu()
    k = int(rng.integers(1, 11))
    hi = max(cost.degrees) * tpg
    f = np.exp(rng.uniform(np.log(0.01), np.log(min(3.0, hi / tpg)), size=k))
    s = np.maximum(1, (f * tpg).astype(np.int64))
    s = np.minimum(s, int(hi))
    return s, cost


def _instances(count, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < count:
        s, cost = _random_instance(rng)
        out.append((s, cost))
    return out


def test_brute_force_sanity(small_cost):
    # one sequence: its best single-group time; two GPUs idle or not
    s = np.array([4096])
    bf = brute_force_one_step(s, small_cost)
    best = min(small_cost.group_overhead_ms(d) + small_cost.time(s, d)[0] for d in small_cost.degrees)
    assert bf == pytest.approx(best)


CASES = _instances(200, seed=7)
_OPT: dict[int, float] = {}


def _case_optimum(k: int) -> float:
    """``brute_force_one_step`` of ``CASES[k]``, computed once: three tests compare against the same
    instances."""
    if k not in _OPT:
        _OPT[k] = brute_force_one_step(*CASES[k])
    return _OPT[k]


@pytest.mark.long
def test_exact_model_matches_brute_force_on_200_instances():
    """Without bucketing the one-micro-step solver's makespan is the exhaustive optimum (1e-6)."""
    fits = 0
    for k, (s, cost) in enumerate(CASES):
        opt = _case_optimum(k)
        r = solve_one_step(s, cost, bucketing=False, effort=20.0, seed=k)
        if not math.isfinite(opt):
            assert r is None, f"case {k}: the solver found a one-micro-step plan the exhaustive search did not"
            continue
        fits += 1
        assert r is not None, f"case {k}: {s.tolist()} fits one micro-step (optimum {opt}) but no plan came back"
        assert r.makespan_ms == pytest.approx(opt, rel=1e-6), (k, s.tolist(), cost.cluster.num_gpus)
        assert r.proved
        # groups are a valid one-micro-step plan
        assert sorted(i for _, g in r.groups for i in g) == list(range(s.size))
        assert sum(d for d, _ in r.groups) <= cost.cluster.num_gpus
        for d, g in r.groups:
            assert cost.memory(s[g], d).sum() <= cost.memory_budget_gb * (1 + 1e-6)
    assert fits >= 150  # most instances fit one micro-step, some do not (memory binds)


def test_bucketed_model_close_to_brute_force():
    """With bucketing forced on (a few buckets, so they really merge lengths) within 1%."""
    for k, (s, cost) in enumerate(CASES[:80]):
        opt = _case_optimum(k)
        if not math.isfinite(opt):
            continue
        r = solve_one_step(s, cost, bucketing=True, buckets=3, effort=5.0, seed=k)
        assert r is not None
        assert r.makespan_ms <= opt * 1.01 + 1e-9, (k, s.tolist())
        assert r.makespan_ms >= opt * (1 - 1e-9)


@pytest.mark.long
def test_plan_flexsp_never_behind_the_one_step_optimum():
    for k, (s, cost) in enumerate(CASES[:60]):
        opt = _case_optimum(k)
        p = plan_flexsp(s, cost, PlanOptions(seed=k, effort=2.0), bucketing=False)
        validate(p, s, cost.cluster, cost)
        if math.isfinite(opt):
            assert p.makespan_ms <= opt + cost.grad_sync_ms() + 1e-6 * opt
        assert p.lower_bound_ms <= p.makespan_ms * (1 + 1e-9)


# ------------------------------------------------------------------------------------------------
# real settings
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["wikipedia", "commoncrawl", "github", "byted"])
def test_families_64_gpus(free_7b_64, family):
    from workbench.data import synthetic_lengths

    cost = free_7b_64
    s = np.minimum(synthetic_lengths(family, 512, seed=3), 131072)
    opts = PlanOptions(seed=0, effort=0.5)
    p = plan_flexsp(s, cost, opts)
    validate(p, s, cost.cluster, cost)
    g = plan_greedy(s, cost, opts)
    b = plan_best_static(s, cost, opts)
    assert p.planner == "flexsp"
    assert p.lower_bound_ms <= p.makespan_ms
    assert p.makespan_ms <= g.makespan_ms * (1 + 1e-9)
    assert p.makespan_ms <= b.makespan_ms * (1 + 1e-9)
    assert p.status in ("optimal", "feasible", "fallback")
    assert p.stats["gap"] == pytest.approx(p.gap)
    json.dumps(p.to_dict())  # plain data


def test_micro_step_chunking(small_cost):
    """A batch far bigger than one micro-step: several micro-steps, valid, never behind greedy."""
    rng = np.random.default_rng(1)
    s = rng.integers(200, 6000, size=60)
    tab = Table(s, small_cost)
    assert min_micro_steps(tab) >= 3
    p = plan_flexsp(s, small_cost, PlanOptions(seed=0, effort=1.0))
    validate(p, s, small_cost.cluster, small_cost)
    assert len(p.micro_steps) >= min_micro_steps(tab)
    assert p.makespan_ms <= plan_greedy(s, small_cost, PlanOptions()).makespan_ms * (1 + 1e-9)
    assert p.stats["min_micro_steps"] == min_micro_steps(tab)


def test_one_micro_step_model_proves_its_optimum_and_status_is_honest(small_cost):
    s = np.array([300, 900, 1500, 2500, 4000, 700])
    p = plan_flexsp(s, small_cost, PlanOptions(seed=0, effort=5.0), bucketing=False)
    validate(p, s, small_cost.cluster, small_cost)
    grad = small_cost.grad_sync_ms()
    opt = brute_force_one_step(s, small_cost)
    assert p.makespan_ms <= (opt + grad) * (1 + 1e-6)
    # the exact per-micro-step model ran and proved the exhaustive search's optimum
    calls = [c for c in p.stats["cp_sat"] if c["model"] == "micro-step"]
    assert len(calls) == 1 and calls[0]["status"] == "OPTIMAL"
    assert calls[0]["objective_ms"] == pytest.approx(opt, rel=1e-6)
    assert calls[0]["hint"] == "complete, feasible"
    # that is no proof for the step (stacked groups may beat one micro-step): optimal only at the bound
    assert (p.status == "optimal") == (p.makespan_ms <= p.lower_bound_ms * (1 + 1e-9))
    for key in ("micro_steps", "min_micro_steps", "cp_sat", "cp_sat_status", "cp_sat_dtime", "wall", "effort_phases",
                "best_bound_ms", "source", "start", "gap", "greedy_ms", "best_static_ms", "groups_per_gpu"):
        assert key in p.stats
    json.dumps(p.to_dict(), allow_nan=False)


def test_registered_and_run_planner(small_cost):
    assert "flexsp" in planner_names()
    s = np.array([512, 1024, 8000, 3000])
    p = run_planner("flexsp", s, small_cost, seed=1, effort=0.5, batch_id="b0")
    assert p.batch_id == "b0" and p.planner == "flexsp"
    validate(p, s, small_cost.cluster, small_cost)


def test_infeasible_sequence_is_a_clear_error(small_cost):
    with pytest.raises(InfeasibleError, match="sequence 1"):
        run_planner("flexsp", [100, 10_000_000], small_cost)
    with pytest.raises(InfeasibleError):
        plan_flexsp(np.array([10_000_000]), small_cost, PlanOptions())


def test_cancellation(a100_7b_64):
    from workbench.data import synthetic_lengths

    s = np.minimum(synthetic_lengths("byted", 64, seed=0), 131072)  # 64 reach the local search as 256 do
    ev = threading.Event()
    ev.set()
    with pytest.raises(Cancelled):
        plan_flexsp(s, a100_7b_64, PlanOptions(effort=5.0, cancel=ev))
    # cancelled while running: a progress message after the baselines and the first starts sets it
    ev2 = threading.Event()
    seen = []

    def progress(f, msg):
        seen.append(msg)
        if "local search" in msg:
            ev2.set()

    with pytest.raises(Cancelled):
        plan_flexsp(s, a100_7b_64, PlanOptions(effort=5.0, cancel=ev2, progress=progress))
    assert seen


def test_progress_is_reported(small_cost):
    seen = []
    s = np.array([512, 1024, 8000, 3000, 5000])
    run_planner("flexsp", s, small_cost, effort=0.3, progress=lambda f, m: seen.append((f, m)))
    assert seen and all(0.0 <= f <= 1.0 for f, _ in seen)


def test_bucketize_minimises_padding():
    import itertools

    rng = np.random.default_rng(0)
    for _ in range(30):
        s = rng.integers(1, 100, size=int(rng.integers(1, 9)))
        B = int(rng.integers(1, 4))
        b = bucketize(s, B)
        assert b.max() < B
        pad = sum(int(s[b == k].max()) * int((b == k).sum()) - int(s[b == k].sum()) for k in np.unique(b))
        u = np.unique(s)
        best = math.inf
        for cuts in itertools.combinations(range(1, u.size), min(B, u.size) - 1):
            edges = [0, *cuts, u.size]
            tot = 0
            for lo, hi in zip(edges, edges[1:]):
                sel = s[(s >= u[lo]) & (s <= u[hi - 1])]
                tot += int(u[hi - 1]) * sel.size - int(sel.sum())
            best = min(best, tot)
        assert pad == best, (s.tolist(), B)
        # buckets are contiguous in length
        order = np.argsort(s, kind="stable")
        assert (np.diff(b[order]) >= 0).all()
