"""`compress eval`: perplexity and logit fidelity of any checkpoint against an optional reference."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from compress import data as bundled_text
from compress import extras
from compress.errors import BadInput, RunFailure
from compress.files import non_finite
from compress.verify import verify_artifact

log = logging.getLogger(__name__)
BACKENDS = ("auto", "cpu", "cpu-a8", "triton", "reference", "transformers")


def _ffn_mass(model, tau: float | None) -> None:
    """`--ffn-mass`: the PrunePath threshold of every routed FFN (docs/prune.md)."""
    if tau is None:
        return
    from compress.prune import routing as prunepath

    if not 0 < tau <= 1:
        raise BadInput(f"--ffn-mass {tau}: the cumulative router mass must be in (0, 1]")
    if not prunepath.set_tau(model, tau):
        raise BadInput("--ffn-mass needs a model with PrunePath FFNs (`prune: prunepath`); this one has none")


def _load(path: str, backend: str = "auto", device: str = "auto"):
    """(model, tokenizer). A packed `hf` export runs on our kernels (`backend`: auto, cpu, cpu-a8, triton,
    reference; compress/export/runtime.py) unless `backend` is `transformers` (auto-round's loader);
    any other checkpoint loads through transformers. The model is moved to `device` (compress/models/devices.py:
    `auto` is an accelerator when torch sees one)."""
    import torch

    from compress.models import devices
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    from compress.export import compressed_tensors
    from compress.export.runtime import is_packed, load_packed
    from compress.models.adapters import ARCHS
    from compress.models.loading import check_finite, resolve_source

    if backend not in BACKENDS:
        raise BadInput(f"unknown --backend `{backend}` (known: {', '.join(BACKENDS)})")
    if backend == "triton":
        extras.require(("triton",), "--backend triton")
    dev = devices.resolve(device)  # an absent device: refused before anything loads
    if dev.type != "cpu" and backend in ("cpu", "cpu-a8"):
        raise BadInput(f"--backend {backend} runs on the CPU, not on {dev}: use --backend auto (triton on CUDA), "
                       "reference or transformers, or --device cpu")
    src, gguf = resolve_source(path)
    verify_artifact(Path(src))
    kw = {"gguf_file": gguf} if gguf else {}
    try:
        if backend != "transformers" and not gguf and is_packed(src):
            model, _ = load_packed(src, backend)
        else:
            config = AutoConfig.from_pretrained(src, **kw)
            encoder = getattr(ARCHS.get(config.model_type), "kind", None) == "encoder"
            opts = compressed_tensors.load_options(config)  # FP4: dequantized at load
            model = (AutoModel if encoder else AutoModelForCausalLM).from_pretrained(src, dtype="auto", **kw, **opts)
            # auto-round casts a packed model to fp16 on CPU and its `.float()` refuses quantized models;
            # nn.Module.float restores fp32 compute (see compress/export/hf.py).
            model = torch.nn.Module.float(model).eval()
            for done in compressed_tensors.as_evaluated(model, Path(src)):  # what transformers' load leaves out
                log.info("%s: %s", path, done)
            if getattr(model.config, "prunepath", None):  # routed FFNs: transformers dropped the router tensors
                from compress.export.hf import load_tensors
                from compress.prune import routing as prunepath

                prunepath.attach(model, load_tensors(Path(src)))
    except (OSError, ValueError) as e:
        raise BadInput(f"cannot load `{path}`: {e}") from e
    check_finite(model, path)
    if dev.type != "cpu":
        model = model.to(dev)
    try:
        tok = AutoTokenizer.from_pretrained(src, **kw)
    except (OSError, ValueError):
        tok = None
    return model, tok


def evaluate_checkpoint(model_path: str, *, reference: str | None, data: list[str], window: int = 256,
                        max_tokens: int | None = None, gen_prompts: int = 16, prompt_tokens: int = 32,
                        new_tokens: int = 64, backend: str = "auto", ffn_mass: float | None = None,
                        text_slice: tuple[float, float] | None = None, progress: bool = False,
                        notify: Callable[[dict], None] | None = None, device: str = "auto") -> dict:
    """Perplexity of `model_path` on each file; with `reference`, also KL/top-1 and greedy-continuation
    agreement (`gen_prompts` prompts, 0 = off) against it on the same tokens. A packed checkpoint runs
    on `backend` (see `_load`); `ffn_mass` sets a PrunePath model's tau; `text_slice` (start, end) evaluates
    that fraction of each file (as a recipe's `eval.text_slice`); `notify(backends)` once the models are loaded,
    before the evaluation starts, with the packed layers per kernel backend ({} for a dense model)."""
    from compress.eval.data import read_text, token_stream
    from compress.eval.data import text_slice as cut
    from compress.eval.generation import compare_causal
    from compress.eval.metrics import perplexity

    if not data:
        raise BadInput("give at least one --data FILE to evaluate on")
    model, tok = _load(model_path, backend, device)
    _ffn_mass(model, ffn_mass)
    ref = _load(reference, device=device) if reference else None
    tok = tok or (ref[1] if ref else None)
    if tok is None:
        raise BadInput(f"no tokenizer found in `{model_path}`" + (f" or `{reference}`" if reference else ""))
    if notify:
        notify(_backends(model))
    out = {}
    for path in map(bundled_text.resolve, data):  # `bundled:NAME`: a text shipped with compress
        text = read_text(path)
        ids = token_stream(tok, cut(text, *text_slice) if text_slice else text)
        bos = getattr(tok, "bos_token_id", None)
        if ref:
            out[Path(path).name] = compare_causal(ref[0], model, ids, window=window, bos_id=bos, max_tokens=max_tokens,
                                                  prompts=gen_prompts, prompt_tokens=prompt_tokens,
                                                  new_tokens=new_tokens, progress=progress)
        else:
            out[Path(path).name] = {"ppl": perplexity(model, ids, window=window, bos_id=bos, max_tokens=max_tokens,
                                                      progress=progress)}
        if ffn_mass is not None:
            from compress.prune import routing as prunepath

            out[Path(path).name].update(ffn_mass=ffn_mass, ffn_active=prunepath.mean_active(model))
    bad = non_finite(out)
    if bad:
        raise RunFailure(f"`{model_path}` computes non-finite values ({', '.join(bad[:4])}): NaN or overflow in "
                         "its weights or activations")
    return out


# Tasks `compress eval --task NAME` knows by name: (train file, train rows, test file, test rows) under --task-data.
KNOWN_TASKS = {"sst2": ("sst2/train_heldout_6735.tsv", None, "sst2/dev.tsv", None),
               "ag_news": ("ag_news/test.tsv", (0, 6000), "ag_news/test.tsv", (6000, 7600))}


def parse_task(spec: str, data_dir: str | Path) -> tuple[str, str, tuple | None, str, tuple | None]:
    """`sst2` / `ag_news` (files under `data_dir`), or `NAME=TRAIN,TEST` (labelled TSV or JSONL files)."""
    if "=" in spec:
        name, _, files = spec.partition("=")
        parts = files.split(",")
        if len(parts) != 2 or not name or not all(parts):
            raise BadInput(f"--task `{spec}`: write NAME=TRAIN_FILE,TEST_FILE (labelled .tsv or .jsonl)")
        return name, parts[0], None, parts[1], None
    if spec not in KNOWN_TASKS:
        raise BadInput(f"--task `{spec}`: known tasks are {', '.join(KNOWN_TASKS)}; or give NAME=TRAIN,TEST files")
    train, rows, test, test_rows = KNOWN_TASKS[spec]
    return spec, str(Path(data_dir) / train), rows, str(Path(data_dir) / test), test_rows


def task_probes(model_path: str, tasks: list[str], *, data_dir: str | Path, pooling: str = "mean",
                max_examples: int = 4000, max_length: int = 128, seed: int = 0, backend: str = "auto") -> dict:
    """Per task: test accuracy of a logistic-regression probe on the checkpoint's pooled output (the last block's
    hidden states; C picked on a quarter of the training rows), with the majority-class rate beside it."""
    from compress.eval.data import read_labeled
    from compress.models.adapters import ModelAdapter
    from compress.select import probscale as ps

    extras.require(("sklearn",), "compress eval --task")
    if pooling not in ("mean", "last"):
        raise BadInput(f"--pooling {pooling}: mean or last")
    model, tok = _load(model_path, backend)
    if tok is None:
        raise BadInput(f"no tokenizer found in `{model_path}`")
    adapter, pad = ModelAdapter(model), ps._pad_id(tok)
    out = {}
    for spec in tasks:
        name, train, rows, test, test_rows = parse_task(spec, data_dir)

        def cut(path, span):
            x, y = read_labeled(path)
            return (x[span[0]:span[1]], y[span[0]:span[1]]) if span else (x, y)

        fit, dev = ps.split(*cut(train, rows), dev_fraction=0.25, limit=max_examples, seed=seed)
        tx, ty = cut(test, test_rows)
        ids = ps.encode(tok, fit[0] + dev[0] + tx, max_length)
        X = ps.features(adapter, ids, pad, pooling=pooling, every=False)[0]
        n, m = len(fit[0]), len(fit[0]) + len(dev[0])
        dev_acc, C, clf = ps.probe(X[:n], fit[1], X[n:m], dev[1], seed=seed)
        out[name] = {"accuracy": round(ps.accuracy(clf, X[m:], ty), 4), "dev_accuracy": round(dev_acc, 4),
                     "chance": round(max(ty.count(c) for c in set(ty)) / len(ty), 4), "C": C,
                     "train": len(fit[0]), "test": len(ty)}
    return out


def generate_text(model_path: str, prompt: str, *, max_new_tokens: int = 64, backend: str = "auto",
                  ffn_mass: float | None = None, progress: bool = False,
                  notify: Callable[[dict], None] | None = None, device: str = "auto") -> dict:
    """Greedy continuation of `prompt` (KV cache, exactly max_new_tokens steps) and its speed: decode
    tokens/s counts the steps after the first token (prefill_s covers the prompt and the first token).
    `progress`: a bar of generated tokens on stderr; `notify(backends)` once the model is loaded."""
    from compress.eval.generation import greedy

    if max_new_tokens < 1:
        raise BadInput("--max-new-tokens must be at least 1")
    model, tok = _load(model_path, backend, device)
    _ffn_mass(model, ffn_mass)
    if tok is None:
        raise BadInput(f"no tokenizer found in `{model_path}`")
    ids = tok(prompt, return_tensors="pt").input_ids
    if ids.numel() == 0:
        raise BadInput("the prompt encodes to no tokens")
    used = _backends(model)
    if notify:
        notify(used)
    timings = {}
    new = greedy(model, ids, max_new_tokens, timings, progress=progress)[0]
    eos = getattr(tok, "eos_token_id", None)
    shown = new.tolist()
    if eos is not None and eos in shown:
        shown = shown[: shown.index(eos)]
    steps = max_new_tokens - 1
    return {"prompt": prompt, "continuation": tok.decode(shown, skip_special_tokens=True),
            "prompt_tokens": ids.shape[1], "new_tokens": max_new_tokens, "backend": used,
            "prefill_s": round(timings["prefill_s"], 4), "decode_s": round(timings["decode_s"], 4),
            "tokens_per_s": round(steps / timings["decode_s"], 2) if steps else None}


def _backends(model) -> dict[str, int]:
    """Packed layers per kernel backend ({} for a model without QuantLinear layers)."""
    from collections import Counter

    from compress.kernels.backends import QuantLinear

    return dict(Counter(m.backend.name for m in model.modules() if isinstance(m, QuantLinear)))


def mc_task_accuracy(model_path: str, specs: list[str], *, reference: str | None = None,
                     data_dir: str | None = None, limit: int | None = None, backend: str = "auto",
                     lm_eval_check: bool = False, progress: bool = False) -> dict:
    """Per log-likelihood multiple-choice task (compress/eval/mc_tasks.py, scored as lm-eval scores it): acc and
    acc_norm of `model_path` on the first `limit` documents; with `reference`, the reference's beside them
    (fp_acc, fp_acc_norm) and the deltas; with `lm_eval_check`, lm-eval's own scores of `model_path` (HF backend,
    batch 1, CPU) and whether both accuracies agree to 1e-6 (`agree`)."""
    import tempfile

    from compress.eval import mc_tasks

    if limit is not None and limit < 1:
        raise BadInput("--limit must be at least 1")
    if lm_eval_check:
        extras.require(("lm_eval",), "--lm-eval-check")
    tasks = [mc_tasks.resolve_task(s, data_dir) for s in specs]  # every task file read before any model loads
    names = [t.name for t in tasks]
    if len(set(names)) != len(names):
        raise BadInput(f"--mc-task names a task twice ({', '.join(names)})")
    model, tok = _load(model_path, backend)
    ref = _load(reference) if reference else None
    tok = tok or (ref[1] if ref else None)
    if tok is None:
        raise BadInput(f"no tokenizer found in `{model_path}`")
    if getattr(model, "get_output_embeddings", lambda: None)() is None:
        raise BadInput("--mc-task scores a causal language model's log-likelihoods; this checkpoint has no LM head")
    out = {}
    for t in tasks:
        res = mc_tasks.score(model, tok, t, limit=limit, progress=progress)
        row = {"acc": res["acc"], "acc_norm": res["acc_norm"], "docs": res["docs"]}
        if ref:
            fp = mc_tasks.score(ref[0], tok, t, limit=limit, progress=progress)
            row = {"fp_acc": fp["acc"], "acc": res["acc"], "acc_delta": res["acc"] - fp["acc"],
                   "fp_acc_norm": fp["acc_norm"], "acc_norm": res["acc_norm"],
                   "acc_norm_delta": res["acc_norm"] - fp["acc_norm"], "docs": res["docs"]}
        if lm_eval_check:
            with tempfile.TemporaryDirectory() as d:
                row.update(mc_tasks.agreement(res, mc_tasks.lm_eval_score(model_path, t, limit=limit, workdir=d)))
        out[t.name] = row
    return out
