"""The newcomer's first look: the tour and the solver notebooks run headless, a short real training
run on this machine, and one explained offline report.

``run_demo()`` makes a run of kind ``demo`` (``runs/<id>/``) and, through papermill
(:mod:`workbench.notebook`), runs ``00_tour`` and ``03_solver`` on their embedded defaults (7B on
64 A100-40G, the wikipedia length family, 1M-token batches: FlexSP's published constants) and
``04_train`` (the tiny model, 2 CPU processes, a few steps; its own-model section plans a model of
your own but trains it only when asked, ``own_steps``: the report shows the tiny model's run): each
is a notebook run of its own in the same store. It then writes ``report.html`` into the demo run:
plotly embedded (opens offline), every chart explained, the terms defined, the clipped sequences
counted, the gradient sync shown on the timeline. Nothing is downloaded; no GPU is needed.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from workbench import runs

__all__ = ["run_demo", "GLOSSARY"]

GLOSSARY = {
    "sequence, token": "one training document, and its length in word pieces (a token is about four characters of English).",
    "max context": "the longest sequence the model trains on; longer documents are clipped (cut, tokens lost), split "
                   "(cut into pieces, nothing lost) or dropped: the <i>policy</i>.",
    "attention work (s²)": "attention compares every token with every earlier one, so its work grows as the square of the "
                           "length s, while the dense layers grow as s.",
    "activations, model states": "what each layer keeps for the backward pass (grows with the tokens a GPU holds); and "
                                 "the parameters, gradients and optimizer states (16 bytes per parameter), sharded over "
                                 "the GPUs by the ZeRO stage.",
    "usable memory, activation budget": "the share of a GPU's memory plans may fill (70% here, as FlexSP's 28 of 40 GB); "
                                        "what is left of it after the model states.",
    "sequence parallelism (SP), SP group, degree": "one sequence split over the GPUs of a group; the degree is how many. "
                                                   "Ulysses SP swaps attention heads for tokens with an all-to-all before "
                                                   "and after attention.",
    "static layout, static-max, replica": "every sequence on groups of one degree (static-max: the degree the max "
                                          "context needs, as Megatron-CP / DeepSpeed-Ulysses users configure it), copied "
                                          "over the GPUs as data-parallel replicas.",
    "heterogeneous SP": "groups of different degrees in the same step, chosen for every step's batch (FlexSP, ASPLOS'25).",
    "micro-step": "one pass over part of the batch when it does not fit in memory at once; the gradients of the "
                  "micro-steps add up.",
    "step time (makespan)": "when the last GPU finishes the step, gradient sync included.",
    "gradient sync": "the all-reduce that averages the gradients over all GPUs after their last micro-step: the grey "
                     "block at the right end of every timeline.",
    "lower bound, gap": "a step time no plan can beat (the work spread perfectly, each sequence at its cheapest feasible "
                        "degree); how far a plan is above it.",
    "imbalance": "when the last GPU finishes computing divided by the average GPU's busy time (1.0 is perfectly even).",
    "planner": "the algorithm that makes a step's plan: static-max, best-static, min-degree, greedy, two-stage, flexsp.",
}


def _fig(run: runs.Run | None, name: str):
    from workbench.report.page import load_figure

    if run is None:
        return None
    p = run.path / "figures" / f"{name}.json"
    return load_figure(p) if p.is_file() else None


def _table(run: runs.Run | None, name: str):
    if run is None:
        return None
    p = run.path / "tables" / f"{name}.json"
    return json.loads(p.read_text()) if p.is_file() else None


def run_demo(*, root: Path | str | None = None, train_steps: int = 16, train: bool = True, samples: int = 100_000,
             seed: int = 0, effort: float = 1.0, log: Callable[[str], None] | None = None,
             own_steps: int = 0) -> runs.Run:
    """Run the demo into a new run folder and return the Run (``report.html`` inside). ``log``
    gets progress lines. ``own_steps``: training steps of ``04_train``'s last section (a tokenizer,
    a model config and a corpus of your own, trained and exported); 0 (default) plans it without
    training: the report does not show that run, and it would add a second torchrun run and an
    export (about 10 s of CPU). Raises RuntimeError naming the notebooks that failed (the report is
    still written, with what worked and a note on what did not)."""
    from workbench.notebook import NotebookFailed, run_notebook, runs_root

    say = log or (lambda msg: None)
    t0 = time.perf_counter()
    store = runs_root(root)
    demo = runs.new_run("demo", {"samples": samples, "seed": seed, "effort": effort, "train_steps": train_steps,
                                 "train": train, "own_steps": own_steps}, root=store)
    runs.update_status(demo.path, state="running", started=runs.now(), message="running the notebooks")
    say(f"demo: writing {demo.path}")
    jobs = [("00_tour", {"samples": samples, "seed": seed, "effort": effort}),
            ("03_solver", {"samples": samples, "seed": seed, "effort": effort})]
    done: dict[str, runs.Run] = {}
    failed: dict[str, str] = {}
    machine, machine_error = None, None
    if train:
        jobs.append(("04_train", {"steps": train_steps, "nproc": TRAIN_NPROC, "max_len": 512, "batch_tokens": 8192,
                                  "seed": seed, "own_steps": own_steps}))
        # the training run plans with a profile of this machine: measured now the first time (a quick
        # profile for its process count), reused from the run store after that
        runs.update_status(demo.path, progress=0.0, message="this machine's profile")
        machine, machine_error = _machine_profile(store, say)
    summary_profile = None if machine is None else {"path": str(machine.path), "run": machine.run.id,
                                                    "measured": machine.measured, "seconds": machine.seconds,
                                                    "fingerprint": machine.fingerprint}
    for k, (name, params) in enumerate(jobs):
        runs.update_status(demo.path, progress=k / (len(jobs) + 1), message=f"running {name}")
        t = time.perf_counter()
        try:
            done[name] = run_notebook(name, params, root=store)
            say(f"demo: {name} done in {time.perf_counter() - t:.0f}s ({done[name].path})")
        except NotebookFailed as e:
            failed[name] = str(e)
            say(f"demo: {name} failed: {e}")
    runs.update_status(demo.path, progress=len(jobs) / (len(jobs) + 1), message="writing the report")
    report = _write_report(demo, done, failed, t0, machine, machine_error)
    summary = {"notebook_runs": {k: str(v.path) for k, v in done.items()}, "failed": failed, "report": str(report),
               "machine_profile": summary_profile, "machine_profile_error": machine_error}
    from workbench.util import write_json_atomic

    write_json_atomic(demo.file("demo.json"), summary)
    took = time.perf_counter() - t0
    if failed:
        msg = "; ".join(f"{k}: {v.splitlines()[0]}" for k, v in failed.items())
        runs.update_status(demo.path, state="failed", finished=runs.now(), error=msg,
                           message=f"report written without {', '.join(failed)}")
        raise RuntimeError(f"demo: {msg} (partial report: {report})")
    runs.update_status(demo.path, state="done", finished=runs.now(), progress=1.0, step=len(done),
                       message=f"done in {took:.0f}s")
    say(f"demo: done in {took:.0f}s; open {report}")
    return demo


TRAIN_NPROC = 2
"""Processes of the demo's training run (and of the machine profile it plans with)."""


def _machine_profile(store: Path, say: Callable[[str], None]):
    """``(MachineProfile or None, error or None)``: this machine's quick profile for the demo's
    training run, cached or measured now with its progress in ``say`` lines."""
    from workbench.profile.machine import ensure_machine_profile, find_machine_profile

    found = find_machine_profile(TRAIN_NPROC, root=store)
    if found is not None:
        say(f"demo: reusing this machine's profile {found.run.id} (measured for {TRAIN_NPROC} processes)")
        return found, None
    say(f"demo: measuring this machine first: a quick profile of {TRAIN_NPROC} processes, kept in {store} for later "
        f"runs (about 30 s on 2 cores)")
    last = [None, 0.0]

    def progress(frac: float, msg: str) -> None:
        phase = msg.split(":")[0]
        now = time.monotonic()
        if phase != last[0] or now - last[1] > 5.0:
            last[0], last[1] = phase, now
            say(f"demo: profile {100 * frac:3.0f}% {msg}")

    t = time.perf_counter()
    try:
        mp = ensure_machine_profile(TRAIN_NPROC, root=store, progress=progress)
    except (RuntimeError, ValueError) as e:
        say(f"demo: measuring this machine failed: {e}; the run plans with the shipped profile")
        return None, str(e)
    say(f"demo: this machine's profile done in {time.perf_counter() - t:.0f}s ({mp.run.path})")
    return mp, None


def _write_report(demo: runs.Run, done: dict, failed: dict, t0: float, machine=None,
                  machine_error: str | None = None) -> Path:
    from workbench.report.page import write_page

    tour, solver, train = done.get("00_tour"), done.get("03_solver"), done.get("04_train")
    t = _table(tour, "tour") or {}
    blocks: list[tuple[str, object]] = []

    def fig(run, name, fallback_note=""):
        f = _fig(run, name)
        if f is not None:
            blocks.append(("figure", f))
        elif fallback_note:
            blocks.append(("warn", fallback_note))

    for name, err in failed.items():
        blocks.append(("warn", f"<b>{name} failed</b>: {err}"))
    sc = t.get("scenario") or {}
    lead = ("One training step of a {model} model on {gpus} GPUs (A100-40G, FlexSP's published constants), with sequence "
            "lengths drawn like {family}'s, planned by a fixed layout and by heterogeneous sequence parallelism; and a real "
            "training run on this machine. Every number comes from the workbench's cost model or the run store; the "
            "notebooks that made them are listed at the end.").format(
        model=sc.get("model", "7b").upper(), gpus=sc.get("num_gpus", 64), family=sc.get("source", "wikipedia"))
    blocks.append(("note", "New to this? The short version: long documents are rare but hold most of the attention work; "
                           "memory forces them onto several GPUs at once; a fixed layout makes <i>every</i> sequence pay for "
                           "that; choosing a mix of layouts for every step does not. The terms are defined in the glossary "
                           "at the end, and where they first appear."))

    # 1. data ---------------------------------------------------------------------------------
    ln = t.get("lengths") or {}
    s, mc = ln.get("summary") or {}, ln.get("max_context") or {}
    blocks.append(("h2", "1. The data: most sequences are short, a few are very long"))
    if s:
        blocks.append(("p", f"{s['count']:,} sequences ({s['tokens']:,} tokens): half are shorter than {s['p50']:,.0f} tokens and "
                            f"99% shorter than {s['p99']:,.0f}, yet the longest has {s['max']:,}. The chart counts sequences per "
                            f"length range on log axes (each bar covers twice the lengths of the one before); red bars lie "
                            f"beyond the <b>max context</b> (dashed line), the longest sequence the model trains on."))
    fig(tour, "lengths_histogram", "the tour did not run: no length figures")
    if mc:
        verbs = {"clip": "cut to", "split": "split into pieces of at most", "drop": "left out: longer than"}
        verb, ml = verbs.get(mc.get("policy"), "cut at"), mc.get("max_len", 0)
        blocks.append(("p", f"<b>The clipped sequences.</b> {mc.get('affected_sequences', 0):,} of "
                            f"{mc.get('sequences_before', 0):,} sequences are longer than {ml:,} tokens and are {verb} {ml:,} "
                            f"tokens (policy <i>{mc.get('policy')}</i>): {mc.get('text', '')}. The chart shows their original "
                            f"lengths."))
    fig(tour, "clipped")

    # 2. attention ------------------------------------------------------------------------------
    blocks.append(("h2", "2. Attention work grows as the square of the length"))
    rows = t.get("compute_by_length") or []
    if rows:
        blocks.append(("p", "Time of one sequence's forward and backward pass on one GPU, from the cost model "
                            "(per layer <i>a·s² + b·s + c</i>): 128 times the tokens cost far more than 128 times the time."))
        blocks.append(("table", ([{"length": f"{r['length']:,}", "time": f"{r['compute_s_on_one_gpu']:.2f} s",
                                   "x_time": f"{r['vs_1K']:,.0f}x", "x_tokens": f"{r['tokens_vs_1K']:,.0f}x"} for r in rows],
                                 [("length", "length (tokens)"), ("time", "forward + backward, one GPU"),
                                  ("x_time", "x the time of 1K"), ("x_tokens", "x the tokens of 1K")])))
    o8 = ln.get("over_8k") or {}
    if o8:
        blocks.append(("p", f"Sequences of 8K tokens or more are {100 * o8['sequences']:.1f}% of the sequences, "
                            f"{100 * o8['tokens']:.0f}% of the tokens and {100 * o8['attention_work']:.0f}% of the attention "
                            f"work. The chart shows running "
                            f"totals against length: the share of sequences, tokens and attention work in sequences up to each "
                            f"length."))
    fig(tour, "cumulative_share")

    # 3. memory ---------------------------------------------------------------------------------
    m = t.get("memory") or {}
    blocks.append(("h2", "3. Memory decides how many GPUs a sequence needs"))
    if m:
        need = ", ".join(f"{int(k):,} tokens: degree {v}" for k, v in (m.get("min_degree") or {}).items())
        blocks.append(("p", f"Of each GPU's {m['usable_gb']:.0f} GB usable memory the model states (parameters, gradients, optimizer "
                            f"states, ZeRO-3 over all GPUs) take {m['model_states_gb']:.2f} GB, leaving an activation budget of "
                            f"{m['activation_budget_gb']:.1f} GB: about {m['tokens_per_gpu']:,.0f} tokens of activations. A longer "
                            f"sequence is spread over an SP group of several GPUs; the smallest <b>degree</b> each length needs: "
                            f"{need}. Each bar below is one GPU's memory, stacked by part, against the usable memory (dashed) and "
                            f"the device (solid)."))
    fig(tour, "memory_examples")

    # 4. static ---------------------------------------------------------------------------------
    st = t.get("static") or {}
    blocks.append(("h2", "4. A static layout: one degree for every sequence"))
    if st:
        b = t.get("batch") or {}
        blocks.append(("p", f"The step's batch: {b.get('sequences', 0):,} sequences, {b.get('tokens', 0):,} tokens. <b>static-max</b> "
                            f"runs every one of them on SP degree {st['degree']} (the degree the max context needs): step time "
                            f"{st['step_s']:.2f} s against a lower bound of {st['lower_bound_s']:.2f} s. A 1K-token sequence costs "
                            f"{st['gpu_ms_1k_on_one']:.0f} GPU-ms on one GPU but {st['gpu_ms_1k_on_static']:.0f} GPU-ms spread over "
                            f"{st['degree']} GPUs: tiny shares of work, each paying an all-to-all across nodes."))
    blocks.append(("p", "<b>How to read a timeline.</b> Each row is one GPU (rank); each bar is an SP group running its sequences, "
                        "from when all its GPUs are free to when it is done, coloured by degree; <i>m0, m1, ...</i> mark the "
                        "<b>micro-steps</b>. <b>Where the gradient sync sits:</b> the grey block at the right end. After its last "
                        "micro-step every GPU joins the all-reduce of the gradients, so that block starts when the last GPU "
                        "finishes computing, and the step ends with it (red line). The dashed line is the lower bound."))
    fig(tour, "timeline_static_max")
    if "imbalance_equal_tokens" in st:
        blocks.append(("p", f"<b>Imbalance.</b> The static-max plan balances its replicas (imbalance {st['imbalance_planned']:.3f}); "
                            f"a data loader that deals each replica the same number of tokens does not: on sampled batches the "
                            f"slowest replica takes {st['imbalance_equal_tokens']:.2f}x the mean on average (diamonds: slowest, dots: "
                            f"every replica, bars: mean), because equal tokens are not equal attention work."))
    fig(tour, "static_imbalance")

    # 5. heterogeneous --------------------------------------------------------------------------
    h = t.get("heterogeneous") or {}
    blocks.append(("h2", "5. Heterogeneous SP: the right degree for each sequence, every step"))
    if h:
        ws, wh = h["work_static_gpu_s"], h["work_heterogeneous_gpu_s"]
        blocks.append(("p", f"<b>{h['planner']}</b> chooses a mix of SP groups (degrees {', '.join(map(str, h['degrees']))}) for this "
                            f"batch by optimising against the cost model: step time {h['step_s']:.2f} s, {100 * h['gap']:.1f}% above "
                            f"the lower bound, <b>{h['speedup_over_static_max']:.2f}x faster than static-max</b>. Long sequences get "
                            f"the wide groups their memory needs, short ones run on one or two GPUs with no communication. Same "
                            f"compute ({wh['compute_gpu_s']:.0f} GPU-s), far less all-to-all: {ws['communication_gpu_s']:.0f} GPU-s "
                            f"under static-max, {wh['communication_gpu_s']:.0f} GPU-s here."))
    fig(tour, "timeline_heterogeneous")
    blocks.append(("p", "Every planner on the same batch: bars are predicted step times (text: gap to the lower bound, speedup "
                        "over static-max); the dashed line is the lower bound. <i>best-static</i> is the best single degree for "
                        "this batch, <i>min-degree</i> puts each sequence on the smallest degree its memory needs (Megatron's "
                        "dynamic context parallelism), <i>greedy</i> and <i>flexsp</i> (a CP-SAT model under a time limit) "
                        "mix degrees, <i>two-stage</i> is Hydraulis-style."))
    fig(tour, "planners")
    blocks.append(("p", "Where each plan's GPU-time goes (GPUs x seconds): compute, SP communication inside groups, the fixed "
                        "cost each group pays per micro-step, GPUs idling while others finish, and the gradient sync."))
    fig(tour, "gpu_time")
    blocks.append(("p", "One GPU of the fullest group of each degree in the heterogeneous plan: the planner fills the activation "
                        "budget but never exceeds it."))
    fig(tour, "memory_per_gpu")

    # 6. the solver notebook --------------------------------------------------------------------
    blocks.append(("h2", "6. The solver notebook: every planner, with its solve time"))
    prow = _table(solver, "planners") or []
    if prow:
        blocks.append(("p", "The same scenario through <code>03_solver</code> (the Solver panel driven from code): each planner's "
                            "step time, its gap to the lower bound, how many micro-steps and groups its plan has, which degrees, "
                            "its imbalance and how long it took to plan."))
        blocks.append(("table", ([{**r, "makespan_s": r.get("makespan_ms", 0) / 1e3, "gap_pct": 100 * r.get("gap", 0)}
                                  for r in prow if "error" not in r],
                                 [("planner", "planner"), ("makespan_s", "step (s)"), ("gap_pct", "over LB (%)"),
                                  ("micro_steps", "micro-steps"), ("groups", "groups"), ("degrees", "degrees"),
                                  ("imbalance", "imbalance"), ("solve_seconds", "solve (s)"), ("status", "status")])))
    fig(solver, "timeline", "the solver notebook did not run")

    # 7. a real run -----------------------------------------------------------------------------
    blocks.append(("h2", "7. A real training run on this machine"))
    tr = _table(train, "train_run")
    if tr:
        run = runs.load_run(tr["run_dir"])
        s7 = run.summary()
        st7 = tr["status"]
        blocks.append(("p", f"<code>04_train</code> launched run <code>{run.id}</code>: {s7.get('nproc')} torchrun processes (gloo on "
                            f"CPU) trained the tiny model for {st7.get('step')} steps on the Python standard library's source, each "
                            f"step running its planner's plan ({s7.get('planner')}). State: <b>{st7.get('state')}</b>. Median step: "
                            f"measured {s7.get('median_measured_ms') or 0:,.0f} ms against "
                            f"{s7.get('median_predicted_ms') or 0:,.0f} ms predicted. Left: the loss "
                            f"falls; right: each step's measured time (solid) and the plan's prediction (dashed)."))
        if machine_error:
            blocks.append(("warn", f"<b>This machine could not be measured</b> ({machine_error}): the run planned with the "
                                   f"shipped profile."))
        blocks += _prediction_blocks(run, s7, machine)
        fig(train, "training")
        plans = run.plans()
        if plans:
            from workbench.report.plans import timeline_figure

            blocks.append(("p", "The plan of the run's last step, on its ranks: the same timeline as above, at the scale of "
                                "this machine; the grey block is the gradient all-reduce after the last micro-step."))
            blocks.append(("figure", timeline_figure(plans[-1]["plan"], title=f"run {run.id}: plan of step {plans[-1]['step']}")))
    else:
        blocks.append(("warn", "No training run in this demo (run without it, or it failed)."))

    # where things are ------------------------------------------------------------------------------
    blocks.append(("h2", "Glossary"))
    blocks.append(("glossary", GLOSSARY))
    blocks.append(("h2", "Where this came from"))
    where = [{"what": k, "run": str(v.path), "notebook": str(v.path / f"{k}.ipynb")} for k, v in done.items()]
    blocks.append(("table", (where, [("what", "notebook"), ("run", "run folder"), ("notebook", "executed notebook")])))
    blocks.append(("p", f"Made by <code>make demo</code> (<code>workbench demo</code>) in {time.perf_counter() - t0:.0f} s. "
                        f"Open the notebooks in JupyterLab with <code>make lab</code> to change the settings and watch the plans "
                        f"change; run any of them headless with <code>workbench notebook run NAME -p KEY VALUE</code>."))
    title = "Workbench demo: why long-tailed data wastes GPUs, and what heterogeneous SP does about it"
    return write_page(demo.file(runs.REPORT_FILE), title, blocks, lead=lead)


def _prediction_blocks(run: runs.Run, summary: dict, machine) -> list[tuple[str, object]]:
    """What the report says about the run's predictions: the profile they came from (this
    machine's, measured now or reused, or another machine's, said as a warning), how far they were
    from the measured steps (``workbench profile --check``), and the load the machine was under."""
    from workbench.profile import check_fidelity

    out: list[tuple[str, object]] = []
    note = summary.get("profile_note")
    prof = summary.get("profile") or "?"
    if note:
        out.append(("warn", f"<b>Predictions from another machine.</b> {note}."))
    elif machine is not None:
        how = (f"measured just now, in {machine.seconds:.0f} s" if machine.measured
               else f"reused from the run store (profile run <code>{machine.run.id}</code>)")
        out.append(("p", f"<b>Where the predictions come from.</b> The run planned with profile <code>{prof}</code>: this "
                         f"machine's quick profile for {machine.fingerprint.get('nproc')} processes ({how}; the key is the "
                         f"CPU, its cores, the torch version, the device and the process count, so a later demo reuses it "
                         f"and another machine measures its own). Besides each layer's compute and the collectives it "
                         f"holds what a step costs beyond its layers, measured from a few real steps: FSDP's fixed cost "
                         f"of a lockstep pass, each micro-step's own, the embedding, head and loss, the optimizer."))
    else:
        out.append(("p", f"The run planned with profile <code>{prof}</code>."))
    ref = (run.spec().get("scenario") or {}).get("profile") or prof
    try:  # the profile the run planned with (a path or a shipped name), against the run itself
        chk = check_fidelity(ref, run.path)
        chk["profile_ref"] = ref
    except ValueError:
        chk = None
    if chk is not None and chk["step_error"]["count"]:
        e = chk["step_error"]
        out.append(("p", f"<b>How well it predicted.</b> <code>workbench profile --check {run.id}</code>: the step time's median "
                         f"error is {e['median_ape']:.1f}% (worst {e['worst_ape']:.1f}%) over {e['count']} steps "
                         f"(the first left out: it pays start-up costs)."))
    load = summary.get("load_average") or {}
    if load.get("text"):
        pl = ((load_profile_safe(chk) or {}).get("provenance") or {}).get("load_average") or {}
        then = (f" The profile was measured under {pl['start']:.1f} to {pl.get('end', pl['start']):.1f}."
                if isinstance(pl.get("start"), (int, float)) else "")
        out.append(("p", f"<b>The machine's load during the run</b>, sampled every 2 s: {load['text']}.{then} Other "
                         f"work on a shared machine slows the ranks down; a profile predicts the machine as it was "
                         f"when it was measured."))
    return out


def load_profile_safe(check: dict | None) -> dict | None:
    """The profile a ``check_fidelity`` result was made with, as a dict (None when it does not load)."""
    from workbench.specs import load_profile

    if not check or not check.get("profile_ref"):
        return None
    try:
        return load_profile(check["profile_ref"]).to_dict()
    except ValueError:
        return None
