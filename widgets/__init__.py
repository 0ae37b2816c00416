"""JupyterLab panels of the workbench (ipywidgets 8 + plotly FigureWidget).

Each panel is a plain class holding ``.widget`` with a Python API a notebook can call headless
(under papermill no widget callback runs, so everything a button does is a method). Panels are
thin: they call ``workbench`` (Scenario, runs, launch, report) and draw ``workbench.report``
figures. ``workbench`` never imports this package.

=================  ===========================================================================
``HardwarePanel``  pick, inspect, save or measure the hardware profile of the cost model
``LengthsPanel``   a length distribution: log histogram, CDF, token and attention shares,
                   what the max context cuts, the imbalance of a static layout
``SolverPanel``    plan one step for a cluster: timeline, every planner, per-GPU memory
``LaunchPanel``    start a real torchrun training run, follow it live, stop it, reattach
``RunsPanel``      compare runs: measured vs predicted, speedups, loss curves
``Workbench``      all five as tabs, handing settings on
=================  ===========================================================================
"""

from widgets.hardware import HardwarePanel
from widgets.launch import LaunchPanel
from widgets.lengths import LengthsPanel
from widgets.runs import RunsPanel
from widgets.solver import SolverPanel
from widgets.workbench import Workbench

__all__ = ["HardwarePanel", "LaunchPanel", "LengthsPanel", "RunsPanel", "SolverPanel", "Workbench"]
