"""From measurements to a HardwareProfile and the evidence shown next to it: pure, no torch.

``measurements`` is what the measuring ranks hand over (plain JSON, kept in the run folder as
``measurements.json``)::

    {"model": "tiny", "world_size": 4, "device": "cpu", "scope": "model",
     "compute": [{"pack": [..], "tokens": n, "role": "fit"|"heldout", "forward_ms": per layer,
                  "backward_ms": per layer, "per_rank": {...}}],
     "collectives": [{"kind": "all_to_all"|"allreduce"|"p2p", "group_size": d, "message_bytes": m,
                      "ms": t, "per_rank": [...]}],
     "groups": [{"degree": d, "pack": [..], "ms": whole-model micro-step, "per_rank": [...]}],
     "memory": {"activation_mb_per_token": x, "model_state_mb": y, "method": "..."},
     "meta": {"name", "gpu", "gpu_memory_gb", "provenance": {...}}}

:func:`build_result` fits it (``workbench.profile.fit``) into a :class:`ProfileResult`: the profile,
plus every point and curve the figures draw.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from workbench.profile.fit import fit_collectives, fit_compute
from workbench.specs import HardwareProfile

__all__ = ["ProfileResult", "build_result", "fit_sp_overhead", "ESTIMATED_ALL_TO_ALL_GBPS", "RESULT_FILE", "MEASUREMENTS_FILE"]

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
    - ``groups``: real SP micro-steps per degree and pack: ``{degree, pack, tokens, measured_ms,
      predicted_ms (compute + collectives), predicted_with_overhead_ms (+ the fitted sp_overhead)}``.
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
                "memory": self.memory, "groups": self.groups, "run_id": self.run_id}

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
                   run_id=data.get("run_id"))

    def to_json(self, **kw) -> str:
        from workbench.util import dumps

        return dumps(self.to_dict(), **kw)


def fit_sp_overhead(profile: HardwareProfile, world: int, groups: list[dict]) -> tuple[dict, dict, list[dict]]:
    """The extra time of a Ulysses group of each size beyond what the profile's compute and
    collective fits predict, from real micro-steps ``groups`` (``{"degree", "pack", "ms"}``, whole
    model). For degree d and a pack, the residual is measured - predicted, less the same pack's
    degree-1 residual divided by d (the compute curve's own error on it). Per degree the residuals
    are fitted as ``layers * (o + r * tokens)`` with o, r >= 0 (least squares; r = 0 when the packs
    have one token count). Returns ``({degree: o, ms per layer}, {degree: r, ms per token and
    layer}, rows)``; rows hold every case's measured and predicted time, before and after."""
    import dataclasses

    import numpy as np

    from workbench.cost import CostModel
    from workbench.profile.fit import nnls
    from workbench.specs import ClusterSpec, get_model

    if not groups:
        return {}, {}, []
    model = get_model(profile.model)
    base = dataclasses.replace(profile, sp_overhead_ms={}, sp_token_ms={})
    cost = CostModel(base, model, ClusterSpec(num_gpus=world, gpus_per_node=world, gpu_memory_gb=1e6))

    def pred(d: int, pack) -> float:
        return cost.group_overhead_ms(d) + float(cost.time(pack, d).sum())

    r1 = {tuple(g["pack"]): g["ms"] - pred(1, g["pack"]) for g in groups if g["degree"] == 1}
    fixed: dict[int, float] = {}
    per_token: dict[int, float] = {}
    for d in sorted({int(g["degree"]) for g in groups if g["degree"] > 1}):
        gs = [g for g in groups if g["degree"] == d]
        tokens = np.array([float(sum(g["pack"])) for g in gs])
        res = np.array([g["ms"] - pred(d, g["pack"]) - r1.get(tuple(g["pack"]), 0.0) / d for g in gs])
        if len(set(tokens.tolist())) >= 2:
            o, r = nnls(np.stack([np.ones_like(tokens), tokens], axis=1), res)
        else:
            o, r = max(0.0, float(np.median(res))), 0.0
        fixed[d], per_token[d] = float(o) / model.layers, float(r) / model.layers
    rows = []
    for g in groups:
        d = int(g["degree"])
        p0 = pred(d, g["pack"])
        extra = model.layers * (fixed.get(d, 0.0) + per_token.get(d, 0.0) * sum(g["pack"]))
        rows.append({"degree": d, "pack": list(g["pack"]), "tokens": int(sum(g["pack"])), "measured_ms": g["ms"],
                     "predicted_ms": p0, "predicted_with_overhead_ms": p0 + extra})
    return fixed, per_token, rows


def build_result(measurements: Mapping[str, Any], *, run_id: str | None = None) -> ProfileResult:
    """Fit ``measurements`` (the shape in the module docstring) into a ProfileResult. Raises
    ValueError when there are too few compute points or a figure is missing."""
    meta = dict(measurements.get("meta") or {})
    rows = [dict(r) for r in measurements.get("compute") or []]
    if not rows:
        raise ValueError("no compute measurements to fit")
    comp = fit_compute(rows)
    coll_pts = [dict(p) for p in measurements.get("collectives") or []]
    links = fit_collectives(coll_pts)
    a2a = {d: f.gbps for d, f in links.get("all_to_all", {}).items()}
    a2a_lat = {d: f.latency_ms for d, f in links.get("all_to_all", {}).items()}
    prov = dict(meta.get("provenance") or {})
    prov.setdefault("kind", "measured")
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
    profile = HardwareProfile(
        name=str(meta.get("name") or f"measured-{measurements.get('model', 'model')}"),
        gpu=str(meta.get("gpu") or "unknown"), model=str(measurements.get("model") or meta.get("model")),
        forward=comp["forward"].curve, backward=comp["backward"].curve,
        all_to_all_gbps=a2a, all_to_all_latency_ms=a2a_lat,
        p2p_gbps={d: f.gbps for d, f in links.get("p2p", {}).items()},
        p2p_latency_ms={d: f.latency_ms for d, f in links.get("p2p", {}).items()},
        allreduce_gbps={d: f.gbps for d, f in links.get("allreduce", {}).items()},
        allreduce_latency_ms={d: f.latency_ms for d, f in links.get("allreduce", {}).items()},
        activation_mb_per_token=float(act) if act else None,
        gpu_memory_gb=float(meta.get("gpu_memory_gb") or 40.0), provenance=prov)
    groups = [dict(g) for g in measurements.get("groups") or []]
    sp, sp_tok, group_rows = fit_sp_overhead(profile, int(measurements.get("world_size") or 1), groups)
    if sp:
        import dataclasses

        prov["sp_overhead"] = ("sp_overhead_ms (per layer) + sp_token_ms (per token and layer): the extra time of real "
                               "Ulysses micro-steps (all blocks at once) beyond the compute and collective fits")
        profile = dataclasses.replace(profile, sp_overhead_ms=sp, sp_token_ms=sp_tok, provenance=prov)
    return ProfileResult(
        profile=profile, compute=rows, groups=group_rows,
        fits={"forward": comp["forward"].to_dict(), "backward": comp["backward"].to_dict()},
        heldout=comp["heldout"], collectives=coll_pts,
        collective_fits={k: {d: f.to_dict() for d, f in v.items()} for k, v in links.items()},
        memory=mem, run_id=run_id)
