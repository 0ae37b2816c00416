"""``workbench`` command line: lengths, cost, plan, simulate, demo, train.

The shapes printed with ``--json`` are the stable interface of DESIGN.md. Bad input exits with
status 2 and one line on stderr saying what was wrong and how to fix it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from workbench.util import dumps

DEFAULT_MODEL = "7b"
DEFAULT_PROFILE = "a100-40g-flexsp"
DEFAULT_GPUS = 64
DEFAULT_PLANNERS = ("static-max", "best-static", "min-degree", "greedy", "two-stage", "flexsp")


class CliError(Exception):
    """Bad input found by the CLI itself."""


def _int_list(text: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CliError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not out:
        raise CliError(f"{what} is empty")
    return out


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# shared options
# ---------------------------------------------------------------------------------------------


def _add_data_args(p: argparse.ArgumentParser, source_flag: bool) -> None:
    if source_flag:
        p.add_argument("--lengths", required=True, metavar="SOURCE",
                       help="family name (wikipedia, commoncrawl, github, byted, uniform, lognormal, stdlib), "
                            "a file, or a comma-separated list of lengths taken in order as the whole batch")
    p.add_argument("--max-len", type=int, default=None, metavar="N",
                   help="max context; longer sequences are handled by --policy (plan/simulate default: the "
                        "largest power of two the cluster can hold, at most the model's max context)")
    p.add_argument("--policy", default="clip", choices=["clip", "split", "drop", "error"],
                   help="what to do with sequences over --max-len (default clip; always reported)")
    p.add_argument("--samples", type=int, default=None, metavar="N",
                   help="sequences to generate from a family or draw from a file (default: family 100000, file all)")
    p.add_argument("--seed", type=int, default=0, help="seeds data sampling and planners")
    p.add_argument("--column", default=None, help="CSV/Parquet/JSONL/dataset column holding lengths or text")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="local Hugging Face tokenizer (tokenizer.json or its folder) for text sources")


def _add_cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpus", type=int, default=DEFAULT_GPUS, metavar="N", help=f"GPUs (default {DEFAULT_GPUS})")
    p.add_argument("--gpus-per-node", type=int, default=8, metavar="G", help="GPUs per node (default 8)")
    p.add_argument("--gpu-memory", type=float, default=None, metavar="GB",
                   help="memory per GPU in GB (default: the profile's GPU)")
    p.add_argument("--memory-fraction", type=float, default=0.7,
                   help="share of GPU memory plans may fill (default 0.7, as FlexSP's 28 of 40 GB)")
    p.add_argument("--zero-stage", type=int, default=3, choices=[0, 1, 2, 3], help="ZeRO stage (default 3)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model preset (default {DEFAULT_MODEL})")
    p.add_argument("--profile", default=DEFAULT_PROFILE, metavar="NAME|PATH",
                   help=f"hardware profile: shipped name or JSON file (default {DEFAULT_PROFILE})")
    p.add_argument("--strategy", default="ulysses", choices=["ulysses", "ring"],
                   help="sequence-parallel attention (default ulysses)")
    p.add_argument("--recompute", action="store_true", help="full activation recomputation (less memory, more time)")


def _add_batch_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--batch-tokens", type=int, default=None, metavar="T", help="global batch by token budget")
    g.add_argument("--batch-size", type=int, default=None, metavar="B", help="global batch by sequence count")
    p.add_argument("--time-limit", type=float, default=1.0, metavar="S", help="solver time limit per step (s)")


def build_cost(args):
    """The CostModel the CLI options describe."""
    from workbench.cost import CostModel
    from workbench.specs import ClusterSpec, get_model, load_profile

    model = get_model(args.model)
    profile = load_profile(args.profile)
    if args.gpus < 1:
        raise CliError(f"--gpus must be at least 1, got {args.gpus}")
    cluster = ClusterSpec(num_gpus=args.gpus, gpus_per_node=min(args.gpus_per_node, args.gpus),
                          gpu_memory_gb=args.gpu_memory if args.gpu_memory is not None else profile.gpu_memory_gb,
                          usable_memory_fraction=args.memory_fraction, zero_stage=args.zero_stage)
    return CostModel(profile, model, cluster, strategy=args.strategy, recompute=args.recompute)


def default_max_len(cost) -> int:
    """The largest power of two the cluster can hold on one group, at most the model's context."""
    cap = max(cost.degrees) * cost.tokens_per_gpu()
    cap = min(cap, cost.model.max_context)
    return 1 << (int(cap).bit_length() - 1)


def load_source(args, max_len: int | None):
    """The LengthSet of ``args.lengths`` (or ``args.source``) with the max-context policy applied."""
    from workbench.data import load_lengths

    src = getattr(args, "source", None) or args.lengths
    ls = load_lengths(src, samples=args.samples, seed=args.seed, max_len=max_len, policy=args.policy,
                      column=args.column, tokenizer=args.tokenizer)
    if ls.policy_report is not None and ls.policy_report.affected_sequences:
        _say(f"max context: {ls.policy_report.describe()}")
    return ls


def make_batches(ls, args, steps: int) -> list[tuple[str, np.ndarray]]:
    """``steps`` global batches from a LengthSet (an explicit list is the one batch, in order)."""
    from workbench.data import GlobalBatchSampler

    if getattr(ls, "ordered", False):
        return [("list", np.asarray(ls.lengths, dtype=np.int64))]
    if args.batch_tokens is None and args.batch_size is None:
        raise CliError("give --batch-tokens T or --batch-size B to draw global batches from "
                       f"{ls.source!r} (or pass the batch itself as --lengths L1,L2,...)")
    sampler = GlobalBatchSampler(ls.lengths, batch_size=args.batch_size, batch_tokens=args.batch_tokens, seed=args.seed)
    return [(b.batch_id, np.asarray(b.lengths, dtype=np.int64)) for b in sampler.take(steps)]


# ---------------------------------------------------------------------------------------------
# commands
# ---------------------------------------------------------------------------------------------


def cmd_lengths(args) -> int:
    from workbench.data import summarize

    ls = load_source(args, args.max_len)
    summary = summarize(ls.lengths)
    if args.json:
        out = dict(summary)
        out["source"] = ls.source
        out["provenance"] = ls.provenance
        if ls.policy_report is not None:
            out["max_context"] = _report_dict(ls.policy_report)
        print(dumps(out))
        return 0
    print(f"{ls.source}: {summary['count']:,} sequences, {summary['tokens']:,} tokens")
    print(f"  p50 {summary['p50']:,.0f}   p90 {summary['p90']:,.0f}   p99 {summary['p99']:,.0f}   max {summary['max']:,}")
    for k, v in summary["token_share_over"].items():
        print(f"  tokens in sequences over {int(k):>7,}: {100 * v:5.1f}%")
    if ls.provenance.get("estimate"):
        print(f"  note: {ls.provenance.get('note', 'lengths are an estimate')}")
    return 0


def _report_dict(rep) -> dict:
    import dataclasses

    d = dataclasses.asdict(rep) if dataclasses.is_dataclass(rep) else dict(rep)
    d["description"] = rep.describe()
    return d


def cmd_cost(args) -> int:
    lengths = _int_list(args.lengths, "--lengths")
    degrees = _int_list(args.degrees, "--degrees")
    cost = build_cost(args)
    bad = [d for d in degrees if d > cost.cluster.num_gpus]
    if bad:
        raise CliError(f"--degrees {bad} exceed --gpus {cost.cluster.num_gpus}")
    table = cost.table(lengths, degrees)
    if args.json:
        print(dumps(table))
        return 0
    print(f"{cost.model.name} on {cost.profile.name} ({cost.strategy}), budget {table['memory_budget_gb']:.2f} GB/GPU "
          f"for activations, group overhead {cost.group_overhead_ms(1):.1f} ms")
    print(f"{'length':>9} {'degree':>6} {'time_ms':>11} {'memory_gb':>10} feasible")
    for r in table["rows"]:
        t = f"{r['time_ms']:11.1f}" if r["time_ms"] is not None else f"{'-':>11}"
        print(f"{r['length']:>9,} {r['degree']:>6} {t} {r['memory_gb']:10.2f} {'yes' if r['feasible'] else 'no'}")
    return 0


def _is_list_source(text: str) -> bool:
    return all(part.strip().isdigit() for part in text.split(",")) and "," in text or text.strip().isdigit()


def _resolve_max_len(args, cost) -> int | None:
    if args.max_len is not None:
        return args.max_len
    if _is_list_source(args.lengths):
        return None  # an explicit batch is planned as given; too long a sequence is an error, not clipped
    m = default_max_len(cost)
    _say(f"max context {m:,} tokens (the largest power of two {cost.cluster.num_gpus} GPUs hold on one group; "
         f"set --max-len to change)")
    return m


def cmd_plan(args) -> int:
    from workbench.solve import run_planner, validate

    cost = build_cost(args)
    max_len = _resolve_max_len(args, cost)
    ls = load_source(args, max_len)
    (bid, batch), = make_batches(ls, args, 1)
    plan = run_planner(args.planner, batch, cost, seed=args.seed, time_limit=args.time_limit, max_len=max_len,
                       batch_id=bid)
    validate(plan, batch, cost.cluster, cost)
    if args.json:
        print(dumps(plan.to_dict()))
        return 0
    print(f"{plan.planner} [{plan.status}] {len(batch)} sequences, {int(batch.sum()):,} tokens on {cost.cluster.num_gpus} GPUs")
    print(f"  makespan {plan.makespan_ms:,.1f} ms, lower bound {plan.lower_bound_ms:,.1f} ms (gap {plan.gap:.1%}), "
          f"solved in {plan.solve_seconds:.2f}s")
    if plan.reason:
        print(f"  {plan.reason}")
    for m, ms in enumerate(plan.micro_steps):
        by_deg: dict[int, list] = {}
        for g in ms.groups:
            by_deg.setdefault(g.degree, []).append(g)
        desc = ", ".join(f"{len(v)}x degree {d} ({sum(len(g.sequences) for g in v)} seqs, "
                         f"max {max(g.time_ms for g in v):,.0f} ms)" for d, v in sorted(by_deg.items(), reverse=True))
        print(f"  micro-step {m}: {desc}")
    return 0


def _progress_printer(enabled: bool):
    last = [0.0]

    def show(frac: float, msg: str) -> None:
        now = time.monotonic()
        if enabled and (now - last[0] > 1.0 or frac >= 1.0):
            last[0] = now
            _say(f"[{100 * frac:5.1f}%] {msg}")

    return show


def cmd_simulate(args) -> int:
    from workbench.simulate import simulate

    cost = build_cost(args)
    max_len = _resolve_max_len(args, cost)
    ls = load_source(args, max_len)
    planners = [p.strip() for p in args.planners.split(",") if p.strip()]
    if not planners:
        raise CliError("--planners is empty; e.g. --planners static-max,greedy,flexsp")
    from workbench.solve import get_planner

    for p in planners:
        get_planner(p)  # unknown names fail before any work
    batches = make_batches(ls, args, args.steps)
    res = simulate(batches, cost, planners, seed=args.seed, time_limit=args.time_limit, max_len=max_len,
                   progress=_progress_printer(not args.quiet))
    if args.json:
        print(dumps(res.to_dict(include_steps=args.steps_detail)))
        return 0 if res.planners else 2
    print(format_sim_table(res.to_dict(include_steps=False)))
    for name, err in res.errors.items():
        print(f"  {name}: could not plan: {err}")
    return 0 if res.planners else 2


def format_sim_table(sim: dict, baselines=("static-max", "best-static")) -> str:
    """A plain-text table of a simulation summary."""
    rows = sim["planners"]
    head = f"{'planner':<14}{'mean step (s)':>14}{'p95 (s)':>9}{'x lower bound':>14}{'imbalance':>10}"
    bl = [b for b in baselines if b in rows]
    head += "".join(f"{'vs ' + b:>17}" for b in bl)
    lines = [head]
    for name, r in rows.items():
        line = (f"{name:<14}{r['mean_step_ms'] / 1e3:>14.2f}{r['p95_step_ms'] / 1e3:>9.2f}"
                f"{r['ratio_to_lower_bound']:>14.3f}{r['imbalance']:>10.2f}")
        line += "".join(f"{rows[b]['mean_step_ms'] / r['mean_step_ms']:>16.2f}x" for b in bl)
        lines.append(line)
    return "\n".join(lines)


def cmd_demo(args) -> int:
    from workbench.demo import run_demo

    run_dir = run_demo(run_root=Path(args.run_root), steps=args.steps, time_limit=args.time_limit,
                       planners=[p for p in args.planners.split(",") if p], seed=args.seed, samples=args.samples)
    print(run_dir)
    return 0


# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="workbench", description="Plan and run heterogeneous sequence-parallel training.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    q = sub.add_parser("lengths", help="summarise a length source")
    q.add_argument("source", metavar="SOURCE", help="family name, file, or comma-separated lengths")
    _add_data_args(q, source_flag=False)
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_lengths, lengths=None)

    q = sub.add_parser("cost", help="print the cost model the planners use")
    q.add_argument("--lengths", required=True, metavar="L1,L2,...")
    q.add_argument("--degrees", default="1,2,4,8,16,32,64", metavar="D1,D2,...")
    _add_cluster_args(q)
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_cost)

    q = sub.add_parser("plan", help="plan one step's batch")
    _add_data_args(q, source_flag=True)
    _add_cluster_args(q)
    _add_batch_args(q)
    q.add_argument("--planner", default="flexsp", help="planner name (default flexsp)")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_plan)

    q = sub.add_parser("simulate", help="replay planners over K steps against the cost model")
    _add_data_args(q, source_flag=True)
    _add_cluster_args(q)
    _add_batch_args(q)
    q.add_argument("--planners", default=",".join(DEFAULT_PLANNERS), metavar="A,B,...")
    q.add_argument("--steps", type=int, default=5, metavar="K")
    q.add_argument("--steps-detail", action="store_true", help="with --json: include every step's figures")
    q.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_simulate)

    q = sub.add_parser("demo", help="lengths -> simulate on the embedded defaults; writes runs/<id>/report.html")
    q.add_argument("--run-root", default="runs", metavar="DIR")
    q.add_argument("--steps", type=int, default=4, metavar="K")
    q.add_argument("--time-limit", type=float, default=1.0, metavar="S")
    q.add_argument("--planners", default=",".join(DEFAULT_PLANNERS))
    q.add_argument("--samples", type=int, default=200_000)
    q.add_argument("--seed", type=int, default=0)
    q.set_defaults(func=cmd_demo)

    try:
        from workbench.launch import torchrun as _launch  # imports no torch
    except ModuleNotFoundError:
        _launch = None
    if _launch is not None and hasattr(_launch, "add_train_arguments"):
        q = sub.add_parser("train", help="launch a real multi-process training run under torchrun")
        _launch.add_train_arguments(q)
        q.set_defaults(func=_launch.train_main)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``workbench`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (CliError, ValueError, FileNotFoundError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"workbench {args.command}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"workbench {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
