"""HardwarePanel: the hardware profile the cost model stands on.

Pick a shipped reference profile (or one measured earlier, or a JSON file), see its per-layer
compute curves with the measured points and residuals, its collectives' bandwidth and latency by
group size (the all-to-all of Ulysses beside the all-gather and reduce-scatter of context
parallelism), and the measured extras of a group's split (Ulysses' and CP's, and a composite
split's residual beyond them), and the host link and host memory that offloaded activations use;
save it elsewhere. Run a quick or full profile of this machine as a run (``workbench.profile``: a torchrun
process tree, never the kernel), with progress, log and Stop; when it ends its fitted curves,
residuals, held-out errors and collectives are drawn and the profile can be used for planning.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import ipywidgets as W

from widgets._base import Panel, figure_box, figure_widget, log_html, model_control, note_html, one_line, set_figure
from widgets.cluster import DoctorSection

__all__ = ["HardwarePanel"]


def _profiler():
    """The profiler module when it provides the run API, else None."""
    try:
        import workbench.profile as prof
    except ImportError:
        return None
    return prof if all(hasattr(prof, n) for n in ("prepare_profile", "start_profile", "load_result")) else None


class HardwarePanel(Panel):
    """Choose, inspect, save and measure hardware profiles.

    Python API: :meth:`select` (a shipped name, a profile JSON file or a profile run),
    :attr:`profile` (the HardwareProfile), :attr:`profile_ref` (what ``Scenario.profile`` takes),
    :meth:`curves`, :meth:`points`, :meth:`links`, :meth:`extras`, :meth:`host`, :meth:`load`, :meth:`save_profile`,
    :meth:`measure_this_machine`,
    :meth:`start_profile`,
    :meth:`refresh`, :meth:`wait`, :meth:`stop`, :meth:`load_result`, :meth:`check_fidelity`,
    :meth:`on_profile`, :attr:`profiler_available`; the Doctor section: :meth:`run_doctor`,
    :meth:`doctor_rows`."""

    title = "Hardware"

    def __init__(self, profile: str = "a100-40g-flexsp", *, root=None, poll_interval: float = 0.5) -> None:
        self.root = root
        self.poll_interval = float(poll_interval)
        self.profile = None
        self.profile_ref: str | None = None
        self.result = None
        """The ProfileResult of the last profile run loaded (None before one)."""
        self.run = None
        self.handle = None
        self.final = None
        self.fidelity: dict | None = None
        self._lock = threading.RLock()
        self._stop_poll = threading.Event()
        self._callbacks: list[Callable[[str], None]] = []
        self._extra_refs: list[tuple[str, str]] = []
        self._quiet = 0
        self._build()
        self._list_profiles()
        self.select(profile)

    # ------------------------------------------------------------------------------------------
    def _build(self) -> None:
        st = {"description_width": "initial"}
        self.w_profile = W.Dropdown(description="profile", style=st, layout=W.Layout(width="520px"))
        self.w_path = W.Text(placeholder="path/to/profile.json", description="load file", style=st,
                             layout=W.Layout(width="420px"))
        self.b_load = W.Button(description="Load", icon="folder-open")
        self.w_save = W.Text(placeholder="path/to/save.json", description="save as", style=st,
                             layout=W.Layout(width="420px"))
        self.b_save = W.Button(description="Save", icon="save")
        self.about = W.HTML()
        self.status = W.HTML()
        self.w_nproc = W.IntSlider(min=1, max=8, value=2, description="processes", style=st, continuous_update=False)
        self.w_model = model_control("tiny", width="260px")
        self.w_quick = W.Checkbox(value=True, description="quick (fewer lengths and repeats)", indent=False)
        self.w_reuse = W.Checkbox(value=True, description="reuse this machine's cached quick profile", indent=False,
                                  tooltip="a quick profile of the tiny model measured here for this process count is "
                                          "kept in the run store and reused; untick to measure again")
        self.b_run = W.Button(description="Profile this machine", icon="play", button_style="primary",
                              layout=W.Layout(width="200px"))
        self.b_stop = W.Button(description="Stop", icon="stop", button_style="danger", disabled=True)
        self.progress = W.FloatProgress(min=0, max=1, value=0, layout=W.Layout(width="300px"))
        self.run_status = W.HTML()
        self.log = W.HTML()
        self.fig_compute = figure_widget()
        self.fig_residuals = figure_widget()
        self.fig_bandwidth = figure_widget()
        self.fig_extras = figure_widget()
        self.host_view = W.HTML()
        self.fig_fit = figure_widget()
        self.fig_collectives = figure_widget()
        self.fig_fidelity = figure_widget()
        self.w_train = W.Dropdown(description="check against run", style=st, layout=W.Layout(width="460px"))
        self.doctor_section = DoctorSection()
        self.b_check = W.Button(description="Check fidelity", icon="check")
        self.w_profile.observe(self._on_pick, names="value")
        self.b_load.on_click(lambda _: self._guard(lambda: self.load(self.w_path.value)))
        self.b_save.on_click(lambda _: self._guard(lambda: self.save_profile(self.w_save.value)))
        self.b_run.on_click(lambda _: self._guard(self._on_run))
        self.b_stop.on_click(lambda _: threading.Thread(target=lambda: self._guard(self.stop), daemon=True).start())
        self.b_check.on_click(lambda _: self._guard(lambda: self.check_fidelity(self.w_train.value)))
        available = _profiler() is not None
        for w in (self.b_run, self.w_nproc, self.w_model, self.w_quick, self.w_reuse, self.b_check, self.w_train):
            w.disabled = not available
        self.run_status.value = note_html("" if available else
                                          "this version has no profiler (workbench.profile); pick a reference profile",
                                          "info" if available else "warn")

        def cap(text: str) -> W.HTML:
            return W.HTML(f"<div style='color:#555;font-size:12.5px;max-width:980px;line-height:1.35'>{text}</div>")

        self.widget = W.VBox([
            W.HTML("<b style='font-size:15px'>Hardware</b> &nbsp; <span style='color:#555'>the measured (or "
                   "published) speeds the cost model plans with</span>"),
            self.w_profile, self.about,
            W.HBox([self.w_path, self.b_load]), W.HBox([self.w_save, self.b_save]), self.status,
            cap("Compute time of one transformer layer for one packed call of sequences: <b>a·s²</b> (attention, "
                "quadratic in the length s) + <b>b·s</b> (the dense layers, linear) per sequence, plus <b>c</b> once per "
                "call (kernel launches and fixed costs: each SP group pays it once per micro-step). Markers are "
                "measured points; the planner divides a sequence's time by its SP degree."),
            figure_box(self.fig_compute), figure_box(self.fig_residuals),
            cap("Bandwidth (left) and latency per call (right) of the collectives by group size: the all-to-all of "
                "Ulysses sequence parallelism inside an SP group, the point-to-point of ring attention, the all-reduce "
                "of the gradients, and the all-gather and reduce-scatter of context parallelism (a group split "
                "u x c gathers K and V over its c strided ranks and reduce-scatters their gradients; FSDP runs the "
                "same collectives over all ranks). Groups that leave a node fall from NVLink to the network: that is "
                "why wide SP groups are expensive."),
            figure_box(self.fig_bandwidth),
            cap("The host link: pinned copies between host memory and a GPU, where offloaded activations go (each "
                "block's checkpointed input leaves as its forward ends and comes back one layer ahead in the "
                "backward). One GPU copying alone, and each GPU's share when all of a node's GPUs copy at once "
                "(they share the PCIe switches and the CPUs' memory); the host memory of one node holds what they "
                "offload. Without a host link figure plans do not offload."),
            self.host_view,
            cap("What a group's split costs beyond its compute and its collectives, measured on real micro-steps, per "
                "layer: Ulysses over u ranks (layout work, waits at every all-to-all) and context parallelism over c "
                "ranks (the chunked layout, the K/V selection, bottom-right-masked attention, waits at every "
                "all-gather); a fixed part per micro-step and a part per 1,000 tokens. Shown when the profile has "
                "them."),
            figure_box(self.fig_extras),
            W.HTML("<h4 style='margin:10px 0 2px'>Profile this machine</h4>"),
            W.HBox([self.w_nproc, self.w_model, self.w_quick, self.w_reuse], layout=W.Layout(flex_flow="row wrap")),
            W.HBox([self.b_run, self.b_stop, self.progress], layout=W.Layout(align_items="center")),
            self.run_status, self.log, figure_box(self.fig_fit), figure_box(self.fig_collectives),
            W.HBox([self.w_train, self.b_check]), figure_box(self.fig_fidelity),
            self.doctor_section.widget,
        ])

    def _figure_widgets(self) -> dict:
        return {"compute": self.fig_compute, "residuals": self.fig_residuals, "bandwidth": self.fig_bandwidth,
                "extras": self.fig_extras, "fit": self.fig_fit, "collectives": self.fig_collectives, "fidelity": self.fig_fidelity}

    def _guard(self, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a button's error is shown, not lost
            self.status.value = note_html(one_line(e), "error")

    @property
    def profiler_available(self) -> bool:
        """Whether this version can measure profiles (``workbench.profile`` has the run API)."""
        return _profiler() is not None

    # ------------------------------------------------------------------------------------------
    # choosing, loading, saving
    # ------------------------------------------------------------------------------------------
    def _list_profiles(self) -> None:
        from workbench import runs
        from workbench.specs import list_profiles

        opts = [(f"{n} (shipped)", n) for n in list_profiles()]
        for r in reversed(runs.list_runs(self.root, kind="profile")):
            p = r.file(runs.PROFILE_FILE)
            if p.is_file():
                opts.append((f"{r.id} (measured here)", str(p)))
        opts += [x for x in self._extra_refs if x not in opts]
        cur = self.w_profile.value
        self._quiet += 1
        try:
            self.w_profile.options = opts
            if cur in [v for _, v in opts]:
                self.w_profile.value = cur
        finally:
            self._quiet -= 1
        try:
            items = [("(pick a finished training run)", "")]
            items += [(f"{r.id} · {r.status().state}", str(r.path)) for r in reversed(runs.list_runs(self.root, kind="train"))
                      if r.status().final and r.status().step > 0]
            self.w_train.options = items
        except OSError:
            pass

    def _on_pick(self, change) -> None:
        if not self._quiet and change["new"]:
            self._guard(lambda: self.select(change["new"]))

    def select(self, ref) -> Any:
        """Use profile ``ref``: a shipped name, a profile JSON file, or a profile run (id, folder
        or Run). Draws it and tells ``on_profile`` listeners. Returns the HardwareProfile; raises
        ValueError when it does not load."""
        from workbench import runs
        from workbench.specs import load_profile

        text = str(ref.path if isinstance(ref, runs.Run) else ref)
        try:
            prof = load_profile(text)
        except ValueError:
            run = runs.load_run(text, root=self.root)  # RunNotFound (a ValueError) when it is not a run either
            text = str(run.file(runs.PROFILE_FILE))
            prof = load_profile(text)
        with self._lock:
            self.profile, self.profile_ref = prof, text
            if text not in [v for _, v in self.w_profile.options]:
                self._extra_refs.append((f"{Path(text).name} ({prof.name})", text))
                self._list_profiles()
            self._quiet += 1
            try:
                self.w_profile.value = text
            finally:
                self._quiet -= 1
            self._draw()
            self._draw_evidence(text)
        for cb in list(self._callbacks):
            cb(text)
        return prof

    def _profile_run(self, text: str):
        """The profile run that ``text`` (a run folder or its profile.json) belongs to, or None."""
        from workbench import runs

        p = Path(text)
        folder = p if p.is_dir() else p.parent if p.name == runs.PROFILE_FILE else None
        if folder is None or not (folder / runs.SPEC_FILE).is_file():
            return None
        run = runs.Run(folder)
        return run if run.kind == "profile" else None

    def _draw_evidence(self, text: str) -> None:
        """For a profile measured here: the profiler's own figures (measured points and fitted curves,
        residuals with the held-out points, collectives); for any other profile none of them."""
        from widgets._base import clear_figure

        self.result = None
        run, prof = self._profile_run(text), _profiler()
        if run is None or prof is None:
            for f in (self.fig_fit, self.fig_collectives):
                clear_figure(f)
            return
        try:
            res = prof.load_result(run)
            from workbench.report import profile as rp
        except Exception as e:  # noqa: BLE001 - the profile itself is in use; its evidence is optional
            self.status.value += " " + note_html(f"no measurement evidence: {one_line(e)}", "warn")
            return
        self.result = res
        set_figure(self.fig_fit, rp.fit_figure(res))
        set_figure(self.fig_residuals, rp.residual_figure(res))
        set_figure(self.fig_collectives, rp.collectives_figure(res))
        self.status.value = note_html(f"measured here by profile run {run.id}: measured points, fit, held-out "
                                      f"residuals and collectives below", "info")

    def load(self, path: str) -> Any:
        """Load a profile JSON file (or a profile run's folder) and use it."""
        if not str(path).strip():
            raise ValueError("give the path of a profile JSON file")
        p = Path(path).expanduser()
        return self.select(str(p if p.suffix == ".json" or not p.is_dir() else p / "profile.json"))

    def save_profile(self, path: str) -> Path:
        """Write the profile in use to ``path`` (JSON, atomically) and return the path (``save``
        writes the panel's figures and tables into a results folder)."""
        if self.profile is None:
            raise ValueError("no profile to save")
        if not str(path).strip():
            raise ValueError("give a file name to save the profile as, e.g. my-cluster.json")
        p = Path(path).expanduser()
        if p.suffix != ".json":
            p = p.with_suffix(".json")
        out = self.profile.save(p)
        self.status.value = note_html(f"saved {self.profile.name} to {out}", "ok")
        return out

    def on_profile(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(profile_ref)`` whenever another profile is chosen."""
        self._callbacks.append(callback)

    def curves(self) -> dict:
        """The profile's compute curves (``workbench.report.hardware.profile_curves``)."""
        from workbench.report.hardware import profile_curves

        return profile_curves(self.profile)

    def points(self) -> list[dict]:
        """The profile's measured packs with the fit's prediction and error."""
        from workbench.report.hardware import profile_points

        return profile_points(self.profile)

    def links(self) -> dict:
        """The profile's collectives by group size (``workbench.report.hardware.profile_links``):
        ``{kind: {size: {"gbps", "latency_ms"}}}``, what the bandwidth figure draws."""
        from workbench.report.hardware import profile_links

        return profile_links(self.profile)

    def extras(self) -> dict:
        """The profile's measured extras of a split (``workbench.report.hardware.split_extras``):
        ``{"ulysses": {u: {...}}, "cp": {c: {...}}, "splits": {"uxc": {...}}}``, what the extras
        figure draws."""
        from workbench.report.hardware import split_extras

        return split_extras(self.profile)

    def host(self) -> dict:
        """The profile's host side (``workbench.report.hardware.host_link``) with the rows the panel
        shows (``"rows"``: ``host_rows``): the host link of one GPU alone and per GPU when the whole
        node copies, host memory per node, and where they come from."""
        from workbench.report.hardware import host_link, host_rows

        return {**host_link(self.profile), "rows": host_rows(self.profile)}

    def _draw_host(self) -> None:
        import html

        from widgets._base import html_table

        h = self.host()
        table = html_table(h["rows"], [("what", "host", None), ("value", "", None)])
        src = h["note"] or ("no note in the profile's provenance" if h["offload"] else "")
        mem = h["memory_note"] or ""
        where = "".join(f"<div style='color:#555;font-size:12.5px;max-width:980px'>{html.escape(x)}</div>"
                        for x in (f"host link ({h['kind'] or '?'}): {src}" if src else "",
                                  f"host memory: {mem}" if mem else "") if x)
        self.host_view.value = table + where

    def _draw(self) -> None:
        from workbench.report.hardware import (bandwidth_figure, compute_figure, describe_profile, residuals_figure,
                                               split_extras_figure)

        p = self.profile
        self.about.value = f"<div style='font-size:13px;color:#333'>{describe_profile(p)}</div>"
        set_figure(self.fig_compute, compute_figure(p))
        set_figure(self.fig_residuals, residuals_figure(p))
        set_figure(self.fig_bandwidth, bandwidth_figure(p))
        set_figure(self.fig_extras, split_extras_figure(p))
        self._draw_host()
        pts = self.points()
        if pts:
            worst = max(abs(x["relative_error"]) for x in pts if x["relative_error"] is not None)
            self.status.value = note_html(f"{len(pts)} measured points kept in the profile; largest fit error "
                                          f"{100 * worst:.1f}%", "info")
        else:
            self.status.value = note_html("a reference profile: the published fit, without measured points", "info")

    # ------------------------------------------------------------------------------------------
    # measuring (workbench.profile, issue 10)
    # ------------------------------------------------------------------------------------------
    def _on_run(self) -> None:
        nproc, model, quick = int(self.w_nproc.value), self.w_model.value.strip(), bool(self.w_quick.value)
        if quick and model == "tiny":
            self.measure_this_machine(nproc=nproc, reuse=bool(self.w_reuse.value))
        else:
            self.start_profile(nproc=nproc, model=model, quick=quick)

    def measure_this_machine(self, *, nproc: int = 2, reuse: bool = True):
        """This machine's quick profile for ``nproc`` processes (the tiny model), as the demo and the
        Launch panel use it: with ``reuse``, the one cached in the run store for this machine's
        fingerprint (CPU, cores, torch, device, processes) is selected at once and None returned;
        otherwise a quick profile run carrying the fingerprint starts (it becomes the cached one)
        and its Run is returned, followed like :meth:`start_profile`."""
        from workbench.profile.machine import find_machine_profile, machine_fingerprint
        from workbench.training import cuda_visible

        device = "cuda" if cuda_visible() else "cpu"
        fp = machine_fingerprint(nproc, device=device)
        found = find_machine_profile(nproc, root=self.root, device=device, fingerprint=fp) if reuse else None
        if found is not None:
            self.select(str(found.path))
            self.run_status.value = note_html(f"reusing this machine's quick profile for {nproc} process(es): run "
                                              f"{found.run.id} (untick 'reuse' to measure again)", "ok")
            return None
        return self.start_profile(nproc=nproc, model="tiny", quick=True, device=device, fingerprint=fp,
                                  oversubscribe=nproc > (os.cpu_count() or 1))

    def start_profile(self, *, nproc: int = 2, model: str = "tiny", quick: bool = True, name: str | None = None,
                      **options):
        """Start a profile run of this machine (a torchrun process tree) and follow it; ``options``
        are further ``prepare_profile`` settings (``max_len``, ``reps``, ``warmup``, ``fingerprint``,
        ...). Returns the Run. Raises RuntimeError when this version has no profiler, ValueError for
        a bad setting."""
        prof = _profiler()
        if prof is None:
            raise RuntimeError("this version of the workbench has no profiler (workbench.profile.prepare_profile)")
        run = prof.prepare_profile(nproc=nproc, model=model, quick=quick, root=self.root, name=name, **options)
        handle = prof.start_profile(run, stop_with_parent=False)
        with self._lock:
            self._stop_poll.set()
            self.run, self.handle, self.final, self.result = run, handle, None, None
            self.b_stop.disabled, self.b_run.disabled = False, True
        self.refresh()
        self._stop_poll = threading.Event()
        threading.Thread(target=self._poll_loop, args=(self._stop_poll,), name="hardware-panel-poll", daemon=True).start()
        return run

    def _poll_loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                st = self.refresh()
            except Exception as e:  # noqa: BLE001 - shown, the loop goes on
                self.run_status.value = note_html(f"reading the run: {one_line(e)}", "warn")
                st = None
            if st is not None and st.final:
                return
            stop.wait(self.poll_interval)

    def refresh(self):
        """Read the profile run's status once, update progress and log; when it has ended, load its
        result. Returns the RunStatus (None without a run)."""
        from workbench import launch

        with self._lock:
            if self.run is None or self.handle is None:
                return None
            ended = launch.poll(self.handle) if self.final is None else self.final
            st = ended or self.run.status()
            self.progress.value = float(st.progress or (1.0 if st.state == "done" else 0.0))
            kind = {"done": "ok", "failed": "error", "stopped": "warn"}.get(st.state, "busy")
            msg = f"{self.run.id}: {st.state}" + (f" · {st.message}" if st.message else "")
            if st.error:
                msg += f" · error: {str(st.error).splitlines()[0]}"
            self.run_status.value = note_html(msg, kind)
            self.log.value = log_html(self.run.log_tail(12))
            if ended is not None and self.final is None:
                self.final = ended
                self.b_stop.disabled, self.b_run.disabled = True, False
                if ended.state == "done":
                    try:
                        self.load_result(self.run)
                    except Exception as e:  # noqa: BLE001 - shown to the user
                        self.run_status.value += " " + note_html(f"loading the result: {one_line(e)}", "error")
            return st

    def wait(self, timeout: float = 600.0):
        """Poll until the profile run ends; returns its final RunStatus (TimeoutError after
        ``timeout`` seconds; the run goes on)."""
        if self.run is None:
            raise ValueError("no profile run to wait for")
        end = time.monotonic() + timeout
        while True:
            st = self.refresh()
            if self.final is not None:
                return st
            if time.monotonic() > end:
                raise TimeoutError(f"profile run {self.run.id} still running after {timeout:.0f}s")
            time.sleep(self.poll_interval)

    def stop(self):
        """End every process of the profile run; returns its final RunStatus."""
        from workbench import launch

        if self.run is None:
            raise ValueError("no profile run to stop")
        st = launch.stop(self.handle if self.handle is not None else self.run)
        self.refresh()
        return st

    def load_result(self, run) -> Any:
        """Load a finished profile run's result (measured points, fitted curves, residuals,
        held-out errors, collectives), draw it and use its profile. Returns the ProfileResult."""
        prof = _profiler()
        if prof is None:
            raise RuntimeError("this version of the workbench has no profiler")
        from workbench import runs

        r = runs.load_run(run, root=self.root)
        if not r.file(runs.PROFILE_FILE).is_file():
            res = prof.load_result(r)
            if getattr(res, "profile", None) is not None:
                res.profile.save(r.file(runs.PROFILE_FILE))  # where a profile run keeps its profile
        self._list_profiles()
        self.select(r)
        if self.result is None:
            raise ValueError(f"profile run {r.id} has no result to show")
        return self.result

    def check_fidelity(self, train_run) -> dict:
        """Compare the profile's predictions with a training run's measured steps
        (``workbench.profile.check_fidelity``), draw it and return its dict."""
        prof = _profiler()
        if prof is None or not hasattr(prof, "check_fidelity"):
            raise RuntimeError("this version of the workbench cannot check a profile's fidelity")
        from workbench import runs

        if not train_run:
            raise ValueError("pick a finished training run")
        check = prof.check_fidelity(self.profile, runs.load_run(train_run, root=self.root))
        self.fidelity = check
        try:
            from workbench.report import profile as rp

            set_figure(self.fig_fidelity, rp.fidelity_figure(check))
        except ImportError:
            pass
        return check

    def run_doctor(self, *, quick: bool = True, wait: bool = True) -> dict | None:
        """``workbench doctor`` on this machine (a process of its own), shown in the Doctor section;
        with ``wait`` returns its report (the ``--json`` dict)."""
        return self.doctor_section.run(quick=quick, wait=wait)

    def doctor_rows(self) -> list[dict]:
        """The doctor's lines as the Doctor section shows them: ``{name, status, detail, fix}``."""
        return self.doctor_section.rows()

    def tables(self) -> dict:
        if self.profile is None:
            return {}
        out = {"profile": self.profile.to_dict(), "curves": self.curves(), "points": self.points(),
               "links": {k: {str(d): v for d, v in t.items()} for k, t in self.links().items()},
               "extras": {k: {str(d): v for d, v in t.items()} for k, t in self.extras().items()},
               "host": self.host()}
        if self.fidelity is not None:
            out["fidelity"] = self.fidelity
        return out
