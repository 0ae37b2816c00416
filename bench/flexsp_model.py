"""FlexSP's own cost model, as a workbench cost model, for planning against its released solver.

FlexSP (ASPLOS'25, PKU-DAIR/Hetu-Galvatron branch ``flexsp``) plans a step as micro-batches run
one after another; in each, every GPU is in at most one SP group, and a micro-batch lasts as long
as its slowest group. A group of degree ``sp`` costs (its ``flexSPCostModel``)::

    sum over its sequences of (alpha1 * s^2 + alpha2 * s) / sp + beta1
        + all-to-all(tokens, sp) = (4 * 2 * layers * hidden * tokens * 2 / 2^20 / sp) / bw[sp]   (ms)

and holds at most ``capacity`` tokens per GPU (``sum(s) / sp``). That is the lockstep model of
``workbench.cost`` with ``beta1`` as the packed call's constant, no per-group extras, no FSDP pass
terms and no gradient sync, so ``FlexSPCost`` gives the workbench planners exactly FlexSP's
numbers: a plan's makespan under it *is* its step time in FlexSP's model (memory is counted in
tokens per GPU; the "budget" is the capacity). ``step_ms`` evaluates any plan with the formulas
above, independently of the planner, for the comparison table.

The constants come from the peer harness's ``results.json`` (its ``cost_model`` block, read off
FlexSP's instantiated objects): nothing of FlexSP's code is here. Pure numpy.
"""

from __future__ import annotations

import numpy as np

from workbench.cost import CostModel
from workbench.specs import ClusterSpec, ModelSpec, load_profile

__all__ = ["FlexSPCost", "step_ms"]


class FlexSPCost(CostModel):
    """FlexSP's cost model (module docstring) behind the ``CostModel`` interface, lockstep.
    ``constants``: the ``cost_model`` block of the peer's results.json. ``degrees``: the SP degrees
    the workbench may use (default every power of two up to the cluster; FlexSP's solver itself
    skips 1)."""

    def __init__(self, constants: dict, *, degrees=()) -> None:
        c = constants
        n = int(c["cluster_size"])
        self.a1 = float(c["cpt_alpha1_ms_per_token2"])
        self.a2 = float(c["cpt_alpha2_ms_per_token"])
        self.b1 = float(c["cpt_beta1_ms"])
        self.layers, self.hidden = int(c["layer_num"]), int(c["hidden_size"])
        self.bw = {int(k): float(v) for k, v in c["alltoall_bandwidth_dict_gbs"].items()}
        self.capacity = int(c["device_token_capacity"])
        self.profile = load_profile("a100-40g-flexsp")
        self.model = ModelSpec(name="flexsp-gpt-7b", layers=self.layers, hidden=self.hidden, heads=32, kv_heads=32,
                               ffn=11008, vocab=32000)
        self.cluster = ClusterSpec(num_gpus=n, gpus_per_node=8, gpu_memory_gb=float(c["memory_limit_gb"]),
                                   usable_memory_fraction=1.0, degrees=tuple(degrees))
        self.strategy, self.recompute, self.precision, self.optimizer = "ulysses", False, "bf16", "adamw"
        self.execution = "lockstep"
        self.memory_budget_gb = float(self.capacity)  # in tokens per GPU
        self.model_states_gb = 0.0
        self.states = None
        self.degrees = tuple(d for d in self.cluster.degrees if d in self.bw)
        self._shapes = tuple((d, 1) for d in self.degrees)  # FlexSP's groups are Ulysses over the whole group

    # the workbench cost interface, in FlexSP's terms
    def compute_ms(self, lengths, degree: int, cp=None) -> np.ndarray:
        s = np.asarray(lengths, dtype=np.float64)
        return (self.a1 * s * s + self.a2 * s) / degree

    def comm_ms(self, lengths, degree: int, cp=None) -> np.ndarray:
        s = np.asarray(lengths, dtype=np.float64)
        if degree == 1:
            return np.zeros_like(s)
        return (4 * 2 * self.layers * self.hidden * s * 2 / 1024 / 1024 / degree) / self.bw[int(degree)]

    def sp_token_ms(self, lengths, degree: int, cp=None) -> np.ndarray:
        return np.zeros_like(np.asarray(lengths, dtype=np.float64))

    def time(self, lengths, degree: int, cp=None) -> np.ndarray:
        return self.compute_ms(lengths, degree) + self.comm_ms(lengths, degree)

    def memory(self, lengths, degree: int, cp=None) -> np.ndarray:
        return np.asarray(lengths, dtype=np.float64) / degree  # tokens per GPU

    def degree_supported(self, d: int) -> bool:
        return int(d) in self.bw

    def collective_latency_ms(self, degree: int, cp=None) -> float:
        return 0.0

    def sp_overhead_ms(self, degree: int, cp=None) -> float:
        return 0.0

    def group_overhead_ms(self, degree: int, cp=None) -> float:
        return self.b1

    def group_extra_ms(self, degree: int, cp=None) -> float:
        return 0.0

    def call_overhead_ms(self) -> float:
        return self.b1

    def pass_comm_ms(self) -> float:
        return 0.0

    def pass_overhead_ms(self) -> float:
        return 0.0

    def grad_sync_ms(self, num_ranks=None) -> float:
        return 0.0

    def tokens_per_gpu(self) -> float:
        return float(self.capacity)

    @property
    def activation_bytes_per_token(self) -> float:
        return 1.0


def step_ms(micro_batches, constants: dict) -> float:
    """A plan's step time in FlexSP's model, from the formulas alone: ``micro_batches`` is a list of
    micro-batches, each a list of ``(sp, [lengths])``; a micro-batch is its slowest group. Raises
    ValueError when a group holds more than the capacity per GPU, or a micro-batch more GPUs than
    the cluster (FlexSP's own rules)."""
    a1, a2, b1 = (float(constants[k]) for k in ("cpt_alpha1_ms_per_token2", "cpt_alpha2_ms_per_token", "cpt_beta1_ms"))
    layers, hidden = int(constants["layer_num"]), int(constants["hidden_size"])
    bw = {int(k): float(v) for k, v in constants["alltoall_bandwidth_dict_gbs"].items()}
    cap, n = int(constants["device_token_capacity"]), int(constants["cluster_size"])
    total = 0.0
    for k, mb in enumerate(micro_batches):
        if sum(int(sp) for sp, _ in mb) > n:
            raise ValueError(f"micro-batch {k} uses more than {n} GPUs")
        worst = 0.0
        for sp, lens in mb:
            sp = int(sp)
            tokens = float(sum(lens))
            if tokens / sp > cap:
                raise ValueError(f"micro-batch {k}: a degree-{sp} group holds {tokens / sp:.0f} tokens per GPU > {cap}")
            t = sum((a1 * s * s + a2 * s) / sp for s in lens) + b1
            if sp > 1:
                t += (4 * 2 * layers * hidden * tokens * 2 / 1024 / 1024 / sp) / bw[sp]
            worst = max(worst, t)
        total += worst
    return total
