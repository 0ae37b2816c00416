"""``workbench`` command line: lengths, cost, plan, simulate, demo, train, export, runs, doctor, gpu-check.

Thin: it parses, builds a :class:`~workbench.scenario.Scenario` (or a run), calls the library and
prints. The shapes printed with ``--json`` are the stable interface of DESIGN.md (strict JSON).
Bad input exits with status 2 and one line on stderr saying what was wrong and how to fix it.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import sys
import time
from pathlib import Path

from workbench.cost.offload import OFFLOAD_CHOICES
from workbench.scenario import DEFAULT_PLANNERS, DEFAULT_STRATEGY, STRATEGIES, Scenario
from workbench.solve.effort import DEFAULT_EFFORT
from workbench.simulate import summary_table
from workbench.util import dumps, positive_float, positive_int

DEFAULT_MODEL = "7b"
DEFAULT_PROFILE = "a100-40g-flexsp"
DEFAULT_GPUS = 64

# Scenario fields as the CLI names them, so that a Scenario error speaks in flags
_FLAGS = {"num_gpus": "--gpus", "gpus_per_node": "--gpus-per-node", "gpu_memory_gb": "--gpu-memory",
          "memory_fraction": "--memory-fraction", "zero_stage": "--zero-stage", "source": "--lengths",
          "max_len": "--max-len", "batch_tokens": "--batch-tokens", "batch_size": "--batch-size",
          "time_limit": "--time-limit", "effort": "--effort", "samples": "--samples", "seed": "--seed", "policy": "--policy",
          "model": "--model", "profile": "--profile", "planner": "--planner", "degrees": "--degrees",
          "precision": "--precision", "optimizer": "--optimizer", "tokenizer": "--tokenizer", "column": "--column",
          "init": "--init", "offload": "--offload", "host_memory_gb": "--host-memory"}


class CliError(Exception):
    """Bad input found by the CLI itself."""


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _flagged(msg: str) -> str:
    """A Scenario message with its field names replaced by the CLI's flags."""
    return re.sub(r"Scenario\.(\w+)", lambda m: _FLAGS.get(m.group(1), m.group(1)), msg)


def _positive_list(text: str, what: str) -> list[int]:
    from workbench.data import parse_length_list

    try:
        return [int(x) for x in parse_length_list(text)]
    except ValueError as e:
        raise CliError(f"{what}: {str(e).split(': ', 1)[-1]}") from None


# ---------------------------------------------------------------------------------------------
# shared options
# ---------------------------------------------------------------------------------------------


def _add_data_args(p: argparse.ArgumentParser, source_flag: bool) -> None:
    if source_flag:
        p.add_argument("--lengths", required=True, metavar="SOURCE",
                       help="family name (wikipedia, commoncrawl, github, byted, uniform, lognormal, stdlib), "
                            "a file, or a comma-separated list of lengths taken in order as the whole batch")
    p.add_argument("--max-len", type=positive_int, default=None, metavar="N",
                   help="max context; longer sequences are handled by --policy (plan/simulate default: the "
                        "largest power of two the cluster can hold, at most the model's max context)")
    p.add_argument("--policy", default="clip", choices=["clip", "split", "drop", "error"],
                   help="what to do with sequences over --max-len (default clip; always reported)")
    p.add_argument("--samples", type=positive_int, default=None, metavar="N",
                   help="sequences to generate from a family or draw from a file (default: family 100000, file all)")
    p.add_argument("--seed", type=int, default=0, help="seeds data sampling and planners")
    p.add_argument("--column", default=None, help="CSV/Parquet/JSONL/dataset column holding lengths or text")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="local Hugging Face tokenizer (tokenizer.json or its folder) for text sources")


def _add_cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpus", type=int, default=DEFAULT_GPUS, metavar="N", help=f"GPUs (default {DEFAULT_GPUS})")
    p.add_argument("--gpus-per-node", type=positive_int, default=8, metavar="G", help="GPUs per node (default 8)")
    p.add_argument("--gpu-memory", type=positive_float, default=None, metavar="GB",
                   help="memory per GPU in GB (default: the profile's GPU)")
    p.add_argument("--memory-fraction", type=float, default=None,
                   help="share of GPU memory plans may fill (default: the profile's, 0.9 on h100-80g where the memory "
                        "model was measured; else 0.7, as FlexSP's 28 of 40 GB)")
    p.add_argument("--offload", default=None, choices=list(OFFLOAD_CHOICES),
                   help="block inputs to host memory and the MLP in token tiles (needs --recompute): none, inputs (every "
                        "group), auto (the default: a group offloads only when it does not fit the GPU otherwise)")
    p.add_argument("--host-memory", type=positive_float, default=None, metavar="GB",
                   help="host memory per node for offloaded activations (default: the profile's)")
    p.add_argument("--zero-stage", type=int, default=3, choices=[0, 1, 2, 3],
                   help="ZeRO stage (default 3: lockstep passes; 0-2: free micro-steps, replicated parameters)")
    p.add_argument("--precision", default=None, choices=["bf16", "fp32"],
                   help="activation and collective precision (default: the model's, bf16; fp32 for tiny)")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd-momentum", "sgd"],
                   help="optimizer whose states the memory model counts (default adamw)")
    p.add_argument("--model", default=DEFAULT_MODEL, metavar="NAME|PATH",
                   help=f"model preset (default {DEFAULT_MODEL}) or a Hugging Face config.json (or its folder)")
    p.add_argument("--profile", default=DEFAULT_PROFILE, metavar="NAME|PATH",
                   help=f"hardware profile: shipped name or JSON file (default {DEFAULT_PROFILE})")
    p.add_argument("--strategy", default=DEFAULT_STRATEGY, type=_strategy, metavar="|".join(STRATEGIES[:3]) + "|cp:C",
                   help="how a group splits its attention: ulysses (heads scattered, capped by the heads), cp "
                        "(context parallelism, K/V all-gathered; ring is its older name), auto (each group the "
                        f"fastest split u x cp that fits; default {DEFAULT_STRATEGY})")
    p.add_argument("--recompute", action="store_true", help="full activation recomputation (less memory, more time)")


def _add_batch_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--batch-tokens", type=positive_int, default=None, metavar="T", help="global batch by token budget")
    g.add_argument("--batch-size", type=positive_int, default=None, metavar="B", help="global batch by sequence count")
    p.add_argument("--effort", type=positive_float, default=DEFAULT_EFFORT, metavar="E",
                   help=f"how much the planner searches per step, in reference seconds (default {DEFAULT_EFFORT:g}: "
                        f"about a second on 2 cores); plans depend only on the inputs, --seed and --effort")
    p.add_argument("--time-limit", type=positive_float, default=None, metavar="S",
                   help="wall-clock safety cap per step (s; default: ten times the effort and more)")
    p.add_argument("--degrees", default=None, metavar="D1,D2,...",
                   help="candidate SP group sizes, any integers up to --gpus (default: every size up to a node, whole "
                        "nodes in twos and threes, the cluster; docs/solver.md)")


def _strategy(text: str) -> str:
    """argparse type of --strategy: a strategy name or cp:C (``workbench.cost.strategy_problem``)."""
    from workbench.cost import strategy_problem

    problem = strategy_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def scenario_from_args(args, **extra) -> Scenario:
    """The Scenario the parsed options describe (planning commands). Raises CliError in flags."""
    from workbench.data import is_length_list

    if getattr(args, "gpus", 1) < 1:
        raise CliError(f"--gpus must be at least 1, got {args.gpus}")
    fields = dict(model=args.model, profile=args.profile, num_gpus=args.gpus, gpus_per_node=args.gpus_per_node,
                  gpu_memory_gb=args.gpu_memory, memory_fraction=args.memory_fraction, zero_stage=args.zero_stage,
                  strategy=args.strategy, recompute=args.recompute, precision=args.precision, optimizer=args.optimizer,
                  offload=args.offload, host_memory_gb=args.host_memory)
    if hasattr(args, "policy"):
        fields.update(source=getattr(args, "source", None) or args.lengths, samples=args.samples, seed=args.seed,
                      column=args.column, tokenizer=args.tokenizer, max_len=args.max_len, policy=args.policy)
    if hasattr(args, "batch_tokens"):
        fields.update(batch_tokens=args.batch_tokens, batch_size=args.batch_size, effort=args.effort,
                      time_limit=args.time_limit)
        if getattr(args, "degrees", None):
            fields["degrees"] = tuple(_positive_list(args.degrees, "--degrees"))
        if args.batch_tokens is None and args.batch_size is None and not is_length_list(fields["source"]):
            raise CliError(f"give --batch-tokens T or --batch-size B to draw global batches from {fields['source']!r} "
                           f"(or pass the batch itself as --lengths L1,L2,...)")
    fields.update(extra)
    try:
        sc = Scenario(**{k: v for k, v in fields.items() if v is not None})
        sc.cost()  # a cluster that cannot hold the model states fails here, in one line
    except ValueError as e:
        raise CliError(_flagged(str(e))) from None
    return sc


def _tokenise_with_progress(source: str, column: str | None, tokenizer: str | None) -> None:
    """Build the token cache of a text source now, with a progress bar on a terminal (plain lines
    otherwise), so that later reads (planning, the trainer's ranks) find it ready. Nothing for a
    lengths-only source or a cache that exists."""
    from workbench.data.tokens import text_source, token_cache

    if text_source(source, column=column, tokenizer=tokenizer) is None:
        return
    bar = None
    show = _progress_printer(True)

    def progress(frac: float, msg: str) -> None:
        nonlocal bar
        if sys.stderr.isatty():
            from tqdm import tqdm

            if bar is None:
                bar = tqdm(total=100, desc="tokenise", unit="%", file=sys.stderr, dynamic_ncols=True,
                           bar_format="{desc}: {percentage:3.0f}%|{bar}| {postfix}")
            bar.n = round(100 * frac, 1)
            bar.set_postfix_str(msg.split(": ", 1)[-1])
        else:
            show(frac, msg)

    try:
        cache = token_cache(source, column=column, tokenizer=tokenizer, progress=progress, say=_say)
    finally:
        if bar is not None:
            bar.close()
    if not cache.reused:
        m = cache.meta
        _say(f"tokenised {m['documents']:,} documents, {m['tokens']:,} tokens in {m['build_seconds']:.1f}s "
             f"({m['documents_per_s']:,.0f} documents/s, {m['tokens_per_s']:,.0f} tokens/s)")
    if cache.skipped:
        ex = cache.meta.get("skipped_examples", {})
        _say("skipped " + "; ".join(f"{n:,} {why} (e.g. {cache.meta.get('unit', 'line')} "
                                    f"{', '.join(str(x) for x in ex.get(why, [])[:3])})" for why, n in cache.skipped.items()))
    if cache.meta["tokenizer"]["digest"] == "byte-level":
        _say("no --tokenizer: byte-level tokens (1 per UTF-8 byte, ids 0..255)")


def _max_len_note(sc: Scenario) -> None:
    if sc.max_len is None and sc.resolved_max_len() is not None:
        _say(f"max context {sc.resolved_max_len():,} tokens (the largest power of two {sc.num_gpus} GPUs hold on one "
             f"group; set --max-len to change)")
    ls = sc.lengths_set()
    if ls.policy_report is not None and ls.policy_report.affected_sequences:
        _say(f"max context: {ls.policy_report.describe()}")


# ---------------------------------------------------------------------------------------------
# planning commands
# ---------------------------------------------------------------------------------------------


def cmd_lengths(args) -> int:
    from workbench.data import load_lengths, summarize

    _tokenise_with_progress(args.source, args.column, args.tokenizer)
    ls = load_lengths(args.source, samples=args.samples, seed=args.seed, max_len=args.max_len, policy=args.policy,
                      column=args.column, tokenizer=args.tokenizer)
    if ls.policy_report is not None and ls.policy_report.affected_sequences:
        _say(f"max context: {ls.policy_report.describe()}")
    summary = summarize(ls.lengths)
    if args.json:
        out = dict(summary)
        out["source"] = ls.source
        out["provenance"] = ls.provenance
        if ls.policy_report is not None:
            out["max_context"] = ls.policy_report.to_dict()
        print(dumps(out))
        return 0
    print(f"{ls.source}: {summary['count']:,} sequences, {summary['tokens']:,} tokens")
    print(f"  p50 {summary['p50']:,.0f}   p90 {summary['p90']:,.0f}   p99 {summary['p99']:,.0f}   max {summary['max']:,}")
    for k, v in summary["token_share_over"].items():
        print(f"  tokens in sequences over {int(k):>7,}: {100 * v:5.1f}%")
    if ls.provenance.get("estimate"):
        print(f"  note: {ls.provenance.get('note', 'lengths are an estimate')}")
    return 0


def cmd_cost(args) -> int:
    lengths = _positive_list(args.lengths, "--lengths")
    cps = _positive_list(args.cp, "--cp") if args.cp else None
    sc = scenario_from_args(args)
    cost = sc.cost()
    # without --degrees, the cluster's own candidates (it stopped on 6 GPUs with "--degrees [8, 16, 32, 64]
    # exceed --gpus 6" when nobody had given any)
    degrees = _positive_list(args.degrees, "--degrees") if args.degrees else list(cost.cluster.degrees)
    bad = [d for d in degrees if d > cost.cluster.num_gpus]
    if bad:
        raise CliError(f"--degrees {bad} exceed --gpus {cost.cluster.num_gpus}")
    try:
        table = cost.table(lengths, degrees, cps)
    except ValueError as e:
        raise CliError(f"--cp: {e}") from None
    if args.json:
        print(dumps(table))
        return 0
    print(f"{cost.model.name} on {cost.profile.name} ({cost.strategy}: Ulysses up to {table['ulysses_limit']} by "
          f"{cost.model.heads} query / {cost.model.kv_heads} KV heads), budget {table['memory_budget_gb']:.2f} GB/GPU "
          f"for activations" + (f" (after {cost.loss_working_gb:.2f} GB for the chunked loss)" if cost.loss_working_gb
                                else f" (with the whole logits' backward, {cost.loss_bytes_per_token / 1e6:.2f} MB a "
                                     f"token)" if cost.loss_bytes_per_token else "")
          + f", group overhead {cost.group_overhead_ms(1):.1f} ms")
    if cost.can_offload:
        print(f"offload {cost.offload}: up to {cost.host_budget_gb:,.0f} GB of host memory per GPU at "
              f"{cost.host_link_gbps:g} GB/s; a sequence longer than any group holds otherwise (over {cost.plain_limit:,} tokens) "
              f"offloads its group's block inputs (docs/offload.md)")
    else:
        print(f"offload: none ({cost.offload_note})")
    # the link figures of these degrees' shapes that are interpolated or extrapolated, not measured (issue 35)
    print(cost.estimated_links_note(degrees))
    print(f"{'length':>9} {'degree':>6} {'u x cp':>7} {'time_ms':>11} {'ulysses_ms':>10} {'cp_ms':>9} {'memory_gb':>10} "
          f"{'host_gb':>8} fits")
    def num(r, k, w):
        return f"{r[k]:{w}.1f}" if r[k] is not None else f"{'-':>{w}}"

    for r in table["split_rows"]:
        mark = "" if r["in_strategy"] else "  (not in --strategy " + cost.strategy + ")"
        print(f"{r['length']:>9,} {r['degree']:>6} {str(r['ulysses']) + 'x' + str(r['cp']):>7} {num(r, 'time_ms', 11)} "
              f"{num(r, 'ulysses_ms', 10)} {num(r, 'cp_ms', 9)} {r['memory_gb']:10.2f} {r['host_gb']:8.2f} "
              f"{'yes' if r['feasible'] else 'no'}{mark}")
    unsupported = [r for r in table["rows"] if r["time_ms"] is None]
    for r in unsupported[:1]:
        print(f"  degree {r['degree']}: {cost.degree_limit_reason(r['degree']) or 'more than --gpus'}")
    return 0


def cmd_plan(args) -> int:
    sc = scenario_from_args(args, planner=args.planner)
    _tokenise_with_progress(sc.source, sc.column, sc.tokenizer)
    _max_len_note(sc)
    try:
        plan = sc.plan()
    except ValueError as e:
        raise CliError(_flagged(str(e))) from None
    batch_len = plan.num_sequences
    if args.json:
        print(dumps(plan.to_dict()))
        return 0
    tokens = sum(sum(g.lengths) for m in plan.micro_steps for g in m.groups)
    print(f"{plan.planner} [{plan.status}] {batch_len} sequences, {tokens:,} tokens on {sc.num_gpus} GPUs")
    print(f"  makespan {plan.makespan_ms:,.1f} ms, lower bound {plan.lower_bound_ms:,.1f} ms (gap {plan.gap:.1%}), "
          f"solved in {plan.solve_seconds:.2f}s")
    used = {r for ms in plan.micro_steps for g in ms.groups for r in g.ranks}
    print(f"  idle GPU-time {plan.idle_share:.1%} of the step" + (
        f" ({plan.num_gpus - len(used)} of {plan.num_gpus} GPUs in no group)" if len(used) < plan.num_gpus else ""))
    if plan.execution == "lockstep":
        print(f"  ZeRO-{plan.zero_stage}: {len(plan.micro_steps)} lockstep pass(es), every rank in every pass; a pass lasts "
              f"as long as its busiest rank (at least FSDP's {plan.pass_comm_ms:,.0f} ms of gathers and reduces) "
              f"+ {plan.pass_overhead_ms:,.0f} ms")
    else:
        print(f"  ZeRO-{plan.zero_stage}: {len(plan.micro_steps)} barrier-free micro-step(s), then "
              f"{plan.grad_sync_ms:,.0f} ms of gradient sync")
    from workbench.solve.ahead import plan_lengths
    from workbench.solve.bound import step_bound_ms

    lengths = plan_lengths(plan)
    if plan.execution == "lockstep" and len(lengths) > 256:
        # 3-20 s from a few hundred sequences up (673 Llama-3-8B sequences on 64 H100s: 20 s)
        print(f"# the lockstep pass bound over {len(lengths):,} sequences (linear programmes: seconds)...",
              file=sys.stderr, flush=True)
    pb = step_bound_ms(lengths, sc.cost(), [plan])
    if pb > plan.lower_bound_ms * (1 + 1e-9):
        print(f"  packing bound {pb:,.1f} ms (gap {plan.makespan_ms / pb - 1:.1%}): no plan is faster, each sequence counted whole")
    if plan.reason:
        print(f"  {plan.reason}")
    _offload_lines(sc, plan)
    for m, ms in enumerate(plan.micro_steps):
        by_shape: dict[tuple[int, int], list] = {}
        for g in ms.groups:
            by_shape.setdefault((g.degree, g.cp), []).append(g)
        desc = ", ".join(f"{len(v)}x degree {d}{f' ({d // c}x{c})' if c > 1 else ''} ({sum(len(g.sequences) for g in v)} "
                         f"seqs, max {max(g.time_ms for g in v):,.0f} ms)" for (d, c), v in sorted(by_shape.items(), reverse=True))
        if ms.time_ms is not None:
            print(f"  pass {m} ({ms.time_ms:,.0f} ms): {desc}")
        else:
            print(f"  micro-step {m}: {desc}")
    return 0


def _offload_lines(sc: Scenario, plan) -> None:
    """What ``workbench plan`` says of memory: the longest single sequence the cluster holds without
    offload and with it, and, for the group that needs most, its memory by part on the GPU and in
    host memory."""
    cost = sc.cost()
    plain = sc.replace(offload="none").cost().longest_sequence()
    if cost.can_offload:
        print(f"  longest sequence this cluster holds: {plain:,} tokens without offload, {cost.longest_sequence():,} with "
              f"(block inputs in host memory: {cost.host_budget_gb:,.0f} GB per GPU, {cost.host_link_gbps:g} GB/s each)")
    else:
        print(f"  longest sequence this cluster holds: {plain:,} tokens (no offload: {cost.offload_note})")
    groups = [g for ms in plan.micro_steps for g in ms.groups]
    if not groups:
        return
    g = max(groups, key=lambda g: (g.memory_gb, g.host_gb))
    parts = cost.memory_breakdown(g.lengths, g.degree, g.cp, g.offload, g.swap_layers)
    gpu = ", ".join(f"{k} {v:,.1f}" for k, v in parts["gpu"].items() if v > 0.05)
    host = ", ".join(f"{k} {v:,.1f}" for k, v in parts["host"].items() if v > 0.05) or "nothing"
    offloaded = [x for x in groups if x.offload != "none"]
    swapped = [x for x in groups if x.swap_layers]
    print(f"  memory of the fullest group (degree {g.degree}, {g.split}, offload {g.offload}, {g.swap_layers} block(s) "
          f"swapped), GB per GPU: {gpu} of {sc.cluster().gpu_memory_gb:g}; host: {host}")
    if offloaded:
        print(f"  {len(offloaded)} group(s) offload their block inputs to host memory and run the MLP in tiles")
    if swapped:
        print(f"  {len(swapped)} group(s) keep whole blocks' activations in host memory instead of recomputing them "
              f"({', '.join(str(x.swap_layers) for x in swapped[:8])}{'...' if len(swapped) > 8 else ''} of "
              f"{cost.model.layers} blocks)")


def _progress_printer(enabled: bool):
    last = [0.0]

    def show(frac: float, msg: str) -> None:
        now = time.monotonic()
        if enabled and (now - last[0] > 1.0 or frac >= 1.0):
            last[0] = now
            _say(f"[{100 * frac:5.1f}%] {msg}")

    return show


def cmd_simulate(args) -> int:
    planners = [p.strip() for p in args.planners.split(",") if p.strip()]
    if not planners:
        raise CliError("--planners is empty; e.g. --planners static-max,greedy,flexsp")
    if args.steps < 1:
        raise CliError(f"--steps must be at least 1, got {args.steps}")
    sc = scenario_from_args(args)
    _tokenise_with_progress(sc.source, sc.column, sc.tokenizer)
    _max_len_note(sc)
    res = sc.simulate(planners, steps=args.steps, progress=_progress_printer(not args.quiet))
    if args.json:
        print(dumps(res.to_dict(include_steps=args.steps_detail)))
        return 0 if res.planners else 2
    print(summary_table(res.to_dict(include_steps=False)))
    for name, err in res.errors.items():
        print(f"  {name}: could not plan: {err}")
    return 0 if res.planners else 2


def cmd_demo(args) -> int:
    from workbench import runs
    from workbench.demo import run_demo

    if args.steps < 1:
        raise CliError(f"--steps must be at least 1, got {args.steps}")
    if args.own_steps < 0 or (args.own_steps and args.no_train):
        raise CliError(f"--own-steps must be 0 or more, and 0 with --no-train; got {args.own_steps}"
                       + (" with --no-train" if args.no_train else ""))
    try:
        run = run_demo(root=args.run_root or runs.default_root(), train_steps=args.steps, train=not args.no_train,
                       effort=args.effort, seed=args.seed, samples=args.samples, log=_say, own_steps=args.own_steps)
    except RuntimeError as e:
        _say(f"workbench demo: error: {e}")
        return 1
    print(run.file("report.html"))
    return 0


# ---------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------

_TRAIN_SETTINGS = ("model", "source", "samples", "column", "tokenizer", "init", "max_len", "policy", "batch_tokens",
                   "batch_size", "planner",
                   "effort", "time_limit", "profile", "gpu_memory_gb", "attention", "steps", "seed", "optimizer", "lr",
                   "weight_decay", "momentum", "grad_clip", "checkpoint_every", "plan_ahead", "timeout_s", "device",
                   "nproc", "nnodes", "zero_stage", "precision", "recompute", "memory_fraction", "degrees",
                   "strategy", "torch_profile", "offload", "host_memory_gb")


def _add_train_arguments(p: argparse.ArgumentParser) -> None:
    from workbench.training import ATTENTION, DEVICES, OPTIMIZERS

    g = p.add_argument_group("processes")
    g.add_argument("--nproc", type=positive_int, default=None, metavar="N",
                   help="processes (GPUs) per node (new run: default 1; a resumed run keeps its own)")
    g.add_argument("--nnodes", type=positive_int, default=None, metavar="N", help="nodes (default 1)")
    g.add_argument("--node-rank", type=int, default=0, metavar="R", help="this node's rank (multi-node)")
    g.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="rendezvous endpoint (multi-node; a single node binds 127.0.0.1 only)")
    g.add_argument("--rdzv-id", default=None, metavar="ID", help="rendezvous id (default: the run id)")
    g.add_argument("--rdzv-timeout", type=positive_float, default=None, metavar="S",
                   help="how long a node waits to reach the endpoint, or node 0 for the others (default 600)")
    g.add_argument("--device", default=None, choices=DEVICES, help="auto (CUDA when available), cpu, cuda")
    g.add_argument("--oversubscribe", action="store_true",
                   help="start even with more processes than the machine's cores or memory hold")
    g = p.add_argument_group("run")
    g.add_argument("--model", default=None, metavar="NAME|PATH",
                   help="model preset (default tiny) or a Hugging Face config.json (or its folder): Llama 2/3/3.1/3.2, "
                        "Mistral, Qwen2/2.5")
    g.add_argument("--init", default=None, metavar="PATH",
                   help="start from these weights: a safetensors file or a Hugging Face model folder (sharded or "
                        "not), checked strictly against --model (default: random weights from --seed)")
    g.add_argument("--lengths", dest="source", default=None, metavar="SOURCE",
                   help="stdlib (default: the embedded corpus, one document per sequence), your text (a document, a "
                        "folder of them, JSONL/CSV/Parquet with a text column, a saved dataset: tokenised once into "
                        "the token cache), a family or lengths file (windows of the stdlib bytes), or L1,L2,... "
                        "(that batch every step)")
    g.add_argument("--samples", type=positive_int, default=None, metavar="N", help="sequences drawn from the source")
    g.add_argument("--column", default=None, help="file column holding lengths or text")
    g.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="local Hugging Face tokenizer (tokenizer.json or its folder) for a text source; without it "
                        "text is tokenised byte-level (1 token per UTF-8 byte)")
    g.add_argument("--max-len", type=positive_int, default=None, metavar="N",
                   help="max context (default: 1024 on CPU, what the cluster holds on CUDA; at most the model's)")
    g.add_argument("--policy", default=None, choices=["clip", "split", "drop", "error"],
                   help="sequences over --max-len (default split: every token kept; always reported)")
    b = g.add_mutually_exclusive_group()
    b.add_argument("--batch-tokens", type=positive_int, default=None, metavar="T",
                   help="global batch token budget (default 16384)")
    b.add_argument("--batch-size", type=positive_int, default=None, metavar="B", help="global batch in sequences")
    g.add_argument("--planner", default=None, help="planner (default greedy)")
    g.add_argument("--effort", type=positive_float, default=None, metavar="E",
                   help=f"planner search per step in reference seconds (default {DEFAULT_EFFORT:g})")
    g.add_argument("--time-limit", type=positive_float, default=None, metavar="S",
                   help="planner wall-clock safety cap per step (s)")
    g.add_argument("--profile", default=None, metavar="NAME|PATH",
                   help="profile for the cost model (default on CPU: this machine's quick profile for the "
                        "processes, when the run store holds one, else cpu-gloo-tiny; a100-40g-flexsp on CUDA)")
    g.add_argument("--gpu-memory", dest="gpu_memory_gb", type=positive_float, default=None, metavar="GB",
                   help="memory per device for the cost model (default: the profile's)")
    g.add_argument("--memory-fraction", type=positive_float, default=None, metavar="F",
                   help="share of device memory plans may fill (default 0.7)")
    g.add_argument("--degrees", default=None, metavar="D1,D2,...",
                   help="candidate SP group sizes, any integers up to the world size (default: every size up to a node, "
                        "whole nodes in twos and threes, the world)")
    g.add_argument("--strategy", default=None, type=_strategy, metavar="|".join(STRATEGIES[:3]) + "|cp:C",
                   help=f"how each group splits its attention (default {DEFAULT_STRATEGY}): ulysses (heads), cp "
                        f"(context parallelism; ring is its older name), auto (each group its fastest split u x cp)")
    g.add_argument("--offload", default=None, choices=list(OFFLOAD_CHOICES),
                   help="which offload levels plans may use (default auto: a group offloads its block inputs only "
                        "when no group holds its sequence without; needs --recompute; docs/offload.md)")
    g.add_argument("--host-memory", dest="host_memory_gb", type=positive_float, default=None, metavar="GB",
                   help="host memory per node for offloaded activations (default: the profile's)")
    g.add_argument("--attention", default=None, choices=ATTENTION, help="attention backend (default auto)")
    g.add_argument("--zero-stage", type=int, default=None, choices=[0, 1, 2, 3],
                   help="how model states are held, planned and run (default 3: FSDP2, lockstep passes; 0-2 keep "
                        "parameters replicated and run micro-steps free; a resumed run keeps its own)")
    g.add_argument("--precision", default=None, choices=["fp32", "bf16"],
                   help="compute precision, planned and run (default bf16 on CUDA, fp32 on CPU; master weights, "
                        "gradient reduction and optimizer states stay fp32)")
    r = g.add_mutually_exclusive_group()
    r.add_argument("--recompute", dest="recompute", action="store_const", const=True, default=None,
                   help="checkpoint every block (recompute its activations in backward), planned and run")
    r.add_argument("--no-recompute", dest="recompute", action="store_const", const=False,
                   help="keep every activation (the default; with --run-dir --change, turn recompute off)")
    g.add_argument("--steps", type=positive_int, default=None, metavar="K",
                   help="optimizer steps in total (required for a new run; a resumed run goes on up to K)")
    g.add_argument("--seed", type=int, default=None, help="seeds weights, batches and plans (default 0)")
    g.add_argument("--optimizer", default=None, choices=OPTIMIZERS, help="default adamw")
    g.add_argument("--lr", type=positive_float, default=None, help="learning rate (default sgd 0.05, adamw 1e-3)")
    g.add_argument("--weight-decay", type=float, default=None)
    g.add_argument("--momentum", type=float, default=None, help="SGD momentum (default 0)")
    g.add_argument("--grad-clip", type=float, default=None, metavar="NORM", help="clip the gradient norm (0: off)")
    g.add_argument("--checkpoint-every", type=int, default=None, metavar="K",
                   help="checkpoint every K steps and after the last (default 100; 0: never)")
    g.add_argument("--no-plan-ahead", dest="plan_ahead", action="store_const", const=False, default=None,
                   help="plan each step inline instead of one step ahead")
    g.add_argument("--timeout", dest="timeout_s", type=positive_float, default=None, metavar="S",
                   help="collective timeout: a rank waiting longer fails (default 600)")
    g.add_argument("--torch-profile", nargs="?", const=0, type=positive_int, default=None, metavar="STEP",
                   help="record step STEP (default: the second this attempt runs) with torch.profiler on every rank: "
                        "a Chrome trace per rank in the run folder, torch-trace-step<STEP>-rank<k>.json")
    g = p.add_argument_group("where")
    g.add_argument("--run-dir", default=None, metavar="DIR",
                   help="resume this existing run from its latest good checkpoint (it keeps its settings)")
    g.add_argument("--change", action="store_true",
                   help="with --run-dir: apply settings that differ from the run's (said on start)")
    g.add_argument("--run-root", default=None, metavar="DIR", help="where new run folders go (default runs)")
    g.add_argument("--name", default=None, metavar="ID", help="the new run's folder name (default: a fresh id)")
    g.add_argument("--detach", action="store_true", help="print the run folder and return; the run goes on")
    g.add_argument("--emit", default=None, choices=["slurm", "torchrun"],
                   help="print, instead of starting, what runs this run on --nnodes nodes: an sbatch script (slurm) "
                        "or one command per node (torchrun); the run store is --run-root (a path every node sees)")
    g.add_argument("--sbatch", action="append", default=[], metavar="OPTION=VALUE",
                   help="with --emit slurm: an extra #SBATCH option, e.g. --sbatch partition=gpu --sbatch time=04:00:00")
    g.add_argument("--quiet", action="store_true", help="no progress output")
    # test hooks: rank 0 plans for this many ranks; each step sleeps
    p.add_argument("--debug-plan-gpus", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--debug-step-sleep", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--debug-plan-zero-stage", type=int, default=None, help=argparse.SUPPRESS)


def cmd_train(args) -> int:
    """``workbench train``: prepare a new run (or check a resume), start it under the supervisor,
    show its progress, and return its exit status. Signals stop the whole run
    (``workbench.launch.terminal``)."""
    from workbench import runs, training
    from workbench.launch import process

    settings = {k: getattr(args, k) for k in _TRAIN_SETTINGS if getattr(args, k, None) is not None}
    if isinstance(settings.get("degrees"), str):
        settings["degrees"] = tuple(_positive_list(settings["degrees"], "--degrees"))
    debug = {}
    if args.debug_plan_gpus is not None:
        debug["plan_num_gpus"] = args.debug_plan_gpus
    if args.debug_step_sleep is not None:
        debug["step_sleep_s"] = args.debug_step_sleep
    if args.debug_plan_zero_stage is not None:
        debug["plan_zero_stage"] = args.debug_plan_zero_stage
    if debug:
        settings["debug"] = debug
    if settings.get("torch_profile") == 0:  # --torch-profile without a step
        settings["torch_profile"] = _default_profile_step(args.run_dir, settings.get("steps"))
    if args.emit:
        return _emit(args, settings)
    if args.sbatch:
        raise CliError("--sbatch goes with --emit slurm")
    if args.run_dir is not None:
        if args.name or args.run_root:
            raise CliError("--run-dir resumes a run; --name and --run-root are for new runs")
        run, spec, changes = training.prepare_train(settings, run_dir=args.run_dir, allow_changes=args.change)
        st = runs.read_status(run.path)
        if process.run_alive(st):
            raise CliError(f"run {run.id} is already running; stop it first (workbench runs stop {run.path})")
        if st.step >= spec.steps and st.state == "done":
            raise CliError(f"run {run.id} already completed {st.step} of {spec.steps} steps; give --steps above "
                           f"{st.step} to go on")
    else:
        if args.change:
            raise CliError("--change applies only when resuming with --run-dir")
        spec = None
    res = training.resource_args(spec, settings)
    nproc, nnodes = res["nproc"], res["nnodes"]
    for w in training.check_resources(**res, allow=args.oversubscribe):
        _say(f"workbench train: warning: {w}")
    process.supervisor_command(".", nproc=nproc, nnodes=nnodes, node_rank=args.node_rank,
                               rdzv_endpoint=args.rdzv_endpoint, rdzv_timeout=args.rdzv_timeout)  # bad counts fail here
    if spec is None:
        # a node of a run over several nodes joins the run another node made (same --name, shared --run-root)
        run, spec, changes = training.prepare_train(settings, root=args.run_root or runs.default_root(), name=args.name,
                                                    join=nnodes > 1)
    else:
        training.check_machine(spec)
        if spec.nnodes > 1:
            node_st = runs.read_status(run.path, args.node_rank)
            if process.run_alive(node_st):
                raise CliError(f"node {args.node_rank} of run {run.id} is already running; stop it first "
                               f"(workbench runs stop {run.path})")
        if changes or spec.steps != training.read_train_spec(run.path).steps:
            from workbench.util import write_json_atomic

            write_json_atomic(run.file(runs.SPEC_FILE), spec.to_dict())
        for c in changes:
            _say(f"workbench train: applying a changed setting on resume: {c.describe()}")
    sc = spec.scenario
    if not args.detach:  # tokenised here with a progress bar; otherwise the first rank does it (progress in log.txt)
        _tokenise_with_progress(sc.source, sc.column, sc.tokenizer)
    print(run.path, flush=True)
    if spec.torch_profile and not args.quiet:
        _say(f"workbench train: torch.profiler records step {spec.torch_profile} on every rank (when this attempt runs it): "
             f"{runs.torch_trace_path(run.path, spec.torch_profile, 0).name} (rank 0) and the others' in the run folder")
    handle = process.start(run, nproc=spec.nproc, nnodes=spec.nnodes, node_rank=args.node_rank,
                           rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id, stop_with_parent=not args.detach,
                           rdzv_timeout=args.rdzv_timeout)
    if args.detach:
        _say(f"workbench train: detached; follow it with `workbench runs show {run.id}`, stop it with "
             f"`workbench runs stop {run.id}`")
        return 0

    from workbench.launch.terminal import follow_in_terminal

    return follow_in_terminal(handle, name="train", follow=lambda: _follow(handle, spec, quiet=args.quiet), say=_say)


def _default_profile_step(run_dir: str | None, steps: int | None) -> int:
    """The step ``--torch-profile`` records when given no step: the second this attempt runs (the
    first pays start-up costs), or its only one."""
    from workbench import runs, training

    done = 0
    if run_dir is not None:
        try:
            done = runs.read_status(run_dir).step
            steps = steps or training.read_train_spec(run_dir).steps
        except (OSError, ValueError):
            pass  # prepare_train says what is wrong with the folder
    if not steps:
        raise CliError("--torch-profile needs --steps K (a new run) to choose its step")
    return max(1, min(done + 2, int(steps)))


def _emit(args, settings: dict) -> int:
    """``workbench train ... --emit slurm|torchrun``: print what runs this run on several nodes
    (nothing is started or written, except the run root's folder for Slurm's output file)."""
    from workbench import runs
    from workbench.training import emit_cluster

    if args.run_dir is not None:
        raise CliError("--emit writes the commands of a new run; leave --run-dir out (give --name to choose its id)")
    if args.sbatch and args.emit != "slurm":
        raise CliError("--sbatch goes with --emit slurm")
    text, spec, name = emit_cluster(args.emit, settings, run_root=args.run_root or runs.default_root(), name=args.name,
                                    endpoint=args.rdzv_endpoint, rdzv_timeout=args.rdzv_timeout, sbatch=args.sbatch)
    sys.stdout.write(text)
    sys.stdout.flush()
    _say(f"workbench train: {args.emit} {'script' if args.emit == 'slurm' else 'commands'} for run {name} on "
         f"{spec.nnodes} node(s) x {spec.nproc}; the run store "
         f"{Path(args.run_root or runs.default_root()).resolve()} must be shared by the nodes")
    return 0


def _follow(handle, spec, *, quiet: bool):
    """Show a run's progress until it ends: its start line (what the max-context policy did, the
    data, the plan-ahead mode), then a progress bar on a terminal, plain lines otherwise."""
    from workbench.launch import process

    run = handle.run
    started = shown_start = False
    bar = None
    tty = sys.stderr.isatty() and not quiet
    t0 = time.monotonic()
    first_step = None
    try:
        while True:
            st = process.poll(handle)
            cur = st or handle.run.status()
            if not shown_start and cur.state == "running" and cur.resolved:
                shown_start = True
                r = cur.resolved
                mc = (r.get("max_context") or {}).get("text")
                if not quiet:
                    _say(f"workbench train: {r.get('world_size')} rank(s), {r.get('device')}/{r.get('backend')}, "
                         f"attention {r.get('attention')}, planner {spec.scenario.planner} ({r.get('planning')})"
                         + (f"; {r['zero']}" if r.get("zero") else ""))
                    _say(f"workbench train: data: {str(r.get('data') or '').split('; max context:')[0]}")
                    if mc:
                        _say(f"workbench train: max context: {mc}")
                    if r.get("init"):
                        _say(f"workbench train: {r['init']}")
                    if cur.resumed_from is not None:
                        _say(f"workbench train: resumed from the checkpoint at step {cur.resumed_from}")
                    for why in r.get("checkpoints_skipped") or []:
                        _say(f"workbench train: warning: skipped a checkpoint: {why}")
                first_step = cur.step
                if tty:
                    from tqdm import tqdm

                    bar = tqdm(total=spec.steps, initial=cur.step, desc="train", unit="step", file=sys.stderr,
                               dynamic_ncols=True)
            for rec in process.new_steps(handle):
                if first_step is not None and rec.step <= first_step:
                    continue  # steps of an earlier attempt: not new
                started = True
                if bar is not None:
                    bar.update(max(0, rec.step - bar.n))
                    bar.set_postfix(loss=f"{rec.loss:.4f}" if rec.loss is not None else "-",
                                    ms=f"{rec.measured_ms:,.0f}" if rec.measured_ms else "-")
                elif not quiet:
                    tps = f", {rec.tokens_per_s:,.0f} tokens/s" if rec.tokens_per_s else ""
                    again = " (again, after resume)" if rec.repeat else ""
                    _say(f"step {rec.step}/{spec.steps}{again}: loss {rec.loss:.4f}, measured {rec.measured_ms:,.0f} ms, "
                         f"predicted {rec.predicted_ms:,.0f} ms{tps}")
            if st is not None:
                if bar is not None:
                    bar.close()
                    bar = None
                if not quiet and st.state == "done":
                    _say(f"workbench train: done, {max(st.step, run.status().step)} steps in {time.monotonic() - t0:.0f}s; "
                         f"{run.path}")
                return st
            time.sleep(0.3 if started else 0.2)
    finally:
        if bar is not None:
            bar.close()


def cmd_export(args) -> int:
    """``workbench export RUN --out DIR``: a run's checkpoint as a Hugging Face model folder."""
    from workbench import runs

    run = runs.load_run(args.run, root=Path(args.root) if args.root else None)
    from workbench.runtime.weights import export_run

    max_shard = None
    if args.max_shard_size:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)B?\s*", args.max_shard_size, re.IGNORECASE)
        if not m:
            raise CliError(f"--max-shard-size {args.max_shard_size!r} is not a size; write e.g. 5GB or 500MB")
        max_shard = int(float(m.group(1)) * {"": 1, "K": 1e3, "M": 1e6, "G": 1e9}[m.group(2).upper()])
    res = export_run(run.path, args.out, step=args.step, dtype=args.dtype,
                     **({"max_shard_bytes": max_shard} if max_shard else {}))
    if args.json:
        print(dumps(res))
        return 0
    tok = f"; tokenizer files {', '.join(res['tokenizer_files'])}" if res["tokenizer_files"] else ""
    print(f"{res['out']}: step {res['step']} of {run.id}, model {res['model']} ({res['params']:,} parameters), "
          f"{res['tensors']} tensors in {', '.join(res['files'])} ({res['dtype']}){tok}")
    return 0


def cmd_doctor(args) -> int:
    """``workbench doctor``: what this machine can do, each line ok / warn / fail (with the fix) or
    skip (with the reason). Exit status 1 when a line failed."""
    from workbench.doctor import format_report, run_doctor

    rep = run_doctor(device=args.device, precision=args.precision, dist=not args.quick,
                     progress=None if args.json or not sys.stderr.isatty() else _say)
    print(dumps(rep.to_dict()) if args.json else format_report(rep), flush=True)
    return 0 if rep.ok else 1


def cmd_gpu_check(args) -> int:
    """``workbench gpu-check``: ``make gpu-check``'s measurements (``workbench.gpucheck``); exit
    status 1 when a part failed, 0 when every part ran or was skipped (no CUDA: every part skipped)."""
    from workbench.gpucheck import run_check

    return run_check(args)


def cmd_profile(args) -> int:
    """``workbench profile``: a profile run (measure, fit, show the held-out error), or with --check
    RUN the profile's predictions against a training run's measurements."""
    from workbench.profile.command import run

    return run(args)


# ---------------------------------------------------------------------------------------------
# runs
# ---------------------------------------------------------------------------------------------


def cmd_runs(args) -> int:
    from workbench import runs

    root = Path(args.root) if args.root else runs.default_root()
    if args.action == "list":
        rows = [r.summary() for r in runs.list_runs(root, kind=args.kind)]
        if args.json:
            print(dumps({"runs": rows}))
            return 0
        if not rows:
            print(f"no runs in {root}")
            return 0
        print(f"{'id':<34} {'kind':<9} {'state':<9} {'step':>9} {'planner':<12} {'loss':>8}  created")
        for r in rows:
            step = f"{r['step']}/{r['steps']}" if r.get("steps") else str(r.get("step") or "")
            loss = f"{r['loss']:.4f}" if isinstance(r.get("loss"), float) else ""
            print(f"{r['id']:<34} {r['kind']:<9} {r['state']:<9} {step:>9} {str(r.get('planner') or ''):<12} "
                  f"{loss:>8}  {r.get('created') or ''}")
        return 0
    if args.action == "show":
        run = runs.load_run(_one(args), root=root)
        st = run.status()
        out = {"summary": run.summary(), "status": st.to_dict(), "log_tail": run.log_tail(args.lines)}
        if args.json:
            print(dumps(out))
            return 0
        s = out["summary"]
        print(f"{run.id} ({s['kind']}): {st.state}, step {st.step}{'/' + str(st.steps) if st.steps else ''}, "
              f"attempt {st.attempt}")
        if st.message:
            print(f"  {st.message}")
        if st.error:
            rank = f" (rank {st.failing_rank}{', ' + st.signal if st.signal else ''})" if st.failing_rank is not None else ""
            print(f"  error{rank}: {st.error}")
        for w in st.warnings:
            print(f"  warning: {w}")
        for nd in s.get("nodes") or []:
            err = f": {nd['error']}" if nd.get("error") else ""
            print(f"  node {nd['node']} ({nd.get('host') or '?'}): {nd['state']}, attempt {nd.get('attempt')}{err}")
        if s.get("median_measured_ms"):
            pred = f", predicted {s['median_predicted_ms']:,.0f} ms" if s.get("median_predicted_ms") else ""
            loss = f"; last loss {s['loss']:.4f}" if isinstance(s.get("loss"), float) else ""
            print(f"  median step: measured {s['median_measured_ms']:,.0f} ms{pred}{loss}")
        if s.get("profile"):
            print(f"  profile: {s['profile']}")
        if s.get("profile_note"):
            print(f"  note: {s['profile_note']}")
        if (s.get("load_average") or {}).get("text"):
            print(f"  load average during the run: {s['load_average']['text']}")
        for p in s.get("problems") or []:
            print(f"  note: {p}")
        if out["log_tail"]:
            print("  log:")
            for line in out["log_tail"]:
                print(f"    {line}")
        return 0
    if args.action == "stop":
        from workbench.launch import process

        run = runs.load_run(_one(args), root=root)
        before = run.status()
        if before.final and not process.run_alive(before):
            print(f"{run.id}: already {before.state}; nothing to stop")
            return 0
        st = process.stop(run, grace=process.STOP_GRACE_S if args.grace is None else args.grace)
        left = [p for p, t in runs.status_pids(st) if runs.pid_alive(p, t)]
        left += [p for _, nst in process.records_here(run.path) for p, t in runs.status_pids(nst) if runs.pid_alive(p, t)]
        nodes = run.nodes()
        elsewhere = [f"node {k} ({r.host}): {r.state}" for k, r in nodes.items() if r.host != socket.gethostname()]
        print(f"{run.id}: {st.state}" + (f"; still alive here: {sorted(set(left))}" if left else "; no process left here")
              + (f"; {', '.join(elsewhere)}" if elsewhere else ""))
        return 0 if not left else 1
    if args.action == "compare":
        if len(args.ids) != 2:
            raise CliError(f"runs compare takes two run ids, got {len(args.ids)}")
        res = runs.compare(args.ids[0], args.ids[1], root=root)
        if args.json:
            print(dumps(res))
            return 0
        print(f"{'run':<34} {'planner':<12} {'steps':>5} {'measured ms':>12} {'predicted ms':>13} {'meas/pred':>10} "
              f"{'tokens/s':>10} {'last loss':>10}")
        for r in res["runs"]:
            def f(v, fmt):
                return format(v, fmt) if isinstance(v, (int, float)) else "-"
            print(f"{r['id']:<34} {str(r.get('planner') or '-'):<12} {r['steps']:>5} {f(r['median_measured_ms'], ',.0f'):>12} "
                  f"{f(r['median_predicted_ms'], ',.0f'):>13} {f(r['measured_over_predicted'], '.2f'):>10} "
                  f"{f(r['median_tokens_per_s'], ',.0f'):>10} {f(r['last_loss'], '.4f'):>10}")
        a, b = res["runs"]
        pred = f" (predicted {res['predicted_speedup']:.2f}x)" if res.get("predicted_speedup") else ""
        print(f"{b['id']} is {res['speedup_b_over_a']:.2f}x as fast as {a['id']} per step (median measured){pred}")
        return 0
    if args.action == "trace":
        from workbench.trace import write_trace

        path, tl = write_trace(_one(args), args.out, args.step, root=root)
        if args.json:
            print(dumps({"path": str(path), "step": tl["step"], "summary": tl["summary"]}))
            return 0
        print(path, flush=True)
        how = "aligned by their clocks" if tl["aligned"] else "each from its own step start (no clock recorded)"
        _say(f"workbench runs trace: step {tl['step']} of {tl['run']} ({tl['execution']}, {tl['planner']}), "
             f"{len(tl['ranks'])} rank(s) {how}; open it in https://ui.perfetto.dev or chrome://tracing")
        for s in tl["summary"]:
            _say(f"  rank {s['rank']}: {s['measured_ms']:,.1f} ms = micro-steps {s['work_ms']:,.1f} + reduction "
                 f"{s['reduction_ms']:,.1f} + optimizer {s['optimizer_ms']:,.1f} + other {s['other_ms']:,.1f}"
                 + (f"; {s['note']}" if s.get("note") else ""))
        return 0
    raise CliError(f"unknown runs action {args.action!r}")


def cmd_notebook(args) -> int:
    """``workbench notebook run NAME -p KEY VALUE``: papermill into a run; ``list``: the notebooks."""
    from workbench import notebook as nbk
    from workbench import runs

    if args.action == "list":
        for path in sorted(nbk.notebooks_dir().glob("*.ipynb")):
            print(path.stem)
            for k, v in nbk.notebook_parameters(path).items():
                print(f"  {k:<18} {v['type']:<6} default {v['default']!r:<22} {v['help']}")
        return 0
    if args.action == "strip":
        paths = [nbk.find_notebook(args.notebook)] if args.notebook else sorted(nbk.notebooks_dir().glob("*.ipynb"))
        for path in paths:
            print(f"{path}: {'stripped' if nbk.strip_notebook(path) else 'clean'}")
        return 0
    if not args.notebook:
        raise CliError("notebook run needs a NAME, e.g. workbench notebook run 03_solver -p num_gpus 16")
    root = Path(args.run_root) if args.run_root else runs.default_root()
    params = dict(args.parameters)
    try:
        run = nbk.run_notebook(args.notebook, params, root=root.resolve(), run_id=args.run_id, timeout=args.timeout,
                               log=_say)
    except nbk.NotebookFailed as e:
        _say(f"workbench notebook: error: {e}")
        print(e.run.path)
        return 1
    print(run.path)
    return 0


def _one(args) -> str:
    if len(args.ids) != 1:
        raise CliError(f"runs {args.action} takes one run id, got {len(args.ids)}")
    return args.ids[0]


# ---------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (what was wrong, and where to read more)."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="workbench", description="Plan and run heterogeneous sequence-parallel training.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    q = sub.add_parser("lengths", help="summarise a length source")
    q.add_argument("source", metavar="SOURCE", help="family name, file, or comma-separated lengths")
    _add_data_args(q, source_flag=False)
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_lengths, lengths=None)

    q = sub.add_parser("cost", help="print the cost model the planners use")
    q.add_argument("--lengths", required=True, metavar="L1,L2,...")
    q.add_argument("--degrees", default=None, metavar="D1,D2,...",
                   help="group sizes to show (default: the cluster's candidate degrees, 1 to 64 on 64 GPUs)")
    q.add_argument("--cp", default=None, metavar="C1,C2,...",
                   help="context-parallel sizes to show for each degree they divide (default: the strategy's splits)")
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

    q = sub.add_parser("demo", help="the first look: the tour and solver notebooks headless plus a short CPU training "
                                     "run; writes an explained runs/<id>/report.html")
    q.add_argument("--run-root", default=None, metavar="DIR", help="the run store (default runs, or $WORKBENCH_RUNS)")
    q.add_argument("--steps", type=int, default=16, metavar="K", help="steps of the training run (default 16)")
    q.add_argument("--no-train", action="store_true", help="leave out the training run")
    q.add_argument("--own-steps", type=int, default=0, metavar="K",
                   help="also train the train notebook's own-model section (a tokenizer, a Llama-shaped config and a "
                        "corpus it makes) K steps and export it (default 0: planned, not trained)")
    q.add_argument("--effort", type=positive_float, default=DEFAULT_EFFORT, metavar="E",
                   help=f"flexsp's search per step in reference seconds (default {DEFAULT_EFFORT:g})")
    q.add_argument("--samples", type=positive_int, default=100_000, help="sequences drawn from the length family")
    q.add_argument("--seed", type=int, default=0)
    q.set_defaults(func=cmd_demo)

    q = sub.add_parser("train", help="launch (or resume) a real multi-process training run under torchrun")
    _add_train_arguments(q)
    q.set_defaults(func=cmd_train)

    q = sub.add_parser("export", help="write a run's checkpoint as a Hugging Face model folder (config.json + "
                                      "safetensors), loadable by transformers")
    q.add_argument("run", metavar="RUN", help="run id (or a unique prefix) or folder")
    q.add_argument("--out", required=True, metavar="DIR", help="the new folder (must not exist, or be empty)")
    q.add_argument("--step", type=positive_int, default=None, metavar="N",
                   help="the checkpoint at step N (default: the newest that verifies)")
    q.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="tensor type written (default: as trained)")
    q.add_argument("--max-shard-size", default=None, metavar="SIZE",
                   help="split the weights into shards of at most SIZE (e.g. 2GB; default 5GB, as transformers)")
    q.add_argument("--root", default=None, metavar="DIR", help="the run store (default runs, or $WORKBENCH_RUNS)")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_export)

    q = sub.add_parser("doctor", help="what this machine can do, checked by doing it: torch, CUDA/NCCL, GPUs and their "
                                      "links, bf16, flash-attn, a training step, NCCL collectives, a sharded step")
    q.add_argument("--json", action="store_true", help="the report as JSON (for scripts)")
    q.add_argument("--quick", action="store_true", help="leave out the 2-rank checks (NCCL collectives, sharded step)")
    q.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where the training step runs")
    q.add_argument("--precision", default=None, choices=["bf16", "fp32"],
                   help="the training step's precision (default bf16 on GPUs that have it, else fp32)")
    q.set_defaults(func=cmd_doctor)

    q = sub.add_parser("gpu-check", help="what one GPU does with the workbench, measured in at most 8 minutes: the doctor, "
                                         "peak bf16 rate, varlen attention kernels, 1B and 8B training steps (tokens/s, "
                                         "MFU, peak memory against the memory model), a profile and its check; writes "
                                         "gpu-check/result.json and report.md (without CUDA every part says it needs it)")
    from workbench.gpucheck import add_arguments as _add_gpu_check_arguments

    _add_gpu_check_arguments(q)
    q.set_defaults(func=cmd_gpu_check)

    q = sub.add_parser("profile", help="measure this machine (a profile run) and fit the cost model; --check RUN: "
                                       "predicted vs measured step and group time of a training run")
    from workbench.profile.command import add_arguments as _add_profile_arguments

    _add_profile_arguments(q)
    q.set_defaults(func=cmd_profile)

    q = sub.add_parser("runs", help="list, show, stop and compare runs in the run store; trace one step of a run")
    q.add_argument("action", choices=["list", "show", "stop", "compare", "trace"])
    q.add_argument("ids", nargs="*", metavar="ID", help="run id (or a unique prefix) or folder")
    q.add_argument("--root", default=None, metavar="DIR", help="the run store (default runs, or $WORKBENCH_RUNS)")
    q.add_argument("--kind", default=None, help="list: only runs of this kind (train, profile, demo, notebook)")
    q.add_argument("--lines", type=int, default=15, help="show: log lines to print (default 15)")
    q.add_argument("--step", type=positive_int, default=None, metavar="N",
                   help="trace: the step (1-based; default the run's median step, the first left out)")
    q.add_argument("--out", default=None, metavar="PATH",
                   help="trace: the trace-event JSON to write (default <run>/trace-step<N>.json)")
    q.add_argument("--grace", type=positive_float, default=None, metavar="S",
                   help="stop: seconds the run's processes get to end after SIGTERM before SIGKILL (default: the "
                        "launcher's, 4 s; a run that saves a large checkpoint as it stops may need more)")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_runs)

    q = sub.add_parser("notebook", help="run a notebook headless (papermill) into runs/<id>/; list the notebooks")
    q.add_argument("action", choices=["run", "list", "strip"],
                   help="run one headless; list them with their parameters; strip outputs from notebooks/ (before "
                        "committing)")
    q.add_argument("notebook", nargs="?", metavar="NAME", help="00_tour, 01_hardware, ... 05_compare (or a path)")
    q.add_argument("-p", "--parameter", nargs=2, action="append", default=[], dest="parameters", metavar=("KEY", "VALUE"),
                   help="set a parameter of the notebook's parameters cell (repeatable)")
    q.add_argument("--run-root", default=None, metavar="DIR", help="the run store (default runs, or $WORKBENCH_RUNS)")
    q.add_argument("--id", dest="run_id", default=None, metavar="ID", help="the run's folder name (default: a fresh id)")
    q.add_argument("--timeout", type=positive_float, default=900.0, metavar="S",
                   help="longest a cell may run (default 900 s)")
    q.set_defaults(func=cmd_notebook)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``workbench`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:
        # the reader went away (`workbench lengths ... --json | head`): no traceback, the usual status
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except OSError:
            pass
        return 141
    except (CliError, ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"workbench {args.command}: error: {_flagged(msg)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"workbench {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
