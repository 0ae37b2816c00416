"""Figures of one step's plans: the timeline of groups over ranks, and every planner side by side.

A plan (``Plan.to_dict()``) is a list of micro-steps; each micro-step splits the ranks into SP
groups. On the timeline a group is a bar over its ranks, coloured by degree and labelled with its
micro-step. How they line up depends on the plan's execution: free plans (ZeRO 0-2) are
barrier-free (a group starts as soon as its own ranks are done with the previous micro-step) and
end with every rank in the gradient reduction, the grey block; lockstep plans (ZeRO-3) run pass
after pass, every rank in every pass (shaded bands): a rank done early waits for the pass to end
(hatched), and a pass lasts at least as long as FSDP's parameter all-gathers and gradient
reduce-scatters. The dashed line is the lower bound (no plan can finish before it). Pure data in,
plotly figures out.
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["timeline_data", "timeline_figure", "planner_rows", "planners_figure", "work_breakdown", "work_figure",
           "DEGREE_COLORS", "idle_gpus", "idle_share"]

DEGREE_COLORS = {1: "#4C78A8", 2: "#72B7B2", 4: "#54A24B", 8: "#EECA3B", 16: "#F58518", 32: "#E45756",
                 64: "#B279A2", 128: "#9D755D", 256: "#FF9DA6", 512: "#BAB0AC", 1024: "#439894",
                 # groups of any size (docs/solver.md): whole nodes in threes, sizes inside a node
                 3: "#88D27A", 6: "#B6992D", 12: "#9ECAE9", 24: "#D67195", 48: "#79706E", 96: "#FFBF79",
                 192: "#83BCB6", 384: "#D6A5C9", 768: "#F2CF5B", 5: "#FF9D98", 7: "#8F6D31"}
_MORE_COLORS = ("#1F77B4", "#FF7F0E", "#2CA02C", "#D62728", "#9467BD", "#8C564B", "#E377C2", "#7F7F7F", "#BCBD22",
                "#17BECF")


def _color(d: int) -> str:
    """A degree's colour: its own for the usual sizes, else one of ten more by the size (so two odd sizes
    in one plan rarely share one)."""
    d = int(d)
    return DEGREE_COLORS.get(d) or _MORE_COLORS[d % len(_MORE_COLORS)]


def idle_gpus(plan: Mapping[str, Any]) -> int:
    """How many of a plan's GPUs are in no group of any micro-step (they wait the whole step)."""
    used = {int(r) for m in plan["micro_steps"] for g in m["groups"] for r in g["ranks"]}
    return int(plan["num_gpus"]) - len(used)


def idle_share(plan: Mapping[str, Any]) -> float:
    """The plan's idle GPU-time as a share of the step (``Plan.idle_share``; the JSON's ``idle_share``,
    computed for plans written before it was)."""
    if plan.get("idle_share") is not None:
        return float(plan["idle_share"])
    from workbench.solve.plan import plan_from_dict

    return plan_from_dict(plan).idle_share


def _split(g: Mapping[str, Any]) -> str:
    """A group's split as ``"u×c"`` (plans written before splits existed: Ulysses over the group)."""
    c = int(g.get("cp", 1))
    return f"{int(g['degree']) // c}×{c}"


def _split_words(g: Mapping[str, Any]) -> str:
    """A group's split in words: ``Ulysses 8 × CP 8``, ``Ulysses over 8``, ``CP over 8``, ``one GPU``."""
    d, c = int(g["degree"]), int(g.get("cp", 1))
    if d == 1:
        return "one GPU"
    if c == 1:
        return f"Ulysses over {d}"
    if c == d:
        return f"context parallel over {d}"
    return f"Ulysses {d // c} × context parallel {c}"


def timeline_data(plan: Mapping[str, Any]) -> dict:
    """The plan replayed on its ranks (``workbench.solve.timeline``) with the gradient sync:
    ``{"groups": [{micro_step, degree, ulysses, cp, ranks [first, last], start_ms, end_ms, sequences}],
    "compute_end_ms", "grad_sync_ms", "makespan_ms", "lower_bound_ms", "num_gpus",
    "rank_busy_ms", "imbalance"}`` (imbalance: compute end / mean rank busy time)."""
    from workbench.solve.plan import plan_from_dict, timeline

    tl = timeline(plan_from_dict(plan))
    busy = tl["rank_busy_ms"]
    mean = sum(busy) / len(busy) if busy else 0.0
    return {"groups": tl["groups"], "compute_end_ms": tl["compute_end_ms"], "grad_sync_ms": float(plan.get("grad_sync_ms") or 0.0),
            "optimizer_ms": float(plan.get("optimizer_ms") or 0.0),
            "makespan_ms": float(plan["makespan_ms"]), "lower_bound_ms": float(plan["lower_bound_ms"]),
            "num_gpus": int(plan["num_gpus"]), "rank_busy_ms": busy,
            "imbalance": tl["compute_end_ms"] / mean if mean > 0 else 1.0,
            "execution": tl["execution"], "passes": tl["passes"], "waits": tl["waits"],
            "wait_ms": float(sum(w["end_ms"] - w["start_ms"] for w in tl["waits"]))}


def timeline_figure(plan: Mapping[str, Any], title: str | None = None, *, max_labels: int = 128):
    """Gantt view of one plan: one horizontal bar per group over its ranks (y: every rank
    labelled, up to ``max_labels`` ranks), x: seconds into the step; colour: degree (legend);
    text: the micro-step (m0, m1, ...; p0, p1, ... for the passes of a lockstep plan) and, for a group
    with context parallelism, its split u×c (the hover says it in words for every group); the gradient
    sync as a grey block at the end; the lower bound as a dashed line. Lockstep plans also show
    their passes as shaded bands and every rank's wait for the end of a pass."""
    import plotly.graph_objects as go

    tl = timeline_data(plan)
    n = tl["num_gpus"]
    lockstep = tl["execution"] == "lockstep"
    tag = "p" if lockstep else "m"
    fig = go.Figure()
    for k, ps in enumerate(tl["passes"]):
        fig.add_vrect(x0=ps["start_ms"] / 1e3, x1=ps["end_ms"] / 1e3, fillcolor="#000" if k % 2 else "#888",
                      opacity=0.05, line_width=0, layer="below",
                      annotation_text=f"pass {k}", annotation_position="top left", annotation_font_size=10)
    if tl["waits"]:
        ws = tl["waits"]
        fig.add_bar(base=[w["start_ms"] / 1e3 for w in ws], x=[(w["end_ms"] - w["start_ms"]) / 1e3 for w in ws],
                    y=[w["rank"] for w in ws], width=[0.86] * len(ws), orientation="h",
                    name="waiting for the pass to end",
                    marker=dict(color="rgba(200,200,200,0.5)", pattern=dict(shape="/", fgcolor="#999", size=6),
                                line=dict(width=0)),
                    customdata=[[w["micro_step"], w["rank"], (w["end_ms"] - w["start_ms"]) / 1e3] for w in ws],
                    hovertemplate=("rank %{customdata[1]} waits %{customdata[2]:.3f}s for pass %{customdata[0]} to end"
                                   "<extra></extra>"))
    for d in sorted({g["degree"] for g in tl["groups"]}):
        gs = [g for g in tl["groups"] if g["degree"] == d]
        fig.add_bar(
            base=[g["start_ms"] / 1e3 for g in gs], x=[(g["end_ms"] - g["start_ms"]) / 1e3 for g in gs],
            y=[(g["ranks"][0] + g["ranks"][1]) / 2 for g in gs], width=[g["ranks"][1] - g["ranks"][0] + 0.86 for g in gs],
            orientation="h", name=f"degree {d}", marker=dict(color=_color(d), line=dict(color="white", width=1)),
            text=[f"{tag}{g['micro_step']}" + (f" {_split(g)}" if g.get("cp", 1) > 1 else "") for g in gs],
            textposition="inside", insidetextanchor="middle", textfont=dict(size=10), constraintext="both",
            customdata=[[g["micro_step"], g["ranks"][0], g["ranks"][1], g["sequences"], g["start_ms"] / 1e3,
                         g["end_ms"] / 1e3, _split_words(g)] for g in gs],
            hovertemplate=(("pass" if lockstep else "micro-step") + " %{customdata[0]}, degree " + str(d)
                           + " (%{customdata[6]})<br>ranks %{customdata[1]}-%{customdata[2]}, "
                           "%{customdata[3]} sequence(s)<br>%{customdata[4]:.3f}s to %{customdata[5]:.3f}s<extra></extra>"))
    end = tl["compute_end_ms"] / 1e3
    sync = tl["grad_sync_ms"] / 1e3
    if sync > 0:
        fig.add_bar(base=[end], x=[sync], y=[(n - 1) / 2], width=[n - 0.14], orientation="h",
                    name="gradient sync (all ranks)", marker=dict(color="#BBBBBB", line=dict(color="#666", width=1)),
                    text=["gradient sync"], textposition="inside", insidetextanchor="middle", textangle=-90,
                    textfont=dict(size=12, color="#333"),
                    hovertemplate=f"gradient all-reduce: {sync:.3f}s after the last micro-step<extra></extra>")
    opt = tl["optimizer_ms"] / 1e3
    if opt > 0:
        fig.add_bar(base=[end + sync], x=[opt], y=[(n - 1) / 2], width=[n - 0.14], orientation="h",
                    name="optimizer step (all ranks)", marker=dict(color="#DDDDDD", line=dict(color="#666", width=1)),
                    text=["optimizer"], textposition="inside", insidetextanchor="middle", textangle=-90,
                    textfont=dict(size=12, color="#333"),
                    hovertemplate=f"optimizer step: {opt:.3f}s<extra></extra>")
    lb = tl["lower_bound_ms"] / 1e3
    fig.add_vline(x=lb, line_dash="dash", line_color="#222", annotation_text=f"lower bound {lb:.2f}s",
                  annotation_position="bottom left", annotation_bgcolor="rgba(255,255,255,0.8)")
    fig.add_vline(x=tl["makespan_ms"] / 1e3, line_color="#E45756", annotation_text=f"step {tl['makespan_ms'] / 1e3:.2f}s",
                  annotation_position="top right")
    step = 1 if n <= max_labels else -(-n // max_labels)
    fig.update_yaxes(title="rank (GPU)", range=[n - 0.5, -0.5], tickmode="array", tickvals=list(range(0, n, step)),
                     ticktext=[str(r) for r in range(0, n, step)], zeroline=False, showgrid=False,
                     tickfont=dict(size=10 if n <= 32 else 8))
    fig.update_xaxes(title="time into the step (s)", rangemode="tozero")
    gap = tl["makespan_ms"] / tl["lower_bound_ms"] - 1 if tl["lower_bound_ms"] > 0 else 0.0
    fig.update_layout(barmode="overlay", template="plotly_white", bargap=0,
                      height=int(min(1400, max(320, 140 + (13 if n > 16 else 22) * n))),
                      title=title or (f"{plan['planner']}: step {tl['makespan_ms'] / 1e3:.2f}s, lower bound "
                                      f"{lb:.2f}s (gap {100 * gap:.1f}%), "
                                      + (f"{len(plan['micro_steps'])} lockstep pass(es) (ZeRO-3)" if lockstep
                                         else f"{len(plan['micro_steps'])} micro-step(s), barrier-free")),
                      legend=dict(orientation="h", y=-0.12 if n > 16 else -0.3, title_text="group degree:"),
                      margin=dict(l=60, r=20, t=70, b=40))
    return fig


def planner_rows(plans: Mapping[str, Mapping[str, Any]], packing_bound_ms: float | None = None) -> list[dict]:
    """One row of plain data per planner: makespan, lower bound, gap, idle GPU-time (``idle_share``, of the
    step's) and GPUs in no group (``idle_gpus``), micro-steps, groups, degrees and splits (``"u x c"``) used,
    imbalance, solve seconds and status; with ``packing_bound_ms`` (the step's
    ``workbench.solve.bound.step_bound_ms``) also ``packing_gap``, the makespan over it."""
    rows = []
    for name, p in plans.items():
        tl = timeline_data(p)
        degs = sorted({g["degree"] for m in p["micro_steps"] for g in m["groups"]})
        splits = sorted({(g["degree"], int(g.get("cp", 1))) for m in p["micro_steps"] for g in m["groups"]},
                        key=lambda x: (-x[0], x[1]))
        rows.append({"planner": name, "makespan_ms": float(p["makespan_ms"]), "lower_bound_ms": float(p["lower_bound_ms"]),
                     "gap": float(p["makespan_ms"]) / float(p["lower_bound_ms"]) - 1 if p["lower_bound_ms"] else 0.0,
                     "idle_share": idle_share(p), "idle_gpus": idle_gpus(p),
                     "micro_steps": len(p["micro_steps"]), "groups": sum(len(m["groups"]) for m in p["micro_steps"]),
                     "degrees": degs, "splits": [f"{d // c}x{c}" for d, c in splits],
                     "imbalance": tl["imbalance"], "grad_sync_ms": tl["grad_sync_ms"],
                     "solve_seconds": float(p.get("solve_seconds") or 0.0), "status": p.get("status", "")})
        if packing_bound_ms:
            rows[-1]["packing_gap"] = float(p["makespan_ms"]) / float(packing_bound_ms) - 1
    return rows


def planners_figure(plans: Mapping[str, Mapping[str, Any]], title: str = "Every planner on the same batch",
                    baseline: str | None = "static-max", packing_bound_ms: float | None = None):
    """Step time of every planner's plan for the same batch (bars, with the gap to the lower
    bound and the speedup over ``baseline`` as text), and the lower bound as a dashed line; with
    ``packing_bound_ms`` that bound too (dotted), when it is above the lower bound."""
    import plotly.graph_objects as go

    rows = planner_rows(plans)
    base = next((r for r in rows if r["planner"] == baseline), None)
    fig = go.Figure()
    text = []
    for r in rows:
        t = f"{r['makespan_ms'] / 1e3:.2f}s · +{100 * r['gap']:.1f}% over LB"
        if base is not None and r is not base:
            t += f" · {base['makespan_ms'] / r['makespan_ms']:.2f}x vs {baseline}"
        text.append(t)
    fig.add_bar(y=[r["planner"] for r in rows], x=[r["makespan_ms"] / 1e3 for r in rows], orientation="h",
                marker_color=["#E45756" if r["planner"].startswith("static") or r["planner"] == "best-static" else "#4C78A8"
                              for r in rows],
                text=text, textposition="auto", insidetextanchor="start",
                customdata=[[r["micro_steps"], ", ".join(map(str, r["degrees"])), r["solve_seconds"], ", ".join(r["splits"]),
                             100 * r["idle_share"], r["idle_gpus"]] for r in rows],
                hovertemplate="%{y}: %{x:.3f}s per step<br>%{customdata[0]} micro-step(s), degrees %{customdata[1]}"
                              "<br>splits (ulysses x cp) %{customdata[3]}<br>idle GPU-time %{customdata[4]:.1f}% "
                              "(%{customdata[5]} GPU(s) in no group)<br>solved in %{customdata[2]:.2f}s<extra></extra>")
    if rows:
        lb = min(r["lower_bound_ms"] for r in rows) / 1e3
        fig.add_vline(x=lb, line_dash="dash", line_color="#222", annotation_text=f"lower bound {lb:.2f}s",
                      annotation_position="bottom right")
        if packing_bound_ms and packing_bound_ms / 1e3 > lb * (1 + 1e-9):
            fig.add_vline(x=packing_bound_ms / 1e3, line_dash="dot", line_color="#54A24B",
                          annotation_text=f"packing bound {packing_bound_ms / 1e3:.2f}s", annotation_position="top right")
    fig.update_xaxes(title="predicted step time (s)", rangemode="tozero")
    fig.update_yaxes(autorange="reversed", automargin=True)
    fig.update_layout(template="plotly_white", title=title, height=max(260, 110 + 42 * len(rows)), showlegend=False,
                      margin=dict(l=10, r=20, t=60, b=40))
    return fig


WORK_PARTS = (("compute_gpu_s", "compute", "#4C78A8"), ("communication_gpu_s", "SP all-to-all / ring", "#E45756"),
              ("overhead_gpu_s", "group overhead (per micro-step)", "#EECA3B"),
              ("idle_gpu_s", "idle (waiting for other GPUs)", "#BAB0AC"), ("grad_sync_gpu_s", "gradient sync", "#72B7B2"))


def work_breakdown(plan: Mapping[str, Any], cost) -> dict:
    """Where a plan's GPU-time goes, in GPU-seconds (the cost model's numbers): ``compute_gpu_s``
    (each group's sequences' compute, times its degree), ``communication_gpu_s`` (exposed SP
    communication inside groups), ``overhead_gpu_s`` (each group's fixed cost per micro-step),
    ``idle_gpu_s`` (GPUs waiting before the gradient sync), ``grad_sync_gpu_s``; they add up to
    ``total_gpu_s`` = GPUs x step time."""
    import numpy as np

    comp = comm = ovh = busy = 0.0
    for ms in plan["micro_steps"]:
        for g in ms["groups"]:
            d, c, L = int(g["degree"]), int(g.get("cp", 1)), np.asarray(g["lengths"], dtype=np.int64)
            comp += d * float(cost.compute_ms(L, d).sum())
            comm += d * float(cost.comm_ms(L, d, c).sum())
            ovh += d * float(cost.group_overhead_ms(d, c))
            busy += d * float(g["time_ms"])
    tl = timeline_data(plan)
    n = tl["num_gpus"]
    idle = n * tl["compute_end_ms"] - busy
    out = {"compute_gpu_s": comp / 1e3, "communication_gpu_s": comm / 1e3, "overhead_gpu_s": ovh / 1e3,
           "idle_gpu_s": max(0.0, idle) / 1e3, "grad_sync_gpu_s": n * tl["grad_sync_ms"] / 1e3,
           "total_gpu_s": n * tl["makespan_ms"] / 1e3, "num_gpus": n}
    return out


def work_figure(plans: Mapping[str, Mapping[str, Any]], cost, title: str = "Where the GPU-time goes"):
    """One stacked bar per planner: its step's GPU-seconds split into compute, SP communication,
    group overheads, idle time and the gradient sync (:func:`work_breakdown`)."""
    import plotly.graph_objects as go

    from workbench.report._style import top_legend

    names = list(plans)
    rows = [work_breakdown(plans[k], cost) for k in names]
    fig = go.Figure()
    for key, label, color in WORK_PARTS:
        fig.add_bar(y=names, x=[r[key] for r in rows], orientation="h", name=label, marker_color=color,
                    hovertemplate=f"%{{y}}: %{{x:,.1f}} GPU-s {label}<extra></extra>")
    fig.update_xaxes(title="GPU-seconds per step (GPUs x seconds)")
    fig.update_yaxes(autorange="reversed", automargin=True)
    fig.update_layout(barmode="stack", template="plotly_white", title=title, legend_traceorder="normal",
                      height=max(260, 140 + 40 * len(names)), margin=dict(l=10, r=20, b=40))
    return top_legend(fig)
