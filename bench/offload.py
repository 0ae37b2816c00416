"""The longest sequence a cluster holds, with and without offload, and what a step of it costs.

For Llama-3-8B (ZeRO-3, bf16, full recomputation, AdamW) on the ``h100-80g`` profile (its host figures
are datasheet estimates: docs/offload.md), prints per cluster and setting the longest single sequence
that plans (``CostModel.longest_sequence``): without offload at FlexSP's 0.7 memory fraction (what
plans used before), at the profile's 0.9, and with offload (``--offload auto``), then the plan of
that longest sequence (``flexsp``): step time, its GPU memory by part, its host memory, and what
offload adds to the step (the copies' exposed part and the tiled MLP's extra forward).

Then the 1M + 200K + 50K + 8K-token batch on 64 H100s with offload allowed (``auto``: it fits without
offload, so no group offloads its inputs, but a group may swap blocks, keeping their activations in
host memory instead of recomputing them) and without (``none``): step time, the blocks each group
swaps and the host memory it takes.

Usage: python bench/offload.py [--gpus 8,64] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench.scenario import Scenario  # noqa: E402

BASE = dict(model="llama3-8b", profile="h100-80g", recompute=True, zero_stage=3, planner="flexsp")
ISSUE_BATCH = "1000000,200000,50000,8000"


def longest(gpus: int) -> dict:
    """The three longest-sequence figures and the plan of the longest with offload."""
    per = min(8, gpus)
    out = {"gpus": gpus}
    for key, kw in (("none_0.7", dict(offload="none", memory_fraction=0.7)),
                    ("none_0.9", dict(offload="none")), ("auto_0.9", dict(offload="auto"))):
        sc = Scenario(num_gpus=gpus, gpus_per_node=per, source="1000", **BASE, **kw)
        out[key] = sc.cost().longest_sequence()
    n = out["auto_0.9"]
    sc = Scenario(num_gpus=gpus, gpus_per_node=per, source=str(n), **BASE)
    plan = sc.plan()
    cost = sc.cost()
    g = max((g for m in plan.micro_steps for g in m.groups), key=lambda g: g.memory_gb)
    parts = cost.memory_breakdown(g.lengths, g.degree, g.cp, g.offload)
    out.update(step_s=plan.makespan_ms / 1e3, group=f"{g.degree} ({g.split})", offload=g.offload,
               offload_s=float(cost.offload_ms(g.lengths, g.degree).sum()) / 1e3 if g.offload != "none" else 0.0,
               gpu=parts["gpu"], host_gb=parts["host"]["block inputs"], budget_gb=cost.memory_budget_gb,
               host_budget_gb=cost.host_budget_gb, host_link_gbps=cost.host_link_gbps)
    return out


def issue_batch() -> dict:
    """The 64-GPU batch's plan with offload allowed and not (same seed)."""
    out = {}
    for off in ("none", "inputs", "auto"):
        plan = Scenario(num_gpus=64, source=ISSUE_BATCH, offload=off, **BASE).plan()
        out[off] = {"step_ms": plan.makespan_ms, "lower_bound_ms": plan.lower_bound_ms,
                    "groups": [{"degree": g.degree, "split": g.split, "offload": g.offload, "swap_layers": g.swap_layers,
                                "host_gb": g.host_gb, "memory_gb": g.memory_gb} for m in plan.micro_steps for g in m.groups]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", default="8,64", help="cluster sizes (GPUs; nodes of 8)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    rows = [longest(int(x)) for x in args.gpus.split(",")]
    print("Llama-3-8B, ZeRO-3, bf16, --recompute, h100-80g: the longest single sequence that plans (tokens)")
    print(f"{'GPUs':>5} {'no offload, 0.7':>16} {'no offload, 0.9':>16} {'offload, 0.9':>14} {'x':>5} "
          f"{'step (s)':>9} {'group':>9} {'offload adds (s)':>17} {'host GB/GPU':>12}")
    for r in rows:
        print(f"{r['gpus']:>5} {r['none_0.7']:>16,} {r['none_0.9']:>16,} {r['auto_0.9']:>14,} "
              f"{r['auto_0.9'] / r['none_0.7']:>5.1f} {r['step_s']:>9,.0f} {r['group']:>9} {r['offload_s']:>17,.1f} "
              f"{r['host_gb']:>12,.1f}")
    for r in rows:
        parts = ", ".join(f"{k} {v:,.1f}" for k, v in r["gpu"].items())
        print(f"  {r['gpus']} GPUs, {r['auto_0.9']:,} tokens, GB per GPU: {parts} (80 in all; activations budget "
              f"{r['budget_gb']:.1f}); host {r['host_gb']:,.1f} of {r['host_budget_gb']:,.0f} per GPU, link "
              f"{r['host_link_gbps']:g} GB/s each")
    ib = issue_batch()
    print(f"\n{ISSUE_BATCH} tokens on 64 H100s (Llama-3-8B, ZeRO-3, --recompute, flexsp):")
    print(f"{'--offload':>10} {'step (ms)':>10} {'x none':>7} {'bound (ms)':>11}  groups (degree, split, offload, blocks "
          f"swapped, GPU GB, host GB per GPU)")
    for off, r in ib.items():
        groups = "; ".join(f"{g['degree']} {g['split']} {g['offload']} {g['swap_layers']} {g['memory_gb']:.1f} "
                           f"{g['host_gb']:.1f}" for g in r["groups"])
        print(f"{off:>10} {r['step_ms']:>10,.0f} {r['step_ms'] / ib['none']['step_ms']:>7.3f} {r['lower_bound_ms']:>11,.0f}  "
              f"{groups}")
    if args.json:
        Path(args.json).write_text(json.dumps({"longest": rows, "issue_batch": {k: v for k, v in ib.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
