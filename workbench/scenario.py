"""One description of what is being planned: model, hardware, cluster, data, batch and planner.

A :class:`Scenario` is built once and shared by everything that plans: the CLI, the demo, the
trainer (which fills in its world size and device), the benchmarks and the JupyterLab panels::

    sc = Scenario(model="7b", num_gpus=64, source="wikipedia", batch_tokens=1_000_000)
    sc.cost()                 # the CostModel
    sc.lengths()              # the LengthSet, max-context policy applied (cached)
    sc.batches(3)             # three global batches
    sc.plan()                 # one step's Plan with sc.planner
    sc.simulate(["static-max", "greedy", "flexsp"], steps=5)

It is frozen, validates itself (``ValueError`` saying which field is wrong and how to fix it) and
round-trips through JSON (``to_dict``/``from_dict``). No printing, no argparse. Pure Python +
numpy: it never imports torch.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from workbench.cost import DEFAULT_STRATEGY, STRATEGIES, strategy_problem
from workbench.cost.offload import DEFAULT_OFFLOAD, OFFLOAD_CHOICES
from workbench.solve.effort import DEFAULT_EFFORT

__all__ = ["Scenario", "DEFAULT_PLANNERS", "STRATEGIES", "DEFAULT_STRATEGY", "POLICIES", "default_max_len"]

DEFAULT_PLANNERS = ("static-max", "best-static", "min-degree", "greedy", "two-stage", "flexsp")
"""The planners a comparison runs when none are named."""
POLICIES = ("clip", "split", "drop", "error")


def _fail(field: str, value: Any, what: str) -> None:
    raise ValueError(f"Scenario.{field} {what}, got {value!r}")


def _check_int(field: str, v: Any, lo: int, optional: bool = False) -> None:
    if v is None and optional:
        return
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
        _fail(field, v, f"must be an integer >= {lo}" + (" or None" if optional else ""))


def _check_num(field: str, v: Any, lo: float, hi: float | None = None, optional: bool = False,
               strict: bool = True) -> None:
    if v is None and optional:
        return
    ok = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and math.isfinite(v)
    ok = ok and (v > lo if strict else v >= lo) and (hi is None or v <= hi)
    if not ok:
        rng = f"{'>' if strict else '>='} {lo:g}" + (f" and <= {hi:g}" if hi is not None else "")
        _fail(field, v, f"must be a finite number {rng}" + (" or None" if optional else ""))


def default_max_len(cost) -> int:
    """The largest power of two of tokens the cluster holds on one group (its largest degree, on the
    split that needs least memory), at most the model's max context."""
    cap = min(max(cost.degrees) * cost.tokens_per_gpu(), cost.model.max_context)
    out = 1 << max(0, int(cap).bit_length() - 1)
    while out > 1 and cost.min_degree([out])[0] == 0:  # a split's own memory (CP's gathered K/V) counts too
        out //= 2
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class Scenario:
    """What is planned: one model on one cluster, one length source batched one way, one planner.

    Every field is plain JSON. ``None`` means "the default", resolved by a method (the profile's
    GPU memory, the largest context the cluster holds, ...)."""

    # ---- the model and the hardware ---------------------------------------------------------
    model: str = "7b"
    """Model preset (``workbench.specs.MODEL_PRESETS``), or the path of a Hugging Face
    ``config.json`` (or its folder) of a supported Llama-family architecture."""
    profile: str = "a100-40g-flexsp"
    """Hardware profile: a shipped name (``workbench.specs.list_profiles()``) or a JSON file."""
    num_gpus: int = 64
    """GPUs (ranks) the step is planned for."""
    gpus_per_node: int = 8
    """GPUs per node; groups up to this size never straddle nodes (capped at ``num_gpus``)."""
    gpu_memory_gb: float | None = None
    """Memory per GPU in GB; None: the profile's GPU."""
    memory_fraction: float | None = None
    """Share of GPU memory plans may fill; None: the profile's (``HardwareProfile.memory_fraction``:
    0.9 on h100-80g, where the memory model was measured within a few percent), else 0.7 (FlexSP's
    28 of 40 GB)."""
    zero_stage: int = 3
    """ZeRO stage of the model states (0-3). ZeRO-3 plans run in lockstep passes, ZeRO 0-2 free."""
    precision: str | None = None
    """``bf16`` or ``fp32``: the bytes of activations and collectives the plans assume, and what a
    run computes in; None: the model's own (bf16, fp32 for ``tiny``)."""
    optimizer: str = "adamw"
    """Optimizer whose states the memory model counts: ``adamw``, ``sgd-momentum`` or ``sgd``."""
    degrees: tuple[int, ...] = ()
    """Candidate sequence-parallel degrees, any integers up to ``num_gpus``; empty:
    ``workbench.specs.candidate_degrees`` (every degree up to a node, whole nodes in twos and threes,
    the cluster)."""
    strategy: str = DEFAULT_STRATEGY
    """How a group splits its attention (``workbench.cost``): ``ulysses`` (heads scattered by an
    all-to-all, capped by the heads), ``cp`` (context parallelism: K/V all-gathered; ``ring`` is its
    older name) or ``auto`` (each group the fastest split ``u x cp`` that fits)."""
    recompute: bool = False
    """Full activation recomputation (less memory, more time)."""
    offload: str = DEFAULT_OFFLOAD
    """Which offload levels plans may use (``workbench.cost.offload``): ``none``, ``inputs`` (every
    group's block inputs in host memory, its MLP in token tiles) or ``auto`` (a group offloads only
    when its activations do not fit the GPU otherwise). Needs ``recompute``; ``auto`` without it plans
    as ``none``."""
    host_memory_gb: float | None = None
    """Host memory per node in GB, where offloaded activations live; None: the profile's."""

    # ---- the data ------------------------------------------------------------------------------
    source: str = "wikipedia"
    """Length source: a family name, ``stdlib``, a file, or a comma-separated list (one batch). A
    text source (documents, JSONL/CSV/Parquet/dataset with a text column) is tokenised into the
    token cache (``workbench.data.tokens``)."""
    samples: int | None = None
    """Sequences drawn from the source (None: a family 100,000; a file or the corpus: all)."""
    column: str | None = None
    """Column of a CSV/Parquet/JSONL/dataset file holding lengths or text."""
    tokenizer: str | None = None
    """Local Hugging Face tokenizer (tokenizer.json or its folder) for text sources."""
    max_len: int | None = None
    """Max context in tokens; None: the largest power of two the cluster holds on one group (at most
    the model's), except for an explicit list, which is planned as given."""
    policy: str = "clip"
    """Sequences over ``max_len``: clip, split, drop or error (always reported)."""
    batch_tokens: int | None = None
    """Global batch by token budget (exclusive with ``batch_size``)."""
    batch_size: int | None = None
    """Global batch by sequence count."""
    seed: int = 0
    """Seeds data sampling, batching and planners."""

    # ---- the planner ---------------------------------------------------------------------------
    planner: str = "flexsp"
    """Planner name (``workbench.solve.planner_names()``)."""
    effort: float = DEFAULT_EFFORT
    """How much the planner searches per step, in reference seconds (``workbench.solve.effort``):
    counted in work done, so a plan depends on the scenario, the batch and the seed alone. 1 plans
    a 64 GPU x 512 sequence step in about a second on the 2-core reference machine."""
    time_limit: float | None = None
    """Wall-clock safety cap per step (s; None: ten times the effort and more). A cap that fires
    makes the plan depend on the machine (its stats and reason say so)."""

    def __post_init__(self) -> None:
        from workbench.models import get_model
        from workbench.solve import get_planner

        for name in ("model", "profile", "source", "planner", "strategy", "policy"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v.strip():
                _fail(name, v, "must be a non-empty string")
        for name in ("column", "tokenizer"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                _fail(name, v, "must be a non-empty string or None")
        _check_int("num_gpus", self.num_gpus, 1)
        _check_int("gpus_per_node", self.gpus_per_node, 1)
        _check_num("gpu_memory_gb", self.gpu_memory_gb, 0.0, optional=True)
        _check_num("memory_fraction", self.memory_fraction, 0.0, 1.0, optional=True)
        _check_num("host_memory_gb", self.host_memory_gb, 0.0, optional=True)
        if self.offload not in OFFLOAD_CHOICES:
            _fail("offload", self.offload, f"must be one of {', '.join(OFFLOAD_CHOICES)}")
        if self.offload == "inputs" and self.recompute is False:
            _fail("offload", self.offload, "needs recompute (the offloaded tensors are the checkpointed block inputs); "
                                           "set recompute, or use auto")
        if self.zero_stage not in (0, 1, 2, 3) or isinstance(self.zero_stage, bool):
            _fail("zero_stage", self.zero_stage, "must be 0, 1, 2 or 3")
        from workbench.cost.memory import OPTIMIZER_STATE_BYTES, PRECISIONS

        if self.precision is not None and self.precision not in PRECISIONS:
            _fail("precision", self.precision, f"must be one of {', '.join(PRECISIONS)} or None")
        if self.optimizer not in OPTIMIZER_STATE_BYTES:
            _fail("optimizer", self.optimizer, f"must be one of {', '.join(OPTIMIZER_STATE_BYTES)}")
        if isinstance(self.degrees, (str, bytes)) or not isinstance(self.degrees, Sequence):
            _fail("degrees", self.degrees, "must be a list of integers")
        for d in self.degrees:
            _check_int("degrees", d, 1)
        object.__setattr__(self, "degrees", tuple(sorted({int(d) for d in self.degrees})))
        if strategy_problem(self.strategy) is not None:
            _fail("strategy", self.strategy, f"must be one of {', '.join(STRATEGIES)} or cp:C (C a positive integer)")
        if not isinstance(self.recompute, bool):
            _fail("recompute", self.recompute, "must be true or false")
        _check_int("samples", self.samples, 1, optional=True)
        _check_int("max_len", self.max_len, 1, optional=True)
        if self.policy not in POLICIES:
            _fail("policy", self.policy, f"must be one of {', '.join(POLICIES)}")
        _check_int("batch_tokens", self.batch_tokens, 1, optional=True)
        _check_int("batch_size", self.batch_size, 1, optional=True)
        if self.batch_tokens is not None and self.batch_size is not None:
            raise ValueError("Scenario: give batch_tokens or batch_size, not both")
        _check_int("seed", self.seed, 0)
        _check_num("effort", self.effort, 0.0)
        _check_num("time_limit", self.time_limit, 0.0, optional=True)
        model = get_model(self.model)  # ValueError listing the presets, or naming a config's bad field
        if self.max_len is not None and self.max_len > model.max_context:
            raise ValueError(f"Scenario.max_len {self.max_len:,} exceeds model {model.name}'s max context "
                             f"{model.max_context:,}; lower max_len or pick a model with a longer context")
        get_planner(self.planner)  # ValueError listing the planners

    # ---- JSON -------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """Every field as plain JSON (``degrees`` as a list)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["degrees"] = list(self.degrees)
        return out

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, stored: bool = False) -> "Scenario":
        """Build from a dict (as ``to_dict`` writes it). Raises ValueError naming unknown fields or
        the invalid one. ``stored``: the dict was read from a file (a run's spec, a scenario file);
        one written before plans were deterministic has a ``time_limit`` and no ``effort``, and its
        time limit was the search budget, so it becomes the effort (a dict built now keeps
        ``time_limit`` as the wall-clock cap it is)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a scenario must be a JSON object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"scenario has unknown field(s) {unknown}; known fields are {sorted(names)}")
        kw = dict(data)
        if "degrees" in kw and isinstance(kw["degrees"], list):
            kw["degrees"] = tuple(kw["degrees"])
        if stored and "effort" not in kw and kw.get("time_limit") is not None:
            # written before plans were deterministic: its time limit was the search budget
            kw["effort"], kw["time_limit"] = kw["time_limit"], None
        return cls(**kw)

    @classmethod
    def from_json(cls, text: str) -> "Scenario":
        return cls.from_dict(json.loads(text), stored=True)

    def replace(self, **changes) -> "Scenario":
        """A copy with ``changes`` applied (validated again). Raises ValueError on a bad value or
        an unknown field."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise ValueError(f"Scenario has no field(s) {unknown}; known fields are {sorted(names)}")
        if "degrees" in changes and changes["degrees"] is not None:
            changes["degrees"] = tuple(changes["degrees"])
        return dataclasses.replace(self, **changes)

    # ---- what it describes ---------------------------------------------------------------------
    def model_spec(self):
        """The ModelSpec of ``model``."""
        from workbench.models import get_model

        return get_model(self.model)

    def profile_spec(self):
        """The HardwareProfile of ``profile``. Raises ValueError when it does not load."""
        return _profile(self.profile, _mtime(self.profile))

    def cluster(self):
        """The ClusterSpec: ``gpus_per_node`` capped at ``num_gpus``, memory from the profile when
        not given, and (when ``degrees`` is empty) ``aligned_degrees``. Raises ValueError for a cluster that cannot be laid out."""
        from workbench.specs import ClusterSpec

        per = min(self.gpus_per_node, self.num_gpus)
        if self.num_gpus % per:
            raise ValueError(f"Scenario: num_gpus ({self.num_gpus}) must be a multiple of gpus_per_node "
                             f"({self.gpus_per_node}) or fit in one node")
        degrees = self.degrees or aligned_degrees(self.num_gpus, per)
        mem = self.gpu_memory_gb if self.gpu_memory_gb is not None else self.profile_spec().gpu_memory_gb
        return ClusterSpec(num_gpus=self.num_gpus, gpus_per_node=per, gpu_memory_gb=float(mem),
                           usable_memory_fraction=self.resolved_memory_fraction(), degrees=degrees,
                           zero_stage=self.zero_stage, host_memory_gb=self.host_memory_gb)

    def resolved_memory_fraction(self) -> float:
        """``memory_fraction``, or the profile's, or 0.7."""
        if self.memory_fraction is not None:
            return float(self.memory_fraction)
        own = self.profile_spec().memory_fraction
        return float(own) if own is not None else 0.7

    def cost(self):
        """The CostModel the planners use. Raises ValueError when the model states alone do not fit
        or no degree works with the strategy."""
        return _cost(self._cost_key())

    def _cost_key(self) -> tuple:
        return (self.model, _model_mtime(self.model), self.profile, _mtime(self.profile), self.num_gpus,
                self.gpus_per_node, self.gpu_memory_gb, self.memory_fraction, self.zero_stage, self.degrees, self.strategy,
                self.recompute, self.precision, self.optimizer, self.offload, self.host_memory_gb)

    def resolved_max_len(self) -> int | None:
        """The max context applied to the data: ``max_len``, or None for an explicit list, or the
        largest power of two the cluster holds on one group (at most the model's)."""
        if self.max_len is not None:
            return int(self.max_len)
        from workbench.data import is_length_list

        if is_length_list(self.source):
            return None
        return default_max_len(self.cost())

    def lengths_set(self, *, apply_policy: bool = True):
        """The ``LengthSet`` of the source, with the max-context policy applied (or not). Cached
        per data settings (a file by its modification time). Raises ValueError for a bad source
        or a sequence over the max context under policy ``error``."""
        max_len = self.resolved_max_len() if apply_policy else None
        return _lengths(self.source, self.samples, self.seed, max_len, self.policy, self.column, self.tokenizer,
                        _mtime(self.source))

    def token_cache(self, *, progress: Callable[[float, str], None] | None = None,
                    say: Callable[[str], None] | None = None):
        """The token cache of the source when it is text (``workbench.data.tokens.TokenCache``),
        built now if it does not exist yet (``progress(fraction, message)`` while tokenising), or
        None for a lengths-only source. Call it before :meth:`lengths_set` to show progress. Raises
        ValueError for a bad column, file or tokenizer."""
        from workbench.data.tokens import text_source, token_cache

        if text_source(self.source, column=self.column, tokenizer=self.tokenizer) is None:
            return None
        return token_cache(self.source, column=self.column, tokenizer=self.tokenizer, progress=progress, say=say)

    def lengths(self) -> np.ndarray:
        """The source's sequence lengths after the max-context policy (read-only int64 array)."""
        return self.lengths_set().lengths

    def sampler(self):
        """The GlobalBatchSampler over the policy-applied lengths. An explicit list is one batch;
        otherwise ``batch_tokens`` or ``batch_size`` is needed (ValueError saying so)."""
        from workbench.data import GlobalBatchSampler

        ls = self.lengths_set()
        if ls.ordered:
            return GlobalBatchSampler(ls, seed=self.seed)
        if self.batch_tokens is None and self.batch_size is None:
            raise ValueError(f"give batch_tokens (--batch-tokens T) or batch_size (--batch-size B) to draw global "
                             f"batches from {self.source!r}, or pass the batch itself as a list L1,L2,...")
        return GlobalBatchSampler(ls, batch_size=self.batch_size, batch_tokens=self.batch_tokens, seed=self.seed)

    def batches(self, k: int, *, start: int = 0) -> list:
        """``k`` global batches (``workbench.data.Batch``) from step ``start``. An explicit list is
        the one batch: at most one is returned. Raises ValueError for k < 1 or a missing batch size."""
        _check_int("batches(k)", k, 1)
        sampler = self.sampler()
        if sampler.ordered:
            return [sampler.batch(0)]
        return sampler.take(int(k), start=int(start))

    # ---- planning --------------------------------------------------------------------------------
    def plan(self, batch=None, *, planner: str | None = None, progress: Callable[[float, str], None] | None = None,
             cancel=None, validate: bool = True):
        """Plan one step: ``batch`` (a Batch, an array of lengths, or None for the first batch)
        with ``planner`` (default ``self.planner``). Returns the validated Plan. Raises ValueError
        (InfeasibleError) when a sequence fits no group, Cancelled when ``cancel`` is set."""
        from workbench.solve import run_planner
        from workbench.solve import validate as check

        if batch is None:
            batch = self.batches(1)[0]
        bid = getattr(batch, "batch_id", None)
        s = np.asarray(getattr(batch, "lengths", batch), dtype=np.int64)
        cost = self.cost()
        p = run_planner(planner or self.planner, s, cost, seed=self.seed, effort=self.effort, time_limit=self.time_limit,
                        max_len=self.resolved_max_len(), progress=progress, cancel=cancel, batch_id=bid)
        if validate:
            check(p, s, cost.cluster, cost)
        return p

    def simulate(self, planners: Sequence[str] | None = None, steps: int = 5, *, keep_plans: bool = False,
                 progress: Callable[[float, str], None] | None = None, cancel=None):
        """Plan ``steps`` batches with every planner (default: ``DEFAULT_PLANNERS``) and replay them
        against the cost model. Returns ``workbench.simulate.SimulationResult``; a planner that cannot
        plan a batch is reported in its ``errors``. Raises ValueError for an unknown planner name or
        steps < 1, Cancelled when ``cancel`` is set."""
        from workbench.simulate import simulate
        from workbench.solve import get_planner

        names = list(planners) if planners is not None else list(DEFAULT_PLANNERS)
        if not names:
            raise ValueError("no planner to simulate; name at least one, e.g. ['static-max', 'greedy', 'flexsp']")
        for n in names:
            get_planner(n)
        _check_int("simulate(steps)", steps, 1)
        batches = [(b.batch_id, np.asarray(b.lengths, dtype=np.int64)) for b in self.batches(steps)]
        return simulate(batches, self.cost(), names, seed=self.seed, effort=self.effort, time_limit=self.time_limit,
                        max_len=self.resolved_max_len(), keep_plans=keep_plans, progress=progress, cancel=cancel)

    def describe(self) -> str:
        """One line: model, cluster, data, batch and planner."""
        batch = (f"{self.batch_tokens:,} tokens per batch" if self.batch_tokens else
                 f"{self.batch_size:,} sequences per batch" if self.batch_size else "the list as one batch")
        ml = self.resolved_max_len()
        ctx = f"max context {ml:,} ({self.policy})" if ml else "no max context"
        run = "lockstep passes" if self.zero_stage == 3 else "free micro-steps"
        return (f"{self.model} on {self.num_gpus} x {self.profile} ({self.gpus_per_node} per node), "
                f"ZeRO-{self.zero_stage} ({run}), {self.source!r}, {ctx}, {batch}, planner {self.planner}")


def aligned_degrees(num_gpus: int, gpus_per_node: int) -> tuple[int, ...]:
    """The default candidate degrees of ``num_gpus`` GPUs in nodes of ``gpus_per_node``
    (``workbench.specs.candidate_degrees``: every degree up to a node, whole nodes in twos and
    threes, the cluster). The name is kept from when these were the powers of two whose aligned
    groups did not straddle nodes."""
    from workbench.specs import candidate_degrees

    return candidate_degrees(num_gpus, gpus_per_node)


# ---- caches: the same settings give the same (immutable) objects --------------------------------


def _mtime(source: str) -> float | None:
    """A file source's modification time (part of the cache key); None for names and lists."""
    from workbench.data import is_length_list

    if is_length_list(source):
        return None
    try:
        p = Path(source)
        return p.stat().st_mtime if p.exists() else None
    except (OSError, ValueError):
        return None


def _model_mtime(model: str) -> float | None:
    """A model config's modification time (part of the cost cache key); None for presets."""
    from workbench.specs import MODEL_PRESETS

    if model.strip().lower() in MODEL_PRESETS:
        return None
    try:
        from workbench.hf import config_path

        return config_path(model).stat().st_mtime
    except (OSError, ValueError):
        return None


@functools.lru_cache(maxsize=32)
def _profile(name: str, mtime: float | None):
    from workbench.specs import load_profile

    return load_profile(name)


@functools.lru_cache(maxsize=64)
def _cost(key: tuple):
    from workbench.cost import CostModel

    (model, _model_mt, profile, mtime, num_gpus, per, mem, frac, zero, degrees, strategy, recompute, precision,
     optimizer, offload, host) = key
    sc = Scenario(model=model, profile=profile, num_gpus=num_gpus, gpus_per_node=per, gpu_memory_gb=mem,
                  memory_fraction=frac, zero_stage=zero, degrees=degrees, strategy=strategy, recompute=recompute,
                  precision=precision, optimizer=optimizer, offload=offload, host_memory_gb=host)
    return CostModel(sc.profile_spec(), sc.model_spec(), sc.cluster(), strategy=strategy, recompute=recompute,
                     precision=precision, optimizer=optimizer, offload=offload)


@functools.lru_cache(maxsize=16)
def _lengths(source, samples, seed, max_len, policy, column, tokenizer, mtime):
    from workbench.data import load_lengths

    return load_lengths(source, samples=samples, seed=seed, max_len=max_len, policy=policy, column=column,
                        tokenizer=tokenizer)


def clear_caches() -> None:
    """Forget cached profiles, cost models and length sets (e.g. after a profile file changed in
    place within the same second)."""
    _profile.cache_clear()
    _cost.cache_clear()
    _lengths.cache_clear()

