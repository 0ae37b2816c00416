"""Step traces: what one step of a training run did on every rank, as measured, beside what its plan
predicted.

:func:`step_timeline` reads a run's ``metrics.jsonl`` (one row per step and rank: the step's
``measured_ms``, its micro-steps or passes with their start and ``measured_ms``, the gradient
reduction's ``allreduce_ms``, the ``optimizer_ms``, the plan broadcast) and ``plans.jsonl`` (the
step's plan) and returns plain data: per rank, the measured parts of the step and the plan's
predicted timeline (``workbench.solve.plan.timeline``), in ms from one origin. :func:`chrome_trace`
turns that into the trace-event format (Chrome's ``about:tracing``, https://ui.perfetto.dev): one
process per rank, a ``measured`` track and a ``planned`` track in each. The Runs panel draws the same
data (``workbench.report.runs.step_timeline_figure``).

The measured parts of a step tile it exactly: the micro-steps (passes) where they ran, the
reduction, the optimizer, and, for time inside the step outside any timed part (slicing sequences,
Python between micro-steps), an ``other`` part; their durations on a rank sum to the step's
``measured_ms`` as ``metrics.jsonl`` records it. A run written before the micro-steps' starts were
kept gets its parts laid end to end, the remainder as ``other``. Ranks are aligned by the wall
clock each recorded at the step's start (one machine: one clock); without it every rank starts at 0.

Pure Python: no torch, no plotly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workbench import runs

__all__ = ["step_timeline", "chrome_trace", "write_trace", "default_step", "rank_summary", "MEASURED_TID",
           "PLANNED_TID", "PART_PREFIX"]

MEASURED_TID = 1
"""The trace's thread (track) holding what each rank measured."""
PLANNED_TID = 2
"""The trace's thread (track) holding the plan's predicted timeline for the rank."""
PART_PREFIX = "step."
"""Categories of the measured parts that tile a step (``step.compute``, ``step.collective``,
``step.optimizer``, ``step.other``); the step itself is ``step``."""
_EPS_MS = 1e-6
_ABSORB_MS = 0.01
"""A hole between measured parts shorter than this (10 us: the bookkeeping between two timers) is
given to the next part rather than drawn as a part of its own."""


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _step_rows(run: runs.Run, step: int) -> dict[int, dict]:
    """Every rank's ``metrics.jsonl`` row of ``step`` (1-based), the latest attempt of each."""
    out: dict[int, dict] = {}
    for r in run.metrics():
        if r.get("step") != step - 1 or not isinstance(r.get("rank"), int):
            continue
        prev = out.get(r["rank"])
        if prev is None or int(r.get("attempt") or 1) >= int(prev.get("attempt") or 1):
            out[r["rank"]] = r
    return dict(sorted(out.items()))


def _step_plan(run: runs.Run, step: int, attempt: int | None) -> dict | None:
    rows = [p for p in run.plans() if p.get("step") == step - 1 and isinstance(p.get("plan"), dict)]
    same = [p for p in rows if attempt is None or int(p.get("attempt") or 1) == attempt]
    pick = (same or rows)
    return pick[-1]["plan"] if pick else None


def default_step(run: runs.Run) -> int:
    """The step a trace shows when none is asked for (1-based): the one whose measured time (rank 0)
    is the median of the run's steps, the first step left out when there are more (it pays start-up
    costs), and a step recorded by ``--torch-profile`` left out when there are others (the
    profiler's overhead). Raises ValueError when the run has measured no step."""
    steps = [s for s in run.steps() if s.measured_ms]
    if not steps:
        raise ValueError(f"run {run.id} has measured no step yet (no metrics.jsonl rows)")
    profiled = {r.get("step", -1) + 1 for r in run.metrics(rank=0) if r.get("torch_trace")}
    use = [s for s in steps if s.step not in profiled] or steps
    use = use[1:] if len(use) > 1 else use
    ordered = sorted(use, key=lambda s: s.measured_ms)
    return ordered[(len(ordered) - 1) // 2].step


def _group_label(groups: list[dict]) -> str:
    parts = []
    for g in groups:
        rk = g.get("ranks") or []
        where = f"rank {rk[0]}" if len(rk) == 1 else f"ranks {rk[0]}-{rk[-1]}" if rk else "?"
        parts.append(f"degree {g.get('degree')} on {where}")
    return " + ".join(parts)


def _measured_parts(row: dict, lockstep: bool) -> list[dict]:
    """A rank's parts of its step, in ms from the rank's step start, tiling ``[0, measured_ms]``."""
    total = _num(row.get("measured_ms")) or 0.0
    step_ms = _num(row.get("step_ms"))
    step_ms = total if step_ms is None else step_ms
    red = _num(row.get("allreduce_ms")) or 0.0
    opt = _num(row.get("optimizer_ms"))
    opt = max(0.0, total - step_ms) if opt is None else opt
    word = "pass" if lockstep else "micro-step"
    parts: list[dict] = []
    cursor = 0.0
    for rec in row.get("micro_steps") or []:
        meas = _num(rec.get("measured_ms")) or 0.0
        groups = rec.get("groups") or ([{"degree": rec.get("degree"), "ranks": rec.get("ranks")}] if rec.get("degree")
                                       else [])
        if not groups and not lockstep:
            continue  # idle in this micro-step: no work, no collective
        start = _num(rec.get("start_ms"))
        start = cursor if start is None else start
        m = rec.get("micro_step")
        name = f"{word} {m}: " + (_group_label(groups) if groups else "empty (joins FSDP's collectives)")
        parts.append({"name": name, "cat": "step.compute", "start_ms": start, "dur_ms": meas,
                      "args": {"micro_step": m, "groups": groups, "tokens": rec.get("tokens"),
                               "sequences": len(rec.get("sequences") or []), "measured_ms": meas,
                               "predicted_ms": rec.get("predicted_ms"), "pass_ms": rec.get("pass_ms"),
                               "loss": rec.get("loss")}})
        cursor = start + meas
    if lockstep:
        red_name = "loss all-reduce (FSDP reduced the gradients inside the passes)"
    else:
        red_name = "gradient reduction (includes waiting for the slowest rank)"
    parts.append({"name": red_name, "cat": "step.collective", "start_ms": max(cursor, step_ms - red), "dur_ms": red,
                  "args": {"allreduce_ms": red}})
    parts.append({"name": "optimizer step", "cat": "step.optimizer", "start_ms": step_ms, "dur_ms": opt,
                  "args": {"optimizer_ms": opt, "grad_norm": row.get("grad_norm")}})
    # clamp what older rows cannot place exactly, then fill the holes: the parts tile the step
    parts.sort(key=lambda p: p["start_ms"])
    out, t = [], 0.0
    for p in parts:
        p["start_ms"] = max(p["start_ms"], t)
        p["dur_ms"] = max(0.0, min(p["dur_ms"], total - p["start_ms"]))
        hole = p["start_ms"] - t
        if hole >= _ABSORB_MS:
            out.append({"name": "other: outside the timed parts (slicing, Python, host work)", "cat": "step.other",
                        "start_ms": t, "dur_ms": hole, "args": {}})
        elif hole > 0:
            p["start_ms"], p["dur_ms"] = t, p["dur_ms"] + hole
        out.append(p)
        t = p["start_ms"] + p["dur_ms"]
    if total - t >= _ABSORB_MS:
        out.append({"name": "other: outside the timed parts (slicing, Python, host work)", "cat": "step.other",
                    "start_ms": t, "dur_ms": total - t, "args": {}})
    elif out and total > t:
        out[-1]["dur_ms"] += total - t
    return out


def _planned_parts(plan_dict: dict, rank: int) -> list[dict]:
    """The plan's predicted timeline for ``rank``, in ms from the step's start."""
    from workbench.solve.plan import plan_from_dict, timeline

    plan = plan_from_dict(plan_dict)
    tl = timeline(plan)
    lockstep = tl["execution"] == "lockstep"
    word = "pass" if lockstep else "micro-step"
    out = []
    for g in tl["groups"]:
        lo, hi = g["ranks"]
        if lo <= rank <= hi:
            where = f"rank {lo}" if lo == hi else f"ranks {lo}-{hi}"
            out.append({"name": f"{word} {g['micro_step']}: degree {g['degree']} on {where} (predicted)",
                        "cat": "planned.compute", "start_ms": g["start_ms"], "dur_ms": g["end_ms"] - g["start_ms"],
                        "args": {"micro_step": g["micro_step"], "degree": g["degree"], "sequences": g["sequences"]}})
    for w in tl.get("waits") or []:
        if w["rank"] == rank:
            out.append({"name": f"waits for pass {w['micro_step']} to end (its busiest rank, FSDP's collectives, the "
                                f"pass's fixed cost)",
                        "cat": "planned.wait", "start_ms": w["start_ms"], "dur_ms": w["end_ms"] - w["start_ms"],
                        "args": {"micro_step": w["micro_step"]}})
    end = tl["compute_end_ms"]
    if not lockstep:
        fin = tl["rank_finish_ms"][rank]
        if end - fin > _EPS_MS:
            out.append({"name": "waits for the slowest rank before the reduction", "cat": "planned.wait",
                        "start_ms": fin, "dur_ms": end - fin, "args": {}})
    if plan.grad_sync_ms > 0:
        out.append({"name": "gradient reduction (predicted)", "cat": "planned.collective", "start_ms": end,
                    "dur_ms": plan.grad_sync_ms, "args": {}})
    if plan.optimizer_ms > 0:
        out.append({"name": "optimizer step (predicted)", "cat": "planned.optimizer", "start_ms": end + plan.grad_sync_ms,
                    "dur_ms": plan.optimizer_ms, "args": {}})
    return sorted(out, key=lambda p: p["start_ms"])


def step_timeline(run: runs.Run | str | Path, step: int | None = None, *, root: str | Path | None = None) -> dict:
    """One step of a training run on every rank, measured and planned, as plain data (module docstring).

    Returns ``{"run", "step", "attempt", "execution", "planner", "ranks", "aligned", "origin_time",
    "measured": [{rank, name, cat, start_ms, dur_ms, args}], "planned": [...], "measured_ms": {rank:
    ms}, "predicted_ms", "summary": [per rank: rank_summary]}``; ``step`` is 1-based (default:
    :func:`default_step`), times are ms from the origin (the earliest event of the step on any rank).
    Raises RunNotFound for an unknown run and ValueError for a step the run did not record."""
    run = runs.load_run(run, root=root)
    if step is None:
        step = default_step(run)
    rows = _step_rows(run, int(step))
    if not rows:
        have = sorted({s.step for s in run.steps()})
        span = ("no step is recorded yet" if not have else f"step {have[0]} is recorded" if len(have) == 1 else
                f"steps {have[0]}-{have[-1]} are recorded")
        raise ValueError(f"run {run.id} has no step {step} in {runs.METRICS_FILE} ({span})")
    first = next(iter(rows.values()))
    lockstep = first.get("execution") == "lockstep"
    attempt = int(first.get("attempt") or 1)
    plan = _step_plan(run, int(step), attempt)
    # absolute placement (seconds) when every rank recorded its clock at the step's start
    aligned = all(_num(r.get("start_time")) is not None for r in rows.values())
    starts: dict[int, float] = {}
    bcast: dict[int, tuple[float, float, bool]] = {}
    for rank, r in rows.items():
        s0 = _num(r.get("start_time")) if aligned else 0.0
        starts[rank] = s0 * 1e3
        b_ms = _num(r.get("broadcast_ms")) or 0.0
        b0 = _num(r.get("broadcast_start_time")) if aligned else None
        exact = b0 is not None
        bcast[rank] = ((b0 * 1e3) if exact else starts[rank] - b_ms, b_ms, exact)
    origin = min(min(starts.values()), min(b for b, _, _ in bcast.values()))
    measured, summary = [], []
    for rank, r in rows.items():
        off = starts[rank] - origin
        total = _num(r.get("measured_ms")) or 0.0
        b_start, b_ms, exact = bcast[rank]
        if b_ms > 0:
            measured.append({"rank": rank, "name": "plan broadcast (before the step; rank 0 plans, the others wait)",
                             "cat": "collective", "start_ms": b_start - origin, "dur_ms": b_ms,
                             "args": {"broadcast_ms": b_ms, "placed": "as recorded" if exact else
                                      "ending at the step's start (its start was not recorded)"}})
        measured.append({"rank": rank, "name": f"step {step}", "cat": "step", "start_ms": off, "dur_ms": total,
                         "args": {"measured_ms": total, "predicted_ms": r.get("predicted_ms"), "loss": r.get("loss"),
                                  "tokens": r.get("tokens"), "peak_memory_mb": r.get("peak_memory_mb"),
                                  "torch_trace": r.get("torch_trace")}})
        parts = _measured_parts(r, lockstep)
        measured += [{"rank": rank, **p, "start_ms": off + p["start_ms"]} for p in parts]
        summary.append(rank_summary(rank, r, parts))
    planned = []
    if plan is not None:
        p0 = min(starts.values()) - origin  # the plan starts with the first rank's step
        for rank in rows:
            planned.append({"rank": rank, "name": f"step {step} (the plan: {plan.get('planner')})", "cat": "planned",
                            "start_ms": p0, "dur_ms": float(plan.get("makespan_ms") or 0.0),
                            "args": {"makespan_ms": plan.get("makespan_ms"), "lower_bound_ms": plan.get("lower_bound_ms")}})
            parts = _planned_parts(plan, rank)
            planned += [{"rank": rank, **p, "start_ms": p0 + p["start_ms"]} for p in parts]
            busy = sum(p["dur_ms"] for p in parts if p["cat"] == "planned.compute")
            wait = sum(p["dur_ms"] for p in parts if p["cat"] == "planned.wait")
            for s in summary:
                if s["rank"] == rank:
                    s.update(predicted_work_ms=busy, predicted_wait_ms=wait)
    _explain_waits(summary, lockstep)
    return {"run": run.id, "step": int(step), "attempt": attempt, "execution": "lockstep" if lockstep else "free",
            "planner": (plan or {}).get("planner") or first.get("planner"), "ranks": list(rows),
            "world_size": (plan or {}).get("num_gpus") or len(rows), "aligned": aligned,
            "origin_time": origin / 1e3 if aligned else None, "measured": measured, "planned": planned,
            "measured_ms": {rank: _num(r.get("measured_ms")) for rank, r in rows.items()},
            "predicted_ms": _num((plan or {}).get("makespan_ms")) or _num(first.get("predicted_ms")),
            "summary": summary, "missing_ranks": _missing(rows, plan)}


def _missing(rows: dict, plan: dict | None) -> list[int]:
    n = int((plan or {}).get("num_gpus") or 0)
    return [r for r in range(n) if r not in rows]


def rank_summary(rank: int, row: dict, parts: list[dict]) -> dict:
    """One rank's step in a few figures: measured in all, in its micro-steps (passes), in the
    reduction, the optimizer, and outside the timed parts (ms)."""
    def tot(cat: str) -> float:
        return sum(p["dur_ms"] for p in parts if p["cat"] == cat)

    return {"rank": rank, "measured_ms": _num(row.get("measured_ms")), "work_ms": tot("step.compute"),
            "reduction_ms": tot("step.collective"), "optimizer_ms": tot("step.optimizer"), "other_ms": tot("step.other"),
            "broadcast_ms": _num(row.get("broadcast_ms")), "tokens": row.get("tokens"),
            "predicted_work_ms": None, "predicted_wait_ms": None, "waited_ms": None, "note": ""}


def _explain_waits(summary: list[dict], lockstep: bool) -> None:
    """Say, per rank, who it waited for: under free execution a rank that finished its micro-steps
    early waits in the reduction for the slowest; in lockstep passes FSDP's collectives make every
    rank wait inside each pass for the busiest one."""
    if not summary:
        return
    slow = max(summary, key=lambda s: s["work_ms"])
    waits = [s["predicted_wait_ms"] for s in summary if s.get("predicted_wait_ms") is not None]
    for s in summary:
        if lockstep:
            # every rank waits for each pass's fixed cost; beyond the least wait, it waits for busier ranks
            extra = s["predicted_wait_ms"] - min(waits) if s.get("predicted_wait_ms") is not None else None
            s["note"] = ("lockstep: waits happen inside the passes (FSDP's collectives); no plan to compare" if extra is None
                         else "the busiest rank of its passes (predicted)" if extra <= 0.05 * max(waits + [1e-9]) else
                         f"waits about {extra:,.1f} ms inside the passes for busier ranks (predicted; FSDP's "
                         f"collectives hold it)")
        elif s is slow:
            s["note"] = "the slowest rank: the others wait for it in the reduction"
        else:
            gap = slow["work_ms"] - s["work_ms"]
            s["note"] = f"finished its micro-steps {gap:,.1f} ms before rank {slow['rank']}: waits for it in the reduction"
    if not lockstep:
        reds = [s["reduction_ms"] for s in summary]
        floor = min(reds)
        for s in summary:
            s["waited_ms"] = s["reduction_ms"] - floor  # the reduction's own time is the least any rank spent in it


def chrome_trace(tl: dict) -> dict:
    """A :func:`step_timeline` as a trace-event JSON object (``{"traceEvents": [...], ...}``): one
    process per rank (``pid`` = rank), thread 1 the measured step, thread 2 the plan's timeline;
    complete (``X``) events with ``ts`` and ``dur`` in microseconds, metadata (``M``) events naming
    the processes and threads. Opens in https://ui.perfetto.dev and Chrome's about:tracing."""
    ev: list[dict] = []
    for rank in tl["ranks"]:
        ev += [{"name": "process_name", "ph": "M", "ts": 0, "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
               {"name": "process_sort_index", "ph": "M", "ts": 0, "pid": rank, "tid": 0, "args": {"sort_index": rank}},
               {"name": "thread_name", "ph": "M", "ts": 0, "pid": rank, "tid": MEASURED_TID, "args": {"name": "measured"}},
               {"name": "thread_sort_index", "ph": "M", "ts": 0, "pid": rank, "tid": MEASURED_TID,
                "args": {"sort_index": MEASURED_TID}}]
        if tl["planned"]:
            ev += [{"name": "thread_name", "ph": "M", "ts": 0, "pid": rank, "tid": PLANNED_TID,
                    "args": {"name": f"planned ({tl.get('planner')})"}},
                   {"name": "thread_sort_index", "ph": "M", "ts": 0, "pid": rank, "tid": PLANNED_TID,
                    "args": {"sort_index": PLANNED_TID}}]
    for tid, events in ((MEASURED_TID, tl["measured"]), (PLANNED_TID, tl["planned"])):
        for e in events:
            ev.append({"name": e["name"], "cat": e["cat"], "ph": "X", "ts": e["start_ms"] * 1e3,
                       "dur": max(0.0, e["dur_ms"]) * 1e3, "pid": e["rank"], "tid": tid, "args": e["args"]})
    return {"traceEvents": ev, "displayTimeUnit": "ms",
            "otherData": {"run": tl["run"], "step": tl["step"], "attempt": tl["attempt"], "execution": tl["execution"],
                          "planner": tl["planner"], "aligned_by_wall_clock": tl["aligned"],
                          "origin_time": tl["origin_time"], "summary": tl["summary"],
                          "source": "workbench runs trace: metrics.jsonl (measured) and plans.jsonl (planned)"}}


def write_trace(run: runs.Run | str | Path, path: str | Path | None = None, step: int | None = None, *,
                root: str | Path | None = None) -> tuple[Path, dict]:
    """Write :func:`chrome_trace` of ``step`` (default :func:`default_step`) to ``path`` (default
    ``<run>/trace-step<N>.json``), atomically; returns ``(path, timeline)``."""
    from workbench.util import write_json_atomic

    run = runs.load_run(run, root=root)
    tl = step_timeline(run, step)
    out = Path(path) if path is not None else run.file(f"trace-step{tl['step']}.json")
    write_json_atomic(out, chrome_trace(tl), indent=None)
    return out, tl
