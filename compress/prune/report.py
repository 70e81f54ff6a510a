"""The prune package's lines in report.md's Structure section: each prune stage's changes, each heal's KL."""

from __future__ import annotations

from compress import registry


def _pruned(st: dict) -> str:
    changes = "; ".join(st["changes"]) or "nothing removed"
    return (f"- prune {st['method']} ({st['importance']}): {changes}; parameters {st['parameters_before']} -> "
            f"{st['parameters_after']}\n")


def _healed(st: dict) -> str:
    return (f"- heal ({st['method']}, {st['steps']} steps, {st['trained_params']} parameters trained): KL to full "
            f"precision {st['kl_before']} -> {st['kl_after']}\n")


STRUCTURE_TITLE = "Structure"  # every structural stage's line, in order (select's too: compress/select/report.py)
PRUNED = registry.Section("structure", _pruned, collect="each", title=STRUCTURE_TITLE)
HEALED = registry.Section("structure", _healed, collect="each", title=STRUCTURE_TITLE)
