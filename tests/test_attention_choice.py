"""``auto`` on CUDA chooses the attention kernel per call: SDPA per sequence for few long sequences,
``varlen_attn`` for packed short ones (``workbench.runtime.attention.choose_kernel``).

- The chooser's decisions against the rule's figures, worked out here by hand from
  docs/gpu-results.md's two 131K rows (not read back from the module).
- The per-sequence SDPA path (flash backend only, ``enable_gqa``, the lower-right causal bias where
  queries are fewer than keys) against a packed path written independently (one dense SDPA call over
  the whole pack with a block-diagonal bottom-right mask), fp64 on CPU, output and gradients.
- The per-call kernel under torch's real ``varlen_attn`` (its two CUDA ops replaced by the
  stand-ins of tests/fakes/_varlen_checks.py, which refuse what the flash kernels refuse): a packed
  call reaches ``varlen_attn``, a long one does not, and both agree with the PyTorch path.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from workbench.runtime.attention import (AUTO_PER_CALL, H200_CROSSOVER, KernelCrossover, _sdpa_per_sequence,
                                         choose_kernel, per_call_attention, sdpa_attention_fn, sdpa_call_problem,
                                         select_attention, torch_varlen_attention, varlen_attention_fn)

FAKES = Path(__file__).resolve().parent / "fakes"

# by hand from docs/gpu-results.md, run 2, forward+backward ms at 131,072 tokens (32 heads over 8 of 128):
# one sequence: SDPA 918.4, varlen 1,503.5; 1,024-token documents (128 of them): SDPA 35.3, varlen 20.8
GAP = (1503.5 - 918.4) / 131072 ** 2              # 3.4057e-8 ms per token^2 that varlen pays more
PER_SEQ = (35.3 - 20.8) / 128 + GAP * 1024 ** 2   # 0.11328 + 0.03571 = 0.14899 ms per sequence SDPA pays more
CROSS = math.sqrt(PER_SEQ / GAP)                  # 2,091.6 tokens: root-mean-square length where they cross


def test_the_crossover_is_the_measured_one():
    assert H200_CROSSOVER.quadratic_gap_ms_per_token2 == pytest.approx(GAP, rel=1e-12)
    assert H200_CROSSOVER.per_sequence_ms == pytest.approx(PER_SEQ, rel=1e-12)
    assert H200_CROSSOVER.crossover_length == pytest.approx(2091.6, abs=0.1)


@pytest.mark.parametrize("n, mx, total, want", [
    (1, 131072, 131072, "sdpa"),        # the measured one-sequence rows: SDPA won at every length
    (1, 4096, 4096, "sdpa"),
    (1, 2092, 2092, "sdpa"),            # just above the crossover
    (1, 2091, 2091, "varlen"),          # just below it
    (128, 1024, 131072, "varlen"),      # the measured 1K-document rows: varlen won at every size
    (4, 1024, 4096, "varlen"),
    (8, 16384, 131072, "sdpa"),         # eight long sequences: 8 x 16384^2 x GAP = 73 ms against 1.2 ms
    (2, 2048, 4096, "varlen"),          # two at 2048 (< 2,092): mean square below the crossover's
    (2, 2200, 4400, "sdpa"),
    (0, 0, 0, "varlen"),                # an empty call (a rank without tokens in a lockstep pass)
])
def test_choices_at_the_rules_thresholds(n, mx, total, want):
    assert choose_kernel(n, mx, total) == want


def test_the_lower_bound_on_the_squares_and_the_heads():
    """A pack of one 32K sequence and 127 1K documents: the bound is 32768^2 + (131072-32768)^2/127
    = 1.1497e9 tokens^2, saving 39.2 ms against 128 x 0.149 = 19.1 ms: SDPA. The same pack with the
    long one at 8K: 6.71e7 + 1.36e8 = 2.03e8 -> 6.9 ms against 19.1: varlen."""
    assert choose_kernel(128, 32768, 32768 + 127 * 1024 + 31744) == "sdpa"  # total 131,072 + 31,744 spread
    assert choose_kernel(128, 8192, 8192 + 127 * 1024) == "varlen"
    # the gap scales with heads x head_dim, the per-sequence cost does not: at 4 heads (Ulysses over 8
    # ranks) one sequence needs sqrt(8) x the length: 2,091.6 x 2.83 = 5,916
    assert choose_kernel(1, 5900, 5900, heads=4) == "varlen" and choose_kernel(1, 5930, 5930, heads=4) == "sdpa"
    assert choose_kernel(1, 5930, 5930) == "sdpa"
    with pytest.raises(ValueError, match="not a pack"):
        choose_kernel(2, 10, 5)


def _packed_reference(q, k, v, lens_q, lens_k):
    """One SDPA call over the whole pack: query i of segment j sees the keys of segment j up to its
    bottom-right aligned position; nothing else. Written independently of attention.py."""
    Tq, H, hd = q.shape
    rep = H // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    mask = torch.zeros(Tq, k.shape[0], dtype=torch.bool)
    oq = ok = 0
    for n, m in zip(lens_q, lens_k):
        for r in range(n):
            mask[oq + r, ok:ok + m - n + r + 1] = True
        oq, ok = oq + n, ok + m
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask)  # (H, Tq, hd)
    return out.transpose(0, 1)  # (Tq, H, hd)


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


PACKINGS = [([23], [23], 4, 4), ([5, 1, 17, 9], [5, 1, 17, 9], 4, 2), ([3, 8, 1], [10, 8, 5], 4, 1),
            ([2, 2], [2, 9], 2, 2), ([6, 6, 6, 6], [6, 12, 18, 24], 8, 2), ([0, 4], [3, 4], 4, 2)]


def _inputs(lens_q, lens_k, H, KV, dtype=torch.float64, hd=16, seed=0):
    g = torch.Generator().manual_seed(seed + len(lens_q) + H)
    q = torch.randn(sum(lens_q), H, hd, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)
    k, v = (torch.randn(sum(lens_k), KV, hd, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)
            for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("lens_q, lens_k, H, KV", PACKINGS)
def test_the_sdpa_path_equals_the_packed_path_fp64(lens_q, lens_k, H, KV):
    """Output and the gradients of q, k, v: the per-sequence SDPA path (flash backend only, GQA without
    repeating K and V, lower-right causal bias for the calls context parallelism makes) against one
    packed dense call, fp64 on CPU."""
    q, k, v = _inputs(lens_q, lens_k, H, KV)
    got = _sdpa_per_sequence(q, k, v, _cu(lens_q), _cu(lens_k))
    qr, kr, vr = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    ref = _packed_reference(qr, kr, vr, lens_q, lens_k)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    gout = torch.randn(got.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    for a, b in zip(torch.autograd.grad((got * gout).sum(), (q, k, v)), torch.autograd.grad((ref * gout).sum(), (qr, kr, vr))):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("lens_q, lens_k, H, KV", PACKINGS)
def test_the_per_call_kernel_gives_one_result_whichever_it_picks(lens_q, lens_k, H, KV):
    """The chooser only picks speed: with the packed path standing in for varlen (fp64 on CPU), forcing
    either choice gives the same output and gradients, and the real chooser's pick is the one taken."""
    taken = []

    def packed(q, k, v, cu_q, cu_k, mq, mk):
        taken.append("varlen")
        bq, bk = cu_q.tolist(), cu_k.tolist()
        return _packed_reference(q, k, v, [b - a for a, b in zip(bq, bq[1:])], [b - a for a, b in zip(bk, bk[1:])])

    def sdpa(*args):
        taken.append("sdpa")
        return _sdpa_per_sequence(*args[:5])

    results = {}
    for forced in ("sdpa", "varlen", None):
        fn = per_call_attention(packed, sdpa, choose_kernel if forced is None else (lambda *a, _f=forced, **kw: _f))
        q, k, v = _inputs(lens_q, lens_k, H, KV)
        out = fn(q, k, v, _cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k))
        gout = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
        results[forced] = (out.detach(), *torch.autograd.grad((out * gout).sum(), (q, k, v)))
    assert taken[:2] == ["sdpa", "varlen"]
    n = len(lens_q)
    assert taken[2] == choose_kernel(n, max(lens_q), sum(lens_q), heads=H, head_dim=16)
    for a, b in zip(results["sdpa"], results["varlen"]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_the_sdpa_path_refuses_what_the_flash_backend_refuses():
    q, k, v = _inputs([5, 7], [5, 7], 4, 2, dtype=torch.bfloat16)
    cu = _cu([5, 7])
    assert sdpa_call_problem(q, k, v, cu, cu, 7, 7) is None
    assert "fp16/bf16" in sdpa_call_problem(q.float(), k.float(), v.float(), cu, cu, 7, 7)
    bad = torch.zeros(12, 4, 12, dtype=torch.bfloat16)
    assert "multiple of 8" in sdpa_call_problem(bad, bad[:, :2], bad[:, :2], cu, cu, 7, 7)
    assert "divide" in sdpa_call_problem(q, k[:, :1].expand(12, 3, 16).contiguous(),
                                         v[:, :1].expand(12, 3, 16).contiguous(), cu, cu, 7, 7)
    with pytest.raises(ValueError, match="SDPA's flash backend cannot run this call: .*fp16/bf16"):
        sdpa_attention_fn("bf16")(q.float(), k.float(), v.float(), cu, cu, 7, 7)
    # without a declared precision (a measuring caller with an fp32 model) it computes in bf16 and
    # returns the input's dtype, as the varlen and flash kernels do
    out = sdpa_attention_fn(None)(q.float(), k.float(), v.float(), cu, cu, 7, 7)
    assert out.dtype == torch.float32


@pytest.fixture
def fake_varlen(monkeypatch):
    """torch's ``varlen_attn`` with its two CUDA ops replaced by the stand-ins (tests/fakes/_varlen_checks.py)."""
    monkeypatch.syspath_prepend(str(FAKES))
    import _varlen_checks

    _varlen_checks.CALLS.clear()
    with _varlen_checks.installed() as calls:
        yield calls


def _agrees_with_the_torch_path(fn, lens_q, lens_k, H, KV, hd):
    """``fn``'s bf16 output and q/k/v gradients against the PyTorch path's in fp32, relative to the
    reference's largest value."""
    q, k, v = _inputs(lens_q, lens_k, H, KV, dtype=torch.bfloat16, hd=hd)
    out = fn(q, k, v, _cu(lens_q).long(), _cu(lens_k).long(), max(lens_q), max(lens_k))
    gout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    grads = torch.autograd.grad((out.float() * gout.float()).sum(), (q, k, v))
    qr, kr, vr = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    ref = torch_varlen_attention(qr, kr, vr, _cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k))
    ref_grads = torch.autograd.grad((ref * gout.float()).sum(), (qr, kr, vr))
    assert out.dtype == torch.bfloat16
    for a, b in zip((out.detach(), *grads), (ref.detach(), *ref_grads)):
        assert float((a.float() - b).abs().max()) <= 2e-2 * float(b.abs().max()), lens_q


@pytest.mark.long
def test_auto_on_cuda_chooses_per_call(fake_varlen):
    """``auto`` on CUDA in bf16 resolves to the per-call kernel with the measured crossover; a pack of
    short documents reaches torch's ``varlen_attn`` (forward and backward), one sequence past the
    crossover does not; both agree with the PyTorch path. By name, on CPU and in fp32: unchanged."""
    fn, name = select_attention("auto", "cuda", "bf16")
    assert name == AUTO_PER_CALL and fn.choose is choose_kernel
    assert select_attention("varlen", "cuda", "bf16")[1] == "varlen"  # asked for by name: always varlen
    assert select_attention("auto", "cpu", "bf16")[1] == "torch"
    assert select_attention("auto", "cuda", "fp32")[1] == "torch"
    # 16 heads of 128: half the measured work per token, so the gap halves (1.7029e-8 ms per token^2)
    # and the crossover's length is 2,091.6 x sqrt(2) = 2,958
    for lens, want in (([64] * 6, "varlen"), ([3000], "sdpa")):
        assert choose_kernel(len(lens), max(lens), sum(lens), heads=16, head_dim=128) == want
        fake_varlen.clear()
        _agrees_with_the_torch_path(fn, lens, lens, 16, 4, 128)
        assert [c["op"] for c in fake_varlen] == (["forward", "backward"] if want == "varlen" else []), lens


# a crossover at toy sizes, so bottom-right calls of "long" segments stay cheap on CPU: a gap of
# (2 - 1) / 1000^2 = 1e-6 ms per token^2 and (3 - 1) / 100 + 1e-6 x 10^2 = 0.0201 ms per sequence:
# sqrt(0.0201 / 1e-6) = 141.8 tokens
TOY = KernelCrossover(source="test", heads=4, head_dim=16, long_tokens=1000, long_sdpa_ms=1.0, long_varlen_ms=2.0,
                      packed_tokens=1000, packed_doc_len=10, packed_sdpa_ms=3.0, packed_varlen_ms=1.0)


@pytest.mark.parametrize("lens_q, lens_k, want", [
    ([150], [150], "sdpa"), ([140], [140], "varlen"), ([10, 210], [60, 250], "sdpa"), ([30, 150], [60, 200], "varlen"),
    ([5, 1, 17], [5, 1, 17], "varlen"), ([50, 50, 150], [50, 120, 400], "varlen"), ([20, 300], [40, 310], "sdpa")])
def test_the_per_call_kernel_under_the_real_varlen_attn(fake_varlen, lens_q, lens_k, want):
    """torch's real ``varlen_attn`` and the SDPA path behind the per-call kernel at a toy crossover,
    including context parallelism's bottom-right calls: the choice is the rule's (by hand, queries:
    [150]: 0.0225 ms saved > 0.0201 paid; [140]: 0.0196 < 0.0201; [10, 210]: (210^2 + 10^2) x 1e-6 =
    0.0442 > 2 x 0.0201; [30, 150]: 0.0234 < 0.0402; [50, 50, 150]: 150^2 + 100^2 / 2 = 27,500 -> 0.0275
    < 0.0603), varlen is reached exactly when chosen, and the result
    is the PyTorch path's either way."""
    assert TOY.crossover_length == pytest.approx(math.sqrt(0.0201 / 1e-6))
    choose = functools.partial(choose_kernel, crossover=TOY)
    fn = per_call_attention(varlen_attention_fn("bf16"), sdpa_attention_fn("bf16"), choose)
    assert choose(len(lens_q), max(lens_q), sum(lens_q), heads=4, head_dim=16) == want
    _agrees_with_the_torch_path(fn, lens_q, lens_k, 4, 2, 16)
    assert [c["op"] for c in fake_varlen] == (["forward", "backward"] if want == "varlen" else [])
