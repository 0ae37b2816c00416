"""Stand-in for flash-attn 2.x (see tests/fakes/README.md)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _flash_checks import CALLS, check_and_compute  # noqa: E402

__version__ = "2.8.3+fake"
__all__ = ["flash_attn_varlen_func", "CALLS"]


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    if dropout_p != 0.0 or window_size != (-1, -1) or softcap or alibi_slopes is not None or block_table is not None:
        raise RuntimeError("the stand-in implements plain causal/full attention only")
    out, lse = check_and_compute(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale)
    return (out, lse, None) if return_attn_probs else out
