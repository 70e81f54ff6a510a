"""Greedy decoding in vLLM, run by `compress serve-check --engine vllm` with the vLLM environment's own python.

Standalone on purpose: that environment has vLLM and its pinned transformers, not compress. Usage:
`python vllm_worker.py REQUEST.json RESULT.json`, REQUEST = {"model": dir, "prompts": [[token ids]], "n_tokens": n,
"top_k": k, "dtype": "float16" | "bfloat16", "kv_cache_dtype": "auto" | "fp8"}; RESULT = {"tokens": [[ids]], "top": [[{id: logprob}]], "vllm": version}
(the `Decoded` JSON of compress/serve/decoded.py). vLLM spawns workers, so the engine starts only under
`__main__`.
"""

import json
import os
import sys


def main(request_path: str, result_path: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: the checks decode 4 short prompts
    import vllm
    from vllm import LLM, SamplingParams

    req = json.loads(open(request_path).read())
    prompts = req["prompts"]
    longest = max(len(p) for p in prompts) + req["n_tokens"]
    llm = LLM(model=req["model"], dtype=req["dtype"], max_model_len=max(longest, 64), seed=0,
              enforce_eager=True, max_num_seqs=len(prompts), disable_log_stats=True,
              kv_cache_dtype=req.get("kv_cache_dtype", "auto"))  # fp8: the checkpoint's k_scale / v_scale
    params = SamplingParams(temperature=0.0, max_tokens=req["n_tokens"], min_tokens=req["n_tokens"],
                            ignore_eos=True, logprobs=req["top_k"])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens, top = [], []
    for out in outs:
        c = out.outputs[0]
        tokens.append(list(c.token_ids))
        top.append([{str(t): float(lp.logprob) for t, lp in step.items()} for step in (c.logprobs or [])])
    with open(result_path, "w") as f:
        json.dump({"tokens": tokens, "top": top, "vllm": vllm.__version__}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
