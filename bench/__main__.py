"""`python -m bench ...`: the lab's benchmark commands, run from the repository root (they read ../shared/data).

`quality` (with its suites), `reproduce` and `scale`: their numbers go in bench/, docs/ and the README; each writes
a markdown table and, with --json, the raw rows. Exit codes and error messages are `compress`'s (compress.cli.run_app).
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import List, Optional

import typer

from compress.cli import JSON_OUT, MARKDOWN_OUT, STATE, emit_bench, run_app
from compress.cli import _setup_logging as setup_logging

bench_app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                        help="The lab's benchmarks, whose numbers go in bench/ and the docs (from a checkout; what a "
                             "user measures on their machine is `compress bench`).\n\n"
                             "Example: python -m bench quality --quick")


@bench_app.callback()
def _main(debug: bool = typer.Option(False, "--debug", help="print tracebacks for every error")):
    STATE["debug"] = debug


@bench_app.command("quality")
def bench_quality(
    json_out: Optional[Path] = JSON_OUT,
    md_out: Optional[Path] = MARKDOWN_OUT,
    quick: bool = typer.Option(False, "--quick", help="tiny settings, for a smoke test"),
    only: Optional[List[str]] = typer.Option(None, "--only", help="run only these models (repeatable)"),
    variant: Optional[List[str]] = typer.Option(None, "--variant", help="--suite walsh: run only these rotation "
                                                "variants (repeatable; vanilla `autoround` always runs as the reference); "
                                                "--suite select: probe, heal, oracle"),
    budget: Optional[List[float]] = typer.Option(None, "--budget", help="--suite mixed / moe: only these budgets "
                                                 "(repeatable)"),
    seed: Optional[List[int]] = typer.Option(None, "--seed", help="--suite mixed / moe: only these seeds (repeatable)"),
    method: Optional[List[str]] = typer.Option(None, "--method", help="--suite mixed / moe: only these allocation "
                                               "rows (repeatable), e.g. greedy-sens+refine, rl+refine; gemq, gemq+ft"),
    quantizer: Optional[List[str]] = typer.Option(None, "--quantizer", help="--suite moe: only these quantizers "
                                                  "(gptq, autoround; repeatable)"),
    group: Optional[int] = typer.Option(None, "--group", help="--suite moe: one group size for every budget "
                                        "(default: the smallest of 64 and 128 whose narrowest candidate leaves room "
                                        "to mix); a setting: results of different groups do not merge"),
    merge: Optional[List[Path]] = typer.Option(None, "--merge", help="--suite moe / select: fold in the cells of "
                                               "these earlier --json results (same model and settings; a cell run "
                                               "now replaces the same one there), to measure the matrix in parts; "
                                               "select: with neither --seed nor --only, only merges"),
    refine: Optional[int] = typer.Option(None, "--refine", help="--suite mixed: pair moves of the +refine rows "
                                         "(default 2000)"),
    suite: str = typer.Option("ptq", "--suite", help="`ptq`: FP/RTN/GPTQ/AutoRound matrix; `lfq`: AutoRound "
                              "with and without LFQ and hard-label CE, three seeds, with greedy-continuation scores; "
                              "`walsh`: AutoRound after no rotation, auto-round's Hadamard and the walsh modes; "
                              "`mixed`: RL vs uniform/greedy/Lagrangian mixed-precision allocation at 2.25/2.5/3.0 "
                              "effective bits (the RL learning curves go next to --markdown as *-rl-curves.png); "
                              "`flipguard`: a quantization-conditioned backdoor on stories260K against RTN int4, "
                              "with and without FlipGuard and noise; `moe`: expert-level allocation (GEMQ) and router "
                              "fine-tuning vs uniform/local/greedy on stories-moe (built into the cache when missing); "
                              "`prune`: FFN/depth pruning with and without heal, chained with AutoRound (the "
                              "size/perplexity Pareto plot goes next to --markdown as *-pareto.png); `select`: "
                              "ProbScale vs bottom/top/every/random layer subsets on MiniLM and stories-llama-1m "
                              "(SST-2, AG News; probe and heal)"),
):
    """FP, RTN, GPTQ and AutoRound at W4/W3/W2 on the real small models and MiniLM (`--suite ptq`),
    the LFQ comparison (`--suite lfq`), the rotation comparison (`--suite walsh`) or mixed-precision
    allocation (`--suite mixed`).

    Example: python -m bench quality --json bench/quality.json --markdown bench/quality.md
    """
    from compress.errors import BadInput

    setup_logging(False)
    if variant and suite not in ("walsh", "select"):
        raise BadInput("--variant selects rotation variants of --suite walsh (or probe/heal/oracle of --suite select)")
    if seed and suite not in ("mixed", "moe", "select"):
        raise BadInput("--seed selects seeds of --suite mixed, moe or select")
    if (budget or method) and suite not in ("mixed", "moe") or refine is not None and suite != "mixed":
        raise BadInput("--budget and --method select rows of --suite mixed or moe; --refine of mixed")
    if (quantizer or group) and suite != "moe" or merge and suite not in ("moe", "select"):
        raise BadInput("--quantizer and --group are options of --suite moe, --merge of --suite moe and select")
    if suite == "ptq":
        from bench.quality import run_quality

        rows, md = run_quality(quick=quick, only=only or None)
    elif suite == "lfq":
        from bench.lfq import run_lfq

        rows, md = run_lfq(quick=quick, only=only or None)
    elif suite == "walsh":
        from bench.walsh import run_walsh

        rows, md = run_walsh(quick=quick, only=only or None, variants=variant or None)
    elif suite == "mixed":
        from bench.mixed import run_mixed

        curves = md_out.with_name(f"{md_out.stem}-rl-curves.png") if md_out else None
        rows, md = run_mixed(quick=quick, only=only or None, curve_png=curves, budgets=budget or None,
                             seeds=seed or None, methods=method or None, refine=refine)
    elif suite == "moe":
        from bench.moe import run_moe

        rows, md = run_moe(quick=quick, budgets=budget or None, seeds=seed or None, methods=method or None,
                           quantizers=quantizer or None, merge=merge or (), group=group)
    elif suite == "prune":
        from bench.prune import run_prune

        pareto = md_out.with_name(f"{md_out.stem}-pareto.png") if md_out else None
        rows, md = run_prune(quick=quick, pareto=pareto)
    elif suite == "select":
        from bench.selection import run_select

        rows, md = run_select(quick=quick, seeds=seed or None, models=only or None, variants=variant or None,
                              merge=merge or (), checkpoint=json_out)
    elif suite == "flipguard":
        from bench.flipguard import run_flipguard

        rows, md = run_flipguard(quick=quick)
    else:
        raise BadInput(f"unknown --suite `{suite}` (known: ptq, lfq, walsh, mixed, moe, prune, select, "
                       "flipguard)")
    emit_bench(rows, md, json_out, md_out)


@bench_app.command("reproduce")
def bench_reproduce(
    json_out: Optional[Path] = JSON_OUT,
    md_out: Optional[Path] = MARKDOWN_OUT,
    against: Optional[Path] = typer.Option(None, "--against", help="compare with the fresh values of an earlier "
                                                                   "`--json` of this command instead of bench/"),
    quick: bool = typer.Option(False, "--quick", help="two cells, a smoke test"),
    suite: Optional[List[str]] = typer.Option(None, "--suite", help="only these suites (ptq, walsh, lfq, mixed, "
                                                                    "mixed-refine; repeatable)"),
    model: Optional[List[str]] = typer.Option(None, "--model", help="only the cells of these models (repeatable)"),
):
    """Rerun seeded cells of the stored benchmark JSONs and diff every value but the timings; exit 1 on a
    difference. Floating-point results depend on the CPU: to check that a change keeps behaviour, run it
    before and after the change on one machine (`--json before.json`, then `--against before.json`).

    Example: python -m bench reproduce --json /tmp/before.json; ...; python -m bench reproduce --against /tmp/before.json
    """
    from bench.reproduce import run_reproduce

    setup_logging(False)
    result, md = run_reproduce(quick=quick, suites=suite or None, models=model or None,
                               against=json.loads(against.read_text()) if against else None)
    emit_bench(result, md, json_out, md_out)
    if not result["identical"]:
        raise typer.Exit(1)


@bench_app.command("recipes")
def bench_recipes(
    out: Path = typer.Option(..., "--out", help="directory for each recipe's report.md (NAME.report.md)"),
    json_out: Optional[Path] = JSON_OUT,
    md_out: Optional[Path] = MARKDOWN_OUT,
    against: Optional[Path] = typer.Option(None, "--against", help="an earlier --out: compare each report.md with "
                                                                   "it, byte for byte but the timing columns"),
    recipe: Optional[List[str]] = typer.Option(None, "--recipe", help="only these bundled recipes (repeatable)"),
    repo: Path = typer.Option(Path("."), "--repo", help="the checkout whose compress and recipes run (default: this "
                                                        "one; e.g. a git worktree of the commit before a change)"),
):
    """Run every bundled recipe as the e2e tier runs it (shrunk), each in its own process, and keep its report.md;
    with --against, exit 1 when a report differs. To check that a change keeps behaviour, run it before and after
    the change on one machine.

    Example: python -m bench recipes --out /tmp/before; ...; python -m bench recipes --out /tmp/after
    --against /tmp/before
    """
    from bench.recipes import markdown, run_recipes

    setup_logging(False)
    result = run_recipes(out, against, recipe or None, repo, log=lambda line: typer.echo(line, err=True))
    emit_bench(result, markdown(result, against), json_out, md_out)
    if not result["identical"]:
        raise typer.Exit(1)


@bench_app.command("scale")
def bench_scale(
    json_out: Optional[Path] = JSON_OUT,
    md_out: Optional[Path] = MARKDOWN_OUT,
    model: Optional[List[str]] = typer.Option(None, "--model", help="shapes to run (repeatable): smollm2-135m, "
                                              "qwen3-0.6b, llama-3.2-1b (default: all three), llama-3.1-8b, "
                                              "llama-3.1-70b (with --blocks for every method), tiny"),
    method: Optional[List[str]] = typer.Option(None, "--method", help="rtn, gptq, autoround (repeatable; default: "
                                               "all three; autoround is measured on one block)"),
    nsamples: int = typer.Option(16, "--nsamples", help="calibration windows"),
    seqlen: int = typer.Option(256, "--seqlen", help="tokens per calibration window"),
    iters: int = typer.Option(10, "--iters", help="AutoRound iterations on the measured block (extrapolated to 200)"),
    blocks: Optional[List[str]] = typer.Option(None, "--blocks", help="[MODEL/]METHOD=N: run only the first N "
                                               "blocks (of MODEL's shapes, or of each) and extrapolate to the "
                                               "depth (repeatable; default autoround=1, gptq=3)"),
    keep: Optional[Path] = typer.Option(None, "--keep", help="write (and reuse) the random models here"),
    quick: bool = typer.Option(False, "--quick", help="the tiny shapes only, a smoke test"),
    check: bool = typer.Option(False, "--check-export", help="check each whole-model export loads in transformers "
                               "(every block's tensor headers, and a one-block cut loaded and run; --quick does)"),
):
    """Streamed W4 quantization at real model shapes (random weights): seconds per block, peak RSS, disk written,
    and an extrapolation to Llama-3.1-8B and 70B shapes.

    Example: python -m bench scale --json bench/scale.json --markdown bench/scale.md
    """
    from bench.quality import TEXT
    from bench.scale import SHAPES, markdown
    from bench.scale import run as run_scale
    from compress.errors import BadInput

    setup_logging(False)
    models = ["tiny"] if quick else model or ["smollm2-135m", "qwen3-0.6b", "llama-3.2-1b"]
    methods = method or ["rtn", "gptq", "autoround"]
    bad = [m for m in models if m not in SHAPES] + [m for m in methods if m not in ("rtn", "gptq", "autoround")]
    if bad:
        raise BadInput(f"unknown --model/--method {', '.join(bad)} (models: {', '.join(SHAPES)}; methods: rtn, gptq, "
                       "autoround)")
    measured = {"autoround": 1, "gptq": 3}
    for spec in blocks or ():
        key, _, n = spec.partition("=")
        shape, _, m = key.rpartition("/")
        if m not in methods or (shape and shape not in models) or not n.isdigit() or int(n) < 1:
            raise BadInput(f"--blocks `{spec}`: give [MODEL/]METHOD=N with a model and method being run and N >= 1")
        measured[key] = int(n)
    cal = str(TEXT / "tinystories" / "tinystories_val.txt")
    result = run_scale(models, methods, nsamples=4 if quick else nsamples, seqlen=64 if quick else seqlen,
                       iters=2 if quick else iters, cal=cal, keep=keep, measured=measured, check=check or quick)
    emit_bench(result, markdown(result), json_out, md_out)


@bench_app.command("peers")
def bench_peers(
    json_out: Optional[Path] = JSON_OUT,
    md_out: Optional[Path] = MARKDOWN_OUT,
    model: str = typer.Option("ref-llama-7m", "--model", help="a model directory, smollm2-135m-instruct or a model "
                              "under ../shared/data/models"),
    bits: int = typer.Option(4, "--bits", help="weight bits"),
    group: int = typer.Option(128, "--group", help="group size"),
    sym: bool = typer.Option(True, "--sym/--asym", help="symmetric or asymmetric weights"),
    nsamples: int = typer.Option(128, "--nsamples", help="calibration windows (WikiText-2 valid), every cell"),
    seqlen: int = typer.Option(512, "--seqlen", help="tokens per calibration window"),
    seeds: str = typer.Option("0,1,2", "--seeds", help="comma-separated seeds of the calibration windows (and of "
                              "AutoRound); data-free cells run once"),
    max_tokens: int = typer.Option(8192, "--max-tokens", help="evaluation tokens (WikiText-2 raw test)"),
    peer_iters: int = typer.Option(200, "--peer-iters", help="AutoRound iterations, auto-round's and compress's "
                                   "(auto-round's own default: 200)"),
    cells: Optional[str] = typer.Option(None, "--cells", help="comma-separated cells to run (the others are rows "
                                        "marked not run): rtn, rtn-opt, gptq, gptq-ao, autoround, awq+gptq, "
                                        "awq+autoround, sq+gptq, sq+rtn, sq0.8+rtn, walsh+gptq, walsh+rtn, "
                                        "infoquant+gptq, infoquant+rtn, walsh+sq+gptq, infoquant+sq+gptq, autoround+lfq, "
                                        "ar, ar-rtn, llmc-gptq, llmc-rtn, llmc-awq, llmc-sq+gptq, nncf-awq, and with "
                                        "--scheme mxfp4 mixq-0, mixq-32, mixq-64 (bench/mixq.py)"),
    mc_task: str = typer.Option("sst2_mc", "--mc-task", help="log-likelihood multiple-choice task every cell is "
                                "also scored on (a bundled name, a task YAML or a JSONL; '' for none)"),
    mc_limit: Optional[int] = typer.Option(None, "--mc-limit", min=1, help="--mc-task: its first N documents"),
    build_env: Optional[List[str]] = typer.Option(None, "--build-env", help="first build (or reuse) a peer's own "
                                                  "environment: llmcompressor (repeatable)"),
    scheme: Optional[str] = typer.Option(None, "--scheme", help="a weight-and-activation scheme instead of a weight "
                                         "setting: w8a8-int8, fp8, nvfp4a16, mxfp4a16, nvfp4, mxfp4, w4a8-int8, w4a8-fp8, w4a4 "
                                         "(cells rtn, gptq, sq+gptq, sq+rtn, sq0.8+rtn, walsh+gptq, llmc-gptq, "
                                         "llmc-sq+gptq; "
                                         "checkpoints scored as served, through transformers + compressed-tensors)"),
    kv_cache: Optional[str] = typer.Option(None, "--kv-cache", help="with --scheme: also quantize the KV cache of "
                                           "compress's cells, TYPE[:SCALES]: fp8, int8, int4 with tensor (default), "
                                           "head or dynamic (int4:dynamic is the KV4 of the W4A4KV4 studies)"),
):
    """compress's PTQ cells side by side with auto-round, llm-compressor and NNCF on one model and weight
    setting: the same calibration windows and evaluation tokens, scored by compress's evaluator (KL, top-1,
    perplexity ratio, stored bytes of the quantized linear layers). A peer that cannot run is a row with the reason.

    Example: python -m bench peers --model ref-llama-7m --bits 4 --group 128 --sym --nsamples 8 --seqlen 128
    --max-tokens 2048 --peer-iters 10 --seeds 0
    """
    from bench.peers import build_env as build, markdown, run_peers
    from compress.errors import BadInput

    setup_logging(False)
    for name in build_env or ():
        info = build(name, echo=lambda line: typer.echo(line, err=True))
        typer.echo(f"{name}: {info['path']} ({info['versions'].splitlines()[-1]})", err=True)
    try:
        seed_list = tuple(int(x) for x in seeds.split(",") if x.strip())
    except ValueError:
        raise BadInput(f"--seeds `{seeds}`: give comma-separated integers, e.g. 0,1,2") from None
    if not seed_list:
        raise BadInput("--seeds: give at least one seed")
    result = run_peers(model, bits, group, sym, nsamples=nsamples, seqlen=seqlen, seeds=seed_list,
                       max_tokens=max_tokens, peer_iters=peer_iters,
                       cells=[c.strip() for c in cells.split(",") if c.strip()] if cells else None,
                       mc_task=mc_task or None, mc_limit=mc_limit, scheme=scheme, kv_cache=kv_cache,
                       command="python -m bench peers " + shlex.join(sys.argv[2:]),
                       checkpoint=lambda partial: _save_partial(partial, markdown, json_out, md_out))
    emit_bench(result, markdown(result), json_out, md_out)


def _save_partial(result: dict, markdown, json_out: Optional[Path], md_out: Optional[Path]) -> None:
    """The cells finished so far, written where the final result goes (replaced by it at the end)."""
    from compress.files import atomic_write_bytes

    if json_out:
        atomic_write_bytes(Path(json_out), (json.dumps(result, indent=2) + "\n").encode())
    if md_out:
        atomic_write_bytes(Path(md_out), markdown(result).encode())


@bench_app.command("peers-summary")
def bench_peers_summary(
    files: List[Path] = typer.Argument(..., help="JSON files `python -m bench peers --json` wrote"),
    md_out: Optional[Path] = MARKDOWN_OUT,
):
    """One row per model and setting of several `peers` runs: compress's best cell beside the best peer's (KL mean
    +- standard deviation over the seeds, top-1, task accuracy, stored bits), for docs/quantize.md. Files of the same
    model and setting are merged (extra seeds of a cell in a later file replace its earlier runs).

    Example: python -m bench peers-summary bench/peers-smollm2-*.json
    """
    from bench.peers import summary
    from compress.errors import BadInput

    results = []
    for f in files:
        try:
            results.append((f.name, json.loads(f.read_text())))
        except (OSError, ValueError) as e:
            raise BadInput(f"{f}: not a `bench peers --json` file ({e})") from e
    md = summary(results)
    typer.echo(md, nl=False)
    if md_out:
        md_out.write_text(md)


def main(argv=None) -> int:
    """`python -m bench ARGS`, with `compress`'s exit codes."""
    return run_app(bench_app, argv)


if __name__ == "__main__":
    sys.exit(main())
