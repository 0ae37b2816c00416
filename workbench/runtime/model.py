"""A Llama-style decoder on packed variable-length sequences, readable top to bottom.

Order: RMSNorm -> rotary embeddings -> grouped-query attention -> SwiGLU MLP -> block -> model.
Sized by a ``ModelSpec``, which also carries what Hugging Face Llama-family configs vary: q/k/v
biases (Qwen2), the rotary base and Llama 3.1's frequency scaling, the norm epsilon, an explicit
head width, tied embeddings. The arithmetic follows transformers' Llama/Mistral/Qwen2 modules
(rotate-half rotary in fp32, RMSNorm statistics in fp32), so loaded weights give their logits.

The model knows nothing about distribution: attention is a callable handed to ``forward``,
``attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> out`` on packed tensors
``(total_tokens, heads, head_dim)`` (the flash-attn varlen convention; the model passes its one pack's
boundaries as both), so the same module runs single-process attention, Ulysses sequence parallelism
or context parallelism without knowing which. The same holds for how a block runs its MLP: an
optional ``mlp_fn(norm, mlp, x) -> mlp(norm(x))`` (the plain calls when None), by which the runtime
runs some rows' MLP sublayer in tiles of tokens (``workbench.runtime.offload``).

Inputs are packed: token ids ``(T,)`` of several sequences back to back, their true position ids
``(T,)`` (a rank holding the middle slice of a sequence passes that slice's positions), and
``cu_seqlens`` ``(n+1,)`` int32, the cumulative sequence lengths. Rotary angles are computed from
the position ids, so a slice gets exactly the rotations it would get in the whole sequence.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from workbench.runtime.loss import chunked_cross_entropy
from workbench.specs import ModelSpec, RopeScaling

__all__ = ["RMSNorm", "rope_inv_freq", "rotary_cos_sin", "apply_rotary", "Attention", "MLP", "Block", "Head", "Transformer",
           "AttentionFn", "MLPFn", "ROPE_BASE"]

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int], torch.Tensor]
"""``attn(q (Tq, H, hd), k (Tk, KV, hd), v (Tk, KV, hd), cu_seqlens_q (n+1,), cu_seqlens_k (n+1,) int32,
max_seqlen_q, max_seqlen_k) -> (Tq, H, hd)``, causal within each packed segment (bottom-right aligned
where a segment has fewer queries than keys; the model's own call has as many)."""

MLPFn = Callable[[nn.Module, nn.Module, torch.Tensor], torch.Tensor]
"""``mlp_fn(norm, mlp, x (T, C)) -> (T, C)``: how a block runs its MLP sublayer, its ``RMSNorm`` and
``MLP`` modules, on the residual stream's rows; the same function of every row as ``mlp(norm(x))``,
computed another way (in tiles of tokens, say: the norm inside the tile, so that neither its tensors
nor the MLP's exist for the whole sequence)."""

ROPE_BASE = 10000.0


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale (no bias, no mean subtraction)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # at least fp32 for the statistics
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)  # (T, C)
        return xf.type_as(x) * self.weight


def rope_inv_freq(head_dim: int, base: float = ROPE_BASE, scaling: RopeScaling | None = None, *,
                  device: torch.device | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rotary inverse frequencies ``(head_dim // 2,)``: ``base ** (-2i / head_dim)``, and with
    ``scaling`` Llama 3.1's adjustment (low frequencies divided by ``factor``, high ones kept, the
    band between interpolated), computed as transformers does so the angles match bit for bit."""
    half = head_dim // 2
    inv_freq = 1.0 / (base ** (torch.arange(0, half, device=device, dtype=dtype) / half))  # (hd/2,)
    if scaling is None:
        return inv_freq
    old = scaling.original_max_position_embeddings
    low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)  # long waves stretched
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)  # (hd/2,)


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, base: float = ROPE_BASE,
                   dtype: torch.dtype = torch.float32, scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables for explicit position ids: returns ``(cos, sin)``, each ``(T, head_dim // 2)``.

    Computed per token from its position, so the same position gives the same rotation wherever
    the token sits in a packed shard."""
    ft = torch.promote_types(dtype, torch.float32)  # angles in fp32 (fp64 for an fp64 model)
    inv_freq = rope_inv_freq(head_dim, base, scaling, device=positions.device, dtype=ft)  # (hd/2,)
    angles = positions.to(ft)[:, None] * inv_freq[None, :]  # (T, hd/2)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of every head (Llama's rotate-half convention). x: (T, h, hd)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]  # (T, h, hd/2) each
    # in x's dtype (a no-op when the tables were made in it): promoting bf16 q and k to fp32 here
    # would double what attention keeps for backward
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)  # (T, 1, hd/2)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)  # (T, h, hd)


class Attention(nn.Module):
    """Grouped-query self-attention: ``heads`` query heads share ``kv_heads`` key/value heads.
    The attention kernel itself (and any communication around it) is the ``attn`` callable."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = spec.heads, spec.kv_heads, spec.head_dim
        # q/k/v biases for Qwen2; the output projection has none in any supported family
        self.q_proj = nn.Linear(spec.hidden, spec.heads * spec.head_dim, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(spec.hidden, spec.kv_heads * spec.head_dim, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(spec.hidden, spec.kv_heads * spec.head_dim, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(spec.heads * spec.head_dim, spec.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor,
                max_seqlen: int, attn: AttentionFn) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.heads, self.head_dim)  # (T, H, hd)
        k = self.k_proj(x).view(T, self.kv_heads, self.head_dim)  # (T, KV, hd)
        v = self.v_proj(x).view(T, self.kv_heads, self.head_dim)  # (T, KV, hd)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)  # (T, H, hd)
        return self.o_proj(y.reshape(T, self.heads * self.head_dim))  # (T, C)


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate = nn.Linear(spec.hidden, spec.ffn, bias=False)
        self.up = nn.Linear(spec.hidden, spec.ffn, bias=False)
        self.down = nn.Linear(spec.ffn, spec.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))  # (T, C)


class Block(nn.Module):
    """Pre-norm transformer block: attention and MLP, each with a residual."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(spec.hidden, spec.norm_eps)
        self.attn = Attention(spec)
        self.mlp_norm = RMSNorm(spec.hidden, spec.norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor,
                max_seqlen: int, attn: AttentionFn, mlp_fn: MLPFn | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, cu_seqlens, max_seqlen, attn)  # (T, C)
        return x + (self.mlp(self.mlp_norm(x)) if mlp_fn is None else mlp_fn(self.mlp_norm, self.mlp, x))  # (T, C)


class Head(nn.Linear):
    """The output head (``nn.Linear(hidden, vocab, bias=False)``, its weight ``head.weight``), which
    also computes the loss when given the labels: ``forward(x)`` returns logits ``(T, vocab)``;
    ``forward(x, labels)`` the summed cross-entropy of the targets that are not ``ignore_index``
    (fp32 at least), from whole logits upcast to fp32 or, with ``loss_chunk`` set (recomputation
    sets it), chunk by chunk with its gradients made in the forward (``workbench.runtime.loss``).
    ``norm`` (the final ``RMSNorm``) is applied to ``x`` first: with ``loss_chunk`` set inside each
    chunk, so that a token keeps only the gradient of the norm's input rather than the norm's
    tensors and the gradient of the head's input. Called as a module either way, so FSDP's hooks
    gather and release its weight around it, and the norm's with it (they are one FSDP unit): the
    norm module is then not called, its gathered weight gets its gradient from the loss's backward
    as the head's does."""

    loss_chunk: int | None = None
    """Tokens per chunk of the chunked loss; None: the loss from whole logits."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, ignore_index: int = -100, *,
                norm: nn.Module | None = None) -> torch.Tensor:
        if norm is not None and (labels is None or self.loss_chunk is None):
            x, norm = norm(x), None  # (T, C) normed whole: only the chunked loss takes the norm in
        if labels is None:
            return F.linear(x, self.weight)  # (T, vocab)
        if self.loss_chunk is None:
            logits = F.linear(x, self.weight)  # (T, vocab)
            return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), labels,
                                   ignore_index=ignore_index, reduction="sum")
        dev = x.device.type
        # the dtype the head computes in: autocast's, or that of its input (the norm's output)
        dt = (torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev)
              else x.dtype if norm is None else torch.promote_types(x.dtype, norm.weight.dtype))
        if norm is None:
            return chunked_cross_entropy(x.to(dt), self.weight.to(dt), labels, chunk=self.loss_chunk,
                                         ignore_index=ignore_index)
        # the residual stream goes in as it is: each chunk is normed, and cast to dt, inside
        return chunked_cross_entropy(x, self.weight.to(dt), labels, chunk=self.loss_chunk, ignore_index=ignore_index,
                                     norm_weight=norm.weight, norm_eps=norm.eps)


class Transformer(nn.Module):
    """The decoder: embedding, ``spec.layers`` blocks, final norm, output head.

    ``forward(tokens, positions, cu_seqlens, max_seqlen, attn)`` returns logits ``(T, vocab)``;
    with ``labels`` ``(T,)`` (``ignore_index`` where there is no target) the summed token loss
    instead (``Head``: chunked under recomputation, the final norm inside the chunks, so no
    ``(T, vocab)`` tensor is kept, nor the norm's tensors);
    ``mlp_fn`` (``MLPFn``) is handed to every block.
    Weights are initialised from ``seed`` (normal, std 0.02; output projections of each block
    scaled by 1/sqrt(2*layers) as in GPT-2; biases zero), independent of the global RNG, so every
    rank builds the same replica. Pretrained weights come in through ``workbench.runtime.weights``.
    """

    def __init__(self, spec: ModelSpec, *, seed: int = 0, init: bool = True) -> None:
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab, spec.hidden)
        self.blocks = nn.ModuleList(Block(spec) for _ in range(spec.layers))
        self.norm = RMSNorm(spec.hidden, spec.norm_eps)
        self.head = Head(spec.hidden, spec.vocab, bias=False)
        if spec.tied_embeddings:
            self.head.weight = self.embed.weight
        if init:  # init=False: built on the meta device and initialised where it will live (the GPU check)
            self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Initialise every weight from ``seed`` (same seed, same weights, on any rank)."""
        gen = torch.Generator().manual_seed(int(seed))
        out_std = 0.02 / (2 * self.spec.layers) ** 0.5
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()  # draws nothing: the weights of a model without biases are unchanged
            else:
                std = out_std if name.endswith(("o_proj.weight", "down.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor,
                max_seqlen: int, attn: AttentionFn, labels: torch.Tensor | None = None,
                ignore_index: int = -100, mlp_fn: MLPFn | None = None) -> torch.Tensor:
        x = self.embed(tokens)  # (T, C)
        spec = self.spec
        dev = x.device.type
        # the tables in the dtype q and k compute in (bf16 under autocast, where x stays fp32)
        rot = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        cos, sin = rotary_cos_sin(positions, spec.head_dim, spec.rope_theta, dtype=rot,
                                  scaling=spec.rope_scaling)  # (T, hd/2) each
        for block in self.blocks:
            x = block(x, cos, sin, cu_seqlens, max_seqlen, attn, mlp_fn)  # (T, C)
        if labels is None:
            return self.head(self.norm(x))  # (T, vocab)
        if self.head.loss_chunk is not None:  # the chunked loss takes the final norm in (Head)
            return self.head(x, labels, ignore_index, norm=self.norm)  # () summed loss
        return self.head(self.norm(x), labels, ignore_index)  # () summed loss

    def num_params(self) -> int:
        """Distinct parameters (a tied head counted once)."""
        return sum(p.numel() for p in self.parameters())
