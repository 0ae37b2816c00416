"""The torch runtime: run Plans on real processes (torchrun; gloo on CPU, NCCL on CUDA).

- ``model``: a Llama-style decoder on packed varlen sequences; attention is a callable handed in.
- ``attention``: causal varlen attention kernels ``attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
  max_seqlen_k)`` (bottom-right aligned): torch's ``varlen_attn``, flash-attn (CUDA, lazy imports) or
  PyTorch SDPA; ``select_attention(name, device)``.
- ``ulysses``: the sequence <-> head all-to-all (autograd), ``shard_layout``, ``UlyssesAttention``.
- ``cp``: context parallelism inside a group split ``u x c``: ``cp_layout``/``group_layout``, the K/V
  all-gather (autograd, backward a reduce-scatter), ``CPAttention``.
- ``groups``: ``GroupRegistry`` - the process groups of SP groups (contiguous rank ranges of any size)
  and their Ulysses/CP sub-groups, made by every rank in one order: aligned blocks at start, or a
  plan's groups when it first needs them (``ensure(plan)``, what training does).
- ``zero``: ``parallelize(model, zero_stage=, precision=, recompute=)`` -> ``ZeroRuntime``: the model
  states as the ZeRO stage holds them (FSDP2 under ZeRO-3, ZeroRedundancyOptimizer under 1-2),
  autocast, the stage's gradient reduction, the bytes held.
- ``step``: ``StepExecutor(model, registry, attn, zero=...).run(plan, sequences) -> StepResult``: free
  micro-steps (ZeRO 0-2) or lockstep passes (ZeRO-3); ``make_shard``, ``check_plan``, ``MicroStepRecord``.
- ``checkpoint``: whole-file (ZeRO 0-2) and sharded (ZeRO-3, torch.distributed.checkpoint) checkpoints,
  ``full_model_state(run_dir, step)``.
- ``weights``: Hugging Face safetensors in (``load_initial_weights``, strict) and out (``export_run``),
  through the name adapter of ``workbench.hf``; a run's weights are read with ``checkpoint.full_model_state``.
- ``timing``: ``Clock`` (CUDA events on a GPU), ``PeakMemory`` (the allocator's peak, reset per step),
  ``StepStats`` (the first step left out); shared by the profiler and the doctor.
- ``peers``: heartbeats through torchrun's store (``PeerWatch``), naming the node of a run over several
  nodes that went away.
- ``doctor``: the torch side of ``workbench doctor`` (run as a process of its own).
- measuring this machine for a ``HardwareProfile`` lives in ``workbench.profile.measure`` (``workbench profile``).

Everything here imports torch; the planning side (``workbench.solve``, ``cost``, ``specs``) never does.
"""

from workbench.runtime.attention import AttentionUnavailable, select_attention, torch_varlen_attention
from workbench.runtime.cp import CPAttention, CPLayout, cp_layout, group_layout
from workbench.runtime.groups import GroupRegistry, aligned_blocks
from workbench.runtime.model import Transformer
from workbench.runtime.step import (
    IGNORE,
    LocalShard,
    MicroStepRecord,
    PassAttention,
    StepExecutor,
    StepResult,
    batch_loss,
    check_plan,
    make_shard,
)
from workbench.runtime.ulysses import ShardLayout, UlyssesAttention, shard_layout
from workbench.runtime.zero import ZeroRuntime, default_precision, parallelize

__all__ = [
    "AttentionUnavailable", "select_attention", "torch_varlen_attention", "GroupRegistry", "aligned_blocks",
    "Transformer", "IGNORE", "LocalShard", "MicroStepRecord", "StepExecutor", "StepResult", "batch_loss",
    "check_plan", "make_shard", "ShardLayout", "UlyssesAttention", "shard_layout", "PassAttention",
    "ZeroRuntime", "parallelize", "default_precision", "CPAttention", "CPLayout", "cp_layout", "group_layout",
]
