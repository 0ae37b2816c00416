"""How well a profile predicts a real training run: pure (numpy), reads only the run store.

For every step of a finished (or running) ``workbench train`` run, the plan it executed
(``plans.jsonl``) is re-timed with the cost model of the profile under test (the run's own ZeRO
stage, precision, optimizer, strategy and recomputation), and compared with what the ranks
measured (``metrics.jsonl``):

- **group** (free execution, ZeRO 0-2: one SP group in one micro-step): predicted = the group's
  overhead plus its sequences' times; measured = the *shortest* of its ranks' micro-step times.
  Micro-steps run barrier-free, so a rank that arrives early waits inside the group's first
  collective and its time includes that wait; the last rank to arrive waits for nobody, so the
  shortest time is the group's own.
- **pass** (lockstep execution, ZeRO-3: one FSDP forward and backward every rank joins): predicted
  = the cost model's pass (its slowest rank's load, FSDP's collectives, the pass's fixed cost);
  measured = the *longest* of the ranks' times for it (ranks leave a pass together, at its last
  reduce-scatter; the one that started it last measured the least).
- **step**: predicted = the plan's timeline replayed with the re-timed groups or passes, plus the
  gradient reduction and the optimizer step (the planner's makespan), plus, on a CPU run planning
  ahead with no core to spare (ranks on this node >= cores), the next plan's solve time divided by
  the cores (the worker solves it on the ranks' cores while the step trains); measured = the
  slowest rank's ``measured_ms`` (micro-steps or passes, the reduction and the optimizer step). The
  optimizer and the reduction are also compared on their own.

Errors are absolute percentage errors, ``100 |predicted - measured| / measured``; the first
``skip`` steps (start-up: allocator, thread pools, first collectives, the optimizer's state) are
left out when there are more.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from workbench.profile.fit import ape, error_summary

__all__ = ["check_fidelity", "fidelity_table", "retime_plan"]


def _profile(obj: Any):
    from workbench.specs import HardwareProfile, load_profile

    if isinstance(obj, HardwareProfile):
        return obj
    if hasattr(obj, "profile") and isinstance(obj.profile, HardwareProfile):  # a ProfileResult
        return obj.profile
    if hasattr(obj, "path") and hasattr(obj, "status"):  # a runs.Run (its folder holds profile.json)
        return load_profile(obj.path)
    return load_profile(obj)


def _latest_by_step(rows: list[dict]) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for r in rows:
        s = r.get("step")
        if isinstance(s, int) and (s not in out or int(r.get("attempt") or 1) >= int(out[s].get("attempt") or 1)):
            out[s] = r
    return out


def retime_plan(plan, cost):
    """``plan`` with every group's time, every lockstep pass and the step's end re-timed by
    ``cost`` (a CostModel of the run's cluster and stage): the plan this profile would have made
    of the same assignment. Returns the new Plan (its ``makespan_ms`` from the replayed timeline)."""
    from workbench.solve.plan import group_time, pass_loads, timeline

    lockstep = plan.execution == "lockstep"
    new_ms = []
    for ms in plan.micro_steps:
        groups = []
        for g in ms.groups:
            t = group_time(cost, np.asarray(g.lengths, dtype=np.int64), g.degree, list(range(len(g.lengths))), g.cp)
            groups.append(dataclasses.replace(g, time_ms=t))
        new_ms.append(dataclasses.replace(ms, groups=tuple(groups), time_ms=None))
    out = dataclasses.replace(plan, micro_steps=tuple(new_ms), grad_sync_ms=cost.grad_sync_ms(),
                              optimizer_ms=cost.optimizer_ms(),
                              shared_overhead_ms=cost.call_overhead_ms() if lockstep else 0.0,
                              pass_comm_ms=cost.pass_comm_ms(), pass_overhead_ms=cost.pass_overhead_ms())
    if lockstep:
        passes = [dataclasses.replace(ms, time_ms=cost.pass_ms(float(load.max()) if load.size else 0.0))
                  for ms, load in zip(out.micro_steps, pass_loads(out))]
        out = dataclasses.replace(out, micro_steps=tuple(passes))
    return dataclasses.replace(out, makespan_ms=timeline(out)["makespan_ms"])


def check_fidelity(profile_or_path, train_run, *, skip: int = 1, root: str | Path | None = None) -> dict:
    """Predicted (by ``profile_or_path``: a HardwareProfile, ProfileResult, profile run, shipped
    name or JSON path) against measured step, group (free execution) and pass (lockstep) times of
    ``train_run`` (a Run, folder or id). Returns plain data::

        {"profile", "profile_kind", "run", "planner", "world_size", "model", "execution", "zero_stage",
         "skipped_steps",
         "steps": [{step, predicted_ms, measured_ms, run_predicted_ms, optimizer_ms, predicted_optimizer_ms,
                    reduction_ms, predicted_reduction_ms, planner_cpu_ms, ape}],
         "groups": [{step, micro_step, degree, ranks, sequences, tokens, predicted_ms, measured_ms, ape}],
         "passes": [{step, pass, groups, load_ms, tokens, predicted_ms, measured_ms, ape}],
         "step_error": {count, median_ape, worst_ape, mean_ape}, "group_error": {...}, "pass_error": {...},
         "optimizer_error": {...},
         "by_degree": {degree: {count, median_ape, worst_ape, mean_ape, median_ratio}},
         "run_profile", "run_step_error": the run's own predictions' error, "load_average": the machine's
         during the run (``Run.load_average``), "profile_note": when the profile is another machine's,
         "notes": [...]}

    Raises ValueError when the profile does not load, the run is not a training run, or it has no
    step with both a plan and measurements yet."""
    from workbench import runs
    from workbench.cost import CostModel
    from workbench.cost.memory import optimizer_kind
    from workbench.models import get_model
    from workbench.solve.plan import pass_loads, plan_from_dict
    from workbench.specs import ClusterSpec

    prof = _profile(profile_or_path)
    run = runs.load_run(train_run, root=root)
    spec = run.spec()
    if spec.get("kind") not in ("train", None) or not isinstance(spec.get("scenario"), dict):
        raise ValueError(f"run {run.id} is not a training run (kind {spec.get('kind')!r}); --check takes a "
                         f"`workbench train` run")
    st = run.status()
    sc = dict(spec["scenario"])
    resolved_sc = (st.resolved or {}).get("scenario")
    if isinstance(resolved_sc, dict):
        sc.update(resolved_sc)
    world = int((st.resolved or {}).get("world_size") or sc.get("num_gpus") or 1)
    model = get_model(str(sc.get("model", "tiny")))
    per = min(int(sc.get("gpus_per_node") or world), world)
    degrees = tuple(int(d) for d in (st.resolved or {}).get("degrees") or ()) or ()
    plans = _latest_by_step(run.plans())
    # the stage the plans ran under: theirs when they say it; a free plan written before plans
    # recorded it ran ZeRO-0 (replicas and one all-reduce), whatever the scenario's default says
    zero = int(sc.get("zero_stage", 3))
    first = plan_from_dict(plans[min(plans)]["plan"]) if plans else None
    if first is not None:
        if first.zero_stage is not None:
            zero = int(first.zero_stage)
        elif (first.execution == "free") != (zero < 3):
            zero = 0 if first.execution == "free" else 3
    cluster = ClusterSpec(num_gpus=world, gpus_per_node=per if world % per == 0 else world,
                          gpu_memory_gb=float(sc.get("gpu_memory_gb") or prof.gpu_memory_gb),
                          usable_memory_fraction=float(sc.get("memory_fraction") or 0.7), degrees=degrees,
                          zero_stage=zero)
    opt = sc.get("optimizer")
    if opt is None and spec.get("optimizer"):
        opt = optimizer_kind(str(spec["optimizer"]), float(spec.get("momentum") or 0.0))
    try:
        cost = CostModel(prof, model, cluster, strategy=str(sc.get("strategy") or "ulysses"),
                         recompute=bool(sc.get("recompute", False)), precision=sc.get("precision"),
                         optimizer=str(opt or "adamw"))
    except ValueError as e:
        raise ValueError(f"profile {prof.name} cannot model run {run.id}: {e}") from None
    metrics = run.metrics()
    by_step: dict[int, dict[int, dict]] = {}
    for r in metrics:
        s, rank = r.get("step"), r.get("rank")
        if not isinstance(s, int) or not isinstance(rank, int):
            continue
        prev = by_step.setdefault(s, {}).get(rank)
        if prev is None or int(r.get("attempt") or 1) >= int(prev.get("attempt") or 1):
            by_step[s][rank] = r
    steps_all = sorted(s for s in by_step if s in plans)
    if not steps_all:
        raise ValueError(f"run {run.id} has no step with both a plan and measurements yet ({st.state}); "
                         f"check a run that has trained")
    used = steps_all[skip:] if len(steps_all) > skip else steps_all
    # a step recorded under torch.profiler (train --torch-profile) pays the profiler's own overhead
    traced = [s for s in used if any(r.get("torch_trace") for r in by_step[s].values())]
    if len(traced) < len(used):
        used = [s for s in used if s not in traced]
    else:
        traced = []
    step_rows, group_rows, pass_rows = [], [], []
    execution = None
    # planning ahead on the ranks' own CPU cores: while step s trains, the worker solves step s+1's
    # plan, and on a machine with no core to spare that solver time is taken from the ranks
    res_ = st.resolved or {}
    cores = int((res_.get("machine") or {}).get("cores") or os.cpu_count() or 1)
    local = int(res_.get("local_world_size") or world)
    contended = res_.get("device") == "cpu" and res_.get("planning") == "ahead" and local >= cores
    for s in used:
        plan = plan_from_dict(plans[s]["plan"])
        execution = plan.execution
        ranks_rows = by_step[s]
        replan = retime_plan(plan, cost)
        solver_ms = 0.0
        if contended and s + 1 in plans:
            solver_ms = 1e3 * float((plans[s + 1].get("plan") or {}).get("solve_seconds") or 0.0) / cores
        pred_step = replan.makespan_ms + solver_ms
        # the solver's share slows the step's compute evenly: every group or pass by the same factor
        busy = replan.makespan_ms - replan.grad_sync_ms - replan.optimizer_ms
        stretch = 1.0 + solver_ms / busy if busy > 0 else 1.0

        def num(r, *keys):
            for k in keys:
                v = r.get(k)
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    return float(v)
            return None

        meas = [num(r, "measured_ms", "step_ms") or 0.0 for r in ranks_rows.values()]
        meas_step = max(meas) if meas else 0.0
        opt_ms = [x for x in (num(r, "optimizer_ms") for r in ranks_rows.values()) if x is not None]
        red_ms = [x for x in (num(r, "allreduce_ms") for r in ranks_rows.values()) if x is not None]
        if meas_step > 0:
            step_rows.append({"step": s, "predicted_ms": pred_step, "measured_ms": meas_step,
                              "run_predicted_ms": plan.makespan_ms, "optimizer_ms": max(opt_ms) if opt_ms else None,
                              "predicted_optimizer_ms": replan.optimizer_ms,
                              "reduction_ms": min(red_ms) if red_ms else None,
                              "predicted_reduction_ms": replan.grad_sync_ms, "planner_cpu_ms": solver_ms,
                              "ape": ape(pred_step, meas_step)})

        def rec_of(rank: int, m: int, ranks_rows=ranks_rows):
            recs = (ranks_rows.get(rank) or {}).get("micro_steps") or []
            return next((x for x in recs if x.get("micro_step") == m), None)

        if replan.execution == "lockstep":
            # passes: every rank runs every one; the slowest rank's time is the pass's
            for m, (ms, load) in enumerate(zip(replan.micro_steps, pass_loads(replan))):
                times = [float(rec["measured_ms"]) for rank in range(world)
                         if (rec := rec_of(rank, m)) is not None and isinstance(rec.get("measured_ms"), (int, float))
                         and rec["measured_ms"] > 0]
                if not times:
                    continue
                mt = max(times)
                pt = float(ms.time_ms) * stretch
                pass_rows.append({"step": s, "pass": m, "groups": len(ms.groups), "load_ms": float(load.max()),
                                  "tokens": int(sum(sum(g.lengths) for g in ms.groups)),
                                  "predicted_ms": pt, "measured_ms": mt, "ape": ape(pt, mt)})
            continue
        # groups: the shortest of the group's ranks' measured micro-step times
        for m, ms in enumerate(replan.micro_steps):
            for g in ms.groups:
                times = []
                for rank in g.ranks:
                    rec = rec_of(rank, m)
                    if rec is not None and rec.get("degree") == g.degree and isinstance(rec.get("measured_ms"), (int, float)) \
                            and rec["measured_ms"] > 0:
                        times.append(float(rec["measured_ms"]))
                if not times:
                    continue
                mt = min(times)
                gt = g.time_ms * stretch
                group_rows.append({"step": s, "micro_step": m, "degree": g.degree, "ranks": list(g.ranks),
                                   "sequences": len(g.sequences), "tokens": int(sum(g.lengths)),
                                   "predicted_ms": gt, "measured_ms": mt, "ape": ape(gt, mt)})
    by_degree = {}
    for d in sorted({g["degree"] for g in group_rows}):
        gs = [g for g in group_rows if g["degree"] == d]
        by_degree[d] = {**error_summary([g["ape"] for g in gs]),
                        "median_ratio": float(statistics.median(g["measured_ms"] / g["predicted_ms"] for g in gs))}
    run_err = error_summary([ape(r["run_predicted_ms"], r["measured_ms"]) for r in step_rows if r["run_predicted_ms"] > 0])
    opt_rows = [r for r in step_rows if r["optimizer_ms"] and r["predicted_optimizer_ms"]]
    notes = []
    if len(steps_all) > skip:
        notes.append(f"left out the first {skip} step(s) (start-up)")
    if traced:
        notes.append(f"left out step(s) {', '.join(map(str, traced))}: recorded under torch.profiler "
                     f"(--torch-profile), whose own overhead is not the model's")
    if st.state not in ("done",):
        notes.append(f"the run is {st.state}; figures cover the steps it has measured")
    if model.name != prof.model:
        notes.append(f"the profile was measured on model {prof.model}; times are scaled to {model.name} by FLOPs")
    try:
        from workbench.profile.machine import profile_origin_note

        origin = profile_origin_note(prof, world, fingerprint=(st.resolved or {}).get("machine"))
    except ValueError:
        origin = None
    if origin:
        notes.append(origin)
    if contended and any(r["planner_cpu_ms"] for r in step_rows):
        mean = statistics.fmean(r["planner_cpu_ms"] for r in step_rows)
        notes.append(f"the plan-ahead worker solved each next step's plan on the ranks' own {cores} CPU core(s) "
                     f"({local} ranks, none to spare): its solve time / {cores} is added to each step's prediction, "
                     f"spread over its groups or passes ({mean:,.0f} ms a step on average; run with --no-plan-ahead, "
                     f"or on GPUs, to leave it out)")
    load = run.load_average() if hasattr(run, "load_average") else None
    if load and load.get("mean") is not None:
        notes.append(f"the machine's load average during the run: {load['text']}")
    pl = prof.provenance.get("load_average") or {}
    if isinstance(pl.get("start"), (int, float)):
        notes.append(f"the profile was measured under a load average of {pl['start']:.1f} (start) to "
                     f"{pl.get('end', pl['start']):.1f} (end): a machine busier or quieter during the run than then "
                     f"moves the measured times away from the predicted ones")
    return {
        "profile": prof.name, "profile_kind": prof.provenance.get("kind"), "run": run.id,
        "planner": sc.get("planner"), "world_size": world, "model": model.name, "execution": execution,
        "zero_stage": cluster.zero_stage,
        "skipped_steps": len(steps_all) - len(used), "steps": step_rows, "groups": group_rows, "passes": pass_rows,
        "step_error": error_summary([r["ape"] for r in step_rows]),
        "group_error": error_summary([g["ape"] for g in group_rows]),
        "pass_error": error_summary([p["ape"] for p in pass_rows]),
        "optimizer_error": error_summary([ape(r["predicted_optimizer_ms"], r["optimizer_ms"]) for r in opt_rows]),
        "by_degree": by_degree, "run_profile": (st.resolved or {}).get("profile") or sc.get("profile"),
        "run_step_error": run_err, "load_average": load, "profile_note": origin, "notes": notes,
    }


def fidelity_table(check: dict) -> str:
    """A markdown table of a :func:`check_fidelity` result: median and worst APE of steps, groups,
    and groups by degree."""

    def f(v, fmt=".1f"):
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    how = {"lockstep": "ZeRO-3, lockstep passes", "free": f"ZeRO-{check.get('zero_stage')}, free micro-steps"}.get(
        check.get("execution") or "", "")
    lines = [f"profile {check['profile']} against run {check['run']} ({check['planner']}, {check['world_size']} "
             f"ranks, {check['model']}{', ' + how if how else ''})", "",
             "| what | count | median APE (%) | worst APE (%) | median measured/predicted |",
             "|---|---:|---:|---:|---:|"]
    se, ge = check["step_error"], check["group_error"]
    ratios = [r["measured_ms"] / r["predicted_ms"] for r in check["steps"] if r["predicted_ms"] > 0]
    lines.append(f"| step | {se['count']} | {f(se['median_ape'])} | {f(se['worst_ape'])} | "
                 f"{f(statistics.median(ratios), '.2f') if ratios else '-'} |")
    gr = [g["measured_ms"] / g["predicted_ms"] for g in check["groups"] if g["predicted_ms"] > 0]
    if ge.get("count"):
        lines.append(f"| group (all) | {ge['count']} | {f(ge['median_ape'])} | {f(ge['worst_ape'])} | "
                     f"{f(statistics.median(gr), '.2f') if gr else '-'} |")
    pe = check.get("pass_error") or {}
    if pe.get("count"):
        pr = [p["measured_ms"] / p["predicted_ms"] for p in check.get("passes") or [] if p["predicted_ms"] > 0]
        lines.append(f"| lockstep pass | {pe['count']} | {f(pe['median_ape'])} | {f(pe['worst_ape'])} | "
                     f"{f(statistics.median(pr), '.2f') if pr else '-'} |")
    oe = check.get("optimizer_error") or {}
    if oe.get("count"):
        orr = [r["optimizer_ms"] / r["predicted_optimizer_ms"] for r in check["steps"]
               if r.get("optimizer_ms") and r.get("predicted_optimizer_ms")]
        lines.append(f"| optimizer step | {oe['count']} | {f(oe['median_ape'])} | {f(oe['worst_ape'])} | "
                     f"{f(statistics.median(orr), '.2f') if orr else '-'} |")
    for d, e in check["by_degree"].items():
        lines.append(f"| group, degree {d} | {e['count']} | {f(e['median_ape'])} | {f(e['worst_ape'])} | "
                     f"{f(e['median_ratio'], '.2f')} |")
    re_ = check.get("run_step_error") or {}
    if re_.get("count"):
        lines.append(f"| step, the run's own profile ({check.get('run_profile')}) | {re_['count']} | "
                     f"{f(re_['median_ape'])} | {f(re_['worst_ape'])} | |")
    for n in check.get("notes") or []:
        lines.append(f"\n{n}")
    return "\n".join(lines)
