"""The Plan of one training step, its timeline, its lower bound, and ``validate``.

A Plan is a list of micro-steps; each micro-step partitions (some of) the ranks into SP groups
``(degree, ranks)`` and gives each group the indices of the sequences it runs. Groups are aligned
blocks of consecutive ranks: a group of degree d holds ranks ``[k*d, (k+1)*d)``.

Timing semantics (the same the runtime has) depend on the plan's ``execution``, fixed by the
ZeRO stage it was planned for:

- ``free`` (ZeRO 0-2): a rank runs its micro-steps in order, and a group starts when all its ranks
  have finished their previous micro-step; there is no global barrier between micro-steps. After
  the last micro-step every rank joins the gradient reduction. So ``makespan = max over ranks of its
  finish time + grad_sync``. For a static layout this is the slowest replica's sum of micro-batches;
  for a plan that changes groups between micro-steps a rank may wait for the ranks of its next
  group. No rank is in two groups of one micro-step.
- ``lockstep`` (ZeRO-3): every micro-step is a *pass* that all ranks run together (FSDP all-gathers
  every unit's parameters over all ranks in each forward and backward). In a pass a rank may serve
  several groups (their tokens go through one packed forward and backward; each layer runs the
  attention of its groups in the order the pass lists them, the same order on every rank), holding
  the activations of all of them. A rank's load in a pass is the sum of its groups' ``time_ms`` less
  ``shared_overhead_ms`` for every group after its first (the packed call's constant, paid once);
  the pass lasts ``max(largest rank load, pass_comm_ms) + pass_overhead_ms`` and the makespan is the
  sum of the passes (gradients are reduce-scattered inside every pass: ``grad_sync_ms`` is 0).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from workbench.cost import CostModel
from workbench.cost.offload import OFFLOAD_LEVELS
from workbench.solve.bound import lower_bound_ms

__all__ = [
    "Group",
    "MicroStep",
    "Plan",
    "PlanError",
    "build_plan",
    "timeline",
    "validate",
    "plan_from_dict",
    "pass_loads",
    "arrange_passes",
    "with_swap",
    "EXECUTIONS",
]

EXECUTIONS = ("free", "lockstep")

STATUSES = ("optimal", "feasible", "heuristic", "fallback")


class PlanError(ValueError):
    """A plan that breaks a rule: overlapping ranks, missing sequences, memory overflow..."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Group:
    """One SP group in one micro-step."""

    degree: int
    ranks: tuple[int, ...]
    sequences: tuple[int, ...]
    """Indices into the step's batch."""
    lengths: tuple[int, ...]
    time_ms: float
    """Predicted time: group overhead + sum of the sequences' times."""
    memory_gb: float
    """Predicted activation memory per GPU."""
    cp: int = 1
    """Context-parallel size of the group's split: ``degree = ulysses x cp`` ranks, Ulysses (heads
    scattered, all-to-all) over ``ulysses`` consecutive ranks inside context parallelism (tokens
    kept, K/V all-gathered) over ``cp`` ranks. 1: Ulysses over the whole group (plans written
    before splits existed)."""
    offload: str = "none"
    """The group's offload level (``workbench.cost.offload``): ``none``, or ``inputs`` (its block inputs
    in host memory between forward and backward, its MLP in token tiles). Plans written before
    offload existed have none."""
    host_gb: float = 0.0
    """Predicted host memory per GPU of the group's offloaded activations (GB)."""
    swap_layers: int = 0
    """How many of the model's blocks the group swaps: runs without recomputation, their whole
    activations kept in host memory (``workbench.cost.offload.swap_blocks`` says which). 0: every
    block recomputed (plans written before swap existed)."""

    def __post_init__(self) -> None:
        if self.cp < 1 or self.degree % self.cp:
            raise PlanError(f"group at ranks {list(self.ranks)[:1]}..: context-parallel size {self.cp} does not divide "
                            f"its degree {self.degree} (a group of degree d runs as ulysses x cp = d)")
        if self.swap_layers < 0:
            raise PlanError(f"group at ranks {list(self.ranks)[:1]}..: swap_layers {self.swap_layers} is negative")
        if self.offload not in OFFLOAD_LEVELS:
            raise PlanError(f"group at ranks {list(self.ranks)[:1]}..: offload {self.offload!r} is not one of "
                            f"{', '.join(OFFLOAD_LEVELS)}")

    @property
    def ulysses(self) -> int:
        """Ulysses size of the group's split (``degree // cp``)."""
        return self.degree // self.cp

    @property
    def split(self) -> str:
        """The split in words, ``"u x c"`` (``"8x1"``: Ulysses over 8 ranks; ``"1x8"``: context parallelism)."""
        return f"{self.ulysses}x{self.cp}"

    def to_dict(self) -> dict:
        return {"degree": self.degree, "ulysses": self.ulysses, "cp": self.cp, "ranks": list(self.ranks),
                "sequences": list(self.sequences), "lengths": list(self.lengths), "time_ms": self.time_ms,
                "memory_gb": self.memory_gb, "offload": self.offload, "host_gb": self.host_gb,
                "swap_layers": self.swap_layers}


@dataclass(frozen=True, kw_only=True, slots=True)
class MicroStep:
    """One micro-step: under free execution groups on disjoint ranks; under lockstep one pass, its
    groups in the order every rank runs them (a rank may be in several)."""

    groups: tuple[Group, ...]
    time_ms: float | None = None
    """Lockstep: the pass's predicted duration (compute or FSDP's collectives, plus the pass
    overhead); None under free execution, where micro-steps overlap across ranks."""

    def to_dict(self) -> dict:
        out: dict = {"groups": [g.to_dict() for g in self.groups]}
        if self.time_ms is not None:
            out["time_ms"] = self.time_ms
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """One step's plan; plain data (``to_dict``) that the CLI prints and panels draw."""

    planner: str
    status: str
    """``optimal`` (proved), ``feasible`` (solver stopped at its limit), ``heuristic`` (a
    baseline or greedy rule: no optimality claim), ``fallback`` (a solver failed; see reason)."""
    makespan_ms: float
    lower_bound_ms: float
    solve_seconds: float
    micro_steps: tuple[MicroStep, ...]
    num_gpus: int
    grad_sync_ms: float = 0.0
    memory_budget_gb: float = math.inf
    batch_id: str | None = None
    reason: str = ""
    """Why the status is what it is (e.g. why a solver fell back)."""
    stats: dict = field(default_factory=dict)
    """Planner-specific figures (buckets, solver bound, iterations...)."""
    execution: str = "free"
    """``free`` (ZeRO 0-2: barrier-free micro-steps) or ``lockstep`` (ZeRO-3: passes every rank
    joins); see the module docstring. Plans written before this field existed are free."""
    zero_stage: int | None = None
    """The ZeRO stage the plan was made for (None: not recorded)."""
    precision: str | None = None
    """``bf16`` or ``fp32``: what the plan's memory and communication assume (None: not recorded)."""
    recompute: bool = False
    """Whether the plan assumes per-block activation recomputation."""
    shared_overhead_ms: float = 0.0
    """Lockstep: the part of every group's ``time_ms`` a rank pays once per pass however many groups
    it serves (the packed call's constant)."""
    pass_comm_ms: float = 0.0
    """Lockstep: FSDP's all-gathers and reduce-scatters of one pass; a pass is at least this long."""
    pass_overhead_ms: float = 0.0
    """Lockstep: what every pass costs on top of its compute (or its collectives)."""
    optimizer_ms: float = 0.0
    """The optimizer step after the last micro-step (in the makespan, after the gradient sync)."""

    @property
    def gap(self) -> float:
        """makespan / lower bound - 1."""
        return self.makespan_ms / self.lower_bound_ms - 1.0 if self.lower_bound_ms > 0 else 0.0

    @property
    def idle_share(self) -> float:
        """The GPU-time in which GPUs wait with nothing of their own to compute, as a share of the
        step's GPU-time (``num_gpus x makespan``): in a lockstep pass each rank waits for the pass's
        busiest (its load against the largest); in free execution each rank waits from the end of its
        own work to the end of the last rank's (``timeline``); a rank in no group waits throughout.
        What no plan avoids (collectives, the optimizer step) is not counted as waiting."""
        if not self.micro_steps or self.makespan_ms <= 0:
            return 0.0
        n = self.num_gpus
        if self.execution == "lockstep":
            idle = sum(float(load.max()) * n - float(load.sum()) for load in pass_loads(self) if load.size)
        else:
            t = timeline(self)
            busy = np.asarray(t["rank_busy_ms"], dtype=np.float64)
            idle = float((float(t["compute_end_ms"]) - busy).clip(min=0.0).sum())
        return max(0.0, idle / (n * self.makespan_ms))

    @property
    def num_sequences(self) -> int:
        return sum(len(g.sequences) for m in self.micro_steps for g in m.groups)

    def with_batch(self, batch_id: str | None) -> "Plan":
        """The same plan tagged with the id of the batch it was made for."""
        return dataclasses.replace(self, batch_id=batch_id)

    def to_dict(self, measured: bool = True) -> dict:
        """The plan as plain JSON (the ``workbench plan --json`` shape). Everything in it is a function
        of the batch, the scenario, the seed and the effort (DESIGN.md), except what the machine
        measured while planning: ``solve_seconds`` and ``stats["wall"]``; ``measured=False`` leaves
        those out, so that the same inputs give byte-identical JSON on any machine."""
        stats = self.stats if measured else {k: v for k, v in self.stats.items() if k != "wall"}
        out = {
            "planner": self.planner,
            "status": self.status,
            "makespan_ms": self.makespan_ms,
            "lower_bound_ms": self.lower_bound_ms,
            "gap": self.gap,
            "idle_share": self.idle_share,
            "solve_seconds": self.solve_seconds,
            "num_gpus": self.num_gpus,
            "grad_sync_ms": self.grad_sync_ms,
            "memory_budget_gb": self.memory_budget_gb if math.isfinite(self.memory_budget_gb) else None,
            "batch_id": self.batch_id,
            "reason": self.reason,
            "stats": stats,
            "execution": self.execution,
            "zero_stage": self.zero_stage,
            "precision": self.precision,
            "recompute": self.recompute,
            "shared_overhead_ms": self.shared_overhead_ms,
            "pass_comm_ms": self.pass_comm_ms,
            "pass_overhead_ms": self.pass_overhead_ms,
            "optimizer_ms": self.optimizer_ms,
            "micro_steps": [m.to_dict() for m in self.micro_steps],
        }
        if not measured:
            del out["solve_seconds"]
        return out


def plan_from_dict(d: Mapping[str, Any]) -> Plan:
    """Rebuild a Plan from ``Plan.to_dict()`` output (e.g. a line of plans.jsonl)."""
    try:
        micro = tuple(
            MicroStep(groups=tuple(
                _group_from_dict(g) for g in m["groups"]), time_ms=None if m.get("time_ms") is None else float(m["time_ms"]))
            for m in d["micro_steps"])
        budget = d.get("memory_budget_gb")
        execution = str(d.get("execution") or "free")
        zero = d.get("zero_stage")
        plan = Plan(planner=str(d["planner"]), status=str(d["status"]), makespan_ms=float(d["makespan_ms"]),
                    lower_bound_ms=float(d["lower_bound_ms"]), solve_seconds=float(d.get("solve_seconds", 0.0)),
                    micro_steps=micro, num_gpus=int(d["num_gpus"]), grad_sync_ms=float(d.get("grad_sync_ms", 0.0)),
                    memory_budget_gb=math.inf if budget is None else float(budget), batch_id=d.get("batch_id"),
                    reason=str(d.get("reason", "")), stats=dict(d.get("stats", {})), execution=execution,
                    zero_stage=None if zero is None else int(zero), precision=d.get("precision"),
                    recompute=bool(d.get("recompute", False)),
                    shared_overhead_ms=float(d.get("shared_overhead_ms", 0.0)),
                    pass_comm_ms=float(d.get("pass_comm_ms", 0.0)), pass_overhead_ms=float(d.get("pass_overhead_ms", 0.0)),
                    optimizer_ms=float(d.get("optimizer_ms", 0.0)))
    except PlanError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise PlanError(f"not a plan: {e!r} (expected the shape of `workbench plan --json`)") from None
    if plan.execution not in EXECUTIONS:
        raise PlanError(f"not a plan: execution {plan.execution!r} is not one of {', '.join(EXECUTIONS)}")
    return plan


def _group_from_dict(g: Mapping[str, Any]) -> Group:
    """A Group from its ``to_dict`` form; a group written before splits existed (no ``cp``) is
    Ulysses over the whole group. Raises PlanError when ``ulysses x cp`` is not the degree."""
    degree, cp = int(g["degree"]), int(g.get("cp", 1))
    if "ulysses" in g and int(g["ulysses"]) * cp != degree:
        raise PlanError(f"not a plan: a group of degree {degree} says ulysses {g['ulysses']} x cp {cp} "
                        f"(ulysses x cp must be the degree)")
    return Group(degree=degree, cp=cp, ranks=tuple(int(r) for r in g["ranks"]),
                 sequences=tuple(int(i) for i in g["sequences"]), lengths=tuple(int(x) for x in g["lengths"]),
                 time_ms=float(g["time_ms"]), memory_gb=float(g["memory_gb"]),
                 offload=str(g.get("offload") or "none"), host_gb=float(g.get("host_gb") or 0.0),
                 swap_layers=int(g.get("swap_layers") or 0))


# ----------------------------------------------------------------------------------------------
# building plans from an assignment
# ----------------------------------------------------------------------------------------------

GroupSpec = tuple  # (degree, sequence indices) or (degree, sequence indices, cp)


def group_time(cost: CostModel, lengths: np.ndarray, degree: int, seqs: Sequence[int], cp: int = 1) -> float:
    """Predicted time of one group of split ``(degree/cp) x cp``: its fixed overhead plus its sequences' times."""
    if len(seqs) == 0:
        return 0.0
    return cost.group_ms(lengths[list(seqs)], degree, cp)


def group_memory(cost: CostModel, lengths: np.ndarray, degree: int, seqs: Sequence[int], cp: int = 1) -> float:
    """Predicted activation memory per GPU of one group of split ``(degree/cp) x cp``."""
    if len(seqs) == 0:
        return 0.0
    return float(cost.memory(lengths[list(seqs)], degree, cp).sum())


def _with_splits(micro_steps, lengths: np.ndarray, cost: CostModel) -> list[list[tuple[int, list[int], int]]]:
    """Every group spec as ``(degree, members, cp)``: a spec without ``cp`` gets the split of its
    degree under which the group is fastest within the memory budget (``CostModel.best_split``)."""
    out = []
    for groups in micro_steps:
        row = []
        for g in groups:
            d, seqs = int(g[0]), [int(i) for i in g[1]]
            c = int(g[2]) if len(g) > 2 else (cost.best_split(lengths[seqs], d) if seqs else 1)
            row.append((d, seqs, c))
        out.append(row)
    return out


def build_plan(
    planner: str,
    micro_steps: Iterable[Iterable[GroupSpec]],
    lengths,
    cost: CostModel,
    *,
    status: str = "heuristic",
    solve_seconds: float = 0.0,
    reason: str = "",
    stats: dict | None = None,
    blocks: Iterable[Iterable[int]] | None = None,
    lower_bound: float | None = None,
    swap: bool = False,
) -> Plan:
    """Turn an assignment ``[[(degree, [seq, ...]), ...] per micro-step]`` into a Plan of the cost
    model's execution (``cost.execution``). A group may say its split, ``(degree, [seq, ...], cp)``;
    without it the group takes the split of its degree under which it is fastest within the memory
    budget (``CostModel.best_split``: under a one-split strategy, the degree's only one).

    Free: ranks are placed per micro-step, larger degrees first; each group takes the free aligned
    block whose ranks are ready earliest (so heavy work lands on ranks that finished early), unless
    ``blocks`` fixes the block index of every group (static layouts keep their replicas). Lockstep:
    every micro-step is a pass; groups take the lowest free aligned blocks (larger degrees first),
    unless ``blocks`` fixes them, and then groups of one pass may share ranks (a rank serving several
    groups in the pass). Empty groups, and passes left empty, are dropped. ``swap``: each placed group
    swaps the blocks that make it fastest (``CostModel.choose_swap``; in a lockstep pass only groups
    whose ranks serve no other group), where the cost model lets groups swap. Raises PlanError when a
    micro-step's groups need more ranks than exist, or fixed blocks overlap in a free micro-step.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    n = cost.cluster.num_gpus
    lockstep = cost.execution == "lockstep"
    ready = np.zeros(n)
    out: list[MicroStep] = []
    fixed = [list(b) for b in blocks] if blocks is not None else None
    # each shape's per-sequence times and memories once (the same figures as group_time's)
    t_of: dict[tuple[int, int], np.ndarray] = {}
    m_of: dict[tuple[int, int], np.ndarray] = {}

    def _group_time(d: int, seqs, c: int) -> float:
        if cost.can_offload:
            return _group_at(d, seqs, c)[1]
        if (d, c) not in t_of:
            t_of[d, c] = cost.time(lengths, d, c)
        return cost.group_overhead_ms(d, c) + float(t_of[d, c][list(seqs)].sum())

    def _group_at(d: int, seqs, c: int) -> tuple[str, float, float, float]:
        """``(offload level, time, GPU memory, host memory)`` of a group at the level it needs."""
        s = lengths[list(seqs)]
        level = cost.group_offload(s, d, c)
        return (level, *cost.group_at(s, d, c, level))

    def _group_memory(d: int, seqs, c: int) -> float:
        if (d, c) not in m_of:
            m_of[d, c] = cost.memory(lengths, d, c)
        return float(m_of[d, c][list(seqs)].sum())

    shared = cost.call_overhead_ms() if lockstep else 0.0
    micro_steps = _with_splits(micro_steps, lengths, cost)
    if lockstep and fixed is None:
        micro_steps = _arranged(micro_steps, lengths, cost, n, _group_time)
    total = 0.0
    for m, groups in enumerate(micro_steps):
        fixed_m = fixed[m] if fixed is not None else None
        if fixed_m is not None and len(fixed_m) != len(groups):
            raise PlanError(f"micro-step {m}: {len(groups)} groups but {len(fixed_m)} fixed blocks")
        need = sum(d for d, s, _ in groups if s)
        if need > n and fixed_m is None:
            raise PlanError(f"micro-step {m}: groups need {need} ranks but the cluster has {n}")
        timed = [(d, s, _group_time(d, s, c), k, c) for k, (d, s, c) in enumerate(groups) if s]
        timed.sort(key=lambda x: (-x[0], -x[2]))
        used = np.zeros(n, dtype=bool)
        placed: list[Group] = []
        for d, s, t, k, c in timed:
            if fixed_m is not None:
                b = fixed_m[k]
                if not 0 <= b < n // d:
                    raise PlanError(f"micro-step {m}: fixed block {b} of degree {d} is out of range")
                if used[b * d:(b + 1) * d].any() and not lockstep:
                    raise PlanError(f"micro-step {m}: fixed block {b} of degree {d} is taken")
            elif lockstep:
                free = ~used[: (n // d) * d].reshape(-1, d).any(axis=1)
                if not free.any():
                    raise PlanError(f"micro-step {m}: no free aligned block of degree {d} left")
                b = int(np.argmax(free))
            else:
                block_ready = ready[: (n // d) * d].reshape(-1, d).max(axis=1)
                block_used = used[: (n // d) * d].reshape(-1, d).any(axis=1)
                block_ready = np.where(block_used, np.inf, block_ready)
                b = int(np.argmin(block_ready))
                if not math.isfinite(block_ready[b]):
                    raise PlanError(f"micro-step {m}: no free aligned block of degree {d} left")
            lo, hi = b * d, (b + 1) * d
            used[lo:hi] = True
            level, _, gpu, host = _group_at(d, s, c) if cost.can_offload else ("none", t, _group_memory(d, s, c), 0.0)
            k = 0
            if swap and cost.swap and not lockstep:  # a free micro-step is one group per rank: it may swap
                k = cost.choose_swap(lengths[list(s)], d, c, level)
                if k:
                    t, gpu, host = cost.group_at(lengths[list(s)], d, c, level, k)
            if not lockstep:
                start = ready[lo:hi].max()
                ready[lo:hi] = start + t
            placed.append(Group(degree=d, cp=c, ranks=tuple(range(lo, hi)), sequences=tuple(int(i) for i in s),
                                lengths=tuple(int(lengths[i]) for i in s), time_ms=t, memory_gb=gpu,
                                offload=level, host_gb=host, swap_layers=k))
        placed.sort(key=lambda g: (g.ranks[0], -g.degree))
        if not placed:
            continue
        if swap and lockstep and cost.swap:
            placed = _swapped(placed, cost)
        if lockstep:
            load = _rank_loads(placed, n, shared)
            pass_ms = cost.pass_ms(float(load.max()))
            total += pass_ms
            out.append(MicroStep(groups=tuple(placed), time_ms=pass_ms))
        else:
            out.append(MicroStep(groups=tuple(placed)))
    grad, opt = cost.grad_sync_ms(), cost.optimizer_ms()
    compute = total if lockstep else (float(ready.max()) if out else 0.0)
    lb = lower_bound_ms(lengths, cost) if lower_bound is None else lower_bound
    return Plan(planner=planner, status=status, makespan_ms=compute + grad + opt, lower_bound_ms=lb,
                solve_seconds=solve_seconds, micro_steps=tuple(out), num_gpus=n, grad_sync_ms=grad,
                memory_budget_gb=cost.memory_budget_gb, reason=reason, stats=dict(stats or {}),
                execution=cost.execution, zero_stage=cost.cluster.zero_stage, precision=cost.precision,
                recompute=cost.recompute, shared_overhead_ms=shared,
                pass_comm_ms=cost.pass_comm_ms(), pass_overhead_ms=cost.pass_overhead_ms(), optimizer_ms=opt)


def with_swap(plan: Plan, lengths, cost: CostModel) -> Plan:
    """``plan`` with each of its groups swapping the blocks that make it fastest (``build_plan``'s
    ``swap``), the same groups on the same ranks in the same micro-steps: every group as fast or
    faster, so the step too; its lower bound the cost model's (each sequence at its least). The plan
    itself where the cost model lets no group swap. A plan proved optimal without swap keeps the
    claim only if it still meets its bound."""
    if not cost.swap or not plan.micro_steps:
        return plan
    steps = [[(g.degree, list(g.sequences), g.cp) for g in ms.groups] for ms in plan.micro_steps]
    blocks = [[g.ranks[0] // g.degree for g in ms.groups] for ms in plan.micro_steps]
    out = build_plan(plan.planner, steps, lengths, cost, status=plan.status, solve_seconds=plan.solve_seconds,
                     reason=plan.reason, stats=plan.stats, blocks=blocks, swap=True)
    if out.makespan_ms > plan.makespan_ms * (1 + 1e-9):  # every group is as fast or faster: kept as a guard
        return plan
    status = out.status
    if status == "optimal" and out.makespan_ms > out.lower_bound_ms * (1 + 1e-6):
        status = "feasible"
    swapped = sum(1 for ms in out.micro_steps for g in ms.groups if g.swap_layers)
    stats = dict(out.stats, swap={"groups": swapped, "before_ms": plan.makespan_ms})
    return dataclasses.replace(out, status=status, stats=stats, batch_id=plan.batch_id)


def _swapped(groups: list[Group], cost: CostModel) -> list[Group]:
    """A lockstep pass's groups with the blocks each swaps (``CostModel.choose_swap``): a rank packs
    all its groups of a pass into one forward, where a block is swapped or recomputed for all of it,
    so only groups whose ranks serve no other group in the pass swap."""
    serving: dict[int, int] = {}
    for g in groups:
        for r in g.ranks:
            serving[r] = serving.get(r, 0) + 1
    out = []
    for g in groups:
        if all(serving[r] == 1 for r in g.ranks):
            k = cost.choose_swap(g.lengths, g.degree, g.cp, g.offload)
            if k:
                t, gpu, host = cost.group_at(g.lengths, g.degree, g.cp, g.offload, k)
                g = dataclasses.replace(g, time_ms=t, memory_gb=gpu, host_gb=host, swap_layers=k)
        out.append(g)
    return out


def _arranged(micro_steps, lengths, cost: CostModel, n: int, group_time) -> list:
    """A lockstep step's passes from a planner's micro-steps: as given, or the same groups arranged
    longest first into passes (``arrange_passes``), whichever sums to less. Planners whose
    micro-step index means "the k-th group of a replica" (barrier-free thinking) thus get the
    passes a lockstep run would pick for the same groups."""
    given = [[(int(d), list(s), int(c)) for d, s, c in groups if len(s)] for groups in micro_steps]
    given = [g for g in given if g]
    flat = [g for groups in given for g in groups]
    if not flat:
        return given
    times = [group_time(d, s, c) for d, s, c in flat]

    def total(passes) -> float:
        return sum(cost.pass_ms(max(times[k] for k in ks)) for ks in passes)

    k = 0
    as_given = []
    for groups in given:
        as_given.append(list(range(k, k + len(groups))))
        k += len(groups)
    ffd = arrange_passes(flat, times, n)
    best = ffd if total(ffd) < total(as_given) * (1 - 1e-12) else as_given
    return [[flat[k] for k in ks] for ks in best]


def arrange_passes(groups, times, n: int) -> list[list[int]]:
    """Indices of ``groups`` (``(degree, members, ...)``) per lockstep pass: longest first, each into the
    first pass with ranks to spare (the degrees of a pass sum to at most ``n``; powers of two that
    each divide the next then always pack into aligned blocks). Longest first makes every pass as
    long as its first group, which keeps the passes' sum small."""
    order = np.argsort(-np.asarray(times, dtype=np.float64), kind="stable")
    free: list[int] = []
    out: list[list[int]] = []
    for k in order:
        d = int(groups[k][0])
        for p, f in enumerate(free):
            if f >= d:
                out[p].append(int(k))
                free[p] -= d
                break
        else:
            out.append([int(k)])
            free.append(n - d)
    return out


def _rank_loads(groups: Sequence[Group], n: int, shared: float) -> np.ndarray:
    """Per rank, its load in one lockstep pass: the summed ``time_ms`` of its groups, less the
    shared overhead for every group after the first."""
    load = np.zeros(n)
    count = np.zeros(n, dtype=np.int64)
    for g in groups:
        r = list(g.ranks)
        load[r] += g.time_ms
        count[r] += 1
    return load - shared * np.maximum(count - 1, 0)


def pass_loads(plan: Plan) -> list[np.ndarray]:
    """Per lockstep pass, every rank's load (ms; 0 for an idle rank). Raises PlanError for a free plan."""
    if plan.execution != "lockstep":
        raise PlanError(f"pass loads are defined for lockstep plans; this plan is {plan.execution}")
    return [_rank_loads(ms.groups, plan.num_gpus, plan.shared_overhead_ms) for ms in plan.micro_steps]


def _pass_ms(plan: Plan, load: np.ndarray) -> float:
    return max(float(load.max()) if load.size else 0.0, plan.pass_comm_ms) + plan.pass_overhead_ms


def timeline(plan: Plan) -> dict:
    """Replay a plan's groups on its ranks: per group start/end, per rank busy and finish times.

    Returns plain data: ``{"execution", "groups": [{micro_step, degree, ranks, start_ms, end_ms,
    sequences}], "rank_busy_ms", "rank_finish_ms", "compute_end_ms", "makespan_ms", "passes"}`` (the
    makespan includes the gradient sync). Free plans replay barrier-free (``passes`` is empty).
    Lockstep plans replay pass by pass: a pass starts when the previous one ended on every rank; a
    rank runs its groups of the pass in the listed order (the first carries the shared overhead);
    ``passes`` gives each pass's ``start_ms``, ``end_ms``, ``compute_ms`` (its largest rank load),
    ``comm_ms`` and ``overhead_ms``, and ``waits`` every rank's wait for the end of a pass
    (``{micro_step, rank, start_ms, end_ms}``; empty for free plans).
    """
    n = plan.num_gpus
    busy = np.zeros(n)
    rows = []
    if plan.execution == "lockstep":
        t = 0.0
        passes = []
        waits = []
        for m, ms in enumerate(plan.micro_steps):
            cursor = np.full(n, t)
            first = np.ones(n, dtype=bool)
            for g in ms.groups:
                r = list(g.ranks)
                dur = g.time_ms - (plan.shared_overhead_ms if not first[r].any() else 0.0)
                start = float(cursor[r].max())
                cursor[r] = start + dur
                first[r] = False
                rows.append({"micro_step": m, "degree": g.degree, "ulysses": g.ulysses, "cp": g.cp, "ranks": [r[0], r[-1]],
                             "start_ms": start,
                             "end_ms": start + dur, "sequences": len(g.sequences)})
            load = _rank_loads(ms.groups, n, plan.shared_overhead_ms)
            busy += load
            dur = ms.time_ms if ms.time_ms is not None else _pass_ms(plan, load)
            passes.append({"micro_step": m, "start_ms": t, "end_ms": t + dur, "compute_ms": float(load.max()),
                           "comm_ms": plan.pass_comm_ms, "overhead_ms": plan.pass_overhead_ms})
            # every rank waits from the end of its own work to the end of the pass
            for r in range(n):
                if t + dur - (t + load[r]) > 1e-9:
                    waits.append({"micro_step": m, "rank": r, "start_ms": float(t + load[r]), "end_ms": float(t + dur)})
            t += dur
        finish = np.full(n, t)
        return {"execution": "lockstep", "groups": rows, "rank_busy_ms": busy.tolist(), "rank_finish_ms": finish.tolist(),
                "compute_end_ms": t, "makespan_ms": t + plan.grad_sync_ms + plan.optimizer_ms, "passes": passes,
                "waits": waits}
    ready = np.zeros(n)
    for m, ms in enumerate(plan.micro_steps):
        for g in sorted(ms.groups, key=lambda g: (-g.degree, -g.time_ms)):
            r = list(g.ranks)
            start = float(ready[r].max())
            ready[r] = start + g.time_ms
            busy[r] += g.time_ms
            rows.append({"micro_step": m, "degree": g.degree, "ulysses": g.ulysses, "cp": g.cp, "ranks": [r[0], r[-1]],
                             "start_ms": start,
                         "end_ms": start + g.time_ms, "sequences": len(g.sequences)})
    end = float(ready.max()) if rows else 0.0
    return {"execution": "free", "groups": rows, "rank_busy_ms": busy.tolist(), "rank_finish_ms": ready.tolist(),
            "compute_end_ms": end, "makespan_ms": end + plan.grad_sync_ms + plan.optimizer_ms, "passes": [], "waits": []}


def validate(plan: Plan, lengths, cluster, cost: CostModel | None = None, *, rtol: float = 1e-6) -> None:
    """Check a plan against its batch and cluster; raise PlanError saying what is wrong and where.

    Checks: the plan's execution is the cluster's (lockstep under ZeRO-3, free under ZeRO 0-2); the
    plan is for ``cluster.num_gpus`` ranks; every group is an aligned block of consecutive ranks
    whose size is its degree (a candidate degree); under free execution no rank is in two groups
    of a micro-step; no group is empty; every sequence of the batch runs exactly once and the
    lengths match; each group's memory fits the budget (recomputed with ``cost`` when given), and
    under lockstep every rank's activations in a pass (all its groups together) fit it too; the
    lower bound does not exceed the makespan.
    """
    s = np.asarray(lengths, dtype=np.int64)
    n = cluster.num_gpus
    if plan.execution != cluster.execution:
        raise PlanError(f"the plan is {plan.execution} but ZeRO-{cluster.zero_stage} runs {cluster.execution} "
                        f"(ZeRO-3: lockstep passes; ZeRO 0-2: free); plan again for ZeRO-{cluster.zero_stage}")
    if plan.num_gpus != n:
        raise PlanError(f"plan is for {plan.num_gpus} ranks but the cluster has {n}")
    seen = np.zeros(s.size, dtype=np.int64)
    budget = cost.memory_budget_gb if cost is not None else plan.memory_budget_gb
    lockstep = plan.execution == "lockstep"
    for m, ms in enumerate(plan.micro_steps):
        taken: dict[int, int] = {}
        rank_mem = np.zeros(n)
        for gi, g in enumerate(ms.groups):
            where = f"micro-step {m}, group {gi} (degree {g.degree}, ranks {g.ranks[0] if g.ranks else '?'}..)"
            if g.degree not in cluster.degrees:
                raise PlanError(f"{where}: degree {g.degree} is not a candidate degree {list(cluster.degrees)}")
            if len(g.ranks) != g.degree:
                raise PlanError(f"{where}: has {len(g.ranks)} ranks, not {g.degree}")
            lo = g.ranks[0]
            if tuple(g.ranks) != tuple(range(lo, lo + g.degree)) or lo % g.degree != 0:
                raise PlanError(f"{where}: ranks {list(g.ranks)} are not an aligned block of {g.degree} "
                                f"consecutive ranks starting at a multiple of {g.degree}")
            if lo + g.degree > n or lo < 0:
                raise PlanError(f"{where}: ranks go beyond the cluster's {n} ranks")
            for r in g.ranks:
                if r in taken and not lockstep:
                    raise PlanError(f"{where}: rank {r} is also in group {taken[r]} of this micro-step")
                taken[r] = gi
            if not g.sequences:
                raise PlanError(f"{where}: has no sequences")
            if len(g.lengths) != len(g.sequences):
                raise PlanError(f"{where}: {len(g.sequences)} sequences but {len(g.lengths)} lengths")
            for i, ln in zip(g.sequences, g.lengths):
                if not 0 <= i < s.size:
                    raise PlanError(f"{where}: sequence index {i} is outside the batch of {s.size}")
                if int(s[i]) != int(ln):
                    raise PlanError(f"{where}: sequence {i} has length {s[i]} in the batch but {ln} in the plan")
                seen[i] += 1
            if cost is not None and (g.degree, g.cp) not in cost.shapes:
                raise PlanError(f"{where}: split {g.split} (ulysses x cp) is not one of the cost model's shapes "
                                f"{[f'{d // c}x{c}' for d, c in cost.shapes if d == g.degree]} for degree {g.degree} "
                                f"(strategy {cost.strategy})")
            mem = g.memory_gb if cost is None else float(cost.memory(s[list(g.sequences)], g.degree, g.cp).sum())
            if mem > budget * (1 + rtol):
                raise PlanError(f"{where}: needs {mem:.2f} GB per GPU of activations but the budget is {budget:.2f} GB")
            rank_mem[list(g.ranks)] += mem
        if lockstep and rank_mem.max(initial=0.0) > budget * (1 + rtol):
            r = int(np.argmax(rank_mem))
            raise PlanError(f"pass {m}: rank {r} holds {rank_mem[r]:.2f} GB of activations over its groups but the "
                            f"budget is {budget:.2f} GB (a rank keeps every group of a pass in memory)")
    missing = np.flatnonzero(seen == 0)
    if missing.size:
        raise PlanError(f"sequence(s) {missing[:10].tolist()}{'...' if missing.size > 10 else ''} are in no group "
                        f"({missing.size} of {s.size} missing)")
    dup = np.flatnonzero(seen > 1)
    if dup.size:
        raise PlanError(f"sequence {int(dup[0])} runs {int(seen[dup[0]])} times ({dup.size} duplicated)")
    if plan.lower_bound_ms > plan.makespan_ms * (1 + rtol):
        raise PlanError(f"lower bound {plan.lower_bound_ms:.3f} ms exceeds the makespan {plan.makespan_ms:.3f} ms: "
                        f"the bound or the plan's timing is wrong")
