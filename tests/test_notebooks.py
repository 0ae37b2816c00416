"""The notebooks: committed clean, parameters parsed and checked, and every one executed headless by
papermill (real kernels) with small parameters, through ``workbench notebook run`` and the Python
runner; the demo built from them. Results are checked in the run store's files.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from workbench import runs
from workbench.notebook import NOTEBOOKS, coerce_value, find_notebook, notebook_parameters, run_notebook, strip_notebook

# its slow tests check notebooks' outputs and files, not times: make test runs them in the untimed lane (tests/_xdist_heavy.py)
pytestmark = pytest.mark.untimed

ROOT = Path(__file__).resolve().parents[1]
NB_DIR = ROOT / "notebooks"


def workbench(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("workbench")
    cmd = [str(exe), *args] if exe.exists() else [sys.executable, "-m", "workbench.cli", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout, env=env)


def executed(run: runs.Run, name: str) -> nbformat.NotebookNode:
    return nbformat.read(run.path / f"{name}.ipynb", as_version=4)


def errors_in(nb) -> list[str]:
    return [f"{o.ename}: {o.evalue}" for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == "error"]


# ------------------------------------------------------------------------------------------------
# committed clean
# ------------------------------------------------------------------------------------------------


def test_every_notebook_is_committed_without_outputs_or_widget_state():
    found = sorted(p.stem for p in NB_DIR.glob("*.ipynb"))
    assert found == sorted(NOTEBOOKS)
    for name in NOTEBOOKS:
        raw = json.loads((NB_DIR / f"{name}.ipynb").read_text())
        nb = nbformat.reads(json.dumps(raw), as_version=4)
        nbformat.validate(nb)
        assert nb.metadata.kernelspec.name == "python3", name
        assert "widgets" not in nb.metadata, f"{name} keeps widget state"
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, \
                    f"{name} keeps outputs ({cell.source[:40]!r}): run `workbench notebook strip` before committing"
            assert not {"execution", "widgets", "papermill"} & set(cell.metadata), f"{name}: {dict(cell.metadata)}"
        tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1, f"{name} needs exactly one cell tagged parameters"
        params = notebook_parameters(NB_DIR / f"{name}.ipynb")
        assert list(params)[:3] == ["interactive", "runs_root", "results_dir"]
        assert params["interactive"] == {"default": True, "type": "bool", "help": params["interactive"]["help"]}
        for k, v in params.items():
            assert v["type"] in ("bool", "int", "float", "str"), f"{name}.{k} is not typed"
            assert v["help"], f"{name}.{k} has no comment saying what it is"


def test_parameters_are_parsed_typed_and_checked(tmp_path):
    p = notebook_parameters(find_notebook("03_solver"))
    assert p["num_gpus"]["default"] == 64 and p["num_gpus"]["type"] == "int"
    assert p["recompute"]["default"] is False and p["effort"]["type"] == "float"
    assert find_notebook("solver") == find_notebook("03") == NB_DIR / "03_solver.ipynb"
    assert coerce_value("num_gpus", "16", 64) == 16
    assert coerce_value("recompute", "true", False) is True and coerce_value("recompute", "0", False) is False
    assert coerce_value("time_limit", "0.5", 1.0) == 0.5 and coerce_value("x", 7, 1) == 7
    with pytest.raises(ValueError, match="expects int"):
        coerce_value("num_gpus", "many", 64)
    with pytest.raises(ValueError, match="no notebook 'nope'"):
        find_notebook("nope")
    # an unknown parameter is an error listing the known ones, before any run exists
    with pytest.raises(ValueError, match=r"no parameter\(s\) gpus; its parameters: interactive \(bool"):
        run_notebook("03_solver", {"gpus": 8}, root=tmp_path)
    assert runs.list_runs(tmp_path) == []
    r = workbench("notebook", "run", "03_solver", "-p", "gpus", "8", "--run-root", str(tmp_path))
    assert r.returncode == 2 and "num_gpus (int, default 64)" in r.stderr and len(r.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------------------
# executed by papermill (slow: real kernels)
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """``workbench demo`` once, short (2 training steps, 20,000 sampled lengths, a 0.1 effort planner limit,
    the train notebook's own-model section trained one step), in a store already holding this machine's
    profile (``seed_machine_profile``), which the demo reuses instead of measuring this machine for 30 s (its
    measuring branch is checked by ``test_the_demo_says_when_it_measured_this_machine``, the measurement
    itself by test_widgets.py's ``two_runs`` and test_profile_run.py): ``(store, report, demo run, the store's
    (kind, id) right after it, {notebook: its run})``. Its ``00_tour``, ``03_solver`` and ``04_train`` runs
    are what the tour, solver and train tests check, so each of them runs once in this file."""
    from conftest import seed_machine_profile

    root = tmp_path_factory.mktemp("demo")
    seed_machine_profile(root)
    r = workbench("demo", "--run-root", str(root), "--steps", "2", "--samples", "20000", "--effort", "0.1",
                  "--own-steps", "1", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    report = Path(r.stdout.strip().splitlines()[-1])
    run = runs.load_run(report.parent)
    kinds = sorted((x.kind, x.id) for x in runs.list_runs(root))  # before a test adds its own runs to the store
    made = json.loads(run.file("demo.json").read_text())["notebook_runs"]
    return root, report, run, kinds, {name: runs.load_run(path) for name, path in made.items()}


@pytest.mark.slow
def test_tour_runs_headless(demo):
    run = demo[4]["00_tour"]
    st = run.status()
    assert st.state == "done" and run.kind == "notebook"
    assert run.spec()["parameters"] == {"samples": 20000, "seed": 0, "effort": 0.1}
    nb = executed(run, "00_tour")
    assert errors_in(nb) == []
    # headless: no output shows a widget, and the executed notebook keeps no widget state (the panels'
    # plotly figures carry plotly.js each: tens of MB)
    assert not [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
                if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert "widgets" not in nb.metadata and (run.path / "00_tour.ipynb").stat().st_size < 5_000_000
    tour = json.loads((run.path / "tables" / "tour.json").read_text())
    h, s = tour["heterogeneous"], tour["static"]
    assert h["step_s"] < s["step_s"] and h["speedup_over_static_max"] == pytest.approx(s["step_s"] / h["step_s"])
    assert h["work_static_gpu_s"]["communication_gpu_s"] > h["work_heterogeneous_gpu_s"]["communication_gpu_s"]
    assert tour["memory"]["min_degree"]["131072"] == 32  # 128K tokens need 32 A100-40G GPUs for 7B
    # offload: a layer's input of s/8 tokens in bf16 over the profile's 25 GB/s per GPU, against a forward
    # that grows as s^2; the longest sequence with and without; swap on the 1M batch
    off = tour["offload"]
    for r in off["copy_vs_compute"]:
        assert r["input_copy_ms"] == pytest.approx(r["tokens"] / 8 * 4096 * 2 / 25e9 * 1e3)
    shares = [r["copy_share"] for r in off["copy_vs_compute"]]
    assert shares == sorted(shares, reverse=True) and shares[-1] < 0.05
    assert off["longest_on_8"]["with offload"] > 4 * off["longest_on_8"]["without offload"]
    assert off["batch_1m"]["auto"] < 0.9 * off["batch_1m"]["none"] and off["batch_1m_swapped_blocks"] > 0
    _check_tour_any_size(nb, tour["any_size"], run.spec()["parameters"])
    figs = {p.name for p in (run.path / "figures").glob("*.html")}
    assert {"lengths_histogram.html", "clipped.html", "timeline_static_max.html", "timeline_heterogeneous.html",
            "planners.html", "gpu_time.html", "memory_per_gpu.html", "timeline_powers_of_two_48.html",
            "timeline_any_size_48.html"} <= figs
    # every term the tour relies on is explained in it
    text = " ".join(c.source for c in nb.cells if c.cell_type == "markdown")
    for term in ("**lower bound**", "**degree**", "**micro-steps**", "**Imbalance**", "**gradient sync**",
                 "**max context**", "**activations**"):
        assert term in text, term


def _check_tour_any_size(nb, got: dict, params: dict) -> None:
    """The tour's section 10 (groups of any size) against run_planner on the same 48-GPU scenario,
    planned here: the step, its bound, the idle share, the GPUs in no group and the groups, with the
    powers of two only and with the default candidate degrees; and the numbers its text shows."""
    import numpy as np

    from workbench.scenario import Scenario
    from workbench.solve import run_planner

    batch = np.array([1048576, 204800, 51200, 8192])
    shown = " ".join(o.get("data", {}).get("text/markdown", "") for c in nb.cells if c.get("id") == "00-24-any-size"
                     for o in c.outputs)
    refs = {}
    for key, degrees in (("powers_of_two", (1, 2, 4, 8, 16, 32)), ("any_size", ())):
        sc = Scenario(model="llama3-8b", profile="h100-80g", num_gpus=48, gpus_per_node=8, zero_stage=3, recompute=True,
                      source=",".join(map(str, batch)), degrees=degrees, effort=params["effort"], seed=params["seed"])
        ref = run_planner("flexsp", batch, sc.cost(), seed=params["seed"], effort=params["effort"], max_len=sc.resolved_max_len())
        groups = [g for m in ref.micro_steps for g in m.groups]
        free = 48 - len({r for g in groups for r in g.ranks})
        v = got[key]
        assert v["degrees"] == (list(degrees) or [1, 2, 4, 8, 16, 24, 32, 48])
        assert v["step_s"] == pytest.approx(ref.makespan_ms / 1e3, rel=1e-9)
        assert v["lower_bound_s"] == pytest.approx(ref.lower_bound_ms / 1e3, rel=1e-9)
        assert v["idle_share"] == pytest.approx(ref.idle_share, abs=1e-12) and v["idle_gpus"] == free
        assert [(g["degree"], g["split"], g["ranks"]) for g in v["groups"]] == [
            (g.degree, f"{g.ulysses}x{g.cp}", [g.ranks[0], g.ranks[-1]]) for g in groups]
        gap = 100 * (ref.makespan_ms / ref.lower_bound_ms - 1)
        assert f"| {v['step_s']:.2f} | {gap:.1f}% | {100 * ref.idle_share:.1f}% | {free} |" in shown
        refs[key] = (ref, free)
    (p2, free2), (pa, free_a) = refs["powers_of_two"], refs["any_size"]
    # the case docs/solver.md quotes: with the powers of two 13 GPUs have no group; with any size none does
    assert free2 == 13 and free_a == 0 and pa.makespan_ms < 0.8 * p2.makespan_ms
    assert (f"**{free2} of 48 GPUs have no group** and\n**{100 * p2.idle_share:.1f}%**" in shown
            and f"idle GPU-time **{100 * pa.idle_share:.1f}%**, step **{pa.makespan_ms / 1e3:.1f} s**" in shown)


@pytest.mark.slow
def test_hardware_and_lengths_notebooks(tmp_path):
    saved = tmp_path / "mine.json"
    run = run_notebook("01_hardware", {"profile": "cpu-gloo-tiny", "save_as": str(saved)}, root=tmp_path)
    assert run.status().state == "done" and errors_in(executed(run, "01_hardware")) == []
    pts = json.loads((run.path / "tables" / "points.json").read_text())
    from workbench.specs import load_profile

    prof = load_profile("cpu-gloo-tiny").to_dict()
    packs = prof["provenance"]["measurements"]
    assert len(pts) == 2 * len(packs)  # forward and backward of every measured pack
    assert all(abs(p["relative_error"]) < 0.2 for p in pts if p["role"] == "fit")
    one = next(p for p in pts if p["kind"] == "forward" and len(p["pack"]) == 1)
    s, f = one["pack"][0], prof["forward"]  # the fitted time by hand: a*s^2 + b*s + c
    assert one["fitted_ms"] == pytest.approx(f["a"] * s * s + f["b"] * s + f["c"])
    assert json.loads(saved.read_text())["name"] == "cpu-gloo-tiny"
    assert (run.path / "figures" / "residuals.html").is_file()

    run = run_notebook("02_lengths", {"source": "github", "samples": "20000", "max_len": "32768", "policy": "split"},
                       root=tmp_path)
    summary = json.loads((run.path / "tables" / "summary.json").read_text())
    assert summary["source"] == "github" and summary["max_len"] == 32768
    assert summary["policy_report"]["policy"] == "split"
    assert summary["after_policy"]["tokens"] == summary["before_policy"]["tokens"]  # split keeps every token
    assert {"histogram.html", "cdf.html", "share.html", "policy.html", "imbalance.html"} <= \
        {p.name for p in (run.path / "figures").glob("*.html")}


@pytest.mark.slow
def test_solver_notebook_headless(demo, tmp_path):
    """The demo's ``03_solver`` run (its default 64 GPUs and 1M-token batches, every planner): the
    tables, valid plans, the figures, and an executed notebook that strips back to the committed one.
    The command line's ``-p`` strings arriving typed is the failing-cell test's (a run through
    ``workbench notebook run``)."""
    from workbench.scenario import Scenario
    from workbench.solve import plan_from_dict, validate

    run = demo[4]["03_solver"]
    assert run.status().state == "done" and run.kind == "notebook"
    assert run.spec()["parameters"] == {"samples": 20000, "seed": 0, "effort": 0.1}
    assert errors_in(executed(run, "03_solver")) == []
    rows = json.loads((run.path / "tables" / "planners.json").read_text())
    assert [r["planner"] for r in rows][0] == "flexsp" and len(rows) == 6  # the chosen planner first, then the others
    sc = Scenario.from_dict(json.loads((run.path / "tables" / "scenario.json").read_text()))
    assert sc.num_gpus == 64 and sc.batch_tokens == 1_000_000 and sc.samples == 20000 and sc.effort == 0.1
    batch = sc.batches(1)[0].lengths
    plans = json.loads((run.path / "tables" / "plans.json").read_text())
    for p in plans.values():
        validate(plan_from_dict(p), batch, sc.cluster(), sc.cost())
        assert p["makespan_ms"] >= p["lower_bound_ms"]
    # an executed notebook strips back to what is committed
    copy = tmp_path / "copy.ipynb"
    copy.write_text((run.path / "03_solver.ipynb").read_text())
    assert strip_notebook(copy) and not strip_notebook(copy)
    stripped, committed = nbformat.read(copy, as_version=4), nbformat.read(NB_DIR / "03_solver.ipynb", as_version=4)
    assert [(c.cell_type, c.source, c.metadata) for c in stripped.cells] == \
        [(c.cell_type, c.source, c.metadata) for c in committed.cells]
    assert all(c.outputs == [] for c in stripped.cells if c.cell_type == "code")
    mem = json.loads((run.path / "tables" / "memory.json").read_text())
    assert mem["total_gb"] <= mem["usable_gb"] + 1e-9
    assert {"timeline.html", "planners.html", "work.html", "memory.html"} <= \
        {p.name for p in (run.path / "figures").glob("*.html")}


@pytest.mark.slow
def test_train_and_compare_notebooks_share_the_store(demo):
    root, *_, made = demo
    run = made["04_train"]  # the demo's: 2 steps of the tiny model on 2 processes
    assert run.status().state == "done" and errors_in(executed(run, "04_train")) == []
    tr = json.loads((run.path / "tables" / "train_run.json").read_text())
    trained = runs.load_run(tr["run_dir"])
    assert trained.path.parent == root.resolve()  # the training run landed in the same store
    assert trained.status().state == "done" and len(trained.steps()) == 2
    assert (run.path / "figures" / "training.html").is_file()

    # 05 finds one finished run, trains one more (greedy) and compares the two: in a store of its own
    # holding only that run and the profile of this machine the demo's store holds, which the new run
    # reuses (measuring this machine would add 30 s here; see the demo fixture for where the
    # measurement is checked)
    store = root.parent / "compare"
    shutil.copytree(trained.path, store / trained.path.name)
    (prof_id,) = [i for k, i in demo[3] if k == "profile"]
    shutil.copytree(root / prof_id, store / prof_id)
    run = run_notebook("05_compare", {"planners": "greedy", "steps": 2}, root=store)
    assert errors_in(executed(run, "05_compare")) == []
    table = json.loads((run.path / "tables" / "runs.json").read_text())
    assert len(table) == 2 and table[0]["id"] == trained.id and table[0]["speedup_over_baseline"] == 1.0
    assert table[1]["speedup_over_baseline"] > 0
    assert len(runs.list_runs(store, kind="train")) == 2
    assert [r.id for r in runs.list_runs(store, kind="profile")] == [prof_id]  # reused, nothing measured


@pytest.mark.slow
def test_a_failing_cell_fails_the_run_with_its_error_in_one_line(tmp_path):
    r = workbench("notebook", "run", "03_solver", "-p", "num_gpus", "16", "-p", "effort", "0.3", "-p", "recompute", "true",
                  "-p", "planner", "nope", "--run-root", str(tmp_path))
    assert r.returncode == 1
    # the command's run_notebook raised NotebookFailed (the only error it reports this way): the failing
    # cell's error in one line
    err = [x for x in r.stderr.splitlines() if x.startswith("workbench notebook: error:")]
    assert len(err) == 1 and "ValueError: unknown planner 'nope'" in err[0] and "in cell [" in err[0]
    run = runs.load_run(r.stdout.strip().splitlines()[-1])
    # the command line's strings arrive typed as the parameters cell declares them
    assert run.spec()["parameters"] == {"num_gpus": 16, "effort": 0.3, "recompute": True, "planner": "nope"}
    st = run.status()
    assert st.state == "failed" and st.error.startswith("ValueError: unknown planner 'nope'")
    assert "\n" not in st.error
    assert (run.path / "03_solver.ipynb").is_file()  # the executed notebook shows where it stopped


@pytest.mark.slow
def test_demo_writes_the_explained_offline_report(demo):
    root, report, run, kinds, made = demo
    assert run.kind == "demo" and run.status().state == "done"
    html = report.read_text()
    assert not re.search(r"<script[^>]*\ssrc=[\"']?https?:", html)  # plotly.js inlined: the page opens offline
    assert len(html) > 3_000_000
    assert html.count("class=\"plotly-graph-div\"") >= 10
    for phrase in ("The clipped sequences.", "Where the gradient sync sits:", "How to read a timeline.", "Glossary",
                   "lower bound, gap", "micro-step", "A real training run on this machine", "faster than static-max",
                   "Where the predictions come from.", "How well it predicted.", "The machine's load during the run"):
        assert phrase in html, phrase
    # the demo's run, its three notebooks, this machine's profile (seeded by the fixture: reused) and the
    # training runs 04_train says it made: the tiny model's, which the report shows, and its own-model
    # section's (--own-steps 1; the demo's default plans it without training): its Launch panel with a
    # config, a tokenizer and a corpus, one step, exported (the notebook checks the export's tensors)
    tables = made["04_train"].path / "tables"
    own = json.loads((tables / "own_model_run.json").read_text())
    assert made["04_train"].spec()["parameters"]["own_steps"] == 1 and len(own["losses"]) == 1
    assert (Path(own["exported"]) / "config.json").is_file()
    trained = [json.loads((tables / "train_run.json").read_text())["run"], own["run"]]
    assert [k for k, _ in kinds] == sorted(["demo", "notebook", "notebook", "notebook", "profile"]
                                           + ["train"] * len(trained))
    assert sorted(i for k, i in kinds if k == "train") == sorted(trained)
    # every training run planned with this machine's profile, reused from the store (nothing measured),
    # and the report says so, with the load
    (prof,) = [runs.load_run(root / i) for k, i in kinds if k == "profile"]
    summary = json.loads(run.file("demo.json").read_text())["machine_profile"]
    assert not summary["measured"] and summary["run"] == prof.id and prof.spec()["fingerprint"]["nproc"] == 2
    for t in trained:
        t = runs.load_run(root / t)
        assert t.spec()["scenario"]["profile"] == str(prof.file(runs.PROFILE_FILE))
        assert t.status().resolved["profile_from_this_machine"] is True and t.load_average()["samples"] >= 1
    assert "run planned with profile <code>cpu-gloo-tiny-2r</code>" in html
    assert (f"this machine's quick profile for 2 processes (reused from the run store (profile run <code>{prof.id}</code>)"
            in html)


@pytest.mark.slow
def test_the_demo_says_when_it_measured_this_machine(demo, tmp_path, monkeypatch):
    """The demo's branch for a store without this machine's profile, which its run above passes over:
    ``_machine_profile`` measures through ``ensure_machine_profile`` (a stand-in here, returning the
    store's profile as measured in 31 s; the measurement itself is test_widgets.py's ``two_runs``,
    through the Launch panel, and test_profile_run.py's), saying so with its progress a line a phase;
    a failed measurement is an error and no profile (the run plans with the shipped one); and the
    report's paragraph on the predictions says the profile was measured just now."""
    import workbench.profile.machine as machine
    from workbench.demo import _machine_profile, _prediction_blocks

    root, _, _, kinds, made = demo
    (prof,) = [runs.load_run(root / i) for k, i in kinds if k == "profile"]
    calls = []

    def measure(nproc, *, root, progress, **kw):
        calls.append((nproc, Path(root)))
        for frac, msg in ((0.0, "starting torchrun"), (0.01, "compute: sample 2/180"), (0.2, "compute: sample 44/180"),
                          (0.8, "collectives: all_to_all d=2 8,192 B"), (1.0, "done in 31s")):
            progress(frac, msg)
        return machine.MachineProfile(path=prof.file(runs.PROFILE_FILE), run=prof, measured=True,
                                      fingerprint=prof.spec()["fingerprint"], seconds=31.0)

    monkeypatch.setattr(machine, "ensure_machine_profile", measure)
    said = []
    got, err = _machine_profile(tmp_path, said.append)
    assert err is None and got.measured and got.run == prof and calls == [(2, tmp_path)]
    assert said[0].startswith("demo: measuring this machine first: a quick profile of 2 processes")
    # one line a phase (a phase's later lines within 5 s are left out), then the time it took
    assert said[1:-1] == ["demo: profile   0% starting torchrun", "demo: profile   1% compute: sample 2/180",
                          "demo: profile  80% collectives: all_to_all d=2 8,192 B", "demo: profile 100% done in 31s"]
    assert re.fullmatch(rf"demo: this machine's profile done in \d+s \({re.escape(str(prof.path))}\)", said[-1])

    def fail(nproc, **kw):
        raise RuntimeError("measuring this machine (profile run x) failed: rank 1 exited with 1")

    monkeypatch.setattr(machine, "ensure_machine_profile", fail)
    said = []
    assert _machine_profile(tmp_path, said.append) == (
        None, "measuring this machine (profile run x) failed: rank 1 exited with 1")
    assert said[-1].endswith("failed: rank 1 exited with 1; the run plans with the shipped profile")

    trained = runs.load_run(json.loads((made["04_train"].path / "tables" / "train_run.json").read_text())["run_dir"])
    text = " ".join(str(b) for kind, b in _prediction_blocks(trained, trained.summary(), got) if kind == "p")
    assert ("Where the predictions come from." in text and
            "this machine's quick profile for 2 processes (measured just now, in 31 s;" in text), text
