"""RunsPanel: pick training runs, compare measured against predicted and against each other.

Everything comes from the run store (``workbench.runs``): each run's step records, its medians,
and ``runs.compare`` for the speedup of one run over another. Figures: loss curves, measured
(solid) against predicted (dashed) step time per run, and each run's speedup over a baseline run,
measured next to predicted. For one step of one run, every rank's measured timeline beside the
plan's (``workbench.trace.step_timeline``, drawn by ``workbench.report.runs.step_timeline_figure``), with
a table saying which rank waited and for whom.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import ipywidgets as W

from widgets._base import Panel, clear_figure, figure_box, figure_widget, html_table, note_html, one_line, set_figure

__all__ = ["RunsPanel"]


class RunsPanel(Panel):
    """Compare training runs.

    Python API: :meth:`refresh` (list the store), :meth:`select` (runs by id, path or Run),
    :meth:`open` (add a run and select it), :meth:`set_baseline`, :meth:`table`,
    :meth:`compare` (``runs.compare`` of two runs), :meth:`show_step` (one step's measured and
    planned timelines), :attr:`selected`, :meth:`figures`, :meth:`tables`, :meth:`save`."""

    title = "Runs"

    def __init__(self, *, root=None, kind: str = "train", skip: int = 1) -> None:
        self.root = root
        self.kind = kind
        self.skip = int(skip)
        """Steps left out of the medians (the first pays start-up costs)."""
        self.rows: list[dict] = []
        self.comparisons: dict = {}
        self.step_timeline: dict | None = None
        """The step drawn by :meth:`show_step` (``workbench.trace.step_timeline``), or None."""
        self._quiet = 0
        self._build()
        self.refresh()

    def _build(self) -> None:
        st = {"description_width": "initial"}
        self.w_runs = W.SelectMultiple(description="runs", rows=7, style=st, layout=W.Layout(width="640px"))
        self.w_baseline = W.Dropdown(description="baseline", style=st, layout=W.Layout(width="420px"))
        self.b_refresh = W.Button(description="Refresh", icon="refresh", tooltip="list the run store again")
        self.status = W.HTML(note_html("pick runs to compare (ctrl/shift-click for several)"))
        self.table_html = W.HTML()
        self.fig_loss = figure_widget()
        self.fig_time = figure_widget()
        self.fig_speedup = figure_widget()
        self.w_trace_run = W.Dropdown(description="step of run", style=st, layout=W.Layout(width="420px"))
        self.w_step = W.Dropdown(description="step", style=st, layout=W.Layout(width="160px"))
        self.trace_note = W.HTML()
        self.trace_table = W.HTML()
        self.fig_trace = figure_widget()
        self.w_runs.observe(self._on_pick, names="value")
        self.w_baseline.observe(self._on_pick, names="value")
        self.w_trace_run.observe(self._on_trace_run, names="value")
        self.w_step.observe(self._on_step, names="value")
        self.b_refresh.on_click(lambda _: self.refresh())
        self.widget = W.VBox([
            W.HTML("<b style='font-size:15px'>Runs</b> &nbsp; <span style='color:#555'>compare training runs: "
                   "measured against predicted, and against each other</span>"),
            W.HBox([self.w_runs, W.VBox([self.b_refresh, self.w_baseline])]),
            self.status, self.table_html,
            W.HTML("<div style='color:#555;font-size:12.5px'>Medians leave out the first step (it pays start-up "
                   "costs). <i>measured / predicted</i> above 1: the run was slower than its plans predicted. The "
                   "speedup divides the baseline's median step by each run's.</div>"),
            figure_box(self.fig_speedup), figure_box(self.fig_time), figure_box(self.fig_loss),
            W.HTML("<b>One step, rank by rank</b> &nbsp; <span style='color:#555;font-size:12.5px'>what each rank "
                   "measured (left) beside what the plan predicted (right); <code>workbench runs trace RUN --step N</code> "
                   "writes the same as a Perfetto / Chrome trace</span>"),
            W.HBox([self.w_trace_run, self.w_step]), self.trace_note, figure_box(self.fig_trace), self.trace_table,
        ])

    def _figure_widgets(self) -> dict:
        return {"speedup": self.fig_speedup, "step_time": self.fig_time, "loss": self.fig_loss,
                "step_timeline": self.fig_trace}

    # ------------------------------------------------------------------------------------------
    def refresh(self) -> list:
        """List the store's runs (newest first) in the picker, keeping the selection; returns the
        Runs."""
        from workbench import runs

        found = list(reversed(runs.list_runs(self.root, kind=self.kind)))
        opts = []
        for r in found:
            st = r.status()
            s = r.summary()
            opts.append((f"{r.id} · {s.get('planner') or '?'} · {st.state} · {st.step}/{st.steps or '?'} steps", str(r.path)))
        keep = [v for v in self.w_runs.value if v in [o[1] for o in opts]]
        self._quiet += 1
        try:
            self.w_runs.options = opts
            self.w_runs.value = tuple(keep)
        finally:
            self._quiet -= 1
        self._update()
        return found

    @property
    def selected(self) -> list:
        """The Runs picked, oldest first (the first is the default baseline)."""
        from workbench import runs

        return [runs.load_run(p) for p in sorted(self.w_runs.value, key=lambda p: Path(p).name)]

    def select(self, refs: Sequence[Any], baseline: Any = None) -> list[dict]:
        """Pick runs (ids, unique id prefixes, folders or Runs) and optionally the baseline;
        returns :meth:`table`. Raises RunNotFound for a run not in the store."""
        from workbench import runs

        paths = [str(runs.load_run(r, root=self.root).path) for r in refs]
        known = [o[1] for o in self.w_runs.options]
        if any(p not in known for p in paths):
            self.refresh()
        self._quiet += 1
        try:
            self.w_runs.value = tuple(paths)
        finally:
            self._quiet -= 1
        self._update()
        if baseline is not None:
            self.set_baseline(baseline)
        return self.table()

    def open(self, run) -> list[dict]:
        """Add ``run`` to the selection (e.g. a run that just finished in the Launch panel)."""
        from workbench import runs

        self.refresh()
        r = runs.load_run(run, root=self.root)
        cur = [p for p in self.w_runs.value if p != str(r.path)]
        return self.select([*cur, str(r.path)])

    def set_baseline(self, ref) -> None:
        """Make ``ref`` (one of the selected runs) the baseline of the speedups."""
        from workbench import runs

        p = str(runs.load_run(ref, root=self.root).path)
        if p not in self.w_runs.value:
            raise ValueError(f"{ref} is not among the selected runs")
        self.w_baseline.value = p

    def _on_pick(self, change) -> None:
        if not self._quiet:
            self._update()

    def _update(self) -> None:
        from workbench import runs
        from workbench.report.runs import loss_figure, run_series, speedup_figure, step_time_figure

        sel = self.selected
        self._quiet += 1
        try:
            base = self.w_baseline.value
            self.w_baseline.options = [(r.id, str(r.path)) for r in sel]
            self.w_baseline.value = base if base in [str(r.path) for r in sel] else (str(sel[0].path) if sel else None)
        finally:
            self._quiet -= 1
        series = [run_series(r, skip=self.skip) for r in sel]
        rows = []
        for r, s in zip(sel, series):
            st = r.status()
            summ = r.summary()
            tps = [x for x in s["tokens_per_s"][self.skip:] or s["tokens_per_s"] if x]
            load = summ.get("load_average") or {}
            rows.append({"id": r.id, "label": s["label"], "planner": summ.get("planner"), "state": st.state,
                         "profile": summ.get("profile"), "profile_note": summ.get("profile_note"),
                         "load_average": load.get("mean"), "load_text": load.get("text"),
                         "steps": len(s["step"]), "median_measured_ms": s["median_measured_ms"],
                         "median_predicted_ms": s["median_predicted_ms"],
                         "measured_over_predicted": (s["median_measured_ms"] / s["median_predicted_ms"]
                                                     if s["median_measured_ms"] and s["median_predicted_ms"] else None),
                         "median_tokens_per_s": sorted(tps)[len(tps) // 2] if tps else None,
                         "last_loss": next((x for x in reversed(s["loss"]) if x is not None), None)})
        self.comparisons = {}
        base = next((r for r in sel if str(r.path) == self.w_baseline.value), None)
        for r, row in zip(sel, rows):
            row["speedup_over_baseline"] = None
            if base is not None and r is not base:
                try:
                    c = runs.compare(base, r, skip=self.skip)
                    self.comparisons[r.id] = c
                    row["speedup_over_baseline"] = c["speedup_b_over_a"]
                    row["predicted_speedup"] = c["predicted_speedup"]
                except ValueError as e:
                    row["error"] = one_line(e)
            elif r is base:
                row["speedup_over_baseline"] = 1.0
        self.rows = rows
        self.table_html.value = html_table(rows, [
            ("id", "run", None), ("planner", "planner", None), ("state", "state", None), ("steps", "steps", "d"),
            ("median_measured_ms", "measured (ms)", ",.0f"), ("median_predicted_ms", "predicted (ms)", ",.0f"),
            ("measured_over_predicted", "meas/pred", ".2f"), ("median_tokens_per_s", "tokens/s", ",.0f"),
            ("last_loss", "last loss", ".4f"), ("speedup_over_baseline", "speedup", ".2f"),
            ("profile", "profile", None), ("load_average", "load avg", ".1f")]) if rows else ""
        # predictions hold where the profile was measured: a run planned with another machine's says so
        notes = [f"{r['id']}: {r['profile_note']}" for r in rows if r.get("profile_note")]
        if notes:
            self.table_html.value += "".join(f"<div>{note_html(n, 'warn')}</div>" for n in notes)
        self._trace_choices(sel)
        if not sel:
            self.status.value = note_html(f"{len(self.w_runs.options)} run(s) in the store; pick some to compare")
            for f in (self.fig_loss, self.fig_time, self.fig_speedup):
                clear_figure(f)
            return
        self.status.value = note_html(f"{len(sel)} run(s) selected" + (f", baseline {base.id}" if base else ""), "ok")
        set_figure(self.fig_loss, loss_figure(series))
        set_figure(self.fig_time, step_time_figure(series))
        if base is not None:
            lab = next(s["label"] for r, s in zip(sel, series) if r is base)
            set_figure(self.fig_speedup, speedup_figure(rows, baseline=lab,
                                                        title=f"Speedup over {lab} (median step, first step left out)"))

    # ---- one step, rank by rank ------------------------------------------------------------------
    def _trace_choices(self, sel: list) -> None:
        """Offer the selected runs (the newest first chosen) and that run's steps; draw its step."""
        keep = self.w_trace_run.value
        opts = [(r.id, str(r.path)) for r in sel]
        self._quiet += 1
        try:
            self.w_trace_run.options = opts
            paths = [o[1] for o in opts]
            self.w_trace_run.value = keep if keep in paths else (paths[-1] if paths else None)
        finally:
            self._quiet -= 1
        self._step_choices()

    def _step_choices(self) -> None:
        from workbench import runs
        from workbench.trace import default_step

        path = self.w_trace_run.value
        self._quiet += 1
        try:
            if path is None:
                self.w_step.options = []
            else:
                run = runs.load_run(path)
                steps = [s.step for s in run.steps()]
                keep = self.w_step.value
                self.w_step.options = steps
                try:
                    want = keep if keep in steps else default_step(run)
                except ValueError:
                    want = None
                self.w_step.value = want
        finally:
            self._quiet -= 1
        self._draw_step()

    def _on_trace_run(self, change) -> None:
        if not self._quiet:
            self._step_choices()

    def _on_step(self, change) -> None:
        if not self._quiet:
            self._draw_step()

    def _draw_step(self) -> None:
        from workbench.report.runs import step_timeline_figure
        from workbench.trace import step_timeline

        path, step = self.w_trace_run.value, self.w_step.value
        if path is None or step is None:
            self.step_timeline = None
            self.trace_note.value = note_html("pick a run with measured steps to see one step rank by rank") if path else ""
            self.trace_table.value = ""
            clear_figure(self.fig_trace)
            return
        try:
            tl = step_timeline(path, step)
        except ValueError as e:
            self.step_timeline = None
            self.trace_note.value = note_html(one_line(e), "warn")
            self.trace_table.value = ""
            clear_figure(self.fig_trace)
            return
        self.step_timeline = tl
        set_figure(self.fig_trace, step_timeline_figure(tl))
        how = "ranks aligned by their clocks" if tl["aligned"] else "each rank from its own step start (no clock recorded)"
        missing = f"; no row from rank(s) {tl['missing_ranks']}" if tl["missing_ranks"] else ""
        self.trace_note.value = note_html(f"step {tl['step']} of {tl['run']} ({tl['execution']}, {tl['planner']}), "
                                          f"{how}{missing}", "warn" if missing else "info")
        self.trace_table.value = html_table(tl["summary"], [
            ("rank", "rank", "d"), ("measured_ms", "step (ms)", ",.1f"), ("work_ms", "micro-steps (ms)", ",.1f"),
            ("reduction_ms", "reduction (ms)", ",.1f"), ("waited_ms", "waited (ms)", ",.1f"),
            ("optimizer_ms", "optimizer (ms)", ",.1f"), ("other_ms", "other (ms)", ",.1f"),
            ("predicted_work_ms", "planned work (ms)", ",.1f"), ("predicted_wait_ms", "planned wait (ms)", ",.1f"),
            ("note", "who waited, and for whom", None)])

    def show_step(self, run=None, step: int | None = None) -> dict | None:
        """Draw one step of ``run`` (one of the selected runs, or any run of the store: it is added to
        the selection; default the run chosen) rank by rank, measured beside planned; ``step`` is
        1-based (default: the run's median step, the first left out). Returns the timeline drawn
        (``workbench.trace.step_timeline``), or None when the run has no measured step. Raises
        RunNotFound for a run not in the store."""
        from workbench import runs

        if run is not None:
            p = str(runs.load_run(run, root=self.root).path)
            if p not in self.w_runs.value:
                self.open(p)
            self._quiet += 1
            try:
                self.w_trace_run.value = p
            finally:
                self._quiet -= 1
            self._step_choices()
        if step is not None:
            if step not in self.w_step.options:
                raise ValueError(f"{self.w_trace_run.label} has no measured step {step} (steps: "
                                 f"{list(self.w_step.options)})")
            self.w_step.value = step  # draws through the observer
        return self.step_timeline

    def table(self) -> list[dict]:
        """One row per selected run: state, steps, median measured and predicted ms, their ratio,
        tokens/s, last loss, and the speedup over the baseline (measured and predicted)."""
        return [dict(r) for r in self.rows]

    def compare(self, a, b) -> dict:
        """``workbench.runs.compare(a, b)``: b's speedup over a, measured and predicted."""
        from workbench import runs

        return runs.compare(a, b, root=self.root, skip=self.skip)

    def tables(self) -> dict:
        out = {"runs": self.table(), "comparisons": self.comparisons} if self.rows else {}
        if self.step_timeline is not None:
            out["step_timeline"] = {"run": self.step_timeline["run"], "step": self.step_timeline["step"],
                                    "summary": self.step_timeline["summary"]}
        return out
