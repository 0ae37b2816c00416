"""Workbench: the five panels as tabs, handing settings on to each other.

- The Hardware panel's profile goes to the Lengths and Solver panels' scenario.
- The Lengths panel's data settings (source, samples, seed, max context, policy, batch) go to the
  Solver; the Solver's cluster (GPUs, degrees, model, memory) goes back to the Lengths panel (its
  static-layout imbalance uses it).
- "Train with these settings" on the Solver tab sends that scenario to the Launch panel and
  switches to it; a run that ends in the Launch panel opens in the Runs panel.
"""

from __future__ import annotations

import ipywidgets as W

from widgets._base import Panel
from widgets.hardware import HardwarePanel
from widgets.launch import LaunchPanel
from widgets.lengths import LengthsPanel
from widgets.runs import RunsPanel
from widgets.solver import SolverPanel
from workbench.scenario import Scenario

__all__ = ["Workbench", "DATA_FIELDS", "CLUSTER_FIELDS"]

DATA_FIELDS = ("source", "samples", "seed", "column", "tokenizer", "max_len", "policy", "batch_tokens", "batch_size")
"""Scenario fields the Lengths panel owns."""
CLUSTER_FIELDS = ("model", "profile", "num_gpus", "gpus_per_node", "gpu_memory_gb", "memory_fraction", "zero_stage",
                  "degrees", "strategy", "recompute")
"""Scenario fields the Solver (and Hardware) panels own."""


class Workbench(Panel):
    """All five panels in one tabbed widget: ``.hardware``, ``.lengths``, ``.solver``,
    ``.launch``, ``.runs``; :attr:`scenario` is the planning scenario they share;
    :meth:`train_with_settings` is what the Solver tab's button does."""

    title = "Workbench"
    TABS = ("hardware", "lengths", "solver", "launch", "runs")

    def __init__(self, scenario: Scenario | None = None, *, root=None, auto: bool = True, tab: str = "solver") -> None:
        sc = scenario or Scenario(batch_tokens=1_000_000, samples=100_000)
        self.root = root
        self.hardware = HardwarePanel(sc.profile, root=root)
        self.lengths = LengthsPanel(sc, auto=auto)
        self.solver = SolverPanel(sc, auto=auto, root=root)
        self.launch = LaunchPanel(root=root)
        self.runs = RunsPanel(root=root)
        self.header = W.HTML()
        self.tabs = W.Tab(children=[getattr(self, t).widget for t in self.TABS],
                          titles=[getattr(self, t).title for t in self.TABS])
        self.tabs.selected_index = self.TABS.index(tab)
        self.widget = W.VBox([self.header, self.tabs])
        self.hardware.on_profile(self._profile_changed)
        self.lengths.on_scenario(self._data_changed)
        self.solver.on_scenario(self._cluster_changed)
        self.solver.on_train(lambda s: self.train_with_settings())
        self.launch.on_finished(self._run_finished)
        self._show_header()

    # ---- hand-offs -------------------------------------------------------------------------------
    @property
    def scenario(self) -> Scenario:
        """The planning scenario: the Solver's cluster and planner with the Lengths panel's data."""
        data = self.lengths.scenario
        return self.solver.scenario.replace(**{k: getattr(data, k) for k in DATA_FIELDS})

    def _show_header(self) -> None:
        try:
            text = self.scenario.describe()
        except ValueError as e:
            text = str(e).splitlines()[0]
        self.header.value = f"<div style='font-size:13px;color:#333;margin-bottom:4px'><b>Scenario:</b> {text}</div>"

    def _profile_changed(self, ref: str) -> None:
        if self.solver.scenario.profile != ref:
            self.solver.set_scenario(self.solver.scenario.replace(profile=ref))
        if self.lengths.scenario.profile != ref:
            self.lengths.set_scenario(self.lengths.scenario.replace(profile=ref))
        self._show_header()

    def _data_changed(self, data: Scenario) -> None:
        sc = self.solver.scenario.replace(**{k: getattr(data, k) for k in DATA_FIELDS})
        self.solver.set_scenario(sc)
        self._show_header()

    def _cluster_changed(self, cluster: Scenario) -> None:
        sc = self.lengths.scenario.replace(**{k: getattr(cluster, k) for k in CLUSTER_FIELDS})
        self.lengths.set_scenario(sc)
        self._show_header()

    def train_with_settings(self) -> dict:
        """Send the planning scenario (data from Lengths, planner from Solver) to the Launch panel
        and show its tab. Returns what it took and kept (``LaunchPanel.use_scenario``)."""
        out = self.launch.use_scenario(self.scenario)
        self.tabs.selected_index = self.TABS.index("launch")
        return out

    def _run_finished(self, run) -> None:
        self.runs.open(run)
        self.solver.refresh_runs()

    def show(self, tab: str) -> None:
        """Select a tab by name (hardware, lengths, solver, launch, runs)."""
        self.tabs.selected_index = self.TABS.index(tab)
