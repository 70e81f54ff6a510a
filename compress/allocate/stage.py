"""The `allocate` stage: mixed precision over column chunks under an effective-bit budget (docs/allocate.md).

Methods: `rl` (PPO controller, compress/allocate/ppo.py), `greedy` (error-per-bit knapsack), `lagrangian`
(multiple-choice knapsack by Lagrangian relaxation), `uniform` (one option everywhere: the nearest
feasible uniform width, the benchmark's baseline) and `file` (a `plan.json` from an earlier run; no search).
Every method emits a `Plan` (compress/allocate/plan.py), saved with `plan_heatmap.png` in the
stage's directory `stages/NN-allocate-METHOD/`, and the next `quantize` stage (method `rtn` or `autoround`;
`group_size` and `sym` default to its own and must equal them) fits each unit with its option.

Statistics: the layers are the next quantize stage's block linears. `a_k = E[x_k^2]` per input column is
collected in one forward pass of the model as it is when the stage runs, i.e. on the **full-precision
trajectory** (allocation runs before any quantization; after a `rotate` stage, the rotated FP model).
The proxy error of every unit and option is computed from those statistics (`allocation.layer_units`).

Terminal reward of the RL controller (`terminal`): `ppl` = -kappa * (log ppl_Q - log ppl_FP) and
`kl` = -kappa * mean KL(p_FP || p_Q) of the next-token distributions (the same scale as the log-ppl
increase, without the variance of the sampled labels), `hidden_mse` = -kappa * relative MSE of the final
hidden states, all on the first `reward_samples` calibration sequences cut to `reward_seqlen` tokens,
with every planned linear replaced by its plan's fake-quantized weight; `none` = proxy reward only. The
terminal reward keeps every option's fake-quantized copy of every planned layer in memory (|options| x the
planned weights in fp32): meant for small and mid-size models; use `terminal: none` (or `greedy` /
`lagrangian`) where that does not fit.

Real-model calibration of the RL controller (all on calibration tokens; the evaluation text is never seen).
With a terminal reward, a second, larger *selection slice* (the first `select_samples` calibration
sequences cut to `select_seqlen` tokens; it contains the training slice) serves two purposes:
- `sensitivity: layer` (default): per layer l, the terminal loss increase dL_l when layer l alone is at its
  cheapest option (every other layer full precision) over its proxy error at that option gives a weight
  w_l = dL_l / e_l (floored at 1% of the largest); the controller's problem has err(u, o) scaled by the
  weight of u's layer (`allocation.reweight`), so the dense reward, the bit-price shaping and the state
  (plus the log weight as a feature) see an estimate of the loss increase instead of per-layer output
  errors on incomparable scales. Costs one forward per planned layer. `unit`: the same per unit (one
  forward per unit; on stories-llama-1m @ 3.0 it was no better than `layer`); `none`: the plain proxy.
- the final plan is picked among the controller's candidates (compress/allocate/ppo.py) by the terminal score on the
  selection slice, not by the small training slice it was trained on. (Taking the selection slice from the
  calibration sequences the training slice does not use was tried and was not better.)
`warm_start` > 0: PPO starts from a policy behaviour-cloned toward the greedy knapsack plan of the
controller's (sensitivity-weighted, if on) problem, and that plan is one of the final candidates: the RL
plan is never worse than it by the selection score. The non-RL `greedy` and `lagrangian` methods use the
unweighted proxy by default; `sensitivity: layer|unit` gives them the same measured weights (the benchmark's
`greedy-sens` row: the baseline with the RL controller's statistics).

`refine: N` (every method with a selection slice: `rl`, `greedy`, `lagrangian`; default 0): after the search,
N random pair moves on the plan (one unit one option up, another one option down, `allocation.refine`), each
kept when the plan stays within the budget and the selection slice's loss falls. One forward per feasible move.
It searches the real model's loss directly, where every solver above optimises its proxy (the mixed-precision
benchmark's `greedy-sens+refine` and `rl+refine` rows). A move keeps the plan's bits at or above the lower of
the start plan's and the budget less 0.005 bits per weight.
"""

from __future__ import annotations

import logging
import time

import torch

from compress import registry
from compress.allocate.configs import (
    GGUF_OPTIONS,
    FileConfig,
    GreedyConfig,
    LagrangianConfig,
    RLConfig,
    UniformConfig,
)
from compress.allocate.figures import write_curve, write_heatmap
from compress.allocate.plan import (
    PLAN_FILE,
    Plan,
    check_plan_file,
    plan_from_choice,
    read_plan,
)
from compress.allocate.problem import (
    Problem,
    build_problem,
    greedy,
    lagrangian,
    map_bits,
    nearest_uniform,
    option_bits,
    refine,
    reweight,
    uniform,
)
from compress.allocate.report import ALLOCATION
from compress.allocate.terminal import Terminal, collect_stats, sensitivity
from compress.errors import BadInput
from compress.quantize.spine import CHUNK_PLAN
from compress.registry import register

log = logging.getLogger(__name__)
HEATMAP_FILE, CURVE_FILE, CURVE_JSON = "plan_heatmap.png", "rl_curve.png", "rl_curve.json"


def planned_linears(adapter, names) -> dict:
    """{name: (linear, block index)} of the block linears among `names` (the quantize stage's layer plan)."""
    out = {}
    for i in range(len(adapter.blocks)):
        for name, lin in adapter.block_linears(i).items():
            if name in names:
                out[name] = (lin, i)
    return out


def check(adapter, cfg, facts):
    """Plan time: the quantize stage the plan is for (from the bind step's facts), `group_size`/`sym`/
    `chunk_size` defaults resolved from it, the budget against the cheapest plan."""
    if facts.rounding is None:
        raise BadInput(f"stage {facts.index} (`allocate`) needs a `quantize` stage after it to apply the plan")
    if facts.grid is not None:
        return _check_gguf(adapter, cfg, facts)
    if cfg.method == "file" or cfg.gguf:
        if cfg.method != "file" or read_plan(cfg.path).gguf:
            raise BadInput(f"stage {facts.index} (`allocate`) plans llama.cpp types, but the next quantize stage does "
                           "not round on llama.cpp's grids: give it `gguf: TYPE` (docs/gguf.md#mixed-precision-plans), "
                           "or plan bit widths")
    if CHUNK_PLAN not in facts.capabilities:
        raise BadInput(f"the `quantize` stage after `allocate` uses method `{facts.consumer}`; mixed-precision plans "
                       f"are fitted by {' or '.join(f'`{m}`' for m in registry.having('quantize', CHUNK_PLAN))}")
    _, group, sym = facts.rounding
    layers = planned_linears(adapter, facts.layers)
    if cfg.method == "file":
        check_plan_file(read_plan(cfg.path), layers, group, sym, cfg.path)
        return cfg
    given = (cfg.group_size if cfg.group_size is not None else group, cfg.sym if cfg.sym is not None else sym)
    if given != (group, sym):
        raise BadInput(f"allocate (group_size {given[0]}, sym {given[1]}) and the next quantize stage "
                       f"(group_size {group}, sym {sym}) must agree")
    try:
        cfg = type(cfg).model_validate({**cfg.model_dump(), "group_size": group, "sym": sym,
                                        "chunk_size": cfg.chunk_size or group})
    except ValueError as e:
        raise BadInput(f"stage {facts.index} (`allocate`) with the next quantize stage's group_size {group}: "
                       f"{e.errors()[0]['msg'] if hasattr(e, 'errors') else e}") from None
    _check_budget(cfg, layers, cfg.chunk_size, cfg.group_size, cfg.sym, map_bits(cfg.options))
    return cfg


def _check_budget(cfg, layers: dict, chunk: int | None, group: int, sym: bool, mbits: int) -> None:
    """The budget against the plan with every unit at its cheapest option (`chunk` None: one unit per layer)."""
    total = least = 0
    options = cfg.option_list()
    for name, (lin, _) in layers.items():
        d_out, d_in = lin.weight.shape  # a short last chunk (or a layer narrower than a group) is one short group
        for s in range(0, d_in, chunk or d_in):
            w = min(chunk or d_in, d_in - s)
            least += min(option_bits(d_out, w, group, o, sym, mbits) for o in options)
            total += d_out * w
    if least > cfg.budget * total:
        raise BadInput(f"allocate budget {cfg.budget} is below the cheapest plan ({least / total:.4f} effective "
                       "bits with every unit at its cheapest option, scales, zero points and plan metadata "
                       "included); raise `budget`, use a larger `group_size`, or add a cheaper option")


def gguf_layers(adapter, names, file_type: str) -> tuple[dict, list[str]]:
    """The planned linears a llama.cpp type is chosen for when the next quantize stage rounds on llama.cpp's grids
    (`planned_linears`), and those left at the type the stage's mix gives them: the routed experts, which the file
    stacks into one tensor per layer (one type for all of them)."""
    from compress.export.gguf import tensor_plan

    entries, _ = tensor_plan(adapter.model, file_type)
    sources: dict[str, set] = {}
    for hf, tensor, _ in entries:
        sources.setdefault(tensor, set()).add(hf.removesuffix(".weight"))
    stacked = {s for group in sources.values() if len(group) > 1 for s in group}
    layers = planned_linears(adapter, names)
    return {n: v for n, v in layers.items() if n not in stacked}, sorted(n for n in layers if n in stacked)


def _check_gguf(adapter, cfg, facts):
    """Plan time, the next quantize stage rounding on llama.cpp's grids (`gguf`): one llama.cpp type per tensor
    (docs/gguf.md#mixed-precision-plans)."""
    key = f"stage {facts.index} (`allocate`)"
    layers, stacked = gguf_layers(adapter, facts.layers, facts.grid)
    if cfg.method == "file":
        check_plan_file(read_plan(cfg.path), layers, None, None, cfg.path, gguf=True)
        return cfg
    given = sorted(f for f in ("group_size", "sym", "chunk_size") if getattr(cfg, f) is not None)
    if given:
        raise BadInput(f"{key} plans one llama.cpp type per tensor for the next quantize stage (`gguf: "
                       f"{facts.grid}`): {', '.join(f'`{f}`' for f in given)} does not apply; remove it")
    if "options" not in cfg.model_fields_set:
        cfg = type(cfg).model_validate({**cfg.model_dump(exclude={"options"}),
                                        "options": [{"gguf": t} for t in GGUF_OPTIONS]})
    elif not cfg.gguf:
        raise BadInput(f"{key}: the next quantize stage rounds on llama.cpp's grids (`gguf: {facts.grid}`), so the "
                       f"options are llama.cpp types (`options: [{{gguf: Q3_K}}, {{gguf: Q4_K}}, ...]`), not bit "
                       "widths; or leave `options` out for " + ", ".join(GGUF_OPTIONS))
    if not layers:
        raise BadInput(f"{key}: no layer of this model is a tensor of its own in the GGUF file; nothing to plan")
    facts.notes.append(f"one llama.cpp type per tensor ({', '.join(o.gguf for o in cfg.options)}) for {len(layers)} "
                       f"block linears within {cfg.budget} bits per weight; the token embeddings and output keep "
                       f"{facts.grid}'s types (the export's type counts are {facts.grid}'s before the allocation)")
    if stacked:
        facts.notes.append(f"{key}: {len(stacked)} routed expert layers (e.g. `{stacked[0]}`) keep the type "
                           f"{facts.grid} gives them: the file stacks a layer's experts into one tensor of one type")
    _check_budget(cfg, layers, None, 0, True, 0)
    return cfg


def apply(ctx, cfg) -> dict:
    """Every allocate method: statistics, the search, the plan handed to the next quantize stage."""
    grid = ctx.facts.grid
    if grid is None:
        layers = planned_linears(ctx.adapter, ctx.facts.layers)
    else:
        layers, stacked = gguf_layers(ctx.adapter, ctx.facts.layers, grid)
        if stacked:
            log.info("allocate: %d routed expert layers keep the type %s gives them (one stacked tensor per layer "
                     "in the file)", len(stacked), grid)
    shapes = {n: tuple(lin.weight.shape) for n, (lin, _) in layers.items()}
    t0 = time.time()
    energy = collect_stats(ctx, layers)
    if cfg.method == "file":
        plan = read_plan(cfg.path)
        check_plan_file(plan, layers, *(ctx.facts.rounding[1:] if grid is None else (None, None)), cfg.path,
                        gguf=grid is not None)
        plan.energy = None if plan.per_layer else energy
        return _finish(ctx, plan, None, time.time() - t0)
    data = {n: (lin.weight.data, energy[n], i) for n, (lin, i) in layers.items()}
    needs_hats = ((cfg.method == "rl" and cfg.terminal != "none") or getattr(cfg, "sensitivity", "none") != "none"
                  or getattr(cfg, "refine", 0) > 0)
    # llama.cpp types: one unit per tensor (a chunk as wide as the widest layer), fitted as llama.cpp fits the type
    chunk = cfg.chunk_size if grid is None else max(w for _, w in shapes.values())
    p, hats = build_problem(data, len(ctx.adapter.blocks), cfg.option_list(), chunk,
                            cfg.group_size or chunk, bool(cfg.sym), cfg.budget, keep_hats=needs_hats)
    stats_s = time.time() - t0
    curve, info, select = None, {}, None
    if cfg.method == "rl":
        choice, curve, info, select = _search_rl(ctx, cfg, layers, hats, p)
    elif cfg.method in ("greedy", "lagrangian"):
        if cfg.sensitivity != "none" or cfg.refine:
            select = _ppl_terminal(ctx, cfg, layers, hats, p)
        if cfg.sensitivity != "none":
            p, info = _weighted(select, p, cfg.sensitivity)
        choice = greedy(p) if cfg.method == "greedy" else lagrangian(p)
    else:
        o = nearest_uniform(p)
        if o is None:
            raise BadInput(f"no single option fits the budget {cfg.budget} uniformly")
        choice = uniform(p, o)
    if getattr(cfg, "refine", 0):
        select = select or _ppl_terminal(ctx, cfg, layers, hats, p)
        seed = cfg.seed if getattr(cfg, "seed", None) is not None else ctx.seed
        bar = ctx.progress(total=cfg.refine, desc=f"{ctx.key} refine", unit="move")
        choice, info["refine"] = refine(p, choice, select.loss, cfg.refine, seed, lambda: bar.update(1))
        bar.close()
    info.update(proxy_error=p.err_of(choice), statistics_seconds=round(stats_s, 3),
                search_seconds=round(time.time() - t0 - stats_s, 3), units=p.n_units)
    plan = plan_from_choice(p, choice, shapes, cfg, cfg.method, None if grid else energy, info)
    return _finish(ctx, plan, curve, time.time() - t0)


def _search_rl(ctx, cfg: RLConfig, layers, hats, p: Problem):
    from compress.allocate.ppo import PPOSettings, train

    terminal = select = None
    info = {}
    if cfg.terminal != "none":
        terminal = Terminal(ctx.model, layers, hats, p, _slice(ctx, cfg.reward_samples, cfg.reward_seqlen),
                            cfg.terminal, cfg.kappa, p.chunk)
        select = Terminal(ctx.model, layers, hats, p, _slice(ctx, cfg.select_samples, cfg.select_seqlen),
                          cfg.terminal, cfg.kappa, p.chunk)
        if cfg.sensitivity != "none":
            p, info = _weighted(select, p, cfg.sensitivity)
    s = PPOSettings(updates=cfg.updates, episodes=cfg.episodes, epochs=cfg.epochs, minibatch=cfg.minibatch,
                    lr=cfg.lr, entropy=cfg.entropy, hidden=cfg.hidden, keep_best=cfg.keep_best,
                    warm_start=cfg.warm_start, steps=cfg.steps, seed=cfg.seed if cfg.seed is not None else ctx.seed)
    reference = greedy(p) if cfg.warm_start else None
    bar = ctx.progress(total=cfg.updates, desc=f"{ctx.key} PPO", unit="update")
    res = train(p, terminal, s, lambda i, row: bar.update(1), reference=reference, select=select)
    bar.close()
    info.update(picked=res.picked, final_terminal=terminal(res.choice) if terminal else None,
                final_select=select(res.choice) if select else None)
    return res.choice, res.curve, info, select


def _ppl_terminal(ctx, cfg, layers, hats, p: Problem) -> Terminal:
    """Perplexity on the selection slice: the layer sensitivities of the knapsack solvers, and `refine`."""
    return Terminal(ctx.model, layers, hats, p, _slice(ctx, cfg.select_samples, cfg.select_seqlen), "ppl", 1.0,
                    p.chunk)


def _slice(ctx, samples: int, seqlen: int) -> torch.Tensor:
    return ctx.calibration_tokens()[:samples, :seqlen]


def _weighted(select: "Terminal", p: Problem, level: str) -> tuple[Problem, dict]:
    """The problem with each layer's (`layer`) or unit's (`unit`) errors scaled by its measured sensitivity,
    and the sensitivities for the plan's info."""
    w = sensitivity(select, p, level)
    if level == "layer":
        return reweight(p, w), {"layer_sensitivity": {n: float(v) for n, v in zip(p.layers, w)}}
    return reweight(p, w, per_unit=True), {"unit_sensitivity": [float(v) for v in w]}


def _finish(ctx, plan: Plan, curve, seconds: float) -> dict:
    """Emit the plan (saved in the stage's directory by the pipeline), draw it, and summarise it for report.md."""
    ctx.emit(plan)
    ws, where = ctx.workspace, f"stages/{ctx.key}"
    ws.path(where).mkdir(parents=True, exist_ok=True)
    write_heatmap(plan, ws.path(f"{where}/{HEATMAP_FILE}"))
    files = {"plan": f"{where}/{PLAN_FILE}", "heatmap": f"{where}/{HEATMAP_FILE}"}
    if curve:
        ws.write_json(f"{where}/{CURVE_JSON}", curve)
        write_curve(curve, ws.path(f"{where}/{CURVE_FILE}"))
        files["curve"] = f"{where}/{CURVE_FILE}"
    allocation = {"method": plan.method, "budget": plan.budget, "effective_bits": round(plan.effective_bits(), 6),
                  "units": sum(len(v) for v in plan.layers.values()), **files}
    log.info("allocation %s: %.4f effective bits (budget %s) over %d layers", plan.method, plan.effective_bits(),
             plan.budget, len(plan.layers))
    return {"effective_bits": plan.effective_bits(), "budget": plan.budget, "layers": len(plan.layers),
            "seconds": round(seconds, 3), **(plan.info or {}), "allocation": allocation}


for _cls, _name, _desc in ((RLConfig, "rl", "PPO allocation of bits/treatments to column chunks (WINDQuant)"),
                           (GreedyConfig, "greedy", "greedy error-per-bit knapsack over column chunks"),
                           (LagrangianConfig, "lagrangian", "Lagrangian multiple-choice knapsack over column chunks"),
                           (UniformConfig, "uniform", "one option for every chunk (nearest feasible uniform width)"),
                           (FileConfig, "file", "a plan.json from an earlier run (no search)")):
    register("allocate", _name, _cls, _desc, check=check, produces=(Plan,), report=(ALLOCATION,))(apply)
