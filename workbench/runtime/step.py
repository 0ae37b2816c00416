"""The step executor: run one Plan's micro-steps on this rank, accumulate gradients, all-reduce.

For each micro-step a rank finds its group (or idles), takes a contiguous ``1/d`` slice of each
sequence assigned to the group (packed varlen, true position ids, padding to a multiple of ``d``
masked out of the loss), runs forward and backward with Ulysses attention inside the group, and
adds to its gradients. After the last micro-step one all-reduce (sum) over all ranks makes every
replica's gradient the gradient of the global-batch loss

    loss = sum of next-token cross-entropy over every target token of the batch / their count

(the last token of a sequence has no target). Each token's loss is computed on exactly one rank,
and the backward of the all-to-alls carries every rank's share of the attention gradient back to
the rank that produced q, k, v, so dividing each rank's summed loss by the global target count and
summing the replicas' gradients gives exactly the single-process gradient.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from workbench.runtime.groups import GroupRegistry
from workbench.runtime.model import Transformer
from workbench.runtime.ulysses import ShardLayout, UlyssesAttention, shard_layout
from workbench.solve.plan import Group, Plan, PlanError

__all__ = ["IGNORE", "LocalShard", "make_shard", "MicroStepRecord", "StepResult", "StepExecutor",
           "check_plan", "batch_loss", "peak_memory_mb"]

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
    layout: ShardLayout
    real_tokens: int
    """Tokens that are not padding."""
    targets: int
    """Labels that are not ``IGNORE``."""


def make_shard(sequences: Sequence[torch.Tensor], degree: int, rank: int) -> LocalShard:
    """Group rank ``rank``'s slice of ``sequences`` (1-D token tensors) on a group of ``degree``.
    Degree 1 gives the whole sequences packed, without padding. Raises ValueError on an empty group."""
    lay = shard_layout([int(s.numel()) for s in sequences], degree, rank)
    toks, labs = [], []
    for s, c in zip(sequences, lay.chunks):
        s = s.reshape(-1).long()
        pad = degree * c - s.numel()
        full_t = F.pad(s, (0, pad), value=0)  # (d*c,)
        full_l = F.pad(torch.cat([s[1:], s.new_full((1,), IGNORE)]), (0, pad), value=IGNORE)  # (d*c,)
        toks.append(full_t[rank * c:(rank + 1) * c])
        labs.append(full_l[rank * c:(rank + 1) * c])
    tokens, labels = torch.cat(toks), torch.cat(labs)
    return LocalShard(tokens=tokens, positions=lay.local_positions(), labels=labels,
                      cu_seqlens=lay.local_cu_seqlens, max_seqlen=int(max(lay.chunks)), layout=lay,
                      real_tokens=int(lay.local_valid().sum()), targets=int((labels != IGNORE).sum()))


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


def check_plan(plan: Plan, lengths: Sequence[int], world_size: int, degrees: Sequence[int] | None = None, *,
               max_context: int | None = None, heads: int | None = None, kv_heads: int | None = None) -> None:
    """Check that ``plan`` can run on ``world_size`` ranks for a batch of ``lengths``: same rank
    count, aligned groups of registered ``degrees``, no rank twice in a micro-step, every sequence
    once with its length, no sequence longer than ``max_context``, and (given ``heads``/``kv_heads``)
    every degree usable by Ulysses. Raises PlanError saying what does not match and how to fix it."""
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
        for g in ms.groups:
            lo = g.ranks[0] if g.ranks else -1
            if (len(g.ranks) != g.degree or tuple(g.ranks) != tuple(range(lo, lo + g.degree)) or lo % g.degree
                    or lo < 0 or lo + g.degree > world_size):
                raise PlanError(f"micro-step {m}: group ranks {list(g.ranks)} are not an aligned block of "
                                f"{g.degree} within {world_size} ranks")
            if degrees is not None and g.degree not in degrees:
                raise PlanError(f"micro-step {m}: degree {g.degree} has no process groups (degrees {list(degrees)})")
            if heads is not None and g.degree > 1:
                kv = kv_heads or heads
                if heads % g.degree or (kv % g.degree and g.degree % kv):
                    raise PlanError(f"micro-step {m}: Ulysses degree {g.degree} does not fit the model's {heads} "
                                    f"query / {kv} KV heads (it must divide the query heads and divide or be a "
                                    f"multiple of the KV heads)")
            if used & set(g.ranks):
                raise PlanError(f"micro-step {m}: rank(s) {sorted(used & set(g.ranks))} are in two groups")
            used |= set(g.ranks)
            if len(g.sequences) != len(g.lengths):
                raise PlanError(f"micro-step {m}: group at ranks {list(g.ranks)} lists {len(g.sequences)} sequences "
                                f"but {len(g.lengths)} lengths")
            for i, ln in zip(g.sequences, g.lengths):
                if not 0 <= i < len(lengths):
                    raise PlanError(f"micro-step {m}: sequence {i} is outside the batch of {len(lengths)}")
                if int(lengths[i]) != int(ln):
                    raise PlanError(f"micro-step {m}: sequence {i} has {lengths[i]} tokens but the plan says {ln}")
                seen[i] += 1
    bad = [i for i, n in enumerate(seen) if n != 1]
    if bad:
        raise PlanError(f"sequence {bad[0]} runs {seen[bad[0]]} times in the plan (every sequence must run once; "
                        f"{len(bad)} wrong)")


@dataclass
class MicroStepRecord:
    """What one rank did in one micro-step (plain data for metrics.jsonl)."""

    micro_step: int
    degree: int
    """The rank's group degree; 0 when it idled."""
    ranks: list[int]
    sequences: list[int]
    tokens: int
    """Real tokens this rank processed (its slices, padding excluded)."""
    padded_tokens: int
    targets: int
    loss: float | None
    """Mean cross-entropy over this rank's targets (None without targets)."""
    predicted_ms: float
    """The plan's time for the group (0 when idle)."""
    measured_ms: float
    peak_memory_mb: float

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
    """Wall time of the step on this rank: micro-steps and gradient all-reduce."""
    allreduce_ms: float
    """Time from this rank's last micro-step to the end of the all-reduce (includes waiting for
    the slowest rank)."""
    records: list[MicroStepRecord] = field(default_factory=list)
    predicted_ms: float = 0.0
    """The plan's makespan (``plan.makespan_ms``)."""

    def to_dict(self) -> dict:
        return asdict(self)


def _my_group(ms, rank: int) -> Group | None:
    for g in ms.groups:
        if rank in g.ranks:
            return g
    return None


class StepExecutor:
    """Runs plans on this rank's replica of ``model``.

    ``registry`` holds the process groups; ``attn`` is the local attention callable (see
    ``attention.select_attention``). Every rank of the world must call ``run`` for every step
    with the same plan and batch: it ends with an all-reduce over all ranks.
    """

    def __init__(self, model: Transformer, registry: GroupRegistry, attn: Callable, *,
                 device: torch.device | str = "cpu") -> None:
        self.model = model
        self.registry = registry
        self.attn = attn
        self.device = torch.device(device)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        if registry.world_size != self.world_size:
            raise ValueError(f"the group registry is for {registry.world_size} ranks but the world has "
                             f"{self.world_size}")
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters")

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def check(self, plan: Plan, lengths: Sequence[int]) -> None:
        """``check_plan`` against this run's world, process groups and model. Raises PlanError."""
        spec = self.model.spec
        check_plan(plan, lengths, self.world_size, self.registry.degrees, max_context=spec.max_context,
                   heads=spec.heads, kv_heads=spec.kv_heads)

    def run(self, plan: Plan, sequences: Sequence[torch.Tensor]) -> StepResult:
        """Forward and backward of every micro-step, then the gradient all-reduce; leaves the
        global-batch gradient in every parameter's ``.grad`` (overwriting what was there) and
        returns this rank's StepResult.

        ``sequences`` are the batch's 1-D token tensors (every rank passes the whole batch; each
        uses its slices). Raises PlanError when the plan does not fit the batch, the world or the
        model (checked before any collective, identically on every rank), and ValueError when the
        batch has no target token.
        """
        lengths = [int(s.numel()) for s in sequences]
        self.check(plan, lengths)
        n_targets = sum(max(0, s - 1) for s in lengths)
        if n_targets == 0:
            raise ValueError("the batch has no target token (every sequence is 1 token long)")
        for p in self.params:
            p.grad = torch.zeros_like(p)
        dev = self.device
        self._sync()
        t_step = time.perf_counter()
        records: list[MicroStepRecord] = []
        loss_sum = 0.0
        for m, ms in enumerate(plan.micro_steps):
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            t0 = time.perf_counter()
            g = _my_group(ms, self.rank)
            if g is None or not g.sequences:
                # idle in this micro-step: no collective of this micro-step involves this rank
                records.append(MicroStepRecord(micro_step=m, degree=0, ranks=[], sequences=[], tokens=0,
                                               padded_tokens=0, targets=0, loss=None, predicted_ms=0.0,
                                               measured_ms=0.0, peak_memory_mb=peak_memory_mb(dev)))
                continue
            sh = make_shard([sequences[i] for i in g.sequences], g.degree, g.ranks.index(self.rank))
            if g.degree == 1:
                attn = self.attn
            else:
                attn = UlyssesAttention(self.registry.get(g.ranks), sh.layout, self.attn)
            logits = self.model(sh.tokens.to(dev), sh.positions.to(dev), sh.cu_seqlens.to(dev), sh.max_seqlen,
                                attn)  # (T_loc, vocab)
            loss = F.cross_entropy(_upcast(logits), sh.labels.to(dev), ignore_index=IGNORE, reduction="sum")
            # every rank of the group runs backward, even one whose slices hold no target: the
            # backward of the all-to-alls is collective too
            (loss / n_targets).backward()
            self._sync()
            lv = float(loss.detach())
            loss_sum += lv
            records.append(MicroStepRecord(
                micro_step=m, degree=g.degree, ranks=list(g.ranks), sequences=list(g.sequences),
                tokens=sh.real_tokens, padded_tokens=int(sh.tokens.numel()), targets=sh.targets,
                loss=lv / sh.targets if sh.targets else None, predicted_ms=float(g.time_ms),
                measured_ms=(time.perf_counter() - t0) * 1e3, peak_memory_mb=peak_memory_mb(dev)))
        t_ar = time.perf_counter()
        total = self._allreduce(loss_sum)
        self._sync()
        t_end = time.perf_counter()
        return StepResult(loss=total / n_targets, targets=n_targets, tokens=sum(lengths),
                          measured_ms=(t_end - t_step) * 1e3, allreduce_ms=(t_end - t_ar) * 1e3,
                          records=records, predicted_ms=float(plan.makespan_ms))

    def _allreduce(self, loss_sum: float) -> float:
        """Sum gradients and the loss numerator over all ranks in one flat all-reduce (each rank's
        gradient already carries its share of ``1/n_targets``); returns the global loss sum."""
        flat = torch.cat([p.grad.reshape(-1) for p in self.params]
                         + [torch.tensor([loss_sum], dtype=self.params[0].grad.dtype, device=self.device)])
        if self.world_size > 1:
            dist.all_reduce(flat)
        off = 0
        for p in self.params:
            n = p.numel()
            p.grad.copy_(flat[off:off + n].view_as(p))
            off += n
        return float(flat[off])
