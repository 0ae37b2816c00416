"""The torch side of ``workbench doctor`` (``workbench.doctor``): the probes that check what this
machine can do by doing it.

Run as a process of its own (``python -m workbench.runtime.probe``), never in the caller (a
notebook kernel must not initialise CUDA). Two modes:

- ``probe``: one process. Torch and its CUDA/NCCL build, every GPU (name, memory, compute
  capability), bf16 support, flash-attn importable and one varlen call against the PyTorch path
  on random data (max error stated), the PyTorch path against a dense causal reference (queries
  as long as the keys, and shorter: bottom-right aligned), which kernel ``--attention auto`` runs
  (with torch's ``varlen_attn`` on a GPU: one call with queries shorter than keys against the
  PyTorch path), and a
  training step of the tiny model in the chosen precision: CUDA-event timing, the allocator's peak
  per step (the first step left out) against the memory model's prediction.
- ``dist``: one of 2 ranks on this machine (the caller starts both; rank 0 hosts the store on a
  loopback socket it is handed). With 2+ GPUs, NCCL all-to-all and all-gather (values checked,
  bandwidth timed with CUDA events); on any machine the sharded path: one step of the tiny model
  under ZeRO-3 (FSDP2, lockstep; NCCL on GPUs, gloo on CPU) against the same step under ZeRO-0.

Each check is ``{"name", "status": ok|warn|fail|skip, "detail", "fix", "data"}``; the JSON goes to
stdout (probe) or to ``--out`` (dist, rank 0). ``workbench.doctor`` runs both and prints them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import traceback

import torch

__all__ = ["probe", "dist_check", "main"]

MEMORY_OK_RATIO = 1.5
"""Measured peak within this factor of the memory model's prediction (either way): ok, else warn."""


def _check(name: str, status: str, detail: str, fix: str = "", **data) -> dict:
    return {"name": name, "status": status, "detail": detail, "fix": fix, "data": data}


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {s[0]}" if s else type(e).__name__


# ------------------------------------------------------------------------------------------------
# one process
# ------------------------------------------------------------------------------------------------


def _torch_check(nvidia_visible: bool) -> dict:
    cuda_build = torch.version.cuda
    detail = f"torch {torch.__version__}, " + (f"CUDA {cuda_build} build" if cuda_build else "CPU build (no CUDA)")
    if nvidia_visible and not cuda_build:
        return _check("torch", "fail", detail + "; this machine has an NVIDIA GPU that torch cannot use",
                      "reinstall on this machine: `make clean install` installs torch's CUDA build where nvidia-smi "
                      "finds a GPU (see docs/gpu-and-clusters.md)", version=torch.__version__, cuda=cuda_build)
    return _check("torch", "ok", detail, version=torch.__version__, cuda=cuda_build)


def _gpu_checks(nvidia_visible: bool) -> list[dict]:
    out = []
    if not torch.cuda.is_available():
        why = ("nvidia-smi shows a GPU but torch.cuda.is_available() is False (driver too old for this CUDA build, "
               "or CUDA_VISIBLE_DEVICES hides it)" if nvidia_visible else "no NVIDIA GPU on this machine")
        status = "fail" if nvidia_visible else "skip"
        fix = ("check `nvidia-smi` (driver version) against torch's CUDA build, and CUDA_VISIBLE_DEVICES"
               if nvidia_visible else "")
        out.append(_check("gpus", status, why, fix))
        out.append(_check("nccl", "skip", "NCCL needs CUDA GPUs; multi-process runs here use gloo"))
        out.append(_check("bf16", "skip", "bf16 training is for GPUs; CPU runs compute in fp32 by default "
                                          "(bf16 matmuls on CPU are slow)"))
        return out
    n = torch.cuda.device_count()
    gpus, old = [], []
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        cc = f"{p.major}.{p.minor}"
        gpus.append({"index": i, "name": p.name, "memory_gb": round(p.total_memory / 1e9, 1), "capability": cc})
        if p.major < 8:
            old.append(f"GPU {i} ({p.name}, sm_{p.major}{p.minor})")
    names = sorted({g["name"] for g in gpus})
    detail = (f"{n} GPU(s): " + "; ".join(f"{nm} x{sum(g['name'] == nm for g in gpus)}" for nm in names)
              + f"; {gpus[0]['memory_gb']} GB, compute capability {gpus[0]['capability']}")
    if old:
        out.append(_check("gpus", "warn", detail + f"; {', '.join(old)} predate Ampere: no bf16 tensor cores, no "
                                          "flash-attn 2", "train in fp32 (--precision fp32) with --attention torch",
                          gpus=gpus))
    else:
        out.append(_check("gpus", "ok", detail, gpus=gpus))
    try:
        ver = ".".join(str(x) for x in torch.cuda.nccl.version())
        ok = torch.distributed.is_nccl_available()
        out.append(_check("nccl", "ok" if ok else "fail", f"NCCL {ver}" + ("" if ok else " (not built into torch)"),
                          "" if ok else "install torch's CUDA build", version=ver))
    except Exception as e:  # noqa: BLE001
        out.append(_check("nccl", "fail", f"NCCL unavailable: {_first_line(e)}", "install torch's CUDA build"))
    bf16 = torch.cuda.is_bf16_supported()
    out.append(_check("bf16", "ok" if bf16 else "warn", "bf16 supported (the GPU default)" if bf16 else
                      "no bf16 on this GPU", "" if bf16 else "train with --precision fp32 and --attention torch",
                      supported=bf16))
    return out


def _dense_causal(q, k, v):
    """Causal attention of one sequence written out densely (scores, mask, softmax), in fp64."""
    T, H, hd = q.shape
    rep = H // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = torch.einsum("thd,uhd->htu", q.double(), k.double()) / math.sqrt(hd)  # (H, T, T)
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    w = s.masked_fill(mask, float("-inf")).softmax(-1)
    return torch.einsum("htu,uhd->thd", w, v.double())  # (T, H, hd)


def _attention_checks(device: torch.device) -> list[dict]:
    from workbench.runtime.attention import flash_attention_fn, flash_version, torch_varlen_attention

    gen = torch.Generator().manual_seed(0)
    lens = [300, 17, 128, 1]
    T, H, KV, hd = sum(lens), 8, 2, 64
    q, k, v = (torch.randn(T, h, hd, generator=gen) for h in (H, KV, KV))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    out = []
    # the PyTorch path (every device) against a dense reference written out here
    ref = torch.cat([_dense_causal(q[a:b], k[a:b], v[a:b]) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    cud = cu.to(device)
    got = torch_varlen_attention(q.to(device), k.to(device), v.to(device), cud, cud, max(lens), max(lens)).double().cpu()
    err = float((got - ref).abs().max())
    # queries shorter than keys (context parallelism's call): the last rows of each sequence, bottom-right
    q_rows = torch.cat([torch.arange(b - (b - a + 1) // 2, b) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    cu_q = torch.tensor([0, *torch.tensor([(n + 1) // 2 for n in lens]).cumsum(0).tolist()], dtype=torch.int32)
    short = torch_varlen_attention(q[q_rows].to(device), k.to(device), v.to(device), cu_q.to(device), cud,
                                   max((n + 1) // 2 for n in lens), max(lens)).double().cpu()
    err = max(err, float((short - ref[q_rows]).abs().max()))
    out.append(_check("attention (PyTorch path)", "ok" if err < 1e-4 else "fail",
                      f"varlen causal SDPA on {device.type}: max error {err:.1e} against a dense fp64 reference "
                      f"({len(lens)} sequences, {H} heads over {KV} KV heads; queries as long as the keys and "
                      f"the last half of them)", "" if err < 1e-4 else
                      "report this: the PyTorch attention path disagrees with its reference", max_error=err))
    version = flash_version()
    if device.type != "cuda":
        out.append(_check("flash-attn", "skip", "flash-attn's kernels need a CUDA GPU" +
                          (f" ({version} is installed)" if version else ""), installed=version))
        return out
    if version is None:
        out.append(_check("flash-attn", "warn", "flash-attn is not installed: training uses the PyTorch attention path "
                          "(SDPA per sequence; slower on long sequences)", "`make install` fetches a prebuilt wheel "
                          "matching torch and CUDA when one exists; FLASH_ATTN_BUILD=1 make install builds it (long)"))
        return out
    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    try:
        fn = flash_attention_fn("bf16")
        qd, kd, vd = (t.to(device=device, dtype=dtype) for t in (q, k, v))
        fo = fn(qd, kd, vd, cud, cud, max(lens), max(lens)).double().cpu()
        to = torch_varlen_attention(qd, kd, vd, cud, cud, max(lens), max(lens)).double().cpu()
        e1, e2 = float((fo - to).abs().max()), float((fo - ref).abs().max())
    except Exception as e:  # noqa: BLE001
        out.append(_check("flash-attn", "fail", f"{version} imports but its varlen call failed: {_first_line(e)}",
                          "reinstall a wheel built for this torch and CUDA (make install), or use --attention torch",
                          installed=version))
        return out
    ok = e1 < 5e-2
    out.append(_check("flash-attn", "ok" if ok else "fail",
                      f"{version}: one varlen call ({dtype}, {T} tokens) against the PyTorch path: max error {e1:.1e} "
                      f"(against fp64: {e2:.1e})", "" if ok else "the kernel disagrees: use --attention torch",
                      installed=version, max_error=e1, max_error_fp64=e2))
    return out


def varlen_error(device: torch.device, dtype: torch.dtype) -> float:
    """Max difference between torch's ``varlen_attn`` (the workbench's kernel around it) and the
    PyTorch path on one call with GQA and queries shorter than keys (bottom-right), in ``dtype``."""
    from workbench.runtime.attention import varlen_attention_fn, torch_varlen_attention

    gen = torch.Generator().manual_seed(1)
    lens_q, lens_k, H, KV, hd = [40, 1, 64], [200, 7, 64], 8, 2, 64
    q, k, v = (torch.randn(sum(n), h, hd, generator=gen).to(device=device, dtype=dtype)
               for n, h in ((lens_q, H), (lens_k, KV), (lens_k, KV)))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device=device)
                  for n in (lens_q, lens_k))
    got = varlen_attention_fn("bf16")(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k)).double().cpu()
    want = torch_varlen_attention(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k)).double().cpu()
    return float((got - want).abs().max())


def _kernel_check(device: torch.device, precision: str) -> dict:
    """Which kernel ``--attention auto`` runs here, and on a GPU torch's ``varlen_attn`` on a call
    whose queries are shorter than its keys (context parallelism's) against the PyTorch path."""
    from workbench.runtime.attention import select_attention, varlen_version

    _, auto = select_attention("auto", device, precision)
    runs = f"--attention auto runs {auto} on {device.type} in {precision}"
    version = varlen_version()
    if device.type != "cuda":
        return _check("attention kernel", "ok", runs + " (torch's varlen kernel and flash-attn need CUDA)",
                      auto=auto, varlen=version)
    if version is None:
        return _check("attention kernel", "warn", runs + f"; torch {torch.__version__} has no varlen_attn with flash "
                      f"kernels", "torch >= 2.10 built with CUDA ships it (torch.nn.attention.varlen)", auto=auto)
    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    try:
        err = varlen_error(device, dtype)
    except Exception as e:  # noqa: BLE001
        return _check("attention kernel", "fail", runs + f"; varlen_attn failed: {_first_line(e)}",
                      "use --attention flash or torch, and report this", auto=auto, varlen=version)
    ok = err < 5e-2
    return _check("attention kernel", "ok" if ok else "fail",
                  runs + f"; varlen_attn ({dtype}, queries shorter than keys, bottom-right) against the PyTorch "
                  f"path: max error {err:.1e}", "" if ok else "the kernel disagrees: use --attention flash or torch",
                  auto=auto, varlen=version, max_error=err)


def _train_step_check(device: torch.device, precision: str, steps: int = 4) -> dict:
    """``steps`` steps of the tiny model on one process (ZeRO-0), timed and measured; returns the check."""
    from workbench.cost import CostModel, activation_bytes_per_token
    from workbench.cost.memory import loss_backward_bytes_per_token
    from workbench.models import get_model
    from workbench.runtime.attention import select_attention
    from workbench.runtime.groups import GroupRegistry
    from workbench.runtime.model import Transformer
    from workbench.runtime.step import StepExecutor
    from workbench.runtime.timing import Clock, PeakMemory, StepStats
    from workbench.runtime.zero import parallelize
    from workbench.solve.plan import build_plan
    from workbench.specs import ClusterSpec, load_profile

    spec = get_model("tiny")
    # on a GPU 96K tokens: at 8K the tiny model's activations (67 MiB) were smaller than what CUDA's
    # libraries allocate for themselves (about 70 MiB more on an H200), so the ratio said nothing
    lengths = [8192, 8192, 4096, 4096] * 4 if device.type == "cuda" else [400, 300, 200, 100]
    cost = CostModel(load_profile("cpu-gloo-tiny"), spec, ClusterSpec(num_gpus=1, gpus_per_node=1, gpu_memory_gb=80.0,
                                                                      zero_stage=0), precision=precision, optimizer="adamw")
    plan = build_plan("doctor", [[(1, list(range(len(lengths))))]], lengths, cost)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, spec.vocab, (n,), generator=gen) for n in lengths]
    attn, attn_name = select_attention("auto", device, precision)
    model = Transformer(spec, seed=0).to(device=device, dtype=torch.float32)
    zero = parallelize(model, zero_stage=0, precision=precision, device=device)
    opt = zero.make_optimizer("adamw", lr=1e-3)
    ex = StepExecutor(model, GroupRegistry(1, [1]), attn, device=device, zero=zero)
    clock, mem, stats = Clock(device), PeakMemory(device), StepStats(warmup=1)
    saved: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):  # what autograd keeps for backward (CPU has no allocator peak to read)
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = max(saved.get(st.data_ptr(), 0), st.nbytes())
        return t

    losses, cpu_peaks = [], []
    for _ in range(steps):
        saved.clear()
        mem.start()
        clock.mark()
        if device.type == "cpu":
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                res = ex.run(plan, seqs)
        else:
            res = ex.run(plan, seqs)
        opt.step()
        clock.mark()
        (ms,) = clock.intervals()
        peak = mem.peak()
        if peak is None:  # CPU: the states held plus everything saved for backward
            st = zero.state_bytes()
            peak = st["parameters_bytes"] + st["gradients_bytes"] + st["optimizer_bytes"] + sum(saved.values())
            cpu_peaks.append(peak)
        stats.add(ms, peak)
        opt.zero_grad(set_to_none=False)
        losses.append(res.loss)
    s = stats.summary()
    # the memory model's own figures (not a profile's measured activation bytes): model states as the
    # runtime holds them under ZeRO-0, activations by the per-token formula (autocast under bf16)
    states = cost.states.total
    act = activation_bytes_per_token(cost.model, False, autocast=precision == "bf16") * sum(lengths)
    # an allocator's peak (CUDA) also holds the loss backward's two (tokens, vocab) gradients for a
    # moment; the CPU figure counts what autograd saved, so it is compared without them
    loss = loss_backward_bytes_per_token(cost.model) * sum(lengths) if device.type == "cuda" else 0.0
    predicted = states + act + loss
    ratio = s["peak_bytes"] / predicted if s["peak_bytes"] else float("nan")
    finite = all(math.isfinite(x) for x in losses)
    timer = "CUDA events" if device.type == "cuda" else "perf_counter"
    how = ("allocator peak per step" if device.type == "cuda" else
           "states from tensor storage + tensors saved for backward")
    detail = (f"tiny model, 1 process, {precision}, attention {attn_name}, {sum(lengths):,} tokens: "
              f"{s['median_ms']:.1f} ms per step ({timer}, median of {s['used']}, the first ({s['first_ms']:.1f} ms) "
              f"left out); peak {s['peak_bytes'] / 2**20:.1f} MiB ({how}) vs predicted {predicted / 2**20:.1f} MiB "
              f"(states {states / 2**20:.1f} + activations {act / 2**20:.1f}"
              + (f" + the loss's backward {loss / 2**20:.1f}" if loss else "") + f"): {ratio:.2f}x")
    if not finite:
        return _check("training step", "fail", detail + f"; loss not finite ({losses})",
                      "report this: a step of the tiny model should never diverge", losses=losses)
    ok = 1 / MEMORY_OK_RATIO <= ratio <= MEMORY_OK_RATIO
    fix = "" if ok else ("the memory model misses this much here: plan with a lower --memory-fraction until it is "
                         "understood (the doctor's JSON has the figures)")
    return _check("training step", "ok" if ok else "warn", detail, fix, median_ms=s["median_ms"], first_ms=s["first_ms"],
                  peak_bytes=s["peak_bytes"], first_peak_bytes=s["first_peak_bytes"], predicted_bytes=predicted,
                  predicted_states_bytes=states, predicted_activation_bytes=act, predicted_loss_backward_bytes=loss,
                  ratio=ratio, losses=losses, precision=precision, attention=attn_name, tokens=sum(lengths), timer=timer)


def _nccl_world_of_one(device: torch.device, backend: str = "nccl") -> dict:
    """NCCL on this GPU alone: a process group of one rank (an in-memory store), then all-reduce,
    all-gather, reduce-scatter and all-to-all with their values checked (a world of one must return
    its input). What every CUDA run needs first: NCCL's communicator forms on this GPU. Never raises.
    (``backend`` gloo on a CPU ``device``: the same steps, for the tests.)"""
    import torch.distributed as dist

    from workbench.runtime.cp import all_gather_single, reduce_scatter_single

    name = f"{backend} (world 1)"
    if dist.is_initialized():
        return _check(name, "skip", "a process group exists in this process already")
    try:
        kw = {"device_id": device} if device.type == "cuda" else {}
        try:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kw)
        except TypeError:  # a torch without device_id
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        try:
            x = torch.arange(1 << 20, dtype=torch.float32, device=device)
            red = x.clone()
            dist.all_reduce(red)
            gathered = torch.empty_like(x)
            all_gather_single(gathered, x)
            scattered = torch.empty_like(x)
            reduce_scatter_single(scattered, x)
            a2a = torch.empty_like(x)
            dist.all_to_all_single(a2a, x)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            bad = [n for n, y in (("all-reduce", red), ("all-gather", gathered), ("reduce-scatter", scattered),
                                  ("all-to-all", a2a)) if not torch.equal(y, x)]
        finally:
            dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - a communicator that cannot form is the finding
        return _check(name, "fail", f"{backend} could not run on one device: {_first_line(e)}",
                      "check the driver against torch's CUDA build (nvidia-smi), and NCCL_DEBUG=INFO for NCCL's reason")
    if bad:
        return _check(name, "fail", f"{backend} on one device returned wrong values for {', '.join(bad)}",
                      "report this with the doctor's --json output")
    return _check(name, "ok", f"a process group of one rank on {device}: all-reduce, all-gather, reduce-scatter and "
                              f"all-to-all return their input, as a world of one must")


def probe(*, device: str = "auto", precision: str | None = None, nvidia_visible: bool = False) -> list[dict]:
    """The one-process checks (module docstring). Never raises: a check that crashes is a ``fail``."""
    out = [_check("python", "ok", f"Python {platform.python_version()} ({platform.python_implementation()}, "
                                  f"{platform.system().lower()} {platform.machine()})")]
    out.append(_torch_check(nvidia_visible))
    out += _gpu_checks(nvidia_visible)
    if device == "cuda" and not torch.cuda.is_available():
        out.append(_check("device", "fail", "--device cuda but torch sees no CUDA device", "use --device cpu or auto"))
        return out
    dev = torch.device("cuda", 0) if (device != "cpu" and torch.cuda.is_available()) else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        out.append(_nccl_world_of_one(dev))
    prec = precision or ("bf16" if dev.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32")
    for name, fn in (("attention", lambda: _attention_checks(dev) + [_kernel_check(dev, prec)]),
                     ("training step", lambda: [_train_step_check(dev, prec)])):
        try:
            out += fn()
        except Exception as e:  # noqa: BLE001 - a crashing check is a finding
            traceback.print_exc(file=sys.stderr)
            out.append(_check(name, "fail", f"crashed: {_first_line(e)}", "report this with the doctor's --json output"))
    return out


# ------------------------------------------------------------------------------------------------
# two ranks
# ------------------------------------------------------------------------------------------------


def _collective_checks(device: torch.device, rank: int, world: int, backend: str) -> list[dict]:
    """All-to-all and all-gather on the default group: values checked, the all-to-all timed (CUDA
    events on GPUs, 64 MiB; 4 MiB with gloo on CPU), the first call left out."""
    import torch.distributed as dist

    from workbench.runtime.cp import all_gather_single
    from workbench.runtime.timing import Clock

    def barrier() -> None:
        dist.barrier(device_ids=[device.index]) if device.type == "cuda" else dist.barrier()

    out = []
    # all-to-all: rank r sends block j (filled with 100*r + j) to rank j
    n = 1 << 20
    send = torch.cat([torch.full((n,), 100.0 * rank + j, device=device) for j in range(world)])
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    want = torch.cat([torch.full((n,), 100.0 * j + rank, device=device) for j in range(world)])
    a2a_ok = bool(torch.equal(recv, want))
    # all-gather: every rank's block, in rank order
    mine = torch.full((n,), float(rank + 1), device=device)
    gathered = torch.empty(world * n, device=device)
    all_gather_single(gathered, mine)
    ag_ok = bool(torch.equal(gathered, torch.cat([torch.full((n,), float(r + 1), device=device) for r in range(world)])))
    # bandwidth of one large all-to-all, the first call left out
    big = torch.empty((16 if device.type == "cuda" else 1) << 20, device=device)
    big_out = torch.empty_like(big)
    clock, times = Clock(device), []
    for _ in range(6):
        barrier()
        clock.mark()
        dist.all_to_all_single(big_out, big)
        clock.mark()
        times += clock.intervals()
    ms = sorted(times[1:])[len(times[1:]) // 2]
    gbps = big.numel() * 4 * (world - 1) / world / (ms / 1e3) / 1e9
    mib = big.numel() * 4 >> 20
    timer = "CUDA events" if device.type == "cuda" else "perf_counter"
    per = "per GPU" if device.type == "cuda" else "per rank, loopback"
    out.append(_check(f"{backend} all-to-all", "ok" if a2a_ok else "fail",
                      f"{world} ranks: values {'right' if a2a_ok else 'WRONG'}; {mib} MiB in {ms:.2f} ms, {gbps:.2f} GB/s "
                      f"{per} ({timer}, median of 5 after one warm-up)",
                      "" if a2a_ok else f"{backend} returned wrong data: check the driver, NCCL_P2P_DISABLE, and "
                                        f"nvidia-smi topo -m", gbps=gbps, ms=ms))
    out.append(_check(f"{backend} all-gather", "ok" if ag_ok else "fail",
                      f"{world} ranks: values {'right' if ag_ok else 'WRONG'}",
                      "" if ag_ok else f"{backend} returned wrong data: check the driver and its environment"))
    return out


def _sharded_check(device: torch.device, precision: str, backend: str) -> dict:
    """One SGD step of the tiny model on 2 ranks under ZeRO-3 (FSDP2, lockstep: a degree-2 group and
    two degree-1 groups over two passes) and under ZeRO-0 (free), from the same weights on the same
    batch; the updates compared tensor by tensor."""
    import torch.distributed as dist

    from workbench.cost import CostModel
    from workbench.models import get_model
    from workbench.runtime.attention import select_attention
    from workbench.runtime.groups import GroupRegistry
    from workbench.runtime.model import Transformer
    from workbench.runtime.step import StepExecutor
    from workbench.runtime.zero import parallelize
    from workbench.solve.plan import build_plan
    from workbench.specs import ClusterSpec, load_profile

    spec = get_model("tiny")
    lengths = [97, 64, 33, 20, 9]
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, spec.vocab, (n,), generator=gen) for n in lengths]
    registry = GroupRegistry(2, [1, 2])
    attn, attn_name = select_attention("auto", device, precision)
    results = {}
    for stage in (3, 0):
        cost = CostModel(load_profile("cpu-gloo-tiny"), spec, ClusterSpec(num_gpus=2, gpus_per_node=2, gpu_memory_gb=80.0,
                                                                          zero_stage=stage), precision=precision,
                         optimizer="sgd")
        micro = [[(2, [0, 2])], [(1, [1, 4]), (1, [3])]]
        plan = build_plan(f"doctor-zero{stage}", micro, lengths, cost, blocks=[[0], [0, 1]])
        model = Transformer(spec, seed=2).to(device=device, dtype=torch.float32)
        init = {n: p.detach().clone() for n, p in model.named_parameters()}
        zero = parallelize(model, zero_stage=stage, precision=precision, device=device)
        opt = zero.make_optimizer("sgd", lr=0.5)
        res = StepExecutor(model, registry, attn, device=device, zero=zero).run(plan, seqs)
        opt.step()
        full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu() for n, p in
                model.named_parameters()}
        results[stage] = (full, res.loss, {n: t.float().cpu() for n, t in init.items()})
    (f3, l3, init), (f0, l0, _) = results[3], results[0]
    worst = max(float((f3[n] - init[n] - (f0[n] - init[n])).norm() / (f0[n] - init[n]).norm().clamp_min(1e-30))
                for n in f0)
    tol = 1e-4 if precision == "fp32" else 5e-2
    ok = worst < tol and math.isfinite(l3) and abs(l3 - l0) <= tol * max(1.0, abs(l0))
    world = dist.get_world_size()
    return _check("sharded step (ZeRO-3)", "ok" if ok else "fail",
                  f"{world} ranks, {backend}, {precision}, attention {attn_name}: one SGD step of the tiny model under "
                  f"ZeRO-3 (FSDP2, lockstep passes, a degree-2 Ulysses group) against ZeRO-0: worst relative update "
                  f"difference {worst:.1e} (tolerance {tol:g}), loss {l3:.4f} vs {l0:.4f}",
                  "" if ok else "the sharded path disagrees with the replicated one: report it with this output",
                  worst=worst, loss_zero3=l3, loss_zero0=l0, backend=backend)


def dist_check(rank: int, world: int, port: int, listen_fd: int | None, out: str | None, precision: str | None,
               timeout_s: float) -> int:
    """One rank of the 2-rank checks; rank 0 writes the checks as JSON to ``out``."""
    import torch.distributed as dist

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cuda = gpus >= world
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)  # before the process group: NCCL binds this rank's GPU
    backend = "nccl" if cuda else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    kw = {"master_listen_fd": listen_fd} if listen_fd is not None else {}
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout, **kw)
    bind = {"device_id": device} if cuda else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **bind)
    checks = []
    try:
        if cuda:
            checks += _collective_checks(device, rank, world, "nccl")
        else:
            why = (f"one GPU here: NCCL needs {world}" if gpus == 1 else "no GPU here") + \
                  "; the same collectives were checked with gloo"
            checks.append(_check("nccl all-to-all", "skip", why))
            checks.append(_check("nccl all-gather", "skip", why))
            checks += _collective_checks(device, rank, world, "gloo")
        prec = precision or ("bf16" if cuda and torch.cuda.is_bf16_supported() else "fp32")
        checks.append(_sharded_check(device, prec, backend))
    except Exception as e:  # noqa: BLE001
        traceback.print_exc(file=sys.stderr)
        checks.append(_check("sharded step (ZeRO-3)", "fail", f"crashed on rank {rank}: {_first_line(e)}",
                             "report this with the doctor's --json output"))
    if rank == 0 and out:
        with open(out, "w") as f:
            json.dump(checks, f)
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workbench.runtime.probe", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("probe")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--precision", default=None, choices=["bf16", "fp32"])
    p.add_argument("--nvidia-visible", action="store_true")
    d = sub.add_parser("dist")
    d.add_argument("--rank", type=int, required=True)
    d.add_argument("--world", type=int, default=2)
    d.add_argument("--port", type=int, required=True)
    d.add_argument("--listen-fd", type=int, default=None)
    d.add_argument("--out", default=None)
    d.add_argument("--precision", default=None, choices=["bf16", "fp32"])
    d.add_argument("--timeout", type=float, default=120.0)
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    if args.mode == "probe":
        print(json.dumps(probe(device=args.device, precision=args.precision, nvidia_visible=args.nvidia_visible)))
        return 0
    return dist_check(args.rank, args.world, args.port, args.listen_fd, args.out, args.precision, args.timeout)


if __name__ == "__main__":
    from workbench.util import exit_process

    exit_process(main())
