"""Bring your own model: Hugging Face configs into ModelSpecs, safetensors weights into the runtime's
model, and a run's checkpoint back out, checked against transformers (the reference implementation).

Fast (one process): config parsing and its refusals, the presets against the published parameter
counts, the state-dict adapter against transformers' own tensor table, logits of tiny random Llama
3.1, Qwen2 and Mistral models loaded with ``--init`` against transformers' logits (fp32, relative
error <= 1e-5) and the loss, strict loading errors, and ``workbench export`` loaded back into
transformers. The 4-rank heterogeneous plans are in test_hf_dist.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from _hf_models import KINDS, hf_batch_loss, hf_config, hf_logits, make_hf_model, rel_err  # noqa: E402

from workbench.hf import (  # noqa: E402
    WeightsError,
    check_weights,
    config_from_model,
    from_hf_name,
    hf_tensor_shapes,
    model_from_config,
    model_from_config_dict,
    to_hf_name,
)
from workbench.models import get_model  # noqa: E402
from workbench.specs import MODEL_PRESETS, ModelSpec  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5


def workbench(*args: str, cwd=ROOT, timeout: float = 300) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("workbench")
    cmd = [str(exe), *args] if exe.exists() else [sys.executable, "-m", "workbench.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """The three tiny models, saved once: ``{kind: (folder, transformers model)}``."""
    root = tmp_path_factory.mktemp("hf")
    return {k: (root / k, make_hf_model(k, root / k, seed=i)) for i, k in enumerate(KINDS)}


# ------------------------------------------------------------------------------------------------
# configs
# ------------------------------------------------------------------------------------------------

# the published totals of the real checkpoints (their safetensors metadata / model cards)
PUBLISHED_PARAMS = {"llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496, "qwen2.5-7b": 7_615_616_512,
                    "mistral-7b": 7_248_023_552}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_new_presets_have_the_published_parameter_counts(name):
    m = get_model(name)
    assert m.params() == PUBLISHED_PARAMS[name]
    assert ModelSpec.from_json(m.to_json()) == m


# the real configs as published (transformers 4 style), written out by hand
LLAMA31_8B = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000,
              "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
              "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
              "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
              "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"},
              "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256}
QWEN25_7B = {"architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "hidden_size": 3584,
             "intermediate_size": 18944, "max_position_embeddings": 131072, "max_window_layers": 28,
             "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
             "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
             "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 152064}
MISTRAL_7B_V03 = {"architectures": ["MistralForCausalLM"], "hidden_act": "silu", "hidden_size": 4096,
                  "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
                  "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
                  "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
                  "torch_dtype": "bfloat16", "vocab_size": 32768}


@pytest.mark.parametrize("cfg, preset", [(LLAMA31_8B, "llama3-8b"), (QWEN25_7B, "qwen2.5-7b"),
                                         (MISTRAL_7B_V03, "mistral-7b")])
def test_published_configs_give_the_presets(tmp_path, cfg, preset):
    d = tmp_path / "Some-Model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    for path in (d, d / "config.json"):  # the folder or the file
        m = get_model(str(path))
        assert m.name == "Some-Model"
        want = MODEL_PRESETS[preset]
        for f in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "max_context", "head_dim", "qkv_bias",
                  "rope_theta", "rope_scaling", "norm_eps", "tied_embeddings", "family"):
            assert getattr(m, f) == getattr(want, f), f


@pytest.mark.parametrize("kind", KINDS)
def test_transformers_5_configs_round_trip(tmp_path, kind):
    """Configs as transformers itself writes them (rope_parameters), and back through our export."""
    cfg = hf_config(kind)
    cfg.save_pretrained(str(tmp_path))
    m = model_from_config(tmp_path)
    assert (m.layers, m.hidden, m.heads, m.kv_heads, m.ffn, m.vocab) == (2, 64, 4, 2, 172, 300)
    assert m.head_dim == (24 if kind == "mistral" else 16)
    assert m.qkv_bias == (kind == "qwen2") and m.tied_embeddings == (kind == "qwen2")
    assert (m.rope_scaling is not None) == (kind == "llama")
    back = model_from_config_dict(config_from_model(m), name=m.name)
    assert back == m
    # and transformers reads what we write as the same config
    from transformers import AutoConfig

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text(json.dumps(config_from_model(m)))
    theirs = AutoConfig.from_pretrained(str(tmp_path / "out"))
    assert model_from_config_dict(theirs.to_dict(), name=m.name) == m


def _bad(**change):
    cfg = {**LLAMA31_8B, **change}
    return {k: v for k, v in cfg.items() if v is not ...}


@pytest.mark.parametrize("cfg, words", [
    ({**MISTRAL_7B_V03, "model_type": "mixtral", "num_local_experts": 8, "architectures": ["MixtralForCausalLM"]},
     "'mixtral' is a mixture-of-experts model"),
    ({**MISTRAL_7B_V03, "sliding_window": 4096}, "sliding_window 4096 (sliding-window attention) is not supported"),
    ({**QWEN25_7B, "use_sliding_window": True}, "use_sliding_window true"),
    (_bad(model_type="gemma2"), "model_type 'gemma2' is not supported; supported: llama"),
    (_bad(model_type=...), "missing field 'model_type'"),
    (_bad(hidden_size=...), "missing field 'hidden_size' (model width)"),
    ({**QWEN25_7B, "num_key_value_heads": None}, "missing field 'num_key_value_heads'"),
    (_bad(rope_scaling={"type": "yarn", "factor": 4.0}), "rope_scaling type 'yarn' is not supported; supported: llama3"),
    (_bad(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "misses 'low_freq_factor'"),
    (_bad(attention_bias=True), "attention_bias true"),
    (_bad(mlp_bias=True), "mlp_bias true"),
    (_bad(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (_bad(architectures=["LlamaForSequenceClassification"]), "architectures ['LlamaForSequenceClassification']"),
    (_bad(hidden_size=-4), "field 'hidden_size' must be a positive integer"),
    (_bad(num_key_value_heads=3), "must be a multiple of num_key_value_heads"),
    (_bad(partial_rotary_factor=0.5), "partial_rotary_factor 0.5 is not supported"),
    ({**QWEN25_7B, "layer_types": ["full_attention", "sliding_attention"]}, "layer_types ['sliding_attention']"),
])
def test_unsupported_configs_are_refused_in_one_line(tmp_path, cfg, words):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        model_from_config(tmp_path)
    msg = str(e.value)
    assert words in msg and "\n" not in msg and str(tmp_path / "config.json") in msg, msg


def test_config_paths_that_are_not_configs(tmp_path):
    with pytest.raises(ValueError, match="holds no config.json"):
        get_model(str(tmp_path))
    (tmp_path / "c.json").write_text("{nope")
    with pytest.raises(ValueError, match="not valid JSON"):
        get_model(str(tmp_path / "c.json"))
    with pytest.raises(ValueError, match="no such file or folder"):
        get_model(str(tmp_path / "missing" / "config.json"))
    with pytest.raises(ValueError, match="presets are tiny, 1b, 7b.*config.json"):
        get_model("llama-9000")


def test_cli_plans_and_costs_a_config_path_and_refuses_a_bad_one(tmp_path, capsys):
    """Through the console script's ``main`` in this process (five interpreters cost more than the checks;
    the export test runs the console script itself)."""
    from conftest import cli_main

    def workbench(*args):
        return cli_main(capsys, *args)

    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(QWEN25_7B))
    p = workbench("plan", "--model", str(d), "--lengths", "4096,2048,1024,512", "--gpus", "8", "--planner", "greedy",
                  "--strategy", "ulysses", "--json")
    assert p.returncode == 0, p.stderr
    plan = json.loads(p.stdout)
    # Qwen2.5-7B has 28 heads: Ulysses degrees must divide 28 (1, 2, 4), never 8
    assert max(g["degree"] for m in plan["micro_steps"] for g in m["groups"]) <= 4
    # with context parallelism (the default, auto) a wider group keeps its Ulysses part within them
    p = workbench("plan", "--model", str(d), "--lengths", "6144,2048,1024,512", "--gpus", "8", "--planner", "greedy",
                  "--json")
    assert p.returncode == 0, p.stderr
    groups = [g for m in json.loads(p.stdout)["micro_steps"] for g in m["groups"]]
    assert all(28 % g["ulysses"] == 0 and g["ulysses"] * g["cp"] == g["degree"] for g in groups)
    # 6,144 tokens need all 8 GPUs (the formula's activations and the whole logits' backward of a
    # 152,064-token vocabulary: 50 GB)
    assert any(g["degree"] == 8 and g["cp"] > 1 for g in groups)
    p = workbench("plan", "--model", str(d), "--lengths", "6144,2048,1024,512", "--gpus", "8", "--strategy", "ulysses")
    assert p.returncode == 2 and "28 query / 4 KV heads" in p.stderr and "--strategy auto" in p.stderr
    p = workbench("cost", "--model", str(d / "config.json"), "--lengths", "1000", "--degrees", "1,2", "--gpus", "8",
                  "--json")
    assert p.returncode == 0, p.stderr
    (d / "config.json").write_text(json.dumps({**MISTRAL_7B_V03, "sliding_window": 4096}))
    p = workbench("plan", "--model", str(d), "--lengths", "1000", "--gpus", "8")
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "sliding_window 4096" in p.stderr


# ------------------------------------------------------------------------------------------------
# the adapter
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_adapter_table_is_transformers_own(hf_dirs, kind):
    folder, ref = hf_dirs[kind]
    spec = model_from_config(folder)
    theirs = {n: tuple(t.shape) for n, t in ref.state_dict().items() if not n.endswith("rotary_emb.inv_freq")}
    if spec.tied_embeddings:
        theirs.pop("lm_head.weight", None)
    assert hf_tensor_shapes(spec) == theirs
    from workbench.runtime.model import Transformer

    ours = Transformer(spec)
    names = [n for n, _ in ours.named_parameters()]
    assert sorted(to_hf_name(n) for n in names) == sorted(theirs)
    assert all(from_hf_name(to_hf_name(n)) == n for n in names)
    assert ours.num_params() == spec.params() == sum(p.numel() for p in ref.parameters())
    # the memory model's table of the runtime's tensors (what ZeRO shards) has the biases too
    from workbench.cost.memory import parameter_shapes

    assert parameter_shapes(spec) == [(n, tuple(p.shape)) for n, p in ours.named_parameters()]


# ------------------------------------------------------------------------------------------------
# weights in: logits and loss against transformers
# ------------------------------------------------------------------------------------------------


def _ours(folder: Path, seed: int = 123):
    from workbench.runtime.model import Transformer
    from workbench.runtime.weights import load_initial_weights

    m = Transformer(model_from_config(folder), seed=seed)
    note = load_initial_weights(m, folder)
    return m.eval(), note


def _our_logits(model, tokens):
    from workbench.runtime.attention import torch_varlen_attention

    with torch.no_grad():
        n = tokens.numel()
        return model(tokens, torch.arange(n), torch.tensor([0, n], dtype=torch.int32), n, torch_varlen_attention)


@pytest.mark.parametrize("kind", KINDS)
def test_loaded_weights_give_transformers_logits_and_loss(hf_dirs, kind):
    from workbench.runtime.attention import torch_varlen_attention
    from workbench.runtime.step import batch_loss

    folder, ref = hf_dirs[kind]
    model, note = _ours(folder)
    assert "tensors" in note and str(folder) in note
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 300, (300,), generator=gen)  # past Llama's original context (64): the scaled band
    assert rel_err(_our_logits(model, tokens), hf_logits(ref, tokens)) <= TOL
    seqs = [torch.randint(0, 300, (n,), generator=gen) for n in (37, 1, 120, 64, 5)]
    with torch.no_grad():
        ours = float(batch_loss(model, seqs, torch_varlen_attention))
    assert ours == pytest.approx(hf_batch_loss(ref, seqs), rel=TOL)


def test_the_logits_comparison_sees_the_architecture_fields(hf_dirs):
    """The same weights without Llama 3.1's scaling, or with another rotary base, give other logits:
    the agreement above is not a comparison that cannot fail."""
    import dataclasses

    from workbench.runtime.model import Transformer

    folder, ref = hf_dirs["llama"]
    tokens = torch.randint(0, 300, (300,), generator=torch.Generator().manual_seed(5))
    want = hf_logits(ref, tokens)
    loaded, _ = _ours(folder)
    for change in ({"rope_scaling": None}, {"rope_theta": 10000.0}, {"norm_eps": 1e-2}):
        spec = dataclasses.replace(loaded.spec, **change)
        other = Transformer(spec)
        other.load_state_dict(loaded.state_dict())
        assert rel_err(_our_logits(other, tokens), want) > 1e-3, change


def test_sharded_checkpoint_loads_the_same(tmp_path):
    ref = make_hf_model("llama", tmp_path, seed=3, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("*.safetensors"))) > 2
    model, note = _ours(tmp_path)
    assert "sharded" in note
    tokens = torch.randint(0, 300, (90,), generator=torch.Generator().manual_seed(1))
    assert rel_err(_our_logits(model, tokens), hf_logits(ref, tokens)) <= TOL


def _rewrite(src: Path, dst: Path, edit) -> Path:
    """Copy a saved model to ``dst`` with its tensors edited by ``edit(dict)``."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_strict_loading_names_what_does_not_match(hf_dirs, tmp_path):
    from workbench.runtime.model import Transformer
    from workbench.runtime.weights import load_initial_weights

    folder, _ = hf_dirs["llama"]
    spec = model_from_config(folder)
    cases = [
        (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "missing tensor 'model.layers.1.mlp.up_proj.weight'"),
        (lambda t: t.update({"model.layers.2.mlp.up_proj.weight": torch.zeros(172, 64)}),
         "unexpected tensor 'model.layers.2.mlp.up_proj.weight'"),
        (lambda t: t.update({"model.norm.weight": torch.ones(65)}),
         "tensor 'model.norm.weight' has shape [65] but model llama needs [64]"),
        (lambda t: t["model.layers.0.self_attn.q_proj.weight"].__setitem__((0, 0), float("nan")), "NaN or infinite"),
    ]
    for i, (edit, words) in enumerate(cases):
        bad = _rewrite(folder, tmp_path / f"bad{i}", edit)
        bad_dir = tmp_path / f"bad{i}-named-llama"
        bad.rename(bad_dir)
        with pytest.raises(WeightsError) as e:
            load_initial_weights(Transformer(spec), bad_dir)
        assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    # a config beside the weights that says another architecture (invisible in the shapes)
    other = tmp_path / "theta"
    other.mkdir()
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters"]["rope_theta"] = 10000.0
    (other / "config.json").write_text(json.dumps(cfg))
    (other / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    with pytest.raises(WeightsError, match="says rope_theta = 10000.0 but the model trained has rope_theta = 500000.0"):
        check_weights(spec, other)
    # weights in pickle format only, and a file that is not safetensors
    pt = tmp_path / "pt"
    pt.mkdir()
    (pt / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(WeightsError, match="no safetensors weights .*pytorch_model.bin"):
        check_weights(spec, pt)
    (pt / "x.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(WeightsError, match="not a safetensors file"):
        check_weights(spec, pt / "x.safetensors")
    # a tied model whose saved head differs from its embedding
    qfolder, _ = hf_dirs["qwen2"]
    qspec = model_from_config(qfolder)
    untied = _rewrite(qfolder, tmp_path / "untied",
                      lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"] + 1.0}))
    with pytest.raises(WeightsError, match="lm_head.weight differs from model.embed_tokens.weight"):
        load_initial_weights(Transformer(qspec), untied)


# ------------------------------------------------------------------------------------------------
# weights out
# ------------------------------------------------------------------------------------------------


def _run_with_checkpoint(root: Path, folder: Path, name: str, step: int = 2):
    """A training run of the model at ``folder`` whose checkpoint at ``step`` holds those weights
    (written in the trainer's own checkpoint format, as the trainer does)."""
    from workbench.runtime.checkpoint import CHECKPOINT_FORMAT, checkpoint_path, save_whole
    from workbench.training import prepare_train

    run, spec, _ = prepare_train({"steps": step, "model": str(folder), "init": str(folder), "device": "cpu"},
                                 root=root, name=name)
    model, _ = _ours(folder)
    save_whole(checkpoint_path(run.path, step), {"format": CHECKPOINT_FORMAT, "step": step,
                                                 "model": model.state_dict(), "optimizer": {}, "sampler": {},
                                                 "rng": {}, "spec": "{}"})
    return run


@pytest.mark.long
@pytest.mark.parametrize("kind", KINDS)
def test_export_loads_back_into_transformers_with_the_same_logits(hf_dirs, tmp_path, kind, capsys):
    from transformers import AutoModelForCausalLM

    folder, ref = hf_dirs[kind]
    run = _run_with_checkpoint(tmp_path / "runs", folder, kind)
    out = tmp_path / "exported"
    if kind == KINDS[0]:  # the console script, as a user runs it
        p = workbench("export", str(run.path), "--out", str(out), "--json")
        assert p.returncode == 0, p.stderr
        stdout = p.stdout
    else:  # the same entry in this process (an interpreter importing torch per kind cost most of the test)
        from conftest import cli_main

        p = cli_main(capsys, "export", str(run.path), "--out", str(out), "--json")
        assert p.returncode == 0, p.stderr
        stdout = p.stdout
    res = json.loads(stdout)
    assert res["step"] == 2 and res["files"] == ["model.safetensors"] and res["dtype"] == "float32"
    back = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(back).__name__ == type(ref).__name__
    tokens = torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(2))
    assert rel_err(hf_logits(back, tokens), hf_logits(ref, tokens)) <= TOL
    # and the exported folder is a valid --init for the same model
    check_weights(model_from_config(folder), out)


def test_export_shards_dtypes_and_refusals(hf_dirs, tmp_path, capsys):
    from safetensors import safe_open

    from workbench.runtime.weights import export_run

    folder, ref = hf_dirs["mistral"]
    run = _run_with_checkpoint(tmp_path / "runs", folder, "m")
    res = export_run(run.path, tmp_path / "sharded", max_shard_bytes=60_000, dtype="bfloat16")
    assert len(res["files"]) > 2 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    with safe_open(str(tmp_path / "sharded" / res["files"][0]), framework="pt") as f:
        assert f.get_tensor(next(iter(f.keys()))).dtype == torch.bfloat16
    model, note = _ours(tmp_path / "sharded")  # our loader reads our shards
    assert "sharded" in note
    # refusals: an existing non-empty folder (nothing overwritten), a step that does not exist, no checkpoint;
    # through the CLI's own entry in this process (the console script runs `workbench export` in the test above,
    # and an interpreter importing torch for each refusal cost more than the rest of the test)
    from conftest import cli_main

    def refused(*args):
        p = cli_main(capsys, "export", *args)
        return p.returncode, p.stderr

    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    rc, err = refused(str(run.path), "--out", str(tmp_path / "busy"))
    assert rc == 2 and "already exists and is not an empty folder" in err
    assert (tmp_path / "busy" / "keep.txt").read_text() == "mine"
    rc, err = refused(str(run.path), "--out", str(tmp_path / "x"), "--step", "7")
    assert rc == 2 and "no checkpoint at step 7; it has step(s) 2" in err
    from workbench.training import prepare_train

    bare, _, _ = prepare_train({"steps": 1}, root=tmp_path / "runs", name="bare")
    rc, err = refused(str(bare.path), "--out", str(tmp_path / "y"))
    assert rc == 2 and "has no checkpoint" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_prepare_train_checks_init_and_tokenizer_before_any_folder(hf_dirs, tmp_path):
    from tokenizers import Tokenizer, models

    from workbench.training import SpecError, prepare_train

    folder, _ = hf_dirs["llama"]
    runs = tmp_path / "runs"
    with pytest.raises(SpecError, match="--init: .*missing tensor 'lm_head.weight'"):
        # Qwen2's weights are tied (no lm_head): not the weights of this untied Llama
        prepare_train({"steps": 1, "model": str(folder), "init": str(hf_dirs["qwen2"][0])}, root=runs)
    vocab = {f"t{i}": i for i in range(400)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(SpecError, match="vocabulary of 400 tokens but model llama has 300 embeddings"):
        prepare_train({"steps": 1, "model": str(folder), "tokenizer": str(tmp_path / "tokenizer.json")}, root=runs)
    assert not runs.exists() or not any(runs.iterdir())


def test_profile_spec_takes_a_config_path(tmp_path):
    from workbench.profile import ProfileSpec

    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(MISTRAL_7B_V03))
    spec = ProfileSpec(model=str(d), nproc=1)
    assert spec.model == str((d / "config.json").resolve())  # a path that names the model wherever it is read
    assert get_model(spec.model).family == "mistral" and spec.resolved("cpu")["max_len"] >= 512
    assert ProfileSpec(model="tiny", nproc=1).model == "tiny"
