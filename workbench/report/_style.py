"""Layout shared by the figures: the legend above the plot (below it, it collides with rotated tick
labels and axis titles), under a title with room for two lines."""

from __future__ import annotations

__all__ = ["top_legend", "add_points", "WEBGL_ABOVE"]

WEBGL_ABOVE = 2000
"""Scatters with more points than this are drawn with WebGL (``Scattergl``): SVG slows the page down."""


def top_legend(fig, *, top: int = 105, title_text: str | None = None):
    """Put ``fig``'s legend in one row above the plot area, the title above it; returns ``fig``."""
    legend = dict(orientation="h", yanchor="bottom", y=1.02, xanchor="left", x=0)
    if title_text:
        legend["title_text"] = title_text
    m = fig.layout.margin
    fig.update_layout(legend=legend, title_y=0.97, title_yanchor="top",
                      margin=dict(t=top, b=m.b if m.b is not None else 50, l=m.l, r=m.r))
    return fig


def add_points(fig, x, y, *, row=None, col=None, **kw):
    """Add a scatter trace to ``fig``: SVG for a few points, WebGL above :data:`WEBGL_ABOVE`."""
    import plotly.graph_objects as go

    cls = go.Scattergl if len(x) > WEBGL_ABOVE else go.Scatter
    if row is not None:
        fig.add_trace(cls(x=x, y=y, **kw), row=row, col=col)
    else:
        fig.add_trace(cls(x=x, y=y, **kw))
    return fig
