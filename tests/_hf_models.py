"""Tiny random Llama, Qwen2 and Mistral models made with transformers (the reference
implementation; configs made here, nothing downloaded), saved as Hugging Face folders.

Each differs from the plain tiny model where the architectures differ: Llama 3.1's rope scaling
(with an original context short enough that the test sequences reach the scaled band), Qwen2's
q/k/v biases and tied embeddings, Mistral's explicit head_dim (24, not hidden / heads = 16). Every
parameter is perturbed so that norms and biases are not at their (1, 0) initial values.
"""

from __future__ import annotations

from pathlib import Path

COMMON = dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=300, max_position_embeddings=4096)
KINDS = ("llama", "qwen2", "mistral")


def hf_config(kind: str):
    """The transformers config object of one kind."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    if kind == "llama":
        return LlamaConfig(**COMMON, rope_theta=500000.0, rms_norm_eps=1e-5,
                           rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if kind == "qwen2":
        return Qwen2Config(**COMMON, rope_theta=1000000.0, tie_word_embeddings=True)
    if kind == "mistral":
        return MistralConfig(**COMMON, sliding_window=None, head_dim=24, rope_theta=1000000.0)
    raise ValueError(kind)


def make_hf_model(kind: str, folder: Path | None = None, *, seed: int = 0, **save_kw):
    """A random transformers model of ``kind`` (eval mode, fp32), saved to ``folder`` when given."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = hf_config(kind)
    cfg._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    if folder is not None:
        model.save_pretrained(str(folder), **save_kw)
    return model


def hf_logits(model, tokens) -> "torch.Tensor":  # noqa: F821 - torch imported lazily
    """Logits ``(T, vocab)`` of one sequence (1-D token ids) from the transformers model."""
    import torch

    with torch.no_grad():
        return model(tokens.reshape(1, -1)).logits[0]


def hf_batch_loss(model, sequences) -> float:
    """Mean next-token cross-entropy over every target token of the batch, from the transformers
    model's logits of each sequence alone (the definition the workbench's step reproduces)."""
    import torch.nn.functional as F

    total, count = 0.0, 0
    for s in sequences:
        if s.numel() < 2:
            continue
        logits = hf_logits(model, s).double()
        total += float(F.cross_entropy(logits[:-1], s[1:].long(), reduction="sum"))
        count += s.numel() - 1
    return total / count


def rel_err(got, ref) -> float:
    """max |got - ref| / max |ref|: the relative error of a whole logit tensor."""
    return float((got - ref).abs().max() / ref.abs().max())
