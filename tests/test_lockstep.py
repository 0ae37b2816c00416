"""Lockstep execution (ZeRO-3): pass times by hand, validation, the lower bound and the flexsp
planner against an exhaustive search over every lockstep plan of small instances."""

from __future__ import annotations


import numpy as np
import pytest

from workbench.cost import CostModel
from workbench.models import get_model
from workbench.solve import PlanError, build_plan, lower_bound_ms, run_planner, timeline, validate
from workbench.solve.microstep import Table
from workbench.solve.lockstep import Passes, plan_lockstep
from workbench.solve.options import PlanOptions
from workbench.solve.plan import pass_loads
from workbench.specs import ClusterSpec, load_profile
from workbench.solve.effort import Effort
from conftest import exhaustive_lockstep_pair_ms

PROFILE = load_profile("a100-40g-flexsp")


def _cost(n, mem, model="1b", degrees=()):
    return CostModel(PROFILE, get_model(model), ClusterSpec(num_gpus=n, gpus_per_node=n, gpu_memory_gb=mem,
                                                            degrees=degrees))


def _instances(count, seed):
    """Small random instances whose memory needs one to three passes (1B on 2 or 4 GPUs with a
    few GB of activation budget)."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < count:
        n, mem = [(2, 34.0), (2, 36.0), (4, 24.0), (4, 26.0)][int(rng.integers(4))]
        cost = _cost(n, mem)
        k = int(rng.integers(2, 5 if n == 2 else 4))
        tpg = cost.tokens_per_gpu()
        s = np.maximum(64, (rng.uniform(0.1, 1.6, size=k) * tpg).astype(np.int64))
        if (cost.min_degree(s) == 0).any():
            continue
        out.append((s, cost))
    return out


def test_pass_times_by_hand():
    cost = _cost(4, 24.0)
    C, comm, ovh = cost.call_overhead_ms(), cost.pass_comm_ms(), cost.pass_overhead_ms()
    assert C > 0 and comm > 0 and ovh > 0
    s = np.array([3000, 800, 700, 600])
    t1, t2 = cost.time(s, 1), cost.time(s, 2)
    g2 = cost.group_overhead_ms(2) + t2[0]  # sequence 0 on ranks 0-1
    g1a = cost.group_overhead_ms(1) + t1[1]  # sequence 1 alone on rank 0 (stacked on the degree-2 group)
    g1b = cost.group_overhead_ms(1) + t1[2] + t1[3]  # sequences 2, 3 on rank 2
    plan = build_plan("hand", [[(2, [0]), (1, [1]), (1, [2, 3])]], s, cost, blocks=[[0, 0, 2]])
    validate(plan, s, cost.cluster, cost)
    load = pass_loads(plan)[0]
    # rank 0 serves two groups and pays the packed call's constant once; rank 3 idles
    assert load[0] == pytest.approx(g2 + g1a - C)
    assert load[1] == pytest.approx(g2) and load[2] == pytest.approx(g1b) and load[3] == 0.0
    expect = max(load.max(), comm) + ovh
    assert plan.micro_steps[0].time_ms == pytest.approx(expect)
    assert plan.makespan_ms == pytest.approx(expect)  # ZeRO-3: no gradient sync after the last pass
    tl = timeline(plan)
    assert tl["execution"] == "lockstep" and tl["makespan_ms"] == pytest.approx(expect)
    assert tl["rank_busy_ms"] == pytest.approx(load.tolist())
    assert [p["compute_ms"] for p in tl["passes"]] == pytest.approx([load.max()])
    # two passes (blocks fixed: as given) add up; the second starts when the first ends on every rank
    two = build_plan("hand", [[(2, [0])], [(1, [1, 2, 3])]], s, cost, blocks=[[0], [0]])
    p0 = max(g2, comm) + ovh
    p1 = max(cost.group_overhead_ms(1) + t1[1:].sum(), comm) + ovh
    assert two.makespan_ms == pytest.approx(p0 + p1)
    assert timeline(two)["passes"][1]["start_ms"] == pytest.approx(p0)
    # without fixed blocks the two groups fit one pass side by side (3 of 4 ranks): arranged so
    one = build_plan("hand", [[(2, [0])], [(1, [1, 2, 3])]], s, cost)
    assert len(one.micro_steps) == 1
    assert one.makespan_ms == pytest.approx(max(g2, cost.group_overhead_ms(1) + t1[1:].sum(), comm) + ovh)


def test_validate_refuses_what_a_lockstep_run_cannot_do():
    cost = _cost(4, 24.0)
    s = np.array([3000, 2000, 400])
    B = cost.memory_budget_gb
    # each group fits alone, but rank 0 would hold both in one pass
    assert cost.memory([3000], 2)[0] < B and cost.memory([2000, 400], 1).sum() < B
    assert B < cost.memory([3000], 2)[0] + cost.memory([2000], 1)[0]
    over = build_plan("hand", [[(2, [0]), (1, [1, 2])]], s, cost, blocks=[[0, 0]])
    with pytest.raises(PlanError, match="rank 0 holds .* over its groups"):
        validate(over, s, cost.cluster, cost)
    ok = build_plan("hand", [[(2, [0]), (1, [1]), (1, [2])]], s, cost, blocks=[[0, 2, 3]])
    validate(ok, s, cost.cluster, cost)
    # a free plan for a ZeRO-3 cluster, and a lockstep plan for a ZeRO-2 one
    free = CostModel(PROFILE, get_model("1b"), ClusterSpec(num_gpus=4, gpus_per_node=4, gpu_memory_gb=80, zero_stage=2))
    fp = build_plan("hand", [[(2, [0]), (1, [1]), (1, [2])]], s, free)
    with pytest.raises(PlanError, match="the plan is free but ZeRO-3 runs lockstep"):
        validate(fp, s, cost.cluster, cost)
    with pytest.raises(PlanError, match="the plan is lockstep but ZeRO-2 runs free"):
        validate(ok, s, free.cluster, free)


def test_lower_bound_and_planner_against_every_lockstep_plan():
    checked = multi_gain = 0
    single_at_opt = 0
    for s, cost in _instances(10, seed=3):
        single, multi = exhaustive_lockstep_pair_ms(s, cost)
        assert multi <= single * (1 + 1e-12)
        lb = lower_bound_ms(s, cost)
        assert lb <= multi * (1 + 1e-9), (s.tolist(), lb, multi)
        for use_multi, opt in ((False, single), (True, multi)):
            p = plan_lockstep(s, cost, PlanOptions(effort=0.5), multi=use_multi)
            validate(p, s, cost.cluster, cost)
            assert p.makespan_ms >= opt * (1 - 1e-9), "a plan faster than every plan"
            assert p.makespan_ms <= opt * 1.10, (s.tolist(), use_multi, p.makespan_ms, opt)
            single_at_opt += (not use_multi) and p.makespan_ms <= opt * (1 + 1e-9)
        multi_gain += multi < single * (1 - 1e-9)
        checked += 1
    assert checked == 10
    assert single_at_opt >= 8  # the single-group planner finds the optimum on most small instances


@pytest.mark.long
def test_passes_bookkeeping_after_local_search():
    rng = np.random.default_rng(5)
    cost = _cost(8, 30.0)
    for _ in range(2):  # two long-tailed batches (2 and 5 passes), each planned with and without stacked groups
        s = np.maximum(64, (rng.pareto(1.2, size=60) * 800).astype(np.int64))
        s = np.minimum(s, int(cost.tokens_per_gpu() * 8 * 0.9))
        tab = Table(s, cost)
        for multi in (False, True):
            p = plan_lockstep(s, cost, PlanOptions(effort=0.4), multi=multi)
            validate(p, s, cost.cluster, cost)
            e_of = {int(d): e for e, d in enumerate(tab.deg)}
            ps = Passes.from_passes(tab, cost, [[(e_of[g.degree], g.ranks[0] // g.degree, list(g.sequences))
                                                 for g in ms.groups] for ms in p.micro_steps], multi=multi)
            ps.check()
            assert ps.step_ms() + p.grad_sync_ms == pytest.approx(p.makespan_ms)
            before = ps.step_ms()
            ps.improve(0.3, Effort(10))
            ps.check()
            assert ps.step_ms() <= before * (1 + 1e-12)


@pytest.mark.long
@pytest.mark.parametrize("family", ["wikipedia", "github"])
def test_flexsp_lockstep_beats_the_lockstep_baselines(family):
    from workbench.scenario import Scenario

    sc = Scenario(num_gpus=64, source=family, samples=50_000, batch_tokens=400_000)
    cost = sc.cost()
    assert cost.execution == "lockstep"
    for b in sc.batches(2):
        s = np.asarray(b.lengths)
        p = run_planner("flexsp", s, cost, effort=1.0)
        validate(p, s, cost.cluster, cost)
        assert p.execution == "lockstep" and p.zero_stage == 3 and p.grad_sync_ms == 0.0
        for other in ("static-max", "best-static", "min-degree", "greedy"):
            q = run_planner(other, s, cost)
            validate(q, s, cost.cluster, cost)
            assert q.execution == "lockstep"
            assert p.makespan_ms <= q.makespan_ms * (1 + 1e-9), (other, p.makespan_ms, q.makespan_ms)


def test_packing_bound_holds_for_every_lockstep_plan():
    from workbench.solve.bound import lockstep_packing_bound_ms, step_bound_ms

    tighter = 0
    for s, cost in _instances(8, seed=7):
        single, multi = exhaustive_lockstep_pair_ms(s, cost)
        pb_single = lockstep_packing_bound_ms(s, cost, multi=False)
        pb_multi = lockstep_packing_bound_ms(s, cost, multi=True)
        assert pb_multi <= multi * (1 + 1e-9), (s.tolist(), pb_multi, multi)
        assert pb_single <= single * (1 + 1e-9), (s.tolist(), pb_single, single)
        # restricted by a plan's step it stays a bound
        p = plan_lockstep(s, cost, PlanOptions(effort=0.3))
        assert lockstep_packing_bound_ms(s, cost, p.makespan_ms, multi=True) <= multi * (1 + 1e-9)
        sb = step_bound_ms(s, cost, [p])
        assert lower_bound_ms(s, cost) <= sb * (1 + 1e-12) and sb <= multi * (1 + 1e-9)
        tighter += pb_single > lower_bound_ms(s, cost) * (1 + 1e-6)
    assert tighter >= 1


def _slower_splits_that_fit(p, s, cost) -> list[str]:
    """Groups of a lockstep plan for which another split of their degree (a shape of the cost model)
    runs their sequences faster and fits their ranks' memory in that pass, recomputed from the cost
    model alone (``cost.time``, ``cost.memory``, ``cost.group_overhead_ms``)."""
    budget = cost.memory_budget_gb
    found = []
    for k, ms in enumerate(p.micro_steps):
        mem = np.zeros(cost.cluster.num_gpus)
        for g in ms.groups:
            mem[list(g.ranks)] += float(cost.memory(s[list(g.sequences)], g.degree, g.cp).sum())
        for g in ms.groups:
            seqs = s[list(g.sequences)]
            own = float(cost.time(seqs, g.degree, g.cp).sum()) + cost.group_overhead_ms(g.degree, g.cp)
            held = float(cost.memory(seqs, g.degree, g.cp).sum())
            for d, c in cost.shapes:
                if d != g.degree or c == g.cp:
                    continue
                m = cost.memory(seqs, d, c)
                if (m > budget).any() or mem[list(g.ranks)].max() - held + float(m.sum()) > budget * (1 + 1e-9):
                    continue
                t = float(cost.time(seqs, d, c).sum()) + cost.group_overhead_ms(d, c)
                if t < own * (1 - 1e-9):
                    found.append(f"pass {k}: {g.split} on ranks {g.ranks[0]}-{g.ranks[-1]} takes {own:.3f} ms, "
                                 f"{d // c}x{c} {t:.3f}")
    return found


@pytest.mark.long
def test_auto_groups_run_their_fastest_split_that_fits(monkeypatch):
    """Under ``--strategy auto`` every group of a lockstep plan runs the fastest split of its degree
    that holds its sequences in its ranks' memory, off the step's critical path too (the local search
    moves sequences and left groups on the split they opened with), whichever planner's plan wins.
    Over Llama-3-8B steps on 16 and 32 H100s; on those where the re-split moved a group, the same
    search without it leaves groups on slower splits (the check sees them)."""
    from workbench.scenario import Scenario

    moved = 0
    for fam, gpus, tokens, k in (("wikipedia", 32, 500_000, 0), ("wikipedia", 32, 800_000, 0),
                                 ("commoncrawl", 32, 500_000, 0), ("commoncrawl", 32, 500_000, 1),
                                 ("commoncrawl", 16, 300_000, 1)):
        # at FlexSP's 0.7 memory fraction (the profile's 0.9 leaves these batches no memory pressure, so no
        # split is ever left behind to move) and without offload (these plans were written for neither)
        sc = Scenario(model="llama3-8b-1m", profile="h100-80g", gpu_memory_gb=80, num_gpus=gpus, zero_stage=3,
                      recompute=True, strategy="auto", source=fam, samples=20_000, seed=1, max_len=262_144,
                      policy="clip", batch_tokens=tokens, memory_fraction=0.7, offload="none")
        cost = sc.cost()
        s = np.asarray(list(sc.batches(k + 1))[k].lengths, dtype=np.int64)
        p = run_planner("flexsp", s, cost, effort=0.3, seed=0)
        validate(p, s, cost.cluster, cost)
        assert _slower_splits_that_fit(p, s, cost) == [], (fam, gpus, tokens, k, p.stats["source"])
        if p.stats.get("groups_resplit", 0) >= 1:
            moved += 1
            with monkeypatch.context() as m:
                m.setattr(Passes, "resplit", lambda self: 0)
                q = run_planner("flexsp", s, cost, effort=0.3, seed=0)
            assert _slower_splits_that_fit(q, s, cost), (fam, gpus, tokens, k)
            assert p.makespan_ms <= q.makespan_ms * (1 + 1e-12)
    assert moved >= 1


def test_resplit_moves_a_group_to_its_fastest_split_and_keeps_the_books():
    """``Passes.resplit`` on a hand-built pass: one group of eight long sequences on the slowest split
    of degree 8 goes to the fastest that fits (found here by trying every split), the loads and
    activations stay consistent (``check``) and the pass gets no longer."""
    from workbench.scenario import Scenario

    cost = Scenario(model="llama3-8b-1m", profile="h100-80g", gpu_memory_gb=80, num_gpus=8, zero_stage=3,
                    recompute=True, strategy="auto").cost()
    s = np.array([40_000, 30_000, 20_000, 9_000, 5_000, 4_000, 3_000, 1_000], dtype=np.int64)
    tab = Table(s, cost)
    rows = [e for e in range(len(tab.deg)) if tab.deg[e] == 8 and tab.ok[e].all()]
    assert len(rows) >= 2
    times = {e: cost.group_overhead_ms(8, int(tab.cp[e])) + float(cost.time(s, 8, int(tab.cp[e])).sum()) for e in rows}
    fits = [e for e in rows if float(cost.memory(s, 8, int(tab.cp[e])).sum()) <= cost.memory_budget_gb]
    slowest, fastest = max(rows, key=times.get), min(fits, key=times.get)
    ps = Passes.from_passes(tab, cost, [[(slowest, 0, list(range(s.size)))]], multi=False)
    before = ps.step_ms()
    assert slowest != fastest
    assert ps.resplit() == 1
    ps.check()
    assert ps.g_e[0] == fastest
    assert ps.pass_len(0) == pytest.approx(times[fastest])  # a rank's load: the group's overhead and its sequences
    assert ps.step_ms() < before
    assert ps.resplit() == 0


def _priced_fill_case():
    """A 7B step on 16 A100-40G (ZeRO-3, every split allowed) whose fastest splits hold too many
    activations for the fewest passes: a fill that takes them runs out of memory."""
    from workbench.scenario import Scenario
    from workbench.solve.microstep import min_micro_steps

    sc = Scenario(model="7b", profile="a100-40g-flexsp", num_gpus=16, zero_stage=3, source="commoncrawl",
                  samples=20_000, batch_tokens=250_000, seed=0)
    cost = sc.cost()
    s = np.asarray(list(sc.batches(2))[1].lengths, dtype=np.int64)
    tab = Table(s, cost)
    return s, cost, tab, min_micro_steps(tab)


def test_a_fill_that_prices_wasted_activations_holds_the_step_in_the_fewest_passes():
    """``fill_passes`` at the fewest passes the activations allow: taking each place's fastest split
    it finds no room for some sequence (context-parallel splits hold up to 1.9x the activations);
    with the activations beyond each sequence's least share priced it holds the whole step. The
    plan it gives is checked by ``validate`` and each rank's activations per pass recomputed from
    ``cost.memory`` against the budget."""
    from workbench.solve.lockstep import fill_passes

    s, cost, tab, M = _priced_fill_case()
    assert fill_passes(tab, cost, M, [0.0] * M, Effort(1e9), multi=True) is None
    level = 1000.0
    ps = fill_passes(tab, cost, M, [0.0] * M, Effort(1e9), multi=True, mem_price=3.0 * level / tab.budget)
    assert ps is not None and len(ps.passes()) == M
    ps.check()
    micro, blocks = ps.assignment()
    plan = build_plan("fill", micro, s, cost, blocks=blocks)
    validate(plan, s, cost.cluster, cost)
    assert sorted(i for ms in plan.micro_steps for g in ms.groups for i in g.sequences) == list(range(s.size))
    for ms in plan.micro_steps:
        act = np.zeros(cost.cluster.num_gpus)
        for g in ms.groups:
            act[list(g.ranks)] += float(cost.memory(s[list(g.sequences)], g.degree, g.cp).sum())
        assert act.max() <= cost.memory_budget_gb * (1 + 1e-9)


def test_the_fill_price_trades_a_faster_split_for_fewer_activations_by_hand():
    """One 145K-token sequence in one pass on 64 A100-40G (7B) whose floor leaves room: unpriced, it
    opens the group whose GPU-time (its degree times the packed call's constant, the group's extra
    and its time) is least, a context-parallel split; priced high, a group that holds no more
    activations than its least share (over every shape that fits)."""
    from workbench.solve.lockstep import fill_passes

    from workbench.scenario import Scenario

    cost = Scenario(model="7b", profile="a100-40g-flexsp", num_gpus=64, zero_stage=3).cost()
    s = np.array([145_000], dtype=np.int64)
    tab = Table(s, cost)
    ps0 = Passes(tab, cost, multi=True)
    rows = [e for e in range(len(tab.deg)) if tab.ok[e, 0]]
    gpu_time = {e: tab.deg[e] * (ps0.C + ps0.extra[e] + tab.t[e, 0]) for e in rows}
    held = {e: tab.deg[e] * tab.mem[e, 0] for e in rows}
    fastest, leanest = min(rows, key=gpu_time.get), min(held.values())
    assert held[fastest] > leanest * 1.1  # the fastest split gathers K/V: a real trade
    for price, want in ((0.0, lambda e: e == fastest), (1e6, lambda e: held[e] <= leanest * (1 + 1e-9))):
        ps = fill_passes(tab, cost, 1, [1e9], Effort(1e9), multi=True, mem_price=price)
        (g,) = ps.groups()
        assert want(ps.g_e[g]), (price, tab.shape(ps.g_e[g]))


def test_a_fill_stops_when_the_activations_left_cannot_hold_the_sequences_left():
    """A fill of fewer passes than the activations need (their least shares over every rank's budget,
    counted here by hand) stops before it places a sequence, charging no effort for one; the fewest
    passes that can hold them place every sequence."""
    from workbench.solve.lockstep import fill_passes

    s, cost, tab, M = _priced_fill_case()
    n, B = cost.cluster.num_gpus, tab.budget
    least = float(sum(min(tab.deg[e] * tab.mem[e, i] for e in range(len(tab.deg)) if tab.ok[e, i])
                      for i in range(s.size)))
    assert (M - 1) * n * B < least <= M * n * B
    clock = Effort(1e9)
    assert fill_passes(tab, cost, M - 1, [0.0] * (M - 1), clock, multi=True) is None
    assert clock.spent == 0.0
    ps = fill_passes(tab, cost, M, [0.0] * M, Effort(1e9), multi=True, mem_price=3000.0 / B)
    assert ps is not None and sorted(i for g in ps.groups() for i in ps.g_members[g]) == list(range(s.size))


def test_a_step_that_fits_one_pass_fills_each_floor_once():
    """A fill is a function of its floors and price: filled twice with the same ones it gives the
    same passes (checked here). So the planner never fills a pass count twice with the same floors
    (a one-pass step's floors are all zero: three identical fills before, whose effort the search
    after them lost)."""
    from workbench.solve.lockstep import fill_passes

    cost = _cost(8, 40.0)
    rng = np.random.default_rng(3)
    s = np.sort(rng.integers(128, 3000, size=24))[::-1].copy()  # ~36K tokens: 8 GPUs hold 55K
    p = plan_lockstep(s, cost, PlanOptions(seed=0, effort=2.0))
    assert p.stats["min_passes"] == 1
    fills = [t for t in p.stats["tried"] if t["rule"].startswith("fill")]
    assert len(fills) >= 2  # the zero floors, and the best fill's own length
    keys = [(t["passes"], tuple(t["floors"]), t["price"]) for t in fills]
    assert len(set(keys)) == len(keys), keys
    tab = Table(s, cost)
    a = fill_passes(tab, cost, 1, [0.0], Effort(1e9), multi=True)
    b = fill_passes(tab, cost, 1, [0.0], Effort(1e9), multi=True)
    assert a is not None and b is not None and a.assignment() == b.assignment()


@pytest.mark.long
def test_the_search_also_takes_the_other_kind_of_start_where_the_effort_allows(monkeypatch):
    """A start's length says little of where its search ends: where the effort leaves every start at
    least IMPROVE_OTHER_MIN, the local search also starts from the best filled start at the count the
    best split leads with (second). At effort 1 it does not (the starts of each count, as before); at
    effort 4 on this memory-bound step (six passes' worth on 4 GPUs) the fill's search ends shorter
    than every other's, and shorter than the plan without the rule."""
    import workbench.solve.lockstep as LS

    cost = _cost(4, 40.0)
    rng = np.random.default_rng(0)
    s = np.sort(rng.integers(128, 8000, size=32))[::-1].copy()
    quick = plan_lockstep(s, cost, PlanOptions(seed=0, effort=1.0))
    assert not any(c.startswith("fill") for c in quick.stats["searched"])
    p = plan_lockstep(s, cost, PlanOptions(seed=0, effort=4.0))
    lead, other = p.stats["searched"][:2]
    count = int(lead.rsplit(":", 1)[1])
    fills = [t for t in p.stats["tried"] if t["rule"].startswith("fill") and t["passes"] == count]
    best_fill = min(fills, key=lambda t: t["ms"])
    assert not lead.startswith("fill") and other == f"fill:{count}:{best_fill['rule'].split(':')[1]}", p.stats["searched"]
    validate(p, s, cost.cluster, cost)
    monkeypatch.setattr(LS, "IMPROVE_OTHER_MIN", float("inf"))
    without = plan_lockstep(s, cost, PlanOptions(seed=0, effort=4.0))
    assert not any(c.startswith("fill") for c in without.stats["searched"])
    assert p.stats["source"].startswith(other) and p.makespan_ms < without.makespan_ms * (1 - 1e-4), (
        p.makespan_ms, without.makespan_ms)
