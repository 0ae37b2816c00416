"""Causal attention on packed variable-length sequences: flash-attn's varlen kernel or PyTorch.

Both backends have the flash-attn shape ``attn(q, k, v, cu_seqlens, max_seqlen) -> out`` with
``q (T, H, hd)``, ``k, v (T, KV, hd)`` (grouped-query: KV divides H) and ``out (T, H, hd)``; every
sequence ``cu_seqlens[i]:cu_seqlens[i+1]`` attends causally to itself only.

The backend is chosen explicitly with ``select_attention("auto" | "flash" | "torch", device)``:
``auto`` takes flash-attn on CUDA when it is installed (2.x as ``flash_attn``, or 3.x as
``flash_attn_interface``) and the run computes in bf16, else the PyTorch path; ``flash`` where it
cannot run is an error, never a silent fallback. flash-attn is imported lazily, inside
``select_attention``, so importing this module costs nothing on machines without it. Every call is
checked against what the kernel requires (``flash_call_problem``, read from flash-attn 2.8's
``mha_varlen_fwd`` and 3.x's ``flash_attn_interface``) before it is made.
"""

from __future__ import annotations

import importlib
import logging
from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["BACKENDS", "torch_varlen_attention", "select_attention", "AttentionUnavailable", "flash_call_problem",
           "flash_version", "FLASH_HALF"]

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


FLASH_HALF = (torch.float16, torch.bfloat16)
"""The dtypes flash-attn's kernels compute in (``mha_varlen_fwd`` refuses any other)."""
FLASH_MAX_HEAD_DIM = 256
"""The largest head dimension flash-attn 2.x and 3.x support."""


def _import_flash_varlen() -> tuple[Callable, str]:
    """flash-attn's varlen kernel and where it came from: ``flash_attn`` (2.x) first, else
    ``flash_attn_interface`` (3.x, Hopper). Raises AttentionUnavailable when neither imports."""
    errors = []
    for module in ("flash_attn", "flash_attn_interface"):
        try:
            mod = importlib.import_module(module)
            fn = mod.flash_attn_varlen_func
        except (ImportError, AttributeError) as e:  # a broken build raises ImportError from its CUDA extension
            errors.append(f"{module}: {e}")
            continue
        return fn, f"{module} {getattr(mod, '__version__', '?')}"
    raise AttentionUnavailable(
        f"attention backend 'flash' needs flash-attn (`make install` on a CUDA machine fetches a prebuilt wheel; "
        f"see docs/gpu-and-clusters.md): {'; '.join(errors)}; use --attention torch")


def flash_call_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                       max_seqlen) -> str | None:
    """Why flash-attn's varlen kernel would refuse this call (as ``mha_varlen_fwd`` checks it in
    flash-attn 2.x and 3.x), or None: q (T, H, hd), k and v (T, KV, hd) of one fp16/bf16 dtype on
    one device with a contiguous last dimension, KV dividing H, hd at most 256 and a multiple of 8;
    ``cu_seqlens`` int32, contiguous, on that device, at least two entries; ``max_seqlen`` a Python
    int (the kernel's schema takes ``int``, not a tensor)."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        return f"q, k, v must be (tokens, heads, head_dim); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
    if q.dtype not in FLASH_HALF:
        return f"flash-attn computes in fp16/bf16 only; q is {q.dtype}"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return f"q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}"
    devs = {t.device for t in (q, k, v, cu_seqlens)}
    if len(devs) != 1:
        return f"q, k, v and cu_seqlens must be on one device; got {sorted(str(d) for d in devs)}"
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        return "q, k, v must have a contiguous last dimension"
    T, H, hd = q.shape
    if k.shape[0] != T or v.shape != k.shape or k.shape[2] != hd:
        return f"k and v must be ({T}, KV, {hd}); got {tuple(k.shape)} and {tuple(v.shape)}"
    if H % k.shape[1]:
        return f"the key/value heads ({k.shape[1]}) must divide the query heads ({H})"
    if hd > FLASH_MAX_HEAD_DIM or hd % 8:
        return f"head dimension {hd} is not supported (at most {FLASH_MAX_HEAD_DIM}, a multiple of 8)"
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or not cu_seqlens.is_contiguous():
        return f"cu_seqlens must be a contiguous 1-D int32 tensor; got {cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}"
    if cu_seqlens.numel() < 2:
        return "cu_seqlens must hold at least one sequence (two boundaries)"
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
        return f"max_seqlen must be a Python int, got {type(max_seqlen).__name__}"
    return None


def flash_attention_fn(precision: str | None = None) -> Callable:
    """flash-attn's varlen kernel as an attention callable (lazy import; raises
    AttentionUnavailable when it is missing).

    With a ``precision`` the run declared (``bf16``), inputs must already be fp16/bf16: a call
    with anything else is a bug that raises, never a silent cast. Without one (callers that
    measure an fp32 model, the profiler) fp32 inputs run in bf16 and come back as fp32."""
    varlen, _ = _import_flash_varlen()

    def flash_varlen_attention(q, k, v, cu_seqlens, max_seqlen):
        dtype = q.dtype
        if precision is None and dtype not in FLASH_HALF:
            q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
        # what the kernel checks: contiguous (T, H, hd) tensors (a no-op for the model's and
        # Ulysses' own), int32 boundaries on q's device, Python ints for the max lengths
        q, k, v = (t.contiguous() for t in (q, k, v))
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32).contiguous()
        mx = int(max_seqlen)
        problem = flash_call_problem(q, k, v, cu, mx)
        if problem is not None:
            raise ValueError(f"flash-attn cannot run this call: {problem}")
        out = varlen(q, k, v, cu, cu, mx, mx, causal=True)  # (T, H, hd); 3.x may return (out, lse)
        if isinstance(out, tuple):
            out = out[0]
        return out.to(dtype)

    return flash_varlen_attention


def flash_version() -> str | None:
    """``"flash_attn 2.8.3"`` (the module and version that would run), or None when flash-attn
    does not import here."""
    try:
        return _import_flash_varlen()[1]
    except AttentionUnavailable:
        return None


def select_attention(name: str, device: torch.device | str, precision: str | None = None) -> tuple[Callable, str]:
    """The attention callable for backend ``name`` on ``device``: returns ``(fn, resolved_name)``.

    ``auto`` resolves to ``flash`` on CUDA when flash-attn imports (and ``precision`` is not
    ``fp32``), else ``torch``. ``precision`` is the run's (``bf16``/``fp32``; None: not declared):
    flash-attn computes in half precision only, so an fp32 run never gets it silently. Raises
    ValueError for an unknown name and AttentionUnavailable when ``flash`` cannot run here (no
    CUDA, no flash-attn, an fp32 run).
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    dev = torch.device(device)
    if name == "torch":
        fn, resolved, why = torch_varlen_attention, "torch", "requested"
    elif precision == "fp32":
        if name == "flash":
            raise AttentionUnavailable("attention backend 'flash' computes in fp16/bf16 but this run's precision is fp32; "
                                       "use --precision bf16, or --attention torch (or auto)")
        fn, resolved, why = torch_varlen_attention, "torch", "auto: the run computes in fp32"
    elif dev.type != "cuda":
        if name == "flash":
            raise AttentionUnavailable(f"attention backend 'flash' needs a CUDA device, this run is on {dev.type}; "
                                       f"use --attention torch (or auto)")
        fn, resolved, why = torch_varlen_attention, "torch", f"auto on {dev.type}"
    else:
        try:
            fn, resolved, why = flash_attention_fn(precision), "flash", name
        except AttentionUnavailable as e:
            if name == "flash":
                raise
            fn, resolved, why = torch_varlen_attention, "torch", f"auto: {e}"
    log.info("attention backend: %s (%s) on %s", resolved, why, dev)
    return fn, resolved
