"""The in-run evaluation and size report: the compressed in-memory model against the full-precision one."""

from __future__ import annotations

import math
from pathlib import Path


def bos_id(tokenizer, adapter) -> int | None:
    if adapter.kind == "encoder":
        return getattr(tokenizer, "cls_token_id", None)
    return getattr(tokenizer, "bos_token_id", None)


def param_bytes(model, itemsize: int | None = None) -> int:
    """Bytes of the parameters (tied tensors counted once), floating ones at `itemsize` bytes when given."""
    return sum(p.numel() * (itemsize if itemsize and p.is_floating_point() else p.element_size())
               for p in model.parameters())


def _export_itemsize(exports: dict) -> int | None:
    from compress.export.hf import DTYPES

    dtype = (exports.get("hf") or exports.get("fake") or {}).get("dtype")
    return DTYPES[dtype].itemsize if dtype else None


def evaluate(ctx, r) -> dict:
    """The FP reference (`ctx.reference()`, the checkpoint as loaded) vs the compressed in-memory model, same tokens."""
    fp_model = ctx.reference().model
    return evaluate_encoder(ctx, r, fp_model) if ctx.adapter.kind == "encoder" else evaluate_causal(ctx, r, fp_model)


def evaluate_encoder(ctx, r, fp_model) -> dict:
    """Embedding cosine fidelity on each labeled TSV, and probe accuracy when `eval.probe_train` is set."""
    from compress.eval.data import read_labeled_tsv
    from compress.eval.encoder import compare_encoder, cosine_fidelity, embed

    train = read_labeled_tsv(r.eval.probe_train) if r.eval.probe_train else None
    out = {}
    for path in r.eval.data:
        test = read_labeled_tsv(path)
        if train:
            res = compare_encoder(fp_model, ctx.model, ctx.tokenizer, probe_train=train, probe_test=test)
        else:
            res = {"cosine": cosine_fidelity(embed(fp_model, ctx.tokenizer, test[0]),
                                             embed(ctx.model, ctx.tokenizer, test[0]))}
        out[Path(path).name] = {k: round(v, 6) for k, v in res.items()}
    return out


def evaluate_causal(ctx, r, fp_model) -> dict:
    from compress.eval.data import read_text, text_slice, token_stream
    from compress.eval.generation import compare_causal

    g, bos = r.eval.generation, bos_id(ctx.tokenizer, ctx.adapter)
    out = {}
    for path in r.eval.data:
        text = read_text(path)
        if r.eval.text_slice:
            text = text_slice(text, *r.eval.text_slice)
        ids = token_stream(ctx.tokenizer, text)
        res = compare_causal(fp_model, ctx.model, ids, window=r.eval.window, bos_id=bos, max_tokens=r.eval.max_tokens,
                             prompts=g.prompts, prompt_tokens=g.prompt_tokens, new_tokens=g.new_tokens,
                             progress=not ctx.quiet)
        out[Path(path).name] = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in res.items()}
    return out


def evaluate_tasks(ctx, r) -> dict:
    """`eval.tasks`: each log-likelihood multiple-choice task (compress/eval/mc_tasks.py) on the FP reference and the
    compressed in-memory model, same documents: accuracy, normalised accuracy and their deltas."""
    from compress.eval import mc_tasks

    fp_model = ctx.reference().model
    out = {}
    for spec in r.eval.tasks:
        task = mc_tasks.resolve_task(spec, r.eval.task_data)
        fp = mc_tasks.score(fp_model, ctx.tokenizer, task, limit=r.eval.task_limit, progress=not ctx.quiet)
        q = mc_tasks.score(ctx.model, ctx.tokenizer, task, limit=r.eval.task_limit, progress=not ctx.quiet)
        out[task.name] = {"fp_acc": round(fp["acc"], 6), "acc": round(q["acc"], 6),
                          "acc_delta": round(q["acc"] - fp["acc"], 6), "fp_acc_norm": round(fp["acc_norm"], 6),
                          "acc_norm": round(q["acc_norm"], 6), "acc_norm_delta": round(q["acc_norm"] - fp["acc_norm"], 6),
                          "docs": q["docs"]}
    return out


def size_report(ctx, qweights: dict, exports: dict) -> dict:
    """Sizes against the model as loaded: an untied LM head (fused rotation) is a real cost of the result."""
    model = ctx.model
    qnumel = sum(q.codes.numel() for q in qweights.values())
    qbits = sum(q.storage_bits() for q in qweights.values())
    names = set(qweights)
    size = _export_itemsize(exports)  # the unquantized tensors as the hf export writes them (float16 by default)
    other = sum(m.weight.numel() * (size or m.weight.element_size()) for n, m in model.named_modules()
                if n in names)  # the FP bytes those layers replace
    packed = param_bytes(model, size) - other + math.ceil(qbits / 8)
    on_disk = next((v["bytes"] for v in exports.values() if v.get("bytes")), None)
    out = {"fp_bytes": ctx.fp_bytes, "bytes": on_disk if on_disk is not None else packed, "packed_bytes": packed,
           "effective_bits": round(qbits / qnumel, 4) if qnumel else None,
           "quantized_params": qnumel, "quantized_layers": len(qweights)}
    # what each export really stored: a layer its format cannot hold packed is written dense
    stored = {fmt: {"bytes": v.get("bytes"), "packed_layers": len(qweights) - v["dense_layers"],
                    "dense_layers": v["dense_layers"], **({"dense": v["dense"]} if v.get("dense") else {})}
              for fmt, v in exports.items() if "dense_layers" in v}
    if "hf" in stored and qweights:
        from compress.export.hf import stored_bytes

        stored["hf"]["tensor_bytes"] = stored_bytes(model, qweights, exports["hf"].get("dtype", "float16"))  # what its layout takes, before file overhead
    if stored:
        out["stored"] = stored
    return out
