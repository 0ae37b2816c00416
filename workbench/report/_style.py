"""Layout shared by the figures: the legend above the plot (below it, it collides with rotated tick
labels and axis titles), under a title with room for two lines."""

from __future__ import annotations

__all__ = ["top_legend"]


def top_legend(fig, *, top: int = 105, title_text: str | None = None):
    """Put ``fig``'s legend in one row above the plot area, the title above it; returns ``fig``."""
    legend = dict(orientation="h", yanchor="bottom", y=1.02, xanchor="left", x=0)
    if title_text:
        legend["title_text"] = title_text
    m = fig.layout.margin
    fig.update_layout(legend=legend, title_y=0.97, title_yanchor="top",
                      margin=dict(t=top, b=m.b if m.b is not None else 50, l=m.l, r=m.r))
    return fig
