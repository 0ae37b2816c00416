"""The output head's cross-entropy in chunks of tokens, the logits recomputed in backward.

The plain loss, ``F.cross_entropy(head(x).float(), labels)``, keeps the log-softmax of every token's
logits for backward (4 bytes x vocab per token) and, while its backward runs, two more fp32
``(tokens, vocab)`` gradients: with Llama 3's 128,256-token vocabulary that is 1.5 MB per token, more
than the recomputed activations of all 32 layers of Llama-3-8B (0.5 MB). Under ``--recompute`` the
runtime therefore computes the loss as this module does (as Liger's fused linear cross-entropy and
Apple's Cut Cross-Entropy do):

- forward: per chunk of ``chunk`` tokens, the chunk's logits ``x W^T`` in the compute dtype, upcast to
  fp32, their log-sum-exp (kept: 4 bytes a token) and the target's logit; the chunk's logits are
  dropped before the next;
- backward: per chunk, the logits again (one more matmul of the head: its forward runs twice, as
  recomputation runs every block's twice), the softmax from the kept log-sum-exp, minus one at the
  target, and from it the chunk's gradient of ``x`` and its part of the weight's gradient
  (accumulated in fp32).

What autograd keeps is ``x``, ``W``, the labels and one fp32 per token; the transient is one chunk's
logits and softmax plus the fp32 weight-gradient accumulator, a constant that the memory model
charges (``workbench.cost.memory.loss_transient_bytes``).
The result is the summed token loss (fp32, fp64 for fp64 inputs) of the targets that are not
``ignore_index``, as ``F.cross_entropy(..., reduction="sum")`` returns it.
"""

from __future__ import annotations

import torch

__all__ = ["chunked_cross_entropy"]

class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, labels, chunk: int, ignore_index: int):
        acc = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):
            lse = torch.empty(x.shape[0], dtype=acc, device=x.device)
            total = torch.zeros((), dtype=acc, device=x.device)
            for a in range(0, x.shape[0], chunk):
                b = min(a + chunk, x.shape[0])
                logits = (x[a:b] @ weight.t()).to(acc)  # (c, V)
                lse[a:b] = torch.logsumexp(logits, dim=-1)
                lab = labels[a:b]
                keep = lab != ignore_index
                target = logits.gather(1, torch.where(keep, lab, 0)[:, None])[:, 0]
                total += torch.where(keep, lse[a:b] - target, 0).sum()
                del logits
        ctx.save_for_backward(x, weight, labels, lse)
        ctx.chunk, ctx.ignore_index = chunk, ignore_index
        return total

    @staticmethod
    def backward(ctx, grad):
        x, weight, labels, lse = ctx.saved_tensors
        chunk, ignore = ctx.chunk, ctx.ignore_index
        acc = lse.dtype
        dx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
        g = grad.to(acc)
        with torch.autocast(x.device.type, enabled=False):
            for a in range(0, x.shape[0], chunk):
                b = min(a + chunk, x.shape[0])
                lab = labels[a:b]
                keep = lab != ignore
                p = ((x[a:b] @ weight.t()).to(acc) - lse[a:b, None]).exp_()  # softmax (c, V)
                rows = torch.arange(b - a, device=x.device)
                p[rows, torch.where(keep, lab, 0)] -= 1.0
                p *= (keep.to(acc) * g)[:, None]  # d loss / d logits, zero on ignored rows
                p = p.to(x.dtype)
                if dx is not None:
                    dx[a:b] = p @ weight
                if dw is not None:
                    dw += (p.t() @ x[a:b]).to(acc)
                del p
        return dx, (dw.to(weight.dtype) if dw is not None else None), None, None, None


def chunked_cross_entropy(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunk: int,
                          ignore_index: int = -100) -> torch.Tensor:
    """Summed cross-entropy of the logits ``x @ weight.T`` against ``labels`` (module docstring).

    ``x`` ``(T, hidden)`` and ``weight`` ``(vocab, hidden)`` in the dtype the head computes in (the
    caller casts them: autocast is off inside), ``labels`` ``(T,)`` int64, ``chunk`` tokens at a time.
    Raises ValueError on mismatched shapes or a chunk below 1."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"chunked_cross_entropy: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply "
                         "as (tokens, hidden) @ (vocab, hidden).T")
    if labels.shape != x.shape[:1]:
        raise ValueError(f"chunked_cross_entropy: {tuple(labels.shape)} labels for {x.shape[0]} tokens")
    if int(chunk) < 1:
        raise ValueError(f"chunked_cross_entropy: chunk must be at least 1 token, got {chunk}")
    return _ChunkedCrossEntropy.apply(x, weight, labels, int(chunk), int(ignore_index))
