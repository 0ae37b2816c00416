"""The torch side of ``make gpu-check`` (``workbench.gpucheck``): measurements run as processes of their own.

    python -m workbench.runtime.bench env --out F
    python -m workbench.runtime.bench peak --out F [--budget-s S]
    python -m workbench.runtime.bench attention --out F [--budget-s S]
    python -m workbench.runtime.bench train --model 1b --zero-stage 0 --tokens 8192,16384 --out F [--budget-s S]
                                            [--peak-tflops X]

- ``env``: torch and its CUDA build, the device (name, memory, compute capability), bf16, NCCL, the
  varlen attention kernels that import (``torch.nn.attention.varlen.varlen_attn``, flash-attn) and
  the one training would use (``select_attention("auto")``).
- ``peak``: the device's bf16 matmul rate, measured (square matmuls of growing size, CUDA events);
  the figure MFU is computed against. The datasheet's dense bf16 rate is given beside it when the
  device's name is known (:data:`DATASHEET_BF16_TFLOPS`).
- ``attention``: every varlen kernel that imports against the per-sequence SDPA path
  (``workbench.runtime.attention.torch_varlen_attention``): outputs and the gradients of q, k and v
  on uneven sequences with grouped-query heads, each compared with an fp32 reference; a kernel
  passes when its error is at most twice the bf16 SDPA path's own, plus a small absolute term
  (flash-attn's test rule). Then forward and forward+backward time of each at 4K to 128K tokens,
  as one sequence, as eight sequences and as packed 1K-token documents.
- ``train``: the runtime's own step (``StepExecutor``, the ZeRO stage asked, bf16) on packed
  batches of growing size: tokens/s, MFU (model FLOPs with the causal attention term,
  ``ModelSpec.flops_per_token``, against the ``peak`` rate), and the allocator's peak
  (``torch.cuda.max_memory_allocated``) against the memory model's prediction
  (``workbench.cost.memory.model_states`` + ``activation_bytes_per_token``). Each size runs without
  recomputation when the memory model says it fits, else with it; an out-of-memory is a finding
  (recorded with the prediction), retried once with recomputation, then the larger sizes are left out.

Every part writes its JSON to ``--out`` after each measurement (atomically), so a part stopped at its
deadline keeps what it measured; a measurement that fails is recorded with its error and the part
goes on. ``--budget-s``: a case that would overrun it is left out, with a line saying so.
``--cpu-rehearsal``: the same code on CPU with toy sizes (the tests drive it; its figures mean nothing).
Uses public torch APIs only.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import platform
import statistics
import sys
import time
import traceback
from typing import Callable

import torch

from workbench.util import write_json_atomic

__all__ = ["env_info", "peak_matmul", "attention_bench", "train_bench", "torch_varlen_fn", "datasheet_tflops",
           "DATASHEET_BF16_TFLOPS", "main"]

DATASHEET_BF16_TFLOPS = (
    ("H200", 989.4), ("GH200", 989.4), ("H100 NVL", 835.5), ("H100 PCIe", 756.5), ("H100", 989.4),
    ("A100", 312.0), ("L40S", 362.1), ("L4", 121.0), ("A10", 125.0),
)
"""Dense bf16 tensor-core TFLOPs from NVIDIA's datasheets (without sparsity), by a substring of the
device's name, first match (H100 without PCIe/NVL is the SXM5 part)."""

FIT_FRACTION = 0.92
"""A training case runs without recomputation when the memory model predicts at most this share of
the device's memory (the rest: CUDA context, allocator fragmentation, NCCL buffers)."""


def _say(msg: str) -> None:
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {s[0]}" if s else type(e).__name__


def _oom_types() -> tuple:
    return tuple(t for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None))
                 if isinstance(t, type))


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, _oom_types()) or "out of memory" in str(e).lower()


def _free(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


class _Deadline:
    def __init__(self, budget_s: float | None) -> None:
        self.t0 = time.monotonic()
        self.end = None if budget_s is None else self.t0 + float(budget_s)

    def left(self) -> float:
        return math.inf if self.end is None else self.end - time.monotonic()

    def allows(self, estimate_s: float) -> bool:
        return estimate_s <= self.left()


class _Out:
    """The part's result, written to ``path`` after every change."""

    def __init__(self, path: str | None, data: dict) -> None:
        self.path, self.data = path, data

    def save(self) -> None:
        if self.path:
            write_json_atomic(self.path, self.data)


def datasheet_tflops(name: str) -> float | None:
    """The dense bf16 TFLOPs of a device by its name (:data:`DATASHEET_BF16_TFLOPS`), or None."""
    for key, v in DATASHEET_BF16_TFLOPS:
        if key.lower() in str(name).lower():
            return v
    return None


# ------------------------------------------------------------------------------------------------
# env
# ------------------------------------------------------------------------------------------------


def torch_varlen_fn() -> tuple[Callable | None, str]:
    """PyTorch's own varlen kernel (``torch.nn.attention.varlen.varlen_attn``, torch 2.10+) as the
    runtime runs it (``workbench.runtime.attention.varlen_attention_fn``: the keywords of this
    release read from its signature), and a note; ``(None, why)`` where it does not import."""
    from workbench.runtime.attention import AttentionUnavailable, varlen_attention_fn, varlen_keywords

    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken build
        return None, f"torch.nn.attention.varlen does not import ({_first_line(e)}): torch {torch.__version__} " \
                     f"predates it (2.10+)"
    try:
        _, _, how = varlen_keywords(varlen_attn)
        fn = varlen_attention_fn("bf16")
    except AttentionUnavailable as e:
        return None, _first_line(e)
    return fn, f"torch.nn.attention.varlen.varlen_attn ({how})"


def env_info(device: torch.device) -> dict:
    """What this process's torch sees (module docstring)."""
    from workbench.runtime.attention import flash_version, select_attention

    cuda = device.type == "cuda"
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda_build": torch.version.cuda,
           "cuda_available": torch.cuda.is_available(), "device_count": torch.cuda.device_count() if cuda else 0,
           "device": device.type}
    if cuda:
        p = torch.cuda.get_device_properties(device)
        out["gpu"] = {"name": p.name, "total_memory_bytes": int(p.total_memory), "capability": f"{p.major}.{p.minor}",
                      "multiprocessors": int(getattr(p, "multi_processor_count", 0) or 0)}
        out["bf16"] = bool(torch.cuda.is_bf16_supported())
        try:
            out["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception as e:  # noqa: BLE001
            out["nccl"] = None
            out["nccl_error"] = _first_line(e)
        out["datasheet_bf16_tflops"] = datasheet_tflops(p.name)
    try:
        out["flash_attn"] = flash_version()
    except Exception as e:  # noqa: BLE001 - a broken flash-attn build can raise anything on import
        out["flash_attn"] = None
        out["flash_attn_error"] = _first_line(e)
    fn, note = torch_varlen_fn()
    out["torch_varlen"] = {"available": fn is not None and cuda, "note": note if fn is not None and cuda else
                           (note if fn is None else "imports, but its kernels need CUDA")}
    try:
        out["attention_auto"] = select_attention("auto", device, "bf16" if cuda else "fp32")[1]
    except Exception as e:  # noqa: BLE001
        out["attention_auto"] = None
        out["attention_auto_error"] = _first_line(e)
    return out


# ------------------------------------------------------------------------------------------------
# peak
# ------------------------------------------------------------------------------------------------


def peak_matmul(device: torch.device, *, sizes=(4096, 8192, 16384), dtype=torch.bfloat16, deadline=None,
                out: _Out | None = None) -> dict:
    """Square ``n x n`` matmuls of each size in ``dtype``, timed back to back (CUDA events), the best
    of three timed loops of at least 0.2 s each: ``{"dtype", "rows": [{n, ms, tflops}], "peak_tflops",
    "at_n"}``. A size that runs out of memory or time is recorded as such."""
    from workbench.runtime.timing import Clock

    deadline = deadline or _Deadline(None)
    res = {"dtype": str(dtype).replace("torch.", ""), "rows": [], "peak_tflops": None, "at_n": None}
    clock = Clock(device)
    for n in sizes:
        if deadline.left() < 5:
            res["rows"].append({"n": n, "status": "skip", "reason": "the part's time is spent"})
            continue
        try:
            gen = torch.Generator(device=device).manual_seed(n)
            a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
            b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
            c = torch.empty(n, n, device=device, dtype=dtype)
            for _ in range(3):
                torch.matmul(a, b, out=c)
            clock.mark()
            torch.matmul(a, b, out=c)
            clock.mark()
            (one,) = clock.intervals()
            iters = max(3, min(500, int(200.0 / max(one, 1e-3))))
            best = math.inf
            for _ in range(3):
                clock.mark()
                for _ in range(iters):
                    torch.matmul(a, b, out=c)
                clock.mark()
                (t,) = clock.intervals()
                best = min(best, t / iters)
            tflops = 2.0 * n ** 3 / (best / 1e3) / 1e12
            res["rows"].append({"n": n, "status": "ok", "ms": best, "tflops": tflops, "iters": iters})
            if res["peak_tflops"] is None or tflops > res["peak_tflops"]:
                res["peak_tflops"], res["at_n"] = tflops, n
            del a, b, c
        except Exception as e:  # noqa: BLE001 - out of memory on a small device, a driver error: a finding
            res["rows"].append({"n": n, "status": "oom" if _is_oom(e) else "error", "error": _first_line(e)})
            _free(device)
        if out is not None:
            out.data["peak"] = res
            out.save()
    return res


# ------------------------------------------------------------------------------------------------
# attention
# ------------------------------------------------------------------------------------------------


def _attention_kernels(device: torch.device) -> tuple[list[tuple[str, Callable]], list[dict]]:
    """``[(name, fn)]`` of the kernels that can run here, the per-sequence SDPA path first, and a
    note for each one that cannot."""
    from workbench.runtime.attention import flash_attention_fn, flash_version, torch_varlen_attention

    kernels = [("sdpa per sequence", torch_varlen_attention)]
    notes = []
    fn, note = torch_varlen_fn()
    if fn is None:
        notes.append({"kernel": "torch varlen", "status": "skip", "reason": note})
    elif device.type != "cuda":
        notes.append({"kernel": "torch varlen", "status": "skip", "reason": "its kernels need CUDA"})
    else:
        kernels.append(("torch varlen", fn))
    try:
        version = flash_version()
    except Exception as e:  # noqa: BLE001
        version, err = None, _first_line(e)
    else:
        err = None
    if version is None:
        notes.append({"kernel": "flash-attn", "status": "skip", "reason": err or "flash-attn is not installed"})
    elif device.type != "cuda":
        notes.append({"kernel": "flash-attn", "status": "skip", "reason": "its kernels need CUDA"})
    else:
        try:
            kernels.append((f"flash-attn ({version})", flash_attention_fn("bf16")))
        except Exception as e:  # noqa: BLE001
            notes.append({"kernel": "flash-attn", "status": "fail", "reason": _first_line(e)})
    return kernels, notes


def _run_attention(fn, q, k, v, cu, mx, dout):
    """Forward and backward of ``fn``; returns (out, dq, dk, dv), detached."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v, cu, cu, mx, mx)  # (T, H, hd)
    out.backward(dout)
    return out.detach(), q.grad.detach(), k.grad.detach(), v.grad.detach()


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def attention_correctness(kernels, device: torch.device, *, heads: int, kv_heads: int, head_dim: int,
                          lengths: list[int], dtype=torch.bfloat16) -> dict:
    """Every kernel's output and q/k/v gradients against an fp32 (fp64 on CPU) per-sequence SDPA
    reference, on ``lengths`` packed; the bf16 SDPA path's own error sets the tolerance."""
    from workbench.runtime.attention import torch_varlen_attention

    gen = torch.Generator().manual_seed(0)
    T = sum(lengths)
    q = torch.randn(T, heads, head_dim, generator=gen)
    k = torch.randn(T, kv_heads, head_dim, generator=gen)
    v = torch.randn(T, kv_heads, head_dim, generator=gen)
    dout = torch.randn(T, heads, head_dim, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    mx = max(lengths)
    ref_dtype = torch.float32 if device.type == "cuda" else torch.float64
    ref = _run_attention(torch_varlen_attention, *(t.to(device, ref_dtype) for t in (q, k, v)), cu, mx,
                         dout.to(device, ref_dtype))
    scale = [float(r.abs().max()) for r in ref]
    args = [t.to(device, dtype) for t in (q, k, v)]
    names = ("out", "dq", "dk", "dv")
    rows, base = [], None
    for name, fn in kernels:
        try:
            got = _run_attention(fn, *args, cu, mx, dout.to(device, dtype))
            errs = {n: _max_err(g, r) for n, g, r in zip(names, got, ref)}
        except Exception as e:  # noqa: BLE001 - a kernel that refuses this call is a finding
            rows.append({"kernel": name, "status": "fail", "error": _first_line(e)})
            continue
        if base is None:  # the per-sequence SDPA path in the same dtype: the tolerance's yardstick
            base = errs
        tol = {n: 2.0 * base[n] + 1e-3 * s for n, s in zip(names, scale)}
        ok = all(math.isfinite(errs[n]) and errs[n] <= tol[n] for n in names)
        rows.append({"kernel": name, "status": "ok" if ok else "fail", "max_abs_error": errs, "tolerance": tol,
                     "relative_error": {n: errs[n] / max(s, 1e-30) for n, s in zip(names, scale)},
                     "yardstick": base is errs})
    return {"lengths": lengths, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
            "dtype": str(dtype).replace("torch.", ""), "reference": str(ref_dtype).replace("torch.", ""),
            "rule": "max |kernel - reference| <= 2 x max |bf16 SDPA per sequence - reference| + 1e-3 x max |reference|, "
                    "for the output and the gradients of q, k and v", "kernels": rows}


def _causal_flops(lengths, heads: int, head_dim: int) -> float:
    """Forward FLOPs of causal attention: QK^T and PV, 2 FLOPs per multiply-add, half the scores."""
    return float(sum(2.0 * s * s * heads * head_dim for s in lengths))


def attention_timing(kernels, device: torch.device, *, heads: int, kv_heads: int, head_dim: int, tokens: list[int],
                     doc_len: int, dtype=torch.bfloat16, reps: int = 3, deadline=None, out: _Out | None = None) -> list[dict]:
    """Forward and forward+backward ms of every kernel at each token count, as one sequence, as eight
    sequences and as packed ``doc_len``-token documents (CUDA events; one warm-up, the median of
    ``reps``). On an H200 per-sequence SDPA beat ``varlen_attn`` 1.6x on one long sequence and lost
    1.4-1.7x on 1K-token documents: eight sequences show where between them the kernels cross."""
    from workbench.runtime.timing import Clock

    deadline = deadline or _Deadline(None)
    clock = Clock(device)
    rows: list[dict] = []
    last = {}  # shape -> seconds the previous (smaller) case took, to estimate the next
    for T in tokens:
        for shape in ("one sequence", "eight sequences", f"{doc_len:,}-token documents"):
            lengths = {"one sequence": [T], "eight sequences": [max(1, T // 8)] * 8}.get(
                shape, [doc_len] * max(1, T // doc_len))
            growth = 4.0 if shape != f"{doc_len:,}-token documents" else 2.0
            est = last.get(shape, 0.0) * growth * 1.2
            if not deadline.allows(est + 2):
                rows.append({"tokens": T, "shape": shape, "status": "skip",
                             "reason": f"about {est:.0f} s more would overrun the part's budget ({deadline.left():.0f} s left)"})
                continue
            t_case = time.monotonic()
            gen = torch.Generator(device=device).manual_seed(T)
            n = sum(lengths)
            try:
                q = torch.randn(n, heads, head_dim, device=device, dtype=dtype, generator=gen).requires_grad_(True)
                k = torch.randn(n, kv_heads, head_dim, device=device, dtype=dtype, generator=gen).requires_grad_(True)
                v = torch.randn(n, kv_heads, head_dim, device=device, dtype=dtype, generator=gen).requires_grad_(True)
                dout = torch.randn(n, heads, head_dim, device=device, dtype=dtype, generator=gen)
            except Exception as e:  # noqa: BLE001
                rows.append({"tokens": T, "shape": shape, "status": "oom" if _is_oom(e) else "error",
                             "error": _first_line(e)})
                _free(device)
                continue
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
            flops = _causal_flops(lengths, heads, head_dim)
            row = {"tokens": n, "shape": shape, "sequences": len(lengths), "status": "ok", "fwd_flops": flops,
                   "kernels": {}}
            for name, fn in kernels:
                try:
                    fwd, both = [], []
                    for r in range(1 + reps):
                        q.grad = k.grad = v.grad = None
                        clock.mark()
                        o = fn(q, k, v, cu, cu, max(lengths), max(lengths))
                        clock.mark()
                        o.backward(dout)
                        clock.mark()
                        f_ms, b_ms = clock.intervals()
                        if r:
                            fwd.append(f_ms)
                            both.append(f_ms + b_ms)
                        del o
                    fm, bm = statistics.median(fwd), statistics.median(both)
                    # backward is 2.5x the forward's FLOPs (flash-attn's convention: 5 matmuls to 2)
                    row["kernels"][name] = {"status": "ok", "fwd_ms": fm, "fwd_bwd_ms": bm,
                                            "fwd_tflops": flops / (fm / 1e3) / 1e12,
                                            "fwd_bwd_tflops": 3.5 * flops / (bm / 1e3) / 1e12}
                except Exception as e:  # noqa: BLE001
                    row["kernels"][name] = {"status": "oom" if _is_oom(e) else "error", "error": _first_line(e)}
                    q.grad = k.grad = v.grad = None
                    _free(device)
            base = row["kernels"].get(kernels[0][0], {}).get("fwd_bwd_ms")
            for r in row["kernels"].values():
                if base and r.get("fwd_bwd_ms"):
                    r["speedup_over_sdpa"] = base / r["fwd_bwd_ms"]
            del q, k, v, dout
            _free(device)
            last[shape] = time.monotonic() - t_case
            row["seconds"] = last[shape]
            rows.append(row)
            if out is not None:
                out.data["timing"] = rows
                out.save()
            _say(f"attention: {n:,} tokens, {shape}: " + ", ".join(
                f"{k} {r['fwd_bwd_ms']:.1f} ms" if r.get("fwd_bwd_ms") else f"{k} {r['status']}"
                for k, r in row["kernels"].items()))
    return rows


def attention_bench(device: torch.device, *, rehearsal: bool = False, deadline=None, out: _Out | None = None) -> dict:
    """The ``attention`` part (module docstring)."""
    from workbench.runtime.attention import select_attention

    kernels, notes = _attention_kernels(device)
    if rehearsal:  # toy sizes on CPU: the same code, meaningless figures
        shape = dict(heads=4, kv_heads=2, head_dim=16)
        lengths, tokens, doc, dtype = [70, 17, 33, 1], [256, 512], 64, torch.bfloat16
    else:  # Llama 3 8B's attention layout: 32 query heads over 8 KV heads of 128
        shape = dict(heads=32, kv_heads=8, head_dim=128)
        lengths, tokens, doc, dtype = [2048, 1000, 513, 300, 17, 1], [4096, 8192, 16384, 32768, 65536, 131072], 1024, \
            torch.bfloat16
    res = {"kernels": [n for n, _ in kernels], "unavailable": notes, **shape}
    try:
        res["training_uses"] = select_attention("auto", device, "bf16" if device.type == "cuda" else "fp32")[1]
    except Exception as e:  # noqa: BLE001
        res["training_uses"] = None
        res["training_uses_error"] = _first_line(e)
    if out is not None:
        out.data.update(res)
        out.save()
    res["correctness"] = attention_correctness(kernels, device, lengths=lengths, dtype=dtype, **shape)
    if out is not None:
        out.data["correctness"] = res["correctness"]
        out.save()
    _say("attention: correctness " + ", ".join(f"{r['kernel']} {r['status']}" for r in res["correctness"]["kernels"]))
    good = [(n, f) for n, f in kernels
            if any(r["kernel"] == n and r["status"] == "ok" for r in res["correctness"]["kernels"]) or n == kernels[0][0]]
    res["timing"] = attention_timing(good, device, tokens=tokens, doc_len=doc, dtype=dtype, deadline=deadline, out=out,
                                     **shape)
    return res


# ------------------------------------------------------------------------------------------------
# train
# ------------------------------------------------------------------------------------------------

_OPTIMIZERS = {"adamw": ("adamw", 0.0), "sgd-momentum": ("sgd", 0.9), "sgd": ("sgd", 0.0)}
"""The memory model's optimizer names and the runtime's (name, momentum) for each."""


def predicted_memory(spec, *, zero_stage: int, precision: str, optimizer: str, recompute: bool, tokens: int) -> dict:
    """The memory model's peak for one rank of a world of 1, the largest of three moments (``peak_at``):

    - the loss's backward: model states as the runtime holds them (``model_states``: parameters,
      gradients, optimizer states and the working set), the activations of ``tokens`` tokens
      (``activation_bytes_per_token``; autocast under ZeRO 0-2 in bf16) and what the loss holds for a
      moment (``loss_transient_bytes``: the whole logits' two fp32 ``(tokens, vocab)`` gradients, or
      under recomputation one chunk's logits and the head gradient's accumulator). Under ZeRO-3 a step of
      one pass has no gradients yet (``ZeroRuntime.zero_grad`` drops them; FSDP2 makes each unit's
      shard at its reduce-scatter), so they are left out here; ZeRO 0-2 zero-fill them at the step's start;
    - the backward's end: the model states with every gradient, the activations gone;
    - the optimizer's step: parameters, gradients and states plus the step's own temporary."""
    from workbench.cost import activation_bytes_per_token
    from workbench.cost.memory import loss_transient_bytes, model_states

    m = dataclasses.replace(spec, dtype_bytes=2 if precision == "bf16" else 4)
    st = model_states(m, zero_stage=zero_stage, num_ranks=1, precision=precision, optimizer=optimizer)
    act = activation_bytes_per_token(m, recompute, autocast=precision == "bf16" and zero_stage < 3) * tokens
    loss = loss_transient_bytes(m, tokens, recompute=recompute)
    step = st.states + st.optimizer_step
    at_loss = st.total + act + loss - (st.gradients if zero_stage == 3 else 0.0)
    moments = {"the loss's backward": at_loss, "the backward's end": st.total, "the optimizer's step": step}
    peak_at = max(moments, key=moments.get)
    return {"states_bytes": st.states, "working_bytes": st.working, "activation_bytes": act, "loss_backward_bytes": loss,
            "optimizer_step_bytes": step, "total_bytes": moments[peak_at], "peak_at": peak_at}


def _init_world_of_one(device: torch.device) -> str:
    """A process group of one rank (NCCL on CUDA, gloo elsewhere) on an in-memory store; returns the backend."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    kw = {"device_id": device} if device.type == "cuda" else {}
    try:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kw)
    except TypeError:  # a torch without device_id
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return backend


def _build(spec, device: torch.device, *, zero_stage: int, precision: str, recompute: bool, optimizer: str):
    """The runtime's model (fp32 master weights made on the device directly: built on the meta
    device, then initialised there, normal std 0.02 with the output projections scaled as
    ``Transformer.reset_parameters`` does), the stage applied, its optimizer and step executor."""
    from workbench.runtime.attention import select_attention
    from workbench.runtime.groups import GroupRegistry
    from workbench.runtime.model import Transformer
    from workbench.runtime.step import StepExecutor
    from workbench.runtime.zero import parallelize

    with torch.device("meta"):  # no memory, no host-side random draws (8B of them would take a minute)
        model = Transformer(spec, init=False)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    out_std = 0.02 / (2 * spec.layers) ** 0.5
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, out_std if name.endswith(("o_proj.weight", "down.weight")) else 0.02, generator=gen)
    zero = parallelize(model, zero_stage=zero_stage, precision=precision, recompute=recompute, device=device)
    name, momentum = _OPTIMIZERS[optimizer]
    opt = zero.make_optimizer(name, lr=1e-5, momentum=momentum)
    attn, attn_name = select_attention("auto", device, precision)
    ex = StepExecutor(model, GroupRegistry(1, [1]), attn, device=device, zero=zero)
    return model, zero, opt, ex, attn_name


def train_bench(model_name: str, device: torch.device, *, zero_stage: int, tokens: list[int], peak_tflops: float | None,
                rehearsal: bool = False, deadline=None, out: _Out | None = None, warmup: int = 2, steps: int = 3) -> dict:
    """The ``train`` part for one model (module docstring)."""
    from workbench.cost import CostModel
    from workbench.runtime.timing import Clock, PeakMemory
    from workbench.solve.plan import build_plan
    from workbench.models import get_model
    from workbench.specs import ClusterSpec, load_profile

    deadline = deadline or _Deadline(None)
    spec = get_model(model_name)
    cuda = device.type == "cuda"
    precision = "bf16" if cuda else "fp32"
    total = int(torch.cuda.get_device_properties(device).total_memory) if cuda else 1 << 50
    name = torch.cuda.get_device_properties(device).name if cuda else "cpu"
    sheet = datasheet_tflops(name) if cuda else None
    res = {"model": spec.name, "params": spec.params(), "zero_stage": zero_stage, "precision": precision, "world": 1,
           "device_memory_bytes": total if cuda else None, "peak_tflops": peak_tflops, "datasheet_tflops": sheet,
           "cases": []}
    t0 = time.monotonic()
    backend = _init_world_of_one(device)
    res["backend"] = backend
    # the optimizer: AdamW where the memory model fits it at the smallest batch with recomputation, else lighter
    opt_kind = next((o for o in _OPTIMIZERS if predicted_memory(spec, zero_stage=zero_stage, precision=precision,
                                                                  optimizer=o, recompute=True,
                                                                  tokens=tokens[0])["total_bytes"] <= FIT_FRACTION * total),
                    None)
    if opt_kind is None:
        p = predicted_memory(spec, zero_stage=zero_stage, precision=precision, optimizer="sgd", recompute=True,
                             tokens=tokens[0])
        res["status"] = "skip"
        res["reason"] = (f"the memory model predicts {p['total_bytes'] / 2**30:.1f} GiB for {spec.name} at "
                         f"{tokens[0]:,} tokens even with plain SGD and recomputation (ZeRO-{zero_stage}, one rank): "
                         f"over {FIT_FRACTION:.0%} of the device's {total / 2**30:.1f} GiB")
        if out is not None:
            out.data.update(res)
            out.save()
        return res
    res["optimizer"] = opt_kind
    if out is not None:
        out.data.update(res)
        out.save()
    clock, mem = Clock(device), PeakMemory(device)
    built = None  # (recompute, model, zero, opt, ex, attn_name)
    gen = torch.Generator().manual_seed(1)
    last_case_s, last_tokens, stop_why = None, None, None
    queue = [(t, None) for t in tokens]  # (tokens, forced recompute)
    while queue:
        T, forced = queue.pop(0)
        lengths = [T // 2, T // 4, T // 8, T - T // 2 - T // 4 - T // 8]
        case = {"tokens": T, "lengths": lengths}
        if stop_why is not None:
            res["cases"].append({**case, "status": "skip", "reason": stop_why})
            continue
        preds = {rc: predicted_memory(spec, zero_stage=zero_stage, precision=precision, optimizer=opt_kind,
                                      recompute=rc, tokens=T) for rc in (False, True)}
        rc = forced if forced is not None else (preds[False]["total_bytes"] > FIT_FRACTION * total)
        if preds[rc]["total_bytes"] > FIT_FRACTION * total and forced is None:
            res["cases"].append({**case, "status": "skip", "recompute": rc, "predicted": preds[rc],
                                 "reason": f"the memory model predicts {preds[rc]['total_bytes'] / 2**30:.1f} GiB with "
                                           f"recomputation, over {FIT_FRACTION:.0%} of {total / 2**30:.1f} GiB"})
            continue
        rebuild = built is None or built[0] != rc
        if last_case_s is not None:
            est = last_case_s * (T / last_tokens) * 1.3 + (res.get("build_s", 0.0) if rebuild else 0.0)
            if not deadline.allows(est):
                stop_why = f"about {est:.0f} s more would overrun the part's budget ({deadline.left():.0f} s left)"
                res["cases"].append({**case, "status": "skip", "reason": stop_why})
                continue
        case.update(recompute=rc, predicted=preds[rc])
        t_case = time.monotonic()
        try:
            if rebuild:
                # every name of the old model goes, then a collection (its modules hold reference cycles, and
                # a failed step's exception held its frames until its handler ended), else it stays allocated
                # beside the new one: an H200 measured an 8B's peak 30 GiB high after a rebuild
                built = zero = opt = ex = None
                _free(device)
                tb = time.monotonic()
                built = (rc, *_build(spec, device, zero_stage=zero_stage, precision=precision, recompute=rc,
                                     optimizer=opt_kind))
                res["build_s"] = time.monotonic() - tb
                res["attention"] = built[5]
                _say(f"train: {spec.name} built on {device} in {res['build_s']:.1f} s (ZeRO-{zero_stage}, {opt_kind}, "
                     f"recompute {rc})")
            _, _, zero, opt, ex, _ = built  # the model lives in built (and ex) alone
            cost = CostModel(load_profile("cpu-gloo-tiny" if rehearsal else "h100-80g"), spec,
                             ClusterSpec(num_gpus=1, gpus_per_node=1, gpu_memory_gb=1e6, usable_memory_fraction=1.0,
                                         zero_stage=zero_stage), precision=precision, optimizer=opt_kind, recompute=rc)
            plan = build_plan("gpu-check", [[(1, list(range(len(lengths))))]], lengths, cost)
            seqs = [torch.randint(0, spec.vocab, (n,), generator=gen) for n in lengths]
            times, peaks, losses = [], [], []
            for i in range(warmup + steps):
                mem.start()
                clock.reset()  # a case that failed half-way (an out-of-memory) left its first mark
                clock.mark()
                r = ex.run(plan, seqs)
                opt.step()
                clock.mark()
                (ms,) = clock.intervals()
                peak = mem.peak()
                opt.zero_grad(set_to_none=True)
                losses.append(r.loss)
                if i >= warmup:
                    times.append(ms)
                    peaks.append(peak)
            step_ms = statistics.median(times)
            flops = sum(s * spec.flops_per_token(s) for s in lengths)
            achieved = flops / (step_ms / 1e3) / 1e12
            peak_b = max(peaks) if peaks and peaks[0] is not None else None
            st = zero.state_bytes()
            case.update(status="ok" if all(math.isfinite(x) for x in losses) else "fail", step_ms=step_ms, steps_ms=times,
                        tokens_per_s=T / (step_ms / 1e3), model_tflops=achieved,
                        mfu=achieved / peak_tflops if peak_tflops else None,
                        mfu_datasheet=achieved / sheet if sheet else None, peak_bytes=peak_b,
                        peak_over_predicted=peak_b / preds[rc]["total_bytes"] if peak_b else None,
                        measured_states_bytes=st["parameters_bytes"] + st["gradients_bytes"] + st["optimizer_bytes"],
                        losses=losses, reference_profile=cost.profile.name, reference_profile_ms=plan.makespan_ms)
            if case["status"] == "fail":
                case["reason"] = f"loss not finite: {losses}"
            _say(f"train: {spec.name} {T:,} tokens (recompute {rc}): {step_ms:,.1f} ms per step, "
                 f"{case['tokens_per_s']:,.0f} tokens/s" + (f", MFU {case['mfu']:.1%}" if case["mfu"] else "")
                 + (f", peak {peak_b / 2**30:.1f} GiB vs predicted {preds[rc]['total_bytes'] / 2**30:.1f} GiB"
                    if peak_b else ""))
        except Exception as e:  # noqa: BLE001 - out of memory is a finding about the memory model
            oom = _is_oom(e)
            case.update(status="oom" if oom else "error", error=_first_line(e))
            if not oom:
                traceback.print_exc()
            if cuda:
                case["max_memory_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
            # a step that failed half-way may leave FSDP's state mid-pass: build afresh, the old model freed
            built = zero = opt = ex = r = None
            _free(device)
            _say(f"train: {spec.name} {T:,} tokens (recompute {rc}): {case['status']}: {case['error']}")
            if oom and not rc:
                queue.insert(0, (T, True))  # once more with recomputation
            elif oom:
                stop_why = f"{T:,} tokens ran out of memory even with recomputation"
            else:
                stop_why = f"{T:,} tokens failed: {case['error']}"
        last_case_s, last_tokens = time.monotonic() - t_case, T
        case["seconds"] = last_case_s
        res["cases"].append(case)
        if out is not None:
            out.data.update(res)
            out.save()
    res["seconds"] = time.monotonic() - t0
    built = None
    _free(device)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return res


# ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workbench.runtime.bench", description=__doc__.splitlines()[0])
    ap.add_argument("part", choices=["env", "peak", "attention", "train"])
    ap.add_argument("--out", default=None, help="the JSON file to write (after every measurement)")
    ap.add_argument("--budget-s", type=float, default=None, help="leave out cases that would overrun this many seconds")
    ap.add_argument("--cpu-rehearsal", action="store_true", help="run on CPU with toy sizes (tests)")
    ap.add_argument("--model", default="1b")
    ap.add_argument("--zero-stage", type=int, default=0, choices=[0, 3])
    ap.add_argument("--tokens", default="8192,16384,32768,65536")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the device's measured bf16 rate (MFU's denominator)")
    a = ap.parse_args(argv)
    threads = int(os.environ.get("OMP_NUM_THREADS") or 0)
    if threads > 0:
        torch.set_num_threads(threads)
    if a.cpu_rehearsal:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    out = _Out(a.out, {"part": a.part, "device": device.type, "rehearsal": a.cpu_rehearsal, "started": time.time()})
    deadline = _Deadline(a.budget_s)
    if a.part != "env" and device.type != "cuda" and not a.cpu_rehearsal:
        out.data.update(status="skip", reason="needs CUDA: torch sees no CUDA device")
        out.save()
        return 0
    try:
        if a.part == "env":
            out.data.update(env_info(device))
        elif a.part == "peak":
            dtype = torch.bfloat16
            sizes = (128, 256) if a.cpu_rehearsal else (4096, 8192, 16384)
            peak_matmul(device, sizes=sizes, dtype=dtype, deadline=deadline, out=out)
        elif a.part == "attention":
            attention_bench(device, rehearsal=a.cpu_rehearsal, deadline=deadline, out=out)
        else:
            tokens = [int(x) for x in a.tokens.split(",") if x.strip()]
            res = train_bench(a.model, device, zero_stage=a.zero_stage, tokens=tokens, peak_tflops=a.peak_tflops,
                              rehearsal=a.cpu_rehearsal, deadline=deadline, out=out,
                              **({"warmup": 1, "steps": 2} if a.cpu_rehearsal else {}))
            out.data.update(res)
        out.data["status"] = out.data.get("status") or "done"
    except Exception as e:  # noqa: BLE001 - the orchestrator reports it; what was measured stays
        traceback.print_exc()
        out.data.update(status="error", error=_first_line(e))
    out.data["finished"] = time.time()
    out.save()
    return 0


if __name__ == "__main__":
    from workbench.util import exit_process

    exit_process(main())
