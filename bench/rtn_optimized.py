"""`python -m bench.rtn_optimized`: plain RTN vs optimised RTN (`method: rtn, optimize: true`) vs GPTQ, and
auto-round's own `iters=0` RTN where auto-round is installed, on real models (docs/quantize.md#optimised-rtn).

Every compress cell is one pipeline run (bench.quality.run_cell: a recipe, `pipeline.run`, the numbers from its
report): KL(FP || Q), top-1 agreement and the perplexity ratio to the full-precision model on the same tokens
(WikiText-2 raw test, the first `--max-tokens` tokens in 256-token windows), the quantize stage's seconds. GPTQ is
calibrated on WikiText-2 valid (64 x 256 tokens, seed 0). The auto-round cell quantizes with auto-round's API
(`AutoRound(..., iters=0)`: its RTN mode as users get it by default, opt-RTN on, calibrated on the same valid text
for the importance matrix its symmetric opt-RTN collects), saves its own `auto_round` checkpoint, which compress
reads (`compress eval`'s loader) and scores on the same tokens. `--speed` adds the time of `primitives.rtn` and
`optimized_rtn` on 100M random weights.

    python -m bench.rtn_optimized --json bench/rtn-optimized.json --markdown bench/rtn-optimized.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import tempfile
import time
from pathlib import Path

from bench.quality import MODELS, TEXT, run_cell

log = logging.getLogger(__name__)
SMOLLM2 = Path.home() / ".cache" / "compress-data" / "smollm2-135m-instruct"
# model -> settings (bits, group_size, sym); never asym g32 at W4 on SmolLM2 (its FP is a dequantized Q4_1 GGUF)
SETTINGS = {
    "ref-llama-7m": [(4, 128, True), (3, 64, False), (2, 64, False)],
    "smollm2-135m-instruct": [(4, 64, True), (3, 64, False)],
}
METHODS = ("rtn", "rtn-opt", "gptq")
TEST = TEXT / "wikitext-2-raw" / "wiki.test.raw"
VALID = TEXT / "wikitext-2" / "valid.txt"


def model_path(name: str) -> str:
    return str(SMOLLM2 if name == "smollm2-135m-instruct" else MODELS / name)


def recipe(path: str, method: str, bits: int, group: int, sym: bool, max_tokens: int) -> dict:
    st = {"stage": "quantize", "method": method.removesuffix("-opt"), "bits": bits, "group_size": group, "sym": sym}
    if method == "rtn-opt":
        st["optimize"] = True
    return {"version": 1, "description": f"bench rtn-optimized: {method} W{bits} g{group}",
            "model": {"path": path, "dtype": "float32"},
            "calibration": {"sources": [str(VALID)], "nsamples": 64, "seqlen": 256, "seed": 0},
            "stages": [st],
            "eval": {"data": [str(TEST)], "window": 256, "max_tokens": max_tokens, "generation": {"prompts": 0}},
            "export": {"formats": []}}


def compress_cell(name: str, method: str, bits: int, group: int, sym: bool, max_tokens: int, tmp: Path) -> dict:
    t = time.time()
    rep = run_cell(recipe(model_path(name), method, bits, group, sym, max_tokens), tmp)
    ev = next(iter(rep["eval"].values()))
    q = sum(s["seconds"] for s in rep["stages"] if s["name"] == "quantize")
    return {"model": name, "bits": bits, "group_size": group, "sym": sym, "method": method,
            "kl": ev["kl"], "top1": ev["top1"], "ppl_ratio": ev["ppl_ratio"], "ppl": ev["ppl"], "fp_ppl": ev["fp_ppl"],
            "tokens": ev["tokens"], "effective_bits": rep["size"]["effective_bits"], "quantize_seconds": round(q, 2),
            "cell_seconds": round(time.time() - t, 1)}


def autoround_cell(name: str, bits: int, group: int, sym: bool, max_tokens: int, tmp: Path) -> dict:
    """auto-round's own RTN mode (`iters=0`, its defaults otherwise), scored by compress on the same tokens."""
    import auto_round
    import torch
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compress.eval.cli import evaluate_checkpoint

    path = model_path(name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    words = VALID.read_text().split()
    dataset = [" ".join(words[i:i + 400]) for i in range(0, 400 * 64, 400)]  # 64 texts of >= 256 tokens
    out = tmp / f"ar-{name}-{bits}-{group}-{sym}"
    t = time.time()
    ar = AutoRound(model, tok, bits=bits, group_size=group, sym=sym, iters=0, dataset=dataset, nsamples=64,
                   seqlen=256, device_map="cpu", seed=0)
    ar.quantize_and_save(str(out), format="auto_round")
    seconds = time.time() - t
    ckpt = next(out.rglob("config.json")).parent
    ev = next(iter(evaluate_checkpoint(str(ckpt), reference=path, data=[str(TEST)], window=256, max_tokens=max_tokens,
                                       gen_prompts=0).values()))
    from compress.export.hf import read_quantized

    _, qw = read_quantized(ckpt)
    n = sum(q.codes.numel() for q in qw.values())
    eff = sum(q.storage_bits() for q in qw.values()) / n if n else None
    return {"model": name, "bits": bits, "group_size": group, "sym": sym,
            "method": f"auto-round {auto_round.__version__} iters=0", "kl": ev["kl"], "top1": ev["top1"],
            "ppl_ratio": ev["ppl_ratio"], "ppl": ev["ppl"], "fp_ppl": ev["fp_ppl"], "tokens": ev["tokens"],
            "effective_bits": round(eff, 4) if eff else None, "quantize_seconds": round(seconds, 2),
            "cell_seconds": round(time.time() - t, 1)}


def speed(n_rows: int = 4096, n_cols: int = 24576) -> list[dict]:
    """Seconds of plain and optimised RTN on a (4096, 24576) = 100.7M-weight random matrix."""
    import torch

    from compress.primitives import rtn
    from compress.quantize.rtn import optimized_rtn

    W = torch.randn(n_rows, n_cols, generator=torch.Generator().manual_seed(0)) * 0.02
    rows = []
    for bits, group, sym in ((4, 128, True), (4, 64, True), (3, 64, False), (2, 64, False)):
        t = time.time()
        rtn(W, bits, group, sym)
        t_rtn = time.time() - t
        t = time.time()
        optimized_rtn(W, bits, group, sym)
        rows.append({"weights": W.numel(), "bits": bits, "group_size": group, "sym": sym,
                     "rtn_seconds": round(t_rtn, 2), "optimized_seconds": round(time.time() - t, 2),
                     "torch_threads": torch.get_num_threads()})
    return rows


def setting(r: dict) -> str:
    return f"W{r['bits']} g{r['group_size']} {'sym' if r['sym'] else 'asym'}"


def markdown(res: dict) -> str:
    m = res["meta"]
    lines = [f"`{m['command']}`", "",
             f"{m['date']}, {m['wall_seconds']} s. Machine: {m['machine']['nproc']} CPUs, {m['machine']['cpu']} "
             f"(torch threads {m['machine']['torch_threads']}, load average at the start "
             f"{m['machine']['load_average']}). Evaluation: WikiText-2 raw test, the first {m['max_tokens']} tokens "
             "in 256-token windows, against the full-precision model on the same tokens. GPTQ and auto-round's "
             "importance matrix: WikiText-2 valid, 64 x 256 tokens, seed 0. `quantize s`: the quantize stage "
             "(auto-round: its whole `quantize_and_save`).", "",
             "| model | setting | method | KL | top-1 | ppl ratio | eff. bits | quantize s |", "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['model']} | {setting(r)} | {r['method']} | {r['kl']:.4f} | {r['top1']:.4f} | "
                     f"{r['ppl_ratio']:.4f} | {r['effective_bits']} | {r['quantize_seconds']} |")
    for e in res.get("errors", []):
        lines.append(f"\nNot measured: {e}")
    if res.get("speed"):
        lines += ["", "Speed on random weights (one matrix, seconds):", "",
                  "| weights | setting | plain RTN s | optimised RTN s |", "|---|---|---|---|"]
        for r in res["speed"]:
            lines.append(f"| {r['weights']:,} | {setting(r)} | {r['rtn_seconds']} | {r['optimized_seconds']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.rtn_optimized", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", action="append", help="run only these models (repeatable): " + ", ".join(SETTINGS))
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated compress rows: rtn, rtn-opt, gptq")
    p.add_argument("--autoround", default="ref-llama-7m", help="models on which auto-round's iters=0 runs too "
                   "(comma-separated; empty: none)")
    p.add_argument("--setting", action="append", help="run only these settings (repeatable), e.g. W3g64asym")
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--speed", action="store_true", help="also time rtn vs optimized_rtn on 100M random weights")
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from compress.eval.machine import machine

    import sys

    t0 = time.time()
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
            "max_tokens": a.max_tokens, "command": "python -m bench.rtn_optimized " + " ".join(sys.argv[1:])}
    rows, errors = [], []
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    with_ar = {m.strip() for m in a.autoround.split(",") if m.strip()}
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.only or list(SETTINGS):
            for bits, group, sym in settings_of(name, a.setting):
                for method in methods:
                    rows.append(compress_cell(name, method, bits, group, sym, a.max_tokens, Path(tmp)))
                    log.info("%s", json.dumps(rows[-1]))
                if name in with_ar:
                    try:
                        rows.append(autoround_cell(name, bits, group, sym, a.max_tokens, Path(tmp)))
                        log.info("%s", json.dumps(rows[-1]))
                    except Exception as e:  # a peer that cannot run is recorded with the reason
                        errors.append(f"auto-round iters=0 on {name} {bits}/{group}/{sym}: {type(e).__name__}: {e}")
                        log.warning(errors[-1])
    res = {"meta": meta, "rows": rows, "errors": errors, "speed": speed() if a.speed else []}
    meta["wall_seconds"] = round(time.time() - t0, 1)
    write(res, markdown(res), a.json, a.markdown)


def settings_of(name: str, only: list | None):
    """(bits, group, sym) of model `name`, restricted to `--setting` names like W3g64asym."""
    return [(b, g, s) for b, g, s in SETTINGS[name] if not only or f"W{b}g{g}{'sym' if s else 'asym'}" in only]


def write(res: dict, text: str, json_path: Path | None, md_path: Path | None) -> None:
    """The result as JSON and markdown where asked, the markdown on stdout."""
    if json_path:
        json_path.write_text(json.dumps(res, indent=1) + "\n")
    if md_path:
        md_path.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
