"""The FlexSP planner's solve time and plan quality over cluster sizes, batch sizes and families,
with CP-SAT on and off (the ablation).

For GPUs in {8, 64, 256, 1024} x sequences per step in {128, 512, 2048, 8192} x each length family
(7B, a100-40g-flexsp profile, max context = the largest power of two the cluster holds on one
group, at most the model's; lengths clipped to it), plans ``--steps`` batches with every planner
and prints one markdown table per (GPUs, sequences) cell: flexsp's solve time p50/p95, its
makespan over the lower bound (median), the speedup of flexsp over static-max, best-static,
min-degree, greedy and two-stage (ratio of mean step times), CP-SAT's contribution (the median over
the steps of flexsp-without-CP-SAT's makespan / flexsp's, minus one), the steps where flexsp is
behind any other planner, and what CP-SAT did: how many calls reported the warm-start hint complete
and feasible, and which plans it produced. It also divides each makespan by the *step bound*
(``workbench.solve.bound.step_bound_ms``: the largest of the lower bound, the packing bound, where
sequences over half a group cannot share it and a long sequence's wide group pays its whole overhead,
and under ZeRO-3 the pass bound, where passes are cut at sequences and the longest ones set their
lengths), given the best plan of the step as the bound's ``upper_ms``, and prints the step bound over
the lower bound. ``--batch-tokens T`` draws batches of T tokens from
each family instead (``GlobalBatchSampler``, as bench/planners.py does), so the seqs column is
"T tokens".

``--small N`` instead runs the ablation on N small random instances (1-8 GPUs, 1-10 sequences,
tight or loose memory, as tests/test_flexsp.py draws them), where the whole-step model has
every sequence as its own item.

Lockstep (ZeRO-3, the default stage) and free execution (``--zero-stage 0..2``) are planned and timed
as a run of that stage would be (``workbench.solve.plan``). Two more tables:

``--peer RESULTS.json`` plans the batches of FlexSP's released solver (the peer harness's
results.json, run outside the project: REFERENCE.md) with flexsp in FlexSP's own cost model
(``bench/flexsp_model.py``), one group per GPU and pass (FlexSP's rule) and with stacked groups, and
prints each plan's step time in that model (``flexsp_model.step_ms``, the formulas alone) against
the peer's, flexsp's solve time (wall clock and the planning thread's CPU time), and every plan over
the lockstep pass bound (``workbench.solve.bound.lockstep_pass_bound_ms``) in the same model.

``--stages`` plans 64 GPUs x 1M-token batches of each family under ZeRO-3 (lockstep; with and
without stacked groups) and ZeRO-2 (free), for 7B and 1B on A100-40G and 7B on H100-80G: which stage
is faster, and by how much, where both hold the model.

Usage: python bench/solver.py [--gpus 8,64,...] [--seqs 128,...] [--batch-tokens T] [--families a,b]
       [--steps K] [--time-limit S|auto] [--zero-stage Z] [--quick] [--json PATH] [--summary-from JSON]
       [--small N] [--peer RESULTS.json] [--stages]
``--time-limit auto`` gives flexsp 1 s up to 64 GPUs x 512 sequences, scaling with the problem
size up to 8 s at 1024 x 8192 (the baselines' own time counts). Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from workbench.data import synthetic_lengths  # noqa: E402
from workbench.scenario import Scenario  # noqa: E402
from workbench.solve import PlanOptions, planner_names, run_planner, validate  # noqa: E402

FAMILIES = ("wikipedia", "commoncrawl", "github", "byted")
OTHERS = ("static-max", "best-static", "min-degree", "greedy", "two-stage")


def auto_time_limit(gpus: int, seqs: int) -> float:
    size = gpus * seqs / (64 * 512)
    return float(min(8.0, max(1.0, size ** 0.5)))


def batches(fam: str, gpus: int, seqs: int, steps: int, seed: int, max_len: int, batch_tokens: int | None):
    """The cell's batches: ``seqs`` synthetic lengths per step, or ``batch_tokens``-token batches
    sampled from 200,000 lengths of the family (both clipped to ``max_len``)."""
    if batch_tokens is None:
        return [np.minimum(synthetic_lengths(fam, seqs, seed=seed + k), max_len) for k in range(steps)]
    sc = Scenario(source=fam, samples=200_000, seed=seed, max_len=max_len, policy="clip", batch_tokens=batch_tokens)
    return [np.asarray(b.lengths) for b in sc.batches(steps)]


def gap_parts(plan, s, cost) -> dict:
    """Where a plan's distance to the lower bound goes, each as a share of the bound: the busiest
    rank's load above the mean rank load (imbalance), GPU-time above every sequence at its cheapest
    degree (wider degrees), group overhead above the activations' minimum number of full groups
    per GPU, and the groups per GPU themselves."""
    from workbench.solve.microstep import Table
    from workbench.solve.stack import Stack

    tab = Table(np.asarray(s, dtype=np.int64), cost)
    st = Stack.from_plan(plan, tab)
    n, lb = cost.cluster.num_gpus, plan.lower_bound_ms
    groups = sum(st.d[e] for e, _, _ in st.groups()) / n
    work = sum(st.d[e] * float(tab.t[e, m].sum()) for e, _, m in st.groups()) / n
    need = float(tab.share.sum()) / n / tab.budget
    return {"imbalance": (st.makespan_ms - float(st.load.mean())) / lb,
            "extra_work": (work - float(tab.best_work.sum()) / n) / lb,
            "extra_overhead": (groups - need) * float(tab.over.min()) / lb,
            "groups_per_gpu": groups, "groups_needed": need}


def run_cell(gpus: int, seqs: int, families, steps: int, time_limit, seed: int, others, batch_tokens=None,
             zero_stage: int = 3):
    from workbench.solve.bound import step_bound_ms
    from workbench.solve.flexsp import plan_flexsp

    sc = Scenario(model="7b", profile="a100-40g-flexsp", num_gpus=gpus, zero_stage=zero_stage)
    if zero_stage != 3:
        # 7B's replicated fp32 weights and gradients do not fit 40 GB: GPUs as large as ZeRO-2's states
        # plus ZeRO-3's activation budget, so both stages plan the same memory pressure
        z3 = Scenario(model="7b", profile="a100-40g-flexsp", num_gpus=gpus).cost()
        states = sc.replace(gpu_memory_gb=1000.0).cost().model_states_gb
        sc = sc.replace(gpu_memory_gb=(z3.memory_budget_gb + states) / sc.memory_fraction)
    cost, max_len = sc.cost(), sc.resolved_max_len()
    size = seqs if batch_tokens is None else 1024
    tl = auto_time_limit(gpus, size) if time_limit == "auto" else float(time_limit)
    rows = []
    for fam in families:
        t0 = time.perf_counter()
        solve, solve_off, ratio, ratio_off, gain = [], [], [], [], []
        ratio_pack, ratio_pack_off, bound_lb = [], [], []
        mk = {p: [] for p in ("flexsp", *others)}
        statuses: dict[str, int] = {}
        sources: dict[str, int] = {}
        cp_status: dict[str, int] = {}
        hints: dict[str, int] = {}
        behind: list[str] = []
        groups_per_gpu = []
        gaps: dict[str, list[dict]] = {"flexsp": [], "greedy": []}
        for k, s in enumerate(batches(fam, gpus, seqs, steps, seed, max_len, batch_tokens)):
            p = run_planner("flexsp", s, cost, seed=seed, effort=tl, max_len=max_len)
            validate(p, s, cost.cluster, cost)
            json.dumps(p.to_dict(), allow_nan=False)  # strict JSON
            # the ablation: the same planner without CP-SAT (heuristics and local search only)
            q = plan_flexsp(s, cost, PlanOptions(seed=seed, effort=tl, max_len=max_len), cpsat=False)
            validate(q, s, cost.cluster, cost)
            solve.append(p.solve_seconds)
            solve_off.append(q.solve_seconds)
            ratio.append(p.makespan_ms / p.lower_bound_ms)
            ratio_off.append(q.makespan_ms / q.lower_bound_ms)
            gain.append(q.makespan_ms / p.makespan_ms - 1.0)
            mk["flexsp"].append(p.makespan_ms)
            # the group degrees summed per GPU (under lockstep: over all passes)
            groups_per_gpu.append(sum(g.degree for m in p.micro_steps for g in m.groups) / gpus)
            statuses[p.status] = statuses.get(p.status, 0) + 1
            src = str(p.stats.get("source", "?"))
            sources[src] = sources.get(src, 0) + 1
            for c in p.stats.get("cp_sat", []):
                key = f"{c.get('model')}: {c.get('status')}"
                cp_status[key] = cp_status.get(key, 0) + 1
                if not str(c.get("status", "")).startswith("skipped"):
                    hints[str(c.get("hint"))] = hints.get(str(c.get("hint")), 0) + 1
            if p.execution == "free":
                gaps["flexsp"].append(gap_parts(p, s, cost))
            step_plans = [p, q]
            for o in others:
                r = run_planner(o, s, cost, seed=seed, effort=tl, max_len=max_len)
                step_plans.append(r)
                mk[o].append(r.makespan_ms)
                if o == "greedy" and r.execution == "free":
                    gaps["greedy"].append(gap_parts(r, s, cost))
                if p.makespan_ms > r.makespan_ms * (1 + 1e-9):
                    behind.append(f"step {k}: {o} {r.makespan_ms / p.makespan_ms - 1:+.2%}")
            # the packing bound, given the step's best plan (its compute time) as the upper limit; the
            # 1M-token cells' pass bound also branches on the longest sequence's shape (5-20 s a batch)
            bound = step_bound_ms(s, cost, step_plans, branch=1 if batch_tokens is not None else 0)
            ratio_pack.append(p.makespan_ms / bound)
            ratio_pack_off.append(q.makespan_ms / bound)
            bound_lb.append(bound / p.lower_bound_ms)
        row = {
            "family": fam, "time_limit": tl, "solve_p50": float(np.percentile(solve, 50)),
            "solve_p95": float(np.percentile(solve, 95)), "solve_p95_off": float(np.percentile(solve_off, 95)),
            "x_lower_bound": float(np.mean(ratio)), "x_lower_bound_median": float(np.median(ratio)),
            "x_lower_bound_median_off": float(np.median(ratio_off)),
            "x_packing_bound_median": float(np.median(ratio_pack)),
            "x_packing_bound_median_off": float(np.median(ratio_pack_off)),
            "bound_over_lb_median": float(np.median(bound_lb)),
            "cp_sat_gain_median": float(np.median(gain)), "cp_sat_gain_max": float(np.max(gain)),
            "speedup": {o: float(np.mean(mk[o]) / np.mean(mk["flexsp"])) for o in others},
            "speedup_median": {o: float(np.median(np.asarray(mk[o]) / np.asarray(mk["flexsp"]))) for o in others},
            "status": statuses, "source": sources, "cp_sat_calls": cp_status, "hints": hints, "behind": behind,
            "groups_per_gpu": float(np.mean(groups_per_gpu)), "steps": len(solve),
            "gap": {k: {f: float(np.median([g[f] for g in v])) for f in v[0]} for k, v in gaps.items() if v},
        }
        rows.append(row)
        print(f"# {gpus} GPUs x {seqs if batch_tokens is None else f'{batch_tokens} tokens'}, {fam}: "
              f"{time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    return rows


def _fmt_counts(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "-"


def print_cell(gpus, seqs, rows, all_others):
    tl = rows[0]["time_limit"] if rows else 0
    print(f"\n### {gpus} GPUs x {seqs} per step (flexsp time limit {tl:g}s)\n")
    head = " | ".join(f"vs {o}" for o in all_others)
    print(f"| family | solve p50 (s) | solve p95 (s) | makespan / LB (median) | CP-SAT off: makespan / LB | "
          f"makespan / step bound (median; CP-SAT off) | step bound / LB | CP-SAT gain (median, max) | {head} | "
          f"behind | groups per GPU | source |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(all_others) + "---:|---:|---|")
    for r in rows:
        sp = " | ".join(f"{r['speedup'][o]:.3f}x" if o in r["speedup"] else "n/a" for o in all_others)
        print(f"| {r['family']} | {r['solve_p50']:.2f} | {r['solve_p95']:.2f} | {r['x_lower_bound_median']:.3f} | "
              f"{r['x_lower_bound_median_off']:.3f} | {r['x_packing_bound_median']:.3f}; "
              f"{r['x_packing_bound_median_off']:.3f} | {r.get('bound_over_lb_median', float('nan')):.3f} | "
              f"{r['cp_sat_gain_median']:+.2%}, {r['cp_sat_gain_max']:+.2%} | {sp} | "
              f"{len(r['behind'])} of {r['steps']} | {r['groups_per_gpu']:.2f} | {_fmt_counts(r['source'])} |", flush=True)
    print("\nCP-SAT calls: " + "; ".join(f"{r['family']}: {_fmt_counts(r['cp_sat_calls'])} (hint: "
                                        f"{_fmt_counts(r['hints'])})" for r in rows))
    late = [f"{r['family']}: {', '.join(r['behind'])}" for r in rows if r["behind"]]
    if late:
        print("\nBehind: " + "; ".join(late))
    if not any(r.get("gap") for r in rows):
        print("\n(where the gap to the lower bound goes: computed for free execution only, --zero-stage 0..2)")
        return
    print("\nWhere the gap to the lower bound goes (medians over the steps, shares of the bound):\n")
    print("| family | planner | imbalance | wider degrees | group overhead | groups per GPU | groups needed |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        for k, g in r.get("gap", {}).items():
            print(f"| {r['family']} | {k} | {g['imbalance']:.2%} | {g['extra_work']:.2%} | {g['extra_overhead']:.2%} | "
                  f"{g['groups_per_gpu']:.2f} | {g['groups_needed']:.2f} |")


def print_summary(out: dict, all_others) -> None:
    """One row per (GPUs, sequences) cell over the families: the worst p95 solve time against the
    limit, the range of median makespan / LB, CP-SAT's median gain, the range of flexsp's speedup
    over each other planner, and the steps where flexsp is behind any of them."""
    print("\n### Summary: one row per cell, ranges over the families\n")
    head = " | ".join(f"vs {o}" for o in all_others)
    print(f"| GPUs x seqs | limit (s) | worst p95 solve (s) | makespan / LB (median) | CP-SAT gain (median) | {head} | "
          f"steps behind |")
    print("|---|---:|---:|---:|---:|" + "---:|" * len(all_others) + "---:|")
    for cell, rows in out.items():
        if not rows:
            continue
        lbr = [r.get("x_lower_bound_median", r["x_lower_bound"]) for r in rows]
        gains = [r["cp_sat_gain_median"] for r in rows if "cp_sat_gain_median" in r]
        cols = []
        for o in all_others:
            sp = [r["speedup"][o] for r in rows if o in r["speedup"]]
            cols.append(f"{min(sp):.2f}-{max(sp):.2f}x" if sp else "n/a")
        behind = sum(len(r.get("behind", [])) for r in rows)
        steps = sum(r.get("steps", 0) for r in rows)
        gain = f"{min(gains):+.2%} to {max(gains):+.2%}" if gains else "n/a"
        print(f"| {cell.replace('x', ' x ', 1)} | {rows[0]['time_limit']:.3g} | {max(r['solve_p95'] for r in rows):.2f} | "
              f"{min(lbr):.3f}-{max(lbr):.3f} | {gain} | " + " | ".join(cols) + f" | {behind} of {steps} |", flush=True)


def small_ablation(count: int, time_limit: float, seed: int) -> None:
    """CP-SAT on against off on ``count`` small random instances; prints one table."""
    from workbench.solve.flexsp import plan_flexsp

    rng = np.random.default_rng(seed)
    configs = [("1b", 1, 40), ("1b", 2, 40), ("1b", 4, 40), ("1b", 8, 40), ("1b", 2, 24), ("1b", 4, 80),
               ("7b", 8, 40), ("7b", 4, 80), ("7b", 8, 80), ("1b", 8, 24)]
    better = worse = 0
    gains, sources = [], {}
    for k in range(count):
        name, n, mem = configs[rng.integers(len(configs))]
        cost = Scenario(model=name, profile="a100-40g-flexsp", num_gpus=n, gpus_per_node=8, gpu_memory_gb=mem).cost()
        tpg = cost.tokens_per_gpu()
        hi = max(cost.degrees) * tpg
        f = np.exp(rng.uniform(np.log(0.01), np.log(min(3.0, hi / tpg)), size=int(rng.integers(1, 11))))
        s = np.minimum(np.maximum(1, (f * tpg).astype(np.int64)), int(hi))
        p = plan_flexsp(s, cost, PlanOptions(seed=k, effort=time_limit))
        q = plan_flexsp(s, cost, PlanOptions(seed=k, effort=time_limit), cpsat=False)
        g = q.makespan_ms / p.makespan_ms - 1.0
        gains.append(g)
        better += g > 1e-9
        worse += g < -1e-9
        src = str(p.stats.get("source"))
        sources[src] = sources.get(src, 0) + 1
    print(f"\n### Small instances: CP-SAT on vs off ({count} instances, time limit {time_limit:g}s)\n")
    print("| instances | CP-SAT faster | CP-SAT slower | gain (mean) | gain (max) | source of the plan |")
    print("|---:|---:|---:|---:|---:|---|")
    print(f"| {count} | {better} | {worse} | {np.mean(gains):+.2%} | {np.max(gains):+.2%} | {_fmt_counts(sources)} |")


def peer_table(path: str, time_limit: float, seed: int) -> dict:
    """FlexSP's released solver against flexsp in FlexSP's own cost model (module docstring)."""
    from flexsp_model import FlexSPCost, step_ms

    from workbench.solve.lockstep import plan_lockstep

    data = json.loads(Path(path).read_text())
    consts = data["cost_model"]
    cost = FlexSPCost(consts)
    rows = []
    for b in data["batches"]:
        s = np.asarray(b["lengths"], dtype=np.int64)
        peer = float(b["total_ms"])
        peer_check = step_ms([[(g["sp_size"], g["lengths"]) for g in mb["groups"]] for mb in b["micro_batches"]], consts)
        row = {"dataset": b["dataset"], "iteration": b["iteration"], "sequences": int(s.size), "tokens": int(s.sum()),
               "peer_ms": peer, "peer_check_ms": peer_check, "peer_passes": len(b["micro_batches"]),
               "peer_solve_s": b.get("solve_wall_s_if_unbounded_cores_est", b.get("solve_wall_s"))}
        for multi in (False, True):
            # plan_lockstep is called directly (run_planner has no one-group-per-GPU switch), so its
            # solve time is measured here: wall clock and the planning thread's CPU time
            w0, c0 = time.perf_counter(), time.thread_time()
            p = plan_lockstep(s, cost, PlanOptions(seed=seed, effort=time_limit), multi=multi)
            wall, cpu = time.perf_counter() - w0, time.thread_time() - c0
            validate(p, s, cost.cluster, cost)
            key = "stacked" if multi else "ours"
            if not multi:
                # one group per GPU and pass: FlexSP's own formulas give the same step
                mine = step_ms([[(g.degree, list(g.lengths)) for g in ms.groups] for ms in p.micro_steps], consts)
                assert abs(mine - p.makespan_ms) <= 1e-6 * mine, (mine, p.makespan_ms)
            row[f"{key}_ms"] = p.makespan_ms
            row[f"{key}_passes"] = len(p.micro_steps)
            row[f"{key}_solve_s"] = wall
            row[f"{key}_cpu_s"] = cpu
            row[f"{key}_stacked_groups"] = p.stats.get("stacked_groups", 0)
        # the lockstep pass bound (every plan, stacked or not), given the best plan as its upper limit;
        # no work cap and branching on the longest sequence's shape: the table wants the tightest bound
        # (10-60 s a batch)
        from workbench.solve.bound import lockstep_pass_bound_ms

        best = min(row["ours_ms"], row["stacked_ms"], peer)
        row["bound_ms"] = lockstep_pass_bound_ms(s, cost, best, work=None, branch=1)
        if row["bound_ms"] > best * (1 + 1e-6):
            raise SystemExit(f"{b['dataset']} {b['iteration']}: the pass bound {row['bound_ms']:,.1f} ms is above a "
                             f"plan of {best:,.1f} ms: a bug in the bound, not a result")
        rows.append(row)
        print(f"# peer batch {b['dataset']} {b['iteration']} done", file=sys.stderr, flush=True)
    print(f"\n### Against FlexSP's released solver, in its own cost model (flexsp time limit {time_limit:g}s)\n")
    print("| batch | sequences | tokens | FlexSP (ms) | passes | FlexSP solve (s) | flexsp (ms) | vs FlexSP | passes | "
          "solve wall (CPU) (s) | stacked groups allowed (ms) | vs FlexSP | solve wall (CPU) (s) | pass bound (ms) | "
          "FlexSP / bound | flexsp / bound | stacked / bound |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['dataset']} {r['iteration']} | {r['sequences']} | {r['tokens']:,} | {r['peer_ms']:,.0f} | "
              f"{r['peer_passes']} | {r['peer_solve_s']:.1f} | {r['ours_ms']:,.0f} | {r['ours_ms'] / r['peer_ms'] - 1:+.1%} | "
              f"{r['ours_passes']} | {r['ours_solve_s']:.2f} ({r['ours_cpu_s']:.2f}) | {r['stacked_ms']:,.0f} | "
              f"{r['stacked_ms'] / r['peer_ms'] - 1:+.1%} | {r['stacked_solve_s']:.2f} ({r['stacked_cpu_s']:.2f}) | "
              f"{r['bound_ms']:,.0f} | {r['peer_ms'] / r['bound_ms']:.3f} | {r['ours_ms'] / r['bound_ms']:.3f} | "
              f"{r['stacked_ms'] / r['bound_ms']:.3f} |")
    rel = [r["ours_ms"] / r["peer_ms"] - 1 for r in rows]
    rel_m = [r["stacked_ms"] / r["peer_ms"] - 1 for r in rows]
    print(f"\nflexsp vs FlexSP: median {np.median(rel):+.1%}, worst {max(rel):+.1%}; with stacked groups: median "
          f"{np.median(rel_m):+.1%}, worst {max(rel_m):+.1%}. FlexSP's totals recomputed from its plans with "
          f"flexsp_model.step_ms: largest difference {max(abs(r['peer_check_ms'] / r['peer_ms'] - 1) for r in rows):.1e}.")
    return {"rows": rows}


def stage_table(families, steps: int, time_limit: float, seed: int, batch_tokens: int = 1_000_000) -> dict:
    """ZeRO-3 (lockstep) against ZeRO-2 (free) at 64 GPUs x ``batch_tokens`` (module docstring)."""
    from workbench.solve.lockstep import plan_lockstep

    cases = [("7b", "a100-40g-flexsp"), ("1b", "a100-40g-flexsp"), ("7b", "h100-80g")]
    rows = []
    for model, prof in cases:
        for fam in families:
            base = Scenario(model=model, profile=prof, num_gpus=64, source=fam, samples=200_000, seed=seed,
                            batch_tokens=batch_tokens, effort=time_limit)
            row = {"model": model, "profile": prof, "family": fam}
            for zero in (3, 2):
                sc = base.replace(zero_stage=zero)
                try:
                    cost = sc.cost()
                except ValueError as e:
                    row[f"z{zero}"] = {"fits": False, "why": str(e).split(";")[0]}
                    continue
                ms, ms_single, passes = [], [], []
                batches = sc.replace(max_len=base.resolved_max_len()).batches(steps)
                try:
                    for b in batches:
                        cost.check_feasible(b.lengths)
                except ValueError as e:  # the budget left holds the batch's sequences on no group
                    row[f"z{zero}"] = {"fits": False, "why": str(e).split("; ")[0]}
                    continue
                for b in batches:
                    s = np.asarray(b.lengths, dtype=np.int64)
                    p = run_planner("flexsp", s, cost, seed=seed, effort=time_limit)
                    validate(p, s, cost.cluster, cost)
                    ms.append(p.makespan_ms)
                    passes.append(len(p.micro_steps))
                    if zero == 3:
                        q = plan_lockstep(s, cost, PlanOptions(seed=seed, effort=time_limit), multi=False)
                        ms_single.append(q.makespan_ms)
                row[f"z{zero}"] = {"fits": True, "mean_ms": float(np.mean(ms)), "budget_gb": cost.memory_budget_gb,
                                   "states_gb": cost.model_states_gb, "parts": float(np.mean(passes)),
                                   "single_mean_ms": float(np.mean(ms_single)) if ms_single else None}
            rows.append(row)
            print(f"# stages {model} {prof} {fam} done", file=sys.stderr, flush=True)
    print(f"\n### ZeRO-3 (lockstep) against ZeRO-2 (free): 64 GPUs x {batch_tokens:,}-token batches, {steps} steps, "
          f"flexsp {time_limit:g}s\n")
    print("| model, GPU | family | ZeRO-3 states / budget (GB) | ZeRO-3 step (s) | passes | one group per GPU (s) | "
          "stacked gain | ZeRO-2 states / budget (GB) | ZeRO-2 step (s) | micro-steps | faster |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        z3, z2 = r["z3"], r["z2"]
        a = (f"{z3['states_gb']:.1f} / {z3['budget_gb']:.1f} | {z3['mean_ms'] / 1e3:.2f} | {z3['parts']:.1f} | "
             f"{z3['single_mean_ms'] / 1e3:.2f} | {z3['single_mean_ms'] / z3['mean_ms'] - 1:+.1%}") if z3["fits"] else \
            "does not fit | | | |"
        if z2["fits"]:
            b = f"{z2['states_gb']:.1f} / {z2['budget_gb']:.1f} | {z2['mean_ms'] / 1e3:.2f} | {z2['parts']:.1f}"
        else:
            b = f"does not fit ({z2['why'].split(' but ')[0]}) | | "
        faster = ("ZeRO-3" if z3["mean_ms"] < z2["mean_ms"] else "ZeRO-2") + \
            f" by {max(z3['mean_ms'], z2['mean_ms']) / min(z3['mean_ms'], z2['mean_ms']) - 1:.1%}" \
            if z3["fits"] and z2["fits"] else ("ZeRO-3 (only it fits)" if z3["fits"] else "-")
        print(f"| {r['model']}, {r['profile']} | {r['family']} | {a} | {b} | {faster} |")
    return {"rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", default="8,64,256,1024")
    ap.add_argument("--seqs", default="128,512,2048,8192")
    ap.add_argument("--batch-tokens", type=int, default=None,
                    help="draw batches of this many tokens from each family instead of --seqs sequences")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--effort", "--time-limit", dest="time_limit", default="auto",
                    help="flexsp effort per step in reference seconds, or auto (1 up to 64 GPUs x 512 sequences, "
                         "growing with the problem to 8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="8 and 64 GPUs x 128 and 512 sequences, 2 steps")
    ap.add_argument("--json", default=None)
    ap.add_argument("--summary-from", default=None, metavar="JSON",
                    help="print the summary table of an earlier run's --json file and exit")
    ap.add_argument("--small", type=int, default=0, metavar="N",
                    help="run the CP-SAT ablation on N small random instances instead")
    ap.add_argument("--zero-stage", type=int, default=3, choices=[0, 1, 2, 3],
                    help="ZeRO stage of the cells (default 3: lockstep passes)")
    ap.add_argument("--peer", default=None, metavar="RESULTS.json",
                    help="compare with FlexSP's released solver on the batches of its results.json instead")
    ap.add_argument("--stages", action="store_true", help="ZeRO-3 against ZeRO-2 at 64 GPUs x 1M tokens instead")
    args = ap.parse_args()
    if args.peer or args.stages:
        tl = 1.0 if args.time_limit == "auto" else float(args.time_limit)
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        print(f"# load average {load:.2f} at start")
        out = peer_table(args.peer, tl, args.seed) if args.peer else stage_table(
            args.families.split(","), args.steps, tl, args.seed)
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        print(f"\n# load average {load:.2f} at the end")
        if args.json:
            from workbench.util import write_json_atomic

            write_json_atomic(args.json, out)
        return 0
    if args.small:
        small_ablation(args.small, 0.5 if args.time_limit == "auto" else float(args.time_limit), args.seed)
        return 0
    if args.summary_from:
        print_summary(json.loads(Path(args.summary_from).read_text()), list(OTHERS))
        return 0
    if args.quick:
        args.gpus, args.seqs, args.steps = "8,64", "128,512", 2
    gpus = [int(x) for x in args.gpus.split(",")]
    seqs = [int(x) for x in args.seqs.split(",")] if args.batch_tokens is None else [0]
    families = args.families.split(",")
    known = set(planner_names())
    if "flexsp" not in known:
        print("flexsp is not available (OR-Tools missing?)", file=sys.stderr)
        return 1
    others = [o for o in OTHERS if o in known]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"# flexsp: 7B on A100-40G (a100-40g-flexsp), {args.steps} steps per family, time limit {args.time_limit}; "
          f"speedup = baseline mean step / flexsp mean step; CP-SAT gain = median over steps of "
          f"(flexsp without CP-SAT) / flexsp - 1; load average {load:.2f} at start")
    out = {}
    for g in gpus:
        for n in seqs:
            rows = run_cell(g, n, families, args.steps, args.time_limit, args.seed, others, args.batch_tokens,
                            zero_stage=args.zero_stage)
            label = f"{n} sequences" if args.batch_tokens is None else f"{args.batch_tokens:,}-token batches"
            print_cell(g, label, rows, list(OTHERS))
            out[f"{g}x{n if args.batch_tokens is None else args.batch_tokens}"] = rows
    if len(out) > 1:
        print_summary(out, list(OTHERS))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\n# load average {load:.2f} at the end")
    if args.json:
        from workbench.util import write_json_atomic

        write_json_atomic(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
