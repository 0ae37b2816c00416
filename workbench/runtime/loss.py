"""The output head's cross-entropy in chunks of tokens, its gradients computed in the forward, the
final norm inside the chunks when given its weight.

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

With the final norm's weight (``norm_weight``) ``x`` is the residual stream before that norm, and
each chunk is normed first (``workbench.runtime.model.RMSNorm``'s arithmetic: statistics in fp32 at
least), then cast to the head's dtype, as autocast casts the head's input; the chunk's gradient is
taken back through the norm at once (its small graph built and dropped per chunk), to the residual
stream and to the norm's weight (accumulated in fp32). Run outside, the norm keeps for every token
until the backward its input in fp32 (for its statistics), the statistics and its normed input, and
the loss keeps the gradient of the head's input (the norm's output): ``4h + 4 + 2ch`` bytes a token
(``8h + 4 + 2h`` under autocast). Inside, a token keeps only the gradient of the norm's input, in the
residual stream's dtype (``ch``, or ``4h`` under autocast, where the stream is fp32): ``4h + ch + 4``
less (``tests/test_loss.py`` measures it).

The result is the summed token loss (fp32, fp64 for fp64 inputs) of the targets that are not
``ignore_index``, as ``F.cross_entropy(..., reduction="sum")`` returns it. The gradients are only
computed where the caller asks (``grad``): a loss under ``torch.no_grad`` is one matmul a chunk.
"""

from __future__ import annotations

import torch

__all__ = ["chunked_cross_entropy"]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``workbench.runtime.model.RMSNorm``'s arithmetic with its weight given (this module cannot
    import the model, which imports it): the statistics in fp32 at least, the result in ``x``'s dtype
    times the weight."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))  # (c, C)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # (c, C)
    return xf.type_as(x) * weight  # (c, C)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, norm_weight, labels, chunk: int, ignore_index: int, eps: float, grad: bool):
        acc = torch.promote_types(weight.dtype, torch.float32)
        need_x = grad and x.requires_grad
        need_n = grad and norm_weight is not None and norm_weight.requires_grad
        dx = torch.empty_like(x) if need_x else None
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if grad else None
        dn = torch.zeros(norm_weight.shape, dtype=torch.promote_types(norm_weight.dtype, torch.float32),
                         device=norm_weight.device) if need_n else None
        total = torch.zeros((), dtype=acc, device=x.device)
        with torch.autocast(x.device.type, enabled=False):
            if norm_weight is not None:  # a leaf of its own, for the per-chunk norm graphs
                wn = norm_weight.detach().requires_grad_(need_n)
            for a in range(0, x.shape[0], chunk):
                b = min(a + chunk, x.shape[0])
                if norm_weight is None:
                    xh = x[a:b]  # (c, C) the head's input
                else:
                    with torch.enable_grad():
                        xn = x[a:b].detach().requires_grad_(need_x)  # (c, C) the norm's input
                        xh = _rms_norm(xn, wn, eps).to(weight.dtype)  # (c, C) the head's input, with its graph
                logits = (xh.detach() @ weight.t()).to(acc)  # (c, V)
                lse = torch.logsumexp(logits, dim=-1)  # (c,)
                lab = labels[a:b]
                keep = lab != ignore_index
                target = torch.where(keep, lab, 0)
                total += torch.where(keep, lse - logits.gather(1, target[:, None])[:, 0], 0).sum()
                if grad:
                    p = logits.sub_(lse[:, None]).exp_()  # the softmax, in place of the logits
                    p[torch.arange(b - a, device=x.device), target] -= 1.0
                    p *= keep.to(acc)[:, None]  # d loss / d logits, zero on ignored rows
                    p = p.to(weight.dtype)
                    dw += (p.t() @ xh.detach()).to(acc)
                    if norm_weight is None and need_x:
                        dx[a:b] = p @ weight
                    elif need_x or need_n:  # d loss / d head input, back through the chunk's norm
                        wanted = [t for t, n in ((xn, need_x), (wn, need_n)) if n]
                        got = list(torch.autograd.grad(xh, wanted, p @ weight))
                        if need_x:
                            dx[a:b] = got.pop(0)
                        if need_n:
                            dn += got.pop(0)
                    del p
                del logits, xh
        ctx.save_for_backward(dx, dw, dn)
        ctx.weight_dtype = weight.dtype
        ctx.norm_dtype = norm_weight.dtype if norm_weight is not None else None
        ctx.used = False
        return total

    @staticmethod
    def backward(ctx, g):
        if ctx.used:
            raise RuntimeError("chunked_cross_entropy: a second backward through the same loss (retain_graph) is "
                               "not supported: its gradients were scaled in place by the first")
        ctx.used = True
        dx, dw, dn = ctx.saved_tensors
        if dw is None:
            raise RuntimeError("chunked_cross_entropy was called with grad=False: it has no gradients to give")
        # scaled in place: no second weight-sized fp32 tensor while every activation is still held
        gx = dx.mul_(g.to(dx.dtype)) if ctx.needs_input_grad[0] else None
        gw = dw.mul_(g.to(dw.dtype)).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        gn = dn.mul_(g.to(dn.dtype)).to(ctx.norm_dtype) if ctx.needs_input_grad[2] and dn is not None else None
        return gx, gw, gn, None, None, None, None, None


def chunked_cross_entropy(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunk: int,
                          ignore_index: int = -100, norm_weight: torch.Tensor | None = None,
                          norm_eps: float = 1e-5) -> torch.Tensor:
    """Summed cross-entropy of the logits ``x @ weight.T`` against ``labels`` (module docstring), or
    with ``norm_weight`` of ``rms_norm(x) @ weight.T``, the norm computed inside each chunk.

    ``weight`` ``(vocab, hidden)`` in the dtype the head computes in, and ``x`` ``(T, hidden)`` in it
    too, or with ``norm_weight`` ``(hidden,)`` (the final ``RMSNorm``'s weight, ``norm_eps`` its epsilon)
    the norm's input as it comes (the residual stream), the normed rows cast to ``weight``'s dtype
    (the caller casts the rest: autocast is off inside); ``labels`` ``(T,)`` int64, ``chunk`` tokens
    at a time. The gradients (of ``x``, ``weight`` and ``norm_weight``) are computed in the forward
    when autograd will want them (grad mode on and one of them requiring them). Raises ValueError on
    mismatched shapes or a chunk below 1."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"chunked_cross_entropy: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply "
                         "as (tokens, hidden) @ (vocab, hidden).T")
    if norm_weight is not None and norm_weight.shape != x.shape[1:]:
        raise ValueError(f"chunked_cross_entropy: a norm weight of shape {tuple(norm_weight.shape)} for "
                         f"{x.shape[1]}-wide rows")
    if labels.shape != x.shape[:1]:
        raise ValueError(f"chunked_cross_entropy: {tuple(labels.shape)} labels for {x.shape[0]} tokens")
    if int(chunk) < 1:
        raise ValueError(f"chunked_cross_entropy: chunk must be at least 1 token, got {chunk}")
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                        or (norm_weight is not None and norm_weight.requires_grad))
    return _ChunkedCrossEntropy.apply(x, weight, norm_weight, labels, int(chunk), int(ignore_index),
                                      float(norm_eps), grad)
