"""Log-likelihood multiple-choice tasks, scored exactly as the lm-eval harness scores `output_type: multiple_choice`.

A task is an lm-eval task YAML (`task`, `dataset_path: json|csv` with `dataset_kwargs.data_files` naming local files,
`test_split`, `doc_to_text`, `doc_to_choice`, `doc_to_target`, `target_delimiter`, `description`, `metric_list`), its
fields rendered by the same Jinja environment lm-eval uses, so that the same YAML runs in lm-eval
(`lm_eval --tasks NAME --include_path DIR`). Per document: context = description + doc_to_text; each choice's
continuation = target_delimiter + choice, tokenized as lm-eval's HF model does (`TemplateLM._encode_pair`: trailing
spaces of the context move to the continuation, the whole string is encoded and split after the context's tokens),
scored by the sum of its tokens' log-probs; `acc`: the argmax of the sums is the gold index; `acc_norm`: the argmax of
sum / len(choice) in characters (lm-eval's `completion_len`, the choice without the delimiter). docs/recipes.md.
"""

from __future__ import annotations

import ast
import csv
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from compress.errors import BadInput

TASK_DIR = Path(__file__).resolve().parent / "tasks"  # the bundled task YAMLs (zero-shot SST-2, AG News)
SHARED_TEXT = "../shared/data/text"  # where the bundled YAMLs' data_files point (relative to the working directory)
METRICS = ("acc", "acc_norm")
DEFAULT_MAX_LENGTH = 2048  # lm-eval's HFLM default when neither the config nor the tokenizer gives a length


# --- the task file ------------------------------------------------------------------------------------------------
@dataclass
class Task:
    name: str
    docs: list[dict]
    doc_to_text: object
    doc_to_choice: object
    doc_to_target: object
    target_delimiter: str = " "
    description: str = ""
    metrics: tuple = METRICS
    config: dict = field(default_factory=dict)  # the YAML as lm-eval reads it, data_files resolved to absolute paths
    features: tuple = ()

    # lm-eval's ConfigurableTask.doc_to_text / doc_to_choice / doc_to_target, for the forms a local YAML can hold
    def text(self, doc: dict) -> str:
        t = self.doc_to_text
        if isinstance(t, str) and t in self.features:
            out = doc[t]
        else:
            out = render(t, doc) if isinstance(t, str) else t
            out = int(out) if isinstance(out, str) and out.isdigit() else out  # lm-eval: an index
        if not isinstance(out, str):
            raise BadInput(f"task {self.name}: doc_to_text gives {out!r}, an index (lm-eval's multiple-input tasks, "
                           "e.g. Winogrande): not supported")
        desc = render(self.description, doc) if self.description else ""
        return desc + out

    def choices(self, doc: dict) -> list[str]:
        c = self.doc_to_choice
        if isinstance(c, str):
            out = doc[c] if c in self.features else ast.literal_eval(render(c, doc))
        elif isinstance(c, dict):
            out = list(c.values())
        else:
            out = c
        if not isinstance(out, (list, tuple)) or not out or not all(isinstance(x, str) for x in out):
            raise BadInput(f"task {self.name}: doc_to_choice must give a list of strings, got {out!r}")
        return list(out)

    def gold(self, doc: dict, choices: list[str]) -> int:
        t = self.doc_to_target
        if isinstance(t, int):
            g = t
        elif isinstance(t, str) and t in self.features:
            g = doc[t]
        elif isinstance(t, str):
            g = render(t, doc)
            if g.isdigit():
                g = ast.literal_eval(g)
            elif len(g) >= 2 and g[0] == "[" and g[-1] == "]":
                raise BadInput(f"task {self.name}: the target {g!r} is a list (several gold answers per document): "
                               "not supported")
        else:
            raise BadInput(f"task {self.name}: doc_to_target {t!r} is not supported (a field, a template or an index)")
        if not isinstance(g, (int, str)):
            raise BadInput(f"task {self.name}: the target {g!r} is neither a choice index nor a choice (several "
                           "targets per document are not supported)")
        if isinstance(g, str):
            return choices.index(g) if g in choices else -100
        return g if g < len(choices) else -100  # lm-eval scores an out-of-range gold as never right


def _env():
    from jinja2 import BaseLoader, Environment, StrictUndefined

    env = Environment(loader=BaseLoader, undefined=StrictUndefined, keep_trailing_newline=True)
    env.filters["regex_replace"] = lambda s, pattern, repl, count=0: re.sub(pattern, repl, s, count=count)
    return env


_ENV = None


def render(template: str, doc: dict) -> str:
    """lm-eval's `utils.apply_template`: Jinja with StrictUndefined, trailing newline kept, `regex_replace`."""
    global _ENV
    from jinja2 import TemplateError

    _ENV = _ENV or _env()
    try:
        return _ENV.from_string(template).render(**doc)
    except TemplateError as e:
        raise BadInput(f"template {template!r}: {e} (document fields: {', '.join(doc)})") from e


def _read_yaml(path: Path) -> dict:
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    def function(loader, node):
        raise BadInput(f"{path}: `!function {loader.construct_scalar(node)}` (Python code in a task) is not supported; "
                       "write the field as a Jinja template")

    Loader.add_constructor("!function", function)
    try:
        cfg = yaml.load(path.read_text(encoding="utf-8"), Loader=Loader)
    except OSError as e:
        raise BadInput(f"cannot read task file {path}: {e}") from e
    except yaml.YAMLError as e:
        raise BadInput(f"task file {path}: {e}") from e
    if not isinstance(cfg, dict):
        raise BadInput(f"task file {path}: a task YAML is a mapping (task, dataset_path, doc_to_text, ...)")
    if "include" in cfg:  # lm-eval's base-config include, relative to this file
        base = _read_yaml((path.parent / cfg.pop("include")).resolve())
        cfg = {**base, **cfg}
    return cfg


def _data_file(cfg: dict, split: str, yaml_path: Path, data_dir: str | None) -> Path:
    kw = cfg.get("dataset_kwargs") or {}
    files = kw.get("data_files")
    if isinstance(files, dict):
        files = files.get(split)
    if isinstance(files, list):
        if len(files) != 1:
            raise BadInput(f"{yaml_path}: split `{split}` must name one data file, not {len(files)}")
        files = files[0]
    if not isinstance(files, str):
        raise BadInput(f"{yaml_path}: dataset_kwargs.data_files must name the local file of split `{split}` "
                       "(a path, or {split: path}); Hub datasets are not read offline")
    if data_dir is not None and files.startswith(SHARED_TEXT + "/"):  # a bundled task's data under --task-data
        files = str(Path(data_dir) / files[len(SHARED_TEXT) + 1:])
    p = Path(files).expanduser()
    if not p.is_absolute():  # relative to the working directory, as `datasets.load_dataset` reads it
        p = Path.cwd() / p
    if not p.is_file():
        hint = ("; the bundled tasks read ../shared/data/text: point --task-data (eval.task_data) at the directory "
                "holding sst2/ and ag_news/" if yaml_path.parent == TASK_DIR else "")
        raise BadInput(f"task {cfg.get('task')}: data file {files} not found (from {yaml_path}; a relative path is "
                       f"read from the working directory, as lm-eval does){hint}")
    return p.resolve()


def _infer(values: list[str]):
    """A CSV column's type as pandas infers it (all ints -> int, all floats -> float, else str)."""
    for cast in (int, float):
        try:
            return [cast(v) for v in values]
        except ValueError:
            continue
    return values


def read_rows(path: Path, kind: str, kw: dict) -> list[dict]:
    if kind == "json":
        text = path.read_text(encoding="utf-8")
        try:
            if text.lstrip().startswith("["):
                rows = json.loads(text)
            else:
                rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise BadInput(f"{path}: not JSON Lines ({e})") from e
        if "field" in kw:
            raise BadInput(f"{path}: dataset_kwargs.field is not supported")
        if not all(isinstance(r, dict) for r in rows):
            raise BadInput(f"{path}: every row must be a JSON object")
        return rows
    delim = kw.get("delimiter", kw.get("sep", ","))
    quoting = kw.get("quoting", csv.QUOTE_MINIMAL)
    names = kw.get("column_names")
    header = kw.get("header", "infer")
    with open(path, encoding="utf-8", newline="") as f:
        lines = list(csv.reader(f, delimiter=delim, quoting=quoting))
    lines = [r for r in lines if r]
    if names is None or header == 0:
        head, lines = lines[0], lines[1:]
        names = names or head
    cols = list(zip(*lines)) if lines else [() for _ in names]
    if any(len(r) != len(names) for r in lines):
        raise BadInput(f"{path}: rows with a number of fields other than the {len(names)} columns {names}")
    cols = [_infer(list(c)) for c in cols]
    return [dict(zip(names, vals)) for vals in zip(*cols)]


def load_task(path: str | Path, data_dir: str | None = None) -> Task:
    """An lm-eval task YAML with local data (json/csv), as a Task (every document read)."""
    path = Path(path)
    cfg = _read_yaml(path)
    name = cfg.get("task")
    if not isinstance(name, str) or not name:
        raise BadInput(f"{path}: `task: NAME` is missing")
    if cfg.get("output_type", "multiple_choice") != "multiple_choice":
        raise BadInput(f"{path}: output_type {cfg['output_type']} (only multiple_choice is scored here)")
    if cfg.get("num_fewshot") not in (None, 0):
        raise BadInput(f"{path}: num_fewshot {cfg['num_fewshot']}: only zero-shot tasks are scored here")
    for key in ("process_docs", "process_results", "use_prompt", "doc_to_decontamination_query"):
        if key in cfg:
            raise BadInput(f"{path}: `{key}` is not supported")
    kind = cfg.get("dataset_path")
    if kind not in ("json", "csv"):
        raise BadInput(f"{path}: dataset_path `{kind}`: local tasks read `json` (JSON Lines) or `csv` files through "
                       "dataset_kwargs.data_files")
    split = cfg.get("test_split") or cfg.get("validation_split")
    if not split:
        raise BadInput(f"{path}: name the evaluated split (test_split or validation_split)")
    for key in ("doc_to_text", "doc_to_choice", "doc_to_target"):
        if cfg.get(key) is None:
            raise BadInput(f"{path}: `{key}` is missing")
    metrics = tuple(m.get("metric") if isinstance(m, dict) else m for m in cfg.get("metric_list") or [{"metric": "acc"}])
    bad = [m for m in metrics if m not in METRICS]
    if bad:
        raise BadInput(f"{path}: metric {bad[0]} is not computed here (known: {', '.join(METRICS)})")
    file = _data_file(cfg, split, path, data_dir)
    kw = {k: v for k, v in (cfg.get("dataset_kwargs") or {}).items() if k != "data_files"}
    docs = read_rows(file, kind, kw)
    if not docs:
        raise BadInput(f"{file}: no documents")
    resolved = {**cfg, "dataset_kwargs": {**(cfg.get("dataset_kwargs") or {}), "data_files": {split: str(file)}}}
    return Task(name=name, docs=docs, doc_to_text=cfg["doc_to_text"], doc_to_choice=cfg["doc_to_choice"],
                doc_to_target=cfg["doc_to_target"], target_delimiter=cfg.get("target_delimiter", " "),
                description=cfg.get("description") or "", metrics=metrics, config=resolved, features=tuple(docs[0]))


def jsonl_task(name: str, path: str | Path) -> Task:
    """`NAME=FILE.jsonl`: rows with `query` (the context), `choices` (list of strings) and `gold` (index)."""
    p = Path(path).expanduser().resolve()
    if not p.is_file():
        raise BadInput(f"task {name}: {path} not found")
    docs = read_rows(p, "json", {})
    miss = [k for k in ("query", "choices", "gold") if docs and k not in docs[0]]
    if not docs or miss:
        raise BadInput(f"{path}: each row needs query, choices and gold (missing {', '.join(miss) or 'rows'})")
    cfg = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(p)}},
           "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{query}}",
           "doc_to_choice": "choices", "doc_to_target": "gold", "target_delimiter": " ",
           "metric_list": [{"metric": m, "aggregation": "mean", "higher_is_better": True} for m in METRICS]}
    return Task(name=name, docs=docs, doc_to_text="{{query}}", doc_to_choice="choices", doc_to_target="gold",
                metrics=METRICS, config=cfg, features=tuple(docs[0]))


def bundled() -> dict[str, Path]:
    """{task name: its YAML} of the tasks shipped with compress."""
    return {p.stem: p for p in sorted(TASK_DIR.glob("*.yaml"))}


def resolve_task(spec: str, data_dir: str | None = None) -> Task:
    """`sst2_mc` / `ag_news_mc` (bundled; their data under `data_dir`, ../shared/data/text by default), a task YAML
    path, or `NAME=FILE.jsonl` (query/choices/gold rows)."""
    if "=" in spec:
        name, _, file = spec.partition("=")
        if not name or not file:
            raise BadInput(f"task `{spec}`: write NAME=FILE.jsonl")
        if file.endswith((".yaml", ".yml")):
            t = load_task(file, data_dir)
            t.name = name
            t.config["task"] = name
            return t
        return jsonl_task(name, file)
    if spec in bundled():
        return load_task(bundled()[spec], data_dir)
    if spec.endswith((".yaml", ".yml")):
        return load_task(spec, data_dir)
    raise BadInput(f"task `{spec}`: a bundled task ({', '.join(bundled())}), a task YAML, or NAME=FILE.jsonl")


def task_name(spec: str) -> str:
    """The name a task spec reports under (read at plan time, before any data)."""
    if "=" in spec:
        return spec.partition("=")[0]
    if spec in bundled():
        return spec
    try:
        return _read_yaml(Path(spec)).get("task") or Path(spec).stem
    except BadInput:
        return Path(spec).stem


# --- scoring ------------------------------------------------------------------------------------------------------
def _max_length(model, tok) -> int:
    """lm-eval's `resolve_max_length`: the config's n_positions / max_position_embeddings / n_ctx, else the
    tokenizer's model_max_length, else 2048."""
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
        v = getattr(cfg, attr, None)
        if v is not None:
            return int(v)
    v = getattr(tok, "model_max_length", None)
    return int(v) if v is not None and v != int(1e30) else DEFAULT_MAX_LENGTH


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's HFLM request tokenization (`TemplateLM.loglikelihood` / `_encode_pair`, causal backend)."""
    prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id

    def enc(s: str, special=None) -> list[int]:
        kw = {} if special is None else {"add_special_tokens": special}
        if special is None and prefix is not None and s.startswith(tok.decode(prefix)):  # has_bos_prefix
            kw = {"add_special_tokens": False}
        return tok.encode(s, **kw)

    if context == "":
        cont = enc(continuation, False)
        return ([prefix], cont) if prefix != cont[0] else (cont[:1], cont[1:])
    n = len(context) - len(context.rstrip())
    if n:
        continuation, context = context[-n:] + continuation, context[:-n]
    whole, ctx = enc(context + continuation), enc(context)
    return ctx, whole[len(ctx):]


def score(model, tok, task: Task, *, limit: int | None = None, batch_tokens: int | None = None,
          progress: bool = False) -> dict:
    """{"acc", "acc_norm", "docs", "requests"} and per-document `lls` (the choices' log-likelihood sums) of `model`
    on the first `limit` documents (lm-eval's --limit). One forward per distinct input sequence, batched by length
    (right padding, as lm-eval pads: a causal model's real positions never see the padding), `batch_tokens` per
    forward (default: 8192, fewer for large vocabularies)."""
    import numpy as np
    import torch

    docs = task.docs[:limit] if limit else task.docs
    L = _max_length(model, tok)
    if batch_tokens is None:  # tokens per forward: at most 8192, and about 256 MB of fp32 logits
        vocab = getattr(getattr(model, "config", None), "vocab_size", None) or len(tok)
        batch_tokens = max(256, min(8192, 2**26 // vocab))
    reqs, per_doc = [], []  # reqs: (input ids, continuation ids); per_doc: (gold, choices, request indices)
    for doc in docs:
        ctx, choices = task.text(doc), task.choices(doc)
        idx = []
        for c in choices:
            ce, co = encode_pair(tok, ctx, f"{task.target_delimiter}{c}")
            if not co:
                raise BadInput(f"task {task.name}: the choice {c!r} encodes to no token after the context")
            inp = (ce + co)[-(L + 1):][:-1]
            idx.append(len(reqs))
            reqs.append((tuple(inp), tuple(co)))
        per_doc.append((task.gold(doc, choices), choices, idx))
    # distinct inputs: single-token choices after one context share a forward (lm-eval's one-token logits cache)
    by_input: dict[tuple, list[int]] = {}
    for j, (inp, _) in enumerate(reqs):
        by_input.setdefault(inp, []).append(j)
    inputs = sorted(by_input, key=len, reverse=True)
    lls_all = [0.0] * len(reqs)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(inputs), desc=f"{task.name}", unit="seq", leave=False)
    device = next(model.parameters()).device
    i = 0
    with torch.inference_mode():
        while i < len(inputs):
            chunk = inputs[i:i + max(1, batch_tokens // len(inputs[i]))]
            x = torch.zeros(len(chunk), len(chunk[0]), dtype=torch.long)
            for k, s in enumerate(chunk):
                x[k, :len(s)] = torch.tensor(s)
            logits = model(x.to(device)).logits
            for k, s in enumerate(chunk):
                for j in by_input[s]:
                    co = reqs[j][1]  # the continuation's positions: inplen - contlen .. inplen
                    lp = torch.nn.functional.log_softmax(logits[k, len(s) - len(co):len(s)].float(), dim=-1).cpu()
                    lls_all[j] = float(torch.gather(lp, 1, torch.tensor(co).unsqueeze(-1)).sum())
            i += len(chunk)
            if bar:
                bar.update(len(chunk))
    if bar:
        bar.close()
    acc = acc_norm = 0.0
    lls = []
    for gold, choices, idx in per_doc:
        ll = np.array([lls_all[j] for j in idx])
        lls.append(ll.tolist())
        acc += float(np.argmax(ll) == gold)
        acc_norm += float(np.argmax(ll / np.array([float(len(c)) for c in choices])) == gold)
    n = len(per_doc)
    return {"acc": acc / n, "acc_norm": acc_norm / n, "docs": n, "requests": len(reqs), "forwards": len(inputs),
            "lls": lls}


# --- lm-eval itself ----------------------------------------------------------------------------------------------
def lm_eval_score(model_path: str, task: Task, *, limit: int | None, workdir: str | Path) -> dict:
    """Run the lm-eval harness (HF backend, float32, CPU, batch 1) on `task` as its YAML (data_files resolved)
    under `workdir`: {"acc", "acc_norm", "docs", "lls"} in document order."""
    import yaml

    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError as e:
        raise BadInput("the lm-eval check needs lm-eval: pip install 'compress-llm[lmeval]'") from e
    d = Path(workdir) / "lm_eval_tasks"
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{task.name}.yaml").write_text(yaml.safe_dump(task.config, sort_keys=False), encoding="utf-8")
    out = lm_eval.simple_evaluate(model="hf", model_args={"pretrained": str(model_path), "dtype": "float32"},
                                  tasks=[task.name], task_manager=TaskManager(include_path=str(d)), limit=limit,
                                  batch_size=1, device="cpu", log_samples=True)
    res = out["results"][task.name]
    samples = sorted(out["samples"][task.name], key=lambda s: s["doc_id"])
    lls = [[float(r[0][0]) for r in s["resps"]] for s in samples]
    return {"acc": res.get("acc,none"), "acc_norm": res.get("acc_norm,none"), "docs": len(samples), "lls": lls}


def agreement(ours: dict, theirs: dict) -> dict:
    """How our scores compare with lm-eval's on the same documents."""
    diff = max((abs(a - b) for x, y in zip(ours["lls"], theirs["lls"]) for a, b in zip(x, y)), default=0.0)
    row = {"lm_eval_acc": theirs["acc"], "lm_eval_acc_norm": theirs["acc_norm"], "lm_eval_docs": theirs["docs"],
           "max_ll_diff": diff}
    row["agree"] = bool(theirs["docs"] == ours["docs"] and abs(theirs["acc"] - ours["acc"]) <= 1e-6
                        and (theirs["acc_norm"] is None or abs(theirs["acc_norm"] - ours["acc_norm"]) <= 1e-6))
    return row
