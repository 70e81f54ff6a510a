"""`compress run`: recipe -> workspace -> load -> stages -> evaluate -> export -> reports.

Stages are keyed `NN-stage-method`; a stage's inputs hash covers the model, the calibration spec
and every stage config up to and including it, so `--resume` skips finished stages with the same
inputs (their per-block checkpoints are re-applied) and continues an unfinished block-wise stage
from its last finished block.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from compress import inputs, registry
from compress.calibration import calibration_tokens, tokens_hash
from compress.errors import BadInput, RunFailure
from compress.models.adapters import ModelAdapter
from compress.models.loading import load_config, load_model, max_positions
from compress.qweight import QuantizedWeight
from compress.workspace import Workspace, non_finite, peak_rss_mb

log = logging.getLogger("compress")


def _bar(quiet: bool):
    from tqdm.auto import tqdm

    def make(**kw):
        return tqdm(disable=quiet, file=sys.stderr, dynamic_ncols=True, **kw)

    return make


@dataclass
class StageContext:
    """What a stage's `apply(ctx, cfg)` may use."""

    loaded: object  # LoadedRecipe
    model: torch.nn.Module
    tokenizer: object
    adapter: ModelAdapter
    workspace: Workspace
    seed: int
    progress: Callable
    quiet: bool = False
    streamer: object | None = None  # BlockStreamer when model.stream is set
    block_stage: str | None = None  # key of the stage whose block checkpoints hold the codes
    key: str = ""
    fp_bytes: int = 0  # the loaded model's parameter bytes, before any stage (a rotation may untie the head)
    qweights: dict[str, QuantizedWeight] = field(default_factory=dict)
    plan: object | None = None  # methods.allocate.Plan from an `allocate` stage, consumed by the next `quantize`
    allocation: dict | None = None  # summary and file names of the last allocation (report.md links them)
    _tokens: torch.Tensor | None = None

    def calibration_tokens(self) -> torch.Tensor:
        """The (nsamples, seqlen) calibration batch, tokenized once per run. Its hash goes into the manifest;
        on resume it must equal the earlier run's (same files, but another tokenizer version would not)."""
        if self._tokens is None:
            c = self.loaded.recipe.calibration
            tokens = calibration_tokens(
                self.tokenizer, list(c.sources), nsamples=c.nsamples, seqlen=c.seqlen, seed=c.seed,
                field=c.text_field, bos_id=bos_id(self.tokenizer, self.adapter),
            )
            record = self.workspace.manifest["inputs"]
            digest, earlier = tokens_hash(tokens), record.get("calibration_tokens_sha256")
            if earlier is not None and earlier != digest:
                raise BadInput("the tokenized calibration differs from the earlier run's although the model and "
                               "calibration files are the same (another tokenizers or transformers version?); "
                               "the earlier stages cannot be continued: rerun with --force to start over")
            record["calibration_tokens_sha256"] = digest
            self.workspace.save_manifest()
            self._tokens = tokens
        return self._tokens


def bos_id(tokenizer, adapter) -> int | None:
    if adapter.kind == "encoder":
        return getattr(tokenizer, "cls_token_id", None)
    return getattr(tokenizer, "bos_token_id", None)


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def stage_key(i: int, cfg) -> str:
    return f"{i:02d}-{cfg.stage}-{cfg.method}"


def versions() -> dict:
    import auto_round
    import transformers

    import compress

    return {"compress": compress.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "auto_round": getattr(auto_round, "__version__", "?"), "python": sys.version.split()[0]}


# -- planning (no model weights are read) ---------------------------------------------------------
def plan(loaded) -> dict:
    """Stages, layers touched and an estimate of peak memory, from the config alone."""
    r = loaded.recipe
    config = load_config(r.model.path, r.model.gguf_file)
    limit = max_positions(config)
    if limit and r.calibration.seqlen > limit:
        raise BadInput(
            f"calibration.seqlen {r.calibration.seqlen} exceeds the model's maximum of {limit} positions"
        )
    g = r.eval.generation
    if limit and g.prompts and g.prompt_tokens + g.new_tokens > limit:
        raise BadInput(f"eval.generation: prompt_tokens + new_tokens = {g.prompt_tokens + g.new_tokens} exceeds the "
                       f"model's maximum of {limit} positions")
    from accelerate import init_empty_weights
    from transformers import AutoModel, AutoModelForCausalLM

    from compress.models.adapters import ARCHS
    from compress.quantize_stage import planned_layers

    kind = ARCHS[config.model_type].kind
    cls = AutoModelForCausalLM if kind == "causal" else AutoModel
    with init_empty_weights():
        skeleton = cls.from_config(config)
    adapter = ModelAdapter(skeleton)
    n_params = sum(p.numel() for p in skeleton.parameters())
    bytes_per = torch.finfo(getattr(torch, r.model.dtype)).bits // 8
    act = r.calibration.nsamples * r.calibration.seqlen * config.hidden_size * 4
    stages = []
    for i, cfg in enumerate(r.stage_configs):
        if cfg.stage == "rotate" and any(c.stage == "quantize" for c in r.stage_configs[:i]):
            raise BadInput(f"stage {i} (`rotate`) comes after a `quantize` stage; rotations must run before "
                           "quantization (they rewrite the weights the quantizer rounds)")
        entry = registry.get(cfg.stage, cfg.method)
        if entry.check is not None:
            cfg = entry.check(adapter, cfg, r) or cfg
        layers = planned_layers(adapter, cfg) if cfg.stage == "quantize" else {}
        stages.append({"key": stage_key(i, cfg), "stage": cfg.stage, "method": cfg.method,
                       "layers": len(layers), "config": cfg.model_dump()})
    for fmt in r.export.formats:  # export formats with a plan-time check (e.g. OpenVINO's NPU target)
        entry = registry.get("export", fmt if isinstance(fmt, str) else fmt.format)
        if entry.check is not None:
            entry.check(adapter, entry.config() if isinstance(fmt, str) else fmt, r)
    inputs.check_data(loaded, kind)  # reads every data file: after the cheap checks
    if r.model.stream:
        _check_streamable(r)
        per_block = sum(p.numel() for p in adapter.blocks[0].parameters())
        rest = n_params - per_block * len(adapter.blocks)
        est = (rest + per_block) * bytes_per + 3 * act  # non-block weights + one block + activations
    else:
        est = 2 * n_params * bytes_per + 3 * act  # model + FP reference for eval, three activation streams
    return {"model": r.model.path, "model_type": config.model_type, "blocks": len(adapter.blocks),
            "parameters": n_params, "stages": stages, "export": export_names(r),
            "estimated_peak_memory_mb": round(est / 2**20, 1)}


def _check_streamable(r) -> None:
    blockwise = [c for c in r.stage_configs if c.stage == "quantize"]
    if len(blockwise) != 1 or len(r.stage_configs) != 1:
        raise BadInput("model.stream supports exactly one `quantize` stage")
    if [f for f in export_names(r) if f != "hf"]:
        raise BadInput("model.stream exports only the `hf` format")


def export_names(recipe) -> list[str]:
    return [f if isinstance(f, str) else f.format for f in recipe.export.formats]


# -- running ----------------------------------------------------------------------------------------
def run(loaded, output: Path, *, resume=False, force=False, quiet=False) -> dict:
    """Plan (every input checked), take OUTPUT under a lock, run. A bad input found while running
    removes what the run wrote only if no stage had finished and OUTPUT held nothing else; finished
    stages are always kept for `--resume`."""
    plan(loaded)  # validates inputs, shapes and limits before anything heavy
    ws = Workspace(output, resume=resume, force=force, inputs=inputs.local_paths(loaded))
    handler = _attach_log(ws)
    discard = False
    try:
        return _run(loaded, ws, quiet)
    except BadInput as e:
        if ws.finished_stages():
            raise BadInput(f"{e}\nthe finished stages are kept in `{output}`: fix this and rerun with --resume") from e
        discard = True
        raise
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()  # before a discard removes run.log
        ws.discard() if discard else ws.close()


def _run(loaded, ws: Workspace, quiet: bool) -> dict:
    r = loaded.recipe
    prior = ws.manifest.get("inputs") or {}
    ws.manifest.update(recipe=loaded.recorded, recipe_sha256=loaded.sha256, versions=versions(),
                       inputs=_identify_inputs(loaded, prior))
    ws.save_manifest()
    progress = _bar(quiet)
    timings: list[dict] = []
    t0 = time.time()
    with _timed(timings, "load", "stream" if r.model.stream else "-"):
        if r.model.stream:
            from compress.models.streaming import BlockStreamer, load_streaming

            model, tok, source = load_streaming(r.model.path, r.model.dtype)
        else:
            model, tok = load_model(r.model.path, r.model.dtype, r.model.gguf_file)
        adapter = ModelAdapter(model)
    ctx = StageContext(loaded, model, tok, adapter, ws, r.calibration.seed, progress, quiet,
                       fp_bytes=_param_bytes(model))
    if r.model.stream:
        ctx.streamer = BlockStreamer(model, adapter, source, r.model.dtype)
    prefix: list = [ws.manifest["inputs"]["sha256"]]  # model and calibration, by path and by content
    for i, cfg in enumerate(r.stage_configs):
        ctx.key = stage_key(i, cfg)
        files = inputs.stage_files(cfg)
        prefix.append({**cfg.model_dump(), "_files": files} if files else cfg.model_dump())
        inputs_hash = _hash(prefix)
        entry = registry.get(cfg.stage, cfg.method)
        resumed = ws.stage_done(ctx.key, inputs_hash)
        if not resumed:
            ws.stage_begin(ctx.key, cfg.stage, cfg.method, inputs_hash)
        start = time.time()
        log.info("stage %s%s", ctx.key, " (finished earlier: re-applying checkpoints)" if resumed else "")
        metrics = entry.apply(ctx, cfg)
        secs = time.time() - start
        if not resumed:
            ws.stage_end(ctx.key, secs, metrics)
        st = ws.manifest["stages"][ctx.key]
        timings.append({"name": cfg.stage, "method": cfg.method, "seconds": st["seconds"],
                        "peak_rss_mb": st["peak_rss_mb"], "resumed": resumed})
    report = {"model": loaded.recorded["model"]["path"], "recipe_sha256": loaded.sha256, "stages": timings}
    figures = {t: p for st in ws.manifest["stages"].values() for t, p in (st.get("metrics") or {}).get("figures", {}).items()}
    if figures:
        report["figures"] = figures
    if ctx.allocation:
        report["allocation"] = ctx.allocation
    if r.eval.enabled and r.eval.data and r.model.stream:
        log.warning("model.stream: the in-run evaluation needs the whole model in memory and is skipped; "
                    "run `compress eval OUTPUT/hf --reference MODEL --data FILE` where memory allows")
    elif r.eval.enabled and r.eval.data:
        with _timed(timings, "eval", adapter.kind):
            report["eval"] = evaluate(ctx, r)
    exports = {}
    for fmt in export_names(r):
        with _timed(timings, "export", fmt):
            exports[fmt] = registry.get("export", fmt).apply(ctx, fmt_config(r, fmt))
    report["size"] = size_report(ctx, exports)
    report["exports"] = {k: v.get("path") for k, v in exports.items()}
    report["seconds"] = round(time.time() - t0, 2)
    report["peak_rss_mb"] = round(peak_rss_mb(), 1)
    ws.manifest["report"] = "report.json"
    # what each export wrote (the openvino one: target devices, compiled here or not); file lists stay in report
    ws.manifest["exports"] = {k: {f: x for f, x in v.items() if f != "files"} for k, v in exports.items()}
    ws.save_manifest()
    bad = non_finite(report)
    if bad:
        report["non_finite"] = bad
    ws.write_json("report.json", report)
    from compress.eval.report import render_markdown

    ws.write_text("report.md", render_markdown(report))
    ws.record_files()  # sha256 of every artifact: `compress verify`, inspect and eval check them
    ws.save_manifest()
    if bad:
        raise RunFailure(f"the run produced non-finite values ({', '.join(bad[:4])}): the compressed model is "
                         f"broken (NaN or overflow); they are null in {ws.path('report.json')}")
    return report


def _identify_inputs(loaded, prior: dict) -> dict:
    """manifest["inputs"]: content hashes of the model and calibration files, and `sha256` over them and the
    resolved model/calibration specs (the root of every stage key). On resume, a change is logged by name;
    the tokenized calibration's hash is carried over only when nothing it depends on changed."""
    fp = inputs.fingerprint(loaded.recipe)
    key = _hash([loaded.resolved.get("model"), loaded.resolved.get("calibration"), fp])
    out = {"sha256": key, **fp}
    if prior.get("sha256") == key:
        if "calibration_tokens_sha256" in prior:
            out["calibration_tokens_sha256"] = prior["calibration_tokens_sha256"]
    elif prior:
        what = inputs.changes(prior, fp) or ["the model or calibration settings"]
        log.warning("--resume: since the earlier run, %s changed; every stage is recomputed", "; ".join(what))
    return out


def fmt_config(recipe, name):
    for f in recipe.export.formats:
        if (f if isinstance(f, str) else f.format) == name:
            return registry.get("export", name).config() if isinstance(f, str) else f
    raise KeyError(name)


class _timed:
    def __init__(self, timings: list, name: str, method: str):
        self.timings, self.name, self.method = timings, name, method

    def __enter__(self):
        self.t = time.time()

    def __exit__(self, *exc):
        if exc[0] is None:
            self.timings.append({"name": self.name, "method": self.method, "seconds": round(time.time() - self.t, 3),
                                 "peak_rss_mb": round(peak_rss_mb(), 1)})


def _attach_log(ws: Workspace) -> logging.Handler:
    """run.log receives INFO and above for the duration of one run; the caller removes it."""
    handler = logging.FileHandler(ws.path("run.log"))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.setLevel(logging.INFO)
    root = logging.getLogger()
    root.addHandler(handler)
    if root.level > logging.INFO:
        root.setLevel(logging.INFO)
    return handler


def evaluate(ctx: StageContext, r) -> dict:
    """FP reference (reloaded from the checkpoint) vs the compressed in-memory model, same tokens."""
    fp_model, _ = load_model(r.model.path, r.model.dtype, r.model.gguf_file)
    ModelAdapter(fp_model)  # same module structure as the compressed model
    out = evaluate_encoder(ctx, r, fp_model) if ctx.adapter.kind == "encoder" else evaluate_causal(ctx, r, fp_model)
    del fp_model
    return out


def evaluate_encoder(ctx: StageContext, r, fp_model) -> dict:
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


def evaluate_causal(ctx: StageContext, r, fp_model) -> dict:
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


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # tied tensors counted once


def size_report(ctx: StageContext, exports: dict) -> dict:
    """Sizes against the model as loaded: an untied LM head (fused rotation) is a real cost of the result."""
    model = ctx.model
    qnumel = sum(q.codes.numel() for q in ctx.qweights.values())
    qbits = sum(q.storage_bits() for q in ctx.qweights.values())
    names = set(ctx.qweights)
    other = sum(m.weight.numel() * m.weight.element_size() for n, m in model.named_modules()
                if n in names)  # the FP bytes those layers replace
    packed = _param_bytes(model) - other + math.ceil(qbits / 8)
    on_disk = next((v["bytes"] for v in exports.values() if v.get("bytes")), None)
    out = {"fp_bytes": ctx.fp_bytes, "bytes": on_disk if on_disk is not None else packed, "packed_bytes": packed,
           "effective_bits": round(qbits / qnumel, 4) if qnumel else None,
           "quantized_params": qnumel, "quantized_layers": len(ctx.qweights)}
    # what each export really stored: a layer its format cannot hold packed is written dense
    stored = {fmt: {"bytes": v.get("bytes"), "packed_layers": len(ctx.qweights) - v["dense_layers"],
                    "dense_layers": v["dense_layers"]} for fmt, v in exports.items() if "dense_layers" in v}
    if stored:
        out["stored"] = stored
    return out
