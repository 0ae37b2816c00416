"""Plotly figures built from plain data (summaries, histograms, simulation results, plans).

One place for figures: the widgets, the notebooks and the CLI's HTML report all call these.
plotly is imported inside the functions so that importing ``workbench.report`` stays cheap.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Sequence

__all__ = ["length_histogram_figure", "token_share_figure", "step_time_figure", "plan_timeline_figure",
           "write_html_report"]

_COLORS = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#FF9DA6", "#9D755D"]


def length_histogram_figure(hist: dict, title: str = "Sequence lengths"):
    """Bar chart of sequence counts per power-of-two length bin, log axes.

    ``hist`` is ``workbench.data.length_histogram`` output (``edges``, ``counts``, ``token_share``)."""
    import plotly.graph_objects as go

    edges = hist["edges"]
    centers = [(edges[i] * edges[i + 1]) ** 0.5 for i in range(len(edges) - 1)]
    labels = [f"{int(edges[i]):,}–{int(edges[i + 1]):,}" for i in range(len(edges) - 1)]
    fig = go.Figure()
    fig.add_bar(x=centers, y=hist["counts"], name="sequences", marker_color=_COLORS[0], customdata=labels,
                hovertemplate="%{customdata} tokens<br>%{y:,} sequences<extra></extra>",
                width=[edges[i + 1] - edges[i] for i in range(len(edges) - 1)])
    fig.update_xaxes(type="log", title="sequence length (tokens)")
    fig.update_yaxes(type="log", title="sequences")
    fig.update_layout(title=title, bargap=0.05, template="plotly_white", height=380)
    return fig


def token_share_figure(hist: dict, curve: dict | None = None, title: str = "Where the tokens are"):
    """Share of all tokens held by each length bin (bars) and, when ``curve`` is given, the
    cumulative token share against length (line)."""
    import plotly.graph_objects as go

    edges = hist["edges"]
    centers = [(edges[i] * edges[i + 1]) ** 0.5 for i in range(len(edges) - 1)]
    fig = go.Figure()
    fig.add_bar(x=centers, y=[100 * x for x in hist["token_share"]], name="token share per bin (%)",
                marker_color=_COLORS[1], width=[edges[i + 1] - edges[i] for i in range(len(edges) - 1)],
                hovertemplate="%{y:.1f}% of tokens<extra></extra>")
    if curve is not None:
        fig.add_scatter(x=curve["lengths"], y=[100 * x for x in curve["cumulative_token_share"]], mode="lines",
                        name="tokens in sequences up to this length (%)", line_color=_COLORS[0])
    fig.update_xaxes(type="log", title="sequence length (tokens)")
    fig.update_yaxes(title="% of tokens", range=[0, 100])
    fig.update_layout(title=title, template="plotly_white", height=380, legend=dict(orientation="h", y=-0.25))
    return fig


def step_time_figure(sim: dict, title: str = "Step time by planner"):
    """Mean step time per planner (bars, with p95 as error bar) against the mean lower bound.

    ``sim`` is ``SimulationResult.to_dict()`` (or the ``workbench simulate --json`` output)."""
    import plotly.graph_objects as go

    names = list(sim["planners"])
    rows = [sim["planners"][n] for n in names]
    fig = go.Figure()
    fig.add_bar(x=names, y=[r["mean_step_ms"] / 1e3 for r in rows], name="mean step time",
                marker_color=[_COLORS[i % len(_COLORS)] for i in range(len(names))],
                error_y=dict(type="data", symmetric=False,
                             array=[(r["p95_step_ms"] - r["mean_step_ms"]) / 1e3 for r in rows],
                             arrayminus=[0] * len(rows)),
                text=[f"{r['mean_step_ms'] / 1e3:.2f}s<br>×{r['ratio_to_lower_bound']:.2f} LB" for r in rows],
                textposition="inside", insidetextanchor="middle",  # outside would collide with the p95 whiskers
                hovertemplate="%{x}: %{y:.2f}s per step<extra></extra>")
    if rows:
        lb = sum(r["lower_bound_ms"] for r in rows) / len(rows) / 1e3
        fig.add_hline(y=lb, line_dash="dash", line_color="black",
                      annotation_text=f"lower bound {lb:.2f}s", annotation_position="top left")
    fig.update_yaxes(title="seconds per step")
    fig.update_layout(title=title, template="plotly_white", height=420, showlegend=False)
    return fig


def plan_timeline_figure(plan: dict, title: str | None = None):
    """Gantt-style view of one plan: each group is a bar over its ranks from start to end, coloured
    by degree. ``plan`` is ``Plan.to_dict()``."""
    import plotly.graph_objects as go

    from workbench.solve.plan import plan_from_dict, timeline

    tl = timeline(plan_from_dict(plan))
    fig = go.Figure()
    degrees = sorted({g["degree"] for g in tl["groups"]})
    for k, d in enumerate(degrees):
        gs = [g for g in tl["groups"] if g["degree"] == d]
        fig.add_bar(
            base=[g["start_ms"] / 1e3 for g in gs], x=[(g["end_ms"] - g["start_ms"]) / 1e3 for g in gs],
            y=[(g["ranks"][0] + g["ranks"][1]) / 2 for g in gs], width=[g["ranks"][1] - g["ranks"][0] + 0.9 for g in gs],
            orientation="h", name=f"degree {d}", marker_color=_COLORS[k % len(_COLORS)],
            customdata=[[g["micro_step"], g["ranks"][0], g["ranks"][1], g["sequences"]] for g in gs],
            hovertemplate="micro-step %{customdata[0]}: ranks %{customdata[1]}–%{customdata[2]}, "
                          "%{customdata[3]} sequences<br>%{base:.2f}s + %{x:.2f}s<extra></extra>")
    fig.update_xaxes(title="time (s)")
    n = plan.get("num_gpus") or 1 + max(g["ranks"][1] for g in tl["groups"])
    fig.update_yaxes(title="rank", range=[n - 0.5, -0.5], tickformat="d", zeroline=False)
    fig.update_layout(barmode="overlay", template="plotly_white", height=420,
                      title=title or f"{plan['planner']}: {plan['makespan_ms'] / 1e3:.2f}s per step "
                                     f"(lower bound {plan['lower_bound_ms'] / 1e3:.2f}s)")
    return fig


def write_html_report(path: str | Path, title: str, sections: Sequence[tuple[str, object]],
                      tables: Sequence[tuple[str, str]] = ()) -> Path:
    """Write one self-contained HTML page (plotly.js inlined: it opens offline) with ``sections``
    of ``(heading, figure)`` and ``tables`` of ``(heading, pre-formatted text)``. Atomic write."""
    from workbench.util import write_text_atomic

    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
             "<style>body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}"
             "pre{background:#f6f6f6;padding:1em;overflow-x:auto}</style></head><body>",
             f"<h1>{html.escape(title)}</h1>"]
    for heading, text in tables:
        parts.append(f"<h2>{html.escape(heading)}</h2><pre>{html.escape(text)}</pre>")
    first = True
    for heading, fig in sections:
        parts.append(f"<h2>{html.escape(heading)}</h2>")
        parts.append(fig.to_html(full_html=False, include_plotlyjs="inline" if first else False))
        first = False
    parts.append("</body></html>")
    return write_text_atomic(path, "\n".join(parts))
