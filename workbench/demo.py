"""The planning demo: lengths -> simulate on the embedded defaults, written as a run.

Defaults: the ``wikipedia`` length family, the ``a100-40g-flexsp`` profile, 64 GPUs, the 7B
model, 1M-token global batches clipped at the largest context the cluster holds. A demo run
(``runs/<id>/``, kind ``demo``) holds ``spec.json`` (the Scenario), ``status.json``,
``lengths.json``, ``simulate.json``, ``plans.json`` (step 0 of every planner) and ``report.html``
(plotly, self-contained: opens offline).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Sequence

from workbench import runs
from workbench.scenario import DEFAULT_PLANNERS, Scenario
from workbench.simulate import summary_table
from workbench.util import write_json_atomic

__all__ = ["run_demo", "demo_scenario"]


def demo_scenario(*, samples: int = 200_000, seed: int = 0, time_limit: float = 1.0, family: str = "wikipedia",
                  num_gpus: int = 64, model: str = "7b", profile: str = "a100-40g-flexsp",
                  batch_tokens: int = 1_000_000) -> Scenario:
    """The demo's Scenario (max context: the largest power of two the cluster holds)."""
    return Scenario(model=model, profile=profile, num_gpus=num_gpus, source=family, samples=samples, seed=seed,
                    batch_tokens=batch_tokens, time_limit=time_limit, policy="clip")


def run_demo(*, root: Path | str | None = None, steps: int = 4, time_limit: float = 1.0,
             planners: Sequence[str] = (), seed: int = 0, samples: int = 200_000,
             scenario: Scenario | None = None, log: Callable[[str], None] | None = None) -> runs.Run:
    """Run the demo pipeline into a new run folder and return the Run. ``log`` gets progress lines."""
    from workbench.data import length_histogram, summarize, token_share_curve
    from workbench.report import (length_histogram_figure, plan_timeline_figure, step_time_figure,
                                  token_share_figure, write_html_report)
    from workbench.solve import planner_names

    say = log or (lambda msg: None)
    t0 = time.perf_counter()
    sc = scenario or demo_scenario(samples=samples, seed=seed, time_limit=time_limit)
    known = set(planner_names())
    planners = [p for p in (planners or DEFAULT_PLANNERS) if p in known or p.startswith("static:")]
    run = runs.new_run("demo", {"scenario": sc.to_dict(), "steps": steps, "planners": planners}, root=root)
    runs.update_status(run.path, state="running", steps=steps, started=runs.now(), message="loading lengths")
    try:
        prof = sc.profile_spec()
        say(f"demo: {sc.describe()}; writing {run.path}")
        raw = sc.lengths_set(apply_policy=False)
        ls = sc.lengths_set()
        summary = summarize(raw.lengths)
        hist, curve = length_histogram(raw.lengths), token_share_curve(raw.lengths)
        rep = ls.policy_report
        write_json_atomic(run.file("lengths.json"), {"summary": summary, "histogram": hist, "token_share_curve": curve,
                                                     "max_context": rep.to_dict() if rep else None})
        say(f"demo: lengths p50 {summary['p50']:,.0f}, p99 {summary['p99']:,.0f}, max {summary['max']:,}; "
            f"{rep.describe() if rep else 'no clipping'}")

        def progress(frac: float, msg: str) -> None:
            runs.update_status(run.path, progress=frac, message=msg)
            say(f"demo: [{100 * frac:5.1f}%] {msg}")

        res = sc.simulate(planners, steps=steps, keep_plans=True, progress=progress)
        sim = res.to_dict()
        write_json_atomic(run.file("simulate.json"), sim)
        write_json_atomic(run.file("plans.json"), {k: v[0] for k, v in res.plans.items() if v})
        table = summary_table(sim)
        show = next((p for p in ("flexsp", "greedy") if p in res.plans), None)
        sections = [
            ("Sequence lengths", length_histogram_figure(hist, f"{sc.source}: {summary['count']:,} sequences")),
            ("Token share by length", token_share_figure(hist, curve)),
            ("Step time by planner", step_time_figure(sim, f"{steps} steps of {sc.batch_tokens:,} tokens, {sc.model}, "
                                                           f"{sc.num_gpus} GPUs")),
        ]
        if show:
            sections.append((f"One step planned by {show}", plan_timeline_figure(res.plans[show][0])))
        if "static-max" in res.plans:
            sections.append(("The same step under static-max", plan_timeline_figure(res.plans["static-max"][0])))
        notes = [table]
        if res.errors:
            notes.append("\n".join(f"{k}: {v}" for k, v in res.errors.items()))
        write_html_report(run.file(runs.REPORT_FILE), f"Workbench demo: {sc.source}, {sc.model}, {sc.num_gpus} GPUs",
                          sections, tables=[("Summary", "\n\n".join(notes)),
                                            ("Cost model", f"profile {prof.name} ({prof.provenance.get('kind')}): "
                                                           f"{prof.provenance.get('source', '')}")])
    except BaseException as e:
        runs.update_status(run.path, state="failed", finished=runs.now(),
                           error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        raise
    runs.update_status(run.path, state="done", step=steps, progress=1.0, finished=runs.now(),
                       message=f"done in {time.perf_counter() - t0:.1f}s")
    print(table)
    say(f"demo: done in {time.perf_counter() - t0:.1f}s; open {run.file(runs.REPORT_FILE)}")
    return run
