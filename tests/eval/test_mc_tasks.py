"""Log-likelihood multiple-choice tasks (compress/eval/mc_tasks.py): lm-eval's scoring, its task YAML, `compress eval
--mc-task`, the recipe's `eval.tasks` with gates, and agreement with the lm-eval harness itself."""

from __future__ import annotations

import json
import math
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
import yaml
from conftest import MODELS, TEXT, invoke
from tiny import save_tiny

from compress.errors import BadInput
from compress.eval import mc_tasks as M

STORIES = MODELS / "stories260K"
DOCS = [{"query": "Once upon a time, there was a little", "choices": ["girl", "dog named Max", "xq"], "gold": 0},
        {"query": "She loved to play", "choices": ["outside", "in the park with her friends"], "gold": 1},
        {"query": "One day, he saw a big ", "choices": ["ball", "tree"], "gold": 0}]  # a trailing space in the context


@pytest.fixture(scope="module")
def stories():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(STORIES).eval(), AutoTokenizer.from_pretrained(STORIES)


def _jsonl(path: Path, docs=DOCS) -> Path:
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return path


def _by_hand(model, tok, context: str, choice: str) -> float:
    """Sum of the continuation's token log-probs, one unbatched forward per choice: the space the context ends with
    goes to the continuation, the whole string is encoded, the continuation is what follows the context's tokens."""
    stripped = context.rstrip()
    cont = context[len(stripped):] + " " + choice
    ctx_ids, whole = tok(stripped).input_ids, tok(stripped + cont).input_ids
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([whole])).logits[0].double(), -1)
    return sum(lp[i - 1, whole[i]].item() for i in range(len(ctx_ids), len(whole)))


def test_sums_match_a_hand_computation(stories, tmp_path):
    model, tok = stories
    task = M.resolve_task(f"mini={_jsonl(tmp_path / 'mini.jsonl')}")
    res = M.score(model, tok, task, batch_tokens=40)  # several batches of unequal lengths, right padded
    hand = [[_by_hand(model, tok, d["query"], c) for c in d["choices"]] for d in DOCS]
    assert res["docs"] == 3 and res["requests"] == 7
    for ours, ref in zip(res["lls"], hand):
        assert ours == pytest.approx(ref, abs=2e-4)
    pred = [max(range(len(h)), key=h.__getitem__) for h in hand]
    assert res["acc"] == pytest.approx(sum(p == d["gold"] for p, d in zip(pred, DOCS)) / 3)
    norm = [max(range(len(h)), key=lambda i: h[i] / len(d["choices"][i])) for h, d in zip(hand, DOCS)]
    assert res["acc_norm"] == pytest.approx(sum(p == d["gold"] for p, d in zip(norm, DOCS)) / 3)
    assert M.score(model, tok, task, limit=2)["docs"] == 2


def test_the_context_boundary_is_lm_evals(stories):
    _, tok = stories
    assert M.encode_pair(tok, "One day, he saw a big ", "ball") == M.encode_pair(tok, "One day, he saw a big", " ball")
    ctx, cont = M.encode_pair(tok, "Once upon a", " time")
    assert ctx == tok("Once upon a").input_ids and ctx + cont == tok("Once upon a time").input_ids
    ctx, cont = M.encode_pair(tok, "", " time")  # an empty context: BOS conditions the continuation
    assert ctx == [tok.bos_token_id] and cont == tok(" time", add_special_tokens=False).input_ids


class Uniform(torch.nn.Module):
    """Every token equally likely: a continuation's log-likelihood is -(its tokens) * log(vocab)."""

    def __init__(self, vocab):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.vocab = vocab
        self.config = type("C", (), {"max_position_embeddings": 512})()

    def forward(self, x):
        return type("O", (), {"logits": torch.zeros(*x.shape, self.vocab)})()


def test_acc_norm_divides_by_the_choices_characters(stories, tmp_path):
    _, tok = stories
    long = "the little girl and the big dog"
    assert len(tok(" " + long, add_special_tokens=False).input_ids) < len(long)  # fewer tokens than characters
    task = M.resolve_task(f"n={_jsonl(tmp_path / 'n.jsonl', [{'query': 'Say', 'choices': ['z', long], 'gold': 1}])}")
    res = M.score(Uniform(len(tok)), tok, task)
    ll = res["lls"][0]
    n_short = len(M.encode_pair(tok, "Say", " z")[1])
    n_long = len(M.encode_pair(tok, "Say", " " + long)[1])
    assert ll == pytest.approx([-n_short * math.log(len(tok)), -n_long * math.log(len(tok))], rel=1e-6)
    assert res["acc"] == 0.0 and res["acc_norm"] == 1.0  # the fewest tokens win acc; per character the long one


def test_the_yaml_reader(tmp_path, monkeypatch):
    data = tmp_path / "d.jsonl"
    _jsonl(data, [{"q": "Is it hot?", "opts": "['yes', 'no']", "ans": "no", "n": 3},
                  {"q": "Is it cold?", "opts": "['yes', 'no']", "ans": "yes", "n": 4}])
    cfg = {"task": "weather", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": "d.jsonl"}},
           "test_split": "test", "output_type": "multiple_choice", "description": "Answer.\n",
           "doc_to_text": "Q{{n}}: {{q | regex_replace('\\\\?', '')}}\nA:", "doc_to_choice": "{{opts}}",
           "doc_to_target": "ans", "target_delimiter": " ", "metric_list": [{"metric": "acc"}]}
    y = tmp_path / "weather.yaml"
    y.write_text(yaml.safe_dump(cfg))
    with pytest.raises(BadInput, match="not found"):  # relative data_files: from the working directory, as lm-eval
        M.load_task(y)
    monkeypatch.chdir(tmp_path)
    t = M.load_task(y)
    d = t.docs[0]
    assert t.name == "weather" and t.text(d) == "Answer.\nQ3: Is it hot\nA:" and t.choices(d) == ["yes", "no"]
    assert t.gold(d, t.choices(d)) == 1 and t.gold(t.docs[1], ["yes", "no"]) == 0
    assert t.config["dataset_kwargs"]["data_files"] == {"test": str(data.resolve())}  # what lm-eval is given
    assert M.task_name(str(y)) == "weather" and M.resolve_task(f"w2={y}").name == "w2"
    # csv without a header (AG News), ints inferred as pandas does
    (tmp_path / "t.tsv").write_text('a "quoted" text\t1\nother\t0\n')
    y.write_text(yaml.safe_dump({**cfg, "dataset_path": "csv", "doc_to_text": "{{text}}", "doc_to_choice": ["x", "y"],
                                 "doc_to_target": "label", "dataset_kwargs": {
                                     "data_files": "t.tsv", "delimiter": "\t", "quoting": 3,
                                     "column_names": ["text", "label"]}}))
    t = M.load_task(y)
    assert t.docs == [{"text": 'a "quoted" text', "label": 1}, {"text": "other", "label": 0}]
    assert t.gold(t.docs[0], ["x", "y"]) == 1
    for bad, msg in [({"num_fewshot": 5}, "zero-shot"), ({"output_type": "generate_until"}, "multiple_choice"),
                     ({"metric_list": [{"metric": "bleu"}]}, "bleu"), ({"dataset_path": "glue"}, "local tasks")]:
        y.write_text(yaml.safe_dump({**cfg, **bad}))
        with pytest.raises(BadInput, match=msg):
            M.load_task(y)
    y.write_text(yaml.safe_dump(cfg) + "process_docs: !function utils.process\n")
    with pytest.raises(BadInput, match="!function"):
        M.load_task(y)
    y.write_text(yaml.safe_dump({**cfg, "doc_to_text": "{{missing}}"}))
    with pytest.raises(BadInput, match="missing"):
        M.load_task(y).text(d)
    y.write_text(yaml.safe_dump({**cfg, "doc_to_target": "[0, 1]"}))
    with pytest.raises(BadInput, match="several gold answers"):
        M.load_task(y).gold(d, ["yes", "no"])


def test_the_bundled_tasks_read_the_shared_data(data_dir):
    sst2 = M.resolve_task("sst2_mc", str(TEXT))
    assert len(sst2.docs) == 872 and sst2.choices(sst2.docs[0]) == ["negative", "positive"]
    assert sst2.text(sst2.docs[0]).endswith("\nQuestion: Is this sentence positive or negative?\nAnswer:")
    assert sum(sst2.gold(d, ["negative", "positive"]) for d in sst2.docs) == 444
    ag = M.resolve_task("ag_news_mc", str(TEXT))
    golds = [ag.gold(d, ag.choices(d)) for d in ag.docs]
    assert len(ag.docs) == 7600 and all(golds.count(i) == 1900 for i in range(4))
    with pytest.raises(BadInput, match="not found"):
        M.resolve_task("sst2_mc", "/nonexistent")


def test_compress_eval_mc_task(tmp_path, data_dir):
    task = _jsonl(tmp_path / "mini.jsonl")
    rc, out, err = invoke("eval", MODELS / "stories-llama-1m", "--reference", STORIES, "--mc-task", f"mini={task}",
                          "--mc-task", "sst2_mc", "--limit", 3, "--json")
    assert rc == 0, err
    res = json.loads(out)
    assert set(res) == {"mc-task mini", "mc-task sst2_mc"} and res["mc-task sst2_mc"]["docs"] == 3
    m = res["mc-task mini"]
    assert m["acc_delta"] == pytest.approx(m["acc"] - m["fp_acc"]) and m["docs"] == 3
    rc, _, err = invoke("eval", STORIES, "--mc-task", "nope")
    assert rc == 1 and "sst2_mc" in err
    rc, _, err = invoke("eval", STORIES, "--data", TEXT / "sst2" / "dev.tsv", "--limit", 3)
    assert rc == 1 and "--mc-task" in err


def _recipe(tmp_path, model, tasks, gates) -> Path:
    r = {"version": 1, "model": {"path": str(model), "dtype": "float32"},
         "calibration": {"sources": [str(TEXT / "tinystories" / "tinystories_val.txt")], "nsamples": 2, "seqlen": 32},
         "stages": [{"stage": "quantize", "method": "rtn", "bits": 2, "group_size": 32}],
         "eval": {"data": [], "tasks": tasks, "task_limit": 2}, "gates": gates}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(r))
    return path


def test_recipe_eval_tasks_report_and_gates(tmp_path, data_dir):
    model = save_tiny("llama", tmp_path / "m")
    task = _jsonl(tmp_path / "mini.jsonl")
    rc, _, err = invoke("run", _recipe(tmp_path, model, [f"mini={task}"], ["tasks.nope.acc >= 0"]), "--dry-run")
    assert rc == 1 and "tasks.mini" in err
    rc, _, err = invoke("run", _recipe(tmp_path, model, [f"mini={tmp_path / 'absent.jsonl'}"], []), "--dry-run")
    assert rc == 1 and "absent.jsonl" in err
    r = _recipe(tmp_path, model, [f"mini={task}", "sst2_mc"], ["tasks.mini.acc_delta >= -1", "tasks.sst2_mc.acc >= 0"])
    rc, out, err = invoke("run", r, "--dry-run")
    assert rc == 0 and f"eval task: sst2_mc -> {M.bundled()['sst2_mc']}" in out, err
    rc, out, err = invoke("run", r, "--output", tmp_path / "o", "--json")
    assert rc == 0, err
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    t = report["tasks"]["mini"]
    assert t["docs"] == 2 and t["acc_delta"] == pytest.approx(t["acc"] - t["fp_acc"], abs=1e-6)
    assert report["tasks"]["sst2_mc"]["docs"] == 2 and all(g["passed"] for g in report["gates"])
    assert "## Task accuracy" in (tmp_path / "o" / "report.md").read_text()
    rc, _, err = invoke("run", _recipe(tmp_path, model, [f"mini={task}"], ["tasks.mini.acc > 1"]), "--output",
                        tmp_path / "o2")
    assert rc == 3 and "tasks.mini.acc" in err


@pytest.mark.e2e  # about 20 s: lm-eval indexes its own task catalogue and loads the model itself
@pytest.mark.skipif(find_spec("lm_eval") is None, reason="lm-eval is not installed (pip install 'compress-llm[lmeval]')")
def test_lm_eval_agrees(tmp_path, data_dir):
    """The harness itself (HF backend, CPU, batch 1) on the same checkpoint, task YAML and limit."""
    model = MODELS / "stories-llama-1m"
    _jsonl(tmp_path / "pets.jsonl", [{"q": "Tom had a pet. The pet was a ", "opts": "['dog', 'big red ball', 'cat']",
                                      "ans": a} for a in ("dog", "cat", "big red ball")])
    (tmp_path / "pets.yaml").write_text(yaml.safe_dump({
        "task": "pets", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(tmp_path / "pets.jsonl")}},
        "test_split": "test", "output_type": "multiple_choice", "description": "A story.\n",
        "doc_to_text": "{{q | regex_replace('Tom', 'Lily')}}", "doc_to_choice": "{{opts}}", "doc_to_target": "ans",
        "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]}))
    rc, out, err = invoke("eval", model, "--mc-task", f"mini={_jsonl(tmp_path / 'mini.jsonl')}", "--mc-task",
                          "sst2_mc", "--mc-task", tmp_path / "pets.yaml", "--limit", 4, "--lm-eval-check", "--json")
    assert rc == 0, err
    assert set(json.loads(out)) == {"mc-task mini", "mc-task sst2_mc", "mc-task pets"}
    for name, r in json.loads(out).items():
        assert r["agree"] and r["lm_eval_docs"] == r["docs"], (name, r)
        assert abs(r["lm_eval_acc"] - r["acc"]) <= 1e-6 and abs(r["lm_eval_acc_norm"] - r["acc_norm"]) <= 1e-6
        assert r["max_ll_diff"] < 1e-4, (name, r)
