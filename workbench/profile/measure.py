"""The profiler's measuring side: one process per rank under torchrun, started by the launcher.

    python -m workbench.launch.supervisor --run-dir RUN --nproc N --module workbench.profile.measure
    (what ``workbench profile`` and ``workbench.profile.start_profile`` do)

Reads ``RUN/spec.json`` (a :class:`~workbench.profile.ProfileSpec`) and, on every rank at once (so
ranks that share a machine contend as they do in training):

1. **compute**: for each pack of the grid, forward (model + loss) and backward of the runtime's own
   model and attention backend, ``warmup`` untimed runs then ``reps`` timed ones, each after a
   barrier; CUDA events on GPU, ``time.perf_counter`` around synchronised work elsewhere. The
   whole model (embedding, blocks, head, loss) is timed and divided by ``layers``; the head alone
   (embedding, final norm, head and loss) is timed too, at three lengths, so the fit can take its
   per-token part out of the blocks' curves. Per rank the trimmed median; the agreed figure is the
   median over ranks (every rank's is kept).
2. **collectives**: for every group size (``workbench.profile.default_group_sizes``: every size up
   to 8, 3 and 6 included, then the ones that tile the ranks; a size that does not divide the world
   runs on its aligned blocks, the ranks left over idle), the Ulysses all-to-all
   (``all_to_all_single`` on every aligned block at once, as concurrent SP groups run it),
   ``collective_inner`` calls back to back per repetition, at several message sizes so latency and bandwidth can both be fitted; the
   all-reduce of the whole world (gradient sync); FSDP's all-gather and reduce-scatter over the
   world, also at the sizes of the model's FSDP units; point-to-point ring steps inside each block
   (ring attention); context parallelism's K/V all-gather and gradient reduce-scatter for every CP
   size c, on the strided CP sub-groups of the largest group c divides (all at once, as the CP
   attention runs them). Agreed over ranks the same way.
3. **SP groups**: one micro-step of the runtime's own sequence-parallel path (slices, Ulysses
   all-to-alls around the varlen attention, forward and backward) for every micro-step size
   (``workbench.profile.micro_step_sizes``: the power-of-two group sizes dividing the world) and a few
   packs, all blocks at once; what it costs beyond the compute and collective fits is the
   profile's per-degree ``sp_overhead_ms``. The same for context-parallel splits
   (``CPAttention``: ``1 x c`` for every c, and ``u x c`` of the largest group where the heads
   allow, both on the CP packs): the ``1 x c`` extra is ``cp_overhead_ms``, ``cp_token_ms`` and
   ``cp_attention_factor``, what a ``u x c`` split costs beyond the sum of its parts
   ``split_overhead_ms`` and ``split_token_ms``.
   **Real steps**: the StepExecutor runs small plans (``default_step_cases``) under ZeRO-3 (FSDP2,
   lockstep passes, idle ranks in empty passes) and ZeRO-0 (free micro-steps), each followed by an
   optimizer step timed apart: a micro-step's and a pass's fixed costs, the pass's compute factor,
   the optimizer per parameter. SP micro-steps and real steps are sampled in the same rounds as the
   compute packs (the same load).
4. **memory**: on CUDA the peak allocated bytes of a forward at two lengths (their difference per
   token: activations) and the allocated bytes of parameters, gradients and AdamW states (model
   states); on CPU the same figures computed from the model (bytes of the tensors autograd saves,
   bytes of parameters and optimizer states), labelled so.
5. **host**: the node's memory (``psutil``), and on CUDA the pinned host-device link
   (:func:`measure_host_link`: 256 MiB copies each way, rank 0 alone, then every rank at once); on
   CPU there is no host link (none recorded, so plans made with the profile do not offload).

Rank 0 writes progress to ``status.json`` (``runs.update_status``), then fits
(``workbench.profile.result.build_result``) and writes ``measurements.json``,
``profile_result.json`` and ``profile.json`` (and the ``out`` copy). A rank that fails writes
``failures/rank<k>.json``; errors found before the first collective are agreed on by every rank,
so none is left waiting.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import math
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from workbench import runs
from workbench.models import get_model
from workbench.profile import ProfileSpec, read_profile_spec
from workbench.profile.fit import trimmed_median
from workbench.profile.machine import cpu_name, machine_fingerprint
from workbench.profile.result import MEASUREMENTS_FILE, RESULT_FILE, build_result
from workbench.specs import ModelSpec
from workbench.util import write_json_atomic

__all__ = ["Clock", "measure_compute", "measure_collectives", "measure_groups", "measure_compute_and_groups",
           "measure_steps", "measure_memory", "measure_optimizer", "measure_host_link", "host_memory_gb", "agree",
           "main", "HOST_COPY_BYTES"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _say(msg: str) -> None:
    sys.stderr.write(msg + "\n")  # one write: lines of ranks sharing log.txt do not interleave
    sys.stderr.flush()


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------


from workbench.runtime.cp import all_gather_single, reduce_scatter_single  # noqa: E402 - torch 2.13's names or the older
from workbench.runtime.timing import Clock  # noqa: E402 - CUDA events on a GPU; shared with the doctor


def _barrier(device: torch.device) -> None:
    if dist.is_available() and dist.is_initialized():
        if device.type == "cuda":
            dist.barrier(device_ids=[device.index])
        else:
            dist.barrier()


def agree(values: Sequence[float], device: torch.device) -> tuple[list[float], list[list[float]]]:
    """Every rank's ``values`` gathered on every rank: ``(median over ranks, per rank)``. Without a
    process group: the values themselves."""
    vals = [float(v) for v in values]
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return vals, [vals]
    t = torch.tensor(vals, dtype=torch.float64, device=device)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    per_rank = [o.cpu().tolist() for o in out]
    med = [float(statistics.median(col)) for col in zip(*per_rank)] if vals else []
    return med, per_rank


# ------------------------------------------------------------------------------------------------
# compute
# ------------------------------------------------------------------------------------------------


def _pack_inputs(pack: Sequence[int], vocab: int, device: torch.device, gen: torch.Generator):
    from workbench.runtime.step import make_shard

    seqs = [torch.randint(0, vocab, (int(s),), generator=gen) for s in pack]
    sh = make_shard(seqs, 1, 0)
    return (sh.tokens.to(device), sh.positions.to(device), sh.cu_seqlens.to(device), sh.max_seqlen,
            sh.labels.to(device))


def _agree_max(value: int, device: torch.device) -> int:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _round_robin(cases: Sequence[Callable[[], list[float]]], *, device: torch.device, warmup: int, reps: int,
                 min_sample_ms: float, progress: Callable[[int], None] | None = None) -> tuple[list, list[int]]:
    """Time ``cases`` (each a callable doing one call and returning its intervals in ms) on every rank
    at once: per case ``warmup`` untimed samples, which also fix ``k``, the calls one sample makes
    back to back (the smallest count lasting ``min_sample_ms``; the largest any rank needs, so every
    rank makes the same calls); then ``reps`` rounds, each sampling every case once after a
    barrier. Round-robin: load from elsewhere on the machine, and any drift, spreads over every
    case alike instead of landing on the ones measured last. Returns ``(samples, ks)`` with
    ``samples[case][rep]`` the intervals of one call (averaged over the sample's k calls)."""

    def sample(i: int, k: int) -> list[float]:
        _barrier(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        total = None
        for _ in range(k):
            iv = cases[i]()
            total = iv if total is None else [a + b for a, b in zip(total, iv)]
        return [t / k for t in total]

    ks = []
    for i in range(len(cases)):
        k = 1
        for _ in range(max(1, warmup)):
            one = sum(sample(i, 1))
            k = max(k, math.ceil(min_sample_ms / max(one, 1e-3))) if min_sample_ms > 0 else 1
        ks.append(_agree_max(k, device))
    out: list[list[list[float]]] = [[] for _ in cases]
    for r in range(reps):
        for i in range(len(cases)):
            out[i].append(sample(i, ks[i]))
            if progress is not None:
                progress(r * len(cases) + i)
    return out, ks


def _compute_cases(spec: ModelSpec, net, packs, attn, dev: torch.device, clock: Clock, gen) -> list[Callable]:
    cases = []
    for pack in packs:
        if max(pack) > spec.max_context:
            raise ValueError(f"pack {list(pack)} has a sequence longer than {spec.name}'s context {spec.max_context}")
        inp = _pack_inputs(pack, spec.vocab, dev, gen)

        def once(inp=inp) -> list[float]:
            tokens, positions, cu, max_s, labels = inp
            net.zero_grad(set_to_none=True)
            clock.mark()
            logits = net(tokens, positions, cu, max_s, attn)  # (T, vocab)
            loss = F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")
            clock.mark()
            loss.backward()
            clock.mark()
            return clock.intervals()  # [forward, backward]

        cases.append(once)
    return cases


def _head_cases(spec: ModelSpec, net, token_counts, dev: torch.device, clock: Clock, gen) -> list[Callable]:
    """What is not a transformer block, timed alone: the embedding, the final norm, the output head
    and the loss (forward, then backward) of one sequence of each token count."""
    cases = []
    for n in token_counts:
        inp = _pack_inputs([int(n)], spec.vocab, dev, gen)

        def once(inp=inp) -> list[float]:
            tokens, _, _, _, labels = inp
            net.zero_grad(set_to_none=True)
            clock.mark()
            logits = net.head(net.norm(net.embed(tokens)))  # (T, vocab)
            loss = F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")
            clock.mark()
            loss.backward()
            clock.mark()
            return clock.intervals()  # [forward, backward]

        cases.append(once)
    return cases


def _head_rows(token_counts, samples, trim: float, device: torch.device) -> list[dict]:
    fwd = [trimmed_median([x[0] for x in smp], trim) for smp in samples]
    bwd = [trimmed_median([x[1] for x in smp], trim) for smp in samples]
    f, f_ranks = agree(fwd, device)
    b, b_ranks = agree(bwd, device)
    return [{"tokens": int(n), "forward_ms": f[i], "backward_ms": b[i],
             "per_rank": {"forward_ms": [x[i] for x in f_ranks], "backward_ms": [x[i] for x in b_ranks]}}
            for i, n in enumerate(token_counts)]


def _compute_rows(spec: ModelSpec, packs, samples, ks, trim: float) -> list[dict]:
    rows = []
    for pack, smp, k in zip(packs, samples, ks):
        fwd, bwd = [x[0] for x in smp], [x[1] for x in smp]
        rows.append({"pack": [int(s) for s in pack], "tokens": int(sum(pack)),
                     "forward_ms": trimmed_median(fwd, trim) / spec.layers,
                     "backward_ms": trimmed_median(bwd, trim) / spec.layers,
                     "forward_all": fwd, "backward_all": bwd, "calls_per_sample": k})
    return rows


def measure_compute(spec: ModelSpec, packs: Sequence[Sequence[int]], *, attn: Callable, warmup: int = 1,
                    reps: int = 3, trim: float = 0.2, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32, seed: int = 0, min_sample_ms: float = 0.0,
                    progress: Callable[[int], None] | None = None) -> list[dict]:
    """Time forward (model + loss) and backward of ``spec`` on each pack, this rank alone (under a
    process group every rank times at once, each sample after a barrier), with the round-robin
    protocol of :func:`_round_robin` (``min_sample_ms`` per sample, ``reps`` rounds).

    Returns ``[{"pack", "tokens", "forward_ms", "backward_ms" (per layer, trimmed median),
    "forward_all", "backward_all" (whole model, every timed sample, per call), "calls_per_sample"}]``.
    Raises ValueError for a pack longer than the model's context."""
    from workbench.runtime.model import Transformer

    dev = torch.device(device)
    net = Transformer(spec, seed=seed).to(device=dev, dtype=dtype)
    clock = Clock(dev)
    cases = _compute_cases(spec, net, packs, attn, dev, clock, torch.Generator().manual_seed(seed))
    samples, ks = _round_robin(cases, device=dev, warmup=warmup, reps=reps, min_sample_ms=min_sample_ms,
                               progress=progress)
    return _compute_rows(spec, packs, samples, ks, trim)


# ------------------------------------------------------------------------------------------------
# collectives
# ------------------------------------------------------------------------------------------------


def measure_collectives(registry, group_sizes: Sequence[int], message_bytes: Sequence[int], *,
                        device: torch.device | str = "cpu", warmup: int = 1, reps: int = 5, inner: int = 4,
                        trim: float = 0.2, kinds: Sequence[str] = ("all_to_all", "allreduce", "p2p"),
                        fsdp_bytes: Sequence[int] = (), cp_sizes: Sequence[int] = (),
                        cp_degree: int | Mapping[int, int] | None = None,
                        progress: Callable[[str], None] | None = None) -> list[dict]:
    """Time collectives under an initialised process group; every rank must call this together.

    ``all_to_all``: for each group size d, every aligned block of d ranks runs
    ``all_to_all_single`` at once on a buffer of ``message_bytes`` per rank. ``allreduce``: the
    whole world. ``p2p``: one ring step inside each block (send to the next rank, receive from the
    previous). ``allgather`` and ``reduce_scatter``: the whole world, as FSDP2 calls them under
    ZeRO-3 (``all_gather_single`` of a shard into a full buffer, ``reduce_scatter_single`` of a full
    buffer into a shard), the full buffer ``message_bytes`` and every size of ``fsdp_bytes`` (one
    FSDP unit's parameters or gradients: the sizes a pass moves). ``cp_allgather`` and
    ``cp_reduce_scatter`` (with ``cp_sizes``): context parallelism's K/V all-gather and gradient
    reduce-scatter, for each CP size c on the strided CP sub-groups of the groups of ``cp_degree``
    ranks (default the world; a mapping gives each c its own: ``workbench.profile.cp_blocks``) split
    ``(cp_degree/c) x c`` (ranks ``r0 + a + u*[0, c)``: every sub-group at once, as the CP attention
    runs them), the full buffer ``message_bytes``. A group size (or CP block) that does not divide
    the world runs on its aligned blocks while the ranks left over wait at the barriers. Each
    timed repetition is ``inner`` calls back to back after a barrier; a point is the trimmed median
    of a rank's repetitions per call, agreed over the ranks that took part (median). Every rank must
    call this together; the registry must hold the ``(cp_degree, c)`` splits.

    Returns ``[{"kind", "group_size", "message_bytes", "ms", "per_rank"}]`` (``message_bytes``:
    per rank for all-to-all and ring steps, the full buffer for the others; ``per_rank``: the ranks
    that took part, and ``"idle_ranks"`` when some did not; CP points also carry ``"stride"``, the
    ``u`` between a sub-group's ranks)."""
    dev = torch.device(device)
    world, rank = dist.get_world_size(), dist.get_rank()
    clock = Clock(dev)
    points = []

    def timed(fn) -> float:
        per = []
        for r in range(warmup + reps):
            _barrier(dev)
            clock.mark()
            for _ in range(inner):
                fn()
            clock.mark()
            (t,) = clock.intervals()
            if r >= warmup:
                per.append(t / inner)
        return trimmed_median(per, trim)

    jobs = []
    for d in group_sizes:
        if "all_to_all" in kinds:
            jobs += [("all_to_all", d, m) for m in message_bytes]
        if "p2p" in kinds:
            jobs += [("p2p", d, m) for m in message_bytes]
    if "allreduce" in kinds and world > 1:
        jobs += [("allreduce", world, m) for m in message_bytes]
    fsdp_sizes = sorted({int(m) for m in (*message_bytes, *fsdp_bytes)})
    for kind in ("allgather", "reduce_scatter"):
        if kind in kinds and world > 1:
            jobs += [(kind, world, m) for m in fsdp_sizes]
    tops = ({int(c): int(t) for c, t in cp_degree.items()} if isinstance(cp_degree, Mapping)
            else {int(c): int(cp_degree or world) for c in cp_sizes})
    for kind in ("cp_allgather", "cp_reduce_scatter"):
        if kind in kinds:
            jobs += [(kind, int(c), m) for c in cp_sizes for m in message_bytes]
    for kind, d, m in jobs:
        lo = rank // d * d
        extra = {}
        # a size that does not divide the world: its aligned blocks run, the ranks left over idle
        top = tops.get(d, world) if kind.startswith("cp_") else (world if kind in _WORLD_KINDS else d)
        busy = rank // top * top + top <= world
        idle = [r for r in range(world) if r // top * top + top > world]
        if not busy:
            group = None
        elif kind in _WORLD_KINDS:
            group = None
        elif kind.startswith("cp_"):
            block = rank // top * top
            group = registry.subgroups(tuple(range(block, block + top)), d, rank)[1]
        else:
            group = registry.get(tuple(range(lo, lo + d)))
        if kind.startswith("cp_"):
            extra = {"stride": top // d}
        if idle:
            extra["idle_ranks"] = idle
        numel = max(d, int(m) // 4 // d * d)
        send = torch.randn(numel, device=dev)
        recv = torch.empty_like(send)
        if kind in ("allgather", "cp_allgather"):  # a shard in, the full buffer out
            send = send[: numel // d].clone()
        elif kind in ("reduce_scatter", "cp_reduce_scatter"):  # the full buffer in, a shard out
            recv = recv[: numel // d].clone()
        fn = (_collective_call(kind, send, recv, group, lo + (rank - lo + 1) % d, lo + (rank - lo - 1) % d)
              if busy else _idle)
        t = timed(fn)
        _, per_rank = agree([t], dev)
        took_part = [p[0] for r, p in enumerate(per_rank) if r not in idle]
        points.append({"kind": kind, "group_size": int(d), "message_bytes": int(numel * 4),
                       "ms": float(statistics.median(took_part)), "per_rank": took_part, **extra})
        if progress is not None:
            progress(f"{kind} d={d} {numel * 4:,} B")
    return points


_WORLD_KINDS = ("allreduce", "allgather", "reduce_scatter")


def _idle() -> None:
    """What a rank outside every block of a size that does not divide the world runs: nothing."""


def _collective_call(kind: str, send: torch.Tensor, recv: torch.Tensor, group, nxt: int, prv: int) -> Callable[[], None]:
    """One call of collective ``kind`` on these buffers (``nxt``/``prv``: the ring neighbours)."""
    if kind == "all_to_all":
        return lambda: dist.all_to_all_single(recv, send, group=group)
    if kind == "allreduce":
        return lambda: dist.all_reduce(send)
    if kind in ("allgather", "cp_allgather"):
        # what FSDP2 and the CP attention call; FSDP's over the world (group None), CP's over its sub-group
        return lambda: all_gather_single(recv, send, group)
    if kind in ("reduce_scatter", "cp_reduce_scatter"):
        return lambda: reduce_scatter_single(recv, send, group)

    ops = [dist.P2POp(dist.isend, send, nxt), dist.P2POp(dist.irecv, recv, prv)]

    def ring_step() -> None:
        # batched: NCCL issues the pair in one group (separate calls can deadlock a ring)
        for q in dist.batch_isend_irecv(ops):
            q.wait()

    return ring_step


# ------------------------------------------------------------------------------------------------
# SP groups: the runtime's own micro-step at every group size
# ------------------------------------------------------------------------------------------------


def _group_cases(spec: ModelSpec, net, registry, group_sizes, packs, attn, dev: torch.device, clock: Clock,
                 gen, splits: Sequence[Sequence[int]] = (),
                 cp_packs: Sequence[Sequence[int]] | None = None) -> tuple[list[tuple[int, int, list[int]]], list[Callable]]:
    from workbench.runtime.cp import CPAttention
    from workbench.runtime.step import IGNORE, make_shard
    from workbench.runtime.ulysses import UlyssesAttention

    rank = dist.get_rank()
    keys, cases = [], []
    shapes = [(d, 1) for d in sorted({1, *[int(x) for x in group_sizes]})]
    shapes += sorted({(int(d), int(c)) for d, c in splits if int(c) > 1})
    for d, c in shapes:
        lo = rank // d * d
        block = tuple(range(lo, lo + d))
        if c == 1:
            group, subs = registry.get(block), None
        else:
            group, subs = None, registry.subgroups(block, c, rank)  # (Ulysses sub-group or None, CP sub-group)
        # every CP split runs the CP packs: the composite ones (u x c) too, so that their residual beyond
        # the 1 x c and u x 1 parts is fitted on the same lengths, the longest included
        for pack in (cp_packs if cp_packs is not None and c > 1 else packs):
            seqs = [torch.randint(0, spec.vocab, (int(n),), generator=gen) for n in pack]

            def once(seqs=seqs, d=d, c=c, lo=lo, group=group, subs=subs) -> list[float]:
                net.zero_grad(set_to_none=True)
                clock.mark()
                # as the step executor does it, inside the timed micro-step: this rank's slices and layout
                sh = make_shard(seqs, d, rank - lo, c)
                if d == 1:
                    a = attn
                elif c == 1:
                    a = UlyssesAttention(group, sh.layout, attn)
                else:
                    a = CPAttention(subs[0], subs[1], sh.layout, attn)
                tokens, positions, cu, labels = (sh.tokens.to(dev), sh.positions.to(dev), sh.cu_seqlens.to(dev),
                                                 sh.labels.to(dev))
                logits = net(tokens, positions, cu, sh.max_seqlen, a)  # (T_loc, vocab)
                loss = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE, reduction="sum")
                loss.backward()
                clock.mark()
                return clock.intervals()  # [micro-step]

            keys.append((d, c, [int(n) for n in pack]))
            cases.append(once)
    return keys, cases


def _group_rows(keys, samples, trim: float, device: torch.device) -> list[dict]:
    med, per_rank = agree([trimmed_median([x[0] for x in smp], trim) for smp in samples], device)
    return [{"degree": d, "cp": c, "pack": p, "tokens": sum(p), "ms": med[i], "per_rank": [r[i] for r in per_rank]}
            for i, (d, c, p) in enumerate(keys)]


def measure_groups(spec: ModelSpec, registry, group_sizes: Sequence[int], packs: Sequence[Sequence[int]], *,
                   attn: Callable, device: torch.device | str = "cpu", warmup: int = 1, reps: int = 3,
                   trim: float = 0.2, dtype: torch.dtype = torch.float32, seed: int = 0, min_sample_ms: float = 0.0,
                   cp_splits: Sequence[Sequence[int]] = (), cp_packs: Sequence[Sequence[int]] | None = None,
                   progress: Callable[[int], None] | None = None) -> list[dict]:
    """Time one micro-step of the runtime's sequence-parallel path, as the step executor runs it:
    each rank takes its slice of every sequence (``make_shard``), forward with Ulysses attention
    inside its group (``UlyssesAttention``: the all-to-alls around the local varlen attention), loss,
    backward. For every degree in ``[1, *group_sizes]`` and pack, every aligned block runs its own
    group of that degree on the pack at once (as concurrent groups do in training); every rank must
    call this together. Samples go round-robin over the (degree, pack) cases. ``cp_splits``: also
    every ``[degree, c]`` split (c > 1) with context parallelism (``CPAttention``: the CP layout's
    chunks, K/V all-gathered over the strided CP sub-group, bottom-right causal attention of each
    chunk on its prefix, the reduce-scatter of their gradients), Ulysses over ``degree / c`` ranks
    inside it; the registry must hold those splits. CP splits (``1 x c`` and ``u x c``) run
    ``cp_packs`` (default ``packs``; ``workbench.profile.cp_packs`` adds the longest length).

    Returns ``[{"degree", "cp" (1: Ulysses only), "pack", "tokens", "ms" (whole model; trimmed
    median, median over ranks), "per_rank"}]``."""
    from workbench.runtime.model import Transformer

    dev = torch.device(device)
    net = Transformer(spec, seed=seed).to(device=dev, dtype=dtype)
    clock = Clock(dev)
    keys, cases = _group_cases(spec, net, registry, group_sizes, packs, attn, dev, clock,
                               torch.Generator().manual_seed(seed), cp_splits, cp_packs)
    samples, _ = _round_robin(cases, device=dev, warmup=warmup, reps=reps, min_sample_ms=min_sample_ms,
                              progress=progress)
    return _group_rows(keys, samples, trim, dev)


def measure_compute_and_groups(spec: ModelSpec, packs, registry, group_sizes, group_packs, *, attn: Callable,
                               device: torch.device | str = "cpu", warmup: int = 1, reps: int = 3, trim: float = 0.2,
                               dtype: torch.dtype = torch.float32, seed: int = 0, min_sample_ms: float = 0.0,
                               head_tokens: Sequence[int] = (), step_cases: Sequence[dict] = (),
                               optimizer: str = "adamw", cp_splits: Sequence[Sequence[int]] = (),
                               cp_packs: Sequence[Sequence[int]] | None = None,
                               progress: Callable[[int, int], None] | None = None) -> tuple[list, list, list, list]:
    """:func:`measure_compute`, :func:`measure_groups`, the head alone (embedding, final norm,
    output head and loss of one sequence of each of ``head_tokens``) and the real steps of
    ``step_cases`` (:func:`measure_steps`) in the same round-robin rounds (with the CP splits of
    ``cp_splits`` among the SP micro-steps), so that the SP
    micro-steps, the head and the real steps see the same load as the compute curve they are
    compared with (on a shared machine the load drifts between phases). ``registry`` None: no SP
    groups and no steps. ``progress(j, n)`` after each of the ``n`` samples. Returns ``(compute
    rows, group rows, head rows, step rows)``; a head row is ``{"tokens", "forward_ms",
    "backward_ms" (whole; trimmed median, median over ranks), "per_rank"}``."""
    from workbench.runtime.model import Transformer

    dev = torch.device(device)
    net = Transformer(spec, seed=seed).to(device=dev, dtype=dtype)
    clock = Clock(dev)
    gen = torch.Generator().manual_seed(seed)
    ccases = _compute_cases(spec, net, packs, attn, dev, clock, gen)
    hcases = _head_cases(spec, net, head_tokens, dev, clock, gen)
    keys, gcases = ([], []) if registry is None else _group_cases(spec, net, registry, group_sizes, group_packs, attn,
                                                                  dev, clock, gen, cp_splits, cp_packs)
    precision = "bf16" if dtype == torch.bfloat16 else "fp32"
    steps = None
    if step_cases and registry is not None:
        steps = _StepCases(spec, registry, step_cases, attn=attn, dev=dev, precision=precision, optimizer=optimizer,
                           seed=seed, gen=gen)
    scases = steps.callables if steps is not None else []
    cases = ccases + hcases + gcases + scases
    n = reps * len(cases)
    samples, ks = _round_robin(cases, device=dev, warmup=warmup, reps=reps, min_sample_ms=min_sample_ms,
                               progress=None if progress is None else (lambda j: progress(j, n)))
    nc, nh, ng = len(ccases), len(hcases), len(gcases)
    rows = _compute_rows(spec, packs, samples[:nc], ks[:nc], trim)
    heads = _head_rows(head_tokens, samples[nc:nc + nh], trim, dev) if hcases else []
    groups = _group_rows(keys, samples[nc + nh:nc + nh + ng], trim, dev) if registry is not None else []
    step_rows = steps.rows(samples[nc + nh + ng:], trim, dev, optimizer, precision) if steps is not None else []
    return rows, groups, heads, step_rows


# ------------------------------------------------------------------------------------------------
# real steps: what a step costs beyond its layers
# ------------------------------------------------------------------------------------------------


def _case_plan(case: dict, world: int, stage: int, precision: str):
    """The Plan (and the batch's lengths) of one step case (``workbench.profile.default_step_cases``)."""
    from workbench.solve.plan import Group, MicroStep, Plan

    lengths: list[int] = []
    micro = []
    for groups in case["micro_steps"]:
        gs = []
        for g in groups:
            seqs = tuple(range(len(lengths), len(lengths) + len(g["lengths"])))
            lengths += [int(x) for x in g["lengths"]]
            gs.append(Group(degree=int(g["degree"]), ranks=tuple(int(r) for r in g["ranks"]), sequences=seqs,
                            lengths=tuple(int(x) for x in g["lengths"]), time_ms=0.0, memory_gb=0.0))
        micro.append(MicroStep(groups=tuple(gs), time_ms=0.0 if case["execution"] == "lockstep" else None))
    plan = Plan(planner="profile", status="heuristic", makespan_ms=0.0, lower_bound_ms=0.0, solve_seconds=0.0,
                micro_steps=tuple(micro), num_gpus=world, execution=case["execution"], zero_stage=stage,
                precision=precision, recompute=False)
    return plan, lengths


def _local_numel(p: torch.Tensor) -> int:
    return int(p.to_local().numel() if hasattr(p, "to_local") else p.numel())


class _StepCases:
    """The real steps of ``cases`` as round-robin callables: one model with its optimizer per ZeRO
    stage the cases need (lockstep: ZeRO-3, FSDP2 over every rank; free: ZeRO-0 replicas), each
    case a StepExecutor run of its plan on random tokens, then an optimizer step timed apart."""

    def __init__(self, spec: ModelSpec, registry, cases: Sequence[dict], *, attn: Callable, dev: torch.device,
                 precision: str, optimizer: str, seed: int, gen: torch.Generator) -> None:
        from workbench.runtime.model import Transformer
        from workbench.runtime.step import StepExecutor
        from workbench.runtime.zero import parallelize

        world = dist.get_world_size() if dist.is_initialized() else 1
        self.cases = list(cases)
        self.plans, self.callables, self.updated = [], [], {}
        runtimes = {}
        for stage in sorted({3 if c["execution"] == "lockstep" else 0 for c in self.cases}, reverse=True):
            net = Transformer(spec, seed=seed).to(device=dev, dtype=torch.float32)
            zero = parallelize(net, zero_stage=stage, precision=precision, device=dev)
            opt = zero.make_optimizer(optimizer, lr=1e-4)
            runtimes[stage] = (StepExecutor(net, registry, attn, device=dev, zero=zero), opt)
            self.updated[stage] = sum(_local_numel(q) for q in zero.params)
        self.runtimes = runtimes
        for c in self.cases:
            stage = 3 if c["execution"] == "lockstep" else 0
            plan, lengths = _case_plan(c, world, stage, precision)
            seqs = [torch.randint(0, spec.vocab, (n,), generator=gen) for n in lengths]
            ex, opt = runtimes[stage]
            self.plans.append((plan, lengths, stage))

            def once(ex=ex, opt=opt, plan=plan, seqs=seqs) -> list[float]:
                res = ex.run(plan, seqs)
                t0 = time.perf_counter()
                # the step's end as the trainer runs it: the update, the model states it records, zeroed grads
                opt.step()
                ex.zero.state_bytes()
                opt.zero_grad(set_to_none=True)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                return [r.measured_ms for r in res.records] + [res.measured_ms, res.allreduce_ms,
                                                              (time.perf_counter() - t0) * 1e3]

            self.callables.append(once)

    def rows(self, samples, trim: float, dev: torch.device, optimizer: str, precision: str) -> list[dict]:
        """Per case, each rank's trimmed median of every figure, gathered on every rank."""
        out = []
        for c, (plan, lengths, stage), smp in zip(self.cases, self.plans, samples):
            mine = [trimmed_median(col, trim) for col in zip(*smp)] + [float(self.updated[stage])]
            _, per_rank = agree(mine, dev)
            k = len(plan.micro_steps)
            out.append({
                "name": c["name"], "execution": c["execution"], "zero_stage": stage, "precision": precision,
                "optimizer": optimizer, "micro_steps": c["micro_steps"], "lengths": lengths,
                "micro_step_ms": [[pr[m] for pr in per_rank] for m in range(k)],
                "step_ms": [pr[k] for pr in per_rank], "allreduce_ms": [pr[k + 1] for pr in per_rank],
                "optimizer_ms": [pr[k + 2] for pr in per_rank], "updated_params": [int(pr[k + 3]) for pr in per_rank]})
        return out


def measure_steps(spec: ModelSpec, registry, cases: Sequence[dict], *, attn: Callable,
                  device: torch.device | str = "cpu", precision: str = "fp32", optimizer: str = "adamw",
                  warmup: int = 1, reps: int = 3, trim: float = 0.2, seed: int = 0, min_sample_ms: float = 0.0,
                  progress: Callable[[int], None] | None = None) -> list[dict]:
    """Run real training steps of the runtime: for each case (``{"name", "execution", "micro_steps":
    [[{"degree", "ranks", "lengths"}]]}``) the StepExecutor runs its plan on random tokens with the
    model states of the execution's ZeRO stage (lockstep: ZeRO-3, FSDP2 over every rank; free:
    ZeRO-0 replicas), then ``optimizer`` steps, timed apart; round-robin over the cases as
    :func:`_round_robin` samples. Every rank must call this together.

    Returns, per case, ``{"name", "execution", "zero_stage", "micro_steps", "lengths",
    "micro_step_ms": [[ms per rank] per micro-step or pass], "step_ms", "allreduce_ms",
    "optimizer_ms", "updated_params": [per rank]}``: each rank's trimmed median over the repetitions."""
    dev = torch.device(device)
    sc = _StepCases(spec, registry, cases, attn=attn, dev=dev, precision=precision, optimizer=optimizer, seed=seed,
                    gen=torch.Generator().manual_seed(seed))
    samples, _ = _round_robin(sc.callables, device=dev, warmup=warmup, reps=reps, min_sample_ms=min_sample_ms,
                              progress=progress)
    return sc.rows(samples, trim, dev, optimizer, precision)


# ------------------------------------------------------------------------------------------------
# memory
# ------------------------------------------------------------------------------------------------


def _model_state_bytes_computed(net: torch.nn.Module) -> dict:
    params = sum(p.numel() * p.element_size() for p in net.parameters())
    adam = sum(2 * p.numel() * 4 for p in net.parameters())  # AdamW: two fp32 moments
    return {"params_bytes": params, "grads_bytes": params, "optimizer_bytes": adam,
            "model_state_mb": (2 * params + adam) / 1e6}


def measure_optimizer(spec: ModelSpec, *, optimizer: str = "adamw", device: torch.device | str = "cpu",
                      max_params: float = 256e6, warmup: int = 1, reps: int = 5) -> dict:
    """The optimizer's step alone, on fp32 tensors of ``spec``'s parameter shapes with gradients, as
    the run holds its master weights: the blocks' tensors first, then the embedding and the head,
    until ``max_params`` (at least one tensor; the step of a memory-bound optimizer is linear in the
    parameters). For profiles whose real steps are skipped (a model over 200M parameters, or
    ``steps`` off), which would otherwise predict no optimizer time (31 ms of a 1B's 16K-token step
    on an H200). Returns ``{"optimizer", "params", "ms", "ms_per_mparam", "reps"}`` (the median)."""
    from workbench.cost.memory import parameter_shapes
    from workbench.runtime.zero import optimizer_class

    dev = torch.device(device)
    named = parameter_shapes(spec)
    outside = ("embed.", "head.")
    shapes = [s for name, s in named if not name.startswith(outside)] + [s for name, s in named if name.startswith(outside)]
    gen = torch.Generator(device=dev).manual_seed(0)
    params, n = [], 0
    for shape in shapes:
        if params and n + math.prod(shape) > max_params:
            break
        p = torch.randn(shape, device=dev, dtype=torch.float32, generator=gen) * 0.02
        p.grad = torch.randn(shape, device=dev, dtype=torch.float32, generator=gen) * 1e-3
        params.append(p)
        n += math.prod(shape)
    cls, kw = optimizer_class(optimizer, lr=1e-4)  # the runtime's own (ZeroRuntime.make_optimizer)
    opt = cls(params, **kw)
    clock = Clock(dev)
    times = []
    for r in range(warmup + reps):
        clock.mark()
        opt.step()
        clock.mark()
        (ms,) = clock.intervals()
        if r >= warmup:
            times.append(ms)
    ms = float(statistics.median(times))
    del opt, params
    return {"optimizer": optimizer, "params": int(n), "ms": ms, "ms_per_mparam": ms / n * 1e6, "reps": reps}


def measure_memory(spec: ModelSpec, *, device: torch.device | str = "cpu", attn: Callable | None = None,
                   dtype: torch.dtype = torch.float32, lengths: tuple[int, int] = (256, 1024)) -> dict:
    """Activation MB per token (whole model) and model-state MB (parameters, gradients, AdamW).

    CUDA: measured, peak allocated during a forward at two lengths (the difference per token, so
    fixed buffers cancel) and allocated bytes after a backward and an optimizer step. Elsewhere:
    computed from the model, the bytes of the distinct tensors autograd saves for backward in one
    forward of the longer length (parameters excluded) per token, and parameter/optimizer bytes.
    Returns ``{"activation_mb_per_token", "model_state_mb", "method", ...}``."""
    from workbench.runtime.attention import torch_varlen_attention
    from workbench.runtime.model import Transformer

    dev = torch.device(device)
    attn = attn or torch_varlen_attention
    gen = torch.Generator().manual_seed(0)
    lengths = tuple(min(int(x), spec.max_context) for x in lengths)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        base0 = torch.cuda.memory_allocated(dev)
        net = Transformer(spec, seed=0).to(device=dev, dtype=dtype)
        params = torch.cuda.memory_allocated(dev) - base0
        peaks = []
        for L in lengths:
            tokens, positions, cu, max_s, labels = _pack_inputs([L], spec.vocab, dev, gen)
            torch.cuda.synchronize(dev)
            base = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            logits = net(tokens, positions, cu, max_s, attn)  # (T, vocab)
            loss = F.cross_entropy(logits.float(), labels, reduction="sum")
            torch.cuda.synchronize(dev)
            peaks.append(torch.cuda.max_memory_allocated(dev) - base)
            if L == lengths[-1]:
                loss.backward()
            del logits, loss
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        opt.step()
        torch.cuda.synchronize(dev)
        state = torch.cuda.memory_allocated(dev) - base0
        per_token = (peaks[1] - peaks[0]) / (lengths[1] - lengths[0]) if lengths[1] != lengths[0] else peaks[0] / lengths[0]
        out = {"activation_mb_per_token": per_token / 1e6, "model_state_mb": state / 1e6, "params_mb": params / 1e6,
               "method": "measured: CUDA peak allocated bytes of a forward at "
                         f"{lengths[0]} and {lengths[1]} tokens (difference per token); model states = allocated "
                         f"bytes of parameters, gradients and AdamW states after one step",
               "points": [{"tokens": L, "peak_bytes": p} for L, p in zip(lengths, peaks)]}
        del net, opt
        torch.cuda.empty_cache()
        return out
    net = Transformer(spec, seed=0).to(device=dev, dtype=dtype)
    param_ptrs = {p.untyped_storage().data_ptr() for p in net.parameters()}
    seen: dict[int, int] = {}

    def pack_hook(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in param_ptrs:
            seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    L = lengths[-1]
    tokens, positions, cu, max_s, labels = _pack_inputs([L], spec.vocab, dev, gen)
    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        logits = net(tokens, positions, cu, max_s, attn)  # (T, vocab)
        loss = F.cross_entropy(logits.float(), labels, reduction="sum")
    del loss, logits
    st = _model_state_bytes_computed(net)
    return {"activation_mb_per_token": sum(seen.values()) / L / 1e6, **st,
            "method": f"computed on CPU: bytes of the tensors autograd saves for backward in one forward of {L} "
                      f"tokens (parameters excluded) per token; model states = parameter and gradient bytes plus "
                      f"two fp32 AdamW moments per parameter"}


# ------------------------------------------------------------------------------------------------
# the host: its memory and the pinned host-device link
# ------------------------------------------------------------------------------------------------


HOST_COPY_BYTES = 256 * 2**20
"""Bytes of one timed host-device copy: large enough that a copy's fixed cost (microseconds) is noise
next to its transfer (milliseconds at tens of GB/s), small enough to pin on any node."""


def host_memory_gb() -> float:
    """This node's host memory (``psutil.virtual_memory().total``) in GB (1e9 bytes)."""
    import psutil

    return psutil.virtual_memory().total / 1e9


def _copy_ms(dst: torch.Tensor, src: torch.Tensor, device: torch.device, *, warmup: int, reps: int,
             together: bool) -> list[float]:
    """``reps`` timed ``dst.copy_(src, non_blocking=True)`` on ``device``'s stream (CUDA events), after
    ``warmup`` untimed ones; with ``together`` every copy starts after a barrier of all ranks."""
    out = []
    for i in range(warmup + reps):
        if together:
            _barrier(device)
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        if i >= warmup:
            out.append(float(start.elapsed_time(end)))
    return out


def measure_host_link(device: torch.device | str, *, nbytes: int = HOST_COPY_BYTES, warmup: int = 2, reps: int = 5,
                      ranks_per_node: int | None = None) -> dict | None:
    """Pinned host-device copy times on CUDA; every rank calls it together. First rank 0 alone copies
    host-to-device, then device-to-host (``warmup`` untimed + ``reps`` timed copies of ``nbytes``
    each), the others waiting at a barrier; then every rank copies at once, each copy after a barrier.
    Returns ``{"bytes", "warmup", "reps", "ranks_per_node", "alone": {"h2d_ms", "d2h_ms"} (rank 0's),
    "all": {"h2d_ms", "d2h_ms"} (per rank)}`` on every rank, what
    ``workbench.profile.fit.fit_host_link`` turns into GB/s; None off CUDA (no host link)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    n = int(nbytes) // 4
    host = torch.empty(n, dtype=torch.float32, pin_memory=True)
    gpu = torch.empty(n, dtype=torch.float32, device=dev)
    host.fill_(1.0)
    gpu.fill_(1.0)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    alone = {"h2d_ms": [0.0] * reps, "d2h_ms": [0.0] * reps}
    _barrier(device)
    if rank == 0:
        alone = {"h2d_ms": _copy_ms(gpu, host, dev, warmup=warmup, reps=reps, together=False),
                 "d2h_ms": _copy_ms(host, gpu, dev, warmup=warmup, reps=reps, together=False)}
    _barrier(device)
    h2d = _copy_ms(gpu, host, dev, warmup=warmup, reps=reps, together=True)
    d2h = _copy_ms(host, gpu, dev, warmup=warmup, reps=reps, together=True)
    _, per_rank = agree(alone["h2d_ms"] + alone["d2h_ms"] + h2d + d2h, dev)  # rank 0's alone times reach everyone
    first = per_rank[0]
    del host, gpu
    return {"bytes": 4 * n, "warmup": int(warmup), "reps": int(reps), "ranks_per_node": int(ranks_per_node or world),
            "alone": {"h2d_ms": first[:reps], "d2h_ms": first[reps:2 * reps]},
            "all": {"h2d_ms": [r[2 * reps:3 * reps] for r in per_rank], "d2h_ms": [r[3 * reps:] for r in per_rank]}}


# ------------------------------------------------------------------------------------------------
# provenance
# ------------------------------------------------------------------------------------------------


def _loadavg() -> float | None:
    """The machine's 1-minute load average (None where the OS has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _memory_gb() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return 8.0


def _driver_version() -> str | None:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        p = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=10)
        return p.stdout.strip().splitlines()[0] if p.returncode == 0 and p.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return None


def _machine(device: torch.device) -> dict:
    """``{"gpu", "gpu_memory_gb", "versions": {...}}`` of this machine."""
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu, mem = torch.cuda.get_device_name(device), props.total_memory / 1e9
        versions.update(cuda=torch.version.cuda, driver=_driver_version())
        try:
            versions["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001 - a version string is not worth failing for
            versions["nccl"] = None
        try:
            import flash_attn

            versions["flash_attn"] = flash_attn.__version__
        except ImportError:
            versions["flash_attn"] = None
    else:
        gpu, mem = f"CPU {cpu_name()} ({os.cpu_count()} cores)", _memory_gb()
    return {"gpu": gpu, "gpu_memory_gb": round(mem, 1), "versions": versions}


# ------------------------------------------------------------------------------------------------
# the run
# ------------------------------------------------------------------------------------------------


class Profiler:
    """One rank of a profile run. ``run()`` returns the exit status (0 done, 1 failed)."""

    # shares of the progress bar: compute with SP micro-steps and real steps, collectives, memory, fit
    SHARES = (0.8, 0.12, 0.04, 0.04)

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.rank = int(os.environ.get("RANK", 0))
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.spec: ProfileSpec | None = None
        self.phase = "setup"

    def _status(self, **fields) -> None:
        if self.rank == 0 and self.run_dir.is_dir():
            runs.update_status(self.run_dir, **fields)

    def _progress(self, fraction: float, message: str) -> None:
        self._status(state="running", progress=round(min(1.0, max(0.0, fraction)), 4), message=message)

    def _fail(self, msg: str) -> int:
        _say(f"workbench profile: error (rank {self.rank}, {self.phase}): {msg}")
        if self.run_dir.is_dir():
            try:
                write_json_atomic(self.run_dir / runs.FAILURES_DIR / f"rank{self.rank}.json",
                                  {"rank": self.rank, "phase": self.phase, "error": msg,
                                   "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")})
            except OSError:
                pass
        self._status(state="failed", error=msg, message=f"failed in {self.phase}")
        return 1

    def _setup(self):
        """Everything that needs no collective: spec, device, attention. Returns (device, attn,
        attn_name, resolved) or raises."""
        from workbench.runtime.attention import select_attention

        self.spec = read_profile_spec(self.run_dir)
        spec = self.spec
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        if spec.nproc != self.world:
            raise ValueError(f"the run is prepared for {spec.nproc} process(es) but torchrun started {self.world}")
        dev_name = spec.resolved_device()
        if dev_name == "cuda":
            if not torch.cuda.is_available():
                raise ValueError("the profile asks for CUDA but torch sees no CUDA device here; use --device cpu")
            n = torch.cuda.device_count()
            if self.local_rank >= n:
                raise ValueError(f"local rank {self.local_rank} has no GPU: this node has {n}; lower --nproc to {n}")
            device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        attn, attn_name = select_attention(spec.attention, device)
        return device, attn, attn_name, spec.resolved(device.type)

    def run(self) -> int:
        err = None
        device, attn, attn_name, res = torch.device("cpu"), None, "torch", {}
        if self.run_dir.is_dir():
            runs.update_status(self.run_dir, pids={"ranks": {str(self.rank): os.getpid()}, **runs.process_record()})
        try:
            device, attn, attn_name, res = self._setup()
        except Exception as e:  # noqa: BLE001 - agreed on below, never left to hang the others
            err = str(e).splitlines()[0] if str(e) else type(e).__name__
        spec = self.spec
        backend = "nccl" if device.type == "cuda" else "gloo"
        if self.world > 1 or "MASTER_ADDR" in os.environ:
            timeout = _dt.timedelta(seconds=spec.timeout_s if spec is not None else 300.0)
            try:
                if device.type == "cuda":
                    dist.init_process_group(backend, timeout=timeout, device_id=device)
                else:
                    dist.init_process_group(backend, timeout=timeout)
            except Exception as e:  # noqa: BLE001
                return self._fail(f"process group ({backend}) did not start: {e}")
            errs: list = [None] * dist.get_world_size()
            dist.all_gather_object(errs, err)
            first = next(((r, e) for r, e in enumerate(errs) if e is not None), None)
            if first is not None:
                r, e = first
                code = 1
                if self.rank == r or self.rank == 0:
                    code = self._fail(e if r == self.rank else f"rank {r}: {e}")
                dist.destroy_process_group()
                return code
        elif err is not None:
            return self._fail(err)
        try:
            code = self._measure(device, attn, attn_name, res, backend)
        except Exception as e:  # noqa: BLE001 - reported in the status; torchrun ends the other ranks
            traceback.print_exc()
            return self._fail(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        if dist.is_initialized():
            dist.destroy_process_group()
        return code

    def _measure(self, device: torch.device, attn, attn_name: str, res: dict, backend: str) -> int:
        spec = self.spec
        model = get_model(spec.model)
        dtype = _DTYPES[res["dtype"]]
        t_start = time.perf_counter()
        fit, held = res["fit_packs"], res["heldout_packs"]
        packs = [(p, "fit") for p in fit] + [(p, "heldout") for p in held]
        self.phase = "compute"
        self._progress(0.0, f"compute: {len(packs)} packs, {res['warmup']} warm-up + {res['reps']} timed samples each "
                            f"(warming up)")

        registry, sp_sizes, cp_tops = None, [], {}
        if dist.is_initialized() and self.world > 1:
            from workbench.runtime.groups import GroupRegistry

            # Ulysses must be able to split the model's heads over the group (collectives need not); the CP
            # sizes' collectives run on the strided sub-groups of the largest group, their micro-steps as
            # the splits cp_grid chose (workbench.profile.cp_grid)
            # (each CP size on the largest group it divides, workbench.profile.cp_blocks); micro-steps run at the
            # micro-step sizes only (workbench.profile.micro_step_sizes), the collectives at every group size
            from workbench.profile import cp_blocks

            cp_tops = cp_blocks(res.get("cp_sizes") or [], res["group_sizes"])
            cp_shapes = {tuple(x) for x in res.get("cp_splits") or []} | {(t, c) for c, t in cp_tops.items()}
            registry = GroupRegistry(self.world, [1, *res["group_sizes"]], shapes=sorted(cp_shapes))
            sp_sizes = [d for d in res.get("micro_step_sizes", res["group_sizes"])
                        if model.heads % d == 0 and (model.kv_heads % d == 0 or d % model.kv_heads == 0)]

        def on_sample(j: int, n: int) -> None:
            self._progress(self.SHARES[0] * (j + 1) / n, f"compute, SP micro-steps and real steps: sample {j + 1}/{n} "
                                                         f"(round {j * res['reps'] // n + 1}/{res['reps']})")

        load_start = _loadavg()
        cases = res.get("step_cases") or []
        if cases and dist.is_initialized() and registry is None:  # one process: steps without SP groups
            from workbench.runtime.groups import GroupRegistry

            registry = GroupRegistry(self.world, [1])
        rows, groups, heads, steps = measure_compute_and_groups(
            model, [p for p, _ in packs], registry, sp_sizes, res["group_packs"], attn=attn, warmup=res["warmup"],
            reps=res["reps"], trim=res["trim"], device=device, dtype=dtype, min_sample_ms=res["min_sample_ms"],
            head_tokens=res.get("head_tokens") or (), step_cases=cases if dist.is_initialized() else (),
            optimizer=res.get("optimizer") or "adamw", cp_splits=res.get("cp_splits") or [],
            cp_packs=res.get("cp_packs") or None,
            progress=on_sample)
        fwd, fwd_ranks = agree([r["forward_ms"] for r in rows], device)
        bwd, bwd_ranks = agree([r["backward_ms"] for r in rows], device)
        compute = []
        for i, ((p, role), r) in enumerate(zip(packs, rows)):
            compute.append({"pack": p, "tokens": r["tokens"], "role": role, "forward_ms": fwd[i], "backward_ms": bwd[i],
                            "per_rank": {"forward_ms": [x[i] for x in fwd_ranks],
                                         "backward_ms": [x[i] for x in bwd_ranks]},
                            "calls_per_sample": r["calls_per_sample"],
                            "rank0_all_ms": {"forward": r["forward_all"], "backward": r["backward_all"]}})
        self.phase = "collectives"
        collectives = []
        if registry is not None:
            sizes = res["group_sizes"]
            cp_sizes = res.get("cp_sizes") or []
            n_jobs = (2 * len(sizes) + 2 * len(cp_sizes)) * len(res["message_bytes"]) + len(res["message_bytes"])
            done = [0]

            def on_coll(what: str) -> None:
                done[0] += 1
                self._progress(self.SHARES[0] + self.SHARES[1] * done[0] / n_jobs, f"collectives: {what}")

            fsdp = res.get("fsdp_bytes") or []
            n_jobs += 2 * len(set(res["message_bytes"]) | set(fsdp))
            collectives = measure_collectives(registry, sizes, res["message_bytes"], device=device,
                                              reps=res["collective_reps"], inner=res["collective_inner"],
                                              trim=res["trim"], fsdp_bytes=fsdp, cp_sizes=cp_sizes,
                                              cp_degree=cp_tops,
                                              kinds=("all_to_all", "allreduce", "p2p", "allgather", "reduce_scatter",
                                                     "cp_allgather", "cp_reduce_scatter"),
                                              progress=on_coll)
        self.phase = "memory"
        self._progress(sum(self.SHARES[:2]), "memory")
        memory = measure_memory(model, device=device, attn=attn, dtype=dtype) if self.rank == 0 else {}
        # the host link: pinned copies on CUDA (every rank takes part), none on CPU
        self.phase = "host link"
        host_link = measure_host_link(device, ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", self.world)))
        # without real steps (a large model, or steps off) the optimizer's step is timed alone
        optimizer = (measure_optimizer(model, optimizer=res.get("optimizer") or "adamw", device=device)
                     if self.rank == 0 and not (cases and dist.is_initialized()) else None)
        if self.rank == 0:
            self.phase = "fit"
            self._progress(sum(self.SHARES[:3]), "fitting")
            mach = _machine(device)
            threads = torch.get_num_threads()
            name = spec.name or f"{device.type}-{backend}-{model.name}-{self.world}r"
            provenance = {
                "kind": "measured", "method": "workbench profile" + (" --quick" if spec.quick else ""),
                "source": "workbench.profile.measure",
                "where": f"{socket.gethostname()}: {mach['gpu']}, {self.world} rank(s) measuring at once, "
                         f"{threads} thread(s) each, {backend}",
                "host": socket.gethostname(), "device": device.type, "backend": backend,
                "when": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
                "command": spec.command, "run_id": self.run_dir.name, "versions": mach["versions"],
                "attention": attn_name, "dtype": res["dtype"], "world_size": self.world, "threads_per_rank": threads,
                "timer": "CUDA events" if device.type == "cuda" else "time.perf_counter around synchronised work",
                "scope": "whole model (embedding, blocks, head, loss) timed, divided by layers",
                "protocol": f"{res['warmup']} warm-up + {res['reps']} timed samples per pack after a barrier (a sample: "
                            f"the pack run back to back until it lasts {res['min_sample_ms']:g} ms), "
                            f"trimmed median ({res['trim']:.0%} cut at each end), median over {self.world} rank(s); "
                            f"non-negative least squares on relative error; collectives: "
                            f"{res['collective_reps']} x {res['collective_inner']} back-to-back calls per size",
                "grid": {"fit_packs": fit, "heldout_packs": held, "max_len": res["max_len"],
                         "group_packs": res["group_packs"], "head_tokens": res.get("head_tokens"),
                         "message_bytes": res["message_bytes"], "fsdp_bytes": res.get("fsdp_bytes"),
                         "group_sizes": res["group_sizes"], "micro_step_sizes": res.get("micro_step_sizes"),
                         "step_cases": [c["name"] for c in cases],
                         "cp_sizes": res.get("cp_sizes"), "cp_splits": res.get("cp_splits"),
                         "cp_packs": res.get("cp_packs"),
                         "optimizer": res.get("optimizer")},
                "load_average": {"start": load_start, "end": _loadavg(), "cores": os.cpu_count(),
                                 "note": "1-minute load average of the machine (os.getloadavg) when the measuring "
                                         f"started and ended; this run's own {self.world} rank(s) count in it"},
                "seconds": None,
            }
            # the machine it was measured on, whoever asked: a run compares its own with it (profile_origin_note)
            provenance["fingerprint"] = dict(spec.fingerprint or machine_fingerprint(self.world, device=device.type))
            meas = {"model": model.name, "world_size": self.world, "device": device.type, "scope": "model",
                    "compute": compute, "collectives": collectives, "groups": groups, "memory": memory,
                    "optimizer": optimizer,
                    "head": heads, "steps": steps, "host": {"memory_gb": host_memory_gb(), "link": host_link},
                    "meta": {"name": name, "gpu": mach["gpu"], "gpu_memory_gb": mach["gpu_memory_gb"],
                             "provenance": provenance}}
            provenance["seconds"] = round(time.perf_counter() - t_start, 1)
            write_json_atomic(self.run_dir / MEASUREMENTS_FILE, meas)
            result = build_result(meas, run_id=self.run_dir.name)
            write_json_atomic(self.run_dir / RESULT_FILE, result.to_dict())
            result.profile.save(self.run_dir / runs.PROFILE_FILE)
            if spec.out:
                result.profile.save(spec.out)
            h = result.heldout["total"]
            msg = (f"done in {provenance['seconds']:.0f}s: held-out per-layer error median {h['median_ape']:.1f}%, "
                   f"worst {h['worst_ape']:.1f}%" if h["count"] else f"done in {provenance['seconds']:.0f}s")
            _say(f"workbench profile: {msg}; wrote {self.run_dir / runs.PROFILE_FILE}"
                 + (f" and {spec.out}" if spec.out else ""))
            self._status(state="running", progress=1.0, message=msg)
        if dist.is_initialized():
            _barrier(device)  # the files are written before any rank reports done
        return 0


def _parent_watchdog() -> None:
    """Exit when torchrun (our parent) dies without ending us (an orphan would wait in a collective
    until the timeout)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(2.0)
            if os.getppid() != parent:
                os._exit(143)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    """Entry point of one rank; returns its exit status (0 done, 1 failed)."""
    p = argparse.ArgumentParser(prog="python -m workbench.profile.measure",
                                description="one rank of a workbench profile run (start it with `workbench profile`)")
    p.add_argument("--run-dir", required=True, help="the run folder holding spec.json")
    args = p.parse_args(argv)
    _parent_watchdog()
    gc.freeze()  # what the imports made lives to the end: no collection (nor a timed sample) walks it again
    return Profiler(Path(args.run_dir)).run()


if __name__ == "__main__":
    from workbench.util import exit_process

    exit_process(main())
