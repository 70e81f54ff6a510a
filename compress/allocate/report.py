"""The allocation's section of report.md: the chunk plan (heatmap, RL curve) or the expert widths of a MoE plan."""

from __future__ import annotations

from compress import registry


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


def _markdown(alloc: dict) -> str:
    if "expert_bits" in alloc:  # a per-layer plan over routed experts (`allocate: moe`)
        return _experts(alloc)
    out = (f"\n## Mixed-precision allocation\n\nmethod `{alloc['method']}`: {alloc['effective_bits']} "
           f"effective bits (budget {alloc['budget']}) over {alloc['units']} units; "
           f"plan: [{alloc['plan']}]({alloc['plan']})\n\n![bits per layer and chunk]({alloc['heatmap']})\n")
    if alloc.get("curve"):
        out += f"\n![RL learning curve]({alloc['curve']})\n"
    return out


# report.json `allocation` (the last allocate stage's) and its report.md section
ALLOCATION = registry.Section("allocation", _markdown)
