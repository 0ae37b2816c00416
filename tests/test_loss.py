"""The chunked cross-entropy of ``workbench.runtime.loss`` against PyTorch's own on whole logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workbench.cost.memory import loss_chunk_tokens, loss_transient_bytes
from workbench.models import get_model
from workbench.runtime.loss import chunked_cross_entropy


def _case(T=37, h=8, V=19, dtype=torch.float64, seed=0, ignored=(0, 5, 36)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, h, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(V, h, generator=g, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, V, (T,), generator=g)
    labels[list(ignored)] = -100
    return x, w, labels


@pytest.mark.parametrize("chunk", [1, 5, 16, 37, 100])
def test_loss_and_gradients_equal_cross_entropy_on_whole_logits(chunk):
    """fp64, chunks that do not divide the tokens, ignored targets: the loss and both gradients are
    those of ``F.cross_entropy(x @ w.T, labels, reduction="sum")`` to rounding."""
    x, w, labels = _case()
    ref = F.cross_entropy(x @ w.t(), labels, ignore_index=-100, reduction="sum")
    gx, gw = torch.autograd.grad(ref * 0.7, (x, w))
    out = chunked_cross_entropy(x, w, labels, chunk=chunk)
    cx, cw = torch.autograd.grad(out * 0.7, (x, w))
    assert out.dtype == torch.float64
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12)
    assert torch.allclose(cx, gx, rtol=1e-10, atol=1e-12)
    assert torch.allclose(cw, gw, rtol=1e-10, atol=1e-12)


def test_gradients_against_finite_differences():
    """Central differences of the loss in fp64, on every entry of a small x and weight."""
    x, w, labels = _case(T=9, h=3, V=5, ignored=(2,))
    out = chunked_cross_entropy(x, w, labels, chunk=4)
    gx, gw = torch.autograd.grad(out, (x, w))
    eps = 1e-6
    for t, g in ((x, gx), (w, gw)):
        for k in range(t.numel()):
            with torch.no_grad():
                t.view(-1)[k] += eps
                up = chunked_cross_entropy(x, w, labels, chunk=4).item()
                t.view(-1)[k] -= 2 * eps
                down = chunked_cross_entropy(x, w, labels, chunk=4).item()
                t.view(-1)[k] += eps
            assert g.view(-1)[k].item() == pytest.approx((up - down) / (2 * eps), abs=1e-7)


def test_all_targets_ignored_gives_zero_loss_and_zero_gradients():
    x, w, labels = _case(T=6, ignored=range(6))
    out = chunked_cross_entropy(x, w, labels, chunk=4)
    out.backward()
    assert out.item() == 0.0 and not x.grad.any() and not w.grad.any()


def test_bf16_follows_the_plain_upcast_loss():
    """bf16 inputs: the loss in fp32 from bf16 logits, as the runtime's plain path computes it
    (``F.cross_entropy(logits.float())``); gradients within bf16's rounding of that path's."""
    x64, w64, labels = _case(T=64, h=32, V=50, dtype=torch.float64)
    x = x64.detach().to(torch.bfloat16).requires_grad_()
    w = w64.detach().to(torch.bfloat16).requires_grad_()
    ref = F.cross_entropy((x @ w.t()).float(), labels, reduction="sum")
    gx, gw = torch.autograd.grad(ref, (x, w))
    out = chunked_cross_entropy(x, w, labels, chunk=7)
    cx, cw = torch.autograd.grad(out, (x, w))
    assert out.dtype == torch.float32 and cx.dtype == torch.bfloat16 and cw.dtype == torch.bfloat16
    assert torch.allclose(out, ref, rtol=1e-6)
    assert torch.allclose(cx.float(), gx.float(), rtol=2e-2, atol=2e-2 * gx.float().abs().max().item())
    assert torch.allclose(cw.float(), gw.float(), rtol=2e-2, atol=2e-2 * gw.float().abs().max().item())


def test_saved_tensors_hold_no_logits():
    """What autograd keeps is the two gradients, made in the forward: ``dx`` (tokens x hidden) and
    the weight's (vocab x hidden), nothing of size tokens x vocab (the plain loss keeps its (T, V)
    log-softmax); under ``torch.no_grad`` no gradient is made, and a backward would say so."""
    x, w, labels = _case(T=40, h=4, V=300)
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked_cross_entropy(x, w, labels, chunk=8)
    assert sorted(sizes) == sorted([40 * 4, 300 * 4])
    sizes.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.cross_entropy(x @ w.t(), labels, reduction="sum")
    assert max(sizes) == 40 * 300  # the reference does keep them
    with torch.no_grad():
        out = chunked_cross_entropy(x, w, labels, chunk=8)
    assert out.item() == pytest.approx(F.cross_entropy(x @ w.t(), labels, reduction="sum").item(), rel=1e-12)


def test_a_second_backward_is_refused():
    x, w, labels = _case()
    out = chunked_cross_entropy(x, w, labels, chunk=8)
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        out.backward()


def test_chunk_size_and_transient():
    """A chunk of Llama 3's vocabulary stays within 1 GiB at 12 bytes a logit; the transient is that
    chunk (8 bytes a logit in fp32: no casts) plus the head weight's gradient in fp32 and, in bf16,
    its bf16 cast; without
    recomputation the whole logits' two fp32 gradients (8 x vocab a token)."""
    import dataclasses

    assert loss_chunk_tokens(128_256) == 697 and 12 * 697 * 128_256 <= 2**30 < 12 * 698 * 128_256
    assert loss_chunk_tokens(10**9) == 64  # never below 64 tokens
    m = dataclasses.replace(get_model("llama3-8b"), dtype_bytes=2)
    assert (m.vocab, m.hidden) == (128_256, 4096)
    assert loss_transient_bytes(m, 100_000, recompute=True) == 12 * 697 * 128_256 + 6 * 128_256 * 4096
    assert loss_transient_bytes(m, 10, recompute=True) == 12 * 10 * 128_256 + 6 * 128_256 * 4096
    m32 = dataclasses.replace(m, dtype_bytes=4)
    assert loss_transient_bytes(m32, 10, recompute=True) == 8 * 10 * 128_256 + 4 * 128_256 * 4096
    assert loss_transient_bytes(m, 1000, recompute=False) == 8 * 128_256 * 1000


def test_bad_input_says_what_is_wrong():
    x, w, labels = _case()
    with pytest.raises(ValueError, match="do not multiply"):
        chunked_cross_entropy(x, w[:, :3], labels, chunk=4)
    with pytest.raises(ValueError, match="labels for 37 tokens"):
        chunked_cross_entropy(x, w, labels[:5], chunk=4)
    with pytest.raises(ValueError, match="at least 1 token"):
        chunked_cross_entropy(x, w, labels, chunk=0)


def test_no_tensor_of_all_tokens_by_vocab_is_built():
    """Every tensor the chunked loss creates, forward and backward, is at most one chunk of logits
    (recorded under a dispatch mode that sees every operator's outputs; the weight's gradient is
    smaller here); the plain loss builds the whole (tokens, vocab) logits."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor):
                    self.numel = max(self.numel, t.numel())
            return out

    T, h, V, chunk = 96, 4, 500, 10
    x, w, labels = _case(T=T, h=h, V=V, dtype=torch.float32, ignored=(3,))
    with Largest() as seen:
        chunked_cross_entropy(x, w, labels, chunk=chunk).backward()
    assert seen.numel == chunk * V
    with Largest() as seen:
        F.cross_entropy(x @ w.t(), labels, reduction="sum").backward()
    assert seen.numel == T * V


def test_the_whole_logits_loss_holds_what_the_memory_model_charges():
    """Without recomputation the loss comes from whole logits: at its backward's peak it holds the
    log-softmax it saved (the activation formula's ``4 x vocab`` a token) and two fp32 ``(tokens,
    vocab)`` gradients (``loss_backward_bytes_per_token``, ``8 x vocab``, which the planner charges
    with every token: ``CostModel.loss_bytes_per_token``). Measured as the peak of the storages its
    operators made, each counted until freed; the input's and the weight's gradients (``(T + V) h``
    floats) are all that is left over."""
    import dataclasses

    from workbench.cost.memory import loss_backward_bytes_per_token
    from workbench.runtime.live import LiveBytes

    T, h, V = 512, 4, 3000
    x, w, labels = _case(T=T, h=h, V=V, dtype=torch.float32, ignored=())
    with LiveBytes() as live:
        F.cross_entropy(F.linear(x, w), labels, reduction="sum").backward()
    model = dataclasses.replace(get_model("tiny"), vocab=V)
    charged = (4 * V + loss_backward_bytes_per_token(model)) * T
    assert charged <= live.peak <= charged + 4 * (T + V) * h + 4 * T + 64
