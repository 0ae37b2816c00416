"""``spec.json`` of a training run: everything needed to repeat it, validated, plain JSON.

The launcher writes it (atomically) before starting torchrun; every rank of the trainer reads it.
Pure Python: no torch, no I/O besides reading and writing the one file.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

__all__ = ["TrainSpec", "SpecError", "OPTIMIZERS", "DEVICES", "ATTENTION", "DEFAULT_LR", "SPEC_FILE", "read_spec",
           "CPU_MAX_LEN", "DEFAULT_BATCH_TOKENS"]

SPEC_FILE = "spec.json"
OPTIMIZERS = ("sgd", "adamw")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION = ("auto", "flash", "torch")
POLICIES = ("clip", "split", "drop", "error")
DEFAULT_LR = {"sgd": 0.05, "adamw": 1e-3}
"""Learning rate when none is given, per optimizer."""
CPU_MAX_LEN = 1024
"""Max context on CPU when ``max_len`` is left to the trainer (attention is quadratic; a CPU
step over 16K-token sequences takes minutes)."""
DEFAULT_BATCH_TOKENS = 16384
"""Global batch token budget when neither ``batch_size`` nor ``batch_tokens`` is given."""


class SpecError(ValueError):
    """A missing or invalid ``spec.json`` (the message says which field and why)."""


def _req(cond: bool, msg: str) -> None:
    if not cond:
        raise SpecError(msg)


def _int(name: str, v: Any, lo: int | None = None, optional: bool = False) -> None:
    if v is None and optional:
        return
    _req(isinstance(v, int) and not isinstance(v, bool), f"spec.{name} must be an integer, got {v!r}")
    if lo is not None:
        _req(v >= lo, f"spec.{name} must be >= {lo}, got {v}")


def _num(name: str, v: Any, lo: float | None = None, optional: bool = False, strict: bool = False) -> None:
    if v is None and optional:
        return
    _req(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
         f"spec.{name} must be a finite number, got {v!r}")
    if lo is not None:
        _req(v > lo if strict else v >= lo, f"spec.{name} must be {'>' if strict else '>='} {lo}, got {v}")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainSpec:
    """One training run. Every field is plain JSON; ``None`` means "the trainer decides" (the
    decision is written to ``status.json`` under ``resolved``)."""

    steps: int
    """Optimizer steps to take in total (a resumed run continues up to this many)."""
    model: str = "tiny"
    """Model preset (``workbench.specs.MODEL_PRESETS``)."""
    lengths: str = "stdlib"
    """Length source: ``stdlib`` (the embedded corpus: each sequence is one document's bytes), a
    family name, a file, or a comma-separated list (the whole batch, every step). Token ids of
    non-corpus sources are windows of the stdlib byte stream, deterministic from the seed."""
    samples: int | None = None
    """Sequences to generate from a family or draw from the corpus or a file (None: the source's
    default: a family 100,000, the corpus and files all)."""
    column: str | None = None
    """Column of a CSV/Parquet/JSONL file holding lengths or text."""
    max_len: int | None = None
    """Max context (tokens) the max-context policy applies; None: min(model max context, 1024) on
    CPU, the largest power of two the cluster holds on CUDA."""
    policy: str = "clip"
    """What to do with longer sequences: clip, split, drop, error."""
    planner: str = "greedy"
    """Planner name (``workbench.solve.planner_names()``)."""
    seed: int = 0
    """Seeds the model's initial weights, the batches and the planner."""
    optimizer: str = "adamw"
    """``sgd`` or ``adamw``."""
    lr: float | None = None
    """Learning rate (None: 0.05 for SGD, 1e-3 for AdamW)."""
    weight_decay: float = 0.0
    momentum: float = 0.0
    """SGD momentum."""
    grad_clip: float = 0.0
    """Clip the global gradient norm to this (0: no clipping)."""
    batch_size: int | None = None
    """Sequences per global batch (exclusive with ``batch_tokens``)."""
    batch_tokens: int | None = None
    """Token budget per global batch (default 16,384 when neither is given; an explicit list
    source is the batch itself)."""
    checkpoint_every: int = 100
    """Save ``checkpoints/step_<n>.pt`` every this many steps and after the last (0: never)."""
    profile: str | None = None
    """Hardware profile name or JSON path for the cost model (None: ``cpu-gloo-tiny`` on CPU,
    ``a100-40g-flexsp`` on CUDA)."""
    gpu_memory_gb: float | None = None
    """Memory per device for the cost model (None: the profile's)."""
    attention: str = "auto"
    """Attention backend: auto, flash, torch."""
    device: str = "auto"
    """auto (CUDA when available), cpu or cuda. gloo on CPU, NCCL on CUDA."""
    time_limit: float = 1.0
    """Planner time limit per step (s)."""
    plan_ahead: bool = True
    """Plan step k+1 on rank 0 while step k runs (when ``workbench.solve.ahead`` exists)."""
    timeout_s: float = 600.0
    """Process-group timeout: a collective that waits longer fails instead of hanging."""
    nproc: int = 1
    """Processes per node the run was launched with (informational: the trainer uses the world
    torchrun gives it)."""
    nnodes: int = 1
    run_id: str = ""
    debug: dict = field(default_factory=dict)
    """Test hooks: ``plan_num_gpus`` (rank 0 plans for that many ranks), ``step_sleep_s``."""
    kind: str = "train"

    def __post_init__(self) -> None:
        _int("steps", self.steps, 1)
        for n in ("model", "lengths", "planner", "policy", "optimizer", "attention", "device"):
            _req(isinstance(getattr(self, n), str) and getattr(self, n).strip() != "",
                 f"spec.{n} must be a non-empty string, got {getattr(self, n)!r}")
        _req(self.kind == "train", f"spec.kind must be 'train', got {self.kind!r} (not a training run's spec.json)")
        _int("samples", self.samples, 1, optional=True)
        _int("max_len", self.max_len, 1, optional=True)
        _req(self.policy in POLICIES, f"spec.policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        _int("seed", self.seed, 0)
        _req(self.optimizer in OPTIMIZERS,
             f"spec.optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        _num("lr", self.lr, 0.0, optional=True, strict=True)
        _num("weight_decay", self.weight_decay, 0.0)
        _num("momentum", self.momentum, 0.0)
        _num("grad_clip", self.grad_clip, 0.0)
        _int("batch_size", self.batch_size, 1, optional=True)
        _int("batch_tokens", self.batch_tokens, 1, optional=True)
        _req(self.batch_size is None or self.batch_tokens is None,
             "give batch_size or batch_tokens, not both")
        _int("checkpoint_every", self.checkpoint_every, 0)
        _num("gpu_memory_gb", self.gpu_memory_gb, 0.0, optional=True, strict=True)
        _req(self.attention in ATTENTION, f"spec.attention must be one of {', '.join(ATTENTION)}, got {self.attention!r}")
        _req(self.device in DEVICES, f"spec.device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        _num("time_limit", self.time_limit, 0.0, strict=True)
        _req(isinstance(self.plan_ahead, bool), f"spec.plan_ahead must be true or false, got {self.plan_ahead!r}")
        _num("timeout_s", self.timeout_s, 0.0, strict=True)
        _int("nproc", self.nproc, 1)
        _int("nnodes", self.nnodes, 1)
        _req(isinstance(self.debug, Mapping), f"spec.debug must be an object, got {self.debug!r}")

    @property
    def learning_rate(self) -> float:
        """``lr``, or the optimizer's default."""
        return float(self.lr) if self.lr is not None else DEFAULT_LR[self.optimizer]

    def to_dict(self) -> dict:
        """Plain dict of every field."""
        return {f.name: (dict(getattr(self, f.name)) if f.name == "debug" else getattr(self, f.name))
                for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TrainSpec":
        """Build from a dict; raises SpecError naming unknown or missing fields."""
        if not isinstance(data, Mapping):
            raise SpecError(f"spec.json must hold a JSON object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        _req(not unknown, f"spec.json has unknown field(s) {unknown}; known fields are {sorted(names)}")
        _req("steps" in data, "spec.json has no 'steps' field")
        return cls(**dict(data))

    def replace(self, **changes) -> "TrainSpec":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)


def read_spec(run_dir: str | Path) -> TrainSpec:
    """Read and validate ``run_dir/spec.json``. Raises SpecError when the folder or the file is
    missing, the file is not JSON, or a field is invalid."""
    run_dir = Path(run_dir)
    path = run_dir / SPEC_FILE
    if not run_dir.is_dir():
        raise SpecError(f"run folder {run_dir} does not exist")
    if not path.is_file():
        raise SpecError(f"{path} is missing; start runs with `workbench train` or "
                        f"workbench.launch.torchrun.prepare_run, which write it")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SpecError(f"{path} is not valid JSON ({e})") from None
    except OSError as e:
        raise SpecError(f"{path} cannot be read ({e.strerror or e})") from None
    try:
        return TrainSpec.from_dict(data)
    except SpecError as e:
        raise SpecError(f"{path}: {e}") from None
    except TypeError as e:
        raise SpecError(f"{path}: {e}") from None
