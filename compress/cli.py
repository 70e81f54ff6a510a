"""The `compress` command line: thin commands that parse, call `compress`, and print.

Exit codes: 0 success, 1 bad input (recipe, path, option), 2 failure while running (or pushing),
3 a quality gate failed (the run finished and wrote everything; compress/gates.py).
A bad input never prints a traceback unless `--debug` is given.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from pathlib import Path
from typing import List, Optional, Tuple

import click
import typer

from compress.config import EVAL_MAX_TOKENS

try:  # typer >= 0.2x runs on its own vendored copy of click, whose exceptions are distinct classes
    from typer._click.exceptions import UsageError as _TyperUsageError
except ImportError:  # older typer uses click itself
    _TyperUsageError = click.UsageError

USAGE_ERRORS = (click.UsageError, _TyperUsageError)


def _flags_without_type() -> None:
    """typer >= 0.2x prints each option's type in --help (`--dry-run <bool>`), which reads as if the flag took a
    value; a flag shows no type."""
    option = getattr(getattr(typer, "core", None), "TyperOption", None)
    shown = getattr(option, "display_type_rich", None)
    if shown is None or getattr(shown, "_compress", False):
        return

    def display_type_rich(self, ctx):
        return None if getattr(self, "is_flag", False) else shown(self, ctx)

    display_type_rich._compress = True
    option.display_type_rich = display_type_rich


_flags_without_type()
EXITS = (click.exceptions.Exit, typer.Exit)
ABORTS = (click.exceptions.Abort, typer.Abort)

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Offline compression toolkit for language models: `compress run recipe.yaml`.\n\n"
                       "Example: compress run recipes/quickstart.yaml --model ../shared/data/models/ref-llama-7m "
                       "--output out/")
STATE = {"debug": False, "argv": []}  # argv: this invocation's arguments (for a command that restarts itself)


bench_app = typer.Typer(no_args_is_help=True, help="Speed on this machine: the packed kernels, greedy decoding, and "
                        "`compress eval` of a packed export (the benchmarks behind the repository's quality tables "
                        "run from a checkout: `python -m bench`).\n\n"
                        "Example: compress bench kernels --quick")
app.add_typer(bench_app, name="bench")


@app.callback()
def _main(debug: bool = typer.Option(False, "--debug", help="print tracebacks for every error")):
    STATE["debug"] = debug


def _setup_logging(quiet: bool, ci: bool = False) -> None:
    """Logs go to stderr (warnings only with --quiet/--json; JSON lines in CI mode); run.log still gets INFO."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING if quiet else logging.INFO)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    if ci:
        from compress.publish.ci import setup_logging

        setup_logging(handler)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    for noisy in ("transformers", "auto_round", "urllib3", "httpx", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _emit_json(obj) -> None:
    from compress.files import strict_json

    sys.stdout.write(strict_json(obj))


@app.command()
def run(
    recipe: Path = typer.Argument(..., help="recipe YAML file"),
    model: Optional[str] = typer.Option(None, "--model", help="model id or local path; replaces the recipe's"),
    calibration: Optional[List[str]] = typer.Option(None, "--calibration", help="calibration text file (repeatable)"),
    eval_data: Optional[List[str]] = typer.Option(None, "--eval-data", help="evaluation text file (repeatable)"),
    output: Path = typer.Option(Path("out"), "--output", "-o", help="output directory"),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="override a recipe key: dotted.key=value"),
    resume: bool = typer.Option(False, "--resume", help="continue an interrupted run in OUTPUT"),
    force: bool = typer.Option(False, "--force", help="clear OUTPUT, an earlier run's directory, and start over "
                               "(a directory that no run wrote is never cleared)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="validate and print the plan; compute nothing"),
    seed: Optional[int] = typer.Option(None, "--seed", help="calibration seed; replaces the recipe's"),
    device: Optional[str] = typer.Option(None, "--device", help="where the blocks are calibrated and tuned: auto, "
                                         "cpu, cuda, cuda:N, xpu, mps; replaces the recipe's `device` (an absent "
                                         "device is refused before anything runs)"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bars, warnings only"),
    as_json: bool = typer.Option(False, "--json", help="print the final report JSON on stdout (logs on stderr)"),
    ci: bool = typer.Option(False, "--ci", help="CI mode (also when CI=true): no progress bars, JSON-lines log, "
                            "SHA256SUMS and summary.md in OUTPUT, a one-screen summary on stdout"),
):
    """Run a recipe: calibrate, compress, evaluate, export; check its `gates` (exit 3 when one fails) and
    `push` to the Hub when they pass.

    Example: compress run recipes/quickstart.yaml --model ../shared/data/models/ref-llama-7m --output out/
    """
    from compress import pipeline
    from compress.eval.report import summary_lines
    from compress.gates import GateFailure
    from compress.publish import ci as ci_mode
    from compress.recipe import load_recipe, validate_paths

    ci = ci_mode.enabled(ci)
    _setup_logging(quiet or as_json, ci=ci)
    loaded = load_recipe(recipe, overrides=[*(set_ or []), *([f"device={device}"] if device else [])], model=model,
                         calibration=calibration or None, eval_data=eval_data or None, seed=seed)
    validate_paths(loaded.recipe)
    if dry_run:
        p = pipeline.plan(loaded)
        _emit_json(p) if as_json else _print_plan(p)
        return
    try:
        report = pipeline.run(loaded, output, resume=resume, force=force, quiet=quiet or as_json or ci)
    except GateFailure as e:
        if ci:
            report = json.loads((output / "report.json").read_text())
            typer.echo(ci_mode.write_artifacts(output, report, error=str(e).splitlines()[0]))
        raise
    if as_json:
        _emit_json(report)
    elif ci:
        typer.echo(ci_mode.write_artifacts(output, report))
    elif not quiet:
        typer.echo("\n".join(summary_lines(report) + [f"output: {output}"]), err=False)


PLAN_LINES = 12  # layers listed one per line in the printed plan


def _print_plan(p: dict) -> None:
    typer.echo(f"model: {p['model']} ({p['model_type']}, {p['blocks']} blocks, {p['parameters']:,} parameters)")
    for s in p["stages"]:
        last = s["config"].get("final_block", "same")
        tail = f"; last block: `final_block: {last}`" if last != "same" else ""
        if s["stage"] == "quantize":
            c = s["config"]
            fmt = "".join([f", scheme {c['scheme']}" if c.get("scheme") else "",
                           f" ({c['activations']} activations)" if c.get("activations") == "static" else "",
                           f", KV cache {c['kv_cache']} ({c.get('kv_scales', 'tensor')} scales)"
                           if c.get("kv_cache") else ""])
            typer.echo(f"  {s['key']}: {s['layers']} layers{fmt}{tail}")
            adapted = s.get("adapted_groups") or {}
            if adapted:
                typer.echo(f"    group_size adapted to {len(adapted)} layers it does not fit (-1 = per-channel):")
                for name, (asked, got) in list(adapted.items())[:PLAN_LINES]:
                    typer.echo(f"      {name}: {asked} -> {got}")
                if len(adapted) > PLAN_LINES:
                    typer.echo(f"      ... and {len(adapted) - PLAN_LINES} more (`--dry-run --json` lists every one)")
        elif s["stage"] == "allocate":
            typer.echo(f"  {s['key']}: {s['what']}, for the {s['layers']} layers of the next quantize stage")
        else:
            typer.echo(f"  {s['key']}: {s['what']}")
        for line in [*s.get("changes", []), *s.get("notes", [])]:
            typer.echo(f"    {line}")
    for change in p.get("structure", []):
        typer.echo(f"  structure: {change}")
    for what, files in p.get("data", {}).items():
        for written, path in files.items():
            typer.echo(f"{what}: {written}" + (f" -> {path}" if path != written else ""))
    typer.echo(f"export: {', '.join(p['export']) or '-'}")
    for note in p.get("notes", []):
        typer.echo(f"  {note}")
    if p.get("serving"):
        typer.echo("serving (engines' published rules, docs/serving.md):")
        width = max(map(len, p["serving"]))
        for engine, problems in p["serving"].items():
            typer.echo(f"  {engine:<{width}}  " + ("serves it" if not problems else "no: " + "; ".join(problems)))
    typer.echo(f"estimated peak memory: {p['estimated_peak_memory_mb']} MB")
    if "estimated_device_peak_mb" in p:
        typer.echo(f"device: {', '.join(p.get('devices') or [p['device']])} (the blocks' work; estimated peak "
                   f"{p['estimated_device_peak_mb']} MB there: one block, its activations and Hessians)")


@app.command()
def validate(recipes: List[Path] = typer.Argument(..., help="recipe YAML files")):
    """Validate recipes without loading any model.

    Example: compress validate recipes/*.yaml
    """
    from compress.errors import BadInput
    from compress.recipe import load_recipe

    bad = 0
    for r in recipes:
        try:
            load_recipe(r)
            typer.echo(f"ok  {r}")
        except BadInput as e:
            bad += 1
            typer.echo(f"bad {r}: {e}", err=True)
    if bad:
        raise typer.Exit(1)


@app.command("eval")
def eval_(
    model: str = typer.Argument(..., help="checkpoint directory (compressed or not) or model id"),
    reference: Optional[str] = typer.Option(None, "--reference", help="full-precision model to compare against"),
    data: Optional[List[str]] = typer.Option(None, "--data", help="evaluation text file (repeatable), or "
                                             "bundled:NAME (a text shipped with compress: bundled:botchan-eval)"),
    window: int = typer.Option(256, "--window", min=2, help="tokens per perplexity window"),
    max_tokens: int = typer.Option(EVAL_MAX_TOKENS, "--max-tokens", min=0, help="cap on evaluated tokens per file, "
                                   "as a run's evaluation; 0: the whole file"),
    text_slice: Optional[Tuple[float, float]] = typer.Option(None, "--text-slice", help="evaluate only this "
                                                             "fraction [START END) of each file, e.g. 0.8 1.0"),
    gen_prompts: int = typer.Option(16, "--gen-prompts", help="with --reference: greedy continuations compared "
                                    "(common prefix, agreement, KL and top-1 along them); 0 = off"),
    prompt_tokens: int = typer.Option(32, "--prompt-tokens", help="tokens per generation prompt"),
    new_tokens: int = typer.Option(64, "--new-tokens", help="greedy tokens generated per prompt"),
    backend: str = typer.Option("auto", "--backend", help="kernels for a packed `hf` export: auto, cpu, cpu-a8, "
                                "triton, reference, or `transformers` (auto-round's loader, fp16 on CPU)"),
    ffn_mass: Optional[float] = typer.Option(None, "--ffn-mass", help="PrunePath models: cumulative router mass "
                                             "of the active FFN experts per token (1 = dense; the checkpoint's own "
                                             "tau when not given)"),
    task: Optional[List[str]] = typer.Option(None, "--task", help="task probe (repeatable): `sst2`, `ag_news` "
                                             "(files under --task-data) or NAME=TRAIN,TEST (labelled .tsv/.jsonl): "
                                             "test accuracy of a logistic probe on the pooled output"),
    task_data: str = typer.Option("../shared/data/text", "--task-data", help="directory of the named tasks' files "
                                  "(--task sst2/ag_news; --mc-task sst2_mc/ag_news_mc)"),
    pooling: str = typer.Option("mean", "--pooling", help="--task features: mean over tokens, or the last token"),
    mc_task: Optional[List[str]] = typer.Option(None, "--mc-task", help="log-likelihood multiple-choice task "
                                                "(repeatable), scored as lm-eval scores it (acc, acc_norm; with "
                                                "--reference, its accuracy and the delta): `sst2_mc`, `ag_news_mc` "
                                                "(bundled zero-shot YAMLs, data under --task-data), an lm-eval task "
                                                "YAML with local data_files, or NAME=FILE.jsonl (query/choices/gold "
                                                "rows)"),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="--mc-task: score the first N documents "
                                        "of each task (lm-eval's --limit)"),
    device: str = typer.Option("auto", "--device", help="where the models run: auto (an accelerator when torch "
                               "sees one), cpu, cuda, cuda:N, xpu, mps (perplexity and --reference comparisons)"),
    lm_eval_check: bool = typer.Option(False, "--lm-eval-check", help="--mc-task: also run the lm-eval harness "
                                       "(HF backend, CPU, batch 1, same --limit) on MODEL and each task YAML; exit 3 "
                                       "unless both accuracies agree to 1e-6 (needs the lmeval extra)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON on stdout"),
):
    """Perplexity and logit fidelity (KL, top-1 vs --reference) of any checkpoint, and how long its
    greedy continuations stay with the reference's; task probes (`--task`) for encoders and decoders;
    task accuracy by log-likelihood multiple choice (`--mc-task`, lm-eval's scoring and task YAML) for decoders.

    Example: compress eval out/hf --reference ../shared/data/models/ref-llama-7m --data ../shared/data/text/wikitext-2-raw/wiki.test.raw
    Example: compress eval out/hf --task sst2 --task ag_news
    Example: compress eval out/hf --reference MODEL --mc-task sst2_mc --mc-task ag_news_mc --limit 200
    """
    from compress.errors import BadInput
    from compress.eval.cli import evaluate_checkpoint, mc_task_accuracy, task_probes

    _setup_logging(as_json)
    if (limit or lm_eval_check) and not mc_task:
        raise BadInput("--limit and --lm-eval-check apply to --mc-task")
    res = {}
    if data or not (task or mc_task):
        cut = f" of the [{text_slice[0]}, {text_slice[1]}) slice" if text_slice else ""
        scope = (f"evaluating {f'at most {max_tokens} tokens' if max_tokens else 'every token'}{cut} of each file in "
                 f"{window}-token windows" + (" (--max-tokens 0: the whole file)" if max_tokens else ""))
        res = evaluate_checkpoint(model, reference=reference, data=data or [], window=window,
                                  max_tokens=max_tokens or None, gen_prompts=gen_prompts, prompt_tokens=prompt_tokens,
                                  new_tokens=new_tokens, backend=backend, ffn_mass=ffn_mass, text_slice=text_slice,
                                  progress=True, notify=lambda used: typer.echo(f"{_backend_line(used)}; {scope}",
                                                                                 err=True), device=device)
    if task:
        res.update({f"task {k}": v for k, v in task_probes(model, task, data_dir=task_data, pooling=pooling,
                                                            backend=backend).items()})
    if mc_task:
        res.update({f"mc-task {k}": v for k, v in mc_task_accuracy(
            model, mc_task, reference=reference, data_dir=task_data, limit=limit, backend=backend,
            lm_eval_check=lm_eval_check, progress=not as_json).items()})
    if as_json:
        _emit_json(res)
    else:
        for name, r in res.items():
            typer.echo(f"{name}: " + ", ".join(f"{k} {v:.5g}" if isinstance(v, float) else f"{k} {v}"
                                               for k, v in r.items()))
    disagree = [k for k, r in res.items() if r.get("agree") is False]
    if disagree:
        typer.echo(f"lm-eval disagrees on {', '.join(disagree)} (see lm_eval_acc, max_ll_diff)", err=True)
        raise typer.Exit(3)


def _backend_line(used: dict) -> str:
    """Which kernels run the model: 'backend cpu (210 packed layers)', or the dense model's."""
    if not used:
        return "backend: dense torch layers (no packed layer)"
    n = sum(used.values())
    return f"backend: {', '.join(f'{k} ({v} of {n} packed layers)' for k, v in used.items())}"


@app.command()
def generate(
    model: str = typer.Argument(..., help="checkpoint directory (a packed `hf` export runs on our kernels)"),
    prompt: str = typer.Option(..., "--prompt", help="text to continue"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="greedy tokens to generate"),
    backend: str = typer.Option("auto", "--backend", help="auto, cpu, cpu-a8, triton, reference, or transformers"),
    device: str = typer.Option("auto", "--device", help="where the model runs: auto (an accelerator when torch sees "
                               "one), cpu, cuda, cuda:N, xpu, mps"),
    ffn_mass: Optional[float] = typer.Option(None, "--ffn-mass", help="PrunePath models: cumulative router mass "
                                             "of the active FFN experts per token (1 = dense; the checkpoint's own "
                                             "tau when not given)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON on stdout"),
):
    """Greedy continuation of a prompt, and the decoding speed (tokens/s) on this machine.

    Example: compress generate out/hf --prompt "Once upon a time" --max-new-tokens 64 --backend cpu
    """
    from compress.eval.cli import generate_text

    _setup_logging(as_json)
    res = generate_text(model, prompt, max_new_tokens=max_new_tokens, backend=backend, ffn_mass=ffn_mass,
                        progress=True, notify=lambda used: typer.echo(_backend_line(used), err=True), device=device)
    if as_json:
        _emit_json(res)
        return
    typer.echo(res["prompt"] + res["continuation"])
    speed = f"{res['tokens_per_s']} tokens/s" if res["tokens_per_s"] is not None else "-"
    typer.echo(f"[{res['new_tokens']} tokens, prefill {res['prefill_s']:.3f} s, decode {speed}, "
               f"backend {res['backend'] or 'dense'}]", err=True)


@app.command()
def inspect(directory: Path = typer.Argument(..., help="an `hf` export directory"),
            as_json: bool = typer.Option(False, "--json", help="print JSON on stdout")):
    """What a compressed checkpoint holds: per-layer bits and group size, effective bits, size.

    Example: compress inspect out/hf
    """
    from compress.export.inspect import inspect_checkpoint

    info = inspect_checkpoint(directory)
    if as_json:
        _emit_json(info)
        return
    for row in info["layers"]:
        typer.echo(f"{row['name']:<48} {row['shape']:>12} bits {row['bits']:>2} group {row['group_size']:>4} "
                   f"{'sym ' if row['sym'] else 'asym'} eff {row['effective_bits']:.3f}")
    typer.echo(f"quantized layers: {info['quantized_layers']}, effective bits {info['effective_bits']}, "
               f"size {info['bytes'] / 2**20:.3f} MiB")
    if info["adapted_groups"]:
        name, (asked, got) = next(iter(info["adapted_groups"].items()))
        typer.echo(f"group_size adapted to {len(info['adapted_groups'])} layers it does not fit (e.g. {name}: "
                   f"{asked} -> {got}; --json lists all)")
    if info["dense"]:
        name, why = next(iter(info["dense"].items()))
        typer.echo(f"stored dense: {len(info['dense'])} quantized layers no auto-round loader reads packed "
                   f"(e.g. {name}: {why}; --json lists all)")
    for block, experts in info["experts"].items():
        typer.echo(f"{block} expert bits: " + " ".join(f"{e}:{b}" for e, b in experts.items()))
    from compress.handoff import ModelSpec

    typer.echo(ModelSpec.from_json(info["structure"]).text())
    if info.get("prunepath"):
        pp = info["prunepath"]
        typer.echo(f"  prunepath: blocks {pp['blocks']} as routed experts of {pp['expert_size']} neurons, tau "
                   f"{pp['tau']:.4f} (--ffn-mass overrides it), k_min {pp['k_min']}")


@app.command("serve-check")
def serve_check(
    out: Path = typer.Argument(..., help="a run's output directory (or an export directory; a .gguf file for "
                               "llama.cpp)"),
    engine: str = typer.Option(..., "--engine", help="vllm | transformers | openvino-genai | ort-genai | llama.cpp"),
    dtype: str = typer.Option("float16", "--dtype", help="the engine's and the reference's compute dtype "
                              "(float16, bfloat16; float32 for the graph engines' exact mode and vLLM on a "
                              "compressed-tensors export; llama.cpp: its KV cache's type)"),
    tokens: int = typer.Option(32, "--tokens", min=1, help="new tokens per prompt"),
    perplexity: Optional[str] = typer.Option(None, "--perplexity", help="transformers and llama.cpp: also compare "
                                             "perplexities on this text file (the engine's vs compress's reading)"),
    max_tokens: int = typer.Option(4096, "--max-tokens", min=1, help="tokens scored by --perplexity"),
    floor: bool = typer.Option(False, "--floor", help="also transformers itself in --dtype against the float32 "
                               "reference: what the dtype alone costs on this model"),
    as_json: bool = typer.Option(False, "--json", help="print JSON on stdout"),
):
    """Load an export in a serving engine, greedy-decode 4 fixed prompts and compare with transformers on the same
    weights (float32): tokens equal, top-5 overlap, max |dlogprob|. Exit 3 when a token differs other than at a tie
    of the reference (two tokens within 0.02 nats). Writes nothing into OUT.

    Example: compress serve-check out/ --engine vllm   (after `compress serve-env vllm`)
    Example: compress serve-check model.gguf --engine llama.cpp --perplexity bundled:botchan-eval   (after `compress
    serve-env llama.cpp`; the reference is compress's reading of the same file)
    """
    from compress.serve.check import serve_check as check

    res = check(out, engine, n_tokens=tokens, dtype=dtype, perplexity=perplexity, max_tokens=max_tokens, floor=floor)
    if as_json:
        _emit_json(res)
    else:
        t = res["tokens"]
        typer.echo(f"{engine} ({res['dtype']}) on {res['export']}: {t['equal']}/{t['total']} greedy tokens equal to "
                   f"{res['reference']}; top-5 overlap {res['top5_overlap']}, max |dlogprob| {res['max_dlogprob']}")
        for d in res["divergences"]:
            typer.echo(f"  prompt {d['prompt']} diverges at token {d['position']}: reference margin {d['margin']} "
                       f"nats ({'a tie' if d['margin'] is not None and d['margin'] <= 0.02 else 'a disagreement'})")
        if res.get("emulated"):  # llama.cpp: the reference with llama.cpp's activation rounding
            e, types = res["emulated"], ", ".join(f"{n} {t}" for t, n in res["weight_types"].items())
            typer.echo(f"against compress's reading with llama.cpp's activation rounding (linear layers: {types}): "
                       f"{e['tokens']['equal']}/{e['tokens']['total']} tokens equal, top-5 overlap "
                       f"{e['top5_overlap']}, max |dlogprob| {e['max_dlogprob']}")
        if res.get("warning"):
            typer.echo(f"warning: {res['warning']}", err=True)
        if res.get("floor"):
            f = res["floor"]
            typer.echo(f"floor: transformers in {res['dtype']}: {f['tokens']['equal']}/{f['tokens']['total']} tokens "
                       f"equal, top-5 overlap {f['top5_overlap']}, max |dlogprob| {f['max_dlogprob']}")
        if res.get("perplexity") and engine == "llama.cpp":
            p = res["perplexity"]
            typer.echo(f"perplexity ({p['tokens']} tokens of {p['data']} in {p['windows']} windows of {p['window']}): "
                       f"llama.cpp {p['llama.cpp']}, compress {p['compress']}: ratio {p['ratio']}")
        elif res.get("perplexity"):
            p = res["perplexity"]
            half = "".join(f", {v} in {k.removeprefix('transformers_')}" for k, v in p.items()
                           if k.startswith("transformers_") and k != "transformers_fp32")
            typer.echo(f"perplexity ({p['max_tokens']} tokens of {p['data']}): transformers {p['transformers_fp32']} in "
                       f"fp32{half}, compress {p['compress']}: ratio {p['ratio']}")
    if not res["agree"]:
        raise typer.Exit(3)


@app.command("serve-env")
def serve_env(name: str = typer.Argument(..., help="vllm | llama.cpp"),
              force: bool = typer.Option(False, "--force", help="rebuild it")):
    """Build (once; cached) the virtual environment of an engine whose requirements conflict with compress's, and
    print where it is. `compress serve-check --engine vllm` runs vLLM there; `--engine llama.cpp` runs llama.cpp
    (llama-cpp-python 0.3.36 and its llama-quantize/llama-imatrix/llama-perplexity, compiled for this CPU: about
    10 minutes on 2 cores; PIP_FIND_LINKS=DIR uses a local copy of its sdist).

    Example: compress serve-env vllm
    """
    from compress.serve.envs import build, path_of

    path_of(name)  # an unknown name is a bad input before any work
    info = build(name, force=force, echo=lambda m: typer.echo(m, err=True))
    typer.echo(f"{info['path']}: {info['versions']}")


@app.command()
def verify(directory: Path = typer.Argument(..., help="a run's output directory (or an export directory in it)")):
    """Check every file of a run's output against the sha256 its manifest recorded; exit 1 on any difference.

    Example: compress verify out/
    """
    from compress.verify import run_root
    from compress.verify import verify as verify_files
    from compress.workspace import MANIFEST

    root, under = run_root(directory) or (directory, "")  # not a run's: verify says why
    n, problems = verify_files(root, under)
    for line in problems:
        typer.echo(f"bad {line}", err=True)
    if problems:
        raise typer.Exit(1)
    typer.echo(f"ok: {n} files match {root / MANIFEST}")


@app.command()
def push(
    output: Path = typer.Argument(..., help="a finished run's output directory"),
    repo: str = typer.Option(..., "--repo", help="Hub repository ORG/NAME (created when missing)"),
    private: bool = typer.Option(False, "--private", help="create the repository private"),
    revision: Optional[str] = typer.Option(None, "--revision", help="branch to push to (created from main)"),
    create_pr: bool = typer.Option(False, "--create-pr", help="open a pull request instead of committing"),
    base_model: Optional[str] = typer.Option(None, "--base-model", help="the card's base_model (default: the "
                                             "recipe's model when it is a Hub id)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="list the files, their sizes and the card; contact nothing"),
    as_json: bool = typer.Option(False, "--json", help="print JSON on stdout"),
):
    """Push a run's exports, report and a generated model card to the Hugging Face Hub in one commit.

    The `hf` export goes to the repository root (`from_pretrained("ORG/NAME")` works), `onnx/` and `openvino/`
    to subfolders, the report and recipe to `compress/`. The token comes from HF_TOKEN or `hf auth login`;
    HF_ENDPOINT points at another Hub. Exit 2 when the Hub refuses or cannot be reached (nothing is committed).

    Example: compress push out/ --repo my-org/SmolLM2-135M-w4 --dry-run
    """
    from compress.publish import ci
    from compress.publish.hub import push as push_run

    _setup_logging(as_json, ci=ci.enabled(False))
    res = push_run(output, repo, private=private, revision=revision, create_pr=create_pr, dry_run=dry_run,
                   base_model=base_model)
    if as_json:
        _emit_json(res)
    elif dry_run:
        for f in res["files"]:
            typer.echo(f"{f['bytes']:>14,}  {f['path']}")
        typer.echo(f"{res['bytes']:>14,}  total, {len(res['files'])} files -> {repo}@{res['revision']} (dry run: "
                   "nothing was sent)\n\n--- README.md ---\n" + res["card"])
    else:
        typer.echo(f"{repo}@{res['revision']}: commit {res['commit'][:12]}"
                   + ("" if res["changed"] else " (nothing changed: no new commit)")
                   + (f"\npull request: {res['pr_url']}" if res["pr_url"] else "") + f"\n{res['url']}")


@app.command()
def compare(
    runs: List[Path] = typer.Argument(..., help="run output directories"),
    metric: str = typer.Option("ppl_ratio", "--metric", help="quality axis: ppl_ratio, kl, top1, gen_agree, cosine, "
                               "probe_acc"),
    size: str = typer.Option("bytes", "--size", help="size axis: bytes (MiB on disk) or effective_bits"),
    data: Optional[str] = typer.Option(None, "--data", help="evaluation file to compare on (default: the first "
                                       "file every run evaluated)"),
    markdown: Optional[Path] = typer.Option(None, "--markdown", help="also write the markdown (a pull-request "
                                            "comment) to this file"),
    plot: Optional[Path] = typer.Option(None, "--plot", help="write the size-vs-quality Pareto plot (PNG) here"),
    as_json: bool = typer.Option(False, "--json", help="print JSON on stdout"),
):
    """Runs side by side: size, quality against full precision, gates, and the size-vs-quality Pareto front.

    Example: compress compare out-w2/ out-w3/ out-w4/ --plot pareto.png --markdown compare.md
    """
    from compress.publish.compare import compare as compare_runs

    res = compare_runs(runs, metric=metric, size=size, data=data, plot=plot)
    if markdown:
        markdown.write_text(res["markdown"])
    _emit_json(res) if as_json else typer.echo(res["markdown"])


@app.command()
def sweep(
    recipe: Path = typer.Argument(..., help="recipe YAML file"),
    grid: List[str] = typer.Option(..., "--grid", help="dotted.key=v1,v2,... (repeatable; the grid is their product)"),
    output: Path = typer.Option(Path("sweep"), "--output", "-o", help="directory: points/<point>/, compare.md, "
                                "pareto.png, sweep.json"),
    model: Optional[str] = typer.Option(None, "--model", help="model id or local path; replaces the recipe's"),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="override a recipe key for every point"),
    executor: str = typer.Option("local", "--executor", help="local (one point after another) or ray"),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="Ray cluster to use (default: RAY_ADDRESS, "
                                              "else a local Ray instance)"),
    cpus_per_point: float = typer.Option(1, "--cpus-per-point", min=0.1, help="CPUs a Ray task reserves per point"),
    gpus_per_point: float = typer.Option(0, "--gpus-per-point", min=0, help="GPUs a Ray task reserves per point (Ray "
                                         "then shows the task only those: give 1 with a recipe `device: cuda`)"),
    metric: str = typer.Option("ppl_ratio", "--metric", help="quality axis of the compare report"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="warnings only"),
    as_json: bool = typer.Option(False, "--json", help="print the sweep's JSON on stdout"),
):
    """Run a recipe over a grid of settings, one output per point (resumable: rerun the same command), then
    compare the points.

    Example: compress sweep recipes/w4-gptq.yaml --model ../shared/data/models/ref-llama-7m --grid stages.0.bits=2,3,4 --grid stages.0.group_size=32,128 -o sweep/
    """
    from compress.publish.sweep import sweep as run_sweep

    _setup_logging(quiet or as_json)
    res = run_sweep(recipe, grid, output, overrides=set_ or [], replacements={"model": model} if model else {},
                    executor=executor, ray_address=ray_address, cpus_per_point=cpus_per_point,
                    gpus_per_point=gpus_per_point, quiet=True, metric=metric)
    if as_json:
        _emit_json(res)
        return
    for p in res["points"]:
        typer.echo(f"{p['point']}: {p['status']}{' (earlier)' if p.get('earlier') else ''}")
    if "compare" in res:
        typer.echo("\n" + res["compare"]["markdown"])


@app.command()
def recipes():
    """List the bundled recipes with a one-line description each.

    Example: compress recipes
    """
    from compress.recipe import bundled, describe

    for name, path in bundled().items():
        typer.echo(f"recipes/{name}: {describe(path)}")


# -- compress bench: what a user measures on their own machine ------------------------------------------------------
JSON_OUT = typer.Option(None, "--json", help="also write the result (rows, cells) as JSON here")
MARKDOWN_OUT = typer.Option(None, "--markdown", help="also write the markdown table here")


def emit_bench(result, md: str, json_out: Optional[Path], md_out: Optional[Path]) -> None:
    """A benchmark's table on stdout, and its JSON / markdown where asked (also the lab's, `python -m bench`)."""
    typer.echo(md)
    if json_out:
        json_out.write_text(json.dumps(result, indent=2) + "\n")
    if md_out:
        md_out.write_text(md)


@bench_app.command("kernels")
def bench_kernels(
    json_out: Optional[Path] = JSON_OUT,
    md_out: Optional[Path] = MARKDOWN_OUT,
    quick: bool = typer.Option(False, "--quick", help="one small shape, few repeats, for a smoke test"),
    repeats: int = typer.Option(10, "--repeats", help="timed runs per measurement (min and median reported)"),
    threads: Optional[int] = typer.Option(None, "--threads", help="threads for every backend (default: torch's)"),
    isa: str = typer.Option("native", "--isa",
                            help="native, or avx2: our kernel built for AVX2, torch's kernels and MKL's GEMM on "
                                 "their AVX2 code, as an AVX2-only CPU runs them (OpenVINO stays native; the command "
                                 "restarts itself with COMPRESS_CPU_ISA, ATEN_CPU_CAPABILITY and "
                                 "MKL_ENABLE_INSTRUCTIONS set)"),
    prefill_only: bool = typer.Option(False, "--prefill-only", help="only the prefill cut-over (kernel vs "
                                      "dequantize + BLAS at 1 to 256 rows, per bit width): what cpu.PREFILL_ROWS "
                                      "should hold for this CPU"),
):
    """Packed GEMM speed: our CPU kernel vs the reference path, torch fp32/bf16/int4 and OpenVINO int4/int2.

    Example: compress bench kernels --json bench-kernels.json --markdown bench-kernels.md
    """
    from compress.errors import BadInput
    from compress.kernels.bench import isa_env_missing, markdown
    from compress.kernels.bench import run as run_kernels

    try:
        missing = isa_env_missing(isa)
    except ValueError as e:
        raise BadInput(str(e)) from None
    if missing:  # torch and MKL read them once, at start: run this command again in a process that has them
        import os

        restart = "import sys; from compress import cli; sys.exit(cli.main())"
        os.execve(sys.executable, [sys.executable, "-c", restart, *STATE["argv"]], {**os.environ, **missing})
    _setup_logging(False)
    result = run_kernels(quick=quick, repeats=repeats, threads=threads, isa=isa, prefill_only=prefill_only)
    emit_bench(result, markdown(result), json_out, md_out)


@bench_app.command("decode")
def bench_decode(
    json_out: Optional[Path] = JSON_OUT,
    md_out: Optional[Path] = MARKDOWN_OUT,
    size: str = typer.Option("0.5b", "--size", help="model size: 0.5b (0.49B parameters), ref-7m (ref-llama-7m's "
                                               "shapes) or tiny"),
    quick: bool = typer.Option(False, "--quick", help="tiny model, 8 new tokens, 1 repeat: a smoke test"),
    new_tokens: int = typer.Option(64, "--new-tokens", help="greedy tokens per run"),
    repeats: int = typer.Option(3, "--repeats", help="runs per backend (the fastest is reported)"),
    threads: Optional[int] = typer.Option(None, "--threads", help="threads for every backend (default: torch's)"),
    openvino: bool = typer.Option(True, "--openvino/--no-openvino", help="also run the OpenVINO int4 export"),
    ffn_mass: Optional[List[float]] = typer.Option(None, "--ffn-mass", help="also decode with every FFN as PrunePath "
                                                   "experts at this tau (repeatable), fp32 and int4"),
):
    """Greedy decoding tokens/s of a random Llama (speed only): torch fp32 vs our int4 CPU kernel vs OpenVINO int4.

    Example: compress bench decode --threads 2 --json bench/decode.json --markdown bench/decode.md
    """
    from compress.errors import BadInput
    from compress.eval.decode_speed import SIZES, markdown
    from compress.eval.decode_speed import run as run_decode

    _setup_logging(False)
    if quick:
        size, new_tokens, repeats = "tiny", 8, 1
    if size not in SIZES:
        raise BadInput(f"unknown --size `{size}` (known: {', '.join(SIZES)})")
    if new_tokens < 2:
        raise BadInput("--new-tokens must be at least 2 (tokens/s counts the steps after the first)")
    if any(not 0 < t <= 1 for t in ffn_mass or ()):
        raise BadInput("--ffn-mass values are cumulative router masses in (0, 1]")
    result = run_decode(size, new_tokens=new_tokens, repeats=repeats, threads=threads, openvino=openvino,
                        ffn_mass=ffn_mass or ())
    emit_bench(result, markdown(result), json_out, md_out)


@bench_app.command("eval")
def bench_eval(
    model: str = typer.Option(..., "--model", help="full-precision model directory (e.g. ../shared/tools/smollm2.sh's)"),
    data: str = typer.Option("bundled:botchan-eval", "--data", help="evaluation text file, or bundled:NAME (a text "
                                                                  "shipped with compress)"),
    bits: Optional[List[int]] = typer.Option(None, "--bits", help="weight bits (repeatable; default 2, 3, 4, 8)"),
    group: int = typer.Option(64, "--group", help="group size of every run"),
    max_tokens: int = typer.Option(32768, "--max-tokens", help="tokens evaluated, as a run's eval.max_tokens"),
    json_out: Optional[Path] = JSON_OUT,
    md_out: Optional[Path] = MARKDOWN_OUT,
):
    """`compress eval` of packed exports vs the run's own evaluation on the same tokens: seconds and metrics.

    Example: compress bench eval --model ~/.cache/compress-data/smollm2-135m-instruct --data
    ../shared/data/text/wikitext-2-raw/wiki.test.raw --json bench/eval-smollm2.json --markdown bench/eval-smollm2.md
    """
    from compress.eval.packed_eval import BITS, markdown
    from compress.eval.packed_eval import run as run_eval

    _setup_logging(False)
    result = run_eval(model, data, bits=tuple(bits or BITS), group=group, max_tokens=max_tokens)
    emit_bench(result, markdown(result), json_out, md_out)


def main(argv=None) -> int:
    """Console entry point with the documented exit codes."""
    return run_app(app, argv)


def run_app(typer_app: typer.Typer, argv=None) -> int:
    """`typer_app` (compress's, or the lab's `python -m bench`) on ARGV with the documented exit codes."""
    from compress.errors import CompressError

    args = list(sys.argv[1:] if argv is None else argv)
    STATE["argv"] = args
    # `--debug` anywhere (every error message suggests appending it): the app's option, placed before the command
    if "--debug" in args[1:] and args[0] != "--debug" and "--" not in args[:args.index("--debug")]:
        args = ["--debug", *[a for a in args if a != "--debug"]]
    try:
        rc = typer_app(args=args, standalone_mode=False)  # an explicit typer.Exit(code) comes back as its code
        if rc == 130:  # typer turns Ctrl-C inside a command into Exit(130)
            typer.echo("interrupted; rerun with --resume to continue", err=True)
        return rc if isinstance(rc, int) else 0
    except EXITS as e:
        return e.exit_code
    except ABORTS:
        typer.echo("interrupted; rerun with --resume to continue", err=True)
        return 130
    except USAGE_ERRORS as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # typer has printed the help already, or it is the message
            if e.format_message().strip():
                e.show()
        else:
            where = f" (see `{e.ctx.command_path} --help`)" if e.ctx is not None else ""
            typer.echo(f"error: {e.format_message()}{where}", err=True)
        return 1
    except CompressError as e:
        if STATE["debug"]:
            traceback.print_exc()
        typer.echo(f"error: {e}", err=True)
        return e.exit_code
    except KeyboardInterrupt:
        typer.echo("interrupted; rerun with --resume to continue", err=True)
        return 130
    except Exception as e:  # a failure while running: exit 2, traceback with --debug
        if STATE["debug"]:
            traceback.print_exc()
        else:
            typer.echo(f"error: {type(e).__name__}: {e} (rerun with --debug for the traceback)", err=True)
        return 2


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()


@bench_app.command("gguf")
def bench_gguf(
    model: str = typer.Option(..., "--model", help="a local model directory (e.g. ../shared/data/models/ref-llama-7m)"),
    data: str = typer.Option(..., "--data", help="the text every file is scored on"),
    calibration: str = typer.Option(..., "--calibration", help="the calibration text (compress's runs and "
                                    "llama.cpp's importance matrix)"),
    types: str = typer.Option(",".join(("Q4_0", "Q4_K_M", "Q3_K_M", "Q2_K")), "--types", help="comma-separated"),
    methods: str = typer.Option("gptq", "--methods", help="compress's quantizers on each type's blocks (`gguf: TYPE`), "
                                                          "comma-separated: rtn, gptq, autoround"),
    seeds: int = typer.Option(3, "--seeds", help="compress runs per type (calibration sampling seeds)"),
    max_tokens: int = typer.Option(8192, "--max-tokens", help="tokens scored"),
    allocate: Optional[str] = typer.Option(None, "--allocate", help="also each method after this `allocate` method "
                                           "(greedy, lagrangian, rl, uniform) choosing llama.cpp types per tensor at "
                                           "the bits per weight the type's own mix gives the same tensors"),
    allocate_option: Optional[List[str]] = typer.Option(None, "--allocate-option", help="KEY=VALUE of the allocate "
                                                        "stage (repeatable), e.g. sensitivity=layer"),
    allocated_only: bool = typer.Option(False, "--allocated-only", help="with --allocate: no compress rows "
                                        "without the allocation"),
    json_out: Optional[Path] = JSON_OUT,
    md_out: Optional[Path] = MARKDOWN_OUT,
):
    """compress's GGUF files against llama.cpp's own quantize (with and without its importance matrix) of the same
    model: KL to the full-precision model, top-1, perplexity ratio and file size on the same tokens. Needs
    `compress serve-env llama.cpp`.

    Example: compress bench gguf --model ../shared/data/models/ref-llama-7m --data ../shared/data/text/wikitext-2-raw/wiki.test.raw --calibration ../shared/data/text/wikitext-2/train.txt
    """
    from compress.export.gguf import bench

    result = bench.run(model, data, calibration, types=tuple(t.strip() for t in types.split(",") if t.strip()),
                       methods=tuple(m.strip() for m in methods.split(",") if m.strip()), seeds=seeds,
                       max_tokens=max_tokens, allocate=allocate, baselines=not allocated_only,
                       allocate_options=_key_values(allocate_option or [], "--allocate-option"))
    emit_bench(result, bench.markdown(result), json_out, md_out)


def _key_values(items: list[str], flag: str) -> dict:
    """KEY=VALUE strings as a dict, each value read as YAML (numbers, booleans, strings)."""
    import yaml

    from compress.errors import BadInput

    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise BadInput(f"{flag} `{item}`: write KEY=VALUE")
        out[key] = yaml.safe_load(value)
    return out


@bench_app.command("serve")
def bench_serve(
    model: str = typer.Option(..., "--model", help="a local model directory (e.g. ../shared/data/models/ref-llama-7m)"),
    engine: str = typer.Option("vllm", "--engine", help="vllm | transformers | openvino-genai | ort-genai (an hf "
                               "export: vllm, transformers)"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="the engine's compute dtype (default float16; "
                                        "--grid: float32, the layout is what it checks)"),
    grid: bool = typer.Option(False, "--grid", help="instead: bits 2/3/4/8 x sym/asym RTN g64 exports (and AutoRound "
                              "W3 asym) loaded in transformers, perplexity against compress's reading of the same "
                              "files"),
    data: str = typer.Option("bundled:botchan-eval", "--data", help="--grid: the text scored"),
    max_tokens: int = typer.Option(8192, "--max-tokens", help="--grid: tokens scored"),
    json_out: Optional[Path] = JSON_OUT,
    md_out: Optional[Path] = MARKDOWN_OUT,
):
    """The schemes users serve (W4 g128 sym and asym, a 3/4-bit mixed plan in 4-bit containers, and a mixed export
    whose zeros are not re-centred, which must disagree), exported by real runs and checked in an engine; or, with
    --grid, every bit width and packing loaded in transformers and scored.

    Example: compress bench serve --model ../shared/data/models/ref-llama-7m --engine vllm --markdown serve.md
    """
    from compress.serve import bench

    if grid:
        result = bench.run_grid(model, data, max_tokens, dtype=dtype or "float32")
        emit_bench(result, bench.markdown_grid(result), json_out, md_out)
        return
    result = bench.run(model, engine=engine, dtype=dtype or "float16")
    emit_bench(result, bench.markdown(result), json_out, md_out)
