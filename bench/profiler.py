"""The profiler on this machine: how long a quick profile takes, how well it predicts held-out
lengths, and how well it predicts a real training run's steps and groups.

1. ``workbench profile --quick --nproc N`` (``--oversubscribe`` when N exceeds the cores), timed
   wall-clock from the command's start to its end (torch start-up included);
2. the fit's held-out error (lengths and packs not in the fit), the collectives' latency and
   bandwidth (context parallelism's all-gather and reduce-scatter on its sub-groups among them),
   the SP overhead per group size and the CP extras per CP size (the profile table prints them);
3. with ``--train-steps K``: a real ``workbench train`` run of the tiny model on N ranks planned
   with that profile (one long-tailed batch family clipped to ``--max-len``, per-rank memory set so
   that a ``--max-len`` sequence needs degree N, as ``bench/runtime.py`` does), then
   ``workbench profile --check``: median and worst error of step and group time.

Everything goes through the console script, as a user runs it. The load average before and after
is printed: the machine is shared, and other work inflates and scatters measured times.

Usage: python bench/profiler.py [--nproc 2] [--full] [--train-steps 8] [--planner flexsp]
       [--lengths wikipedia] [--max-len 4096] [--batch-tokens 32768] [--json PATH] [--out PROFILE.json]
       [--figures DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _cli(*args: str, timeout: float = 1200) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("workbench")
    cmd = [str(exe), *args] if exe.exists() else [sys.executable, "-m", "workbench.cli", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return p


def _load() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def _memory_for(profile: str, nproc: int, max_len: int) -> float:
    """Per-rank memory (GB) at which a ``max_len`` sequence needs degree ``nproc`` (25% to spare)."""
    from workbench.scenario import Scenario

    probe = Scenario(model="tiny", profile=profile, num_gpus=nproc, gpus_per_node=nproc, gpu_memory_gb=1000.0).cost()
    act = float(probe.memory([max_len], nproc)[0]) * 1.25
    return (act + probe.cluster.model_state_gb(probe.model)) / probe.cluster.usable_memory_fraction


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--full", action="store_true", help="the full grid instead of --quick")
    ap.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"],
                    help="cpu (default), cuda: NCCL ranks, CUDA events, flash-attn when installed (not run here)")
    ap.add_argument("--train-steps", type=int, default=0, help="also train this many steps and check the profile")
    ap.add_argument("--planner", default="flexsp")
    ap.add_argument("--lengths", default="wikipedia")
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--batch-tokens", type=int, default=32768)
    ap.add_argument("--json", default=None)
    ap.add_argument("--out", default=None, help="keep a copy of the profile JSON here (e.g. for bench/runtime.py)")
    ap.add_argument("--figures", default=None, metavar="DIR",
                    help="write the figures here: one HTML page, and PNGs when playwright and a chromium are installed")
    args = ap.parse_args(argv)
    from workbench.profile import load_result
    from workbench.profile.command import profile_table
    from workbench.profile.fidelity import fidelity_table

    over = ["--oversubscribe"] if args.nproc > (os.cpu_count() or 1) and args.device == "cpu" else []
    out: dict = {"nproc": args.nproc, "cores": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "runs"
        prof = Path(tmp) / "profile.json"
        load0 = _load()
        t0 = time.perf_counter()
        _cli("profile", *([] if args.full else ["--quick"]), "--nproc", str(args.nproc), *over, "--device", args.device,
             "--run-root", str(root), "--name", "profile", "--out", str(prof), "--quiet")
        wall = time.perf_counter() - t0
        load1 = _load()
        res = load_result(root / "profile")
        if args.out:
            res.profile.save(args.out)
        out.update(profile_wall_s=wall, load_before=load0, load_after=load1, result=res.to_dict())
        print(f"# workbench profile {'' if args.full else '--quick '}--nproc {args.nproc} on {os.cpu_count()} cores: "
              f"{wall:.0f} s wall-clock (torch start-up included); load average {load0:.1f} before, {load1:.1f} after")
        print()
        print(profile_table(res))
        if args.train_steps:
            mem = _memory_for(str(prof), args.nproc, args.max_len)
            load2 = _load()
            _cli("train", "--nproc", str(args.nproc), *over, "--model", "tiny", "--lengths", args.lengths,
                 "--max-len", str(args.max_len), "--policy", "clip", "--batch-tokens", str(args.batch_tokens),
                 "--gpu-memory", f"{mem:.6f}", "--planner", args.planner, "--steps", str(args.train_steps),
                 "--seed", "0", "--profile", str(prof), "--run-root", str(root), "--name", "train", "--quiet",
                 "--checkpoint-every", "0")
            load3 = _load()
            chk = json.loads(_cli("profile", "--check", "train", "--profile", str(prof), "--run-root", str(root),
                                  "--json").stdout)
            out.update(check=chk, train_load_before=load2, train_load_after=load3, gpu_memory_gb=mem)
            print()
            print(f"# real run: workbench train --nproc {args.nproc} --model tiny --lengths {args.lengths} --max-len "
                  f"{args.max_len} --policy clip --batch-tokens {args.batch_tokens} --gpu-memory {mem:.4f} --planner "
                  f"{args.planner} --steps {args.train_steps}; load average {load2:.1f} before, {load3:.1f} after")
            print()
            print(fidelity_table(chk))
    if args.figures:
        _figures(Path(args.figures), res, out.get("check"))
    if args.json:
        from workbench.util import write_json_atomic

        write_json_atomic(args.json, out)
    return 0


def _figures(folder: Path, res, check) -> None:
    """The profile's figures (and the fidelity one with a check) as one HTML page in ``folder``, and
    as PNGs where playwright can drive a local chromium (skipped, with a note, where it cannot)."""
    import shutil

    from workbench.report import write_html_report
    from workbench.report.hardware import bandwidth_figure, split_extras_figure
    from workbench.report.profile import collectives_figure, fidelity_figure, fit_figure, residual_figure

    figs = [("fit", fit_figure(res)), ("residuals", residual_figure(res)), ("collectives", collectives_figure(res)),
            ("links", bandwidth_figure(res.profile)), ("extras", split_extras_figure(res.profile))]
    if check:
        figs.append(("fidelity", fidelity_figure(check)))
    folder.mkdir(parents=True, exist_ok=True)
    write_html_report(folder / "profile.html", f"Profile {res.profile.name}", figs)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        print(f"# figures: {folder / 'profile.html'} (no PNGs: playwright is not installed)", file=sys.stderr)
        return
    exe = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=exe) if exe else pw.chromium.launch()
        page = browser.new_page(viewport={"width": 900, "height": 520})
        for name, fig in figs:
            fig.update_layout(width=900, height=500)
            html = folder / f".{name}.html"
            html.write_text(fig.to_html(full_html=True, include_plotlyjs="inline"))
            page.goto(html.resolve().as_uri())
            page.wait_for_timeout(500)
            page.screenshot(path=str(folder / f"profile-{name}.png"), full_page=False)
            html.unlink()
        browser.close()
    print(f"# figures: {folder}/profile-*.png and profile.html", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
