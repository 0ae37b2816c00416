"""Plain, validated descriptions of what is being planned: the model, the cluster, the hardware.

Every spec is a frozen keyword-only dataclass that checks itself in ``__post_init__`` (raising
``ValueError`` that says what is wrong and how to fix it) and round-trips through JSON with
``to_dict`` / ``from_dict``. Nothing here imports torch or ipywidgets.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

__all__ = [
    "ModelSpec",
    "RopeScaling",
    "FAMILIES",
    "ClusterSpec",
    "candidate_degrees",
    "degree_chains",
    "MAX_CHAINS",
    "ComputeCurve",
    "HardwareProfile",
    "MODEL_PRESETS",
    "load_profile",
    "list_profiles",
    "spec_from_dict",
]


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _positive_int(owner: str, name: str, value: Any) -> None:
    _require(
        isinstance(value, int) and not isinstance(value, bool) and value > 0,
        f"{owner}.{name} must be a positive integer, got {value!r}",
    )


_FIELD_DOCS = {
    "name": "a short name", "gpu": "the GPU model, e.g. A100-SXM4-40GB",
    "model": "the model preset the curves were measured on, e.g. tiny or 7b",
    "forward": "the per-layer forward time curve {a, b, c} in ms",
    "backward": "the per-layer backward time curve {a, b, c} in ms",
    "a": "ms per token squared", "b": "ms per token", "layers": "number of transformer blocks",
    "hidden": "model width", "heads": "attention heads", "kv_heads": "key/value heads", "ffn": "MLP width",
    "vocab": "vocabulary size", "num_gpus": "number of GPUs",
}


def _field_doc(cls: type, name: str) -> str:
    return _FIELD_DOCS.get(name, f"a field of {cls.__name__}")


class _JsonMixin:
    """to_dict / from_dict / to_json / from_json shared by the specs."""

    def to_dict(self) -> dict:
        """Return a plain, JSON-serialisable dict of every field."""
        out = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if isinstance(v, _JsonMixin):
                v = v.to_dict()
            elif isinstance(v, tuple):
                v = list(v)
            elif isinstance(v, Mapping):
                v = {str(k): (x.to_dict() if isinstance(x, _JsonMixin) else x) for k, x in v.items()}
            out[f.name] = v
        return out

    def to_json(self, **kw) -> str:
        """Return the spec as a JSON string."""
        return json.dumps(self.to_dict(), **kw)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]):
        """Build the spec from a dict; raises ValueError naming unknown or missing fields."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{cls.__name__}: expected a JSON object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(data) - names)
        _require(not unknown, f"{cls.__name__}: unknown field(s) {unknown}; known fields are {sorted(names)}")
        kwargs = dict(data)
        missing = [f for f in dataclasses.fields(cls)  # type: ignore[arg-type]
                   if f.name not in kwargs and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        if missing:
            what = "; ".join(f"'{f.name}' ({_field_doc(cls, f.name)})" for f in missing)
            raise ValueError(f"{cls.__name__}: missing field{'s' if len(missing) > 1 else ''} {what}")
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            conv = f.metadata.get("from_json") if f.metadata else None
            if conv is not None and f.name in kwargs:
                kwargs[f.name] = conv(kwargs[f.name])
        try:
            return cls(**kwargs)
        except TypeError as e:  # a missing required field
            raise ValueError(f"{cls.__name__}: {e}") from None

    @classmethod
    def from_json(cls, text: str):
        """Build the spec from a JSON string."""
        return cls.from_dict(json.loads(text))


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class RopeScaling(_JsonMixin):
    """Llama 3.1's rotary frequency scaling (Hugging Face ``rope_type: "llama3"``): wavelengths
    longer than ``original_max_position_embeddings / low_freq_factor`` are stretched by ``factor``,
    shorter than ``.../high_freq_factor`` kept, and those between interpolated smoothly."""

    rope_type: str = "llama3"
    """The only kind supported: ``llama3``."""
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    """Context the model was pretrained on before the scaling."""

    def __post_init__(self) -> None:
        _require(self.rope_type == "llama3",
                 f"RopeScaling.rope_type {self.rope_type!r} is not supported; supported: llama3 (Llama 3.1)")
        for n in ("factor", "low_freq_factor", "high_freq_factor"):
            v = getattr(self, n)
            _require(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0,
                     f"RopeScaling.{n} must be a number > 0, got {v!r}")
        _require(self.high_freq_factor > self.low_freq_factor,
                 f"RopeScaling: high_freq_factor ({self.high_freq_factor}) must exceed low_freq_factor "
                 f"({self.low_freq_factor})")
        _positive_int("RopeScaling", "original_max_position_embeddings", self.original_max_position_embeddings)


def _rope_scaling(v: Any) -> RopeScaling | None:
    return v if v is None or isinstance(v, RopeScaling) else RopeScaling.from_dict(v)


FAMILIES = ("llama", "mistral", "qwen2")
"""Hugging Face ``model_type`` a ModelSpec follows (what an exported ``config.json`` says)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec(_JsonMixin):
    """A Llama-style decoder: RMSNorm, rotary positions, grouped-query attention, SwiGLU.

    The fields after ``tied_embeddings`` carry what a Hugging Face Llama-family config adds (Llama
    2/3/3.1/3.2, Mistral without a sliding window, Qwen2/2.5); their defaults are the original
    Llama's, so a spec written before they existed means the same model."""

    name: str
    """Preset or user name; used to match a hardware profile measured on this model."""
    layers: int
    """Number of transformer blocks."""
    hidden: int
    """Model width; must be divisible by ``heads`` unless ``head_dim`` is given."""
    heads: int
    """Query heads. Ulysses sequence parallelism of degree d needs d to divide this."""
    kv_heads: int
    """Key/value heads (grouped-query attention); must divide ``heads``."""
    ffn: int
    """SwiGLU inner width."""
    vocab: int
    """Vocabulary size (256 for the byte-level tiny model)."""
    max_context: int = 131072
    """Longest sequence the model is trained on (rotary tables are built this long)."""
    dtype_bytes: int = 2
    """Bytes per activation/parameter element in compute (2 for bf16, 4 for fp32)."""
    tied_embeddings: bool = False
    """Whether the output head shares the input embedding matrix."""
    head_dim: int = 0
    """Width of one attention head; 0 (the default) means ``hidden // heads``, and is replaced by that
    value on construction. Explicit in configs such as Llama 3.2's and Mistral-Nemo's."""
    qkv_bias: bool = False
    """Whether the q, k and v projections have a bias (Qwen2 does; the output projection never)."""
    rope_theta: float = 10000.0
    """Rotary base (Llama 2: 10,000; Llama 3: 500,000; Qwen2.5, Mistral v0.3: 1,000,000)."""
    rope_scaling: RopeScaling | None = field(default=None, metadata={"from_json": _rope_scaling})
    """Rotary frequency scaling (Llama 3.1's), or None."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon (``rms_norm_eps``)."""
    family: str = "llama"
    """Hugging Face ``model_type`` the shape follows: llama, mistral or qwen2 (what an export writes)."""

    def __post_init__(self) -> None:
        _require(isinstance(self.name, str) and self.name, "ModelSpec.name must be a non-empty string")
        for n in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "max_context", "dtype_bytes"):
            _positive_int("ModelSpec", n, getattr(self, n))
        _require(isinstance(self.head_dim, int) and not isinstance(self.head_dim, bool) and self.head_dim >= 0,
                 f"ModelSpec.head_dim must be a positive integer or 0 (hidden // heads), got {self.head_dim!r}")
        if self.head_dim == 0:
            _require(
                self.hidden % self.heads == 0,
                f"ModelSpec {self.name}: hidden ({self.hidden}) must be divisible by heads ({self.heads}), "
                f"or give head_dim",
            )
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        _require(self.head_dim % 2 == 0, f"ModelSpec {self.name}: head_dim ({self.head_dim}) must be even (rotary "
                                         f"positions rotate pairs)")
        _require(
            self.heads % self.kv_heads == 0,
            f"ModelSpec {self.name}: heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})",
        )
        _require(self.dtype_bytes in (1, 2, 4, 8), f"ModelSpec.dtype_bytes must be 1, 2, 4 or 8, got {self.dtype_bytes}")
        _require(isinstance(self.rope_theta, (int, float)) and not isinstance(self.rope_theta, bool)
                 and math.isfinite(self.rope_theta) and self.rope_theta > 0,
                 f"ModelSpec.rope_theta must be a number > 0, got {self.rope_theta!r}")
        object.__setattr__(self, "rope_scaling", _rope_scaling(self.rope_scaling))
        _require(isinstance(self.norm_eps, (int, float)) and not isinstance(self.norm_eps, bool)
                 and math.isfinite(self.norm_eps) and self.norm_eps > 0,
                 f"ModelSpec.norm_eps must be a number > 0, got {self.norm_eps!r}")
        _require(self.family in FAMILIES, f"ModelSpec.family must be one of {', '.join(FAMILIES)}, got {self.family!r}")
        # what Hugging Face can express: Qwen2 always has q/k/v biases; a Llama config's
        # attention_bias would put one on the output projection too
        _require(self.qkv_bias == (self.family == "qwen2"),
                 f"ModelSpec {self.name}: q/k/v biases go with family qwen2 (qkv_bias=True) and only with it; "
                 f"got family {self.family!r}, qkv_bias={self.qkv_bias}")

    @property
    def q_dim(self) -> int:
        """Width of all query heads together (``heads * head_dim``; ``hidden`` unless head_dim is explicit)."""
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_params(self) -> int:
        """Parameters in one block (attention with its biases, MLP, two norms)."""
        h = self.hidden
        attn = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h  # q, k, v, o
        if self.qkv_bias:
            attn += self.q_dim + 2 * self.kv_dim
        mlp = 3 * h * self.ffn  # gate, up, down
        return attn + mlp + 2 * h

    def params(self) -> int:
        """Total parameter count (a tied head counted once)."""
        emb = self.vocab * self.hidden
        head = 0 if self.tied_embeddings else self.vocab * self.hidden
        return emb + head + self.layers * self.layer_params() + self.hidden

    def flops_per_token(self, seq_len: float) -> float:
        """Training FLOPs per token (forward + backward = 3x forward) at a given sequence length.

        Matrix multiplies count 2 FLOPs per multiply-add (the output head too, tied or not);
        causal attention scores and values add 2 * 2 * s * q_dim / 2 per layer and token in the
        forward pass.
        """
        dense = 2 * (self.layers * self.layer_params() + self.vocab * self.hidden)
        attn = self.layers * 2 * seq_len * self.q_dim  # causal: half of 4*s*q_dim
        return 3.0 * (dense + attn)


def _llama(name: str, layers: int, hidden: int, heads: int, kv: int, ffn: int, vocab: int, ctx: int, **kw) -> ModelSpec:
    return ModelSpec(name=name, layers=layers, hidden=hidden, heads=heads, kv_heads=kv, ffn=ffn, vocab=vocab,
                     max_context=ctx, **kw)


_LLAMA31_ROPE = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)

MODEL_PRESETS: dict[str, ModelSpec] = {
    # byte-level toy model that trains on a CPU in seconds (fp32 on CPU)
    "tiny": ModelSpec(name="tiny", layers=2, hidden=64, heads=4, kv_heads=2, ffn=172, vocab=256,
                      max_context=16384, dtype_bytes=4),
    # Llama-3.2-1B shape
    "1b": _llama("1b", 16, 2048, 32, 8, 8192, 128256, 131072),
    # Llama-2-7B shape (multi-head attention, as FlexSP's GPT-7B)
    "7b": _llama("7b", 32, 4096, 32, 32, 11008, 32000, 393216),
    # Llama-2-13B shape
    "13b": _llama("13b", 40, 5120, 40, 40, 13824, 32000, 393216),
    # LLaMA-30B (33B) shape
    "30b": _llama("30b", 60, 6656, 52, 52, 17920, 32000, 393216),
    # Llama-2-70B shape, grouped-query attention with 8 KV heads
    "70b": _llama("70b", 80, 8192, 64, 8, 28672, 32000, 393216),
    # The common open shapes, from their Hugging Face config.json numbers. llama3-*: the Llama 3.1
    # configs (meta-llama/Llama-3.1-8B, -70B): 128K context with Llama 3.1's rope scaling (the 3.0
    # release has the same shapes with 8K context and no scaling: pass its config.json for that)
    "llama3-8b": _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 131072, rope_theta=500000.0,
                        rope_scaling=_LLAMA31_ROPE, norm_eps=1e-5),
    # the same shape with its context extended to 1M tokens, as long-context continued training does
    # (MEMO, ByteScale); the rotary settings stay Llama 3.1's: give an extended model's own config.json
    # to train its exact rotary
    "llama3-8b-1m": _llama("llama3-8b-1m", 32, 4096, 32, 8, 14336, 128256, 1048576, rope_theta=500000.0,
                           rope_scaling=_LLAMA31_ROPE, norm_eps=1e-5),
    "llama3-70b": _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 131072, rope_theta=500000.0,
                         rope_scaling=_LLAMA31_ROPE, norm_eps=1e-5),
    # Qwen/Qwen2.5-7B: q/k/v biases, 28 heads (Ulysses degrees must divide 28: 1, 2, 4), 4 KV heads
    "qwen2.5-7b": _llama("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064, 131072, rope_theta=1000000.0,
                         norm_eps=1e-6, qkv_bias=True, family="qwen2"),
    # mistralai/Mistral-7B-v0.3 (no sliding window)
    "mistral-7b": _llama("mistral-7b", 32, 4096, 32, 8, 14336, 32768, 32768, rope_theta=1000000.0,
                         norm_eps=1e-5, family="mistral"),
}


# --------------------------------------------------------------------------------------------
# Cluster
# --------------------------------------------------------------------------------------------


def candidate_degrees(num_gpus: int, gpus_per_node: int) -> tuple[int, ...]:
    """The default candidate SP degrees of ``num_gpus`` GPUs in nodes of ``gpus_per_node``, chosen so
    that no GPU need sit idle because a count is not a power of two (docs/solver.md, "Groups of any
    size"):

    - one node (``num_gpus <= gpus_per_node``): every degree from 1 to ``num_gpus``;
    - several nodes: the degrees dividing the node size (a group never straddles nodes), the node
      size times ``2^a`` and ``3 x 2^a`` up to the cluster (whole nodes: 1, 2, 3, 4, 6, 8, 12, ...
      of them), and the cluster itself.

    Every other multiple of the node size (5 or 7 nodes of a 64-node cluster) is left out: each adds
    divisibility chains to search (``degree_chains``) for groups a mix of these already comes close to
    (bench/any_size.py measures the trade-off)."""
    n, g = int(num_gpus), int(gpus_per_node)
    if n <= g:
        return tuple(range(1, n + 1))
    out = {d for d in range(1, g + 1) if g % d == 0} | {n}
    for k in (1, 3):
        m = k
        while m * g <= n:
            out.add(m * g)
            m *= 2
    return tuple(sorted(out))


MAX_CHAINS = 24
"""``degree_chains`` keeps at most this many chains (the first in its order)."""


def degree_chains(degrees) -> tuple[tuple[int, ...], ...]:
    """The maximal divisibility chains of a set of degrees: the subsets in which each degree divides
    the next, not extendable by another degree of the set. Groups of one chain's degrees pack into
    aligned blocks (a group of degree ``d`` on ranks ``[k*d, (k+1)*d)``) for any mix whose degrees sum
    to at most the cluster, which is what the planners search (``workbench.solve.run_planner`` runs a
    planner over the chains and keeps the fastest plan). Order: the chain holding the set's powers of
    two first (the only chain of a power-of-two set: plans as before), then the others by their
    largest degree, descending, then lexicographically; at most ``MAX_CHAINS``."""
    ds = sorted({int(d) for d in degrees})
    if not ds:
        return ()
    succ = {d: [e for e in ds if e > d and e % d == 0 and not any(d < f < e and f % d == 0 and e % f == 0 for f in ds)]
            for d in ds}
    starts = [d for d in ds if not any(e < d and d % e == 0 for e in ds)]
    out: list[tuple[int, ...]] = []

    def walk(chain: list[int]) -> None:
        if len(out) > 4 * MAX_CHAINS:
            return
        nxt = succ[chain[-1]]
        if not nxt:
            out.append(tuple(chain))
            return
        for e in nxt:
            walk(chain + [e])

    for d in starts:
        walk([d])
    pow2 = tuple(d for d in ds if d & (d - 1) == 0)

    def key(c: tuple[int, ...]):
        holds_pow2 = bool(pow2) and set(pow2) <= set(c)
        return (not holds_pow2, -c[-1], c)

    return tuple(sorted(set(out), key=key))[:MAX_CHAINS]


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterSpec(_JsonMixin):
    """The GPUs a step is planned for."""

    num_gpus: int
    """Total ranks (GPUs)."""
    gpus_per_node: int = 8
    """Ranks per node; groups no larger than this never straddle nodes."""
    gpu_memory_gb: float = 40.0
    """Memory of one GPU in GB (1e9 bytes)."""
    usable_memory_fraction: float = 0.7
    """Share of GPU memory the planner may fill (FlexSP ran 28 GB of a 40 GB A100: 0.7); the rest
    covers allocator fragmentation, communication buffers and kernels' workspace."""
    degrees: tuple[int, ...] = ()
    """Candidate sequence-parallel degrees, any integers from 1 to ``num_gpus`` (default:
    ``candidate_degrees``: every degree up to a node, whole nodes in twos and threes, the cluster).
    A plan's groups use the degrees of one divisibility chain (``degree_chains``)."""
    zero_stage: int = 3
    """ZeRO stage of the model states sharding over all ranks (0, 1, 2 or 3). It fixes how a step
    executes (``execution``): ZeRO-3 in lockstep passes, ZeRO 0-2 barrier-free."""
    host_memory_gb: float | None = None
    """Host memory of one node in GB, where offloaded activations live (``workbench.cost.offload``);
    None: the profile's."""

    def __post_init__(self) -> None:
        _positive_int("ClusterSpec", "num_gpus", self.num_gpus)
        _require(self.host_memory_gb is None or (isinstance(self.host_memory_gb, (int, float))
                                                 and not isinstance(self.host_memory_gb, bool) and self.host_memory_gb > 0),
                 f"ClusterSpec.host_memory_gb must be a positive number of GB per node or null, got {self.host_memory_gb!r}")
        _positive_int("ClusterSpec", "gpus_per_node", self.gpus_per_node)
        _require(
            self.num_gpus % self.gpus_per_node == 0 or self.num_gpus < self.gpus_per_node,
            f"ClusterSpec: num_gpus ({self.num_gpus}) must be a multiple of gpus_per_node ({self.gpus_per_node}) "
            f"or fit in one node; pass --gpus-per-node to match your machines",
        )
        _require(
            isinstance(self.gpu_memory_gb, (int, float)) and self.gpu_memory_gb > 0,
            f"ClusterSpec.gpu_memory_gb must be positive, got {self.gpu_memory_gb!r}",
        )
        _require(
            0 < self.usable_memory_fraction <= 1,
            f"ClusterSpec.usable_memory_fraction must be in (0, 1], got {self.usable_memory_fraction!r}",
        )
        _require(self.zero_stage in (0, 1, 2, 3), f"ClusterSpec.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        degrees = tuple(int(d) for d in self.degrees) if self.degrees else candidate_degrees(self.num_gpus,
                                                                                             self.gpus_per_node)
        object.__setattr__(self, "degrees", tuple(sorted(set(degrees))))
        for d in self.degrees:
            _require(
                1 <= d <= self.num_gpus,
                f"ClusterSpec: degree {d} is outside 1..num_gpus ({self.num_gpus}); drop it from degrees",
            )

    @property
    def chains(self) -> tuple[tuple[int, ...], ...]:
        """The divisibility chains of ``degrees`` (``degree_chains``): the degree sets one plan's groups use."""
        return degree_chains(self.degrees)

    def crosses_nodes(self, degree: int) -> bool:
        """Whether a group of ``degree`` ranks may span nodes: larger than a node, or (on several
        nodes) a size that does not divide the node's, whose aligned blocks straddle a node boundary
        somewhere (so every group of that size is costed with the inter-node link: the slowest block
        sets a collective's pace where they run together)."""
        d, g = int(degree), self.gpus_per_node
        return d > g or (self.num_gpus > g and g % d != 0)

    @property
    def num_nodes(self) -> int:
        return max(1, self.num_gpus // self.gpus_per_node)

    @property
    def usable_memory_gb(self) -> float:
        return self.gpu_memory_gb * self.usable_memory_fraction

    @property
    def execution(self) -> str:
        """``lockstep`` under ZeRO-3 (every forward and backward all-gathers parameters over all
        ranks, so every rank runs the same passes together), ``free`` under ZeRO 0-2 (replicated
        parameters: a rank runs its groups back to back, meeting the others only at the step's end)."""
        return "lockstep" if self.zero_stage == 3 else "free"

    def model_state_gb(self, model: ModelSpec) -> float:
        """FlexSP's published formula for the per-GPU memory of parameters, gradients and Adam
        states (16 bytes/parameter in mixed precision) under this ZeRO stage sharded over all ranks.
        The planners use what the runtime holds instead (``workbench.cost.memory.model_states``);
        this is kept to compare with FlexSP's figures."""
        n = self.num_gpus
        share = {0: 1.0, 1: 6 / 8 / n + 2 / 8, 2: 7 / 8 / n + 1 / 8, 3: 1.0 / n}[self.zero_stage]
        return 16.0 * model.params() * share / 1e9


# --------------------------------------------------------------------------------------------
# Hardware profile
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class ComputeCurve(_JsonMixin):
    """Time in ms of one transformer layer on one GPU for a packed call: ``a*s^2 + b*s`` per
    sequence of ``s`` tokens (the whole sequence's work, before division by the SP degree) plus
    ``c`` once per call (launch and fixed costs, paid once per group and micro-step). A sequence
    shorter than ``short_len`` tokens costs ``a_short`` per token pair instead of ``a`` (attention
    kernels block short sequences differently: on CPU the same pair costs about twice as much
    below ~768 tokens); without them ``a`` holds for every length."""

    a: float
    b: float
    c: float = 0.0
    a_short: float | None = None
    short_len: int | None = None

    def __post_init__(self) -> None:
        for n in ("a", "b", "c"):
            v = getattr(self, n)
            _require(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0,
                     f"ComputeCurve.{n} must be a finite number >= 0, got {v!r}")
        _require((self.a_short is None) == (self.short_len is None),
                 "ComputeCurve.a_short and short_len go together: give both or neither")
        if self.a_short is not None:
            _require(isinstance(self.a_short, (int, float)) and math.isfinite(self.a_short) and self.a_short >= 0,
                     f"ComputeCurve.a_short must be a finite number >= 0, got {self.a_short!r}")
            _require(isinstance(self.short_len, int) and not isinstance(self.short_len, bool) and self.short_len >= 2,
                     f"ComputeCurve.short_len must be an integer >= 2 (tokens), got {self.short_len!r}")

    def quadratic(self, lengths):
        """The attention part, ``a * s^2`` (``a_short * s^2`` below ``short_len``), of each length."""
        import numpy as np

        s = np.asarray(lengths, dtype=np.float64)
        if self.short_len is None:
            return self.a * s * s
        return np.where(s < self.short_len, self.a_short, self.a) * s * s


def _curve(v: Any) -> ComputeCurve:
    return v if isinstance(v, ComputeCurve) else ComputeCurve.from_dict(v)


def _latency_table(v: Any) -> dict[int, float]:
    if not isinstance(v, Mapping):
        raise ValueError(f"latency table must be an object {{group size: ms}}, got {v!r}")
    out = {}
    for k, x in v.items():
        try:
            kk = int(k)
        except (TypeError, ValueError):
            raise ValueError(f"latency table key {k!r} is not a group size (an integer)") from None
        _require(kk >= 1, f"latency table key {kk} must be >= 1")
        _require(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0,
                 f"latency for group size {kk} must be a finite number >= 0 ms, got {x!r}")
        out[kk] = float(x)
    return dict(sorted(out.items()))


def split_key(ulysses: int, cp: int) -> str:
    """The key of split ``ulysses x cp`` in a profile's per-split tables: ``"2x2"``."""
    return f"{int(ulysses)}x{int(cp)}"


def _split_table(v: Any) -> dict[str, float]:
    """A per-split table ``{"uxc": ms}`` of composite splits (u > 1 and c > 1: a ``u x 1`` split's
    extras are ``sp_*``, a ``1 x c`` one's ``cp_*``), values finite and >= 0; keys normalised
    (``" 2 x 2 "`` -> ``"2x2"``) and sorted by (c, u)."""
    if not isinstance(v, Mapping):
        raise ValueError(f"split table must be an object {{\"u x c\" split, e.g. \"2x2\": ms}}, got {v!r}")
    out = {}
    for k, x in v.items():
        parts = str(k).replace(" ", "").lower().split("x")
        try:
            u, c = (int(t) for t in parts)
        except ValueError:
            raise ValueError(f"split table key {k!r} is not a split \"u x c\" (e.g. \"2x2\": Ulysses over u ranks "
                             f"inside context parallelism over c)") from None
        _require(u > 1 and c > 1, f"split table key {k!r}: only composite splits (u > 1 and c > 1) have an entry; "
                                  f"a u x 1 split's extras are sp_overhead_ms / sp_token_ms, a 1 x c split's "
                                  f"cp_overhead_ms / cp_token_ms")
        _require(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0,
                 f"value for split {k!r} must be a finite number >= 0 ms, got {x!r}")
        out[(c, u)] = float(x)
    return {split_key(u, c): out[(c, u)] for c, u in sorted(out)}


def _bw_table(v: Any) -> dict[int, float]:
    if not isinstance(v, Mapping):
        raise ValueError(f"bandwidth table must be an object {{group size: GB/s}}, got {v!r}")
    out = {}
    for k, x in v.items():
        try:
            kk = int(k)
        except (TypeError, ValueError):
            raise ValueError(f"bandwidth table key {k!r} is not a group size (an integer)") from None
        _require(kk >= 1, f"bandwidth table key {kk} must be >= 1")
        _require(isinstance(x, (int, float)) and x > 0, f"bandwidth for group size {kk} must be > 0 GB/s, got {x!r}")
        out[kk] = float(x)
    return dict(sorted(out.items()))


@dataclass(frozen=True, kw_only=True, slots=True)
class HardwareProfile(_JsonMixin):
    """What a cost model needs to know about a machine, measured or taken from a reference."""

    name: str
    """Short name, e.g. ``a100-40g-flexsp``."""
    gpu: str
    """GPU model, e.g. ``A100-SXM4-40GB``."""
    model: str
    """Name of the model the compute curves were measured on; other models are scaled from it
    by their per-layer FLOPs."""
    forward: ComputeCurve = field(metadata={"from_json": _curve})
    """Per-layer forward time curve (ms)."""
    backward: ComputeCurve = field(metadata={"from_json": _curve})
    """Per-layer backward time curve (ms)."""
    all_to_all_gbps: dict = field(default_factory=dict, metadata={"from_json": _bw_table})
    """Per-GPU all-to-all bandwidth in GB/s by group size (Ulysses)."""
    p2p_gbps: dict = field(default_factory=dict, metadata={"from_json": _bw_table})
    """Per-GPU point-to-point bandwidth in GB/s by ring size (ring attention)."""
    allreduce_gbps: dict = field(default_factory=dict, metadata={"from_json": _bw_table})
    """All-reduce bus bandwidth in GB/s by group size (data-parallel gradient sync)."""
    all_to_all_latency_ms: dict = field(default_factory=dict, metadata={"from_json": _latency_table})
    """Fixed time of one all-to-all call by group size (ms), fitted with the bandwidth from several
    message sizes; empty: no latency term (the reference profiles publish none)."""
    p2p_latency_ms: dict = field(default_factory=dict, metadata={"from_json": _latency_table})
    """Fixed time of one ring step (send to the next rank, receive from the previous) by ring size (ms)."""
    allreduce_latency_ms: dict = field(default_factory=dict, metadata={"from_json": _latency_table})
    """Fixed time of one all-reduce call by group size (ms)."""
    sp_token_ms: dict = field(default_factory=dict, metadata={"from_json": _latency_table})
    """Measured extra time per token and layer of a Ulysses group of size d (ms per token of the
    group's sequences), beyond its compute and all-to-all bytes: the layout work that grows with the
    tokens (gathers, copies, waits that lengthen with the work between meetings); empty: none."""
    sp_overhead_ms: dict = field(default_factory=dict, metadata={"from_json": _latency_table})
    """Measured extra fixed time per layer of one Ulysses group of size d in one micro-step (ms),
    beyond its compute and its all-to-all bytes and latency: the runtime's layout work (slicing,
    packing, index gathers, KV repeats) and the waits of ranks that must meet every layer. Fitted
    from real micro-steps of each group size; empty: none."""
    cp_token_ms: dict = field(default_factory=dict, metadata={"from_json": _latency_table})
    """Measured extra time per token and layer of context parallelism over c ranks (ms per token of
    the group's sequences, for a 1 x c split; a u x c split's share scales with its K/V heads per
    rank), beyond its compute and its all-gather / reduce-scatter bytes: the K/V selection, its
    scatter-add in the backward, and bottom-right-masked attention where the kernel is slower with
    it. Empty: none."""
    cp_overhead_ms: dict = field(default_factory=dict, metadata={"from_json": _latency_table})
    """Measured extra fixed time per layer of one context-parallel sub-group of size c in one
    micro-step (ms), beyond its compute and its collectives' bytes and latency: the CP layout work
    and the waits of ranks that meet at every layer's all-gather. Empty: none."""
    cp_attention_factor: dict = field(default_factory=dict, metadata={"from_json": _latency_table})
    """Measured extra attention time of context parallelism over c ranks, as a fraction of a rank's
    causal share of the attention (the compute curves' quadratic term ``a * s^2``, which a rank of a
    degree-d group computes ``1/d`` of): each sequence of a ``u x c`` split adds ``factor[c] *
    quadratic(s) / d``. Each CP chunk's queries attend to a prefix of keys, bottom-right aligned; where
    the kernel runs that with an explicit mask (SDPA on CPU) it computes the whole rectangle, not the
    causal triangle, so the excess grows with the square of the length (GPU flash / varlen kernels
    skip the masked blocks: near 0). Fitted on ``1 x c`` groups; a ``u x c`` rank runs the same
    rectangles over its ``H/u`` heads, so the same fraction of its own (``1/d``) attention. Empty: none."""
    split_overhead_ms: dict = field(default_factory=dict, metadata={"from_json": _split_table})
    """Measured extra fixed time per layer of one group of a composite split ``u x c`` (u > 1 and
    c > 1) in one micro-step (ms), keyed by the split (``"2x2"``), beyond the sum of its parts (its
    compute and collectives, the Ulysses extras at u and the CP extras at c): what running two
    different sub-group collectives per layer costs on top of each alone (a rank meets its Ulysses
    partners, then its CP partners, and waits for the slowest of both). A residual, fitted from real
    ``u x c`` micro-steps; it applies to exactly that split (none for a split without an entry).
    Empty: none (reference and GPU profiles)."""
    split_token_ms: dict = field(default_factory=dict, metadata={"from_json": _split_table})
    """The same residual's part per token and layer (ms per token of the group's sequences), keyed by
    the split. Empty: none."""
    allgather_gbps: dict = field(default_factory=dict, metadata={"from_json": _bw_table})
    """All-gather bus bandwidth in GB/s by group size (FSDP's parameter all-gather under ZeRO-3 over
    the world, context parallelism's K/V all-gather over its sub-groups: each rank receives (n-1)/n
    of the bytes); empty: estimated from ``allreduce_gbps``."""
    reduce_scatter_gbps: dict = field(default_factory=dict, metadata={"from_json": _bw_table})
    """Reduce-scatter bus bandwidth in GB/s by group size (FSDP's gradient reduce-scatter under ZeRO-3);
    empty: estimated from ``allreduce_gbps``."""
    allgather_latency_ms: dict = field(default_factory=dict, metadata={"from_json": _latency_table})
    """Fixed time of one all-gather call by group size (ms)."""
    reduce_scatter_latency_ms: dict = field(default_factory=dict, metadata={"from_json": _latency_table})
    """Fixed time of one reduce-scatter call by group size (ms)."""
    pass_overhead_ms: dict = field(default_factory=dict, metadata={"from_json": _latency_table})
    """Measured fixed time of one lockstep pass by world size (ms): what a ZeRO-3 forward and backward
    costs every rank beyond its groups' work and the exposed all-gather / reduce-scatter (FSDP's
    hooks, the empty pass of an idle rank); empty: none."""
    pass_compute_factor: dict = field(default_factory=dict, metadata={"from_json": _latency_table})
    """How much longer a rank's work takes inside a lockstep (ZeRO-3) pass than the same work in a
    free micro-step, by world size (1.15: 15% longer): every FSDP unit's all-gather and
    reduce-scatter meets all ranks, so a pass waits for the slowest rank at each of them, and the
    collectives' buffers share the caches (on GPUs, the SMs) with the compute. Fitted from real
    passes at several loads; empty: 1."""
    activation_mb_per_token: float | None = None
    """Activation memory of the whole ``model`` per token in MB (1e6 bytes), measured; None to
    estimate it from the model's shape."""
    head_ms_per_token: float | None = None
    """Forward and backward time per token of what is not a transformer block (the embedding, the
    final norm, the output head and the loss) on ``model`` (ms), measured from real steps; None: the
    compute curves include it (the published whole-model fits do) or it was not measured."""
    micro_step_ms: float | None = None
    """Fixed time of one micro-step outside the layers (ms): the Python of a forward and backward,
    building the shard, the loss's reduction; paid once per group in free execution and once per
    rank and pass in lockstep. None: not measured."""
    optimizer_ms_per_mparam: float | None = None
    """Time of the optimizer step per million parameters a rank updates (ms), measured with the
    profiled optimizer on plain tensors (ZeRO 0-2: whole replicas, or ZeroRedundancyOptimizer's
    partition); None: not measured."""
    sharded_optimizer_ms_per_mparam: float | None = None
    """The same under ZeRO-3, where the optimizer updates FSDP2's sharded parameters (DTensors,
    whose per-tensor dispatch costs more than the arithmetic of a small shard); None: use
    ``optimizer_ms_per_mparam``."""
    pass_comm_overlap: float | None = None
    """Share (0 to 1) of FSDP's all-gathers and reduce-scatters in a lockstep pass that runs under
    the compute: 1 where FSDP2 prefetches on its own CUDA streams; 0 on CPU, where it runs them on
    the compute thread in the order they are needed (a pass then costs compute plus all of them).
    None: 1, the published (FlexSP) model."""
    gpu_memory_gb: float = 40.0
    """Memory of the profiled GPU (GB)."""
    gpus_per_node: int | None = None
    """GPUs per node of the machines measured: entries of the bandwidth tables for larger groups were
    measured across nodes (FlexSP's 8 x 8 A100: all-to-all within a node up to 8, over InfiniBand
    from 16). None: one node, or not known (every entry is taken for every group)."""
    inter_node_all_to_all_gbps: dict = field(default_factory=dict, metadata={"from_json": _bw_table})
    """All-to-all bandwidth per GPU (GB/s) of groups that span nodes, by group size; empty: the
    entries of ``all_to_all_gbps`` above ``gpus_per_node``."""
    inter_node_p2p_gbps: dict = field(default_factory=dict, metadata={"from_json": _bw_table})
    """Point-to-point bandwidth (GB/s) of rings that span nodes, by ring size; empty: the entries of
    ``p2p_gbps`` above ``gpus_per_node``."""
    inter_node_allreduce_gbps: dict = field(default_factory=dict, metadata={"from_json": _bw_table})
    """Bus bandwidth (GB/s) of all-reduce, all-gather and reduce-scatter over ranks of several
    nodes, by group size; empty: the entries of each table above ``gpus_per_node``."""
    host_link_gbps: float | None = None
    """Pinned host-device copy bandwidth of one GPU copying alone (GB/s, the slower of the two
    directions): what offloaded activations move over (``workbench.cost.offload``). None: unknown,
    so plans do not offload."""
    host_link_node_gbps: float | None = None
    """The same for all of a node's GPUs copying at once, in total (GB/s): the host side (root
    complex, memory channels) they share. None: each GPU gets ``host_link_gbps``."""
    host_memory_gb: float | None = None
    """Host memory of one node (GB), where offloaded activations live. None: unknown (a cluster may
    give it: ``ClusterSpec.host_memory_gb``)."""
    memory_fraction: float | None = None
    """The share of GPU memory plans fill by default on this device, from how well the memory model
    predicted measured peaks here (0.9 where it was within a few percent); None: 0.7 (FlexSP's 28 of
    40 GB, kept for its published setting)."""
    provenance: dict = field(default_factory=dict)
    """Where the figures come from: ``{"kind": "measured"|"reference"|"estimate", "source": ..., ...}``."""

    def __post_init__(self) -> None:
        _require(isinstance(self.name, str) and self.name, "HardwareProfile.name must be a non-empty string")
        object.__setattr__(self, "forward", _curve(self.forward))
        object.__setattr__(self, "backward", _curve(self.backward))
        for n in ("all_to_all_gbps", "p2p_gbps", "allreduce_gbps", "allgather_gbps", "reduce_scatter_gbps",
                  "inter_node_all_to_all_gbps", "inter_node_p2p_gbps", "inter_node_allreduce_gbps"):
            object.__setattr__(self, n, _bw_table(getattr(self, n)))
        _require(self.gpus_per_node is None or (isinstance(self.gpus_per_node, int) and not isinstance(
            self.gpus_per_node, bool) and self.gpus_per_node >= 1),
                 f"HardwareProfile {self.name}: gpus_per_node must be a positive integer or null, got {self.gpus_per_node!r}")
        for n in ("all_to_all_latency_ms", "p2p_latency_ms", "allreduce_latency_ms", "sp_overhead_ms", "sp_token_ms",
                  "cp_overhead_ms", "cp_token_ms", "cp_attention_factor", "allgather_latency_ms", "reduce_scatter_latency_ms",
                  "pass_overhead_ms", "pass_compute_factor"):
            object.__setattr__(self, n, _latency_table(getattr(self, n)))
        for n in ("split_overhead_ms", "split_token_ms"):
            try:
                object.__setattr__(self, n, _split_table(getattr(self, n)))
            except ValueError as e:
                raise ValueError(f"HardwareProfile {self.name}: {n}: {e}") from None
        _require(bool(self.all_to_all_gbps), f"HardwareProfile {self.name}: all_to_all_gbps is empty; "
                                             f"give at least one {{group size: GB/s}} entry")
        if self.activation_mb_per_token is not None:
            _require(self.activation_mb_per_token > 0,
                     f"HardwareProfile {self.name}: activation_mb_per_token must be > 0 or null")
        for n in ("head_ms_per_token", "micro_step_ms", "optimizer_ms_per_mparam", "sharded_optimizer_ms_per_mparam",
                  "pass_comm_overlap", "host_link_gbps", "host_link_node_gbps", "host_memory_gb"):
            v = getattr(self, n)
            _require(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0),
                     f"HardwareProfile {self.name}: {n} must be a finite number >= 0 or null, got {v!r}")
        _require(self.pass_comm_overlap is None or self.pass_comm_overlap <= 1,
                 f"HardwareProfile {self.name}: pass_comm_overlap is a share from 0 to 1, got {self.pass_comm_overlap!r}")
        _require(self.gpu_memory_gb > 0, f"HardwareProfile {self.name}: gpu_memory_gb must be > 0")
        _require(self.memory_fraction is None or (isinstance(self.memory_fraction, (int, float)) and 0 < self.memory_fraction <= 1),
                 f"HardwareProfile {self.name}: memory_fraction is a share in (0, 1] or null, got {self.memory_fraction!r}")
        kind = self.provenance.get("kind") if isinstance(self.provenance, Mapping) else None
        _require(kind in ("measured", "reference", "estimate"),
                 f"HardwareProfile {self.name}: provenance.kind must be 'measured', 'reference' or 'estimate', "
                 f"got {kind!r}; say where the figures come from")

    @property
    def is_estimate(self) -> bool:
        return self.provenance.get("kind") == "estimate"

    def save(self, path: str | Path) -> Path:
        """Write the profile as JSON (atomically) and return the path."""
        from workbench.util import write_json_atomic

        return write_json_atomic(path, self.to_dict())


_PROFILE_PACKAGE = "workbench.profile"


def list_profiles() -> list[str]:
    """Names of the shipped reference profiles."""
    root = resources.files(_PROFILE_PACKAGE) / "reference"
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".json"))


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """Load a shipped profile by name or a profile JSON file by path.

    Raises ValueError when neither exists or the file is not a valid profile (naming the file).
    """
    p = Path(name_or_path)
    if not str(name_or_path).strip():
        raise ValueError(f"empty profile name; shipped profiles are {', '.join(list_profiles())}")
    if p.suffix == ".json" or p.exists():
        if not p.exists():
            raise ValueError(f"profile file {p} does not exist; shipped profiles are {', '.join(list_profiles())}")
        if p.is_dir():
            cand = p / "profile.json"
            if not cand.is_file():
                raise ValueError(f"profile path {p} is a folder, not a profile JSON file; give the file "
                                 f"(a profile run keeps it as <run>/profile.json)")
            p = cand
        try:
            text = p.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"profile file {p} cannot be read ({getattr(e, 'strerror', None) or e})") from None
        where = str(p)
    else:
        res = resources.files(_PROFILE_PACKAGE) / "reference" / f"{name_or_path}.json"
        if not res.is_file():
            raise ValueError(
                f"unknown profile {str(name_or_path)!r}: not a file and not a shipped profile "
                f"({', '.join(list_profiles())}); run `workbench profile --out PATH` to measure one"
            )
        text = res.read_text()
        where = f"shipped profile {name_or_path}"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e})") from None
    try:
        return HardwareProfile.from_dict(data)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def spec_from_dict(kind: str, data: Mapping[str, Any]):
    """Build a ``model``, ``cluster`` or ``profile`` spec from a dict."""
    cls = {"model": ModelSpec, "cluster": ClusterSpec, "profile": HardwareProfile}.get(kind)
    if cls is None:
        raise ValueError(f"unknown spec kind {kind!r}; expected model, cluster or profile")
    return cls.from_dict(data)
