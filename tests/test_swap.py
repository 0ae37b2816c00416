"""Blocks swapped instead of recomputed (``workbench.runtime.offload``: a group's ``swap_layers``),
each against an independent reference:

- a whole forward and backward of a small Transformer under recomputation with 0, 1, half and all
  of its blocks swapped, with and without the ``inputs`` offload on all or some rows, against the
  same model with neither (float64, 1e-10);
- what a step keeps outside the host buffers (``LiveBytes``) with every block swapped: what the
  plain step without recomputation keeps, less all but two blocks' activations; the host bytes are
  the cost model's ``block_activation_bytes`` per swapped block (but the last) and token, plus what
  the PyTorch attention path keeps besides a flash kernel; and attention runs once per block, where
  recomputation runs it twice (so no swapped block is recomputed);
- the step executor runs a plan's swapping groups (free micro-steps, world size 1) to the plain
  plan's gradients, recording the host bytes;
- ``check_plan`` refuses swap without recomputation, a swap outside the model's blocks and, in a
  lockstep pass, groups of one rank that swap differently, in one line each.

The 4-rank step with swapping groups is in ``tests/test_offload.py`` (its one torchrun launch).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import pytest
import torch

from workbench.models import get_model

pytestmark = pytest.mark.untimed


def _spec(layers=4, **kw):
    return dataclasses.replace(get_model("tiny"), layers=layers, **kw)


def _batch(spec, lengths, seed=0):
    from workbench.runtime.step import make_shard

    g = torch.Generator().manual_seed(seed)
    return make_shard([torch.randint(0, spec.vocab, (n,), generator=g) for n in lengths], 1, 0)


def _recomputing(spec, dtype=torch.float64, seed=3):
    from workbench.runtime.model import Transformer
    from workbench.runtime.offload import apply_offload
    from workbench.runtime.zero import apply_recompute

    model = Transformer(spec, seed=seed).to(dtype)
    apply_recompute(model)
    model.head.loss_chunk = 16
    apply_offload(model)
    return model


class _Counted:
    """The PyTorch attention, counting its calls: once per block forward, once more per recomputation."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *args):
        from workbench.runtime.attention import torch_varlen_attention

        self.calls += 1
        return torch_varlen_attention(*args)


def _loss_and_grads(model, sh, op=None, attn=None):
    from workbench.runtime.attention import torch_varlen_attention
    from workbench.runtime.offload import offloading

    model.zero_grad(set_to_none=True)
    with (offloading(model, op) if op is not None else contextlib.nullcontext()):
        loss = model(sh.tokens, sh.positions, sh.cu_seqlens, sh.max_seqlen, attn or torch_varlen_attention,
                     labels=sh.labels, mlp_fn=op.mlp if op is not None else None)
        loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


@functools.lru_cache(maxsize=1)
def _reference() -> tuple[float, dict]:
    """The loss and gradients of the 4-layer float64 recomputing model (seed 3) on the swap cases' batch
    with neither swap nor offload: the same for all twelve cases, computed once (read, never changed)."""
    spec = _spec(layers=4)
    return _loss_and_grads(_recomputing(spec), _batch(spec, [23, 9, 31, 14]))


@pytest.mark.parametrize("rows", ["none", "all", "some"])
@pytest.mark.parametrize("k", [0, 1, 2, 4])
def test_swapped_blocks_give_the_same_loss_and_gradients(k, rows):
    """float64, 4 layers, recomputation: ``k`` of 4 blocks swapped (``swap_blocks``: none, the last,
    every other one, all), the ``inputs`` offload (block inputs in host memory, the MLP sublayer in
    tiles of 5 tokens) on no row, every row or two of three row segments, give the loss and every
    parameter's gradient of the run with neither within 1e-10; attention runs once per block and
    once more per recomputed one; host memory held every swapped block's activations but the
    last's."""
    from workbench.runtime.offload import OffloadPass, swap_blocks

    spec = _spec(layers=4)
    sh = _batch(spec, [23, 9, 31, 14])
    T = int(sh.tokens.numel())
    segments = {"none": [(0, T, False)], "all": [(0, T, True)],
                "some": [(0, 23, True), (23, 32, False), (32, T, True)]}[rows]
    model = _recomputing(spec)
    ref_loss, ref = _reference()
    swapped = swap_blocks(spec.layers, k)
    op = OffloadPass(segments, layers=spec.layers, tile=5, swap=swapped)
    attn = _Counted()
    loss, got = _loss_and_grads(model, sh, op, attn)
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    for n, g in ref.items():
        torch.testing.assert_close(got[n], g, rtol=1e-10, atol=1e-10, msg=n)
    assert attn.calls == spec.layers + (spec.layers - k)
    assert (op.swap_host_bytes > 0) == any(i < spec.layers - 1 for i in swapped)
    assert op.wait_ms == 0.0  # CPU: synchronous copies


def _peak(model, sh, op=None, autocast=False) -> tuple[int, int]:
    """``LiveBytes``' peak over one forward and backward (parameters and gradients counted from the
    start), and the attention calls."""
    from workbench.runtime.live import LiveBytes
    from workbench.runtime.offload import offloading

    attn = _Counted()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with LiveBytes() as live:
        for p in model.parameters():
            p.grad.zero_()
            p.detach()
        with (offloading(model, op) if op is not None else contextlib.nullcontext()):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = model(sh.tokens, sh.positions, sh.cu_seqlens, sh.max_seqlen, attn, labels=sh.labels,
                             mlp_fn=op.mlp if op is not None else None)
            loss.backward()
    return live.peak, attn.calls


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast"])
def test_swapping_every_block_keeps_two_blocks_and_recomputes_none(autocast):
    """6 layers of the tiny model's width, batches of 512 and 1,024 tokens (sequences of 64); fp32,
    or bf16 autocast over fp32 weights. Per token (the peaks' growth from one batch to the other, so
    that what does not grow with the tokens, the weights and autocast's copies of them, drops out):

    - host bytes: ``block_activation_bytes`` (the cost model's per-block activations) for each
      swapped block but the last, plus what the PyTorch attention path keeps besides a flash
      kernel (K and V repeated to the query heads, its output once more, concatenated): exactly
      (fp32 5,592 = 5,080 + 512; autocast 3,704 = 3,448 + 256);
    - the device, every block swapped: what the plain step (no recomputation) keeps, less all but
      two blocks' activations (the one in use and the one in flight), within 8%: measured fp32
      12,888 against 12,465 (+3.4%), autocast 8,392 against 7,960 (+5.4%). The plain step's peak is
      at its forward's end, the swapped step's in a block's backward; since the chunked loss takes
      the final norm in (its fp32 input, normed output and head-input gradient gone: ``4h + c h + 4``
      a token), the plain step's is that much lower and the swapped step's is not (the outside
      norm's tensors were freed before a block's backward anyway): before, +1.3% and -1.0%. The
      recomputing step keeps 8,576 and 5,968: swapping every block costs about one block's
      activations less the blocks' inputs;
    - attention runs 6 times (12 with recomputation): no swapped block is recomputed."""
    from workbench.cost import block_activation_bytes
    from workbench.runtime.model import Transformer
    from workbench.runtime.offload import OffloadPass, swap_blocks

    spec = _spec(layers=6)
    L = spec.layers
    model = _recomputing(spec, dtype=torch.float32)
    model.head.loss_chunk = 256
    plain_model = Transformer(spec, seed=3)
    plain_model.head.loss_chunk = 256  # the same chunked loss: only the blocks differ
    c = 2 if autocast else spec.dtype_bytes
    torch_path = c * (2 * (spec.q_dim - spec.kv_dim) + spec.q_dim)  # repeated K and V, the output's copy
    per_block = block_activation_bytes(spec, autocast=autocast) + torch_path
    peaks: dict[str, list[int]] = {"plain": [], "recomputed": [], "swapped": []}
    sizes = (8, 16)
    for n in sizes:
        sh = _batch(spec, [64] * n)
        T = int(sh.tokens.numel())
        plain, plain_calls = _peak(plain_model, sh, autocast=autocast)
        recomputed, re_calls = _peak(model, sh, autocast=autocast)
        op = OffloadPass([(0, T, False)], layers=L, tile=64, swap=swap_blocks(L, L))
        swapped, calls = _peak(model, sh, op, autocast=autocast)
        assert (plain_calls, re_calls, calls) == (L, 2 * L, L)
        assert op.swap_host_bytes == (L - 1) * T * per_block
        for key, v in (("plain", plain), ("recomputed", recomputed), ("swapped", swapped)):
            peaks[key].append(v)
    dT = 64 * (sizes[1] - sizes[0])
    slope = {key: (v[1] - v[0]) / dT for key, v in peaks.items()}
    want = slope["plain"] - (L - 2) * per_block
    print(f"\nper token: swapping every block keeps {slope['swapped']:.0f} B (plain less {L - 2} blocks: {want:.0f}, "
          f"{slope['swapped'] / want - 1:+.1%}); recomputation keeps {slope['recomputed']:.0f}; plain "
          f"{slope['plain']:.0f}; host {per_block * (L - 1):.0f} ({per_block:.0f} a block)")
    assert slope["swapped"] == pytest.approx(want, rel=0.08)


# ---- the step executor and check_plan ------------------------------------------------------------

def _plan(micro, lengths, *, world=1, stage=0, recompute=True, blocks=None):
    from workbench.cost import CostModel
    from workbench.cost.memory import optimizer_kind
    from workbench.solve.plan import build_plan
    from workbench.specs import ClusterSpec, load_profile

    cost = CostModel(load_profile("cpu-gloo-tiny"), get_model("tiny"),
                     ClusterSpec(num_gpus=world, gpus_per_node=world, gpu_memory_gb=4.0, zero_stage=stage),
                     precision="fp32", recompute=recompute, optimizer=optimizer_kind("sgd", 0.0))
    return build_plan("hand", micro, lengths, cost, blocks=blocks)


def _with(plan, **fields_of):
    """``plan`` with each group's fields set by ``fields_of[name](m, k)`` (micro-step m, group k);
    fields a Group would refuse (a negative swap) are set behind its back."""
    steps = []
    for m, ms in enumerate(plan.micro_steps):
        groups = []
        for k, g in enumerate(ms.groups):
            vals = {name: f(m, k) for name, f in fields_of.items()}
            try:
                g = dataclasses.replace(g, **vals)
            except ValueError:
                g = dataclasses.replace(g)
                for name, v in vals.items():
                    object.__setattr__(g, name, v)
            groups.append(g)
        steps.append(dataclasses.replace(ms, groups=tuple(groups)))
    return dataclasses.replace(plan, micro_steps=tuple(steps))


def test_the_executor_swaps_the_groups_that_say_so():
    """World size 1, ZeRO-0 with recomputation, float64, the tiny model's 2 blocks: micro-steps
    swapping both blocks (with offload), the last one, and none give the plain plan's gradients
    (1e-10); the records say what each group swapped and the host bytes it took (one block's
    activations for a swap of both, nothing for the last alone)."""
    from workbench.runtime.attention import torch_varlen_attention
    from workbench.runtime.groups import GroupRegistry
    from workbench.runtime.model import Transformer
    from workbench.runtime.step import StepExecutor
    from workbench.runtime.zero import parallelize

    spec = get_model("tiny")
    lengths = [40, 9, 23, 17]
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, spec.vocab, (n,), generator=g) for n in lengths]
    plain = _plan([[(1, [0, 1])], [(1, [2])], [(1, [3])]], lengths)
    swapping = _with(plain, swap_layers=lambda m, k: [2, 1, 0][m], offload=lambda m, k: "inputs" if m == 0 else "none")
    grads, records = [], []
    for plan in (plain, swapping):
        model = Transformer(spec, seed=2).double()
        zero = parallelize(model, zero_stage=0, precision="fp32", recompute=True)
        res = StepExecutor(model, GroupRegistry(1, [1]), torch_varlen_attention, zero=zero).run(plan, seqs)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        records.append(res.records)
    for n, gr in grads[0].items():
        torch.testing.assert_close(grads[1][n], gr, rtol=1e-10, atol=1e-10, msg=n)
    assert [r.groups[0]["swap_layers"] for r in records[1]] == [2, 1, 0]
    assert records[1][0].swap_host_mb > 0 and records[1][1].swap_host_mb == 0 == records[1][2].swap_host_mb
    assert all(r.swap_host_mb == 0 for r in records[0])


def test_check_plan_refuses_swaps_it_cannot_run():
    from workbench.runtime.step import check_plan
    from workbench.solve.plan import PlanError

    lengths = [30, 7, 12]
    plan = _with(_plan([[(1, [0])], [(1, [1])]], lengths[:2], recompute=False), swap_layers=lambda m, k: m)
    with pytest.raises(PlanError, match=r"^micro-step 1: group at ranks \[0\] swaps 1 blocks \(keeps their activations "
                                        r"in host memory instead of recomputing them\), which needs --recompute[^\n]*$"):
        check_plan(plan, lengths[:2], 1)  # the plan's own recompute (none)
    check_plan(dataclasses.replace(plan, recompute=True), lengths[:2], 1, recompute=True, layers=2)
    for k in (3, -1):
        odd = _with(_plan([[(1, [0, 1])]], lengths[:2]), swap_layers=lambda m, i, k=k: k)
        with pytest.raises(PlanError, match=rf"^micro-step 0: group at ranks \[0\] swaps {k} blocks, outside 0..2 "
                                            r"\(the model's blocks\)[^\n]*$"):
            check_plan(odd, lengths[:2], 1, layers=2)
    # ZeRO-3: rank 0 packs a degree-2 group and a degree-1 group in pass 0; swapping differently, refused
    lock = _plan([[(2, [0]), (1, [1]), (1, [2])]], lengths, world=2, stage=3, blocks=[[0, 0, 1]])
    mixed = _with(lock, swap_layers=lambda m, k: [2, 1, 2][k])
    with pytest.raises(PlanError, match=r"^pass 0: rank\(s\) \[0\] serve groups that swap different numbers of "
                                        r"blocks \(1, 2\)[^\n]*$"):
        check_plan(mixed, lengths, 2, layers=2)
    check_plan(_with(lock, swap_layers=lambda m, k: [1, 1, 1][k]), lengths, 2, layers=2)
