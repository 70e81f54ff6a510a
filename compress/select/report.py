"""The select stage's sections of report.md: the layer selection (relevance table, kept layers, accuracy, budget
sweep) and its line in the Structure section."""

from __future__ import annotations

from compress import registry
from compress.eval.report import table
from compress.prune.report import STRUCTURE_TITLE


def _selection(sel: dict) -> str:
    """`select: probscale`: the relevance table, the kept layers, their accuracy and the budget sweep."""
    tasks = list(sel["tasks"])
    cols = ["layer", "block", "params", *[f"acc_{t}" for t in tasks], "relevance", "kept"]
    lp, tp = sel["layer_params"], sel["total_params"]
    out = [f"\n## Layer selection\n\n`{sel['pick']}` (gain `{sel['gain']}`), budget {sel['budget']} of "
           f"{sel['budget_of']} parameters: kept blocks {sel['kept_blocks']}; layer parameters {lp['kept']} of "
           f"{lp['total']} ({lp['ratio']}), all parameters {tp['kept']} of {tp['total']} ({tp['ratio']})."
           + (f" Re-probing swapped: {sel['swaps']} (knapsack picked {sel['picked_blocks']})." if sel["swaps"] else "")
           + "\n\nProbe dev accuracy per layer (layer 0: the embeddings) and relevance:\n\n" + table(sel["table"], cols)]
    acc = [{"task": t, "dev full": v["full"], "dev subnetwork": v["subnet"],
            "test full": (sel["test_accuracy"].get(t) or {}).get("full"),
            "test subnetwork": (sel["test_accuracy"].get(t) or {}).get("subnet"),
            "healed dev": ((sel.get("heal") or {}).get("accuracy", {}).get(t) or {}).get("dev"),
            "healed test": ((sel.get("heal") or {}).get("accuracy", {}).get(t) or {}).get("test")}
           for t, v in sel["dev_accuracy"].items()]
    out.append("\nProbe accuracy of the full model and of the subnetwork (healed: its head after `heal`):\n\n"
               + table(acc, [c for c in acc[0] if any(r[c] is not None for r in acc)]))
    sc = sel.get("scaling")
    if sc:
        fit = sc.get("fit")
        out.append(f"\nBudget sweep (`budget: auto`, target {sc['target']}): "
                   + (f"P(N) = {fit['p_inf']} - {fit['A']} N^-{fit['alpha']} (N in M parameters); " if fit else "")
                   + f"smallest predicted: {sc['smallest_params']} parameters; chosen budget {sc['budget_params']}."
                   "\n\n" + table(sc["points"], ["budget", "params", "kept", "retained"]))
    return "".join(out)


def _selected(st: dict) -> str:
    return (f"- select probscale ({st['pick']}): {'; '.join(st['changes']) or 'nothing removed'}; parameters "
            f"{st['parameters_before']} -> {st['parameters_after']}\n")


SELECTION = registry.Section("selection", _selection)
SELECTED = registry.Section("structure", _selected, collect="each", title=STRUCTURE_TITLE)
