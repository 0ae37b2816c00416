"""The torch runtime: run Plans on real processes (torchrun; gloo on CPU, NCCL on CUDA).

- ``model``: a Llama-style decoder on packed varlen sequences; attention is a callable handed in.
- ``attention``: causal varlen attention, flash-attn (CUDA, lazy import) or PyTorch SDPA;
  ``select_attention(name, device)``.
- ``ulysses``: the sequence <-> head all-to-all (autograd), ``shard_layout``, ``UlyssesAttention``.
- ``groups``: ``GroupRegistry`` - every aligned (degree, block) process group, made once.
- ``step``: ``StepExecutor(model, registry, attn).run(plan, sequences) -> StepResult``;
  ``make_shard``, ``check_plan``, ``MicroStepRecord``.
- ``weights``: Hugging Face safetensors in (``load_initial_weights``, strict) and out (``export_run``;
  ``full_model_state`` reads a run's checkpoint), through the name adapter of ``workbench.hf``.
- measuring this machine for a ``HardwareProfile`` lives in ``workbench.profile.measure`` (``workbench profile``).

Everything here imports torch; the planning side (``workbench.solve``, ``cost``, ``specs``) never does.
"""

from workbench.runtime.attention import AttentionUnavailable, select_attention, torch_varlen_attention
from workbench.runtime.groups import GroupRegistry, aligned_blocks
from workbench.runtime.model import Transformer
from workbench.runtime.step import (
    IGNORE,
    LocalShard,
    MicroStepRecord,
    StepExecutor,
    StepResult,
    batch_loss,
    check_plan,
    make_shard,
)
from workbench.runtime.ulysses import ShardLayout, UlyssesAttention, shard_layout

__all__ = [
    "AttentionUnavailable", "select_attention", "torch_varlen_attention", "GroupRegistry", "aligned_blocks",
    "Transformer", "IGNORE", "LocalShard", "MicroStepRecord", "StepExecutor", "StepResult", "batch_loss",
    "check_plan", "make_shard", "ShardLayout", "UlyssesAttention", "shard_layout",
]
