"""LaunchPanel: start a real training run through the launcher, watch it live, stop it.

The run is a torchrun process tree started by ``workbench.launch.start`` in a session of its own
(the kernel never forks and never imports torch); its output goes to the run's ``log.txt``. A poll
thread reads the run store (``status.json``, ``metrics.jsonl``, the log's tail) and updates widget
values and the figure only. Stop ends the whole tree (SIGTERM, grace, SIGKILL). A run started with
``stop_with_parent=False`` outlives a kernel restart or a page reload; a new panel finds it in the
run store and reattaches.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import ipywidgets as W

from widgets._base import (Panel, figure_box, figure_widget, log_html, model_control, note_html, one_line, path_control,
                           set_figure)
from widgets.cluster import ClusterSection
from workbench.scenario import Scenario

__all__ = ["LaunchPanel"]

_STATE_KIND = {"created": "info", "starting": "busy", "running": "busy", "done": "ok", "failed": "error",
               "stopped": "warn"}


class LaunchPanel(Panel):
    """Launch, follow and stop training runs.

    Python API (what the buttons call): :meth:`settings`, :meth:`set`, :meth:`use_scenario`,
    :meth:`launch` (returns the Run), :meth:`refresh` (one poll of the run store), :meth:`wait`,
    :meth:`stop`, :meth:`attach`, :meth:`live_runs`, :meth:`on_finished`; :attr:`run`,
    :attr:`handle`, :attr:`state`; on a cluster: :meth:`cluster_script`, :meth:`save_cluster_script`."""

    title = "Launch"
    LINGER_S = 30.0
    """After the supervisor ends, how long the panel waits for the run's last processes before it
    reports the end anyway (naming what is still alive)."""

    def __init__(self, *, root=None, reattach: bool = True, poll_interval: float = 0.5, nproc: int = 2,
                 steps: int = 20, follow: bool = True, measure_machine: bool = True,
                 profile_options: dict | None = None) -> None:
        self.root = root
        self.poll_interval = float(poll_interval)
        """Seconds between the panel's reads of the run store: of the run it follows, and of a
        measurement of this machine while it runs (its progress bar; at most every 0.5 s)."""
        self.follow = follow
        """Whether a background thread polls the run (False: call :meth:`refresh` yourself)."""
        self.measure_machine = measure_machine
        """Whether a CPU run without a profile of its own plans with this machine's quick profile for
        its process count (measured on the first launch, then reused from the run store)."""
        self.profile_options = dict(profile_options or {})
        """How this machine is measured when it has no profile yet: ``ProfileSpec`` fields of
        ``workbench.profile.machine.SIZING_OPTIONS``, e.g. ``{"reps": 2}`` for a quicker, noisier
        measurement (default: the quick grid). A cached profile is reused whatever sizes measured it."""
        self.machine_profile = None
        """The ``workbench.profile.machine.MachineProfile`` the last launch planned with (None: the
        run named its own profile, or ran on GPUs)."""
        self.run = None
        self.handle = None
        self.final = None
        """The final RunStatus of the run shown, once it ended."""
        self.polls = 0
        self._drawn = -1
        self._lock = threading.RLock()
        self._poller: threading.Thread | None = None
        self._stop_poll = threading.Event()
        self._finished: list[Callable[[Any], None]] = []
        self._extra: dict = {}
        self._reattached = False
        self._ended_at: float | None = None
        self._build(nproc, steps)
        if reattach:
            live = self.live_runs()
            if live:
                self.attach(live[-1])

    # ------------------------------------------------------------------------------------------
    def _build(self, nproc: int, steps: int) -> None:
        from workbench.data import SOURCE_NAMES
        from workbench.scenario import DEFAULT_PLANNERS
        from workbench.training import OPTIMIZERS, TRAIN_DEFAULTS

        st = {"description_width": "initial"}
        lay = W.Layout(width="210px")
        cores = os.cpu_count() or 2
        self.w_nproc = W.IntSlider(min=1, max=max(4, min(8, 2 * cores)), value=nproc, description="processes",
                                   style=st, continuous_update=False, layout=W.Layout(width="260px"))
        self.w_steps = W.BoundedIntText(min=1, max=10**7, value=steps, description="steps", style=st, layout=lay)
        self.w_planner = W.Dropdown(options=list(DEFAULT_PLANNERS), value=TRAIN_DEFAULTS["planner"],
                                    description="planner", style=st, layout=lay)
        # a name, or your text (JSONL, Parquet, CSV, documents, a saved dataset) typed in
        self.w_source = W.Combobox(options=list(SOURCE_NAMES), value=TRAIN_DEFAULTS["source"], ensure_option=False,
                                   continuous_update=False, placeholder="stdlib, a family, or path/to/data.jsonl",
                                   description="data", style=st, layout=W.Layout(width="330px"))
        self.w_model = model_control(TRAIN_DEFAULTS["model"], width="260px")
        self.w_tokenizer = path_control("tokenizer", "path/to/tokenizer.json (empty: byte-level)")
        self.w_column = path_control("column", "text column (auto)", width="200px")
        self.w_init = path_control("init weights", "safetensors file or model folder (empty: random)")
        self.w_max_len = W.Dropdown(options=[256, 512, 1024, 2048, 4096, 8192], value=1024, description="max context",
                                    style=st, layout=lay)
        self.w_batch = W.BoundedIntText(min=64, max=10**9, step=4096, value=TRAIN_DEFAULTS["batch_tokens"],
                                        description="batch tokens", style=st, layout=lay)
        self.w_optimizer = W.Dropdown(options=list(OPTIMIZERS), value="adamw", description="optimizer", style=st,
                                      layout=lay)
        self.w_seed = W.BoundedIntText(min=0, max=2**31 - 1, value=0, description="seed", style=st,
                                       layout=W.Layout(width="140px"))
        self.b_launch = W.Button(description="Launch", icon="play", button_style="primary",
                                 tooltip="start a torchrun run with these settings")
        self.b_stop = W.Button(description="Stop", icon="stop", button_style="danger", disabled=True,
                               tooltip="end every process of the run (SIGTERM, grace, SIGKILL)")
        self.w_live = W.Dropdown(description="running", style=st, layout=W.Layout(width="420px"))
        self.b_attach = W.Button(description="Reattach", icon="link", tooltip="follow the run picked on the left")
        self.b_scan = W.Button(icon="refresh", tooltip="look for running runs in the run store",
                               layout=W.Layout(width="40px"))
        self.reattach_row = W.HBox([self.w_live, self.b_attach, self.b_scan], layout=W.Layout(align_items="center"))
        self.settings_note = W.HTML()
        self.status = W.HTML(note_html("no run yet: set the run up and press Launch"))
        self.profile_note = W.HTML()
        self.progress = W.IntProgress(min=0, max=steps, value=0, description="step 0", style=st,
                                      layout=W.Layout(width="420px"))
        self.log = W.HTML(log_html([]))
        self.log_lines: list[str] = []
        """The log's last lines as shown."""
        self.fig = figure_widget()
        self.cluster = ClusterSection(self.settings)
        self.b_launch.on_click(lambda _: self._guard(self.launch))
        self.b_stop.on_click(lambda _: self._stop_in_background())
        self.b_attach.on_click(lambda _: self._guard(lambda: self.attach(self.w_live.value or None)))
        self.b_scan.on_click(lambda _: self.live_runs())
        self.widget = W.VBox([
            W.HTML("<b style='font-size:15px'>Launch</b> &nbsp; <span style='color:#555'>train for real: torchrun "
                   "processes run each step's plan, one rank per process (gloo on CPU)</span>"),
            W.HBox([self.w_nproc, self.w_steps, self.w_planner], layout=W.Layout(flex_flow="row wrap")),
            W.HBox([self.w_model, self.w_init], layout=W.Layout(flex_flow="row wrap")),
            W.HBox([self.w_source, self.w_tokenizer, self.w_column], layout=W.Layout(flex_flow="row wrap")),
            W.HBox([self.w_max_len, self.w_batch], layout=W.Layout(flex_flow="row wrap")),
            W.HBox([self.w_optimizer, self.w_seed], layout=W.Layout(flex_flow="row wrap")),
            self.settings_note,
            W.HBox([self.b_launch, self.b_stop, self.progress], layout=W.Layout(align_items="center", flex_flow="row wrap")),
            self.status,
            self.profile_note,
            self.reattach_row,
            W.HTML("<div style='color:#555;font-size:12.5px'>The run's log (its last lines, read from "
                   "<code>log.txt</code> in the run folder):</div>"),
            self.log,
            W.HTML("<div style='color:#555;font-size:12.5px'>Loss, and each step's measured time against the time "
                   "the plan predicted from the cost model (the first step also pays start-up costs).</div>"),
            figure_box(self.fig),
            self.cluster.widget,
        ])

    def _figure_widgets(self) -> dict:
        return {"training": self.fig}

    def _guard(self, fn: Callable[[], Any]) -> None:
        # a button's error goes to the status line (a callback's exception would be lost)
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - shown to the user, not raised into the void
            self.status.value = note_html(one_line(e), "error")

    # ------------------------------------------------------------------------------------------
    # settings
    # ------------------------------------------------------------------------------------------
    def settings(self) -> dict:
        """The settings a launch uses (``workbench.training.prepare_train`` fields)."""
        paths = {k: w.value.strip() or None for k, w in
                 (("tokenizer", self.w_tokenizer), ("column", self.w_column), ("init", self.w_init))}
        return {"steps": int(self.w_steps.value), "nproc": int(self.w_nproc.value), "planner": self.w_planner.value,
                "source": self.w_source.value.strip(), "model": self.w_model.value.strip(),
                "max_len": int(self.w_max_len.value), "batch_tokens": int(self.w_batch.value),
                "optimizer": self.w_optimizer.value, "seed": int(self.w_seed.value),
                **{k: v for k, v in paths.items() if v is not None}, **self._extra}

    def set(self, **settings: Any) -> dict:
        """Set controls by ``prepare_train`` field name (``steps``, ``nproc``, ``planner``,
        ``source``, ``model`` (a preset or a config.json path), ``tokenizer``, ``column``, ``init``,
        ``max_len``, ``batch_tokens``, ``optimizer``, ``seed``; any other training or Scenario field
        is kept and passed on at launch). Returns :meth:`settings`."""
        from workbench.training import SCENARIO_FIELDS, TRAIN_FIELDS

        widgets = {"steps": self.w_steps, "nproc": self.w_nproc, "planner": self.w_planner, "source": self.w_source,
                   "model": self.w_model, "max_len": self.w_max_len, "batch_tokens": self.w_batch,
                   "optimizer": self.w_optimizer, "seed": self.w_seed, "tokenizer": self.w_tokenizer,
                   "column": self.w_column, "init": self.w_init}
        extra = dict(self._extra)
        for k, v in settings.items():
            if k in ("tokenizer", "column", "init", "source", "model"):
                widgets[k].value = "" if v is None else str(v)
            elif k in widgets:
                w = widgets[k]
                if isinstance(w, W.Dropdown) and v not in [o[1] if isinstance(o, tuple) else o for o in w.options]:
                    w.options = [*w.options, v]
                w.value = v
            elif k in TRAIN_FIELDS or k in SCENARIO_FIELDS:
                extra[k] = v
            else:
                raise ValueError(f"unknown training setting {k!r}")
        self._extra = extra
        return self.settings()

    def use_scenario(self, sc: Scenario) -> dict:
        """Take the planning settings of ``sc`` (from the Lengths and Solver panels): data source,
        samples, seed, max-context policy, planner and its effort. On a machine with CUDA also
        the model, max context and batch; on CPU those stay small (a 7B model or a 128K context does
        not train on a CPU) and the note says so. Returns ``{"taken": {...}, "kept": {...}}``."""
        from workbench.training import CPU_MAX_LEN, cuda_visible

        taken = {"source": sc.source, "seed": sc.seed, "policy": sc.policy, "planner": sc.planner,
                 "effort": sc.effort, "time_limit": sc.time_limit, "tokenizer": sc.tokenizer, "column": sc.column}
        if sc.samples is not None:
            taken["samples"] = sc.samples
        kept = {}
        # your own model comes along when a CPU can train it (a config of at most ~200M parameters)
        small = sc.model_spec().params() <= 200e6 and sc.model.strip().lower() not in ("1b", "7b", "13b", "30b", "70b")
        if cuda_visible():
            taken.update(model=sc.model, max_len=sc.resolved_max_len(), batch_tokens=sc.batch_tokens)
        else:
            if small:
                taken["model"] = sc.model
            kept = {"max_len": min(int(self.w_max_len.value), CPU_MAX_LEN),
                    "batch_tokens": int(self.w_batch.value),
                    "profile": "this machine's quick profile (measured at the first launch, then reused)",
                    "GPUs": f"{int(self.w_nproc.value)} CPU processes instead of {sc.num_gpus} GPUs"}
            if not small:
                kept = {"model": self.w_model.value, **kept}
        self.set(**{k: v for k, v in taken.items() if v is not None or k in ("tokenizer", "column")})
        if not cuda_visible():
            self.set(max_len=kept["max_len"])
        t = ", ".join(f"{k} {v}" for k, v in taken.items() if v is not None)
        k = ", ".join(f"{a} {b}" for a, b in kept.items())
        self.settings_note.value = (f"<div style='font-size:12.5px'>From the planning tabs: {t}."
                                    + (f"<br><span style='color:#B26A00'>Kept for this CPU machine: {k}.</span>" if k else "")
                                    + "</div>")
        return {"taken": taken, "kept": kept}

    # ------------------------------------------------------------------------------------------
    # runs
    # ------------------------------------------------------------------------------------------
    def launch(self, **overrides: Any):
        """Prepare a training run with :meth:`settings` (and ``overrides``), start it through the
        launcher and follow it. Returns the Run. Raises ValueError for bad settings, RunBusy /
        ValueError when a run of this panel is still going, ResourceError when the machine cannot
        hold it."""
        from workbench import launch, training

        if self.handle is not None and self.state in ("starting", "running"):
            raise ValueError(f"run {self.run.id} is still going; stop it first")
        settings = {**self.settings(), **overrides}
        warnings = training.check_resources(**training.resource_args(None, settings))
        self.machine_profile = None
        self.profile_note.value = ""
        on_cpu = settings.get("device", "auto") == "cpu" or (settings.get("device", "auto") == "auto"
                                                             and not training.cuda_visible())
        if self.measure_machine and on_cpu and not settings.get("profile") and int(settings.get("nnodes", 1)) == 1:
            # predictions hold where they were measured: plan with this machine's own quick profile,
            # once every other setting checks out (a bad setting fails at once, nothing measured)
            training.prepare_train(settings, root=self.root, dry_run=True)
            try:
                self.machine_profile = self.machine_profile_for(int(settings["nproc"]))
                settings["profile"] = str(self.machine_profile.path)
            except RuntimeError as e:  # the run still goes, with the shipped profile and its note
                warnings = [*warnings, f"this machine could not be measured ({one_line(e)}); planning with the "
                                       f"shipped profile"]
        run, spec, _ = training.prepare_train(settings, root=self.root)
        handle = launch.start(run, nproc=spec.nproc, stop_with_parent=False)
        self._reattached = False
        self._follow(run, handle, spec.steps)
        note = ("; " + "; ".join(warnings)) if warnings else ""
        self.status.value = note_html(f"started {run.id}: {spec.nproc} process(es), {spec.steps} steps{note}", "busy")
        return run

    def machine_profile_for(self, nproc: int):
        """This machine's quick profile for ``nproc`` processes (``ensure_machine_profile``): the one
        cached in the run store, or measured now (sized by :attr:`profile_options`) with its progress
        on the panel. Returns the MachineProfile; raises RuntimeError when measuring fails,
        ValueError for bad :attr:`profile_options`."""
        from workbench.profile.machine import ensure_machine_profile

        def show(frac: float, msg: str) -> None:
            self.progress.max = 100
            self.progress.value = int(100 * min(1.0, max(0.0, frac)))
            self.progress.description = "profile"
            self.status.value = note_html(f"measuring this machine first (a quick profile of {nproc} process(es), "
                                          f"kept for later runs): {msg}", "busy")

        mp = ensure_machine_profile(nproc, root=self.root, progress=show, poll=min(self.poll_interval, 0.5),
                                    **self.profile_options)
        self.profile_note.value = note_html(f"planned with {mp.describe()}: {mp.path}", "info")
        return mp

    def _follow(self, run, handle, steps: int | None) -> None:
        with self._lock:
            self._stop_poll.set()
            self.run, self.handle, self.final, self._ended_at = run, handle, None, None
            self._drawn = -1
            self.progress.max = int(steps or 1)
            self.progress.value = 0
            self.progress.bar_style = ""
            self.b_stop.disabled = False
            self.b_launch.disabled = True
            self.reattach_row.layout.display = "none"  # following a run; the picker is for finding one
            self.log_lines = []
            self.log.value = log_html([])
        self.refresh()
        if self.follow:
            self._stop_poll = threading.Event()
            self._poller = threading.Thread(target=self._poll_loop, args=(self._stop_poll,), name="launch-panel-poll",
                                            daemon=True)
            self._poller.start()

    def _poll_loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                st = self.refresh()
            except Exception as e:  # noqa: BLE001 - a reader hiccup is shown, the loop goes on
                self.status.value = note_html(f"reading the run store: {one_line(e)}", "warn")
                st = None
            if st is not None and st.final:
                return
            stop.wait(self.poll_interval)

    @property
    def state(self) -> str | None:
        """The shown run's state (None without a run)."""
        if self.run is None:
            return None
        return self.final.state if self.final is not None else self.run.status().state

    def refresh(self, draw: bool = True):
        """Read the run store once and update the widgets: status, progress, log tail and, with
        ``draw``, the figure. Returns the run's RunStatus (None without a run). Safe to call from
        any thread."""
        from workbench import launch
        from workbench.report.runs import live_run_figure, run_series

        with self._lock:
            if self.run is None or self.handle is None:
                return None
            self.polls += 1
            ended = launch.poll(self.handle) if self.final is None else self.final
            lingering = []
            if ended is not None and self.final is None:
                # the supervisor has ended; the run is over when its last process is (a stop's
                # SIGKILL may still be on its way): until then say so, for at most LINGER_S
                from workbench import runs

                lingering = [p for p, t in runs.status_pids(ended) if runs.pid_alive(p, t)]
                self._ended_at = self._ended_at or time.monotonic()
                if lingering and time.monotonic() - self._ended_at < self.LINGER_S:
                    ended = None
            st = ended or self.run.status()
            steps = self.run.steps()
            newly_ended = ended is not None and self.final is None
            if newly_ended:
                self.final = ended
                self.b_stop.disabled = True
                self.b_launch.disabled = False
                self.progress.bar_style = {"done": "success", "failed": "danger", "stopped": "warning"}.get(ended.state, "")
                self.reattach_row.layout.display = ""
            total = st.steps or self.progress.max
            self.progress.max = max(1, int(total))
            self.progress.value = min(int(st.step), self.progress.max)
            self.progress.description = f"step {st.step}/{total}"
            self.log_lines = self.run.log_tail(14)
            self.log.value = log_html(self.log_lines)
            if draw and len(steps) != self._drawn:
                self._drawn = len(steps)
                set_figure(self.fig, live_run_figure(run_series(self.run), title=f"{self.run.id}"))
            last = steps[-1] if steps else None
            state = st.state
            if st.final and (ended is None or self.final is None):
                # the run wrote its end but its processes are still exiting: not over yet
                state = {"stopped": "stopping", "done": "finishing", "failed": "failing"}[st.state]
            bits = [f"{self.run.id}{' (reattached)' if self._reattached else ''}: {state}"]
            if last is not None:
                bits.append(f"step {last.step}, loss {last.loss:.4f}" if last.loss is not None else f"step {last.step}")
                if last.measured_ms:
                    bits.append(f"measured {last.measured_ms:,.0f} ms vs predicted {last.predicted_ms or 0:,.0f} ms")
            elif st.message:
                bits.append(st.message)
            if st.error:
                bits.append(f"error: {str(st.error).splitlines()[0]}")
            note = (st.resolved or {}).get("profile_note")
            if note:  # planned with another machine's profile: its predictions may not hold here
                self.profile_note.value = note_html(note, "warn")
            elif (st.resolved or {}).get("profile") and self.machine_profile is None:
                self.profile_note.value = note_html(f"profile {st.resolved['profile']}: measured on this machine",
                                                    "info")
            bits += [f"warning: {str(w).splitlines()[0]}" for w in st.warnings]
            if lingering and ended is None:
                bits.append(f"waiting for {len(lingering)} process(es) to exit")
            elif lingering:
                bits.append(f"process(es) {lingering} still alive after {self.LINGER_S:.0f}s")
            self.status.value = note_html(" · ".join(bits), _STATE_KIND.get(state, "busy"))
            if newly_ended:
                for cb in list(self._finished):
                    try:
                        cb(self.run)
                    except Exception as e:  # noqa: BLE001 - a listener's bug must not stop the panel
                        self.status.value += " " + note_html(f"on_finished: {one_line(e)}", "warn")
            return st

    def wait(self, timeout: float = 300.0):
        """Poll until the run ends; returns its final RunStatus. Raises TimeoutError after
        ``timeout`` seconds (the run goes on) and ValueError without a run.

        The figure is drawn once, at the end (a live panel's poller draws it as steps come): a
        plotly figure costs tens of ms of CPU to build and send, which a run on a CPU machine with
        no core to spare pays in its measured step times (about 5 points of the demo's median
        prediction error on 2 cores)."""
        if self.run is None:
            raise ValueError("no run to wait for; launch one first")
        end = time.monotonic() + timeout
        while True:
            st = self.refresh(draw=False)
            if st is not None and st.final and self.final is not None:
                self.refresh()
                return st
            if time.monotonic() > end:
                raise TimeoutError(f"run {self.run.id} still {st.state if st else '?'} after {timeout:.0f}s")
            time.sleep(min(self.poll_interval, 0.5))

    def stop(self):
        """End every process of the run shown (SIGTERM to the supervisor, grace, SIGKILL to every
        recorded process group) and return the final RunStatus (``stopped`` unless it had ended)."""
        from workbench import launch

        if self.run is None:
            raise ValueError("no run to stop")
        self.status.value = note_html(f"stopping {self.run.id}...", "busy")
        st = launch.stop(self.handle if self.handle is not None else self.run)
        self.refresh()
        return st

    def _stop_in_background(self) -> None:
        # a stop waits up to a few seconds for the processes to end: keep the page responsive
        self.b_stop.disabled = True

        def go():
            try:
                self.stop()
            except Exception as e:  # noqa: BLE001 - shown to the user
                self.status.value = note_html(f"stop: {one_line(e)}", "error")

        threading.Thread(target=go, name="launch-panel-stop", daemon=True).start()

    def live_runs(self) -> list:
        """Training runs in the store whose processes are alive on this machine (oldest first);
        also lists them in the reattach picker."""
        from workbench import launch, runs

        live = []
        for r in runs.list_runs(self.root, kind="train"):
            st = r.status()
            if not st.final and launch.run_alive(st):
                live.append(r)
        self.w_live.options = [("(no running run)" if not live else "(pick a running run)", "")] + \
            [(f"{r.id} · step {r.status().step}", str(r.path)) for r in live]
        self.w_live.value = ""
        return live

    def attach(self, run=None):
        """Follow a run that is still going (after a kernel restart or a page reload): ``run`` (a
        Run, id or folder), or the newest live one. Returns the RunHandle, or None when nothing of
        that run is alive."""
        from workbench import launch, runs

        if run is None:
            live = self.live_runs()
            if not live:
                self.status.value = note_html("no running training run to reattach to", "info")
                return None
            run = live[-1]
        r = runs.load_run(run, root=self.root)
        handle = launch.attach(r)
        if handle is None:
            self.status.value = note_html(f"{r.id} is not running any more ({r.status().state})", "info")
            return None
        spec = r.spec()
        self._reattached = True
        self._follow(r, handle, spec.get("steps"))
        return handle

    def on_finished(self, callback: Callable[[Any], None]) -> None:
        """Call ``callback(run)`` when the run shown ends (done, failed or stopped)."""
        self._finished.append(callback)

    def tables(self) -> dict:
        if self.run is None:
            return {}
        return {"run": self.run.summary()}

    def cluster_script(self, kind: str = "slurm", *, nnodes: int = 2, run_root: str | None = None,
                       endpoint: str | None = None, name: str | None = None) -> str:
        """The Slurm batch script (``kind="slurm"``) or per-node torchrun commands (``"torchrun"``)
        that run this panel's settings on ``nnodes`` nodes, with the run store at ``run_root`` (a path
        every node sees); shown in the panel. What ``workbench train ... --emit KIND`` prints."""
        return self.cluster.script(kind=kind, nnodes=nnodes, run_root=run_root, endpoint=endpoint, name=name)

    def save_cluster_script(self, path) -> Path:
        """Save the script shown (made with the current settings if none is) to ``path``."""
        return self.cluster.save(path)

    def close(self) -> None:
        """Stop following (the run itself goes on)."""
        self._stop_poll.set()
