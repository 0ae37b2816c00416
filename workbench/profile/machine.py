"""This machine's profile: its fingerprint, a cache of quick profiles in the run store, and a note
when a run plans with another machine's.

Predictions hold where the profile was measured. A profile measured here for the process count a
run uses is *this machine's*; the shipped ``cpu-gloo-tiny`` (another machine's 4-rank measurement)
is not. ::

    fp = machine_fingerprint(2)                       # CPU model, cores, torch, device, processes
    mp = ensure_machine_profile(2, root="runs")       # the cached quick profile, or measure it now
    ensure_machine_profile(2, root="runs", reps=2)    # ... measured with 2 samples a pack when there is none
    mp.path, mp.measured, mp.run                      # profile.json, whether it ran now, its profile run
    profile_origin_note(load_profile("cpu-gloo-tiny"), 2)   # "... was measured on another machine ..."

The cache is the run store itself: a machine profile is a quick profile run (kind ``profile``)
whose spec carries the fingerprint; the newest finished one whose ``profile.json`` loads and says
the same fingerprint is reused (whatever sizes measured it: ``SIZING_OPTIONS``), anything else
(another machine, another process count, a failed or damaged run) is passed over and a new one
measured. Pure Python: never imports torch (the torch version comes from the installed package's
metadata).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from workbench import runs

__all__ = ["machine_fingerprint", "profile_fingerprint", "describe_fingerprint", "same_machine", "find_machine_profile",
           "ensure_machine_profile", "MachineProfile", "profile_origin_note", "cpu_name", "MACHINE_MODEL",
           "SIZING_OPTIONS"]

MACHINE_MODEL = "tiny"
"""The model a machine profile times (quick to measure; other models are scaled from it by FLOPs)."""
_KEYS = ("cpu", "cores", "torch", "device", "nproc")
SIZING_OPTIONS = ("max_len", "fit_packs", "heldout_packs", "group_packs", "warmup", "reps", "trim", "message_bytes",
                  "collective_reps", "collective_inner", "min_sample_ms", "timeout_s")
"""The ``workbench.profile.ProfileSpec`` fields :func:`ensure_machine_profile` takes to size a new
measurement: how many lengths, samples and message sizes it times, not what it prices (every
machine profile measures the same terms, so any of them plans a run here)."""


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``; elsewhere what ``platform`` says)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _torch_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "none"


def _key(fp: Mapping[str, Any]) -> str:
    text = json.dumps({k: fp.get(k) for k in _KEYS}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def machine_fingerprint(nproc: int, *, device: str = "cpu") -> dict:
    """What a profile must have been measured on to predict runs of ``nproc`` processes here:
    ``{"cpu", "cores", "torch", "device", "nproc", "key"}`` (``key``: a short hash of the rest).
    ``device`` is ``cpu`` or ``cuda`` (then the GPU's name, from ``nvidia-smi``, joins it)."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    dev = device
    if device == "cuda":
        import shutil
        import subprocess

        exe = shutil.which("nvidia-smi")
        name = ""
        if exe:
            try:
                p = subprocess.run([exe, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                                   timeout=10)
                name = p.stdout.strip().splitlines()[0] if p.returncode == 0 and p.stdout.strip() else ""
            except (OSError, subprocess.TimeoutExpired, IndexError):
                name = ""
        dev = f"cuda {name}".strip()
    fp = {"cpu": cpu_name(), "cores": int(os.cpu_count() or 1), "torch": _torch_version(), "device": dev,
          "nproc": int(nproc)}
    fp["key"] = _key(fp)
    return fp


def profile_fingerprint(profile) -> dict | None:
    """The fingerprint a profile was measured with: its provenance's own (profiles measured as a
    machine profile), else one read from a measured profile's provenance (CPU name and cores from
    its ``gpu`` field, torch version, device, world size); None for a reference or estimate."""
    prov = profile.provenance or {}
    if isinstance(prov.get("fingerprint"), Mapping):
        fp = {k: prov["fingerprint"].get(k) for k in _KEYS}
        fp["key"] = _key(fp)
        return fp
    if prov.get("kind") != "measured":
        return None
    m = re.match(r"^CPU (.*) \((\d+) cores\)$", str(profile.gpu or ""))
    dev = str(prov.get("device") or ("cpu" if m else "cuda"))
    fp = {"cpu": m.group(1) if m else None, "cores": int(m.group(2)) if m else None,
          "torch": (prov.get("versions") or {}).get("torch"),
          "device": dev if dev == "cpu" else f"cuda {profile.gpu}".strip(), "nproc": prov.get("world_size")}
    fp["key"] = _key(fp)
    return fp


def describe_fingerprint(fp: Mapping[str, Any] | None) -> str:
    """One phrase naming a fingerprint: ``Intel Xeon (2 cores), torch 2.13.0+cpu, cpu, 2 processes``."""
    if not fp:
        return "an unknown machine"
    cores = f" ({fp.get('cores')} cores)" if fp.get("cores") else ""
    n = fp.get("nproc")
    return (f"{fp.get('cpu') or 'an unknown CPU'}{cores}, torch {fp.get('torch') or '?'}, {fp.get('device') or '?'}, "
            f"{n if n is not None else '?'} process{'es' if n != 1 else ''}")


def _same(k: str, a: Any, b: Any) -> bool:
    """One key of two fingerprints alike: torch versions without their local tag (a CUDA image's
    package metadata says ``2.11.0`` where ``torch.__version__`` says ``2.11.0+cu130``; the device
    key tells the builds apart)."""
    if k == "torch" and a and b:
        return str(a).split("+")[0] == str(b).split("+")[0]
    return a == b


def _differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    return [k for k in _KEYS if not _same(k, a.get(k), b.get(k))]


def same_machine(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> bool:
    """Whether two fingerprints name the same machine and process count."""
    return bool(a) and bool(b) and not _differences(a, b)


def profile_origin_note(profile, nproc: int, *, device: str = "cpu", fingerprint: Mapping[str, Any] | None = None) -> str | None:
    """None when ``profile`` was measured on this machine (``fingerprint``, default
    :func:`machine_fingerprint` of ``nproc`` on ``device``) for this process count; else one
    sentence saying whose it is and how to measure this one."""
    here = dict(fingerprint) if fingerprint else machine_fingerprint(nproc, device=device)
    theirs = profile_fingerprint(profile)
    if same_machine(here, theirs):
        return None
    prov = profile.provenance or {}
    if theirs is None:
        where = f"a {prov.get('kind') or 'reference'} profile ({prov.get('source') or profile.gpu})"
    else:
        diff = _differences(here, theirs)
        what = {"cpu": "CPU", "cores": "cores", "torch": "torch version", "device": "device",
                "nproc": "process count"}
        where = f"measured on {describe_fingerprint(theirs)} (differs in {', '.join(what[k] for k in diff)})"
    return (f"profile {profile.name} is from another machine: {where}; this run is {describe_fingerprint(here)}, so "
            f"its predicted times may not hold here. Measure this machine with `workbench profile --quick --nproc "
            f"{here.get('nproc')}` (the demo and the Launch panel do it for you)")


@dataclass(frozen=True)
class MachineProfile:
    """This machine's profile for a process count: its ``profile.json``, the profile run holding it,
    whether it was ``measured`` just now (False: reused from the cache), and the fingerprint."""

    path: Path
    run: runs.Run
    measured: bool
    fingerprint: dict
    seconds: float = 0.0

    def describe(self) -> str:
        how = (f"measured now ({self.seconds:.0f} s)" if self.measured
               else f"reused from the cache (profile run {self.run.id})")
        return f"this machine's quick profile for {self.fingerprint.get('nproc')} process(es), {how}"


def find_machine_profile(nproc: int, *, root: str | Path | None = None, device: str = "cpu",
                         model: str = MACHINE_MODEL, fingerprint: Mapping[str, Any] | None = None) -> MachineProfile | None:
    """The newest finished machine profile in the run store for this fingerprint (``nproc`` on
    ``device``, ``model``) whose ``profile.json`` loads and carries the same fingerprint; None when
    there is none. Damaged, failed or foreign entries are passed over, and so are profiles of more
    than one process measured by an older profiler (``profiler_version`` below
    ``PROFILER_VERSION``: they lack what plans now price, such as context parallelism's terms)."""
    from workbench.profile.result import PROFILER_VERSION
    from workbench.specs import load_profile

    fp = dict(fingerprint) if fingerprint else machine_fingerprint(nproc, device=device)
    for run in reversed(runs.list_runs(root, kind="profile")):
        try:
            spec = run.spec()
            if not isinstance(spec.get("fingerprint"), Mapping) or not same_machine(spec["fingerprint"], fp):
                continue
            if spec.get("model") != model or run.status().state != "done":
                continue
            path = run.file(runs.PROFILE_FILE)
            prof = load_profile(path)
        except (ValueError, OSError):  # a damaged entry: measured again, never trusted
            continue
        outdated = int(nproc) > 1 and int((prof.provenance or {}).get("profiler_version") or 1) < PROFILER_VERSION
        if prof.model == model and same_machine(profile_fingerprint(prof), fp) and not outdated:
            return MachineProfile(path=path, run=run, measured=False, fingerprint=fp)
    return None


def ensure_machine_profile(nproc: int, *, root: str | Path | None = None, device: str = "cpu",
                           model: str = MACHINE_MODEL, progress: Callable[[float, str], None] | None = None,
                           timeout: float = 900.0, poll: float = 0.5, **options: Any) -> MachineProfile:
    """This machine's quick profile for ``nproc`` processes: the cached one
    (:func:`find_machine_profile`), or a quick profile run measured now (a torchrun tree through
    the launcher, oversubscribed when ``nproc`` exceeds the cores, as such a training run is),
    ``progress(fraction, message)`` called while it runs. Returns a MachineProfile. Raises
    RuntimeError (one line, naming the profile run) when the measurement fails or takes longer than
    ``timeout`` seconds (it is stopped), ValueError for bad arguments.

    ``options`` size a new measurement: the ``ProfileSpec`` fields of :data:`SIZING_OPTIONS`, e.g.
    ``reps=2`` or ``max_len=1024`` for a quicker, noisier one (default: the quick grid; they are
    kept in the profile run's spec). They are checked before the cache is read, and they do not
    decide which profile is reused: a cached profile is this machine's whatever sizes measured it
    (the fingerprint says whose machine it is; the sizes change how much is timed, not what). To
    measure again with other sizes, remove the cached profile run."""
    from workbench.launch import process
    from workbench.profile import ProfileSpec, prepare_profile, start_profile

    other = sorted(set(options) - set(SIZING_OPTIONS))
    if other:
        raise ValueError(f"this machine's profile cannot be measured with option(s) {', '.join(other)}: only its sizes "
                         f"are chosen ({', '.join(SIZING_OPTIONS)}); to plan with a profile measured otherwise, "
                         f"measure it with `workbench profile` and give it as the run's profile")
    ProfileSpec(model=model, nproc=nproc, quick=True, device=device, **options)  # ValueError naming a bad value
    fp = machine_fingerprint(nproc, device=device)
    found = find_machine_profile(nproc, root=root, device=device, model=model, fingerprint=fp)
    if found is not None:
        if progress is not None:
            progress(1.0, f"reusing this machine's profile {found.run.id}")
        return found
    t0 = time.monotonic()
    run = prepare_profile(nproc=nproc, model=model, quick=True, root=root, device=device,
                          oversubscribe=nproc > (os.cpu_count() or 1), fingerprint=fp,
                          command=f"this machine's quick profile for {nproc} process(es) (workbench.profile.machine)",
                          **options)
    handle = start_profile(run, stop_with_parent=True)
    last = None
    while True:
        st = process.poll(handle)
        cur = st or run.status()
        if progress is not None and (cur.progress, cur.message) != last:
            last = (cur.progress, cur.message)
            progress(float(cur.progress or 0.0), cur.message or cur.state)
        if st is not None:
            break
        if time.monotonic() - t0 > timeout:
            process.stop(handle)
            raise RuntimeError(f"measuring this machine (profile run {run.id}) took over {timeout:.0f} s; stopped it")
        time.sleep(poll)
    if st.state != "done" or not run.file(runs.PROFILE_FILE).is_file():
        raise RuntimeError(f"measuring this machine failed (profile run {run.id}, {st.state}): "
                           f"{str(st.error or 'no profile written').splitlines()[0]}")
    return MachineProfile(path=run.file(runs.PROFILE_FILE), run=run, measured=True, fingerprint=fp,
                          seconds=time.monotonic() - t0)
