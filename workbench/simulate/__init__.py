"""Replay planners over K steps of a dataset against the cost model.

``simulate`` draws K global batches (the same batches for every planner), plans each with every
planner, replays each plan's timeline and reports, per planner and step: makespan, lower bound,
per-GPU busy and idle time and the imbalance ratio (compute makespan / mean GPU busy time).
Everything returned is plain data a panel can draw. Pure numpy: no torch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from workbench.cost import CostModel
from workbench.solve import Plan, run_planner, timeline, validate
from workbench.solve.effort import DEFAULT_EFFORT
from workbench.solve.options import Cancelled

__all__ = ["simulate", "step_record", "SimulationResult", "summarize_steps", "summary_table"]


def step_record(plan: Plan, step: int) -> dict:
    """Per-step figures of one plan: makespan, lower bound, busy/idle per GPU, imbalance."""
    tl = timeline(plan)
    busy = np.asarray(tl["rank_busy_ms"])
    end = tl["compute_end_ms"]
    mean_busy = float(busy.mean()) if busy.size else 0.0
    return {
        "step": step,
        "batch_id": plan.batch_id,
        "makespan_ms": plan.makespan_ms,
        "lower_bound_ms": plan.lower_bound_ms,
        "compute_end_ms": end,
        "grad_sync_ms": plan.grad_sync_ms,
        "mean_busy_ms": mean_busy,
        "idle_ms": float((end - busy).sum()),
        "imbalance": end / mean_busy if mean_busy > 0 else 1.0,
        "micro_steps": len(plan.micro_steps),
        "groups": sum(len(m.groups) for m in plan.micro_steps),
        "degrees": sorted({g.degree for m in plan.micro_steps for g in m.groups}),
        "solve_seconds": plan.solve_seconds,
        "status": plan.status,
        "rank_busy_ms": busy.tolist(),
    }


def summarize_steps(records: Sequence[dict]) -> dict:
    """Summary of a planner's steps: the ``workbench simulate --json`` per-planner shape."""
    ms = np.array([r["makespan_ms"] for r in records], dtype=float)
    lb = np.array([r["lower_bound_ms"] for r in records], dtype=float)
    solve = np.array([r["solve_seconds"] for r in records], dtype=float)
    return {
        "mean_step_ms": float(ms.mean()),
        "p50_step_ms": float(np.percentile(ms, 50)),
        "p95_step_ms": float(np.percentile(ms, 95)),
        "imbalance": float(np.mean([r["imbalance"] for r in records])),
        "lower_bound_ms": float(lb.mean()),
        "ratio_to_lower_bound": float((ms / lb).mean()),
        "solve_seconds_p50": float(np.percentile(solve, 50)),
        "solve_seconds_p95": float(np.percentile(solve, 95)),
        "steps": len(records),
    }


@dataclass
class SimulationResult:
    """Per-planner step records and summaries (``to_dict`` is plain JSON)."""

    planners: dict[str, dict] = field(default_factory=dict)
    steps: dict[str, list[dict]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    batches: list[dict] = field(default_factory=list)
    plans: dict[str, list[dict]] = field(default_factory=dict)
    config: dict = field(default_factory=dict)

    def speedup(self, planner: str, baseline: str) -> float:
        """Mean step time of ``baseline`` over that of ``planner``."""
        return self.planners[baseline]["mean_step_ms"] / self.planners[planner]["mean_step_ms"]

    def to_dict(self, include_steps: bool = True) -> dict:
        out = {"planners": self.planners, "config": self.config}
        if self.errors:
            out["errors"] = self.errors
        if include_steps:
            out["steps"] = {k: [{x: y for x, y in r.items() if x != "rank_busy_ms"} for r in v]
                            for k, v in self.steps.items()}
            out["batches"] = self.batches
        return out


def simulate(
    batches: Sequence[np.ndarray] | Sequence[tuple[str, np.ndarray]],
    cost: CostModel,
    planners: Sequence[str],
    *,
    seed: int = 0,
    effort: float = DEFAULT_EFFORT,
    time_limit: float | None = None,
    max_len: int | None = None,
    keep_plans: bool = False,
    check: bool = True,
    progress: Callable[[float, str], None] | None = None,
    cancel=None,
) -> SimulationResult:
    """Plan every batch with every planner and replay the plans.

    ``batches`` are arrays of lengths, or ``(batch_id, lengths)`` pairs. A planner that cannot plan
    a batch (e.g. a static degree too small for its longest sequence) is reported in ``errors``
    with its message, and left out of ``planners``; other planners go on. Raises Cancelled when
    ``cancel`` is set, ValueError on an unknown planner name.
    """
    items = [(b if isinstance(b, tuple) else (f"b{k:06d}", np.asarray(b))) for k, b in enumerate(batches)]
    res = SimulationResult()
    res.config = {"planners": list(planners), "steps": len(items), "num_gpus": cost.cluster.num_gpus,
                  "model": cost.model.name, "profile": cost.profile.name, "strategy": cost.strategy,
                  "memory_budget_gb": cost.memory_budget_gb, "seed": seed, "effort": effort, "time_limit": time_limit}
    res.batches = [{"batch_id": bid, "sequences": int(len(s)), "tokens": int(np.sum(s)), "max": int(np.max(s))}
                   for bid, s in items]
    total = max(1, len(items) * len(planners))
    done = 0
    t_start = time.perf_counter()
    for name in planners:
        recs: list[dict] = []
        plans: list[dict] = []
        for k, (bid, s) in enumerate(items):
            if cancel is not None and cancel.is_set():
                raise Cancelled("simulation was cancelled")
            try:
                plan = run_planner(name, s, cost, seed=seed + k, effort=effort, time_limit=time_limit, max_len=max_len,
                                   cancel=cancel, batch_id=bid)
            except Cancelled:
                raise
            except ValueError as e:
                res.errors[name] = str(e)
                break
            if check:
                validate(plan, s, cost.cluster, cost)
            recs.append(step_record(plan, k))
            if keep_plans:
                plans.append(plan.to_dict())
            done += 1
            if progress is not None:
                el = time.perf_counter() - t_start
                progress(done / total, f"{name}: step {k + 1}/{len(items)} {plan.makespan_ms:,.0f} ms "
                                       f"({el:.1f}s elapsed)")
        if name in res.errors:
            done += len(items) - len(recs)
            continue
        res.steps[name] = recs
        res.planners[name] = summarize_steps(recs)
        if keep_plans:
            res.plans[name] = plans
    return res


def summary_table(sim: dict, baselines: Sequence[str] = ("static-max", "best-static")) -> str:
    """A plain-text table of a simulation summary (``SimulationResult.to_dict()``): mean and p95
    step time, ratio to the lower bound, imbalance and the speedup over each baseline."""
    rows = sim["planners"]
    head = f"{'planner':<14}{'mean step (s)':>14}{'p95 (s)':>9}{'x lower bound':>14}{'imbalance':>10}"
    bl = [b for b in baselines if b in rows]
    head += "".join(f"{'vs ' + b:>17}" for b in bl)
    lines = [head]
    for name, r in rows.items():
        line = (f"{name:<14}{r['mean_step_ms'] / 1e3:>14.2f}{r['p95_step_ms'] / 1e3:>9.2f}"
                f"{r['ratio_to_lower_bound']:>14.3f}{r['imbalance']:>10.2f}")
        line += "".join(f"{rows[b]['mean_step_ms'] / r['mean_step_ms']:>16.2f}x" for b in bl)
        lines.append(line)
    return "\n".join(lines)
