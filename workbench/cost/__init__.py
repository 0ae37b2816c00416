"""The cost model the planners use: time and memory of a sequence on an SP group of degree d.

Time of one sequence of ``s`` tokens on a group of ``d`` GPUs (whole model, ms)::

    compute(s, d) = (A*s^2 + B*s) / d                 # fitted per-layer curves x layers (A: A_short for
                                                      # sequences under the profile's short_len)
    ulysses(s, d) = passes * layers * bytes(s, d) / all_to_all_bw(d)
        bytes(s, d) = dtype * (s/d) * (2*q_dim + 2*kv_dim_eff) * (d-1)/d    # q, k, v, o; each rank
                                                                            # sends (d-1)/d of its share

``passes`` is 2 (forward and backward), 3 with full recomputation.

A group of degree ``d`` runs as a *split* ``u x c`` (``d = u * c``): Ulysses over ``u`` consecutive
ranks (heads scattered: ``u`` must divide the query heads and divide or be a multiple of the KV heads,
which are replicated past their count) inside context parallelism over ``c`` ranks (each sequence
cut in ``2c`` chunks, K and V all-gathered in the CP sub-group before attention and their gradients
reduce-scattered back: Llama 3's all-gather CP, ``workbench.runtime.cp``). Every rank holds ``s/d``
tokens of a sequence whatever the split, so compute does not depend on it; communication does::

    ulysses(s, d, u) = passes * layers * dtype * (s/d) * (2*q_dim + 2*kv_eff(u)) * (u-1)/u / all_to_all_bw(u)
    cp(s, d, u, c)   = passes * layers * (c-1)/c * s * kv_bytes(u) / bus_bw(c)   # one all-gather per
                       forward (2 with recomputation) and one reduce-scatter in the backward, per layer
        kv_bytes(u)  = 2 * dtype * head_dim * kv_eff(u) / u   # K and V of one token on one rank
        kv_eff(u)    = max(kv_heads, u)

and CP keeps what it gathered for its attention's backward: ``s * kv_bytes(u) * (1 - 1/(2c))`` bytes
beyond the local K/V per layer (one layer's worth with recomputation), plus the gathered tensor of
the layer being computed. The CP sub-group spans the whole group (stride ``u``), so its link is
inter-node when the group spans nodes; the Ulysses sub-group spans ``u`` consecutive ranks. Ulysses
moves every activation of the layer (q, k, v and the output), CP only K and V: with GQA and long
sequences CP is cheaper, for short ones (and within a node) Ulysses is. ``strategy`` says which
splits plans may use: ``ulysses`` (``c = 1``, capped by the heads), ``cp`` (``u = 1``; ``ring`` is
the older name and plans the same), ``auto`` (every split the heads allow, less those another split
of the same degree beats on overhead, time per token and memory per token alike: ``shapes``). The
per-degree functions (``time(lengths, d)`` without ``cp``) give each sequence its best split of
the degree (a bound on any group's); planners that choose splits pass ``cp``. A group larger than a node
(``cluster.gpus_per_node``) spans nodes and gets the profile's inter-node bandwidth (``link_gbps``);
so do the all-rank collectives of a cluster of several nodes. A group's time in a micro-step
is the sum of its sequences' times plus ``group_overhead_ms(d)``: the fitted constant ``c`` (one
packed call per layer) and, when the profile measured it, the fixed latency of the group's
collective calls, which does not depend on how many tokens the group runs::

    overhead(d, c) = C + calls_u * latency_a2a(u) + calls_c * latency_ag(c) + layers * sp_overhead(u)
                     [+ layers * cp_overhead(c) + layers * split_overhead(u x c): below]
        calls_u = 2 * passes * layers (u > 1)    # q/k/v there and the output back, per pass
        calls_c = passes * layers (c > 1)        # the all-gathers and the reduce-scatter
        sp_overhead(u): the profile's measured extra per layer of a Ulysses group (layout work, waits)

and, when the profile measured it, each sequence adds ``layers * sp_token(u) * s / c`` (the part of
that extra that grows with the rank's tokens). Context parallelism's measured extras enter the same
way (``cp_overhead(c)`` per layer in the overhead, ``cp_token(c)`` per token and layer, scaled by the
K/V heads a rank of ``u x c`` holds), and one more grows with the square of the length::

    cp_attention(s, d, c) = cp_attention_factor(c) * A*s^2 / d      # c > 1

a fraction of the rank's causal share of the attention: each CP chunk's queries attend to a prefix
of keys, bottom-right aligned, and a kernel that runs that with an explicit mask (SDPA on CPU)
computes the whole rectangle where the causal one skips the blocks above the diagonal (GPU flash /
varlen kernels skip them too: a factor near 0). It is measured on ``1 x c`` groups; a rank of
``u x c`` runs the same rectangles over its ``H/u`` heads, so the same fraction of its own ``1/d``.

A composite split (u > 1 and c > 1) is priced as the sum of those parts, plus, when the profile
measured that very split, its residual beyond them (``split_overhead_ms["uxc"]`` per layer in the
group's fixed overhead, ``split_token_ms["uxc"]`` per token of its sequences and layer): what two
different sub-group collectives per layer cost together beyond each alone (every rank waits on its
Ulysses partners, then on its CP partners). Fitted from real ``u x c`` micro-steps; a split
without an entry (every GPU and reference profile today) adds nothing, and no entry is
interpolated to another split::

    split(d, c) = layers * split_overhead["uxc"]            (in group_overhead_ms)
                + layers * split_token["uxc"] * s           (per sequence, in time)

A group fits when the sum of its sequences' ``memory(s, d)`` is at most ``memory_budget_gb``
(usable GPU memory less the model states the runtime holds under the cluster's ZeRO stage,
``workbench.cost.memory``).

How a step executes depends on the ZeRO stage (``execution``):

- ``free`` (ZeRO 0-2, replicated parameters): a rank runs its groups back to back, each group a
  forward and backward of its own paying ``group_overhead_ms``; after the last one every rank joins
  the step's gradient reduction, ``grad_sync_ms`` (ZeRO-0 an all-reduce; ZeRO-1 an all-reduce and
  the sharded optimizer's parameter broadcast; ZeRO-2 a reduce-scatter and that broadcast; fp32
  gradients, over the profile's bus bandwidths).
- ``lockstep`` (ZeRO-3, FSDP2): every forward and backward all-gathers each unit's parameters over
  all ranks, so the step is a sequence of *passes* every rank joins. In a pass a rank runs one
  packed forward and backward over all its groups' tokens: it pays the packed call's constant
  ``call_overhead_ms`` once, and per group the rest of ``group_overhead_ms`` (``group_extra_ms``:
  the collective latencies and SP layout cost) and its sequences' times. A pass lasts as long as its
  most loaded rank, or as FSDP's parameter all-gathers and gradient reduce-scatters
  (``pass_comm_ms``, overlapped with compute) when those take longer, plus ``pass_overhead_ms`` (what
  cannot overlap: the first unit's all-gather and its reduce-scatter, and the profile's measured
  fixed cost of a pass)::

      pass = max(max over ranks of rank load, pass_comm) + pass_overhead
      step = sum of the passes     (gradients are reduce-scattered inside every pass)

  How much of FSDP's traffic can hide under the compute is the profile's ``pass_comm_overlap`` o
  (1 when it does not say: FSDP2 prefetches on CUDA streams; measured profiles on CPU say 0, as
  FSDP2 runs every collective on the compute thread there). With ``comm`` all of a pass's
  all-gathers and reduce-scatters and ``first`` the first unit's::

      pass_comm     = o * comm
      pass_overhead = (1 - o) * comm + o * first + fixed(world size)

  so a CPU pass costs its slowest rank's load plus every collective plus the fixed cost, and a
  GPU pass the longer of the two plus what cannot overlap. A rank's work itself runs the profile's
  ``pass_compute_factor`` f times longer inside a pass than in a free micro-step (every unit's
  collectives meet all ranks, so each waits for the slowest; their buffers share the caches): under
  lockstep execution the fitted A, B and C are multiplied by f.

Every step ends with ``step_end_ms``: the gradient reduction of free execution and the optimizer
step (the profile's time per million parameters the most loaded rank updates).

Pure numpy: no torch.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from workbench.cost import offload as _off
from workbench.cost.memory import (PRECISIONS, fsdp_units, loss_backward_bytes_per_token, loss_chunk_tokens,
                                   loss_transient_bytes, model_states)
from workbench.specs import ClusterSpec, ComputeCurve, HardwareProfile, ModelSpec, split_key

__all__ = ["CostModel", "block_activation_bytes", "STRATEGIES", "DEFAULT_STRATEGY", "InfeasibleError", "EXECUTIONS",
           "strategy_problem"]

EXECUTIONS = ("free", "lockstep")

STRATEGIES = ("auto", "ulysses", "cp", "ring")
"""Which splits ``u x c`` a cost model's groups may use (module docstring); ``ring`` is ``cp``.
``cp:C`` (``strategy_problem`` accepts it) fixes the CP size: every group runs ``(d/C) x C``, a group
smaller than C context parallelism over all of it."""


def strategy_problem(strategy) -> str | None:
    """Why ``strategy`` is not one (one line naming the choices), or None: a name of ``STRATEGIES``
    or ``cp:C`` with C a positive integer (context parallelism of any size)."""
    s = str(strategy)
    if s in STRATEGIES:
        return None
    if s.startswith("cp:"):
        try:
            c = int(s[3:])
        except ValueError:
            c = 0
        if c >= 1:
            return None
        return f"strategy {s!r}: the CP size after 'cp:' must be a positive integer, e.g. cp:2 or cp:3"
    return f"unknown strategy {s!r}; choose one of {', '.join(STRATEGIES)} or cp:C (a fixed CP size, e.g. cp:2)"

DEFAULT_STRATEGY = "auto"
"""The strategy scenarios, the command line and the panels plan with unless told."""


class InfeasibleError(ValueError):
    """A sequence (or a batch) that no group of the cluster can hold."""


def _interp(table: dict[int, float], d: int, *, log_values: bool) -> float:
    """Value for group size ``d`` between measured sizes, clamped at the ends: interpolated
    linearly in log(d), on log values (``log_values``: power laws, as bandwidths follow) or on the
    values themselves."""
    keys = sorted(table)
    if d in table:
        return table[d]
    if d <= keys[0]:
        return table[keys[0]]
    if d >= keys[-1]:
        return table[keys[-1]]
    for lo, hi in zip(keys, keys[1:]):
        if lo < d < hi:
            t = (math.log(d) - math.log(lo)) / (math.log(hi) - math.log(lo))
            if log_values:
                return math.exp(math.log(table[lo]) * (1 - t) + math.log(table[hi]) * t)
            return table[lo] * (1 - t) + table[hi] * t
    raise AssertionError("unreachable")


def _interp_bw(table: dict[int, float], d: int) -> float:
    """Bandwidth for group size ``d``: log-log interpolation between measured sizes, clamped."""
    return _interp(table, d, log_values=True)


def _node_split(table: dict[int, float], node: int | None) -> tuple[dict[int, float], dict[int, float]]:
    """A size-keyed table split at the profile's node size: ``(within a node, across nodes)``. Without
    a node size (or nothing on one side) the whole table serves that side."""
    if not node:
        return table, {}
    intra = {k: v for k, v in table.items() if k <= node}
    inter = {k: v for k, v in table.items() if k > node}
    return intra or table, inter


def _interp_latency(table: dict[int, float], d: int) -> float:
    """Latency (ms) for group size ``d``: linear in log(d) between measured sizes, clamped; 0 when
    the profile has none."""
    return _interp(table, d, log_values=False) if table else 0.0


def _interp_source(table: dict[int, float], d: int) -> tuple[str, list[int]]:
    """How ``_interp`` gets the figure of group size ``d`` from ``table``: ``("measured", [d])``,
    ``("interpolated", [lo, hi])`` (the measured sizes either side, linear in log(d)),
    ``("extrapolated", [k])`` (beyond the measured sizes: the nearest one's figure ``k`` held) or
    ``("none", [])`` (an empty table)."""
    keys = sorted(int(k) for k in table)
    d = int(d)
    if not keys:
        return "none", []
    if d in keys:
        return "measured", [d]
    if d < keys[0]:
        return "extrapolated", [keys[0]]
    if d > keys[-1]:
        return "extrapolated", [keys[-1]]
    return "interpolated", [max(k for k in keys if k < d), min(k for k in keys if k > d)]


def _envelope_splits(cands, budget: float, r_max: float) -> set[int]:
    """The CP sizes of ``cands`` (``(c, o, k, g, m)`` per split, in increasing c) that are the fastest
    split holding a group somewhere in ``1 <= S <= top``, ``0 <= r <= r_max``, where split c takes
    ``o + (k + g * r) * S`` and holds S when ``m * S <= budget`` (``top``: the largest S any split
    holds; ties to the smaller c). Empty when no split holds one token.

    For one r the times are lines in S: the fastest changes only where two lines cross
    (``bp_ij(r) = (o_j - o_i) / ((k_i - k_j) + (g_i - g_j) r)``) or a split stops holding S
    (``budget / m``), so one probe between consecutive such points (and at S = 1) finds every split
    that is fastest on an interval. Over r that picture changes only where those points meet: a
    crossing passes 1, ``top`` or a memory limit (a linear equation in r), two crossings of one split
    with two others meet (three lines through one point: linear in r), or two lines become parallel.
    Probing every such r and one r between consecutive ones finds every split that is fastest on a
    region of positive area, and the probes at the critical r themselves keep a split that is fastest
    only on a curve or a point (keeping more is safe: nothing a group prefers is dropped)."""
    c = np.array([x[0] for x in cands], dtype=np.int64)
    o, k, g, m = (np.array([x[i] for x in cands], dtype=np.float64) for i in (1, 2, 3, 4))
    n = len(cands)
    top = float(np.max(budget / m))
    if top < 1.0:
        return set()
    fixed = np.clip(np.concatenate([[1.0, top], budget / m]), 1.0, top)
    iu, ju = np.triu_indices(n, 1)
    dk, dg, do = k[iu] - k[ju], g[iu] - g[ju], o[ju] - o[iu]
    rs = np.array([0.0])
    if n > 1 and r_max > 0 and np.ptp(g) > 0:
        crit = [np.array([0.0, r_max])]
        with np.errstate(divide="ignore", invalid="ignore"):
            crit.append(-dk / dg)  # parallel lines: their crossing leaves through either end
            crit.append(((do[:, None] / fixed[None, :]) - dk[:, None]) / dg[:, None])  # a crossing at a fixed S
            for a in range(n):  # three lines through one point: crossings (a, b) and (a, e) meet
                for b in range(a + 1, n):
                    for e in range(b + 1, n):
                        do_b, do_e = o[b] - o[a], o[e] - o[a]
                        dk_b, dk_e, dg_b, dg_e = k[a] - k[b], k[a] - k[e], g[a] - g[b], g[a] - g[e]
                        crit.append(np.array([(do_e * dk_b - do_b * dk_e) / (do_b * dg_e - do_e * dg_b)]))
        r = np.concatenate([x.ravel() for x in crit])
        r = np.unique(r[np.isfinite(r) & (r >= 0) & (r <= r_max)])
        rs = np.unique(np.concatenate([r, (r[:-1] + r[1:]) / 2]))
    K = k[None, :] + g[None, :] * rs[:, None]  # (r probes, splits): time per token at each r
    with np.errstate(divide="ignore", invalid="ignore"):
        bp = do[None, :] / (K[:, iu] - K[:, ju])  # (r probes, pairs): where two lines cross
    bp = np.where(np.isfinite(bp) & (bp > 1.0) & (bp < top), bp, 1.0)
    pts = np.sort(np.concatenate([np.broadcast_to(fixed, (len(rs), len(fixed))), bp], axis=1), axis=1)
    S = np.concatenate([np.ones((len(rs), 1)), (pts[:, :-1] + pts[:, 1:]) / 2], axis=1)  # (r probes, S probes)
    T = o[None, None, :] + K[:, None, :] * S[:, :, None]
    T = np.where(m[None, None, :] * S[:, :, None] <= budget * (1 + 1e-12), T, np.inf)
    best = np.argmin(T, axis=2)  # the first of equal times: the smaller c
    ok = np.isfinite(np.min(T, axis=2))
    return {int(x) for x in c[best[ok]]}


def _quadratic_coeff(m: ModelSpec) -> float:
    # attention scores and values: FLOPs per sequence grow as s^2 * hidden per layer
    return m.layers * m.hidden


def _linear_coeff(m: ModelSpec) -> float:
    # dense matmuls: FLOPs per token grow with the block parameters and the output head
    return m.layers * m.layer_params() + m.vocab * m.hidden


def activation_bytes_per_token(model: ModelSpec, recompute: bool = False, *, autocast: bool = False) -> float:
    """Bytes per token the runtime's model keeps for backward (whole model), counted tensor by
    tensor as autograd saves them, with a flash-style attention (q, k, v, the output and the fp32
    softmax statistics; no s^2 buffers). ``c = model.dtype_bytes`` is the compute precision; every
    tensor is in it (fp32, or bf16 weights and activations as FSDP2 runs ZeRO-3) unless ``autocast``
    (bf16 matmuls over fp32 weights, ZeRO 0-2)::

        per block, c everywhere          autocast (c = 2); q = heads x head_dim (h unless explicit)
        RMSNorm x2: input (fp32: its     input and normed input fp32 (the residual stream is
          statistics), rstd, normed        fp32); each projection keeps its own bf16 copy of the
          input and output (c each)        normed output (q, k, v, gate, up: 5 x 2h)
        q, k, v (after rotary), attention output, softmax lse (4 bytes x heads)
        gate, up, silu(gate), product (c x ffn each)
        = c (4h + 2q + 2 kv + 4 ffn)      = 26h + 4q + 4 kv + 8 ffn + 4 heads + 8
          + 8h + 4 heads + 8
        outside the blocks: token ids and targets (int64), the rotary tables (c), the final norm,
        the fp32 log-softmax of the logits (4 vocab)

    (RMSNorm keeps both its normed input, for its weight's gradient, and its output, the next
    matmul's input: a fused norm kernel would keep less.) With full recomputation each block keeps
    only its input (the residual stream: c, or 4 under autocast, bytes x h), plus one block's
    working set while it is recomputed; outside the blocks the token ids and the rotary tables stay,
    and the loss is computed in chunks that take the final norm in, with their gradients made in the
    forward (``workbench.runtime.loss``): it keeps the gradient of the norm's input (``resid x h``)
    in place of the norm's and the head's tensors, and neither the 4 vocab bytes of the log-softmax
    nor the targets (8). What the loss holds besides is ``workbench.cost.memory.loss_transient_bytes``."""
    h, V = model.hidden, model.vocab
    c = model.dtype_bytes
    per_layer = block_activation_bytes(model, autocast=autocast)
    if autocast:
        resid = 4  # the residual stream (embedding output, norms, additions) stays fp32
        outside = 16 + 2 * c * (model.head_dim // 2) + (8 * h + 4 + 2 * h) + 4 * V
    else:
        resid = c
        outside = 16 + 2 * c * (model.head_dim // 2) + (4 * h + 2 * c * h + 4) + 4 * V
    if recompute:
        # the chunked loss takes the final norm in and makes its gradients in the forward: it keeps
        # the gradient of the norm's input (the residual stream's bytes) where the norm kept its fp32
        # input and normed output and the head its input, and neither the log-softmax nor the targets
        return model.layers * resid * h + per_layer + 16 + 2 * c * (model.head_dim // 2) + resid * h - 8
    return model.layers * per_layer + outside


def block_activation_bytes(model: ModelSpec, *, autocast: bool = False) -> float:
    """Bytes per token one block keeps for its backward when it is not recomputed (the per-block part
    of ``activation_bytes_per_token``): ``c (4h + 2q + 2kv + 4ffn) + 8h + 4 heads + 8``, or under
    autocast ``26h + 4q + 4kv + 8ffn + 4 heads + 8``."""
    h, q, kv, f, H = model.hidden, model.q_dim, model.kv_dim, model.ffn, model.heads
    if autocast:
        return float(26 * h + 4 * q + 4 * kv + 8 * f + 4 * H + 8)
    return float(model.dtype_bytes * (4 * h + 2 * q + 2 * kv + 4 * f) + 8 * h + 4 * H + 8)


@dataclass(frozen=True)
class _Fit:
    A: float  # ms per token^2, whole model, forward+backward (+recompute)
    B: float  # ms per token: the blocks, and the embedding, head and loss when measured apart
    C: float  # ms per packed call (group and micro-step), the micro-step's fixed cost included
    act_bytes: float  # per token, whole model
    formula: bool = True  # act_bytes from the formula (no measured or published figure for the model)
    A_short: float | None = None  # ms per token^2 of sequences under short_len (None: A for all)
    short_len: int | None = None
    A_fwd: float = 0.0  # one forward's share of A (ms per token^2; A_short's forward share ignored: only
    B_fwd: float = 0.0  # long sequences offload) and the blocks' part of one forward's B (ms per token)

    def quadratic(self, s: np.ndarray) -> np.ndarray:
        """The attention part of each sequence's time, ``A * s^2`` (``A_short`` below ``short_len``)."""
        if self.short_len is None:
            return self.A * s * s
        return np.where(s < self.short_len, self.A_short, self.A) * s * s


class CostModel:
    """Time and memory of sequences on SP groups, for one model on one cluster and profile.

    ``time`` and ``memory`` are vectorised over lengths. ``precision`` (``bf16`` or ``fp32``; None:
    the model's own, ``dtype_bytes``) sets the bytes of activations and of what the collectives
    carry; ``optimizer`` (``adamw``, ``sgd-momentum``, ``sgd``) the optimizer states the memory model
    counts. Raises ValueError when the model states alone do not fit the GPU, or on an unknown
    strategy, precision or optimizer.
    """

    def __init__(
        self,
        profile: HardwareProfile,
        model: ModelSpec,
        cluster: ClusterSpec,
        *,
        strategy: str = "ulysses",
        recompute: bool = False,
        precision: str | None = None,
        optimizer: str = "adamw",
        offload: str = "none",
    ) -> None:
        problem = strategy_problem(strategy) or _off.offload_problem(offload, bool(recompute))
        if problem is not None:
            raise ValueError(problem)
        strategy = "cp" if strategy == "ring" else strategy
        precision = precision or ("fp32" if model.dtype_bytes >= 4 else "bf16")
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
        native_bytes = model.dtype_bytes  # what the profile's activation figure was measured in
        compute_bytes = 2 if precision == "bf16" else 4
        if model.dtype_bytes != compute_bytes:
            model = dataclasses.replace(model, dtype_bytes=compute_bytes)
        self.profile = profile
        self.model = model
        self.cluster = cluster
        self.strategy = strategy
        self.recompute = bool(recompute)
        self.precision = precision
        self.optimizer = optimizer
        self.execution = cluster.execution
        self._native_bytes = native_bytes
        self._fit = self._fit_for_model()
        self.states = model_states(model, zero_stage=cluster.zero_stage, num_ranks=cluster.num_gpus,
                                   precision=precision, optimizer=optimizer)
        self.model_states_gb = self.states.total / 1e9
        # what the loss holds for a moment is held with every activation, at the step's peak: under
        # recomputation the chunked loss's constant (one whole chunk of logits and the head's
        # gradient); without it the whole logits' backward, two fp32 (tokens, vocab) gradients, so a
        # token's share goes with its activations (docs/zero.md)
        self.loss_working_gb = (loss_transient_bytes(model, loss_chunk_tokens(model.vocab), recompute=True) / 1e9
                                if self.recompute else 0.0)
        self.loss_bytes_per_token = (loss_backward_bytes_per_token(model) if not self.recompute and self._fit.formula
                                     else 0.0)
        """Bytes per token the loss holds for a moment beyond the saved activations, charged with them
        (``memory``): without recomputation the whole logits' backward (``8 x vocab``) where the
        activations come from the formula (a profile's measured figure is a forward's peak, which
        already holds the logits, their fp32 copy and the log-softmax: within ``2 x vocab`` of the
        backward's); with recomputation 0 (the chunked loss's transient is ``loss_working_gb``)."""
        self.memory_budget_gb = cluster.usable_memory_gb - self.model_states_gb - self.loss_working_gb
        if self.memory_budget_gb <= 0:
            hint = ("more GPUs or GPUs with more memory" if cluster.zero_stage == 3 else
                    "ZeRO-3 (--zero-stage 3, lockstep passes), more GPUs or GPUs with more memory")
            raise ValueError(
                f"model {model.name} needs {self.model_states_gb:.1f} GB per GPU of parameters, gradients "
                f"and optimizer states (ZeRO-{cluster.zero_stage}, {precision}, {optimizer}, over {cluster.num_gpus} "
                f"GPUs) but only {cluster.usable_memory_gb:.1f} GB are usable; use {hint}"
            )
        self._init_offload(offload)
        self._shapes = self._choose_shapes(cluster.degrees)
        self.degrees = tuple(sorted({d for d, _ in self._shapes}))
        if not self.degrees:
            raise ValueError(
                f"no candidate degree in {list(cluster.degrees)} works with {strategy} for model {model.name} "
                f"({model.heads} heads, {model.kv_heads} KV heads); try --strategy auto"
            )

    # ---- fitting the profile to the model ------------------------------------------------
    def _fit_for_model(self) -> _Fit:
        p, m = self.profile, self.model
        fwd, bwd, act_mb = p.forward, p.backward, p.activation_mb_per_token
        ref = m if p.model == m.name else _reference_model(p.model)
        passes_f = 2.0 if self.recompute else 1.0  # recomputation runs the forward again

        def tot(curve: ComputeCurve, n: float) -> tuple[float, float, float, float]:
            short = curve.a if curve.a_short is None else curve.a_short
            return curve.a * n, curve.b * n, curve.c * n, short * n

        af, bf, cf, sf = tot(fwd, ref.layers)
        ab, bb, cb, sb = tot(bwd, ref.layers)
        A = passes_f * af + ab
        B = passes_f * bf + bb
        C = passes_f * cf + cb
        short_len = fwd.short_len or bwd.short_len  # the profiler fits both with one threshold
        A_short = passes_f * sf + sb if short_len else None
        head = float(p.head_ms_per_token or 0.0)  # embedding, final norm, head and loss, per token
        if ref is not m:
            # scale by FLOPs: quadratic (attention) and linear (dense) parts separately
            A *= _quadratic_coeff(m) / _quadratic_coeff(ref)
            if A_short is not None:
                A_short *= _quadratic_coeff(m) / _quadratic_coeff(ref)
            B *= _linear_coeff(m) / _linear_coeff(ref)
            C *= m.layers / ref.layers
            head *= (m.vocab * m.hidden) / (ref.vocab * ref.hidden)
        B += head
        C += float(p.micro_step_ms or 0.0)
        if self.execution == "lockstep" and p.pass_compute_factor:
            # inside a ZeRO-3 pass the same work takes longer (the profile's measured factor)
            f = _interp_latency(p.pass_compute_factor, self.cluster.num_gpus)
            A, B, C = A * f, B * f, C * f
            A_short = None if A_short is None else A_short * f
        # bf16 under ZeRO 0-2 is autocast over the fp32 replica; under ZeRO-3 FSDP2 casts the weights
        autocast = self.precision == "bf16" and self.cluster.zero_stage < 3
        mine = activation_bytes_per_token(m, self.recompute, autocast=autocast)
        measured = act_mb is not None and p.model == m.name
        if measured:
            # measured in the model's own precision, without recomputation (the profile's attention
            # may keep more than the formula's flash-style one): scaled by the formula's ratio
            native = dataclasses.replace(m, dtype_bytes=self._native_bytes)
            act = act_mb * 1e6 * mine / activation_bytes_per_token(native, False)
        else:
            act = mine
        A_fwd, B_fwd = af, bf
        if ref is not m:
            A_fwd *= _quadratic_coeff(m) / _quadratic_coeff(ref)
            B_fwd *= _linear_coeff(m) / _linear_coeff(ref)
        if self.execution == "lockstep" and p.pass_compute_factor:
            A_fwd, B_fwd = A_fwd * f, B_fwd * f
        return _Fit(A=A, B=B, C=C, act_bytes=act, A_short=A_short, short_len=short_len, formula=not measured,
                    A_fwd=A_fwd, B_fwd=B_fwd)

    # ---- degrees and splits ----------------------------------------------------------------
    def split_supported(self, ulysses: int) -> bool:
        """Whether Ulysses can scatter the heads over ``ulysses`` ranks: 1 always; otherwise it must
        divide the query heads, and the KV heads must split over it or be replicated to it (a
        multiple of the KV heads)."""
        u, m = int(ulysses), self.model
        return u == 1 or (m.heads % u == 0 and (m.kv_heads % u == 0 or u % m.kv_heads == 0))

    def degree_supported(self, d: int) -> bool:
        """Whether the strategy can run a group of degree ``d`` at all (ignoring memory): some split
        of it is allowed (``ulysses``: Ulysses over all ``d``; ``cp`` and ``auto``: any degree)."""
        d = int(d)
        if d == 1 or self.strategy in ("auto", "cp"):
            return True
        return bool(self._allowed_splits(d))

    def ulysses_limit(self) -> int:
        """The widest Ulysses group the heads allow (the largest supported ``u`` up to the query heads)."""
        return max(u for u in range(1, self.model.heads + 1) if self.split_supported(u))

    def degree_limit_reason(self, d: int) -> str:
        """Why degree ``d`` is unsupported (empty when it is supported)."""
        if self.degree_supported(d):
            return ""
        m = self.model
        u = d // min(d, int(self.strategy[3:])) if self.strategy.startswith("cp:") else d
        return (f"a Ulysses group of {u} ranks does not fit {m.name}'s {m.heads} query / {m.kv_heads} KV heads "
                f"(Ulysses groups go up to {self.ulysses_limit()}); use --strategy auto (or cp) for context parallelism")

    def _allowed_splits(self, d: int) -> list[int]:
        """The CP sizes ``c`` (dividing ``d``) the strategy allows for degree ``d``, before pruning."""
        d = int(d)
        if self.strategy == "ulysses":
            return [1] if self.split_supported(d) else []
        if self.strategy == "cp":
            return [d]
        if self.strategy.startswith("cp:"):
            c = min(d, int(self.strategy[3:]))
            return [c] if d % c == 0 and self.split_supported(d // c) else []
        return [c for c in range(1, d + 1) if d % c == 0 and self.split_supported(d // c)]

    def _choose_shapes(self, degrees) -> tuple[tuple[int, int], ...]:
        """Every allowed ``(degree, cp)`` that is the fastest split of its degree for some group.

        Compute aside (the split does not change it), a group of sequences ``s_i`` runs under split c
        in ``o(c) + k(c) * S + g(c) * Q`` with ``S = sum s_i`` its tokens and ``Q = sum quadratic(s_i)``
        its attention (``g(c) = cp_attention_factor(c) / d``: CP's measured extra attention, 0 without
        it), and needs ``m(c) * S`` memory within the budget; ``o(c)`` is ``group_overhead_ms`` and
        ``k(c)`` the per-token ``_split_linear_ms``, so a composite split's measured residual
        (``split_residual``: fixed and per token) is in them and the pruning stays exact with it. With ``r = Q / S`` a group is a point
        ``(S, r)``: S from one token to the most any split holds (``top``), r from 0 to the largest
        ``quadratic(s) / s`` of one sequence of up to ``top`` tokens (a weighted mean of the
        sequences' ``quadratic(s_i) / s_i``, so never above it). A split is kept when it is the
        fastest of the splits that hold S (ties to the smaller c) somewhere in that rectangle
        (``_envelope_splits``): a superset of the points real groups reach, so every group's best
        split is kept and nothing is lost (tests/test_cost.py checks it by brute force); without a
        quadratic term (every g equal) r plays no part and this is the lower envelope of the lines
        ``o(c) + k(c) * S``. A degree none of whose splits holds a token keeps its least-memory split."""
        out = []
        one = np.ones(1)
        B = float(self.memory_budget_gb)
        # memory per token at the level that keeps least (offloaded groups hold more tokens): every
        # group size a split reaches is inside the rectangle, so the kept splits stay a superset
        least = "inputs" if self._offload_ok else "none"
        for d in degrees:
            cands = [(int(c), float(self.group_overhead_ms(d, c)), float(self._split_linear_ms(one, d, c)[0]),
                      self.cp_attention_factor(c) / int(d), float(self.gpu_memory(one, d, c, least)[0]))
                     for c in self._allowed_splits(d)]
            if not cands:
                continue
            top = max(B / x[4] for x in cands)
            s_top = max(1.0, top)
            # the largest quadratic(s)/s of one sequence up to top tokens: a(s)*s grows with s on each
            # side of short_len, so its maximum is at top or just under short_len
            ends = [s_top] + ([min(float(self._fit.short_len - 1), s_top)] if self._fit.short_len else [])
            r_max = max(float(self._fit.quadratic(np.array([x]))[0]) / x for x in ends if x >= 1.0)
            kept = _envelope_splits(cands, B, r_max)
            if not kept:
                kept = {min(cands, key=lambda x: (x[4], x[0]))[0]}
            out.extend((int(d), c) for c in kept)
        return tuple(sorted(out))

    @property
    def shapes(self) -> tuple[tuple[int, int], ...]:
        """The group shapes plans of this cost model may use: ``(degree, cp)`` pairs, sorted, a group
        of ``degree`` ranks running Ulysses over ``degree // cp`` of them inside context parallelism
        over ``cp`` (the runtime creates process groups for exactly these)."""
        return self._shapes

    def splits(self, degree: int) -> tuple[int, ...]:
        """The CP sizes of degree ``degree``'s shapes (empty for a degree the strategy cannot run)."""
        return tuple(c for d, c in self._shapes if d == int(degree))

    def _cps(self, degree: int, cp: int | None) -> tuple[int, ...]:
        """The splits a per-degree call is about: ``(cp,)`` when given (checked), else the degree's shapes."""
        d = int(degree)
        if cp is None:
            cps = self.splits(d)
            return cps or (1,)
        c = int(cp)
        if c < 1 or d % c:
            raise ValueError(f"context-parallel size {c} does not divide degree {d} (a group of degree d runs as "
                             f"ulysses x cp = d)")
        if not self.split_supported(d // c):
            m = self.model
            raise ValueError(f"split {d // c}x{c} of degree {d}: Ulysses over {d // c} ranks does not fit {m.name}'s "
                             f"{m.heads} query / {m.kv_heads} KV heads (Ulysses groups go up to {self.ulysses_limit()})")
        return (c,)

    def best_split(self, lengths, degree: int) -> int:
        """The CP size of degree ``degree``'s shape under which a group running all of ``lengths``
        takes least time (overhead plus sequences) with its activations within the budget; when none
        holds them, the one needing least memory."""
        s = np.asarray(lengths, dtype=np.float64)
        best, best_key = None, None
        for c in self._cps(degree, None):
            mem = float(self.memory(s, degree, c).sum())
            t = self.group_ms(s, degree, c)
            key = (mem > self.memory_budget_gb * (1 + 1e-9), t if mem <= self.memory_budget_gb * (1 + 1e-9) else mem)
            if best_key is None or key < best_key:
                best, best_key = c, key
        return int(best)

    # ---- links: within a node or across nodes -------------------------------------------------
    def crosses_nodes(self, degree: int) -> bool:
        """Whether a group (or a Ulysses sub-group) of ``degree`` ranks spans nodes
        (``ClusterSpec.crosses_nodes``): larger than a node, or, on several nodes, a size that does
        not divide the node's (some of its aligned blocks straddle a node boundary, so all are costed
        across nodes)."""
        return self.cluster.crosses_nodes(degree)

    def _table_gbps(self, table: dict[int, float], inter: dict[int, float], d: int, crosses: bool | None = None) -> float:
        """Bandwidth of a ``d``-rank collective from ``table`` (``inter``: the profile's own inter-node
        table): its entries within a node, or across nodes when the ranks span nodes (``crosses``;
        None: when ``d`` is larger than a node)."""
        intra_part, inter_part = _node_split(table, self.profile.gpus_per_node)
        if self.crosses_nodes(d) if crosses is None else crosses:
            across = inter or inter_part
            return _interp_bw(across or table, d)
        return _interp_bw(intra_part, d)

    def link_gbps(self, kind: str, degree: int) -> float:
        """Bandwidth (GB/s) a group of ``degree`` gets for ``kind`` (``all_to_all``: Ulysses; ``p2p``:
        ring steps). A group within a node takes the profile's figures measured within a node (its
        entries up to ``profile.gpus_per_node``); a group that spans nodes (``crosses_nodes``) takes
        the inter-node figures: ``inter_node_*_gbps`` when the profile has them, else its entries
        measured on groups larger than a node, else (a one-node profile) the same table. Raises
        ValueError for an unknown kind."""
        p = self.profile
        if kind == "all_to_all":
            return self._table_gbps(p.all_to_all_gbps, p.inter_node_all_to_all_gbps, degree)
        if kind == "p2p":
            if p.p2p_gbps:
                return self._table_gbps(p.p2p_gbps, p.inter_node_p2p_gbps, degree)
            return self._table_gbps(p.all_to_all_gbps, p.inter_node_all_to_all_gbps, degree)
        raise ValueError(f"unknown link kind {kind!r}; all_to_all or p2p")

    def inter_node_source(self) -> str:
        """Where the figures of node-spanning groups come from, in words (for notes and the cost table)."""
        p = self.profile
        if self.cluster.num_gpus <= self.cluster.gpus_per_node:
            return "one node: no group spans nodes"
        if p.inter_node_all_to_all_gbps:
            return f"the profile's inter-node tables (profile {p.name})"
        if p.gpus_per_node and any(k > p.gpus_per_node for k in p.all_to_all_gbps):
            return f"the profile's entries for groups over {p.gpus_per_node} GPUs (measured across nodes)"
        return (f"profile {p.name} has no inter-node figures: groups over {self.cluster.gpus_per_node} ranks are "
                f"costed as if within a node (measure across nodes, or give inter_node_all_to_all_gbps)")

    LINK_KINDS = ("all_to_all", "p2p", "allreduce", "allgather", "reduce_scatter")
    """The collectives ``link_source`` knows (the profile's ``<kind>_gbps`` tables)."""

    def link_source(self, kind: str, size: int, *, crosses: bool | None = None) -> dict:
        """Where the bandwidth of a ``size``-rank ``kind`` collective comes from: the table the cost
        model reads (as ``link_gbps``, ``cp_link_gbps`` and the all-rank collectives do: within a node
        or, when the ranks span nodes, ``crosses``, None: ``crosses_nodes(size)``, across nodes; the
        all-to-all table for ``p2p`` without its own, the all-reduce's for an all-gather or a
        reduce-scatter without theirs) and how the figure is had from it. Pure (no torch).

        Returns ``{"kind", "size", "across_nodes", "table", "source", "sizes", "gbps"}``:
        ``source`` ``measured`` (``sizes`` ``[size]``), ``interpolated`` (between the measured
        ``sizes`` ``[lo, hi]``, linear in log(size) on log(bandwidth): a power law through both),
        ``extrapolated`` (beyond every measured size: the figure of the nearest, ``sizes`` ``[k]``,
        held constant) or ``none`` (the profile has no such table: ``gbps`` 0, the collective is not
        priced). Raises ValueError for an unknown kind."""
        p = self.profile
        d = int(size)
        if kind == "all_to_all" or (kind == "p2p" and not p.p2p_gbps):
            name, table, inter_name, inter = ("all_to_all_gbps", p.all_to_all_gbps, "inter_node_all_to_all_gbps",
                                              p.inter_node_all_to_all_gbps)
        elif kind == "p2p":
            name, table, inter_name, inter = "p2p_gbps", p.p2p_gbps, "inter_node_p2p_gbps", p.inter_node_p2p_gbps
        elif kind in ("allreduce", "allgather", "reduce_scatter"):
            own = {"allreduce": p.allreduce_gbps, "allgather": p.allgather_gbps,
                   "reduce_scatter": p.reduce_scatter_gbps}[kind]
            name = f"{kind}_gbps" if own else "allreduce_gbps"
            table, inter_name, inter = own or p.allreduce_gbps, "inter_node_allreduce_gbps", p.inter_node_allreduce_gbps
        else:
            raise ValueError(f"unknown link kind {kind!r}; one of {', '.join(self.LINK_KINDS)}")
        across = self.crosses_nodes(d) if crosses is None else bool(crosses)
        intra_part, inter_part = _node_split(table, p.gpus_per_node)
        if not table:
            used, label = {}, name
        elif across and inter:
            used, label = inter, inter_name
        elif across and inter_part:
            used, label = inter_part, f"{name} over {p.gpus_per_node} ranks"
        elif across:
            used, label = table, name
        else:
            used = intra_part
            label = name if len(intra_part) == len(table) else f"{name} up to {p.gpus_per_node} ranks"
        source, sizes = _interp_source(used, d)
        return {"kind": kind, "size": d, "across_nodes": across, "table": label, "source": source, "sizes": sizes,
                "gbps": _interp_bw(used, d) if used else 0.0}

    def estimated_links(self, degrees=None) -> list[dict]:
        """The link figures plans over ``degrees`` (default the cost model's) use that no measurement
        gave: ``link_source`` of every ``all_to_all`` over a shape's Ulysses ranks ``u > 1`` and every
        CP ``allgather`` and ``reduce_scatter`` over its ``cp > 1`` ranks, for the strategy's shapes
        of those degrees, the interpolated and extrapolated ones only (once each, by kind and size)."""
        keep = {int(d) for d in (degrees if degrees is not None else self.degrees)}
        seen, out = set(), []
        for d, c in self._shapes:
            if d not in keep:
                continue
            u = d // c
            asks = ([("all_to_all", u, None)] if u > 1 else []) + \
                ([(k, c, self.crosses_nodes(d)) for k in ("allgather", "reduce_scatter")] if c > 1 else [])
            for kind, n, crosses in asks:
                src = self.link_source(kind, n, crosses=crosses)
                key = (kind, n, src["across_nodes"])
                if key in seen or src["source"] in ("measured", "none"):
                    continue
                seen.add(key)
                out.append(src)
        return sorted(out, key=lambda r: (self.LINK_KINDS.index(r["kind"]), r["across_nodes"], r["size"]))

    def estimated_links_note(self, degrees=None) -> str:
        """``estimated_links`` in one line (what ``workbench cost`` prints): the group sizes whose link
        figures are interpolated between measured sizes (in brackets) or extrapolated beyond them
        (the measured size whose figure is held), by collective; says so when every one was measured."""
        rows = self.estimated_links(degrees)
        if not rows:
            return f"links: every group size's figure measured (profile {self.profile.name})"
        names = {"all_to_all": "all-to-all", "allgather": "CP all-gather", "reduce_scatter": "CP reduce-scatter"}
        groups: dict[tuple, list[int]] = {}
        for r in rows:  # sorted by kind, then within a node before across, then size
            key = (r["kind"], r["source"], r["across_nodes"], tuple(r["sizes"]), r["table"])
            groups.setdefault(key, []).append(r["size"])
        parts = []
        for (kind, how, across, frm, table), sizes in groups.items():
            own = "" if table == f"{kind}_gbps" else f" ({table})"
            where = " across nodes" if across else ""
            frm_s = f"between {frm[0]} and {frm[1]}" if how == "interpolated" else f"{frm[0]}'s figure"
            parts.append(f"{names[kind]}{own} {how} at {', '.join(map(str, sizes))}{where} ({frm_s})")
        return ("links not measured at their group size (log-log between measured sizes, the nearest one's figure "
                "beyond them): " + "; ".join(parts))

    # ---- per-sequence costs -------------------------------------------------------------------
    def compute_ms(self, lengths, degree: int, cp: int | None = None) -> np.ndarray:
        """Compute time (ms) of each sequence on a group of ``degree``, without communication (the
        same for every split: each rank holds ``s/d`` of the tokens and ``1/d`` of the attention)."""
        s = np.asarray(lengths, dtype=np.float64)
        f = self._fit
        return (f.quadratic(s) + f.B * s) / degree

    def attention_ms(self, lengths, degree: int) -> np.ndarray:
        """The attention part of ``compute_ms`` (ms): the fitted ``A * s^2`` (``A_short`` under the
        profile's ``short_len``) of each sequence over ``degree``, what one rank of the group computes
        of it (its causal share)."""
        return self._fit.quadratic(np.asarray(lengths, dtype=np.float64)) / int(degree)

    def _passes(self) -> float:
        return 3.0 if self.recompute else 2.0

    def kv_bytes_per_token(self, ulysses: int) -> float:
        """Bytes of K and V one token carries on one rank of a Ulysses group of ``ulysses`` (KV heads
        replicated to ``ulysses`` when fewer): what CP all-gathers, per token of the sequence."""
        m, u = self.model, max(1, int(ulysses))
        return 2.0 * m.dtype_bytes * m.head_dim * max(m.kv_heads, u) / u

    def ulysses_comm_ms(self, lengths, degree: int, cp: int = 1) -> np.ndarray:
        """The Ulysses all-to-alls of each sequence in a ``degree`` group of split ``(degree/cp) x cp``
        (ms; 0 for ``u = 1``): q, k, v there and the output back per layer and pass, each rank sending
        ``(u-1)/u`` of its ``s/d`` tokens' share, over the ``u`` consecutive ranks' link."""
        s = np.asarray(lengths, dtype=np.float64)
        d, c = int(degree), int(cp)
        u = d // c
        if u <= 1:
            return np.zeros_like(s)
        m = self.model
        kv_eff = max(m.kv_heads, u) * m.head_dim  # KV replicated when u exceeds the KV heads
        per_layer = m.dtype_bytes * (s / d) * (2 * m.q_dim + 2 * kv_eff) * (u - 1) / u  # q and o, k and v
        return self._passes() * m.layers * per_layer / (self.link_gbps("all_to_all", u) * 1e9) * 1e3

    def cp_link_gbps(self, kind: str, degree: int, cp: int) -> float:
        """Bus bandwidth (GB/s) of a CP sub-group's ``kind`` (``allgather`` or ``reduce_scatter``):
        ``cp`` ranks, strided across the whole group, so across nodes when the group spans nodes.
        The profile's own table for the kind, else its all-reduce figures; 0 when it has none."""
        p = self.profile
        table = {"allgather": p.allgather_gbps, "reduce_scatter": p.reduce_scatter_gbps}[kind] or p.allreduce_gbps
        if not table:
            return 0.0
        return self._table_gbps(table, p.inter_node_allreduce_gbps, int(cp), crosses=self.crosses_nodes(degree))

    def cp_comm_ms(self, lengths, degree: int, cp: int = 1) -> np.ndarray:
        """The context-parallel collectives of each sequence in a ``degree`` group of split
        ``(degree/cp) x cp`` (ms; 0 for ``cp = 1``): per layer its K and V all-gathered over the CP
        sub-group in every forward (twice with recomputation) and their gradients reduce-scattered in
        the backward, each moving ``(c-1)/c`` of the sequence's ``s * kv_bytes(u)``."""
        s = np.asarray(lengths, dtype=np.float64)
        d, c = int(degree), int(cp)
        if c <= 1:
            return np.zeros_like(s)
        u = d // c
        nbytes = s * self.kv_bytes_per_token(u) * (c - 1) / c
        ag, rs = self.cp_link_gbps("allgather", d, c), self.cp_link_gbps("reduce_scatter", d, c)
        if not ag or not rs:
            return np.zeros_like(s)
        per_layer = (self._passes() - 1) * nbytes / (ag * 1e9) + nbytes / (rs * 1e9)
        return self.model.layers * per_layer * 1e3

    def comm_ms(self, lengths, degree: int, cp: int | None = None) -> np.ndarray:
        """Communication time (ms) of each sequence inside its group: the Ulysses all-to-alls and the
        CP collectives of the split (``cp``; None: each sequence's best split of the degree)."""
        return self._least(lambda c: self.ulysses_comm_ms(lengths, degree, c) + self.cp_comm_ms(lengths, degree, c),
                           degree, cp)

    def sp_token_ms(self, lengths, degree: int, cp: int | None = None) -> np.ndarray:
        """The profile's measured extra time of each sequence in a Ulysses group that grows with the
        rank's tokens (``layers * sp_token_ms[u] * s / c``; 0 for ``u = 1`` or a profile without it)."""
        def one(c: int) -> np.ndarray:
            s = np.asarray(lengths, dtype=np.float64)
            u = int(degree) // c
            if u <= 1 or not self.profile.sp_token_ms:
                return np.zeros_like(s)
            return self.model.layers * _interp_latency(self.profile.sp_token_ms, u) * s / c
        return self._least(one, degree, cp)

    def cp_attention_factor(self, cp: int) -> float:
        """The profile's ``cp_attention_factor`` at CP size ``cp`` (linear in log c between measured
        sizes, clamped at the ends, as the other per-size tables); 0 for ``cp = 1`` or a profile
        without it."""
        c = int(cp)
        if c <= 1 or not self.profile.cp_attention_factor:
            return 0.0
        return _interp_latency(self.profile.cp_attention_factor, c)

    def cp_attention_ms(self, lengths, degree: int, cp: int) -> np.ndarray:
        """CP's measured extra attention time of each sequence on a rank of a ``degree`` group of split
        ``(degree/cp) x cp`` (ms): ``cp_attention_factor(c) * quadratic(s) / d``, a fraction of the
        rank's causal share of the attention (the fitted ``A * s^2``: scaled to the model by FLOPs,
        with the recomputed forward and the lockstep pass factor when those apply). Measured on
        ``1 x c`` groups; a ``u x c`` rank runs the same bottom-right rectangles over its ``H/u``
        heads, so the same fraction of its own ``1/d`` of the attention. 0 for ``cp = 1``."""
        s = np.asarray(lengths, dtype=np.float64)
        f = self.cp_attention_factor(cp)
        if f <= 0:
            return np.zeros_like(s)
        return f * self.attention_ms(s, degree)

    def split_residual(self, degree: int, cp: int) -> tuple[float, float]:
        """The profile's measured residual of the composite split ``(degree/cp) x cp`` beyond the sum
        of its parts, per layer: ``(fixed ms per micro-step, ms per token)`` from
        ``split_overhead_ms`` and ``split_token_ms`` at exactly that split's key (``"2x2"``);
        ``(0, 0)`` for a ``u x 1`` or ``1 x c`` split and for a split the profile has no entry for."""
        d, c = int(degree), int(cp)
        u = d // c
        if u <= 1 or c <= 1:
            return 0.0, 0.0
        key, p = split_key(u, c), self.profile
        return float(p.split_overhead_ms.get(key, 0.0)), float(p.split_token_ms.get(key, 0.0))

    def _split_linear_ms(self, lengths, degree: int, cp: int) -> np.ndarray:
        """The part of ``_split_ms`` linear in each sequence's tokens: the collectives, the measured
        SP and CP extras per token and, for a composite split the profile measured, its residual per
        token (``split_residual``) (ms)."""
        c = int(cp)
        s = np.asarray(lengths, dtype=np.float64)
        extra = np.zeros_like(s)
        u = int(degree) // c
        p, L = self.profile, self.model.layers
        if u > 1 and p.sp_token_ms:
            extra = extra + L * _interp_latency(p.sp_token_ms, u) * s / c
        if c > 1 and p.cp_token_ms:
            # measured on 1 x c groups; a rank of a u x c group selects the K/V of its heads only
            extra = extra + L * _interp_latency(p.cp_token_ms, c) * s * self.kv_bytes_per_token(u) / self.kv_bytes_per_token(1)
        per_token = self.split_residual(degree, c)[1]
        if per_token:
            extra = extra + L * per_token * s
        return self.ulysses_comm_ms(s, degree, c) + self.cp_comm_ms(s, degree, c) + extra

    def _split_ms(self, lengths, degree: int, cp: int) -> np.ndarray:
        """What a split adds to each sequence's compute (ms): its collectives, the measured SP and CP
        extras that grow with the tokens (``_split_linear_ms``) and CP's extra attention, which grows
        with the square of the length (``cp_attention_ms``)."""
        return self._split_linear_ms(lengths, degree, cp) + self.cp_attention_ms(lengths, degree, cp)

    def _least(self, fn, degree: int, cp: int | None) -> np.ndarray:
        """``fn(c)`` for split ``cp``, or elementwise the least over the degree's splits (cp None)."""
        out = None
        for c in self._cps(degree, cp):
            v = fn(c)
            out = v if out is None else np.minimum(out, v)
        return out

    def time(self, lengths, degree: int, cp: int | None = None) -> np.ndarray:
        """Time (ms) of each sequence on a group of ``degree`` and split ``(degree/cp) x cp``: compute
        plus communication (plus the measured SP and CP extras per token, CP's extra attention and a
        composite split's measured residual per token, when the profile has them), plus what offload
        adds where the sequence is planned offloaded (``offloaded``, ``offload_ms`` with no block
        swapped). Planners see that: a group's swapped blocks (``choose_swap``) only shorten it, after
        it is placed. The bounds see the least over the counts of swapped blocks (``bound_view``).
        ``cp`` None: each sequence on its fastest split of the degree (no group is faster). The
        group's fixed cost per micro-step is ``group_overhead_ms``, not included."""
        s = np.asarray(lengths, dtype=np.float64)
        extra = plain = None
        if self._offload_ok and self._bound_view:
            extra = self.least_offload_ms(s, degree, "inputs")
            plain = self.least_offload_ms(s, degree, "none")
        elif self._offload_ok:
            extra = self.offload_ms(s, degree, "inputs", 0)
            plain = np.zeros_like(s)

        def one(c: int) -> np.ndarray:
            t = self._split_ms(s, degree, c)
            return t if extra is None else t + np.where(self.offloaded(s, degree, c), extra, plain)
        return self.compute_ms(s, degree) + self._least(one, degree, cp)

    def least_offload_ms(self, lengths, degree: int, level: str) -> np.ndarray:
        """What ``level`` adds to each sequence's time at best (ms): ``offload_ms`` with no block
        swapped, or, where groups may swap (``swap``), its least over the counts of swapped blocks,
        memory aside. Planners and bounds see this: a group's own count (``choose_swap``, within the
        budgets, one count for all its sequences) never makes it faster, so their bounds hold. Planners
        see none of it (``time``): an assignment made with the gains of swapping in mind was 0.06%
        longer than without offload on a github batch, as no group swaps as much as each sequence
        alone would."""
        s = np.asarray(lengths, dtype=np.float64)
        base = self.offload_ms(s, degree, level, 0) if level == "inputs" else np.zeros_like(s)
        if not self.swap:
            return base
        rows = self._offload_rows(s, degree, level, np.arange(1, self.model.layers + 1))
        return np.minimum(base, rows.min(axis=0))

    def cp_memory_gb(self, lengths, degree: int, cp: int) -> np.ndarray:
        """What CP keeps per GPU beyond the local activations (GB per sequence; 0 for ``cp = 1``): the
        K and V its attention gathered and keeps for the backward, ``s * kv_bytes(u) * (1 - 1/(2c))``
        beyond the local share per layer (every layer; one with recomputation), plus the layer's
        gathered K/V while it is computed."""
        s = np.asarray(lengths, dtype=np.float64)
        d, c = int(degree), int(cp)
        if c <= 1:
            return np.zeros_like(s)
        per_layer = s * self.kv_bytes_per_token(d // c)
        kept = 1 if self.recompute else self.model.layers
        return (kept * per_layer * (1 - 1 / (2 * c)) + per_layer) / 1e9

    def memory(self, lengths, degree: int, cp: int | None = None) -> np.ndarray:
        """Activation memory (GB per GPU) each sequence is charged against ``memory_budget_gb`` on a
        group of ``degree`` and split ``cp`` (None: its least over the degree's splits): what it keeps
        on the GPU, or, where it is planned offloaded (``offloaded``), the larger of that (with the
        tiled MLP's working set, ``tile_gb``) and its host bytes as a share of the host budget scaled
        to the GPU's (``memory_budget_gb / host_budget_gb``), so that a group within the budget fits
        both the GPU and the host. Under ``auto`` a sequence not offloaded is charged at least its host
        share too, as its group may offload (``group_offload``)."""
        s = np.asarray(lengths, dtype=np.float64)
        return self._least(lambda c: self._planned_memory(s, degree, c), degree, cp)

    # ---- offload (workbench.cost.offload) -----------------------------------------------------------
    def _init_offload(self, offload: str) -> None:
        """The host budget and link, and whether plans may offload (``offload_note`` says why not)."""
        p, m, cl = self.profile, self.model, self.cluster
        self.offload = offload
        autocast = self.precision == "bf16" and cl.zero_stage < 3
        per_node = min(cl.gpus_per_node, cl.num_gpus)
        host = cl.host_memory_gb if cl.host_memory_gb is not None else p.host_memory_gb
        self.host_memory_gb = float(host) if host else None
        """Host memory of one node (GB): the cluster's, else the profile's; None: unknown."""
        self.host_budget_gb = float(host) * _off.HOST_MEMORY_FRACTION / per_node if host else 0.0
        """Host memory per GPU plans may fill with offloaded activations (GB)."""
        self.host_link_gbps = _off.host_link_gbps(p.host_link_gbps, p.host_link_node_gbps, per_node)
        """Host-device bandwidth of one GPU while all of its node's GPUs copy (GB/s; 0: unknown)."""
        note = ""
        if not self.recompute:
            note = "offload needs --recompute (it moves the checkpointed block inputs)"
        elif offload == "none":
            note = "offload is off (--offload none)"
        elif not self.host_link_gbps:
            note = f"profile {p.name} has no host link figure (host_link_gbps): measure it with workbench profile"
        elif not self.host_budget_gb:
            note = "the host memory per node is unknown: give --host-memory GB"
        if offload in ("inputs", "swap") and note:
            raise ValueError(f"--offload {offload}: {note}")
        self.offload_note = note
        """Why plans of this cost model cannot offload ('' when they can)."""
        self._offload_ok = not note
        self._plain_limit: int | None = None
        self._bound_view = False
        self._bounds: "CostModel | None" = None
        self._unswapped: "CostModel | None" = None
        formula = activation_bytes_per_token(m, True, autocast=autocast)
        self._saved_share = min(0.95, _off.offload_saved_bytes_per_token(m, autocast=autocast) / formula)
        self._host_bytes = _off.host_bytes_per_token(m, autocast=autocast)
        self._resid_bytes = _off.residual_bytes(m, autocast=autocast)
        self._block_bytes = block_activation_bytes(m, autocast=autocast)
        self.swap = offload in ("auto", "swap") and not note
        """Whether groups may swap blocks (their full activations in host memory instead of recomputed)."""
        self.tile_gb = _off.tile_working_bytes(m, autocast=autocast) / 1e9 if self._offload_ok else 0.0
        """GPU memory the tiled MLP's tile holds at its peak (GB), charged once per offloaded sequence."""

    def without_swap(self) -> "CostModel":
        """This cost model as the planners search with it: a copy in which no group swaps (``swap``
        False), or itself where none may. ``workbench.solve.run_planner`` plans with it and gives the
        chosen plan's groups their swapped blocks afterwards (``workbench.solve.plan.with_swap``), so a
        plan's groups are those the search would have found without swap, each as fast or faster."""
        return self._view("_unswapped", swap=False, _bounds=None) if self.swap else self

    def bound_view(self) -> "CostModel":
        """This cost model as the lower bounds must see it: where groups may swap blocks, a copy whose
        ``time`` takes each sequence's least over the counts of swapped blocks (``least_offload_ms``),
        so that no group of any plan is faster; else itself."""
        return self._view("_bounds", _bound_view=True) if self.swap and not self._bound_view else self

    def chain_view(self) -> "CostModel":
        """This cost model over one divisibility chain of its degrees (``workbench.specs.degree_chains``),
        where the planners' aligned blocks pack: itself when its degrees are one chain (every
        power-of-two set is), else ``restricted`` to the first (the one holding the powers of two).
        A planner called directly plans over that chain; ``workbench.solve.run_planner`` searches the
        others too."""
        from workbench.specs import degree_chains

        chains = degree_chains(self.degrees)
        return self if len(chains) <= 1 else self.restricted(chains[0])

    def restricted(self, degrees) -> "CostModel":
        """This cost model over some of its degrees (one divisibility chain: ``ClusterSpec.chains``):
        a copy whose ``degrees``, ``shapes`` and ``cluster.degrees`` keep only those, and whose
        per-shape caches start afresh (``plain_limit``: the longest sequence the kept shapes hold).
        Every time and memory figure is the same as this model's. Itself when nothing is dropped."""
        keep = tuple(sorted({int(d) for d in degrees} & set(self.degrees)))
        if keep == self.degrees:
            return self
        if not keep:
            raise ValueError(f"none of the degrees {sorted({int(d) for d in degrees})} is a candidate degree "
                             f"{list(self.degrees)}")
        views = self.__dict__.setdefault("_restricted_views", {})
        view = views.get(keep)
        if view is None:
            view = copy.copy(self)
            view._shapes = tuple(x for x in self._shapes if x[0] in keep)
            view.degrees = keep
            view.cluster = dataclasses.replace(self.cluster, degrees=keep)
            view._plain_limit = None
            view._unswapped = None
            view._bounds = None
            view._restricted_views = {}
            views[keep] = view
        return view

    def _view(self, slot: str, **attrs) -> "CostModel":
        """A copy of this cost model with ``attrs`` set, made once and kept in ``slot`` (its own too)."""
        view = getattr(self, slot)
        if view is None:
            view = copy.copy(self)
            for name, value in attrs.items():
                setattr(view, name, value)
            setattr(view, slot, view)
            setattr(self, slot, view)
        return view

    @property
    def can_offload(self) -> bool:
        """Whether plans of this cost model may offload (``offload_note`` says why not)."""
        return self._offload_ok

    def gpu_memory(self, lengths, degree: int, cp: int, level: str = "none") -> np.ndarray:
        """GPU memory (GB per GPU) of each sequence at offload ``level`` on split ``(degree/cp) x cp``,
        without the tiled MLP's per-group working set (``tile_gb``). Level ``inputs`` removes
        ``workbench.cost.offload.offload_saved_bytes_per_token``'s share of the formula's activations
        from the model's (the same bytes where they come from the formula; the same share of a
        profile's measured figure, which the formula scales too)."""
        s = np.asarray(lengths, dtype=np.float64)
        d = int(degree)
        per_token = self.memory_bytes_per_token
        if level == "inputs":
            per_token = self._fit.act_bytes * (1.0 - self._saved_share) + self.loss_bytes_per_token
        return per_token * s / d / 1e9 + self.cp_memory_gb(s, d, int(cp))

    def host_memory(self, lengths, degree: int, level: str = "inputs") -> np.ndarray:
        """Host memory (GB per GPU of the group) of each sequence at offload ``level``: every block's
        input of its ``s / degree`` tokens under ``inputs``, nothing under ``none``."""
        s = np.asarray(lengths, dtype=np.float64)
        if level != "inputs":
            return np.zeros_like(s)
        return self._host_bytes * s / int(degree) / 1e9

    def offloaded(self, lengths, degree: int, cp: int) -> np.ndarray:
        """Which sequences plans offload on split ``(degree/cp) x cp`` (bool per sequence): none unless
        offload is possible (``can_offload``); all under ``inputs``; under ``auto`` those longer than
        any group holds without offload (``plain_limit``). So under ``auto`` a batch that fits without
        offload is planned exactly as without it: letting shorter sequences offload to run on fewer
        GPUs made heuristic planners (static-max, greedy, min-degree) take smaller degrees and longer
        steps (docs/offload.md)."""
        s = np.asarray(lengths, dtype=np.float64)
        if not self._offload_ok:
            return np.zeros(s.shape, dtype=bool)
        if self.offload in ("inputs", "swap"):
            return np.ones(s.shape, dtype=bool)
        return s > self.plain_limit

    @property
    def plain_limit(self) -> int:
        """The longest sequence some shape holds alone without offload (tokens; bisection, cached)."""
        if self._plain_limit is None:
            def fits(n: int) -> bool:
                x = np.array([float(n)])
                return any(self.gpu_memory(x, d, c, "none")[0] <= self.memory_budget_gb for d, c in self._shapes)
            lo, hi = 0, 1 << 36
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid)
            self._plain_limit = lo
        return self._plain_limit

    def _planned_memory(self, s: np.ndarray, degree: int, cp: int) -> np.ndarray:
        none = self.gpu_memory(s, degree, cp, "none")
        if not self._offload_ok:
            return none
        host = self.host_memory(s, degree) * (self.memory_budget_gb / self.host_budget_gb)
        inputs = np.maximum(self.gpu_memory(s, degree, cp, "inputs") + self.tile_gb, host)
        if self.offload in ("inputs", "swap"):
            return inputs
        return np.where(s > self.plain_limit, inputs, np.maximum(none, host))

    def offload_ms(self, lengths, degree: int, level: str = "inputs", swap: int = 0) -> np.ndarray:
        """What offload ``level`` with ``swap`` blocks swapped adds to each sequence's time on a group
        of ``degree`` (ms; negative where swapping saves more than the copies cost):

        - the copies' exposed part, per direction: the block inputs of the ``L - swap`` checkpointed
          blocks (level ``inputs``) and the whole activations of the ``swap`` swapped ones, over
          ``host_link_gbps``, beyond the compute they run under (the forward going out, the
          recomputation and backward coming back; ``workbench.cost.offload.exposed_copy_ms`` with
          every layer alike);
        - the tiled MLP's extra forward in each checkpointed block under ``inputs`` (the MLP's share
          of a forward's per-token block time);
        - less the recomputed forward of each swapped block.

        Infinite where the link is unknown."""
        s = np.asarray(lengths, dtype=np.float64)
        if not self.host_link_gbps:
            return np.full(s.shape, np.inf)
        return self._offload_rows(s, degree, level, np.array([float(swap)]))[0]

    def _offload_rows(self, s: np.ndarray, degree: int, level: str, k: np.ndarray) -> np.ndarray:
        """``offload_ms`` for every count of swapped blocks in ``k`` at once: ``(len(k), len(s))``."""
        d, L, f = int(degree), self.model.layers, self._fit
        k = np.asarray(k, dtype=np.float64)[:, None]
        inputs = level == "inputs"
        gbps = self.host_link_gbps * 1e9
        per_input = (s / d) * self.model.hidden * self._resid_bytes / gbps * 1e3
        per_block = (s / d) * self._block_bytes / gbps * 1e3
        forward = (f.A_fwd * s * s + f.B_fwd * s) / d / L  # one layer's forward
        backward = np.maximum(0.0, self.compute_ms(s, d) / L - 2 * forward)  # its backward alone
        copies = (L - k) * per_input * inputs + k * per_block
        out = (np.maximum(0.0, copies - L * forward) + np.maximum(0.0, copies - L * backward - (L - k) * forward)
               - k * forward)
        if inputs:
            out = out + f.B_fwd * _off.mlp_flop_share(self.model) * s / d * (L - k) / L
        return out

    def _cp_layer_gb(self, s: np.ndarray, degree: int, cp: int) -> np.ndarray:
        """What one block of a ``(degree/cp) x cp`` split keeps of the K and V it gathered (GB per GPU;
        0 without context parallelism): ``cp_memory_gb``'s per-layer part."""
        d, c = int(degree), int(cp)
        if c <= 1:
            return np.zeros_like(s)
        return s * self.kv_bytes_per_token(d // c) * (1 - 1 / (2 * c)) / 1e9

    def swap_gpu_memory(self, lengths, degree: int, level: str, swap: int, cp: int = 1) -> np.ndarray:
        """What ``swap`` swapped blocks change in each sequence's GPU memory (GB per GPU): one block's
        whole activations more (the one in use and the one in flight, where recomputation held one;
        with its gathered K/V under context parallelism), less the swapped blocks' own inputs under
        level ``none`` (they are among their activations)."""
        s = np.asarray(lengths, dtype=np.float64)
        if int(swap) <= 0:
            return np.zeros_like(s)
        d = int(degree)
        kept = 0.0 if level == "inputs" else int(swap) * self.model.hidden * self._resid_bytes
        return (self._block_bytes - kept) * s / d / 1e9 + self._cp_layer_gb(s, d, cp)

    def swap_host_memory(self, lengths, degree: int, level: str, swap: int, cp: int = 1) -> np.ndarray:
        """Host memory (GB per GPU) of each sequence with ``swap`` blocks swapped at ``level``: the
        swapped blocks' whole activations (with their gathered K/V under context parallelism) but the
        last block's, which the runtime keeps on the GPU for the backward that starts with it, and
        under ``inputs`` the other blocks' inputs."""
        s = np.asarray(lengths, dtype=np.float64)
        k, L, d = int(swap), self.model.layers, int(degree)
        inputs = (L - k) * self.model.hidden * self._resid_bytes if level == "inputs" else 0.0
        out = max(0, k - 1) * (self._block_bytes * s / d / 1e9 + self._cp_layer_gb(s, d, cp))
        return inputs * s / d / 1e9 + out

    def choose_swap(self, lengths, degree: int, cp: int, level: str) -> int:
        """How many blocks a group running ``lengths`` at ``level`` swaps: the count from 0 to the
        layers that makes it fastest with its GPU memory and its host memory within their budgets
        (the fewest among equals); 0 unless groups may swap (``swap``). Every count at once: the
        group's time, GPU and host memory are ``group_at``'s, summed per sequence."""
        s = np.asarray(lengths, dtype=np.float64)
        if not self.swap or s.size == 0:
            return 0
        L, d = self.model.layers, int(degree)
        k = np.arange(L + 1, dtype=np.float64)[:, None]  # (L+1, 1) against the sequences (1, n)
        inputs = level == "inputs"
        extra = self._offload_rows(s, d, level, k[:, 0])
        if not inputs:
            extra[0] = 0.0  # no block swapped at level none: nothing offloaded, nothing added
        t = extra.sum(axis=1)  # what each count adds to the group's time
        tokens = float(s.sum()) / d
        kept = 0.0 if inputs else self.model.hidden * self._resid_bytes
        base_gpu = float(self.gpu_memory(s, d, cp, level).sum())
        cp_layer = float(self._cp_layer_gb(s, d, cp).sum())
        gpu = base_gpu + np.where(k[:, 0] > 0, (self._block_bytes - k[:, 0] * kept) * tokens / 1e9 + cp_layer, 0.0)
        gpu = gpu + (self.tile_gb if inputs else 0.0) * (k[:, 0] < L)
        swapped_out = np.maximum(0.0, k[:, 0] - 1)  # the last swapped block stays on the GPU
        host = ((L - k[:, 0]) * self.model.hidden * self._resid_bytes * inputs + swapped_out * self._block_bytes) * tokens / 1e9
        host = host + swapped_out * cp_layer
        ok = (gpu <= self.memory_budget_gb * (1 + 1e-9)) & (host <= self.host_budget_gb * (1 + 1e-9))
        ok[0] = True
        t = np.where(ok, t, np.inf)
        best = int(np.argmin(t))  # the first of equal times: the fewest blocks
        return best if t[best] < t[0] - 1e-9 * max(1.0, abs(float(t[0]))) else 0

    def group_offload(self, lengths, degree: int, cp: int) -> str:
        """The offload level of a group running ``lengths`` on split ``(degree/cp) x cp``: ``none``
        unless plans may offload; ``inputs`` under ``--offload inputs``; under ``auto`` ``inputs`` only
        when the group's activations do not fit the GPU without it."""
        if not self._offload_ok:
            return "none"
        if self.offload in ("inputs", "swap"):
            return "inputs"
        need = float(self.gpu_memory(lengths, degree, cp, "none").sum())
        return "inputs" if need > self.memory_budget_gb * (1 + 1e-9) else "none"

    def group_at(self, lengths, degree: int, cp: int, level: str, swap: int = 0) -> tuple[float, float, float]:
        """``(time_ms, gpu_gb, host_gb)`` of one group running ``lengths`` on split ``(degree/cp) x cp``
        at offload ``level`` with ``swap`` blocks swapped: its overhead and sequences' times (plus
        ``offload_ms`` of every sequence when it offloads or swaps), its GPU memory per GPU (plus one
        tile's working set under ``inputs`` while a block is still checkpointed; ``swap_gpu_memory``)
        and its host memory per GPU."""
        s = np.asarray(lengths, dtype=np.float64)
        if s.size == 0:
            return 0.0, 0.0, 0.0
        d, c, k = int(degree), int(cp), int(swap)
        t = self.group_overhead_ms(d, c) + float((self.compute_ms(s, d) + self._split_ms(s, d, c)).sum())
        gpu = float((self.gpu_memory(s, d, c, level) + self.swap_gpu_memory(s, d, level, k, c)).sum())
        if level == "inputs" or k:
            t += float(self.offload_ms(s, d, level, k).sum())
        if level == "inputs" and k < self.model.layers:
            gpu += self.tile_gb
        return t, gpu, float(self.swap_host_memory(s, d, level, k, c).sum())

    def memory_breakdown(self, lengths, degree: int, cp: int, level: str, swap: int = 0) -> dict:
        """Per-GPU memory of one group at offload ``level`` by part (GB): ``gpu`` (``model states``,
        ``loss working set``, ``block inputs``: what recomputation keeps of them on the GPU,
        ``layer working set`` (one layer's while it is recomputed, the loss's share per token and CP's
        gathered K/V), ``MLP tile``, ``unplanned reserve``: the share of the GPU plans leave free) and
        ``host`` (``block inputs``: the offloaded ones, per GPU of the group)."""
        s = np.asarray(lengths, dtype=np.float64)
        d, c = int(degree), int(cp)
        act = float((self.gpu_memory(s, d, c, level) + self.swap_gpu_memory(s, d, level, swap, c)).sum())
        layers = self.model.layers
        kept_layers = layers - int(swap) if level == "none" else min(2, layers - int(swap))
        inputs = float(kept_layers * self.model.hidden * self._resid_bytes * s.sum() / d / 1e9) if self.recompute else 0.0
        inputs = min(inputs, act)
        return {"gpu": {"model states": self.model_states_gb, "loss working set": self.loss_working_gb,
                        "block inputs": inputs, "layer working set": act - inputs,
                        "MLP tile": self.tile_gb if level == "inputs" else 0.0,
                        "unplanned reserve": self.cluster.gpu_memory_gb - self.cluster.usable_memory_gb},
                "host": {"block inputs": float(self.host_memory(s, d, level).sum()) * (layers - int(swap)) / layers,
                         "swapped blocks": float(self.swap_host_memory(s, d, "none", swap, c).sum())}}

    def longest_sequence(self, limit: int = 1 << 36) -> int:
        """The longest single sequence (tokens) some group of this cost model holds, up to ``limit``
        and the model's max context aside: bisection on ``min_degree`` (memory grows with length)."""
        lo, hi = 0, int(limit)
        if self.min_degree([hi])[0] > 0:
            return hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.min_degree([mid])[0] > 0:
                lo = mid
            else:
                hi = mid
        return lo

    def work(self, lengths, degree: int, cp: int | None = None) -> np.ndarray:
        """GPU-time (ms x GPUs) of each sequence on ``degree``: ``degree * time``."""
        return degree * self.time(lengths, degree, cp)

    def collective_calls(self, degree: int, cp: int | None = None) -> int:
        """Collective calls one group of ``degree`` and split ``cp`` makes per micro-step (0 for
        degree 1): Ulysses sends q/k/v and brings the output back once per layer and pass (forward,
        backward, and the recomputed forward); CP all-gathers K/V in every forward and
        reduce-scatters their gradients in the backward, once per layer. ``cp`` None: the degree's
        first split."""
        d = int(degree)
        c = self._cps(d, cp)[0]
        passes = int(self._passes())
        u = d // c
        return (2 * passes * self.model.layers if u > 1 else 0) + (passes * self.model.layers if c > 1 else 0)

    def collective_latency_ms(self, degree: int, cp: int | None = None) -> float:
        """The part of ``group_overhead_ms`` spent in the fixed latency of collective calls (0 when
        the profile has no latency figures). ``cp`` None: the least over the degree's splits."""
        def one(c: int) -> float:
            d, p, L = int(degree), self.profile, self.model.layers
            u, passes = d // c, int(self._passes())
            out = 0.0
            if u > 1:
                out += 2 * passes * L * _interp_latency(p.all_to_all_latency_ms, u)
            if c > 1:
                ag = _interp_latency(p.allgather_latency_ms or p.allreduce_latency_ms, c)
                rs = _interp_latency(p.reduce_scatter_latency_ms or p.allreduce_latency_ms, c)
                out += L * ((passes - 1) * ag + rs)
            return out
        return min(one(c) for c in self._cps(degree, cp))

    def sp_overhead_ms(self, degree: int, cp: int | None = None) -> float:
        """The profile's measured extra fixed time of a group's split per micro-step: the Ulysses
        part's per-layer figure at ``u``, the CP part's at ``c`` and, for a composite split the
        profile measured, its residual beyond those two (``split_residual``), times the model's layers
        (0 for ``1 x 1`` or a profile without them). ``cp`` None: the least over the degree's splits."""
        def one(c: int) -> float:
            u, p, out = int(degree) // c, self.profile, 0.0
            if u > 1 and p.sp_overhead_ms:
                out += self.model.layers * _interp_latency(p.sp_overhead_ms, u)
            if c > 1 and p.cp_overhead_ms:
                out += self.model.layers * _interp_latency(p.cp_overhead_ms, c)
            out += self.model.layers * self.split_residual(degree, c)[0]
            return out
        return min(one(c) for c in self._cps(degree, cp))

    def group_ms(self, lengths, degree: int, cp: int | None = None) -> float:
        """Time (ms) of one group of ``degree`` and split ``(degree/cp) x cp`` running all of
        ``lengths`` in a micro-step: its fixed overhead plus its sequences' times (``cp`` None: each
        term its least over the degree's splits, as in ``time`` and ``group_overhead_ms``)."""
        return self.group_overhead_ms(degree, cp) + float(self.time(lengths, degree, cp).sum())

    def group_overhead_ms(self, degree: int, cp: int | None = None) -> float:
        """Fixed time a group pays once per micro-step: the fitted constant c of every layer and the
        profile's measured fixed cost of a micro-step, plus the latency of the group's collective
        calls and the measured extras of its split when the profile has them (``sp_overhead_ms``: the
        Ulysses and CP parts and a composite split's own residual). ``cp`` None: the least over the
        degree's splits."""
        return self._fit.C + min(self.collective_latency_ms(degree, c) + self.sp_overhead_ms(degree, c)
                                 for c in self._cps(degree, cp))

    @property
    def activation_bytes_per_token(self) -> float:
        """Bytes per token kept for backward (whole model)."""
        return self._fit.act_bytes

    @property
    def memory_bytes_per_token(self) -> float:
        """Bytes per token a rank's budget is charged: the activations and the loss's transient share
        (``loss_bytes_per_token``)."""
        return self._fit.act_bytes + self.loss_bytes_per_token

    def tokens_per_gpu(self) -> float:
        """How many tokens of activations one GPU holds within the budget."""
        return self.memory_budget_gb * 1e9 / self.memory_bytes_per_token

    # ---- collectives over all ranks ----------------------------------------------------------------
    def _bus(self, kind: str, nbytes: float, n: int) -> float:
        """Time (ms) of one ``kind`` collective (``allreduce``, ``allgather``, ``reduce_scatter``) of
        ``nbytes`` over ``n`` ranks at the profile's bus bandwidth, plus its latency: an all-reduce
        moves 2(n-1)/n of the bytes per rank, the others (n-1)/n. All-gather and reduce-scatter fall
        back to the all-reduce figures when the profile has none of their own; 0 without any."""
        p = self.profile
        own = {"allreduce": (p.allreduce_gbps, p.allreduce_latency_ms),
               "allgather": (p.allgather_gbps, p.allgather_latency_ms),
               "reduce_scatter": (p.reduce_scatter_gbps, p.reduce_scatter_latency_ms)}[kind]
        bw, lat = own if own[0] else (p.allreduce_gbps, p.allreduce_latency_ms)
        if n <= 1 or not bw:
            return 0.0
        share = 2 * (n - 1) / n if kind == "allreduce" else (n - 1) / n
        return share * nbytes / (self._table_gbps(bw, p.inter_node_allreduce_gbps, n) * 1e9) * 1e3 + \
            _interp_latency(lat, n)

    def grad_sync_ms(self, num_ranks: int | None = None) -> float:
        """The step's gradient reduction after the last micro-step of a free step, fp32 gradients
        (4 bytes per parameter): ZeRO-0 one all-reduce; ZeRO-1 an all-reduce, then the sharded
        optimizer's parameter broadcast (ZeroRedundancyOptimizer broadcasts each parameter from its
        owner: fp32, costed as one all-gather); ZeRO-2 a reduce of each owner's gradients to it (the
        runtime's ``dist.reduce`` per owner: a reduce-scatter's bytes, costed as one) and that
        broadcast. 0 under ZeRO-3 (every pass reduce-scatters its gradients: ``pass_comm_ms``), on one
        rank, or when the profile has no collective figures."""
        n = num_ranks or self.cluster.num_gpus
        stage = self.cluster.zero_stage
        if n <= 1 or stage == 3:
            return 0.0
        nbytes = 4.0 * self.model.params()
        if stage == 0:
            return self._bus("allreduce", nbytes, n)
        first = self._bus("allreduce" if stage == 1 else "reduce_scatter", nbytes, n)
        return first + self._bus("allgather", nbytes, n)

    def step_end_ms(self) -> float:
        """What every step costs after its last micro-step: the gradient reduction and the optimizer
        step (``grad_sync_ms + optimizer_ms``)."""
        return self.grad_sync_ms() + self.optimizer_ms()

    def updated_params(self) -> float:
        """Parameters the most loaded rank's optimizer updates: all of them under ZeRO-0, its
        ZeroRedundancyOptimizer partition under ZeRO-1/2, its FSDP shard under ZeRO-3."""
        from workbench.cost.memory import parameter_shapes, zero_partition

        n, stage = self.cluster.num_gpus, self.cluster.zero_stage
        shapes = [shape for _, shape in parameter_shapes(self.model)]
        if stage == 0 or n == 1:
            return float(sum(math.prod(x) for x in shapes))
        if stage == 3:
            return float(sum(math.ceil(x[0] / n) * math.prod(x[1:]) for x in shapes))
        return float(max(zero_partition([math.prod(x) for x in shapes], n)))

    def optimizer_ms(self) -> float:
        """The optimizer step after the step's last micro-step (ms): the profile's measured time per
        million updated parameters (its ZeRO-3 figure for FSDP's sharded parameters when it has
        one) times ``updated_params``; 0 when the profile did not measure it."""
        p = self.profile
        rate = p.optimizer_ms_per_mparam
        if self.cluster.zero_stage == 3 and self.cluster.num_gpus > 1 and p.sharded_optimizer_ms_per_mparam is not None:
            rate = p.sharded_optimizer_ms_per_mparam
        return float(rate) * self.updated_params() / 1e6 if rate else 0.0

    # ---- lockstep passes (ZeRO-3) ---------------------------------------------------------------------
    def call_overhead_ms(self) -> float:
        """The part of ``group_overhead_ms`` paid once per packed forward and backward: the fitted
        constant c of every layer. In a lockstep pass a rank pays it once however many groups it
        serves; in free execution every group is a forward and backward of its own."""
        return self._fit.C

    def group_extra_ms(self, degree: int, cp: int | None = None) -> float:
        """The part of ``group_overhead_ms`` every group pays on its own: its collectives' latency
        and its measured SP layout cost (``group_overhead_ms - call_overhead_ms``)."""
        return self.group_overhead_ms(degree, cp) - self._fit.C

    def _unit_comm(self) -> list[tuple[float, float]]:
        """Per FSDP unit, in forward order: (all-gather ms, reduce-scatter ms) over all ranks (computed
        once: every lockstep pass's time asks for it)."""
        cached = self.__dict__.get("_unit_comm_ms")
        if cached is not None:
            return cached
        n = self.cluster.num_gpus
        out = []
        for unit in fsdp_units(self.model):
            numel = float(sum(math.prod(shape) for _, shape in unit))
            out.append((self._bus("allgather", numel * self.model.dtype_bytes, n),
                        self._bus("reduce_scatter", numel * 4.0, n)))
        self._unit_comm_ms = out
        return out

    def fsdp_comm_ms(self) -> float:
        """All of FSDP's collectives in one lockstep pass (ms): every unit all-gathered for the
        forward and again for the backward, its gradient reduce-scattered in fp32. 0 outside
        lockstep execution or on one rank."""
        if self.execution != "lockstep" or self.cluster.num_gpus <= 1:
            return 0.0
        return float(sum(2 * ag + rs for ag, rs in self._unit_comm()))

    def comm_overlap(self) -> float:
        """The profile's ``pass_comm_overlap`` (1 when it does not say)."""
        o = self.profile.pass_comm_overlap
        return 1.0 if o is None else float(o)

    def pass_comm_ms(self) -> float:
        """The part of FSDP's collectives in one lockstep pass that overlaps the compute
        (``comm_overlap * fsdp_comm_ms``): a pass is at least this long. 0 outside lockstep
        execution or on one rank."""
        return self.comm_overlap() * self.fsdp_comm_ms()

    def pass_overhead_ms(self) -> float:
        """What every lockstep pass costs beyond the longer of its compute and ``pass_comm_ms``: the
        collectives that do not overlap (``(1 - overlap) * fsdp_comm_ms``; of those that do, the
        first unit's all-gather, as nothing computes before it arrives, and its reduce-scatter, as
        nothing computes after it), and the profile's measured fixed cost of a pass. 0 outside
        lockstep."""
        if self.execution != "lockstep":
            return 0.0
        fixed = _interp_latency(self.profile.pass_overhead_ms, self.cluster.num_gpus)
        if self.cluster.num_gpus <= 1:
            return fixed
        o = self.comm_overlap()
        ag0, rs0 = self._unit_comm()[0]
        return (1 - o) * self.fsdp_comm_ms() + o * (ag0 + rs0) + fixed

    def pass_ms(self, max_rank_load_ms: float) -> float:
        """Duration of one lockstep pass whose most loaded rank computes ``max_rank_load_ms``."""
        return max(float(max_rank_load_ms), self.pass_comm_ms()) + self.pass_overhead_ms()


    # ---- feasibility ----------------------------------------------------------------------------
    def min_degree(self, lengths) -> np.ndarray:
        """Smallest supported degree whose memory holds each sequence alone (0 where none does)."""
        s = np.asarray(lengths, dtype=np.float64)
        out = np.zeros(s.shape, dtype=np.int64)
        for d in sorted(self.degrees, reverse=True):
            ok = self.memory(s, d) <= self.memory_budget_gb
            out[ok] = d
        return out

    def check_feasible(self, lengths) -> None:
        """Raise InfeasibleError naming the first sequence no group can hold, the memory it needs
        and the smallest degree that would hold it."""
        s = np.asarray(lengths, dtype=np.int64)
        md = self.min_degree(s)
        bad = np.flatnonzero(md == 0)
        if bad.size == 0:
            return
        i = int(bad[0])
        raise InfeasibleError(self.infeasible_message(i, int(s[i])) +
                              (f" ({bad.size - 1} more sequence(s) too long as well)" if bad.size > 1 else ""))

    def infeasible_message(self, index: int, length: int) -> str:
        """One line saying why sequence ``index`` of ``length`` tokens fits no group."""
        need_total = self.memory([length], 1)[0]
        d_need = math.ceil(need_total / self.memory_budget_gb)
        # the smallest candidate degree that many GPUs' budgets add up to (the need itself past them)
        d_fit = min([d for d in self.cluster.degrees if d >= d_need], default=d_need)
        gpus = self.cluster.num_gpus
        kept = (f" even with its block inputs in host memory ({self.host_budget_gb:,.0f} GB per GPU)"
                if self._offload_ok else "")
        msg = (f"sequence {index} ({length:,} tokens) needs {need_total:,.1f} GB of activations{kept}, so degree "
               f"{d_fit} on {self.cluster.gpu_memory_gb:g} GB GPUs ({self.memory_budget_gb:.1f} GB per GPU for "
               f"activations)")
        if d_fit > gpus:
            msg += f"; the cluster has {gpus} GPUs"
        elif not self.degree_supported(d_fit):
            msg += f"; {self.degree_limit_reason(d_fit)}"
        else:
            msg += f"; candidate degrees are {list(self.degrees)}"
        if not self.recompute:
            return msg + ". Lower --max-len, add GPUs, or use --recompute (and --offload auto)"
        if not self._offload_ok and self.offload != "none":
            return msg + f". Lower --max-len or add GPUs ({self.offload_note})"
        if not self._offload_ok:
            return msg + ". Lower --max-len, add GPUs, or allow offload (--offload auto)"
        return msg + ". Lower --max-len or add GPUs"

    # ---- reporting ----------------------------------------------------------------------------------
    def table(self, lengths, degrees=None, cps=None) -> dict:
        """The cost model as plain data (the ``workbench cost --json`` shape).

        ``rows``: per length and degree, the sequence alone on its best split of the degree
        (``ulysses``, ``cp`` say which; ``time_ms`` and ``memory_gb`` are that split's).
        ``split_rows``: the same per length and shape ``(degree, ulysses, cp)`` (the degree's shapes,
        or every split in ``cps`` that divides it), with the split's ``comm_ms`` (``ulysses_ms``,
        ``cp_ms``) and ``group_overhead_ms``. ``group_overhead_ms`` per degree is its least over the
        splits; ``shapes`` lists the strategy's shapes with their overheads, collectives, CP attention factor
        and, for a composite split, its measured residual (``split_residual_ms`` per micro-step and
        ``split_residual_ms_per_token``, whole model; 0 without an entry).
        Raises ValueError when a CP size in ``cps`` divides none of ``degrees``."""
        degrees = list(degrees) if degrees else list(self.cluster.degrees)
        if cps is not None:
            cps = [int(c) for c in cps]
            bad = [c for c in cps if not any(int(d) % c == 0 for d in degrees)]
            if bad:
                raise ValueError(f"CP size(s) {bad} divide none of the degrees {degrees}: a group of degree d runs as "
                                 f"ulysses x cp = d, so cp must divide d")
        rows, split_rows = [], []
        for s in lengths:
            for d in degrees:
                supported = self.degree_supported(d) and d <= self.cluster.num_gpus
                row = {"length": int(s), "degree": int(d), "time_ms": None, "memory_gb": float(self.memory([s], d)[0]),
                       "feasible": False, "ulysses": None, "cp": None}
                if supported:
                    c = self.best_split([s], d)
                    mem = float(self.memory([s], d, c)[0])
                    off = bool(self.offloaded([s], d, c)[0])
                    row.update(time_ms=float(self.time([s], d, c)[0]), memory_gb=mem, ulysses=int(d) // c, cp=c,
                               feasible=bool(mem <= self.memory_budget_gb), offload="inputs" if off else "none",
                               host_gb=float(self.host_memory([s], d, "inputs" if off else "none")[0]))
                rows.append(row)
                show = self.splits(d) if cps is None else [c for c in cps if int(d) % c == 0]
                for c in show:
                    ok = d <= self.cluster.num_gpus and self.split_supported(int(d) // c)
                    mem = float(self._planned_memory(np.array([float(s)]), d, c)[0])
                    off = bool(self.offloaded([s], d, c)[0])
                    split_rows.append({
                        "length": int(s), "degree": int(d), "ulysses": int(d) // c, "cp": int(c),
                        "time_ms": float(self.time([s], d, c)[0]) if ok else None,
                        "ulysses_ms": float(self.ulysses_comm_ms([s], d, c)[0]) if ok else None,
                        "cp_ms": float(self.cp_comm_ms([s], d, c)[0]) if ok else None,
                        "memory_gb": mem, "group_overhead_ms": self.group_overhead_ms(d, c) if ok else None,
                        "feasible": bool(ok and mem <= self.memory_budget_gb),
                        "in_strategy": bool((int(d), int(c)) in self._shapes),
                        "offload": "inputs" if off else "none",
                        "host_gb": float(self.host_memory([s], d, "inputs" if off else "none")[0]),
                    })
        shapes = []
        for d, c in self._shapes:
            if d not in degrees:
                continue
            u = d // c
            shapes.append({
                "degree": d, "ulysses": u, "cp": c, "group_overhead_ms": self.group_overhead_ms(d, c),
                "collective_calls": self.collective_calls(d, c),
                "all_to_all_gbps": self.link_gbps("all_to_all", u) if u > 1 else None,
                "cp_allgather_gbps": self.cp_link_gbps("allgather", d, c) if c > 1 else None,
                "cp_reduce_scatter_gbps": self.cp_link_gbps("reduce_scatter", d, c) if c > 1 else None,
                "kv_bytes_per_token": self.kv_bytes_per_token(u) if c > 1 else None,
                "cp_attention_factor": self.cp_attention_factor(c) if c > 1 else None,
                # a composite split's measured residual beyond its parts (whole model): fixed, per token
                "split_residual_ms": self.model.layers * self.split_residual(d, c)[0] if u > 1 and c > 1 else None,
                "split_residual_ms_per_token": self.model.layers * self.split_residual(d, c)[1] if u > 1 and c > 1 else None,
            })
        return {
            "rows": rows,
            "split_rows": split_rows,
            "shapes": shapes,
            "group_overhead_ms": {str(d): self.group_overhead_ms(d) for d in degrees if self.degree_supported(d)},
            "memory_budget_gb": self.memory_budget_gb,
            "offload": self.offload,
            "offload_note": self.offload_note,
            "host_budget_gb": self.host_budget_gb,
            "host_link_gbps": self.host_link_gbps,
            "grad_sync_ms": self.grad_sync_ms(),
            "optimizer_ms": self.optimizer_ms(),
            "execution": self.execution,
            "zero_stage": self.cluster.zero_stage,
            "precision": self.precision,
            "optimizer": self.optimizer,
            "model_states_gb": self.model_states_gb,
            "loss_working_gb": self.loss_working_gb,
            "loss_bytes_per_token": self.loss_bytes_per_token,
            "model_states": self.states.to_dict(),
            "call_overhead_ms": self.call_overhead_ms(),
            "pass_comm_ms": self.pass_comm_ms(),
            "pass_overhead_ms": self.pass_overhead_ms(),
            "fsdp_comm_ms": self.fsdp_comm_ms(),
            "pass_comm_overlap": self.comm_overlap(),
            "strategy": self.strategy,
            "ulysses_limit": self.ulysses_limit(),
            "recompute": self.recompute,
            "model": self.model.name,
            "profile": self.profile.name,
            "profile_kind": self.profile.provenance.get("kind"),
            "gpus_per_node": self.cluster.gpus_per_node,
            "inter_node_degrees": [int(d) for d in degrees if self.crosses_nodes(d)],
            # the link figures these degrees' shapes use that were interpolated or extrapolated (link_source)
            "estimated_links": self.estimated_links(degrees),
            "link_gbps": {str(d): self.link_gbps("all_to_all", d) for d in degrees if d > 1},
            "inter_node_source": self.inter_node_source(),
        }


def _reference_model(name: str) -> ModelSpec:
    from workbench.models import get_model

    try:
        return get_model(name)
    except ValueError:
        raise ValueError(f"the profile was measured on model {name!r}, which is not a preset, so it cannot be "
                         f"scaled to another model; profile the model you plan for") from None
