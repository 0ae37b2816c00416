"""Plotly figures of a hardware profile and its fidelity, built from plain data.

- :func:`fit_figure`: measured per-layer times (fit points filled, held-out points open) and the
  fitted curves ``a*s^2 + b*s + c`` over the sequence length, forward and backward;
- :func:`residual_figure`: relative residuals of the fit points and errors of the held-out ones;
- :func:`collectives_figure`: measured collective times against message size with the fitted
  ``latency + bytes / bandwidth`` line, per kind and group size;
- :func:`fidelity_figure`: predicted against measured time of every group (by degree) and step of a
  training run (``workbench.profile.check_fidelity``'s output), with the ``y = x`` line.

They take a ``ProfileResult`` (or its ``to_dict()``) and plain dicts, and return ``go.Figure``; the
Hardware panel wraps them. plotly is imported inside the functions.
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["fit_figure", "residual_figure", "collectives_figure", "fidelity_figure"]

_COLORS = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#FF9DA6", "#9D755D"]


def _plain(result: Any) -> Mapping:
    return result.to_dict() if hasattr(result, "to_dict") else result


def _pack_label(pack) -> str:
    if len(pack) == 1:
        return f"one sequence of {pack[0]:,}"
    if len(set(pack)) == 1:
        return f"{len(pack)} x {pack[0]:,}"
    return f"{len(pack)} sequences: {', '.join(f'{s:,}' for s in pack)}"


def fit_figure(result, title: str | None = None):
    """Measured per-layer forward and backward time against tokens, with the fitted curves for one
    sequence of that length. Packs of several sequences are drawn at their token count (their
    predicted time, a point, sits below the single-sequence curve: less attention)."""
    import plotly.graph_objects as go

    r = _plain(result)
    prof = r["profile"]
    rows = r["compute"]
    fig = go.Figure()
    longest = max((max(x["pack"]) for x in rows), default=1)
    xs = [longest * i / 200 for i in range(1, 201)]
    for k, (key, label) in enumerate((("forward", "forward"), ("backward", "backward"))):
        color = _COLORS[k]
        for role, symbol, name in (("fit", "circle", "fitted on"), ("heldout", "circle-open", "held out")):
            pts = [x for x in rows if x.get("role", "fit") == role]
            if not pts:
                continue
            fig.add_scatter(x=[x["tokens"] for x in pts], y=[x[f"{key}_ms"] for x in pts], mode="markers",
                            name=f"{label}: measured ({name})", marker=dict(color=color, symbol=symbol, size=9),
                            customdata=[_pack_label(x["pack"]) for x in pts],
                            hovertemplate="%{customdata}<br>%{y:.3f} ms per layer<extra></extra>")
        c = prof[key]
        short = c.get("short_len")
        fig.add_scatter(x=xs, y=[(c["a_short"] if short and s < short else c["a"]) * s * s + c["b"] * s + c["c"]
                                 for s in xs], mode="lines",
                        name=f"{label}: fit {c['a']:.2e}·s² + {c['b']:.2e}·s + {c['c']:.2f}",
                        line=dict(color=color))
    fig.update_xaxes(title="tokens in the pack")
    fig.update_yaxes(title="ms per layer")
    fig.update_layout(title=title or f"Compute of {prof['model']} on {prof['gpu']}", template="plotly_white", height=420,
                      legend=dict(orientation="h", y=-0.2))
    return fig


def residual_figure(result, title: str | None = None):
    """Relative error (measured - predicted) / measured in % of every fit point and every held-out
    point, forward and backward, against tokens; held-out median and worst in the title."""
    import plotly.graph_objects as go

    r = _plain(result)
    fig = go.Figure()
    for k, key in enumerate(("forward", "backward")):
        f = r["fits"][key]
        fig.add_scatter(x=[sum(p) for p in f["packs"]],
                        y=[100 * (m - p) / m for m, p in zip(f["measured_ms"], f["predicted_ms"])], mode="markers",
                        name=f"{key}: fit points", marker=dict(color=_COLORS[k], size=9),
                        customdata=[_pack_label(p) for p in f["packs"]],
                        hovertemplate="%{customdata}<br>%{y:+.1f}%<extra></extra>")
        h = (r.get("heldout") or {}).get(key) or {}
        pts = h.get("points") or []
        if pts:
            fig.add_scatter(x=[p["tokens"] for p in pts],
                            y=[100 * (p["measured_ms"] - p["predicted_ms"]) / p["measured_ms"] for p in pts],
                            mode="markers", name=f"{key}: held out", marker=dict(color=_COLORS[k], size=11,
                                                                                  symbol="diamond-open"),
                            customdata=[_pack_label(p["pack"]) for p in pts],
                            hovertemplate="%{customdata}<br>%{y:+.1f}%<extra></extra>")
    fig.add_hline(y=0, line_color="black", line_width=1)
    tot = (r.get("heldout") or {}).get("total") or {}
    sub = (f"held-out fwd+bwd error: median {tot['median_ape']:.1f}%, worst {tot['worst_ape']:.1f}%"
           if tot.get("count") else "no held-out points")
    fig.update_xaxes(title="tokens in the pack")
    fig.update_yaxes(title="(measured - predicted) / measured, %")
    fig.update_layout(title=title or f"Residuals ({sub})", template="plotly_white", height=380,
                      legend=dict(orientation="h", y=-0.25))
    return fig


def collectives_figure(result, title: str | None = None):
    """Measured time per call against message bytes per rank (log-log), one colour per collective
    and group size, with the fitted ``latency + bytes / bandwidth`` line."""
    import plotly.graph_objects as go

    from workbench.profile.fit import wire_bytes

    r = _plain(result)
    fig = go.Figure()
    k = 0
    for kind, by in (r.get("collective_fits") or {}).items():
        for d, f in sorted(by.items(), key=lambda x: int(x[0])):
            color = _COLORS[k % len(_COLORS)]
            k += 1
            d = int(d)
            label = f"{kind.replace('_', '-')}, {d} ranks"
            fig.add_scatter(x=f["message_bytes"], y=f["measured_ms"], mode="markers", name=f"{label}: measured",
                            marker=dict(color=color, size=9), legendgroup=label,
                            hovertemplate="%{x:,} B per rank<br>%{y:.3f} ms<extra></extra>")
            lo, hi = min(f["message_bytes"]), max(f["message_bytes"])
            xs = [lo * (hi / lo) ** (i / 40) for i in range(41)] if hi > lo else [lo]
            ys = [f["latency_ms"] + wire_bytes(kind, x, d) / (f["gbps"] * 1e9) * 1e3 for x in xs]
            fig.add_scatter(x=xs, y=ys, mode="lines", line=dict(color=color), legendgroup=label,
                            name=f"{label}: {f['latency_ms']:.3f} ms + bytes / {f['gbps']:.2f} GB/s")
    fig.update_xaxes(type="log", title="message bytes per rank")
    fig.update_yaxes(type="log", title="ms per call")
    fig.update_layout(title=title or "Collectives: latency and bandwidth", template="plotly_white", height=420,
                      legend=dict(orientation="h", y=-0.25))
    return fig


def fidelity_figure(check: Mapping, title: str | None = None):
    """Predicted against measured time of a training run's groups (one colour per degree) and steps
    (diamonds), with ``y = x``. ``check`` is ``workbench.profile.check_fidelity``'s output."""
    import plotly.graph_objects as go

    fig = go.Figure()
    groups = check.get("groups") or []
    for k, d in enumerate(sorted({g["degree"] for g in groups})):
        gs = [g for g in groups if g["degree"] == d]
        fig.add_scatter(x=[g["predicted_ms"] for g in gs], y=[g["measured_ms"] for g in gs], mode="markers",
                        name=f"degree {d} groups", marker=dict(color=_COLORS[k % len(_COLORS)], size=8, opacity=0.8),
                        customdata=[[g["step"], g["micro_step"], g["ranks"][0], g["ranks"][-1], g["sequences"],
                                     g["tokens"]] for g in gs],
                        hovertemplate="step %{customdata[0]}, micro-step %{customdata[1]}, ranks %{customdata[2]}-"
                                      "%{customdata[3]}: %{customdata[4]} seqs, %{customdata[5]:,} tokens<br>"
                                      "predicted %{x:.1f} ms, measured %{y:.1f} ms<extra></extra>")
    steps = check.get("steps") or []
    if steps:
        fig.add_scatter(x=[s["predicted_ms"] for s in steps], y=[s["measured_ms"] for s in steps], mode="markers",
                        name="steps", marker=dict(color="black", symbol="diamond", size=10),
                        customdata=[s["step"] for s in steps],
                        hovertemplate="step %{customdata}: predicted %{x:.0f} ms, measured %{y:.0f} ms<extra></extra>")
    vals = [v for g in groups for v in (g["predicted_ms"], g["measured_ms"])] + \
           [v for s in steps for v in (s["predicted_ms"], s["measured_ms"])]
    if vals:
        lo, hi = min(vals), max(vals)
        fig.add_scatter(x=[lo, hi], y=[lo, hi], mode="lines", name="measured = predicted",
                        line=dict(color="grey", dash="dash"))
    se, ge = check.get("step_error") or {}, check.get("group_error") or {}

    def pct(e, k):
        return f"{e[k]:.1f}%" if isinstance(e.get(k), (int, float)) else "-"

    fig.update_xaxes(type="log", title="predicted (ms)")
    fig.update_yaxes(type="log", title="measured (ms)")
    fig.update_layout(title=title or (f"{check.get('profile')} vs run {check.get('run')}: step error median "
                                      f"{pct(se, 'median_ape')} (worst {pct(se, 'worst_ape')}), group error median "
                                      f"{pct(ge, 'median_ape')} (worst {pct(ge, 'worst_ape')})"),
                      template="plotly_white", height=460, legend=dict(orientation="h", y=-0.2))
    return fig
