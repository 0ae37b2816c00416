"""Two sections the Hardware and Launch panels hold: the doctor's report, and the cluster script.

- :class:`DoctorSection` (Hardware panel): ``workbench doctor --json`` run as a process of its own (the
  kernel never imports torch or initialises CUDA), its lines shown as a table: ok / warn / fail with
  the fix, skip with the reason.
- :class:`ClusterSection` (Launch panel): the Slurm batch script (or the per-node torchrun commands)
  that runs the panel's training run on N nodes, shown and saved (``workbench.launch.cluster``,
  what ``workbench train ... --emit`` prints).

Threads set widget values only; everything a button does is a method.
"""

from __future__ import annotations

import html
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import ipywidgets as W

from widgets._base import note_html, one_line

__all__ = ["DoctorSection", "ClusterSection"]

_COLOR = {"ok": "#2E7D32", "warn": "#B26A00", "fail": "#C62828", "skip": "#777"}


class DoctorSection:
    """What this machine can do (``workbench doctor``), run on demand as a process.

    Python API: :meth:`run` (``quick``: leave out the 2-rank checks; ``wait``), :meth:`wait`,
    :meth:`rows`, :attr:`report` (the doctor's JSON as a dict, None before a run)."""

    def __init__(self) -> None:
        self.report: dict | None = None
        self.error: str | None = None
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen | None = None
        self.w_quick = W.Checkbox(value=True, description="quick (leave out the 2-rank checks)", indent=False)
        self.b_run = W.Button(description="Run doctor", icon="stethoscope", tooltip="check what this machine can do, "
                              "by doing it (a process of its own; the kernel never touches CUDA)")
        self.status = W.HTML(note_html("not run yet: press Run doctor", "info"))
        self.table = W.HTML()
        self.b_run.on_click(lambda _: self.run(quick=bool(self.w_quick.value), wait=False))
        self.widget = W.VBox([
            W.HTML("<h4 style='margin:10px 0 2px'>Doctor</h4><div style='color:#555;font-size:12.5px'>What this "
                   "machine can do, checked by doing it: torch and its CUDA/NCCL build, the GPUs and their links, "
                   "bf16, flash-attn against the PyTorch path, a training step timed with CUDA events and its peak "
                   "memory against the memory model, NCCL collectives and a sharded (ZeRO-3) step on 2 ranks. "
                   "Skipped lines say why.</div>"),
            W.HBox([self.b_run, self.w_quick], layout=W.Layout(align_items="center")), self.status, self.table])

    def command(self, quick: bool = True) -> list[str]:
        return [sys.executable, "-m", "workbench.doctor", "--json", *(["--quick"] if quick else [])]

    def run(self, *, quick: bool = True, wait: bool = True, timeout: float = 900.0) -> dict | None:
        """Run the doctor; with ``wait`` return its report (the dict ``workbench doctor --json`` prints).
        Raises RuntimeError (with ``wait``) when the doctor could not run."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("the doctor is already running")
        self.report, self.error = None, None
        self.b_run.disabled = True
        self.status.value = note_html("running the doctor" + (" (quick)" if quick else "") + "...", "busy")
        self._thread = threading.Thread(target=self._work, args=(quick, timeout), name="doctor", daemon=True)
        self._thread.start()
        if not wait:
            return None
        self.wait(timeout + 30)
        if self.error:
            raise RuntimeError(self.error)
        return self.report

    def _work(self, quick: bool, timeout: float) -> None:
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        try:
            self._proc = subprocess.Popen(self.command(quick), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          env=env, start_new_session=True, stdin=subprocess.DEVNULL)
            try:
                out, err = self._proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, 9)
                self._proc.wait()
                raise RuntimeError(f"the doctor did not finish in {timeout:.0f} s") from None
            try:
                self.report = json.loads(out.strip().splitlines()[-1])
            except (ValueError, IndexError):
                raise RuntimeError(f"the doctor could not run: {(err.strip().splitlines() or ['no output'])[-1]}") from None
            c = self.report["counts"]
            kind = "error" if c["fail"] else "warn" if c["warn"] else "ok"
            self.status.value = note_html(f"{self.report['summary']} ({self.report['seconds']:.0f} s)", kind)
            self.table.value = self._table_html()
        except Exception as e:  # noqa: BLE001 - shown, never raised into a thread's void
            self.error = one_line(e)
            self.status.value = note_html(self.error, "error")
        finally:
            self.b_run.disabled = False

    def wait(self, timeout: float = 900.0) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def rows(self) -> list[dict]:
        """The report's lines as shown: ``{name, status, detail, fix}``."""
        return [{k: c.get(k, "") for k in ("name", "status", "detail", "fix")} for c in (self.report or {}).get("checks", [])]

    def _table_html(self) -> str:
        trs = []
        for r in self.rows():
            col = _COLOR.get(r["status"], "#555")
            fix = f"<br><span style='color:#555'>fix: {html.escape(r['fix'])}</span>" if r["fix"] and r["status"] in (
                "warn", "fail") else ""
            trs.append(f"<tr><td style='padding:2px 8px;color:{col};font-weight:600'>{html.escape(r['status'])}</td>"
                       f"<td style='padding:2px 8px;white-space:nowrap'>{html.escape(r['name'])}</td>"
                       f"<td style='padding:2px 8px'>{html.escape(r['detail'])}{fix}</td></tr>")
        return f"<table style='border-collapse:collapse;font-size:12.5px;max-width:1000px'>{''.join(trs)}</table>"


class ClusterSection:
    """The run on N nodes: a Slurm batch script (or one ``workbench train`` command per node) for the
    settings of ``settings()`` (the Launch panel's), shown and saved.

    Python API: :meth:`script` (returns the text and shows it), :meth:`save`; :attr:`text`, :attr:`name`."""

    def __init__(self, settings: Callable[[], dict]) -> None:
        self._settings = settings
        self.text = ""
        self.name: str | None = None
        st = {"description_width": "initial"}
        self.w_kind = W.Dropdown(options=[("Slurm batch script", "slurm"), ("torchrun commands per node", "torchrun")],
                                 value="slurm", description="for", style=st, layout=W.Layout(width="300px"))
        self.w_nnodes = W.BoundedIntText(min=1, max=4096, value=2, description="nodes", style=st,
                                         layout=W.Layout(width="130px"))
        self.w_root = W.Text(value="", placeholder="/shared/runs (every node must see it)", description="run store",
                             style=st, layout=W.Layout(width="340px"))
        self.w_endpoint = W.Text(value="", placeholder="HOST:PORT of node 0 (torchrun) or :PORT", description="endpoint",
                                 style=st, layout=W.Layout(width="300px"))
        self.b_show = W.Button(description="Cluster script", icon="server",
                               tooltip="the script that runs these settings on N nodes (workbench train --emit)")
        self.w_path = W.Text(value="job.sbatch", description="save as", style=st, layout=W.Layout(width="300px"))
        self.b_save = W.Button(description="Save", icon="save")
        self.status = W.HTML()
        self.area = W.Textarea(value="", layout=W.Layout(width="98%", height="220px"))
        self.b_show.on_click(lambda _: self._guard(self.script))
        self.b_save.on_click(lambda _: self._guard(lambda: self.save(self.w_path.value)))
        self.widget = W.VBox([
            W.HTML("<h4 style='margin:10px 0 2px'>On a cluster</h4><div style='color:#555;font-size:12.5px'>The same "
                   "run on several nodes: one torchrun per node (Slurm's srun starts them), the rendezvous on the "
                   "first node, the run store on a path every node sees. Submit the script with sbatch, then follow "
                   "and stop the run from here or with <code>workbench runs</code>.</div>"),
            W.HBox([self.w_kind, self.w_nnodes, self.w_root, self.w_endpoint], layout=W.Layout(flex_flow="row wrap")),
            W.HBox([self.b_show, self.w_path, self.b_save], layout=W.Layout(align_items="center")),
            self.status, self.area])

    def _guard(self, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - shown beside the button
            self.status.value = note_html(one_line(e), "error")

    def script(self, *, kind: str | None = None, nnodes: int | None = None, run_root: str | None = None,
               endpoint: str | None = None, name: str | None = None, sbatch=()) -> str:
        """The text for the current settings on ``nnodes`` nodes (the controls' values unless given);
        shown in the text area. Raises ValueError for settings that cannot run."""
        from workbench import runs
        from workbench.training import emit_cluster

        kind = kind or self.w_kind.value
        nnodes = int(nnodes or self.w_nnodes.value)
        root = run_root or self.w_root.value.strip() or str(runs.default_root())
        ep = endpoint if endpoint is not None else (self.w_endpoint.value.strip() or None)
        settings = {**self._settings(), "nnodes": nnodes}
        self.text, spec, self.name = emit_cluster(kind, settings, run_root=root, name=name, endpoint=ep, sbatch=sbatch)
        self.w_kind.value, self.w_nnodes.value = kind, nnodes
        self.area.value = self.text
        self.status.value = note_html(f"run {self.name}: {spec.nnodes} node(s) x {spec.nproc} "
                                      f"{'GPU(s)' if spec.device != 'cpu' else 'process(es)'}; the run store "
                                      f"{Path(root).resolve()} must be shared by the nodes", "ok")
        return self.text

    def save(self, path: str | Path) -> Path:
        """Write the script shown (made now if none is) to ``path`` (executable). Raises ValueError for
        an empty path."""
        if not str(path).strip():
            raise ValueError("give a file to save the script to, e.g. job.sbatch")
        if not self.text:
            self.script()
        p = Path(path).expanduser()
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(self.text)
        p.chmod(0o755)
        self.status.value = note_html(f"saved {p.resolve()}; submit it with: sbatch {p}" if self.w_kind.value == "slurm"
                                      else f"saved {p.resolve()}; run each node's line on that node", "ok")
        return p
