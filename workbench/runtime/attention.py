"""Causal attention on packed variable-length sequences: flash-attn's varlen kernel or PyTorch.

Both backends have the flash-attn shape ``attn(q, k, v, cu_seqlens, max_seqlen) -> out`` with
``q (T, H, hd)``, ``k, v (T, KV, hd)`` (grouped-query: KV divides H) and ``out (T, H, hd)``; every
sequence ``cu_seqlens[i]:cu_seqlens[i+1]`` attends causally to itself only.

The backend is chosen explicitly with ``select_attention("auto" | "flash" | "torch", device)``:
``auto`` takes flash-attn on CUDA when the ``gpu`` extra is installed, else the PyTorch path;
``flash`` where it cannot run is an error, never a silent fallback. flash-attn is imported lazily,
inside ``select_attention``, so importing this module costs nothing on machines without it.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["BACKENDS", "torch_varlen_attention", "select_attention", "AttentionUnavailable"]

BACKENDS = ("auto", "flash", "torch")

log = logging.getLogger(__name__)


class AttentionUnavailable(RuntimeError):
    """The requested attention backend cannot run here (no CUDA, flash-attn not installed...)."""


def torch_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                           max_seqlen: int) -> torch.Tensor:
    """Causal attention per packed sequence with ``F.scaled_dot_product_attention``; runs on any
    device and dtype. KV heads are repeated to the query heads (grouped-query attention)."""
    T, H, hd = q.shape
    kvh = k.shape[1]
    if H % kvh:
        raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({kvh})")
    if kvh != H:
        k = k.repeat_interleave(H // kvh, dim=1)  # (T, H, hd)
        v = v.repeat_interleave(H // kvh, dim=1)  # (T, H, hd)
    bounds = cu_seqlens.tolist()
    if bounds[-1] != T:
        raise ValueError(f"cu_seqlens ends at {bounds[-1]} but the packed tensor has {T} tokens")
    sizes = [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])]
    # one split, not a slice per sequence: the backward of a split is one concatenation (O(T)),
    # while each slice's backward would write a gradient the size of the whole pack (O(sequences x T))
    outs = []
    for qi, ki, vi in zip(q.split(sizes), k.split(sizes), v.split(sizes)):
        if qi.shape[0] == 0:
            continue
        oi = F.scaled_dot_product_attention(qi.transpose(0, 1).unsqueeze(0), ki.transpose(0, 1).unsqueeze(0),
                                            vi.transpose(0, 1).unsqueeze(0), is_causal=True)  # (1, H, s, hd)
        outs.append(oi[0].transpose(0, 1))  # (s, H, hd)
    return torch.cat(outs, dim=0) if outs else q.new_zeros(q.shape)  # (T, H, hd)


def _flash_attention_fn() -> Callable:
    """Import flash-attn's varlen kernel lazily; raises AttentionUnavailable when it is missing."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as e:
        raise AttentionUnavailable(
            f"attention backend 'flash' needs flash-attn (pip install -e '.[gpu]' on a CUDA machine): {e}; "
            f"use --attention torch") from None

    def flash_varlen_attention(q, k, v, cu_seqlens, max_seqlen):
        # flash-attn computes in fp16/bf16 only: fp32 inputs run in bf16 and come back as fp32
        dtype = q.dtype
        if dtype not in (torch.float16, torch.bfloat16):
            q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        out = flash_attn_varlen_func(q, k, v, cu, cu, int(max_seqlen), int(max_seqlen), dropout_p=0.0,
                                     causal=True)  # (T, H, hd)
        return out.to(dtype)

    return flash_varlen_attention


def select_attention(name: str, device: torch.device | str) -> tuple[Callable, str]:
    """The attention callable for backend ``name`` on ``device``: returns ``(fn, resolved_name)``.

    ``auto`` resolves to ``flash`` on CUDA when flash-attn imports, else ``torch``. Raises
    ValueError for an unknown name and AttentionUnavailable when ``flash`` cannot run here.
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    dev = torch.device(device)
    if name == "torch":
        fn, resolved, why = torch_varlen_attention, "torch", "requested"
    elif dev.type != "cuda":
        if name == "flash":
            raise AttentionUnavailable(f"attention backend 'flash' needs a CUDA device, this run is on {dev.type}; "
                                       f"use --attention torch (or auto)")
        fn, resolved, why = torch_varlen_attention, "torch", f"auto on {dev.type}"
    else:
        try:
            fn, resolved, why = _flash_attention_fn(), "flash", name
        except AttentionUnavailable as e:
            if name == "flash":
                raise
            fn, resolved, why = torch_varlen_attention, "torch", f"auto: {e}"
    log.info("attention backend: %s (%s) on %s", resolved, why, dev)
    return fn, resolved
