"""Groups of any size (issue 35): what shapes that are not powers of two buy, and what they cost.

Three tables, all planned by ``flexsp`` at effort 1 (deterministic), Llama-3-8B on ``h100-80g``,
ZeRO-3, ``--recompute``:

1. **The issue's rows**: the batch of 1M, 200K, 50K and 8K tokens on 48 GPUs (6 nodes of 8), 24 (3
   nodes of 8) and 64, and 100K, 30K, 8K, 8K, 4K on 6 GPUs (one node of 6), planned with the powers of
   two that the tool used before (those whose aligned groups fit the nodes) and with the default
   candidate degrees now (``workbench.specs.candidate_degrees``), under ``--offload none`` (the
   issue's setting: it predates offload) and ``auto`` (today's default): step, its lower bound and
   gap, the idle GPU-time share, the solve time, the groups.
2. **Which candidate set**: mean step and mean solve time over a few clusters and batches for three
   sets: the powers of two, the default (degrees dividing a node, whole nodes in ``2^a`` and
   ``3 x 2^a``, the cluster) and every multiple of the node size (the issue's example), so the
   trade-off between solve time and plan quality is measured, not assumed.
3. With ``--families``: sampled batches (``--steps`` per family, 2M tokens clipped at 1M) on 48 and
   64 GPUs, powers of two against the default: where the new shapes shorten plans, by how much.

Usage: python bench/any_size.py [--effort E] [--families a,b] [--steps K] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from workbench.data import synthetic_lengths  # noqa: E402
from workbench.scenario import Scenario  # noqa: E402
from workbench.solve import run_planner  # noqa: E402
from workbench.specs import candidate_degrees  # noqa: E402

BIG = [1_048_576, 204_800, 51_200, 8_192]
SMALL = [102_400, 30_720, 8_192, 8_192, 4_096]
ROWS = [  # (GPUs, per node, batch, the step the issue measured before (ms))
    (48, 8, BIG, 89_878.0),
    (24, 8, BIG, 179_130.0),
    (6, 6, SMALL, 19_646.0),
    (64, 8, BIG, 47_630.0),
]


def pow2_degrees(n: int, g: int) -> tuple[int, ...]:
    """The candidate degrees before issue 35: powers of two up to n whose aligned groups fit the nodes."""
    out, d = [], 1
    while d <= n:
        if g % d == 0 or d % g == 0:
            out.append(d)
        d *= 2
    return tuple(out)


def node_multiples(n: int, g: int) -> tuple[int, ...]:
    """The issue's example: every degree up to a node, every multiple of the node size, the cluster."""
    if n <= g:
        return tuple(range(1, n + 1))
    return tuple(sorted({d for d in range(1, g + 1) if g % d == 0} | set(range(g, n + 1, g)) | {n}))


SETS = {"powers of two": pow2_degrees, "default": candidate_degrees, "node multiples": node_multiples}


def scenario(n: int, g: int, degrees, offload: str, max_len: int = 1_048_576) -> Scenario:
    return Scenario(num_gpus=n, gpus_per_node=g, model="llama3-8b-1m", profile="h100-80g", gpu_memory_gb=80,
                    zero_stage=3, recompute=True, degrees=tuple(degrees), offload=offload, max_len=max_len)


def plan_row(n, g, lengths, degrees, offload, effort) -> dict:
    cost = scenario(n, g, degrees, offload).cost()
    t = time.perf_counter()
    p = run_planner("flexsp", np.asarray(lengths), cost, seed=0, effort=effort)
    solve = time.perf_counter() - t
    shapes: dict[str, int] = {}
    for ms in p.micro_steps:
        for grp in ms.groups:
            key = f"{grp.degree}" + (f" ({grp.ulysses}x{grp.cp})" if grp.cp > 1 else "")
            shapes[key] = shapes.get(key, 0) + 1
    used = {r for ms in p.micro_steps for grp in ms.groups for r in grp.ranks}
    return {"step_ms": p.makespan_ms, "bound_ms": p.lower_bound_ms, "gap": p.gap, "idle": p.idle_share,
            "idle_gpus": n - len(used), "solve_s": solve, "groups": shapes, "passes": len(p.micro_steps),
            "chains": p.stats.get("chains")}


def table_rows(effort: float) -> list[dict]:
    out = []
    print("## 1. The issue's rows (flexsp, effort 1; Llama-3-8B, h100-80g, ZeRO-3, --recompute)\n")
    print("| GPUs | batch | offload | degrees | step (ms) | vs powers of two | vs the issue's | gap to own bound "
          "| idle GPU-time | GPUs in no group | solve (s) | groups |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for n, g, lengths, before in ROWS:
        for offload in ("none", "auto"):
            base = None
            for name in ("powers of two", "default"):
                r = plan_row(n, g, lengths, SETS[name](n, g), offload, effort)
                base = base or r["step_ms"]
                r.update(gpus=n, per_node=g, lengths=lengths, offload=offload, degrees=name, issue_ms=before)
                out.append(r)
                groups = ", ".join(f"{k} x{v}" if v > 1 else k for k, v in r["groups"].items())
                print(f"| {n} ({n // g if n > g else 1}x{min(n, g)}) | {len(lengths)} seqs | {offload} | {name} | "
                      f"{r['step_ms']:,.0f} | {r['step_ms'] / base:.3f} | {r['step_ms'] / before:.3f} | {r['gap']:.1%} | "
                      f"{r['idle']:.1%} | {r['idle_gpus']} | {r['solve_s']:.2f} | {groups} |", flush=True)
    return out


def table_sets(effort: float) -> list[dict]:
    clusters = [(24, 8), (40, 8), (48, 8), (64, 8), (96, 8), (12, 4), (6, 6)]
    batches = {"1M+200K+50K+8K": BIG, "github 2M": None}
    out = []
    print("\n## 2. Which candidate degrees: mean step and solve time over the clusters "
          f"{', '.join(f'{n}/{g}' for n, g in clusters)} (offload auto)\n")
    print("| set | batch | mean step vs powers of two | worst | best | mean solve (s) | max solve (s) | mean degrees | mean chains |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for bname, lengths in batches.items():
        base: dict[tuple[int, int], float] = {}
        for name, fn in SETS.items():
            ratios, solves, ndeg, nchains = [], [], [], []
            for n, g in clusters:
                s = lengths if lengths is not None else np.minimum(
                    _batch("github", 2_000_000, seed=n), 1_048_576).tolist()
                degrees = fn(n, g)
                r = plan_row(n, g, s, degrees, "auto", effort)
                base.setdefault((n, g), r["step_ms"])
                ratios.append(r["step_ms"] / base[(n, g)])
                solves.append(r["solve_s"])
                ndeg.append(len(degrees))
                nchains.append(len(r["chains"] or [None]))
                out.append({"set": name, "batch": bname, "gpus": n, "per_node": g, **r})
            print(f"| {name} | {bname} | {np.mean(ratios):.3f} | {max(ratios):.3f} | {min(ratios):.3f} | "
                  f"{np.mean(solves):.2f} | {max(solves):.2f} | {np.mean(ndeg):.1f} | {np.mean(nchains):.1f} |", flush=True)
    return out


def _batch(family: str, tokens: int, seed: int) -> np.ndarray:
    """Sequences of ``family`` drawn until ``tokens`` (the last one cut to fit), seeded."""
    pool = synthetic_lengths(family, 4096, seed=seed)
    pool = np.minimum(pool, 1_048_576)
    k = int(np.searchsorted(np.cumsum(pool), tokens)) + 1
    out = pool[:k].copy()
    out[-1] -= max(0, int(out.sum()) - tokens)
    return out[out > 0]


def table_families(families, steps: int, effort: float) -> list[dict]:
    out = []
    print("\n## 3. Sampled batches (2M tokens clipped at 1M), powers of two against the default (offload auto)\n")
    print("| GPUs | family | steps | mean step, powers of two (s) | mean step, default (s) | ratio | steps shorter | longest |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for n, g in ((48, 8), (64, 8)):
        for fam in families:
            a, b = [], []
            for k in range(steps):
                s = _batch(fam, 2_000_000, seed=1000 * k + n).tolist()
                a.append(plan_row(n, g, s, pow2_degrees(n, g), "auto", effort)["step_ms"])
                b.append(plan_row(n, g, s, candidate_degrees(n, g), "auto", effort)["step_ms"])
            r = [y / x for x, y in zip(a, b)]
            out.append({"gpus": n, "family": fam, "pow2_ms": a, "default_ms": b})
            print(f"| {n} | {fam} | {steps} | {np.mean(a) / 1e3:.2f} | {np.mean(b) / 1e3:.2f} | {np.mean(b) / np.mean(a):.3f} "
                  f"| {sum(x < 1 - 1e-9 for x in r)} | {max(r):.4f} |", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--effort", type=float, default=1.0)
    ap.add_argument("--families", default="", help="comma-separated families for table 3 (default: none)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    res = {"rows": table_rows(args.effort), "sets": table_sets(args.effort)}
    if args.families:
        res["families"] = table_families([f for f in args.families.split(",") if f], args.steps, args.effort)
    print(f"\n{time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
