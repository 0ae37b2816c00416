"""Causal attention on packed variable-length sequences: PyTorch's varlen kernel, flash-attn, or SDPA.

Every backend is a *kernel* with flash-attn's varlen shape

    attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> out

``q (Tq, H, hd)``, ``k, v (Tk, KV, hd)`` (grouped-query: KV divides H), ``out (Tq, H, hd)``; query
segment ``i`` (rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``) attends to key segment ``i`` causally
with **bottom-right alignment**: its queries are the *last* rows of their key range, so query row
``r`` of a segment of ``sq`` queries and ``sk >= sq`` keys sees keys ``0 .. sk - sq + r``. With
``sq == sk`` that is ordinary causal self-attention, which is how the model calls it (the same
pack and boundaries twice); context parallelism calls it with a sequence's local chunk as queries
and the prefix of the sequence up to that chunk's end as keys.

The backend is chosen explicitly with ``select_attention("auto" | "varlen" | "flash" | "torch", device)``:

- ``torch``: ``F.scaled_dot_product_attention`` per sequence (a lower-right causal mask where the
  queries are shorter than the keys); any device and dtype, the reference the others are checked against.
- ``varlen``: PyTorch's own ``torch.nn.attention.varlen.varlen_attn`` (CUDA, fp16/bf16, flash
  kernels built into torch since 2.10; GQA with ``enable_gqa``, causal with ``window_size=(-1, 0)``).
- ``flash``: flash-attn's ``flash_attn_varlen_func`` (2.x as ``flash_attn`` or 3.x as
  ``flash_attn_interface``; ``causal=True`` is bottom-right since flash-attn 2.1).
- ``auto``: on CUDA in half precision ``varlen`` when this torch has it, else ``flash`` when it is
  installed, else ``torch``; ``torch`` on every other device and in fp32. Where it resolves to
  ``varlen`` it chooses per call (resolved name ``varlen+sdpa``): SDPA per sequence on the flash
  backend for a call of few long sequences, ``varlen_attn`` for packed short ones, by the crossover
  measured on an H200 (``choose_kernel``, ``KernelCrossover``). Both give the same result; the
  choice is only about speed.

A backend asked for by name where it cannot run is an error, never a silent fallback. flash-attn
and the varlen module are imported lazily, inside ``select_attention``, so importing this module
costs nothing. Every call is checked against what the kernel requires (``varlen_call_problem``,
``flash_call_problem``) before it is made.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["BACKENDS", "torch_varlen_attention", "select_attention", "AttentionUnavailable", "flash_call_problem",
           "varlen_call_problem", "flash_version", "varlen_version", "varlen_attention_fn", "FLASH_HALF", "CAUSAL_WINDOW",
           "KernelCrossover", "H200_CROSSOVER", "choose_kernel", "sdpa_call_problem", "sdpa_attention_fn",
           "per_call_attention", "AUTO_PER_CALL"]

BACKENDS = ("auto", "varlen", "flash", "torch")

log = logging.getLogger(__name__)


class AttentionUnavailable(RuntimeError):
    """The requested attention backend cannot run here (no CUDA, flash-attn not installed...)."""


def _bounds(cu: torch.Tensor, total: int, what: str) -> list[int]:
    bounds = cu.tolist()
    if not bounds or bounds[-1] != total:
        raise ValueError(f"cu_seqlens_{what} ends at {bounds[-1] if bounds else None} but the packed tensor has "
                         f"{total} tokens")
    return bounds


def torch_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int) -> torch.Tensor:
    """Causal attention per packed segment with ``F.scaled_dot_product_attention`` (bottom-right
    aligned where a segment has fewer queries than keys); runs on any device and dtype. KV heads are
    repeated to the query heads (grouped-query attention). Returns ``(Tq, H, hd)``. Raises
    ValueError when the heads do not divide, the boundaries do not describe the packs, or a segment
    has more queries than keys."""
    Tq, H, hd = q.shape
    kvh = k.shape[1]
    if H % kvh:
        raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({kvh})")
    if kvh != H:
        k = k.repeat_interleave(H // kvh, dim=1)  # (Tk, H, hd)
        v = v.repeat_interleave(H // kvh, dim=1)  # (Tk, H, hd)
    outs = []
    for args, n, m in _segments(q, k, v, cu_seqlens_q, cu_seqlens_k):
        if n == m:
            oi = F.scaled_dot_product_attention(*args, is_causal=True)  # (1, H, n, hd)
        else:  # the queries are the last n of the m positions: query r sees keys 0 .. m - n + r
            mask = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)  # (n, m)
            oi = F.scaled_dot_product_attention(*args, attn_mask=mask)  # (1, H, n, hd)
        outs.append(oi[0].transpose(0, 1))  # (n, H, hd)
    return torch.cat(outs, dim=0) if outs else q.new_zeros(q.shape)  # (Tq, H, hd)


def _segments(q, k, v, cu_seqlens_q, cu_seqlens_k):
    """Every packed segment with queries, as SDPA takes it: ``(args, n, m)`` with ``args`` the
    segment's q, k, v as ``(1, H, n or m, hd)`` and ``n``, ``m`` its query and key counts. Raises
    ValueError when the boundaries do not describe the packs or a segment has more queries than keys."""
    bq = _bounds(cu_seqlens_q, q.shape[0], "q")  # one read of the boundaries: the split needs them on the host
    bk = bq if cu_seqlens_k is cu_seqlens_q else _bounds(cu_seqlens_k, k.shape[0], "k")
    if len(bk) != len(bq):
        raise ValueError(f"cu_seqlens_q has {len(bq) - 1} segments but cu_seqlens_k {len(bk) - 1}")
    sq = [hi - lo for lo, hi in zip(bq[:-1], bq[1:])]
    sk = [hi - lo for lo, hi in zip(bk[:-1], bk[1:])]
    # one split, not a slice per sequence: the backward of a split is one concatenation (O(T)),
    # while each slice's backward would write a gradient the size of the whole pack (O(sequences x T))
    for qi, ki, vi in zip(q.split(sq), k.split(sk), v.split(sk)):
        n, m = qi.shape[0], ki.shape[0]
        if n == 0:
            continue
        if n > m:
            raise ValueError(f"a segment has {n} queries but only {m} keys (bottom-right causal needs queries <= keys)")
        yield (qi.transpose(0, 1).unsqueeze(0), ki.transpose(0, 1).unsqueeze(0), vi.transpose(0, 1).unsqueeze(0)), n, m


FLASH_HALF = (torch.float16, torch.bfloat16)
"""The dtypes the flash kernels compute in (``mha_varlen_fwd`` refuses any other)."""
FLASH_MAX_HEAD_DIM = 256
"""The largest head dimension flash-attn 2.x/3.x and PyTorch's vendored flash kernels support."""
CAUSAL_WINDOW = (-1, 0)
"""``varlen_attn``'s causal window: unlimited to the left, nothing to the right (bottom-right aligned)."""
VARLEN_MIN_TORCH = "2.10"
"""The first torch with ``torch.nn.attention.varlen.varlen_attn``."""


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
        f"see docs/gpu-and-clusters.md): {'; '.join(errors)}; use --attention varlen or torch")


def _import_varlen() -> Callable:
    """``torch.nn.attention.varlen.varlen_attn``. Raises AttentionUnavailable when this torch lacks it
    or was built without its flash kernels."""
    try:
        fn = importlib.import_module("torch.nn.attention.varlen").varlen_attn
    except (ImportError, AttributeError):
        raise AttentionUnavailable(f"attention backend 'varlen' needs torch >= {VARLEN_MIN_TORCH} "
                                   f"(torch.nn.attention.varlen); this is torch {torch.__version__}: "
                                   f"upgrade torch, or use --attention flash or torch") from None
    if not torch.backends.cuda.is_flash_attention_available():
        raise AttentionUnavailable(f"attention backend 'varlen' needs torch's flash kernels, which this build of "
                                   f"torch {torch.__version__} lacks; use --attention flash or torch")
    return fn


def _kernel_call_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> str | None:
    """What both flash kernels (flash-attn's and torch's vendored copy, ``mha_varlen_fwd``) check."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        return f"q, k, v must be (tokens, heads, head_dim); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
    if q.dtype not in FLASH_HALF:
        return f"the flash kernels compute in fp16/bf16 only; q is {q.dtype}"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return f"q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}"
    devs = {t.device for t in (q, k, v, cu_seqlens_q, cu_seqlens_k)}
    if len(devs) != 1:
        return f"q, k, v and cu_seqlens must be on one device; got {sorted(str(d) for d in devs)}"
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        return "q, k, v must have a contiguous last dimension"
    Tq, H, hd = q.shape
    if v.shape != k.shape or k.shape[2] != hd:
        return f"k and v must be (Tk, KV, {hd}) alike; got {tuple(k.shape)} and {tuple(v.shape)}"
    if H % k.shape[1]:
        return f"the key/value heads ({k.shape[1]}) must divide the query heads ({H})"
    if hd > FLASH_MAX_HEAD_DIM or hd % 8:
        return f"head dimension {hd} is not supported (at most {FLASH_MAX_HEAD_DIM}, a multiple of 8)"
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1 or not cu.is_contiguous():
            return f"{name} must be a contiguous 1-D int32 tensor; got {cu.dtype} of shape {tuple(cu.shape)}"
    if cu_seqlens_q.numel() < 2:
        return "cu_seqlens must hold at least one sequence (two boundaries)"
    if cu_seqlens_k.numel() != cu_seqlens_q.numel():
        return f"cu_seqlens_q and cu_seqlens_k must have one length; got {cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}"
    for name, mx in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(mx, bool) or not isinstance(mx, int):
            return f"{name} must be a Python int, got {type(mx).__name__}"
    return None


def flash_call_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                       cu_seqlens_k: torch.Tensor, max_seqlen_q, max_seqlen_k) -> str | None:
    """Why flash-attn's varlen kernel would refuse this call (as ``mha_varlen_fwd`` checks it in
    flash-attn 2.x and 3.x), or None: q (Tq, H, hd), k and v (Tk, KV, hd) of one fp16/bf16 dtype on
    one device with a contiguous last dimension, KV dividing H, hd at most 256 and a multiple of 8;
    ``cu_seqlens_q/k`` int32, contiguous, on that device, of one length (at least two entries);
    ``max_seqlen_q/k`` Python ints (the kernel's schema takes ``int``, not a tensor)."""
    return _kernel_call_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)


def varlen_call_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        cu_seqlens_k: torch.Tensor, max_seqlen_q, max_seqlen_k, *, enable_gqa: bool,
                        window_size) -> str | None:
    """Why ``torch.nn.attention.varlen.varlen_attn`` would refuse this causal call, or silently
    compute something else, or None. Read from torch's ``varlen.py`` and the vendored
    ``mha_varlen_fwd`` it calls (``aten::_flash_attention_forward``): everything
    ``flash_call_problem`` checks, and ``enable_gqa`` exactly when the KV heads are fewer than the
    query heads (``varlen_attn`` raises without it), and ``window_size`` the tuple ``(-1, 0)``
    (``varlen_attn`` compares with that tuple to set ``is_causal``: anything else, a list
    included, is not the causal call)."""
    problem = _kernel_call_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if problem is not None:
        return problem
    if q.shape[1] != k.shape[1] and not enable_gqa:
        return f"{q.shape[1]} query heads over {k.shape[1]} KV heads need enable_gqa=True"
    if not (isinstance(window_size, tuple) and window_size == CAUSAL_WINDOW):
        return f"the causal call takes window_size={CAUSAL_WINDOW} (a tuple), got {window_size!r}"
    return None


def _half_inputs(precision: str | None, q, k, v):
    """The inputs as the flash kernels take them: contiguous, fp16/bf16. With a ``precision`` the run
    declared, inputs must already be half precision (a call with anything else is a bug the
    pre-check refuses, never a silent cast); without one (callers that measure an fp32 model, the
    profiler) fp32 inputs run in bf16 and the output comes back in their dtype."""
    if precision is None and q.dtype not in FLASH_HALF:
        q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    return tuple(t.contiguous() for t in (q, k, v))


def flash_attention_fn(precision: str | None = None) -> Callable:
    """flash-attn's varlen kernel as an attention kernel (lazy import; raises AttentionUnavailable
    when it is missing). ``precision`` as in ``_half_inputs``."""
    varlen, _ = _import_flash_varlen()

    def flash_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        dtype = q.dtype
        # what the kernel checks: contiguous (T, H, hd) tensors (a no-op for the model's, Ulysses'
        # and context parallelism's own), int32 boundaries on q's device, Python ints for the max lengths
        q, k, v = _half_inputs(precision, q, k, v)
        cu_q = cu_seqlens_q.to(device=q.device, dtype=torch.int32).contiguous()
        cu_k = cu_q if cu_seqlens_k is cu_seqlens_q else cu_seqlens_k.to(device=q.device, dtype=torch.int32).contiguous()
        mq, mk = int(max_seqlen_q), int(max_seqlen_k)
        problem = flash_call_problem(q, k, v, cu_q, cu_k, mq, mk)
        if problem is not None:
            raise ValueError(f"flash-attn cannot run this call: {problem}")
        out = varlen(q, k, v, cu_q, cu_k, mq, mk, causal=True)  # (Tq, H, hd); 3.x may return (out, lse)
        if isinstance(out, tuple):
            out = out[0]
        return out.to(dtype)

    return flash_varlen_attention


def varlen_keywords(fn: Callable) -> tuple[dict, bool, str]:
    """How this torch's ``varlen_attn`` is asked for causal attention, read from its signature (its
    keywords changed between releases): ``window_size=(-1, 0)`` (2.11 and later) or
    ``is_causal=True`` (2.10); and whether it takes ``enable_gqa`` (2.12 and later; before, K and V
    are repeated to the query heads). Returns ``(causal keywords, has enable_gqa, a note)``. Raises
    AttentionUnavailable for a signature with neither causal keyword."""
    params = inspect.signature(fn).parameters
    if "window_size" in params:
        causal = {"window_size": CAUSAL_WINDOW}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        raise AttentionUnavailable(f"varlen_attn of torch {torch.__version__} takes neither window_size nor "
                                   f"is_causal; use --attention flash or torch")
    gqa = "enable_gqa" in params
    note = ", ".join([f"{k}={v}" for k, v in causal.items()] + ["enable_gqa" if gqa else "KV heads repeated"])
    return causal, gqa, note


def varlen_attention_fn(precision: str | None = None) -> Callable:
    """PyTorch's ``varlen_attn`` as an attention kernel, whatever its release's keywords
    (``varlen_keywords``); raises AttentionUnavailable when this torch lacks it. ``precision`` as in
    ``_half_inputs``."""
    _import_varlen()

    def torch_flash_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        # looked up at call time, so a stand-in installed after selection is the one called
        varlen = importlib.import_module("torch.nn.attention.varlen").varlen_attn
        causal, has_gqa, _ = varlen_keywords(varlen)
        dtype = q.dtype
        q, k, v = _half_inputs(precision, q, k, v)
        gqa = k.shape[1] != q.shape[1]
        if gqa and not has_gqa:  # an older release: one KV head per query head
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1).contiguous()  # (Tk, H, hd)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1).contiguous()  # (Tk, H, hd)
            gqa = False
        cu_q = cu_seqlens_q.to(device=q.device, dtype=torch.int32).contiguous()
        cu_k = cu_q if cu_seqlens_k is cu_seqlens_q else cu_seqlens_k.to(device=q.device, dtype=torch.int32).contiguous()
        mq, mk = int(max_seqlen_q), int(max_seqlen_k)
        problem = varlen_call_problem(q, k, v, cu_q, cu_k, mq, mk, enable_gqa=gqa,
                                      window_size=causal.get("window_size", CAUSAL_WINDOW))
        if problem is not None:
            raise ValueError(f"varlen_attn cannot run this call: {problem}")
        kw = dict(causal, **({"enable_gqa": gqa} if has_gqa else {}))
        out = varlen(q, k, v, cu_q, cu_k, mq, mk, **kw)  # (Tq, H, hd)
        if isinstance(out, tuple):
            out = out[0]
        return out.to(dtype)

    return torch_flash_varlen_attention


# ------------------------------------------------------------------------------------------------
# auto on CUDA: the kernel chosen per call
# ------------------------------------------------------------------------------------------------

AUTO_PER_CALL = "varlen+sdpa"
"""The resolved name of ``auto`` where it chooses per call between ``varlen_attn`` and SDPA per sequence."""


@dataclass(frozen=True, kw_only=True, slots=True)
class KernelCrossover:
    """Where SDPA per sequence and ``varlen_attn`` cross, from two measured rows (forward+backward ms).

    The cost model behind it, per call: SDPA per sequence pays ``per_sequence_ms`` for every
    sequence (its launches, splits and the concatenation, forward and backward) and ``varlen_attn``
    pays ``quadratic_gap_ms_per_token2`` more for every causal query-key pair (its kernel was
    about 1.6x slower per FLOP on long sequences). So SDPA is faster exactly when
    ``quadratic_gap x sum(s^2) > per_sequence_ms x sequences``, i.e. when the sequences' mean square
    length exceeds ``crossover_length^2``. The gap scales with the work per token (heads x head_dim);
    the per-sequence cost does not."""

    source: str
    """Where the figures were measured."""
    heads: int
    """Query heads of the measured calls."""
    head_dim: int
    """Head dimension of the measured calls."""
    long_tokens: int
    """The one-sequence row: its length."""
    long_sdpa_ms: float
    """The one-sequence row: SDPA per sequence, forward+backward."""
    long_varlen_ms: float
    """The one-sequence row: ``varlen_attn``, forward+backward."""
    packed_tokens: int
    """The packed-documents row: its tokens."""
    packed_doc_len: int
    """The packed-documents row: each document's length."""
    packed_sdpa_ms: float
    """The packed-documents row: SDPA per sequence, forward+backward."""
    packed_varlen_ms: float
    """The packed-documents row: ``varlen_attn``, forward+backward."""

    @property
    def quadratic_gap_ms_per_token2(self) -> float:
        """varlen's extra ms per token^2 of one sequence: (long varlen - long SDPA) / long_tokens^2."""
        return (self.long_varlen_ms - self.long_sdpa_ms) / self.long_tokens ** 2

    @property
    def per_sequence_ms(self) -> float:
        """SDPA's extra ms per sequence: the packed row's loss per document plus the quadratic gap the
        document would have saved it."""
        docs = self.packed_tokens // self.packed_doc_len
        return ((self.packed_sdpa_ms - self.packed_varlen_ms) / docs
                + self.quadratic_gap_ms_per_token2 * self.packed_doc_len ** 2)

    @property
    def crossover_length(self) -> float:
        """The root-mean-square sequence length above which SDPA per sequence is faster (at the
        measured heads x head_dim): sqrt(per_sequence_ms / quadratic_gap)."""
        return math.sqrt(self.per_sequence_ms / self.quadratic_gap_ms_per_token2)


H200_CROSSOVER = KernelCrossover(
    source="docs/gpu-results.md, run 2 (one H200, torch 2.11.0+cu130, bf16, 2026-11-26): the attention part's "
           "131,072-token rows, one sequence and 1,024-token documents",
    heads=32, head_dim=128, long_tokens=131_072, long_sdpa_ms=918.4, long_varlen_ms=1503.5,
    packed_tokens=131_072, packed_doc_len=1024, packed_sdpa_ms=35.3, packed_varlen_ms=20.8)
"""The crossover ``auto`` uses on CUDA: a gap of 3.41e-8 ms per token^2 and 0.149 ms per sequence,
so SDPA per sequence wins above a root-mean-square length of about 2,092 tokens (32 heads of 128).
From the two 131K rows alone it predicts the sign of every one of the twelve measured differences
(4K to 128K tokens, one sequence and 1K documents), and the size of most within 25%."""


def choose_kernel(num_sequences: int, max_seqlen: int, total_tokens: int, *, heads: int = 32, head_dim: int = 128,
                  crossover: KernelCrossover = H200_CROSSOVER) -> str:
    """``"sdpa"`` (per sequence) or ``"varlen"`` for a causal call of ``num_sequences`` packed
    sequences, the longest ``max_seqlen``, ``total_tokens`` in all, with ``heads`` x ``head_dim``
    query work per token. Uses only what the call knows without reading its boundaries from the
    device: the sum of squared lengths is at least ``max^2 + (total - max)^2 / (n - 1)`` (the rest
    spread evenly), and SDPA is chosen only when that lower bound's saving beats its per-sequence
    cost (``KernelCrossover``), so a mixed pack errs towards ``varlen`` (the kernel training used
    for everything before). Raises ValueError on negative or inconsistent counts."""
    if num_sequences < 0 or max_seqlen < 0 or total_tokens < 0 or max_seqlen > total_tokens:
        raise ValueError(f"a call of {num_sequences} sequences, the longest {max_seqlen} of {total_tokens} tokens "
                         f"is not a pack")
    if num_sequences == 0 or max_seqlen == 0:
        return "varlen"
    rest = total_tokens - max_seqlen
    squares = float(max_seqlen) ** 2 + (float(rest) ** 2 / (num_sequences - 1) if num_sequences > 1 else 0.0)
    work = heads * head_dim / (crossover.heads * crossover.head_dim)
    saving_ms = crossover.quadratic_gap_ms_per_token2 * work * squares
    return "sdpa" if saving_ms > crossover.per_sequence_ms * num_sequences else "varlen"


def sdpa_call_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: torch.Tensor, max_seqlen_q, max_seqlen_k) -> str | None:
    """Why SDPA's flash backend would refuse this call's sequences, or None: the flash kernels'
    own rules (``flash_call_problem``: fp16/bf16, one device, head dimension at most 256 and a
    multiple of 8, KV heads dividing the query heads), checked on the packed call before it is cut
    into sequences."""
    return _kernel_call_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)


def _sdpa_per_sequence(q, k, v, cu_seqlens_q, cu_seqlens_k) -> torch.Tensor:
    """SDPA per packed segment on the flash backend alone (a call it cannot take raises, never falls
    back to the math kernel): grouped-query heads with ``enable_gqa`` (K and V never repeated),
    ``is_causal`` where a segment's queries are as many as its keys, else PyTorch's lower-right
    causal bias (``causal_lower_right``: the flash kernel's own bottom-right alignment)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    Tq = q.shape[0]
    gqa = k.shape[1] != q.shape[1]
    outs = []
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for args, n, m in _segments(q, k, v, cu_seqlens_q, cu_seqlens_k):
            if n == m:
                oi = F.scaled_dot_product_attention(*args, is_causal=True, enable_gqa=gqa)  # (1, H, n, hd)
            else:  # query r of the last n sees keys 0 .. m - n + r
                oi = F.scaled_dot_product_attention(*args, attn_mask=causal_lower_right(n, m), enable_gqa=gqa)
            outs.append(oi[0].transpose(0, 1))  # (n, H, hd)
    if len(outs) == 1 and outs[0].shape[0] == Tq:  # one sequence (the case this path is chosen for): no copy
        return outs[0]  # (Tq, H, hd); the flash backend's output is (1, n, H, hd) in memory, so contiguous
    return torch.cat(outs, dim=0) if outs else q.new_zeros(q.shape)  # (Tq, H, hd)


def sdpa_attention_fn(precision: str | None = None) -> Callable:
    """SDPA per sequence on the flash backend as an attention kernel (the path ``auto`` takes on
    CUDA for few long sequences). ``precision`` as in ``_half_inputs``; a call the flash backend
    cannot take raises ValueError naming why (``sdpa_call_problem``)."""

    def sdpa_flash_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        dtype = q.dtype
        q, k, v = _half_inputs(precision, q, k, v)
        cu_q = cu_seqlens_q.to(device=q.device, dtype=torch.int32).contiguous()
        cu_k = cu_q if cu_seqlens_k is cu_seqlens_q else cu_seqlens_k.to(device=q.device, dtype=torch.int32).contiguous()
        problem = sdpa_call_problem(q, k, v, cu_q, cu_k, int(max_seqlen_q), int(max_seqlen_k))
        if problem is not None:
            raise ValueError(f"SDPA's flash backend cannot run this call: {problem}")
        return _sdpa_per_sequence(q, k, v, cu_q, cu_k).to(dtype)

    return sdpa_flash_attention


def per_call_attention(varlen: Callable, sdpa: Callable,
                       choose: Callable[..., str] = choose_kernel) -> Callable:
    """A kernel that runs ``sdpa`` or ``varlen`` per call, as ``choose(num_sequences, max_seqlen,
    total_tokens, heads=, head_dim=)`` says, from the call's shapes and its query side alone (no read
    of the boundaries from the device, so a ``varlen`` call never waits on the host): for a call with
    fewer queries than keys (context parallelism's) the query side under-counts the work, which only
    makes ``varlen`` likelier. The choice is a function of the shapes, so a recomputed forward takes
    the same kernel as the first."""

    def auto_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        n = max(int(cu_seqlens_q.numel()) - 1, 0)
        mx = min(int(max_seqlen_q), int(q.shape[0]))
        kind = choose(n, mx, int(q.shape[0]), heads=int(q.shape[1]), head_dim=int(q.shape[2]))
        fn = sdpa if kind == "sdpa" else varlen
        return fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)

    auto_attention.choose = choose
    return auto_attention


def flash_version() -> str | None:
    """``"flash_attn 2.8.3"`` (the module and version that would run), or None when flash-attn
    does not import here."""
    try:
        return _import_flash_varlen()[1]
    except AttentionUnavailable:
        return None


def varlen_version() -> str | None:
    """``"torch 2.13.0"`` when this torch has ``varlen_attn`` with its flash kernels, else None."""
    try:
        _import_varlen()
    except AttentionUnavailable:
        return None
    return f"torch {torch.__version__}"


def _cuda_capability_problem(dev: torch.device) -> str | None:
    """Why the flash kernels cannot run on ``dev`` (they need compute capability 8.0, Ampere), or None."""
    try:
        major, minor = torch.cuda.get_device_capability(dev)
    except Exception as e:  # noqa: BLE001 - no driver, a stand-in CUDA: the kernel's own check speaks
        log.debug("no compute capability for %s: %s", dev, e)
        return None
    if major < 8:
        return f"the flash kernels need compute capability 8.0 (Ampere) or newer, {dev} has {major}.{minor}"
    return None


def select_attention(name: str, device: torch.device | str, precision: str | None = None) -> tuple[Callable, str]:
    """The attention kernel for backend ``name`` on ``device``: returns ``(fn, resolved_name)``,
    ``fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)``.

    ``auto`` resolves on CUDA (and ``precision`` not ``fp32``) to ``varlen+sdpa`` (``varlen_attn``
    or SDPA per sequence, chosen per call: ``per_call_attention``) when this torch has ``varlen_attn``
    and the GPU runs it, else ``flash`` when flash-attn imports, else ``torch``; elsewhere to
    ``torch``. ``precision`` is the run's (``bf16``/``fp32``; None: not declared): the flash kernels
    compute in half precision only, so an fp32 run never gets one silently. Raises ValueError for
    an unknown name and AttentionUnavailable when ``varlen`` or ``flash`` cannot run here (no CUDA,
    not in this torch / not installed, an fp32 run).
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    dev = torch.device(device)
    if name == "torch":
        fn, resolved, why = torch_varlen_attention, "torch", "requested"
    elif precision == "fp32":
        if name != "auto":
            raise AttentionUnavailable(f"attention backend '{name}' computes in fp16/bf16 but this run's precision is "
                                       f"fp32; use --precision bf16, or --attention torch (or auto)")
        fn, resolved, why = torch_varlen_attention, "torch", "auto: the run computes in fp32"
    elif dev.type != "cuda":
        if name != "auto":
            raise AttentionUnavailable(f"attention backend '{name}' needs a CUDA device, this run is on {dev.type}; "
                                       f"use --attention torch (or auto)")
        fn, resolved, why = torch_varlen_attention, "torch", f"auto on {dev.type}"
    elif name == "varlen":
        problem = _cuda_capability_problem(dev)
        if problem is not None:
            raise AttentionUnavailable(f"attention backend 'varlen': {problem}; use --attention torch")
        fn, resolved, why = varlen_attention_fn(precision), "varlen", "requested"
    elif name == "flash":
        fn, resolved, why = flash_attention_fn(precision), "flash", "requested"
    else:  # auto on CUDA in half precision: torch's own kernel, else flash-attn, else SDPA
        notes = []
        fn = None
        problem = _cuda_capability_problem(dev)
        for backend, make in (("varlen", varlen_attention_fn), ("flash", flash_attention_fn)):
            if problem is not None:
                notes.append(problem)
                break
            try:
                fn, resolved = make(precision), backend
                break
            except AttentionUnavailable as e:
                notes.append(str(e))
        if fn is None:
            fn, resolved = torch_varlen_attention, "torch"
        elif resolved == "varlen":  # measured against SDPA per sequence: choose per call (choose_kernel)
            fn, resolved = per_call_attention(fn, sdpa_attention_fn(precision)), AUTO_PER_CALL
            notes.append(f"per call: SDPA per sequence above a root-mean-square length of "
                         f"{H200_CROSSOVER.crossover_length:,.0f} tokens at 32 heads of 128, else varlen")
        why = "auto" + (f" ({'; '.join(notes)})" if notes else "")
    log.info("attention backend: %s (%s) on %s", resolved, why, dev)
    return fn, resolved
