"""Launching training runs: ``spec.json`` (``spec``) and the torchrun embedding (``torchrun``).

Nothing here imports torch; the trainer itself (``workbench.runtime.train``) runs in the
processes torchrun starts.
"""
