"""Baseline planners vs the lower bound, per length family, at 64 GPUs, 7B, a100-40g-flexsp.

Two settings (issue 2):
  A. 128K max context, 1M-token global batches;
  B. 384K max context, 512 sequences per step. No layout holds a 384K sequence of the 7B model
     on 64 A100-40G without recomputation (4.48 MB/token of activations: 27.5 GB per GPU even over
     all 64, and Ulysses stops at the model's 32 heads), so B runs with full recomputation.

Prints, per family and planner: mean step time, its ratio to the lower bound, and the speedup over
static-max and best-static. Usage: python bench/planners.py [--steps K] [--time-limit S]
[--families a,b] [--planners a,b] [--json PATH]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench.scenario import Scenario  # noqa: E402
from workbench.solve import planner_names  # noqa: E402
from workbench.util import write_json_atomic  # noqa: E402

FAMILIES = ("wikipedia", "commoncrawl", "github", "byted")
PLANNERS = ("static-max", "best-static", "min-degree", "greedy", "two-stage", "flexsp")
SETTINGS = {
    "A: 128K ctx, 1M-token batch": dict(max_len=131072, batch_tokens=1_000_000, batch_size=None, recompute=False),
    "B: 384K ctx, 512 seqs, recompute": dict(max_len=393216, batch_tokens=None, batch_size=512, recompute=True),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--effort", "--time-limit", dest="time_limit", type=float, default=1.0)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--planners", default=",".join(PLANNERS))
    ap.add_argument("--samples", type=int, default=200_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write all figures to this JSON file")
    args = ap.parse_args()
    known = set(planner_names())
    planners = [p for p in args.planners.split(",") if p in known]
    missing = [p for p in args.planners.split(",") if p not in known]
    if missing:
        print(f"# planners not available here: {', '.join(missing)}", file=sys.stderr)
    out = {}
    print(f"# 7B on 64x A100-40G (profile a100-40g-flexsp), {args.steps} steps per row, solver limit {args.time_limit}s")
    for setting, cfg in SETTINGS.items():
        print(f"\n## {setting}\n")
        print("| family | planner | mean step (s) | x lower bound | vs static-max | vs best-static | solve p95 (s) |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for fam in args.families.split(","):
            t0 = time.perf_counter()
            sc = Scenario(model="7b", profile="a100-40g-flexsp", num_gpus=64, source=fam, samples=args.samples,
                          seed=args.seed, max_len=cfg["max_len"], policy="clip", batch_tokens=cfg["batch_tokens"],
                          batch_size=cfg["batch_size"], recompute=cfg["recompute"], effort=args.time_limit)
            res = sc.simulate(planners, steps=args.steps)
            rows = res.planners
            for name, r in rows.items():
                if r["mean_step_ms"] < r["lower_bound_ms"] * (1 - 1e-9):
                    raise SystemExit(f"{fam}/{name}: mean step below the lower bound: the bound or the planner is wrong")
                def vs(b, r=r, rows=rows):
                    return f"{rows[b]['mean_step_ms'] / r['mean_step_ms']:.2f}x" if b in rows else "-"
                print(f"| {fam} | {name} | {r['mean_step_ms'] / 1e3:.2f} | {r['ratio_to_lower_bound']:.3f} | "
                      f"{vs('static-max')} | {vs('best-static')} | {r['solve_seconds_p95']:.2f} |")
            for name, err in res.errors.items():
                print(f"| {fam} | {name} | could not plan: {err} | | | | |")
            out.setdefault(setting, {})[fam] = res.to_dict(include_steps=False)
            print(f"# {fam}: {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    if args.json:
        write_json_atomic(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
