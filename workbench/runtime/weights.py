"""Weights in and out in Hugging Face's format: safetensors checkpoints into the runtime's model,
and a run's checkpoint out as a Hugging Face folder.

* :func:`load_initial_weights` fills a plain, unwrapped :class:`~workbench.runtime.model.Transformer`
  from a safetensors checkpoint (one file, or sharded with its index), strictly: a missing,
  unexpected or mis-shaped tensor is one line naming it (:class:`~workbench.hf.WeightsError`).
* :func:`hf_state_dict` / :func:`from_hf_state_dict` are the state-dict adapter: our names and
  Hugging Face's (the table is :func:`workbench.hf.hf_tensor_shapes`), nothing else changes (the
  model uses transformers' rotate-half rotary layout, so no tensor is permuted).
* :func:`full_model_state` is the one place that reads a run's checkpoint as a full, unsharded
  state dict; :func:`export_run` writes ``config.json`` + safetensors (sharded above
  ``max_shard_bytes``) from it, so the trained model leaves the workbench.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from workbench import hf
from workbench.hf import WeightsError
from workbench.specs import ModelSpec

__all__ = ["load_initial_weights", "hf_state_dict", "from_hf_state_dict", "full_model_state", "export_run",
           "WeightsError", "DTYPES"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""Export dtypes by their Hugging Face ``torch_dtype`` name."""
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
"""transformers' default shard size for ``save_pretrained``."""
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "generation_config.json")


# ------------------------------------------------------------------------------------------------
# the adapter
# ------------------------------------------------------------------------------------------------


def hf_state_dict(state: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Our state dict (``Transformer.state_dict()``) under Hugging Face names, contiguous, in the
    order of :func:`workbench.hf.hf_tensor_shapes`; a tied head is left out (the embedding serves).
    Raises WeightsError naming a tensor the model should have and the state lacks, or one it has
    that the adapter does not know."""
    want = hf.hf_tensor_shapes(spec)
    by_hf = {}
    for name, t in state.items():
        if spec.tied_embeddings and name == "head.weight":
            continue
        try:
            by_hf[hf.to_hf_name(name)] = t
        except KeyError:
            raise WeightsError(f"parameter {name!r} has no Hugging Face name; the adapter in workbench.hf maps "
                               f"only the Llama-family parameters") from None
    missing = [n for n in want if n not in by_hf]
    if missing:
        raise WeightsError(f"the state has no tensor for {missing[0]!r} ({len(missing)} missing); "
                           f"is it a checkpoint of model {spec.name}?")
    out = {}
    for n, shape in want.items():
        t = by_hf[n].detach()
        if tuple(t.shape) != shape:
            raise WeightsError(f"tensor {n!r} has shape {list(t.shape)} but model {spec.name} needs {list(shape)}")
        out[n] = t.contiguous()
    return out


def from_hf_state_dict(tensors: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Hugging Face tensors -> our names (``Transformer.load_state_dict`` input). A tied model gets
    ``head.weight`` = the embedding. Names are assumed checked (:func:`workbench.hf.check_weights`)."""
    out = {}
    for n, t in tensors.items():
        if n == "lm_head.weight" and spec.tied_embeddings:
            continue
        out[hf.from_hf_name(n)] = t
    if spec.tied_embeddings:
        out["head.weight"] = out["embed.weight"]
    return out


# ------------------------------------------------------------------------------------------------
# weights in
# ------------------------------------------------------------------------------------------------


def _read_tensors(path: str | os.PathLike, names: set[str] | None = None) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    files, _ = hf.safetensors_files(path)
    out = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for n in sf.keys():
                    if names is None or n in names:
                        out[n] = sf.get_tensor(n)
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise WeightsError(f"{f}: cannot be read as safetensors ({first})") from None
    return out


@torch.no_grad()
def load_initial_weights(model: torch.nn.Module, path: str | os.PathLike) -> str:
    """Load the safetensors checkpoint at ``path`` into ``model`` (a plain, unwrapped
    ``Transformer``, before any sharding), converting each tensor to its parameter's dtype and
    device. Strict: every parameter is set, nothing is left over.

    Returns one line saying what was loaded. Raises WeightsError with one line naming the first
    missing, unexpected or mis-shaped tensor, a config beside the weights that describes another
    model (:func:`workbench.hf.check_weights`), an unreadable file, a non-finite value, or a tied
    model whose ``lm_head.weight`` differs from its embedding."""
    spec: ModelSpec = model.spec
    info = hf.check_weights(spec, path)
    tensors = _read_tensors(path)
    for n, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise WeightsError(f"{path}: tensor {n!r} holds NaN or infinite values")
    if spec.tied_embeddings and "lm_head.weight" in tensors:
        if not torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]):
            raise WeightsError(f"{path}: lm_head.weight differs from model.embed_tokens.weight but the model ties them "
                               f"(tie_word_embeddings); set tie_word_embeddings false in the config to keep both")
    ours = from_hf_state_dict(tensors, spec)
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, p in params.items():
        p.copy_(ours[name].to(dtype=p.dtype, device=p.device))
    dtypes = "/".join(info["dtypes"])
    files = len(info["files"])
    return (f"weights from {path}: {info['tensors']} tensors ({dtypes}) in {files} file{'s' if files > 1 else ''}"
            f"{', sharded' if info['sharded'] else ''}")


# ------------------------------------------------------------------------------------------------
# weights out
# ------------------------------------------------------------------------------------------------


def full_model_state(run_dir: str | Path, step: int | None = None) -> tuple[int, dict[str, torch.Tensor]]:
    """``(step, state)``: the full (unsharded) model state of a run's checkpoint at ``step`` (None:
    the newest that verifies), under our parameter names, on CPU, whatever layout the run wrote
    (``workbench.runtime.checkpoint.full_model_state`` reads whole files and sharded folders).

    Raises ValueError when the run has no checkpoint, none at ``step`` (listing those it has), or it
    does not verify."""
    from workbench.runtime.checkpoint import checkpoints
    from workbench.runtime.checkpoint import full_model_state as read

    found = checkpoints(run_dir)
    if not found:
        raise ValueError(f"run {run_dir} has no checkpoint; train with --checkpoint-every K (default 100; a "
                         f"checkpoint is always written after the last step unless it is 0)")
    if step is None:
        errors = []
        for s, _ in found:  # newest first
            try:
                return s, read(run_dir, s)
            except Exception as e:  # noqa: BLE001 - CheckpointError; try the next older one
                errors.append(str(e))
        raise ValueError(f"no checkpoint of run {run_dir} verifies: " + "; ".join(errors))
    if int(step) not in {s for s, _ in found}:
        have = ", ".join(str(s) for s in sorted(s for s, _ in found))
        raise ValueError(f"run {run_dir} has no checkpoint at step {step}; it has step(s) {have}")
    try:
        return int(step), read(run_dir, int(step))
    except Exception as e:  # noqa: BLE001 - CheckpointError (damaged, unchecksummed): one line
        raise ValueError(str(e)) from None


def _write_shards(tensors: dict[str, torch.Tensor], out: Path, max_shard_bytes: int, metadata: dict) -> list[str]:
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for n, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][n] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / hf.SINGLE_FILE), metadata=metadata)
        return [hf.SINGLE_FILE]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        save_file(shard, str(out / name), metadata=metadata)
        weight_map.update({n: name for n in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / hf.INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return names


def export_run(run_dir: str | Path, out: str | Path, *, step: int | None = None, dtype: str | None = None,
               max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> dict[str, Any]:
    """Write a run's checkpoint as a Hugging Face model folder ``out``: ``config.json`` (from the
    run's model; token ids carried over from the config it started from) and
    ``model.safetensors`` (or shards with ``model.safetensors.index.json`` above
    ``max_shard_bytes``), plus the run's tokenizer files when it trained with one. ``dtype``:
    float32, bfloat16 or float16 (None: as stored). The folder is written next to ``out`` and
    renamed into place, so a failure leaves nothing half-written.

    Returns ``{"out", "step", "files", "tensors", "dtype", "model", "tokenizer_files"}``. Raises
    ValueError when ``out`` exists and is not an empty folder, the run has no usable checkpoint,
    or the checkpoint does not match the run's model."""
    from workbench.training import read_train_spec

    run_dir = Path(run_dir)
    spec = read_train_spec(run_dir)
    sc = spec.scenario
    model = sc.model_spec()
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} already exists and is not an empty folder; give a new --out folder (nothing is "
                         f"overwritten)")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    step, state = full_model_state(run_dir, step)
    tensors = hf_state_dict(state, model)
    stored = {str(t.dtype).replace("torch.", "") for t in tensors.values()}
    name = dtype or (stored.pop() if len(stored) == 1 else "float32")
    tensors = {n: t.to(DTYPES[name]).contiguous() for n, t in tensors.items()}
    # token ids (bos/eos/pad) of the config the run started from, when there was one
    extra = hf.read_config(sc.model)[0] if hf.looks_like_config_path(sc.model) else {}
    config = hf.config_from_model(model, dtype=name, extra=extra)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.export-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        meta = {"format": "pt", "workbench_run": str(run_dir.resolve()), "workbench_step": str(step)}
        files = _write_shards(tensors, tmp, max_shard_bytes, meta)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tok_files = []
        if sc.tokenizer:
            tp = Path(sc.tokenizer)
            folder = tp if tp.is_dir() else tp.parent
            for f in _TOKENIZER_FILES:
                src = tp if (tp.is_file() and f == "tokenizer.json") else folder / f
                if src.is_file():
                    shutil.copy2(src, tmp / f)
                    tok_files.append(f)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return {"out": str(out), "step": step, "files": files, "tensors": len(tensors), "dtype": name,
            "model": model.name, "params": model.params(), "tokenizer_files": tok_files}
