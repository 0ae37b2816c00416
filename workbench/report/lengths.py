"""Figures (and the plain data behind them) about a length distribution: where the sequences, the
tokens and the attention work are; what a max-context policy cuts; and how unevenly a static
layout's replicas are loaded when each gets the same number of tokens.

Attention work grows as s^2 (every token attends to every earlier one), so a long tail that holds
a small share of the sequences can hold most of the attention work: :func:`length_profile` puts
the three shares side by side. Pure numpy; plotly only inside the figure functions.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from workbench.report._style import add_points, top_legend

__all__ = ["length_profile", "policy_effect", "token_balanced_loads", "lengths_histogram_figure",
           "cdf_figure", "share_figure", "policy_figure", "imbalance_figure"]

_SEQ, _TOK, _WORK = "#4C78A8", "#F58518", "#E45756"


def _arr(lengths: Any) -> np.ndarray:
    a = np.asarray(getattr(lengths, "lengths", lengths))
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"lengths must be a non-empty 1-D array, got shape {a.shape}")
    if a.dtype.kind not in "iu" or a.min() < 1:
        raise ValueError("lengths must be positive integers")
    return a.astype(np.int64)


def length_profile(lengths: Any, *, max_points: int = 400) -> dict:
    """Where the sequences, tokens and attention work (s^2) of ``lengths`` are, as plain data.

    Returns ``{"bins": {edges, centers, counts, sequence_share, token_share, work_share},
    "cdf": {lengths, sequences, tokens, work}}``: power-of-two bins (bin k holds
    ``[2^k, 2^(k+1))``), each share summing to 1; the CDF gives, at a length L, the share of
    sequences, tokens and attention work in sequences of at most L tokens (at most ``max_points``
    points, always including the longest sequence). Raises ValueError for bad lengths."""
    from workbench.data import length_histogram

    s = _arr(lengths)
    hist = length_histogram(s)
    edges = np.asarray(hist["edges"])
    k = np.clip(np.searchsorted(edges, s, side="right") - 1, 0, len(edges) - 2)
    sq = s.astype(np.float64) ** 2
    work = np.bincount(k, weights=sq, minlength=len(edges) - 1)
    srt = np.sort(s)
    cs_seq = np.arange(1, srt.size + 1) / srt.size
    cs_tok = np.cumsum(srt, dtype=np.float64) / float(srt.sum())
    cs_work = np.cumsum(srt.astype(np.float64) ** 2) / float(sq.sum())
    # the last index of each distinct length (a CDF is a step function), then at most max_points
    last = np.flatnonzero(np.r_[srt[1:] != srt[:-1], True])
    if last.size > max_points:
        pick = np.unique(np.r_[np.linspace(0, last.size - 1, max_points - 1).round().astype(np.int64), last.size - 1])
        last = last[pick]
    return {
        "bins": {"edges": [float(x) for x in edges], "centers": hist["centers"], "counts": hist["counts"],
                 "sequence_share": [c / s.size for c in hist["counts"]], "token_share": hist["token_share"],
                 "work_share": [float(w / sq.sum()) for w in work]},
        "cdf": {"lengths": [int(x) for x in srt[last]], "sequences": [float(x) for x in cs_seq[last]],
                "tokens": [float(x) for x in cs_tok[last]], "work": [float(x) for x in cs_work[last]]},
    }


def policy_effect(raw: Any, max_len: int | None, policy: str) -> dict:
    """What a max-context policy does to ``raw`` lengths, as plain data: the sequences over
    ``max_len`` (count, share, their tokens and the tokens removed), and a power-of-two histogram
    of the affected sequences' original lengths. ``max_len`` None: nothing is cut."""
    s = _arr(raw)
    if not max_len:
        return {"max_len": None, "policy": policy, "affected": 0, "affected_share": 0.0, "affected_tokens": 0,
                "tokens_removed": 0, "tokens_removed_share": 0.0, "edges": [], "counts": []}
    over = s[s > max_len]
    removed = int((over - max_len).sum()) if policy == "clip" else int(over.sum()) if policy == "drop" else 0
    out = {"max_len": int(max_len), "policy": policy, "affected": int(over.size),
           "affected_share": float(over.size / s.size), "affected_tokens": int(over.sum()),
           "tokens_removed": removed, "tokens_removed_share": float(removed / s.sum()), "edges": [], "counts": []}
    if over.size:
        lo = int(np.floor(np.log2(max_len)))
        hi = int(np.floor(np.log2(over.max()))) + 1
        edges = 2.0 ** np.arange(lo, hi + 1)
        counts, _ = np.histogram(over, bins=edges)
        out["edges"], out["counts"] = [float(x) for x in edges], [int(c) for c in counts]
    return out


def token_balanced_loads(batches: Sequence[Any], cost, degree: int) -> dict:
    """The load of every replica of a static layout (all sequences on SP groups of ``degree``,
    data parallel over ``num_gpus // degree`` replicas; a degree that does not divide the GPUs leaves
    ``num_gpus % degree`` of them idle, ``idle_gpus``) when each replica gets the same number of
    tokens, as a token-balanced data loader deals them: each batch's sequences, in their order,
    are cut into consecutive runs of about ``tokens / replicas`` tokens (a sequence goes to the
    replica its first token falls in). A replica's load is the cost model's time of its sequences
    on that degree (``cost.time``, communication included) plus one group overhead.

    Equal tokens are not equal work: attention grows as s^2, so the replica that got a long
    sequence takes longer and the others wait for it at the gradient sync. Returns
    ``{"degree", "replicas", "batches": [{"loads_ms", "tokens", "imbalance"}], "mean_imbalance"}``
    with imbalance = slowest replica / mean replica, and ``too_long``: sequences whose activations do
    not fit one group of that degree (the layout could not run them at all; their time is still
    counted). Raises ValueError for a degree that is not a candidate."""
    n = int(cost.cluster.num_gpus)
    d = int(degree)
    if d not in cost.degrees or d > n:
        raise ValueError(f"degree {d} is not a candidate degree of this cluster ({list(cost.degrees)})")
    reps = n // d
    out = []
    for b in batches:
        s = np.asarray(getattr(b, "lengths", b), dtype=np.int64)
        first_tok = np.cumsum(s) - s
        share = float(s.sum()) / reps
        rep = np.minimum((first_tok / share).astype(np.int64), reps - 1)
        t = cost.time(s, d)
        loads = np.bincount(rep, weights=t, minlength=reps) + np.where(
            np.bincount(rep, minlength=reps) > 0, cost.group_overhead_ms(d), 0.0)
        toks = np.bincount(rep, weights=s.astype(np.float64), minlength=reps)
        mean = float(loads.mean())
        too_long = int((cost.memory(s, d) > cost.memory_budget_gb).sum())
        out.append({"loads_ms": [float(x) for x in loads], "tokens": [int(x) for x in toks],
                    "imbalance": float(loads.max() / mean) if mean > 0 else 1.0, "too_long": too_long})
    return {"degree": d, "replicas": reps, "idle_gpus": n - reps * d, "batches": out,
            "mean_imbalance": float(np.mean([b["imbalance"] for b in out])) if out else 1.0,
            "too_long": int(sum(b["too_long"] for b in out))}


# ------------------------------------------------------------------------------------------------
# figures
# ------------------------------------------------------------------------------------------------


def _vline(fig, x: float | None, text: str) -> None:
    if x:
        fig.add_vline(x=x, line_dash="dash", line_color="#333", annotation_text=text, annotation_position="top left")


def lengths_histogram_figure(profile: Mapping[str, Any], *, max_len: int | None = None,
                             title: str = "Sequence lengths"):
    """Sequences per power-of-two length bin on log axes (``length_profile(...)["bins"]``), with
    the max context as a dashed line and the bins beyond it drawn in red."""
    import plotly.graph_objects as go

    b = profile["bins"]
    e = b["edges"]
    widths = [e[i + 1] - e[i] for i in range(len(e) - 1)]
    over = [bool(max_len) and e[i + 1] > max_len for i in range(len(e) - 1)]
    labels = [f"{int(e[i]):,}-{int(e[i + 1]) - 1:,}" for i in range(len(e) - 1)]
    fig = go.Figure()
    fig.add_bar(x=b["centers"], y=b["counts"], width=widths, customdata=labels, name="sequences",
                marker_color=[_WORK if o else _SEQ for o in over],
                hovertemplate="%{customdata} tokens<br>%{y:,} sequences<extra></extra>")
    _vline(fig, max_len, f"max context {max_len:,}" if max_len else "")
    fig.update_xaxes(type="log", title="sequence length (tokens, log scale)")
    fig.update_yaxes(type="log", title="sequences (log scale)")
    fig.update_layout(title=title, template="plotly_white", height=360, bargap=0.05, showlegend=False,
                      margin=dict(t=60, b=50))
    return fig


def cdf_figure(profile: Mapping[str, Any], *, max_len: int | None = None,
               title: str = "Cumulative share by length"):
    """Three cumulative curves against length (log x): the share of sequences, of tokens and of
    attention work (s^2) in sequences of at most that length."""
    import plotly.graph_objects as go

    c = profile["cdf"]
    fig = go.Figure()
    for key, name, color in (("sequences", "sequences", _SEQ), ("tokens", "tokens", _TOK),
                             ("work", "attention work (s²)", _WORK)):
        fig.add_scatter(x=c["lengths"], y=[100 * v for v in c[key]], mode="lines", name=name,
                        line=dict(color=color, width=2.5, shape="hv"),
                        hovertemplate=f"up to %{{x:,}} tokens: %{{y:.1f}}% of {name}<extra></extra>")
    _vline(fig, max_len, f"max context {max_len:,}" if max_len else "")
    fig.update_xaxes(type="log", title="sequence length (tokens, log scale)")
    fig.update_yaxes(title="% in sequences up to this length", range=[0, 101])
    fig.update_layout(title=title, template="plotly_white", height=360,
                      margin=dict(t=60, b=50))
    return top_legend(fig)


def share_figure(profile: Mapping[str, Any], title: str = "Share of sequences, tokens and attention work by length"):
    """Grouped bars per power-of-two length bin: the bin's % of sequences, of tokens and of
    attention work (s^2)."""
    import plotly.graph_objects as go

    b = profile["bins"]
    e = b["edges"]
    keep = [i for i, c in enumerate(b["counts"]) if c > 0]
    labels = [f"{_short(e[i])}-{_short(e[i + 1])}" for i in keep]
    fig = go.Figure()
    for key, name, color in (("sequence_share", "sequences", _SEQ), ("token_share", "tokens", _TOK),
                             ("work_share", "attention work (s²)", _WORK)):
        fig.add_bar(x=labels, y=[100 * b[key][i] for i in keep], name=name, marker_color=color,
                    hovertemplate=f"%{{x}} tokens: %{{y:.1f}}% of {name}<extra></extra>")
    fig.update_xaxes(title="sequence length bin (tokens)")
    fig.update_yaxes(title="% of the whole")
    fig.update_layout(barmode="group", title=title, template="plotly_white", height=360, margin=dict(t=60, b=50))
    return top_legend(fig)


def _short(x: float) -> str:
    x = int(x)
    for unit, div in (("M", 1 << 20), ("K", 1 << 10)):
        if x >= div and x % div == 0:
            return f"{x // div}{unit}"
    return str(x)


def policy_figure(effect: Mapping[str, Any], title: str | None = None):
    """The sequences a max-context policy affects, by original length (power-of-two bins), with
    the counts and tokens removed in the title."""
    import plotly.graph_objects as go

    e, c = effect.get("edges") or [], effect.get("counts") or []
    fig = go.Figure()
    if c:
        fig.add_bar(x=[f"{_short(e[i])}-{_short(e[i + 1])}" for i in range(len(c))], y=c, marker_color=_WORK,
                    hovertemplate="%{x} tokens: %{y:,} sequences<extra></extra>", name="affected")
    ml = effect.get("max_len")
    if title is None:
        if not ml:
            title = "No max context: nothing is cut"
        elif not effect.get("affected"):
            title = f"No sequence is longer than the max context {ml:,}"
        else:
            verb = {"clip": "clipped", "drop": "dropped", "split": "split", "error": "refused"}.get(effect["policy"], "cut")
            title = (f"{effect['affected']:,} sequences ({100 * effect['affected_share']:.2f}%) over {ml:,} tokens are {verb}"
                     + (f"; {100 * effect['tokens_removed_share']:.1f}% of tokens removed" if effect["tokens_removed"]
                        else "; no token lost"))
    fig.update_xaxes(title="original length (tokens)")
    fig.update_yaxes(title="sequences", rangemode="tozero")
    fig.update_layout(title=title, template="plotly_white", height=300, showlegend=False, margin=dict(t=60, b=50))
    return fig


def imbalance_figure(loads: Mapping[str, Any], title: str | None = None):
    """Each replica's load in every sampled batch (``token_balanced_loads`` output) as a strip of
    markers per batch, slowest replica highlighted, with the batch's imbalance above it."""
    import plotly.graph_objects as go

    fig = go.Figure()
    xs, ys, txt = [], [], []
    for k, b in enumerate(loads["batches"]):
        for r, v in enumerate(b["loads_ms"]):
            xs.append(f"batch {k}")
            ys.append(v / 1e3)
            txt.append(f"replica {r}: {b['tokens'][r]:,} tokens")
    add_points(fig, xs, ys, mode="markers", marker=dict(color=_SEQ, size=9, opacity=0.6), name="replica",
               text=txt, hovertemplate="%{text}<br>%{y:.2f}s<extra></extra>")
    slow = [max(b["loads_ms"]) / 1e3 for b in loads["batches"]]
    mean = [float(np.mean(b["loads_ms"])) / 1e3 for b in loads["batches"]]
    cats = [f"batch {k}" for k in range(len(slow))]
    fig.add_scatter(x=cats, y=slow, mode="markers+text", marker=dict(color=_WORK, size=13, symbol="diamond"),
                    text=[f"×{b['imbalance']:.2f}" for b in loads["batches"]], textposition="top center",
                    name="slowest replica (everyone waits for it)")
    fig.add_scatter(x=cats, y=mean, mode="markers", marker=dict(color="#333", size=12, symbol="line-ew-open",
                                                                line=dict(width=3)), name="mean replica")
    fig.update_yaxes(title="replica time per step (s)", range=[0, 1.2 * max(slow, default=1.0)])
    warn = (f"<br><sup>{loads['too_long']} sequence(s) do not even fit a degree-{loads['degree']} group's memory</sup>"
            if loads.get("too_long") else "")
    fig.update_layout(title=title or (f"Static degree {loads['degree']} ({loads['replicas']} replicas), equal tokens each: "
                                      f"slowest / mean = {loads['mean_imbalance']:.2f} on average{warn}"),
                      template="plotly_white", height=360, margin=dict(t=60, b=40))
    return top_legend(fig)
