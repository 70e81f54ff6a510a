"""PNG figures for run reports (matplotlib, Agg backend: no display needed).

A stage that draws a figure writes it under the run directory with `save_png` and returns
`{"figures": {title: relative_path}}` in its metrics; the pipeline collects them into
`report["figures"]` and report.md links them.
"""

from __future__ import annotations

import io

import torch


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, workspace, rel: str) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    _pyplot().close(fig)
    workspace.write_bytes(rel, buf.getvalue())
    return rel


def energy_spectrum(before: dict, after: dict, title: str, max_layers: int = 8):
    """One row per layer (at most `max_layers`, evenly spaced), one column per tap kind: each coordinate's
    share of the input energy, sorted in decreasing order (log scale), before and after the stage.

    before/after: (layer, tap name) -> per-coordinate energy vector."""
    plt = _pyplot()
    layers = sorted({k[0] for k in before})
    if len(layers) > max_layers:
        layers = [layers[round(i * (len(layers) - 1) / (max_layers - 1))] for i in range(max_layers)]
    taps = sorted({k[1] for k in before})
    fig, axes = plt.subplots(len(layers), len(taps), figsize=(4.2 * len(taps), 2.2 * len(layers)), squeeze=False,
                             layout="constrained")
    for r, layer in enumerate(layers):
        for c, tap in enumerate(taps):
            ax = axes[r][c]
            for label, energy, style in (("before", before, "-"), ("after", after, "--")):
                e = energy.get((layer, tap))
                if e is None or float(e.sum()) <= 0:
                    continue
                share = (e / e.sum()).sort(descending=True).values.clamp(min=1e-12)
                ax.semilogy(torch.arange(1, share.numel() + 1).numpy(), share.numpy(), style, label=label, lw=1.2)
            ax.set_title(f"layer {layer}: {tap} input", fontsize=8)
            ax.tick_params(labelsize=7)
            if r == 0 and c == 0:
                ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.supxlabel("coordinate rank", fontsize=8)
    fig.supylabel("share of input energy", fontsize=8)
    return fig


def relevance_figure(table: list[dict], tasks: list[str], scaling: dict | None = None):
    """ProbScale (select): per layer the probe accuracy of each task (lines) and the relevance (bars, kept
    blocks dark); with a budget sweep, a second panel of retained accuracy against kept layer parameters and
    the power-law fit."""
    plt = _pyplot()
    panels = 2 if scaling and scaling.get("points") else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 3.8), squeeze=False)
    ax = axes[0][0]
    x = [r["layer"] for r in table]
    ax.bar(x, [r["relevance"] for r in table], color=["#1f4e79" if r["kept"] else "#b0c4de" for r in table],
           label="relevance (dark: kept)")
    ax.set_xlabel("layer (0 = embeddings)")
    ax.set_ylabel("relevance")
    ax2 = ax.twinx()
    for t in tasks:
        ax2.plot(x, [r[f"acc_{t}"] for r in table], marker="o", label=f"probe accuracy {t}")
    ax2.set_ylabel("probe dev accuracy")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper left")
    ax.set_title("layer relevance")
    if panels == 2:
        import numpy as np

        ax = axes[0][1]
        pts = scaling["points"]
        ax.plot([p["params"] / 1e6 for p in pts], [p["retained"] for p in pts], "o", label="optimal subsets")
        fit = scaling.get("fit")
        if fit:
            n = np.linspace(min(p["params"] for p in pts), max(p["params"] for p in pts), 100) / 1e6
            ax.plot(n, fit["p_inf"] - fit["A"] * n ** -fit["alpha"], "-", label="P(N) = P_inf - A N^-alpha")
        ax.axhline(scaling["target"], ls="--", color="gray", label=f"target {scaling['target']}")
        ax.set_xlabel("kept layer parameters (M)")
        ax.set_ylabel("retained probe accuracy")
        ax.legend(fontsize=7)
        ax.set_title("budget sweep")
    fig.tight_layout()
    return fig
