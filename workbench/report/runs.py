"""Figures of training runs from the run store: loss curves, measured against predicted step time,
and speedups between runs.

:func:`run_series` turns a run's step records (``Run.steps()``) into plain lists; the figure
functions take those lists, so the live Launch panel, the Runs panel, the notebooks and the demo
report draw the same numbers. plotly is imported inside the figure functions.
"""

from __future__ import annotations

import statistics
from typing import Any, Mapping, Sequence

from workbench.report._style import add_points, top_legend

__all__ = ["run_series", "live_run_figure", "loss_figure", "step_time_figure", "speedup_figure", "run_label",
           "step_timeline_figure", "STEP_PART_COLORS"]

_PALETTE = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#FF9DA6", "#9D755D"]


def run_label(run) -> str:
    """A short label for a run: its planner and the tail of its id."""
    spec = run.spec()
    sc = spec.get("scenario") if isinstance(spec.get("scenario"), dict) else {}
    planner = sc.get("planner") or spec.get("planner") or spec.get("kind") or "?"
    return f"{planner} · {run.id[-9:]}"


def run_series(run, *, skip: int = 0) -> dict:
    """A run's steps as plain lists: ``{"id", "label", "step", "loss", "measured_ms",
    "predicted_ms", "tokens_per_s", "peak_memory_mb", "median_measured_ms",
    "median_predicted_ms"}`` (medians leave out the first ``skip`` steps when there are more)."""
    steps = run.steps()
    use = steps[skip:] if len(steps) > skip else steps
    meas = [s.measured_ms for s in use if s.measured_ms]
    pred = [s.predicted_ms for s in use if s.predicted_ms]
    return {"id": run.id, "label": run_label(run), "step": [s.step for s in steps], "loss": [s.loss for s in steps],
            "measured_ms": [s.measured_ms for s in steps], "predicted_ms": [s.predicted_ms for s in steps],
            "tokens_per_s": [s.tokens_per_s for s in steps], "peak_memory_mb": [s.peak_memory_mb for s in steps],
            "median_measured_ms": statistics.median(meas) if meas else None,
            "median_predicted_ms": statistics.median(pred) if pred else None}


def live_run_figure(series: Mapping[str, Any], title: str = "Training"):
    """Two panels for one run: loss per step (left), measured and predicted step time (right)."""
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12)
    add_points(fig, series["step"], series["loss"], mode="lines+markers", name="loss",
               line=dict(color=_PALETTE[0]), row=1, col=1)
    add_points(fig, series["step"], series["measured_ms"], mode="lines+markers", name="measured (ms)",
               line=dict(color=_PALETTE[3]), row=1, col=2)
    add_points(fig, series["step"], series["predicted_ms"], mode="lines+markers", name="predicted by the plan (ms)",
               line=dict(color="#333", dash="dash"), marker=dict(size=5, symbol="line-ew-open"), row=1, col=2)
    fig.update_xaxes(title_text="step", rangemode="tozero")
    fig.update_yaxes(title_text="loss", row=1, col=1)
    fig.update_yaxes(title_text="ms per step", rangemode="tozero", row=1, col=2)
    fig.update_layout(template="plotly_white", height=340, title=title,
                      margin=dict(t=70, b=50))
    return top_legend(fig)


def loss_figure(series: Sequence[Mapping[str, Any]], title: str = "Loss per step"):
    """Loss curves of several runs (one line each)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for i, s in enumerate(series):
        add_points(fig, s["step"], s["loss"], mode="lines+markers", name=s["label"],
                   line=dict(color=_PALETTE[i % len(_PALETTE)]))
    fig.update_xaxes(title="step")
    fig.update_yaxes(title="loss")
    fig.update_layout(template="plotly_white", title=title, height=340)
    return top_legend(fig)


def step_time_figure(series: Sequence[Mapping[str, Any]], title: str = "Step time: measured (solid) and predicted (dashed)"):
    """Measured (solid) and predicted (dashed) step time of several runs, one colour per run."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for i, s in enumerate(series):
        c = _PALETTE[i % len(_PALETTE)]
        add_points(fig, s["step"], s["measured_ms"], mode="lines+markers", name=f"{s['label']} measured",
                   line=dict(color=c))
        add_points(fig, s["step"], s["predicted_ms"], mode="lines", name=f"{s['label']} predicted",
                   line=dict(color=c, dash="dash"))
    fig.update_xaxes(title="step")
    fig.update_yaxes(title="ms per step", rangemode="tozero")
    fig.update_layout(template="plotly_white", title=title, height=360)
    return top_legend(fig)


def speedup_figure(rows: Sequence[Mapping[str, Any]], baseline: str, title: str | None = None):
    """Speedup of every run over ``baseline`` (median measured step, bars) next to the speedup the
    cost model predicted (hollow bars). ``rows``: ``{"label", "median_measured_ms",
    "median_predicted_ms"}``, one of them labelled ``baseline``."""
    import plotly.graph_objects as go

    base = next((r for r in rows if r["label"] == baseline), None)
    fig = go.Figure()
    if base is not None and base.get("median_measured_ms"):
        lab = [r["label"] for r in rows]
        meas = [base["median_measured_ms"] / r["median_measured_ms"] if r.get("median_measured_ms") else None for r in rows]
        pred = [base["median_predicted_ms"] / r["median_predicted_ms"]
                if r.get("median_predicted_ms") and base.get("median_predicted_ms") else None for r in rows]
        fig.add_bar(x=lab, y=meas, name="measured", marker_color="#4C78A8",
                    text=[f"{v:.2f}x" if v else "" for v in meas], textposition="outside")
        fig.add_bar(x=lab, y=pred, name="predicted", marker=dict(color="rgba(0,0,0,0)", line=dict(color="#333", width=2)),
                    text=[f"{v:.2f}x" if v else "" for v in pred], textposition="outside")
        fig.add_hline(y=1.0, line_dash="dot", line_color="#999")
    fig.update_yaxes(title=f"speedup over {baseline} (median step)", rangemode="tozero")
    fig.update_layout(barmode="group", template="plotly_white", height=340, title=title or f"Speedup over {baseline}")
    return top_legend(fig)


STEP_PART_COLORS = {
    "step.compute": "#4C78A8", "planned.compute": "#4C78A8",
    "step.collective": "#F58518", "planned.collective": "#F58518", "collective": "#FFBF79",
    "step.optimizer": "#54A24B", "planned.optimizer": "#54A24B",
    "step.other": "#BAB0AC", "planned.wait": "#E45756",
}
"""Colour of each part of a step (``workbench.trace`` categories): micro-steps and passes, collectives
(the plan broadcast lighter), the optimizer, untimed host work, and the waits the plan predicts."""
_PART_NAMES = {"step.compute": "micro-steps / passes", "step.collective": "reduction", "collective": "plan broadcast",
               "step.optimizer": "optimizer", "step.other": "other (untimed)", "planned.compute": "micro-steps / passes",
               "planned.collective": "reduction", "planned.optimizer": "optimizer", "planned.wait": "waiting"}


def step_timeline_figure(tl: Mapping[str, Any], title: str | None = None):
    """One step on every rank: what each rank measured (left) beside what the plan predicted (right),
    as bars over time (ms from the step's first event), one row per rank, coloured by what the
    time went to. ``tl`` is ``workbench.trace.step_timeline``; the bars of a rank's measured row
    (the plan broadcast aside) sum to its measured step time."""
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, shared_yaxes=True, horizontal_spacing=0.06,
                        subplot_titles=("measured", f"planned ({tl.get('planner')})"))
    seen = set()
    for col, events in ((1, tl["measured"]), (2, tl["planned"])):
        for cat in STEP_PART_COLORS:
            es = [e for e in events if e["cat"] == cat]
            if not es:
                continue
            label = _PART_NAMES[cat]
            fig.add_bar(base=[e["start_ms"] for e in es], x=[e["dur_ms"] for e in es], y=[e["rank"] for e in es],
                        orientation="h", name=label, legendgroup=label, showlegend=label not in seen,
                        marker=dict(color=STEP_PART_COLORS[cat], line=dict(width=0.5, color="#fff")), width=0.8,
                        customdata=[[e["name"]] for e in es],
                        hovertemplate="rank %{y}: %{customdata[0]}<br>%{base:,.1f} ms + %{x:,.1f} ms<extra></extra>",
                        row=1, col=col)
            seen.add(label)
    ends = [e["start_ms"] + e["dur_ms"] for e in [*tl["measured"], *tl["planned"]]]
    starts = [e["start_ms"] for e in [*tl["measured"], *tl["planned"]]]
    span = [min(starts, default=0.0), max(ends, default=1.0)]
    fig.update_xaxes(title_text="ms", range=span)  # one scale for both: lengths compare across the panels
    n = max(tl.get("world_size") or 0, 1 + max(tl["ranks"], default=0))
    fig.update_yaxes(title_text="rank", range=[n - 0.5, -0.5], tickmode="array", tickvals=list(range(n)), row=1, col=1)
    fig.update_yaxes(range=[n - 0.5, -0.5], tickmode="array", tickvals=list(range(n)), row=1, col=2)
    worst = max(tl["measured_ms"].values(), default=None)
    pred = tl.get("predicted_ms")
    head = title or (f"Step {tl['step']} of {tl['run']}: measured (slowest rank {worst:,.0f} ms)"
                     + (f" and planned ({pred:,.0f} ms)" if pred else ""))
    fig.update_layout(barmode="overlay", template="plotly_white", height=max(300, 120 + 40 * n), title=head)
    return top_legend(fig)
