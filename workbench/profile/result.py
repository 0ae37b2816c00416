"""From measurements to a HardwareProfile and the evidence shown next to it: pure, no torch.

``measurements`` is what the measuring ranks hand over (plain JSON, kept in the run folder as
``measurements.json``)::

    {"model": "tiny", "world_size": 4, "device": "cpu", "scope": "model",
     "compute": [{"pack": [..], "tokens": n, "role": "fit"|"heldout", "forward_ms": per layer,
                  "backward_ms": per layer, "per_rank": {...}}],
     "collectives": [{"kind": "all_to_all"|"allreduce"|"p2p"|"allgather"|"reduce_scatter"|"cp_allgather"|
                      "cp_reduce_scatter", "group_size": d, "message_bytes": m, "ms": t, "per_rank": [...]}],
     "groups": [{"degree": d, "cp": c (1: Ulysses only), "pack": [..], "ms": whole-model micro-step,
                 "per_rank": [...]}],
     "head": [{"tokens": n, "forward_ms": whole, "backward_ms": whole, "per_rank": {...}}],
     "steps": [{"name", "execution": "lockstep"|"free", "zero_stage", "micro_steps": [[{degree, ranks,
                lengths}]], "micro_step_ms": [[ms per rank] per pass or micro-step], "step_ms": [per rank],
                "allreduce_ms": [...], "optimizer_ms": [...], "updated_params": [...]}],
     "memory": {"activation_mb_per_token": x, "model_state_mb": y, "method": "..."},
     "host": {"memory_gb": host memory of the node (psutil), "link": None (CPU: no host link) or
              {"bytes", "warmup", "reps", "ranks_per_node", "alone": {"h2d_ms", "d2h_ms"},
               "all": {"h2d_ms": [[..] per rank], "d2h_ms": [..]}} (pinned copies on CUDA)},
     "meta": {"name", "gpu", "gpu_memory_gb", "provenance": {...}}}

:func:`build_result` fits it (``workbench.profile.fit``) into a :class:`ProfileResult`: the profile,
plus every point and curve the figures draw. In order:

1. the **head** (embedding, final norm, output head and loss, timed alone): a line per token
   (``head_ms_per_token``), whose per-token part is taken out of the whole-model compute rows, so
   that the per-layer curves are the blocks' own (the head scales with vocab x hidden, the blocks
   with their FLOPs, when the profile plans another model);
2. the per-layer **compute curves** and the **collectives** (all-to-all, ring steps, all-reduce,
   and FSDP's all-gather and reduce-scatter over the world; context parallelism's on its strided
   sub-groups fill ``allgather_*`` and ``reduce_scatter_*`` at the CP sizes FSDP did not measure:
   the world-size entries stay FSDP's);
3. the **micro-step's fixed cost** (``micro_step_ms``): what the runtime's real micro-steps of
   degree-1 groups (free execution, ZeRO-0) take beyond the curves and the head: the Python of a
   forward and backward, building the shard, the loss;
4. the **SP overhead** per degree from the real SP micro-steps (``fit_sp_overhead``), the
   **CP extras** per CP size from the real ``1 x c`` micro-steps (``fit_cp_overhead``:
   ``cp_overhead_ms``, ``cp_token_ms`` and ``cp_attention_factor``), and the **composite splits'
   residual** from the real ``u x c`` micro-steps (u > 1 and c > 1) beyond the sum of those parts
   (``fit_split_overhead``: ``split_overhead_ms``, ``split_token_ms``, keyed ``"uxc"``);
5. the **fixed cost of a lockstep pass** (``pass_overhead_ms`` at the world size) and the
   **pass's compute factor** (``pass_compute_factor``) from real ZeRO-3 steps (FSDP2 over every
   rank, idle ranks running empty passes): what a pass takes beyond FSDP's collectives
   (``pass_comm_overlap``: 0 on CPU, where they do not overlap) and beyond the same work run as
   free micro-steps, as a fixed cost plus a share of that work;
6. the **optimizer step** per million parameters a rank updates, plain (ZeRO-0) and sharded (ZeRO-3);
7. the **host**: its memory (``host_memory_gb``) and, on CUDA, the pinned host-device copy bandwidth
   of one GPU alone (``host_link_gbps``, the slower direction) and of a node's GPUs copying at once
   (``host_link_node_gbps``, in total), ``workbench.profile.fit.fit_host_link``; on CPU there is no
   host link (both None, so plans made with the profile do not offload), and ``provenance.host_link``
   says which.

Steps 3-6 need the ``steps`` measurements (profiles measured before them have none: those fields
stay empty and the cost model leaves the terms out).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import dataclasses
import statistics

from workbench.profile.fit import fit_collectives, fit_compute, fit_line
from workbench.specs import HardwareProfile

__all__ = ["ProfileResult", "build_result", "fit_sp_overhead", "fit_cp_overhead", "fit_split_overhead",
           "fit_head", "fit_micro_step", "fit_pass_overhead",
           "fit_optimizer", "step_predictions", "ESTIMATED_ALL_TO_ALL_GBPS", "RESULT_FILE", "MEASUREMENTS_FILE",
           "PROFILER_VERSION"]

PROFILER_VERSION = 4
"""What a profile measured, as a number its provenance carries (``profiler_version``): 1 (or none)
before context parallelism, 2 with the CP collectives, the 1 x c micro-steps and their fit
(``cp_overhead_ms``, ``cp_token_ms``, ``cp_attention_factor``), 3 with the composite splits'
residual (``u x c`` micro-steps on the 1 x c packs: ``split_overhead_ms``, ``split_token_ms``), 4 with the host
(``host_memory_gb``; on CUDA the pinned copies: ``host_link_gbps``, ``host_link_node_gbps``). A cached machine profile older
than this one is measured again (``workbench.profile.machine``)."""
RESULT_FILE = "profile_result.json"
"""The fit and its evidence, in a profile run's folder (beside ``profile.json``)."""
MEASUREMENTS_FILE = "measurements.json"
"""What the ranks measured, before any fit."""

ESTIMATED_ALL_TO_ALL_GBPS = {2: 0.5, 4: 0.3, 8: 0.2}
"""Used only for a profile measured on one process (nothing to measure): gloo over loopback moves a
few hundred MB/s to ~1 GB/s per rank on a small VM. Provenance says so."""


@dataclass
class ProfileResult:
    """A fitted profile and the evidence for it, as plain data (what the Hardware panel draws).

    - ``profile``: the HardwareProfile (what ``--profile PATH`` loads);
    - ``compute``: every measured pack: ``{pack, tokens, role ("fit"|"heldout"), forward_ms,
      backward_ms}`` (per layer, agreed over ranks);
    - ``fits``: ``{"forward"|"backward": {a, b, c, packs, measured_ms, predicted_ms, residuals_ms,
      errors}}`` on the fit points;
    - ``heldout``: ``{"forward"|"backward"|"total": {points: [{pack, tokens, measured_ms,
      predicted_ms, ape}], count, median_ape, worst_ape, mean_ape}}`` on lengths not in the fit;
    - ``collectives``: measured points ``{kind, group_size, message_bytes, ms}``;
    - ``collective_fits``: ``{kind: {group size: {latency_ms, gbps, message_bytes, measured_ms,
      predicted_ms, errors}}}``;
    - ``memory``: activation MB per token, model-state MB and how they were obtained;
    - ``groups``: real SP micro-steps per degree and pack: ``{degree, cp, pack, tokens, measured_ms,
      predicted_ms (compute + collectives), predicted_with_overhead_ms (+ the fitted sp_overhead)}``;
      context-parallel ones (``cp > 1``) also ``split`` (``"u x c"``), and their
      ``predicted_with_overhead_ms`` adds the fitted CP extras; composite ones (u > 1 and c > 1)
      also ``predicted_parts_ms`` (the sum of the parts: compute, collectives, Ulysses and CP
      extras), and their ``predicted_with_overhead_ms`` adds the split's own fitted residual.
    """

    profile: HardwareProfile
    compute: list = field(default_factory=list)
    fits: dict = field(default_factory=dict)
    heldout: dict = field(default_factory=dict)
    collectives: list = field(default_factory=list)
    collective_fits: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    groups: list = field(default_factory=list)
    run_id: str | None = None
    head: dict = field(default_factory=dict)
    """The head alone: ``{"points": [{tokens, forward_ms, backward_ms}], "forward_per_token",
    "backward_per_token", "forward_intercept", "backward_intercept"}`` (empty: not measured)."""
    steps: list = field(default_factory=list)
    """Real steps, per pass or micro-step: ``{case, execution, micro_step, measured_ms,
    predicted_ms (with every fitted term), loads_ms}`` and per step ``{case, execution, step,
    measured_ms, predicted_ms, optimizer_ms, predicted_optimizer_ms}``."""
    host: dict = field(default_factory=dict)
    """The host: ``{"memory_gb", "link": fit_host_link's figures or None (no host link: CPU)}``
    (empty: not measured)."""

    def summary(self) -> dict:
        """The headline figures: held-out median/worst APE and the fitted links."""
        out = {"profile": self.profile.name, "model": self.profile.model, "run_id": self.run_id}
        for k in ("forward", "backward", "total"):
            h = self.heldout.get(k) or {}
            out[f"heldout_{k}_median_ape"] = h.get("median_ape")
            out[f"heldout_{k}_worst_ape"] = h.get("worst_ape")
        out["links"] = [{"kind": kind, "group_size": int(d), "latency_ms": f["latency_ms"], "gbps": f["gbps"]}
                        for kind, by in self.collective_fits.items() for d, f in by.items()]
        return out

    def to_dict(self) -> dict:
        return {"profile": self.profile.to_dict(), "compute": self.compute, "fits": self.fits,
                "heldout": self.heldout, "collectives": self.collectives,
                "collective_fits": {k: {str(d): f for d, f in v.items()} for k, v in self.collective_fits.items()},
                "memory": self.memory, "groups": self.groups, "run_id": self.run_id, "head": self.head,
                "steps": self.steps, "host": self.host}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ProfileResult":
        """Rebuild from ``to_dict`` output. Raises ValueError when it is not a profile result."""
        if not isinstance(data, Mapping) or "profile" not in data:
            raise ValueError("not a profile result (no 'profile' field)")
        prof = HardwareProfile.from_dict(data["profile"])
        cf = {k: {int(d): f for d, f in v.items()} for k, v in (data.get("collective_fits") or {}).items()}
        return cls(profile=prof, compute=list(data.get("compute") or []), fits=dict(data.get("fits") or {}),
                   heldout=dict(data.get("heldout") or {}), collectives=list(data.get("collectives") or []),
                   collective_fits=cf, memory=dict(data.get("memory") or {}), groups=list(data.get("groups") or []),
                   run_id=data.get("run_id"), head=dict(data.get("head") or {}), steps=list(data.get("steps") or []),
                   host=dict(data.get("host") or {}))

    def to_json(self, **kw) -> str:
        from workbench.util import dumps

        return dumps(self.to_dict(), **kw)


def _single_residuals(cost, groups: list[dict]) -> dict:
    """Per pack measured on one rank (degree 1): what the cost model's group time leaves unexplained
    (measured less predicted, ms), the part of a wider group's residual that is not its own."""
    return {tuple(g["pack"]): g["ms"] - cost.group_ms(g["pack"], 1) for g in groups if int(g["degree"]) == 1}


def fit_sp_overhead(profile: HardwareProfile, world: int, groups: list[dict]) -> tuple[dict, dict, list[dict]]:
    """The extra time of a Ulysses group of each size beyond what the profile's compute and
    collective fits predict, from real micro-steps ``groups`` (``{"degree", "pack", "ms"}``, whole
    model). For degree d and a pack, the residual is measured - predicted, less the same pack's
    degree-1 residual divided by d (the compute curve's own error on it). Per degree the residuals
    are fitted as ``layers * (o + r * tokens)`` with o, r >= 0 (least squares; r = 0 when the packs
    have one token count). Returns ``({degree: o, ms per layer}, {degree: r, ms per token and
    layer}, rows)``; rows hold every case's measured and predicted time, before and after."""
    import numpy as np

    from workbench.cost import CostModel
    from workbench.models import get_model
    from workbench.profile.fit import nnls
    from workbench.specs import ClusterSpec

    groups = [g for g in groups if int(g.get("cp", 1)) == 1]  # Ulysses only: CP splits are fit_cp_overhead's
    if not groups:
        return {}, {}, []
    model = get_model(profile.model)
    base = dataclasses.replace(profile, sp_overhead_ms={}, sp_token_ms={})
    cost = CostModel(base, model, ClusterSpec(num_gpus=world, gpus_per_node=world, gpu_memory_gb=1e6))

    r1 = _single_residuals(cost, groups)
    fixed: dict[int, float] = {}
    per_token: dict[int, float] = {}
    for d in sorted({int(g["degree"]) for g in groups if g["degree"] > 1}):
        gs = [g for g in groups if g["degree"] == d]
        tokens = np.array([float(sum(g["pack"])) for g in gs])
        res = np.array([g["ms"] - cost.group_ms(g["pack"], d) - r1.get(tuple(g["pack"]), 0.0) / d for g in gs])
        if len(set(tokens.tolist())) >= 2:
            o, r = nnls(np.stack([np.ones_like(tokens), tokens], axis=1), res)
        else:
            o, r = max(0.0, float(np.median(res))), 0.0
        fixed[d], per_token[d] = float(o) / model.layers, float(r) / model.layers
    rows = []
    for g in groups:
        d = int(g["degree"])
        p0 = cost.group_ms(g["pack"], d)
        extra = model.layers * (fixed.get(d, 0.0) + per_token.get(d, 0.0) * sum(g["pack"]))
        rows.append({"degree": d, "cp": 1, "pack": list(g["pack"]), "tokens": int(sum(g["pack"])),
                     "measured_ms": g["ms"], "predicted_ms": p0, "predicted_with_overhead_ms": p0 + extra})
    return fixed, per_token, rows


def fit_cp_overhead(profile: HardwareProfile, world: int, groups: list[dict], *,
                    attention: bool = True) -> tuple[dict, dict, list[dict], dict]:
    """The extra time of context parallelism over c ranks beyond what ``profile``'s compute and
    collective fits predict (its all-gather and reduce-scatter bytes and latency at c, and for a
    ``u x c`` split the Ulysses part with its measured extras), from real micro-steps ``groups``
    (``{"degree", "cp", "pack", "ms"}``, whole model), the way :func:`fit_sp_overhead` fits
    Ulysses': for a ``1 x c`` split and a pack the residual is measured - predicted, less the same
    pack's degree-1 residual divided by c; per c the residuals are fitted as ``layers * (o + r *
    tokens) + q * attention`` with o, r, q >= 0 (non-negative least squares), ``attention`` the
    rank's causal share of the pack's attention (the compute curves' ``a * s^2`` summed over the
    pack, over c: ``CostModel.attention_ms``), so q is a fraction of it. What it holds: the CP layout
    and the K/V selection (and its scatter-add in the backward), waits at every layer's all-gather
    (o, r), and the bottom-right-masked attention where the kernel computes the whole rectangle of
    each chunk's queries against its key prefix rather than the causal triangle (q: on CPU the
    excess grows with the square of the length). With packs of one token count only o is fitted;
    with two distinct (tokens, attention) pairs, or ``attention=False`` (the per-token fit profiles
    had before ``cp_attention_factor``), o and r. ``u x c`` splits (u > 1) are not fitted here: their
    rows re-time them with the fitted extras (the cost model scales the per-token one by the K/V heads
    a rank holds and takes the same fraction of the rank's own attention); their residual beyond
    that sum is :func:`fit_split_overhead`'s. Returns
    ``({c: o, ms per layer}, {c: r, ms per token and layer}, rows, {c: q})``; rows hold every CP
    case's measured and predicted time, without and with the extras."""
    import numpy as np

    from workbench.cost import CostModel
    from workbench.profile.fit import nnls

    cps = [g for g in groups if int(g.get("cp", 1)) > 1]
    if not cps:
        return {}, {}, [], {}
    model = _model(profile.model)
    base = dataclasses.replace(profile, cp_overhead_ms={}, cp_token_ms={}, cp_attention_factor={})
    cluster = _cluster(world, 0)
    cost = CostModel(base, model, cluster, strategy="auto")
    r1 = _single_residuals(cost, groups)
    fixed: dict[int, float] = {}
    per_token: dict[int, float] = {}
    factor: dict[int, float] = {}
    for c in sorted({int(g["cp"]) for g in cps if int(g["degree"]) == int(g["cp"])}):
        gs = [g for g in cps if int(g["degree"]) == c and int(g["cp"]) == c]
        tokens = np.array([float(sum(g["pack"])) for g in gs])
        attn = np.array([float(cost.attention_ms(g["pack"], c).sum()) for g in gs])
        res = np.array([g["ms"] - cost.group_ms(g["pack"], c, c) - r1.get(tuple(g["pack"]), 0.0) / c for g in gs])
        o, r, q = 0.0, 0.0, 0.0
        if attention and len(set(zip(tokens.tolist(), attn.tolist()))) >= 3 and np.any(attn > 0):
            X = np.stack([np.ones_like(tokens), tokens, attn], axis=1)
            scale = np.max(np.abs(X), axis=0)  # columns of one size: ms, thousands of tokens, ms
            o, r, q = nnls(X / scale, res) / scale
        elif len(set(tokens.tolist())) >= 2:
            o, r = nnls(np.stack([np.ones_like(tokens), tokens], axis=1), res)
        else:
            o = max(0.0, float(np.median(res)))
        fixed[c], per_token[c], factor[c] = float(o) / model.layers, float(r) / model.layers, float(q)
    fitted = CostModel(dataclasses.replace(profile, cp_overhead_ms=fixed, cp_token_ms=per_token,
                                           cp_attention_factor=factor), model, cluster, strategy="auto")
    rows = []
    for g in cps:
        d, c = int(g["degree"]), int(g["cp"])
        rows.append({"degree": d, "cp": c, "split": f"{d // c}x{c}", "pack": list(g["pack"]),
                     "tokens": int(sum(g["pack"])), "measured_ms": g["ms"], "predicted_ms": cost.group_ms(g["pack"], d, c),
                     "predicted_with_overhead_ms": fitted.group_ms(g["pack"], d, c)})
    return fixed, per_token, rows, factor


def fit_split_overhead(profile: HardwareProfile, world: int, groups: list[dict]) -> tuple[dict, dict, list[dict]]:
    """The residual of every composite split ``u x c`` (u > 1 and c > 1) measured in real
    micro-steps ``groups`` (``{"degree", "cp", "pack", "ms"}``, whole model) beyond the sum of its
    parts as ``profile`` prices it: compute, the Ulysses and CP collectives, the Ulysses extras at u
    (``sp_*``) and the CP extras at c (``cp_*``, ``cp_attention_factor``), so ``profile`` should hold
    those already (``build_result`` fits them first). As :func:`fit_sp_overhead` does: per pack the
    residual is measured - predicted, less the same pack's degree-1 residual divided by the degree
    (the compute curve's own error); per split the residuals are fitted as ``layers * (o + r *
    tokens)`` with o, r >= 0 (non-negative least squares), tokens the pack's. Packs of one token
    count only (or one pack) fit o alone, the median residual clipped at 0. What it holds: what two
    different sub-group collectives per layer cost together beyond each alone (a rank waits on its
    Ulysses partners, then on its CP partners; with ranks oversubscribed on the cores, on both).

    Returns ``({"uxc": o, ms per layer}, {"uxc": r, ms per token and layer}, rows)``; rows hold every
    composite case: ``{degree, cp, split, pack, tokens, measured_ms, predicted_ms (compute +
    collectives), predicted_parts_ms (+ the Ulysses and CP extras: the sum of the parts),
    predicted_with_overhead_ms (+ the split's fitted residual)}``. Empty without composite splits."""
    import numpy as np

    from workbench.cost import CostModel
    from workbench.profile.fit import nnls
    from workbench.specs import split_key

    comp = [g for g in groups if int(g.get("cp", 1)) > 1 and int(g["degree"]) > int(g.get("cp", 1))]
    if not comp:
        return {}, {}, []
    model = _model(profile.model)
    cluster = _cluster(world, 0)
    parts = dataclasses.replace(profile, split_overhead_ms={}, split_token_ms={})
    bare = dataclasses.replace(parts, sp_overhead_ms={}, sp_token_ms={}, cp_overhead_ms={}, cp_token_ms={},
                               cp_attention_factor={})
    cost = CostModel(parts, model, cluster, strategy="auto")
    r1 = _single_residuals(cost, groups)
    fixed: dict[str, float] = {}
    per_token: dict[str, float] = {}
    for d, c in sorted({(int(g["degree"]), int(g["cp"])) for g in comp}, key=lambda x: (x[1], x[0])):
        gs = [g for g in comp if int(g["degree"]) == d and int(g["cp"]) == c]
        tokens = np.array([float(sum(g["pack"])) for g in gs])
        res = np.array([g["ms"] - cost.group_ms(g["pack"], d, c) - r1.get(tuple(g["pack"]), 0.0) / d for g in gs])
        if len(set(tokens.tolist())) >= 2:
            o, r = nnls(np.stack([np.ones_like(tokens), tokens], axis=1), res)
        else:
            o, r = max(0.0, float(np.median(res))), 0.0
        key = split_key(d // c, c)
        fixed[key], per_token[key] = float(o) / model.layers, float(r) / model.layers
    fitted = CostModel(dataclasses.replace(profile, split_overhead_ms=fixed, split_token_ms=per_token), model, cluster,
                       strategy="auto")
    bare_cost = CostModel(bare, model, cluster, strategy="auto")
    rows = []
    for g in comp:
        d, c = int(g["degree"]), int(g["cp"])
        rows.append({"degree": d, "cp": c, "split": split_key(d // c, c), "pack": list(g["pack"]),
                     "tokens": int(sum(g["pack"])), "measured_ms": g["ms"], "predicted_ms": bare_cost.group_ms(g["pack"], d, c),
                     "predicted_parts_ms": cost.group_ms(g["pack"], d, c),
                     "predicted_with_overhead_ms": fitted.group_ms(g["pack"], d, c)})
    return fixed, per_token, rows


def _model(name: str):
    from workbench.models import get_model

    return get_model(name)


def _cluster(world: int, zero_stage: int):
    from workbench.specs import ClusterSpec

    # memory never binds here: these cost models re-time what ran, they do not plan it
    return ClusterSpec(num_gpus=world, gpus_per_node=world, gpu_memory_gb=1e6, zero_stage=zero_stage)


def fit_head(heads: list[dict]) -> dict:
    """The head's forward and backward time as lines in the tokens (``fit_line``), from rows
    ``{"tokens", "forward_ms", "backward_ms"}`` (the whole head, one sequence). Returns ``{}`` for
    no rows, else ``{"forward_per_token", "backward_per_token", "forward_intercept",
    "backward_intercept", "points"}`` (ms and ms per token)."""
    pts = [h for h in heads if h.get("forward_ms", 0) > 0 and h.get("backward_ms", 0) > 0]
    if not pts:
        return {}
    toks = [float(h["tokens"]) for h in pts]
    fs, fi = fit_line(toks, [h["forward_ms"] for h in pts])
    bs, bi = fit_line(toks, [h["backward_ms"] for h in pts])
    return {"forward_per_token": fs, "backward_per_token": bs, "forward_intercept": fi, "backward_intercept": bi,
            "points": [{"tokens": int(h["tokens"]), "forward_ms": h["forward_ms"], "backward_ms": h["backward_ms"]}
                       for h in pts]}


def _blocks_only(rows: list[dict], head: dict, layers: int) -> list[dict]:
    """Compute rows with the head's per-token time taken out (its intercept stays, with every
    other per-call constant, in the curves' c); the whole-model figures kept as ``model_*``."""
    if not head:
        return rows
    out = []
    for r in rows:
        r = dict(r)
        t = float(r["tokens"])
        for k in ("forward", "backward"):
            whole = r[f"{k}_ms"]
            r[f"model_{k}_ms"] = whole
            # never below a tenth of the whole: a head measured slower than the model it is part of
            # is noise, and a non-positive time cannot be fitted
            r[f"{k}_ms"] = max(0.1 * whole, whole - head[f"{k}_per_token"] * t / layers)
        out.append(r)
    return out


def _free_group_rows(cost, steps: list[dict]) -> list[dict]:
    """Every group of the free (ZeRO-0) steps: measured (the shortest of its ranks' micro-step
    times: an early rank waits inside the group's first collective) against ``cost``'s
    ``group_time``."""
    import numpy as np

    from workbench.solve.plan import group_time

    out = []
    for c in steps:
        if c.get("execution") != "free":
            continue
        for m, groups in enumerate(c["micro_steps"]):
            for g in groups:
                ls = np.asarray(g["lengths"], dtype=np.int64)
                meas = min(float(c["micro_step_ms"][m][r]) for r in g["ranks"])
                pred = group_time(cost, ls, int(g["degree"]), list(range(len(ls))))
                out.append({"case": c["name"], "micro_step": m, "degree": int(g["degree"]), "ranks": list(g["ranks"]),
                            "tokens": int(ls.sum()), "measured_ms": meas, "predicted_ms": pred})
    return out


def fit_micro_step(profile: HardwareProfile, world: int, steps: list[dict], groups: list[dict]) -> tuple[float | None, list[dict]]:
    """The fixed cost of one micro-step outside the layers (ms): the median of what the runtime's
    real degree-1 micro-steps take beyond ``profile``'s curves and head (free steps: the
    StepExecutor's own micro-steps, ZeRO-0), clipped at 0; without steps, from the degree-1 SP
    micro-steps (``groups``). Returns ``(micro_step_ms or None without points, rows)``; rows hold
    each point's measured and predicted time (without the fixed cost)."""
    from workbench.cost import CostModel

    base = dataclasses.replace(profile, micro_step_ms=None, sp_overhead_ms={}, sp_token_ms={})
    cost = CostModel(base, _model(profile.model), _cluster(world, 0))
    rows = [r for r in _free_group_rows(cost, steps) if r["degree"] == 1]
    if not rows:
        for g in groups:
            if int(g["degree"]) == 1:
                pred = cost.group_ms(g["pack"], 1)
                rows.append({"case": "sp micro-step", "degree": 1, "tokens": int(sum(g["pack"])),
                             "measured_ms": float(g["ms"]), "predicted_ms": pred})
    if not rows:
        return None, []
    return max(0.0, float(statistics.median(r["measured_ms"] - r["predicted_ms"] for r in rows))), rows


def _pass_rows(cost, steps: list[dict]) -> list[dict]:
    """Every pass of the lockstep (ZeRO-3) steps: measured (the slowest rank's: ranks leave a pass
    together, at its last reduce-scatter) against ``cost``'s pass (its slowest rank's load, the
    packed call's constant once per rank)."""
    import numpy as np

    from workbench.solve.plan import group_time

    out = []
    C = cost.call_overhead_ms()
    for c in steps:
        if c.get("execution") != "lockstep":
            continue
        for m, groups in enumerate(c["micro_steps"]):
            load = np.zeros(cost.cluster.num_gpus)
            count = np.zeros(cost.cluster.num_gpus)
            for g in groups:
                ls = np.asarray(g["lengths"], dtype=np.int64)
                load[list(g["ranks"])] += group_time(cost, ls, int(g["degree"]), list(range(len(ls))))
                count[list(g["ranks"])] += 1
            load -= C * np.maximum(count - 1, 0)
            meas = max(float(x) for x in c["micro_step_ms"][m])
            out.append({"case": c["name"], "micro_step": m, "measured_ms": meas, "load_ms": float(load.max()),
                        "predicted_ms": cost.pass_ms(float(load.max()))})
    return out


def fit_pass_overhead(profile: HardwareProfile, world: int, steps: list[dict]) -> tuple[float | None, float | None, list[dict]]:
    """What a lockstep pass on ``world`` ranks costs beyond ``profile``'s pass model without it (its
    slowest rank's load, FSDP's collectives as ``pass_comm_overlap`` says), from real ZeRO-3 passes:
    ``excess = fixed + (factor - 1) * work``, fitted (non-negative least squares) over the passes,
    where ``work`` is what the same pass took as a free micro-step (the free case of the same name,
    measured in the same run: the factor is then the pass's own, not the compute curve's error), or
    the curve's load where there is none (the near-empty pass). Returns ``(fixed ms, factor, rows)``
    (``(None, None, [])`` without lockstep steps; the factor is None with fewer than two distinct
    works, and then the fixed cost is the median excess, clipped at 0)."""
    import numpy as np

    from workbench.cost import CostModel
    from workbench.profile.fit import nnls

    base = dataclasses.replace(profile, pass_overhead_ms={}, pass_compute_factor={})
    cost = CostModel(base, _model(profile.model), _cluster(world, 3))
    rows = _pass_rows(cost, steps)
    if not rows:
        return None, None, []
    # the same micro-step run free: its slowest group, each group's time the shortest of its ranks'
    # (an early rank of a group waits inside its first collective)
    free = {(c["name"].split("-", 1)[-1], m): max(min(float(ms[r]) for r in g["ranks"]) for g in c["micro_steps"][m])
            for c in steps if c.get("execution") == "free" for m, ms in enumerate(c["micro_step_ms"])}
    for r in rows:
        r["work_ms"] = free.get((r["case"].split("-", 1)[-1], r["micro_step"]), r["load_ms"])
        # the pass model without its fixed cost, on that work
        r["excess_ms"] = r["measured_ms"] - cost.pass_ms(r["work_ms"])
    x = np.array([r["work_ms"] for r in rows])
    y = np.array([r["excess_ms"] for r in rows])
    if len(set(np.round(x, 6).tolist())) < 2:
        return max(0.0, float(np.median(y))), None, rows
    fixed, slope = nnls(np.stack([np.ones_like(x), x], axis=1), y)
    return float(fixed), 1.0 + float(slope), rows


def fit_optimizer(steps: list[dict]) -> tuple[float | None, float | None]:
    """The optimizer step per million updated parameters (ms), ``(plain, sharded)``: the median over
    the steps and ranks of ``optimizer_ms / updated_params`` of the free (ZeRO-0) steps and of the
    lockstep (ZeRO-3, FSDP2's DTensor shards) steps; None where there are none."""
    out = []
    for execution in ("free", "lockstep"):
        rates = [1e6 * float(t) / float(n) for c in steps if c.get("execution") == execution
                 for t, n in zip(c.get("optimizer_ms") or [], c.get("updated_params") or []) if n and t > 0]
        out.append(float(statistics.median(rates)) if rates else None)
    return out[0], out[1]


def step_predictions(profile: HardwareProfile, world: int, steps: list[dict]) -> list[dict]:
    """Every real step re-timed with ``profile`` (every fitted term), as evidence: per pass or
    group ``{case, execution, micro_step, degree?, measured_ms, predicted_ms}`` and per step
    ``{case, execution, step: True, measured_ms (slowest rank, optimizer included), predicted_ms}``."""
    from workbench.cost import CostModel
    from workbench.solve.plan import build_plan

    import numpy as np

    out: list[dict] = []
    model = _model(profile.model)
    for stage, execution in ((3, "lockstep"), (0, "free")):
        cases = [c for c in steps if c.get("execution") == execution]
        if not cases:
            continue
        cost = CostModel(profile, model, _cluster(world, stage))
        rows = _pass_rows(cost, cases) if execution == "lockstep" else _free_group_rows(cost, cases)
        out += [{**r, "execution": execution} for r in rows]
        for c in cases:
            lengths: list[int] = []
            assignment = []
            blocks = []
            for groups in c["micro_steps"]:
                ms, bs = [], []
                for g in groups:
                    ms.append((int(g["degree"]), list(range(len(lengths), len(lengths) + len(g["lengths"])))))
                    bs.append(int(g["ranks"][0]) // int(g["degree"]))
                    lengths += [int(x) for x in g["lengths"]]
                assignment.append(ms)
                blocks.append(bs)
            plan = build_plan("profile", assignment, np.asarray(lengths, dtype=np.int64), cost, blocks=blocks,
                              lower_bound=0.0)
            meas = max(float(s) + float(o) for s, o in zip(c["step_ms"], c["optimizer_ms"]))
            out.append({"case": c["name"], "execution": execution, "step": True, "measured_ms": meas,
                        "predicted_ms": plan.makespan_ms, "optimizer_ms": max(c["optimizer_ms"]),
                        "predicted_optimizer_ms": cost.optimizer_ms()})
    return out


def _with_host(profile: HardwareProfile, host: Mapping[str, Any] | None, device: str,
               prov: dict) -> tuple[HardwareProfile, dict]:
    """``profile`` with the host's figures from the measurements' ``host`` entry (see the module
    docstring): ``host_memory_gb``, and on CUDA ``host_link_gbps`` and ``host_link_node_gbps``
    (``fit_host_link``); ``prov`` gains ``host_memory``, ``host_link`` (what was measured, where and
    how, or why there is no figure) and ``host_link_gpus`` (GPUs of a node copying at once).
    Returns ``(profile, {"memory_gb", "link"})``; profiles measured before the host was (no entry)
    come back unchanged with ``{}``."""
    from workbench.profile.fit import fit_host_link

    if not host:
        return profile, {}
    where = prov.get("host") or "the measuring node"
    out: dict = {"memory_gb": None, "link": None}
    mem = host.get("memory_gb")
    if mem:
        out["memory_gb"] = float(mem)
        profile = dataclasses.replace(profile, host_memory_gb=float(mem))
        prov["host_memory"] = (f"host_memory_gb: {float(mem):,.1f} GB, psutil.virtual_memory().total of {where} "
                               f"(GB = 1e9 bytes)")
    link = host.get("link")
    if link:
        f = fit_host_link(link)
        out["link"] = f
        n, a, e = f["ranks_per_node"], f["alone"], f["all"]
        profile = dataclasses.replace(profile, host_link_gbps=f["host_link_gbps"],
                                      host_link_node_gbps=f["host_link_node_gbps"])
        prov["host_link_gpus"] = n
        prov["host_link"] = (
            f"measured on {where} ({profile.gpu}): pinned host memory <-> GPU copies of {f['bytes'] / 2**20:,.0f} MiB "
            f"(non_blocking tensor copies timed by CUDA events, {link.get('warmup', '?')} warm-up + "
            f"{link.get('reps', '?')} timed, median). One GPU alone (rank 0, the others waiting at a barrier): "
            f"host-to-device {a['h2d_gbps']:.1f}, device-to-host {a['d2h_gbps']:.1f} GB/s, host_link_gbps "
            f"{f['host_link_gbps']:.1f} (the slower direction). All {len(e['h2d_gbps'])} rank(s) copying at once: "
            f"the slowest rank {min(e['h2d_gbps']):.1f} host-to-device, {min(e['d2h_gbps']):.1f} device-to-host "
            f"GB/s, x {n} GPU(s) a node = host_link_node_gbps {f['host_link_node_gbps']:.1f}")
    elif device == "cpu":
        prov["host_link"] = ("none: measured on CPU, where there is no host-device link to copy over; host_link_gbps "
                             "is null, so plans made with this profile do not offload activations")
    return profile, out


def build_result(measurements: Mapping[str, Any], *, run_id: str | None = None) -> ProfileResult:
    """Fit ``measurements`` (the shape in the module docstring) into a ProfileResult. Raises
    ValueError when there are too few compute points or a figure is missing."""
    meta = dict(measurements.get("meta") or {})
    rows = [dict(r) for r in measurements.get("compute") or []]
    if not rows:
        raise ValueError("no compute measurements to fit")
    model_name = str(measurements.get("model") or meta.get("model"))
    world = int(measurements.get("world_size") or 1)
    head = fit_head([dict(h) for h in measurements.get("head") or []])
    if head:
        rows = _blocks_only(rows, head, _model(model_name).layers)
    comp = fit_compute(rows)
    coll_pts = [dict(p) for p in measurements.get("collectives") or []]
    links = fit_collectives(coll_pts)
    a2a = {d: f.gbps for d, f in links.get("all_to_all", {}).items()}
    a2a_lat = {d: f.latency_ms for d, f in links.get("all_to_all", {}).items()}
    prov = dict(meta.get("provenance") or {})
    prov.setdefault("kind", "measured")
    prov["profiler_version"] = PROFILER_VERSION
    if not a2a:
        a2a, a2a_lat = dict(ESTIMATED_ALL_TO_ALL_GBPS), {}
        prov["collectives"] = "estimate"
        prov["collectives_note"] = ("all_to_all_gbps is an estimate for gloo on one machine: a profile on one "
                                    "process has no group to measure (run it with --nproc 2 or more)")
    else:
        prov["collectives"] = "measured"
    mem = dict(measurements.get("memory") or {})
    act = mem.get("activation_mb_per_token")
    prov["fit"] = {
        "forward": comp["forward"].errors(), "backward": comp["backward"].errors(),
        "heldout_median_ape": {k: comp["heldout"][k]["median_ape"] for k in ("forward", "backward", "total")},
        "heldout_worst_ape": {k: comp["heldout"][k]["worst_ape"] for k in ("forward", "backward", "total")},
    }
    prov["memory"] = {k: v for k, v in mem.items() if k != "points"}

    def link(kind: str, attr: str) -> dict:
        return {d: getattr(f, attr) for d, f in links.get(kind, {}).items()}

    def with_cp(kind: str, attr: str) -> dict:
        # context parallelism's sub-groups fill the sizes FSDP's world-wide collective does not
        # measure; at the world size (a 1 x world split is the whole world) FSDP's figure stays
        return {**link(f"cp_{kind}", attr), **link(kind, attr)}

    device = str(measurements.get("device") or prov.get("device") or "cpu")
    steps = [dict(c) for c in measurements.get("steps") or []]
    profile = HardwareProfile(
        name=str(meta.get("name") or f"measured-{measurements.get('model', 'model')}"),
        gpu=str(meta.get("gpu") or "unknown"), model=model_name,
        forward=comp["forward"].curve, backward=comp["backward"].curve,
        all_to_all_gbps=a2a, all_to_all_latency_ms=a2a_lat,
        p2p_gbps=link("p2p", "gbps"), p2p_latency_ms=link("p2p", "latency_ms"),
        allreduce_gbps=link("allreduce", "gbps"), allreduce_latency_ms=link("allreduce", "latency_ms"),
        allgather_gbps=with_cp("allgather", "gbps"), allgather_latency_ms=with_cp("allgather", "latency_ms"),
        reduce_scatter_gbps=with_cp("reduce_scatter", "gbps"),
        reduce_scatter_latency_ms=with_cp("reduce_scatter", "latency_ms"),
        head_ms_per_token=(head["forward_per_token"] + head["backward_per_token"]) if head else None,
        # FSDP2 overlaps its collectives with compute only on CUDA streams (prefetching); on CPU it
        # runs them on the compute thread, in the order they are needed
        pass_comm_overlap=(0.0 if device == "cpu" else 1.0) if steps else None,
        activation_mb_per_token=float(act) if act else None,
        gpu_memory_gb=float(meta.get("gpu_memory_gb") or 40.0), provenance=prov)
    if head:
        prov["head"] = ("head_ms_per_token: the embedding, final norm, output head and loss timed alone (forward and "
                        "backward) at several lengths, a line in the tokens; its per-token part is taken out of the "
                        "whole-model times before the per-layer curves are fitted")
    groups = [dict(g) for g in measurements.get("groups") or []]
    micro, micro_rows = fit_micro_step(profile, world, steps, groups)
    if micro is not None:
        profile = dataclasses.replace(profile, micro_step_ms=micro)
        prov["micro_step"] = ("micro_step_ms: the median of what the runtime's real micro-steps of one rank take beyond "
                              "the curves and the head (" + ("free ZeRO-0 steps of the StepExecutor" if steps else
                                                             "the degree-1 SP micro-steps") + ")")
    sp, sp_tok, group_rows = fit_sp_overhead(profile, world, groups)
    if sp:
        prov["sp_overhead"] = ("sp_overhead_ms (per layer) + sp_token_ms (per token and layer): the extra time of real "
                               "Ulysses micro-steps (all blocks at once) beyond the compute and collective fits")
        profile = dataclasses.replace(profile, sp_overhead_ms=sp, sp_token_ms=sp_tok)
    cp_links = sorted(links.get("cp_allgather", {}))
    if cp_links:
        fsdp = sorted(links.get("allgather", {}))
        prov["cp_collectives"] = (
            f"allgather_* and reduce_scatter_* at {', '.join(str(c) for c in cp_links if c not in fsdp) or 'no size'}: "
            f"context parallelism's K/V all-gather and gradient reduce-scatter on the strided CP sub-groups; "
            f"{', '.join(str(c) for c in fsdp) or 'none'}: FSDP's over the world (kept; the CP figure at that size "
            f"is in profile_result.json's collective_fits)")
    cp_fixed, cp_tok, cp_rows, cp_attn = fit_cp_overhead(profile, world, groups)
    if cp_fixed:
        prov["cp_overhead"] = ("cp_overhead_ms (per layer) + cp_token_ms (per token and layer) + cp_attention_factor "
                               "(a fraction of the rank's causal share of the attention, a * s^2 / c): the extra time of "
                               "real 1 x c context-parallel micro-steps (CPAttention, all sub-groups at once) beyond the "
                               "compute and collective fits")
        profile = dataclasses.replace(profile, cp_overhead_ms=cp_fixed, cp_token_ms=cp_tok, cp_attention_factor=cp_attn)
    sp_fixed, sp_tok, split_rows = fit_split_overhead(profile, world, groups)
    if split_rows:
        prov["split_overhead"] = ("split_overhead_ms (per layer) + split_token_ms (per token and layer), by split "
                                  "\"u x c\": the extra time of real composite micro-steps (u > 1 and c > 1) beyond the "
                                  "sum of their parts (compute, collectives, the Ulysses extras at u and the CP extras "
                                  "at c), for exactly that split")
        profile = dataclasses.replace(profile, split_overhead_ms=sp_fixed, split_token_ms=sp_tok)
    # the composite splits' rows are fit_split_overhead's (re-timed with their own residual too)
    group_rows = group_rows + [r for r in cp_rows if r["degree"] == r["cp"]] + split_rows
    fixed, factor, pass_rows = fit_pass_overhead(profile, world, steps)
    if fixed is not None:
        profile = dataclasses.replace(profile, pass_overhead_ms={world: fixed},
                                      pass_compute_factor={world: factor} if factor is not None else {})
        prov["pass_overhead"] = (f"pass_overhead_ms and pass_compute_factor at {world} rank(s): what real ZeRO-3 passes "
                                 f"(FSDP2, idle ranks in empty passes) take beyond FSDP's all-gathers and "
                                 f"reduce-scatters (pass_comm_overlap {profile.pass_comm_overlap:g}) and the same work "
                                 f"as free micro-steps, fitted as a fixed cost plus a share of that work")
    plain, sharded = fit_optimizer(steps)
    alone = measurements.get("optimizer") or {}
    if plain is None and alone.get("ms_per_mparam"):
        plain = float(alone["ms_per_mparam"])
        prov["optimizer"] = (f"optimizer_ms_per_mparam (ZeRO-0 replicas): the {alone.get('optimizer', 'adamw')} step "
                             f"timed alone on fp32 tensors of the model's shapes ({alone['params'] / 1e6:,.0f}M "
                             f"parameters, {alone['ms']:.2f} ms), the real steps being skipped")
        profile = dataclasses.replace(profile, optimizer_ms_per_mparam=plain)
    elif plain is not None or sharded is not None:
        profile = dataclasses.replace(profile, optimizer_ms_per_mparam=plain, sharded_optimizer_ms_per_mparam=sharded)
        opt = next((c.get("optimizer") for c in steps if c.get("optimizer")), "adamw")
        prov["optimizer"] = (f"optimizer_ms_per_mparam (ZeRO-0 replicas) and sharded_optimizer_ms_per_mparam (ZeRO-3 "
                             f"shards): {opt} steps after the real steps, per million parameters the rank updates")
    profile, host = _with_host(profile, measurements.get("host"), device, prov)
    profile = dataclasses.replace(profile, provenance=prov)
    step_rows = step_predictions(profile, world, steps) if steps else []
    if step_rows:
        from workbench.profile.fit import ape, error_summary

        whole = [r for r in step_rows if r.get("step")]
        prov["steps_error"] = error_summary([ape(r["predicted_ms"], r["measured_ms"]) for r in whole])
    return ProfileResult(
        profile=profile, compute=rows, groups=group_rows,
        fits={"forward": comp["forward"].to_dict(), "backward": comp["backward"].to_dict()},
        heldout=comp["heldout"], collectives=coll_pts,
        collective_fits={k: {d: f.to_dict() for d, f in v.items()} for k, v in links.items()},
        memory=mem, run_id=run_id, head=head, host=host,
        steps=step_rows + [{"fit": "micro_step_ms", **r} for r in micro_rows]
        + [{"fit": "pass_overhead_ms", **r} for r in pass_rows])
