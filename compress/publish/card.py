"""The model card (README.md) of a pushed run, generated from its manifest and report.json with
huggingface_hub's `ModelCard` / `ModelCardData`: YAML metadata (base model, license when known, tags,
model-index with the measured metrics), the metrics and gates tables, the resolved recipe, and how to load
each exported format. The load snippets are written so that they run verbatim against the pushed repository
(tests/publish/test_publish.py runs them against a Hub on loopback). docs/hub.md.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import yaml

log = logging.getLogger("compress")

PIPELINE_TAG = {"causal": "text-generation", "encoder": "feature-extraction"}
METRICS = (("ppl_ratio", "perplexity ratio (compressed / FP)"), ("kl", "KL to FP (nats/token)"),
           ("top1", "top-1 agreement with FP"), ("gen_agree", "greedy-continuation agreement"),
           ("fp_ppl", "FP perplexity"), ("ppl", "perplexity"), ("cosine", "embedding cosine to FP"),
           ("probe_acc", "probe accuracy"))


def looks_like_hub_id(path: str) -> bool:
    """`org/name` that is not a local path (a local directory is no base_model the Hub can link)."""
    p = str(path)
    return (p.count("/") == 1 and not p.startswith((".", "/", "~")) and not Path(p).exists()
            and all(part and part not in (".", "..") for part in p.split("/")))


def base_license(model_path: str) -> str | None:
    """The base model's `license` from its model card: the local directory's README.md, or the cached
    README.md of a Hub id (nothing is downloaded)."""
    from huggingface_hub import ModelCard, try_to_load_from_cache

    readme = Path(model_path) / "README.md"
    if not readme.is_file() and looks_like_hub_id(model_path):
        cached = try_to_load_from_cache(model_path, "README.md")
        readme = Path(cached) if isinstance(cached, str) else readme
    if not readme.is_file():
        return None
    try:
        return ModelCard.load(readme).data.license
    except Exception as e:  # an unparsable card: no license rather than no push
        log.warning("base model card %s: %s; no license copied", readme, e)
        return None


def _quant_tags(recipe: dict) -> list[str]:
    tags = []
    for st in recipe.get("stages", []):
        tags.append(st["method"])
        if st["stage"] == "quantize" and st.get("bits"):
            tags.append(f"{st['bits']}-bit")
    return tags


def metadata(manifest: dict, report: dict, repo: str, kind: str, base_model: str | None):
    from huggingface_hub import EvalResult, ModelCardData

    recipe = manifest.get("recipe") or {}
    formats = list(manifest.get("exports") or {})
    tags = list(dict.fromkeys(["compress", "quantized", *_quant_tags(recipe),
                               *(["safetensors", "auto-round"] if "hf" in formats else []),
                               *[f for f in formats if f in ("onnx", "openvino")]]))
    model_path = (recipe.get("model") or {}).get("path", "")
    base = base_model or (model_path if looks_like_hub_id(model_path) else None)
    results = []
    task = PIPELINE_TAG.get(kind, "text-generation")
    for name, ev in (report.get("eval") or {}).items():
        for key, label in METRICS:
            if isinstance(ev.get(key), (int, float)):
                results.append(EvalResult(task_type=task, dataset_type=Path(name).stem, dataset_name=name,
                                          metric_type=key, metric_name=label, metric_value=ev[key]))
    return ModelCardData(
        base_model=base, license=base_license(model_path) if model_path else None,
        library_name="transformers" if "hf" in formats else (formats[0] if formats else None),
        pipeline_tag=task, tags=tags, model_name=repo, eval_results=results or None)


def _table(rows: list[list], head: list[str]) -> str:
    return ("| " + " | ".join(head) + " |\n|" + "---|" * len(head) + "\n"
            + "".join("| " + " | ".join("" if v is None else str(v) for v in r) + " |\n" for r in rows))


def _fmt(v) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def snippets(repo: str, formats: dict[str, str], kind: str) -> str:
    """How to load each pushed format from `repo`; `formats`: format -> directory in the repository ("" for
    the root). Each block runs as written (a test runs them)."""
    out = []
    if "hf" in formats and kind == "encoder":
        out.append(f"""### transformers

The packed layers are in auto-round's format: `pip install auto-round` lets transformers read them.

```python
import torch
from transformers import AutoModel, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("{repo}")
model = AutoModel.from_pretrained("{repo}").eval()
batch = tokenizer(["A sentence to embed."], return_tensors="pt")
with torch.no_grad():
    hidden = model(**batch).last_hidden_state
mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
embedding = (hidden * mask).sum(1) / mask.sum(1)  # mean pooling
print("embedding:", tuple(embedding.shape))
```
""")
    if "hf" in formats and kind == "causal":
        out.append(f"""### transformers

The packed layers are in auto-round's format: `pip install auto-round` lets transformers read them.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("{repo}")
model = AutoModelForCausalLM.from_pretrained("{repo}")
ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
print(tokenizer.decode(model.generate(ids, max_new_tokens=16, do_sample=False)[0]))
```
""")
    def feeds(loop: str, name: str, dim1: str, dim3: str) -> str:
        return f"""feeds = {{}}
{loop}  # input_ids; with a KV cache also attention_mask, position_ids and an empty past
    if {name} == "input_ids":
        feeds[{name}] = ids
    elif {name} == "attention_mask":
        feeds[{name}] = np.ones_like(ids)
    elif {name} == "position_ids":
        feeds[{name}] = np.arange(ids.shape[1])[None]
    else:  # past_key_values.N.key / .value: (batch, kv heads, 0 positions, head dim)
        feeds[{name}] = np.zeros((1, {dim1}, 0, {dim3}), dtype=np.float32)"""

    tok = f'AutoTokenizer.from_pretrained("{repo}")' if "hf" in formats else None
    ids = (f'ids = {tok}("Once upon a time", return_tensors="np").input_ids.astype(np.int64)' if tok
           else "ids = np.array([[1, 2, 3, 4]], dtype=np.int64)  # token ids of your prompt")
    imports = "from transformers import AutoTokenizer\n" if tok else ""
    if "onnx" in formats and kind == "causal":
        d = formats["onnx"]
        out.append(f"""### onnxruntime

`com.microsoft::MatMulNBits` linears: onnxruntime >= 1.17 runs them on CPU.

```python
import numpy as np
import onnxruntime as ort
from huggingface_hub import snapshot_download
{imports}
path = snapshot_download("{repo}", allow_patterns=["{d}/*"])
session = ort.InferenceSession(f"{{path}}/{d}/model.onnx", providers=["CPUExecutionProvider"])
{ids}
{feeds("for i in session.get_inputs():", "i.name", "i.shape[1]", "i.shape[3]")}
logits = session.run(["logits"], feeds)[0]
print("next token:", int(logits[0, -1].argmax()))
```
""")
    if "openvino" in formats and kind == "causal":
        d = formats["openvino"]
        out.append(f"""### OpenVINO

```python
import numpy as np
import openvino as ov
from huggingface_hub import snapshot_download
{imports}
path = snapshot_download("{repo}", allow_patterns=["{d}/*"])
# f32 activations, as the export was checked; CPUs with bf16 default to bf16 (faster, less exact)
compiled = ov.Core().compile_model(f"{{path}}/{d}/openvino_model.xml", "CPU",
                                   {{"INFERENCE_PRECISION_HINT": "f32"}})
{ids}
{feeds("for port in compiled.inputs:", "port.any_name", "port.get_partial_shape()[1].get_length()",
        "port.get_partial_shape()[3].get_length()")}
logits = compiled(feeds)["logits"]
print("next token:", int(logits[0, -1].argmax()))
```
""")
    return "\n".join(out) if out else "The repository holds the exported files as listed; no loading snippet for " \
                                        "this combination of model and formats.\n"


def model_kind(root: Path, exports: dict) -> str:
    """`causal` or `encoder`, from the `hf` export's config.json (graph exports are decoders only)."""
    hf = exports.get("hf")
    config = Path(root) / (hf.get("directory", "hf") if hf else "hf") / "config.json"
    try:
        archs = json.loads(config.read_text()).get("architectures") or []
    except (OSError, ValueError):
        return "causal"
    return "causal" if not archs or any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs) else "encoder"


def render(manifest: dict, report: dict, repo: str, formats: dict[str, str], *, base_model: str | None = None,
           kind: str = "causal") -> str:
    """README.md for `repo`: metadata front matter and the body; `kind` causal or encoder (`model_kind`)."""
    from huggingface_hub import ModelCard

    data = metadata(manifest, report, repo, kind, base_model)
    recipe = manifest.get("recipe") or {}
    stages = ", ".join(f"{s['stage']} `{s['method']}`" + (f" W{s['bits']}" if s.get("bits") else "")
                       for s in recipe.get("stages", []))
    body = [f"# {repo.split('/')[-1]}\n",
            f"`{report.get('model', '?')}`" + (f" ([{data.base_model}](https://huggingface.co/{data.base_model}))"
                                                if data.base_model else "")
            + f" compressed with [compress](https://github.com/compress-llm/compress): {stages or 'no stages'}. "
            f"Formats: {', '.join(f'`{f}`' + (f' (`{d}/`)' if d else ' (repository root)') for f, d in formats.items())}.\n"]
    ev = report.get("eval") or {}
    if ev:
        cols = [k for k, _ in METRICS if any(k in v for v in ev.values())]
        body.append("## Quality against the full-precision model\n\nSame tokens through both models "
                    "(`compress run`'s evaluation):\n\n"
                    + _table([[f"`{n}`", *[_fmt(v.get(c)) if c in v else "" for c in cols]] for n, v in ev.items()],
                             ["data", *[dict(METRICS)[c] for c in cols]]))
    size = report.get("size") or {}
    if size:
        rows = [["effective bits per quantized weight", size.get("effective_bits")],
                ["quantized layers", size.get("quantized_layers")],
                ["full-precision parameters (MiB)", round(size["fp_bytes"] / 2**20, 3) if size.get("fp_bytes") else None],
                ["compressed (MiB)", round(size["bytes"] / 2**20, 3) if size.get("bytes") else None]]
        body.append("## Size\n\n" + _table([r for r in rows if r[1] is not None], ["", "value"]))
    gates = report.get("gates")
    if gates:
        from compress.gates import table

        body.append("## Quality gates\n\n" + table(gates))
    if report.get("serving"):
        from compress.serve.rules import markdown as serving_table

        body.append("## Where it runs\n\n" + serving_table(report["serving"]) + "\n")
    body.append("## Use it\n\n" + snippets(repo, formats, kind))
    body.append("## Recipe\n\nThe resolved recipe of the run (`compress/recipe.yaml` in this repository; "
                "`compress run compress/recipe.yaml` reproduces it):\n\n```yaml\n"
                + yaml.safe_dump(recipe, sort_keys=False) + "```\n")
    versions = manifest.get("versions") or {}
    if versions:
        body.append("## Versions\n\n" + ", ".join(f"{k} {v}" for k, v in versions.items()) + "\n")
    body.append("The full report is `compress/report.md` (`compress/report.json`).\n")
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body)).content

