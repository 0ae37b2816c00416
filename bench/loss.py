"""The output head's loss: from whole logits, or chunked with its gradients made in the forward.

For a few vocabularies and token counts (one rank's tokens), times the head's loss forward and
backward both ways on this machine's CPU (fp32, the median of ``--repeats``) and measures the peak
of the bytes alive in tensors the loss made (every operator's outputs tracked under a dispatch mode
until freed; the inputs ``x`` and ``W`` not counted): what the memory model calls the loss's saved
tensors plus its transient. Beside each measured peak, the memory model's figure:

- whole logits: the log-softmax kept (``activation_bytes_per_token`` counts 4 x vocab bytes a token)
  and the backward's two fp32 gradients (``loss_backward_bytes_per_token``: 8 x vocab);
- chunked (``workbench.runtime.loss``): ``loss_transient_bytes`` (one chunk at 8 bytes a logit in
  fp32 and the head's fp32 gradient) plus the kept gradient of the head's input (4 bytes x hidden a
  token).

Usage: python bench/loss.py [--vocab 32000,128256] [--tokens 1024,4096] [--hidden 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from workbench.cost.memory import loss_chunk_tokens, loss_transient_bytes  # noqa: E402
from workbench.models import get_model  # noqa: E402
from workbench.runtime.live import LiveBytes  # noqa: E402
from workbench.runtime.loss import chunked_cross_entropy  # noqa: E402


def _inputs(T: int, h: int, V: int):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(T, h, generator=g) * 0.1).requires_grad_()
    w = (torch.randn(V, h, generator=g) * 0.02).requires_grad_()
    labels = torch.randint(0, V, (T,), generator=g)
    return x, w, labels


def _plain(x, w, labels):
    return F.cross_entropy(F.linear(x, w), labels, reduction="sum")


def _chunked(x, w, labels):
    return chunked_cross_entropy(x, w, labels, chunk=loss_chunk_tokens(w.shape[0]))


def measure(fn, T: int, h: int, V: int, repeats: int) -> tuple[float, int]:
    times = []
    for _ in range(repeats):
        x, w, labels = _inputs(T, h, V)
        t0 = time.perf_counter()
        fn(x, w, labels).backward()
        times.append((time.perf_counter() - t0) * 1e3)
    x, w, labels = _inputs(T, h, V)
    with LiveBytes() as live:
        fn(x, w, labels).backward()
    return statistics.median(times), live.peak


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", default="32000,128256")
    ap.add_argument("--tokens", default="1024,4096")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    h = args.hidden
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"# the head's loss, fp32 on this CPU ({torch.get_num_threads()} threads), hidden {h}; "
          f"{time.strftime('%Y-%m-%d %H:%M')}\n")
    print("| vocab | tokens | chunk | whole: ms | chunked: ms | whole: peak MB | model | chunked: peak MB | model |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for V in (int(v) for v in args.vocab.split(",")):
        model = dataclasses.replace(get_model("tiny"), vocab=V, hidden=h, dtype_bytes=4)
        for T in (int(t) for t in args.tokens.split(",")):
            tp, mp = measure(_plain, T, h, V, args.repeats)
            tc, mc = measure(_chunked, T, h, V, args.repeats)
            whole_model = 12.0 * V * T
            chunk_model = loss_transient_bytes(model, T, recompute=True) + 4.0 * h * T
            print(f"| {V:,} | {T:,} | {min(T, loss_chunk_tokens(V)):,} | {tp:,.0f} | {tc:,.0f} | {mp / 1e6:,.0f} | "
                  f"{whole_model / 1e6:,.0f} | {mc / 1e6:,.0f} | {chunk_model / 1e6:,.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
