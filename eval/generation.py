"""Generation quality: what perplexity hides in long greedy continuations.

For K held-out prompts (P tokens each, evenly spaced through the evaluation text, deterministic),
both models generate N tokens greedily (same code path, KV cache, no stopping at EOS). Reported:

* `gen_prefix`: mean length of the common prefix of the two continuations (tokens, 0..N);
* `gen_agree`: fraction of the N positions where the two continuations hold the same token;
* `gen_kl`, `gen_top1`: mean KL(FP || compressed) and top-1 agreement at every position of the FP
  continuation, both models teacher-forced on prompt + FP continuation.
"""

from __future__ import annotations

import inspect
import time

import torch

from compress.errors import BadInput
from compress.eval.metrics import compare_lm, progress_bar, token_kl


def prompts_from(ids: torch.Tensor, k: int, length: int, bos_id: int | None = None) -> torch.Tensor:
    """(k, length) prompts at evenly spaced offsets of a 1-D token stream (BOS first where given)."""
    body = length - (bos_id is not None)
    if body < 1 or ids.numel() < body:
        raise BadInput(f"generation prompts of {length} tokens need at least {body} tokens of text; "
                       f"the evaluation text has {ids.numel()}")
    starts = torch.linspace(0, ids.numel() - body, k).long().unique()
    rows = [ids[s : s + body] for s in starts.tolist()]
    if bos_id is not None:
        rows = [torch.cat([ids.new_tensor([bos_id]), r]) for r in rows]
    return torch.stack(rows)


def _cache_key(model) -> str:
    """transformers 5.2x renamed `past_key_values` to `cache` (argument and output field)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.inference_mode()
def greedy(model, prompts: torch.Tensor, new_tokens: int, timings: dict | None = None,
           progress: bool = False) -> torch.Tensor:
    """(k, new_tokens) greedy continuations, one batched forward per step with the KV cache.
    `timings`, if given, receives `prefill_s` (the prompt's forward and first token) and `decode_s`
    (the other new_tokens - 1 steps), wall-clock seconds. `progress`: a bar of generated tokens on stderr."""
    device, key = next(model.parameters()).device, _cache_key(model)
    with progress_bar(new_tokens * prompts.shape[0], "generate", "tok", progress) as bar:
        t0 = time.perf_counter()
        out = model(input_ids=prompts.to(device), use_cache=True)
        tokens = []
        nxt = out.logits[:, -1].argmax(-1)
        t1 = time.perf_counter()
        bar.update(prompts.shape[0])
        for _ in range(new_tokens - 1):
            tokens.append(nxt)
            out = model(input_ids=nxt[:, None], use_cache=True, **{key: getattr(out, key)})
            nxt = out.logits[:, -1].argmax(-1)
            bar.update(prompts.shape[0])
        tokens.append(nxt)
    result = torch.stack(tokens, 1).cpu()  # waits for the device
    if timings is not None:
        timings.update(prefill_s=t1 - t0, decode_s=time.perf_counter() - t1)
    return result


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row, the number of leading positions where `a` and `b` agree."""
    return (a == b).long().cumprod(1).sum(1)


@torch.inference_mode()
def compare_generation(fp_model, q_model, ids: torch.Tensor, *, prompts: int = 16, prompt_tokens: int = 32,
                       new_tokens: int = 64, bos_id: int | None = None) -> dict:
    p = prompts_from(ids, prompts, prompt_tokens, bos_id)
    fp_cont, q_cont = greedy(fp_model, p, new_tokens), greedy(q_model, p, new_tokens)
    seq = torch.cat([p, fp_cont], 1)
    device = next(fp_model.parameters()).device
    # logits that predict each continuation token: positions P-1 .. P+N-2
    sl = slice(p.shape[1] - 1, seq.shape[1] - 1)
    fp_logits = fp_model(input_ids=seq.to(device)).logits[:, sl].float()
    q_logits = q_model(input_ids=seq.to(next(q_model.parameters()).device)).logits[:, sl].float()
    return {"gen_prefix": float(common_prefix(fp_cont, q_cont).double().mean()),
            "gen_agree": float((fp_cont == q_cont).double().mean()),
            "gen_kl": float(token_kl(fp_logits, q_logits.to(fp_logits.device)).mean()),
            "gen_top1": float((fp_logits.argmax(-1).cpu() == q_logits.argmax(-1).cpu()).double().mean()),
            "gen_prompts": p.shape[0], "gen_new_tokens": new_tokens}


def compare_causal(fp_model, q_model, ids: torch.Tensor, *, window: int, bos_id: int | None,
                   max_tokens: int | None, prompts: int, prompt_tokens: int, new_tokens: int,
                   progress: bool = False) -> dict:
    """`compare_lm` on the token stream plus, when `prompts` > 0, `compare_generation` on prompts from it:
    the one FP-vs-compressed comparison of a causal model used by runs and by `compress eval`."""
    res = compare_lm(fp_model, q_model, ids, window=window, bos_id=bos_id, max_tokens=max_tokens, progress=progress)
    if prompts:
        res.update(compare_generation(fp_model, q_model, ids, prompts=prompts, prompt_tokens=prompt_tokens,
                                      new_tokens=new_tokens, bos_id=bos_id))
    return res
