"""Model states per GPU under each ZeRO stage: what the runtime actually holds, byte for byte.

The planner's activation budget is the usable GPU memory less these states, so they must be the
runtime's, not a textbook formula. What ``workbench.runtime`` keeps per rank (``P`` parameters,
``N`` ranks, ``O`` optimizer bytes per parameter: AdamW 8 (``exp_avg``, ``exp_avg_sq``), SGD with
momentum 4, plain SGD 0; master weights and gradients are always fp32, 4 bytes each)::

    stage  execution  parameters   gradients            optimizer   how
    0      free       4P           4P                   O*P         full replicas, one all-reduce per step
    1      free       4P           4P                   O*P/N       ZeroRedundancyOptimizer shards the states
    2      free       4P           4P (peak), 4P/N      O*P/N       + gradients reduced to their owner at
                                   after the reduce                 the step's end
    3      lockstep   4P/N         4P/N                 O*P/N       FSDP2 fully_shard per block (+ its
                                                                    working set, below)

Under ZeRO 0-2 parameters are replicated, so micro-steps need no collective and run barrier-free;
free execution accumulates *whole* gradients until the step ends (a reduce after every micro-step
would be a collective every rank must join), so ZeRO-2's gradient sharding lowers nothing at the
peak: it holds what ZeRO-1 holds until the step's reduce. With bf16 precision ZeRO 0-2 run under
autocast (the fp32 weights are cast per matmul; activations bf16), so the states above do not change,
but every matmul keeps its bf16 copy of the weight for its backward: from the forward to that
layer's backward a rank holds ``2 * M`` bytes more (``M`` the matmul weights: every projection and the
head; not the embedding lookup or the norms), charged as ZeRO 0-2's *working set*.

ZeRO-3 shards every tensor of a unit on its first dimension over the ranks (FSDP2 pads the last
shard), so a rank holds ``ceil(rows / N)`` rows of each. While a unit computes it is all-gathered in
the compute dtype, and FSDP prefetches the next one; in backward the unit's unsharded gradient
waits for its reduce-scatter in fp32. That *working set* (``2 * U * compute bytes + U * 4``, ``U``
the largest unit) is transient but real at the peak, so it is charged against the budget too (at a
world of one as well: FSDP2 still gathers into unsharded copies, measured on an H200).
Units are what the runtime wraps: the embedding, each block, and the final norm with the head (one
unit with the embedding when they are tied).

ZeroRedundancyOptimizer assigns whole parameters to ranks (largest first, each to the rank holding
the fewest elements so far), so stages 1 and 2 are computed per rank with that same rule rather
than as ``O*P/N``; the planner plans for the most loaded rank.

Pure Python + numpy: no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["OPTIMIZER_STATE_BYTES", "PRECISIONS", "ModelStates", "parameter_shapes", "fsdp_units",
           "zero_partition", "model_states", "optimizer_kind", "loss_backward_bytes_per_token", "final_norm_bytes_per_token",
           "loss_transient_bytes", "loss_chunk_tokens", "LOSS_CHUNK_BYTES", "LOSS_BYTES_PER_LOGIT",
           "LOSS_BYTES_PER_LOGIT_FP32"]

OPTIMIZER_STATE_BYTES = {"adamw": 8, "sgd-momentum": 4, "sgd": 0}
"""Optimizer state bytes per parameter (fp32): AdamW's two moments, SGD's momentum buffer, none."""
PRECISIONS = ("bf16", "fp32")
MASTER_BYTES = 4
"""Master parameters and gradients are fp32 in every stage and precision."""


def optimizer_kind(name: str, momentum: float = 0.0) -> str:
    """The memory model's optimizer name for a training optimizer: ``adamw``, ``sgd-momentum``
    (SGD with a momentum buffer) or ``sgd``. Raises ValueError for an unknown one."""
    if name == "adamw":
        return "adamw"
    if name == "sgd":
        return "sgd-momentum" if momentum else "sgd"
    if name in OPTIMIZER_STATE_BYTES:
        return name
    raise ValueError(f"unknown optimizer {name!r}; choose one of adamw, sgd, sgd-momentum")


def parameter_shapes(model) -> list[tuple[str, tuple[int, ...]]]:
    """Every trainable tensor of the runtime's Transformer for ``model`` (a ModelSpec), in
    ``named_parameters`` order: ``[(name, shape), ...]`` (a tied head is listed once, as the
    embedding)."""
    h, hd = model.hidden, model.head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("embed.weight", (model.vocab, h))]
    for i in range(model.layers):
        p = f"blocks.{i}."
        out.append((p + "attn_norm.weight", (h,)))
        for proj, rows in (("q", model.heads * hd), ("k", model.kv_heads * hd), ("v", model.kv_heads * hd)):
            out.append((p + f"attn.{proj}_proj.weight", (rows, h)))
            if model.qkv_bias:  # Qwen2's q/k/v biases
                out.append((p + f"attn.{proj}_proj.bias", (rows,)))
        out += [(p + "attn.o_proj.weight", (h, model.heads * hd)),
                (p + "mlp_norm.weight", (h,)),
                (p + "mlp.gate.weight", (model.ffn, h)),
                (p + "mlp.up.weight", (model.ffn, h)),
                (p + "mlp.down.weight", (h, model.ffn))]
    out.append(("norm.weight", (h,)))
    if not model.tied_embeddings:
        out.append(("head.weight", (model.vocab, h)))
    return out


def fsdp_units(model) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The tensors of each FSDP2 unit the runtime shards under ZeRO-3, in forward order: the
    embedding, every block, the final norm with the head (with a tied head, the embedding joins
    that last unit, as one weight must live in one unit)."""
    shapes = parameter_shapes(model)
    embed = [x for x in shapes if x[0].startswith("embed.")]
    tail = [x for x in shapes if x[0].startswith(("norm.", "head."))]
    blocks: dict[str, list] = {}
    for name, shape in shapes:
        if name.startswith("blocks."):
            blocks.setdefault(name.split(".")[1], []).append((name, shape))
    units = [] if model.tied_embeddings else [embed]
    units += list(blocks.values())
    units.append(tail + embed if model.tied_embeddings else tail)
    return units


def _numel(shape: tuple[int, ...]) -> int:
    return int(math.prod(shape))


def _sharded_numel(shape: tuple[int, ...], n: int) -> int:
    """Elements rank 0 holds of a tensor sharded on dim 0 over ``n`` ranks (FSDP2: ``ceil(rows/n)``
    rows, the last ranks' shards padded to the same size)."""
    rows = shape[0]
    return int(math.ceil(rows / n)) * _numel(shape[1:])


def zero_partition(numels: list[int], n: int) -> list[int]:
    """Elements each of ``n`` ranks owns when whole parameters of ``numels`` elements are assigned
    as ZeroRedundancyOptimizer does: largest first, each to the rank owning the fewest so far."""
    owned = [0] * n
    for k in sorted(numels, reverse=True):
        r = min(range(n), key=lambda i: (owned[i], i))
        owned[r] += k
    return owned


@dataclass(frozen=True)
class ModelStates:
    """Model-state memory of the most loaded rank, in bytes, by part (plain data for figures)."""

    zero_stage: int
    execution: str
    """``free`` (ZeRO 0-2) or ``lockstep`` (ZeRO-3)."""
    precision: str
    optimizer: str
    num_ranks: int
    parameters: float
    gradients: float
    """At the step's peak (free execution: whole gradients until the step's reduce)."""
    optimizer_states: float
    working: float
    """Transient but real at the peak: under ZeRO-3 the all-gathered units and the unsharded gradient
    awaiting its reduce-scatter; under ZeRO 0-2 in bf16 autocast's bf16 weight copies."""
    gradients_after_reduce: float
    """Gradients held after the step's reduce (ZeRO-2 shards them there)."""
    note: str
    optimizer_step: float = 0.0
    """Transient while the optimizer steps, beside the parameters, gradients and states (activations
    are gone by then): AdamW's multi-tensor step (PyTorch's default on CUDA) makes one fp32 temporary
    the size of the local parameters (``sqrt(exp_avg_sq)``); SGD updates in place."""

    @property
    def total(self) -> float:
        """Bytes charged against the GPU: parameters + gradients (peak) + optimizer + working set."""
        return self.parameters + self.gradients + self.optimizer_states + self.working

    @property
    def states(self) -> float:
        """Bytes of parameters, gradients and optimizer states the rank holds at rest (what a run
        counts from tensor storage), without the transient working set."""
        return self.parameters + self.gradients + self.optimizer_states

    def to_dict(self) -> dict:
        return {"zero_stage": self.zero_stage, "execution": self.execution, "precision": self.precision,
                "optimizer": self.optimizer, "num_ranks": self.num_ranks,
                "parameters_bytes": self.parameters, "gradients_bytes": self.gradients,
                "optimizer_bytes": self.optimizer_states, "working_bytes": self.working,
                "gradients_after_reduce_bytes": self.gradients_after_reduce, "total_bytes": self.total,
                "optimizer_step_bytes": self.optimizer_step, "note": self.note}


def loss_backward_bytes_per_token(model) -> float:
    """Bytes per token the loss's backward holds for a moment beyond what autograd saved: the fp32
    gradient of the log-probabilities (``nll_loss``'s backward makes it dense, ``(tokens, vocab)``)
    and the log-softmax's gradient of its input, both alive while the log-softmax backward runs beside
    its saved output (which ``activation_bytes_per_token`` counts): ``8 x vocab``. Every activation
    is still held then, so this adds to them at the step's peak: on an H200, a 1B model (vocabulary
    128,256) at 8K and 16K tokens measured 10.8 x vocab bytes per token above the saved tensors while
    the runtime still held its bf16 logits through backward (2 x vocab, dropped since)."""
    return 8.0 * float(model.vocab)


LOSS_CHUNK_BYTES = 1 << 30
"""Under recomputation the runtime computes the loss in chunks of tokens (``workbench.runtime.loss``):
what one chunk's transient tensors may take."""

LOSS_BYTES_PER_LOGIT = 12
"""A chunk's bytes per logit at most: the logits in bf16 (2), upcast to fp32 (4), a fp32 temporary
(4) and the gradient cast back to bf16 (2). In fp32 there are no casts: ``LOSS_BYTES_PER_LOGIT_FP32``."""

LOSS_BYTES_PER_LOGIT_FP32 = 8
"""A fp32 chunk's bytes per logit: the logits (4, turned into the softmax in place) and one temporary
(4); ``bench/loss.py`` measured 7."""


def loss_chunk_tokens(vocab: int, budget_bytes: int = LOSS_CHUNK_BYTES) -> int:
    """Tokens per chunk of the chunked loss for a vocabulary of ``vocab``: as many as keep a chunk
    within ``budget_bytes`` (at least 64)."""
    return max(64, int(budget_bytes) // (LOSS_BYTES_PER_LOGIT * max(1, int(vocab))))


def loss_transient_bytes(model, tokens: int, *, recompute: bool) -> float:
    """Bytes the loss holds for a moment beyond what autograd saved, on a rank with ``tokens`` tokens,
    while every activation is still held (the step's peak): from whole logits (no recomputation)
    ``loss_backward_bytes_per_token`` a token; chunked (recomputation: ``workbench.runtime.loss``)
    one chunk's logits (``LOSS_BYTES_PER_LOGIT`` a logit, ``LOSS_BYTES_PER_LOGIT_FP32`` in fp32) and
    the head weight's gradient, made in the
    forward: fp32, plus its cast to the compute dtype in a lower precision (``model.dtype_bytes``),
    and the final norm's tensors of the chunk's tokens (the chunk takes the norm in:
    ``final_norm_bytes_per_token``). A constant, but for ranks with fewer tokens than a chunk."""
    if not recompute:
        return loss_backward_bytes_per_token(model) * float(tokens)
    chunk = min(int(tokens), loss_chunk_tokens(model.vocab))
    low = model.dtype_bytes < 4
    grad = (4.0 + (model.dtype_bytes if low else 0)) * model.vocab * model.hidden
    logits = float(LOSS_BYTES_PER_LOGIT if low else LOSS_BYTES_PER_LOGIT_FP32) * chunk * model.vocab
    return logits + grad + final_norm_bytes_per_token(model) * chunk


def final_norm_bytes_per_token(model, *, autocast: bool = False) -> float:
    """Bytes per token the final norm holds while its chunk of the chunked loss is computed: its fp32
    input (for the statistics), its normed output in the compute dtype (fp32 under autocast, where the
    residual stream is) and its statistics (``4 h + c h + 4``; tests/test_loss.py measures it)."""
    return float(4 * model.hidden + (4 if autocast else model.dtype_bytes) * model.hidden + 4)


def _step_temporary(optimizer: str, stepped: float) -> float:
    """``ModelStates.optimizer_step`` for a rank whose optimizer steps ``stepped`` parameters."""
    return MASTER_BYTES * stepped if optimizer == "adamw" else 0.0


def model_states(model, *, zero_stage: int, num_ranks: int, precision: str = "bf16", optimizer: str = "adamw",
                 rank: int | None = None) -> ModelStates:
    """Model states per GPU of ``model`` (a ModelSpec) as the runtime holds them (module docstring).

    ``rank``: the figures of that rank (stages 1-2 differ per rank); None: the most loaded rank.
    Raises ValueError for an unknown stage, precision or optimizer, or a rank outside the world."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZER_STATE_BYTES)}, got {optimizer!r}")
    n = int(num_ranks)
    if n < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks!r}")
    if rank is not None and not 0 <= rank < n:
        raise ValueError(f"rank {rank} is outside a world of {n}")
    opt_bytes = OPTIMIZER_STATE_BYTES[optimizer]
    shapes = parameter_shapes(model)
    numels = [_numel(s) for _, s in shapes]
    P = float(sum(numels))
    compute_bytes = 2 if precision == "bf16" else 4
    if zero_stage == 3:
        # every rank holds a padded 1/N shard of each tensor (rank 0's size is every rank's)
        local = float(sum(_sharded_numel(s, n) for _, s in shapes))
        unit = max(sum(_numel(s) for _, s in u) for u in fsdp_units(model))
        # FSDP2 all-gathers into unsharded copies at a world of one too (in bf16 its casts): the same set
        working = 2.0 * unit * compute_bytes + unit * MASTER_BYTES
        return ModelStates(zero_stage=3, execution="lockstep", precision=precision, optimizer=optimizer, num_ranks=n,
                           parameters=MASTER_BYTES * local, gradients=MASTER_BYTES * local,
                           optimizer_states=opt_bytes * local, working=working,
                           gradients_after_reduce=MASTER_BYTES * local,
                           optimizer_step=_step_temporary(optimizer, local),
                           note=(f"FSDP2 shards parameters, gradients and optimizer states over {n} ranks; each pass "
                                 f"all-gathers one unit at a time (its working set, {working / 1e9:.2f} GB, is transient)"))
    if zero_stage == 0:
        stepped = P  # the parameters this rank's optimizer steps
        note = "full replicas: parameters, gradients and optimizer states on every rank"
    else:
        owned = zero_partition(numels, n)
        stepped = float(owned[rank] if rank is not None else max(owned))
        note = f"optimizer states sharded over {n} ranks (whole parameters per rank)"
    opt = opt_bytes * stepped
    grads_after = MASTER_BYTES * P
    working = 0.0
    if precision == "bf16":
        # autocast's bf16 weight copies, kept by every matmul for its backward (module docstring)
        matmul = sum(_numel(s) for name, s in shapes if len(s) == 2 and not name.startswith("embed."))
        if model.tied_embeddings:
            matmul += model.vocab * model.hidden  # the head multiplies by the embedding's weight
        working = 2.0 * matmul
        note += f"; autocast keeps bf16 copies of the matmul weights for backward ({working / 1e9:.2f} GB, transient)"
    if zero_stage == 2:
        owned = zero_partition(numels, n)
        grads_after = MASTER_BYTES * float(owned[rank] if rank is not None else max(owned))
        note += ("; gradients are reduced to their owner at the step's end: free execution accumulates whole "
                 "gradients until then, so the peak holds them all")
    return ModelStates(zero_stage=zero_stage, execution="free", precision=precision, optimizer=optimizer, num_ranks=n,
                       parameters=MASTER_BYTES * P, gradients=MASTER_BYTES * P, optimizer_states=opt, working=working,
                       gradients_after_reduce=grads_after, note=note, optimizer_step=_step_temporary(optimizer, stepped))
