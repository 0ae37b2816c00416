"""The output head's cross-entropy in chunks of tokens, its gradients computed in the forward.

The plain loss, ``F.cross_entropy(head(x).float(), labels)``, keeps the log-softmax of every token's
logits for backward (4 bytes x vocab per token) and, while its backward runs, two more fp32
``(tokens, vocab)`` gradients: with Llama 3's 128,256-token vocabulary that is 1.5 MB per token, three
times the recomputed activations of all 32 layers of Llama-3-8B (0.5 MB). The loss is the last
operation of the step and its gradient with respect to the logits needs nothing but the logits, so
under ``--recompute`` the runtime computes it as this module does (the scheme of Liger's fused
linear cross-entropy):

- forward, per chunk of ``chunk`` tokens: the chunk's logits ``x W^T`` in the compute dtype, upcast
  to fp32; the loss of its targets; the softmax minus one at each target (the gradient of the summed
  loss with respect to the logits, zero on ignored rows), and from it at once the chunk's gradient of
  ``x`` and its part of the weight's gradient (accumulated in fp32). The chunk's logits are dropped
  before the next;
- backward: those two gradients times the incoming scalar.

The same matmuls as the plain loss (logits, then ``dx`` and ``dW``), none twice. What is kept for
backward is ``dx`` (the compute dtype, ``tokens x hidden``) and the fp32 ``dW``; the transient is one
chunk's logits and softmax: the memory model's ``workbench.cost.memory.loss_transient_bytes``.
The result is the summed token loss (fp32, fp64 for fp64 inputs) of the targets that are not
``ignore_index``, as ``F.cross_entropy(..., reduction="sum")`` returns it. The gradients are only
computed where the caller asks (``grad``): a loss under ``torch.no_grad`` is one matmul a chunk.
"""

from __future__ import annotations

import torch

__all__ = ["chunked_cross_entropy"]


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, labels, chunk: int, ignore_index: int, grad: bool):
        acc = torch.promote_types(x.dtype, torch.float32)
        dx = torch.empty_like(x) if grad else None
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if grad else None
        total = torch.zeros((), dtype=acc, device=x.device)
        with torch.autocast(x.device.type, enabled=False):
            for a in range(0, x.shape[0], chunk):
                b = min(a + chunk, x.shape[0])
                logits = (x[a:b] @ weight.t()).to(acc)  # (c, V)
                lse = torch.logsumexp(logits, dim=-1)  # (c,)
                lab = labels[a:b]
                keep = lab != ignore_index
                target = torch.where(keep, lab, 0)
                total += torch.where(keep, lse - logits.gather(1, target[:, None])[:, 0], 0).sum()
                if grad:
                    p = logits.sub_(lse[:, None]).exp_()  # the softmax, in place of the logits
                    p[torch.arange(b - a, device=x.device), target] -= 1.0
                    p *= keep.to(acc)[:, None]  # d loss / d logits, zero on ignored rows
                    p = p.to(x.dtype)
                    dx[a:b] = p @ weight
                    dw += (p.t() @ x[a:b]).to(acc)
                    del p
                del logits
        ctx.save_for_backward(dx, dw)
        ctx.weight_dtype, ctx.used = weight.dtype, False
        return total

    @staticmethod
    def backward(ctx, g):
        if ctx.used:
            raise RuntimeError("chunked_cross_entropy: a second backward through the same loss (retain_graph) is "
                               "not supported: its gradients were scaled in place by the first")
        ctx.used = True
        dx, dw = ctx.saved_tensors
        if dx is None:
            raise RuntimeError("chunked_cross_entropy was called with grad=False: it has no gradients to give")
        # scaled in place: no second weight-sized fp32 tensor while every activation is still held
        gx = dx.mul_(g.to(dx.dtype)) if ctx.needs_input_grad[0] else None
        gw = dw.mul_(g.to(dw.dtype)).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        return gx, gw, None, None, None, None


def chunked_cross_entropy(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunk: int,
                          ignore_index: int = -100) -> torch.Tensor:
    """Summed cross-entropy of the logits ``x @ weight.T`` against ``labels`` (module docstring).

    ``x`` ``(T, hidden)`` and ``weight`` ``(vocab, hidden)`` in the dtype the head computes in (the
    caller casts them: autocast is off inside), ``labels`` ``(T,)`` int64, ``chunk`` tokens at a time.
    The gradients are computed in the forward when autograd will want them (grad mode on and ``x``
    or ``weight`` requiring them). Raises ValueError on mismatched shapes or a chunk below 1."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"chunked_cross_entropy: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply "
                         "as (tokens, hidden) @ (vocab, hidden).T")
    if labels.shape != x.shape[:1]:
        raise ValueError(f"chunked_cross_entropy: {tuple(labels.shape)} labels for {x.shape[0]} tokens")
    if int(chunk) < 1:
        raise ValueError(f"chunked_cross_entropy: chunk must be at least 1 token, got {chunk}")
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return _ChunkedCrossEntropy.apply(x, weight, labels, int(chunk), int(ignore_index), grad)
