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
