"""``workbench profile``: measure this machine as a run, or check a profile against a training run.

    workbench profile [--nproc N] [--model NAME] [--quick] [--out PATH] [--run-root DIR] [--name ID]
                      [--device auto|cpu|cuda] [--dtype float32|bfloat16] [--attention auto|varlen|flash|torch] [--max-len N]
                      [--reps N] [--warmup N] [--min-sample-ms MS] [--collective-reps N]
                      [--group-sizes 2,4] [--oversubscribe] [--detach] [--quiet]
    workbench profile --check RUN [--profile NAME|PATH|RUN] [--skip K] [--json] [--html PATH]

The first form prepares a profile run (``runs/<id>/``, kind ``profile``), starts it through the
launcher, shows its progress and prints the fit and its held-out error; the profile JSON is
``runs/<id>/profile.json`` (and ``--out PATH``), ready for ``--profile PATH`` in plan, simulate
and train. The second prints predicted against measured step and group time of a training run.
Bad input raises ValueError (the CLI prints it as one line, exit status 2).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from workbench.util import positive_int

__all__ = ["add_arguments", "run", "profile_table"]


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _int_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError("expected at least one number")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``workbench profile`` options."""
    from workbench.profile import ATTENTION

    g = p.add_argument_group("measure")
    g.add_argument("--nproc", type=positive_int, default=None, metavar="N",
                   help="processes measuring at once (default: the GPUs; on CPU min(2, cores)); the collectives' "
                        "group sizes and the contention a training run of N ranks sees")
    g.add_argument("--model", default="tiny",
                   help="model preset, or a Hugging Face config.json (or its folder), whose layers are timed (default tiny)")
    g.add_argument("--quick", action="store_true", help="small grid, few repetitions (under a minute on 2 cores)")
    g.add_argument("--out", default=None, metavar="PATH", help="also write the profile JSON here")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--attention", default="auto", choices=list(ATTENTION),
                   help="attention backend timed (default auto: on CUDA torch's varlen kernel, else flash-attn when "
                        "installed, else the PyTorch path)")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="parameter dtype timed (default: what runs on the device compute in, bfloat16 on CUDA, "
                        "float32 on CPU)")
    g.add_argument("--max-len", type=positive_int, default=None, metavar="N",
                   help="longest sequence timed (default 4096 on CPU, 32768 on CUDA, at most the model's)")
    g.add_argument("--reps", type=positive_int, default=None, help="timed samples per pack (default 5 quick, 9 full)")
    g.add_argument("--warmup", type=int, default=None, help="untimed runs per pack (default 1 quick, 2 full)")
    g.add_argument("--min-sample-ms", type=float, default=None, metavar="MS",
                   help="a timed sample repeats its pack until it lasts this long (default 50 on CPU, where a "
                        "scheduler tick is milliseconds, 5 on CUDA); 0 times one call a sample: faster, noisier")
    g.add_argument("--collective-reps", type=positive_int, default=None, metavar="N",
                   help="timed repetitions of each collective at each size (default 9 quick, 15 full)")
    g.add_argument("--group-sizes", type=_int_list, default=None, metavar="D1,D2",
                   help="collective group sizes, any from 2 to --nproc (default: every size up to 8, then the ones "
                        "that tile the ranks; SP micro-steps at the powers of two dividing --nproc)")
    g.add_argument("--oversubscribe", action="store_true",
                   help="allow more processes than CPU cores (measures the contention such a run has)")
    g.add_argument("--run-root", default=None, metavar="DIR", help="the run store (default runs, or $WORKBENCH_RUNS)")
    g.add_argument("--name", default=None, metavar="ID", help="the run folder's name (default: a fresh id)")
    g.add_argument("--detach", action="store_true", help="print the run folder and return; the run goes on")
    g.add_argument("--quiet", action="store_true", help="no progress output")
    g = p.add_argument_group("fidelity")
    g.add_argument("--check", default=None, metavar="RUN",
                   help="compare a profile's predicted step and group times with this training run's measured ones")
    g.add_argument("--profile", default=None, metavar="NAME|PATH|RUN",
                   help="with --check: the profile to test (default: the one the run planned with, else the newest "
                        "finished profile run)")
    g.add_argument("--skip", type=int, default=1, metavar="K", help="with --check: leave out the first K steps (default 1)")
    g.add_argument("--json", action="store_true", help="print plain JSON")
    g.add_argument("--html", default=None, metavar="PATH", help="also write the figures to this HTML file")


def _default_nproc(device: str) -> int:
    from workbench.profile import gpu_count

    gpus = gpu_count() if device in ("auto", "cuda") else 0
    if gpus:
        return gpus
    return max(1, min(2, os.cpu_count() or 1))


def profile_table(res) -> str:
    """The fit and its evidence as text: curves, held-out errors, links, memory."""
    p = res.profile
    lines = [f"profile {p.name} ({p.gpu}; model {p.model}; attention {p.provenance.get('attention')})", "",
             "| curve (per layer) | a (ms/token^2) | b (ms/token) | c (ms) | fit median APE (%) | held-out median APE (%) "
             "| held-out worst APE (%) |", "|---|---:|---:|---:|---:|---:|---:|"]

    def f(v, fmt=".1f"):
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    for k in ("forward", "backward"):
        c, h = res.fits[k], res.heldout.get(k, {})
        lines.append(f"| {k} | {c['a']:.3e} | {c['b']:.3e} | {c['c']:.3f} | {f(c['errors']['median_ape'])} | "
                     f"{f(h.get('median_ape'))} | {f(h.get('worst_ape'))} |")
    h = res.heldout.get("total", {})
    lines.append(f"| forward + backward | | | | | {f(h.get('median_ape'))} | {f(h.get('worst_ape'))} |")
    if p.forward.short_len:
        lines.append(f"\nsequences under {p.forward.short_len:,} tokens: a = {p.forward.a_short:.3e} forward, "
                     f"{p.backward.a_short:.3e} backward (attention kernels block short sequences differently)")
    if h.get("points"):
        lines += ["", "| held-out pack | tokens | measured fwd+bwd (ms/layer) | predicted (ms/layer) | APE (%) |",
                  "|---|---:|---:|---:|---:|"]
        for pt in h["points"]:
            pk = pt["pack"]
            desc = f"{pk[0]}" if len(pk) == 1 else (f"{len(pk)} x {pk[0]}" if len(set(pk)) == 1 else f"{len(pk)} seqs")
            lines.append(f"| {desc} | {pt['tokens']:,} | {pt['measured_ms']:.2f} | {pt['predicted_ms']:.2f} | "
                         f"{pt['ape']:.1f} |")
    if res.collective_fits:
        lines += ["", "| collective | group size | latency (ms) | bandwidth (GB/s) | fit median APE (%) |",
                  "|---|---:|---:|---:|---:|"]
        for kind, by in res.collective_fits.items():
            for d, fl in sorted(by.items()):
                lines.append(f"| {kind} | {d} | {fl['latency_ms']:.3f} | {fl['gbps']:.3f} | "
                             f"{f(fl['errors']['median_ape'])} |")
    if res.groups:
        sp = res.profile.sp_overhead_ms
        lines += ["", "| SP micro-step (all blocks at once) | degree | split (Ulysses x CP) | measured (ms) | predicted: "
                      "compute + collectives | + sp / cp / split extras |", "|---|---:|---:|---:|---:|---:|"]
        for g in res.groups:
            pk = g["pack"]
            desc = f"{pk[0]}" if len(pk) == 1 else f"{len(pk)} x {pk[0]}"
            split = g.get("split") or f"{g['degree']}x1"
            lines.append(f"| {desc} | {g['degree']} | {split} | {g['measured_ms']:.1f} | {g['predicted_ms']:.1f} | "
                         f"{g['predicted_with_overhead_ms']:.1f} |")
        if sp:
            tok = res.profile.sp_token_ms
            lines.append("\nSP overhead per layer: " + ", ".join(
                f"degree {d}: {v:.2f} ms + {1e3 * tok.get(d, 0.0):.2f} ms per 1,000 tokens" for d, v in sp.items()))
        cpo = res.profile.cp_overhead_ms
        if cpo:
            tok, att = res.profile.cp_token_ms, res.profile.cp_attention_factor
            lines.append("\nCP extras per layer (1 x c): " + ", ".join(
                f"c = {c}: {v:.2f} ms + {1e3 * tok.get(c, 0.0):.2f} ms per 1,000 tokens" for c, v in cpo.items()))
            if att:
                lines.append("CP's extra attention (bottom-right-masked chunks), as a fraction of a rank's causal "
                             "share a * s^2 / d: " + ", ".join(f"c = {c}: {v:.3f}" for c, v in att.items()))
        spo = res.profile.split_overhead_ms
        if spo:
            tok = res.profile.split_token_ms
            parts = {g["split"]: [] for g in res.groups if g.get("predicted_parts_ms") is not None}
            for g in res.groups:
                if g.get("predicted_parts_ms") is not None:
                    parts[g["split"]].append(g["measured_ms"] / g["predicted_parts_ms"])
            lines.append("\ncomposite splits beyond the sum of their parts, per layer: " + ", ".join(
                f"{k}: {v:.2f} ms + {1e3 * tok.get(k, 0.0):.2f} ms per 1,000 tokens"
                + (f" (measured / the parts' prediction: {min(parts[k]):.2f}-{max(parts[k]):.2f})" if parts.get(k) else "")
                for k, v in spo.items()))
    extras = [(k, v) for k, v in (
        ("head (embedding, final norm, head, loss) per 1,000 tokens, fwd+bwd",
         None if p.head_ms_per_token is None else f"{1e3 * p.head_ms_per_token:.3f} ms"),
        ("fixed cost of a micro-step", None if p.micro_step_ms is None else f"{p.micro_step_ms:.2f} ms"),
        ("fixed cost of a ZeRO-3 pass", ", ".join(f"{d} ranks: {v:.2f} ms" for d, v in p.pass_overhead_ms.items())
         or None),
        ("work inside a ZeRO-3 pass, vs a free micro-step",
         ", ".join(f"{d} ranks: x{v:.3f}" for d, v in p.pass_compute_factor.items()) or None),
        ("FSDP's collectives overlapping compute", None if p.pass_comm_overlap is None else f"{p.pass_comm_overlap:g}"),
        ("optimizer per million parameters (replicas)",
         None if p.optimizer_ms_per_mparam is None else f"{p.optimizer_ms_per_mparam:.2f} ms"),
        ("optimizer per million parameters (ZeRO-3 shards)",
         None if p.sharded_optimizer_ms_per_mparam is None else f"{p.sharded_optimizer_ms_per_mparam:.2f} ms"),
    ) if v is not None]
    if extras:
        lines += ["", "| what a step costs beyond its layers (measured from real steps) | |", "|---|---:|"]
        lines += [f"| {k} | {v} |" for k, v in extras]
        whole = [r for r in res.steps if r.get("step")]
        if whole:
            lines += ["", "| real step (the profiler's own, re-timed with this profile) | measured (ms) | predicted (ms) |",
                      "|---|---:|---:|"]
            lines += [f"| {r['case']} | {r['measured_ms']:.1f} | {r['predicted_ms']:.1f} |" for r in whole]
    m = res.memory
    if m:
        lines += ["", f"activations {f(m.get('activation_mb_per_token'), '.4f')} MB/token, model states "
                      f"{f(m.get('model_state_mb'), '.2f')} MB ({m.get('method', '').split(':')[0]})"]
    link = ("none (a CPU has no host link: plans do not offload)" if not p.host_link_gbps else
            f"{p.host_link_gbps:.1f} GB/s one GPU alone" + (f", {p.host_link_node_gbps:.1f} GB/s the whole node at once"
                                                             if p.host_link_node_gbps else ""))
    lines += ["", f"host memory {f(p.host_memory_gb, ',.0f')} GB per node; host link (pinned copies) {link}"]
    return "\n".join(lines)


def _check(args) -> int:
    from workbench import runs
    from workbench.profile import check_fidelity
    from workbench.profile.fidelity import fidelity_table
    from workbench.util import dumps

    root = Path(args.run_root) if args.run_root else runs.default_root()
    prof = args.profile
    if prof is None:
        # the profile the run planned with (a shipped name or a file), else the newest measured here
        from workbench.specs import load_profile

        train = runs.load_run(args.check, root=root)
        own = (train.spec().get("scenario") or {}).get("profile")
        try:
            if own:
                load_profile(own)
                prof = own
        except ValueError:
            prof = None
        if prof is None:
            done = [r for r in runs.list_runs(root, kind="profile") if r.file(runs.PROFILE_FILE).is_file()]
            prof = str(done[-1].path) if done else None
        if not prof:
            raise ValueError(f"no profile to check: give --profile NAME|PATH (run {train.id} names none that loads)")
    else:
        p = Path(prof)
        if not p.exists() and not prof.endswith(".json"):
            try:  # a profile run's id
                prof = str(runs.load_run(prof, root=root).path)
            except runs.RunNotFound:
                pass
    res = check_fidelity(prof, args.check, skip=args.skip, root=root)
    if args.html:
        from workbench.report import write_html_report
        from workbench.report.profile import fidelity_figure

        write_html_report(args.html, f"Profile {res['profile']} against run {res['run']}",
                          [("Predicted vs measured", fidelity_figure(res))], [("Errors", fidelity_table(res))])
    if args.json:
        print(dumps(res))
    else:
        print(fidelity_table(res))
    return 0


def _follow(handle, quiet: bool):
    from workbench.launch import process

    bar = None
    tty = sys.stderr.isatty() and not quiet
    last = None
    try:
        while True:
            st = process.poll(handle)
            cur = st or handle.run.status()
            if not quiet and cur.message and cur.message != last:
                last = cur.message
                if tty:
                    if bar is None:
                        from tqdm import tqdm

                        bar = tqdm(total=100, desc="profile", unit="%", file=sys.stderr, dynamic_ncols=True,
                                   bar_format="{l_bar}{bar}| {elapsed} {postfix}")
                    if cur.progress is not None:
                        bar.update(max(0, int(100 * cur.progress) - bar.n))
                    bar.set_postfix_str(cur.message[:60])
                else:
                    pct = f"{100 * cur.progress:3.0f}% " if cur.progress is not None else ""
                    _say(f"workbench profile: {pct}{cur.message}")
            if st is not None:
                return st
            time.sleep(0.25)
    finally:
        if bar is not None:
            bar.close()


def run(args) -> int:
    """Run ``workbench profile`` for parsed ``args``; returns the exit status."""
    if args.check:
        return _check(args)
    from workbench import runs
    from workbench.profile import load_result, prepare_profile, start_profile

    for flag in ("profile", "html"):
        if getattr(args, flag):
            raise ValueError(f"--{flag} goes with --check RUN")
    nproc = args.nproc or _default_nproc(args.device)
    opts = {"device": args.device, "dtype": args.dtype, "attention": args.attention, "max_len": args.max_len,
            "reps": args.reps,
            "warmup": args.warmup, "oversubscribe": args.oversubscribe, "out": args.out,
            "command": "workbench " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["profile"] else "workbench profile"}
    if args.group_sizes:
        opts["group_sizes"] = tuple(args.group_sizes)
    if args.min_sample_ms is not None:
        opts["min_sample_ms"] = args.min_sample_ms
    if args.collective_reps is not None:
        opts["collective_reps"] = args.collective_reps
    run_ = prepare_profile(nproc=nproc, model=args.model, quick=args.quick,
                           root=args.run_root or runs.default_root(), name=args.name, **opts)
    print(run_.path, flush=True)
    handle = start_profile(run_, stop_with_parent=not args.detach)
    if args.detach:
        _say(f"workbench profile: detached; follow it with `workbench runs show {run_.id}`, stop it with "
             f"`workbench runs stop {run_.id}`")
        return 0

    from workbench.launch.terminal import follow_in_terminal

    code = follow_in_terminal(handle, name="profile", follow=lambda: _follow(handle, args.quiet), say=_say)
    if code != 0:
        return code
    res = load_result(run_)
    if args.json:
        from workbench.util import dumps

        print(dumps({"run": str(run_.path), "profile_path": str(run_.file(runs.PROFILE_FILE)), "out": args.out,
                     **res.summary()}))
    elif not args.quiet:
        print(profile_table(res))
        print(f"\nprofile: {run_.file(runs.PROFILE_FILE)}" + (f" (copied to {args.out})" if args.out else "")
              + f"; use it with --profile {args.out or run_.file(runs.PROFILE_FILE)}")
    return 0
