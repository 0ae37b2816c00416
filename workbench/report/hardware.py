"""Figures of a hardware profile computed from its own coefficients (any profile: shipped
reference, measured, or saved): the per-layer compute curves, the measured points they were fitted
to (when the profile keeps them) with their residuals, and the collective bandwidths by group size.

A profile's compute curve is per transformer layer and per packed call: ``a*s^2 + b*s`` for each
sequence of ``s`` tokens, plus ``c`` once per call. Pure Python; plotly inside the figure functions.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from workbench.report._style import top_legend

__all__ = ["profile_curves", "profile_points", "compute_figure", "residuals_figure", "bandwidth_figure",
           "describe_profile"]


def _curve_ms(c: Mapping[str, float], pack: Sequence[int]) -> float:
    def a(s: int) -> float:  # a_short for the sequences under short_len, when the curve has one
        return c["a_short"] if c.get("short_len") and s < c["short_len"] else c["a"]

    return sum(a(s) * s * s + c["b"] * s for s in pack) + c["c"]


def profile_curves(profile, lengths: Sequence[int] | None = None) -> dict:
    """Per-layer forward, backward and total ms of one sequence of each length (one packed call),
    from the profile's coefficients: ``{"lengths", "forward_ms", "backward_ms", "total_ms",
    "coefficients": {"forward": {a, b, c}, "backward": {...}}}``. Default lengths: powers of two
    from 64 to 128K."""
    pd = profile.to_dict() if hasattr(profile, "to_dict") else dict(profile)
    ls = list(lengths) if lengths is not None else [1 << k for k in range(6, 18)]
    f, b = pd["forward"], pd["backward"]
    fwd = [_curve_ms(f, [s]) for s in ls]
    bwd = [_curve_ms(b, [s]) for s in ls]
    return {"lengths": ls, "forward_ms": fwd, "backward_ms": bwd, "total_ms": [x + y for x, y in zip(fwd, bwd)],
            "coefficients": {"forward": dict(f), "backward": dict(b)}}


def profile_points(profile) -> list[dict]:
    """The measured packs a profile keeps in ``provenance.measurements`` (quick-fit profiles do),
    each with the fit's prediction and the relative error: ``[{pack, tokens, kind, measured_ms,
    fitted_ms, relative_error, role}]`` (kind: forward or backward; role: ``fit`` or ``heldout``, a
    pack kept out of the fit). Empty for a reference profile."""
    pd = profile.to_dict() if hasattr(profile, "to_dict") else dict(profile)
    out = []
    for m in (pd.get("provenance") or {}).get("measurements") or []:
        pack = [int(x) for x in m.get("pack") or []]
        if not pack:
            continue
        for kind in ("forward", "backward"):
            meas = m.get(f"{kind}_ms")
            if not isinstance(meas, (int, float)):
                continue
            fit = _curve_ms(pd[kind], pack)
            out.append({"pack": pack, "tokens": sum(pack), "kind": kind, "measured_ms": float(meas), "fitted_ms": fit,
                        "relative_error": (float(meas) - fit) / fit if fit > 0 else None,
                        "role": m.get("role", "fit")})
    return out


def describe_profile(profile) -> str:
    """One line: name, GPU, what model it was measured on, and where its figures come from."""
    pd = profile.to_dict() if hasattr(profile, "to_dict") else dict(profile)
    prov = pd.get("provenance") or {}
    when = f", {prov['when']}" if prov.get("when") else ""
    src = prov.get("source") or prov.get("method") or ""
    return (f"{pd['name']}: {pd['gpu']}, {pd.get('gpu_memory_gb', '?')} GB, curves measured on model {pd['model']}; "
            f"{prov.get('kind', '?')}{when}" + (f" ({src})" if src else ""))


def compute_figure(profile, title: str | None = None):
    """Per-layer time of one sequence against its length (log-log): forward, backward and their
    sum from the coefficients, with the measured single-sequence packs as markers."""
    import plotly.graph_objects as go

    pd = profile.to_dict() if hasattr(profile, "to_dict") else dict(profile)
    pts = [p for p in profile_points(pd) if len(p["pack"]) == 1]
    try:  # up to the longest context of the model the curves were measured on (at most 128K)
        from workbench.models import get_model

        top = min(1 << 17, get_model(pd["model"]).max_context)
    except ValueError:
        top = 1 << 17
    top = max(top, 2 * max([p["tokens"] for p in pts], default=0))
    ls = [1 << k for k in range(6, top.bit_length())]
    c = profile_curves(pd, ls)
    fig = go.Figure()
    for key, name, color in (("forward_ms", "forward (fit)", "#4C78A8"), ("backward_ms", "backward (fit)", "#F58518"),
                             ("total_ms", "forward + backward (fit)", "#333")):
        fig.add_scatter(x=c["lengths"], y=c[key], mode="lines", name=name,
                        line=dict(color=color, dash="dot" if key == "total_ms" else "solid"),
                        hovertemplate=f"%{{x:,}} tokens: %{{y:.3g}} ms per layer ({name})<extra></extra>")
    for kind, color in (("forward", "#4C78A8"), ("backward", "#F58518")):
        ps = [p for p in pts if p["kind"] == kind]
        if ps:
            fig.add_scatter(x=[p["tokens"] for p in ps], y=[p["measured_ms"] for p in ps], mode="markers",
                            name=f"{kind} measured", marker=dict(color=color, size=10, symbol="circle-open",
                                                                 line=dict(width=2)))
    f, b = pd["forward"], pd["backward"]
    fig.update_xaxes(type="log", title="sequence length (tokens, log scale)")
    fig.update_yaxes(type="log", title="ms per layer (log scale)")
    fig.update_layout(template="plotly_white", height=380,
                      title=title or (f"{pd['name']}: compute per layer = a·s² + b·s + c "
                                      f"<br><sup>forward a={f['a']:.3g}, b={f['b']:.3g}, c={f['c']:.3g}; "
                                      f"backward a={b['a']:.3g}, b={b['b']:.3g}, c={b['c']:.3g}</sup>"))
    return top_legend(fig)


def residuals_figure(profile, title: str | None = None):
    """Relative error of the fit on every measured pack (measured / fitted - 1), by tokens in the
    pack; empty (with a title saying so) for a profile without measurements."""
    import plotly.graph_objects as go

    pts = profile_points(profile)
    fig = go.Figure()
    for kind, color in (("forward", "#4C78A8"), ("backward", "#F58518")):
        ps = [p for p in pts if p["kind"] == kind and p["relative_error"] is not None]
        if ps:
            fig.add_scatter(x=[p["tokens"] for p in ps], y=[100 * p["relative_error"] for p in ps], mode="markers",
                            name=kind, marker=dict(color=color, size=10),
                            text=[f"pack of {len(p['pack'])}: {', '.join(map(str, p['pack'][:6]))}"
                                  + ("..." if len(p["pack"]) > 6 else "") for p in ps],
                            hovertemplate="%{text}<br>%{y:+.1f}% (measured vs fit)<extra></extra>")
    fig.add_hline(y=0, line_color="#999")
    fig.update_xaxes(type="log", title="tokens in the packed call (log scale)")
    fig.update_yaxes(title="measured / fitted - 1 (%)")
    fig.update_layout(template="plotly_white", height=320,
                      title=title or ("Fit residuals on the measured packs" if pts else
                                      "No measured points in this profile (a reference profile keeps only its fit)"))
    return top_legend(fig)


def bandwidth_figure(profile, title: str | None = None):
    """Collective bandwidth per GPU by group size: all-to-all (Ulysses), point-to-point (ring)
    and all-reduce (gradient sync), log-2 x axis."""
    import plotly.graph_objects as go

    pd = profile.to_dict() if hasattr(profile, "to_dict") else dict(profile)
    fig = go.Figure()
    for key, name, color in (("all_to_all_gbps", "all-to-all (Ulysses SP)", "#4C78A8"),
                             ("p2p_gbps", "point-to-point (ring SP)", "#54A24B"),
                             ("allreduce_gbps", "all-reduce (gradient sync)", "#E45756")):
        t = {int(k): float(v) for k, v in (pd.get(key) or {}).items()}
        if t:
            ks = sorted(t)
            fig.add_scatter(x=ks, y=[t[k] for k in ks], mode="lines+markers", name=name, line=dict(color=color),
                            hovertemplate=f"group of %{{x}}: %{{y:.3g}} GB/s ({name})<extra></extra>")
    fig.update_xaxes(type="log", dtick=0.30103, title="group size (GPUs, log scale)")
    fig.update_yaxes(type="log", title="GB/s per GPU (log scale)")
    fig.update_layout(template="plotly_white", height=340,
                      title=title or f"{pd['name']}: collective bandwidth by group size")
    return top_legend(fig)

