"""Model states held as a ZeRO stage says, through PyTorch's own APIs, applied to a plain model.

The ``Transformer`` stays plain; :func:`parallelize` applies a stage to it (as torchtitan's
``parallelize`` does) and returns a :class:`ZeroRuntime`, the one object the step executor and the
trainer use for everything that differs between stages::

    stage  model states (torch API)                   gradient reduction                       execution
    0      full replica, torch.optim                  one flat all-reduce (sum) after the      free
                                                      step's last micro-step
    1      replica + ZeroRedundancyOptimizer          the same all-reduce; the optimizer       free
           (states of whole parameters per rank)      steps its own parameters and
                                                      broadcasts them
    2      replica + ZeroRedundancyOptimizer          each owner's gradients reduced to it     free
                                                      (``dist.reduce``), the rest freed; then
                                                      as 1
    3      FSDP2 ``fully_shard`` on every unit of     reduce-scatter inside every pass (FSDP)  lockstep
           ``workbench.cost.memory.fsdp_units``       and accumulated into sharded gradients
           and the root

**Gradient scaling.** Each rank divides its summed token losses by the *global* target count, so
the single-process gradient is the SUM of the ranks' gradients: the all-reduce and reduces sum,
and FSDP's reduce-scatter is told to divide by 1 (``set_gradient_divide_factor(1.0)``; it averages
by default). Gloo has no pre-multiplied sum, so FSDP is also asked for plain sums
(``set_force_sum_reduction_for_comms``).

**Precision.** ``fp32``: everything fp32. ``bf16``: under ZeRO-3 FSDP2's
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (fp32 sharded master weights, bf16
all-gathered weights and activations, gradients reduced and kept in fp32); under ZeRO 0-2
``torch.autocast`` over the fp32 replica (bf16 matmuls and activations, fp32 weights, gradients
and optimizer states). The backward runs outside autocast, as autocast's documentation asks.

**Recomputation.** Every block's forward runs under ``torch.utils.checkpoint`` (non-reentrant),
set on the block *instance* before ``fully_shard`` so that parameter names, state dicts and FSDP
units stay those of the plain model; around it the hooks that move the checkpointed inputs of the
groups a plan says offload to host memory (``workbench.runtime.offload.apply_offload``).

What each stage holds is ``workbench.cost.memory.model_states``; :meth:`ZeroRuntime.state_bytes`
counts it from tensor storage so a run can check the model.
"""

from __future__ import annotations

import contextlib
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["PRECISIONS", "ZERO_STAGES", "default_precision", "compute_dtype", "apply_recompute", "fsdp_modules",
           "apply_fsdp", "storage_bytes", "optimizer_class", "ZeroRuntime", "parallelize"]

PRECISIONS = ("fp32", "bf16")
ZERO_STAGES = (0, 1, 2, 3)
STAGE_IMPORTS = {0: (), 1: ("torch.distributed.optim",), 2: ("torch.distributed.optim",),
                 3: ("torch.distributed.fsdp", "torch.distributed.checkpoint")}
"""The torch modules a rank imports for its ZeRO stage (lazily, in ``parallelize`` and its checkpoints):
FSDP alone is 0.8 s of CPU. A supervisor that forks its ranks imports them once for all of them
(``workbench.launch.supervisor``)."""


def default_precision(device: torch.device | str) -> str:
    """``bf16`` on CUDA, ``fp32`` elsewhere (CPU bf16 matmuls are slow and gain no memory that binds)."""
    return "bf16" if torch.device(device).type == "cuda" else "fp32"


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype activations and all-gathered weights compute in. Raises ValueError for an unknown precision."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return torch.bfloat16 if precision == "bf16" else torch.float32


def apply_recompute(model: nn.Module) -> None:
    """Run every block of ``model.blocks`` under non-reentrant activation checkpointing: only the
    block's inputs are kept for backward, its activations are recomputed there; and the loss in
    chunks with its gradients made in the forward (``Head.loss_chunk``; ``workbench.runtime.loss``),
    so that no ``(tokens, vocab)`` tensor is kept or built whole. Idempotent."""
    from torch.utils.checkpoint import checkpoint

    from workbench.cost.memory import loss_chunk_tokens

    model.head.loss_chunk = loss_chunk_tokens(model.head.weight.shape[0])

    for block in model.blocks:
        if getattr(block, "_workbench_recompute", False):
            continue
        inner = block.forward  # the bound method of the plain block

        def forward(*args, _inner=inner, **kwargs):
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        # an instance attribute: nn.Module.__call__ (and FSDP's hooks around it) call it, while the
        # module keeps its class, its parameter names and its state dict keys
        block.forward = forward
        block._workbench_recompute = True


def fsdp_modules(model: nn.Module) -> list[list[nn.Module]]:
    """The modules of every FSDP unit, in forward order, as ``workbench.cost.memory.fsdp_units``
    counts them: the embedding, each block, the final norm with the head (a tied head's embedding
    joins that last unit: one weight lives in one unit)."""
    tied = model.head.weight is model.embed.weight
    units: list[list[nn.Module]] = [] if tied else [[model.embed]]
    units += [[b] for b in model.blocks]
    units.append([model.norm, model.head, model.embed] if tied else [model.norm, model.head])
    return units


def optimizer_class(name: str, *, lr: float, momentum: float = 0.0, weight_decay: float = 0.0) -> tuple[type, dict]:
    """The torch.optim class and keywords of optimizer ``name`` (``sgd`` or ``adamw``), as the
    runtime steps it. Raises ValueError for an unknown name."""
    if name == "sgd":
        return torch.optim.SGD, dict(lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW, dict(lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; choose sgd or adamw")


def _cpu_mesh():
    """A device mesh of the whole world on the CPU. FSDP2's default mesh is on the accelerator
    whenever one exists, so on a machine with one GPU and a gloo world of two (the doctor's 2-rank
    checks) it moved a CPU model's parameters to cuda:0 while its inputs stayed on the CPU."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def apply_fsdp(model: nn.Module, precision: str, *, mesh=None) -> None:
    """Shard ``model`` with FSDP2: ``fully_shard`` on every unit of :func:`fsdp_modules`, then on the
    root, with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` for bf16; gradients are
    summed over the ranks, not averaged (module docstring). The model must be on its device."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    # fp32: no casts at all (a float64 model, as exactness tests use, stays float64)
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if compute_dtype(precision)
          == torch.bfloat16 else MixedPrecisionPolicy())
    for unit in fsdp_modules(model):
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor counts its local shard; views
    and tied tensors sharing a storage count once; None is skipped)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        st = _local(t).untyped_storage()
        if st.nbytes():
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
    return sum(seen.values())


def _optimizer_tensors(opt) -> list[torch.Tensor]:
    state = opt.optim.state if hasattr(opt, "optim") else opt.state  # ZeroRedundancyOptimizer: its local optimizer
    return [v for s in state.values() for v in s.values() if isinstance(v, torch.Tensor)]


class ZeroRuntime:
    """One rank's model states under a ZeRO stage: the model as applied by :func:`parallelize`,
    its optimizer (:meth:`make_optimizer`), and what differs per stage in a step: the precision
    context, the gradient reduction, gradient clipping and the bytes held.

    ``execution`` is ``lockstep`` under ZeRO-3 (every rank runs every pass: FSDP all-gathers each
    unit over all ranks) and ``free`` otherwise.
    """

    def __init__(self, model: nn.Module, *, zero_stage: int, precision: str, recompute: bool,
                 device: torch.device | str = "cpu") -> None:
        self.model = model
        self.zero_stage = int(zero_stage)
        self.precision = precision
        self.recompute = bool(recompute)
        self.device = torch.device(device)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.optimizer = None
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._owner: dict[int, int] = {}  # ZeRO 1-2: id(param) -> the rank whose optimizer steps it
        self.peak_gradient_bytes = 0
        """Gradient bytes at the step's peak (set by :meth:`note_gradients`, before the step's reduce)."""

    @property
    def execution(self) -> str:
        return "lockstep" if self.zero_stage == 3 else "free"

    def describe(self) -> str:
        how = {0: "full replicas", 1: "replicas, ZeroRedundancyOptimizer", 2: "replicas, ZeroRedundancyOptimizer, "
               "gradients reduced to their owners", 3: "FSDP2 fully_shard per block"}[self.zero_stage]
        return (f"ZeRO-{self.zero_stage} ({how}; {self.execution}), {self.precision}"
                f"{', recompute' if self.recompute else ''}")

    # ---- the optimizer ---------------------------------------------------------------------------
    def make_optimizer(self, name: str, *, lr: float, momentum: float = 0.0, weight_decay: float = 0.0):
        """The stage's optimizer over this rank's parameters: ``sgd`` or ``adamw`` (torch.optim),
        wrapped in ``ZeroRedundancyOptimizer`` under ZeRO 1-2 (sharded states). Raises ValueError
        for an unknown name."""
        cls, kw = optimizer_class(name, lr=lr, momentum=momentum, weight_decay=weight_decay)
        if self.zero_stage in (1, 2) and self.world_size > 1:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(self.params, optimizer_class=cls, **kw)
            # which rank steps each parameter (whole parameters, largest first to the least loaded
            # rank: workbench.cost.memory.zero_partition); ZeRO-2 reduces each gradient to it
            self._owner = {id(p): int(r) for p, r in opt._param_to_rank.items()}
        else:
            opt = cls(self.params, **kw)
        self.optimizer = opt
        return opt

    def optimizer_state_dict(self) -> dict | None:
        """The optimizer's whole state dict (every parameter's states, keyed by index) for a
        whole-file checkpoint: this rank's own under ZeRO-0; under ZeRO 1-2 consolidated on rank 0
        (collective: every rank calls it; the others get None). Not for ZeRO-3 (sharded checkpoints)."""
        opt = self.optimizer
        if not hasattr(opt, "consolidate_state_dict"):
            return opt.state_dict()
        opt.consolidate_state_dict(to=0)
        if self.rank != 0:
            return None
        sd = opt.state_dict()
        # ZeroRedundancyOptimizer keeps the gathered copies until the next consolidation: a whole
        # optimizer's states on rank 0 that no one needs once the checkpoint is written
        opt._all_state_dicts = []
        return sd

    def owner(self, p: torch.Tensor) -> int:
        """The rank whose optimizer updates ``p`` (ZeRO 1-2; every rank's own otherwise)."""
        return self._owner.get(id(p), self.rank)

    # ---- one step --------------------------------------------------------------------------------
    def autocast(self):
        """The forward's precision context: ``torch.autocast`` to bf16 under ZeRO 0-2 with bf16
        (FSDP2 casts under ZeRO-3 itself), else nothing."""
        if self.precision == "bf16" and self.zero_stage < 3:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def zero_grad(self) -> None:
        """Start a step: ZeRO 0-2 accumulate into zeroed whole gradients (every rank holds every
        parameter's, even one it runs no token of); ZeRO-3 lets FSDP create the sharded ones."""
        self.peak_gradient_bytes = 0
        for p in self.params:
            p.grad = None if self.zero_stage == 3 else torch.zeros_like(p)

    def note_gradients(self) -> None:
        """Record the gradient bytes held now as the step's peak (call before the step's reduce)."""
        self.peak_gradient_bytes = max(self.peak_gradient_bytes, storage_bytes(p.grad for p in self.params))

    def reduce_gradients(self, loss_sum: float) -> float:
        """The stage's gradient reduction at the end of a step (module docstring); returns the
        global sum of the ranks' ``loss_sum``. Every rank must call it."""
        self.note_gradients()
        dev = self.device
        if self.world_size == 1:
            return float(loss_sum)
        if self.zero_stage == 3:  # gradients were reduce-scattered in every pass: only the loss
            t = torch.tensor([loss_sum], dtype=torch.float64, device=dev)
            dist.all_reduce(t)
            return float(t)
        if self.zero_stage in (0, 1):
            # one flat all-reduce: the gradients and the loss numerator together
            flat = torch.cat([p.grad.reshape(-1) for p in self.params]
                             + [torch.tensor([loss_sum], dtype=self.params[0].grad.dtype, device=dev)])
            dist.all_reduce(flat)
            off = 0
            for p in self.params:
                n = p.numel()
                p.grad.copy_(flat[off:off + n].view_as(p))
                off += n
            return float(flat[off])
        # ZeRO-2: each owner receives the sum of its parameters' gradients, one reduce per owner
        # (the bytes of a reduce-scatter); the other ranks free theirs
        for r in range(self.world_size):
            mine = [p for p in self.params if self.owner(p) == r]
            if not mine:
                continue
            flat = torch.cat([p.grad.reshape(-1) for p in mine])
            dist.reduce(flat, dst=r)
            off = 0
            for p in mine:
                n = p.numel()
                if r == self.rank:
                    p.grad.copy_(flat[off:off + n].view_as(p))
                else:
                    p.grad = None
                off += n
        t = torch.tensor([loss_sum], dtype=torch.float64, device=dev)
        dist.all_reduce(t)
        return float(t)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip the global gradient norm to ``max_norm`` as ``torch.nn.utils.clip_grad_norm_`` does
        on one process; returns the norm before clipping (the same on every rank)."""
        if self.zero_stage == 3:
            norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
            return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if self.zero_stage != 2 or self.world_size == 1:
            return float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        # ZeRO-2: each rank holds only its own parameters' gradients
        grads = [p.grad for p in self.params if p.grad is not None]
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for g in grads:
            sq += g.double().pow(2).sum()
        dist.all_reduce(sq)
        norm = float(sq.sqrt())
        coef = min(1.0, max_norm / (norm + 1e-6))
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        return norm

    # ---- memory ------------------------------------------------------------------------------------
    def state_bytes(self) -> dict:
        """What this rank holds, counted from tensor storage (distinct storages; local shards):
        ``{"parameters_bytes", "gradients_bytes", "optimizer_bytes"}``. Gradients are the step's
        peak (:meth:`note_gradients`: whole gradients before a ZeRO-2 reduce, FSDP's sharded ones
        under ZeRO-3) or, when none was noted, those held now; optimizer states exist after the
        first step."""
        grads = self.peak_gradient_bytes or storage_bytes(p.grad for p in self.params)
        opt = storage_bytes(_optimizer_tensors(self.optimizer)) if self.optimizer is not None else 0
        return {"parameters_bytes": storage_bytes(self.params), "gradients_bytes": grads, "optimizer_bytes": opt}


def parallelize(model: nn.Module, *, zero_stage: int, precision: str, recompute: bool = False,
                device: torch.device | str = "cpu") -> ZeroRuntime:
    """Apply a ZeRO stage to ``model`` (already on ``device``, identical on every rank): recompute
    first when asked (with the hooks that offload block inputs and swap blocks, ``workbench.runtime.offload``), then
    FSDP2 under ZeRO-3. Returns the :class:`ZeroRuntime`. Raises ValueError
    for an unknown stage or precision, or ZeRO-3 without an initialised process group."""
    if zero_stage not in ZERO_STAGES or isinstance(zero_stage, bool):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    compute_dtype(precision)
    if recompute:
        apply_recompute(model)
        # what a plan's offload "inputs" and swap_layers need (workbench.runtime.offload): inert until a pass is active
        from workbench.runtime.offload import apply_offload

        apply_offload(model)
    if zero_stage == 3:
        if not dist.is_initialized():
            raise ValueError("ZeRO-3 shards over a process group: initialise torch.distributed first")
        apply_fsdp(model, precision, mesh=_cpu_mesh() if torch.device(device).type == "cpu" else None)
    return ZeroRuntime(model, zero_stage=zero_stage, precision=precision, recompute=recompute, device=device)
