"""What flash-attn's varlen kernel requires of a call, written independently of the workbench
(read from flash-attn 2.8's ``mha_varlen_fwd`` in csrc/flash_attn/flash_api.cpp and 3.x's
hopper/flash_attn_interface.py), and the reference computation the stand-ins return: causal is
bottom-right aligned (flash-attn >= 2.1: a segment's queries are the last rows of its keys)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

CALLS: list[dict] = []


def check_and_compute(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise RuntimeError(f"{name} must be a 3-D tensor (total, heads, head_dim)")
        if not t.is_contiguous():
            raise RuntimeError(f"{name}: input tensor must be contiguous")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise RuntimeError("query and key/value must have the same dtype")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32:
            raise RuntimeError(f"{name} must have dtype int32")
        if cu.dim() != 1 or not cu.is_contiguous():
            raise RuntimeError(f"{name} must be a contiguous 1-D tensor")
    if len({t.device for t in (q, k, v, cu_seqlens_q, cu_seqlens_k)}) != 1:
        raise RuntimeError("Tensor must be on the same device (q, k, v, cu_seqlens)")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if type(m) is not int:
            raise TypeError(f"{name} must be int, got {type(m).__name__}")
    T, H, hd = q.shape
    batch = cu_seqlens_q.numel() - 1
    if batch <= 0:
        raise RuntimeError("batch size must be positive")
    if hd > 256 or hd % 8:
        raise RuntimeError("head dimension must be at most 256 and a multiple of 8")
    if H % k.shape[1]:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")
    if k.shape != v.shape or k.shape[2] != hd:
        raise RuntimeError("k and v must be (total_k, heads_k, head_dim)")
    bq, bk = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if len(bk) != len(bq):
        raise RuntimeError("cu_seqlens_k must have shape (batch_size + 1)")
    if bq[-1] != T or bk[-1] != k.shape[0] or bq != sorted(bq) or bk != sorted(bk):
        raise RuntimeError("cu_seqlens do not describe the packed tensors")
    # the kernel sizes its grid by the max lengths: a smaller value than a segment's silently drops rows
    if max(b - a for a, b in zip(bq, bq[1:])) > max_seqlen_q:
        raise RuntimeError("a sequence is longer than max_seqlen_q")
    if max(b - a for a, b in zip(bk, bk[1:])) > max_seqlen_k:
        raise RuntimeError("a key sequence is longer than max_seqlen_k")
    CALLS.append({"dtype": q.dtype, "shape": tuple(q.shape), "kv_heads": k.shape[1], "causal": causal,
                  "cu": bq, "cu_k": bk, "max_seqlen": (max_seqlen_q, max_seqlen_k), "device": q.device})
    rep = H // k.shape[1]
    out = torch.zeros_like(q)
    for (a, b), (c, d) in zip(zip(bq, bq[1:]), zip(bk, bk[1:])):
        if b == a:
            continue
        qi = q[a:b].transpose(0, 1)  # (H, sq, hd)
        ki = k[c:d].repeat_interleave(rep, dim=1).transpose(0, 1)  # (H, sk, hd)
        vi = v[c:d].repeat_interleave(rep, dim=1).transpose(0, 1)  # (H, sk, hd)
        sq, sk = b - a, d - c
        # bottom-right: query r of sq sees keys 0 .. sk - sq + r
        mask = (torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)) if causal else None
        out[a:b] = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=softmax_scale).transpose(0, 1)
    lse = torch.zeros(H, T, dtype=torch.float32, device=q.device)
    return out, lse
