"""report.json -> report.md (the same content as tables). The stages' own sections are rendered by their
registrations (`registry.Section`): this module names none of them."""

from __future__ import annotations

from compress import registry

LISTED = 20  # layers named one by one in report.md


def table(rows: list[dict], cols: list[str]) -> str:
    if not rows:
        return "_none_\n"
    head = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
    return head + "".join("| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |\n" for r in rows)


def _fmt(v) -> str:
    if isinstance(v, float):  # ratios near 1 (ppl_ratio 1.000206) need their digits: 1.000206, not 1
        return f"{v:.4g}" if abs(v - 1) > 0.01 or v == 1 else f"{v:.6g}"
    return "" if v is None else str(v)


def _section(section: registry.Section, value) -> str:
    """A stage's section (registry.Section): an "each" section is its title over every stage's line, each rendered by
    the registration that produced it."""
    if section.collect != "each":
        return section.render(value)
    return f"\n## {section.title}\n\n" + "".join(registry.section_of(v["stage"], v["method"], section.key).render(v)
                                                  for v in value)


def render_markdown(report: dict) -> str:
    model = (report.get("inputs") or {}).get("model") or {}
    digest = f" (sha256 `{model['sha256'][:16]}`)" if model.get("sha256") else ""
    out = [f"# compress report\n\nmodel: `{report.get('model')}`{digest}  \nrecipe sha256: `{report.get('recipe_sha256')}`\n"]
    out.append("\n## Stages\n\n" + table(report.get("stages", []), ["name", "method", "seconds", "peak_rss_mb", "rss_mb"]))
    cal = report.get("calibration")
    if cal:
        out.append("\n## Calibration\n\nWindows drawn from each source (`format` chat: conversations rendered with "
                   "the chat template, or `role: content` lines without one):\n\n" + table(
                       [{"source": k, **v} for k, v in cal.items()],
                       ["source", "format", "conversations", "tokens", "windows", "calibration_tokens"]))
    sections = registry.sections()
    out += [_section(s, report[k]) for k, s in sections.items() if s.place == "stages" and report.get(k)]
    served = [f"- {what}: {report[k]['as']} ({report[k]['layers']} {unit})" for k, what, unit in
              (("activations", "activations", "linear layers"), ("kv_cache", "KV cache", "attention layers"))
              if report.get(k)]
    if served:  # a scheme's quantized activations and KV cache: the evaluation below computes with them
        out.append("\n## Served arithmetic (the evaluation computes with it)\n\n" + "\n".join(served) + "\n")
    ev = report.get("eval") or {}
    if ev:
        rows = [{"dataset": k, **v} for k, v in ev.items()]
        cols = [c for c in ("dataset", "fp_ppl", "ppl", "ppl_ratio", "kl", "top1", "tokens", "gen_prefix",
                            "gen_agree", "gen_kl", "gen_top1", "cosine", "fp_probe_acc", "probe_acc")
                if any(c in r for r in rows)]
        out.append("\n## Evaluation (full precision vs compressed, same tokens)\n\n" + table(rows, cols))
    tasks = report.get("tasks") or {}
    if tasks:
        out.append("\n## Task accuracy (log-likelihood multiple choice, lm-eval's scoring; full precision vs "
                   "compressed, same documents)\n\n" + table(
                       [{"task": k, **v} for k, v in tasks.items()],
                       ["task", "fp_acc", "acc", "acc_delta", "fp_acc_norm", "acc_norm", "acc_norm_delta", "docs"]))
    if report.get("gates"):
        from compress.gates import markdown

        out.append(markdown(report["gates"]))
    size = dict(report.get("size") or {})
    stored = size.pop("stored", {})
    if size:
        out.append("\n## Size\n\n" + table([size], list(size)))
    if stored:
        out.append("\n### What each export stored\n\n" + table(
            [{"format": k, **v} for k, v in stored.items()], ["format", "bytes", "packed_layers", "dense_layers"]))
        for fmt, st in stored.items():
            dense = list((st.get("dense") or {}).items())
            if dense:
                more = f", and {len(dense) - LISTED} more (report.json lists all)" if len(dense) > LISTED else ""
                out.append(f"\n{fmt} stores these quantized layers dense: "
                           + ", ".join(f"`{n}` ({why})" for n, why in dense[:LISTED]) + more + "\n")
    out += [_section(s, report[k]) for k, s in sections.items() if s.place == "size" and report.get(k)]
    if report.get("figures"):
        out.append("\n## Figures\n\n" + "".join(f"![{t}]({p})\n\n" for t, p in report["figures"].items()))
    if report.get("exports"):
        out.append("\n## Exports\n\n" + table([{"format": k, "path": v} for k, v in report["exports"].items()],
                                               ["format", "path"]))
    if report.get("serving"):
        from compress.serve.rules import markdown as serving_table

        out.append("\n## Where it runs\n\nEngines' published rules applied to the checkpoint written "
                   "(`compress serve-check OUT --engine E` loads it in one):\n\n" + serving_table(report["serving"]) + "\n")
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
    for name, t in (report.get("tasks") or {}).items():
        lines.append(f"task {name}: accuracy {t['fp_acc']:.4f} (FP) -> {t['acc']:.4f} ({t['acc_delta']:+.4f}), "
                     f"normalised {t['fp_acc_norm']:.4f} -> {t['acc_norm']:.4f} over {t['docs']} documents")
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
