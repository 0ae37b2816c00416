"""From the workbench to the cluster: the commands that run one training run on several nodes, and
the checks that every node runs the same run.

- :func:`train_argv`: the ``workbench train`` arguments that rebuild a TrainSpec exactly (every
  setting explicit, paths absolute), so that every node prepares the same spec from them.
- :func:`torchrun_commands`: one ``workbench train`` command per node (``--nnodes N --node-rank k
  --rdzv-endpoint HOST:PORT --run-root SHARED --name ID``), for machines without Slurm.
- :func:`slurm_script`: an sbatch script that runs the same run on N nodes: ``srun`` starts one
  ``workbench train`` per node (each one torchrun, through the supervisor), the rendezvous on the
  job's first node, the run store on the shared ``--run-root``.
- :func:`node_problem`, :func:`spec_differences`: what differs between the nodes of a run, in one line.

Pure Python (no torch): the CLI, the Launch panel and the trainer share it.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = ["train_argv", "torchrun_commands", "slurm_script", "node_problem", "spec_differences", "rank_ranges",
           "workbench_executable", "DEFAULT_RDZV_PORT", "KINDS"]

KINDS = ("slurm", "torchrun")

DEFAULT_RDZV_PORT = 29500


# ------------------------------------------------------------------------------------------------
# what differs between nodes
# ------------------------------------------------------------------------------------------------


def rank_ranges(ranks: Sequence[int]) -> str:
    """``[2, 3, 5]`` -> ``"2-3, 5"``."""
    out, rs = [], sorted(set(int(r) for r in ranks))
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ", ".join(out)


def _flat(d: Mapping, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def spec_differences(a: Mapping, b: Mapping, limit: int = 3) -> list[str]:
    """The fields where two spec dicts differ, as ``"name: A there, B here"`` (at most ``limit``)."""
    fa, fb = _flat(a), _flat(b)
    keys = [k for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]
    return [f"{k.replace('scenario.', '')}: {fa.get(k)!r} on node 0, {fb.get(k)!r} here" for k in keys[:limit]]


def node_problem(infos: Sequence[Mapping[str, Any]]) -> tuple[int, str] | None:
    """``(rank, message)`` of the first thing that differs between the nodes, from every rank's
    ``{"rank", "node", "host", "local_world_size", "run_id", "spec"}`` (rank order), or None.
    Every rank gets the same answer from the same gathered list (node 0's spec is the run's)."""
    by_node: dict[int, list[Mapping]] = {}
    for info in infos:
        by_node.setdefault(int(info["node"]), []).append(info)
    if len(by_node) < 2:
        return None
    first = by_node[min(by_node)][0]
    sizes = {k: int(v[0]["local_world_size"]) for k, v in by_node.items()}
    if len(set(sizes.values())) > 1:
        spec0 = first.get("spec") or {}
        want = int(spec0.get("nproc") or sizes[min(sizes)])
        odd = next(k for k, n in sizes.items() if n != want) if want in sizes.values() else max(sizes)
        seen = ", ".join(f"node {k}: {n}" for k, n in sizes.items())
        return (int(by_node[odd][0]["rank"]),
                f"node {odd} ({by_node[odd][0]['host']}) started {sizes[odd]} process(es) but the run has {want} per node "
                f"({seen}); start every node with --nproc {want}")
    for k, members in sorted(by_node.items()):
        info = members[0]
        if info.get("run_id") != first.get("run_id"):
            return (int(info["rank"]),
                    f"node {k} ({info['host']}) joined with run {info.get('run_id')!r} but node 0 runs "
                    f"{first.get('run_id')!r}: give every node the same --name (and --run-root) or --run-dir")
        if info.get("spec") is not None and first.get("spec") is not None and info.get("spec") != first.get("spec"):
            diff = "; ".join(spec_differences(first.get("spec") or {}, info.get("spec") or {}))
            return (int(info["rank"]),
                    f"node {k} ({info['host']}) runs another spec than node 0 ({diff}); give every node the same "
                    f"settings (`workbench train ... --emit torchrun` prints the commands)")
    return None


# ------------------------------------------------------------------------------------------------
# the commands
# ------------------------------------------------------------------------------------------------


def workbench_executable() -> str:
    """The absolute path of this environment's ``workbench`` console script (beside the Python that
    runs us), or ``workbench`` when there is none (then it must be on the nodes' PATH)."""
    exe = Path(sys.executable).with_name("workbench")
    return str(exe) if exe.exists() else "workbench"


_TRAIN_FLAGS = {"steps": "--steps", "optimizer": "--optimizer", "lr": "--lr", "weight_decay": "--weight-decay",
                "momentum": "--momentum", "grad_clip": "--grad-clip", "checkpoint_every": "--checkpoint-every",
                "attention": "--attention", "device": "--device", "timeout_s": "--timeout", "nproc": "--nproc",
                "nnodes": "--nnodes", "init": "--init", "torch_profile": "--torch-profile"}
_SCENARIO_FLAGS = {"model": "--model", "source": "--lengths", "samples": "--samples", "column": "--column",
                   "tokenizer": "--tokenizer", "max_len": "--max-len", "policy": "--policy",
                   "batch_tokens": "--batch-tokens", "batch_size": "--batch-size", "planner": "--planner",
                   "effort": "--effort", "time_limit": "--time-limit", "profile": "--profile", "gpu_memory_gb": "--gpu-memory",
                   "zero_stage": "--zero-stage", "precision": "--precision", "seed": "--seed",
                   "memory_fraction": "--memory-fraction"}
_DEBUG_FLAGS = {"plan_num_gpus": "--debug-plan-gpus", "step_sleep_s": "--debug-step-sleep",
                "plan_zero_stage": "--debug-plan-zero-stage"}


def train_argv(spec) -> list[str]:
    """``workbench train`` arguments that prepare exactly ``spec`` (a TrainSpec) again: every setting
    given, so nothing depends on the defaults of the machine that reads them. Raises ValueError for a
    setting no flag carries."""
    sc = spec.scenario
    out: list[str] = []
    for name, flag in _SCENARIO_FLAGS.items():
        v = getattr(sc, name)
        if v is not None:
            out += [flag, _text(v)]
    out.append("--recompute" if sc.recompute else "--no-recompute")
    if sc.degrees:
        out += ["--degrees", ",".join(str(d) for d in sc.degrees)]
    out += ["--strategy", sc.strategy]
    for name, flag in _TRAIN_FLAGS.items():
        v = getattr(spec, name)
        if v is not None:
            out += [flag, _text(v)]
    if not spec.plan_ahead:
        out.append("--no-plan-ahead")
    for k, v in (spec.debug or {}).items():
        if k not in _DEBUG_FLAGS:
            raise ValueError(f"debug setting {k!r} has no workbench train flag")
        out += [_DEBUG_FLAGS[k], _text(v)]
    return out


def _text(v: Any) -> str:
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e15:
        return repr(v)  # 0.5 -> '0.5', 2.0 -> '2.0': argparse reads both back as the same float
    return str(v)


def _node_command(base: Sequence[str], *, node_rank: int | str, endpoint: str, rdzv_id: str,
                  run_root: str, name: str, rdzv_timeout: float | None) -> list[str]:
    cmd = [*base, "--node-rank", str(node_rank), "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id,
           "--run-root", run_root, "--name", name]
    if rdzv_timeout is not None:
        cmd += ["--rdzv-timeout", f"{float(rdzv_timeout):g}"]
    return cmd


def torchrun_commands(spec, *, run_root: str | Path, name: str, endpoint: str | None = None,
                      rdzv_timeout: float | None = None, executable: str | None = None) -> str:
    """The commands to run ``spec`` (a TrainSpec of ``nnodes`` nodes) by hand: one ``workbench train``
    per node, each starting torchrun for its ``nproc`` processes, the rendezvous at ``endpoint``
    (node 0's address and a free port; a placeholder when None), the run store at ``run_root``
    (a path every node sees). Returns a shell snippet with a comment per node."""
    if spec.nnodes < 2:
        raise ValueError("--emit torchrun is for a run over several nodes; give --nnodes N (N >= 2)")
    exe = executable or workbench_executable()
    base = [exe, "train", *train_argv(spec)]
    ep = endpoint or f"NODE0_HOST:{DEFAULT_RDZV_PORT}"
    root = str(Path(run_root).resolve())
    lines = [f"# run {name}: {spec.scenario.model} on {spec.nnodes} nodes x {spec.nproc} process(es), planner "
             f"{spec.scenario.planner}, {spec.steps} steps",
             f"# the run store {root} must be the same folder on every node (a shared filesystem);",
             f"# node 0 listens at {ep} (its address and a free port{'' if endpoint else ': replace NODE0_HOST'}).",
             "# Start node 0 first; every node waits for the others (--rdzv-timeout). Follow it from any node:",
             f"#   workbench runs show {name} --root {root}      stop it: workbench runs stop {name} --root {root}"]
    for k in range(spec.nnodes):
        cmd = _node_command(base, node_rank=k, endpoint=ep, rdzv_id=name, run_root=root, name=name,
                            rdzv_timeout=rdzv_timeout)
        lines += ["", f"# node {k}", _wrapped([shlex.quote(w) for w in cmd])]
    return "\n".join(lines) + "\n"


def slurm_script(spec, *, run_root: str | Path, name: str, port: int = DEFAULT_RDZV_PORT,
                 rdzv_timeout: float | None = None, sbatch: Sequence[str] = (), executable: str | None = None) -> str:
    """An sbatch script running ``spec`` on ``nnodes`` nodes: one task per node, each ``workbench
    train --node-rank $SLURM_NODEID`` (torchrun for its ``nproc`` processes), the rendezvous on the
    job's first node at ``port``, the run store at ``run_root`` (shared), ``--rdzv-id`` the job id.
    ``sbatch``: extra ``#SBATCH`` options (``partition=gpu``, ``time=02:00:00``...)."""
    exe = executable or workbench_executable()
    root = str(Path(run_root).resolve())
    base = [exe, "train", *train_argv(spec)]
    gpu = spec.device != "cpu"
    head = [
        "#!/bin/bash",
        f"# workbench run {name}: {spec.scenario.model} on {spec.nnodes} node(s) x {spec.nproc} "
        f"{'GPU(s)' if gpu else 'process(es)'}, planner {spec.scenario.planner}, {spec.steps} steps",
        "# written by `workbench train ... --emit slurm`; submit with: sbatch THIS_FILE",
        f"#SBATCH --job-name=wb-{name}"[:80],
        f"#SBATCH --nodes={spec.nnodes}",
        "#SBATCH --ntasks-per-node=1",
    ]
    if gpu:
        head.append(f"#SBATCH --gpus-per-node={spec.nproc}")
    head.append(f"#SBATCH --output={root}/{name}.slurm-%j.out")
    for opt in sbatch:
        opt = opt.strip().lstrip("-")
        if not opt:
            continue
        head.append(f"#SBATCH --{opt}")
    node_cmd = [*base, "--rdzv-endpoint", "$HEAD:$PORT", "--rdzv-id", "slurm-$SLURM_JOB_ID", "--run-root", root,
                "--name", name]
    if rdzv_timeout is not None:
        node_cmd += ["--rdzv-timeout", f"{float(rdzv_timeout):g}"]
    quoted = _wrapped([_shell_word(w) for w in node_cmd], indent="    ")
    body = [
        "set -euo pipefail",
        "# the rendezvous: node 0 of the job (the first host of the allocation) listens on PORT",
        'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"PORT=${{WORKBENCH_RDZV_PORT:-{int(port)}}}",
        f"mkdir -p {shlex.quote(root)}",
        "# one task per node; each appends its own --node-rank (Slurm's node id) and starts torchrun for",
        "# its processes through the workbench supervisor; the run store is shared by every node",
        "srun --nodes=\"$SLURM_NNODES\" --ntasks-per-node=1 --kill-on-bad-exit=1 \\",
        "  bash -c 'exec \"$@\" --node-rank \"$SLURM_NODEID\"' workbench-node \\",
        f"    {quoted}",
    ]
    return "\n".join(head + [""] + body) + "\n"


def _wrapped(words: Sequence[str], indent: str = "    ", width: int = 110) -> str:
    """Shell words joined into lines of at most ``width`` characters, continued with a backslash; a
    flag stays on the line of its value."""
    groups: list[str] = []
    for w in words:
        if groups and not w.startswith("-") and groups[-1].startswith("-") and " " not in groups[-1]:
            groups[-1] += " " + w
        else:
            groups.append(w)
    lines, cur = [], ""
    for g in groups:
        if cur and len(cur) + 1 + len(g) > width:
            lines.append(cur)
            cur = g
        else:
            cur = f"{cur} {g}" if cur else g
    lines.append(cur)
    return (" \\\n" + indent).join(lines)


def _shell_word(w: str) -> str:
    """Quote ``w`` for the script, leaving the variables the job fills in ($HEAD, $PORT,
    $SLURM_JOB_ID) to the shell."""
    if "$" in w:
        return '"' + w.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return shlex.quote(w)
