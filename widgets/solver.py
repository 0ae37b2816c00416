"""SolverPanel: plan one step of a batch for a cluster, every planner side by side.

Controls are the Scenario's cluster, model, batch and planner fields. A change schedules a solve
on a background thread (debounced; a newer change cancels the older solve through the planners'
cancel hook), so the page stays responsive; :meth:`SolverPanel.solve` does the same synchronously
for notebooks run by papermill and for tests. The panel draws ``workbench.report`` figures: the
plan's timeline (groups over ranks per micro-step), the planners compared, and the per-GPU memory
breakdown of a chosen group (parameters, gradients, optimizer states, working set, activations
against the budget; for a group that offloads, the host memory it fills beside it, against the host
budget), and for a finished run, predicted against measured model states per rank (and
peak memory on CUDA).
"""

from __future__ import annotations

import html
import re
import threading
import time
from typing import Any, Callable, Sequence

import ipywidgets as W

from widgets._base import (LatestWorker, Panel, ScenarioSource, figure_box, figure_widget, html_table, model_control, note_html,
                           one_line, path_control, set_figure)
from workbench.cost.offload import OFFLOAD_CHOICES
from workbench.scenario import DEFAULT_PLANNERS, DEFAULT_STRATEGY, STRATEGIES, Scenario

__all__ = ["SolverPanel", "SolveResult", "idle_text"]

_PER_NODE = list(range(1, 17))
"""GPUs per node the control offers (any size; another comes in through :meth:`SolverPanel.set`)."""
_MAX_GPUS = 8192


def _gpu_counts(per_node: int, current: int | None = None) -> list[int]:
    """The GPU counts the control offers for nodes of ``per_node``: every count in one node, then every
    whole number of nodes up to 64, then 2^a and 3 x 2^a nodes (up to ``_MAX_GPUS`` GPUs), plus
    ``current``. Any count a node size allows is valid (``ClusterSpec``); the list only keeps the
    dropdown short. One that is not valid (``current``, set from code) is shown with its note."""
    g = max(1, int(per_node))
    out = set(range(1, g + 1)) | {g * k for k in range(1, 65) if g * k <= _MAX_GPUS}
    for first in (64, 96):
        k = first
        while g * k <= _MAX_GPUS:
            out.add(g * k)
            k *= 2
    if current is not None:
        out.add(int(current))
    return sorted(out)


def _pow2_upto(n: int, lo: int = 1) -> list[int]:
    out, d = [], lo
    while d <= n:
        out.append(d)
        d *= 2
    return out


def _ctx_label(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def idle_text(plan) -> str:
    """A plan's idle GPU-time as the panel says it: ``idle GPU-time 29.6% (13 of 48 GPUs in no group)``
    (the share of the step's GPU-time in which GPUs wait, ``Plan.idle_share``; the GPUs no group uses)."""
    used = {r for m in plan.micro_steps for g in m.groups for r in g.ranks}
    free = plan.num_gpus - len(used)
    return f"idle GPU-time {100 * plan.idle_share:.1f}%" + (f" ({free} of {plan.num_gpus} GPUs in no group)" if free else "")


def _chain(c) -> str:
    return "·".join(map(str, c))


class SolveResult(dict):
    """Plans of one solve by planner name (``Plan`` objects), with ``errors`` (planner: one line),
    ``scenario``, ``batch`` (lengths), ``seconds`` and ``packing_bound_ms`` (the step's
    ``workbench.solve.bound.step_bound_ms`` given these plans; None without plans). A threaded solve
    of a lockstep step shows its plans first and adds the lockstep pass bound when it is ready
    (``pass_bound_pending`` until then: it takes seconds on thousands of sequences)."""

    def __init__(self, plans: dict, errors: dict, scenario: Scenario, batch, seconds: float, generation: int,
                 packing_bound_ms: float | None = None) -> None:
        super().__init__(plans)
        self.errors = errors
        self.scenario = scenario
        self.batch = batch
        self.seconds = seconds
        self.generation = generation
        self.packing_bound_ms = packing_bound_ms
        self.pass_bound_pending = False


class SolverPanel(ScenarioSource, Panel):
    """Plan one step's batch with every planner and draw the plans.

    Python API (what the buttons call; usable headless): :meth:`set`, :attr:`scenario`,
    :meth:`solve` (synchronous, returns a :class:`SolveResult` of planner -> Plan),
    :meth:`request_solve` / :meth:`wait_idle` / :meth:`cancel` (the threaded path),
    :meth:`show_planner`, :meth:`select_group`, :meth:`memory`, :meth:`host_memory`, :meth:`compare_run`,
    :meth:`planner_table`, :meth:`figures`, :meth:`tables`, :meth:`save`, :meth:`on_train`."""

    title = "Solver"

    def __init__(self, scenario: Scenario | None = None, *, planners: Sequence[str] = DEFAULT_PLANNERS,
                 auto: bool = True, debounce: float = 0.35, root=None) -> None:
        self._base = scenario or Scenario(batch_tokens=1_000_000, samples=100_000)
        if self._base.batch_tokens is None and self._base.batch_size is None and not self._is_list(self._base):
            self._base = self._base.replace(batch_tokens=1_000_000)
        self.planners = list(planners)
        self.auto = auto
        self.root = root
        self.result: SolveResult | None = None
        self.solves = 0
        """Solves whose plans were drawn (threaded or not)."""
        self.error: str | None = None
        self._quiet = 0
        self._lock = threading.RLock()
        self._train_callbacks: list[Callable[[Scenario], None]] = []
        self._chosen_group: tuple[int, int] | None = None
        self._last_progress = 0.0
        self._build()
        self._worker = LatestWorker(self._job, done=self._apply, failed=self._fail, debounce=debounce,
                                    name="solver-panel")
        # the lockstep pass bound of the plans shown, after them (a newer solve cancels it)
        self._bounds = LatestWorker(self._bound_job, done=self._apply_bound, failed=self._fail_bound, debounce=0.0,
                                    name="solver-panel-bound")
        self._load_controls(self._base)
        if auto:
            self.request_solve(debounce=False)  # the first plan, drawn when ready

    # ------------------------------------------------------------------------------------------
    # widgets
    # ------------------------------------------------------------------------------------------
    @staticmethod
    def _is_list(sc: Scenario) -> bool:
        from workbench.data import is_length_list

        return is_length_list(sc.source)

    def _build(self) -> None:
        from workbench.data import SOURCE_NAMES
        from workbench.solve import planner_names

        st = {"description_width": "initial"}
        lay = W.Layout(width="210px")
        self.w_model = model_control("7b", width="250px")
        # the data: a name, or your text (with your tokenizer) or lengths file typed in
        self.w_source = W.Combobox(options=list(SOURCE_NAMES), ensure_option=False, continuous_update=False,
                                   placeholder="family, stdlib, or path/to/data.jsonl", description="data", style=st,
                                   layout=W.Layout(width="330px"))
        self.w_tokenizer = path_control("tokenizer", "path/to/tokenizer.json (empty: byte-level)", width="330px")
        self.w_column = path_control("column", "text column (auto)", width="200px")
        # any count: every count in one node, then whole nodes (the options follow GPUs per node)
        self.w_gpus = W.Dropdown(options=_gpu_counts(8), value=8, description="GPUs", style=st, layout=lay,
                                 tooltip="any count: up to one node, or whole nodes")
        self.w_per_node = W.Dropdown(options=_PER_NODE, value=8, description="GPUs per node", style=st, layout=lay)
        self.w_memory = W.BoundedFloatText(min=0.5, max=4096, step=1, description="GPU memory (GB)", style=st,
                                           layout=lay)
        self.w_fraction = W.FloatSlider(min=0.3, max=1.0, step=0.05, description="usable share", style=st,
                                        readout_format=".2f", continuous_update=False, layout=W.Layout(width="260px"))
        self.w_zero = W.Dropdown(options=[("ZeRO-0 (free)", 0), ("ZeRO-1 (free)", 1), ("ZeRO-2 (free)", 2),
                                          ("ZeRO-3 (lockstep)", 3)],
                                 description="model states", style=st, layout=lay,
                                 tooltip="ZeRO-3 shards everything (most memory for activations) but every pass "
                                         "all-gathers parameters, so all GPUs run the passes together; ZeRO 0-2 "
                                         "replicate parameters (less memory) and run barrier-free")
        self.w_max_len = W.Dropdown(description="max context", style=st, layout=lay)
        self.w_batch = W.BoundedIntText(min=1, max=10**10, step=65536, description="batch tokens", style=st, layout=lay)
        self.w_batch_index = W.BoundedIntText(min=0, max=10**6, description="batch #", style=st,
                                              layout=W.Layout(width="140px"))
        self.w_recompute = W.Checkbox(description="recompute activations", indent=False, layout=W.Layout(width="190px"))
        self.w_offload = W.Dropdown(options=list(OFFLOAD_CHOICES), description="offload", style=st,
                                    layout=W.Layout(width="170px"),
                                    tooltip="block inputs to host memory (and the MLP in token tiles), under "
                                            "recomputation: none; inputs (every group); auto (only the groups whose "
                                            "activations do not fit the GPU otherwise)")
        self.w_host = W.BoundedFloatText(min=0, max=10**6, step=64, description="host memory (GB/node)", style=st,
                                         layout=W.Layout(width="230px"),
                                         tooltip="host memory of one node, where offloaded activations live; "
                                                 "0: the profile's (unknown: no offload)")
        self.w_strategy = W.Dropdown(options=[s for s in STRATEGIES if s != "ring"], value=DEFAULT_STRATEGY,
                                     description="SP split", style=st, layout=lay)
        names = [n for n in planner_names() if n != "static:D"]
        self.w_planner = W.Dropdown(options=names, description="planner", style=st, layout=lay)
        # the planner's search, in reference seconds: counted in work done, so the plan is the same on
        # any machine (a busy one takes longer to find it)
        self.w_effort = W.FloatSlider(min=0.1, max=10.0, step=0.1, description="effort", style=st,
                                      readout_format=".1f", continuous_update=False, layout=W.Layout(width="260px"),
                                      tooltip="planner search per step, in reference seconds (about a second each on 2 cores)")
        self.w_compare = W.Checkbox(value=True, description="every planner side by side", indent=False,
                                    layout=W.Layout(width="210px"))
        self.w_degrees_auto = W.ToggleButton(value=True, description="auto",
                                             tooltip="the cluster's candidate degrees: every size up to a node, whole "
                                                     "nodes in twos and threes, the cluster (untick to choose)",
                                             layout=W.Layout(width="56px"))
        self.w_degrees = W.HBox(layout=W.Layout(flex_flow="row wrap"))
        self._degree_buttons: dict[int, W.ToggleButton] = {}
        # constraint notes shown beside the control they are about
        self.n_cluster = W.HTML()
        self.n_memory = W.HTML()
        self.n_data = W.HTML()
        self.n_degrees = W.HTML()
        self.n_planner = W.HTML()
        self.degrees_line = W.HTML()
        """The candidate degrees' divisibility chains (a plan's groups use one chain), and after a solve
        what the chosen planner found on each."""

        self.b_solve = W.Button(description="Solve now", icon="play", button_style="primary",
                                tooltip="plan the batch with the settings above")
        self.b_cancel = W.Button(description="Cancel", icon="stop", tooltip="stop the solve that is running")
        self.b_train = W.Button(description="Train with these settings", icon="rocket", button_style="success",
                                layout=W.Layout(display="none", width="230px"),
                                tooltip="send the data and planner settings to the Launch tab")
        self.progress = W.FloatProgress(min=0, max=1, value=0, layout=W.Layout(width="220px"))
        self.status = W.HTML(note_html("not solved yet"))
        self.data_line = W.HTML()

        self.w_show = W.Dropdown(description="timeline of", style=st, layout=W.Layout(width="240px"))
        self.fig_timeline = figure_widget()
        self.fig_planners = figure_widget()
        self.fig_work = figure_widget()
        self.table = W.HTML()
        self.w_group = W.Dropdown(description="group", style=st, layout=W.Layout(width="560px"))
        self.fig_memory = figure_widget()
        self.memory_line = W.HTML()
        self.host_line = W.HTML()
        self.w_run = W.Dropdown(description="finished run", style=st, layout=W.Layout(width="460px"))
        self.b_run_refresh = W.Button(icon="refresh", tooltip="list runs again", layout=W.Layout(width="40px"))
        self.fig_run_memory = figure_widget()
        self.run_memory_line = W.HTML()

        for w in (self.w_model, self.w_source, self.w_tokenizer, self.w_column, self.w_gpus, self.w_per_node,
                  self.w_memory, self.w_fraction, self.w_zero,
                  self.w_max_len, self.w_batch, self.w_batch_index, self.w_recompute, self.w_offload, self.w_host,
                  self.w_strategy, self.w_planner,
                  self.w_effort, self.w_compare, self.w_degrees_auto):
            w.observe(self._on_control, names="value")
        self.w_show.observe(self._on_show, names="value")
        self.w_group.observe(self._on_group, names="value")
        self.w_run.observe(self._on_run, names="value")
        self.b_solve.on_click(lambda _: self.request_solve(debounce=False))
        self.b_cancel.on_click(lambda _: self.cancel())
        self.b_train.on_click(lambda _: self.train())
        self.b_run_refresh.on_click(lambda _: self.refresh_runs())

        def cap(text: str) -> W.HTML:
            return W.HTML(f"<div style='color:#555;font-size:12.5px;max-width:980px;line-height:1.35'>{text}</div>")

        head = W.HTML("<b style='font-size:15px'>Solver</b> &nbsp; <span style='color:#555'>plan one training step: "
                      "which sequence-parallel (SP) groups to form and which sequences each runs</span>")
        controls = W.VBox([
            W.HBox([self.w_model, self.w_gpus, self.w_per_node, self.n_cluster], layout=W.Layout(flex_flow="row wrap")),
            W.HBox([self.w_memory, self.w_fraction, self.w_zero, self.w_recompute, self.w_offload, self.w_host,
                    self.n_memory], layout=W.Layout(flex_flow="row wrap")),
            W.HBox([self.w_source, self.w_tokenizer, self.w_column], layout=W.Layout(flex_flow="row wrap")),
            W.HBox([self.w_max_len, self.w_batch, self.w_batch_index, self.w_strategy, self.n_data],
                   layout=W.Layout(flex_flow="row wrap")),
            W.HBox([W.Label("candidate degrees", layout=W.Layout(width="130px")), self.w_degrees_auto, self.w_degrees,
                    self.n_degrees], layout=W.Layout(align_items="center", flex_flow="row wrap")),
            self.degrees_line,
            W.HBox([self.w_planner, self.w_effort, self.w_compare, self.n_planner], layout=W.Layout(flex_flow="row wrap")),
        ])
        actions = W.HBox([self.b_solve, self.b_cancel, self.progress, self.b_train],
                         layout=W.Layout(align_items="center", flex_flow="row wrap"))
        self.widget = W.VBox([
            head, controls, actions, self.status, self.data_line,
            W.HTML("<h4 style='margin:10px 0 2px'>The plan on a timeline</h4>"),
            cap("Each bar is one SP group: a block of consecutive GPUs (ranks, the rows) that runs its sequences "
                "together, coloured by its <b>degree</b> (how many GPUs share each sequence); its <b>split</b> u×c "
                "(label and hover) says how: Ulysses scatters the heads over u of them, context parallelism keeps "
                "the tokens and all-gathers K and V over c (the <i>SP split</i> control: auto picks each group's "
                "fastest). When the batch does "
                "not fit in memory at once it runs in several parts whose gradients add up, and how those line up "
                "depends on the <b>ZeRO stage</b>. Under <b>ZeRO-3</b> every forward and backward all-gathers the "
                "parameters over all GPUs, so the parts are <b>lockstep passes</b> (p0, p1, ..., shaded bands): "
                "every GPU runs every pass, a GPU done early waits for the pass to end (hatched), and a GPU may "
                "serve several groups in one pass. Under <b>ZeRO 0-2</b> parameters are replicated, so the parts "
                "are barrier-free <b>micro-steps</b> (m0, m1, ...): a group starts as soon as its own GPUs are "
                "free, and the grey block is the gradient reduction every GPU joins at the end. The dashed line "
                "is the <b>lower bound</b>: no plan can finish the step before it."),
            self.w_show, figure_box(self.fig_timeline),
            W.HTML("<h4 style='margin:10px 0 2px'>Every planner on the same batch</h4>"),
            cap("Predicted step time of each planner's plan for this batch. <i>static-max</i> is the fixed layout "
                "users of Megatron-CP/DeepSpeed-Ulysses configure for the max context; <i>best-static</i> the best "
                "fixed degree for this batch; the others mix degrees. The gap is how far a plan is above the lower "
                "bound (an upper bound on how far it is from optimal)."),
            figure_box(self.fig_planners), self.table,
            cap("The same step as GPU-time (GPUs x seconds): the compute is the same whatever the plan; what differs "
                "is the communication a sequence pays for being split over more GPUs than it needs, the fixed cost "
                "of every group in every micro-step, and GPUs idling while others finish."),
            figure_box(self.fig_work),
            W.HTML("<h4 style='margin:10px 0 2px'>Memory of one GPU</h4>"),
            cap("Per-GPU memory of a group in the plan, as the cost model counts it: model states (parameters, "
                "gradients and optimizer states, sharded by the ZeRO stage) plus the activations of the group's "
                "sequences, against the usable memory (dashed; the rest is kept for fragmentation and buffers) "
                "and the device (solid). The planner keeps every group's activations within usable - model states. "
                "A group that <b>offloads</b> keeps its block inputs in host memory between forward and backward, "
                "and one that <b>swaps</b> keeps whole blocks' activations there instead of recomputing them "
                "(its bar is what stays on the GPU); the table under the figure gives the host memory per GPU each "
                "such group fills, against the host budget (a node's host memory, less a reserve, over its GPUs)."),
            self.w_group, figure_box(self.fig_memory), self.memory_line, self.host_line,
            W.HBox([self.w_run, self.b_run_refresh]), self.run_memory_line, figure_box(self.fig_run_memory),
        ])

    def _figure_widgets(self) -> dict:
        return {"timeline": self.fig_timeline, "planners": self.fig_planners, "work": self.fig_work, "memory": self.fig_memory,
                "run_memory": self.fig_run_memory}

    # ------------------------------------------------------------------------------------------
    # scenario <-> controls
    # ------------------------------------------------------------------------------------------
    def _load_controls(self, sc: Scenario) -> None:
        """Show ``sc`` in the controls (without scheduling a solve)."""
        self._quiet += 1
        try:
            if sc.gpus_per_node not in self.w_per_node.options:
                self.w_per_node.options = sorted({*self.w_per_node.options, sc.gpus_per_node})
            self.w_gpus.options = _gpu_counts(sc.gpus_per_node, sc.num_gpus)
            self.w_model.value = sc.model
            self.w_source.value = sc.source
            self.w_tokenizer.value = sc.tokenizer or ""
            self.w_column.value = sc.column or ""
            self.w_gpus.value = sc.num_gpus
            self.w_per_node.value = sc.gpus_per_node
            self.w_memory.value = float(sc.gpu_memory_gb if sc.gpu_memory_gb is not None else self._profile_memory(sc))
            self.w_fraction.value = sc.resolved_memory_fraction()
            self.w_zero.value = sc.zero_stage
            self._set_max_len_options(sc)
            self.w_batch.value = int(sc.batch_tokens or 0) if sc.batch_tokens else self.w_batch.value or 1_000_000
            self.w_batch.disabled = sc.batch_tokens is None
            self.w_recompute.value = bool(sc.recompute)
            if sc.offload not in self.w_offload.options:
                self.w_offload.options = [*self.w_offload.options, sc.offload]
            self.w_offload.value = sc.offload
            self.w_host.value = float(sc.host_memory_gb if sc.host_memory_gb is not None else self._profile_host(sc))
            self.w_strategy.value = "cp" if sc.strategy == "ring" else sc.strategy  # ring is cp's older name
            if sc.planner not in self.w_planner.options:
                self.w_planner.options = [*self.w_planner.options, sc.planner]
            self.w_planner.value = sc.planner
            self.w_effort.value = float(min(10.0, max(0.1, sc.effort)))
            self._set_degree_buttons(sc.num_gpus, sc.gpus_per_node, sc.degrees)
        finally:
            self._quiet -= 1
        self._base = sc
        try:
            self._show_degrees(sc)
        except ValueError:  # a cluster that cannot be laid out: said beside its control when checked
            self.degrees_line.value = ""

    @staticmethod
    def _profile_memory(sc: Scenario) -> float:
        try:
            return float(sc.profile_spec().gpu_memory_gb)
        except ValueError:
            return 40.0

    @staticmethod
    def _profile_fraction(sc: Scenario) -> float:
        """The usable share of GPU memory ``sc``'s profile gives (its ``memory_fraction``, else 0.7)."""
        try:
            return sc.replace(memory_fraction=None).resolved_memory_fraction()
        except ValueError:
            return 0.7

    @staticmethod
    def _profile_host(sc: Scenario) -> float:
        """The profile's host memory per node (GB), 0 where it has none."""
        try:
            return float(sc.profile_spec().host_memory_gb or 0.0)
        except ValueError:
            return 0.0

    def _set_max_len_options(self, sc: Scenario) -> None:
        cap = sc.model_spec().max_context
        # 0 stands for "auto" (a Dropdown cannot hold None as a value: it means "nothing selected")
        opts = [("auto", 0)] + [(_ctx_label(n), n) for n in _pow2_upto(cap, 512)]
        if sc.max_len is not None and sc.max_len not in [v for _, v in opts]:
            opts.append((f"{sc.max_len:,}", sc.max_len))
        self.w_max_len.options = opts
        self.w_max_len.value = sc.max_len or 0

    def _set_degree_buttons(self, n: int, per: int, chosen: Sequence[int]) -> None:
        """One toggle per candidate degree of ``n`` GPUs in nodes of ``per`` (``candidate_degrees``, any
        integers) and per degree in ``chosen`` beyond them; ``chosen`` empty: auto (every candidate)."""
        from workbench.specs import candidate_degrees

        options = sorted(set(candidate_degrees(n, per)) | {int(d) for d in chosen if 1 <= int(d) <= n})
        buttons = []
        self._degree_buttons = {}
        for d in options:
            b = W.ToggleButton(value=(d in chosen) if chosen else True, description=str(d),
                               layout=W.Layout(width="48px"), disabled=not chosen)
            b.observe(self._on_control, names="value")
            self._degree_buttons[d] = b
            buttons.append(b)
        self.w_degrees.children = buttons
        self.w_degrees_auto.value = not chosen

    def _controls_scenario(self) -> Scenario:
        """The Scenario the controls describe; ValueError (marked beside its control) when invalid."""
        base = self._base
        prof_mem = self._profile_memory(base.replace(model=self.w_model.value.strip()))
        mem = float(self.w_memory.value)
        host = float(self.w_host.value)
        frac = float(self.w_fraction.value)
        fields: dict[str, Any] = dict(
            model=self.w_model.value.strip(), source=self.w_source.value.strip() or base.source,
            tokenizer=self.w_tokenizer.value.strip() or None, column=self.w_column.value.strip() or None,
            num_gpus=int(self.w_gpus.value), gpus_per_node=int(self.w_per_node.value),
            gpu_memory_gb=None if abs(mem - prof_mem) < 1e-9 else mem,
            # the profile's share (0.9 where its memory model was measured on the device) unless changed here, so
            # another profile brings its own
            memory_fraction=None if abs(frac - self._profile_fraction(base)) < 1e-9 else frac,
            zero_stage=int(self.w_zero.value), max_len=self.w_max_len.value or None, recompute=bool(self.w_recompute.value),
            offload=self.w_offload.value,
            host_memory_gb=None if host <= 0 or abs(host - self._profile_host(base)) < 1e-9 else host,
            strategy=self.w_strategy.value, planner=self.w_planner.value, effort=float(self.w_effort.value))
        if base.batch_tokens is not None or (base.batch_size is None and not self._is_list(base)):
            fields["batch_tokens"] = int(self.w_batch.value)
        if self.w_degrees_auto.value:
            fields["degrees"] = ()
        else:
            fields["degrees"] = tuple(d for d, b in self._degree_buttons.items() if b.value)
        return base.replace(**fields)

    @property
    def scenario(self) -> Scenario:
        """The Scenario the controls show (data fields from the scenario given or set)."""
        try:
            return self._controls_scenario()
        except ValueError:
            return self._base

    def set(self, **fields: Any) -> Scenario:
        """Set controls by Scenario field name (``num_gpus=16, planner="greedy"``; also
        ``batch_index`` and ``compare``) and return the new Scenario. With ``auto`` a solve is
        scheduled on the background thread (:meth:`solve` runs one at once). Raises ValueError for
        an unknown field or a value the Scenario rejects; a scenario that cannot be laid out (e.g.
        GPUs not a multiple of GPUs per node) is shown beside its control and in the status."""
        extra = {k: fields.pop(k) for k in ("batch_index", "compare") if k in fields}
        sc = self.scenario.replace(**fields) if fields else self.scenario
        self._load_controls(sc)
        self._quiet += 1
        try:
            if "batch_index" in extra:
                self.w_batch_index.value = int(extra["batch_index"])
            if "compare" in extra:
                self.w_compare.value = bool(extra["compare"])
        finally:
            self._quiet -= 1
        ok = self._check_controls()  # a broken constraint is shown beside its control, solve or not
        self._notify_scenario()
        if self.auto and ok is not None:
            self.request_solve()
        return sc

    def set_scenario(self, sc: Scenario, *, solve: bool | None = None) -> None:
        """Take ``sc`` whole (e.g. the data settings from the Lengths panel)."""
        if sc == self.scenario:
            return
        self._load_controls(sc)
        if self.auto if solve is None else solve:
            self.request_solve()

    def _on_control(self, change) -> None:
        if self._quiet:
            return
        owner = change["owner"]
        if owner is self.w_degrees_auto:
            for b in self._degree_buttons.values():
                b.disabled = bool(self.w_degrees_auto.value)
        if owner in (self.w_gpus, self.w_per_node):
            chosen = () if self.w_degrees_auto.value else tuple(d for d, b in self._degree_buttons.items() if b.value)
            self._quiet += 1
            try:
                if owner is self.w_per_node:  # the counts offered follow the node size; the count chosen stays
                    cur = int(self.w_gpus.value)
                    self.w_gpus.options = _gpu_counts(int(self.w_per_node.value), cur)
                    self.w_gpus.value = cur
                self._set_degree_buttons(int(self.w_gpus.value), int(self.w_per_node.value),
                                         [d for d in chosen if d <= int(self.w_gpus.value)])
            finally:
                self._quiet -= 1
        if owner is self.w_model:
            self._quiet += 1
            try:
                cur = self.w_max_len.value
                try:
                    self._set_max_len_options(self._base.replace(model=self.w_model.value.strip(), max_len=None))
                except ValueError:
                    pass  # a path that is not a supported config: said beside the control below
                if cur and cur in [v for _, v in self.w_max_len.options]:
                    self.w_max_len.value = cur
            finally:
                self._quiet -= 1
        if self._check_controls() is not None:
            self._notify_scenario()
            if self.auto:
                self.request_solve()

    _FIELD_NOTES = (("num_gpus", "cluster"), ("gpus_per_node", "cluster"), ("--gpus", "cluster"),
                    ("gpu_memory", "memory"), ("memory_fraction", "memory"), ("ZeRO", "memory"),
                    ("offload", "memory"), ("host_memory", "memory"), ("host memory", "memory"),
                    ("model states", "memory"), ("GB per GPU of parameters", "memory"), ("max_len", "data"),
                    ("max context", "data"), ("batch", "data"), ("tokens)", "data"), ("tokenizer", "data"),
                    ("column", "data"), ("config.json", "cluster"), ("unknown model", "cluster"), ("degree", "degrees"),
                    ("planner", "planner"), ("effort", "planner"), ("time_limit", "planner"))

    def _mark(self, msg: str | None) -> None:
        notes = {"cluster": self.n_cluster, "memory": self.n_memory, "data": self.n_data, "degrees": self.n_degrees,
                 "planner": self.n_planner}
        for n in notes.values():
            n.value = ""
        if not msg:
            return
        where = next((w for key, w in self._FIELD_NOTES if key in msg), "planner")
        short = re.sub(r"Scenario\.", "", msg)
        short = re.sub(r"(?:/[^/\s:,;]+)+(/[^/\s:,;]+/[^/\s:,;]+)", r"...\1", short)  # long paths: their last two parts
        notes[where].value = note_html(short if len(short) < 220 else short[:217] + "...", "error")

    def _check_controls(self) -> Scenario | None:
        try:
            sc = self._controls_scenario()
            sc.cost()
        except ValueError as e:
            self.error = one_line(e)
            self._mark(str(e).splitlines()[0])
            self.status.value = note_html(f"cannot plan: {str(e).splitlines()[0]}", "error")
            return None
        self._mark(None)
        self._show_degrees(sc)
        return sc

    def _show_degrees(self, sc: Scenario, plan=None) -> None:
        """The candidate degrees and their divisibility chains under the degree toggles; with ``plan``
        also the chains its planner searched, each with the step of its plan as it runs, and those it
        left out (``stats["chains"]``)."""
        cl = sc.cluster()
        chains = cl.chains
        text = (f"candidates {', '.join(map(str, cl.degrees))}: "
                + (f"{len(chains)} divisibility chains (a plan's groups come from one of them, " if len(chains) > 1
                   else "one divisibility chain (")
                + "a group of degree d on ranks [k·d, (k+1)·d)): " + " | ".join(_chain(c) for c in chains))
        tried = (plan.stats.get("chains") if plan is not None else None) or []
        if tried:
            def step(c: dict) -> float:  # the chain's plan as it runs (with swapped blocks), where recorded
                return c["swapped_ms"] if c.get("swapped_ms") is not None else c["makespan_ms"]

            done = [c for c in tried if c.get("makespan_ms") is not None]
            skip = [c for c in tried if c.get("makespan_ms") is None]
            text += (f". {plan.planner} planned " + ", ".join(f"{_chain(c['degrees'])} ({step(c) / 1e3:.3f}s)" for c in done)
                     + ("; not searched (a bound too close to the best plan's, or two chains beyond the first already): "
                        + ", ".join(_chain(c["degrees"]) for c in skip) if skip else ""))
        self.degrees_line.value = f"<div style='color:#555;font-size:12px;max-width:980px'>{html.escape(text)}</div>"

    # ------------------------------------------------------------------------------------------
    # solving
    # ------------------------------------------------------------------------------------------
    def _batch(self, sc: Scenario):
        return sc.batches(1, start=int(self.w_batch_index.value))[0]

    def _job(self, sc: Scenario, planners: list[str], generation: int, passes: bool = True, *, cancel) -> SolveResult:
        t0 = time.perf_counter()
        # the user's text is tokenised once (into the token cache) before its lengths are planned
        sc.token_cache(progress=lambda f, m: self._progress(0.0, f"{m} ({100 * f:.0f}%)"), say=self._note)
        batch = self._batch(sc)
        plans, errors = {}, {}
        order = [sc.planner] + [p for p in planners if p != sc.planner]
        for k, name in enumerate(order):
            if cancel.is_set():
                from workbench.solve import Cancelled

                raise Cancelled("superseded by a newer request")
            self._progress(k / len(order), f"{name}: planning {len(batch.lengths):,} sequences")

            def prog(frac: float, msg: str, k=k) -> None:
                self._progress((k + frac) / len(order), msg)

            try:
                plans[name] = sc.plan(batch, planner=name, progress=prog, cancel=cancel)
            except ValueError as e:
                errors[name] = one_line(e).split(": ", 1)[-1]
            if k == 0 and name in plans and not cancel.is_set() and generation == self._worker.generation:
                # the chosen plan first, so the timeline appears while the others are solved
                self._draw_timeline(plans[name].to_dict())
        bound = None
        if plans and not cancel.is_set():
            from workbench.solve.bound import step_bound_ms

            self._progress(1.0 - 1e-6, "packing bound: how fast any plan of whole groups could be")
            bound = step_bound_ms(batch.lengths, sc.cost(), plans.values(), passes=passes)
        res = SolveResult(plans, errors, sc, batch, time.perf_counter() - t0, generation, bound)
        res.pass_bound_pending = bool(plans) and not passes and sc.cost().execution == "lockstep"
        return res

    def _bound_job(self, res: SolveResult, *, cancel) -> tuple:
        from workbench.solve import Cancelled
        from workbench.solve.bound import step_bound_ms

        def check() -> None:
            if cancel.is_set():
                raise Cancelled("superseded by a newer request")

        return res, step_bound_ms(res.batch.lengths, res.scenario.cost(), res.values(), cancel=check)

    def _apply_bound(self, out: tuple) -> None:
        res, bound = out
        with self._lock:
            if self.result is not res:
                return
            res.packing_bound_ms = max(res.packing_bound_ms or 0.0, float(bound))
            res.pass_bound_pending = False
            self._status_line(res)
            self._draw_planners()

    def _fail_bound(self, e: BaseException) -> None:
        from workbench.solve import Cancelled

        if not isinstance(e, Cancelled):
            self.status.value = note_html(f"the lockstep pass bound failed: {one_line(e)}", "warn")

    def _note(self, msg: str) -> None:
        self.status.value = note_html(msg, "warn")

    def _progress(self, frac: float, msg: str) -> None:
        now = time.monotonic()
        if now - self._last_progress < 0.1 and frac < 1.0:
            return
        self._last_progress = now
        self.progress.value = max(0.0, min(1.0, frac))
        self.status.value = note_html(msg, "busy")

    def _planners_for(self, sc: Scenario) -> list[str]:
        return list(self.planners) if self.w_compare.value else [sc.planner]

    def request_solve(self, debounce: bool = True) -> int | None:
        """Schedule a solve on the background thread (debounced; supersedes an older one). Returns
        the request's generation, or None when the controls do not describe a valid scenario."""
        sc = self._check_controls()
        if sc is None:
            return None
        old = self._worker.debounce
        if not debounce:
            self._worker.debounce = 0.0
        try:
            gen = self._worker.generation + 1
            self.status.value = note_html(f"solving (request #{gen})...", "busy")
            self._bounds.cancel()
            return self._worker.submit(sc, self._planners_for(sc), gen, False)
        finally:
            self._worker.debounce = old

    def cancel(self) -> None:
        """Cancel the solve that is running or pending (the plans shown stay)."""
        self._worker.cancel()
        self._bounds.cancel()
        self.status.value = note_html("cancelled", "warn")
        self.progress.value = 0

    def wait_idle(self, timeout: float = 60.0, *, bound: bool = False) -> bool:
        """Wait until no solve is pending or running (with ``bound``, also until the lockstep pass
        bound of the plans shown is in); False on timeout."""
        end = time.monotonic() + timeout
        if not self._worker.wait_idle(timeout):
            return False
        return self._bounds.wait_idle(max(0.0, end - time.monotonic())) if bound else True

    @property
    def busy(self) -> bool:
        return self._worker.busy()

    def solve(self, planners: Sequence[str] | None = None, *, pass_bound: bool = True) -> SolveResult:
        """Plan the batch now, on the calling thread, with the chosen planner and (when
        comparing) every other, draw the plans and return them (planner -> Plan; ``errors`` holds
        the planners that could not plan). Cancels a background solve first. Raises ValueError
        when the controls do not describe a valid scenario.

        ``pass_bound=False`` leaves the lockstep pass bound out of a lockstep step's packing bound
        (``packing_bound_ms`` is then the quick bound a click's solve shows first): for plans in a
        hurry, as that bound takes seconds on a big batch (a free step's bound is the same either
        way)."""
        self._worker.cancel()
        self._bounds.cancel()
        self._worker.wait_idle(120)
        sc = self._controls_scenario()
        sc.cost()
        names = list(planners) if planners is not None else self._planners_for(sc)
        res = self._job(sc, names, self._worker.generation, bool(pass_bound), cancel=threading.Event())
        res.pass_bound_pending = False  # computed above, or left out as asked: none comes later
        self._apply(res)
        return res

    def _fail(self, e: BaseException) -> None:
        from workbench.solve import Cancelled

        if isinstance(e, Cancelled):
            return
        self.error = one_line(e)
        self._mark(str(e).splitlines()[0] if str(e) else type(e).__name__)
        self.status.value = note_html(f"could not plan: {one_line(e)}", "error")
        self.progress.value = 0

    def _apply(self, res: SolveResult) -> None:
        with self._lock:
            self.result = res
            self.error = None
            self.solves += 1
            sc = res.scenario
            chosen = sc.planner if sc.planner in res else next(iter(res), None)
            self._quiet += 1
            try:
                self.w_show.options = list(res)
                if chosen is not None:
                    self.w_show.value = chosen
            finally:
                self._quiet -= 1
            self.progress.value = 1.0
            s = res.batch.lengths
            ls = sc.lengths_set()
            rep = ls.policy_report
            cost = sc.cost()
            loss = (f"; the chunked loss {cost.loss_working_gb:.2f} GB under recomputation" if cost.loss_working_gb
                    else f"; the whole logits' backward {cost.loss_bytes_per_token / 1e6:.2f} MB a token with the "
                         f"activations" if cost.loss_bytes_per_token else "")
            self.data_line.value = (
                f"<span style='color:#555'>batch #{int(self.w_batch_index.value)} of <b>{sc.source}</b>: "
                f"{len(s):,} sequences, {int(sum(s)):,} tokens, longest {int(max(s)):,}; "
                f"{rep.describe() if rep is not None else 'no max context applied'}. "
                f"Activation budget {cost.memory_budget_gb:.2f} GB per GPU (model states "
                f"{cost.model_states_gb:.2f} GB under ZeRO-{sc.zero_stage}, "
                f"{'lockstep passes' if cost.execution == 'lockstep' else 'barrier-free micro-steps'}{loss}). "
                f"{self._offload_text(cost)}</span>")
            if chosen is None:
                self.status.value = note_html("no planner could plan this batch: " +
                                              "; ".join(f"{k}: {v}" for k, v in res.errors.items()), "error")
                self._mark(next(iter(res.errors.values()), None))
                return
            self._mark(None)
            self._status_line(res)
            self._show_degrees(sc, res[chosen])
            self._draw_all()
            if res.pass_bound_pending:
                self._bounds.submit(res)

    @staticmethod
    def _offload_text(cost) -> str:
        if cost.can_offload:
            return (f"Offload {cost.offload}: block inputs to host memory, {cost.host_budget_gb:,.1f} GB per GPU "
                    f"({cost.host_memory_gb:,.0f} GB per node), host link {cost.host_link_gbps:.3g} GB/s per GPU.")
        return f"No offload: {cost.offload_note}." if cost.offload_note else ""

    def _status_line(self, res: SolveResult) -> None:
        sc = res.scenario
        chosen = sc.planner if sc.planner in res else next(iter(res))
        p = res[chosen]
        pb = res.packing_bound_ms
        packing = (f", packing bound {pb / 1e3:.3f}s (gap {100 * (p.makespan_ms / pb - 1):.1f}%)"
                   if pb and pb > p.lower_bound_ms * (1 + 1e-9) else "")
        if res.pass_bound_pending:
            packing += ", the lockstep pass bound on its way"
        self.status.value = note_html(
            f"plan #{self.solves}: {chosen} {p.makespan_ms / 1e3:.3f}s per step, lower bound "
            f"{p.lower_bound_ms / 1e3:.3f}s (gap {100 * p.gap:.1f}%){packing}, {idle_text(p)}, {len(p.micro_steps)} "
            f"{'lockstep pass(es) (ZeRO-3)' if p.execution == 'lockstep' else 'micro-step(s), barrier-free'}, "
            f"{len(res)} planner(s) in {res.seconds:.1f}s", "ok")

    def _draw_timeline(self, plan: dict) -> None:
        from workbench.report.plans import timeline_figure

        fig = timeline_figure(plan)
        with self._lock:  # the worker thread and the kernel's thread both draw: one at a time
            set_figure(self.fig_timeline, fig)

    def _draw_all(self) -> None:
        from workbench.report.plans import work_figure

        res = self.result
        if res is None or not res:
            return
        self._draw_timeline(res[self.w_show.value].to_dict())
        self._draw_planners()
        set_figure(self.fig_work, work_figure({k: v.to_dict() for k, v in res.items()}, res.scenario.cost()))
        self._draw_memory(reset_group=True)

    def _draw_planners(self) -> None:
        """The planners figure and table (they carry the step bound)."""
        from workbench.report.plans import planner_rows, planners_figure

        res = self.result
        dicts = {k: v.to_dict() for k, v in res.items()}
        set_figure(self.fig_planners, planners_figure(dicts, title=f"Every planner on batch #{int(self.w_batch_index.value)}",
                                                      packing_bound_ms=res.packing_bound_ms))
        rows = planner_rows(dicts, res.packing_bound_ms)
        for r in rows:
            r["_style"] = "font-weight:600" if r["planner"] == self.w_show.value else ""
        err_rows = [{"planner": k, "status": f"cannot plan: {v}"} for k, v in res.errors.items()]
        self.table.value = html_table(rows + err_rows, [
            ("planner", "planner", None), ("makespan_ms", "step (s)", lambda v: f"{v / 1e3:.3f}"),
            ("gap", "over LB", lambda v: f"{100 * v:.1f}%"),
            ("packing_gap", "over packing bound", lambda v: f"{100 * v:.1f}%"),
            ("idle_share", "idle GPU-time", lambda v: f"{100 * v:.1f}%"), ("idle_gpus", "GPUs in no group", "d"),
            ("micro_steps", "passes" if res.scenario.zero_stage == 3 else "micro-steps", "d"),
            ("groups", "groups", "d"), ("degrees", "degrees", lambda v: ",".join(map(str, v))),
            ("splits", "splits (u x cp)", lambda v: ", ".join(v)),
            ("imbalance", "imbalance", ".3f"), ("solve_seconds", "solve (s)", ".2f"), ("status", "status", None)])

    def _on_show(self, change) -> None:
        if self._quiet or self.result is None or change["new"] not in self.result:
            return
        with self._lock:
            self._draw_timeline(self.result[change["new"]].to_dict())
            self._draw_memory(reset_group=True)

    def show_planner(self, name: str) -> None:
        """Draw ``name``'s plan on the timeline and in the memory breakdown. Raises KeyError
        when the last solve has no plan of that name."""
        if self.result is None or name not in self.result:
            raise KeyError(f"no plan of {name!r}; planned: {list(self.result or {})}")
        self.w_show.value = name

    # ------------------------------------------------------------------------------------------
    # memory
    # ------------------------------------------------------------------------------------------
    def _groups(self) -> list[dict]:
        from workbench.report.memory import plan_memory

        if self.result is None or self.w_show.value not in self.result:
            return []
        plan = self.result[self.w_show.value].to_dict()
        rows = plan_memory(plan, self.result.scenario.cost())
        for r in rows:  # the host memory the planner recorded (and checked against the host budget)
            g = plan["micro_steps"][r["micro_step"]]["groups"][r["index"]]
            r["plan_host_gb"] = float(g.get("host_gb") or 0.0)
        return rows

    def _draw_memory(self, reset_group: bool = False) -> None:
        rows = self._groups()
        if not rows:
            return
        if reset_group or self._chosen_group is None:
            top = max(rows, key=lambda r: r["activations_gb"])
            self._chosen_group = (top["micro_step"], top["index"])
        self._quiet += 1
        try:
            self.w_group.options = [(f"m{r['micro_step']} · degree {r['degree']}"
                                     + (f" ({r['degree'] // r['cp']}x{r['cp']})" if (r.get("cp") or 1) > 1 else "")
                                     + f" · ranks {r['ranks'][0]}-{r['ranks'][1]} · "
                                     f"{r['sequences']} seq · {r['activations_gb']:.2f} GB activations",
                                     (r["micro_step"], r["index"])) for r in rows]
            self.w_group.value = self._chosen_group
        finally:
            self._quiet -= 1
        self._draw_memory_figure()

    def _draw_memory_figure(self) -> None:
        from workbench.report.memory import memory_breakdown_figure

        rows = self._groups()
        chosen = next((r for r in rows if (r["micro_step"], r["index"]) == self._chosen_group), None)
        if chosen is None:
            return
        shown = [dict(chosen, label=f"chosen: {chosen['label']}")]
        for d in sorted({r["degree"] for r in rows}, reverse=True):
            top = max((r for r in rows if r["degree"] == d), key=lambda r: r["activations_gb"])
            if top is not chosen:
                shown.append(dict(top, label=f"fullest degree-{d} group: m{top['micro_step']}, ranks "
                                             f"{top['ranks'][0]}-{top['ranks'][1]}"))
        set_figure(self.fig_memory, memory_breakdown_figure(shown, title=f"{self.w_show.value}: memory per GPU",
                                                            highlight=0))
        c = chosen
        working = (f", working set {c['working_gb']:.2f} ({c['working_label']})" if c.get("working_gb") else "")
        self.memory_line.value = (
            f"<span style='font-size:13px'>Chosen group: <b>{c['total_gb']:.2f} GB</b> of {c['usable_gb']:.1f} GB usable "
            f"({c['gpu_memory_gb']:.0f} GB x {c['usable_gb'] / c['gpu_memory_gb']:.2f}): parameters {c['parameters_gb']:.2f}, "
            f"gradients {c['gradients_gb']:.2f}, optimizer states {c['optimizer_gb']:.2f} (ZeRO-{c['zero_stage']} over "
            f"{c['num_gpus']} GPUs){working}, activations {c['activations_gb']:.2f} GB for {c['sequences']} sequence(s) "
            f"/ {c['tokens']:,} tokens split over {c['degree']} GPU(s); headroom {c['headroom_gb']:.2f} GB."
            + (f" Offloaded ({c['offload']}, {c.get('swap_layers', 0)} blocks swapped): host memory per GPU "
               f"<b>{c['plan_host_gb']:.2f} GB</b> of {self.result.scenario.cost().host_budget_gb:.2f} GB budget."
               if c.get("offload", "none") != "none" or c.get("swap_layers") else "")
            + "</span>")
        self._draw_host(rows, c)

    def _draw_host(self, rows: list[dict], chosen: dict) -> None:
        """The host memory of the plan's offloading groups, beside their GPU memory (a small table), or
        a line saying why none offloads."""
        h = self.host_memory(rows, chosen)
        if not h["groups"]:
            why = (f"offload is possible ({h['offload']}), but every group's activations fit the GPU without it "
                   f"and no group gains by swapping blocks"
                   if h["can_offload"] else h["note"] or "no offload")
            self.host_line.value = f"<span style='font-size:13px;color:#555'>No group of this plan offloads: {why}.</span>"
            return
        table = html_table([dict(g, _style="font-weight:600" if g["chosen"] else "") for g in h["groups"]], [
            ("group", "offloading group", None), ("offload", "block inputs", None),
            ("swap_layers", "blocks swapped", "d"), ("sequences", "seq", "d"), ("tokens", "tokens", ","),
            ("gpu_gb", "GPU memory (GB)", ".2f"), ("host_gb", "host memory per GPU (GB)", ".2f"),
            ("budget_share", "of the host budget", lambda v: f"{100 * v:.0f}%")])
        head = (f"<div style='font-size:13px'>Host memory per GPU: {h['chosen_host_gb']:.2f} GB of "
                f"{h['host_budget_gb']:.2f} GB budget (chosen group)" if h["chosen_host_gb"] is not None else
                f"<div style='font-size:13px'>Host budget {h['host_budget_gb']:.2f} GB per GPU")
        head += (f"; the budget: {h['host_memory_gb']:,.0f} GB host memory per node, less a reserve, over its GPUs; "
                 f"host link {h['host_link_gbps']:.3g} GB/s per GPU</div>")
        self.host_line.value = head + table

    def host_memory(self, rows: list[dict] | None = None, chosen: dict | None = None) -> dict:
        """Host memory of the plan shown: ``{"offload"`` (the scenario's choice), ``"can_offload"``,
        ``"note"`` (why not, when not), ``"host_budget_gb"`` (per GPU), ``"host_memory_gb"`` (per node),
        ``"host_link_gbps"`` (per GPU while the node copies), ``"groups"``: every offloading group
        ``{micro_step, index, group, degree, ranks, offload, sequences, tokens, gpu_gb (its GPU total),
        host_gb (the plan's), budget_share, chosen}``, ``"chosen_host_gb"`` (the chosen group's, None
        when it does not offload)}``; before a solve the groups are empty."""
        rows = self._groups() if rows is None else rows
        chosen = self.memory() if chosen is None else chosen
        sc = self.result.scenario if self.result is not None else self.scenario
        cost = sc.cost()
        budget = float(cost.host_budget_gb or 0.0)
        groups = []
        for r in rows:
            if r.get("offload", "none") == "none" and not r.get("swap_layers"):
                continue
            is_chosen = chosen is not None and (r["micro_step"], r["index"]) == (chosen["micro_step"], chosen["index"])
            groups.append({"micro_step": r["micro_step"], "index": r["index"], "degree": r["degree"],
                           "group": f"m{r['micro_step']} · degree {r['degree']} · ranks {r['ranks'][0]}-{r['ranks'][1]}",
                           "ranks": r["ranks"], "offload": r["offload"], "swap_layers": r.get("swap_layers", 0),
                           "sequences": r["sequences"],
                           "tokens": r["tokens"], "gpu_gb": r["total_gb"], "host_gb": r["plan_host_gb"],
                           "budget_share": r["plan_host_gb"] / budget if budget else None, "chosen": is_chosen})
        pick = next((g for g in groups if g["chosen"]), None)
        return {"offload": sc.offload, "can_offload": cost.can_offload, "note": cost.offload_note,
                "host_budget_gb": budget, "host_memory_gb": cost.host_memory_gb, "host_link_gbps": cost.host_link_gbps,
                "groups": groups, "chosen_host_gb": pick["host_gb"] if pick else None}

    def _on_group(self, change) -> None:
        if self._quiet or change["new"] is None:
            return
        with self._lock:
            self._chosen_group = tuple(change["new"])
            self._draw_memory_figure()

    def select_group(self, micro_step: int, index: int) -> dict:
        """Choose the group shown in the memory breakdown (its micro-step and index in it);
        returns its breakdown. Raises KeyError when the plan shown has no such group."""
        for r in self._groups():
            if (r["micro_step"], r["index"]) == (micro_step, index):
                self._chosen_group = (micro_step, index)
                self._quiet += 1
                try:
                    self.w_group.value = self._chosen_group
                finally:
                    self._quiet -= 1
                self._draw_memory_figure()
                return r
        raise KeyError(f"the plan shown has no group {index} in micro-step {micro_step}")

    def memory(self) -> dict | None:
        """The per-GPU memory breakdown of the chosen group (``workbench.report.memory``), or None
        before a solve."""
        return next((r for r in self._groups() if (r["micro_step"], r["index"]) == self._chosen_group), None)

    # ------------------------------------------------------------------------------------------
    # a finished run: predicted against measured model states (and CUDA peaks)
    # ------------------------------------------------------------------------------------------
    def refresh_runs(self) -> None:
        """List the finished training runs of the store in the run picker."""
        from workbench import runs

        items = [("(pick a finished training run)", "")]
        for r in reversed(runs.list_runs(self.root, kind="train")):
            st = r.status()
            if st.final and st.step > 0:
                items.append((f"{r.id} · {st.state} · {st.step} steps", str(r.path)))
        self._quiet += 1
        try:
            cur = self.w_run.value
            self.w_run.options = items
            self.w_run.value = cur if cur in [v for _, v in items] else ""
        finally:
            self._quiet -= 1

    def _on_run(self, change) -> None:
        if self._quiet or not change["new"]:
            return
        try:
            self.compare_run(change["new"])
        except ValueError as e:
            self.run_memory_line.value = note_html(one_line(e), "error")

    def compare_run(self, run) -> dict:
        """Predicted against measured memory per rank for a training run. The model states
        (parameters, gradients at their peak, optimizer states) the memory model predicts for each
        rank under the run's stage, precision and optimizer, against those the run counted from
        tensor storage (``model_states`` in metrics.jsonl); on CUDA also the predicted peak (model
        states, working set and the largest activations of the last step's plan) against the
        allocator's peak. Returns ``{"run", "predicted_gb", "measured_gb", "note", "peak_predicted_gb",
        "peak_measured_gb"}`` and draws it. Raises ValueError when the run has no plans or no measured
        model states (a run of an older workbench)."""
        from workbench import runs
        from workbench.report.memory import (measured_cuda_peak, measured_model_states, memory_compare_figure,
                                             predicted_model_states, rank_memory)

        r = runs.load_run(run, root=self.root)
        plans = r.plans()
        if not plans:
            raise ValueError(f"run {r.id} has no plans yet")
        spec = r.spec()
        sc = Scenario.from_dict(spec["scenario"], stored=True)
        cost = sc.cost()
        metrics = r.metrics()
        predicted = predicted_model_states(cost)
        measured = measured_model_states(metrics)
        if not measured:
            raise ValueError(f"run {r.id} reported no model-state bytes (trained by an older workbench?)")
        peak_pred = rank_memory(plans[-1]["plan"], cost)
        peak_meas = measured_cuda_peak(metrics)
        st = cost.states
        note = (f"ZeRO-{st.zero_stage}, {st.precision}, {st.optimizer}: parameters, gradients at their peak and "
                f"optimizer states, measured from tensor storage")
        if st.execution == "free":
            note += " (free execution holds whole gradients until the step's reduce)"
        extra = []
        if peak_meas:
            note += "; peaks: the plan's model states + working set + activations vs CUDA max_memory_allocated"
            extra = [("peak, predicted", peak_pred), ("peak, measured (CUDA)", peak_meas)]
        set_figure(self.fig_run_memory, memory_compare_figure(predicted, measured, note=note, extra=extra,
                                                              title=f"Run {r.id}: model states per rank"))
        worst = max(abs(measured[k] - predicted[k]) / predicted[k] for k in measured if k < len(predicted))
        self.run_memory_line.value = note_html(
            f"{r.id}: model states predicted {max(predicted) * 1e3:.2f} MB, measured up to "
            f"{max(measured.values()) * 1e3:.2f} MB per rank (worst difference {100 * worst:.1f}%)", "info")
        return {"run": r.id, "predicted_gb": predicted, "measured_gb": measured, "note": note,
                "peak_predicted_gb": peak_pred, "peak_measured_gb": peak_meas}

    # ------------------------------------------------------------------------------------------
    # tables, hand-on
    # ------------------------------------------------------------------------------------------
    def planner_table(self) -> list[dict]:
        """One row per planner of the last solve (``workbench.report.plans.planner_rows``) plus
        the planners that could not plan (with ``error``)."""
        from workbench.report.plans import planner_rows

        if self.result is None:
            return []
        rows = planner_rows({k: v.to_dict() for k, v in self.result.items()}, self.result.packing_bound_ms)
        return rows + [{"planner": k, "error": v} for k, v in self.result.errors.items()]

    def tables(self) -> dict:
        if self.result is None:
            return {}
        out = {"planners": self.planner_table(), "scenario": self.result.scenario.to_dict(),
               "plans": {k: v.to_dict() for k, v in self.result.items()}}
        mem = self.memory()
        if mem is not None:
            out["memory"] = mem
            out["host_memory"] = self.host_memory()
        return out

    def on_train(self, callback: Callable[[Scenario], None]) -> None:
        """Show the "Train with these settings" button; a click calls ``callback(scenario)``."""
        self._train_callbacks.append(callback)
        self.b_train.layout.display = ""

    def train(self) -> Scenario:
        """Hand the current scenario to every ``on_train`` callback (what the button does)."""
        sc = self.scenario
        for cb in list(self._train_callbacks):
            cb(sc)
        return sc
