"""The model a run names: a preset or a Hugging Face ``config.json``, resolved into a ModelSpec.

:mod:`workbench.specs` holds the plain specs and the presets; :mod:`workbench.hf` reads a
``config.json`` into a spec. This module sits above both, so the specs never import the reader.
Pure Python: no torch.
"""

from __future__ import annotations

from workbench.hf import looks_like_config_path, model_from_config
from workbench.specs import MODEL_PRESETS, ModelSpec

__all__ = ["get_model"]


def get_model(name: str) -> ModelSpec:
    """Return the preset ``name``, or the model of a Hugging Face ``config.json`` (a path to the file
    or to a folder holding it; see :mod:`workbench.hf`).

    Raises ValueError listing the presets when ``name`` is neither, or naming the field of a config
    that is not supported (MoE, sliding window, unknown ``model_type``, a missing field...)."""
    key = str(name).strip().lower()
    if key in MODEL_PRESETS:
        return MODEL_PRESETS[key]
    if looks_like_config_path(str(name)):
        return model_from_config(str(name))
    raise ValueError(f"unknown model {name!r}; presets are {', '.join(MODEL_PRESETS)}, or give the path of a "
                     f"Hugging Face config.json (or its folder)")
