"""LengthsPanel: a length distribution, what the max context cuts, and what imbalance costs.

Pick a family (or a file, or the embedded stdlib corpus); the panel shows the lengths on log axes,
the cumulative share of sequences, tokens and attention work (s^2) by length, the same shares per
length bin, which sequences the max-context policy affects, and how unevenly a static layout's
replicas are loaded on sampled batches when each gets the same number of tokens. Loading runs on a
background thread (debounced); :meth:`LengthsPanel.refresh` does it synchronously.
"""

from __future__ import annotations

import threading
from typing import Any

import ipywidgets as W

from widgets._base import (LatestWorker, Panel, ScenarioSource, figure_box, figure_widget, html_table, note_html, one_line,
                           path_control, set_figure)
from workbench.scenario import Scenario

__all__ = ["LengthsPanel"]

_FILE = "(a file...)"


def _degree_label(d: int, n: int) -> str:
    """A static degree as the control says it: ``8 (6 replicas)``, ``32 (1 replica, 16 GPUs idle)``."""
    r, idle = n // d, n % d
    return f"{d} ({r} replica{'' if r == 1 else 's'}" + (f", {idle} GPU{'' if idle == 1 else 's'} idle)" if idle else ")")


class LengthsPanel(ScenarioSource, Panel):
    """Look at a length source the way the planner will see it.

    Python API: :meth:`set` (Scenario data fields: ``source``, ``samples``, ``seed``, ``max_len``,
    ``policy``, ``batch_tokens``; and ``static_degree``, ``batches``), :meth:`refresh` (synchronous;
    returns the data behind every figure), :attr:`data`, :attr:`scenario`, :meth:`set_scenario`,
    :meth:`on_scenario`, :meth:`wait_idle`, :meth:`figures`, :meth:`tables`, :meth:`save`."""

    title = "Lengths"

    def __init__(self, scenario: Scenario | None = None, *, auto: bool = True, debounce: float = 0.35,
                 batches: int = 8, static_degree: int | None = None) -> None:
        self._base = scenario or Scenario(batch_tokens=1_000_000, samples=100_000)
        if self._base.batch_tokens is None and self._base.batch_size is None:
            self._base = self._base.replace(batch_tokens=1_000_000)
        self.auto = auto
        self.data: dict | None = None
        self.refreshes = 0
        self.error: str | None = None
        self._quiet = 0
        self._lock = threading.RLock()
        self._build(batches)
        self._static_degree = static_degree
        self._worker = LatestWorker(self._job, done=self._apply, failed=self._fail, debounce=debounce,
                                    name="lengths-panel")
        self._load_controls(self._base)
        if auto:
            self.request_refresh()

    def _build(self, batches: int) -> None:
        from workbench.data import SOURCE_NAMES

        st = {"description_width": "initial"}
        lay = W.Layout(width="220px")
        self.w_source = W.Dropdown(options=[*SOURCE_NAMES, _FILE], description="source", style=st, layout=lay)
        self.w_path = W.Text(placeholder="path to a lengths file (txt/csv/parquet/npy/jsonl) or dataset",
                             description="file", style=st, layout=W.Layout(width="440px", display="none"),
                             continuous_update=False)
        # text is tokenised with your tokenizer (byte-level without one), once, into the token cache
        self.w_tokenizer = path_control("tokenizer", "path/to/tokenizer.json (empty: byte-level)")
        self.w_column = path_control("column", "column (auto)", width="180px")
        self.file_row = W.HBox([self.w_path, self.w_tokenizer, self.w_column],
                               layout=W.Layout(flex_flow="row wrap", display="none"))
        self.w_samples = W.BoundedIntText(min=1, max=10**8, step=10000, description="samples", style=st, layout=lay)
        self.w_seed = W.BoundedIntText(min=0, max=2**31 - 1, description="seed", style=st, layout=W.Layout(width="140px"))
        self.w_max_len = W.Dropdown(description="max context", style=st, layout=lay)
        self.w_policy = W.ToggleButtons(options=["clip", "split", "drop"], description="longer sequences",
                                        style={"description_width": "initial", "button_width": "70px"},
                                        tooltips=["cut to the max context (tokens lost)",
                                                  "cut into max-context pieces (all tokens kept)",
                                                  "leave the sequence out (tokens lost)"])
        self.w_batch = W.BoundedIntText(min=1, max=10**10, step=65536, description="batch tokens", style=st, layout=lay)
        self.w_degree = W.Dropdown(description="static degree", style=st, layout=W.Layout(width="240px"))
        self.w_batches = W.IntSlider(min=1, max=32, value=batches, description="sampled batches", style=st,
                                     continuous_update=False, layout=W.Layout(width="300px"))
        self.status = W.HTML(note_html("not loaded yet"))
        self.summary = W.HTML()
        self.fig_hist = figure_widget()
        self.fig_cdf = figure_widget()
        self.fig_share = figure_widget()
        self.fig_policy = figure_widget()
        self.fig_imbalance = figure_widget()
        for w in (self.w_source, self.w_path, self.w_tokenizer, self.w_column, self.w_samples, self.w_seed, self.w_max_len,
                  self.w_policy, self.w_batch,
                  self.w_degree, self.w_batches):
            w.observe(self._on_control, names="value")

        def cap(text: str) -> W.HTML:
            return W.HTML(f"<div style='color:#555;font-size:12.5px;max-width:980px;line-height:1.35'>{text}</div>")

        self.widget = W.VBox([
            W.HTML("<b style='font-size:15px'>Lengths</b> &nbsp; <span style='color:#555'>how long the training "
                   "sequences are, and why that makes one fixed parallel layout wasteful</span>"),
            W.HBox([self.w_source, self.w_samples, self.w_seed], layout=W.Layout(flex_flow="row wrap")),
            self.file_row,
            W.HBox([self.w_max_len, self.w_policy], layout=W.Layout(flex_flow="row wrap", align_items="center")),
            W.HBox([self.w_batch, self.w_degree, self.w_batches], layout=W.Layout(flex_flow="row wrap")),
            self.status, self.summary,
            cap("Most sequences are short and a few are very long (a <b>long tail</b>). Both axes are logarithmic: "
                "each bar is a power-of-two range of lengths. Red bars lie beyond the <b>max context</b>, the "
                "longest sequence the model trains on; the policy above decides what happens to them."),
            figure_box(self.fig_hist),
            cap("The same data as running totals. Attention compares every token with every other, so its work "
                "grows as the <b>square</b> of the length: the few long sequences hold a small share of the "
                "sequences, a larger share of the tokens, and most of the attention work."),
            figure_box(self.fig_cdf), figure_box(self.fig_share),
            cap("What the max-context policy does to the sequences longer than the max context."),
            figure_box(self.fig_policy),
            cap("A <b>static layout</b> runs every sequence on sequence-parallel groups of one fixed <b>degree</b> "
                "(GPUs per group) and copies that layout over the rest of the GPUs (<b>replicas</b>, data "
                "parallelism). Deal each sampled batch to the replicas with equal tokens each, as a data loader "
                "does, and time each replica with the cost model: the replica that got a long sequence has far "
                "more attention work, and every other replica waits for it at the gradient sync. "
                "<b>Imbalance</b> = slowest replica / mean replica (1.0 is perfect)."),
            figure_box(self.fig_imbalance),
        ])

    def _figure_widgets(self) -> dict:
        return {"histogram": self.fig_hist, "cdf": self.fig_cdf, "share": self.fig_share, "policy": self.fig_policy,
                "imbalance": self.fig_imbalance}

    # ---- scenario <-> controls ------------------------------------------------------------------
    def _load_controls(self, sc: Scenario) -> None:
        from workbench.data import SOURCE_NAMES
        from workbench.solve.baselines import static_max_degree

        self._quiet += 1
        try:
            if sc.source in SOURCE_NAMES:
                self.w_source.value = sc.source
                self._show_file_row(False)
            else:
                self.w_source.value = _FILE
                self.w_path.value = sc.source
                self._show_file_row(True)
            self.w_tokenizer.value = sc.tokenizer or ""
            self.w_column.value = sc.column or ""
            self.w_samples.value = int(sc.samples or 100_000)
            self.w_samples.disabled = sc.source == "stdlib" and sc.samples is None
            self.w_seed.value = int(sc.seed)
            cap = sc.model_spec().max_context
            opts = [("auto", 0)]  # 0: auto (None would mean "no selection")
            d = 512
            while d <= cap:
                opts.append((f"{d // 1024}K" if d >= 1024 else str(d), d))
                d *= 2
            if sc.max_len is not None and sc.max_len not in [v for _, v in opts]:
                opts.append((f"{sc.max_len:,}", sc.max_len))
            self.w_max_len.options = opts
            self.w_max_len.value = sc.max_len or 0
            self.w_policy.value = sc.policy if sc.policy in self.w_policy.options else "clip"
            self.w_batch.value = int(sc.batch_tokens or 1_000_000)
            try:
                cost = sc.cost()
                degs = list(cost.degrees)
                want = self._static_degree or self.w_degree.value
                if want not in degs:
                    try:
                        want = static_max_degree(cost, sc.resolved_max_len() or max(degs))
                    except ValueError:
                        want = max(degs)
                self.w_degree.options = [(_degree_label(d, sc.num_gpus), d) for d in degs]
                self.w_degree.value = want
            except ValueError:
                pass
        finally:
            self._quiet -= 1
        self._base = sc

    def _controls_scenario(self) -> Scenario:
        src = self.w_path.value.strip() if self.w_source.value == _FILE else self.w_source.value
        if not src:
            raise ValueError("Scenario.source: give the path of a lengths file")
        samples = None if (src == "stdlib" and self.w_samples.disabled) else int(self.w_samples.value)
        return self._base.replace(source=src, samples=samples, seed=int(self.w_seed.value), max_len=self.w_max_len.value or None,
                                  tokenizer=self.w_tokenizer.value.strip() or None, column=self.w_column.value.strip() or None,
                                  policy=self.w_policy.value, batch_tokens=int(self.w_batch.value), batch_size=None)

    @property
    def scenario(self) -> Scenario:
        """The Scenario with the data settings the controls show."""
        try:
            return self._controls_scenario()
        except ValueError:
            return self._base

    def set(self, **fields: Any) -> Scenario:
        """Set data controls by Scenario field name (``source``, ``samples``, ``seed``, ``max_len``,
        ``policy``, ``batch_tokens``, or any other Scenario field) and ``static_degree`` /
        ``batches``; with ``auto`` a refresh is scheduled. Returns the new Scenario. Raises
        ValueError for an invalid value."""
        deg = fields.pop("static_degree", None)
        nb = fields.pop("batches", None)
        sc = self.scenario.replace(**fields) if fields else self.scenario
        if deg is not None:
            self._static_degree = int(deg)
        self._load_controls(sc)
        if nb is not None:
            self._quiet += 1
            try:
                self.w_batches.value = int(nb)
            finally:
                self._quiet -= 1
        self._notify_scenario()
        if self.auto:
            self.request_refresh()
        return sc

    def set_scenario(self, sc: Scenario, *, refresh: bool | None = None) -> None:
        """Take ``sc`` whole (e.g. the cluster from the Solver panel: it sets the static degrees)."""
        if sc == self.scenario:
            return
        self._load_controls(sc)
        if self.auto if refresh is None else refresh:
            self.request_refresh()

    def _on_control(self, change) -> None:
        if self._quiet:
            return
        if change["owner"] is self.w_source:
            self._show_file_row(change["new"] == _FILE)
            self._quiet += 1
            try:
                self.w_samples.disabled = change["new"] == "stdlib"
            finally:
                self._quiet -= 1
            if change["new"] == _FILE and not self.w_path.value.strip():
                self.status.value = note_html("type the path of a lengths file", "info")
                return
        if change["owner"] is self.w_degree:
            self._static_degree = change["new"]
        self._notify_scenario()
        if self.auto:
            self.request_refresh()

    def _busy(self, msg: str) -> None:
        self.status.value = note_html(msg, "busy")

    def _show_file_row(self, show: bool) -> None:
        for w in (self.file_row, self.w_path):
            w.layout.display = "" if show else "none"

    # ---- computing -----------------------------------------------------------------------------
    def _job(self, sc: Scenario, degree: int | None, nbatches: int, *, cancel) -> dict:
        from workbench.data import summarize
        from workbench.report.lengths import length_profile, policy_effect, token_balanced_loads

        # text: tokenised once into the token cache (what training reads), with progress in the status
        sc.token_cache(progress=lambda f, m: self._busy(f"{m} ({100 * f:.0f}%)"),
                       say=lambda m: self._busy(m))
        raw = sc.lengths_set(apply_policy=False)
        if cancel.is_set():
            return {}
        ml = sc.resolved_max_len()
        ls = sc.lengths_set()
        prof = length_profile(raw.lengths)
        out = {"scenario": sc.to_dict(), "source": raw.source, "provenance": raw.provenance,
               "summary": summarize(raw.lengths), "after_policy": summarize(ls.lengths), "max_len": ml,
               "policy_report": ls.policy_report.to_dict() if ls.policy_report else None, "profile": prof,
               "policy": policy_effect(raw.lengths, ml, sc.policy), "imbalance": None, "imbalance_error": None}
        if cancel.is_set():
            return out
        try:
            cost = sc.cost()
            deg = degree if degree in cost.degrees else max(cost.degrees)
            out["imbalance"] = token_balanced_loads(sc.batches(int(nbatches)), cost, deg)
        except ValueError as e:
            out["imbalance_error"] = one_line(e)
        return out

    def request_refresh(self) -> int | None:
        """Schedule a refresh on the background thread (debounced; supersedes an older one)."""
        try:
            sc = self._controls_scenario()
        except ValueError as e:
            self.status.value = note_html(one_line(e), "error")
            return None
        self.status.value = note_html(f"loading {sc.source}...", "busy")
        return self._worker.submit(sc, self.w_degree.value, int(self.w_batches.value))

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Wait until no refresh is pending or running; False on timeout."""
        return self._worker.wait_idle(timeout)

    def refresh(self) -> dict:
        """Load the source and compute everything now (on the calling thread), draw it and
        return the data behind the figures: ``summary`` (before the policy), ``after_policy``,
        ``policy_report``, ``profile`` (bins and CDF of sequences, tokens and attention work),
        ``policy`` (what the max context cuts) and ``imbalance`` (token-balanced static loads).
        Raises ValueError for a bad source or setting."""
        self._worker.cancel()
        self._worker.wait_idle(120)
        data = self._job(self._controls_scenario(), self.w_degree.value, int(self.w_batches.value),
                         cancel=threading.Event())
        self._apply(data)
        return data

    def _fail(self, e: BaseException) -> None:
        self.error = one_line(e)
        self.status.value = note_html(f"cannot load: {one_line(e)}", "error")

    def _apply(self, data: dict) -> None:
        from workbench.report.lengths import (cdf_figure, imbalance_figure, lengths_histogram_figure, policy_figure,
                                              share_figure)

        if not data:
            return
        with self._lock:
            self.data = data
            self.error = None
            self.refreshes += 1
            s, ml = data["summary"], data["max_len"]
            shares = data["profile"]["bins"]
            tail = [(e, t, w) for e, t, w in zip(shares["edges"], shares["token_share"], shares["work_share"])]
            over8k_work = sum(w for e, _, w in tail if e >= 8192)
            rows = [{"what": "sequences", "v": f"{s['count']:,}"}, {"what": "tokens", "v": f"{s['tokens']:,}"},
                    {"what": "median / p90 / p99 length", "v": f"{s['p50']:,.0f} / {s['p90']:,.0f} / {s['p99']:,.0f}"},
                    {"what": "longest", "v": f"{s['max']:,}"}]
            rows += [{"what": f"tokens in sequences over {int(k) // 1024}K", "v": f"{100 * v:.1f}%"}
                     for k, v in s["token_share_over"].items()]
            rows.append({"what": "attention work in sequences of 8K or more", "v": f"{100 * over8k_work:.1f}%"})
            prov = data["provenance"]
            if prov.get("token_cache"):  # text: where its tokens are, and what could not be trained on
                skipped = ", ".join(f"{v:,} {k}" for k, v in (prov.get("skipped") or {}).items())
                rows.append({"what": "tokenised", "v": f"{prov.get('tokenizer')}; token cache {prov['token_cache']}"
                             + (f"; skipped {skipped}" if skipped else "")})
            rep = data["policy_report"]
            rows.append({"what": "max context", "v": rep["text"] if rep else "none (the list is planned as given)"})
            if data["imbalance"]:
                im = data["imbalance"]
                rows.append({"what": f"static degree {im['degree']}, equal tokens per replica",
                             "v": f"imbalance {im['mean_imbalance']:.2f} (mean over {len(im['batches'])} batches)"})
            self.summary.value = html_table(rows, [("what", data["source"], None), ("v", "", None)])
            est = " (byte-level estimate)" if data["provenance"].get("estimate") else ""
            self.status.value = note_html(f"{data['source']}: {s['count']:,} sequences{est}; refresh #{self.refreshes}", "ok")
            set_figure(self.fig_hist, lengths_histogram_figure(data["profile"], max_len=ml,
                                                               title=f"{data['source']}: {s['count']:,} sequences"))
            set_figure(self.fig_cdf, cdf_figure(data["profile"], max_len=ml))
            set_figure(self.fig_share, share_figure(data["profile"]))
            set_figure(self.fig_policy, policy_figure(data["policy"]))
            if data["imbalance"]:
                set_figure(self.fig_imbalance, imbalance_figure(data["imbalance"]))
            elif data["imbalance_error"]:
                self.status.value += " " + note_html(f"imbalance: {data['imbalance_error']}", "warn")

    def tables(self) -> dict:
        if not self.data:
            return {}
        d = self.data
        return {"summary": {"source": d["source"], "before_policy": d["summary"], "after_policy": d["after_policy"],
                            "max_len": d["max_len"], "policy_report": d["policy_report"]},
                "length_profile": d["profile"], "policy_effect": d["policy"], "static_imbalance": d["imbalance"]}
