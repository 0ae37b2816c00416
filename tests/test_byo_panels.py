"""The panels take the user's own model and data: a Hugging Face config path in every model
control, a data path with a tokenizer in the Solver and Launch panels (headless, by their API)."""

from __future__ import annotations

import html
import json

import numpy as np
import pytest

from workbench.scenario import Scenario

pytest.importorskip("ipywidgets")

CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 172,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
          "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}


@pytest.fixture
def own(tmp_path):
    """A config folder, a JSONL corpus and a word-level tokenizer, all made here."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    (tmp_path / "mymodel").mkdir()
    (tmp_path / "mymodel" / "config.json").write_text(json.dumps(CONFIG))
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(100)]
    with open(tmp_path / "corpus.jsonl", "w") as f:
        for _ in range(400):
            f.write(json.dumps({"text": " ".join(rng.choice(words, size=int(rng.integers(1, 300))))}) + "\n")
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(["[UNK]", *words])}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_solver_plans_a_config_path_on_tokenised_text(own):
    from widgets import SolverPanel

    # a 4,000-token batch (~25 sequences) planned by greedy alone (the chosen planner, so flexsp does not run
    # first), without the lockstep pass bound (on 20,000 tokens it took 4 s of CPU): the plans are not what is
    # checked here, the model and the tokenised lengths they are made of are
    panel = SolverPanel(Scenario(num_gpus=8, gpus_per_node=8, batch_tokens=4_000, effort=0.3, planner="greedy"),
                        auto=False)
    panel.set(model=str(own / "mymodel"), source=str(own / "corpus.jsonl"), tokenizer=str(own / "tokenizer.json"))
    assert panel.w_model.value == str(own / "mymodel") and panel.w_tokenizer.value.endswith("tokenizer.json")
    res = panel.solve(["greedy"], pass_bound=False)
    plan = res["greedy"]
    # the batch's lengths are word counts: the word-level tokenizer's, read from the token cache
    counts = [len(json.loads(x)["text"].split()) for x in (own / "corpus.jsonl").read_text().splitlines()]
    assert set(int(x) for x in res.batch.lengths) <= set(counts) and plan.num_sequences == len(res.batch.lengths)
    assert panel.scenario.model_spec().name == "mymodel"
    # a control edited by hand: a config that is not supported is said beside the model control
    (own / "bad").mkdir()
    (own / "bad" / "config.json").write_text(json.dumps({**CONFIG, "model_type": "gemma2"}))
    panel.w_model.value = str(own / "bad")
    assert "bad/config.json: model_type 'gemma2' is not supported" in html.unescape(panel.n_cluster.value)
    panel.w_model.value = "tiny"
    assert panel.n_cluster.value == ""


def test_launch_panel_passes_model_data_tokenizer_and_init_on(own, tmp_path):
    from widgets import LaunchPanel

    panel = LaunchPanel(root=tmp_path / "runs", follow=False, reattach=False)
    s = panel.set(model=str(own / "mymodel"), source=str(own / "corpus.jsonl"), tokenizer=str(own / "tokenizer.json"),
                  column="text")
    assert (s["model"], s["source"], s["tokenizer"], s["column"]) == (
        str(own / "mymodel"), str(own / "corpus.jsonl"), str(own / "tokenizer.json"), "text")
    assert "init" not in s  # empty: random weights
    # the planning tabs' scenario brings the user's small model and tokenizer along, even on a CPU
    sc = Scenario(model=str(own / "mymodel"), source=str(own / "corpus.jsonl"), tokenizer=str(own / "tokenizer.json"),
                  num_gpus=8, batch_tokens=20_000)
    got = panel.use_scenario(sc)
    assert got["taken"]["model"] == str(own / "mymodel") and panel.settings()["tokenizer"] == str(own / "tokenizer.json")
    # a missing init file is refused at launch, in one line, before any process starts
    panel.set(init=str(own / "nowhere.safetensors"))
    with pytest.raises(ValueError, match="--init: .*nowhere.safetensors: no such file"):
        panel.launch()
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_lengths_panel_tokenises_text_with_the_tokenizer(own):
    from widgets import LengthsPanel

    panel = LengthsPanel(Scenario(num_gpus=8, batch_tokens=20_000), auto=False)
    panel.set(source=str(own / "corpus.jsonl"), tokenizer=str(own / "tokenizer.json"), samples=400)
    assert panel.w_tokenizer.value.endswith("tokenizer.json") and panel.file_row.layout.display == ""
    data = panel.refresh()
    counts = sorted(len(json.loads(x)["text"].split()) for x in (own / "corpus.jsonl").read_text().splitlines())
    assert data["summary"]["count"] == 400 and data["summary"]["tokens"] == sum(counts)  # word-level: one per word
    assert data["provenance"]["token_cache"] and "token cache" in panel.summary.value
