"""The FlexSP planner's solve time and plan quality over cluster sizes, batch sizes and families.

For GPUs in {8, 64, 256, 1024} x sequences per step in {128, 512, 2048, 8192} x each length family
(7B, a100-40g-flexsp profile, max context = the largest power of two the cluster holds on one
group, at most the model's; lengths clipped to it), plans ``--steps`` batches with every planner
and prints one markdown table per (GPUs, sequences) cell: flexsp's solve time p50/p95, its mean
step time over the lower bound, and the speedup of flexsp over static-max, best-static,
min-degree, greedy and two-stage (ratio of mean step times; n/a when a planner is missing).

Usage: python bench/solver.py [--gpus 8,64,...] [--seqs 128,...] [--families a,b] [--steps K]
       [--time-limit S|auto] [--quick] [--json PATH] [--summary-from JSON]
``--time-limit auto`` gives flexsp 1 s up to 64 GPUs x 512 sequences, scaling with the problem
size up to 8 s at 1024 x 8192 (the baselines' own time counts: greedy alone takes ~5 s there).
Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from workbench.cli import default_max_len  # noqa: E402
from workbench.cost import CostModel  # noqa: E402
from workbench.data import synthetic_lengths  # noqa: E402
from workbench.solve import planner_names, run_planner, validate  # noqa: E402
from workbench.specs import ClusterSpec, get_model, load_profile  # noqa: E402

FAMILIES = ("wikipedia", "commoncrawl", "github", "byted")
OTHERS = ("static-max", "best-static", "min-degree", "greedy", "two-stage")


def auto_time_limit(gpus: int, seqs: int) -> float:
    size = gpus * seqs / (64 * 512)
    return float(min(8.0, max(1.0, size ** 0.5)))


def run_cell(gpus: int, seqs: int, families, steps: int, time_limit, seed: int, others):
    profile, model = load_profile("a100-40g-flexsp"), get_model("7b")
    cost = CostModel(profile, model, ClusterSpec(num_gpus=gpus))
    max_len = default_max_len(cost)
    tl = auto_time_limit(gpus, seqs) if time_limit == "auto" else float(time_limit)
    rows = []
    for fam in families:
        t0 = time.perf_counter()
        solve, ratio, mk = [], [], {p: [] for p in ("flexsp", *others)}
        statuses: dict[str, int] = {}
        sources: dict[str, int] = {}
        for k in range(steps):
            s = np.minimum(synthetic_lengths(fam, seqs, seed=seed + k), max_len)
            p = run_planner("flexsp", s, cost, seed=seed, time_limit=tl, max_len=max_len)
            validate(p, s, cost.cluster, cost)
            solve.append(p.solve_seconds)
            ratio.append(p.makespan_ms / p.lower_bound_ms)
            mk["flexsp"].append(p.makespan_ms)
            statuses[p.status] = statuses.get(p.status, 0) + 1
            src = str(p.stats.get("source", "?"))
            sources[src] = sources.get(src, 0) + 1
            for o in others:
                q = run_planner(o, s, cost, seed=seed, time_limit=tl, max_len=max_len)
                mk[o].append(q.makespan_ms)
        row = {
            "family": fam, "time_limit": tl, "solve_p50": float(np.percentile(solve, 50)),
            "solve_p95": float(np.percentile(solve, 95)), "x_lower_bound": float(np.mean(ratio)),
            "x_lower_bound_median": float(np.median(ratio)),
            "speedup": {o: float(np.mean(mk[o]) / np.mean(mk["flexsp"])) for o in others},
            "status": statuses, "source": sources,
        }
        rows.append(row)
        print(f"# {gpus} GPUs x {seqs} seqs, {fam}: {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    return rows


def print_cell(gpus, seqs, rows, all_others):
    tl = rows[0]["time_limit"] if rows else 0
    print(f"\n### {gpus} GPUs x {seqs} sequences per step (flexsp time limit {tl:g}s)\n")
    head = " | ".join(f"vs {o}" for o in all_others)
    print(f"| family | solve p50 (s) | solve p95 (s) | makespan / LB | {head} | status | source |")
    print("|---|---:|---:|---:|" + "---:|" * len(all_others) + "---|---|")
    for r in rows:
        sp = " | ".join(f"{r['speedup'][o]:.3f}x" if o in r["speedup"] else "n/a" for o in all_others)
        st = ", ".join(f"{k} {v}" for k, v in sorted(r["status"].items()))
        so = ", ".join(f"{k} {v}" for k, v in sorted(r["source"].items()))
        print(f"| {r['family']} | {r['solve_p50']:.2f} | {r['solve_p95']:.2f} | {r['x_lower_bound']:.3f} | {sp} | "
              f"{st} | {so} |", flush=True)


def print_summary(out: dict, all_others) -> None:
    """One row per (GPUs, sequences) cell over the families: the worst p95 solve time, the range of
    makespan / LB, and the range of flexsp's speedup over each other planner ("behind" where any
    family has flexsp more than 0.05% slower)."""
    print("\n### Summary: one row per cell, ranges over the families\n")
    head = " | ".join(f"vs {o}" for o in all_others)
    print(f"| GPUs x seqs | limit (s) | worst p95 solve (s) | makespan / LB | {head} |")
    print("|---|---:|---:|---:|" + "---:|" * len(all_others))
    for cell, rows in out.items():
        if not rows:
            continue
        lbr = [r["x_lower_bound"] for r in rows]
        cols = []
        for o in all_others:
            sp = [r["speedup"][o] for r in rows if o in r["speedup"]]
            if not sp:
                cols.append("n/a")
                continue
            flag = " (behind)" if min(sp) < 1 - 5e-4 else ""
            cols.append(f"{min(sp):.2f}-{max(sp):.2f}x{flag}")
        print(f"| {cell.replace('x', ' x ')} | {rows[0]['time_limit']:.3g} | {max(r['solve_p95'] for r in rows):.2f} | "
              f"{min(lbr):.3f}-{max(lbr):.3f} | " + " | ".join(cols) + " |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", default="8,64,256,1024")
    ap.add_argument("--seqs", default="128,512,2048,8192")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--time-limit", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="8 and 64 GPUs x 128 and 512 sequences, 2 steps")
    ap.add_argument("--json", default=None)
    ap.add_argument("--summary-from", default=None, metavar="JSON",
                    help="print the summary table of an earlier run's --json file and exit")
    args = ap.parse_args()
    if args.summary_from:
        print_summary(json.loads(Path(args.summary_from).read_text()), list(OTHERS))
        return 0
    if args.quick:
        args.gpus, args.seqs, args.steps = "8,64", "128,512", 2
    gpus = [int(x) for x in args.gpus.split(",")]
    seqs = [int(x) for x in args.seqs.split(",")]
    families = args.families.split(",")
    known = set(planner_names())
    if "flexsp" not in known:
        print("flexsp is not available (OR-Tools missing?)", file=sys.stderr)
        return 1
    others = [o for o in OTHERS if o in known]
    print(f"# flexsp: 7B on A100-40G (a100-40g-flexsp), {args.steps} steps per family, time limit {args.time_limit}; "
          f"speedup = baseline mean step / flexsp mean step")
    out = {}
    for g in gpus:
        for n in seqs:
            rows = run_cell(g, n, families, args.steps, args.time_limit, args.seed, others)
            print_cell(g, n, rows, list(OTHERS))
            out[f"{g}x{n}"] = rows
    if len(out) > 1:
        print_summary(out, list(OTHERS))
    if args.json:
        from workbench.util import write_json_atomic

        write_json_atomic(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
