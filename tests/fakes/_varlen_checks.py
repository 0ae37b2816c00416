"""A stand-in for the flash kernels torch's ``varlen_attn`` calls, for machines without a GPU.

``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10) is a custom op whose forward calls
``aten::_flash_attention_forward`` and whose backward calls ``aten::_flash_attention_backward``
(torch's vendored flash-attn 2, ``mha_varlen_fwd``/``mha_varlen_bwd``), both CUDA only. While
``installed()`` is active those two ops are replaced by functions that refuse what the real ones
refuse (read from aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp, written here
independently of the workbench), record every call in ``CALLS``, and compute the result with
dense softmax attention written out in fp32: bottom-right causal when ``is_causal`` or the right
window is 0, the gradients from the textbook formulas (dV = P^T dO, dS = P * (dP - rowsum(dO * O)),
dQ = dS K * scale, dK = dS^T Q * scale), KV-head gradients summed over the query heads sharing
them. Everything above the two ops (varlen_attn's own checks, its custom op and autograd
registration) is torch's, and runs for real.
"""

from __future__ import annotations

import contextlib
import math

import torch

CALLS: list[dict] = []


def _check(q, k, v, cu_q, cu_k, max_q, max_k) -> tuple[list[int], list[int]]:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise RuntimeError(f"{name} must be (total, num_heads, head_size)")
        if t.stride(-1) != 1:
            raise RuntimeError("Input tensor must have contiguous last dimension")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise RuntimeError("query and key must have the same dtype")
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32:
            raise RuntimeError(f"{name} must have dtype int32")
        if not cu.is_contiguous():
            raise RuntimeError(f"{name} must be contiguous")
    if len({t.device for t in (q, k, v, cu_q, cu_k)}) != 1:
        raise RuntimeError("q, k, v and cu_seqlens must be on one device")
    for name, m in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
        if type(m) is not int:
            raise TypeError(f"{name} must be int, got {type(m).__name__}")
    batch = cu_q.numel() - 1
    if batch <= 0:
        raise RuntimeError("batch size must be positive")
    Tq, H, hd = q.shape
    if hd > 256:
        raise RuntimeError("FlashAttention forward only supports head dimension at most 256")
    if hd % 8:
        raise RuntimeError("head_size must be a multiple of 8, this is ensured by padding!")
    if H % k.shape[1]:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")
    if k.shape != v.shape or k.shape[2] != hd:
        raise RuntimeError("k and v must have shape (total_k, num_heads_k, head_size)")
    if cu_k.shape != (batch + 1,) or cu_q.shape != (batch + 1,):
        raise RuntimeError("cu_seqlens_q and cu_seqlens_k must have shape (batch_size + 1)")
    bq, bk = cu_q.tolist(), cu_k.tolist()
    if bq[0] != 0 or bk[0] != 0 or bq[-1] != Tq or bk[-1] != k.shape[0] or bq != sorted(bq) or bk != sorted(bk):
        raise RuntimeError("cu_seqlens do not describe the packed tensors")  # the kernel would read out of bounds
    # the kernel sizes its grid by the max lengths: a smaller value than a segment's silently drops rows
    if max(b - a for a, b in zip(bq, bq[1:])) > max_q or max(b - a for a, b in zip(bk, bk[1:])) > max_k:
        raise RuntimeError("a segment is longer than max_seqlen_q / max_seqlen_k")
    return bq, bk


def _probs(qi, ki, scale: float, causal: bool) -> torch.Tensor:
    """(H, sq, sk) fp32 attention probabilities of one segment, bottom-right causal."""
    s = torch.einsum("qhd,khd->hqk", qi.float(), ki.float()) * scale
    sq, sk = qi.shape[0], ki.shape[0]
    if causal:
        allowed = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)  # (sq, sk)
        s = s.masked_fill(~allowed, float("-inf"))
    return s.softmax(-1)


def flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                            return_debug_mask=False, *, scale=None, window_size_left=None, window_size_right=None,
                            seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None):
    bq, bk = _check(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k)
    if dropout_p != 0.0 or seqused_k is not None or block_table is not None or alibi_slopes is not None:
        raise RuntimeError("the stand-in implements dropout-free attention without a KV cache only")
    causal = bool(is_causal) or window_size_right == 0
    if window_size_left not in (None, -1) or window_size_right not in (None, -1, 0):
        raise RuntimeError("the stand-in implements causal or full attention only")
    CALLS.append({"op": "forward", "dtype": query.dtype, "q_shape": tuple(query.shape), "kv_heads": key.shape[1],
                  "is_causal": bool(is_causal), "window": (window_size_left, window_size_right), "cu_q": bq,
                  "cu_k": bk, "max": (max_q, max_k)})
    Tq, H, hd = query.shape
    rep = H // key.shape[1]
    sc = scale if scale is not None else 1.0 / math.sqrt(hd)
    out = torch.zeros(Tq, H, hd, dtype=torch.float32)
    lse = torch.zeros(H, Tq, dtype=torch.float32)
    for (a, b), (c, d) in zip(zip(bq, bq[1:]), zip(bk, bk[1:])):
        if b == a:
            continue
        ki, vi = key[c:d].repeat_interleave(rep, dim=1), value[c:d].repeat_interleave(rep, dim=1)
        p = _probs(query[a:b], ki, sc, causal)
        out[a:b] = torch.einsum("hqk,khd->qhd", p, vi.float())
    return (out.to(query.dtype), lse, torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64),
            torch.empty(0, dtype=query.dtype))


def flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                             dropout_p, is_causal, philox_seed, philox_offset, *, scale=None, window_size_left=None,
                             window_size_right=None):
    bq, bk = _check(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k)
    if grad_out.dtype != query.dtype or out.dtype != query.dtype:
        raise RuntimeError("query and dout must have the same dtype")
    if grad_out.stride(-1) != 1 or out.stride(-1) != 1:
        raise RuntimeError("dout tensor must have contiguous last dimension")
    causal = bool(is_causal) or window_size_right == 0
    CALLS.append({"op": "backward", "dtype": query.dtype, "q_shape": tuple(query.shape), "cu_q": bq, "cu_k": bk})
    Tq, H, hd = query.shape
    kvh = key.shape[1]
    rep = H // kvh
    sc = scale if scale is not None else 1.0 / math.sqrt(hd)
    dq = torch.zeros(Tq, H, hd)
    dk = torch.zeros(key.shape[0], H, hd)
    dv = torch.zeros(key.shape[0], H, hd)
    for (a, b), (c, d) in zip(zip(bq, bq[1:]), zip(bk, bk[1:])):
        if b == a:
            continue
        qi = query[a:b].float()
        ki, vi = key[c:d].repeat_interleave(rep, dim=1).float(), value[c:d].repeat_interleave(rep, dim=1).float()
        p = _probs(qi, ki, sc, causal)  # (H, sq, sk)
        go = grad_out[a:b].float()  # (sq, H, hd)
        o = torch.einsum("hqk,khd->qhd", p, vi)
        dv[c:d] = torch.einsum("hqk,qhd->khd", p, go)
        dp = torch.einsum("qhd,khd->hqk", go, vi)
        ds = p * (dp - (go * o).sum(-1).transpose(0, 1)[:, :, None])
        dq[a:b] = torch.einsum("hqk,khd->qhd", ds, ki) * sc
        dk[c:d] = torch.einsum("hqk,qhd->khd", ds, qi) * sc
    fold = (key.shape[0], kvh, rep, hd)  # the query heads sharing a KV head sum into it
    return (dq.to(query.dtype), dk.reshape(fold).sum(2).to(key.dtype), dv.reshape(fold).sum(2).to(value.dtype))


@contextlib.contextmanager
def installed():
    """The stand-ins in place of torch's two flash ops (and torch told its flash kernels exist),
    restored on exit."""
    import torch.nn.attention.varlen  # noqa: F401 - first: importing it registers flop formulas on the real ops

    aten = torch.ops.aten
    saved = (aten._flash_attention_forward, aten._flash_attention_backward,
             torch.backends.cuda.is_flash_attention_available)
    aten._flash_attention_forward = flash_attention_forward
    aten._flash_attention_backward = flash_attention_backward
    torch.backends.cuda.is_flash_attention_available = lambda: True
    try:
        yield CALLS
    finally:
        aten._flash_attention_forward, aten._flash_attention_backward = saved[:2]
        torch.backends.cuda.is_flash_attention_available = saved[2]
