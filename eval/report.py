"""report.json -> report.md (the same content as tables)."""

from __future__ import annotations


LISTED = 20  # layers named one by one in report.md


def _table(rows: list[dict], cols: list[str]) -> str:
    if not rows:
        return "_none_\n"
    head = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
    return head + "".join("| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |\n" for r in rows)


def _fmt(v) -> str:
    if isinstance(v, float):  # ratios near 1 (ppl_ratio 1.000206) need their digits: 1.000206, not 1
        return f"{v:.4g}" if abs(v - 1) > 0.01 or v == 1 else f"{v:.6g}"
    return "" if v is None else str(v)


def _experts(alloc: dict) -> str:
    """Bits and calibration tokens of every routed expert (`allocate method: moe`)."""
    layers = sorted(alloc["expert_bits"], key=int)
    n = max(len(alloc["loads"][k]) for k in layers)
    rows = [f"| layer | {' | '.join(f'e{e}' for e in range(n))} |", "|---" * (n + 1) + "|"]
    for k in layers:
        forced = set(alloc["forced"].get(k, []))
        cells = [f"{alloc['expert_bits'][k].get(str(e), '-')} b, {alloc['loads'][k][e]} tok"
                 + (" (forced)" if e in forced else "") for e in range(n)]
        rows.append(f"| {k} | {' | '.join(cells)} |")
    return (f"\n## Expert allocation\n\nmethod `moe` ({alloc['solve']}): {alloc['effective_bits']} bits per expert "
            f"parameter (budget {alloc['budget']}) over {alloc['units']} experts; plan: [{alloc['plan']}]"
            f"({alloc['plan']}), statistics: [{alloc['statistics']}]({alloc['statistics']}). Each cell: the expert's "
            "bits and the calibration tokens routed to it (top-k); `forced`: too few, its statistics used forced "
            f"routing.\n\n" + "\n".join(rows) + f"\n\n![bits and tokens per expert]({alloc['figure']})\n")


def _selection(sel: dict) -> str:
    """`select: probscale`: the relevance table, the kept layers, their accuracy and the budget sweep."""
    tasks = list(sel["tasks"])
    cols = ["layer", "block", "params", *[f"acc_{t}" for t in tasks], "relevance", "kept"]
    lp, tp = sel["layer_params"], sel["total_params"]
    out = [f"\n## Layer selection\n\n`{sel['pick']}` (gain `{sel['gain']}`), budget {sel['budget']} of "
           f"{sel['budget_of']} parameters: kept blocks {sel['kept_blocks']}; layer parameters {lp['kept']} of "
           f"{lp['total']} ({lp['ratio']}), all parameters {tp['kept']} of {tp['total']} ({tp['ratio']})."
           + (f" Re-probing swapped: {sel['swaps']} (knapsack picked {sel['picked_blocks']})." if sel["swaps"] else "")
           + "\n\nProbe dev accuracy per layer (layer 0: the embeddings) and relevance:\n\n" + _table(sel["table"], cols)]
    acc = [{"task": t, "dev full": v["full"], "dev subnetwork": v["subnet"],
            "test full": (sel["test_accuracy"].get(t) or {}).get("full"),
            "test subnetwork": (sel["test_accuracy"].get(t) or {}).get("subnet"),
            "healed dev": ((sel.get("heal") or {}).get("accuracy", {}).get(t) or {}).get("dev"),
            "healed test": ((sel.get("heal") or {}).get("accuracy", {}).get(t) or {}).get("test")}
           for t, v in sel["dev_accuracy"].items()]
    out.append("\nProbe accuracy of the full model and of the subnetwork (healed: its head after `heal`):\n\n"
               + _table(acc, [c for c in acc[0] if any(r[c] is not None for r in acc)]))
    sc = sel.get("scaling")
    if sc:
        fit = sc.get("fit")
        out.append(f"\nBudget sweep (`budget: auto`, target {sc['target']}): "
                   + (f"P(N) = {fit['p_inf']} - {fit['A']} N^-{fit['alpha']} (N in M parameters); " if fit else "")
                   + f"smallest predicted: {sc['smallest_params']} parameters; chosen budget {sc['budget_params']}."
                   "\n\n" + _table(sc["points"], ["budget", "params", "kept", "retained"]))
    return "".join(out)


def render_markdown(report: dict) -> str:
    model = (report.get("inputs") or {}).get("model") or {}
    digest = f" (sha256 `{model['sha256'][:16]}`)" if model.get("sha256") else ""
    out = [f"# compress report\n\nmodel: `{report.get('model')}`{digest}  \nrecipe sha256: `{report.get('recipe_sha256')}`\n"]
    out.append("\n## Stages\n\n" + _table(report.get("stages", []), ["name", "method", "seconds", "peak_rss_mb", "rss_mb"]))
    cal = report.get("calibration")
    if cal:
        out.append("\n## Calibration\n\nWindows drawn from each source (`format` chat: conversations rendered with "
                   "the chat template, or `role: content` lines without one):\n\n" + _table(
                       [{"source": k, **v} for k, v in cal.items()],
                       ["source", "format", "conversations", "tokens", "windows", "calibration_tokens"]))
    alloc = report.get("allocation")
    if alloc and alloc.get("method") == "moe":
        out.append(_experts(alloc))
    elif alloc:
        out.append(f"\n## Mixed-precision allocation\n\nmethod `{alloc['method']}`: {alloc['effective_bits']} "
                   f"effective bits (budget {alloc['budget']}) over {alloc['units']} units; "
                   f"plan: [{alloc['plan']}]({alloc['plan']})\n\n![bits per layer and chunk]({alloc['heatmap']})\n")
        if alloc.get("curve"):
            out.append(f"\n![RL learning curve]({alloc['curve']})\n")
    rt = report.get("routers")
    if rt:
        out.append(f"\n## Router fine-tuning\n\n{rt['routers']} routers ({rt['router_params']} parameters), loss "
                   f"`{rt['loss']}`, {rt['epochs']} epoch(s) over {rt['sequences']} calibration sequences; against "
                   "full precision on those tokens:\n\n| | top-k match | router KL | cross-entropy |\n"
                   "|---|---|---|---|\n"
                   f"| before | {rt['topk_match_before']} | {rt['router_kl_before']} | {rt['ce_before']} |\n"
                   f"| after | {rt['topk_match_after']} | {rt['router_kl_after']} | {rt['ce_after']} |\n")
    if report.get("selection"):
        out.append(_selection(report["selection"]))
    if report.get("structure"):
        out.append("\n## Structure\n\n" + "".join(f"- {_structure_step(st)}\n" for st in report["structure"]))
    ev = report.get("eval") or {}
    if ev:
        rows = [{"dataset": k, **v} for k, v in ev.items()]
        cols = [c for c in ("dataset", "fp_ppl", "ppl", "ppl_ratio", "kl", "top1", "tokens", "gen_prefix",
                            "gen_agree", "gen_kl", "gen_top1", "cosine", "fp_probe_acc", "probe_acc")
                if any(c in r for r in rows)]
        out.append("\n## Evaluation (full precision vs compressed, same tokens)\n\n" + _table(rows, cols))
    if report.get("gates"):
        from compress.gates import markdown

        out.append(markdown(report["gates"]))
    size = dict(report.get("size") or {})
    stored = size.pop("stored", {})
    if size:
        out.append("\n## Size\n\n" + _table([size], list(size)))
    if stored:
        out.append("\n### What each export stored\n\n" + _table(
            [{"format": k, **v} for k, v in stored.items()], ["format", "bytes", "packed_layers", "dense_layers"]))
        for fmt, st in stored.items():
            dense = list((st.get("dense") or {}).items())
            if dense:
                more = f", and {len(dense) - LISTED} more (report.json lists all)" if len(dense) > LISTED else ""
                out.append(f"\n{fmt} stores these quantized layers dense: "
                           + ", ".join(f"`{n}` ({why})" for n, why in dense[:LISTED]) + more + "\n")
    adapted = report.get("adapted_groups")
    if adapted:
        out.append("\n## Group sizes adapted\n\nLayers the recipe's `group_size` does not fit, with the group each got "
                   "(-1: per-channel; docs/quantize.md#group-size-adaptation):\n\n"
                   + _table([{"layer": n, "group_size": a, "used": g} for n, (a, g) in adapted.items()],
                            ["layer", "group_size", "used"]))
    if report.get("figures"):
        out.append("\n## Figures\n\n" + "".join(f"![{t}]({p})\n\n" for t, p in report["figures"].items()))
    if report.get("exports"):
        out.append("\n## Exports\n\n" + _table([{"format": k, "path": v} for k, v in report["exports"].items()],
                                               ["format", "path"]))
    return "".join(out)


def summary_lines(report: dict) -> list[str]:
    """A few lines for the terminal after a run."""
    lines = []
    for name, e in (report.get("eval") or {}).items():
        if "ppl" in e:
            lines.append(f"{name}: perplexity {e['fp_ppl']:.3f} (FP) -> {e['ppl']:.3f} (x{e['ppl_ratio']:.4f}), "
                         f"KL {e['kl']:.4g}, top-1 {e['top1']:.4f}")
            if "gen_prefix" in e:
                lines.append(f"{name}: greedy continuations ({e['gen_prompts']} x {e['gen_new_tokens']} tokens): "
                             f"common prefix {e['gen_prefix']:.1f}, agreement {e['gen_agree']:.3f}, "
                             f"KL {e['gen_kl']:.4g}, top-1 {e['gen_top1']:.4f}")
        elif "cosine" in e:
            lines.append(f"{name}: cosine {e['cosine']:.4f}, probe {e.get('fp_probe_acc')} -> {e.get('probe_acc')}")
    s = report.get("size") or {}
    if s:
        eb = s.get("effective_bits")
        lines.append(f"size: {s['fp_bytes'] / 2**20:.2f} MiB (FP) -> {s['bytes'] / 2**20:.2f} MiB; effective bits "
                     f"{eb if eb is not None else '-'} over {s.get('quantized_layers', 0)} layers")
        for fmt, st in (s.get("stored") or {}).items():
            if st["dense_layers"]:
                lines.append(f"{fmt}: {st['dense_layers']} of {s.get('quantized_layers', 0)} quantized layers are "
                             "stored dense (the format cannot hold their shape packed); see report.md")
    lines.append(f"time: {report.get('seconds')} s, peak RSS {report.get('peak_rss_mb')} MB")
    return lines


def _structure_step(st: dict) -> str:
    """One line of report.md's Structure section: a prune stage's changes or a heal stage's KL."""
    if st["stage"] == "select":
        return (f"select probscale ({st['pick']}): {'; '.join(st['changes']) or 'nothing removed'}; parameters "
                f"{st['parameters_before']} -> {st['parameters_after']}")
    if st["stage"] == "heal":
        return (f"heal ({st['method']}, {st['steps']} steps, {st['trained_params']} parameters trained): KL to full "
                f"precision {st['kl_before']} -> {st['kl_after']}")
    changes = "; ".join(st["changes"]) or "nothing removed"
    return (f"prune {st['method']} ({st['importance']}): {changes}; parameters {st['parameters_before']} -> "
            f"{st['parameters_after']}")
