"""Per-GPU memory as a breakdown: parameters, gradients, optimizer states, working set, activations.

The numbers are the cost model's own (the planners plan against them): model states per GPU are
``workbench.cost.memory.model_states`` under the cluster's ZeRO stage, precision and optimizer
(``CostModel.states``), the bytes the runtime holds (a run counts them from tensor storage and
writes them to ``metrics.jsonl``); activations are ``CostModel.memory(lengths, degree)`` summed over
a group's sequences. What each stage holds per rank (``P`` parameters, ``N`` ranks, ``O`` optimizer
bytes per parameter: AdamW 8, SGD with momentum 4; master weights and gradients fp32)::

    stage  parameters  gradients (peak)  optimizer   working set (transient)
    0      4P          4P                O*P         bf16: autocast's bf16 weight copies
    1      4P          4P                O*P/N (*)   bf16: the same
    2      4P          4P (**)           O*P/N (*)   bf16: the same
    3      4P/N        4P/N              O*P/N       the all-gathered units and the unsharded gradient
                                                     awaiting its reduce-scatter

(*) whole parameters per rank, so each rank's share differs a little. (**) free execution (ZeRO
0-2) accumulates whole gradients until the step's reduce; ZeRO-2 keeps only its own after it.

Of the GPU's memory only ``usable = gpu_memory_gb x memory_fraction`` is planned (the rest is the
reserve for fragmentation, communication buffers and workspaces); the activation budget is
``usable - model states - working set`` (``CostModel.memory_budget_gb``).

Pure Python + numpy; plotly only inside the figure functions.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from workbench.report._style import top_legend

__all__ = ["model_state_parts", "working_label", "gpu_memory_breakdown", "plan_memory", "rank_activations",
           "rank_memory", "predicted_model_states", "measured_model_states", "measured_peak_memory",
           "measured_cuda_peak", "memory_breakdown_figure", "memory_compare_figure", "PART_LABELS", "PART_COLORS",
           "FREE_GRADIENTS_NOTE"]

PART_LABELS = {"parameters": "parameters", "gradients": "gradients", "optimizer": "optimizer states",
               "working": "working set (transient)", "activations": "activations"}
PART_COLORS = {"parameters": "#4C78A8", "gradients": "#72B7B2", "optimizer": "#B279A2", "working": "#9D755D",
               "activations": "#F58518"}
FREE_GRADIENTS_NOTE = ("free execution (ZeRO 0-2) holds whole gradients until the step's reduce: ZeRO-2 shards "
                       "them only after it")


def _states(cost, rank: int | None = None):
    from workbench.cost.memory import model_states

    if rank is None:
        return cost.states
    cl = cost.cluster
    return model_states(cost.model, zero_stage=cl.zero_stage, num_ranks=cl.num_gpus, precision=cost.precision,
                        optimizer=cost.optimizer, rank=rank)


def model_state_parts(cost, rank: int | None = None) -> dict[str, float]:
    """Model states per GPU in GB (1e9 bytes), by part: ``{"parameters", "gradients", "optimizer",
    "working"}`` (``working``: the transient working set). From ``cost.states`` (the most loaded
    rank), or of ``rank`` (ZeRO 1-2 differ per rank)."""
    st = _states(cost, rank)
    return {"parameters": st.parameters / 1e9, "gradients": st.gradients / 1e9,
            "optimizer": st.optimizer_states / 1e9, "working": st.working / 1e9 + cost.loss_working_gb}


def working_label(cost) -> str:
    """What the working set is under ``cost``'s stage and precision (empty when there is none)."""
    st = cost.states
    parts = []
    if st.working and st.zero_stage == 3:
        parts.append("all-gathered FSDP units and the unsharded gradient awaiting its reduce-scatter (ZeRO-3)")
    elif st.working:
        parts.append("autocast's bf16 copies of the matmul weights, kept for backward")
    if cost.loss_working_gb:
        parts.append("the chunked loss's logits and head gradient (recomputation)")
    return "; ".join(parts)


def gpu_memory_breakdown(cost, lengths: Sequence[int] = (), degree: int = 1, cp: int | None = None,
                         offload: str | None = None, swap: int = 0) -> dict:
    """Memory of one GPU of a group of ``degree`` and split ``cp`` (None: the degree's least-memory
    split) running ``lengths`` in one micro-step, in GB.

    Returns plain data: ``parameters_gb``, ``gradients_gb``, ``optimizer_gb``, ``model_states_gb``
    (the three: what a run counts from tensor storage), ``working_gb`` (the transient working set,
    ``working_label`` says what it is), ``activations_gb`` (the group's sequences, each
    ``cost.memory(s, degree, cp)``: with context parallelism its gathered K/V too, without recomputation
    the whole logits' backward, ``cost.loss_bytes_per_token`` a token), ``total_gb``,
    ``usable_gb`` (GPU memory x fraction), ``gpu_memory_gb``, ``reserve_gb`` (what is not planned),
    ``activation_budget_gb`` (usable less model states and working set), ``headroom_gb`` (usable less
    total; negative: over budget), ``fits``, ``degree``, ``cp``, ``sequences``, ``tokens``,
    ``zero_stage``, ``execution``, ``states_note``, ``offload``, ``swap_layers`` and ``host_gb``: with
    ``offload`` (a group's level, ``workbench.cost.offload``; ``swap`` its swapped blocks) the
    activations are what the group keeps on the GPU at that level (one MLP tile included) and
    ``host_gb`` what it keeps in host memory per GPU."""
    import numpy as np

    cl = cost.cluster
    parts = model_state_parts(cost)
    s = np.asarray(list(lengths), dtype=np.int64)
    host = 0.0
    if offload is not None and s.size:
        c = cost.best_split(s, int(degree)) if cp is None else int(cp)
        _, act, host = cost.group_at(s, int(degree), c, offload, int(swap))
    else:
        act = float(cost.memory(s, int(degree), cp).sum()) if s.size else 0.0
    states = parts["parameters"] + parts["gradients"] + parts["optimizer"]
    usable = float(cl.usable_memory_gb)
    total = states + parts["working"] + act
    return {
        "degree": int(degree), "cp": None if cp is None else int(cp), "sequences": int(s.size),
        "tokens": int(s.sum()) if s.size else 0,
        "parameters_gb": parts["parameters"], "gradients_gb": parts["gradients"], "optimizer_gb": parts["optimizer"],
        "model_states_gb": states, "working_gb": parts["working"], "working_label": working_label(cost),
        "activations_gb": act, "total_gb": total, "usable_gb": usable,
        "gpu_memory_gb": float(cl.gpu_memory_gb), "reserve_gb": float(cl.gpu_memory_gb) - usable,
        "activation_budget_gb": float(cost.memory_budget_gb), "headroom_gb": usable - total,
        "fits": act <= float(cost.memory_budget_gb) * (1 + 1e-9), "zero_stage": int(cl.zero_stage),
        "num_gpus": int(cl.num_gpus), "execution": cost.execution, "states_note": cost.states.note,
        "offload": offload or "none", "swap_layers": int(swap), "host_gb": host,
    }


def plan_memory(plan: Mapping[str, Any], cost) -> list[dict]:
    """Every group of a plan (``Plan.to_dict()``) with its per-GPU breakdown (see
    :func:`gpu_memory_breakdown`) plus ``micro_step``, ``index`` (in its micro-step), ``ranks``
    ``[first, last]`` and a short ``label``. Activations are recomputed from the group's lengths
    with ``cost``, so they are the numbers the planner checked."""
    out = []
    for m, ms in enumerate(plan.get("micro_steps") or []):
        for k, g in enumerate(ms.get("groups") or []):
            c = int(g.get("cp", 1))
            row = gpu_memory_breakdown(cost, g["lengths"], g["degree"], c, g.get("offload") or "none",
                                       int(g.get("swap_layers") or 0))
            r = list(g["ranks"])
            where = f"rank {r[0]}" if len(r) == 1 else f"ranks {r[0]}-{r[-1]}"
            split = f" ({int(g['degree']) // c}x{c})" if c > 1 else ""
            what = " + ".join(x for x in ("block inputs" if row["offload"] != "none" else "",
                                          f"{row['swap_layers']} blocks swapped" if row["swap_layers"] else "") if x)
            host = f", {what}: {row['host_gb']:.1f} GB in host memory" if what else ""
            row.update(micro_step=m, index=k, ranks=[r[0], r[-1]],
                       label=f"micro-step {m}, degree {g['degree']}{split}, {where}{host}")
            out.append(row)
    return out


def rank_activations(plan: Mapping[str, Any], cost) -> list[float]:
    """The largest activations (GB) each rank of a plan holds at once: free execution frees a
    micro-step's before the next, so its largest group's; a lockstep pass keeps every group a rank
    serves in it, so the largest sum over a pass."""
    n = int(plan.get("num_gpus") or cost.cluster.num_gpus)
    peak = [0.0] * n
    for ms in plan.get("micro_steps") or []:
        held = [0.0] * n
        for g in ms.get("groups") or []:
            mem = (float(cost.memory(list(g["lengths"]), int(g["degree"]), int(g.get("cp", 1))).sum())
                   if g["lengths"] else 0.0)
            for r in g["ranks"]:
                if r < n:
                    held[r] = held[r] + mem if plan.get("execution") == "lockstep" else max(held[r], mem)
        peak = [max(a, b) for a, b in zip(peak, held)]
    return peak


def rank_memory(plan: Mapping[str, Any], cost) -> list[float]:
    """Predicted peak memory (GB) of every rank in a plan: its model states and working set (the
    chunked loss's under recomputation too) plus the largest activations it holds at once
    (:func:`rank_activations`)."""
    return [_states(cost, r).total / 1e9 + cost.loss_working_gb + a for r, a in enumerate(rank_activations(plan, cost))]


def predicted_model_states(cost) -> list[float]:
    """Model states (parameters, gradients at their peak, optimizer states; GB) the memory model
    predicts for every rank of ``cost``'s cluster: what a run counts from tensor storage."""
    return [_states(cost, r).states / 1e9 for r in range(cost.cluster.num_gpus)]


def _latest_rows(metrics: Sequence[Mapping[str, Any]]) -> dict[int, Mapping[str, Any]]:
    out: dict[int, Mapping[str, Any]] = {}
    for r in metrics:
        rank, step = r.get("rank"), r.get("step")
        if isinstance(rank, int) and isinstance(step, int) and (rank not in out or step >= out[rank].get("step", -1)):
            out[rank] = r
    return out


def measured_model_states(metrics: Sequence[Mapping[str, Any]]) -> dict[int, float]:
    """Model states each rank reported for its latest step (``model_states`` in metrics.jsonl:
    parameter, peak gradient and optimizer bytes from tensor storage), in GB; ranks of older runs
    without them are left out."""
    out = {}
    for rank, r in _latest_rows(metrics).items():
        st = r.get("model_states")
        if isinstance(st, Mapping):
            out[rank] = sum(float(st.get(k) or 0) for k in ("parameters_bytes", "gradients_bytes", "optimizer_bytes")) / 1e9
    return dict(sorted(out.items()))


def measured_peak_memory(metrics: Sequence[Mapping[str, Any]]) -> dict[int, float]:
    """The largest ``peak_memory_mb`` each rank reported in a run's metrics rows, in GB (1e9 bytes)."""
    out: dict[int, float] = {}
    for r in metrics:
        rank, mb = r.get("rank"), r.get("peak_memory_mb")
        if isinstance(rank, int) and isinstance(mb, (int, float)) and not isinstance(mb, bool):
            out[rank] = max(out.get(rank, 0.0), float(mb) * 2**20 / 1e9)
    return dict(sorted(out.items()))


def measured_cuda_peak(metrics: Sequence[Mapping[str, Any]]) -> dict[int, float]:
    """The largest ``max_memory_allocated_bytes`` (CUDA's allocator peak) each rank reported, in GB;
    empty for a CPU run."""
    out: dict[int, float] = {}
    for r in metrics:
        rank, b = r.get("rank"), r.get("max_memory_allocated_bytes")
        if isinstance(rank, int) and isinstance(b, (int, float)) and not isinstance(b, bool):
            out[rank] = max(out.get(rank, 0.0), float(b) / 1e9)
    return dict(sorted(out.items()))


def memory_breakdown_figure(rows: Sequence[Mapping[str, Any]], title: str = "Memory per GPU", *,
                            highlight: int | None = None):
    """Stacked horizontal bars, one per breakdown in ``rows`` (from :func:`gpu_memory_breakdown` or
    :func:`plan_memory`, each with a ``label``): parameters, gradients, optimizer states, the working
    set (named in its hover: ZeRO-3's all-gathered units, or autocast's weight copies) and
    activations per GPU, against the usable memory (dashed) and the device's memory (solid). Under
    free execution the subtitle says that gradients are held whole until the step's reduce.
    ``highlight``: index of the row drawn with a dark outline (the chosen group)."""
    import plotly.graph_objects as go

    labels = [str(r.get("label") or f"group {i}") for i, r in enumerate(rows)]
    fig = go.Figure()
    for part in ("parameters", "gradients", "optimizer", "working", "activations"):
        vals = [float(r.get(f"{part}_gb") or 0.0) for r in rows]
        if part == "working" and not any(vals):
            continue
        name = PART_LABELS[part]
        what = [f" ({r.get('working_label')})" if part == "working" and r.get("working_label") else "" for r in rows]
        fig.add_bar(y=labels, x=vals, orientation="h", name=name, marker_color=PART_COLORS[part],
                    marker_line_width=[2.5 if i == highlight else 0 for i in range(len(rows))],
                    marker_line_color="#222", customdata=what,
                    text=[f"{v:.2f}" if v >= 0.06 * max(1e-9, float(rows[i]["gpu_memory_gb"])) else ""
                          for i, v in enumerate(vals)],
                    textposition="inside", insidetextanchor="middle",
                    hovertemplate=f"%{{y}}<br>{name}%{{customdata}}: %{{x:.2f}} GB<extra></extra>")
    if rows:
        usable, dev = float(rows[0]["usable_gb"]), float(rows[0]["gpu_memory_gb"])
        fig.add_vline(x=usable, line_dash="dash", line_color="#333",
                      annotation_text=f"usable {usable:.1f} GB", annotation_position="top left")
        fig.add_vline(x=dev, line_color="#999", annotation_text=f"device {dev:.0f} GB",
                      annotation_position="bottom left")
        xmax = max(dev, max(float(r["total_gb"]) for r in rows)) * 1.05
        fig.update_xaxes(range=[0, xmax])
        if any(r.get("execution") == "free" for r in rows):
            title = f"{title}<br><sup>{FREE_GRADIENTS_NOTE}</sup>"
        elif any(r.get("working_gb") for r in rows):
            title = f"{title}<br><sup>working set: {rows[0].get('working_label')}</sup>"
    fig.update_xaxes(title="GB per GPU")
    fig.update_yaxes(autorange="reversed", automargin=True)
    fig.update_layout(barmode="stack", template="plotly_white", title=title, legend_traceorder="normal",
                      height=max(260, 150 + 44 * len(rows)),
                      margin=dict(l=10, r=20, t=60, b=40))
    return top_legend(fig)


def memory_compare_figure(predicted_gb: Sequence[float], measured_gb: Mapping[int, float], *,
                          title: str = "Model states per rank: predicted and measured", note: str = "",
                          names: tuple[str, str] = ("predicted (memory model)", "measured (tensor storage)"),
                          extra: Sequence[tuple[str, Sequence[float] | Mapping[int, float]]] = ()):
    """Grouped bars per rank: a prediction (the memory model's model states, or a peak) and the
    run's measurement, ``names`` naming the two; ``extra`` adds more ``(name, values)`` series (e.g. the
    predicted and measured CUDA peak). ``note`` goes under the title (what "measured" means)."""
    import plotly.graph_objects as go

    ranks = list(range(len(predicted_gb)))
    x = [f"rank {r}" for r in ranks]
    colors = ["#4C78A8", "#E45756", "#9ECAE9", "#FF9D98"]
    fig = go.Figure()
    series = [(names[0], list(predicted_gb)), (names[1], measured_gb), *extra]
    for i, (name, vals) in enumerate(series):
        ys = [vals.get(r) for r in ranks] if isinstance(vals, Mapping) else list(vals)
        fig.add_bar(x=x, y=ys, name=name, marker_color=colors[i % len(colors)],
                    hovertemplate=f"%{{x}}: %{{y:.4f}} GB {name}<extra></extra>")
    full = title + (f"<br><sup>{note}</sup>" if note else "")
    fig.update_yaxes(title="GB")
    fig.update_layout(barmode="group", template="plotly_white", title=full, height=340)
    return top_legend(fig)
