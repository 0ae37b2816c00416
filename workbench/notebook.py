"""Run the workbench's notebooks headless through papermill, as runs in the run store.

``run_notebook("03_solver", {"num_gpus": 16})`` creates ``runs/<id>/`` (kind ``notebook``), checks
the parameters against the notebook's ``parameters`` cell (an unknown name is an error listing the
known ones; a value given as text, as on the command line, is converted to the type of the
default), executes the notebook with papermill into ``runs/<id>/<name>.ipynb`` with ``results_dir``
set to the run folder (the notebook writes its figures and tables there) and ``runs_root`` to the
store, and records the outcome in ``status.json``. A failing cell makes the run ``failed`` with
that cell's error in one line, and raises :class:`NotebookFailed`.

Notebooks call :func:`runs_root` and :func:`results_folder` to find the store and their results
folder when run by hand. This module imports papermill only to execute; never ipywidgets.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Mapping

from workbench import runs

__all__ = ["NOTEBOOKS", "NotebookFailed", "notebooks_dir", "find_notebook", "notebook_parameters", "coerce_value",
           "run_notebook", "runs_root", "results_folder", "strip_notebook"]

NOTEBOOKS = ("00_tour", "01_hardware", "02_lengths", "03_solver", "04_train", "05_compare")
"""The notebooks shipped in ``notebooks/``, in reading order."""
KERNEL = "python3"


class NotebookFailed(RuntimeError):
    """A notebook run that ended in an error: ``run`` is its Run, ``cell`` the failing cell's
    execution count (None when the kernel died), and the message the error in one line."""

    def __init__(self, message: str, run: runs.Run, cell: int | None = None) -> None:
        super().__init__(message)
        self.run = run
        self.cell = cell


def notebooks_dir() -> Path:
    """The project's ``notebooks/`` folder (beside the ``workbench`` package)."""
    return Path(__file__).resolve().parents[1] / "notebooks"


def find_notebook(name: str | Path) -> Path:
    """The notebook named ``name``: a path to an ``.ipynb``, or a shipped name (``03_solver``,
    ``03``, ``solver``, with or without ``.ipynb``). Raises ValueError listing the notebooks."""
    p = Path(name)
    if p.suffix == ".ipynb" and p.is_file():
        return p
    key = p.name[:-6] if p.name.endswith(".ipynb") else p.name
    folder = notebooks_dir()
    found = sorted(folder.glob("*.ipynb")) if folder.is_dir() else []
    for nb in found:
        stem = nb.stem
        if key in (stem, stem.split("_", 1)[0], stem.split("_", 1)[-1]):
            return nb
    names = ", ".join(nb.stem for nb in found) or f"none (no notebooks in {folder})"
    raise ValueError(f"no notebook {str(name)!r}; notebooks: {names}")


def _parameters_cell(nb: Mapping[str, Any]) -> dict | None:
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code" and "parameters" in (cell.get("metadata", {}).get("tags") or []):
            return cell
    return None


def notebook_parameters(path: str | Path) -> dict[str, dict]:
    """The parameters a notebook declares in its cell tagged ``parameters``: ``{name: {"default":
    value, "type": annotation or type name, "help": the line's comment}}`` in order. Raises
    ValueError when the notebook has no such cell or a default is not a literal."""
    path = Path(path)
    nb = json.loads(path.read_text(encoding="utf-8"))
    cell = _parameters_cell(nb)
    if cell is None:
        raise ValueError(f"{path.name} has no cell tagged 'parameters'")
    src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
    lines = src.splitlines()
    out: dict[str, dict] = {}
    for node in ast.parse(src).body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            name, ann, value = node.target.id, ast.unparse(node.annotation), node.value
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name, ann, value = node.targets[0].id, None, node.value
        else:
            continue
        try:
            default = ast.literal_eval(value) if value is not None else None
        except ValueError:
            raise ValueError(f"{path.name}: parameter {name} has a default that is not a literal "
                             f"({ast.unparse(value)}); papermill cannot override it faithfully") from None
        line = lines[node.lineno - 1]
        comment = line.split("#", 1)[1].strip() if "#" in line else ""
        out[name] = {"default": default, "type": ann or type(default).__name__, "help": comment}
    return out


_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def coerce_value(name: str, text: Any, default: Any, type_name: str = "") -> Any:
    """``text`` converted to the type of the parameter's ``default`` when it is a string (as the
    command line gives it); other values pass through. Raises ValueError saying what was
    expected."""
    if not isinstance(text, str):
        return text
    want = type_name or type(default).__name__
    t = text.strip()
    try:
        if isinstance(default, bool) or want == "bool":
            if t.lower() in _TRUE:
                return True
            if t.lower() in _FALSE:
                return False
            raise ValueError
        if isinstance(default, int) or want == "int":
            return int(t.replace("_", ""))
        if isinstance(default, float) or want == "float":
            return float(t)
        if isinstance(default, (list, tuple, dict)) or want.startswith(("list", "tuple", "dict")):
            v = ast.literal_eval(t) if t[:1] in "[({" else [x.strip() for x in t.split(",") if x.strip()]
            return list(v) if isinstance(default, list) and isinstance(v, tuple) else v
        if default is None or "None" in want or "|" in want:
            if t.lower() in ("none", "null", ""):
                return None
            try:
                return ast.literal_eval(t)
            except (ValueError, SyntaxError):
                return text
        return text
    except (ValueError, SyntaxError):
        raise ValueError(f"parameter {name} expects {want} (default {default!r}), got {text!r}") from None


def runs_root(runs_root: str | Path | None = "") -> Path:
    """The run store a notebook uses: ``runs_root`` when given, else ``$WORKBENCH_RUNS``, else the
    project's ``runs/`` folder (beside ``notebooks/``), else ``./runs``. Made absolute."""
    if runs_root:
        return Path(runs_root).expanduser().resolve()
    env = os.environ.get("WORKBENCH_RUNS")
    if env:
        return Path(env).expanduser().resolve()
    project = Path(__file__).resolve().parents[1] / "runs"
    if project.is_dir():
        return project
    return Path("runs").resolve()


def results_folder(results_dir: str | Path | None, notebook: str, root: str | Path | None = None) -> Path:
    """Where a notebook writes its results: ``results_dir`` when given (``workbench notebook run``
    sets it to the run folder), else a new run of kind ``notebook`` in the store (a notebook run by
    hand with ``interactive=False``)."""
    if results_dir:
        p = Path(results_dir)
        p.mkdir(parents=True, exist_ok=True)
        return p
    run = runs.new_run("notebook", {"notebook": notebook, "by": "hand"}, root=runs_root(root))
    runs.update_status(run.path, state="done", finished=runs.now(), message=f"results of {notebook}, run by hand")
    return run.path


def strip_notebook(path: str | Path) -> bool:
    """Remove outputs, execution counts, widget state and papermill's traces (its metadata and
    injected-parameters cell) from a notebook file, in place, as the notebooks are committed (what
    nbstripout does). Returns whether the file changed."""
    import nbformat

    from workbench.util import write_text_atomic

    path = Path(path)
    before = path.read_text(encoding="utf-8")
    nb = nbformat.reads(before, as_version=4)
    nb.metadata.pop("widgets", None)
    nb.metadata.pop("papermill", None)
    nb.cells = [c for c in nb.cells if "injected-parameters" not in c.metadata.get("tags", [])]
    for cell in nb.cells:
        for key in ("execution", "widgets", "papermill", "collapsed", "scrolled"):
            cell.metadata.pop(key, None)
        if not cell.metadata.get("tags", True):
            del cell.metadata["tags"]
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    after = nbformat.writes(nb) + "\n"
    if after == before:
        return False
    write_text_atomic(path, after)
    return True


def run_notebook(name: str | Path, parameters: Mapping[str, Any] | None = None, *, root: str | Path | None = None,
                 run_id: str | None = None, timeout: float = 900.0, log=None,
                 widget_state: bool | None = None) -> runs.Run:
    """Execute notebook ``name`` with ``parameters`` through papermill as a new notebook run.

    Returns the Run (``done``). Raises ValueError for an unknown notebook or parameter (listing
    the known ones) or a value of the wrong type, before anything runs (and before papermill is
    imported: a mistyped name is answered at once); NotebookFailed (the run is ``failed``, the
    message is the failing cell's error in one line) when a cell raises, a cell runs longer than
    ``timeout`` seconds, or the kernel dies.

    ``widget_state``: whether the executed notebook keeps the state of the widgets the kernel made
    (in its metadata, so that widgets its outputs show render without a kernel). None (default):
    only when the run is interactive; a headless run (``interactive`` False) shows no widget (the
    panels are driven from code), and the state of the panels' plotly figures, each carrying
    plotly.js, would make the executed notebook tens of MB."""
    say = log or (lambda msg: None)
    path = find_notebook(name)
    known = notebook_parameters(path)
    given = dict(parameters or {})
    unknown = sorted(set(given) - set(known))
    if unknown:
        listing = ", ".join(f"{k} ({v['type']}, default {v['default']!r})" for k, v in known.items())
        raise ValueError(f"notebook {path.stem} has no parameter(s) {', '.join(unknown)}; its parameters: {listing}")
    values = {k: coerce_value(k, v, known[k]["default"], known[k]["type"]) for k, v in given.items()}
    import papermill as pm

    store = runs_root(root)
    run = runs.new_run("notebook", {"notebook": path.stem, "source": str(path), "parameters": values}, root=store,
                       run_id=run_id)
    if "results_dir" in known and "results_dir" not in values:
        values["results_dir"] = str(run.path.resolve())
    if "runs_root" in known and "runs_root" not in values:
        values["runs_root"] = str(store)
    if "interactive" in known and "interactive" not in values:
        values["interactive"] = False
    if widget_state is None:
        widget_state = bool(values.get("interactive", True))
    out = run.file(f"{path.stem}.ipynb")
    runs.update_status(run.path, state="running", started=runs.now(), progress=0.0,
                       message=f"executing {path.name} with papermill", resolved={"parameters": values})
    say(f"workbench notebook: {path.stem} -> {run.path}")
    handler = logging.FileHandler(run.file(runs.LOG_FILE), encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    pm_log = logging.getLogger("papermill")
    old_level = pm_log.level
    pm_log.addHandler(handler)
    pm_log.setLevel(logging.INFO)
    t0 = time.perf_counter()
    try:
        pm.execute_notebook(str(path), str(out), parameters=values, kernel_name=KERNEL, progress_bar=False,
                            log_output=True, cwd=str(run.path), execution_timeout=timeout,
                            request_save_on_cell_execute=True, store_widget_state=widget_state,
                            # the kernel's own start-up warnings (unencrypted local TCP) are noise here
                            extra_arguments=["--IPKernelApp.log_level=ERROR"])
    except Exception as e:  # noqa: BLE001 - every way a notebook fails ends the run as failed, in one line
        cell, msg = _failure(e, timeout)
        runs.update_status(run.path, state="failed", finished=runs.now(), error=msg, failing_rank=None,
                           message=f"{path.stem} failed" + (f" in cell {cell}" if cell else ""))
        raise NotebookFailed(f"{path.stem} failed" + (f" in cell [{cell}]" if cell else "") + f": {msg} "
                             f"(executed notebook: {out})", run, cell) from None
    finally:
        pm_log.removeHandler(handler)
        pm_log.setLevel(old_level)
        handler.close()
    files = sorted(str(p.relative_to(run.path)) for p in run.path.rglob("*")
                   if p.is_file() and p.suffix in (".html", ".json") and p.name not in (runs.SPEC_FILE, runs.STATUS_FILE))
    runs.update_status(run.path, state="done", finished=runs.now(), progress=1.0, step=len(files),
                       message=f"{path.stem} done in {time.perf_counter() - t0:.1f}s; {len(files)} result file(s)")
    say(f"workbench notebook: {path.stem} done in {time.perf_counter() - t0:.1f}s")
    return run


def _failure(e: BaseException, timeout: float) -> tuple[int | None, str]:
    """``(cell, one line)`` for an exception papermill or nbclient raised."""
    ename = getattr(e, "ename", None)
    if ename:  # PapermillExecutionError: the cell's own exception
        evalue = str(getattr(e, "evalue", "") or "").strip().splitlines()
        return getattr(e, "exec_count", None), f"{ename}: {evalue[0] if evalue else ''}".rstrip(": ")
    kind = type(e).__name__
    if "Timeout" in kind or "timed out" in str(e).lower():
        return None, f"a cell ran longer than {timeout:.0f}s ({kind})"
    if "DeadKernel" in kind:
        return None, "the kernel died (out of memory, or killed)"
    text = str(e).strip().splitlines()
    return None, f"{kind}: {text[0] if text else ''}".rstrip(": ")
