"""Pictures of an allocation: the plan heatmap and the RL learning curves."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from compress.allocate.plan import Plan


def write_heatmap(plan: Plan, path: Path) -> None:
    """Bits per layer (rows) and chunk (columns); missing chunks (narrow layers) blank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(plan.layers)
    width = max(len(v) for v in plan.layers.values())
    grid = np.full((len(names), width), np.nan)
    for r, n in enumerate(names):
        grid[r, : len(plan.layers[n])] = [plan.options[i].bits for i in plan.layers[n]]
    fig, ax = plt.subplots(figsize=(max(4, 0.35 * width + 3), max(3, 0.18 * len(names) + 1.5)))
    im = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=2, vmax=16, interpolation="nearest")
    ax.set_yticks(range(len(names)), [n.removeprefix("model.") for n in names], fontsize=5)
    ax.set_xlabel(f"chunk ({plan.chunk_size} input columns)")
    ax.set_title(f"{plan.method}: {plan.effective_bits():.4f} effective bits (budget {plan.budget})", fontsize=8)
    fig.colorbar(im, ax=ax, label="bits")
    fig.tight_layout()
    _save(fig, path)


def write_curve(curves, path: Path, labels=None) -> None:
    """RL learning curve(s): mean episode return per PPO update."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if curves and isinstance(curves[0], dict):
        curves, labels = [curves], labels or ["return"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for c, lab in zip(curves, labels or [None] * len(curves)):
        ax.plot([r["update"] for r in c], [r["return"] for r in c], label=lab)
    ax.set_xlabel("PPO update")
    ax.set_ylabel("mean episode return")
    if labels:
        ax.legend(fontsize=6)
    fig.tight_layout()
    _save(fig, path)


def write_experts(expert_bits: dict, loads: dict, path: Path, title: str) -> None:
    """Two panels over (MoE layer, expert): the bits each expert got, and the calibration tokens routed to it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    layers = sorted(expert_bits, key=int)
    n = max(len(loads[k]) for k in layers)
    bits = np.full((len(layers), n), np.nan)
    tokens = np.full((len(layers), n), np.nan)
    for r, k in enumerate(layers):
        for e, b in expert_bits[k].items():
            bits[r, int(e)] = b
        tokens[r, : len(loads[k])] = loads[k]
    fig, axes = plt.subplots(1, 2, figsize=(max(6, 0.7 * n + 4), max(2.5, 0.4 * len(layers) + 1.5)))
    for ax, grid, label, cmap in ((axes[0], bits, "bits", "viridis"), (axes[1], tokens, "tokens routed", "magma")):
        im = ax.imshow(grid, aspect="auto", cmap=cmap, interpolation="nearest")
        ax.set_yticks(range(len(layers)), [f"layer {k}" for k in layers], fontsize=7)
        ax.set_xlabel("expert")
        fig.colorbar(im, ax=ax, label=label)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    _save(fig, path)


def _save(fig, path: Path) -> None:
    """Write the figure next to `path` and rename it into place (no half-written picture), then free it."""
    import matplotlib.pyplot as plt

    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)
