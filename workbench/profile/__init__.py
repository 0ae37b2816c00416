"""The hardware profiler: measure this machine, fit the cost model, show how well it predicts.

A profile run is a run (``runs/<id>/``, kind ``profile``), started through the launcher as its own
torchrun process tree, never inside a notebook kernel::

    run = prepare_profile(nproc=2, model="tiny", quick=True)   # validates, creates the run folder
    handle = start_profile(run)                                 # torchrun -m workbench.profile.measure
    workbench.launch.process.wait(handle)
    res = load_result(run)                                      # ProfileResult: .profile + evidence
    check_fidelity(run, "runs/<a training run>")                # predicted vs measured step and group time

Layout: ``fit`` (least squares, residuals, held-out error: pure numpy), ``result`` (measurements
-> HardwareProfile + evidence: pure), ``fidelity`` (a profile against a training run's metrics:
pure), ``machine`` (this machine's fingerprint, its cached quick profile, the note for another
machine's: pure), ``measure`` (the torch side, run by the ranks), ``command`` (``workbench profile``).
The shipped reference profiles live in ``reference/``. Importing this package never imports torch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from workbench import runs
from workbench.profile.fidelity import check_fidelity
from workbench.profile.fit import ape, error_summary, fit_curve, fit_pack_curve, nnls, trimmed_median
from workbench.profile.result import MEASUREMENTS_FILE, RESULT_FILE, ProfileResult, build_result

__all__ = ["ProfileSpec", "prepare_profile", "start_profile", "load_result", "check_fidelity", "ProfileResult",
           "build_result", "read_profile_spec", "default_grid", "default_step_cases", "head_token_counts", "cp_grid", "cp_packs",
           "default_group_sizes", "micro_step_sizes", "cp_blocks",
           "fsdp_unit_bytes", "gpu_count", "MEASURE_MODULE", "RESULT_FILE",
           "MEASUREMENTS_FILE", "nnls", "fit_curve", "fit_pack_curve", "trimmed_median", "ape", "error_summary",
           "DEVICES", "ATTENTION"]

MEASURE_MODULE = "workbench.profile.measure"
"""What torchrun runs on every rank of a profile run."""
DEVICES = ("auto", "cpu", "cuda")
ATTENTION = ("auto", "varlen", "flash", "torch")
DEFAULT_MAX_LEN = {"cpu": 4096, "cuda": 32768}
"""Longest sequence timed by default: CPU attention at 4K tokens already takes a second per step."""
KB, MB = 1 << 10, 1 << 20
MESSAGE_BYTES = {
    ("cpu", True): (8 * KB, 128 * KB, 1 * MB),
    ("cpu", False): (4 * KB, 32 * KB, 256 * KB, 1 * MB, 4 * MB),
    ("cuda", True): (64 * KB, 1 * MB, 16 * MB),
    ("cuda", False): (16 * KB, 256 * KB, 4 * MB, 32 * MB, 128 * MB),
}
"""Per-rank buffer sizes of the collectives: small ones expose the latency, large ones the bandwidth."""


# ------------------------------------------------------------------------------------------------
# the run's settings
# ------------------------------------------------------------------------------------------------


def _pow2_floor(x: float) -> int:
    return 1 << max(0, int(x).bit_length() - 1)


def default_grid(max_len: int, quick: bool) -> dict:
    """The packs timed for a longest sequence ``max_len``: ``{"fit": [...], "heldout": [...],
    "groups": [...]}`` (the last: packs run as real SP micro-steps at every group size).

    Fit: single sequences over the range (the s^2 term) and packs of short ones (the per-token and
    per-call costs of the varlen path). Held out: lengths in between and a pack, never in the fit,
    so their error says how well the curve predicts what it was not fitted on."""
    L = _pow2_floor(max_len)

    def n(x: float) -> int:
        return max(8, int(x))

    # packs of short sequences up to 2L tokens: what a rank runs in a pass of a long-tailed batch (the
    # per-token cost grows with the tokens of a call, as they leave the CPU's caches: the linear fit
    # must see the sizes training runs)
    if quick:
        fit = [[n(L / 64)], [n(L / 16)], [n(L / 4)], [L], [n(L / 64)] * 16, [n(L / 16)] * 8, [n(L / 8)] * 8,
               [n(L / 16)] * 16, [n(L / 8)] * 16]
        held = [[n(L / 32)], [n(L / 8)], [n(L / 2)], [n(L / 32)] * 8]
        groups = [[n(L / 4)], [n(L / 2)], [n(L / 32)] * 8, [n(L / 16)] * 8]
    else:
        fit = [[n(L / 128)], [n(L / 64)], [n(L / 16)], [n(L / 4)], [n(L / 2)], [L], [n(L / 64)] * 16,
               [n(L / 16)] * 8, [n(L / 4), n(L / 8), n(L / 16), n(L / 32), n(L / 64), n(L / 64)], [n(L / 128)] * 32,
               [n(L / 8)] * 8, [n(L / 4)] * 8]
        held = [[n(3 * L / 64)], [n(3 * L / 16)], [n(3 * L / 8)], [n(3 * L / 4)], [n(3 * L / 32)] * 5,
                [n(L / 32)] * 12]
        groups = [[n(L / 4)], [n(L / 2)], [L], [n(L / 32)] * 8, [n(L / 16)] * 8, [n(L / 64)] * 32]
    seen, fit_u = set(), []
    for p in fit:
        if tuple(p) not in seen:
            seen.add(tuple(p))
            fit_u.append(p)
    held_u = [p for p in held if tuple(p) not in seen and not seen.add(tuple(p))]
    return {"fit": fit_u, "heldout": held_u, "groups": groups}


def default_step_cases(world: int, max_len: int, sp_degree: int | None = None) -> list[dict]:
    """The real training steps a profile run times on ``world`` ranks (what a step costs beyond its
    layers): ``[{"name", "execution", "micro_steps": [[{"degree", "ranks", "lengths"}]]}]``.

    Lockstep (ZeRO-3, FSDP2 over every rank): a pass where one rank runs a few tokens and every
    other rank an empty pass (the pass's fixed cost), a pass where every rank runs a sequence of
    ``max_len / 4``, one where every rank runs 8 of ``max_len / 8``, and two passes of short packs
    then a ``max_len / 2`` sequence on groups of ``sp_degree`` (when given). Free (ZeRO-0
    replicas): the same work but the first as micro-steps (the fixed cost of a micro-step; and,
    pass by pass against the lockstep cases, how much longer the same work takes in a pass). After
    each, the optimizer steps (its time per parameter)."""
    L = _pow2_floor(max_len)

    def n(x: float) -> int:
        return max(8, int(x))

    busy = [{"degree": 1, "ranks": [r], "lengths": [n(L / 4)]} for r in range(world)]
    heavy = [{"degree": 1, "ranks": [r], "lengths": [n(L / 8)] * 8} for r in range(world)]
    short = [{"degree": 1, "ranks": [r], "lengths": [n(L / 32)] * 8} for r in range(world)]
    mixed = [short]
    if sp_degree and sp_degree > 1 and world % sp_degree == 0:
        mixed.append([{"degree": sp_degree, "ranks": list(range(b * sp_degree, (b + 1) * sp_degree)),
                       "lengths": [n(L / 2)]} for b in range(world // sp_degree)])
    return [
        {"name": "lockstep-idle", "execution": "lockstep", "micro_steps": [[{"degree": 1, "ranks": [0], "lengths": [8]}]]},
        {"name": "lockstep-busy", "execution": "lockstep", "micro_steps": [busy]},
        {"name": "lockstep-heavy", "execution": "lockstep", "micro_steps": [heavy]},
        {"name": "lockstep-mixed", "execution": "lockstep", "micro_steps": mixed},
        {"name": "free-busy", "execution": "free", "micro_steps": [busy]},
        {"name": "free-heavy", "execution": "free", "micro_steps": [heavy]},
        {"name": "free-mixed", "execution": "free", "micro_steps": mixed},
    ]


EVERY_SIZE_UP_TO = 8
"""``default_group_sizes`` measures every group size up to this one (a node of 8 GPUs: every degree
the planner may give it); above it, the sizes that tile a node or whole nodes."""


def default_group_sizes(world: int, node: int | None = None) -> list[int]:
    """The group sizes a profile of ``world`` ranks (nodes of ``node``, default one node of all of
    them) measures its collectives at: the sizes a run on this machine can plan
    (``workbench.specs.candidate_degrees``: every degree up to a node), capped in count so that a
    profile's time grows slowly with the world:

    - every size from 2 to ``min(node, 8)`` (3, 5, 6 and 7 included: groups of any size);
    - above 8, within a node its divisors and the sizes ``2^a`` and ``3 x 2^a`` (12, 16, 24, 32, 48, ...);
      across nodes whole nodes in the same steps (``node x 2^a``, ``node x 3 x 2^a``, as
      ``candidate_degrees`` plans them); and the world itself.

    A size that does not divide the world is measured on its aligned blocks (``[k*d, (k+1)*d)``) with
    the ranks left over idle. Other sizes are interpolated by the cost model (``CostModel.link_source``
    says which)."""
    n = int(world)
    g = int(node or n)
    if n < 2:
        return []
    out = set(range(2, min(g, n, EVERY_SIZE_UP_TO) + 1))
    out |= {d for d in range(2, min(g, n) + 1) if g % d == 0}
    for base, top in ((1, g), (3, g), (g, n), (3 * g, n)):
        m = base
        while m <= min(top, n):
            if m >= 2:
                out.add(m)
            m *= 2
    out.add(n)
    return sorted(out)


def micro_step_sizes(group_sizes, world: int) -> list[int]:
    """The group sizes whose real SP and CP micro-steps a profile runs (``sp_overhead_ms``,
    ``cp_overhead_ms``, ...): those of ``group_sizes`` that are powers of two dividing ``world`` (as
    before groups of any size: every rank in a block, and the quick profile's time kept). The
    micro-step extras of other sizes are interpolated in log(d) by the cost model, clamped at the ends."""
    return [int(d) for d in group_sizes if int(world) % int(d) == 0 and int(d) & (int(d) - 1) == 0]


def cp_blocks(cp_sizes, group_sizes) -> dict[int, int]:
    """For each CP size ``c``, the group whose strided CP sub-groups its collectives are measured
    on: the largest of ``group_sizes`` that ``c`` divides (``c`` itself at least: then the sub-group
    is an aligned block of ``c`` ranks). With power-of-two sizes that is the largest group, as before."""
    sizes = [int(d) for d in group_sizes]
    return {int(c): max([d for d in sizes if d % int(c) == 0] or [int(c)]) for c in cp_sizes}


def cp_grid(group_sizes, ulysses_sizes) -> tuple[list[int], list[list[int]]]:
    """What a profile measures of context parallelism on groups of ``group_sizes`` (the model's
    heads allowing Ulysses over ``ulysses_sizes``): ``(cp_sizes, splits)``. Every group size is a
    CP size c (its collectives are measured on the strided sub-groups of the largest group,
    ``workbench.runtime.groups.split_subgroups``); the splits ``[degree, c]`` run as real
    micro-steps are ``1 x c`` for every c, and ``u x c`` of the largest group for every c below it
    whose ``u`` the heads allow (2 x 2 on 4 ranks: its residual beyond the ``u x 1`` and ``1 x c``
    parts is the profile's ``split_overhead_ms`` and ``split_token_ms``)."""
    sizes = sorted({int(d) for d in group_sizes if int(d) > 1})
    if not sizes:
        return [], []
    top = sizes[-1]
    splits = [[c, c] for c in sizes]
    splits += [[top, c] for c in sizes if c < top and top // c in set(int(u) for u in ulysses_sizes)]
    return sizes, splits


def cp_packs(group_packs, fit_packs) -> list[list[int]]:
    """The packs context-parallel micro-steps (``1 x c`` and ``u x c``) run: the SP groups' packs and
    one sequence of the longest length the compute curves are fitted to, when they have none that
    long. On CPU the CP attention's bottom-right-masked calls cost more than the causal share, and
    the excess grows with the square of the length (``cp_attention_factor``): the extras are fitted
    over the lengths CP is planned for (the long ones), not extrapolated from shorter ones. A
    composite split runs the same packs, so its residual beyond its parts (``split_token_ms``) is
    fitted on three token counts (1,024, 2,048 and 4,096 on CPU), not two."""
    packs = [[int(s) for s in p] for p in group_packs]
    longest = max(int(s) for p in fit_packs for s in p)
    if all(max(p) < longest for p in packs):
        packs.append([longest])
    return packs


def head_token_counts(max_len: int) -> list[int]:
    """Lengths the head (embedding, final norm, output head, loss) is timed at alone."""
    L = _pow2_floor(max_len)
    return sorted({max(8, L // 16), max(8, L // 4), L})


def fsdp_unit_bytes(model_name: str, dtype_bytes: int) -> list[int]:
    """The sizes FSDP moves under ZeRO-3 for ``model_name``: each unit's parameters (all-gathered,
    in ``dtype_bytes``) and gradients (reduce-scattered in fp32), distinct, at most four (the
    smallest and largest of each)."""
    from workbench.cost.memory import fsdp_units
    from workbench.models import get_model

    m = get_model(model_name)
    numels = sorted({sum(math.prod(shape) for _, shape in u) for u in fsdp_units(m)})
    picks = {numels[0], numels[-1]}
    return sorted({x * b for x in picks for b in {int(dtype_bytes), 4}})


def gpu_count() -> int:
    """NVIDIA GPUs this process may use, found without importing torch (``nvidia-smi -L``, limited
    by ``CUDA_VISIBLE_DEVICES``); 0 when there is none."""
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is not None and vis.strip() in ("", "-1"):
        return 0
    exe = shutil.which("nvidia-smi")
    n = 0
    if exe:
        try:
            p = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=10)
            if p.returncode == 0:
                n = sum(1 for ln in p.stdout.splitlines() if ln.startswith("GPU "))
        except (OSError, subprocess.TimeoutExpired):
            n = 0
    if n == 0 and Path("/proc/driver/nvidia/gpus").is_dir():
        n = sum(1 for _ in Path("/proc/driver/nvidia/gpus").iterdir())
    if vis is not None and n:
        n = min(n, len([x for x in vis.split(",") if x.strip()]))
    return n


def _packs(value: Any, what: str) -> list[list[int]]:
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{what} must be a non-empty list of packs (lists of sequence lengths), got {value!r}")
    out = []
    for p in value:
        p = [p] if isinstance(p, int) and not isinstance(p, bool) else p
        if (not isinstance(p, (list, tuple)) or not p
                or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in p)):
            raise ValueError(f"{what}: {p!r} is not a pack of positive sequence lengths")
        out.append([int(s) for s in p])
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileSpec:
    """What a profile run measures (its ``spec.json``, kind ``profile``). Validated; plain JSON."""

    model: str = "tiny"
    """Model preset whose layers are timed (``workbench.specs.MODEL_PRESETS``), or a Hugging Face
    ``config.json`` path (kept absolute)."""
    nproc: int = 2
    """Processes (ranks) measuring at once: the group sizes of the collectives, and the contention
    training will see."""
    quick: bool = True
    """A small grid and few repetitions (under a minute on a 2-core machine)."""
    device: str = "auto"
    """``auto`` (CUDA when visible), ``cpu`` or ``cuda``."""
    attention: str = "auto"
    """Attention backend: ``auto`` (flash-attn on CUDA when installed), ``flash`` or ``torch``."""
    max_len: int | None = None
    """Longest sequence timed (default 4,096 on CPU, 32,768 on CUDA; at most the model's context)."""
    fit_packs: tuple = ()
    """Packs the curves are fitted on (default: :func:`default_grid`)."""
    heldout_packs: tuple = ()
    """Packs predicted but not fitted on (default: :func:`default_grid`)."""
    group_packs: tuple = ()
    """Packs run as real SP micro-steps at every group size (default: :func:`default_grid`)."""
    warmup: int | None = None
    """Untimed runs per pack (default 1 quick, 2 full)."""
    reps: int | None = None
    """Timed samples per pack (default 5 quick, 9 full); the trimmed median is kept."""
    trim: float = 0.2
    """Share of the fastest and of the slowest repetitions dropped before the median."""
    group_sizes: tuple = ()
    """Group sizes of the collectives, any from 2 to ``nproc`` (default: :func:`default_group_sizes`,
    every size up to 8, then the ones that tile the ranks); real SP micro-steps run at those of them
    :func:`micro_step_sizes` keeps."""
    message_bytes: tuple = ()
    """Per-rank buffer sizes of the collectives (default by device and mode)."""
    collective_reps: int | None = None
    """Timed repetitions of each collective (default 9 quick, 15 full), after one warm-up."""
    collective_inner: int = 8
    """Back-to-back calls per timed repetition (as a layer after a layer runs them)."""
    min_sample_ms: float | None = None
    """A timed compute sample repeats the pack until it lasts this long (default 50 ms on CPU, where
    a scheduler tick is milliseconds, 5 ms on CUDA)."""
    dtype: str | None = None
    """Parameter dtype. None: what a run on the device computes in, ``bfloat16`` on CUDA (training
    there defaults to bf16) and ``float32`` on CPU. (An fp32 profile of a GPU predicts fp32 matmuls
    for bf16 runs.)"""
    oversubscribe: bool = False
    """Allow more processes than CPU cores (or GPUs)."""
    cp: bool = True
    """Also measure context parallelism (``workbench.runtime.cp``) for every group size c: the K/V
    all-gather and the gradient reduce-scatter on the strided CP sub-groups (all at once), and real
    micro-steps of ``1 x c`` splits (and ``u x c`` splits of the largest group where the heads
    allow), whose extras beyond the fits are the profile's ``cp_overhead_ms``, ``cp_token_ms`` and
    ``cp_attention_factor`` (and, for ``u x c``, beyond the sum of its parts, ``split_overhead_ms``
    and ``split_token_ms``)."""
    steps: bool = True
    """Also time real training steps (ZeRO-3 lockstep passes and ZeRO-0 micro-steps, each followed by
    an optimizer step), in the same rounds as the compute packs: the fixed costs of a micro-step
    and of a pass, the pass's compute factor and the optimizer's time per parameter
    (``default_step_cases``; models over 200M parameters skip them: three copies of the model
    states would be held at once)."""
    optimizer: str = "adamw"
    """The optimizer whose step is timed (``adamw`` or ``sgd``), as training runs it."""
    fingerprint: dict | None = None
    """The machine this profile is for (``workbench.profile.machine``): set when it is measured
    as this machine's cached profile; kept in the profile's provenance."""
    timeout_s: float = 300.0
    """Collective timeout: a rank waiting longer fails instead of hanging."""
    name: str | None = None
    """The profile's name (default ``<device>-<backend>-<model>-<nproc>r``)."""
    out: str | None = None
    """Also copy the profile JSON here."""
    command: str = ""
    """The command line (or call) that made the run, for the profile's provenance."""

    def __post_init__(self) -> None:
        from workbench.models import get_model

        def bad(field: str, what: str, v: Any) -> None:
            raise ValueError(f"profile {field} {what}, got {v!r}")

        m = get_model(self.model)  # ValueError listing the presets, or naming a config's bad field
        from workbench.specs import MODEL_PRESETS

        if self.model.strip().lower() in MODEL_PRESETS:
            object.__setattr__(self, "model", m.name)
        else:  # a Hugging Face config: keep its absolute path, which names the model wherever it is read
            from workbench.hf import config_path

            object.__setattr__(self, "model", str(config_path(self.model).resolve()))
        if isinstance(self.nproc, bool) or not isinstance(self.nproc, int) or self.nproc < 1:
            bad("nproc", "must be a positive integer", self.nproc)
        if not isinstance(self.quick, bool):
            bad("quick", "must be true or false", self.quick)
        if self.device not in DEVICES:
            bad("device", f"must be one of {', '.join(DEVICES)}", self.device)
        if self.attention not in ATTENTION:
            bad("attention", f"must be one of {', '.join(ATTENTION)}", self.attention)
        if self.max_len is not None:
            if isinstance(self.max_len, bool) or not isinstance(self.max_len, int) or self.max_len < 64:
                bad("max_len", "must be an integer >= 64", self.max_len)
            if self.max_len > m.max_context:
                raise ValueError(f"profile max_len {self.max_len:,} exceeds model {m.name}'s context {m.max_context:,}")
        for f in ("fit_packs", "heldout_packs", "group_packs"):
            v = getattr(self, f)
            if v:
                packs = _packs(v, f)
                longest = max(max(p) for p in packs)
                if longest > m.max_context:
                    raise ValueError(f"profile {f}: a sequence of {longest:,} tokens exceeds model {m.name}'s "
                                     f"context {m.max_context:,}")
                object.__setattr__(self, f, tuple(tuple(p) for p in packs))
        if self.fit_packs and len(self.fit_packs) < 3:
            bad("fit_packs", "needs at least 3 packs to fit a, b and c", list(self.fit_packs))
        for f, lo in (("warmup", 0), ("reps", 1), ("collective_reps", 1), ("collective_inner", 1)):
            v = getattr(self, f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < lo):
                bad(f, f"must be an integer >= {lo}", v)
        if self.min_sample_ms is not None and (not isinstance(self.min_sample_ms, (int, float))
                                               or not 0 <= self.min_sample_ms <= 10_000):
            bad("min_sample_ms", "must be a number of ms in [0, 10000]", self.min_sample_ms)
        if not isinstance(self.trim, (int, float)) or not 0 <= self.trim < 0.5:
            bad("trim", "must be in [0, 0.5)", self.trim)
        gs = tuple(int(d) for d in self.group_sizes) if self.group_sizes else ()
        for d in gs:
            if d < 2 or d > self.nproc:
                raise ValueError(f"group size {d} cannot be formed from {self.nproc} process(es): group sizes must be "
                                 f"from 2 to --nproc")
        object.__setattr__(self, "group_sizes", tuple(sorted(set(gs))))
        mb = tuple(int(x) for x in self.message_bytes) if self.message_bytes else ()
        if any(x < 64 for x in mb):
            bad("message_bytes", "must all be at least 64", list(mb))
        object.__setattr__(self, "message_bytes", tuple(sorted(set(mb))))
        for f in ("steps", "cp"):
            if not isinstance(getattr(self, f), bool):
                bad(f, "must be true or false", getattr(self, f))
        if self.optimizer not in ("adamw", "sgd"):
            bad("optimizer", "must be adamw or sgd", self.optimizer)
        if self.fingerprint is not None and not isinstance(self.fingerprint, Mapping):
            bad("fingerprint", "must be an object or null", self.fingerprint)
        if self.dtype is not None and self.dtype not in ("float32", "bfloat16", "float16"):
            bad("dtype", "must be float32, bfloat16 or float16", self.dtype)
        if not isinstance(self.timeout_s, (int, float)) or self.timeout_s <= 0:
            bad("timeout_s", "must be a positive number of seconds", self.timeout_s)
        if self.name is not None and not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*$", str(self.name)):
            bad("name", "may hold only letters, digits, '.', '_' and '-'", self.name)

    # ---- resolved settings (what the ranks use) ------------------------------------------------
    def resolved_device(self) -> str:
        """``cpu`` or ``cuda`` (``auto``: CUDA when a GPU is visible)."""
        if self.device == "auto":
            return "cuda" if gpu_count() > 0 else "cpu"
        return self.device

    def resolved(self, device: str | None = None) -> dict:
        """Every default filled in for ``device`` (default :meth:`resolved_device`): max_len,
        fit/held-out packs, repetitions, group sizes, message sizes."""
        from workbench.models import get_model

        dev = device or self.resolved_device()
        m = get_model(self.model)
        max_len = self.max_len or min(m.max_context, DEFAULT_MAX_LEN[dev])
        grid = default_grid(max_len, self.quick)
        fit = [list(p) for p in self.fit_packs] or grid["fit"]
        held = [list(p) for p in self.heldout_packs] or ([] if self.fit_packs else grid["heldout"])
        fit_keys = {tuple(p) for p in fit}
        held = [p for p in held if tuple(p) not in fit_keys]
        groups = list(self.group_sizes) or default_group_sizes(self.nproc)
        # the collectives at every size of ``groups``; real micro-steps at the power-of-two divisors among them
        steps_at = micro_step_sizes(groups, self.nproc)
        sp = [d for d in steps_at if m.heads % d == 0 and (m.kv_heads % d == 0 or d % m.kv_heads == 0)]
        dtype = self.dtype or ("bfloat16" if dev == "cuda" else "float32")
        dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
        # the runtime computes in fp32 or bf16; a big model's three copies of its states would not fit
        run_steps = self.steps and dtype != "float16" and m.params() <= 200e6
        # CP collectives at every group size (each on the largest group it divides: cp_blocks), CP micro-steps
        # at the micro-step sizes' splits
        cp_sizes, cp_splits = (groups, cp_grid(steps_at, sp)[1]) if self.cp else ([], [])
        group_packs = [list(p) for p in self.group_packs] or grid["groups"]
        return {
            "device": dev, "dtype": dtype, "max_len": max_len, "fit_packs": fit, "heldout_packs": held,
            "warmup": self.warmup if self.warmup is not None else (1 if self.quick else 2),
            "reps": self.reps if self.reps is not None else (5 if self.quick else 9),
            "trim": float(self.trim), "group_sizes": groups, "micro_step_sizes": steps_at,
            "message_bytes": list(self.message_bytes) or list(MESSAGE_BYTES[(dev, self.quick)]),
            "collective_reps": self.collective_reps or (9 if self.quick else 15),
            "collective_inner": int(self.collective_inner),
            "group_packs": group_packs,
            "min_sample_ms": float(self.min_sample_ms if self.min_sample_ms is not None
                                   else (50.0 if dev == "cpu" else 5.0)),
            "head_tokens": head_token_counts(max_len),
            "fsdp_bytes": fsdp_unit_bytes(self.model, dtype_bytes) if self.nproc > 1 else [],
            "step_cases": default_step_cases(self.nproc, max_len,
                                             max(sp) if sp else None) if run_steps else [],
            "optimizer": self.optimizer,
            "cp_sizes": cp_sizes, "cp_splits": cp_splits,
            "cp_packs": cp_packs(group_packs, fit) if cp_splits else [],
        }

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for k in ("fit_packs", "heldout_packs", "group_packs"):
            out[k] = [list(p) for p in out[k]]
        for k in ("group_sizes", "message_bytes"):
            out[k] = list(out[k])
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ProfileSpec":
        """Build from ``to_dict`` output (``kind`` and ``resolved`` ignored). Raises ValueError naming unknown fields
        or the invalid one."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a profile spec must be a JSON object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in data.items() if k not in ("kind", "resolved")}  # resolved: informational
        unknown = sorted(set(kw) - names)
        if unknown:
            raise ValueError(f"profile spec has unknown field(s) {unknown}; known fields are {sorted(names)}")
        for k in ("fit_packs", "heldout_packs", "group_packs", "group_sizes", "message_bytes"):
            if isinstance(kw.get(k), list):
                kw[k] = tuple(kw[k])
        return cls(**kw)


def read_profile_spec(run_dir: str | Path) -> ProfileSpec:
    """The ProfileSpec of a profile run folder. Raises ValueError when ``spec.json`` is missing, not
    a profile run's, or invalid."""
    p = Path(run_dir) / runs.SPEC_FILE
    try:
        data = json.loads(p.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{p} does not exist: not a run folder") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{p} cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict) or data.get("kind") != "profile":
        raise ValueError(f"{p} is not a profile run's spec (kind {data.get('kind') if isinstance(data, dict) else None!r})")
    return ProfileSpec.from_dict(data)


# ------------------------------------------------------------------------------------------------
# preparing, starting, reading
# ------------------------------------------------------------------------------------------------


def check_machine(spec: ProfileSpec, *, cores: int | None = None, gpus: int | None = None) -> str:
    """The device the run will use, after checking the machine can hold it. Raises ValueError (one
    line) for more processes than CPU cores (unless ``oversubscribe``) or than GPUs, or ``cuda``
    asked for without a GPU."""
    gpus = gpu_count() if gpus is None else gpus
    dev = spec.device if spec.device != "auto" else ("cuda" if gpus > 0 else "cpu")
    if dev == "cuda":
        if gpus == 0:
            raise ValueError("--device cuda but this machine shows no NVIDIA GPU; use --device cpu (or auto)")
        if spec.nproc > gpus:
            raise ValueError(f"{spec.nproc} processes but this machine has {gpus} GPU(s): one process per GPU; "
                             f"lower --nproc to {gpus}")
        return dev
    if spec.attention in ("flash", "varlen"):
        raise ValueError(f"--attention {spec.attention} needs CUDA; this profile runs on CPU (use --attention torch "
                         f"or auto)")
    cores = cores or os.cpu_count() or 1
    if spec.nproc > cores and not spec.oversubscribe:
        raise ValueError(f"{spec.nproc} processes on {cores} CPU core(s): they would share cores and every time "
                         f"measured would include that contention; lower --nproc to {cores}, or pass --oversubscribe "
                         f"to measure exactly that (as a {spec.nproc}-rank training run on this machine sees it)")
    return dev


def prepare_profile(*, nproc: int = 2, model: str = "tiny", quick: bool = True, root: str | Path | None = None,
                    name: str | None = None, **options: Any) -> runs.Run:
    """Validate a profile run and create its folder (kind ``profile``) with its spec; nothing runs
    yet (see :func:`start_profile`). ``options`` are further :class:`ProfileSpec` fields (device,
    attention, max_len, fit_packs, heldout_packs, warmup, reps, group_sizes, message_bytes,
    oversubscribe, out, command, ...); ``name`` is the run folder's name. Returns the Run.

    Raises ValueError (one line) for bad input: an unknown model or field, more processes than
    CPU cores (without ``oversubscribe=True``) or GPUs, a group size ``nproc`` cannot form, a
    sequence longer than the model's context, an ``out`` path that is a folder."""
    spec = ProfileSpec(model=model, nproc=nproc, quick=quick, **options)
    dev = check_machine(spec)
    if spec.out is not None:
        out = Path(spec.out)
        if out.is_dir():
            raise ValueError(f"--out {out} is a folder; give the profile JSON file to write, e.g. {out / 'profile.json'}")
        for parent in out.parents:
            if parent.exists() and not parent.is_dir():
                raise ValueError(f"--out {out}: {parent} is a file, not a folder")
        spec = dataclasses.replace(spec, out=str(out.resolve()))
    if not spec.command:
        spec = dataclasses.replace(spec, command=f"workbench.profile.prepare_profile(nproc={nproc}, model={model!r}, "
                                                 f"quick={quick})")
    data = spec.to_dict()
    data["resolved"] = spec.resolved(dev)
    return runs.new_run("profile", data, root=root, run_id=name)


def start_profile(run: runs.Run | str | Path, *, stop_with_parent: bool = False, env: dict | None = None):
    """Start a prepared profile run through the launcher (a torchrun tree in its own session running
    ``workbench.profile.measure`` on every rank) and return its ``RunHandle`` at once. Raises
    ValueError when ``run`` is not a profile run, RunBusy when it is already running."""
    from workbench.launch import process

    run = runs.load_run(run) if not isinstance(run, runs.Run) else run
    spec = read_profile_spec(run.path)
    return process.start(run, nproc=spec.nproc, module=MEASURE_MODULE, stop_with_parent=stop_with_parent, env=env)


def load_result(run: runs.Run | str | Path) -> ProfileResult:
    """The ProfileResult of a finished profile run (a Run, a run folder, or its id under the default
    root). Raises ValueError saying what is missing (a run that has not finished, failed, or is not
    a profile run)."""
    run = runs.load_run(run) if not isinstance(run, runs.Run) else run
    path = run.file(RESULT_FILE)
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        st = run.status()
        why = f": {st.error}" if st.error else ""
        raise ValueError(f"run {run.id} has no {RESULT_FILE} (it is {st.state}{why})") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path} cannot be read ({type(e).__name__}: {e})") from None
    res = ProfileResult.from_dict(data)
    res.run_id = res.run_id or run.id
    return res


def profile_paths(run: runs.Run) -> dict:
    """Where a profile run keeps its files: ``{"profile", "result", "measurements"}``."""
    return {"profile": run.file(runs.PROFILE_FILE), "result": run.file(RESULT_FILE),
            "measurements": run.file(MEASUREMENTS_FILE)}
