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
and feasible, and which plans it produced. It also divides each makespan by the larger of the lower
bound and the packing bound (``workbench.solve.bound``: sequences over half a group cannot share
it, a long sequence's wide group pays its whole overhead), given the best plan of the step as the
bound's ``upper_ms``. ``--batch-tokens T`` draws batches of T tokens from
each family instead (``GlobalBatchSampler``, as bench/planners.py does), so the seqs column is
"T tokens".

``--small N`` instead runs the ablation on N small random instances (1-8 GPUs, 1-10 sequences,
tight or loose memory, as tests/test_flexsp.py draws them), where the whole-step model has
every sequence as its own item.

Usage: python bench/solver.py [--gpus 8,64,...] [--seqs 128,...] [--batch-tokens T] [--families a,b]
       [--steps K] [--time-limit S|auto] [--quick] [--json PATH] [--summary-from JSON] [--small N]
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
    from workbench.solve.flexsp import _Table
    from workbench.solve.stack import Stack

    tab = _Table(np.asarray(s, dtype=np.int64), cost)
    st = Stack.from_plan(plan, tab)
    n, lb = cost.cluster.num_gpus, plan.lower_bound_ms
    groups = sum(st.d[e] for e, _, _ in st.groups()) / n
    work = sum(st.d[e] * float(tab.t[e, m].sum()) for e, _, m in st.groups()) / n
    need = float(tab.share.sum()) / n / tab.budget
    return {"imbalance": (st.makespan_ms - float(st.load.mean())) / lb,
            "extra_work": (work - float(tab.best_work.sum()) / n) / lb,
            "extra_overhead": (groups - need) * float(tab.over.min()) / lb,
            "groups_per_gpu": groups, "groups_needed": need}


def run_cell(gpus: int, seqs: int, families, steps: int, time_limit, seed: int, others, batch_tokens=None):
    from workbench.solve.bound import step_bound_ms
    from workbench.solve.flexsp import plan_flexsp

    sc = Scenario(model="7b", profile="a100-40g-flexsp", num_gpus=gpus)
    cost, max_len = sc.cost(), sc.resolved_max_len()
    size = seqs if batch_tokens is None else 1024
    tl = auto_time_limit(gpus, size) if time_limit == "auto" else float(time_limit)
    rows = []
    for fam in families:
        t0 = time.perf_counter()
        solve, solve_off, ratio, ratio_off, gain = [], [], [], [], []
        ratio_pack, ratio_pack_off = [], []
        mk = {p: [] for p in ("flexsp", *others)}
        statuses: dict[str, int] = {}
        sources: dict[str, int] = {}
        cp_status: dict[str, int] = {}
        hints: dict[str, int] = {}
        behind: list[str] = []
        groups_per_gpu = []
        gaps: dict[str, list[dict]] = {"flexsp": [], "greedy": []}
        for k, s in enumerate(batches(fam, gpus, seqs, steps, seed, max_len, batch_tokens)):
            p = run_planner("flexsp", s, cost, seed=seed, time_limit=tl, max_len=max_len)
            validate(p, s, cost.cluster, cost)
            json.dumps(p.to_dict(), allow_nan=False)  # strict JSON
            # the ablation: the same planner without CP-SAT (heuristics and local search only)
            q = plan_flexsp(s, cost, PlanOptions(seed=seed, time_limit=tl, max_len=max_len), cpsat=False)
            validate(q, s, cost.cluster, cost)
            solve.append(p.solve_seconds)
            solve_off.append(q.solve_seconds)
            ratio.append(p.makespan_ms / p.lower_bound_ms)
            ratio_off.append(q.makespan_ms / q.lower_bound_ms)
            gain.append(q.makespan_ms / p.makespan_ms - 1.0)
            mk["flexsp"].append(p.makespan_ms)
            groups_per_gpu.append(float(p.stats.get("groups_per_gpu", 0.0)))
            statuses[p.status] = statuses.get(p.status, 0) + 1
            src = str(p.stats.get("source", "?"))
            sources[src] = sources.get(src, 0) + 1
            for c in p.stats.get("cp_sat", []):
                key = f"{c.get('model')}: {c.get('status')}"
                cp_status[key] = cp_status.get(key, 0) + 1
                if not str(c.get("status", "")).startswith("skipped"):
                    hints[str(c.get("hint"))] = hints.get(str(c.get("hint")), 0) + 1
            gaps["flexsp"].append(gap_parts(p, s, cost))
            step_plans = [p, q]
            for o in others:
                r = run_planner(o, s, cost, seed=seed, time_limit=tl, max_len=max_len)
                step_plans.append(r)
                mk[o].append(r.makespan_ms)
                if o == "greedy":
                    gaps["greedy"].append(gap_parts(r, s, cost))
                if p.makespan_ms > r.makespan_ms * (1 + 1e-9):
                    behind.append(f"step {k}: {o} {r.makespan_ms / p.makespan_ms - 1:+.2%}")
            # the packing bound, given the step's best plan (its compute time) as the upper limit
            bound = step_bound_ms(s, cost, step_plans)
            ratio_pack.append(p.makespan_ms / bound)
            ratio_pack_off.append(q.makespan_ms / bound)
        row = {
            "family": fam, "time_limit": tl, "solve_p50": float(np.percentile(solve, 50)),
            "solve_p95": float(np.percentile(solve, 95)), "solve_p95_off": float(np.percentile(solve_off, 95)),
            "x_lower_bound": float(np.mean(ratio)), "x_lower_bound_median": float(np.median(ratio)),
            "x_lower_bound_median_off": float(np.median(ratio_off)),
            "x_packing_bound_median": float(np.median(ratio_pack)),
            "x_packing_bound_median_off": float(np.median(ratio_pack_off)),
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
          f"makespan / packing bound (median; CP-SAT off) | CP-SAT gain (median, max) | {head} | behind | "
          f"groups per GPU | source |")
    print("|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(all_others) + "---:|---:|---|")
    for r in rows:
        sp = " | ".join(f"{r['speedup'][o]:.3f}x" if o in r["speedup"] else "n/a" for o in all_others)
        print(f"| {r['family']} | {r['solve_p50']:.2f} | {r['solve_p95']:.2f} | {r['x_lower_bound_median']:.3f} | "
              f"{r['x_lower_bound_median_off']:.3f} | {r['x_packing_bound_median']:.3f}; "
              f"{r['x_packing_bound_median_off']:.3f} | {r['cp_sat_gain_median']:+.2%}, {r['cp_sat_gain_max']:+.2%} | {sp} | "
              f"{len(r['behind'])} of {r['steps']} | {r['groups_per_gpu']:.2f} | {_fmt_counts(r['source'])} |", flush=True)
    print("\nCP-SAT calls: " + "; ".join(f"{r['family']}: {_fmt_counts(r['cp_sat_calls'])} (hint: "
                                        f"{_fmt_counts(r['hints'])})" for r in rows))
    late = [f"{r['family']}: {', '.join(r['behind'])}" for r in rows if r["behind"]]
    if late:
        print("\nBehind: " + "; ".join(late))
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
        p = plan_flexsp(s, cost, PlanOptions(seed=k, time_limit=time_limit))
        q = plan_flexsp(s, cost, PlanOptions(seed=k, time_limit=time_limit), cpsat=False)
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", default="8,64,256,1024")
    ap.add_argument("--seqs", default="128,512,2048,8192")
    ap.add_argument("--batch-tokens", type=int, default=None,
                    help="draw batches of this many tokens from each family instead of --seqs sequences")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--time-limit", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="8 and 64 GPUs x 128 and 512 sequences, 2 steps")
    ap.add_argument("--json", default=None)
    ap.add_argument("--summary-from", default=None, metavar="JSON",
                    help="print the summary table of an earlier run's --json file and exit")
    ap.add_argument("--small", type=int, default=0, metavar="N",
                    help="run the CP-SAT ablation on N small random instances instead")
    args = ap.parse_args()
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
            rows = run_cell(g, n, families, args.steps, args.time_limit, args.seed, others, args.batch_tokens)
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
