"""Stand-in for flash-attn 3.x (Hopper) ``flash_attn_interface`` (see tests/fakes/README.md): the
3.x signature (no ``dropout_p``) and the ``(out, softmax_lse)`` tuple its early betas returned."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _flash_checks import CALLS, check_and_compute  # noqa: E402

__version__ = "3.0.0b1+fake"
__all__ = ["flash_attn_varlen_func", "CALLS"]


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                           seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                           v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                           pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
    return check_and_compute(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale)
