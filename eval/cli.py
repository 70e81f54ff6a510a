"""`compress eval`: perplexity and logit fidelity of any checkpoint against an optional reference."""

from __future__ import annotations

from pathlib import Path

from compress.errors import BadInput


def _load(path: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compress.models.loading import resolve_source

    src, gguf = resolve_source(path)
    kw = {"gguf_file": gguf} if gguf else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(src, dtype="auto", **kw)
        # auto-round casts a packed model to fp16 on CPU and its `.float()` refuses quantized models;
        # nn.Module.float restores fp32 compute (see compress/export/hf.py).
        model = torch.nn.Module.float(model).eval()
    except (OSError, ValueError) as e:
        raise BadInput(f"cannot load `{path}`: {e}") from e
    try:
        tok = AutoTokenizer.from_pretrained(src, **kw)
    except (OSError, ValueError):
        tok = None
    return model, tok


def evaluate_checkpoint(model_path: str, *, reference: str | None, data: list[str], window: int = 256,
                        max_tokens: int | None = None, gen_prompts: int = 16, prompt_tokens: int = 32,
                        new_tokens: int = 64) -> dict:
    """Perplexity of `model_path` on each file; with `reference`, also KL/top-1 and greedy-continuation
    agreement (`gen_prompts` prompts, 0 = off) against it on the same tokens."""
    from compress.eval.data import read_text, token_stream
    from compress.eval.generation import compare_causal
    from compress.eval.metrics import perplexity

    if not data:
        raise BadInput("give at least one --data FILE to evaluate on")
    model, tok = _load(model_path)
    ref = _load(reference) if reference else None
    tok = tok or (ref[1] if ref else None)
    if tok is None:
        raise BadInput(f"no tokenizer found in `{model_path}`" + (f" or `{reference}`" if reference else ""))
    out = {}
    for path in data:
        ids = token_stream(tok, read_text(path))
        bos = getattr(tok, "bos_token_id", None)
        if ref:
            out[Path(path).name] = compare_causal(ref[0], model, ids, window=window, bos_id=bos, max_tokens=max_tokens,
                                                  prompts=gen_prompts, prompt_tokens=prompt_tokens,
                                                  new_tokens=new_tokens)
        else:
            out[Path(path).name] = {"ppl": perplexity(model, ids, window=window, bos_id=bos, max_tokens=max_tokens)}
    return out
