"""Hugging Face interop without torch: ``config.json`` <-> ModelSpec, tensor names <-> ours, and
what a safetensors checkpoint holds.

* :func:`model_from_config` reads a Llama-family ``config.json`` (Llama 2/3/3.1/3.2, Mistral without
  a sliding window, Qwen2/2.5) into a :class:`~workbench.specs.ModelSpec`; anything else (MoE, a
  sliding window, an unknown ``model_type``, a missing field, a rope scaling other than Llama 3.1's)
  is refused with one line naming the field and what is supported. :func:`config_from_model` is
  the way back (what ``workbench export`` writes).
* :func:`hf_tensor_shapes` is the state-dict adapter's table: every Hugging Face tensor name of a
  model with its shape; :func:`to_hf_name` / :func:`from_hf_name` map names one by one (the
  runtime's ``Transformer`` keeps its own short names; see ``workbench.runtime.weights``).
* :func:`safetensors_files` finds a checkpoint's files (one ``.safetensors`` file, a folder with
  ``model.safetensors``, or a sharded folder with its ``model.safetensors.index.json``);
  :func:`read_safetensors_header` reads one file's tensor table (names, dtypes, shapes) from its
  JSON header; :func:`check_weights` checks a checkpoint against a model strictly, by headers only.

Pure Python: planning and ``prepare_train`` use it without importing torch.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import struct
from pathlib import Path
from typing import Any, Mapping

from workbench.specs import ModelSpec, RopeScaling

__all__ = [
    "SUPPORTED",
    "looks_like_config_path",
    "config_path",
    "read_config",
    "model_from_config",
    "model_from_config_dict",
    "config_from_model",
    "to_hf_name",
    "from_hf_name",
    "hf_tensor_shapes",
    "safetensors_files",
    "read_safetensors_header",
    "check_weights",
    "WeightsError",
]

SUPPORTED = "llama (Llama 2, 3, 3.1, 3.2), mistral (without a sliding window), qwen2 (Qwen2, Qwen2.5)"
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "dbrx", "jamba", "olmoe",
              "granitemoe", "phimoe", "llama4")
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size", "num_experts_per_tok")
# what a field means, for "missing field" lines
_FIELD_HELP = {
    "hidden_size": "model width", "intermediate_size": "SwiGLU inner width", "num_hidden_layers": "blocks",
    "num_attention_heads": "query heads", "num_key_value_heads": "key/value heads", "vocab_size": "vocabulary size",
    "max_position_embeddings": "longest context",
}
# transformers' own defaults for the optional fields, per model_type (what it would load)
_DEFAULTS = {
    "llama": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0},
    "mistral": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0},
    "qwen2": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0},
}


class WeightsError(ValueError):
    """A checkpoint that does not match the model (missing, unexpected or mis-shaped tensor), or
    cannot be read."""


# ------------------------------------------------------------------------------------------------
# config.json -> ModelSpec
# ------------------------------------------------------------------------------------------------


def looks_like_config_path(text: str) -> bool:
    """Whether ``text`` names a file or folder (rather than a preset): it exists, ends in
    ``.json``, or holds a path separator."""
    t = text.strip()
    if not t:
        return False
    if "/" in t or os.sep in t or t.lower().endswith(".json") or t.startswith("~"):
        return True
    try:
        return Path(t).exists()
    except (OSError, ValueError):
        return False


def config_path(path: str | os.PathLike) -> Path:
    """The ``config.json`` that ``path`` names: the file itself, or ``path/config.json`` for a
    folder. Raises ValueError when neither exists."""
    p = Path(os.path.expanduser(os.fspath(path)))
    if p.is_dir():
        cand = p / "config.json"
        if not cand.is_file():
            raise ValueError(f"{p}: the folder holds no config.json; give a Hugging Face model folder or its config.json")
        return cand
    if not p.is_file():
        raise ValueError(f"{p}: no such file or folder; give a preset name or the path of a Hugging Face config.json")
    return p


def read_config(path: str | os.PathLike) -> tuple[dict, Path]:
    """``(config dict, config.json path)``. Raises ValueError naming the file when it cannot be
    read or is not a JSON object."""
    p = config_path(path)
    try:
        data = json.loads(p.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{p}: cannot be read ({getattr(e, 'strerror', None) or e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{p}: expected a JSON object (a Hugging Face config.json), got {type(data).__name__}")
    return data, p


def model_from_config(path: str | os.PathLike) -> ModelSpec:
    """The ModelSpec of a Hugging Face ``config.json`` (the file, or a folder holding it), named
    after its folder. Cached by the file's path, size and modification time. Raises ValueError
    with one line naming the file and the field that is not supported or missing."""
    p = config_path(path)
    st = p.stat()
    return _model_cached(str(p.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _model_cached(path: str, size: int, mtime_ns: int) -> ModelSpec:
    data, p = read_config(path)
    name = p.parent.name or p.stem
    return model_from_config_dict(data, name=name, where=str(p))


def _num(cfg: Mapping, key: str, where: str, *, kind=int, default: Any = None, required: bool = False):
    v = cfg.get(key, None)
    if v is None:
        if required:
            what = _FIELD_HELP.get(key, "")
            raise ValueError(f"{where}: missing field {key!r}{f' ({what})' if what else ''}; a Llama-family config "
                             f"needs hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, "
                             f"num_key_value_heads, vocab_size and max_position_embeddings")
        return default
    if kind is int:
        ok = isinstance(v, int) and not isinstance(v, bool) and v > 0
    else:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
    if not ok:
        raise ValueError(f"{where}: field {key!r} must be a positive {'integer' if kind is int else 'number'}, got {v!r}")
    return kind(v)


def _rope(cfg: Mapping, mt: str, where: str) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, scaling)`` from either config style: transformers 4's ``rope_theta`` +
    ``rope_scaling``, or transformers 5's ``rope_parameters`` holding both."""
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping) and params and all(isinstance(v, Mapping) for v in params.values()):
        raise ValueError(f"{where}: per-layer rope_parameters (several attention kinds) are not supported; "
                         f"supported: one rotary setting for every layer")
    scaling = cfg.get("rope_scaling")
    if isinstance(params, Mapping):
        theta = params.get("rope_theta", cfg.get("rope_theta"))
        scaling = scaling or params
    else:
        theta = cfg.get("rope_theta")
    if theta is None:
        theta = _DEFAULTS[mt]["rope_theta"]
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not theta > 0:
        raise ValueError(f"{where}: field 'rope_theta' must be a positive number, got {theta!r}")
    if not scaling:
        return float(theta), None
    if not isinstance(scaling, Mapping):
        raise ValueError(f"{where}: field 'rope_scaling' must be an object or null, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    prf = scaling.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if prf not in (None, 1, 1.0):
        raise ValueError(f"{where}: partial_rotary_factor {prf} is not supported; supported: rotary on the whole head (1.0)")
    if kind in (None, "default"):
        return float(theta), None
    if kind != "llama3":
        raise ValueError(f"{where}: rope_scaling type {kind!r} is not supported; supported: llama3 (Llama 3.1 style) "
                         f"or none")
    need = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in need if scaling.get(k) is None]
    if missing:
        raise ValueError(f"{where}: rope_scaling of type llama3 misses {', '.join(repr(k) for k in missing)}")
    try:
        rs = RopeScaling(factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
                         high_freq_factor=float(scaling["high_freq_factor"]),
                         original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: rope_scaling: {e}") from None
    return float(theta), rs


def model_from_config_dict(cfg: Mapping[str, Any], *, name: str = "hf-model", where: str = "config.json") -> ModelSpec:
    """The ModelSpec of a config dict (see :func:`model_from_config`). ``where`` names it in errors.

    Refused, each with one line: a ``model_type`` other than llama, mistral or qwen2 (MoE types
    named as such); expert fields; ``sliding_window`` (Mistral) or ``use_sliding_window`` (Qwen2);
    layer types other than full attention; an activation other than SiLU; Llama's
    ``attention_bias`` (a bias on the output projection too) or ``mlp_bias``; a rope scaling
    other than Llama 3.1's; a partial rotary factor; a missing shape field."""
    mt = cfg.get("model_type")
    if mt is None:
        raise ValueError(f"{where}: missing field 'model_type'; supported: {SUPPORTED}")
    if mt in _MOE_TYPES or any(cfg.get(k) for k in _MOE_KEYS):
        key = next((k for k in _MOE_KEYS if cfg.get(k)), "model_type")
        raise ValueError(f"{where}: {mt!r} is a mixture-of-experts model ({key} = {cfg.get(key)!r}), which is not "
                         f"supported; supported: dense {SUPPORTED}")
    if mt not in _ARCHITECTURES:
        raise ValueError(f"{where}: model_type {mt!r} is not supported; supported: {SUPPORTED}")
    archs = cfg.get("architectures")
    if archs:
        bad = [a for a in archs if a != _ARCHITECTURES[mt]]
        if bad:
            raise ValueError(f"{where}: architectures {bad} is not supported; supported: {_ARCHITECTURES[mt]} "
                             f"(a causal language model) for model_type {mt!r}")
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"{where}: hidden_act {act!r} is not supported; supported: silu (SwiGLU)")
    if mt == "mistral" and cfg.get("sliding_window") is not None:
        raise ValueError(f"{where}: sliding_window {cfg['sliding_window']} (sliding-window attention) is not supported; "
                         f"supported: full attention (set sliding_window to null)")
    if mt == "qwen2" and cfg.get("use_sliding_window"):
        raise ValueError(f"{where}: use_sliding_window true (sliding-window attention) is not supported; supported: "
                         f"full attention (use_sliding_window false)")
    layer_types = cfg.get("layer_types") or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        raise ValueError(f"{where}: layer_types {other} are not supported; supported: full_attention in every layer")
    if mt == "llama" and cfg.get("attention_bias"):
        raise ValueError(f"{where}: attention_bias true (a bias on q, k, v and the output projection) is not "
                         f"supported; supported: no attention bias (llama, mistral) or q/k/v bias (qwen2)")
    if cfg.get("mlp_bias"):
        raise ValueError(f"{where}: mlp_bias true is not supported; supported: SwiGLU without biases")
    hidden = _num(cfg, "hidden_size", where, required=True)
    ffn = _num(cfg, "intermediate_size", where, required=True)
    layers = _num(cfg, "num_hidden_layers", where, required=True)
    heads = _num(cfg, "num_attention_heads", where, required=True)
    # transformers' LlamaConfig makes a missing num_key_value_heads equal to the heads; Mistral's
    # and Qwen2's defaults differ by version, so there it must be given
    kv = _num(cfg, "num_key_value_heads", where, required=mt != "llama", default=heads)
    vocab = _num(cfg, "vocab_size", where, required=True)
    ctx = _num(cfg, "max_position_embeddings", where, required=True)
    head_dim = _num(cfg, "head_dim", where, default=0)
    eps = _num(cfg, "rms_norm_eps", where, kind=float, default=_DEFAULTS[mt]["rms_norm_eps"])
    theta, scaling = _rope(cfg, mt, where)
    dtype = cfg.get("dtype", cfg.get("torch_dtype"))
    tied = cfg.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):
        raise ValueError(f"{where}: field 'tie_word_embeddings' must be true or false, got {tied!r}")
    if heads % kv:
        raise ValueError(f"{where}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv})")
    try:
        return ModelSpec(name=name, layers=layers, hidden=hidden, heads=heads, kv_heads=kv, ffn=ffn, vocab=vocab,
                         max_context=ctx, dtype_bytes=4 if dtype == "float32" else 2, tied_embeddings=tied,
                         head_dim=head_dim, qkv_bias=mt == "qwen2", rope_theta=theta, rope_scaling=scaling,
                         norm_eps=eps, family=mt)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def config_from_model(spec: ModelSpec, *, dtype: str | None = None, extra: Mapping[str, Any] | None = None) -> dict:
    """A Hugging Face ``config.json`` dict for ``spec`` (transformers 4 style, which transformers 5
    reads too): ``model_type`` = ``spec.family``, every shape field, rotary base and scaling, norm
    epsilon, tied embeddings, ``dtype``/``torch_dtype``. ``extra`` (e.g. token ids from
    the config the run started from) is added where it does not describe the architecture. ``dtype``
    None: float32 for a 4-byte model, else bfloat16."""
    dtype = dtype or ("float32" if spec.dtype_bytes == 4 else "bfloat16")
    cfg: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[spec.family]],
        "model_type": spec.family,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.ffn,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab,
        "max_position_embeddings": spec.max_context,
        "rms_norm_eps": spec.norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": (dict(spec.rope_scaling.to_dict()) if spec.rope_scaling is not None else None),
        "hidden_act": "silu",
        "tie_word_embeddings": spec.tied_embeddings,
        "torch_dtype": dtype,
        "dtype": dtype,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if spec.family == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    elif spec.family == "mistral":
        cfg["sliding_window"] = None
    else:  # qwen2
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=spec.layers)
    for k, v in dict(extra or {}).items():
        if k not in cfg and k in ("bos_token_id", "eos_token_id", "pad_token_id", "_name_or_path"):
            cfg[k] = v
    return cfg


# ------------------------------------------------------------------------------------------------
# tensor names: the state-dict adapter (ours <-> Hugging Face)
# ------------------------------------------------------------------------------------------------

# ours (workbench.runtime.model.Transformer) -> Hugging Face, for the parts inside a block
_BLOCK_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.q_proj.bias": "self_attn.q_proj.bias",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.k_proj.bias": "self_attn.k_proj.bias",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.v_proj.bias": "self_attn.v_proj.bias",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}
_BLOCK_MAP_BACK = {v: k for k, v in _BLOCK_MAP.items()}
_TOP_MAP = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight", "head.weight": "lm_head.weight"}
_TOP_MAP_BACK = {v: k for k, v in _TOP_MAP.items()}
_OURS_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")
_HF_BLOCK = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def to_hf_name(name: str) -> str:
    """Our parameter name -> the Hugging Face one (``blocks.3.attn.q_proj.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``). Raises KeyError for a name the adapter does not know."""
    if name in _TOP_MAP:
        return _TOP_MAP[name]
    m = _OURS_BLOCK.match(name)
    if m and m.group(2) in _BLOCK_MAP:
        return f"model.layers.{m.group(1)}.{_BLOCK_MAP[m.group(2)]}"
    raise KeyError(name)


def from_hf_name(name: str) -> str:
    """A Hugging Face tensor name -> ours. Raises KeyError for a name the adapter does not know."""
    if name in _TOP_MAP_BACK:
        return _TOP_MAP_BACK[name]
    m = _HF_BLOCK.match(name)
    if m and m.group(2) in _BLOCK_MAP_BACK:
        return f"blocks.{m.group(1)}.{_BLOCK_MAP_BACK[m.group(2)]}"
    raise KeyError(name)


def hf_tensor_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of ``spec`` holds, with its shape, in the order
    transformers writes them. A tied model has no ``lm_head.weight`` (the embedding serves)."""
    h, q, kv, f = spec.hidden, spec.q_dim, spec.kv_dim, spec.ffn
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab, h)}
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "self_attn.q_proj.weight"] = (q, h)
        if spec.qkv_bias:
            out[p + "self_attn.q_proj.bias"] = (q,)
        out[p + "self_attn.k_proj.weight"] = (kv, h)
        if spec.qkv_bias:
            out[p + "self_attn.k_proj.bias"] = (kv,)
        out[p + "self_attn.v_proj.weight"] = (kv, h)
        if spec.qkv_bias:
            out[p + "self_attn.v_proj.bias"] = (kv,)
        out[p + "self_attn.o_proj.weight"] = (h, q)
        out[p + "post_attention_layernorm.weight"] = (h,)
        out[p + "mlp.gate_proj.weight"] = (f, h)
        out[p + "mlp.up_proj.weight"] = (f, h)
        out[p + "mlp.down_proj.weight"] = (h, f)
    out["model.norm.weight"] = (h,)
    if not spec.tied_embeddings:
        out["lm_head.weight"] = (spec.vocab, h)
    return out


# ------------------------------------------------------------------------------------------------
# safetensors checkpoints, read by their headers
# ------------------------------------------------------------------------------------------------

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# a header is JSON of at most this many bytes (safetensors' own limit is 100 MB)
_MAX_HEADER = 100_000_000


def safetensors_files(path: str | os.PathLike) -> tuple[list[Path], dict[str, Path] | None]:
    """The files of a safetensors checkpoint and, when sharded, which file holds each tensor:
    ``(files, weight_map or None)``. ``path``: a ``.safetensors`` file, an index
    ``model.safetensors.index.json``, or a folder holding either ``model.safetensors`` or an index
    (or, failing those, exactly one ``.safetensors`` file). Raises WeightsError naming the path
    when nothing usable is there, or a shard the index names is missing."""
    p = Path(os.path.expanduser(os.fspath(path)))
    if not p.exists():
        raise WeightsError(f"{p}: no such file or folder; give a .safetensors file or a folder holding model.safetensors "
                           f"(or a sharded checkpoint with {INDEX_FILE})")
    index = None
    if p.is_dir():
        if (p / INDEX_FILE).is_file():
            index = p / INDEX_FILE
        elif (p / SINGLE_FILE).is_file():
            return [p / SINGLE_FILE], None
        else:
            found = sorted(p.glob("*.safetensors"))
            if len(found) == 1:
                return found, None
            others = sorted(x.name for x in p.iterdir() if x.suffix in (".bin", ".pt", ".pth", ".ckpt"))
            hint = (f" (it holds {', '.join(others)}: only safetensors are read; convert with transformers' "
                    f"save_pretrained(..., safe_serialization=True))") if others else ""
            what = f"{len(found)} .safetensors files and no {INDEX_FILE}" if found else "no safetensors weights"
            if (p / "spec.json").is_file() and (p / "checkpoints").is_dir():
                hint = f" (a workbench run: write its weights out first with `workbench export {p} --out DIR`)"
            raise WeightsError(f"{p}: {what}{hint}")
    elif p.name.endswith(".index.json"):
        index = p
    elif p.suffix != ".safetensors":
        raise WeightsError(f"{p}: not a .safetensors file or an index .json; give the weights in safetensors format")
    else:
        return [p], None
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
        wm = data["weight_map"]
        if not isinstance(wm, dict) or not wm:
            raise ValueError("empty weight_map")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise WeightsError(f"{index}: not a readable safetensors index ({type(e).__name__}: {e})") from None
    weight_map = {str(k): index.parent / str(v) for k, v in wm.items()}
    files = sorted(set(weight_map.values()))
    for f in files:
        if not f.is_file():
            raise WeightsError(f"{index}: shard {f.name} is missing (the index names it for "
                               f"{sum(1 for v in weight_map.values() if v == f)} tensor(s))")
    return files, weight_map


def read_safetensors_header(path: str | os.PathLike) -> dict[str, dict]:
    """``{tensor name: {"dtype", "shape", "data_offsets"}}`` of one safetensors file, read from its
    JSON header (no tensor data). Raises WeightsError naming the file when it is not safetensors
    (too short, a header that is not JSON, offsets beyond the file)."""
    p = Path(path)
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise WeightsError(f"{p}: not a safetensors file (only {len(head)} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > min(_MAX_HEADER, size - 8):
                raise WeightsError(f"{p}: not a safetensors file (header length {n} beyond the file's {size} bytes)")
            raw = f.read(n)
    except OSError as e:
        raise WeightsError(f"{p}: cannot be read ({e.strerror or e})") from None
    try:
        table = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise WeightsError(f"{p}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(table, dict):
        raise WeightsError(f"{p}: not a safetensors file (its header is not a JSON object)")
    table.pop("__metadata__", None)
    data_len = size - 8 - n
    for name, info in table.items():
        try:
            lo, hi = info["data_offsets"]
            shape = [int(x) for x in info["shape"]]
            info["shape"] = shape
        except (KeyError, TypeError, ValueError):
            raise WeightsError(f"{p}: tensor {name!r} has a malformed header entry") from None
        if not 0 <= lo <= hi <= data_len:
            raise WeightsError(f"{p}: tensor {name!r} lies beyond the end of the file (truncated? {size} bytes)")
    return table


def _check_sibling_config(spec: ModelSpec, path: str | os.PathLike) -> None:
    """A ``config.json`` beside the weights must describe the architecture they go into: the
    rotary base and scaling, the norm epsilon and tied embeddings do not show in the shapes."""
    p = Path(os.path.expanduser(os.fspath(path)))
    folder = p if p.is_dir() else p.parent
    cfg = folder / "config.json"
    if not cfg.is_file():
        return
    try:
        theirs = model_from_config(cfg)
    except ValueError as e:
        raise WeightsError(f"the weights' {e}") from None
    keys = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "head_dim", "qkv_bias", "rope_theta",
            "rope_scaling", "norm_eps", "tied_embeddings")
    diff = [(k, getattr(theirs, k), getattr(spec, k)) for k in keys if getattr(theirs, k) != getattr(spec, k)]
    if diff:
        k, a, b = diff[0]
        raise WeightsError(f"{cfg} says {k} = {a!r} but the model trained has {k} = {b!r}"
                           f"{f' ({len(diff) - 1} more differences)' if len(diff) > 1 else ''}; pass --model {folder} "
                           f"to train the model these weights belong to")


def check_weights(spec: ModelSpec, path: str | os.PathLike) -> dict[str, Any]:
    """Check a safetensors checkpoint against ``spec`` by its headers, strictly: every tensor the
    model needs is there with its shape, nothing else is, and a ``config.json`` beside the weights
    describes the same architecture. A tied model may carry ``lm_head.weight`` too (its values are
    checked equal to the embedding when loaded). Returns ``{"files", "tensors",
    "dtypes", "sharded"}``. Raises WeightsError with one line naming the first missing, unexpected
    or mis-shaped tensor (and how many more), or a sharded index that disagrees with its shards."""
    files, weight_map = safetensors_files(path)
    where: dict[str, tuple[Path, dict]] = {}
    for f in files:
        for name, info in read_safetensors_header(f).items():
            if name in where:
                raise WeightsError(f"{f}: tensor {name!r} is also in {where[name][0].name}")
            where[name] = (f, info)
    if weight_map is not None:
        for name, f in weight_map.items():
            if name not in where:
                raise WeightsError(f"{f}: the index puts tensor {name!r} there, but the file does not hold it")
    want = hf_tensor_shapes(spec)
    allowed_extra = {"lm_head.weight"} if spec.tied_embeddings else set()
    # buffers some exporters write: rotary tables, which we compute
    ignorable = {n for n in where if n.endswith("rotary_emb.inv_freq")}
    missing = [n for n in want if n not in where]
    unexpected = [n for n in where if n not in want and n not in allowed_extra and n not in ignorable]
    label = str(path)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise WeightsError(f"{label}: missing tensor {missing[0]!r}{more} for model {spec.name} "
                           f"({spec.layers} layers, {'q/k/v bias' if spec.qkv_bias else 'no bias'}"
                           f"{', tied embeddings' if spec.tied_embeddings else ''}); are these the weights of this model?")
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise WeightsError(f"{label}: unexpected tensor {unexpected[0]!r}{more}: model {spec.name} has no such "
                           f"parameter; are these the weights of this model?")
    shapes = dict(want)
    if spec.tied_embeddings and "lm_head.weight" in where:
        shapes["lm_head.weight"] = (spec.vocab, spec.hidden)
    for n, shape in shapes.items():
        got = tuple(where[n][1]["shape"])
        if got != shape:
            raise WeightsError(f"{label}: tensor {n!r} has shape {list(got)} but model {spec.name} needs {list(shape)}; "
                               f"is --model the config these weights were saved with?")
    _check_sibling_config(spec, path)
    dtypes = sorted({info["dtype"] for n, (_, info) in where.items() if n in shapes})
    return {"files": [str(f) for f in files], "tensors": len(shapes), "dtypes": dtypes, "sharded": weight_map is not None}
