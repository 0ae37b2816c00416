"""Block inputs offloaded to host memory and the tiled MLP (``workbench.runtime.offload``), each
against an independent reference:

- the tiled MLP, and the tiled MLP sublayer (the block's norm inside the tile), against the plain
  ``MLP`` module and ``mlp(norm(x))`` (float64: values and every gradient to rounding, the norm's
  weight's included, tiles that do and do not divide the tokens; central finite differences of the
  input gradient); under CPU autocast against the plain modules under autocast; what each keeps;
- a whole forward and backward of a small Transformer under recomputation with offload and tiling
  on all rows and on some rows, against the same model without (float64, 1e-10);
- what a step keeps outside the offload buffers (``LiveBytes``): offloading saves exactly the inputs
  of all but two layers; the whole lever saves the inputs, the MLP's intermediates and the norm's
  tensors (``(layers-2) h resid + 4 c ffn + 4 h + 2 c h``) within 10% under autocast, and in fp32
  that plus up to the plain MLP's backward gradients the memory model does not count;
- one SGD step of a plan mixing Ulysses x CP groups, some of them offloading, and the same plan with
  swapped blocks besides (``tests/test_swap.py`` has the one-process checks), on 4 gloo ranks under
  ZeRO-0 and ZeRO-3, against the same plan without either (fp32, 1e-5; slow, on the shared torchrun
  world of ``tests/_torchrun.py``);
- ``check_plan`` refuses offload without recomputation and unknown levels, in one line.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from workbench.models import get_model
from workbench.runtime.model import MLP, RMSNorm
from workbench.runtime.offload import tiled_mlp

pytestmark = pytest.mark.untimed


def _mlp(hidden=6, ffn=11, dtype=torch.float64, seed=0):
    spec = dataclasses.replace(get_model("tiny"), hidden=hidden, heads=1, kv_heads=1, ffn=ffn)
    torch.manual_seed(seed)
    m = MLP(spec).to(dtype)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return m


def _grads(m, x, fn, gy):
    xx = x.detach().clone().requires_grad_()
    y = fn(m, xx)
    gs = torch.autograd.grad(y, [xx, *m.parameters()], gy)
    return y.detach(), gs


@pytest.mark.parametrize("tile", [1, 4, 7, 16, 100])
def test_tiled_mlp_equals_the_plain_mlp(tile):
    """float64, 16 tokens: tiles of 1, 4 (dividing), 7 (not dividing), 16 (one tile) and more
    than the tokens; the output and the gradients of the input and of gate, up and down."""
    m = _mlp()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 6, generator=g, dtype=torch.float64)
    gy = torch.randn(16, 6, generator=g, dtype=torch.float64)
    y0, g0 = _grads(m, x, lambda m, x: m(x), gy)
    y1, g1 = _grads(m, x, lambda m, x: tiled_mlp(m, x, tile), gy)
    torch.testing.assert_close(y1, y0, rtol=1e-13, atol=1e-13)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _norm(hidden=6, dtype=torch.float64, seed=0):
    torch.manual_seed(seed + 100)
    n = RMSNorm(hidden, eps=1e-5).to(dtype)
    torch.nn.init.normal_(n.weight, mean=1.0, std=0.3)  # not ones: its gradient and its scaling both show
    return n


@pytest.mark.parametrize("tile", [1, 4, 7, 16, 100])
def test_tiled_sublayer_equals_the_plain_norm_and_mlp(tile):
    """float64, 16 tokens: ``tiled_mlp(mlp, x, tile, norm=norm)`` against ``mlp(norm(x))``, the
    output and the gradients of the input and of the norm's weight, gate, up and down."""
    m, n = _mlp(), _norm()
    g = torch.Generator().manual_seed(1)
    x = 3.0 * torch.randn(16, 6, generator=g, dtype=torch.float64)
    gy = torch.randn(16, 6, generator=g, dtype=torch.float64)

    def grads(fn):
        xx = x.detach().clone().requires_grad_()
        y = fn(xx)
        return y.detach(), torch.autograd.grad(y, [xx, *n.parameters(), *m.parameters()], gy)

    y0, g0 = grads(lambda xx: m(n(xx)))
    y1, g1 = grads(lambda xx: tiled_mlp(m, xx, tile, norm=n))
    torch.testing.assert_close(y1, y0, rtol=1e-13, atol=1e-13)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_tiled_mlp_input_gradient_against_finite_differences():
    m = _mlp(hidden=3, ffn=5)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 3, generator=g, dtype=torch.float64)  # the loss: <w, mlp(x)>
    (gx,) = torch.autograd.grad((tiled_mlp(m, x, 2) * w).sum(), x)
    eps = 1e-6
    with torch.no_grad():
        for k in range(x.numel()):
            x.view(-1)[k] += eps
            up = float((tiled_mlp(m, x, 2) * w).sum())
            x.view(-1)[k] -= 2 * eps
            down = float((tiled_mlp(m, x, 2) * w).sum())
            x.view(-1)[k] += eps
            assert gx.view(-1)[k].item() == pytest.approx((up - down) / (2 * eps), abs=1e-8)


def test_tiled_mlp_under_autocast_follows_the_plain_one():
    """CPU bf16 autocast over fp32 weights: the output in bf16 as the plain MLP's, its values and
    gradients within bf16 rounding of the plain path's (the tiled one sums the weights' gradients
    over tiles in fp32, the plain one in one bf16 matmul)."""
    m = _mlp(hidden=32, ffn=48, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 32, generator=g)
    gy = torch.randn(40, 32, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        xx0 = x.clone().requires_grad_()
        y0 = m(xx0)
        xx1 = x.clone().requires_grad_()
        y1 = tiled_mlp(m, xx1, 16)
    assert y1.dtype == y0.dtype == torch.bfloat16
    g0 = torch.autograd.grad(y0, [xx0, *m.parameters()], gy.to(y0.dtype))
    g1 = torch.autograd.grad(y1, [xx1, *m.parameters()], gy.to(y1.dtype))
    torch.testing.assert_close(y1.float(), y0.float(), rtol=0, atol=0)  # every row the same bf16 arithmetic
    for a, b in zip(g1, g0):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * float(b.abs().max()))


def test_tiled_sublayer_under_autocast_follows_the_plain_one():
    """CPU bf16 autocast over fp32 weights and an fp32 residual stream: the tiled sublayer's output
    is the plain ``mlp(norm(x))``'s bit for bit, its gradients (the norm weight's included) within
    bf16 rounding of the plain path's."""
    m, n = _mlp(hidden=32, ffn=48, dtype=torch.float32), _norm(32, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 32, generator=g)
    gy = torch.randn(40, 32, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        xx0 = x.clone().requires_grad_()
        y0 = m(n(xx0))
        xx1 = x.clone().requires_grad_()
        y1 = tiled_mlp(m, xx1, 16, norm=n)
    assert y1.dtype == y0.dtype == torch.bfloat16
    params = [*n.parameters(), *m.parameters()]
    g0 = torch.autograd.grad(y0, [xx0, *params], gy.to(y0.dtype))
    g1 = torch.autograd.grad(y1, [xx1, *params], gy.to(y1.dtype))
    torch.testing.assert_close(y1.float(), y0.float(), rtol=0, atol=0)
    for a, b in zip(g1, g0):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * float(b.abs().max()))


def test_tiled_mlp_keeps_only_its_input():
    """What autograd keeps for the tiled MLP is the input (and the weights, not copies); the plain
    MLP keeps its intermediates, ``4 x ffn`` a token."""
    m = _mlp(hidden=8, ffn=24, dtype=torch.float32)
    x = torch.randn(50, 8, requires_grad=True)
    for fn, want in ((lambda: tiled_mlp(m, x, 7), 0), (lambda: m(x), 4 * 24 * 50)):
        sizes: list[int] = []

        def pack(t, sizes=sizes):
            if t.shape[0] == 50 and t.data_ptr() != x.data_ptr():
                sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        assert sum(sizes) == want


def test_tiled_sublayer_keeps_only_its_input():
    """The tiled sublayer keeps its input itself and nothing else of the tokens; the plain norm and
    MLP keep (fp32, distinct storages) the norm's statistics (1 a token), its normed input and output
    (``2 x hidden``) and the MLP's four intermediates (``4 x ffn``)."""
    m, n = _mlp(hidden=8, ffn=24, dtype=torch.float32), _norm(8, dtype=torch.float32)
    x = torch.randn(50, 8, requires_grad=True)
    for fn, want in ((lambda: tiled_mlp(m, x, 7, norm=n), 0), (lambda: m(n(x)), 50 * (1 + 2 * 8 + 4 * 24))):
        kept: dict[int, int] = {}

        def pack(t, kept=kept):
            if t.dim() and t.shape[0] == 50 and t.data_ptr() != x.data_ptr():
                kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes() // 4
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        assert sum(kept.values()) == want


def test_tiled_mlp_refuses_a_bad_tile():
    with pytest.raises(ValueError, match="at least 1 token"):
        tiled_mlp(_mlp(), torch.zeros(3, 6, dtype=torch.float64), 0)


# ---- one process: the whole model ------------------------------------------------------------------

def _spec(layers=4, **kw):
    return dataclasses.replace(get_model("tiny"), layers=layers, **kw)


def _batch(spec, lengths, seed=0):
    from workbench.runtime.step import make_shard

    g = torch.Generator().manual_seed(seed)
    return make_shard([torch.randint(0, spec.vocab, (n,), generator=g) for n in lengths], 1, 0)


def _loss_and_grads(model, sh, op=None):
    """Summed token loss and every parameter's gradient of one forward and backward, with the pass
    ``op`` active (None: plain)."""
    import contextlib

    from workbench.runtime.attention import torch_varlen_attention
    from workbench.runtime.offload import offloading

    model.zero_grad(set_to_none=True)
    with (offloading(model, op) if op is not None else contextlib.nullcontext()):
        loss = model(sh.tokens, sh.positions, sh.cu_seqlens, sh.max_seqlen, torch_varlen_attention, labels=sh.labels,
                     mlp_fn=op.mlp if op is not None else None)
        loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def _recomputing(spec, dtype=torch.float64, seed=3):
    from workbench.runtime.model import Transformer
    from workbench.runtime.offload import apply_offload
    from workbench.runtime.zero import apply_recompute

    model = Transformer(spec, seed=seed).to(dtype)
    apply_recompute(model)
    model.head.loss_chunk = 16
    apply_offload(model)
    return model


@pytest.mark.parametrize("rows", ["all", "some"])
def test_offload_and_tiling_give_the_same_loss_and_gradients(rows):
    """float64, 4 layers, recomputation: offloaded block inputs and a tiled MLP (tiles of 5 tokens,
    not dividing the rows) on every row, or on two of three row segments of a packed batch, give
    the loss and every parameter's gradient of the plain run within 1e-10; the host buffers held
    ``layers - 1`` blocks' offloaded rows (the last block's input stays)."""
    from workbench.runtime.offload import OffloadPass

    spec = _spec(layers=4)
    sh = _batch(spec, [23, 9, 31, 14])
    T = int(sh.tokens.numel())
    segments = [(0, T, True)] if rows == "all" else [(0, 23, True), (23, 32, False), (32, T, True)]
    model = _recomputing(spec)
    ref_loss, ref = _loss_and_grads(model, sh)
    op = OffloadPass(segments, layers=spec.layers, tile=5)
    loss, got = _loss_and_grads(model, sh, op)
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    for n, g in ref.items():
        torch.testing.assert_close(got[n], g, rtol=1e-10, atol=1e-10, msg=n)
    off_rows = sum(hi - lo for lo, hi, on in segments if on)
    assert op.peak_host_bytes == (spec.layers - 1) * off_rows * spec.hidden * 8
    assert op.host_bytes == 0 and op.wait_ms == 0.0  # released at the end; CPU copies do not wait


def test_a_pass_without_offloaded_rows_changes_nothing():
    """Segments that offload nothing: no hooks, the plain MLP, the same result; the model runs
    plainly again after a pass."""
    from workbench.runtime.offload import OffloadPass

    spec = _spec(layers=3)
    sh = _batch(spec, [12, 7])
    model = _recomputing(spec)
    ref_loss, ref = _loss_and_grads(model, sh)
    op = OffloadPass([(0, 19, False)], layers=spec.layers, tile=4)
    loss, got = _loss_and_grads(model, sh, op)
    assert op.peak_host_bytes == 0 and loss == ref_loss
    assert all(torch.equal(got[n], g) for n, g in ref.items())
    loss2, _ = _loss_and_grads(model, sh)
    assert loss2 == ref_loss


def test_offload_needs_recomputation():
    from workbench.runtime.model import Transformer
    from workbench.runtime.offload import OffloadPass, apply_offload, offloading

    model = Transformer(_spec(layers=2))
    with pytest.raises(ValueError, match="needs recomputation"):
        apply_offload(model)
    with pytest.raises(ValueError, match="does not offload block inputs"):
        with offloading(model, OffloadPass([(0, 4, True)], layers=2, tile=2)):
            pass


def _peak(model, sh, *, tile=None, offload=False, autocast=False, mlp_fn=None) -> int:
    """``LiveBytes``' peak over one forward and backward (the forward under CPU bf16 autocast with
    ``autocast``), parameters and gradients counted from the start in every run: the bytes the step
    keeps, outside the offload pass's host buffers. ``tile``: the MLP sublayer tiled (``RowMLP``);
    ``mlp_fn``: the blocks' hook as given."""
    import contextlib

    from workbench.runtime.attention import torch_varlen_attention
    from workbench.runtime.live import LiveBytes
    from workbench.runtime.offload import OffloadPass, RowMLP, offloading

    T = int(sh.tokens.numel())
    op = OffloadPass([(0, T, True)], layers=len(model.blocks), tile=tile) if offload else None
    if mlp_fn is None:
        mlp_fn = op.mlp if op is not None else RowMLP([(0, T, True)], tile) if tile else None
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with LiveBytes() as live:
        for p in model.parameters():
            # counted from the start in every run: LiveBytes counts a storage made before it when an
            # operator first returns it (the tiled MLP's backward detaches the weights), which would
            # otherwise add a block's weights as the backward reaches it
            p.grad.zero_()
            p.detach()
        with (offloading(model, op) if op is not None else contextlib.nullcontext()):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = model(sh.tokens, sh.positions, sh.cu_seqlens, sh.max_seqlen, torch_varlen_attention,
                             labels=sh.labels, mlp_fn=mlp_fn)
            loss.backward()
    return live.peak


@pytest.mark.long
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast"])
def test_what_a_step_keeps_falls_by_the_offloaded_inputs_and_the_mlp_intermediates(autocast):
    """6 layers of the tiny model's width, 2,048 tokens (16 sequences of 128), recomputation, the MLP
    sublayer (norm and MLP) in tiles of ``mlp_tile_tokens`` (64); fp32, or bf16 autocast over fp32
    weights (the residual stream, and so the block inputs, stay fp32). Measured per token
    (``LiveBytes`` peaks):

    - offloading the block inputs (tiled both ways) saves exactly the inputs of all but two layers,
      ``(layers - 2) x hidden x 4`` = 1,024 bytes (measured 1,024 both ways);
    - the norm inside the tile, against the MLP alone tiled: the norm's tensors, its statistics (4)
      and normed input (4 h), and its output (fp32: 4 h) or (autocast) the bf16 copy of it the tiled
      MLP kept (2 h): 516 and 388 bytes, measured 533 and 444 (the rest: the plain norm's backward
      transients, which the tile also holds for a tile only);
    - the whole lever (offload and tiling, against neither) against the memory model's
      ``offload_saved_bytes_per_token`` (``(layers-2) h resid + 4 c ffn + 4 h + 2 c h``): under autocast within 10% (measured 3,041
      against 2,912, +4.4%); in fp32 at least the formula and at most that plus the two
      ``ffn``-wide gradients the plain MLP's backward holds at its peak besides its four saved
      intermediates, which the memory model does not count (``2 x ffn x 4`` = 1,376): measured
      5,173 against 4,544."""
    from workbench.cost.offload import mlp_tile_tokens, offload_saved_bytes_per_token

    spec = _spec(layers=6)
    sh = _batch(spec, [128] * 16)
    T = int(sh.tokens.numel())
    model = _recomputing(spec, dtype=torch.float32)
    model.head.loss_chunk = 256
    tile = mlp_tile_tokens(spec)
    plain = _peak(model, sh, autocast=autocast)
    mlp_only = _peak(model, sh, autocast=autocast, mlp_fn=lambda norm, mlp, x: tiled_mlp(mlp, norm(x), tile))
    tiled = _peak(model, sh, tile=tile, autocast=autocast)
    both = _peak(model, sh, tile=tile, offload=True, autocast=autocast)
    inputs = (tiled - both) / T
    norm_part = (mlp_only - tiled) / T
    drop = (plain - both) / T
    formula = offload_saved_bytes_per_token(spec, autocast=autocast)
    h = spec.hidden
    norm_want = 4 + 4 * h + (2 * h if autocast else 4 * h)
    print(f"\nper token: drop {drop:.0f} B (formula {formula:.0f}, {drop / formula - 1:+.1%}); inputs part {inputs:.0f} "
          f"(expected {(spec.layers - 2) * h * 4}); the norm in the tile {norm_part:.0f} (expected {norm_want}); "
          f"tiling part {(plain - tiled) / T:.0f}")
    assert inputs == pytest.approx((spec.layers - 2) * h * 4, rel=0.01)
    assert norm_want <= norm_part <= 1.15 * norm_want  # and some of the plain norm's backward transients
    if autocast:
        assert drop == pytest.approx(formula, rel=0.10)
    else:
        assert formula <= drop <= formula + 2 * spec.ffn * 4


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


def _with_offload(plan, level_of):
    """``plan`` with group ``k`` of micro-step ``m`` at offload ``level_of(m, k)``."""
    steps = tuple(dataclasses.replace(ms, groups=tuple(dataclasses.replace(g, offload=level_of(m, k))
                                                       for k, g in enumerate(ms.groups)))
                  for m, ms in enumerate(plan.micro_steps))
    return dataclasses.replace(plan, micro_steps=steps)


def test_the_executor_offloads_the_groups_that_say_so():
    """World size 1, ZeRO-0 with recomputation, float64: a plan of three micro-steps, the first and
    the last offloading, gives the gradients of the same plan without offload (1e-10); the records
    say which group offloaded and that no copy was waited for (CPU)."""
    from workbench.runtime.attention import torch_varlen_attention
    from workbench.runtime.groups import GroupRegistry
    from workbench.runtime.model import Transformer
    from workbench.runtime.step import StepExecutor
    from workbench.runtime.zero import parallelize

    spec = _spec(layers=4)
    lengths = [40, 9, 23, 17]
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, spec.vocab, (n,), generator=g) for n in lengths]
    plain = _plan([[(1, [0, 1])], [(1, [2])], [(1, [3])]], lengths)
    offl = _with_offload(plain, lambda m, k: "inputs" if m != 1 else "none")
    grads, records = [], []
    for plan in (plain, offl):
        model = Transformer(spec, seed=2).double()
        zero = parallelize(model, zero_stage=0, precision="fp32", recompute=True)
        res = StepExecutor(model, GroupRegistry(1, [1]), torch_varlen_attention, zero=zero).run(plan, seqs)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        records.append(res.records)
    for n, gr in grads[0].items():
        torch.testing.assert_close(grads[1][n], gr, rtol=1e-10, atol=1e-10, msg=n)
    assert [r.groups[0]["offload"] for r in records[1]] == ["inputs", "none", "inputs"]
    assert all(r.offload_wait_ms == 0.0 and "offload_wait_ms" in r.to_dict() for r in records[1])


def test_check_plan_refuses_offload_without_recomputation_and_unknown_levels():
    from workbench.runtime.step import check_plan
    from workbench.solve.plan import PlanError

    lengths = [30, 7]
    plan = _with_offload(_plan([[(1, [0])], [(1, [1])]], lengths, recompute=False),
                         lambda m, k: "inputs" if m == 1 else "none")
    with pytest.raises(PlanError, match=r"^micro-step 1: group at ranks \[0\] offloads its block inputs, which needs "
                                        r"--recompute [^\n]*$"):
        check_plan(plan, lengths, 1)  # the plan's own recompute (none)
    with pytest.raises(PlanError, match="which needs --recompute"):
        check_plan(plan, lengths, 1, recompute=False)  # the run's
    check_plan(dataclasses.replace(plan, recompute=True), lengths, 1, recompute=True)
    odd = _plan([[(1, [0, 1])]], lengths)
    object.__setattr__(odd.micro_steps[0].groups[0], "offload", "everything")  # what no Group would accept
    with pytest.raises(PlanError, match=r"^micro-step 0: group at ranks \[0\] has offload 'everything', which is not "
                                        r"one of none, inputs[^\n]*$"):
        check_plan(odd, lengths, 1)


# ---- 4 gloo ranks: the shared torchrun world (tests/_torchrun.py) -----------------------------------

WORLD = 4
DIST_TIMEOUT_S = 60
WORLD_SHAPES = ((4, 2),)
FP32_RTOL = 1e-5
LR = 0.5
DIST_LENGTHS = [300, 33, 6, 150, 41, 7, 90, 19]


def _dist_plan(stage: int):
    """Pass/micro-step 0: a 2x2 group (Ulysses 2 x CP 2) over all four ranks, offloading. Then groups
    of degree 2 (ranks 0-1, offloading), 1 (rank 2, not) and 1 (rank 3, offloading); under ZeRO-3 one
    more degree-1 group on rank 0 that does not offload, packed in rank 0's pass after its
    offloading degree-2 group (the offload applies to the first segment of the pass only). The
    300-token sequence gives each rank of the 2x2 group 75 rows and the 150 one rank 3 150: more
    than one MLP tile (``mlp_tile_tokens`` = 64). Returns the plain plan, the offloading one, and
    the offloading one with swapped blocks (of the tiny model's 2): the 2x2 group both, ranks 0-1's
    degree-2 group the last one (under ZeRO-3 so does rank 0's degree-1 group, packed with it:
    one rank's pass swaps one set of blocks), rank 2's group both, rank 3's none."""
    if stage == 3:
        micro = [[(4, [0, 2], 2)], [(2, [1, 5]), (1, [4]), (1, [3]), (1, [6, 7])]]
        blocks = [[0], [0, 0, 2, 3]]
        levels = [["inputs"], ["inputs", "none", "none", "inputs"]]
        swaps = [[2], [1, 1, 2, 0]]
    else:
        micro = [[(4, [0, 2], 2)], [(2, [1, 4, 5]), (1, [3]), (1, [6, 7])]]
        blocks = [[0], [0, 2, 3]]
        levels = [["inputs"], ["inputs", "none", "inputs"]]
        swaps = [[2], [1, 2, 0]]
    plan = _plan(micro, DIST_LENGTHS, world=WORLD, stage=stage, blocks=blocks)
    offl = _with_offload(plan, lambda m, k: levels[m][k])
    steps = tuple(dataclasses.replace(ms, groups=tuple(dataclasses.replace(g, swap_layers=swaps[m][k])
                                                       for k, g in enumerate(ms.groups)))
                  for m, ms in enumerate(offl.micro_steps))
    return plan, offl, dataclasses.replace(offl, micro_steps=steps)


def _dist_step(registry, plan, seqs, stage):
    """One SGD step of ``plan`` under ``stage`` (fp32, recomputation): ({name: full updated tensor},
    StepResult)."""
    from workbench.runtime.attention import torch_varlen_attention
    from workbench.runtime.model import Transformer
    from workbench.runtime.step import StepExecutor
    from workbench.runtime.zero import parallelize

    model = Transformer(get_model("tiny"), seed=3)
    zero = parallelize(model, zero_stage=stage, precision="fp32", recompute=True)
    opt = zero.make_optimizer("sgd", lr=LR)
    res = StepExecutor(model, registry, torch_varlen_attention, zero=zero).run(plan, seqs)
    opt.step()
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()}
    return full, res


def _check_offload_steps(registry, rank) -> dict:
    from workbench.runtime.model import Transformer

    spec = get_model("tiny")
    g = torch.Generator().manual_seed(11)
    seqs = [torch.randint(0, spec.vocab, (n,), generator=g) for n in DIST_LENGTHS]
    init = {n: p.detach().clone() for n, p in Transformer(spec, seed=3).named_parameters()}
    out = {}
    for stage in (0, 3):
        plain, offl, swapping = _dist_plan(stage)
        ref, ref_res = _dist_step(registry, plain, seqs, stage)
        for name, plan in (("offload", offl), ("swap", swapping)):
            got, res = _dist_step(registry, plan, seqs, stage)
            worst, where = 0.0, ""
            for n, r in ref.items():
                du, dr = got[n] - init[n], r - init[n]
                rel = float((du - dr).norm()) / max(float(dr.norm()), 1e-30)
                if rel > worst:
                    worst, where = rel, n
            levels = [[gr["offload"] for gr in rec.groups] for rec in res.records]
            out[f"{name}_z{stage}"] = {
                "ok": worst < FP32_RTOL and abs(res.loss - ref_res.loss) <= FP32_RTOL * ref_res.loss,
                "worst_rel": worst, "worst_param": where, "loss": res.loss, "ref_loss": ref_res.loss,
                "levels": levels, "splits": [[f"{gr['degree'] // gr['cp']}x{gr['cp']}" for gr in rec.groups]
                                             for rec in res.records],
                "swaps": [[gr["swap_layers"] for gr in rec.groups] for rec in res.records],
                "wait_ms": [rec.offload_wait_ms for rec in res.records],
                "host_mb": [rec.offload_host_mb for rec in res.records],
                "swap_mb": [rec.swap_host_mb for rec in res.records],
                "rows": [rec.padded_tokens for rec in res.records]}
    return out


def world_checks() -> list:
    """The checks this file runs in the shared world (``tests/_torchrun.py``)."""
    return [_check_offload_steps]


@pytest.fixture(scope="module")
def offload_results(request, tmp_path_factory):
    """This file's checks in the shared 4-rank world (launched once a session, ``tests/_torchrun.py``)."""
    from _torchrun import by_check, shared_world

    return by_check(shared_world(request, tmp_path_factory, __name__))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 3])
def test_a_step_with_offloading_groups_equals_the_step_without(offload_results, stage):
    """fp32, recomputation: one SGD step of a plan whose 2x2 (Ulysses x CP) group and some of whose
    degree-2 and degree-1 groups offload updates every parameter as the same plan without offload
    (1e-5 relative), under ZeRO-0 (free) and ZeRO-3 (lockstep, a rank packing an offloading and a
    plain group in one pass); every rank ran the groups at the levels the plan says."""
    from _torchrun import assert_all_ranks

    assert_all_ranks(offload_results, f"offload_z{stage}", WORLD)
    per_rank = offload_results[f"offload_z{stage}"]
    assert per_rank["0"]["splits"][0] == ["2x2"] and per_rank["0"]["levels"][0] == ["inputs"]
    want_rank0 = ["inputs", "none"] if stage == 3 else ["inputs"]
    assert per_rank["0"]["levels"][1] == want_rank0
    assert per_rank["2"]["levels"][1] == ["none"] and per_rank["3"]["levels"][1] == ["inputs"]
    assert all(w == 0.0 for v in per_rank.values() for w in v["wait_ms"])  # CPU: synchronous copies
    # what went to host memory: every block's input but the last one's, of the offloading rows (fp32)
    spec = get_model("tiny")
    per_row = (spec.layers - 1) * spec.hidden * 4 / 2**20
    assert per_rank["0"]["rows"][0] > 0 and per_rank["0"]["host_mb"][0] == pytest.approx(per_rank["0"]["rows"][0] * per_row)
    assert per_rank["2"]["host_mb"][1] == 0.0 and per_rank["3"]["host_mb"][1] == pytest.approx(
        per_rank["3"]["rows"][1] * per_row)
    if stage == 3:  # rank 0's pass: only its degree-2 group's rows (its degree-1 group's 41 tokens stay)
        assert per_rank["0"]["host_mb"][1] == pytest.approx((per_rank["0"]["rows"][1] - 41) * per_row)
    assert all(m == 0.0 for v in per_rank.values() for m in v["swap_mb"])


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 3])
def test_a_step_with_swapping_groups_equals_the_step_without(offload_results, stage):
    """fp32, recomputation: the same plan with offload and, besides, swapped blocks (the 2x2 group
    both of the tiny model's 2 blocks, the degree-2 group the last, rank 2's group both, rank 3's
    none; under ZeRO-3 rank 0's two packed groups the last) updates every parameter as the plain plan
    (1e-5 relative), under ZeRO-0 and ZeRO-3; every rank swapped what the plan says; host memory held
    a swapped block's activations where the first block was swapped (the last one's stay on the
    device), the offloaded inputs only of the recomputed blocks."""
    from _torchrun import assert_all_ranks

    assert_all_ranks(offload_results, f"swap_z{stage}", WORLD)
    per_rank = offload_results[f"swap_z{stage}"]
    assert per_rank["0"]["splits"][0] == ["2x2"] and all(v["swaps"][0] == [2] for v in per_rank.values())
    assert per_rank["0"]["swaps"][1] == ([1, 1] if stage == 3 else [1])
    assert per_rank["2"]["swaps"][1] == [2] and per_rank["3"]["swaps"][1] == [0]
    # the first block swapped: its activations in host memory, no block input offloaded (the other
    # block, the last, is swapped too and kept on the device)
    for r in map(str, range(WORLD)):
        assert per_rank[r]["swap_mb"][0] > 0 and per_rank[r]["host_mb"][0] == 0.0
    assert per_rank["2"]["swap_mb"][1] > 0
    # the last block alone swapped (kept on the device), or none: nothing of a block in host memory;
    # rank 3 offloads its inputs as before
    assert per_rank["0"]["swap_mb"][1] == 0.0 and per_rank["3"]["swap_mb"][1] == 0.0
    spec = get_model("tiny")
    assert per_rank["3"]["host_mb"][1] == pytest.approx(per_rank["3"]["rows"][1] * (spec.layers - 1) * spec.hidden * 4 / 2**20)
