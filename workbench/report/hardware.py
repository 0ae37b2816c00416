"""Figures of a hardware profile computed from its own coefficients (any profile: shipped
reference, measured, or saved): the per-layer compute curves, the measured points they were fitted
to (when the profile keeps them) with their residuals, the collectives' bandwidth and latency by
group size (Ulysses' all-to-all, ring steps, the all-reduce, and the all-gather and reduce-scatter
that context parallelism runs on its sub-groups and FSDP over all ranks), and the measured extras
of a group's split (Ulysses' and context parallelism's, fixed and per token, and a composite u x c
split's measured residual beyond those two); the host link and host memory offloaded activations
use (``host_link``, ``host_rows``: a table, not a figure).

A profile's compute curve is per transformer layer and per packed call: ``a*s^2 + b*s`` for each
sequence of ``s`` tokens, plus ``c`` once per call. Pure Python; plotly inside the figure functions.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from workbench.report._style import top_legend

__all__ = ["profile_curves", "profile_points", "compute_figure", "residuals_figure", "bandwidth_figure",
           "describe_profile", "profile_links", "split_extras", "split_extras_figure", "host_link", "host_rows", "LINKS"]

LINKS = (("all_to_all", "all-to-all (Ulysses SP)", "#4C78A8"),
         ("p2p", "point-to-point (ring SP)", "#54A24B"),
         ("allreduce", "all-reduce (gradient sync)", "#E45756"),
         ("allgather", "all-gather (CP K/V; FSDP parameters at all ranks)", "#B279A2"),
         ("reduce_scatter", "reduce-scatter (CP K/V gradients; FSDP gradients at all ranks)", "#F58518"))
"""The collectives a profile may hold by group size: ``(kind, label, colour)``; ``<kind>_gbps`` and
``<kind>_latency_ms`` are its fields."""


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


def profile_links(profile) -> dict:
    """The profile's collectives by group size, as plain data: ``{kind: {group size: {"gbps",
    "latency_ms"}}}`` for every kind of :data:`LINKS` the profile has (``latency_ms`` None where it
    has no latency figure for that size). The all-gather and reduce-scatter tables serve context
    parallelism's sub-groups of every size and FSDP over all ranks; a measured profile's entry at
    its world size is FSDP's (``provenance.cp_collectives`` says which)."""
    pd = profile.to_dict() if hasattr(profile, "to_dict") else dict(profile)
    out = {}
    for kind, _, _ in LINKS:
        bw = {int(k): float(v) for k, v in (pd.get(f"{kind}_gbps") or {}).items()}
        lat = {int(k): float(v) for k, v in (pd.get(f"{kind}_latency_ms") or {}).items()}
        if bw:
            out[kind] = {d: {"gbps": bw[d], "latency_ms": lat.get(d)} for d in sorted(bw)}
    return out


def bandwidth_figure(profile, title: str | None = None):
    """Collectives by group size, two panels: bandwidth per GPU (left) and latency per call (right)
    of the all-to-all (Ulysses), point-to-point (ring), all-reduce (gradient sync), and the
    all-gather and reduce-scatter (context parallelism's K/V on its sub-groups; FSDP's at all
    ranks); log-2 x axes. A kind without latency figures has no line on the right."""
    from plotly.subplots import make_subplots

    pd = profile.to_dict() if hasattr(profile, "to_dict") else dict(profile)
    links = profile_links(pd)
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12)
    for kind, name, color in LINKS:
        t = links.get(kind)
        if not t:
            continue
        ks = sorted(t)
        fig.add_scatter(x=ks, y=[t[k]["gbps"] for k in ks], mode="lines+markers", name=name, line=dict(color=color),
                        legendgroup=kind, row=1, col=1,
                        hovertemplate=f"group of %{{x}}: %{{y:.3g}} GB/s ({name})<extra></extra>")
        lk = [k for k in ks if t[k]["latency_ms"] is not None]
        if lk:
            fig.add_scatter(x=lk, y=[t[k]["latency_ms"] for k in lk], mode="lines+markers", name=f"{name}: latency",
                            line=dict(color=color, dash="dot"), marker=dict(symbol="diamond"), legendgroup=kind,
                            showlegend=False, row=1, col=2,
                            hovertemplate=f"group of %{{x}}: %{{y:.3g}} ms per call ({name})<extra></extra>")
    fig.update_xaxes(type="log", dtick=0.30103, title="group size (GPUs, log scale)")
    fig.update_yaxes(type="log", title="bandwidth: GB/s per GPU (log scale)", row=1, col=1)
    fig.update_yaxes(title="latency: ms per call", rangemode="tozero", row=1, col=2)
    fig.update_layout(template="plotly_white", height=380,
                      title=title or f"{pd['name']}: collectives by group size")
    return top_legend(fig, top=120)


_EXTRAS = (("sp", "Ulysses over u ranks", "#4C78A8"), ("cp", "context parallelism over c ranks", "#B279A2"),
           ("split", "composite split u x c: beyond its parts", "#F58518"))


def split_extras(profile) -> dict:
    """The measured extras of a group's split (what real micro-steps cost beyond the compute and
    collective fits), per layer, as plain data: ``{"ulysses": {u: {"fixed_ms", "per_1k_tokens_ms"}},
    "cp": {c: {...}}, "splits": {"uxc": {...}}}`` from ``sp_overhead_ms``/``sp_token_ms``,
    ``cp_overhead_ms``/``cp_token_ms`` and ``split_overhead_ms``/``split_token_ms`` (per 1,000 tokens
    of the group's sequences). A ``u x c`` split pays the Ulysses part at u, the CP part at c and,
    under ``splits``, its own measured residual beyond those two (keyed ``"2x2"``, in increasing c
    then u); CP's entries also carry ``attention_factor`` (``cp_attention_factor``: its extra
    attention as a share of the rank's causal attention). Empty parts for a profile without them
    (profiles written before the composite residual have no ``splits`` entries)."""
    from workbench.specs import split_key

    pd = profile.to_dict() if hasattr(profile, "to_dict") else dict(profile)
    out = {}
    for key, name in (("sp", "ulysses"), ("cp", "cp")):
        fixed = {int(k): float(v) for k, v in (pd.get(f"{key}_overhead_ms") or {}).items()}
        tok = {int(k): float(v) for k, v in (pd.get(f"{key}_token_ms") or {}).items()}
        attn = {int(k): float(v) for k, v in (pd.get("cp_attention_factor") or {}).items()} if key == "cp" else {}
        out[name] = {d: {"fixed_ms": fixed.get(d, 0.0), "per_1k_tokens_ms": 1e3 * tok.get(d, 0.0),
                         **({"attention_factor": attn.get(d, 0.0)} if key == "cp" else {})}
                     for d in sorted(set(fixed) | set(tok) | set(attn))}
    fixed, tok = (dict(pd.get(f"split_{k}") or {}) for k in ("overhead_ms", "token_ms"))

    def order(k: str) -> tuple[int, int]:
        u, c = (int(x) for x in str(k).lower().split("x"))
        return c, u
    out["splits"] = {split_key(*order(k)[::-1]): {"fixed_ms": float(fixed.get(k, 0.0)),
                                                  "per_1k_tokens_ms": 1e3 * float(tok.get(k, 0.0))}
                     for k in sorted(set(fixed) | set(tok), key=order)}
    return out


def split_extras_figure(profile, title: str | None = None):
    """The measured extras of a split per layer, by group size, three panels: the fixed part per
    micro-step, the part per 1,000 tokens, Ulysses (``sp_*``) and context parallelism (``cp_*``)
    side by side, with the composite splits' residual beyond those parts (``split_*``, one bar per
    measured split, labelled ``"2x2"``) after them, and CP's extra attention as a share of the
    rank's causal attention (right). No traces (and a title saying so) for a profile without them."""
    from plotly.subplots import make_subplots

    pd = profile.to_dict() if hasattr(profile, "to_dict") else dict(profile)
    ex = split_extras(pd)
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.09)
    for (key, name, color), part in zip(_EXTRAS, ("ulysses", "cp", "splits")):
        t = ex.get(part) or {}
        if not t:
            continue
        ks = list(t) if part == "splits" else sorted(t)  # splits: in increasing c, then u (split_extras)
        for col, field in ((1, "fixed_ms"), (2, "per_1k_tokens_ms")):
            fig.add_bar(x=[str(k) for k in ks], y=[t[k][field] for k in ks], name=name, marker_color=color,
                        legendgroup=key, showlegend=col == 1, row=1, col=col,
                        hovertemplate=("split %{x}, beyond its parts: %{y:.3g} ms per layer<extra></extra>"
                                       if part == "splits" else
                                       f"{name}, %{{x}} ranks: %{{y:.3g}} ms per layer<extra></extra>"))
        if part == "cp" and any(v["attention_factor"] for v in t.values()):
            fig.add_bar(x=[str(k) for k in ks], y=[t[k]["attention_factor"] for k in ks], name=name, marker_color=color,
                        legendgroup=key, showlegend=False, row=1, col=3,
                        hovertemplate=f"{name}, %{{x}} ranks: extra attention %{{y:.2f}} x the causal share<extra></extra>")
    fig.update_xaxes(title="ranks of the Ulysses or CP sub-group; u x c: a composite split", type="category")
    fig.update_yaxes(title="fixed: ms per layer and micro-step", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title="ms per layer and 1,000 tokens", rangemode="tozero", row=1, col=2)
    fig.update_yaxes(title="CP's extra attention / causal share", rangemode="tozero", row=1, col=3)
    fig.update_layout(template="plotly_white", height=340, barmode="group",
                      title=title or (f"{pd['name']}: what a group's split costs beyond its compute and collectives"
                                      if fig.data else f"{pd['name']} has no measured split extras"))
    return top_legend(fig)



def host_link(profile) -> dict:
    """The host side of a profile, as plain data: ``{"per_gpu_gbps"`` (``host_link_gbps``: one GPU
    copying alone, the slower direction), ``"node_gbps"`` (``host_link_node_gbps``: all of a node's
    GPUs at once, in total), ``"gpus_per_node"`` (the profile's, else the GPUs that copied at once
    when it was measured; None: unknown), ``"per_gpu_node_gbps"`` (``node_gbps / gpus_per_node``:
    each GPU's when the whole node copies), ``"host_memory_gb"`` (per node), ``"offload"`` (whether
    plans with it may offload: it has a host link), ``"kind"`` (the provenance's: measured,
    reference, estimate), ``"note"`` (where the link's figures come from: the profile's
    ``provenance.host_link``, else for a profile not measured here its ``provenance.host`` note, the
    measured profiles' ``host`` being the machine's name) and ``"memory_note"``}. None where the
    profile has no figure."""
    pd = profile.to_dict() if hasattr(profile, "to_dict") else dict(profile)
    prov = pd.get("provenance") or {}
    kind = prov.get("kind")

    def num(key):
        v = pd.get(key)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else None

    per, node, mem = num("host_link_gbps"), num("host_link_node_gbps"), num("host_memory_gb")
    n = pd.get("gpus_per_node") or prov.get("host_link_gpus") or prov.get("gpus_per_node")
    n = int(n) if isinstance(n, (int, float)) and n >= 1 else None
    note = prov.get("host_link")
    return {"per_gpu_gbps": per, "node_gbps": node, "gpus_per_node": n,
            "per_gpu_node_gbps": node / n if node and n else None, "host_memory_gb": mem,
            "offload": bool(per or node), "kind": kind, "note": str(note) if note else None,
            "memory_note": prov.get("host_memory")}


def host_rows(profile) -> list[dict]:
    """The host side of a profile as table rows ``{"what", "value", "gbps" | "gb"}`` (what the
    Hardware panel shows): the host link of one GPU alone, of each GPU when the whole node copies (and
    the node's total), and the host memory per node; a profile without a host link says so in one row
    ("none: plans do not offload")."""
    h = host_link(profile)
    rows = []
    if not h["offload"]:
        rows.append({"what": "host link (pinned host-device copies)", "value": "none: plans do not offload",
                     "gbps": None})
    else:
        if h["per_gpu_gbps"]:
            rows.append({"what": "host link, one GPU copying alone", "value": f"{h['per_gpu_gbps']:.3g} GB/s",
                         "gbps": h["per_gpu_gbps"]})
        if h["node_gbps"]:
            n = h["gpus_per_node"]
            each = (f"{h['per_gpu_node_gbps']:.3g} GB/s per GPU (node total {h['node_gbps']:.3g} GB/s)" if n
                    else f"node total {h['node_gbps']:.3g} GB/s")
            rows.append({"what": f"host link, all {n or 'the'} GPUs of a node copying at once", "value": each,
                         "gbps": h["per_gpu_node_gbps"] if n else None, "node_gbps": h["node_gbps"]})
    rows.append({"what": "host memory per node",
                 "value": f"{h['host_memory_gb']:,.0f} GB" if h["host_memory_gb"] else "unknown (give --host-memory)",
                 "gb": h["host_memory_gb"]})
    return rows
