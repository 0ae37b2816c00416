"""Offload: what a token keeps on the GPU and in host memory under each offload level, and what
the copies cost.

Under full recomputation (``--recompute``) a block keeps only its input for the backward, so per
token the GPU holds every layer's input (``layers x hidden x resid`` bytes, ``resid`` the residual
stream's bytes: the compute precision, 4 under autocast) plus one layer's working set while it is
recomputed and differentiated, of which the SwiGLU MLP's intermediates (gate, up, silu(gate) and
their product: ``4 x ffn`` values per token) are the largest part (``workbench.cost``'s
``activation_bytes_per_token``). Two levers move that off the GPU (MEMO, ALST):

- **inputs**: each block's checkpointed input goes to host memory as the block's forward ends and
  comes back one layer ahead in the backward, so the GPU holds at most two layers' inputs at a time
  (the one in use and the one in flight). Host memory holds all of them.
- **tiling**, part of the same level: the MLP runs in tiles of ``mlp_tile_tokens`` tokens (ALST's
  rule: as many tokens as the hidden size), so its intermediates exist for one tile, never for the
  whole sequence; the tiles are recomputed in the MLP's backward (one more MLP forward per layer).

Levels: ``none`` (as without offload) and ``inputs`` (both levers). A cost model's ``offload``
option says which levels its plans may use: ``none``, ``inputs`` (every group), ``auto`` (each
group the level it needs: ``none`` where its activations fit the GPU, else ``inputs``). Offload
needs recomputation: without it nothing is checkpointed.

What a copy costs: a block's input of ``t`` tokens on one GPU is ``t x hidden x resid`` bytes, over
the host link at ``host_link_gbps(profile, gpus copying)``: the profile's per-GPU pinned bandwidth,
or its share of the node's when all of a node's GPUs copy at once (``host_link_node_gbps``, shared).
The device-to-host copy of layer ``i`` runs under layer ``i+1``'s forward, the host-to-device copy
of layer ``i-1`` under layer ``i``'s recomputation and backward, so per layer only what a copy
outlasts its compute shows (``exposed_copy_ms``). Attention grows as ``s^2``, the copy as ``s``, so
at long context the copy hides; at short context it may not, and ``auto`` leaves such groups alone.

Pure Python + numpy: no torch.
"""

from __future__ import annotations

import numpy as np

__all__ = ["OFFLOAD_LEVELS", "OFFLOAD_CHOICES", "DEFAULT_OFFLOAD", "HOST_MEMORY_FRACTION", "offload_problem", "swap_blocks",
           "mlp_tile_tokens", "residual_bytes", "host_bytes_per_token", "offload_saved_bytes_per_token",
           "tile_working_bytes", "mlp_flop_share", "host_link_gbps", "exposed_copy_ms"]

OFFLOAD_LEVELS = ("none", "inputs")
"""What one group does: ``none`` (activations as recomputation keeps them) or ``inputs`` (block
inputs in host memory, the MLP in token tiles)."""

OFFLOAD_CHOICES = ("none", "inputs", "swap", "auto")
"""What a cost model's plans may use: one level for every group (``swap``: ``inputs`` and, per group,
the blocks whose swapping makes it fastest), or ``auto`` (per group: ``inputs`` as needed, and the
swapped blocks that make it fastest)."""

DEFAULT_OFFLOAD = "auto"
"""Scenarios, the command line and the panels plan with it unless told: a group offloads only when
its activations do not fit the GPU otherwise, so a plan that fits without offload does not change."""

HOST_MEMORY_FRACTION = 0.8
"""Share of a node's host memory plans may fill with offloaded activations: the rest is the
operating system's, the data loader's, the pinned staging buffers' and the Python processes' own."""


def offload_problem(offload, recompute: bool) -> str | None:
    """Why ``offload`` is not a choice for a cost model with ``recompute`` (one line), or None."""
    if offload not in OFFLOAD_CHOICES:
        return f"unknown offload {offload!r}; choose one of {', '.join(OFFLOAD_CHOICES)}"
    if offload in ("inputs", "swap") and not recompute:
        return (f"offload {offload!r} moves the checkpointed block inputs to host memory, which needs "
                "recomputation: add --recompute (or use --offload auto, which offloads only under it)")
    return None


def swap_blocks(layers: int, k: int) -> tuple[int, ...]:
    """Which of ``layers`` blocks a group swapping ``k`` of them swaps: evenly spread, block ``i`` iff
    ``floor((i+1) k / layers) > floor(i k / layers)`` (the runtime and the cost model use this one rule).
    Raises ValueError for ``k`` outside 0..layers."""
    L, k = int(layers), int(k)
    if not 0 <= k <= L:
        raise ValueError(f"swap_layers {k} is outside 0..{L} (the model's layers)")
    return tuple(i for i in range(L) if (i + 1) * k // L > i * k // L)


def mlp_tile_tokens(model) -> int:
    """Tokens per MLP tile under offload: the model's hidden size (ALST's rule: a tile's
    intermediates, ``tile x ffn``, are then the size of ``hidden x ffn``, one weight's)."""
    return max(1, int(model.hidden))


def residual_bytes(model, *, autocast: bool = False) -> int:
    """Bytes of one value of the residual stream (a block's input): the compute precision's, or 4
    under autocast (the stream stays fp32 over a bf16 matmul)."""
    return 4 if autocast else int(model.dtype_bytes)


def host_bytes_per_token(model, *, autocast: bool = False) -> float:
    """Host bytes per token of a group at level ``inputs`` (whole model, before dividing over the
    group's ranks): every block's input."""
    return float(model.layers * model.hidden * residual_bytes(model, autocast=autocast))


def offload_saved_bytes_per_token(model, *, autocast: bool = False) -> float:
    """GPU bytes per token (whole model) that level ``inputs`` removes from what recomputation keeps:
    the block inputs of all but two layers (the one in use and the one in flight), and what the tiled
    unit (the MLP's norm and the MLP, ``workbench.runtime.offload``) keeps for one tile instead of
    every token: the MLP's intermediates (gate, up, silu(gate) and their product, ``4 c ffn``) and the
    norm's fp32 input and its normed input and output (``4 h + 2 c h``), ``c`` the compute precision's
    bytes. Measured with the runtime's live-bytes counter (tests/test_offload.py, 6 layers x 2,048
    tokens): 5,173 bytes a token in fp32 against 4,544 here, 3,041 under autocast against 2,912, so
    the plans' figure is the lower (the MLP's backward also holds ffn-wide gradients at its peak)."""
    c = 2 if autocast else int(model.dtype_bytes)
    h = model.hidden
    inputs = max(0, model.layers - 2) * h * residual_bytes(model, autocast=autocast)
    return float(inputs + 4 * c * model.ffn + 4 * h + 2 * c * h)


def tile_working_bytes(model, *, autocast: bool = False) -> float:
    """GPU bytes one tile of the tiled MLP holds at its peak (a tile's intermediates and, in its
    backward, their gradients: ``2 x 4 x ffn`` values per token of the tile). Charged once per
    offloaded sequence, which is at least once per group at level ``inputs``."""
    c = 2 if autocast else int(model.dtype_bytes)
    return float(mlp_tile_tokens(model) * 2 * 4 * c * model.ffn)


def mlp_flop_share(model) -> float:
    """The MLP's share of a block's matmul FLOPs per token (what the tiled MLP's extra forward adds,
    as a share of the block's linear forward time): ``3 h f / (h (q + 2 kv) + q h + 3 h f)``."""
    h, q, kv, f = model.hidden, model.q_dim, model.kv_dim, model.ffn
    mlp = 3.0 * h * f
    return mlp / (h * (q + 2 * kv) + q * h + mlp)


def host_link_gbps(per_gpu: float | None, per_node: float | None, gpus_copying: int) -> float:
    """Host-device bandwidth one GPU gets (GB/s) when ``gpus_copying`` GPUs of its node copy at once:
    its own pinned figure, or its share of the node's when that is lower (0 when unknown)."""
    own = float(per_gpu or 0.0)
    if per_node and gpus_copying > 0:
        share = float(per_node) / gpus_copying
        own = min(own, share) if own else share
    return own


def exposed_copy_ms(copy_ms, forward_ms, backward_ms, layers: int) -> np.ndarray:
    """What the copies add to a step (ms), per sequence: per layer, the device-to-host copy beyond
    the next layer's forward and the host-to-device copy beyond the layer's recomputation and
    backward (``copy_ms``, ``forward_ms``, ``backward_ms`` per layer), times the layers."""
    c = np.asarray(copy_ms, dtype=np.float64)
    return layers * (np.maximum(0.0, c - np.asarray(forward_ms)) + np.maximum(0.0, c - np.asarray(backward_ms)))
