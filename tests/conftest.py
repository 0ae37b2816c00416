import dataclasses
import itertools
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("OMP_NUM_THREADS", "1")

# make test runs the suite in parallel with the heavy (slow) tests one at a time: see _xdist_heavy.py
from _xdist_heavy import (pytest_collection_modifyitems, pytest_configure, pytest_configure_node,  # noqa: E402,F401
                          pytest_unconfigure, pytest_xdist_make_scheduler)


@pytest.fixture(scope="session", autouse=True)
def _token_cache_in_tmp(tmp_path_factory):
    """Token caches go to a temporary folder, never the user's ~/.cache (subprocesses inherit it)."""
    if "WORKBENCH_CACHE" not in os.environ:
        os.environ["WORKBENCH_CACHE"] = str(tmp_path_factory.mktemp("workbench-cache"))
    yield


def free_cost(model="7b", n=8, *, mem=40.0, per_node=None, degrees=(), profile="a100-40g-flexsp", **kw):
    """A cost model with free execution (ZeRO-2: replicated parameters, barrier-free micro-steps) whose
    activation budget is the one FlexSP's textbook ZeRO-3 formula gives ``n`` GPUs of ``mem`` GB
    (70% usable less 16 bytes per parameter over the GPUs). The runtime's ZeRO-2 holds far more model
    states (whole fp32 weights and gradients), so the GPUs are made larger by exactly that much: the
    free planners' tests keep the memory pressure they were written for, on an execution model a run
    can have."""
    from workbench.cost import CostModel
    from workbench.cost.memory import model_states
    from workbench.models import get_model
    from workbench.specs import ClusterSpec, load_profile

    m = get_model(model)
    per = per_node if per_node is not None else min(8, n)
    budget = 0.7 * mem - 16.0 * m.params() / n / 1e9
    precision = kw.get("precision") or ("fp32" if m.dtype_bytes >= 4 else "bf16")
    if precision == "bf16":
        # bf16 under ZeRO 0-2 is autocast, which keeps more activation bytes per token (an fp32
        # residual stream, per-projection bf16 copies) than the figure these budgets were written
        # for: scale the budget so that it holds the same tokens
        from workbench.cost import activation_bytes_per_token

        mb, rc = dataclasses.replace(m, dtype_bytes=2), bool(kw.get("recompute", False))
        budget *= activation_bytes_per_token(mb, rc, autocast=True) / activation_bytes_per_token(mb, rc)
    states = model_states(m, zero_stage=2, num_ranks=n, precision=precision,
                          optimizer=kw.get("optimizer", "adamw")).total / 1e9
    prof = load_profile(profile) if isinstance(profile, str) else profile
    cl = ClusterSpec(num_gpus=n, gpus_per_node=per, gpu_memory_gb=(budget + states) / 0.7, degrees=degrees,
                     zero_stage=2)
    probe = CostModel(prof, m, cl, **kw)
    if probe.loss_bytes_per_token:
        # the whole logits' backward, charged with every token without recomputation (a model the
        # profile has no figure for): the same tokens again
        budget *= probe.memory_bytes_per_token / probe.activation_bytes_per_token
        cl = ClusterSpec(num_gpus=n, gpus_per_node=per, gpu_memory_gb=(budget + states) / 0.7, degrees=degrees,
                         zero_stage=2)
    return CostModel(prof, m, cl, **kw)


@pytest.fixture
def a100_7b_64():
    """The FlexSP reference setting: 7B on 64 A100-40G (ZeRO-3: lockstep passes)."""
    from workbench.cost import CostModel
    from workbench.models import get_model
    from workbench.specs import ClusterSpec, load_profile

    return CostModel(load_profile("a100-40g-flexsp"), get_model("7b"), ClusterSpec(num_gpus=64))


@pytest.fixture
def free_7b_64():
    """7B on 64 GPUs with free execution and the activation budget of FlexSP's 64 A100-40G (``free_cost``)."""
    return free_cost("7b", 64)


@pytest.fixture
def small_cost():
    """7B on 8 GPUs, free execution, with the activation budget of 8 A100-40G under FlexSP's ZeRO-3
    formula (``free_cost``): memory binds at a few thousand tokens, so small cases exercise every rule."""
    return free_cost("7b", 8)


@pytest.fixture
def small_lockstep():
    """7B on 8 A100-40G under ZeRO-3 (lockstep passes)."""
    from workbench.cost import CostModel
    from workbench.models import get_model
    from workbench.specs import ClusterSpec, load_profile

    return CostModel(load_profile("a100-40g-flexsp"), get_model("7b"), ClusterSpec(num_gpus=8, gpus_per_node=8))


def run_cli(*args, check=True):
    """Run the real console entry in a subprocess; returns CompletedProcess."""
    import subprocess

    exe = Path(sys.executable).with_name("workbench")
    cmd = [str(exe), *args] if exe.exists() else [sys.executable, "-m", "workbench.cli", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    if check and p.returncode != 0:
        raise AssertionError(f"{cmd} failed ({p.returncode}):\n{p.stderr}")
    return p


def cli_main(capsys, *args):
    """``workbench *args`` through the console script's entry (``workbench.cli.main``, which the script
    exits with) in this process, for checks of what the command says and returns, where an interpreter
    per case would cost more than the check (``run_cli`` runs the console script itself). Returns
    ``(returncode, stdout, stderr)`` as attributes, like ``run_cli``'s CompletedProcess. An exception
    escaping ``main`` fails the test, as its traceback would show in a terminal."""
    from types import SimpleNamespace

    from workbench.cli import main

    capsys.readouterr()
    try:
        rc = main(list(args))
    except SystemExit as e:  # argparse's own refusals exit from inside parse_args
        rc = e.code
    out, err = capsys.readouterr()
    return SimpleNamespace(returncode=rc, stdout=out, stderr=err)


def seed_machine_profile(root, nproc: int = 2):
    """A machine profile run in the store ``root`` as ``ensure_machine_profile`` leaves one, without
    measuring: the shipped ``cpu-gloo-tiny`` figures stamped with this machine's fingerprint for
    ``nproc`` processes and the current profiler version, so a CPU launch in that store reuses it
    instead of measuring this machine first (about 30 s on 2 cores). For tests whose checks are not
    about the measurement (the demo's fixture in ``test_notebooks.py`` too); the Launch panel's
    (``test_widgets.py``'s ``two_runs``) and ``test_profile_run.py`` measure for real. Returns the
    profile Run."""
    from workbench import runs
    from workbench.profile.machine import MACHINE_MODEL, machine_fingerprint
    from workbench.profile.result import PROFILER_VERSION
    from workbench.specs import HardwareProfile, load_profile

    fp = machine_fingerprint(nproc)
    d = load_profile("cpu-gloo-tiny").to_dict()
    d.update(name=f"cpu-gloo-tiny-{nproc}r", gpu=f"CPU {fp['cpu']} ({fp['cores']} cores)")
    d["provenance"] = {**d["provenance"], "fingerprint": fp, "world_size": nproc, "profiler_version": PROFILER_VERSION,
                       "note": "seeded by the tests (tests/conftest.py seed_machine_profile), not measured"}
    run = runs.new_run("profile", {"model": MACHINE_MODEL, "nproc": nproc, "quick": True, "fingerprint": fp}, root=root)
    HardwareProfile.from_dict(d).save(run.file(runs.PROFILE_FILE))
    runs.update_status(run.path, state="done")
    return run


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the test item (``item.rep_call``), for fixtures that act on a
    failure (the browser test's screenshot)."""
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)


def set_partitions(items):
    """Every partition of ``items`` into non-empty groups (the exhaustive searches enumerate plans
    by it): yields lists of lists."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for p in set_partitions(rest):
        for j in range(len(p)):
            yield p[:j] + [[first] + p[j]] + p[j + 1:]
        yield [[first]] + p


def exhaustive_lockstep_ms(s, cost, *, multi):
    """The least step (ms) over every lockstep plan: every partition of the sequences into groups,
    every shape (degree and split) and aligned block for each group, every partition of the groups
    into passes; a pass lasts max(largest rank load, comm) + overhead, a rank's load being the packed
    call's constant once plus, per group it serves, the group's extra and its sequences' times, and
    its activations in a pass fit the budget. Without ``multi`` a rank serves at most one group per
    pass. Plus the step's end. (One of the two optima :func:`exhaustive_lockstep_pair_ms` finds.)"""
    single, stacked = exhaustive_lockstep_pair_ms(s, cost)
    return stacked if multi else single


def exhaustive_lockstep_pair_ms(s, cost):
    """``exhaustive_lockstep_ms`` (its docstring says what is searched) without and with ``multi`` in
    one enumeration (the groups' figures are the costly part, computed once for both): returns
    ``(single, stacked)``. A passes partition counts for the one-group-per-rank optimum only if no rank
    serves two groups in any of its passes; the search leaves a partition once it can improve
    neither."""
    n = cost.cluster.num_gpus
    C, comm, ovh = cost.call_overhead_ms(), cost.pass_comm_ms(), cost.pass_overhead_ms()
    B = cost.memory_budget_gb * (1 + 1e-9)
    places = [(d, cp, b) for d, cp in cost.shapes if d <= n for b in range(n // d)]
    best_multi = best_single = math.inf
    for groups in set_partitions(list(range(len(s)))):
        for choice in itertools.product(places, repeat=len(groups)):
            info = []
            for members, (d, cp, b) in zip(groups, choice):
                t = float(cost.time(s[members], d, cp).sum())
                m = float(cost.memory(s[members], d, cp).sum())
                info.append((d, b, cost.group_extra_ms(d, cp) + t, m))
            if any(m > B for *_, m in info):
                continue
            for passes in set_partitions(list(range(len(info)))):
                total, single = 0.0, True
                for ks in passes:
                    load, cnt, mem = np.zeros(n), np.zeros(n), np.zeros(n)
                    for k in ks:
                        d, b, t, m = info[k]
                        load[b * d:(b + 1) * d] += t
                        cnt[b * d:(b + 1) * d] += 1
                        mem[b * d:(b + 1) * d] += m
                    if (mem > B).any():
                        total = math.inf
                        break
                    single = single and not (cnt > 1).any()
                    total += max(float((load + C * (cnt > 0)).max()), comm) + ovh
                    if total >= best_multi and (not single or total >= best_single):
                        break
                best_multi = min(best_multi, total)
                if single:
                    best_single = min(best_single, total)
    end = cost.step_end_ms()
    return best_single + end, best_multi + end


def profile_rank_in_subworld(run_dir, rank: int) -> int:
    """Rank side, in a sub-world of the shared torchrun launch (``tests/_torchrun.py``): this rank of the
    profile run prepared in ``run_dir`` (``Profiler.run``, which starts and ends a process group of its
    own, on a store rank 0 hosts on a free loopback port, as under torchrun), once it has left the
    sub-world's process group (``_run_subworld`` has the ranks meet again after it). Returns the rank's
    exit status (0 done, 1 failed). No supervisor marks the run done: its status is as rank 0 left it
    (progress 1.0, ``done in ...``)."""
    import socket

    import torch.distributed as dist
    from _torchrun import environ_kept

    from workbench.profile.measure import Profiler

    run_dir = Path(run_dir)
    port = [None]
    if rank == 0:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port[0] = sock.getsockname()[1]
    dist.broadcast_object_list(port, src=0)
    world = dist.get_world_size()
    dist.destroy_process_group()  # the sub-world's ranks meet again after this check (_run_subworld)
    with environ_kept("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK",
                      "TORCHELASTIC_USE_AGENT_STORE"):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port[0]), WORLD_SIZE=str(world),
                          LOCAL_WORLD_SIZE=str(world), LOCAL_RANK=str(rank), TORCHELASTIC_USE_AGENT_STORE="False")
        return Profiler(run_dir).run()
