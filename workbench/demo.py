"""``make demo``: lengths -> simulate on the embedded defaults, written to ``runs/<id>/``.

Defaults: the ``wikipedia`` length family, the ``a100-40g-flexsp`` profile, 64 GPUs, the 7B
model, 1M-token global batches clipped at the largest context the cluster holds. Writes
``spec.json``, ``lengths.json``, ``simulate.json``, ``plans.json`` (step 0 of every planner) and
``report.html`` (plotly, self-contained: opens offline).
"""

from __future__ import annotations

import secrets
import sys
import time
from pathlib import Path
from typing import Sequence

from workbench.util import write_json_atomic

__all__ = ["run_demo", "new_run_dir"]


def new_run_dir(root: str | Path, kind: str) -> Path:
    """Create and return a fresh ``root/<YYYYmmdd-HHMMSS>-<kind>-<4 hex>`` folder."""
    rid = f"{time.strftime('%Y%m%d-%H%M%S')}-{kind}-{secrets.token_hex(2)}"
    path = Path(root) / rid
    path.mkdir(parents=True, exist_ok=False)
    return path


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_demo(*, run_root: Path = Path("runs"), steps: int = 4, time_limit: float = 1.0,
             planners: Sequence[str] = (), seed: int = 0, samples: int = 200_000,
             family: str = "wikipedia", num_gpus: int = 64, model: str = "7b",
             profile: str = "a100-40g-flexsp", batch_tokens: int = 1_000_000) -> Path:
    """Run the demo pipeline and return the run folder."""
    from workbench.cli import DEFAULT_PLANNERS, default_max_len, format_sim_table
    from workbench.cost import CostModel
    from workbench.data import GlobalBatchSampler, length_histogram, load_lengths, summarize, token_share_curve
    from workbench.report import (length_histogram_figure, plan_timeline_figure, step_time_figure,
                                  token_share_figure, write_html_report)
    from workbench.simulate import simulate
    from workbench.solve import planner_names
    from workbench.specs import ClusterSpec, get_model, load_profile

    t0 = time.perf_counter()
    known = set(planner_names())
    planners = [p for p in (planners or DEFAULT_PLANNERS) if p in known or p.startswith("static:")]
    prof = load_profile(profile)
    cost = CostModel(prof, get_model(model), ClusterSpec(num_gpus=num_gpus, gpu_memory_gb=prof.gpu_memory_gb))
    max_len = default_max_len(cost)
    run_dir = new_run_dir(run_root, "demo")
    spec = {"kind": "demo", "family": family, "samples": samples, "seed": seed, "model": model, "profile": profile,
            "num_gpus": num_gpus, "batch_tokens": batch_tokens, "max_len": max_len, "steps": steps,
            "planners": planners, "time_limit": time_limit}
    write_json_atomic(run_dir / "spec.json", spec)
    _say(f"demo: {family} lengths ({samples:,} samples), {model} on {num_gpus}x {prof.gpu}, writing {run_dir}")

    raw = load_lengths(family, samples=samples, seed=seed)
    ls = load_lengths(family, samples=samples, seed=seed, max_len=max_len, policy="clip")
    summary = summarize(raw.lengths)
    hist, curve = length_histogram(raw.lengths), token_share_curve(raw.lengths)
    rep = ls.policy_report
    write_json_atomic(run_dir / "lengths.json", {"summary": summary, "histogram": hist, "token_share_curve": curve,
                                                 "max_context": rep.describe() if rep else None})
    _say(f"demo: lengths p50 {summary['p50']:,.0f}, p99 {summary['p99']:,.0f}, max {summary['max']:,}; "
         f"{rep.describe() if rep else 'no clipping'}")

    sampler = GlobalBatchSampler(ls.lengths, batch_tokens=batch_tokens, seed=seed)
    batches = [(b.batch_id, b.lengths) for b in sampler.take(steps)]

    def progress(frac: float, msg: str) -> None:
        _say(f"demo: [{100 * frac:5.1f}%] {msg}")

    res = simulate(batches, cost, planners, seed=seed, time_limit=time_limit, max_len=max_len, keep_plans=True,
                   progress=progress)
    sim = res.to_dict()
    write_json_atomic(run_dir / "simulate.json", sim)
    write_json_atomic(run_dir / "plans.json", {k: v[0] for k, v in res.plans.items() if v})
    table = format_sim_table(sim)
    show = next((p for p in ("flexsp", "greedy") if p in res.plans), None)
    sections = [
        ("Sequence lengths", length_histogram_figure(hist, f"{family}: {summary['count']:,} sequences")),
        ("Token share by length", token_share_figure(hist, curve)),
        ("Step time by planner", step_time_figure(sim, f"{steps} steps of {batch_tokens:,} tokens, {model}, "
                                                       f"{num_gpus} GPUs")),
    ]
    if show:
        sections.append((f"One step planned by {show}", plan_timeline_figure(res.plans[show][0])))
    if "static-max" in res.plans:
        sections.append(("The same step under static-max", plan_timeline_figure(res.plans["static-max"][0])))
    notes = [table]
    if res.errors:
        notes.append("\n".join(f"{k}: {v}" for k, v in res.errors.items()))
    write_html_report(run_dir / "report.html", f"Workbench demo: {family}, {model}, {num_gpus} GPUs", sections,
                      tables=[("Summary", "\n\n".join(notes)),
                              ("Cost model", f"profile {prof.name} ({prof.provenance.get('kind')}): "
                                             f"{prof.provenance.get('source', '')}")])
    write_json_atomic(run_dir / "status.json", {"state": "done", "seconds": time.perf_counter() - t0})
    print(table)
    _say(f"demo: done in {time.perf_counter() - t0:.1f}s; open {run_dir / 'report.html'}")
    return run_dir
