"""The step executor: run one Plan on this rank, as the run's ZeRO stage executes it.

Per group a rank takes its part of each sequence assigned to the group (packed varlen, true
position ids, end padding masked out of the loss) and runs attention as the group's split says:
a group of degree ``d = u x c`` with ``c = 1`` (Ulysses over the whole group) holds a contiguous
``1/d`` slice of every sequence and runs the Ulysses all-to-all (``workbench.runtime.ulysses``);
with ``c > 1`` it holds two chunks of every sequence per CP rank, sliced over Ulysses, and
all-gathers K and V over the CP ranks (``workbench.runtime.cp``). The loss it back-propagates is
its share of

    loss = sum of next-token cross-entropy over every target token of the batch / their count

(the last token of a sequence has no target). Each token's loss is computed on exactly one rank,
and the backward of the all-to-alls (and of the K/V all-gather: a reduce-scatter) carries every
rank's share of the attention gradient back to the rank that produced q, k, v, so the SUM of the
ranks' gradients is exactly the single-process gradient; the stage's reduction
(``workbench.runtime.zero``) sums them.

How micro-steps run depends on the plan's ``execution``, which must be the run's:

- ``free`` (ZeRO 0-2, replicated parameters): a rank runs the micro-steps it has a group in, one
  forward and backward per group, idles through the others (no collective of a micro-step involves
  a rank outside its groups), and accumulates whole gradients; after the last one every rank joins
  the stage's reduction (ZeRO 0-1 an all-reduce, ZeRO-2 a reduce to each parameter's owner).
- ``lockstep`` (ZeRO-3, FSDP2): every rank runs exactly ``len(plan.micro_steps)`` passes, each one
  forward and backward in which FSDP all-gathers every unit's parameters over all ranks and
  reduce-scatters its gradients. In a pass a rank packs the slices of *all* its groups into one
  forward and backward; its attention callable (``PassAttention``) runs each group's attention on
  that group's segment, in the order the pass lists the groups. Every rank follows that one order,
  and autograd runs a rank's backward collectives in the reverse of its forward order, so no two
  ranks ever wait on each other's collectives in opposite orders. A rank with no group in a pass
  runs an *empty pass*: one token with no target, so every FSDP hook fires and every parameter gets
  a (zero) gradient exactly as on a busy rank, and the reduce-scatters match.

A group whose plan says ``offload="inputs"`` (recomputation only) has its rows' checkpointed block
inputs moved to host memory and its rows' MLP run in token tiles (``workbench.runtime.offload``);
in a lockstep pass only that group's rows of the packed input. A group whose plan says
``swap_layers = k`` runs ``k`` of the blocks (``workbench.cost.offload.swap_blocks``) without
recomputation, their activations in host memory between forward and backward; per rank and pass a
block is swapped or recomputed for all its rows, so the groups one rank packs in a pass swap the
same blocks (``check_plan``), and every rank of a group swaps the same ones, so the recomputation's
collectives (a recomputed block's all-to-alls and all-gathers) run on all of them or none. Offload
and swap are otherwise local: they change what a rank keeps, never which collectives it runs or in
what order.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from workbench.runtime.cp import CPAttention, CPLayout, group_layout
from workbench.runtime.groups import GroupRegistry
from workbench.runtime.model import Transformer
from workbench.runtime.offload import OFFLOAD_LEVELS, OffloadPass, offload_pass, offloading
from workbench.runtime.ulysses import ShardLayout, UlyssesAttention, shard_layout
from workbench.runtime.zero import ZeroRuntime
from workbench.solve.plan import Group, Plan, PlanError

__all__ = ["IGNORE", "LocalShard", "make_shard", "pack_shards", "PassAttention", "MicroStepRecord", "StepResult",
           "StepExecutor", "check_plan", "batch_loss", "peak_memory_mb"]

IGNORE = -100
"""Label of tokens without a target (a sequence's last token, padding)."""


@dataclass(frozen=True)
class LocalShard:
    """What one rank feeds the model for one group: its slice of every sequence of the group."""

    tokens: torch.Tensor
    """(T_loc,) token ids, padding = 0."""
    positions: torch.Tensor
    """(T_loc,) true position ids."""
    labels: torch.Tensor
    """(T_loc,) next-token targets, ``IGNORE`` for padding and each sequence's last token."""
    cu_seqlens: torch.Tensor
    """(n+1,) int32 local pack boundaries."""
    max_seqlen: int
    layout: ShardLayout | CPLayout
    """The group's layout (``group_layout``): ``ShardLayout`` for a Ulysses-only group, ``CPLayout`` with cp > 1."""
    real_tokens: int
    """Tokens that are not padding."""
    targets: int
    """Labels that are not ``IGNORE``."""


def make_shard(sequences: Sequence[torch.Tensor], degree: int, rank: int, cp: int = 1) -> LocalShard:
    """Group rank ``rank``'s part of ``sequences`` (1-D token tensors) on a group of ``degree`` split
    ``(degree/cp) x cp`` (``group_layout``): its tokens at their true positions, labels taken from
    the padded whole sequence (``IGNORE`` for padding and each sequence's last token). Degree 1
    gives the whole sequences packed, without padding. Raises ValueError on an empty group or a
    ``cp`` that does not divide the degree."""
    lay = group_layout([int(s.numel()) for s in sequences], degree, cp, rank)
    positions = lay.local_positions()
    toks, labs = [], []
    for s, n, pos in zip(sequences, lay.padded_lengths, positions.split(list(lay.chunks))):
        s = s.reshape(-1).long()
        pad = n - s.numel()
        full_t = F.pad(s, (0, pad), value=0)  # (L,)
        full_l = F.pad(torch.cat([s[1:], s.new_full((1,), IGNORE)]), (0, pad), value=IGNORE)  # (L,)
        toks.append(full_t[pos])
        labs.append(full_l[pos])
    tokens, labels = torch.cat(toks), torch.cat(labs)
    return LocalShard(tokens=tokens, positions=positions, labels=labels,
                      cu_seqlens=lay.local_cu_seqlens, max_seqlen=int(max(lay.chunks)), layout=lay,
                      real_tokens=int(lay.local_valid().sum()), targets=int((labels != IGNORE).sum()))


def pack_shards(shards: Sequence[LocalShard]) -> LocalShard:
    """Several groups' shards of one rank packed back to back into one model input (a lockstep
    pass). ``cu_seqlens`` continue across the shards; ``layout`` is the first shard's (each group's
    attention uses its own, see ``PassAttention``). Raises ValueError when there is no shard."""
    if not shards:
        raise ValueError("no shard to pack")
    if len(shards) == 1:
        return shards[0]
    cus, off = [shards[0].cu_seqlens[:1]], 0
    for sh in shards:
        cus.append(sh.cu_seqlens[1:] + off)
        off += int(sh.tokens.numel())
    return LocalShard(tokens=torch.cat([sh.tokens for sh in shards]), positions=torch.cat([sh.positions for sh in shards]),
                      labels=torch.cat([sh.labels for sh in shards]), cu_seqlens=torch.cat(cus),
                      max_seqlen=max(sh.max_seqlen for sh in shards), layout=shards[0].layout,
                      real_tokens=sum(sh.real_tokens for sh in shards), targets=sum(sh.targets for sh in shards))


def _empty_shard() -> LocalShard:
    """The input of an empty pass: one token without a target (its loss and gradients are zero)."""
    lay = shard_layout([1], 1, 0)
    return LocalShard(tokens=torch.zeros(1, dtype=torch.long), positions=torch.zeros(1, dtype=torch.long),
                      labels=torch.full((1,), IGNORE, dtype=torch.long), cu_seqlens=lay.local_cu_seqlens,
                      max_seqlen=1, layout=lay, real_tokens=0, targets=0)


class PassAttention:
    """The attention callable of one rank in one lockstep pass: the rank's groups' tokens are
    packed back to back, ``segments[i] = (start, stop, attn_i, cu_seqlens_i, max_seqlen_i)``; every
    layer runs each group's attention (Ulysses or Ulysses x CP inside the group, or local for degree
    1) on its own rows, in the pass's order, and concatenates the outputs. The model's own ``cu_seqlens`` are
    ignored: each group's attention knows its sequences."""

    def __init__(self, segments: Sequence[tuple[int, int, Callable, torch.Tensor, int]]) -> None:
        self.segments = list(segments)
        self._moved: dict = {}

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int) -> torch.Tensor:
        outs = []
        for i, (lo, hi, fn, cu, mx) in enumerate(self.segments):
            if cu.device != q.device:  # moved once per device, not once per layer
                if (i, q.device) not in self._moved:
                    self._moved[(i, q.device)] = cu.to(q.device)
                cu = self._moved[(i, q.device)]
            outs.append(fn(q[lo:hi], k[lo:hi], v[lo:hi], cu, cu, mx, mx))  # (hi-lo, H, hd)
        return outs[0] if len(outs) == 1 else torch.cat(outs)  # (T, H, hd)


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """The loss in at least fp32 (bf16/fp16 logits are upcast; fp64 stays fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def batch_loss(model: Transformer, sequences: Sequence[torch.Tensor], attn: Callable,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """The single-process reference: mean next-token cross-entropy of the whole batch packed in one
    call (differentiable). Used by tests and as the definition the distributed step reproduces."""
    sh = make_shard(sequences, 1, 0)
    logits = model(sh.tokens.to(device), sh.positions.to(device), sh.cu_seqlens.to(device), sh.max_seqlen, attn)
    return F.cross_entropy(_upcast(logits), sh.labels.to(device), ignore_index=IGNORE, reduction="sum") / sh.targets


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory so far in MB: CUDA allocator peak (since the last reset) or the process's peak
    resident set on CPU (``ru_maxrss``; monotonic over the process's life)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        import resource
    except ImportError:  # not on Linux/macOS
        return 0.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def _offload(g: Group) -> str:
    """A group's offload level: ``none`` for groups of plans written before offload existed."""
    return getattr(g, "offload", "none")


def _swap(g: Group) -> int:
    """How many blocks a group swaps: 0 for groups of plans written before swap existed."""
    return int(getattr(g, "swap_layers", 0))


def _group_fields(g: Group) -> dict:
    """A record's entry for a group it served."""
    return {"degree": g.degree, "cp": g.cp, "ranks": list(g.ranks), "sequences": list(g.sequences),
            "offload": _offload(g), "swap_layers": _swap(g)}


def _offload_fields(op: OffloadPass | None) -> dict:
    """A record's offload figures from the pass that ran (none: zeros)."""
    if op is None:
        return {}
    return {"offload_wait_ms": float(op.wait_ms), "offload_host_mb": op.peak_host_bytes / 2**20,
            "swap_host_mb": op.swap_host_bytes / 2**20}


def _stage_name(execution: str) -> str:
    return "ZeRO-3" if execution == "lockstep" else "ZeRO 0-2"


def _shapes_text(shapes) -> str:
    return ", ".join(f"{d // c}x{c}" for d, c in sorted(shapes)) or "none"


def check_plan(plan: Plan, lengths: Sequence[int], world_size: int, degrees: Sequence[int] | None = None, *,
               max_context: int | None = None, heads: int | None = None, kv_heads: int | None = None,
               zero_stage: int | None = None, precision: str | None = None, recompute: bool | None = None,
               shapes: Sequence[tuple[int, int]] | None = None, layers: int | None = None) -> None:
    """Check that ``plan`` can run on ``world_size`` ranks for a batch of ``lengths``: given the
    run's ``zero_stage`` (``precision``, ``recompute``), the plan was made for them (its execution,
    and its stage, precision and recomputation where it records them); same rank count; every group
    on a contiguous range of ``degree`` ranks inside the world (any start and any size: ``(1, 2)`` or
    ``(3, 4, 5)`` on 6 ranks as well as the aligned power-of-two blocks of older plans), of one of the
    run's candidate ``degrees`` (any degree when None), whose split ``(degree, cp)`` is one of the
    run's ``shapes`` (without ``shapes``, Ulysses-only groups of ``degrees``), a cp (any integer)
    that divides its degree, no rank twice in a micro-step under free execution (a lockstep pass may give
    a rank several groups), every sequence once with its length, no sequence longer than
    ``max_context``, (given ``heads``/``kv_heads``) every group's Ulysses size usable with the
    model's heads, every group's ``offload`` a known level, ``inputs`` only with recomputation
    (the run's, else the plan's), and every group's ``swap_layers`` within ``0 .. layers`` (given the
    model's ``layers``), above 0 only with recomputation, and in a lockstep pass the same for all the
    groups one rank serves. Raises PlanError saying, in one line, what does not match and how to fix it."""
    if zero_stage is not None:
        run_exec = "lockstep" if zero_stage == 3 else "free"
        if plan.execution != run_exec:
            raise PlanError(f"the plan is {plan.execution} ({_stage_name(plan.execution)}) but this run is "
                            f"ZeRO-{zero_stage} ({run_exec}); plan for ZeRO-{zero_stage}")
        if plan.zero_stage is not None and plan.zero_stage != zero_stage:
            raise PlanError(f"the plan is for ZeRO-{plan.zero_stage} but this run is ZeRO-{zero_stage}; "
                            f"plan for ZeRO-{zero_stage}")
    if precision is not None and plan.precision is not None and plan.precision != precision:
        raise PlanError(f"the plan assumes {plan.precision} but this run computes in {precision}; "
                        f"plan with --precision {precision}")
    if recompute is not None and plan.recompute != bool(recompute):
        raise PlanError(f"the plan assumes {'' if plan.recompute else 'no '}activation recomputation but this run "
                        f"{'recomputes' if recompute else 'does not recompute'}; plan with"
                        f"{'' if recompute else 'out'} --recompute")
    lockstep = plan.execution == "lockstep"
    runs_recompute = bool(plan.recompute if recompute is None else recompute)
    if plan.num_gpus != world_size:
        raise PlanError(f"the plan is for {plan.num_gpus} ranks but this run has {world_size} (the world size); "
                        f"plan for --nproc x --nnodes = {world_size} GPUs")
    for i, n in enumerate(lengths):
        if int(n) < 1:
            raise PlanError(f"sequence {i} is empty ({n} tokens); drop empty documents before planning")
        if max_context is not None and int(n) > max_context:
            raise PlanError(f"sequence {i} has {int(n):,} tokens but the model's context is {max_context:,}; "
                            f"clip the batch with --max-len {max_context} or use a model with a longer context")
    seen = [0] * len(lengths)
    for m, ms in enumerate(plan.micro_steps):
        used: set[int] = set()
        swaps: dict[int, set[int]] = {}  # rank -> the swap_layers of its groups in this pass
        for g in ms.groups:
            lo = g.ranks[0] if g.ranks else 0
            if g.degree < 1 or len(g.ranks) != g.degree or tuple(g.ranks) != tuple(range(lo, lo + g.degree)):
                raise PlanError(f"micro-step {m}: group ranks {list(g.ranks)} are not a contiguous range of {g.degree} "
                                f"ranks (a group of degree d holds ranks r0, r0+1, .., r0+d-1, in order); plan with this "
                                f"runtime's planner")
            if lo < 0 or lo + g.degree > world_size:
                raise PlanError(f"micro-step {m}: group ranks {list(g.ranks)} are outside ranks 0..{world_size - 1} "
                                f"(the world size is {world_size}); plan for {world_size} GPUs")
            if g.cp < 1 or g.degree % g.cp:
                raise PlanError(f"micro-step {m}: group at ranks {list(g.ranks)} has context-parallel size {g.cp}, "
                                f"which does not divide its degree {g.degree}")
            u = g.degree // g.cp
            if degrees is not None and g.degree not in degrees:
                raise PlanError(f"micro-step {m}: degree {g.degree} has no process groups (this run's candidate degrees "
                                f"are {list(degrees)}); plan with this run's cost model")
            if shapes is not None and (g.degree, g.cp) not in shapes and g.degree > 1:
                raise PlanError(f"micro-step {m}: group at ranks {list(g.ranks)} is split {u}x{g.cp} (Ulysses x CP), "
                                f"which has no process groups: this run's shapes are {_shapes_text(shapes)}; plan "
                                f"with this run's cost model")
            if shapes is None and degrees is not None and g.cp > 1:
                raise PlanError(f"micro-step {m}: group at ranks {list(g.ranks)} is split {u}x{g.cp} (Ulysses x CP) "
                                f"but this run made process groups for Ulysses-only splits; plan with this run's "
                                f"cost model")
            if heads is not None and u > 1:
                kv = kv_heads or heads
                if heads % u or (kv % u and u % kv):
                    raise PlanError(f"micro-step {m}: group at ranks {list(g.ranks)} (split {u}x{g.cp}) runs Ulysses "
                                    f"over {u} ranks, which does not fit the model's {heads} query / {kv} KV heads "
                                    f"(the Ulysses size must divide the query heads and divide or be a multiple of "
                                    f"the KV heads); plan with --strategy auto, which splits such groups with "
                                    f"context parallelism")
            k = _swap(g)
            if k < 0 or (layers is not None and k > layers):
                raise PlanError(f"micro-step {m}: group at ranks {list(g.ranks)} swaps {k} blocks, outside 0.."
                                f"{layers if layers is not None else 'the layers'} (the model's blocks); plan with "
                                f"this run's model")
            if k and not runs_recompute:
                raise PlanError(f"micro-step {m}: group at ranks {list(g.ranks)} swaps {k} blocks (keeps their "
                                f"activations in host memory instead of recomputing them), which needs --recompute; "
                                f"run with --recompute or plan with --offload none")
            off = _offload(g)
            if off not in OFFLOAD_LEVELS:
                raise PlanError(f"micro-step {m}: group at ranks {list(g.ranks)} has offload {off!r}, which is not one "
                                f"of {', '.join(OFFLOAD_LEVELS)}; plan with this runtime's version of the planner")
            if off == "inputs" and not runs_recompute:
                raise PlanError(f"micro-step {m}: group at ranks {list(g.ranks)} offloads its block inputs, which needs "
                                f"--recompute (the offloaded tensors are the checkpointed block inputs); run with "
                                f"--recompute or plan with --offload none")
            if used & set(g.ranks) and not lockstep:
                raise PlanError(f"micro-step {m}: rank(s) {sorted(used & set(g.ranks))} are in two groups")
            for r in g.ranks:
                swaps.setdefault(r, set()).add(k)
            used |= set(g.ranks)
            if len(g.sequences) != len(g.lengths):
                raise PlanError(f"micro-step {m}: group at ranks {list(g.ranks)} lists {len(g.sequences)} sequences "
                                f"but {len(g.lengths)} lengths")
            if lockstep and not g.sequences:
                raise PlanError(f"pass {m}: group at ranks {list(g.ranks)} has no sequence (a lockstep pass lists "
                                f"only groups that run something)")
            for i, ln in zip(g.sequences, g.lengths):
                if not 0 <= i < len(lengths):
                    raise PlanError(f"micro-step {m}: sequence {i} is outside the batch of {len(lengths)}")
                if int(lengths[i]) != int(ln):
                    raise PlanError(f"micro-step {m}: sequence {i} has {lengths[i]} tokens but the plan says {ln}")
                seen[i] += 1
        mixed = sorted(r for r, ks in swaps.items() if len(ks) > 1)
        if mixed:
            raise PlanError(f"pass {m}: rank(s) {mixed} serve groups that swap different numbers of blocks "
                            f"({', '.join(str(k) for k in sorted(swaps[mixed[0]]))}), but a rank's pass runs each "
                            f"block swapped or recomputed for all its rows; plan with this runtime's planner")
    bad = [i for i, n in enumerate(seen) if n != 1]
    if bad:
        raise PlanError(f"sequence {bad[0]} runs {seen[bad[0]]} times in the plan (every sequence must run once; "
                        f"{len(bad)} wrong)")


@dataclass
class MicroStepRecord:
    """What one rank did in one micro-step (free) or pass (lockstep): plain data for metrics.jsonl."""

    micro_step: int
    degree: int
    """The degree of the rank's (first) group; 0 when it idled (free) or ran an empty pass (lockstep)."""
    ranks: list[int]
    """The ranks of that group."""
    sequences: list[int]
    """Every sequence the rank ran a slice of (all its groups)."""
    tokens: int
    """Real tokens this rank processed (its slices, padding excluded)."""
    padded_tokens: int
    targets: int
    loss: float | None
    """Mean cross-entropy over this rank's targets (None without targets)."""
    predicted_ms: float
    """The plan's time for the rank's work: its group's ``time_ms`` (free; 0 when idle), or in a
    lockstep pass the sum of its groups' less the packed call's shared constant for every group after
    the first (0 in an empty pass)."""
    measured_ms: float
    peak_memory_mb: float
    groups: list[dict] = field(default_factory=list)
    """Every group the rank served, in order: ``{degree, cp, ranks, sequences, offload, swap_layers}``
    (lockstep passes may hold several)."""
    pass_ms: float | None = None
    """Lockstep: the plan's predicted duration of the whole pass (its slowest rank, or FSDP's
    collectives, plus the pass overhead); None under free execution."""
    start_ms: float | None = None
    """When the micro-step (pass) began on this rank, in ms from the start of the rank's step
    (``StepResult.start_time``); None in records written before it was kept."""
    offload_wait_ms: float = 0.0
    """Time the compute waited for offloaded block inputs and swapped activations to come back from
    host memory (CUDA events; 0 without offload or swap, and on CPU, where the copies are synchronous)."""
    offload_host_mb: float = 0.0
    """Host memory the offloaded block inputs took at most (MB; the plan's ``host_gb`` predicts it)."""
    swap_host_mb: float = 0.0
    """Host memory the swapped blocks' activations took (MB): all of them are there when the forward
    ends (the plan's ``host_gb`` counts them with the offloaded inputs)."""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class StepResult:
    """One step on one rank: the global loss (same on every rank) and per-micro-step records."""

    loss: float
    """Mean next-token cross-entropy over every target token of the global batch."""
    targets: int
    """Target tokens of the global batch (each sequence's length less one, summed)."""
    tokens: int
    """Tokens of the global batch."""
    measured_ms: float
    """Wall time of the step on this rank: micro-steps (passes) and the gradient reduction."""
    allreduce_ms: float
    """Time from this rank's last micro-step to the end of the step's reduction (the stage's: an
    all-reduce, reduces to owners, or under ZeRO-3 the loss only; includes waiting for the slowest
    rank)."""
    records: list[MicroStepRecord] = field(default_factory=list)
    predicted_ms: float = 0.0
    """The plan's makespan (``plan.makespan_ms``)."""
    execution: str = "free"
    start_time: float | None = None
    """Wall-clock time (``time.time()``, seconds) at which the step began on this rank: after the
    gradients were cleared, where ``measured_ms`` starts. Ranks of one machine share the clock, so
    their timelines line up (across machines, as well as their clocks agree)."""

    def to_dict(self) -> dict:
        return asdict(self)


def _my_groups(ms, rank: int) -> list[Group]:
    return [g for g in ms.groups if rank in g.ranks]


class StepExecutor:
    """Runs plans on this rank's part of ``model``.

    ``registry`` holds the process groups (``run`` makes those a plan needs that it lacks); ``attn``
    is the local attention callable (see ``attention.select_attention``); ``zero`` the model states'
    stage (``zero.parallelize``; None: ZeRO-0 in the model's own dtype). Every rank of the world must
    call ``run`` for every step with the same plan and batch: it ends in a reduction over all ranks
    (and under ZeRO-3 every pass is collective).
    """

    def __init__(self, model: Transformer, registry: GroupRegistry, attn: Callable, *,
                 device: torch.device | str = "cpu", zero: ZeroRuntime | None = None) -> None:
        self.model = model
        self.registry = registry
        self.attn = attn
        self.device = torch.device(device)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        if registry.world_size != self.world_size:
            raise ValueError(f"the group registry is for {registry.world_size} ranks but the world has "
                             f"{self.world_size}")
        self.zero = zero if zero is not None else ZeroRuntime(model, zero_stage=0, precision="fp32", recompute=False,
                                                              device=self.device)
        if self.zero.model is not model:
            raise ValueError("the ZeroRuntime holds another model than the executor's")
        self.params = self.zero.params
        if not self.params:
            raise ValueError("the model has no trainable parameters")

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def check(self, plan: Plan, lengths: Sequence[int]) -> None:
        """``check_plan`` against this run's stage, world, process groups and model. Raises PlanError."""
        spec = self.model.spec
        z = self.zero
        check_plan(plan, lengths, self.world_size, self.registry.degrees, max_context=spec.max_context,
                   heads=spec.heads, kv_heads=spec.kv_heads, zero_stage=z.zero_stage, precision=z.precision,
                   recompute=z.recompute, shapes=self.registry.shapes, layers=spec.layers)

    def run(self, plan: Plan, sequences: Sequence[torch.Tensor]) -> StepResult:
        """Every micro-step (free) or pass (lockstep) of ``plan``, then the stage's gradient
        reduction; leaves the global-batch gradient in the parameters' ``.grad`` (overwriting what
        was there: whole gradients under ZeRO 0-1, the owner's under ZeRO-2, the local shards under
        ZeRO-3) and returns this rank's StepResult.

        ``sequences`` are the batch's 1-D token tensors (every rank passes the whole batch; each
        uses its slices). Raises PlanError when the plan does not fit the batch, the run's stage,
        the world or the model (checked before any collective, identically on every rank), and
        ValueError when the batch has no target token. Makes the process groups of the plan's groups
        that the registry does not hold yet (``GroupRegistry.ensure``), before the step's clock starts.
        """
        lengths = [int(s.numel()) for s in sequences]
        self.check(plan, lengths)
        n_targets = sum(max(0, s - 1) for s in lengths)
        if n_targets == 0:
            raise ValueError("the batch has no target token (every sequence is 1 token long)")
        # the process groups of the plan's groups that do not exist yet (collective: every rank holds this
        # plan and gets here with it, after the same verdict); none when they were made at start or by an
        # earlier plan
        self.registry.ensure(plan)
        self.zero.zero_grad()
        self._sync()
        t_step, start_time = time.perf_counter(), time.time()
        if plan.execution == "lockstep":
            records, loss_sum = self._run_lockstep(plan, sequences, n_targets, t_step)
        else:
            records, loss_sum = self._run_free(plan, sequences, n_targets, t_step)
        t_ar = time.perf_counter()
        total = self.zero.reduce_gradients(loss_sum)
        self._sync()
        t_end = time.perf_counter()
        return StepResult(loss=total / n_targets, targets=n_targets, tokens=sum(lengths),
                          measured_ms=(t_end - t_step) * 1e3, allreduce_ms=(t_end - t_ar) * 1e3,
                          records=records, predicted_ms=float(plan.makespan_ms), execution=plan.execution,
                          start_time=start_time)

    def _forward_backward(self, sh: LocalShard, attn: Callable, n_targets: int,
                          offload: OffloadPass | None = None) -> float:
        """One forward (in the stage's precision) and backward of a packed shard, with ``offload``'s
        rows offloaded and tiled (``workbench.runtime.offload``; local: the collectives are the same
        with or without it); returns the summed token loss."""
        dev = self.device
        with offloading(self.model, offload) if offload is not None else contextlib.nullcontext():
            with self.zero.autocast():
                # the summed token loss from the model's head (in fp32; chunked under recomputation): the
                # logits do not outlive it, where holding them through backward would cost 2-4 bytes x
                # vocab per token at the step's peak (measured on an H200)
                loss = self.model(sh.tokens.to(dev), sh.positions.to(dev), sh.cu_seqlens.to(dev), sh.max_seqlen,
                                  attn, labels=sh.labels.to(dev), ignore_index=IGNORE,
                                  mlp_fn=offload.mlp if offload is not None else None)
            # every rank of a group runs backward, even one whose slices hold no target: the backward of
            # the all-to-alls (and under ZeRO-3 FSDP's reduce-scatters) is collective too
            (loss / n_targets).backward()
        self._sync()
        return float(loss.detach())

    def _offload_pass(self, groups: Sequence[Group], shards: Sequence[LocalShard]) -> OffloadPass | None:
        """The offload of a forward over ``shards`` packed back to back, each group's rows as its
        ``offload`` says, swapping the blocks the groups' ``swap_layers`` says (one number for all of
        them: ``check_plan``); None when no group offloads or swaps."""
        segments, lo = [], 0
        for g, part in zip(groups, shards):
            hi = lo + int(part.tokens.numel())
            segments.append((lo, hi, _offload(g) == "inputs"))
            lo = hi
        return offload_pass(segments, self.model, swap_layers=_swap(groups[0]) if groups else 0)

    def _group_attention(self, g: Group, sh: LocalShard) -> Callable:
        if g.degree == 1:
            return self.attn
        if g.cp == 1:
            return UlyssesAttention(self.registry.get(g.ranks), sh.layout, self.attn)
        ulysses_group, cp_group = self.registry.subgroups(g.ranks, g.cp, self.rank)
        return CPAttention(ulysses_group, cp_group, sh.layout, self.attn)

    def _run_free(self, plan: Plan, sequences, n_targets: int, t_step: float) -> tuple[list[MicroStepRecord], float]:
        dev = self.device
        records: list[MicroStepRecord] = []
        loss_sum = 0.0
        for m, ms in enumerate(plan.micro_steps):
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            t0 = time.perf_counter()
            mine = _my_groups(ms, self.rank)
            g = mine[0] if mine else None
            if g is None or not g.sequences:
                # idle in this micro-step: no collective of this micro-step involves this rank
                records.append(MicroStepRecord(micro_step=m, degree=0, ranks=[], sequences=[], tokens=0,
                                               padded_tokens=0, targets=0, loss=None, predicted_ms=0.0,
                                               measured_ms=0.0, peak_memory_mb=peak_memory_mb(dev),
                                               start_ms=(t0 - t_step) * 1e3))
                continue
            sh = make_shard([sequences[i] for i in g.sequences], g.degree, g.ranks.index(self.rank), g.cp)
            op = self._offload_pass([g], [sh])
            lv = self._forward_backward(sh, self._group_attention(g, sh), n_targets, op)
            loss_sum += lv
            records.append(MicroStepRecord(
                micro_step=m, degree=g.degree, ranks=list(g.ranks), sequences=list(g.sequences),
                tokens=sh.real_tokens, padded_tokens=int(sh.tokens.numel()), targets=sh.targets,
                loss=lv / sh.targets if sh.targets else None, predicted_ms=float(g.time_ms),
                measured_ms=(time.perf_counter() - t0) * 1e3, peak_memory_mb=peak_memory_mb(dev),
                groups=[_group_fields(g)],
                start_ms=(t0 - t_step) * 1e3, **_offload_fields(op)))
        return records, loss_sum

    def _run_lockstep(self, plan: Plan, sequences, n_targets: int, t_step: float) -> tuple[list[MicroStepRecord], float]:
        dev = self.device
        records: list[MicroStepRecord] = []
        loss_sum = 0.0
        for m, ms in enumerate(plan.micro_steps):  # the same number of passes on every rank
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            t0 = time.perf_counter()
            mine = _my_groups(ms, self.rank)  # in the pass's order: one global order for every rank
            op = None
            if not mine:
                sh, attn = _empty_shard(), self.attn
            else:
                shards = [make_shard([sequences[i] for i in g.sequences], g.degree, g.ranks.index(self.rank), g.cp)
                          for g in mine]
                sh = pack_shards(shards)
                if len(mine) == 1:
                    attn = self._group_attention(mine[0], shards[0])
                else:
                    segments, lo = [], 0
                    for g, part in zip(mine, shards):
                        hi = lo + int(part.tokens.numel())
                        segments.append((lo, hi, self._group_attention(g, part), part.cu_seqlens, part.max_seqlen))
                        lo = hi
                    attn = PassAttention(segments)
                op = self._offload_pass(mine, shards)
            lv = self._forward_backward(sh, attn, n_targets, op)
            loss_sum += lv
            load = sum(float(g.time_ms) for g in mine) - float(plan.shared_overhead_ms) * max(0, len(mine) - 1)
            first = mine[0] if mine else None
            records.append(MicroStepRecord(
                micro_step=m, degree=first.degree if first else 0, ranks=list(first.ranks) if first else [],
                sequences=[i for g in mine for i in g.sequences], tokens=sh.real_tokens,
                padded_tokens=int(sh.tokens.numel()) if mine else 0, targets=sh.targets,
                loss=lv / sh.targets if sh.targets else None, predicted_ms=load if mine else 0.0,
                measured_ms=(time.perf_counter() - t0) * 1e3, peak_memory_mb=peak_memory_mb(dev),
                groups=[_group_fields(g) for g in mine],
                pass_ms=None if ms.time_ms is None else float(ms.time_ms), start_ms=(t0 - t_step) * 1e3,
                **_offload_fields(op)))
        return records, loss_sum
