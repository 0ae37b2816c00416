"""What every panel shares: the background worker, figure updates, small widget helpers.

Threads here never ``print`` or ``display`` (since ipykernel 7 a thread's output lands in whichever
cell ran last, and Output widgets drop it): they set widget *values* and figure *data* only.
"""

from __future__ import annotations

import html
import threading
import time
import traceback
from typing import Any, Callable

import ipywidgets as W

__all__ = ["LatestWorker", "Panel", "set_figure", "figure_widget", "figure_box", "clear_figure", "log_html", "note_html", "one_line"]


def one_line(e: BaseException | str) -> str:
    """An exception (or text) as one line: ``Type: first line``."""
    if isinstance(e, BaseException):
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"{type(e).__name__}: {text}" if text else type(e).__name__
    return str(e).strip().splitlines()[0] if str(e).strip() else ""


def note_html(text: str, kind: str = "info") -> str:
    """A one-line coloured note for an ``HTML`` widget (kind: info, ok, warn, error, busy)."""
    color = {"info": "#555", "ok": "#2E7D32", "warn": "#B26A00", "error": "#C62828", "busy": "#1565C0"}[kind]
    icon = {"info": "", "ok": "✔ ", "warn": "⚠ ", "error": "✖ ", "busy": "» "}[kind]
    return f"<span style='color:{color}'>{icon}{html.escape(text)}</span>"


_WARM = threading.Lock()
_warmed = False


def _warm_plotly() -> None:
    """Build and apply one figure of every kind the panels draw, once, on the calling thread.

    plotly imports its trace, layout and validator classes lazily on first use; two threads doing
    that first use at once can see a half-imported module (a property then looks missing and
    ``fig.data = ...`` raises AttributeError). The same holds for pandas, which plotly looks up in
    ``sys.modules`` and OR-Tools imports on the first flexsp solve. Panels call this while they are
    built, on the kernel's main thread, before any worker thread draws."""
    global _warmed
    with _WARM:
        if _warmed:
            return
        import importlib.util

        # plotly reads sys.modules["pandas"] without importing it; OR-Tools imports pandas on the
        # first flexsp solve (a worker thread): a figure drawn meanwhile would see half a module
        if importlib.util.find_spec("pandas") is not None:
            import pandas  # noqa: F401
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        fig = make_subplots(rows=1, cols=2)
        fig.add_bar(x=[1], y=[1], base=[0], orientation="h", marker=dict(color="#000", line=dict(width=1)), text=["a"],
                    customdata=[[1]], width=[1], row=1, col=1)
        fig.add_scatter(x=[1], y=[1], mode="lines+markers+text", line=dict(dash="dash", shape="hv"), row=1, col=2)
        fig.add_trace(go.Scattergl(x=[1], y=[1], mode="markers"), row=1, col=2)
        fig.add_vline(x=1, line_dash="dash", annotation_text="a")
        fig.add_hline(y=1, line_dash="dot")
        fig.update_xaxes(type="log", title="x", range=[0, 1], tickmode="array", tickvals=[1], ticktext=["1"])
        fig.update_yaxes(title="y", autorange="reversed")
        fig.update_layout(template="plotly_white", legend=dict(orientation="h", title_text="t"), barmode="stack",
                          title="t", margin=dict(l=1), height=100)
        fw = go.FigureWidget()
        set_figure(fw, fig)
        go.Figure(fw).to_json()
        _warmed = True


def log_html(lines, max_chars: int = 170) -> str:
    """The last lines of a log for an ``HTML`` widget: monospace, one row per line (a long line is
    cut, with an ellipsis; the whole log is in the run folder), so the newest line is always the
    bottom row in view."""
    cut = [ln if len(ln) <= max_chars else ln[: max_chars - 1] + "…" for ln in lines]
    text = html.escape("\n".join(cut)) if cut else "(no output yet)"
    return ("<div style='border:1px solid #ddd;background:#fafafa;padding:4px 8px;overflow-x:auto'>"
            f"<pre style='margin:0;white-space:pre;font-size:11.5px;line-height:1.35'>{text}</pre></div>")


def figure_widget(fig=None):
    """A ``go.FigureWidget`` (an anywidget since plotly 6) holding ``fig`` (or empty)."""
    import plotly.graph_objects as go

    _warm_plotly()
    fw = go.FigureWidget()
    if fig is not None:
        set_figure(fw, fig)
    return fw


def set_figure(fw, fig) -> None:
    """Replace the traces and layout of FigureWidget ``fw`` with those of ``fig`` in one
    ``batch_update`` (one message to the browser instead of one per property); a figure kept in a
    :func:`figure_box` is shown while it has data."""
    with fw.batch_update():
        fw.data = ()
        if fig.data:
            fw.add_traces(list(fig.data))
        fw.layout = fig.layout
    box = getattr(fw, "_wb_box", None)
    if box is not None:
        box.layout.display = "" if fig.data else "none"


def clear_figure(fw) -> None:
    """Empty FigureWidget ``fw`` (and hide its :func:`figure_box`)."""
    with fw.batch_update():
        fw.data = ()
    box = getattr(fw, "_wb_box", None)
    if box is not None:
        box.layout.display = "none"


def figure_box(fw) -> W.Box:
    """A box holding FigureWidget ``fw``, hidden until the figure has data (an empty plotly
    figure draws as bare axes)."""
    box = W.VBox([fw], layout=W.Layout(display="" if fw.data else "none"))
    fw._wb_box = box
    return box


class LatestWorker:
    """One background thread that runs the latest request only.

    ``submit(*args)`` asks for ``job(*args, cancel=event)`` to run after ``debounce`` seconds of
    quiet; a newer submit supersedes an older one: a pending one is dropped, a running one gets
    its cancel Event set (planners stop with ``Cancelled`` at their next check). ``done(result)``
    or ``failed(exc)`` is called on the worker thread for the request that is still the latest
    when it finishes; superseded results are thrown away. ``wait_idle(timeout)`` blocks until
    nothing is pending or running."""

    def __init__(self, job: Callable[..., Any], *, done: Callable[[Any], None], failed: Callable[[BaseException], None],
                 debounce: float = 0.35, name: str = "panel-worker") -> None:
        self._job, self._done, self._failed = job, done, failed
        self.debounce = float(debounce)
        self._cv = threading.Condition()
        self._pending: tuple | None = None
        self._pending_at = 0.0
        self._running: threading.Event | None = None
        self._generation = 0
        self._thread: threading.Thread | None = None
        self._name = name
        self.completed = 0
        """Requests that ran to the end and were still the latest (their result was applied)."""
        self.superseded = 0
        """Requests dropped or cancelled because a newer one came."""
        self.last_error: str | None = None

    @property
    def generation(self) -> int:
        return self._generation

    def submit(self, *args: Any) -> int:
        """Ask for a run with ``args``; returns the request's generation number."""
        with self._cv:
            self._generation += 1
            if self._pending is not None:
                self.superseded += 1
            if self._running is not None:
                self._running.set()
            self._pending = (self._generation, args)
            self._pending_at = time.monotonic()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._cv.notify_all()
            return self._generation

    def cancel(self) -> None:
        """Drop a pending request and cancel a running one."""
        with self._cv:
            self._generation += 1
            if self._pending is not None:
                self._pending = None
                self.superseded += 1
            if self._running is not None:
                self._running.set()
            self._cv.notify_all()

    def busy(self) -> bool:
        with self._cv:
            return self._pending is not None or self._running is not None

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Block until no request is pending or running; False on timeout."""
        end = time.monotonic() + timeout
        with self._cv:
            while self._pending is not None or self._running is not None:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 0.2))
        return True

    def _loop(self) -> None:
        while True:
            with self._cv:
                while self._pending is None:
                    if not self._cv.wait(30.0) and self._pending is None:
                        self._thread = None
                        return
                # debounce: wait until the latest request has been quiet for `debounce` seconds
                while self._pending is not None and time.monotonic() - self._pending_at < self.debounce:
                    self._cv.wait(self.debounce - (time.monotonic() - self._pending_at))
                if self._pending is None:
                    continue
                gen, args = self._pending
                self._pending = None
                cancel = threading.Event()
                self._running = cancel
            try:
                result, error = self._job(*args, cancel=cancel), None
            except BaseException as e:  # noqa: BLE001 - reported through failed(), never raised on a thread
                result, error = None, e
            with self._cv:
                latest = gen == self._generation and not cancel.is_set()
            try:
                if not latest:
                    self.superseded += 1
                elif error is not None:
                    self.last_error = one_line(error)
                    self._failed(error)
                else:
                    self.last_error = None
                    self._done(result)
                    self.completed += 1
            except BaseException:  # noqa: BLE001 - a drawing bug must not kill the worker
                self.last_error = traceback.format_exc().strip().splitlines()[-1]
            finally:
                with self._cv:
                    self._running = None
                    self._cv.notify_all()


class Panel:
    """Base of the panels: a plain class holding ``.widget`` (displayed when the panel is the
    last expression of a cell)."""

    widget: W.Widget
    title = "panel"

    def _repr_mimebundle_(self, **kw):
        return self.widget._repr_mimebundle_(**kw)

    def figures(self) -> dict:
        """The panel's figures as plain ``go.Figure`` (for saving and for batch notebooks)."""
        import plotly.graph_objects as go

        return {k: go.Figure(v) for k, v in self._figure_widgets().items() if v.data}

    def _figure_widgets(self) -> dict:
        return {}

    def save(self, folder) -> dict:
        """Write every figure into ``folder/figures/`` (``<name>.html``, opening offline, and
        ``<name>.json``) and the panel's tables into ``folder/tables/<name>.json``; returns
        ``{"figures": [html paths], "tables": [json paths]}``."""
        from pathlib import Path

        from workbench.report.page import save_figure, save_table

        folder = Path(folder)
        figs = [str(save_figure(f, folder / "figures", name)) for name, f in self.figures().items()]
        tabs = [str(save_table(t, folder / "tables", name)) for name, t in self.tables().items()]
        return {"figures": figs, "tables": tabs}

    def tables(self) -> dict:
        """The panel's tables as plain data (``{name: JSON-able}``)."""
        return {}


class ScenarioSource:
    """A panel whose controls describe a Scenario that other panels follow (the Workbench wires
    Lengths and Solver to each other this way): ``on_scenario(callback)`` registers a listener,
    ``_notify_scenario()`` calls every listener with the panel's current ``scenario``."""

    def on_scenario(self, callback: Callable[[Any], None]) -> None:
        """Call ``callback(scenario)`` whenever the panel's controls change its scenario."""
        self.__dict__.setdefault("_scenario_callbacks", []).append(callback)

    def _notify_scenario(self) -> None:
        sc = self.scenario
        for cb in list(self.__dict__.get("_scenario_callbacks", [])):
            cb(sc)


def model_control(value: str = "tiny", *, description: str = "model", width: str = "260px") -> W.Combobox:
    """The model control of every panel: the presets to pick from, or the path of a Hugging Face
    ``config.json`` (or its folder) typed in; the value changes on Enter or leaving the field."""
    from workbench.specs import MODEL_PRESETS

    return W.Combobox(options=list(MODEL_PRESETS), value=value, ensure_option=False, continuous_update=False,
                      placeholder="preset, or path/to/config.json", description=description,
                      style={"description_width": "initial"}, layout=W.Layout(width=width),
                      tooltip="a preset, or a Hugging Face config.json (Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5)")


def path_control(description: str, placeholder: str, *, width: str = "330px") -> W.Text:
    """A text field for a path (a data file, a tokenizer, weights); empty means none."""
    return W.Text(value="", placeholder=placeholder, description=description, continuous_update=False,
                  style={"description_width": "initial"}, layout=W.Layout(width=width))


def labelled(widget: W.Widget, note: W.HTML | None = None, width: str = "auto") -> W.Widget:
    """A control with its constraint note beside it (shown only when it says something)."""
    if note is None:
        return widget
    return W.HBox([widget, note], layout=W.Layout(align_items="center", width=width))


def html_table(rows, columns) -> str:
    """A compact HTML table for an ``HTML`` widget; ``columns``: ``(key, heading, format)``."""
    head = "".join(f"<th style='padding:2px 10px;text-align:{'left' if i == 0 else 'right'}'>{html.escape(h)}</th>"
                   for i, (_, h, _) in enumerate(columns))
    body = []
    for r in rows:
        cells = []
        for i, (k, _, fmt) in enumerate(columns):
            v = r.get(k) if isinstance(r, dict) else getattr(r, k, None)
            txt = "–" if v is None else (fmt(v) if callable(fmt) else format(v, fmt) if fmt else str(v))
            style = r.get("_style", "") if isinstance(r, dict) else ""
            cells.append(f"<td style='padding:2px 10px;text-align:{'left' if i == 0 else 'right'};{style}'>"
                         f"{html.escape(txt)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return (f"<table style='border-collapse:collapse;font-size:13px'><thead style='border-bottom:1px solid #ccc'>"
            f"<tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>")
