"""`compress bench decode`: tokens per second of greedy decoding, side by side in one process.

A randomly initialised Llama-architecture model built from a config (speed only; `SIZES["0.5b"]`:
hidden 1024, 28 blocks, SwiGLU 4096, 16 query / 4 KV heads, vocab 32000, untied head: 0.49B
parameters) decodes `new_tokens` tokens greedily after a `prompt_tokens` random prompt, batch 1, with
the KV cache (`eval.generation.greedy`), as:

* `torch-fp32`: the model itself (transformers eager, fp32);
* `ours-int4` / `ours-int4-a8`: every linear of the blocks and the LM head RTN-quantized to int4 g128
  (symmetric) and replaced by `QuantLinear` on our CPU kernel (`cpu`: fp32 activations, `cpu-a8`:
  int8 activations per group); the rest of the model (attention, norms, embedding) is unchanged torch;
* `openvino-int4`: the same quantized model exported by `compress.export.openvino` (u4 constants,
  KV-cache inputs) and run by OpenVINO's CPU plugin (its defaults: dynamic int8 activations).

`tokens_per_s` counts the decode steps after the first token (the prompt's forward is `prefill_s`),
best of `repeats` runs; all backends use `threads` threads. `agree` is the fraction of generated
tokens equal to torch-fp32's (int4 rounding may change a random model's argmax).
"""

from __future__ import annotations

import logging
import tempfile
import time

import numpy as np
import torch

logger = logging.getLogger(__name__)

SIZES = {
    "0.5b": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=4, vocab_size=32000),
    "ref-7m": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=8,
                   num_key_value_heads=4, vocab_size=4096),  # ref-llama-7m's shapes
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
}
EXPERT_SIZE = {"0.5b": 128, "ref-7m": 32, "tiny": 32}  # PrunePath rows (--ffn-mass): neurons per expert
BITS, GROUP = 4, 128


def build(size: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SIZES[size], max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def linear_names(model) -> list[str]:
    """The linears of the blocks and the LM head."""
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def quantize_int4(model) -> dict:
    from compress.primitives import rtn

    return {n: rtn(model.get_submodule(n).weight.data, BITS, GROUP, True) for n in linear_names(model)}


def decode(step_fn, prompt: torch.Tensor, new_tokens: int, repeats: int) -> dict:
    """Best-of-`repeats` timings of `step_fn(prompt, new_tokens, timings) -> tokens`."""
    best, tokens = None, None
    for _ in range(repeats):
        timings = {}
        tokens = step_fn(prompt, new_tokens, timings)
        if best is None or timings["decode_s"] < best["decode_s"]:
            best = timings
    steps = new_tokens - 1
    return {"tokens_per_s": round(steps / best["decode_s"], 2), "ms_per_token": round(1e3 * best["decode_s"] / steps, 2),
            "prefill_s": round(best["prefill_s"], 3), "tokens": tokens}


def torch_step(model):
    from compress.eval.generation import greedy

    return lambda prompt, n, timings: greedy(model, prompt, n, timings)[0]


def openvino_step(path, config, threads: int):
    """Greedy decoding with the exported IR: prefill, then one token per request, KV cache fed back."""
    import openvino as ov

    compiled = ov.Core().compile_model(str(path), "CPU", {"INFERENCE_NUM_THREADS": threads})
    req = compiled.create_infer_request()
    layers = config.num_hidden_layers
    hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    empty = np.zeros((1, config.num_key_value_heads, 0, hd), np.float32)

    def run(ids: np.ndarray, past: list[np.ndarray]):
        feed = {"input_ids": ids, "attention_mask": np.ones((1, past[0].shape[2] + ids.shape[1]), np.int64)}
        feed.update({f"past_key_values.{i}.{kv}": past[2 * i + j] for i in range(layers)
                     for j, kv in enumerate(("key", "value"))})
        out = req.infer(feed)
        logits = out[compiled.output("logits")]
        present = [out[compiled.output(f"present.{i}.{kv}")] for i in range(layers) for kv in ("key", "value")]
        return int(logits[0, -1].argmax()), present

    def step(prompt: torch.Tensor, n: int, timings: dict):
        t0 = time.perf_counter()
        nxt, past = run(prompt.numpy(), [empty] * (2 * layers))
        t1 = time.perf_counter()
        tokens = [nxt]
        for _ in range(n - 1):
            nxt, past = run(np.array([[nxt]], np.int64), past)
            tokens.append(nxt)
        timings.update(prefill_s=t1 - t0, decode_s=time.perf_counter() - t1)
        return torch.tensor(tokens)

    return step


def prunepath_rows(size: str, masses, prompt, new_tokens: int, repeats: int, kernel: str) -> list[dict]:
    """Decode speed of the same random model with every FFN as PrunePath experts (random routers, scaled so
    the active fraction spans the masses; speed only), fp32 and int4, at each `--ffn-mass` tau: the gather
    path computes only a token's active experts."""
    from compress.kernels.backends import quantize_model
    from compress.prune import routing as pp

    rows = []
    for dtype in ("fp32", "int4"):
        model = build(size)
        gen = torch.Generator().manual_seed(1)
        hidden, s = model.config.hidden_size, EXPERT_SIZE[size]
        for layer in model.model.layers:
            router = torch.randn(model.config.intermediate_size // s, hidden, generator=gen) / hidden ** 0.5
            layer.mlp = pp.PrunePathMLP(layer.mlp, pp.PathRouter(router), s)
        if dtype == "int4":
            qweights = quantize_int4(model)
            quantize_model(model, qweights, kernel)
            pp.prepare_gather(model, qweights, kernel)
        for tau in masses:
            pp.set_tau(model, tau)
            for m in pp.mlps(model):
                m.active = [0.0, 0]
            r = decode(torch_step(model), prompt, new_tokens, repeats)
            r.pop("tokens")
            rows.append({"backend": f"{'torch-fp32' if dtype == 'fp32' else 'ours-' + kernel} prunepath",
                         "tau": tau, "ffn_active": round(pp.mean_active(model), 4), **r})
            logger.info("prunepath %s tau %.2f: %.2f tokens/s, %.1f%% of FFN experts active", dtype, tau,
                        r["tokens_per_s"], 100 * rows[-1]["ffn_active"])
    return rows


def run(size: str = "0.5b", new_tokens: int = 64, prompt_tokens: int = 32, repeats: int = 3,
        threads: int | None = None, openvino: bool = True, ffn_mass=()) -> dict:
    from compress.kernels import cpu
    from compress.kernels.backends import quantize_model

    previous = torch.get_num_threads()
    torch.set_num_threads(threads or previous)
    try:
        model = build(size)
        n_params = sum(p.numel() for p in model.parameters())
        prompt = torch.randint(0, model.config.vocab_size, (1, prompt_tokens), generator=torch.Generator().manual_seed(0))
        rows = []
        ref = decode(torch_step(model), prompt, new_tokens, repeats)
        rows.append({"backend": "torch-fp32", **ref})
        logger.info("torch-fp32: %.2f tokens/s", ref["tokens_per_s"])
        qweights = quantize_int4(model)
        kernel = "cpu" if cpu.extension() is not None else "reference"
        quantize_model(model, qweights, kernel)  # frees the fp32 linears
        rows.append({"backend": "ours-int4", "kernel": kernel, **decode(torch_step(model), prompt, new_tokens, repeats)})
        if kernel == "cpu":
            quantize_model(model, qweights, "cpu-a8")
            rows.append({"backend": "ours-int4-a8", "kernel": "cpu-a8",
                         **decode(torch_step(model), prompt, new_tokens, repeats)})
        if openvino:
            from compress.export.openvino import export_openvino

            with tempfile.TemporaryDirectory() as tmp:
                res = export_openvino(model, qweights, tmp, kv_cache=True)
                step = openvino_step(res["path"], model.config, torch.get_num_threads())
                rows.append({"backend": "openvino-int4", **decode(step, prompt, new_tokens, repeats)})
        for r in rows:
            logger.info("%s: %.2f tokens/s", r["backend"], r["tokens_per_s"])
            r["speedup_vs_fp32"] = round(r["tokens_per_s"] / ref["tokens_per_s"], 2)
            r["agree"] = round(float((r.pop("tokens") == ref["tokens"]).double().mean()), 3)
        from compress.eval.machine import machine

        out = {"machine": machine(), "size": size, "parameters": n_params,
               "format": f"int{BITS}-g{GROUP} sym, lm_head included", "new_tokens": new_tokens,
               "prompt_tokens": prompt_tokens, "repeats": repeats, "threads": torch.get_num_threads(), "rows": rows}
        if ffn_mass:
            del model
            out["prunepath"] = prunepath_rows(size, ffn_mass, prompt, new_tokens, repeats, kernel)
            out["expert_size"] = EXPERT_SIZE[size]
        return out
    finally:
        torch.set_num_threads(previous)


def markdown(result: dict) -> str:
    from compress.eval.machine import machine_text

    lines = [f"Greedy decoding, random Llama {result['size']} ({result['parameters'] / 1e6:.1f}M parameters), batch 1, "
             f"{result['prompt_tokens']}-token prompt, {result['new_tokens']} new tokens, {result['threads']} threads, "
             f"best of {result['repeats']}; int4 = {result['format']}.{machine_text(result.get('machine'))}", "",
             "| backend | tokens/s | ms/token | prefill s | vs torch fp32 | tokens equal to fp32 |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['backend']} | {r['tokens_per_s']:.2f} | {r['ms_per_token']:.1f} | {r['prefill_s']:.3f} | "
                     f"{r['speedup_vs_fp32']:.2f}x | {r['agree']:.2f} |")
    if result.get("prunepath"):
        lines += ["", f"PrunePath (every FFN as experts of {result['expert_size']} neurons, random routers: speed "
                      "only), `--ffn-mass` tau; the gather path computes a token's active experts only:", "",
                  "| backend | tau | FFN experts active | tokens/s | ms/token | vs the same backend dense |",
                  "|---|---:|---:|---:|---:|---:|"]
        for r in result["prunepath"]:
            base = next(x["tokens_per_s"] for x in result["rows"]
                        if x["backend"] == ("torch-fp32" if "fp32" in r["backend"] else "ours-int4"))
            lines.append(f"| {r['backend']} | {r['tau']} | {r['ffn_active']:.3f} | {r['tokens_per_s']:.2f} | "
                         f"{r['ms_per_token']:.1f} | {r['tokens_per_s'] / base:.2f}x |")
    return "\n".join(lines) + "\n"
