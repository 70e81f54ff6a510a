"""`compress run`: recipe -> bind -> workspace -> load -> stages -> evaluate -> export -> reports.

The bind step (compress/bind.py) resolves every cross-stage dependency at plan time. Stages are keyed
`NN-stage-method` and each owns `stages/NN-stage-method/`, where the hand-offs it emits are saved with
their sha256. A stage's inputs hash covers the model, the calibration spec and every bound stage config
up to and including it; on `--resume` a finished stage with the same inputs is not applied again: its
hand-offs are loaded (a stage registered `replay=True`, a rotation, is applied again instead), and an
unfinished block-wise stage continues from its last finished block (docs/stages.md).
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from compress import inputs, registry, rss
from compress.bind import Binding, Bound, Facts, bind
from compress.calibration import calibration_tokens, tokens_hash
from compress.errors import BadInput, RunFailure
from compress.evaluate import bos_id, evaluate, evaluate_tasks, param_bytes, size_report
from compress.files import non_finite
from compress.handoff import QuantizedWeights
from compress.models import devices
from compress.models.adapters import ModelAdapter
from compress.models.loading import load_config, load_model, max_positions
from compress.prune import routing as prunepath
from compress.quantize.activations import quantized_inputs, scheme_layers
from compress.quantize.kvcache import quantized_kv
from compress.serve import rules
from compress.serve.plan import written
from compress.workspace import Workspace

log = logging.getLogger("compress")


def _bar(quiet: bool):
    from tqdm.auto import tqdm

    def make(**kw):
        return tqdm(disable=quiet, file=sys.stderr, dynamic_ncols=True, **kw)

    return make


@dataclass
class StageContext:
    """What a stage's `apply(ctx, cfg)` may use: the model, the workspace, `facts` (what the bind step
    resolved for it), `inputs` (the hand-offs it consumes, by type) and `emit` (the hand-offs it produces)."""

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
    facts: Facts | None = None
    inputs: dict = field(default_factory=dict)  # hand-off type -> value consumed by this stage
    emitted: list = field(default_factory=list)
    replaying: bool = False  # a finished `replay` stage applied again on --resume
    identity: dict = field(default_factory=dict)  # inputs by name and sha256 (compress.inputs.identity)
    _tokens: torch.Tensor | None = None
    calibration_info: dict = field(default_factory=dict)  # per source: format, tokens, windows drawn from it
    exports: dict = field(default_factory=dict)  # format -> what the run's earlier exports returned
    activations: dict = field(default_factory=dict)  # {layer: ActivationSpec} of a weight-and-activation scheme
    kv: object | None = None  # the quantized KV cache (compress.quantize.kvcache.KVCache), calibrated; None: none
    _reference: ModelAdapter | None = None
    devices: list = field(default_factory=lambda: [torch.device("cpu")])  # the recipe's `device` first, resolved

    def reference(self) -> ModelAdapter:
        """The full-precision model as the recipe names it (its adapter; `.model`), loaded on first use and shared
        by every stage that compares against it and by the evaluation: read it, never change it. The pipeline
        releases it after the last stage registered `reference=True` when the run does not evaluate."""
        if self._reference is None:
            m = self.loaded.recipe.model
            self._reference = ModelAdapter(load_model(m.path, m.dtype, m.gguf_file)[0])
        return self._reference

    def emit(self, value) -> None:
        """Hand `value` (a compress.handoff.Handoff) to the later stages; the pipeline saves it."""
        self.emitted.append(value)

    def calibration_tokens(self) -> torch.Tensor:
        """The (nsamples, seqlen) calibration batch, tokenized once per run. Its hash goes into the manifest;
        on resume it must equal the earlier run's (same files, but another tokenizer version would not)."""
        if self._tokens is None:
            c = self.loaded.recipe.calibration
            tokens, self.calibration_info = calibration_tokens(
                self.tokenizer, list(c.sources), nsamples=c.nsamples, seqlen=c.seqlen, seed=c.seed,
                field=c.text_field, bos_id=bos_id(self.tokenizer, self.adapter), weights=c.weights,
                messages=c.messages_field, fmt=c.format,
            )
            for source, st in self.calibration_info.items():
                log.info("calibration: %s (%s): %d windows, %d of its %d tokens", source, st["format"],
                         st["windows"], st["calibration_tokens"], st["tokens"])
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


def _activations(ctx, binding: Binding, qweights: list, timings: list) -> dict:
    """{layer: ActivationSpec} of a weight-and-activation scheme's layers ({} for a weight-only run), static scales
    calibrated (compress/quantize/activations.py) in the dtype the compressed-tensors export stores them in."""
    from compress.quantize.activations import calibrate

    acts = scheme_layers(binding.stages, qweights)
    if not any(s.calibrated for s in acts.values()):
        return acts
    log.info("activations: calibrating %d input scales on the calibration text", len(acts))
    with _timed(timings, "calibrate", "activations"):
        return calibrate(ctx.model, acts, ctx.calibration_tokens(), _scale_dtype(binding))


def _scale_dtype(binding: Binding) -> torch.dtype:
    """The dtype the compressed-tensors export stores calibrated scales in (float32 without that export)."""
    dtype = next((b.cfg.dtype for b in binding.exports if b.cfg.format == "compressed-tensors"), None)
    return getattr(torch, dtype or "float32")


def _kv_cache(ctx, binding: Binding, timings: list):
    """The KV cache a quantize stage's `kv_cache` asks for (None: none), its static scales calibrated through the model
    as it now computes (quantized weights and activations), in the dtype the compressed-tensors export stores them."""
    from compress.quantize import kvcache

    cfg = next((b.cfg for b in binding.stages if b.cfg.stage == "quantize" and getattr(b.cfg, "kv_cache", None)), None)
    if cfg is None:
        return None
    kv = kvcache.KVCache(cfg.kv_cache, cfg.kv_scales, ctx.adapter.attention_shape()[2],
                         dict.fromkeys(kvcache.attention_modules(ctx.adapter), (None, None)))
    if cfg.kv_scales == "dynamic":
        return kv
    log.info("kv cache: calibrating the %s scales of %d attention layers on the calibration text", cfg.kv_cache,
             len(kv.layers))
    with _timed(timings, "calibrate", "kv_cache"), quantized_inputs(ctx.model, ctx.activations):
        return kvcache.calibrate(ctx.model, kv, ctx.calibration_tokens(), _scale_dtype(binding))


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def versions() -> dict:
    import auto_round
    import transformers

    import compress

    return {"compress": compress.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "auto_round": getattr(auto_round, "__version__", "?"), "python": sys.version.split()[0]}


# -- planning (no model weights are read) ---------------------------------------------------------
_LIBRARIES_MB = 250  # auto-round, safetensors, the kernels and each graph exporter, imported during a run (measured)


def plan(loaded) -> dict:
    """Stages, layers touched and an estimate of peak memory, from the config alone."""
    return _plan(loaded)[0]


def _plan(loaded) -> tuple[dict, Binding]:
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

    kind = ARCHS[config.model_type].kind
    cls = AutoModelForCausalLM if kind == "causal" else AutoModel
    with init_empty_weights():
        skeleton = cls.from_config(config)
    skeleton.tie_weights()  # from_config leaves a tied head its own (meta) tensor: counted twice otherwise
    adapter = ModelAdapter(skeleton)
    n_params = sum(p.numel() for p in skeleton.parameters())
    bytes_per = torch.finfo(getattr(torch, r.model.dtype)).bits // 8
    act = r.calibration.nsamples * r.calibration.seqlen * config.hidden_size * 4
    binding = bind(r, adapter)
    # quantize: the layers it rounds; allocate: the layers of the quantize stage its plan is for
    stages = [{"key": b.key, "stage": b.cfg.stage, "method": b.cfg.method, "layers": len(b.facts.layers),
               "what": b.entry.description, "config": b.cfg.model_dump()} for b in binding.stages]
    for st, b in zip(stages, binding.stages):
        if b.facts.adapted:  # quantize: the layers whose group the plan adapted
            st["adapted_groups"] = b.facts.adapted
        if b.facts.changes:  # the shapes the stage changes: per pruned layer, the width before and after
            st["changes"] = b.facts.changes
        if b.facts.notes:  # what the stage adapted to honour the recipe on this model
            st["notes"] = b.facts.notes
    used = devices.resolve_all(r.device, r.devices)  # BadInput (exit 1) for a device torch does not see
    device_notes = []
    if used[0].type != "cpu":
        if r.eval.enabled and (r.eval.data or r.eval.tasks):
            device_notes.append(f"the in-run evaluation runs on the CPU, not on {used[0]} (`compress eval "
                                f"OUTPUT/hf --device {used[0]}` evaluates the export there)")
        for st, b in zip(stages, binding.stages):
            if (why := _stays_on_cpu(b)) is not None:
                st["notes"] = [*st.get("notes", []), f"runs on the CPU, not on {used[0]}: {why}"]
    inputs.check_data(loaded, kind)  # reads every data file: after the cheap checks
    if r.model.stream:
        per_block = sum(p.numel() for p in adapter.blocks[0].parameters())
        rest = n_params - per_block * len(adapter.blocks)
        est = (rest + per_block) * bytes_per + 3 * act  # non-block weights + one block + activations
    else:
        est = 2 * n_params * bytes_per + 3 * act  # model + FP reference for eval, three activation streams
    if r.eval.enabled and r.eval.data and kind == "causal":  # FP and compressed logits of a window, log-softmaxed
        est += 4 * r.eval.window * getattr(config, "vocab_size", 0) * 4
    # the process as it stands (Python, torch, transformers) plus what the run imports later: the libraries
    # are most of a small model's peak (a 0.9M-parameter run peaks near 1 GB)
    graphs = sum(f in ("onnx", "openvino") for f in r.export.names())
    est += (rss.resident_mb() + _LIBRARIES_MB * (1 + graphs)) * 2**20
    out = {"model": r.model.path, "model_type": config.model_type, "blocks": len(adapter.blocks),
           "parameters": n_params, "stages": stages, "export": r.export.names(),
           "estimated_peak_memory_mb": round(est / 2**20, 1), "data": _data_files(loaded),
           "device": str(used[0])}
    if len(used) > 1:
        out["devices"] = [str(d) for d in used]
    if used[0].type != "cpu":  # one block at fp32, the calibration activations (three streams) and its Hessians
        block = max(adapter.blocks, key=lambda b: sum(p.numel() for p in b.parameters()))
        hess = sum(m.in_features ** 2 for m in block.modules() if isinstance(m, torch.nn.Linear)) * 4
        split = act / len(used)
        out["estimated_device_peak_mb"] = round((sum(p.numel() for p in block.parameters()) * 4 + 3 * split + hess)
                                                / 2**20, 1)
    if r.gates:
        from compress import gates

        out["gates"] = [g.text for g, _ in gates.check(r.gates, r, kind, r.export.names())]
    if r.push:
        out["push"] = r.push.model_dump()
    if binding.serving:  # {engine: why it cannot serve the planned checkpoint ([]: it serves it)}
        out["serving"] = rules.as_json(binding.serving)
    notes = [n for b in binding.exports for n in b.facts.notes] + device_notes
    if notes:
        out["notes"] = notes
    changed = binding.spec.differences(binding.base)
    if changed:
        out["structure"] = changed
    return out, binding


def _stays_on_cpu(b: Bound) -> str | None:
    """Why stage `b` does its work on the CPU whatever the recipe's `device` (None: it uses the device)."""
    if b.entry.on_device is None:
        return f"`{b.cfg.stage}: {b.cfg.method}` does not use `device` yet"
    return b.entry.on_device(b.cfg)


def _data_files(loaded) -> dict:
    """{"calibration": {source as written: what is read}, "eval": {...}}: a `bundled:NAME` reference and the
    shipped file it names, every other source itself."""
    r, written = loaded.recipe, loaded.resolved
    out = {"calibration": dict(zip(written["calibration"]["sources"], r.calibration.sources)),
           "eval": dict(zip(written["eval"]["data"], r.eval.data)) if r.eval.enabled else {}}
    if r.eval.enabled and r.eval.tasks:  # a bundled task: the YAML shipped with compress (docs/tasks.md)
        from compress.eval.mc_tasks import bundled

        out["eval task"] = {t: str(bundled().get(t, t)) for t in r.eval.tasks}
    return out


# -- running ----------------------------------------------------------------------------------------
def run(loaded, output: Path, *, resume=False, force=False, quiet=False) -> dict:
    """Plan (every input checked), take OUTPUT under a lock, run. A bad input found while running
    removes what the run wrote only if no stage had finished and OUTPUT held nothing else; finished
    stages are always kept for `--resume`."""
    _, binding = _plan(loaded)  # validates inputs, shapes and limits before anything heavy
    ws = Workspace(output, resume=resume, force=force, inputs=inputs.local_paths(loaded))
    handler = _attach_log(ws)
    discard = False
    try:
        return _run(loaded, binding, ws, quiet)
    except BadInput as e:
        if ws.finished_stages():
            raise BadInput(f"{e}\nthe finished stages are kept in `{output}`: fix this and rerun with --resume") from e
        discard = True
        raise
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()  # before a discard removes run.log
        ws.discard() if discard else ws.close()


def _run(loaded, binding: Binding, ws: Workspace, quiet: bool) -> dict:
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

            head = any(getattr(b.cfg, "final_block", "same") != "same" or getattr(b.cfg, "lm_head", False)
                       for b in binding.stages)  # a stage computes with the LM head
            model, tok, source = load_streaming(r.model.path, r.model.dtype, head_in_use=head)
        else:
            model, tok = load_model(r.model.path, r.model.dtype, r.model.gguf_file)
        adapter = ModelAdapter(model)
    ctx = StageContext(loaded, model, tok, adapter, ws, r.calibration.seed, progress, quiet,
                       fp_bytes=param_bytes(model), identity=inputs.identity(loaded, ws.manifest["inputs"]),
                       devices=devices.resolve_all(r.device, r.devices))
    if ctx.devices[0].type != "cpu":
        log.info("device: %s (the accelerated stages' block work; the model stays on the CPU)",
                 ", ".join(map(str, ctx.devices)))
        devices.deterministic(ctx.devices[0])
    if r.model.stream:
        ctx.streamer = BlockStreamer(model, adapter, source, r.model.dtype)
    handoffs: dict[type, list] = {}
    prefix: list = [ws.manifest["inputs"]["sha256"]]  # model and calibration, by path and by content
    if ctx.devices[0].type != "cpu":  # another device rounds differently: its stages are not the CPU run's
        prefix.append({"device": ctx.devices[0].type, "devices": len(ctx.devices)})
    evaluates = r.eval.enabled and bool(r.eval.data or r.eval.tasks) and not r.model.stream
    for k, b in enumerate(binding.stages):
        files = inputs.stage_files(b.cfg)
        prefix.append({**b.cfg.model_dump(), "_files": files} if files else b.cfg.model_dump())
        _run_stage(ctx, b, _hash([*prefix, _facts_digest(b.facts)]), handoffs, timings)
        if not evaluates and not any(later.entry.reference for later in binding.stages[k + 1:]):
            ctx._reference = None  # no later reader of the full-precision model
    qweights = QuantizedWeights.merged(handoffs.get(QuantizedWeights, []))
    report = {"model": ctx.identity["model"]["name"], "recipe_sha256": loaded.sha256, "inputs": ctx.identity,
              "stages": timings}
    if ctx.devices[0].type != "cpu":
        report["device"] = {"devices": [str(d) for d in ctx.devices], "name": devices.name(ctx.devices[0]),
                            "deterministic": devices.DETERMINISM}
    figures = {t: p for st in ws.manifest["stages"].values() for t, p in (st.get("metrics") or {}).get("figures", {}).items()}
    if figures:
        report["figures"] = figures
    report.update(_sections(ws.manifest["stages"].values()))
    if ctx.calibration_info:
        report["calibration"] = ctx.calibration_info
    if r.eval.enabled and (r.eval.data or r.eval.tasks) and r.model.stream:
        log.warning("model.stream: the in-run evaluation needs the whole model in memory and is skipped; "
                    "run `compress eval OUTPUT/hf --reference MODEL --data FILE` where memory allows")
    # a weight-and-activation scheme: the evaluation computes with its quantized activations, the export stores them
    ctx.activations = _activations(ctx, binding, handoffs.get(QuantizedWeights, []), timings)
    acts = ctx.activations
    if acts:
        static = sum(not s.dynamic for s in acts.values())
        report["activations"] = {"layers": len(acts), "static": static, "as": next(iter(acts.values())).describe()
                                 + " (compressed-tensors' arithmetic: docs/formats.md#w8a8-int8)"}
    ctx.kv = _kv_cache(ctx, binding, timings)
    if ctx.kv is not None:
        report["kv_cache"] = {"layers": len(ctx.kv.layers), "type": ctx.kv.type, "scales": ctx.kv.scales,
                              "as": ctx.kv.describe() + " (docs/formats.md#quantized-kv-cache)"}
    if evaluates:
        log.info("evaluation: %s against the full-precision model", ", ".join(
            [Path(p).name for p in r.eval.data] + [f"task {t}" for t in r.eval.tasks]))
        with _timed(timings, "eval", adapter.kind), quantized_inputs(ctx.model, acts), quantized_kv(ctx.model, ctx.kv):
            if r.eval.data:
                report["eval"] = evaluate(ctx, r)
            if r.eval.tasks:
                report["tasks"] = evaluate_tasks(ctx, r)
        ctx._reference = None
    exports = ctx.exports
    for b in binding.exports:
        with _timed(timings, "export", b.cfg.format):
            ctx.key, ctx.facts = b.key, b.facts
            ctx.inputs = {k: v[-1] for k, v in handoffs.items() if k in b.entry.uses}
            if QuantizedWeights in ctx.inputs:
                ctx.inputs[QuantizedWeights] = QuantizedWeights(qweights, ctx.inputs[QuantizedWeights].stage, 0)
            exports[b.cfg.format] = b.entry.apply(ctx, b.cfg)
        res = exports[b.cfg.format]
        log.info("export %s: %s%s", b.cfg.format, res.get("path"), f" ({res['bytes']:,} bytes)" if res.get("bytes") else "")
    report["size"] = size_report(ctx, qweights, exports)
    report["exports"] = {k: v.get("path") for k, v in exports.items()}
    if exports:  # which engines serve what was written (compress/serve/rules.py), with the reason where one does not
        report["serving"] = rules.as_json(rules.table(written(qweights, exports, ctx.adapter.model_type)))
    report["seconds"] = round(time.time() - t0, 2)
    report["peak_rss_mb"] = round(rss.run_peak_mb(), 1)
    ws.manifest["report"] = "report.json"
    # what each export wrote (the openvino one: target devices, compiled here or not); file lists stay in report
    ws.manifest["exports"] = {b.cfg.format: {**{f: x for f, x in exports[b.cfg.format].items() if f != "files"},
                                             "directory": b.cfg.directory} for b in binding.exports}
    ws.save_manifest()
    bad = non_finite(report)
    if bad:
        report["non_finite"] = bad
    if r.gates:
        from compress import gates

        report["gates"] = gates.evaluate(r.gates, r, adapter.kind, r.export.names(), report)
        ws.write_text("gates.xml", gates.junit_xml(report["gates"]))
    ws.write_json("report.json", report)
    from compress.eval.report import render_markdown

    ws.write_text("report.md", render_markdown(report))
    from compress.eval.report import summary_lines

    for line in summary_lines(report) if not bad else []:
        log.info("summary: %s", line)
    log.info("report: %s, %s", ws.path("report.json"), ws.path("report.md"))
    ws.record_files()  # sha256 of every artifact: `compress verify`, inspect and eval check them
    ws.save_manifest()
    if bad:
        raise RunFailure(f"the run produced non-finite values ({', '.join(bad[:4])}): the compressed model is "
                         f"broken (NaN or overflow); they are null in {ws.path('report.json')}")
    failed = [g for g in report.get("gates", []) if not g["passed"]]
    if failed:
        from compress.gates import GateFailure, failure_message

        message = failure_message(report["gates"])
        log.error("gates: %s", message)
        if r.push:
            log.warning("push to %s skipped: a gate failed", r.push.repo)
        raise GateFailure(message + f"\n(report: {ws.path('report.md')}, "
                          f"JUnit: {ws.path('gates.xml')})")
    if r.push:
        from compress.publish.hub import PushFailure, push

        try:
            ws.manifest["push"] = push(ws.root, **r.push.model_dump())
        except PushFailure as e:
            raise PushFailure(f"{e}\nthe run itself finished: its outputs are complete in `{ws.root}`; push them "
                              f"with `compress push {ws.root} --repo {r.push.repo}`") from None
        ws.save_manifest()
    return report


def _sections(stages) -> dict:
    """The stages' own report sections (registry.Section), collected from their metrics in stage order."""
    out = {}
    for key, section in registry.sections().items():
        found = [st["metrics"][key] for st in stages if (st.get("metrics") or {}).get(key)]
        if found:
            if section.collect == "last":
                out[key] = found[-1]
            elif section.collect == "each":
                out[key] = found
            else:  # merge
                out[key] = {k: v for d in found for k, v in d.items()}
    return out


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


def _run_stage(ctx: StageContext, b: Bound, inputs_hash: str, handoffs: dict, timings: list) -> None:
    """Apply one bound stage, or, finished earlier with the same inputs, load its hand-offs (replay it when
    its registration says so); save what it emits in its directory."""
    ws, entry = ctx.workspace, b.entry
    ctx.key, ctx.facts, ctx.emitted = b.key, b.facts, []
    ctx.inputs = {k: v[-1] for k, v in handoffs.items() if k in entry.consumes + entry.uses}
    resumed = ws.stage_done(b.key, inputs_hash)
    ctx.replaying = resumed and entry.replay
    start = time.time()
    produced = None
    if resumed and not entry.replay:
        log.info("stage %s (finished earlier: its hand-offs are loaded)", b.key)
        try:
            produced = [kind.load(ctx, b.key) for kind in entry.produces]
        except RunFailure as e:  # a checkpoint flipped or removed since: recompute what is missing
            log.warning("stage %s: %s; recomputing the stage (its intact block checkpoints are kept)", b.key, e)
            resumed = False
    if produced is None:
        if not resumed:
            ws.stage_begin(b.key, b.cfg.stage, b.cfg.method, inputs_hash)
        log.info("stage %s%s", b.key, " (finished earlier: replayed)" if resumed else "")
        device = ctx.devices[0] if _stays_on_cpu(b) is None else torch.device("cpu")
        devices.reset_peak(device)
        with prunepath.dense(ctx.model, not entry.routed):  # calibrate on dense FFNs; eval and heal at tau
            metrics = entry.apply(ctx, b.cfg)
        if device.type != "cpu":
            metrics = {**(metrics or {}), "device": str(device), "device_peak_mb": devices.peak_mb(device)}
        produced = ctx.emitted
        kinds = sorted(type(v).__name__ for v in produced)
        if kinds != sorted(k.__name__ for k in entry.produces):
            raise RuntimeError(f"stage {b.key} emitted {kinds or 'nothing'}, its registration declares "
                               f"{sorted(k.__name__ for k in entry.produces) or 'nothing'}")
        if not resumed:
            for v in produced:
                v.save(ws, b.key)
            ws.stage_end(b.key, time.time() - start, metrics)
    for kind in entry.consumes + entry.uses:
        if kind.must_be_consumed:  # applied once (a plan): a later stage of the same kind uses its own settings
            handoffs.pop(kind, None)
    for v in produced:
        handoffs.setdefault(type(v), []).append(v)
    st = ws.manifest["stages"][b.key]
    timings.append({"name": b.cfg.stage, "method": b.cfg.method, "seconds": st["seconds"],
                    "peak_rss_mb": st["peak_rss_mb"], "rss_mb": st.get("rss_mb"), "resumed": resumed})
    if "device" in (st.get("metrics") or {}):  # an accelerated stage on an accelerator: where, and its peak there
        timings[-1].update(device=st["metrics"]["device"], device_peak_mb=st["metrics"]["device_peak_mb"])


def _facts_digest(facts: Facts) -> str:
    """What a stage's result depends on from its neighbours (the layers it plans for, the rounding it scales
    against): part of its inputs hash, so changing the quantize stage recomputes an allocation before it."""
    return repr((facts.rounding, facts.consumer, sorted(facts.layers.items()), facts.plan_from))


class _timed:
    def __init__(self, timings: list, name: str, method: str):
        self.timings, self.name, self.method = timings, name, method

    def __enter__(self):
        self.t = time.time()
        rss.new_stage()

    def __exit__(self, *exc):
        if exc[0] is None:
            self.timings.append({"name": self.name, "method": self.method, "seconds": round(time.time() - self.t, 3),
                                 **rss.stage_marks()})


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


