"""Hugging Face models under a heterogeneous 4-rank plan, against transformers; and the whole path
through the CLI: a user's tiny model and JSONL with their tokenizer, trained from ``--init`` on 2
ranks (a sharded ZeRO-3 checkpoint needs no more), exported, loaded back into transformers.

The first part runs on the 4 ranks of the shared torchrun world (``tests/_torchrun.py``: one launch
runs the checks of every file that takes part): each rank loads the tiny Llama 3.1 / Qwen2 / Mistral weights with
``load_initial_weights``, runs a plan mixing degrees 4, 2 and 1 (Ulysses all-to-alls, an idle rank)
and compares the logits of its slices with transformers' logits of the whole sequences (fp32,
relative error <= 1e-5), and the step's loss with transformers' loss of the batch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _torchrun import shared_world

# its slow tests check exact results and recorded calls, not times: make test runs them in the untimed
# lanes (tests/_xdist_heavy.py), as the other files of the shared 4-rank world
pytestmark = pytest.mark.untimed

WORLD = 4
TOL = 1e-5
DIST_TIMEOUT_S = 90
ROOT = Path(__file__).resolve().parents[1]
LENGTHS = [33, 6, 1, 50, 7, 2, 19, 4, 97]
# micro-step 0: a degree-2 group (ranks 0-1) and a degree-1 group on rank 2 (rank 3 idle);
# micro-step 1: one degree-4 group; micro-step 2: degree 1, 1 and a degree-2 group on ranks 2-3
MICRO = [[(2, [0, 1]), (1, [2])], [(4, [3, 4, 8])], [(1, [5]), (1, [6]), (2, [7])]]
BLOCKS = [[0, 2], [0], [0, 1, 1]]


# ------------------------------------------------------------------------------------------------
# worker side (runs under torchrun)
# ------------------------------------------------------------------------------------------------


def _check_kind(registry, rank: int, folder: Path, ref: dict) -> dict:
    import torch

    from workbench.cost import CostModel
    from workbench.hf import model_from_config
    from workbench.runtime.attention import torch_varlen_attention
    from workbench.runtime.model import Transformer
    from workbench.runtime.step import StepExecutor, make_shard
    from workbench.runtime.ulysses import UlyssesAttention
    from workbench.runtime.weights import load_initial_weights
    from workbench.solve.plan import build_plan
    from workbench.specs import ClusterSpec, load_profile

    spec = model_from_config(folder)
    model = Transformer(spec, seed=99)
    load_initial_weights(model, folder)
    seqs, logits_ref = ref["sequences"], ref["logits"]
    scale = max(float(x.abs().max()) for x in logits_ref)
    # replicated weights (ZeRO-0, free micro-steps): the executor below holds the plain model
    cost = CostModel(load_profile("cpu-gloo-tiny"), spec, ClusterSpec(num_gpus=WORLD, gpus_per_node=WORLD,
                                                                       gpu_memory_gb=4.0, zero_stage=0))
    plan = build_plan("mixed", MICRO, LENGTHS, cost, blocks=BLOCKS)
    worst, compared, degrees = 0.0, 0, set()
    with torch.no_grad():
        for ms in plan.micro_steps:
            g = next((g for g in ms.groups if rank in g.ranks), None)
            if g is None:
                continue
            degrees.add(g.degree)
            sh = make_shard([seqs[i] for i in g.sequences], g.degree, g.ranks.index(rank))
            attn = (torch_varlen_attention if g.degree == 1
                    else UlyssesAttention(registry.get(g.ranks), sh.layout, torch_varlen_attention))
            out = model(sh.tokens, sh.positions, sh.cu_seqlens, sh.max_seqlen, attn)  # (T_loc, vocab)
            valid = sh.layout.local_valid()
            cu = sh.cu_seqlens.tolist()
            for j, i in enumerate(g.sequences):
                lo, hi = cu[j], cu[j + 1]
                keep = valid[lo:hi]
                pos = sh.positions[lo:hi][keep]
                got, want = out[lo:hi][keep], logits_ref[i][pos]
                if got.numel():
                    worst = max(worst, float((got - want).abs().max()) / scale)
                    compared += int(keep.sum())
    res = StepExecutor(model, registry, torch_varlen_attention).run(plan, seqs)
    loss_rel = abs(res.loss - ref["loss"]) / abs(ref["loss"])
    return {"ok": worst <= TOL and loss_rel <= TOL, "worst_rel": worst, "loss": res.loss, "ref_loss": ref["loss"],
            "loss_rel": loss_rel, "compared_tokens": compared, "degrees": sorted(degrees)}


def _check_kinds(registry, rank: int, data_dir: str) -> dict:
    import torch

    results = {}
    for kind in ("llama", "qwen2", "mistral"):
        ref = torch.load(Path(data_dir) / f"{kind}.pt", weights_only=True)
        try:
            results[kind] = _check_kind(registry, rank, Path(data_dir) / kind, ref)
        except Exception as e:  # noqa: BLE001 - reported per rank; every rank runs the same collectives
            results[kind] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    return results


def world_checks(data_dir: str) -> list:
    """The checks this file runs in the shared world (``tests/_torchrun.py``); none without
    transformers (its tests are skipped then)."""
    return [lambda registry, rank: _check_kinds(registry, rank, data_dir)] if data_dir else []


# ------------------------------------------------------------------------------------------------
# pytest side
# ------------------------------------------------------------------------------------------------


def world_prepare(data: Path) -> list[str]:
    """Pytest side, before the launch: each kind's tiny model and transformers' logits and loss of
    the batch written to ``data``; the argument of :func:`world_checks` ("" without transformers)."""
    import torch

    try:
        import transformers  # noqa: F401
    except ImportError:
        return [""]
    from _hf_models import KINDS, hf_batch_loss, hf_logits, make_hf_model

    gen = torch.Generator().manual_seed(11)
    seqs = [torch.randint(0, 300, (n,), generator=gen) for n in LENGTHS]
    for i, kind in enumerate(KINDS):
        ref = make_hf_model(kind, data / kind, seed=20 + i)
        torch.save({"sequences": seqs, "logits": [hf_logits(ref, s) for s in seqs], "loss": hf_batch_loss(ref, seqs)},
                   data / f"{kind}.pt")
    return [str(data)]


@pytest.fixture(scope="module")
def dist_results(request, tmp_path_factory):
    """This file's checks in the shared 4-rank world (launched once a session, ``tests/_torchrun.py``)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return shared_world(request, tmp_path_factory, __name__)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_logits_and_loss_under_a_heterogeneous_plan_match_transformers(dist_results, kind):
    per_rank = {r: res[kind] for r, res in dist_results.items()}
    bad = {r: v for r, v in per_rank.items() if not v["ok"]}
    assert not bad, bad
    # every token of the batch was compared on exactly one rank (the degree-d groups split them)
    assert sum(v["compared_tokens"] for v in per_rank.values()) == sum(LENGTHS)
    assert per_rank["0"]["degrees"] == [1, 2, 4] and per_rank["3"]["degrees"] == [2, 4]  # rank 3 idles in micro-step 0


# ------------------------------------------------------------------------------------------------
# the whole path through the CLI
# ------------------------------------------------------------------------------------------------


def workbench(*args: str, cwd: Path, timeout: float = 400) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("workbench")
    cmd = [str(exe), *args] if exe.exists() else [sys.executable, "-m", "workbench.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.mark.slow
def test_own_model_and_jsonl_train_from_init_on_2_ranks_and_export(tmp_path, capsys, monkeypatch):
    """A user's Qwen2-shaped model (made by transformers, saved) and JSONL corpus with a BPE
    tokenizer: ``workbench train --init`` on 2 ranks with the greedy planner; the first step's loss
    equals transformers' loss on the same batch (the sequences read back from the token cache); one
    SGD step later ``workbench export`` (the console script's entry in this process, in the user's
    folder: an interpreter importing torch and transformers again cost ~2.8 s of CPU; test_hf.py
    runs the console script) loads into transformers and matches the run's own checkpoint loaded
    into the runtime's model."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from _hf_models import hf_batch_loss, hf_logits, make_hf_model, rel_err
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM

    rng = __import__("random").Random(0)
    words = "long short sequence parallel plan group rank token model data".split()
    texts = [" ".join(rng.choice(words) for _ in range(int(rng.lognormvariate(3.5, 1.0)) + 1)) for _ in range(300)]
    with open(tmp_path / "corpus.jsonl", "w") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"id": i, "text": t}) + "\n")
        f.write(json.dumps({"id": 300, "text": ""}) + "\n")  # skipped and reported
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=290, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    ref = make_hf_model("qwen2", tmp_path / "mymodel", seed=5)
    if True:  # the token cache goes where conftest points WORKBENCH_CACHE (a temporary folder)
        args = ["train", "--model", "mymodel", "--init", "mymodel", "--lengths", "corpus.jsonl", "--tokenizer",
                "tokenizer.json", "--nproc", "2", "--planner", "greedy", "--steps", "1", "--optimizer", "sgd", "--lr",
                "0.5", "--max-len", "256", "--batch-tokens", "2048", "--checkpoint-every", "1", "--seed", "3",
                "--time-limit", "0.5", "--run-root", "runs", "--name", "own", "--quiet"]
        p = workbench(*args, cwd=tmp_path)
        run = tmp_path / "runs" / "own"
        log = (run / "log.txt").read_text()[-3000:] if (run / "log.txt").exists() else ""
        assert p.returncode == 0, f"{p.stderr[-3000:]}\n{log}"
        assert "skipped 1 empty document" in p.stderr
        st = json.loads((run / "status.json").read_text())
        assert "tensors" in st["resolved"]["init"] and "token cache" in st["resolved"]["data"]
        plan = json.loads((run / "plans.jsonl").read_text().splitlines()[0])["plan"]
        assert plan["num_gpus"] == 2
        row = next(json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"rank": 0' in x)
        # the batch the run trained on, read back independently: the sampler over the TokenData
        from workbench.data import GlobalBatchSampler
        from workbench.data.sequences import TokenData

        td = TokenData(str(tmp_path / "corpus.jsonl"), max_len=256, policy="split", seed=3,
                       tokenizer=str(tmp_path / "tokenizer.json"))
        batch = GlobalBatchSampler(td, batch_tokens=2048, seed=3).batch(0)
        assert batch.batch_id == row["batch_id"]
        seqs = [torch.from_numpy(td.tokens(int(i))) for i in batch.indices]
        want = hf_batch_loss(ref, seqs)
        assert row["loss"] == pytest.approx(want, rel=TOL)
        # export the step-1 checkpoint; transformers loads it; it equals our checkpoint in our model
        from conftest import cli_main

        monkeypatch.chdir(tmp_path)  # the relative paths a user in that folder gives
        p = cli_main(capsys, "export", "runs/own", "--out", "exported")
        assert p.returncode == 0, p.stderr
        assert (tmp_path / "exported" / "tokenizer.json").is_file()
        back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported")).eval()
        from workbench.hf import model_from_config
        from workbench.runtime.attention import torch_varlen_attention
        from workbench.runtime.model import Transformer

        ours = Transformer(model_from_config(tmp_path / "mymodel"))
        # the run is ZeRO-3 (the default), so its checkpoint is a sharded folder; read it whole
        from workbench.runtime.checkpoint import full_model_state

        ours.load_state_dict(full_model_state(run, 1))
        s = seqs[0]
        with torch.no_grad():
            got = ours(s, torch.arange(s.numel()), torch.tensor([0, s.numel()], dtype=torch.int32), s.numel(),
                       torch_varlen_attention)
        assert rel_err(hf_logits(back, s), got) <= TOL
        assert rel_err(hf_logits(back, s), hf_logits(ref, s)) > 1e-4  # the step did change the weights
