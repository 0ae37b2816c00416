"""How groups split their attention: Ulysses only, context parallelism only, or each group its own.

For each length family (the four of ``bench/solver.py`` and ``longctx``: ProLong's long-context
continued-training mix, 60% of the tokens in documents of 64K to 1M tokens; ``workbench.data``),
plans ``--steps`` batches with ``flexsp`` under three strategies of the cost model:

- ``ulysses``: every group Ulysses over all its ranks (capped by the heads: a sequence that needs a
  wider group cannot run, and is counted, then left out of that strategy's step);
- ``cp``: every group context parallelism over all its ranks (K/V all-gathered);
- ``auto``: every group its fastest split ``u x cp`` that fits (the default).

Two settings: Llama-3-8B (32 query, 8 KV heads; ``llama3-8b-1m``, its context extended to 1M) on 64
H100-80G (``h100-80g``), 2M-token batches clipped at 1M, and 7B (Llama-2 shape, 32 heads and 32 KV
heads: no GQA) on 64 A100-40G (``a100-40g-flexsp``), 1M-token batches clipped at 256K; ZeRO-3 with
full recomputation. Plus the batch of the issue: 1M, 200K, 50K and 8K tokens on the first setting.
Prints per family the mean step time of each strategy (seconds), ``auto``'s speedup over the
better of the two others, the sequences ``ulysses`` cannot run, and the splits ``auto``'s groups of
8 GPUs or more took. ``--bounds`` adds what is left: each ``auto`` plan over the step bound
(``step_bound_ms``: the largest of the lower, packing and lockstep pass bounds; 5-60 s a step on 2
cores), the median and the largest per family.

Usage: python bench/strategies.py [--steps K] [--families a,b] [--effort E] [--bounds] [--json PATH]
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

from workbench.scenario import Scenario  # noqa: E402
from workbench.solve import run_planner  # noqa: E402
from workbench.solve.bound import step_bound_ms  # noqa: E402

FAMILIES = ("wikipedia", "commoncrawl", "github", "byted", "longctx")
STRATEGIES = ("auto", "ulysses", "cp")
SETTINGS = {
    "llama3-8b, 64 H100-80G": dict(model="llama3-8b-1m", profile="h100-80g", gpu_memory_gb=80, max_len=1_048_576,
                                   batch_tokens=2_000_000),
    "7b (no GQA), 64 A100-40G": dict(model="7b", profile="a100-40g-flexsp", max_len=262_144, batch_tokens=1_000_000),
}
ISSUE_BATCH = [1_000_000, 200_000, 50_000, 8_000]


def _plan(sc: Scenario, s: np.ndarray, strategy: str, effort: float, bound: bool = False) -> dict:
    cost = sc.replace(strategy=strategy).cost()
    ok = cost.min_degree(s) > 0
    p = run_planner("flexsp", s[ok], cost, effort=effort, seed=sc.seed)
    over = float(p.makespan_ms / step_bound_ms(s[ok], cost, [p])) if bound else None
    splits: dict[str, int] = {}
    for ms in p.micro_steps:
        for g in ms.groups:
            if g.degree >= 8:
                splits[g.split] = splits.get(g.split, 0) + 1
    return {"step_s": p.makespan_ms / 1e3, "cannot_run": [int(x) for x in s[~ok]], "solve_s": p.solve_seconds,
            "splits": splits, "passes": len(p.micro_steps), "over_bound": over}


def run(families, steps: int, effort: float, seed: int = 0, bounds: bool = False) -> dict:
    out: dict = {"settings": {}, "issue_batch": None}
    for name, kw in SETTINGS.items():
        base = Scenario(num_gpus=64, zero_stage=3, recompute=True, source="wikipedia", samples=200_000, seed=seed,
                        policy="clip", strategy="auto", **kw)
        rows = []
        for fam in families:
            sc = base.replace(source=fam)
            per = {st: [] for st in STRATEGIES}
            for b in sc.batches(steps):
                s = np.asarray(b.lengths, dtype=np.int64)
                for st in STRATEGIES:
                    per[st].append(_plan(sc, s, st, effort, bound=bounds and st == "auto"))
            mean = {st: float(np.mean([r["step_s"] for r in per[st]])) for st in STRATEGIES}
            splits: dict[str, int] = {}
            for r in per["auto"]:
                for k, v in r["splits"].items():
                    splits[k] = splits.get(k, 0) + v
            rows.append({"family": fam, "steps": steps, **{f"{st}_s": mean[st] for st in STRATEGIES},
                         "speedup_over_better": min(mean["ulysses"], mean["cp"]) / mean["auto"],
                         "ulysses_cannot_run": sum(len(r["cannot_run"]) for r in per["ulysses"]),
                         "ulysses_cannot_run_max": max((max(r["cannot_run"]) for r in per["ulysses"] if r["cannot_run"]),
                                                       default=None),
                         "auto_never_slower": all(a["step_s"] <= min(u["step_s"], c["step_s"]) * (1 + 1e-9)
                                                  for a, u, c in zip(per["auto"], per["ulysses"], per["cp"])),
                         "auto_splits": splits, "solve_s_max": max(r["solve_s"] for st in STRATEGIES for r in per[st]),
                         "auto_over_bound": ([r["over_bound"] for r in per["auto"]] if bounds else None)})
            print(f"# {name}: {fam} done", file=sys.stderr, flush=True)
        out["settings"][name] = rows
    base = Scenario(num_gpus=64, zero_stage=3, recompute=True, source=",".join(map(str, ISSUE_BATCH)), seed=seed,
                    strategy="auto", **{k: v for k, v in SETTINGS["llama3-8b, 64 H100-80G"].items()
                                        if k not in ("max_len", "batch_tokens")})
    s = np.asarray(ISSUE_BATCH, dtype=np.int64)
    out["issue_batch"] = {st: _plan(base, s, st, effort) for st in STRATEGIES}
    return out


def print_tables(out: dict) -> None:
    for name, rows in out["settings"].items():
        bounds = any(r.get("auto_over_bound") for r in rows)
        print(f"\n### {name}, ZeRO-3, recompute: mean step (s) by strategy\n")
        print("| family | steps | auto | ulysses only | cp only | auto vs the better | ulysses cannot run | "
              "auto never slower | auto's splits (groups of 8+ GPUs) |" + (" auto / step bound: median (largest) |"
                                                                           if bounds else ""))
        print("|---|---:|---:|---:|---:|---:|---|---|---|" + ("---:|" if bounds else ""))
        for r in rows:
            ob = r.get("auto_over_bound")
            tail = f" {float(np.median(ob)):.3f} ({max(ob):.3f}) |" if ob else ""
            cant = (f"{r['ulysses_cannot_run']} (longest {r['ulysses_cannot_run_max']:,})" if r["ulysses_cannot_run"]
                    else "none")
            sp = ", ".join(f"{k}: {v}" for k, v in sorted(r["auto_splits"].items(), key=lambda kv: -kv[1]))
            print(f"| {r['family']} | {r['steps']} | {r['auto_s']:.2f} | {r['ulysses_s']:.2f} | {r['cp_s']:.2f} | "
                  f"{r['speedup_over_better']:.2f}x | {cant} | {'yes' if r['auto_never_slower'] else 'NO'} | {sp} |" + tail)
    ib = out["issue_batch"]
    print("\n### The batch of 1M, 200K, 50K and 8K tokens (Llama-3-8B, 64 H100-80G, ZeRO-3, recompute)\n")
    print("| strategy | step (s) | vs ulysses only | passes | splits (groups of 8+ GPUs) |")
    print("|---|---:|---:|---:|---|")
    for st in STRATEGIES:
        r = ib[st]
        sp = ", ".join(f"{k}: {v}" for k, v in r["splits"].items())
        print(f"| {st} | {r['step_s']:.1f} | {r['step_s'] / ib['ulysses']['step_s']:.2f}x | {r['passes']} | {sp} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--effort", type=float, default=1.0, help="flexsp's effort per step (reference seconds)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bounds", action="store_true", help="also each auto plan over the step bound (slower)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    out = run([f.strip() for f in args.families.split(",") if f.strip()], args.steps, args.effort, args.seed,
              bounds=args.bounds)
    print(f"# strategies: flexsp effort {args.effort:g} per step, {args.steps} steps per family; "
          f"{time.strftime('%Y-%m-%d %H:%M')}, load {os.getloadavg()[0]:.1f}, {time.perf_counter() - t0:.0f} s")
    print_tables(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
