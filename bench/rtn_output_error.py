"""`python -m bench.rtn_output_error`: why optimised RTN can lose to plain RTN on a real model, layer by layer.

Optimised RTN (`method: rtn, optimize: true`, docs/quantize.md#optimised-rtn) minimises each group's weight
reconstruction error with no calibration data. What the network sees is the output error of each linear,
`tr(dW H dW^T)` with `H = X^T X` over calibration rows (the objective GPTQ and AWQ minimise). This script rounds
every linear but the LM head with both (compress's own `primitives.rtn` and `rtn.optimized_rtn`), and reports for
each the weight error `||dW||^2` and the output error on WikiText-2 valid windows (the bench's windows:
bench.peers.windows, BOS first), in total and for the layers where the searched rounding is worst.

    python -m bench.rtn_output_error --model smollm2-135m-instruct --bits 4 --group 64 --sym
"""

from __future__ import annotations

import argparse
import datetime

import torch


def output_errors(model, tokens: torch.Tensor, bits: int, group: int, sym: bool) -> dict:
    """{layer: {"rtn": (weight error, output error), "opt": (...)}} over the linears of `model` but lm_head."""
    from compress.primitives import rtn
    from compress.quantize.rtn import optimized_rtn

    H = {}

    def hook(name):
        def f(_m, args, _out):
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            H[name] = H.get(name, 0) + x.T @ x
        return f

    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    handles = [m.register_forward_hook(hook(n)) for n, m in linears.items()]
    try:
        with torch.no_grad():
            for b in tokens.split(2):
                model(input_ids=b)
    finally:
        for h in handles:
            h.remove()
    out = {}
    for n, m in linears.items():
        W = m.weight.detach()
        out[n] = {}
        for key, q in (("rtn", rtn(W, bits, group, sym)), ("opt", optimized_rtn(W, bits, group, sym))):
            dW = (q.dequantize() - W).double()
            out[n][key] = (float(dW.square().sum()), float(torch.einsum("ij,jk,ik->", dW, H[n], dW)))
    return out


def markdown(errors: dict, meta: dict, top: int = 8) -> str:
    tot = {k: [sum(v[k][i] for v in errors.values()) for i in (0, 1)] for k in ("rtn", "opt")}
    worse = sorted(((v["opt"][1] / v["rtn"][1], n, v["opt"][0] / v["rtn"][0]) for n, v in errors.items()
                    if v["rtn"][1] > 0), reverse=True)
    lines = [f"# Optimised RTN vs RTN, output error: {meta['model']} W{meta['bits']} g{meta['group']} "
             f"{'sym' if meta['sym'] else 'asym'}", "", f"`{meta['command']}` ({meta['date']}; {meta['windows']} x "
             f"{meta['seqlen']} WikiText-2 valid tokens for H)", "",
             "| rounding | sum weight error | sum output error |", "|---|---|---|",
             *[f"| {k} | {tot[k][0]:.4g} | {tot[k][1]:.4g} |" for k in ("rtn", "opt")], "",
             f"Layers whose output error the search raises: {sum(1 for r, *_ in worse if r > 1)} of {len(worse)}. "
             "The worst:", "", "| layer | output error opt / rtn | weight error opt / rtn |", "|---|---|---|",
             *[f"| {n} | {r:.3f} | {w:.3f} |" for r, n, w in worse[:top]]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    import sys

    from transformers import AutoModelForCausalLM

    from bench.peers import model_path, windows

    ap = argparse.ArgumentParser(prog="python -m bench.rtn_output_error", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--sym", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--markdown", help="also write the table here")
    a = ap.parse_args(argv)
    path = model_path(a.model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    errors = output_errors(model, windows(path, a.windows, a.seqlen, 0), a.bits, a.group, a.sym)
    meta = {"model": a.model, "bits": a.bits, "group": a.group, "sym": a.sym, "windows": a.windows,
            "seqlen": a.seqlen, "date": datetime.date.today().isoformat(),
            "command": "python -m bench.rtn_output_error " + " ".join(sys.argv[1:] if argv is None else argv)}
    md = markdown(errors, meta)
    print(md, end="")
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
