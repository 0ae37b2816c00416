"""The NCCL path's rules and flash-attn inside Ulysses, checked on the 4 gloo ranks of the shared
torchrun world (``tests/_torchrun.py``: one launch runs the checks of every file that takes part);
the pytest tests below assert on its JSON results.

- Every collective the runtime makes (the step of every ZeRO stage with heterogeneous plans, the
  stage's gradient reduction, clipping, the optimizer's consolidation for a checkpoint, the
  trainer's setup agreement and per-step broadcast) is recorded by an auditor wrapped around
  ``torch.distributed``'s functions, and checked against what ProcessGroupNCCL supports: no
  gloo-only call (``monitored_barrier``, a receive from any source), no reduce op NCCL lacks
  (bitwise), no sparse tensor, only dtypes NCCL carries, and every tensor on the rank's compute
  device (CPU here; on a GPU run the same code passes ``device=`` the GPU).
- Ulysses attention of degree 2 and 4 whose local kernel is the flash-attn stand-in
  (``tests/fakes``, which refuses what the real kernel refuses) in bf16: forward and backward
  against the PyTorch path on the whole sequences.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _torchrun import shared_world

# its slow tests check exact results and recorded calls, not times: make test runs them in the untimed
# lanes (tests/_xdist_heavy.py), as the other files of the shared 4-rank world
pytestmark = pytest.mark.untimed

WORLD = 4
DIST_TIMEOUT_S = 120
HERE = Path(__file__).resolve().parent

# what ProcessGroupNCCL implements (torch 2.x): the others (monitored_barrier) are gloo's alone
NCCL_CALLS = {"all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
              "all_gather_single", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all",
              "all_to_all_single", "send", "recv", "isend", "irecv", "barrier", "gather", "scatter",
              "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
              "batch_isend_irecv", "new_group"}
AUDITED = sorted(NCCL_CALLS | {"monitored_barrier"})
NCCL_DTYPES = {"torch.float16", "torch.float32", "torch.float64", "torch.bfloat16", "torch.int8", "torch.uint8",
               "torch.int32", "torch.int64", "torch.bool"}


# ------------------------------------------------------------------------------------------------
# worker side (runs under torchrun)
# ------------------------------------------------------------------------------------------------


def _tensors(x):
    import torch

    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


def _install_auditor(records: list):
    """Wrap every collective of ``torch.distributed`` so each call is recorded; returns an undo."""
    import torch.distributed as dist

    saved = {}
    for name in AUDITED:
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        saved[name] = fn

        def wrapper(*args, _fn=fn, _name=name, **kwargs):
            ts = list(_tensors(list(args) + list(kwargs.values())))
            op = kwargs.get("op")
            if op is None:
                op = next((a for a in args if type(a).__name__ in ("RedOpType", "ReduceOp")), None)
            records.append({"call": _name, "devices": sorted({str(t.device) for t in ts}),
                            "dtypes": sorted({str(t.dtype) for t in ts}), "sparse": any(t.is_sparse for t in ts),
                            "op": str(op) if op is not None else None,
                            "any_source": _name in ("recv", "irecv") and kwargs.get("src", args[1] if len(args) > 1
                                                                                     else None) is None})
            return _fn(*args, **kwargs)

        setattr(dist, name, wrapper)

    def undo():
        for name, fn in saved.items():
            setattr(dist, name, fn)

    return undo


def _check_flash_ulysses(registry, rank: int) -> dict:
    import torch

    sys.path.insert(0, str(HERE / "fakes"))
    import flash_attn  # the stand-in

    from test_runtime_dist import _slice
    from workbench.runtime.attention import flash_attention_fn, torch_varlen_attention
    from workbench.runtime.ulysses import UlyssesAttention, shard_layout

    out = {}
    flash = flash_attention_fn("bf16")
    H, KV, hd = 4, 2, 16
    lengths = [9, 1, 24, 6, 33]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    T = int(cu[-1])
    for d in (2, 4):
        gen = torch.Generator().manual_seed(7 + d)  # the same inputs on every rank
        q, k, v, gout = (torch.randn(T, h, hd, generator=gen).to(torch.bfloat16) for h in (H, KV, KV, H))
        qr, kr, vr = (t.float().requires_grad_(True) for t in (q, k, v))
        ref = torch_varlen_attention(qr, kr, vr, cu, cu, max(lengths), max(lengths))  # fp32 from the same bf16 values
        (ref * gout.float()).sum().backward()
        ranks = tuple(range((rank // d) * d, (rank // d + 1) * d))
        gr = ranks.index(rank)
        lay = shard_layout(lengths, d, gr)

        def local(x, d=d, gr=gr):
            return torch.cat([_slice(x[int(cu[i]):int(cu[i + 1])], d, gr) for i in range(len(lengths))])

        ql, kl, vl = (local(t).requires_grad_(True) for t in (q, k, v))
        n_calls = len(flash_attn.CALLS)
        cu_l = lay.local_cu_seqlens
        o = UlyssesAttention(registry.get(ranks), lay, flash)(ql, kl, vl, cu_l, cu_l, max(lay.chunks), max(lay.chunks))
        (o.float() * local(gout).float()).sum().backward()
        valid = lay.local_valid()
        errs = {"out": float((o.float()[valid] - local(ref.detach())[valid]).abs().max())}
        for name, got, want in (("dq", ql.grad, qr.grad), ("dk", kl.grad, kr.grad), ("dv", vl.grad, vr.grad)):
            errs[name] = float((got.float()[valid] - local(want)[valid]).abs().max())
        calls = flash_attn.CALLS[n_calls:]
        out[f"flash_ulysses_d{d}"] = {
            "ok": max(errs.values()) < 5e-2 and len(calls) == 1 and calls[0]["dtype"] == torch.bfloat16
                  and calls[0]["causal"] and calls[0]["cu"] == lay.full_cu_seqlens.tolist(),
            "errors": errs, "calls": len(calls), "dtype": o.dtype == torch.bfloat16}
    return out


def _exercise_runtime(registry, rank: int) -> None:
    """Everything a training run does with collectives, on this rank."""
    import torch
    import torch.distributed as dist

    from test_runtime_zero import LENGTHS, _fixed_plan, _run_stage
    from workbench.models import get_model
    from workbench.runtime.train import DistEnv, Trainer

    spec = get_model("tiny")
    gen = torch.Generator().manual_seed(11)
    seqs = [torch.randint(0, spec.vocab, (n,), generator=gen) for n in LENGTHS]
    for stage in (0, 1, 2, 3):
        _, _, zero, _ = _run_stage(registry, spec, _fixed_plan(stage, "fp32"), seqs, stage=stage, precision="fp32",
                                   optimizer="adamw")
        zero.clip_grad_norm(1.0) if stage != 3 else None  # after the step: the gradients are still there
        if stage in (1, 2):
            zero.optimizer_state_dict()  # consolidation for a whole-file checkpoint
    # the trainer's start (setup agreement) and its step's plan broadcast and final barrier
    t = Trainer(Path("/nonexistent"), DistEnv(rank=rank, world_size=WORLD, local_rank=rank, local_world_size=WORLD))
    t._agree(None)
    payload = [{"plan": "x"} if rank == 0 else None]
    dist.broadcast_object_list(payload, src=0)
    dist.barrier()


def _check_audit(_shared_registry, rank: int) -> dict:
    """Every collective of a training run's work, recorded: the registry of process groups made
    under the auditor too (its ``new_group`` calls), then the runtime exercised."""
    import torch.distributed as dist

    from workbench.runtime.groups import GroupRegistry

    records: list = []
    undo = _install_auditor(records)
    try:
        registry = GroupRegistry(dist.get_world_size(), [1, 2, 4])
        _exercise_runtime(registry, rank)
    finally:
        undo()
    return {"audit": records}


def world_checks() -> list:
    """The checks this file runs in the shared world (``tests/_torchrun.py``), in order."""
    return [_check_audit, _check_flash_ulysses]


# ------------------------------------------------------------------------------------------------
# pytest side
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_dist(request, tmp_path_factory):
    """This file's checks in the shared 4-rank world (launched once a session, ``tests/_torchrun.py``)."""
    per_rank = shared_world(request, tmp_path_factory, __name__)
    return [per_rank[str(r)] for r in range(WORLD)]  # in rank order


@pytest.mark.slow
def test_every_collective_is_one_nccl_runs(gpu_dist):
    for rank, res in enumerate(gpu_dist):
        calls = res["audit"]
        seen = {c["call"] for c in calls}
        # the run's collectives were all seen (the audit is not vacuous)
        assert {"all_reduce", "all_to_all_single", "reduce", "all_gather_object", "broadcast_object_list",
                "barrier"} <= seen, seen
        # FSDP2's parameter all-gathers and gradient reduce-scatters (torch 2.13 names them *_single)
        assert {"all_gather_single", "reduce_scatter_single"} <= seen or {"all_gather_into_tensor",
                                                                          "reduce_scatter_tensor"} <= seen, seen
        assert any(c["call"] == "broadcast" for c in calls), "ZeroRedundancyOptimizer's parameter broadcast"
        bad = [c for c in calls if c["call"] not in NCCL_CALLS or c["any_source"] or c["sparse"]
               or (c["op"] or "").split(".")[-1] in ("BAND", "BOR", "BXOR") or set(c["dtypes"]) - NCCL_DTYPES
               or set(c["devices"]) - {"cpu"}]
        assert not bad, f"rank {rank}: calls NCCL cannot make: {bad[:5]}"


@pytest.mark.slow
@pytest.mark.parametrize("d", [2, 4])
def test_flash_attention_inside_ulysses(gpu_dist, d):
    for rank, res in enumerate(gpu_dist):
        r = res[f"flash_ulysses_d{d}"]
        assert r["ok"], f"rank {rank}: {r}"
