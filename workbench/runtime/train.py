"""The trainer: one process per rank under torchrun, executing a planner's plan every step.

    python -m torch.distributed.run --standalone --nproc-per-node N \\
        -m workbench.runtime.train --run-dir runs/<id>

Reads ``<run-dir>/spec.json`` (``workbench.launch.spec.TrainSpec``), then every step:

1. every rank draws the same global batch (``GlobalBatchSampler``, deterministic from the seed);
2. rank 0 plans it (one step ahead with ``workbench.solve.ahead.PlanAhead`` when that exists) and
   broadcasts the plan as a dict; a planning error is broadcast instead, so every rank stops;
3. every rank checks the plan (``check_plan``) before running it, against the run's ZeRO stage,
   precision and recomputation too: a bad plan fails everywhere at the same point, and no rank
   waits in a collective for one that gave up; then every rank makes the process groups of the
   plan's groups that no earlier plan needed (``GroupRegistry.ensure``: on demand, in an order
   derived from the plan alone, so the same on every rank);
4. ``StepExecutor.run`` does the micro-steps (or lockstep passes) and the stage's gradient
   reduction; the optimizer steps.

The model states are held as the scenario's ZeRO stage says (``workbench.runtime.zero``: FSDP2
under ZeRO-3, ZeroRedundancyOptimizer under 1-2), in its precision, with per-block recomputation
when it asks for it. Artefacts in the run folder: ``plans.jsonl`` (rank 0), ``metrics.jsonl`` (one
line per step and rank, with the bytes of model states the rank holds), ``status.json`` (rank 0:
running / done / failed, step, error), ``checkpoints/step_<n>.pt`` or ``step_<n>.dcp/`` (ZeRO-3,
sharded; ``workbench.runtime.checkpoint``),
``ranks/rank<k>.json`` (pid and host of each rank, so a stop can reach every process), and on a
failure ``failures/rank<k>.json``. A restarted run resumes from its latest checkpoint.

Setup errors (a missing or invalid spec, a bad source, a sequence over the max context under
policy ``error``...) are collected on every rank *before* the first collective that could block,
then agreed on with one ``all_gather_object``: every rank stops, rank 0 writes the message.

Over several nodes (torchrun's ``GROUP_WORLD_SIZE`` > 1) that same gather also compares the nodes:
another ``--nproc``, another run or another spec on some node stops every rank with one line naming
it (``workbench.runtime.peers.node_problem``). Each rank records its pid in its node's record
(``nodes/node<k>.json``) and, on nodes other than 0, appends its metrics to that node's file;
heartbeats through torchrun's store (``PeerWatch``) let a rank whose collective failed name the node
that went away.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from workbench import runs
from workbench.data.sequences import TokenData  # the data side lives there; re-exported for callers
from workbench.runtime.checkpoint import (CHECKPOINT_FORMAT, CheckpointError, checkpoint_path, latest_checkpoint,
                                          load_checkpoint, resume_state)
from workbench.training import CPU_MAX_LEN, SpecError, TrainSpec, read_train_spec
from workbench.util import write_json_atomic

__all__ = ["TokenData", "TrainError", "checkpoint_path", "latest_checkpoint", "load_checkpoint", "main"]

FALLBACK_CPU_PROFILE = "a100-40g-flexsp"


class TrainError(RuntimeError):
    """A run that cannot go on; the message is what status.json and stderr say."""


def _say(msg: str) -> None:
    sys.stderr.write(msg + "\n")  # one write: lines of ranks sharing log.txt do not interleave
    sys.stderr.flush()


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# ------------------------------------------------------------------------------------------------
# set-up
# ------------------------------------------------------------------------------------------------


@dataclass
class DistEnv:
    """What torchrun tells a worker about its place in the world."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node: int = 0
    """This node's rank (torchrun's ``GROUP_RANK``: the ``--node-rank`` it was started with)."""
    nnodes: int = 1
    """Nodes of the run (torchrun's ``GROUP_WORLD_SIZE``)."""

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    @classmethod
    def from_env(cls) -> "DistEnv":
        env = os.environ
        if "RANK" not in env or "WORLD_SIZE" not in env:
            # a plain `python -m workbench.runtime.train`: a world of one on a local rendezvous
            env.setdefault("MASTER_ADDR", "127.0.0.1")
            env.setdefault("MASTER_PORT", str(_free_port()))
        return cls(rank=int(env.get("RANK", 0)), world_size=int(env.get("WORLD_SIZE", 1)),
                   local_rank=int(env.get("LOCAL_RANK", 0)),
                   local_world_size=int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", 1))),
                   node=int(env.get("GROUP_RANK", 0)), nnodes=int(env.get("GROUP_WORLD_SIZE", 1)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def resolve_device(spec: TrainSpec | None, env: DistEnv) -> torch.device:
    """CUDA (this rank's local GPU) when asked for or available under ``auto``, else CPU.
    Raises TrainError when ``cuda`` is asked for and there is none."""
    want = spec.device if spec is not None else "auto"
    if want == "cpu" or (want == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise TrainError("spec.device is 'cuda' but this machine has no CUDA device; use --device cpu or auto")
    n = torch.cuda.device_count()
    if env.local_rank >= n:
        raise TrainError(f"local rank {env.local_rank} has no GPU: this node has {n}; lower --nproc to {n}")
    return torch.device("cuda", env.local_rank)


def run_scenario(spec: TrainSpec, world: int, per_node: int, device: torch.device):
    """``(Scenario, note)`` this rank plans and trains with: the spec's, checked against the world
    torchrun gave, its max context resolved for the device (the spec's; else 1,024 on CPU, the
    largest power of two the cluster holds on CUDA) and its precision (the spec's; else bf16 on
    CUDA, fp32 on CPU: resolved before planning, so the plans assume what the run computes in).
    Raises TrainError when the world differs from the run's."""
    sc = spec.scenario
    if world != sc.num_gpus:
        raise TrainError(f"the run is prepared for {sc.num_gpus} rank(s) (nproc {spec.nproc} x nnodes {spec.nnodes}) "
                         f"but torchrun started {world}; resume it with its own --nproc")
    if per_node != min(sc.gpus_per_node, sc.num_gpus):
        sc = sc.replace(gpus_per_node=per_node)
    note = ""
    if sc.precision is None:
        from workbench.runtime.zero import default_precision

        sc = sc.replace(precision=default_precision(device))
    if sc.max_len is None:
        ctx = sc.model_spec().max_context
        sc = sc.replace(max_len=min(ctx, CPU_MAX_LEN) if device.type == "cpu" else sc.resolved_max_len())
    prof = sc.profile_spec()
    if device.type == "cpu" and prof.provenance.get("device") != "cpu" and not str(prof.gpu).startswith("CPU"):
        note = (f"profile {prof.name} describes GPUs; predicted times will not match this CPU run "
                f"(measure one with `workbench profile`)")
    return sc, note


# ------------------------------------------------------------------------------------------------
# planning on rank 0
# ------------------------------------------------------------------------------------------------


class RankZeroPlanner:
    """Plans batches on rank 0: one step ahead with ``PlanAhead`` when available, else inline.
    ``payload(batch, next_batch)`` returns what is broadcast: ``{"plan": dict, "plan_wait_s"}`` or
    ``{"error": message}``.

    A plan-ahead worker that dies (killed, out of memory, a crash in the solver) costs time, not the
    run: the planner says so once (``note``: stderr, hence the run's log, and with ``run_dir`` the
    run's ``status.json``: ``warnings`` and ``resolved.planning``) and plans this batch and every
    later one inline, with the same planner, seed, effort and max context, so the plans are the
    ones the worker would have made. It does not start a new worker: what killed one (the
    out-of-memory killer, a planner crashing on these batches) would likely kill the next, and a
    new process would have to be added to the pids a stop must reach while the run is live."""

    def __init__(self, name: str, cost, *, seed: int, effort: float, time_limit: float | None, max_len: int,
                 ahead: bool, run_dir: Path | None = None) -> None:
        self.name, self.cost, self.seed, self.max_len = name, cost, seed, max_len
        self.effort, self.time_limit = effort, time_limit
        self.run_dir = run_dir
        self.note: str | None = None
        """Why planning went inline mid-run (None while it has not)."""
        self._ahead = None
        self.mode = "inline"
        if ahead:
            try:
                from workbench.solve.ahead import PlanAhead, WorkerDied
            except ImportError:
                PlanAhead = None
            if PlanAhead is not None:
                self._ahead = PlanAhead(name, cost, seed=seed, effort=effort, time_limit=time_limit, max_len=max_len)
                self.mode = "ahead"
                try:
                    self._ahead.warm_up()  # starts the worker now (its pid is recorded for stops)
                except WorkerDied as e:  # it died while starting
                    self._go_inline(e, "before the first step")

    def _inline(self, batch):
        from workbench.solve import run_planner

        return run_planner(self.name, np.asarray(batch.lengths, dtype=np.int64), self.cost, seed=self.seed,
                           effort=self.effort, time_limit=self.time_limit, max_len=self.max_len, batch_id=batch.batch_id)

    def _go_inline(self, why: Exception, when: str) -> None:
        """The worker died: close what is left of it, say so once, plan inline from now on."""
        ahead, self._ahead = self._ahead, None
        self.mode = "inline"
        try:
            ahead.close()
        except Exception:  # noqa: BLE001 - it is dead already
            pass
        self.note = (f"{why} {when}; planning the remaining steps inline (planner {self.name}, seed {self.seed}, "
                     f"effort {self.effort:g}: the same plans, each step now waits for its own)")
        _say(f"workbench train: warning: {self.note}")
        if self.run_dir is not None:
            try:
                runs.update_status(self.run_dir, warnings=[self.note],
                                   resolved={"planning": "inline (the plan-ahead worker died)"})
            except (OSError, ValueError):
                pass  # the log has it; the run goes on

    def payload(self, batch, next_batch=None) -> dict:
        from workbench.solve.ahead import WorkerDied

        t0 = time.perf_counter()
        try:
            plan = None
            if self._ahead is not None:
                try:
                    self._ahead.submit(batch)  # a no-op when it was submitted as the previous step's next batch
                    if next_batch is not None:
                        self._ahead.submit(next_batch)  # planned while this step trains
                    plan = self._ahead.get(batch)
                except WorkerDied as e:
                    self._go_inline(e, f"before step {batch.step + 1}")
            if plan is None:
                plan = self._inline(batch)
        except Exception as e:  # noqa: BLE001 - any planning failure stops every rank the same way
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            return {"error": f"planner {self.name} failed on batch {batch.batch_id}: {msg}"}
        return {"plan": plan.to_dict(), "plan_wait_s": time.perf_counter() - t0}

    def worker_pids(self) -> list[int]:
        """Pids of the plan-ahead worker process and multiprocessing's resource tracker (empty inline)."""
        return self._ahead.worker_pids() if self._ahead is not None else []

    def close(self) -> None:
        if self._ahead is not None:
            try:
                self._ahead.close()
            except Exception:  # noqa: BLE001 - closing a helper thread must not mask the run's result
                pass


# ------------------------------------------------------------------------------------------------
# the run
# ------------------------------------------------------------------------------------------------


def _parent_watchdog() -> None:
    """Exit when torchrun (our parent) dies without ending us: an orphan would otherwise wait in
    a collective until the process-group timeout."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(2.0)
            if os.getppid() != parent:
                if os.getpgrp() == os.getpid():
                    # we lead our own group (torchrun starts each rank in a session of its own):
                    # take the plan-ahead worker with us
                    os.killpg(os.getpgrp(), signal.SIGKILL)
                os._exit(143)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


class Trainer:
    """One rank's run. ``run()`` returns the process exit status (0 done, 1 failed)."""

    def __init__(self, run_dir: Path, env: DistEnv) -> None:
        self.run_dir = run_dir
        self.env = env
        self.rank = env.rank
        self.spec: TrainSpec | None = None
        self.step = 0
        self.attempt = 1
        self.node = env.node if env.multi_node else None
        """This rank's node record (``nodes/node<k>.json``) in a run over several nodes, else None."""
        self.peers = None
        self.members: dict[int, tuple[int, str]] = {}
        """Every rank's ``(node, host)``, agreed at start."""

    # ---- status and artefacts (rank 0 writes the run's progress; every rank its pid) ---------------
    def _write_status(self, **fields) -> None:
        if self.rank != 0 or not self.run_dir.is_dir():
            return
        runs.update_status(self.run_dir, **fields)

    def _fail(self, msg: str, *, where: str = "") -> int:
        """Report a failure on this rank (stderr, failures/rank<k>.json; status.json on rank 0)."""
        if self.peers is not None:
            self.peers.mark_ended("failed")
        _say(f"workbench train: error (rank {self.rank}{', ' + where if where else ''}): {msg}")
        if self.run_dir.is_dir():
            try:
                write_json_atomic(self.run_dir / "failures" / f"rank{self.rank}.json",
                                  {"rank": self.rank, "step": self.step, "error": msg, "time": _now()})
            except OSError:
                pass
        self._write_status(state="failed", step=self.step, error=msg)
        return 1

    # ---- phase 1: everything that needs no collective -------------------------------------------
    def _setup_local(self, device: torch.device) -> None:
        from workbench.data import GlobalBatchSampler
        from workbench.runtime.attention import select_attention
        from workbench.solve import get_planner

        spec = self.spec
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        get_planner(spec.scenario.planner)  # an unknown name fails here, on every rank
        self.scenario, self.cost_note = run_scenario(spec, self.env.world_size, self.env.local_world_size, device)
        sc = self.scenario
        self.cost = sc.cost()
        # predictions hold where the profile was measured: say so when it is another machine's
        from workbench.profile.machine import machine_fingerprint, profile_origin_note

        self.machine = machine_fingerprint(self.env.world_size, device=device.type)
        self.origin_note = profile_origin_note(self.cost.profile, self.env.world_size, fingerprint=self.machine)
        if self.origin_note and not self.cost_note:
            self.cost_note = self.origin_note
        self.max_len = int(sc.max_len)
        self.data = TokenData(sc.source, max_len=self.max_len, policy=sc.policy, seed=sc.seed, samples=sc.samples,
                              column=sc.column, tokenizer=sc.tokenizer, vocab=self.cost.model.vocab)
        bs, bt = sc.batch_size, sc.batch_tokens
        if self.data.ordered:
            bs = bt = None  # an explicit list is the batch itself
        elif bs is None and bt is None:
            raise TrainError("the scenario has neither batch_tokens nor batch_size; give --batch-tokens T")
        self.batch_size, self.batch_tokens = bs, bt
        self.sampler = GlobalBatchSampler(self.data, batch_size=bs, batch_tokens=bt, seed=sc.seed)
        self.attn, self.attn_name = select_attention(spec.attention, device, sc.precision)
        if spec.debug.get("plan_num_gpus") is not None:
            k = int(spec.debug["plan_num_gpus"])
            self.plan_cost = sc.replace(num_gpus=k, gpus_per_node=min(sc.gpus_per_node, k)).cost()
        elif spec.debug.get("plan_zero_stage") is not None:  # test hook: plans made for another stage
            self.plan_cost = sc.replace(zero_stage=int(spec.debug["plan_zero_stage"])).cost()
        else:
            self.plan_cost = self.cost
        found = resume_state(self.run_dir)
        self.resume = self.resume_state = None
        self.resume_skipped: list[str] = []
        if found is not None:
            step, path, state, self.resume_skipped = found
            self.resume, self.resume_state = (step, path), state
        if self.resume_state is not None:
            smp = self.resume_state.get("sampler", {})
            mine = {"seed": sc.seed, "batch_size": bs, "batch_tokens": bt, "lengths": sc.source}
            if "data" in smp:  # the token data itself (a cache key): an edited file or tokenizer is not resumed
                mine["data"] = self.data.fingerprint
            diff = {k: (smp.get(k), v) for k, v in mine.items() if smp.get(k) != v}
            if diff:
                raise TrainError(f"checkpoint {self.resume[1].name} was written with other data settings "
                                 f"({', '.join(f'{k}: {a!r} there, {b!r} now' for k, (a, b) in diff.items())}); "
                                 f"use a new run folder")

    def _info(self) -> dict:
        """What this rank says about itself at start, for the nodes' comparison."""
        spec = self.spec.to_dict() if self.spec is not None else None
        if spec is not None:
            spec.pop("steps", None)  # a resume may raise the steps on one node first; the rest must match
        return {"rank": self.rank, "node": self.env.node, "host": socket.gethostname(),
                "local_world_size": self.env.local_world_size, "run_id": self.run_dir.name, "spec": spec}

    def _agree(self, err: str | None) -> tuple[int, str] | None:
        """All ranks' setup errors (and, over several nodes, what differs between the nodes), gathered
        on every rank: ``(rank, message)`` of the first, or None. Also keeps every rank's node and
        host (``self.members``) for naming a node that goes away later."""
        from workbench.runtime.peers import node_problem

        got: list = [None] * self.env.world_size
        dist.all_gather_object(got, (err, self._info()))
        self.members = {int(i["rank"]): (int(i["node"]), str(i["host"])) for _, i in got}
        nodes = node_problem([i for _, i in got])
        if nodes is not None:
            return nodes  # before the errors it causes (a world of another size, say)
        for r, (e, _) in enumerate(got):
            if e is not None:
                return r, e
        return None

    def _watch_peers(self) -> None:
        """Heartbeats through torchrun's store (several nodes only), so a failure can name the node gone."""
        from workbench.runtime.peers import PeerWatch, store_from_env

        if not self.env.multi_node:
            return
        try:
            found = store_from_env(timeout_s=10.0)
        except Exception as e:  # noqa: BLE001 - without it a failure is reported as it comes
            _say(f"workbench train: warning (rank {self.rank}): no heartbeats through the rendezvous store: {e}")
            return
        if found is None:
            return
        store, where = found
        stall = min(60.0, float(self.spec.timeout_s)) if self.spec is not None else 60.0

        def stalled(msg: str) -> None:
            # a peer vanished without closing its sockets: end now rather than wait in a collective
            self._fail(msg, where=f"step {self.step}")
            os._exit(1)

        self.peers = PeerWatch(store, self.rank, self.members, stall_s=stall, on_stall=stalled,
                               store_host=where).start()

    def _explain(self, msg: str) -> str:
        """A failure's message, prefixed with which node went away when a peer is gone (the
        collective's own words then shortened to their first sentence, without gloo's source path)."""
        if self.peers is None:
            return msg
        why = self.peers.diagnose()
        if not why:
            return msg
        short = re.sub(r"\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", msg)
        short = re.split(r"(?<=[.!?])\s", short, maxsplit=1)[0]
        return f"{why} ({short})"

    # ---- the run ----------------------------------------------------------------------------------
    def run(self) -> int:
        env = self.env
        err: str | None = None
        device = torch.device("cpu")
        if self.run_dir.is_dir():
            # where every rank lives, so that a stop can reach processes torchrun put in their own sessions
            # (over several nodes: in this node's record, written on this host only)
            runs.update_status(self.run_dir, node=self.node,
                               pids={"ranks": {str(self.rank): os.getpid()}, **runs.process_record()})
            self.attempt = max(1, runs.read_status(self.run_dir, self.node).attempt)
        try:
            self.spec = read_train_spec(self.run_dir)
        except SpecError as e:
            err = str(e)
        try:
            device = resolve_device(self.spec, env)
        except TrainError as e:
            err = err or str(e)
        if device.type == "cuda":
            # before anything touches CUDA (and before the process group): every later CUDA call and
            # NCCL's communicator use this rank's own GPU, never GPU 0 of every rank
            torch.cuda.set_device(device)
        if err is None:
            try:
                self._setup_local(device)
            except (TrainError, CheckpointError, ValueError, FileNotFoundError, ImportError) as e:
                err = str(e).splitlines()[0] if str(e) else type(e).__name__
            except Exception as e:  # noqa: BLE001 - reported, never left to hang the others
                err = f"{type(e).__name__}: {e}"
                traceback.print_exc()
        # decided the same way on every rank (not from this rank's device, which a failed set-up
        # may have left on CPU): ranks on different backends would never meet
        cuda = torch.cuda.is_available() and (self.spec is None or self.spec.device != "cpu")
        backend = "nccl" if cuda else "gloo"
        timeout = datetime.timedelta(seconds=self.spec.timeout_s if self.spec is not None else 600.0)
        try:
            # NCCL bound to this rank's GPU (``device_id``): the communicator forms now, and subgroups
            # split from it
            bind = {"device_id": device} if backend == "nccl" and device.type == "cuda" else {}
            dist.init_process_group(backend, timeout=timeout, rank=env.rank, world_size=env.world_size, **bind)
        except Exception as e:  # noqa: BLE001
            return self._fail(f"process group ({backend}) did not start: {e}", where="init")
        agreed = self._agree(err)
        if agreed is not None:
            origin, msg = agreed
            if self.rank == origin:
                self._fail(msg, where="setup")
            elif self.rank == 0 or (self.env.multi_node and self.env.local_rank == 0):
                # one report of the first error, naming the rank it came from (and one on every node,
                # whose run store may not be rank 0's)
                self._fail(f"rank {origin}: {msg}", where="setup")
            # everybody agreed to stop: nothing is pending, so the group can be torn down cleanly
            dist.destroy_process_group()
            return 1
        self._watch_peers()
        try:
            code = self._train(device, backend)
        except (TrainError, ValueError) as e:
            return self._fail(self._explain(str(e).splitlines()[0] if str(e) else type(e).__name__),
                              where=f"step {self.step}")
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            first = str(e).splitlines()[0] if str(e) else ""
            return self._fail(self._explain(f"{type(e).__name__}: {first}"), where=f"step {self.step}")
        if self.peers is not None:
            self.peers.mark_ended("done")
            self.peers.stop()
        dist.destroy_process_group()
        return code

    def _train(self, device: torch.device, backend: str) -> int:
        from workbench.runtime.checkpoint import restore
        from workbench.runtime.groups import GroupRegistry
        from workbench.runtime.model import Transformer
        from workbench.runtime.step import StepExecutor, check_plan, peak_memory_mb
        from workbench.runtime.weights import load_initial_weights
        from workbench.runtime.zero import parallelize
        from workbench.solve import plan_from_dict

        spec, env = self.spec, self.env
        world = env.world_size
        model_spec = self.cost.model
        sc = self.scenario
        # the plain model in fp32 (master weights); pretrained weights into it before anything wraps it
        # (a resume loads its checkpoint instead); then the stage the plans were made for
        model = Transformer(model_spec, seed=sc.seed).to(device=device, dtype=torch.float32)
        init_note = load_initial_weights(model, spec.init) if spec.init and self.resume_state is None else None
        zero = parallelize(model, zero_stage=sc.zero_stage, precision=sc.precision, recompute=sc.recompute,
                           device=device)
        lr = spec.learning_rate
        opt = zero.make_optimizer(spec.optimizer, lr=lr, momentum=spec.momentum, weight_decay=spec.weight_decay)
        start = 0
        if self.resume_state is not None:
            st = self.resume_state
            restore(st, model, zero)  # any layout, stage and world size it was written with
            start = int(st["step"])
            rng = st.get("rng", {})
            if "torch" in rng:
                torch.set_rng_state(rng["torch"])
            if device.type == "cuda" and "cuda" in rng:
                torch.cuda.set_rng_state(rng["cuda"], device)
            self.resume_state = None
        self.step = start
        # no process group yet: each step's plan gets its groups' ones when it first needs them (on every rank,
        # in the plan's order, before it runs; workbench.runtime.groups says why)
        registry = GroupRegistry(world, self.cost.degrees, shapes=self.cost.shapes, eager=False)
        executor = StepExecutor(model, registry, self.attn, device=device, zero=zero)
        planner = None
        if self.rank == 0:
            planner = RankZeroPlanner(sc.planner, self.plan_cost, seed=sc.seed, effort=sc.effort,
                                      time_limit=sc.time_limit, max_len=self.max_len, ahead=spec.plan_ahead,
                                      run_dir=self.run_dir)
            if planner.worker_pids():  # the plan-ahead worker and its helpers: a stop must reach them too
                runs.update_status(self.run_dir, node=self.node, pids={"workers": planner.worker_pids(),
                                                       **{k: v for p in planner.worker_pids()
                                                          for k, v in runs.process_record(p).items()}})
        # steps that ran in an earlier attempt after the checkpoint we resume from run again: say so
        ran_before = max((r.step for r in runs.Run(self.run_dir).steps()), default=0) if self.rank == 0 else 0
        resolved = {
            "world_size": world, "local_world_size": env.local_world_size, "nnodes": env.nnodes,
            "hosts": sorted({h for _, h in self.members.values()}),
            "device": device.type, "backend": backend,
            "attention": self.attn_name, "profile": self.cost.profile.name, "profile_note": self.cost_note,
            "max_len": self.max_len, "batch_size": self.batch_size, "batch_tokens": self.batch_tokens,
            "lr": lr, "degrees": list(self.cost.degrees), "shapes": [list(x) for x in registry.shapes],
            "planning": planner.mode if planner else None,
            "data": self.data.describe(), "sampler": self.sampler.describe(),
            "max_context": self.data.report.to_dict() if self.data.report is not None else None,
            "params": model_spec.params(), "scenario": sc.to_dict(),
            "checkpoints_skipped": self.resume_skipped, "init": init_note, "zero": zero.describe(),
            "zero_stage": zero.zero_stage, "precision": zero.precision, "recompute": zero.recompute,
            "execution": zero.execution, "machine": self.machine,
            "profile_from_this_machine": self.origin_note is None,
        }
        if self.rank == 0:
            if self.cost_note:
                _say(f"workbench train: warning: {self.cost_note}")
            _say(f"workbench train: {sc.model} ({model_spec.params():,} parameters) on {world} rank(s), {backend}, "
                 f"{device.type}; {zero.describe()}; {self.data.describe()}; {self.sampler.describe()}; planner {sc.planner} "
                 f"({resolved['planning']}); profile {self.cost.profile.name}")
            for why in self.resume_skipped:
                _say(f"workbench train: warning: skipped a checkpoint: {why}")
            if start:
                again = f"; steps {start + 1}-{ran_before} ran before and run again" if ran_before > start else ""
                _say(f"workbench train: resuming from {self.resume[1]} (step {start} of {spec.steps}){again}")
        self._write_status(state="running", step=start, steps=spec.steps, error=None,
                           resumed_from=start if self.resume is not None else None, resolved=resolved,
                           message=f"training from step {start}")
        sleep_s = float(spec.debug.get("step_sleep_s", 0.0))
        try:
            batch = self.sampler.batch(start) if start < spec.steps else None
            for step in range(start, spec.steps):
                self.step = step
                nxt = self.sampler.batch(step + 1) if step + 1 < spec.steps else None
                payload = [planner.payload(batch, nxt) if planner is not None else None]
                t_wait, bcast_start = time.perf_counter(), time.time()
                dist.broadcast_object_list(payload, src=0)
                bcast_ms = (time.perf_counter() - t_wait) * 1e3
                msg = payload[0]
                if "error" in msg:
                    raise TrainError(msg["error"])
                plan = plan_from_dict(msg["plan"])
                lengths = [int(x) for x in batch.lengths]
                # same verdict on every rank; a plan made for another stage, precision or
                # recomputation is refused here, naming both
                check_plan(plan, lengths, world, registry.degrees, zero_stage=zero.zero_stage,
                           precision=zero.precision, recompute=zero.recompute, shapes=registry.shapes)
                # every rank holds this same plan (broadcast above, checked alike): the process groups it needs
                # and no earlier plan made are made now, by every rank in plan_rank_sets' order
                registry.ensure(plan)
                if self.rank == 0:
                    runs.append_jsonl(self.run_dir / runs.PLANS_FILE, {
                        "step": step, "attempt": self.attempt, "batch_id": batch.batch_id,
                        "plan_wait_s": msg.get("plan_wait_s"), "plan": msg["plan"]})
                seqs = [torch.from_numpy(self.data.tokens(int(i))) for i in batch.indices]
                profiler = _torch_profiler(device) if spec.torch_profile == step + 1 else None
                if profiler is not None:
                    profiler.__enter__()
                res = executor.run(plan, seqs)
                t_opt = time.perf_counter()
                grad_norm = None
                if spec.grad_clip > 0:
                    grad_norm = zero.clip_grad_norm(spec.grad_clip)
                opt.step()
                torch_trace = self._torch_trace(profiler, step + 1) if profiler is not None else None
                # what this rank holds, from tensor storage: parameters and optimizer states now (after
                # the step), gradients at the step's peak (before a ZeRO-2 reduce freed any)
                states = zero.state_bytes()
                opt.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                opt_ms = (time.perf_counter() - t_opt) * 1e3
                if not math.isfinite(res.loss):
                    raise TrainError(f"loss is {res.loss} at step {step}; lower --lr or set a gradient clip")
                peak = max([r.peak_memory_mb for r in res.records] + [peak_memory_mb(device)])
                runs.append_jsonl(runs.metrics_path(self.run_dir, self.node), {
                    "step": step, "rank": self.rank, "attempt": self.attempt, "repeat": step < ran_before,
                    "batch_id": batch.batch_id, "loss": res.loss,
                    "tokens": sum(r.tokens for r in res.records), "batch_tokens": res.tokens,
                    "sequences": len(lengths), "targets": res.targets,
                    "predicted_ms": plan.makespan_ms, "measured_ms": res.measured_ms + opt_ms,
                    "step_ms": res.measured_ms, "allreduce_ms": res.allreduce_ms, "optimizer_ms": opt_ms,
                    "broadcast_ms": bcast_ms, "plan_wait_s": msg.get("plan_wait_s"), "planner": plan.planner,
                    "grad_norm": grad_norm, "lr": lr, "peak_memory_mb": peak, "time": time.time(),
                    "model_states": states, "execution": res.execution, "start_time": res.start_time,
                    "broadcast_start_time": bcast_start,
                    **({"torch_trace": torch_trace} if torch_trace else {}),
                    **({"max_memory_allocated_bytes": torch.cuda.max_memory_allocated(device)}
                       if device.type == "cuda" else {}),
                    "micro_steps": [r.to_dict() for r in res.records],
                })
                done = step + 1
                self.step = done
                if spec.checkpoint_every and (done % spec.checkpoint_every == 0 or done == spec.steps):
                    self._checkpoint(done, model, zero, device)  # every rank: sharded or consolidated
                if self.rank == 0:
                    again = " (again, after resume)" if step < ran_before else ""
                    print(f"step {done}/{spec.steps}{again} loss {res.loss:.4f} tokens {res.tokens:,} "
                          f"measured {res.measured_ms + opt_ms:,.0f} ms predicted {plan.makespan_ms:,.0f} ms "
                          f"({len(plan.micro_steps)} micro-step(s), {plan.planner})", flush=True)
                    self._write_status(state="running", step=done, loss=res.loss, message=f"step {done}/{spec.steps}")
                if sleep_s:
                    time.sleep(sleep_s)
                batch = nxt
            # a checkpoint is complete before anyone reports done
            dist.barrier(device_ids=[device.index]) if device.type == "cuda" else dist.barrier()
        finally:
            if planner is not None:
                planner.close()
        # "done" is the supervisor's word, written once every process of the run has exited
        self._write_status(step=self.step, message=f"trained {self.step} steps; exiting")
        return 0

    def _torch_trace(self, profiler, step: int) -> str | None:
        """End ``profiler`` (recording step ``step``, 1-based) and write its Chrome trace next to the
        run's files (``runs.torch_trace_path``); returns the file's name, or None (said in the log)
        when it could not be written. The optimizer step is inside the recording, as in the step's
        ``measured_ms``."""
        try:
            profiler.__exit__(None, None, None)
            path = runs.torch_trace_path(self.run_dir, step, self.rank)
            profiler.export_chrome_trace(str(path))
        except Exception as e:  # noqa: BLE001 - a failed recording must not end the run
            _say(f"workbench train: warning (rank {self.rank}): torch.profiler could not record step {step}: {e}")
            return None
        if self.rank == 0:
            _say(f"workbench train: torch.profiler recorded step {step} (every rank): {path.name} and the other "
                 f"ranks' beside it in {self.run_dir}; this step's times include the profiler's overhead")
        return path.name

    def _checkpoint(self, done: int, model, zero, device: torch.device) -> None:
        """Every rank: a sharded folder under ZeRO-3 (each rank writes its shards), else a whole file
        written by rank 0 (ZeRO 1-2 consolidate the optimizer's states there first)."""
        from workbench.runtime.checkpoint import save_sharded, save_whole

        rng = {"torch": torch.get_rng_state()}
        if device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(device)
        state = {
            "format": CHECKPOINT_FORMAT, "step": done,
            "sampler": {"next_step": done, "seed": self.scenario.seed, "batch_size": self.batch_size,
                        "batch_tokens": self.batch_tokens, "lengths": self.scenario.source,
                        "data": self.data.fingerprint},
            "rng": rng, "spec": json.dumps(self.spec.to_dict()), "zero_stage": zero.zero_stage,
            "precision": zero.precision, "world_size": self.env.world_size,
        }
        if zero.zero_stage == 3:
            save_sharded(checkpoint_path(self.run_dir, done, sharded=True), model, zero.optimizer, state)
            return
        optimizer = zero.optimizer_state_dict()  # collective under ZeRO 1-2
        if self.rank == 0:
            state.update(model={k: v.detach().cpu() for k, v in model.state_dict().items()}, optimizer=optimizer)
            save_whole(checkpoint_path(self.run_dir, done), state)


def _torch_profiler(device: torch.device):
    """A ``torch.profiler.profile`` of CPU activity (and CUDA kernels on a GPU), not yet entered."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    return profile(activities=acts, record_shapes=False, with_stack=False)


def main(argv: list[str] | None = None) -> int:
    """Entry point of one rank; returns its exit status (0 done, 1 failed, 2 bad arguments)."""
    p = argparse.ArgumentParser(prog="python -m workbench.runtime.train",
                                description="one rank of a workbench training run (start it with torchrun)")
    p.add_argument("--run-dir", required=True, help="the run folder holding spec.json")
    args = p.parse_args(argv)
    env = DistEnv.from_env()
    _parent_watchdog()
    gc.freeze()  # what the imports made lives to the end: no collection walks it again (~0.1-0.3 s each)
    return Trainer(Path(args.run_dir), env).run()


if __name__ == "__main__":
    from workbench.util import exit_process

    exit_process(main())
