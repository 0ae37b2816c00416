"""Per-GPU memory as a breakdown: parameters, gradients, optimizer states, activations, budget.

The numbers are the cost model's own (the planners plan against them): model states per GPU are
``ClusterSpec.model_state_gb(model)`` split into its three parts by the ZeRO stage's formula, and
activations are ``CostModel.memory(lengths, degree)`` summed over a group's sequences. Mixed
precision with Adam keeps 16 bytes per parameter (FlexSP's formula):

==============  =====  ======================================  =================
part            bytes  what                                     sharded from
==============  =====  ======================================  =================
parameters       2     bf16 weights used by forward/backward    ZeRO-3
gradients        2     bf16 gradients                           ZeRO-2
optimizer       12     fp32 master weights, Adam's m and v      ZeRO-1
==============  =====  ======================================  =================

A sharded part is divided over all ``num_gpus`` ranks; the others are replicated on every GPU.
(ZeRO-1: 12/16 = 6/8 sharded + 2/8 replicated, ZeRO-2: 7/8 + 1/8, ZeRO-3: all 1/N, exactly
``model_state_gb``.) Of the GPU's memory only ``usable = gpu_memory_gb x memory_fraction`` is
planned (the rest is the reserve for fragmentation, communication buffers and workspaces); the
activation budget is ``usable - model states`` (``CostModel.memory_budget_gb``).

Pure Python + numpy; plotly only inside the figure functions.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from workbench.report._style import top_legend

__all__ = ["BYTES_PER_PARAMETER", "SHARDED_FROM_STAGE", "model_state_parts", "gpu_memory_breakdown",
           "plan_memory", "rank_memory", "measured_peak_memory", "memory_breakdown_figure",
           "memory_compare_figure", "PART_LABELS", "PART_COLORS"]

BYTES_PER_PARAMETER = {"parameters": 2.0, "gradients": 2.0, "optimizer": 12.0}
"""Bytes per parameter of each model-state part (mixed precision, Adam): 16 in all."""
SHARDED_FROM_STAGE = {"optimizer": 1, "gradients": 2, "parameters": 3}
"""The ZeRO stage from which each part is sharded over the ranks."""
PART_LABELS = {"parameters": "parameters", "gradients": "gradients", "optimizer": "optimizer states",
               "activations": "activations"}
PART_COLORS = {"parameters": "#4C78A8", "gradients": "#72B7B2", "optimizer": "#B279A2", "activations": "#F58518"}


def model_state_parts(model, cluster) -> dict[str, float]:
    """Model states per GPU in GB (1e9 bytes), by part: ``{"parameters", "gradients", "optimizer"}``.

    ``model`` is a ModelSpec, ``cluster`` a ClusterSpec. The three sum to
    ``cluster.model_state_gb(model)``. Raises ValueError for an unknown ZeRO stage."""
    stage = int(cluster.zero_stage)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    n = int(cluster.num_gpus)
    params = float(model.params())
    out = {}
    for part, nbytes in BYTES_PER_PARAMETER.items():
        share = 1.0 / n if stage >= SHARDED_FROM_STAGE[part] else 1.0
        out[part] = nbytes * params * share / 1e9
    return out


def gpu_memory_breakdown(cost, lengths: Sequence[int] = (), degree: int = 1) -> dict:
    """Memory of one GPU of a group of ``degree`` running ``lengths`` in one micro-step, in GB.

    Returns plain data: ``parameters_gb``, ``gradients_gb``, ``optimizer_gb``, ``model_states_gb``,
    ``activations_gb`` (the group's sequences, each ``cost.memory(s, degree)``), ``total_gb``,
    ``usable_gb`` (GPU memory x fraction), ``gpu_memory_gb``, ``reserve_gb`` (what is not planned),
    ``activation_budget_gb`` (usable less model states), ``headroom_gb`` (usable less total; negative:
    over budget), ``fits``, ``degree``, ``sequences``, ``tokens``."""
    import numpy as np

    cl = cost.cluster
    parts = model_state_parts(cost.model, cl)
    s = np.asarray(list(lengths), dtype=np.int64)
    act = float(cost.memory(s, int(degree)).sum()) if s.size else 0.0
    states = sum(parts.values())
    usable = float(cl.usable_memory_gb)
    total = states + act
    return {
        "degree": int(degree), "sequences": int(s.size), "tokens": int(s.sum()) if s.size else 0,
        "parameters_gb": parts["parameters"], "gradients_gb": parts["gradients"], "optimizer_gb": parts["optimizer"],
        "model_states_gb": states, "activations_gb": act, "total_gb": total, "usable_gb": usable,
        "gpu_memory_gb": float(cl.gpu_memory_gb), "reserve_gb": float(cl.gpu_memory_gb) - usable,
        "activation_budget_gb": float(cost.memory_budget_gb), "headroom_gb": usable - total,
        "fits": act <= float(cost.memory_budget_gb) * (1 + 1e-9), "zero_stage": int(cl.zero_stage),
        "num_gpus": int(cl.num_gpus),
    }


def plan_memory(plan: Mapping[str, Any], cost) -> list[dict]:
    """Every group of a plan (``Plan.to_dict()``) with its per-GPU breakdown (see
    :func:`gpu_memory_breakdown`) plus ``micro_step``, ``index`` (in its micro-step), ``ranks``
    ``[first, last]`` and a short ``label``. Activations are recomputed from the group's lengths
    with ``cost``, so they are the numbers the planner checked."""
    out = []
    for m, ms in enumerate(plan.get("micro_steps") or []):
        for k, g in enumerate(ms.get("groups") or []):
            row = gpu_memory_breakdown(cost, g["lengths"], g["degree"])
            r = list(g["ranks"])
            where = f"rank {r[0]}" if len(r) == 1 else f"ranks {r[0]}-{r[-1]}"
            row.update(micro_step=m, index=k, ranks=[r[0], r[-1]], label=f"micro-step {m}, degree {g['degree']}, {where}")
            out.append(row)
    return out


def rank_memory(plan: Mapping[str, Any], cost) -> list[float]:
    """Predicted peak memory (GB) of every rank in a plan: model states plus the largest
    activation footprint of the groups it runs (one micro-step's activations are freed before
    the next)."""
    n = int(plan.get("num_gpus") or cost.cluster.num_gpus)
    states = sum(model_state_parts(cost.model, cost.cluster).values())
    peak = [0.0] * n
    for row in plan_memory(plan, cost):
        lo, hi = row["ranks"]
        for r in range(lo, hi + 1):
            if r < n:
                peak[r] = max(peak[r], row["activations_gb"])
    return [states + a for a in peak]


def measured_peak_memory(metrics: Sequence[Mapping[str, Any]]) -> dict[int, float]:
    """The largest ``peak_memory_mb`` each rank reported in a run's metrics rows, in GB (1e9 bytes)."""
    out: dict[int, float] = {}
    for r in metrics:
        rank, mb = r.get("rank"), r.get("peak_memory_mb")
        if isinstance(rank, int) and isinstance(mb, (int, float)) and not isinstance(mb, bool):
            out[rank] = max(out.get(rank, 0.0), float(mb) * 2**20 / 1e9)
    return dict(sorted(out.items()))


def memory_breakdown_figure(rows: Sequence[Mapping[str, Any]], title: str = "Memory per GPU", *,
                            highlight: int | None = None):
    """Stacked horizontal bars, one per breakdown in ``rows`` (from :func:`gpu_memory_breakdown` or
    :func:`plan_memory`, each with a ``label``): parameters, gradients, optimizer states and
    activations per GPU, against the usable memory (dashed) and the device's memory (solid).
    ``highlight``: index of the row drawn with a dark outline (the chosen group)."""
    import plotly.graph_objects as go

    labels = [str(r.get("label") or f"group {i}") for i, r in enumerate(rows)]
    fig = go.Figure()
    for part in ("parameters", "gradients", "optimizer", "activations"):
        vals = [float(r[f"{part}_gb"]) for r in rows]
        fig.add_bar(y=labels, x=vals, orientation="h", name=PART_LABELS[part], marker_color=PART_COLORS[part],
                    marker_line_width=[2.5 if i == highlight else 0 for i in range(len(rows))],
                    marker_line_color="#222",
                    text=[f"{v:.2f}" if v >= 0.06 * max(1e-9, float(rows[i]["gpu_memory_gb"])) else ""
                          for i, v in enumerate(vals)],
                    textposition="inside", insidetextanchor="middle",
                    hovertemplate=f"%{{y}}<br>{PART_LABELS[part]}: %{{x:.2f}} GB<extra></extra>")
    if rows:
        usable, dev = float(rows[0]["usable_gb"]), float(rows[0]["gpu_memory_gb"])
        fig.add_vline(x=usable, line_dash="dash", line_color="#333",
                      annotation_text=f"usable {usable:.1f} GB", annotation_position="top left")
        fig.add_vline(x=dev, line_color="#999", annotation_text=f"device {dev:.0f} GB",
                      annotation_position="bottom left")
        xmax = max(dev, max(float(r["total_gb"]) for r in rows)) * 1.05
        fig.update_xaxes(range=[0, xmax])
    fig.update_xaxes(title="GB per GPU")
    fig.update_yaxes(autorange="reversed", automargin=True)
    fig.update_layout(barmode="stack", template="plotly_white", title=title, legend_traceorder="normal",
                      height=max(260, 150 + 44 * len(rows)),
                      margin=dict(l=10, r=20, t=60, b=40))
    return top_legend(fig)


def memory_compare_figure(predicted_gb: Sequence[float], measured_gb: Mapping[int, float], *,
                          title: str = "Peak memory per rank: predicted and measured", note: str = ""):
    """Grouped bars per rank: the plan's predicted peak (model states + largest activations) and
    the run's measured peak. ``note`` goes under the title (e.g. what "measured" means on CPU)."""
    import plotly.graph_objects as go

    ranks = list(range(len(predicted_gb)))
    fig = go.Figure()
    fig.add_bar(x=[f"rank {r}" for r in ranks], y=list(predicted_gb), name="predicted (cost model)",
                marker_color="#4C78A8", hovertemplate="%{x}: %{y:.3f} GB predicted<extra></extra>")
    fig.add_bar(x=[f"rank {r}" for r in ranks], y=[measured_gb.get(r) for r in ranks], name="measured peak",
                marker_color="#E45756", hovertemplate="%{x}: %{y:.3f} GB measured<extra></extra>")
    full = title + (f"<br><sup>{note}</sup>" if note else "")
    fig.update_yaxes(title="GB")
    fig.update_layout(barmode="group", template="plotly_white", title=full, height=340)
    return top_legend(fig)
