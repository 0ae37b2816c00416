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
    # and the final norm's tensors of the chunk's tokens (the chunk takes the norm in): its fp32 input, its
    # normed output in the compute dtype, its statistics
    norm = 4 * 4096 + 2 * 4096 + 4
    assert loss_transient_bytes(m, 100_000, recompute=True) == 12 * 697 * 128_256 + 697 * norm + 6 * 128_256 * 4096
    assert loss_transient_bytes(m, 10, recompute=True) == 12 * 10 * 128_256 + 10 * norm + 6 * 128_256 * 4096
    m32 = dataclasses.replace(m, dtype_bytes=4)
    assert loss_transient_bytes(m32, 10, recompute=True) == (8 * 10 * 128_256 + 10 * (8 * 4096 + 4)
                                                             + 4 * 128_256 * 4096)
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


# ---- the final norm inside the chunks ---------------------------------------------------------------

def _model(tied: bool, dtype=torch.float64, seed=3):
    """A 2-layer model of the tiny preset's width, its final norm's weight drawn (not all ones, so its
    gradient is tested for what it multiplies)."""
    import dataclasses

    from workbench.runtime.model import Transformer

    spec = dataclasses.replace(get_model("tiny"), tied_embeddings=tied)
    model = Transformer(spec, seed=seed).to(dtype)
    with torch.no_grad():
        model.norm.weight.copy_(1 + 0.3 * torch.randn(spec.hidden, generator=torch.Generator().manual_seed(seed)))
    return model


def _loss_and_grads(model, lengths=(23, 9, 31), autocast=False):
    """One forward and backward of a packed batch: the summed loss and every parameter's gradient."""
    from workbench.runtime.attention import torch_varlen_attention
    from workbench.runtime.step import make_shard

    g = torch.Generator().manual_seed(1)
    sh = make_shard([torch.randint(0, model.spec.vocab, (n,), generator=g) for n in lengths], 1, 0)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(sh.tokens, sh.positions, sh.cu_seqlens, sh.max_seqlen, torch_varlen_attention, labels=sh.labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("chunk", [5, 21, 63, 100])
def test_the_final_norm_inside_the_chunks_gives_the_plain_loss_and_gradients(chunk, tied):
    """fp64, 63 tokens in three packed sequences (chunks that do and do not divide them): the model
    under recomputation (``apply_recompute``: blocks checkpointed, the loss chunked, the final norm
    inside its chunks) gives the loss and every parameter's gradient (the final norm's weight, the
    head's, a tied embedding's from both its uses) of the plain model, which norms the whole
    sequence and takes the loss from whole logits, within 1e-10."""
    from workbench.runtime.zero import apply_recompute

    plain = _model(tied)
    ref_loss, ref = _loss_and_grads(plain)
    model = _model(tied)
    apply_recompute(model)
    model.head.loss_chunk = chunk
    loss, got = _loss_and_grads(model)
    assert (model.head.weight is model.embed.weight) == tied
    assert torch.allclose(loss, ref_loss, rtol=1e-12, atol=0)
    assert got.keys() == ref.keys() and "norm.weight" in got
    for n in ref:
        assert torch.allclose(got[n], ref[n], rtol=1e-10, atol=1e-12 * float(ref[n].abs().max())), n


def test_the_norm_inside_under_no_grad_and_for_some_gradients_only():
    """Under ``torch.no_grad`` the chunked loss with the norm inside is the plain one (no gradient
    made); with only the norm's weight requiring a gradient, that one is the plain one's."""
    from workbench.runtime.model import Head, RMSNorm

    x, w, labels = _case(T=29, h=6, V=11, ignored=(0, 28))
    norm = RMSNorm(6).to(torch.float64)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3, generator=torch.Generator().manual_seed(2))
    head = Head(6, 11, bias=False).to(torch.float64)
    with torch.no_grad():
        head.weight.copy_(w)
    ref = head(norm(x), labels)
    (gn_ref,) = torch.autograd.grad(ref, (norm.weight,))
    head.loss_chunk = 4
    with torch.no_grad():
        assert torch.allclose(head(x, labels, norm=norm), ref, rtol=1e-12, atol=0)
    head.weight.requires_grad_(False)
    out = head(x.detach(), labels, norm=norm)
    (gn,) = torch.autograd.grad(out, (norm.weight,))
    assert torch.allclose(gn, gn_ref, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("how", ["autocast", "bf16"])
def test_the_norm_inside_follows_the_plain_path_in_bf16(how):
    """``autocast``: CPU bf16 autocast over fp32 weights and an fp32 residual stream (ZeRO 0-2);
    ``bf16``: everything in bf16 without autocast (FSDP2's mixed precision under ZeRO-3). The norm
    inside the chunks against ``head(norm(x))`` on whole logits: the loss within 1e-5 relative, the
    gradients (the residual stream's, the norm weight's, the head weight's, each in its tensor's
    dtype) within bf16's rounding."""
    from workbench.runtime.model import Head, RMSNorm

    h, V, T = 32, 50, 64
    dtype = torch.float32 if how == "autocast" else torch.bfloat16
    x64, w64, labels = _case(T=T, h=h, V=V)
    x = x64.detach().to(dtype).requires_grad_()
    norm = RMSNorm(h).to(dtype)
    head = Head(h, V, bias=False).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(h, generator=torch.Generator().manual_seed(4)))
        head.weight.copy_(w64)
    params = (x, norm.weight, head.weight)

    def run(chunk):
        head.loss_chunk = chunk
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=how == "autocast"):
            out = head(norm(x), labels) if chunk is None else head(x, labels, norm=norm)
        return out, torch.autograd.grad(out, params)

    ref, ref_g = run(None)
    out, got = run(7)
    assert out.dtype == torch.float32
    assert torch.allclose(out, ref, rtol=1e-5)
    for g, r, p in zip(got, ref_g, params):
        assert g.dtype == r.dtype == p.dtype
        assert torch.allclose(g.float(), r.float(), rtol=2e-2, atol=2e-2 * r.float().abs().max().item())


def _head_kept(T: int, *, inside: bool, how: str, h: int = 64, V: int = 256) -> tuple[int, int]:
    """Bytes the final norm, head and chunked loss (64-token chunks) keep after their forward, and
    their peak over forward and backward, on ``T`` tokens of a residual stream (``LiveBytes``;
    the parameters, the labels and the stream's leaf counted from the start, so neither figure
    includes them). ``inside``: ``head(x, labels, norm=norm)``, else ``head(norm(x), labels)``."""
    from workbench.runtime.live import LiveBytes
    from workbench.runtime.model import Head, RMSNorm

    dtype = torch.bfloat16 if how == "bf16" else torch.float32
    g = torch.Generator().manual_seed(0)
    norm, head = RMSNorm(h).to(dtype), Head(h, V, bias=False).to(dtype)
    head.loss_chunk = 64
    x0 = torch.randn(T, h, generator=g, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, V, (T,), generator=g)
    with LiveBytes() as live:
        for t in (*norm.parameters(), *head.parameters(), labels, x0):
            t.detach()  # counted from the start: LiveBytes counts an older storage when an operator returns it
        base = live.now
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=how == "autocast"):
            x = x0.clone()  # (T, C) the residual stream, as the last block leaves it
            loss = head(x, labels, norm=norm) if inside else head(norm(x), labels)
            del x
        kept = live.now - base
        loss.backward()
        peak = live.peak - base
    return kept, peak


@pytest.mark.parametrize("how", ["fp32", "autocast", "bf16"])
def test_the_norm_inside_keeps_only_the_gradient_of_the_residual_stream(how):
    """What the final norm, head and loss keep per token after the forward (``LiveBytes``, the slope
    between 512 and 1,024 tokens, hidden 64; the memory model's "outside" term less the embedding's
    and rotary parts): with the norm outside, the norm's input in fp32 (``4h``), its statistics
    (4), its normed input and the gradient of the head's input (``c h`` each): ``4h + 2ch + 4``; with
    the norm inside, the gradient of the norm's input in the residual stream's dtype: ``resid h``
    (``c``, or 4 under autocast, where the stream is fp32). Measured exactly (h = 64):

    ============ ======================= ============ =============== ======================
    how          outside (4h + 2ch + 4)   inside       fall            peak, fwd+bwd (o -> i)
    ============ ======================= ============ =============== ======================
    fp32  (c=4)  772                      256 (4h)     516 (8h + 4)    1,536 -> 512
    autocast     644 (8h + 4 + 2h)        256 (4h)     388 (6h + 4)    1,536 -> 512
    bf16  (c=2)  516                      128 (2h)     388 (6h + 4)    1,536 -> 256
    ============ ======================= ============ =============== ======================

    The fall is ``4h + c h + 4`` in all three (the norm's fp32 input and its statistics, and one of
    its normed input and output, ``c h``; under autocast the bf16 head input ``2h`` and the fp32
    normed input ``4h`` go, and the fp32 gradient ``4h`` replaces the bf16 one)."""
    h = 64
    c, resid = {"fp32": (4, 4), "autocast": (2, 4), "bf16": (2, 2)}[how]
    slope = {}
    for inside in (False, True):
        (k1, p1), (k2, p2) = (_head_kept(T, inside=inside, how=how, h=h) for T in (512, 1024))
        slope[inside] = ((k2 - k1) / 512, (p2 - p1) / 512)
    outside = (8 * h + 4 + 2 * h) if how == "autocast" else (4 * h + 2 * c * h + 4)
    assert slope[False][0] == outside
    assert slope[True][0] == resid * h
    assert slope[False][0] - slope[True][0] == 4 * h + c * h + 4
    assert slope[True][1] < slope[False][1] / 2  # nor does the backward build the norm's gradients for every token
