"""The whole-step planner under free execution (ZeRO 0-2): stacked groups, every start, CP-SAT.

A step's plan is a *stack* (``workbench.solve.stack``): every group on an aligned block of ranks,
each rank running the groups of its blocks larger degrees first, so that the step's compute time is
exactly the largest per-rank load (the barrier-free timeline of ``plan.timeline``). The problem
(DESIGN.md, "The solver, precisely"): choose the groups (shape, block, sequences) so that every
sequence runs once, each group's activations fit the memory budget, and the largest rank load
(group overheads plus sequence times over the rank's blocks) is least.

How a step is planned (``plan_free``):

1. The other planners' plans (``rivals``: greedy's three list-scheduling rules, ``best-static``,
   ``two-stage``), each exactly as that planner alone would make it with the same seed and effort,
   so the answer is never slower than any of them; their plans are stacks already. The search
   below gets what they left of the effort (at least ``MIN_SEARCH_SHARE`` of it).
2. ``Stack.greedy``: list scheduling under stack semantics (a sequence may join any group with
   room, not only the last one on its ranks), aiming at the lower bound and a little above it,
   with and without a cap on the extra GPU-time of wider degrees: each target gives another
   structure.
3. For batches of at most ``AUTO_BUCKET_ABOVE`` sequences whose memory fits one micro-step: the
   exact per-micro-step CP-SAT model (``microstep.solve_step``), one more candidate.
4. Local search (``Stack.improve``) from the best starts, on the exact per-rank loads.
5. The whole-step CP-SAT model (``stack.solve_stack``), warm-started from the best stack (on
   parts of ``CPSAT_PART_GPUS`` ranks for larger clusters), its answer mapped back to sequences
   and polished by the local search; kept when it is faster.
6. What time is left: more local search on the best.

Pure numpy + OR-Tools; no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from workbench.cost import CostModel
from workbench.solve.bound import lower_bound_ms
from workbench.solve.cpsat import warm_up
from workbench.solve.effort import Phases
from workbench.solve.microstep import AUTO_BUCKET_ABOVE, StepResult, Table, min_micro_steps, place_groups, solve_step
from workbench.solve.options import PlanOptions
from workbench.solve.plan import Plan, build_plan
from workbench.solve.rivals import MIN_SEARCH_SHARE, rival_plans
from workbench.solve.stack import Stack, solve_stack

__all__ = ["plan_free"]


STACK_GREEDY_RULES = ((1.03, 0.5, True), (1.0, None, False), (1.02, 0.2, True), (1.02, None, True),
                      (1.03, 0.1, False), (1.03, 0.05, True), (1.02, None, False), (1.0, 0.1, True))
"""``Stack.greedy`` runs (target as a multiple of the lower bound's compute time, ``max_extra_work``,
``lowest``), in the order they are tried while time allows: the first 8 of a greedy choice among 50
rules on 20 batches that are not the benchmarks' (64 GPUs; sampler seed 1 and synthetic seeds
10-11), each adding the most to the best of the ones before."""

STARTS_SHARE = 0.5
"""No ``Stack.greedy`` run starts after this share of the time limit (the first always runs)."""

LS_STARTS = 3
"""How many starts the local search improves (the best of the stack greedy and of the baselines first)."""

BASELINE_KINDS = ("greedy", "best-static", "two-stage", "micro-step")

MICRO_SHARE = 0.3
"""Share of the time left that the exact per-micro-step model gets (small batches only)."""

LS_SHARE = 0.3
"""Share of the time left that the first local search gets."""

CPSAT_SHARE = 0.6
"""Share of the time left after the first local search that the whole-step CP-SAT model gets
(with the polishing local search of its answer)."""

CPSAT_MAX_SEQS = 4096
"""The whole-step model runs on parts of at most this many sequences: above it, mapping the bucket
tokens back to sequences costs more time than the model gains (measured at 64 GPUs x 8192
sequences: CP-SAT gain -0.3% to 0% and solve time past the limit)."""

MIN_CPSAT_S = 0.15
"""The whole-step model is not built with less time than this left for it (building takes ~0.1 s)."""

POLISH_SHARE = 0.5
"""Share of the time left after a whole-step CP-SAT call for polishing its answer."""

CPSAT_PART_GPUS = 64
"""The whole-step CP-SAT model runs on parts of this many GPUs (aligned blocks no group straddles)
when the cluster is larger, the parts whose ranks end latest first."""


def _replace(p: Plan, **kw) -> Plan:
    return dataclasses.replace(p, **kw)

@dataclass
class _Cand:
    """A candidate whole-step plan: its stack, where it came from and its compute time."""

    stack: Stack
    source: str
    start: str

    @property
    def ms(self) -> float:
        return self.stack.makespan_ms

def plan_free(lengths, cost: CostModel, opts: PlanOptions | None = None, *, bucketing: bool | None = None,
                buckets: int = 16, extra_micro_steps: int = 2, cpsat: bool = True) -> Plan:
    """The ``flexsp`` plan of one step under free execution (ZeRO 0-2).

    Steps (module docstring): the baselines (greedy's rules, ``best-static``, a short ``two-stage``)
    and ``Stack.greedy`` runs give stacks (groups on aligned blocks, larger degrees first); local
    search on the exact per-rank loads improves the best of them; the whole-step CP-SAT model
    (``stack.solve_stack``) is warm-started from the best stack and its answer polished by the same
    local search; for small batches that fit one micro-step, the exact per-micro-step model is one
    more candidate. The fastest candidate wins.

    ``cpsat=False`` skips both CP-SAT models (the ablation ``bench/solver.py`` reports).
    ``bucketing`` / ``buckets``: the per-micro-step model's length buckets (None: only above
    ``AUTO_BUCKET_ABOVE`` sequences, False: never). ``extra_micro_steps`` is kept for
    compatibility and unused (stacks choose each rank's number of groups themselves).

    Returns a Plan never slower than greedy's, best-static's (hence min-degree's and static-max's)
    or the short two-stage run's for the same batch. ``status``: ``optimal`` when the plan meets the
    lower bound (nothing else proves a whole step optimal: the per-micro-step model's OPTIMAL is
    optimal among one-micro-step plans only); ``feasible`` otherwise; ``fallback`` when the
    baselines took the whole effort and the best of them is returned (``reason`` says why).
    ``stats`` (plain JSON): ``source`` (``cp-sat`` when the plan is CP-SAT's answer as mapped
    back, ``cp-sat+local-search`` when the local search then improved it; CP-SAT's answer counts
    only when CP-SAT improved on its own hint; ``local-search`` when the local search improved a
    start, ``stack-greedy`` or a baseline's name when a start won as it was), ``start`` (which
    start: ``greedy:<rule>``, ``best-static``, ``two-stage``, ``stack-greedy:<target>,<extra>,<ties>``,
    ``micro-step``), ``cp_sat`` (one entry per CP-SAT call: ``model`` (``whole-step`` or
    ``micro-step``), ``status`` (CP-SAT's own, or why it was skipped), ``objective_ms`` and
    ``bound_ms`` (compute time, model units converted to ms; None without a solution),
    ``dtime`` (CP-SAT's deterministic time), ``variables``, ``hint`` (what CP-SAT reported of the warm start),
    ``used`` (its answer is the plan returned), and for the whole-step model ``part``,
    ``hint_objective_ms``, ``improved_hint``, ``mapped_ms``, ``polished_ms``, ``singles``,
    ``buckets``, ``presolve``), ``cp_sat_status`` ({status: calls}), ``cp_sat_dtime``,
    ``best_bound_ms``, ``groups``, ``groups_per_gpu``, ``micro_steps``, ``min_micro_steps``,
    ``greedy_ms``, ``best_static_ms``, ``two_stage_ms``, ``local_search_moves``, ``gap``,
    ``effort_phases`` (reference seconds of effort per stage), and ``wall`` (measured: seconds per stage
    and in CP-SAT; the only figures the machine's speed changes). Raises InfeasibleError when a sequence fits no group,
    Cancelled when cancelled.
    """
    if cost.execution != "free":
        raise ValueError(f"plan_free plans free (ZeRO 0-2) steps; this cost model is {cost.execution}")
    cost = cost.chain_view()  # groups on aligned blocks: one divisibility chain of the degrees
    opts, clock = (opts or PlanOptions()).start()
    warm_up()
    start = clock.now()
    budget = max(0.05, float(opts.effort))
    s = np.asarray(lengths, dtype=np.int64)
    cost.check_feasible(s)
    lb = lower_bound_ms(s, cost)
    grad = cost.step_end_ms()  # the gradient sync and the optimizer step
    tab = Table(s, cost)
    phases = Phases(clock)
    cp_wall = 0.0
    opts.report(0.02, "flexsp: the other planners' plans (greedy, best static, two-stage)")
    rivals = rival_plans(s, cost, opts)
    rule_plans, greedy, static = rivals.greedy, rivals.greedy[0], rivals.best_static
    baselines = [greedy, static, *([rivals.two_stage] if rivals.two_stage is not None else [])]
    baseline = rivals.best()
    phases.lap("baselines")
    # the search's own effort: what the rivals left of the budget, and at least MIN_SEARCH_SHARE of it;
    # 15% of that stays for building and checking the final plan
    t0 = clock.now()
    limit = max(budget - (t0 - start), MIN_SEARCH_SHARE * budget)
    deadline = t0 + 0.85 * limit
    M0 = min_micro_steps(tab)
    cp_calls: list[dict] = []
    cands: list[_Cand] = []
    moves = 0
    if not clock.past(deadline):
        seen = set()
        for p in sorted([*rule_plans, *baselines[1:]], key=lambda p: p.makespan_ms):
            key = round(p.makespan_ms, 6)
            if key in seen:
                continue
            seen.add(key)
            name = p.planner if p.planner != "greedy" else f"greedy:{p.stats.get('rule', '')}"
            cands.append(_Cand(Stack.from_plan(p, tab), p.planner, name))
        # 1. list scheduling under stack semantics, for a few targets (each gives another structure)
        opts.report(0.15, "flexsp: whole-step list scheduling")
        lbc = lb - grad
        for k, (tgt, extra, lowest) in enumerate(STACK_GREEDY_RULES):
            if k and clock.past(t0 + STARTS_SHARE * limit):
                break
            opts.check_cancel()
            # the first run may take until the deadline (there is no stack without it); the others
            # give up a little after the starts' share
            cut = deadline if k == 0 else min(deadline, t0 + (STARTS_SHARE + 0.1) * limit)
            st = Stack.greedy(tab, target=lbc * tgt, clock=clock, max_extra_work=extra, deadline=cut, lowest=lowest,
                              cancel=opts.check_cancel)
            if st is None:
                break
            name = f"stack-greedy:{tgt:g},{'-' if extra is None else f'{extra:g}'},{'lowest' if lowest else 'first'}"
            cands.append(_Cand(st, "stack-greedy", name))
        phases.lap("stack_greedy")
        # 2. the exact per-micro-step model where the batch is small and fits one micro-step
        if cpsat and M0 == 1 and s.size <= AUTO_BUCKET_ABOVE and not clock.past(deadline):
            opts.report(0.2, "flexsp: CP-SAT on the one-micro-step model")
            left = clock.left(deadline)
            r = solve_step(tab, np.arange(s.size), bucketing=bucketing, buckets=buckets,
                           effort=MICRO_SHARE * left, clock=clock, seed=opts.seed, opts=opts)
            if r is not None:
                call = {"model": "micro-step", **_step_call_info(r)}
                cp_calls.append(call)
                cp_wall += float(r.info.get("wall_s", 0.0))
                st = Stack.from_groups(tab, place_groups(tab, r.rows))
                cands.append(_Cand(st, "cp-sat" if call["used"] else "heuristic", "micro-step"))
            phases.lap("micro_step_model")
        # 3. local search from the best starts, each until it stops improving or its share
        cands.sort(key=lambda c: c.ms)
        opts.report(0.3, "flexsp: local search on the whole step")
        ls_end = clock.now() + LS_SHARE * clock.left(deadline)
        # the best start of each kind first (a baseline's plan improves most; the stack greedy's
        # start lower), then the next best
        firsts = [next((c for c in cands if c.start.split(":")[0] == k), None) for k in ("stack-greedy", *BASELINE_KINDS)]
        starts = [c for c in firsts if c is not None]
        starts.sort(key=lambda c: c.ms)
        starts += [c for c in cands if c not in starts]
        starts = starts[:LS_STARTS]
        for k, c in enumerate(starts):
            opts.check_cancel()
            left = clock.left(ls_end)
            if left <= 0:
                break
            st = c.stack.copy()
            before = st.makespan_ms
            moves += st.improve(clock.now() + left * (0.5 if k + 1 < len(starts) else 1.0), clock,
                                cancel=opts.check_cancel)
            if st.makespan_ms < before * (1 - 1e-12):
                cands.append(_Cand(st, _plus(c.source, "local-search"), c.start))
        cands.sort(key=lambda c: c.ms)
        phases.lap("local_search")
        # 4. the whole-step CP-SAT model, warm-started from the best stack
        if cpsat and not clock.past(deadline - 0.02):
            best = cands[0]
            opts.report(0.55, "flexsp: CP-SAT on the whole-step model")
            left = clock.left(deadline)
            cp_deadline = clock.now() + CPSAT_SHARE * left
            split = _split(best.stack)
            # the parts whose ranks end latest first
            parts = [None] if split is None else sorted((p for p in split if split[p].num_groups()),
                                                        key=lambda p: -split[p].makespan_ms)
            sizes = {p: sum(len(m) for _, _, m in (best.stack if p is None else split[p]).groups()) for p in parts}
            for k, part in enumerate(parts):
                left = clock.left(cp_deadline) / (len(parts) - k)
                if left < MIN_CPSAT_S:
                    cp_calls.append({"model": "whole-step", "status": f"skipped ({left:.2f} effort left)",
                                     "objective_ms": None, "bound_ms": None, "dtime": 0.0, "variables": 0, "hint": "none",
                                     "used": False})
                    break
                if sizes[part] > CPSAT_MAX_SEQS:
                    cp_calls.append({"model": "whole-step", "status": f"skipped ({sizes[part]} sequences)",
                                     "objective_ms": None, "bound_ms": None, "dtime": 0.0,
                                     "variables": 0, "hint": "none", "used": False})
                    continue
                if part is None:
                    hint = best.stack
                else:  # the part as it is now: polishing after an earlier part may have moved sequences
                    split = _split(best.stack)
                    if split is None:
                        break
                    hint = split[part]
                # part of the share stays for mapping the answer back and polishing it
                out, info = solve_stack(hint.tab, hint, effort=0.7 * left, clock=clock, seed=opts.seed, opts=opts)
                cp_wall += info.wall_s
                call = {"model": "whole-step", **info.to_dict(), "used": False}
                if part is not None:
                    call["part"] = part
                cp_calls.append(call)
                opts.check_cancel()
                if out is None:
                    continue
                merged = _merge_part(best.stack, part, out)
                raw = merged.makespan_ms
                polished = merged.copy()
                moves += polished.improve(clock.now() + max(0.01, POLISH_SHARE * clock.left(deadline)), clock,
                                          cancel=opts.check_cancel)
                call["mapped_ms"] = raw
                call["polished_ms"] = polished.makespan_ms
                # CP-SAT's answer counts only when CP-SAT improved on its hint (else it handed the hint
                # back, and whatever the mapping and polishing found is the local search's)
                found = info.objective_ms is not None and info.objective_ms < info.extra["hint_objective_ms"] * (1 - 1e-9)
                call["improved_hint"] = bool(found)
                if found and polished.makespan_ms < best.ms * (1 - 1e-12):
                    src = "cp-sat" if polished.makespan_ms >= raw * (1 - 1e-12) else "cp-sat+local-search"
                    best = _Cand(polished if polished.makespan_ms < raw else merged, src, best.start)
                    call["used"] = True
                    cands.append(best)
            cands.sort(key=lambda c: c.ms)
            phases.lap("cp_sat")
        # 5. what effort is left: more local search on the best
        if cands and clock.left(deadline) > 0.01:
            c = cands[0]
            st = c.stack.copy()
            n = st.improve(deadline, clock, cancel=opts.check_cancel)
            moves += n
            if st.makespan_ms < c.ms * (1 - 1e-12):
                cands.insert(0, _Cand(st, _plus(c.source, "local-search"), c.start))
            phases.lap("local_search")
    opts.check_cancel()

    stats: dict = {
        "min_micro_steps": M0,
        "greedy_ms": greedy.makespan_ms,
        "best_static_ms": static.makespan_ms,
        "two_stage_ms": baselines[2].makespan_ms if len(baselines) > 2 else None,
        "local_search_moves": moves,
        "cp_sat": cp_calls,
        "cp_sat_status": _count(str(c.get("status")) for c in cp_calls),
        "cp_sat_dtime": round(float(sum(c.get("dtime") or 0.0 for c in cp_calls)), 9),
    }
    best = min(cands, key=lambda c: c.ms) if cands else None
    if best is not None and best.ms + grad < baseline.makespan_ms * (1 - 1e-12):
        micro, blocks = best.stack.assignment()
        plan = build_plan("flexsp", micro, s, cost, blocks=blocks, lower_bound=lb)
        # CP-SAT's OPTIMAL on the per-micro-step model is optimal among one-micro-step plans only:
        # stacking groups on a rank can still be faster, so it proves nothing about the step
        plan = _replace(plan, status="feasible", reason="")
        stats["source"] = best.source
        stats["start"] = best.start
    else:
        if best is None:
            status, reason = "fallback", (f"the baselines (greedy, best static) took the whole effort ({opts.effort:g}); "
                                          f"returning {baseline.planner}'s plan (raise --effort to let the solver "
                                          f"improve on it)")
        else:
            status, reason = "feasible", f"no candidate beat {baseline.planner}'s plan; returning it"
        plan = _replace(baseline, planner="flexsp", status=status, reason=reason)
        stats["source"] = baseline.planner
        stats["start"] = baseline.planner
    if plan.status != "optimal" and plan.makespan_ms <= lb * (1 + 1e-9):
        plan = _replace(plan, status="optimal", reason="the plan meets the lower bound")
    groups = [g for m in plan.micro_steps for g in m.groups]
    stats["groups"] = len(groups)
    stats["groups_per_gpu"] = float(sum(g.degree for g in groups)) / max(1, cost.cluster.num_gpus)
    stats["micro_steps"] = len(plan.micro_steps)
    stats["best_bound_ms"] = lb
    stats["gap"] = plan.makespan_ms / lb - 1.0 if lb > 0 else 0.0
    stats["effort_phases"] = phases.effort
    stats["wall"] = {"phases_s": phases.wall, "cp_sat_s": cp_wall}
    opts.report(0.99, f"flexsp: {plan.makespan_ms:,.0f} ms ({stats['source']})")
    return _replace(plan, lower_bound_ms=lb, stats=stats)

def _plus(source: str, step: str) -> str:
    """``source`` with ``step`` appended once (``greedy`` + ``local-search`` is ``local-search``)."""
    if source.startswith("cp-sat"):
        return "cp-sat+local-search"
    return step

def _count(keys) -> dict:
    out: dict[str, int] = {}
    for k in keys:
        out[k] = out.get(k, 0) + 1
    return out

def _step_call_info(r: StepResult) -> dict:
    """The per-micro-step CP-SAT call's figures in the shape of the whole-step ones."""
    i = r.info
    used = "cp_sat_ms" in i and i.get("heuristic_ms") is not None and i["cp_sat_ms"] < i["heuristic_ms"] * (1 - 1e-12)
    return {"status": str(i.get("cp_sat_status", "not run")), "objective_ms": i.get("objective_ms"),
            "bound_ms": i.get("bound_ms"), "dtime": float(i.get("dtime", 0.0)),
            "variables": int(i.get("variables", 0)), "hint": str(i.get("hint", "none")), "used": bool(used)}

def _split(stack: Stack) -> dict | None:
    """The stack's parts ``{part index: sub-stack on its ranks}``, a part being an aligned block
    of ``CPSAT_PART_GPUS`` ranks, or None when the cluster is not larger than that or some group
    is wider (it would straddle two parts)."""
    tab = stack.tab
    P = int(CPSAT_PART_GPUS)
    used = max((int(tab.deg[e]) for e, _, _ in stack.groups()), default=1)
    if stack.n <= P or stack.n % P or used > P:
        return None
    sub = Table.__new__(Table)
    sub.__dict__.update(tab.__dict__)
    sub.n_gpus = P
    per_part: dict[int, list] = {p: [] for p in range(stack.n // P)}
    for e, b, mem in stack.groups():
        d = int(tab.deg[e])
        p = (b * d) // P
        per_part[p].append((e, b - p * (P // d), mem))
    return {p: Stack.from_groups(sub, g) for p, g in per_part.items()}

def _merge_part(stack: Stack, part, out: Stack) -> Stack:
    """``stack`` with part ``part`` replaced by ``out`` (a stack on the part's ranks)."""
    if part is None:
        return Stack.from_groups(stack.tab, out.groups())
    tab = stack.tab
    P = out.n
    groups = []
    for e, b, mem in stack.groups():
        d = int(tab.deg[e])
        if (b * d) // P != part:
            groups.append((e, b, mem))
    for e, b, mem in out.groups():
        d = int(tab.deg[e])
        groups.append((e, b + part * (P // d), mem))
    return Stack.from_groups(tab, groups)
