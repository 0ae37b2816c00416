"""Checkpoints of a training run: whole files under ZeRO 0-2, sharded folders under ZeRO-3.

Two layouts in ``<run>/checkpoints/``, both written atomically and verified before a resume uses them:

- ``step_<n>.pt`` (ZeRO 0-2): one ``torch.save`` file of the whole state (model weights, the
  optimizer's state dict with every parameter's states, ZeroRedundancyOptimizer's consolidated on
  rank 0), beside its ``step_<n>.pt.sha256``. Written to a temporary file and renamed.
- ``step_<n>.dcp/`` (ZeRO-3): a ``torch.distributed.checkpoint`` folder in which every rank writes
  its shards of the model and optimizer (FSDP2's distributed state dict, keyed by parameter name),
  plus ``trainer.pt`` (step, sampler position, RNG, spec) and ``SHA256SUMS`` (every file's
  checksum, as ``sha256sum`` writes them). Written to ``.step_<n>.dcp.tmp`` and renamed once
  complete, so a crash leaves either the old folder or none.

Either layout resumes under any ZeRO stage and any number of processes: DCP reshards a folder to
the new world (or to whole tensors), and a whole file is loaded by every rank and sharded by FSDP
(``set_state_dict`` with full state dicts). :func:`full_model_state` gives a checkpoint's model
weights as whole tensors under the Transformer's parameter names, without a process group.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from workbench import runs

__all__ = ["CHECKPOINT_FORMAT", "CheckpointError", "checkpoint_path", "checkpoints", "latest_checkpoint",
           "verify_checkpoint", "load_checkpoint", "resume_state", "save_whole", "save_sharded", "restore",
           "full_model_state", "SUMS_FILE", "TRAINER_FILE"]

CHECKPOINT_FORMAT = 1
SUMS_FILE = "SHA256SUMS"
TRAINER_FILE = "trainer.pt"
_NAME = re.compile(r"^step_(\d+)\.(pt|dcp)$")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, damaged or not a workbench checkpoint (the message names it)."""


def checkpoint_path(run_dir: str | Path, step: int, *, sharded: bool = False) -> Path:
    """``run_dir/checkpoints/step_<step>.pt`` (whole) or ``step_<step>.dcp`` (sharded folder)."""
    return Path(run_dir) / runs.CHECKPOINTS_DIR / f"step_{int(step)}.{'dcp' if sharded else 'pt'}"


def checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every checkpoint of a run (files and folders), newest first."""
    return sorted(runs.Run(run_dir).checkpoints(), reverse=True)


def latest_checkpoint(run_dir: str | Path) -> tuple[int, Path] | None:
    """``(step, path)`` of the newest checkpoint of a run (verified or not), or None."""
    found = checkpoints(run_dir)
    return found[0] if found else None


def verify_checkpoint(path: str | Path) -> str | None:
    """None when the checkpoint matches its checksums; otherwise why not, in one line (a missing or
    empty file, a missing checksum, a file that does not match, a folder missing a file)."""
    path = Path(path)
    if not path.is_dir():
        return runs.verify_checksum(path)
    sums = path / SUMS_FILE
    try:
        lines = [ln.split(None, 1) for ln in sums.read_text(encoding="utf-8").splitlines() if ln.strip()]
    except (OSError, UnicodeDecodeError):
        return f"{path} has no readable {SUMS_FILE}"
    listed = {name.strip().lstrip("*"): digest for digest, name in lines}
    if TRAINER_FILE not in listed or not any(n.endswith(".metadata") for n in listed):
        return f"{path}/{SUMS_FILE} does not list {TRAINER_FILE} and the checkpoint's .metadata"
    for name, want in sorted(listed.items()):
        f = path / name
        if not f.is_file():
            return f"{f} is missing"
        if f.stat().st_size == 0:
            return f"{f} is empty"
        got = runs.file_sha256(f)
        if got != want:
            return f"{f} does not match its checksum (sha256 {got[:12]}... expected {want[:12]}...): the file is damaged"
    return None


def _load_file(path: Path, map_location: Any) -> dict:
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the same thing here
        first = str(e).splitlines()[0] if str(e) else ""
        raise CheckpointError(f"checkpoint {path} cannot be loaded ({type(e).__name__}: {first})") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path} is not a workbench checkpoint (format {CHECKPOINT_FORMAT})")
    return state


def load_checkpoint(path: str | Path, map_location: Any = "cpu", *, verify: bool = True) -> dict:
    """A checkpoint's state after checking it against its checksums. A whole file gives
    ``{"format", "step", "model", "optimizer", "sampler", "rng", "spec", ...}``; a sharded folder its
    ``trainer.pt`` (the same without ``model`` and ``optimizer``) plus ``"sharded": <folder>`` (the
    weights stay on disk until :func:`restore`). Raises CheckpointError naming the file when it is
    empty, damaged, unchecksummed (with ``verify``) or not a workbench checkpoint."""
    path = Path(path)
    if verify:
        why = verify_checkpoint(path)
        if why is not None:
            raise CheckpointError(why)
    if path.is_dir():
        state = _load_file(path / TRAINER_FILE, map_location)
        state["sharded"] = str(path)
        return state
    return _load_file(path, map_location)


def resume_state(run_dir: str | Path) -> tuple[int, Path, dict, list[str]] | None:
    """The newest checkpoint that verifies and loads: ``(step, path, state, skipped)`` where
    ``skipped`` says, one line each, which newer checkpoints were passed over and why. None when
    the run has no checkpoint. Raises CheckpointError when it has some but none is usable."""
    found = checkpoints(run_dir)
    if not found:
        return None
    skipped = []
    for step, path in found:
        try:
            return step, path, load_checkpoint(path), skipped
        except CheckpointError as e:
            skipped.append(str(e))
    raise CheckpointError(f"no usable checkpoint in {Path(run_dir) / runs.CHECKPOINTS_DIR}: " + "; ".join(skipped)
                          + "; start a new run")


# ------------------------------------------------------------------------------------------------
# writing
# ------------------------------------------------------------------------------------------------


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def save_whole(path: Path, state: dict) -> None:
    """Write a whole checkpoint and then its checksum, each through a temporary file and a rename: a
    crash leaves either the old pair, or a new file without a checksum (which resume skips). One
    process writes it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        torch.save(state, tmp)
        _fsync(tmp)
        runs.checksum_path(path).unlink(missing_ok=True)
        os.replace(tmp, path)
        runs.write_checksum(path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_sharded(path: Path, model: torch.nn.Module, optimizer, trainer_state: dict) -> None:
    """Write a sharded checkpoint folder (collective: every rank calls it with its model and
    optimizer). Each rank writes its shards into ``.<name>.tmp``; rank 0 then adds ``trainer.pt``
    (``trainer_state``) and ``SHA256SUMS`` and renames the folder into place (replacing an older
    one of the same step). Returns once the folder is in place on every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank = dist.get_rank() if dist.is_initialized() else 0
    tmp = path.with_name(f".{path.name}.tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a half-written folder of a crashed attempt
        tmp.mkdir(parents=True)
    _barrier()
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp))  # every rank its shards; rank 0 .metadata
    _barrier()
    if rank == 0:
        torch.save(trainer_state, tmp / TRAINER_FILE)
        _fsync(tmp / TRAINER_FILE)
        names = sorted(p.name for p in tmp.iterdir() if p.is_file())
        text = "".join(f"{runs.file_sha256(tmp / n)}  {n}\n" for n in names)
        (tmp / SUMS_FILE).write_text(text, encoding="utf-8")
        _fsync(tmp / SUMS_FILE)
        old = path.with_name(f".{path.name}.old")
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)  # a folder rename: atomic on one file system
        shutil.rmtree(old, ignore_errors=True)
    _barrier()


# ------------------------------------------------------------------------------------------------
# reading back into a run (any stage, any world size)
# ------------------------------------------------------------------------------------------------


def _by_name(model: torch.nn.Module, optimizer_state: dict) -> dict:
    """A torch.optim state dict keyed by parameter index (a whole checkpoint's) keyed by parameter
    name instead (DCP's form); the optimizer was built over ``model.parameters()`` in order."""
    names = [n for n, _ in model.named_parameters()]
    groups = [dict(g, params=[names[i] for i in g["params"]]) for g in optimizer_state["param_groups"]]
    return {"state": {names[i]: s for i, s in optimizer_state["state"].items()}, "param_groups": groups}


def restore(state: dict, model: torch.nn.Module, zero) -> None:
    """Load a checkpoint's model and optimizer (``state`` from :func:`load_checkpoint`) into this
    rank's ``model`` and ``zero.optimizer``, whatever the stage and world size it was written with
    (collective when either side is sharded or the optimizer is a ZeroRedundancyOptimizer)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    opt = zero.optimizer
    zero_redundancy = hasattr(opt, "consolidate_state_dict")
    # ZeroRedundancyOptimizer loads a whole (index-keyed) state dict; DCP's helpers need a plain
    # optimizer, so they go through one of the same class over the same parameters
    target = type(opt.optim)(zero.params, **opt.optim.defaults) if zero_redundancy else opt
    if "sharded" in state:
        import torch.distributed.checkpoint as dcp

        msd, osd = get_state_dict(model, target)
        sd = {"model": msd, "optimizer": osd}
        dcp.load(sd, checkpoint_id=state["sharded"], no_dist=not dist.is_initialized())
        set_state_dict(model, target, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
    elif zero.zero_stage == 3:
        opts = StateDictOptions(full_state_dict=True)
        set_state_dict(model, target, model_state_dict=state["model"],
                       optim_state_dict=_by_name(model, state["optimizer"]), options=opts)
    else:
        model.load_state_dict(state["model"])
        target.load_state_dict(state["optimizer"])
    if zero_redundancy:
        opt.load_state_dict(target.state_dict())


def full_model_state(run_dir: str | Path, step: int) -> dict[str, torch.Tensor]:
    """The model weights of the run's checkpoint at ``step`` as whole CPU tensors under the
    Transformer's parameter names (``embed.weight``, ``blocks.0.attn.q_proj.weight``, ...), from
    either layout, verified first; no process group needed. Raises CheckpointError when the run has
    no such checkpoint or it does not verify."""
    found = {s: p for s, p in checkpoints(run_dir)}
    if int(step) not in found:
        have = ", ".join(str(s) for s in sorted(found)) or "none"
        raise CheckpointError(f"run {run_dir} has no checkpoint at step {step} (checkpoints: {have})")
    path = found[int(step)]
    state = load_checkpoint(path)
    if "sharded" not in state:
        return {k: v.detach().cpu() for k, v in state["model"].items()}
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    prefix = "model."
    model = {k[len(prefix):]: torch.empty(tuple(m.size), dtype=m.properties.dtype)
             for k, m in meta.items() if k.startswith(prefix) and hasattr(m, "size")}
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": on purpose, one process
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": model}, checkpoint_id=str(path), no_dist=True)
    return model
