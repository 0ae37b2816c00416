"""Measured vs predicted step time of real plans: the tiny model on CPU, gloo ranks under torchrun.

``--zero-stage 3,0`` runs the whole comparison once per ZeRO stage: plans made for that stage (ZeRO-3:
lockstep passes, FSDP2 all-gathers every unit in every pass; ZeRO 0-2: free micro-steps, replicated
parameters) and executed with its model states (``workbench.runtime.zero.parallelize``).

For one long-tailed global batch (a synthetic length family, or the stdlib corpus, clipped to
``--max-len``), each planner (static-max, best-static, min-degree, greedy, and flexsp / two-stage
where registered) plans the step against the cost model of ``--profile`` (a shipped name or a
profile JSON, e.g. a fresh ``workbench profile --quick --nproc 4 --oversubscribe --out p.json``),
built through ``workbench.scenario.Scenario``; then every rank runs that plan with the StepExecutor: ``--warmup`` untimed
steps and ``--steps`` timed ones, round-robin over the planners, each followed by an AdamW step with learning rate 0 (the
optimizer's work, the weights unchanged, so every step runs the same model). A step's time is the slowest rank's (they
end together in the gradient reduction), optimizer included; the table shows its median next to the plan's predicted
makespan, and the median ratio measured/predicted of the plan's groups (compute per micro-step, without waits).

``--profile machine`` (the default) is this machine's quick profile for ``--nproc`` processes
(``workbench.profile.machine``): taken from the run store (``--run-root``, default runs/), or measured
first, as the demo and the Launch panel do.

Memory: activations of the tiny model are ~13 KB/token, so real CPU RAM never binds and every
planner would run everything on degree 1. By default the per-rank memory is set so that a
``--max-len`` sequence needs degree 4 (as a 128K sequence does on a GPU): ``--gpu-memory-gb``
overrides it.

The tables: per planner, predicted and measured step (the step-time error is their APE), the
measured/predicted ratio of its groups by degree (a group's time is the shortest of its ranks':
an early rank waits inside the group's first collective); then the speedup of each mixed plan over
``static-max`` (degree 4), predicted and measured (from the median steps and from the best, the
least disturbed by other work on a shared machine), and the ratio of the gains (1: the model
predicts the measured gain exactly).

``--splits`` instead runs one plan per group split: ``static:N`` (every group all N ranks) with its
groups as Ulysses over N (``N x 1``), Ulysses x context parallelism (``--strategy cp:2``: ``N/2 x 2``)
and context parallelism over N (``1 x N``), and prints each one's measured and predicted step and
whether the measured ranking of the three is the predicted one.

Usage: python bench/runtime.py [--nproc 4] [--zero-stage 3,0] [--profile machine|NAME|PATH] [--lengths wikipedia]
[--max-len 4096] [--batch-tokens 32768] [--steps 3] [--warmup 1] [--planners a,b] [--strategy auto] [--splits]
[--gpu-memory-gb G] [--json PATH]
It launches torchrun itself (argument lists, its own session; killed on --timeout).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PLANNERS = ("static-max", "best-static", "min-degree", "greedy", "two-stage", "flexsp")


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--zero-stage", default="3,0",
                    help="ZeRO stage(s) to plan and run, comma-separated (default 3,0: lockstep and free)")
    ap.add_argument("--lengths", default="wikipedia", help="length family name or 'stdlib'")
    ap.add_argument("--max-len", type=int, default=4096, help="clip lengths to this (the tiny model's context is 16384)")
    ap.add_argument("--batch-tokens", type=int, default=32768)
    ap.add_argument("--samples", type=int, default=20000)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--planners", default=",".join(PLANNERS))
    ap.add_argument("--strategy", default="auto", help="how the planners' groups split (auto, ulysses, cp, cp:C)")
    ap.add_argument("--splits", action="store_true",
                    help="one static plan per split (N x 1, N/2 x 2, 1 x N) instead of the planners")
    ap.add_argument("--profile", default="machine",
                    help="profile name or JSON path, or 'machine': this machine's quick profile for --nproc, from the "
                         "run store or measured first (default)")
    ap.add_argument("--run-root", default=None, help="the run store holding machine profiles (default runs/)")
    ap.add_argument("--gpu-memory-gb", type=float, default=None,
                    help="per-rank memory for the cost model (default: a max-len sequence needs degree nproc)")
    ap.add_argument("--effort", "--time-limit", dest="time_limit", type=float, default=2.0,
                    help="flexsp effort per step (reference seconds)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1200, help="seconds before the torchrun job is killed")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# ------------------------------------------------------------------------------------------------
# worker (under torchrun)
# ------------------------------------------------------------------------------------------------


def _scenario(args, gpu_memory_gb: float, stage: int, strategy: str | None = None):
    from workbench.scenario import Scenario

    n = args.nproc
    return Scenario(model="tiny", profile=args.profile, num_gpus=n, gpus_per_node=n, gpu_memory_gb=gpu_memory_gb,
                    source=args.lengths, samples=args.samples, max_len=args.max_len, policy="clip",
                    batch_tokens=args.batch_tokens, seed=args.seed, effort=args.time_limit, zero_stage=stage,
                    precision="fp32", optimizer="adamw", strategy=strategy or args.strategy)


def _runs(args) -> list[tuple[str, str, str]]:
    """``(row name, planner, strategy)`` of every plan the bench runs."""
    if args.splits:
        n = args.nproc
        return [(f"{n}x1", f"static:{n}", "ulysses"), (f"{n // 2}x2", f"static:{n}", "cp:2"), (f"1x{n}", f"static:{n}", "cp")]
    return [(name, name, args.strategy) for name in args.planners.split(",")]


def _setup(args, stage: int):
    """Rank 0's batch, cost model and plans for ``stage``, built through a Scenario (planners may
    not be deterministic: plan once)."""
    from workbench.solve import planner_names

    n = args.nproc
    mem = args.gpu_memory_gb
    if mem is None:
        # the memory at which a max-len sequence needs degree n (with 25% to spare on n ranks)
        probe = _scenario(args, 1000.0, stage).cost()
        act_gb = float(probe.memory([args.max_len], n)[0]) * 1.25
        mem = (act_gb + probe.model_states_gb) / probe.cluster.usable_memory_fraction
    sc = _scenario(args, mem, stage)
    cost = sc.cost()
    batch = sc.batches(1)[0]
    lengths = [int(x) for x in batch.lengths]
    known = set(planner_names())
    plans, errors, shapes = {}, {}, set()
    for row, name, strategy in _runs(args):
        if name not in known and not name.startswith("static:"):
            errors[row] = "not registered"
            continue
        try:
            s2 = sc.replace(strategy=strategy)
            plans[row] = s2.plan(batch, planner=name).to_dict()
            shapes |= set(s2.cost().shapes)
        except Exception as e:  # a planner that fails is reported, the others still run
            errors[row] = f"{type(e).__name__}: {e}"
    profile = cost.profile
    info = {"lengths": lengths, "gpu_memory_gb": mem, "memory_budget_gb": cost.memory_budget_gb,
            "shapes": sorted(shapes),
            "zero_stage": stage, "execution": cost.execution,
            "profile": profile.name, "profile_when": profile.provenance.get("when"),
            "profile_world": profile.provenance.get("world_size"),
            "group_overhead_ms": {str(d): cost.group_overhead_ms(d) for d in cost.degrees},
            "lower_bound_ms": float(next(iter(plans.values()))["lower_bound_ms"]) if plans else None}
    return info, plans, errors


def _stages(args) -> list[int]:
    out = [int(x) for x in str(args.zero_stage).split(",") if x.strip()]
    if not out or any(x not in (0, 1, 2, 3) for x in out):
        raise SystemExit(f"--zero-stage takes stages 0-3, comma-separated; got {args.zero_stage!r}")
    return out


def _run_stage(args, stage: int, rank: int, world: int) -> dict:
    """Plan (rank 0) and run every planner's plan under ``stage``; returns the stage's rows."""
    import torch
    import torch.distributed as dist

    from workbench.models import get_model
    from workbench.runtime import GroupRegistry, StepExecutor, Transformer, parallelize, select_attention
    from workbench.solve import plan_from_dict

    obj = [_setup(args, stage) if rank == 0 else None]
    dist.broadcast_object_list(obj, src=0)
    info, plans, errors = obj[0]
    spec = get_model("tiny")
    degrees = [d for d in (1, 2, 4, 8, 16) if d <= world]
    registry = GroupRegistry(world, degrees, shapes=[tuple(x) for x in info["shapes"] if x[0] in degrees])
    attn, backend = select_attention("torch", "cpu")
    model = Transformer(spec, seed=args.seed)
    zero = parallelize(model, zero_stage=stage, precision="fp32")
    ex = StepExecutor(model, registry, attn, zero=zero)
    opt = zero.make_optimizer("adamw", lr=0.0)  # the optimizer's work, the weights unchanged
    gen = torch.Generator().manual_seed(args.seed)
    seqs = [torch.randint(0, spec.vocab, (n,), generator=gen) for n in info["lengths"]]
    # round-robin over the plans, step by step, so that load from elsewhere on the machine hits
    # every planner alike (no optimizer step: every step runs the same weights)
    parsed = {name: plan_from_dict(pd) for name, pd in plans.items()}
    steps = {name: [] for name in plans}
    ratios = {name: [] for name in plans}
    groups = {name: [] for name in plans}
    losses = {}
    for i in range(args.warmup + args.steps):
        for name, plan in parsed.items():
            dist.barrier()
            res = ex.run(plan, seqs)
            t0 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t = torch.tensor([res.measured_ms + (time.perf_counter() - t0) * 1e3])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            losses[name] = res.loss
            if i >= args.warmup:
                steps[name].append(float(t))
                # lockstep: a rank's time is the whole pass (it waits for the slowest rank and FSDP's
                # collectives), so it is compared with the pass's prediction, not its own load
                pred = [(r, r.pass_ms if r.pass_ms is not None else r.predicted_ms) for r in res.records]
                ratios[name] += [r.measured_ms / p for r, p in pred if r.degree and p > 0]
                groups[name] += [((i, r.micro_step, r.ranks[0]), (r.degree, r.measured_ms, p))
                                 for r, p in pred if r.degree and p > 0]
    rows = {}
    for name, pd in plans.items():
        all_ratios = [None] * world
        dist.all_gather_object(all_ratios, ratios[name])
        all_groups = [None] * world
        dist.all_gather_object(all_groups, groups[name])
        by_group = {}
        for per_rank in all_groups:
            for key, (deg, meas, pred) in per_rank:
                k = tuple(key)
                by_group[k] = (deg, min(meas, by_group[k][1]) if k in by_group else meas, pred)
        by_degree = {}
        for deg, meas, pred in by_group.values():
            by_degree.setdefault(str(deg), []).append(meas / pred)
        flat = [x for r in all_ratios for x in r]
        degrees = sorted({g["degree"] for m in pd["micro_steps"] for g in m["groups"]})
        splits = sorted({f"{g['ulysses']}x{g['cp']}" for m in pd["micro_steps"] for g in m["groups"] if g["degree"] > 1})
        med = statistics.median(steps[name])
        rows[name] = {"measured_ms": med, "measured_all_ms": steps[name], "predicted_ms": pd["makespan_ms"],
                      "ratio": med / pd["makespan_ms"], "group_ratio_median": statistics.median(flat) if flat else None,
                      "micro_steps": len(pd["micro_steps"]), "degrees": degrees, "splits": splits, "loss": losses[name],
                      "group_ratio_by_degree": {d: statistics.median(v) for d, v in sorted(by_degree.items())}}
    return {"info": info, "rows": rows, "errors": errors, "attention": backend}


def _worker(args) -> int:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"stages": {str(st): _run_stage(args, st, rank, world) for st in _stages(args)}, "world": world,
           "threads_per_rank": torch.get_num_threads()}
    if rank == 0:
        Path(args.worker_out).write_text(json.dumps(out, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------------------------------------
# launcher
# ------------------------------------------------------------------------------------------------


def _launch(args, argv) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               str(Path(__file__).resolve())]
        # the worker's arguments travel in the environment: torchrun's own parser would take --nproc
        env = dict(os.environ, OMP_NUM_THREADS="1", WORKBENCH_BENCH_ARGV=json.dumps([*argv, "--worker-out", str(out)]))
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise SystemExit(f"torchrun did not finish in {args.timeout:.0f} s") from None
        except KeyboardInterrupt:
            os.killpg(proc.pid, signal.SIGTERM)
            raise
        if rc != 0:
            raise SystemExit(f"torchrun failed with exit status {rc}")
        return json.loads(out.read_text())


def _print_stage(args, stage: str, res: dict) -> None:
    info = res["info"]
    ls = info["lengths"]
    print(f"\n## ZeRO-{stage} ({info['execution']}): profile {info['profile']} (measured {info['profile_when']}), "
          f"attention {res['attention']}")
    print(f"# batch: {len(ls)} sequences, {sum(ls):,} tokens from '{args.lengths}' clipped to {args.max_len} "
          f"(max {max(ls)}, median {int(statistics.median(ls))}); per-rank memory {info['gpu_memory_gb']:.3f} GB "
          f"(activation budget {info['memory_budget_gb'] * 1e3:.1f} MB); median of {args.steps} steps after "
          f"{args.warmup} warm-up")
    if info["lower_bound_ms"] is not None:
        print(f"# lower bound (cost model): {info['lower_bound_ms']:.0f} ms")
    print()
    unit = "passes" if info["execution"] == "lockstep" else "micro-steps"
    what = ("pass measured/predicted by the degree of the rank's first group (median)" if info["execution"] == "lockstep"
            else "group measured/predicted by degree (median)")
    print(f"| planner | degrees | {unit} | predicted (ms) | measured (ms) | best step (ms) | measured/predicted | "
          f"step APE (%) | {what} |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    apes = []
    for name, _, _ in _runs(args):
        r = res["rows"].get(name)
        if r is None:
            why = res["errors"].get(name, "not run")
            print(f"| {name} | n/a | | | | | | | ({why}) |")
            continue
        ape = 100 * abs(r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"]
        apes.append(ape)
        gr = ", ".join(f"d{d}: {v:.2f}" for d, v in (r.get("group_ratio_by_degree") or {}).items()) or "-"
        print(f"| {name} | {','.join(map(str, r['degrees']))} | {r['micro_steps']} | {r['predicted_ms']:.0f} | "
              f"{r['measured_ms']:.0f} | {min(r['measured_all_ms']):.0f} | {r['ratio']:.2f} | {ape:.1f} | {gr} |")
    if apes:
        print(f"\nstep-time prediction error over the planners: median {statistics.median(apes):.1f}%, "
              f"worst {max(apes):.1f}%")
    if args.splits:
        rows = {name: res["rows"][name] for name, _, _ in _runs(args) if name in res["rows"]}
        pred = sorted(rows, key=lambda k: rows[k]["predicted_ms"])
        meas = sorted(rows, key=lambda k: rows[k]["measured_ms"])
        print(f"\nranking, fastest first: predicted {' < '.join(pred)}; measured {' < '.join(meas)}: "
              f"{'the same' if pred == meas else 'DIFFERENT'}")
        return
    base = res["rows"].get("static-max")
    if base is None or base["degrees"] != [max(base["degrees"])]:
        return
    print()
    print(f"| mixed plan | predicted speedup over static-max (degree {base['degrees'][0]}) | measured (median steps) | "
          "measured / predicted | within 1.5x | measured (best steps) |")
    print("|---|---:|---:|---:|---|---:|")
    for name in ("flexsp", "greedy", "min-degree", "two-stage", "best-static"):
        r = res["rows"].get(name)
        if r is None or len(r["degrees"]) < 2:
            continue
        p = base["predicted_ms"] / r["predicted_ms"]
        m = base["measured_ms"] / r["measured_ms"]
        b = min(base["measured_all_ms"]) / min(r["measured_all_ms"])
        q = m / p
        print(f"| {name} | {p:.3f}x | {m:.3f}x | {q:.2f} | {'yes' if 1 / 1.5 <= q <= 1.5 else 'NO'} | {b:.3f}x |")


def main(argv=None) -> int:
    if argv is None and os.environ.get("WORKBENCH_BENCH_ARGV"):
        argv = json.loads(os.environ["WORKBENCH_BENCH_ARGV"])
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _args(argv)
    if args.worker_out:
        return _worker(args)
    _stages(args)  # a bad --zero-stage fails here, before torchrun starts
    if args.profile == "machine":
        from workbench.profile.machine import ensure_machine_profile

        def show(frac: float, msg: str) -> None:
            print(f"# measuring this machine ({args.nproc} processes): {100 * frac:.0f}% {msg}", file=sys.stderr)

        mp = ensure_machine_profile(args.nproc, root=args.run_root, progress=show)
        print(f"# profile: {mp.describe()}: {mp.path}", file=sys.stderr)
        args.profile = str(mp.path)
        argv = [*argv, "--profile", args.profile]
    from workbench.runs import LoadSampler, read_jsonl, summarize_load

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:  # the machine's load, sampled every 2 s while the ranks run
        sampler = LoadSampler(tmp).start()
        try:
            res = _launch(args, argv)
        finally:
            sampler.stop()
        load = summarize_load(read_jsonl(Path(tmp) / "load.jsonl")[0], processes=args.nproc)
    res["load_average"] = load
    print(f"# tiny model, {res['world']} gloo ranks on CPU ({os.cpu_count()} cores, {res['threads_per_rank']} thread "
          f"each); load average during the run: {load['text'] if load else 'not available'} (other work on the "
          f"machine inflates measured times)")
    for stage, sres in res["stages"].items():
        _print_stage(args, stage, sres)
    print(f"\n# {time.perf_counter() - t0:.0f} s in all", file=sys.stderr)
    if args.json:
        from workbench.util import write_json_atomic

        write_json_atomic(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
