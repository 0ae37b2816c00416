"""The panels in a real JupyterLab, driven in a real browser.

A ``jupyter lab`` server (token on, bound to 127.0.0.1 on a free port, serving a copy of the
notebooks so nothing is saved into the repository) and Debian's Chromium driven by Playwright
(the Python package; never a downloaded browser). ``03_solver``: run all cells, the Solver panel
and its plotly timeline render, a changed control draws a new plan. ``04_train``: Launch, progress,
Stop, ``stopped`` in the panel and in the run store, no process left. Screenshots go to
``test-output/browser/`` (or ``$WORKBENCH_TEST_OUTPUT/browser``).

The copies plan and run no more than these checks need (``_BROWSER_COPIES``): the solver plans
20,000 sampled lengths with flexsp alone at effort 0.3 (the headless runs of ``test_notebooks.py``
plan the defaults with every planner), and ``04_train`` stops before its own-model section (which
the demo's 04_train run in ``test_notebooks.py`` plans and trains one step).

Skips with a line saying how to enable it when Playwright or Chromium is missing, unless
``WORKBENCH_REQUIRE_BROWSER=1`` (CI sets it), which turns a missing browser into a failure.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("WORKBENCH_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic", "--disable-dev-shm-usage"]
HOW = ("install the browser with `apt-get install -y chromium` and the `playwright` Python package (pip; never "
       "`playwright install`), or set WORKBENCH_CHROMIUM to a Chromium binary")

pytestmark = pytest.mark.slow


def _need_browser():
    missing = []
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing.append("the playwright package")
    if not (Path(CHROMIUM).is_file() and os.access(CHROMIUM, os.X_OK)):
        missing.append(f"a Chromium at {CHROMIUM}")
    if missing:
        msg = f"browser test needs {' and '.join(missing)}: {HOW}"
        if os.environ.get("WORKBENCH_REQUIRE_BROWSER") == "1":
            pytest.fail(msg + " (WORKBENCH_REQUIRE_BROWSER=1 makes this a failure)")
        pytest.skip(msg + "; set WORKBENCH_REQUIRE_BROWSER=1 to make a missing browser fail")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_BROWSER_COPIES = {
    # the Solver panel renders and replans the same with one planner, fewer lengths and less search (not
    # less than this: at effort 0.1 the first plan came before the page had loaded the timeline's plotly
    # FigureWidget, and the timeline stayed empty in 3 of 6 runs on a loaded machine)
    "03_solver.ipynb": ({"samples": 20000, "effort": 0.3, "compare": False}, None),
    # the Launch panel's cells only (the own-model section trains a tokenizer, plans and makes a second
    # panel, on the cores the run being started needs), and the demo's shorter steps: the first one
    # shows sooner, and the run is stopped after it
    "04_train.ipynb": ({"max_len": 512, "batch_tokens": 8192}, "04-04"),
}
"""For each notebook the browser opens: parameter defaults changed in its copy, and the id of the
last cell kept (None: all of them)."""


def _cheaper_copy(path: Path, params: dict, last_cell: str | None) -> None:
    """Set ``params`` in the copy's parameters cell (its ``name: type = value  # help`` lines, as
    JupyterLab shows them) and drop the cells after ``last_cell``."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    if last_cell is not None:
        ids = [c.get("id") for c in nb.cells]
        nb.cells = nb.cells[:ids.index(last_cell) + 1]
    (cell,) = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    for name, value in params.items():
        cell.source, n = re.subn(rf"^({name}: \w+ = )[^#\n]*?(\s+#)", rf"\g<1>{value!r}\g<2>", cell.source, flags=re.M)
        assert n == 1, f"{path.name} has no parameter {name}"
    nbformat.write(nb, path)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A running JupyterLab over a copy of the notebooks: ``(base_url, token, runs_root, shots)``."""
    _need_browser()
    work = tmp_path_factory.mktemp("lab")
    nbdir, runs_root, cfg = work / "notebooks", work / "runs", work / "jupyter"
    shutil.copytree(ROOT / "notebooks", nbdir)
    for name, (params, last_cell) in _BROWSER_COPIES.items():
        _cheaper_copy(nbdir / name, params, last_cell)
    runs_root.mkdir()
    shots = Path(os.environ.get("WORKBENCH_TEST_OUTPUT") or ROOT / "test-output") / "browser"
    shots.mkdir(parents=True, exist_ok=True)
    # no "official Jupyter news?" pop-up over the page
    notes = cfg / "settings" / "@jupyterlab" / "apputils-extension"
    notes.mkdir(parents=True)
    (notes / "notification.jupyterlab-settings").write_text('{"fetchNews": "false", "checkForUpdates": false}')
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, WORKBENCH_RUNS=str(runs_root), JUPYTER_RUNTIME_DIR=str(cfg / "runtime"),
               JUPYTER_CONFIG_DIR=str(cfg / "config"), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    jupyter = Path(sys.executable).with_name("jupyter")
    cmd = [str(jupyter) if jupyter.exists() else sys.executable, *([] if jupyter.exists() else ["-m", "jupyter"]),
           "lab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
           "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={nbdir}",
           f"--LabServerApp.workspaces_dir={cfg / 'workspaces'}", f"--LabServerApp.user_settings_dir={cfg / 'settings'}",
           "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(work / "jupyter.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=nbdir, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"jupyter lab did not start: {(work / 'jupyter.log').read_text()[-2000:]}")
            time.sleep(0.5)
        # no token, no entry: the server is not open to anyone on the machine
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(f"{base}/api/contents", timeout=5)
        yield base, token, runs_root, shots
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


@pytest.fixture(scope="module")
def page(lab):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        ctx = browser.new_context(viewport={"width": 1400, "height": 1300})
        pg = ctx.new_page()
        pg.set_default_timeout(60_000)
        yield pg
        ctx.close()
        browser.close()


@pytest.fixture
def shoot_on_failure(request, page, lab):
    """A screenshot (and the page's text) of the moment a browser test fails."""
    yield
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        shots = lab[3]
        page.screenshot(path=str(shots / f"FAILED-{request.node.name}.png"), full_page=False)
        (shots / f"FAILED-{request.node.name}.txt").write_text(page.inner_text("body")[-20000:])


_PANEL = ".jp-NotebookPanel:not(.lm-mod-hidden)"  # the notebook in the tab shown


_POLL_MS = 200
"""How often a page.wait_for_function condition is checked (Playwright's default is every animation
frame, which keeps Chromium's renderer busy while a kernel plans or trains on the same cores)."""

_KERNEL_IDLE = ("() => { const ind = document.querySelector('%s .jp-Notebook-ExecutionIndicator');"
                " const bar = document.querySelector('#jp-main-statusbar');"
                " return !!ind && ind.getAttribute('data-status') === 'idle' && "
                "/\\(ipykernel\\)\\s*\\|\\s*Idle/.test(bar ? bar.innerText : ''); }" % _PANEL)
"""True when this notebook's kernel is connected: its execution indicator and the status bar say idle."""

_KERNEL_DIALOG = ".jp-Dialog .jp-Dialog-button.jp-mod-accept"


def _open(page, lab, name: str) -> None:
    """Open notebook ``name`` and wait for its kernel: by its URL the first time, then from the file
    browser of the JupyterLab already loaded (loading the page again costs Chromium a few seconds of CPU)."""
    base, token, _, _ = lab
    if page.url.startswith(f"{base}/lab"):
        page.locator(".jp-DirListing-itemText", has_text=re.compile(rf"^{re.escape(name)}$")).first.dblclick()
        page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current", has_text=name).wait_for(timeout=60_000)
    else:
        page.goto(f"{base}/lab/tree/{name}?token={token}", timeout=120_000)
    page.locator(_PANEL).first.wait_for(timeout=120_000)
    # JupyterLab may ask which kernel to start (the notebook's own, python3, is preselected): accept it
    # when it asks; else the kernel starts by itself. Whichever comes first, no fixed wait for a dialog
    page.wait_for_function("() => !!document.querySelector('%s') || (%s)()" % (_KERNEL_DIALOG, _KERNEL_IDLE),
                           timeout=120_000, polling=_POLL_MS)
    select = page.locator(_KERNEL_DIALOG, has_text=re.compile("Select"))
    if select.count():
        select.first.click()
    page.wait_for_function(_KERNEL_IDLE, timeout=120_000, polling=_POLL_MS)


def _run_all(page) -> None:
    """Run > Run All Cells, again if no cell of this notebook started (a click while the kernel was
    still connecting runs nothing)."""
    for _ in range(3):
        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
        page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
        try:
            page.wait_for_function("() => [...document.querySelectorAll('%s .jp-InputArea-prompt')]"
                                   ".some(e => /\\[(\\*|\\d+)\\]/.test(e.innerText))" % _PANEL, timeout=20_000,
                                   polling=_POLL_MS)
            return
        except Exception:  # noqa: BLE001 - playwright's TimeoutError: try the menu again
            time.sleep(2)
    raise AssertionError("Run All Cells did not start any cell")


def _shut_down_kernel(page) -> None:
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Kernel$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Shut Down Kernel$")).click()
    dialog = page.locator(".jp-Dialog button", has_text=re.compile("Shut Down"))
    if dialog.count():
        dialog.first.click()


def _widget_text(page, pattern: str, timeout: float = 120_000):
    loc = page.locator(f"{_PANEL} .jp-OutputArea-output .widget-html-content", has_text=re.compile(pattern)).first
    loc.wait_for(timeout=timeout)
    return loc


def _timeline_ranks(page) -> int | None:
    """Ranks on the drawn timeline (from plotly's own layout in the page)."""
    return page.evaluate("""() => {
        for (const gd of document.querySelectorAll('.js-plotly-plot')) {
            const y = gd.layout && gd.layout.yaxis;
            if (y && y.title && /rank/.test(y.title.text || '') && y.range) return Math.round(y.range[0] + 0.5);
        }
        return null; }""")


def test_solver_notebook_renders_and_replans(lab, page, shoot_on_failure):
    _, _, _, shots = lab
    _open(page, lab, "03_solver.ipynb")
    _run_all(page)
    _widget_text(page, r"plan #1: flexsp", timeout=180_000)
    # the timeline is drawn by plotly in the page: bars exist and every rank has a label
    page.wait_for_function("() => [...document.querySelectorAll('.js-plotly-plot')].some(gd => "
                           "gd.layout && gd.layout.yaxis && /rank/.test((gd.layout.yaxis.title||{}).text||'') && "
                           "gd.querySelectorAll('.barlayer .point').length > 0)", timeout=120_000, polling=_POLL_MS)
    assert _timeline_ranks(page) == 64
    labels = page.evaluate("""() => { for (const gd of document.querySelectorAll('.js-plotly-plot')) {
        if (/rank/.test(((gd.layout.yaxis||{}).title||{}).text||''))
            return [...gd.querySelectorAll('.ytick text')].map(t => t.textContent); } return []; }""")
    assert labels[:3] == ["0", "1", "2"] and "63" in labels
    page.locator(".widget-html-content", has_text="plan #1").first.scroll_into_view_if_needed()
    page.screenshot(path=str(shots / "solver-64.png"))
    # change a control in the page: 64 -> 16 GPUs; a new plan is drawn for 16 ranks
    gpus = page.locator(".widget-dropdown", has=page.locator("label", has_text=re.compile(r"^GPUs$"))).locator("select")
    gpus.select_option(label="16")
    _widget_text(page, r"plan #2: flexsp", timeout=120_000)
    page.wait_for_function(f"() => ({_js_ranks()}) === 16", timeout=60_000, polling=_POLL_MS)
    page.locator(".widget-html-content", has_text="plan #2").first.scroll_into_view_if_needed()
    page.screenshot(path=str(shots / "solver-16.png"))
    page.locator(".js-plotly-plot").first.scroll_into_view_if_needed()
    page.screenshot(path=str(shots / "solver-timeline.png"))
    _shut_down_kernel(page)  # its CPU is the training run's


def _js_ranks() -> str:
    return ("(() => { for (const gd of document.querySelectorAll('.js-plotly-plot')) { const y = gd.layout && "
            "gd.layout.yaxis; if (y && y.title && /rank/.test(y.title.text || '') && y.range) "
            "return Math.round(y.range[0] + 0.5); } return null; })()")


def test_train_notebook_launch_progress_stop(lab, page, shoot_on_failure):
    from workbench import runs
    from workbench.launch import run_alive

    from conftest import seed_machine_profile

    _, _, runs_root, shots = lab
    # this machine's profile in the store, so Launch starts the run at once instead of measuring this
    # machine for 30 s first (the Launch panel's measurement is test_widgets.py's two_runs)
    seed_machine_profile(runs_root)
    _open(page, lab, "04_train.ipynb")
    _run_all(page)
    launch = page.locator(f"{_PANEL} .jp-OutputArea-output button", has_text=re.compile(r"^\s*Launch\s*$")).first
    launch.wait_for(timeout=120_000)
    launch.click()
    # progress: the run writes its first step and the panel's progress bar shows it
    page.locator(f"{_PANEL} .widget-inline-hbox .widget-label", has_text=re.compile(r"^step [1-9]\d*/20$")).first.wait_for(
        timeout=180_000)
    _widget_text(page, r": running · step [1-9]")
    page.screenshot(path=str(shots / "train-running.png"))
    page.locator(f"{_PANEL} .jp-OutputArea-output button", has_text=re.compile(r"^\s*Stop\s*$")).first.click()
    _widget_text(page, r": stopped", timeout=60_000)
    page.screenshot(path=str(shots / "train-stopped.png"))
    trained = runs.list_runs(runs_root, kind="train")
    assert len(trained) == 1, trained
    st = trained[0].status()
    assert st.state == "stopped", st.to_dict()
    assert len(trained[0].steps()) >= 1, trained[0].log_tail(20)
    assert runs.status_pids(st), "the run recorded its processes"
    assert not run_alive(st), f"processes left: {[p for p, t in runs.status_pids(st) if runs.pid_alive(p, t)]}"
