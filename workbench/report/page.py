"""Saving figures and tables into a run folder, and writing an explained offline HTML page.

- :func:`save_figure` writes ``<name>.html`` (plotly.js kept once per folder in ``plotly.min.js``,
  so the pages open offline without each carrying 4 MB) and ``<name>.json`` (the figure as plotly
  JSON: a report can rebuild it). :func:`save_table` writes ``<name>.json``.
- :func:`write_page` writes one self-contained page (plotly.js inlined once) of blocks: headings,
  paragraphs, figures, tables, and a glossary, so that a reader who has never seen the workbench
  learns what every chart means.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from workbench.util import dumps, write_text_atomic

__all__ = ["save_figure", "save_table", "load_figure", "write_page", "table_html"]


def save_figure(fig, folder: str | Path, name: str) -> Path:
    """Write ``fig`` (a plotly Figure or FigureWidget) as ``folder/name.html`` and
    ``folder/name.json``; returns the HTML path. Plain ``go.Figure`` is written either way."""
    import plotly.graph_objects as go

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    plain = fig if type(fig) is go.Figure else go.Figure(fig)
    write_text_atomic(folder / f"{name}.json", plain.to_json())
    js = folder / "plotly.min.js"
    if not js.is_file():
        from plotly.offline import get_plotlyjs

        write_text_atomic(js, get_plotlyjs())
    page = plain.to_html(full_html=True, include_plotlyjs="directory", config={"displaylogo": False})
    return write_text_atomic(folder / f"{name}.html", page)


def load_figure(path: str | Path):
    """A figure written by :func:`save_figure` (give the ``.json`` or the ``.html`` path)."""
    import plotly.io as pio

    p = Path(path)
    return pio.from_json(p.with_suffix(".json").read_text())


def save_table(data: Any, folder: str | Path, name: str) -> Path:
    """Write plain data as strict JSON ``folder/name.json``; returns the path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(folder / f"{name}.json", dumps(data, indent=2) + "\n")


def _fmt(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return "" if v is None else ("yes" if v else "no")
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, (list, tuple)):
        return ", ".join(_fmt(x) for x in v)
    return str(v)


def table_html(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str]] | None = None) -> str:
    """An HTML table of ``rows``; ``columns`` are ``(key, heading)`` pairs (default: every key of
    the first row)."""
    if not rows:
        return "<p><em>(no rows)</em></p>"
    cols = list(columns) if columns else [(k, k) for k in rows[0]]
    head = "".join(f"<th>{html.escape(h)}</th>" for _, h in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(r.get(k)))}</td>" for k, _ in cols) + "</tr>" for r in rows)
    return f"<table class='wb'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


_STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;max-width:1150px;margin:2em auto;padding:0 1.2em;
     color:#222;line-height:1.5}
h1{margin-bottom:.2em} h2{margin-top:2em;border-bottom:1px solid #ddd;padding-bottom:.2em}
p.lead{font-size:1.1em;color:#444}
.note{background:#f6f8fa;border-left:4px solid #4C78A8;padding:.6em 1em;margin:1em 0}
.warn{background:#fff6f0;border-left:4px solid #F58518;padding:.6em 1em;margin:1em 0}
table.wb{border-collapse:collapse;margin:1em 0;font-size:.92em}
table.wb th,table.wb td{border:1px solid #ddd;padding:.3em .7em;text-align:right}
table.wb th{background:#f3f3f3} table.wb td:first-child,table.wb th:first-child{text-align:left}
dl.gloss dt{font-weight:600;margin-top:.6em} dl.gloss dd{margin-left:1.2em}
pre{background:#f6f6f6;padding:1em;overflow-x:auto}
"""


def write_page(path: str | Path, title: str, blocks: Iterable[tuple[str, Any]], *, lead: str = "") -> Path:
    """Write one offline HTML page (plotly.js inlined once) and return its path. ``blocks`` are
    ``(kind, content)``: ``"h2"`` (text), ``"p"`` / ``"note"`` / ``"warn"`` (trusted HTML),
    ``"figure"`` (a plotly figure), ``"table"`` (``(rows, columns)``), ``"glossary"``
    (``{term: explanation}``), ``"pre"`` (text). Atomic write."""
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
             f"<style>{_STYLE}</style></head><body>", f"<h1>{html.escape(title)}</h1>"]
    if lead:
        parts.append(f"<p class='lead'>{lead}</p>")
    first = True
    for kind, content in blocks:
        if kind == "h2":
            parts.append(f"<h2>{html.escape(str(content))}</h2>")
        elif kind == "p":
            parts.append(f"<p>{content}</p>")
        elif kind in ("note", "warn"):
            parts.append(f"<div class='{kind}'>{content}</div>")
        elif kind == "figure":
            parts.append(content.to_html(full_html=False, include_plotlyjs="inline" if first else False,
                                         config={"displaylogo": False}))
            first = False
        elif kind == "table":
            rows, cols = content
            parts.append(table_html(rows, cols))
        elif kind == "glossary":
            items = "".join(f"<dt>{html.escape(k)}</dt><dd>{v}</dd>" for k, v in dict(content).items())
            parts.append(f"<dl class='gloss'>{items}</dl>")
        elif kind == "pre":
            parts.append(f"<pre>{html.escape(str(content))}</pre>")
        else:
            raise ValueError(f"unknown block kind {kind!r}")
    parts.append("</body></html>")
    return write_text_atomic(path, "\n".join(parts))


def read_json(path: str | Path) -> Any:
    """JSON from a file (a small helper for reports that read results back)."""
    return json.loads(Path(path).read_text())
