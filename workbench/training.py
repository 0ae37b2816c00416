"""A training run's settings (``spec.json``), preparing and resuming runs, and resource checks.

``spec.json`` of a training run is ``{"kind": "train", "scenario": {...}, <TrainSpec fields>}``:
the :class:`~workbench.scenario.Scenario` (model, profile, cluster, data, batch, planner) and the
run's own settings (steps, optimizer, processes, checkpoints). :func:`prepare_train` makes a new
run or checks a resume against the run's spec; :func:`check_resources` says whether the machine
can hold it; :func:`emit_cluster` writes the commands that run a new run on several nodes (the
scripts of :mod:`workbench.launch.cluster`). The trainer (``workbench.runtime.train``, torch)
reads the spec with :func:`read_train_spec`. Pure Python: no torch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from workbench import runs
from workbench.scenario import Scenario

__all__ = ["TrainSpec", "SpecError", "read_train_spec", "prepare_train", "ResumeChange", "check_resources",
           "ResourceError", "cuda_visible", "OPTIMIZERS", "DEVICES", "ATTENTION", "DEFAULT_LR", "CPU_MAX_LEN",
           "DEFAULT_BATCH_TOKENS", "TRAIN_DEFAULTS", "RANK_MEMORY_GB", "check_model_and_data", "check_machine",
           "flash_installed", "JOIN_WAIT_S", "resource_args", "emit_cluster", "TRAIN_FIELDS",
           "SCENARIO_FIELDS"]

OPTIMIZERS = ("sgd", "adamw")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION = ("auto", "varlen", "flash", "torch")
DEFAULT_LR = {"sgd": 0.05, "adamw": 1e-3}
CPU_MAX_LEN = 1024
"""Max context on CPU when none is given (attention is quadratic: a CPU step over 16K-token
sequences takes minutes). With policy ``split`` no token is lost."""
DEFAULT_BATCH_TOKENS = 16384
TRAIN_DEFAULTS = dict(model="tiny", source="stdlib", planner="greedy", policy="split", batch_tokens=DEFAULT_BATCH_TOKENS)
"""Scenario settings a training run gets when they are not given (differ from planning's)."""
RANK_MEMORY_GB = 0.45
"""Resident memory of one CPU trainer rank of the tiny model (torch, gloo, data), measured
~0.35 GB; rank 0's plan-ahead worker ~0.25 GB more."""
MAX_PROCS_PER_CORE = 4
"""Above this many processes per core a CPU run is refused unless asked for."""
JOIN_WAIT_S = 30.0
"""How long a node joining a run over several nodes waits for the node that made its folder to write
its spec."""


class SpecError(ValueError):
    """A missing or invalid ``spec.json`` (the message says which field and why)."""


class ResourceError(ValueError):
    """The machine cannot hold the run as asked (too many processes for its cores or memory)."""


def _req(cond: bool, msg: str) -> None:
    if not cond:
        raise SpecError(msg)


def _int(name: str, v: Any, lo: int) -> None:
    _req(isinstance(v, int) and not isinstance(v, bool) and v >= lo, f"{name} must be an integer >= {lo}, got {v!r}")


def _num(name: str, v: Any, lo: float, strict: bool = False, optional: bool = False) -> None:
    if v is None and optional:
        return
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (v > lo if strict else v >= lo)
    _req(ok, f"{name} must be a finite number {'>' if strict else '>='} {lo:g}, got {v!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainSpec:
    """One training run: the scenario it plans and the run's own settings."""

    scenario: Scenario
    """Model, profile, cluster (``num_gpus`` = world size), data, batch, planner, seed."""
    steps: int
    """Optimizer steps in total (a resumed run goes on up to this many)."""
    optimizer: str = "adamw"
    lr: float | None = None
    """Learning rate (None: 0.05 for SGD, 1e-3 for AdamW)."""
    weight_decay: float = 0.0
    momentum: float = 0.0
    grad_clip: float = 0.0
    """Clip the global gradient norm to this (0: off)."""
    checkpoint_every: int = 100
    """Save ``checkpoints/step_<n>.pt`` (with its checksum) every this many steps and after the last (0: never)."""
    attention: str = "auto"
    device: str = "auto"
    plan_ahead: bool = True
    """Plan step k+1 in a worker process while step k trains."""
    timeout_s: float = 600.0
    """Collective timeout: a rank waiting longer fails instead of hanging."""
    nproc: int = 1
    """Processes per node."""
    nnodes: int = 1
    debug: dict = field(default_factory=dict)
    """Test hooks: ``plan_num_gpus`` (rank 0 plans for that many ranks), ``plan_zero_stage`` (rank 0 plans
    for that ZeRO stage), ``step_sleep_s``."""
    init: str | None = None
    """Safetensors checkpoint the weights start from (a file, or a Hugging Face model folder, sharded
    or not), checked strictly against the model; None: random weights from the seed. A resumed run
    starts from its own checkpoint instead."""
    torch_profile: int | None = None
    """Record this step (1-based) with ``torch.profiler`` on every rank: a Chrome trace per rank in the
    run folder (``runs.torch_trace_path``); None: never. Changing it on resume changes no plan."""

    def __post_init__(self) -> None:
        _req(isinstance(self.scenario, Scenario), f"scenario must be a Scenario, got {type(self.scenario).__name__}")
        _int("steps", self.steps, 1)
        _req(self.optimizer in OPTIMIZERS, f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        _num("lr", self.lr, 0.0, strict=True, optional=True)
        _num("weight_decay", self.weight_decay, 0.0)
        _num("momentum", self.momentum, 0.0)
        _num("grad_clip", self.grad_clip, 0.0)
        _int("checkpoint_every", self.checkpoint_every, 0)
        _req(self.attention in ATTENTION, f"attention must be one of {', '.join(ATTENTION)}, got {self.attention!r}")
        _req(self.device in DEVICES, f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        _req(isinstance(self.plan_ahead, bool), f"plan_ahead must be true or false, got {self.plan_ahead!r}")
        _num("timeout_s", self.timeout_s, 0.0, strict=True)
        _int("nproc", self.nproc, 1)
        _int("nnodes", self.nnodes, 1)
        _req(isinstance(self.debug, Mapping), f"debug must be an object, got {self.debug!r}")
        _req(self.init is None or (isinstance(self.init, str) and self.init.strip() != ""),
             f"init must be a path (a safetensors file or a model folder) or null, got {self.init!r}")
        _req(self.torch_profile is None or (isinstance(self.torch_profile, int) and not isinstance(self.torch_profile, bool)
                                            and 1 <= self.torch_profile <= self.steps),
             f"torch_profile (--torch-profile) must be a step from 1 to steps ({self.steps}), got {self.torch_profile!r}")
        _req(self.scenario.num_gpus == self.nproc * self.nnodes,
             f"scenario.num_gpus ({self.scenario.num_gpus}) must equal nproc x nnodes ({self.nproc} x {self.nnodes})")
        # the memory model counts the optimizer the run trains with: the scenario follows the spec
        from workbench.cost.memory import optimizer_kind

        kind = optimizer_kind(self.optimizer, self.momentum)
        if self.scenario.optimizer != kind:
            object.__setattr__(self, "scenario", self.scenario.replace(optimizer=kind))

    @property
    def learning_rate(self) -> float:
        """``lr``, or the optimizer's default."""
        return float(self.lr) if self.lr is not None else DEFAULT_LR[self.optimizer]

    def to_dict(self) -> dict:
        """``spec.json``'s object: ``{"kind": "train", "scenario": {...}, ...}``."""
        out = {"kind": "train"}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = v.to_dict() if f.name == "scenario" else (dict(v) if f.name == "debug" else v)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TrainSpec":
        """Build from ``spec.json``'s object. Raises SpecError naming an unknown, missing or invalid field."""
        if not isinstance(data, Mapping):
            raise SpecError(f"spec.json must hold a JSON object, got {type(data).__name__}")
        kind = data.get("kind", "train")
        _req(kind == "train", f"spec.json is of a {kind!r} run, not a training run")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names - {"kind"})
        _req(not unknown, f"spec.json has unknown field(s) {unknown}; known fields are {sorted(names)}")
        _req("steps" in data, "spec.json has no 'steps' field")
        _req("scenario" in data, "spec.json has no 'scenario' field (written by an older workbench? start a new run)")
        kw = {k: v for k, v in data.items() if k != "kind"}
        try:
            kw["scenario"] = Scenario.from_dict(kw["scenario"], stored=True)
            return cls(**kw)
        except SpecError:
            raise
        except (TypeError, ValueError) as e:
            raise SpecError(str(e)) from None

    def replace(self, **changes) -> "TrainSpec":
        """A copy with ``changes`` (TrainSpec fields, or Scenario fields, which go to the scenario)."""
        own = {f.name for f in dataclasses.fields(self)}
        sc = {k: v for k, v in changes.items() if k not in own}
        mine = {k: v for k, v in changes.items() if k in own}
        if sc:
            mine["scenario"] = mine.get("scenario", self.scenario).replace(**sc)
        try:
            return dataclasses.replace(self, **mine)
        except TypeError as e:
            raise SpecError(str(e)) from None


def read_train_spec(run_dir: str | Path) -> TrainSpec:
    """Read and validate ``run_dir/spec.json``. Raises SpecError when the folder or file is
    missing, not JSON, or a field is invalid (naming the file)."""
    run_dir = Path(run_dir)
    path = run_dir / runs.SPEC_FILE
    if not run_dir.is_dir():
        raise SpecError(f"run folder {run_dir} does not exist")
    if not path.is_file():
        raise SpecError(f"{path} is missing; start training runs with `workbench train` (or workbench.training.prepare_train)")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise SpecError(f"{path} is not valid JSON ({e})") from None
    except OSError as e:
        raise SpecError(f"{path} cannot be read ({e.strerror or e})") from None
    try:
        return TrainSpec.from_dict(data)
    except SpecError as e:
        raise SpecError(f"{path}: {e}") from None


# ------------------------------------------------------------------------------------------------
# preparing and resuming
# ------------------------------------------------------------------------------------------------


def cuda_visible() -> bool:
    """Whether this machine shows an NVIDIA GPU, found without importing torch (the kernel that
    launches must not initialise CUDA)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    if Path("/proc/driver/nvidia/gpus").is_dir() and any(Path("/proc/driver/nvidia/gpus").iterdir()):
        return True
    exe = shutil.which("nvidia-smi")
    if not exe:
        return False
    try:
        return subprocess.run([exe, "-L"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


TRAIN_FIELDS = frozenset(f.name for f in dataclasses.fields(TrainSpec)) - {"scenario"}
"""The run's own settings ``prepare_train`` takes (TrainSpec's fields but its scenario)."""
SCENARIO_FIELDS = frozenset(f.name for f in dataclasses.fields(Scenario))
"""The Scenario's settings ``prepare_train`` takes (the Launch panel passes on any it has no control for)."""


@dataclass(frozen=True)
class ResumeChange:
    """A setting given on resume that differs from the run's spec."""

    name: str
    was: Any
    now: Any

    def describe(self) -> str:
        return f"{self.name}: {self.was!r} in the run, {self.now!r} given"


def prepare_train(settings: Mapping[str, Any] | None = None, *, scenario: Scenario | None = None,
                  run_dir: str | Path | None = None, root: str | Path | None = None, name: str | None = None,
                  allow_changes: bool = False, join: bool = False, dry_run: bool = False,
                  on_gpu: bool | None = None) -> tuple[runs.Run | None, TrainSpec, list[ResumeChange]]:
    """Make a new training run, or check a resume. Returns ``(run, spec, changes)``.

    New run (``run_dir`` None): ``settings`` are TrainSpec fields (``steps`` required) and Scenario
    fields; ``scenario`` (e.g. from a panel) is the base they apply to, else the training defaults
    (:data:`TRAIN_DEFAULTS`). The world is ``nproc x nnodes``; the profile defaults, on CPU, to this
    machine's cached quick profile for the world size when the store holds one, else
    ``cpu-gloo-tiny``, and to ``a100-40g-flexsp`` with CUDA; the max context to 1,024 (policy
    split: every token kept) on CPU; the precision to bf16 with CUDA and fp32 on CPU; the ZeRO stage
    is the scenario's (3 unless given), and the scenario's optimizer follows ``optimizer`` and
    ``momentum``. The folder is ``root/name`` (or a fresh id); nothing is written
    before every setting checks out.

    Resume (``run_dir`` given): the folder must hold a training run. The spec is the run's;
    ``settings`` may raise ``steps``; any other setting that differs is refused (ValueError listing
    them) unless ``allow_changes`` is True, then applied and returned in ``changes``. Settings equal
    to the run's are fine. Nothing is written here for a resume (the launcher records the attempt).

    A node of a run over several nodes (``join``): when ``root/name`` exists it is joined, provided it
    holds a run that has not ended and whose spec is the one these settings make (else one line
    naming what differs); when it does not exist it is made (whichever node comes first).
    ``dry_run``: check and return the spec, write nothing (``run`` is None); ``on_gpu`` resolves
    the defaults for a machine with (True) or without (False) CUDA instead of this one (cluster
    scripts written on a login node) and skips the checks of this machine.

    Raises ValueError (SpecError) with one clear line for bad settings, a missing or foreign run
    folder, or a path that is a file; for ``--device cuda`` on a machine without an NVIDIA GPU, and
    for ``--attention flash`` where flash-attn cannot run (``check_machine``).
    """
    settings = {k: v for k, v in dict(settings or {}).items() if v is not None}
    unknown = sorted(set(settings) - TRAIN_FIELDS - SCENARIO_FIELDS)
    if unknown:
        raise SpecError(f"unknown training setting(s) {unknown}")
    settings = _absolute_paths(settings)
    if run_dir is not None:
        return _resume(run_dir, settings, allow_changes)
    if "steps" not in settings:
        raise SpecError("steps is required for a new run (--steps K)")
    train = {k: v for k, v in settings.items() if k in TRAIN_FIELDS}
    scen = {k: v for k, v in settings.items() if k in SCENARIO_FIELDS}
    nproc, nnodes = int(train.get("nproc", 1)), int(train.get("nnodes", 1))
    device = train.get("device", "auto")
    here = on_gpu is None
    if on_gpu is None:
        on_gpu = device == "cuda" or (device == "auto" and cuda_visible())
    base = scenario.to_dict() if scenario is not None else dict(TRAIN_DEFAULTS)
    if scenario is None and "profile" not in scen:
        # this machine's cached profile is one machine's: not for a run over several nodes, nor for a
        # script written for another machine
        base["profile"] = ("a100-40g-flexsp" if on_gpu else
                           _cpu_profile(nproc, root) if here and nnodes == 1 else "cpu-gloo-tiny")
    if "gpus_per_node" not in scen:
        base["gpus_per_node"] = nproc
    base.update(scen)
    base["num_gpus"] = nproc * nnodes
    sc = Scenario.from_dict(base)
    if sc.max_len is None and not on_gpu:
        sc = sc.replace(max_len=min(CPU_MAX_LEN, sc.model_spec().max_context))
    if sc.precision is None:  # resolved now, so spec.json says what the run computes in and plans assume
        sc = sc.replace(precision="bf16" if on_gpu else "fp32")
    spec = TrainSpec(scenario=sc, **train)
    cost = sc.cost()  # a cluster or profile that cannot work fails here, before a folder exists
    max_len = sc.resolved_max_len()
    if max_len is not None and cost.min_degree([max_len])[0] == 0:
        # a sequence of the max context could come in any step: refuse now, not at that step
        why = cost.infeasible_message(-1, int(max_len)).replace("sequence -1 ", "the max context ")
        raise SpecError(f"{why} (or lower --max-len)" if "--max-len" not in why else why)
    check_model_and_data(spec)
    if here:
        check_machine(spec)
    if dry_run:
        return None, spec, []
    body = {k: v for k, v in spec.to_dict().items() if k != "kind"}
    if join:
        return _join(spec, body, root, name), spec, []
    run = runs.new_run("train", body, root=root, run_id=name)
    return run, spec, []


def _join(spec: TrainSpec, body: dict, root, name: str | None) -> runs.Run:
    """Make ``root/name`` with ``spec``, or join it when another node made it (the same spec, not
    ended). Raises SpecError naming what differs."""
    import time

    from workbench.launch.cluster import spec_differences

    if not name:
        raise SpecError("a run over several nodes needs --name ID, the same on every node, so that the nodes join one "
                        "run (`workbench train ... --emit torchrun` prints the commands)")
    root = Path(root) if root is not None else runs.default_root()
    try:
        return runs.new_run("train", body, root=root, run_id=name)
    except ValueError as e:
        if "already exists" not in str(e):
            raise
    path = root / name
    deadline = time.monotonic() + JOIN_WAIT_S
    while not (path / runs.SPEC_FILE).is_file() and time.monotonic() < deadline:
        time.sleep(0.2)  # the node that made the folder writes its spec next
    theirs = read_train_spec(path)
    st = runs.read_status(path)
    if st.final:
        raise SpecError(f"run {name} in {root} already ended ({st.state}); pick another --name for a new run, or "
                        f"resume it with --run-dir {path} on every node")
    mine = {k: v for k, v in spec.to_dict().items() if k != "steps"}
    there = {k: v for k, v in theirs.to_dict().items() if k != "steps"}
    if mine != there or spec.steps != theirs.steps:
        diff = spec_differences(theirs.to_dict(), spec.to_dict())
        raise SpecError(f"run {name} in {root} was prepared (by another node) with other settings ({'; '.join(diff)}); "
                        f"give every node the same settings, or another --name for another run")
    return runs.Run(path)


def emit_cluster(kind: str, settings: Mapping[str, Any], *, run_root: str | Path, name: str | None = None,
                 endpoint: str | None = None, rdzv_timeout: float | None = None,
                 sbatch: Sequence[str] = ()) -> tuple[str, TrainSpec, str]:
    """The ``kind`` (``slurm`` or ``torchrun``) text that runs a new training run of ``settings``
    (``prepare_train`` fields, ``nnodes`` among them) on several nodes: ``(text, spec, name)``.
    Nothing is started or written, except ``run_root`` for Slurm's output file. ``device`` auto
    is taken as ``cuda`` (a cluster script is for the GPU nodes, wherever it is written). For Slurm
    only the port of ``endpoint`` is used (the host is the job's first node). Raises ValueError with
    one line for bad settings, a name taken, a bad endpoint or option."""
    import re
    import time

    from workbench.launch.cluster import DEFAULT_RDZV_PORT, KINDS, slurm_script, torchrun_commands

    if kind not in KINDS:
        raise ValueError(f"unknown cluster script {kind!r}; choose slurm or torchrun")
    settings = dict(settings)
    nnodes = int(settings.get("nnodes", 1))
    if kind == "torchrun" and nnodes < 2:
        raise ValueError("--emit torchrun prints one command per node; give --nnodes N (N >= 2)")
    for opt in sbatch:
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*(=\S.*)?", opt.strip().lstrip("-")):
            raise ValueError(f"--sbatch {opt!r} is not an sbatch option; write e.g. --sbatch partition=gpu")
    if settings.get("device", "auto") == "auto":
        settings["device"] = "cuda"
    _, spec, _ = prepare_train(settings, dry_run=True, on_gpu=settings["device"] == "cuda")
    root = Path(run_root).expanduser().resolve()
    name = name or f"{time.strftime('%Y%m%d-%H%M%S')}-train-{os.urandom(2).hex()}"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise ValueError(f"--name {name!r} may hold only letters, digits, '.', '_' and '-'")
    if (root / name).exists():
        raise ValueError(f"{root / name} already exists; pick another --name")
    if kind == "slurm":
        port = DEFAULT_RDZV_PORT
        if endpoint:
            try:
                port = int(endpoint.rsplit(":", 1)[1])
            except (IndexError, ValueError):
                raise ValueError(f"--rdzv-endpoint {endpoint!r} has no port; with --emit slurm give :PORT (the host "
                                 f"is the job's first node)") from None
        root.mkdir(parents=True, exist_ok=True)  # Slurm writes the job's output file there
        return slurm_script(spec, run_root=root, name=name, port=port, rdzv_timeout=rdzv_timeout, sbatch=sbatch), spec, name
    return torchrun_commands(spec, run_root=root, name=name, endpoint=endpoint, rdzv_timeout=rdzv_timeout), spec, name


def flash_installed() -> str | None:
    """The module flash-attn would be imported from (``flash_attn``, 2.x; ``flash_attn_interface``,
    3.x), found without importing it (no torch, no CUDA), or None."""
    import importlib.util

    for mod in ("flash_attn", "flash_attn_interface"):
        try:
            if importlib.util.find_spec(mod) is not None:
                return mod
        except (ImportError, ValueError):
            continue
    return None


def torch_has_varlen() -> bool:
    """Whether the installed torch is 2.10 or newer (it ships ``torch.nn.attention.varlen``),
    read from its metadata without importing it."""
    import importlib.metadata
    import re

    try:
        m = re.match(r"(\d+)\.(\d+)", importlib.metadata.version("torch"))
    except importlib.metadata.PackageNotFoundError:
        return False
    return m is not None and (int(m.group(1)), int(m.group(2))) >= (2, 10)


def check_machine(spec: TrainSpec) -> None:
    """What this machine must have for ``spec``, checked without importing torch; raises SpecError
    with one line: ``--device cuda`` without an NVIDIA GPU; ``--attention flash`` or ``varlen`` on
    CPU or in fp32, ``flash`` without flash-attn installed, ``varlen`` with a torch older than 2.10."""
    gpu = cuda_visible()
    if spec.device == "cuda" and not gpu:
        raise SpecError("--device cuda but this machine shows no NVIDIA GPU (no /proc/driver/nvidia/gpus, and "
                        "nvidia-smi lists none, or CUDA_VISIBLE_DEVICES hides them); use --device cpu or auto, or run "
                        "`workbench doctor` to see what this machine has")
    if spec.attention in ("flash", "varlen"):
        if spec.device == "cpu" or not gpu:
            raise SpecError(f"--attention {spec.attention} needs CUDA and this run is on CPU; use --attention torch "
                            f"(or auto)")
        if spec.scenario.precision == "fp32":
            raise SpecError(f"--attention {spec.attention} computes in bf16/fp16 but this run's precision is fp32; use "
                            f"--precision bf16, or --attention torch")
    if spec.attention == "varlen" and not torch_has_varlen():
        raise SpecError("--attention varlen needs torch >= 2.10 (torch.nn.attention.varlen); upgrade torch, or use "
                        "--attention auto (flash-attn or the PyTorch path)")
    _check_host_memory(spec)
    if spec.attention == "flash":
        if flash_installed() is None:
            raise SpecError("--attention flash but flash-attn is not installed here (`make install` fetches a prebuilt "
                            "wheel when one matches torch and CUDA; see docs/gpu-and-clusters.md); use --attention auto "
                            "(the PyTorch path) or torch")


def _check_host_memory(spec: TrainSpec) -> None:
    """Refuse, in one line, a run whose plans may offload into more host memory than this machine has:
    the host memory the cost model plans with (``--host-memory``, else the profile's) over the node's
    total. Nothing to check where the run's plans cannot offload."""
    try:
        cost = spec.scenario.cost()
    except ValueError:
        return  # the planner says what is wrong with the scenario, in its own words, when the run plans
    if not cost.can_offload or not cost.host_memory_gb:
        return
    try:
        import psutil

        here = psutil.virtual_memory().total / 1e9
    except Exception:  # noqa: BLE001 - no figure, no check
        return
    if cost.host_memory_gb > here * 1.001:
        raise SpecError(f"plans may offload activations into {cost.host_memory_gb:,.0f} GB of host memory per node "
                        f"(--host-memory, else profile {cost.profile.name}'s) but this machine has {here:,.0f} GB; give "
                        f"--host-memory {int(here)} or less, or --offload none")


def _cpu_profile(world: int, root) -> str:
    """A CPU run's default profile: this machine's cached quick profile for ``world`` processes
    (``workbench.profile.machine``) when the run store has one, else the shipped ``cpu-gloo-tiny``
    (another machine's: the run will say so)."""
    from workbench.profile.machine import find_machine_profile

    found = find_machine_profile(world, root=root)
    return str(found.path) if found is not None else "cpu-gloo-tiny"


_PATH_SETTINGS = ("model", "source", "tokenizer", "init", "profile")


def _absolute_paths(settings: dict) -> dict:
    """Settings naming existing files or folders made absolute: the trainer's processes may run
    elsewhere, and a resume given the same relative path must compare equal."""
    out = dict(settings)
    for k in _PATH_SETTINGS:
        v = out.get(k)
        if not isinstance(v, str) or not v.strip():
            continue
        p = Path(os.path.expanduser(v.strip()))
        if k == "model" and v.strip().lower() in _presets():
            continue
        if k == "source" and v.strip().lower() == "stdlib":
            continue
        try:
            if p.exists() and ("/" in v or os.sep in v or k in ("tokenizer", "init") or p.suffix):
                out[k] = str(p.resolve())
        except (OSError, ValueError):
            pass
    return out


def _presets() -> set[str]:
    from workbench.specs import MODEL_PRESETS

    return set(MODEL_PRESETS)


def check_model_and_data(spec: TrainSpec) -> None:
    """What can be checked before any process starts, each failing with one line (SpecError): the
    ``init`` weights against the model (every tensor, by the safetensors headers), and a
    tokenizer whose vocabulary is larger than the model's."""
    sc = spec.scenario
    model = sc.model_spec()
    if spec.init is not None:
        from workbench.hf import WeightsError, check_weights

        try:
            check_weights(model, spec.init)
        except WeightsError as e:
            raise SpecError(f"--init: {e}") from None
    if sc.tokenizer is None and model.vocab < 256:
        raise SpecError(f"model {model.name} has {model.vocab:,} embeddings but byte-level tokens (no --tokenizer) "
                        f"need 256; give --tokenizer PATH, or a model with vocab_size >= 256")
    if sc.tokenizer is not None:
        from workbench.data.tokens import load_tokenizer

        tok = load_tokenizer(sc.tokenizer)
        if tok.vocab_size > model.vocab:
            raise SpecError(f"tokenizer {sc.tokenizer} has a vocabulary of {tok.vocab_size:,} tokens but model "
                            f"{model.name} has {model.vocab:,} embeddings; use a model whose vocab_size is at least "
                            f"{tok.vocab_size:,} (or the tokenizer the model was made for)")


def _resume(run_dir: str | Path, settings: dict, allow_changes: bool):
    text = os.fspath(run_dir)
    if not str(text).strip():
        raise SpecError("--run-dir is empty; name the run folder to resume, e.g. runs/20261123-101500-train-1a2b")
    p = Path(text)
    for parent in (p, *p.parents):
        if parent.exists() and not parent.is_dir():
            raise SpecError(f"{p} is not a run folder: {parent} is a file")
    if not p.exists():
        raise SpecError(f"no run at {p}: --run-dir resumes an existing run; to start a new one leave --run-dir out "
                        f"(optionally --name ID)")
    if not (p / runs.SPEC_FILE).exists():
        raise SpecError(f"{p} is not a training run (no {runs.SPEC_FILE}); --run-dir resumes an existing run")
    spec = read_train_spec(p)
    changes: list[ResumeChange] = []
    upd: dict = {}
    for k, v in settings.items():
        if k in ("steps", "torch_profile"):  # neither changes what the run plans or computes
            continue
        old = getattr(spec, k) if k in TRAIN_FIELDS else getattr(spec.scenario, k)
        if k == "degrees":
            v = tuple(v)
        if old != v:
            changes.append(ResumeChange(k, old, v))
            upd[k] = v
    if changes and not allow_changes:
        raise SpecError(f"{p} keeps its own settings on resume; "
                        + "; ".join(c.describe() for c in changes)
                        + ". Leave those options out, or pass --change to apply them (later steps' plans will differ)")
    if {"nproc", "nnodes"} & set(upd):
        nproc = int(upd.get("nproc", spec.nproc))
        nnodes = int(upd.get("nnodes", spec.nnodes))
        upd["num_gpus"] = nproc * nnodes
        if "gpus_per_node" not in upd:
            upd["gpus_per_node"] = nproc
    if "steps" in settings:
        upd["steps"] = int(settings["steps"])
    if "torch_profile" in settings:
        upd["torch_profile"] = settings["torch_profile"]
    new = spec.replace(**upd) if upd else spec
    return runs.Run(p), new, changes


def resource_args(spec: "TrainSpec | None", settings: dict | None = None) -> dict:
    """:func:`check_resources`' arguments for a run: from its TrainSpec (a resumed run) or, without
    one, from the settings of a new run (as the CLI and the Launch panel build them)."""
    if spec is not None:
        sc = spec.scenario
        return dict(nproc=spec.nproc, device=spec.device, model=sc.model, zero_stage=sc.zero_stage,
                    precision=sc.precision, optimizer=spec.optimizer, momentum=spec.momentum, nnodes=spec.nnodes)
    s = settings or {}
    return dict(nproc=int(s.get("nproc", 1)), device=s.get("device", "auto"), model=s.get("model", TRAIN_DEFAULTS["model"]),
                zero_stage=s.get("zero_stage"), precision=s.get("precision"), optimizer=s.get("optimizer") or "adamw",
                momentum=float(s.get("momentum") or 0.0), nnodes=int(s.get("nnodes", 1)))


def check_resources(nproc: int, *, device: str = "auto", model: str = "tiny", allow: bool = False,
                    cores: int | None = None, available_gb: float | None = None, zero_stage: int | None = None,
                    precision: str | None = None, optimizer: str = "adamw", momentum: float = 0.0,
                    nnodes: int = 1) -> list[str]:
    """Warnings about running ``nproc`` processes here; raises ResourceError above a sane limit
    (more than 4 processes per core, or an estimated memory above 80% of what is available on a
    CPU run) unless ``allow``. The memory estimate is per rank ~0.45 GB plus the model states the
    run holds at its peak on a CPU (``cost.memory.model_states``: ZeRO-3, the default, shards them
    over the ``nproc x nnodes`` ranks; 0-2 keep whole parameters and gradients on every rank; AdamW
    or SGD states), plus the plan-ahead worker."""
    from workbench.cost.memory import model_states, optimizer_kind
    from workbench.models import get_model

    cores = cores or os.cpu_count() or 1
    if available_gb is None:
        available_gb = _available_gb()
    on_gpu = device == "cuda" or (device == "auto" and cuda_visible())
    stage = 3 if zero_stage is None else int(zero_stage)
    states_gb = 0.0
    if not on_gpu:
        states = model_states(get_model(model), zero_stage=stage, num_ranks=max(1, nproc * nnodes),
                              precision=precision or "fp32", optimizer=optimizer_kind(optimizer, momentum))
        states_gb = states.total / 1e9
    est = nproc * (RANK_MEMORY_GB + states_gb) + 0.5
    warnings = []
    if not on_gpu and nproc > cores:
        warnings.append(f"{nproc} processes on {cores} CPU core(s): each rank gets 1/{math.ceil(nproc / cores)} of a core, "
                        f"so steps run about {nproc / cores:.1f}x slower than with {cores}")
    what = f"{nproc} process(es) of model {model}" + ("" if on_gpu else f", ZeRO-{stage}: {states_gb:.2f} GB of model states each")
    if available_gb is not None and est > 0.5 * available_gb:
        warnings.append(f"estimated memory {est:.1f} GB for {what} ({available_gb:.1f} GB available)")
    too_many = not on_gpu and nproc > MAX_PROCS_PER_CORE * cores
    too_big = available_gb is not None and est > 0.8 * available_gb
    if (too_many or too_big) and not allow:
        why = []
        if too_many:
            why.append(f"{nproc} processes is more than {MAX_PROCS_PER_CORE} per core on {cores} core(s)")
        if too_big:
            why.append(f"~{est:.1f} GB estimated for {what} against {available_gb:.1f} GB available")
        shard = "; --zero-stage 3 shards the model states over the ranks" if too_big and not on_gpu and stage < 3 else ""
        raise ResourceError("refusing to start: " + " and ".join(why) + f"; lower --nproc{shard}, or pass "
                            "--oversubscribe to run anyway")
    return warnings


def _available_gb() -> float | None:
    try:
        import psutil

        return psutil.virtual_memory().available / 1e9
    except Exception:  # noqa: BLE001 - no estimate is better than a crash
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / 1e9
        except OSError:
            pass
    return None
