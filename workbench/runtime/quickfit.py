"""Quick fit: measure this machine's compute (and, under a process group, collectives) for one
``ModelSpec`` and return a ``HardwareProfile`` the cost model can use.

Protocol (Galvatron's, made small): for a handful of packs of sequences (single sequences of a few
lengths, and packs of short ones), time the forward (model + loss) and the backward of the model
on this device, ``warmup`` untimed runs then ``reps`` timed ones, keep the median. Under
``torch.distributed`` every rank measures at the same time (so ranks sharing a machine contend as
they do in training) and the per-pack medians are combined with the median over ranks. Then
``t = a * sum(s^2) + b * sum(s) + c`` is fitted per pack by non-negative least squares on
relative error, separately for forward and backward.

What "per layer" means here: the profile's curves are per transformer layer and the cost model
multiplies them by ``layers``. We time the whole model (embedding, blocks, output head, loss)
and divide by ``layers``, so the head's cost, which is not small for the tiny model, is not
lost; the cost model's scaling to other models counts the head in its linear term the same way.
``scope="layer"`` times one block alone instead.

Collectives (only under a process group): all-to-all bandwidth per rank for every aligned group
size (all blocks of a size at once, as concurrent SP groups run in training), and the all-reduce
bus bandwidth of the whole world. Without a process group the all-to-all table is a documented
estimate (provenance says so).

Run it: ``python -m workbench.runtime.quickfit --model tiny --out PATH`` (one process) or under
``torchrun --nproc-per-node N`` to include collectives. Returns/writes a HardwareProfile JSON.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import itertools
import os
import platform
import statistics
import sys
import time
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from workbench.specs import ComputeCurve, HardwareProfile, ModelSpec, get_model

__all__ = ["DEFAULT_PACKS", "measure_compute", "fit_curve", "nnls", "measure_activation_mb_per_token",
           "measure_collectives", "quickfit", "main"]

DEFAULT_PACKS: tuple[tuple[int, ...], ...] = (
    (64,), (256,), (1024,), (2048,), (4096,),
    (64,) * 16, (256,) * 8, (1024, 512, 256, 128, 64, 64),
)
"""Packs timed by default: single sequences (the s^2 term) and packs of short ones (the per-token
and per-sequence costs of the varlen path)."""

# Without a process group there is nothing to measure: gloo over loopback/shared memory moves a
# few hundred MB/s to ~1 GB/s per rank on a small VM (what this file measured on a 2-core VM:
# see cpu-gloo-tiny.json). Used only when quickfit runs without torch.distributed.
ESTIMATED_ALL_TO_ALL_GBPS = {2: 0.5, 4: 0.3, 8: 0.2}


# ------------------------------------------------------------------------------------------------
# least squares with non-negative coefficients
# ------------------------------------------------------------------------------------------------


def nnls(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares ``min ||X w - y||`` s.t. ``w >= 0`` for a few columns, exactly:
    every subset of active columns is solved by ordinary least squares and the best non-negative
    solution kept. Returns ``w`` (zeros where a column is dropped)."""
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    k = X.shape[1]
    if k > 8:
        raise ValueError(f"nnls enumerates column subsets; {k} columns is too many")
    best, best_res = np.zeros(k), float(np.sum(y * y))
    for r in range(1, k + 1):
        for cols in itertools.combinations(range(k), r):
            w_sub, *_ = np.linalg.lstsq(X[:, cols], y, rcond=None)
            if np.any(w_sub < 0):
                continue
            w = np.zeros(k)
            w[list(cols)] = w_sub
            res = float(np.sum((X @ w - y) ** 2))
            if res < best_res - 1e-18:
                best, best_res = w, res
    return best


def fit_curve(packs: Sequence[Sequence[int]], times_ms: Sequence[float]) -> ComputeCurve:
    """Fit ``t = a*sum(s^2) + b*sum(s) + c`` to measured pack times (ms), non-negative, minimising
    relative error (so short packs count as much as long ones). Returns a ComputeCurve."""
    X = np.array([[sum(s * s for s in p), sum(p), 1.0] for p in packs], dtype=np.float64)
    t = np.asarray(times_ms, dtype=np.float64)
    if len(t) != len(X) or len(t) < 3:
        raise ValueError(f"need at least 3 measured packs with one time each, got {len(X)} packs, {len(t)} times")
    w = 1.0 / np.maximum(t, 1e-9)
    coef = nnls(X * w[:, None], t * w)
    return ComputeCurve(a=float(coef[0]), b=float(coef[1]), c=float(coef[2]))


# ------------------------------------------------------------------------------------------------
# measuring compute
# ------------------------------------------------------------------------------------------------


def _pack_inputs(pack: Sequence[int], vocab: int, device: torch.device, gen: torch.Generator):
    from workbench.runtime.step import make_shard

    seqs = [torch.randint(0, vocab, (int(s),), generator=gen) for s in pack]
    sh = make_shard(seqs, 1, 0)
    return (sh.tokens.to(device), sh.positions.to(device), sh.cu_seqlens.to(device), sh.max_seqlen,
            sh.labels.to(device))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_compute(spec: ModelSpec, packs: Sequence[Sequence[int]] = DEFAULT_PACKS, *, warmup: int = 1,
                    reps: int = 3, device: torch.device | str = "cpu", attention: str = "torch",
                    scope: str = "model", dtype: torch.dtype = torch.float32, seed: int = 0) -> list[dict]:
    """Time forward and backward of ``spec`` on each pack: median over ``reps`` after ``warmup``.

    Returns ``[{"pack": [...], "tokens": n, "forward_ms": per layer, "backward_ms": per layer}]``
    (whole model divided by ``layers`` for ``scope="model"``, one block for ``scope="layer"``).
    Raises ValueError for a pack longer than the model's context or an unknown scope.
    """
    from workbench.runtime.attention import select_attention
    from workbench.runtime.model import Block, Transformer, rotary_cos_sin

    if scope not in ("model", "layer"):
        raise ValueError(f"scope must be 'model' or 'layer', got {scope!r}")
    dev = torch.device(device)
    attn, _ = select_attention(attention, dev)
    torch.manual_seed(seed)
    if scope == "model":
        net = Transformer(spec, seed=seed).to(device=dev, dtype=dtype)
    else:
        net = Block(spec).to(device=dev, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for pack in packs:
        if max(pack) > spec.max_context:
            raise ValueError(f"pack {list(pack)} has a sequence longer than {spec.name}'s context {spec.max_context}")
        tokens, positions, cu, max_s, labels = _pack_inputs(pack, spec.vocab, dev, gen)
        if scope == "layer":
            x0 = torch.randn(tokens.numel(), spec.hidden, generator=gen).to(device=dev, dtype=dtype)
            cos, sin = rotary_cos_sin(positions, spec.head_dim, dtype=dtype)
        fwd, bwd = [], []
        for r in range(warmup + reps):
            net.zero_grad(set_to_none=True)
            _sync(dev)
            t0 = time.perf_counter()
            if scope == "model":
                logits = net(tokens, positions, cu, max_s, attn)  # (T, vocab)
                out = F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")
            else:
                x = x0.detach().requires_grad_(True)
                out = net(x, cos, sin, cu, max_s, attn).float().square().sum()  # a scalar to differentiate
            _sync(dev)
            t1 = time.perf_counter()
            out.backward()
            _sync(dev)
            t2 = time.perf_counter()
            if r >= warmup:
                fwd.append((t1 - t0) * 1e3)
                bwd.append((t2 - t1) * 1e3)
        per = spec.layers if scope == "model" else 1
        rows.append({"pack": [int(s) for s in pack], "tokens": int(sum(pack)),
                     "forward_ms": statistics.median(fwd) / per, "backward_ms": statistics.median(bwd) / per})
    return rows


def measure_activation_mb_per_token(spec: ModelSpec, length: int = 512, *, device: torch.device | str = "cpu",
                                    dtype: torch.dtype = torch.float32) -> float:
    """Activation memory of the whole model per token (MB), measured as the bytes of the distinct
    tensors autograd saves for backward in one forward of ``length`` tokens (parameters excluded),
    divided by ``length``. Device independent, so it is measured the same on CPU and GPU."""
    from workbench.runtime.attention import torch_varlen_attention
    from workbench.runtime.model import Transformer

    dev = torch.device(device)
    net = Transformer(spec, seed=0).to(device=dev, dtype=dtype)
    param_ptrs = {p.data_ptr() for p in net.parameters()}
    seen: dict[tuple, int] = {}

    def pack(t: torch.Tensor):
        if t.device.type != "meta" and t.untyped_storage().data_ptr() not in param_ptrs:
            key = (t.untyped_storage().data_ptr(), t.device.type)
            seen[key] = max(seen.get(key, 0), t.untyped_storage().nbytes())
        return t

    gen = torch.Generator().manual_seed(0)
    tokens, positions, cu, max_s, labels = _pack_inputs([length], spec.vocab, dev, gen)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = net(tokens, positions, cu, max_s, torch_varlen_attention)  # (T, vocab)
        loss = F.cross_entropy(logits.float(), labels, reduction="sum")
    del loss
    return sum(seen.values()) / length / 1e6


# ------------------------------------------------------------------------------------------------
# measuring collectives (under torch.distributed)
# ------------------------------------------------------------------------------------------------


def _median_over_ranks(values: Sequence[float]) -> list[float]:
    import torch.distributed as dist

    t = torch.tensor(list(values), dtype=torch.float64)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.stack(out).median(dim=0).values.tolist()


def measure_collectives(*, message_mb: float = 4.0, warmup: int = 2, reps: int = 5,
                        registry=None) -> dict:
    """All-to-all bandwidth per rank by group size and all-reduce bus bandwidth of the world, in
    GB/s (1e9 bytes), under an initialised process group (CPU tensors: gloo).

    All aligned blocks of a size run their all-to-all at once (as concurrent SP groups do). The
    all-to-all figure is the bytes a rank sends to others, ``size * (d-1)/d``, over the time; the
    all-reduce figure is ``2 (n-1)/n * size`` over the time. Times are medians over reps, then over
    ranks. Returns ``{"all_to_all_gbps": {d: GB/s}, "allreduce_gbps": {n: GB/s}}``.
    """
    import torch.distributed as dist

    from workbench.runtime.groups import GroupRegistry

    n = dist.get_world_size()
    rank = dist.get_rank()
    degrees = [d for d in (2 ** i for i in range(1, 16)) if d <= n and n % d == 0]
    registry = registry or GroupRegistry(n, [1, *degrees])
    numel = int(message_mb * 1e6 / 4)
    a2a: dict[int, float] = {}
    for d in degrees:
        numel_d = numel // d * d
        send = torch.randn(numel_d)
        recv = torch.empty_like(send)
        block = tuple(range(rank // d * d, rank // d * d + d))
        group = registry.get(block)
        times = []
        for r in range(warmup + reps):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_to_all_single(recv, send, group=group)
            if r >= warmup:
                times.append(time.perf_counter() - t0)
        t = _median_over_ranks([statistics.median(times)])[0]
        a2a[d] = numel_d * 4 * (d - 1) / d / t / 1e9
    allreduce: dict[int, float] = {}
    if n > 1:
        buf = torch.randn(numel)
        times = []
        for r in range(warmup + reps):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            if r >= warmup:
                times.append(time.perf_counter() - t0)
        t = _median_over_ranks([statistics.median(times)])[0]
        allreduce[n] = 2 * (n - 1) / n * numel * 4 / t / 1e9
    return {"all_to_all_gbps": a2a, "allreduce_gbps": allreduce}


# ------------------------------------------------------------------------------------------------
# the profile
# ------------------------------------------------------------------------------------------------


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gb() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return 8.0


def quickfit(spec: ModelSpec | str = "tiny", *, packs: Sequence[Sequence[int]] = DEFAULT_PACKS, warmup: int = 1,
             reps: int = 3, device: torch.device | str = "cpu", attention: str = "torch", scope: str = "model",
             name: str | None = None, where: str | None = None, collectives: bool | None = None) -> HardwareProfile:
    """Measure and fit a HardwareProfile for ``spec`` on this machine (see the module docstring).

    ``collectives=None`` measures them when torch.distributed is initialised. Under a process group
    every rank must call this together; all ranks return the same profile. Raises ValueError on a
    pack longer than the model's context.
    """
    import torch.distributed as dist

    spec = get_model(spec) if isinstance(spec, str) else spec
    dev = torch.device(device)
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    t_start = time.perf_counter()
    if distributed:
        dist.barrier()
    rows = measure_compute(spec, packs, warmup=warmup, reps=reps, device=dev, attention=attention, scope=scope)
    if distributed:
        fwd = _median_over_ranks([r["forward_ms"] for r in rows])
        bwd = _median_over_ranks([r["backward_ms"] for r in rows])
        for r, f, b in zip(rows, fwd, bwd):
            r["forward_ms"], r["backward_ms"] = f, b
    forward = fit_curve([r["pack"] for r in rows], [r["forward_ms"] for r in rows])
    backward = fit_curve([r["pack"] for r in rows], [r["backward_ms"] for r in rows])
    act_mb = measure_activation_mb_per_token(spec, device=dev)
    if collectives is None:
        collectives = distributed and world > 1
    if collectives:
        coll = measure_collectives()
        a2a, allreduce, comm_kind = coll["all_to_all_gbps"], coll["allreduce_gbps"], "measured"
    else:
        a2a, allreduce, comm_kind = dict(ESTIMATED_ALL_TO_ALL_GBPS), {}, "estimate"
    if not a2a:  # one rank: nothing to measure
        a2a, comm_kind = dict(ESTIMATED_ALL_TO_ALL_GBPS), "estimate"
    threads = torch.get_num_threads()
    if dev.type == "cuda":
        gpu = torch.cuda.get_device_name(dev)
        mem_gb = torch.cuda.get_device_properties(dev).total_memory / 1e9
    else:
        gpu = f"CPU {_cpu_name()} ({os.cpu_count()} cores)"
        mem_gb = _memory_gb()
    fit_err = {}
    for key, curve in (("forward_ms", forward), ("backward_ms", backward)):
        pred = np.array([curve.a * sum(s * s for s in r["pack"]) + curve.b * sum(r["pack"]) + curve.c for r in rows])
        meas = np.array([r[key] for r in rows])
        fit_err[key] = float(np.max(np.abs(pred / meas - 1.0)))
    where = where or (f"{platform.node() or 'unknown host'}: {gpu}, {world} rank(s) measuring at once, "
                      f"{threads} thread(s) each, torch {torch.__version__}")
    provenance = {
        "kind": "measured",
        "method": "quickfit",
        "where": where,
        "when": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "source": "workbench.runtime.quickfit",
        "scope": ("whole model (embedding, blocks, head, loss) timed, divided by layers" if scope == "model"
                  else "one transformer block timed alone"),
        "protocol": f"{warmup} warm-up + {reps} timed runs per pack, median; median over {world} rank(s); "
                    f"non-negative least squares on relative error",
        "attention": attention,
        "device": dev.type,
        "world_size": world,
        "threads_per_rank": threads,
        "collectives": comm_kind,
        "max_relative_fit_error": fit_err,
        "measurements": rows,
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    if comm_kind == "estimate":
        provenance["collectives_note"] = ("all_to_all_gbps is an estimate for gloo on one CPU machine "
                                          "(run quickfit under torchrun to measure it)")
    return HardwareProfile(
        name=name or f"{dev.type}-{'gloo' if dev.type == 'cpu' else 'nccl'}-{spec.name}",
        gpu=gpu, model=spec.name, forward=forward, backward=backward, all_to_all_gbps=a2a,
        allreduce_gbps=allreduce, activation_mb_per_token=act_mb, gpu_memory_gb=round(mem_gb, 1),
        provenance=provenance)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m workbench.runtime.quickfit [--model tiny] [--out PATH]``; under torchrun it also
    measures collectives. Rank 0 writes the profile (atomically) or prints it."""
    ap = argparse.ArgumentParser(prog="python -m workbench.runtime.quickfit", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--out", default=None, help="profile JSON to write (default: print it)")
    ap.add_argument("--name", default=None)
    ap.add_argument("--where", default=None, help="a sentence saying which machine this is")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--scope", choices=("model", "layer"), default="model")
    ap.add_argument("--max-len", type=int, default=None, help="drop packs with a sequence longer than this")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--attention", default="torch")
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if distributed:
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=_dt.timedelta(seconds=300))
    packs = [p for p in DEFAULT_PACKS if args.max_len is None or max(p) <= args.max_len]
    prof = quickfit(args.model, packs=packs, warmup=args.warmup, reps=args.reps, device=args.device,
                    attention=args.attention, scope=args.scope, name=args.name, where=args.where)
    rank = 0
    if distributed:
        import torch.distributed as dist

        rank = dist.get_rank()
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        if args.out:
            prof.save(args.out)
            print(f"wrote {args.out}", file=sys.stderr)
        else:
            print(prof.to_json(indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
