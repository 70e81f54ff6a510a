"""A new stage costs one file plus its registration (docs/stages.md).

This file registers a stage of its own, `measure/ffn-occupancy`: it consumes the quantize stage's
`QuantizedWeights`, keeps the FFN channels whose rounded `down_proj` columns carry the most weight, and
produces a `ModelSpec`, and contributes its own section to report.json and report.md. Nothing else in the
package knows it; it runs in a recipe, the bind step checks its hand-offs and the exports against its shapes
at plan time, `--resume` loads its spec instead of applying it again, and the report renders its section.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Literal

import pytest
import torch
import yaml
from conftest import CAL, STORIES260K, TEXT, invoke
from pydantic import Field

from compress import registry
from compress.config import StrictModel
from compress.handoff import ModelSpec, QuantizedWeights

CALLS: list[str] = []


class OccupancyConfig(StrictModel):
    stage: Literal["measure"] = "measure"
    method: Literal["ffn-occupancy"] = "ffn-occupancy"
    keep_first: float = Field(1.0, gt=0, le=1, description="share of block 0's FFN channels kept")


def reshape(spec: ModelSpec, cfg: OccupancyConfig) -> ModelSpec:
    """Plan time: the shapes after the stage (block 0 keeps `keep_first` of its channels)."""
    b0 = spec.blocks[0]
    first = dataclasses.replace(b0, ffn=round(cfg.keep_first * b0.ffn))
    return dataclasses.replace(spec, blocks=(first, *spec.blocks[1:]))


def apply(ctx, cfg: OccupancyConfig) -> dict:
    CALLS.append(ctx.key)
    q = ctx.inputs[QuantizedWeights]
    name = f"{ctx.adapter.block_name(0)}.mlp.down_proj"
    norms = q.weights[name].dequantize(torch.float32).norm(dim=0)  # per FFN channel, from the rounded codes
    n = round(cfg.keep_first * norms.numel())
    kept = tuple(sorted(norms.topk(n).indices.tolist()))
    spec = reshape(ModelSpec.of(ctx.adapter), cfg)
    spec = dataclasses.replace(spec, kept_ffn={0: kept} if n < norms.numel() else {})
    spec.restore(ctx.adapter)  # the model takes the shapes the spec describes
    ctx.emit(spec)
    return {"kept": n, "of": norms.numel(), "occupancy": {"kept": n, "of": norms.numel(), "block": 0}}


def occupancy_markdown(occ: dict) -> str:
    return f"\n## FFN occupancy\n\nblock {occ['block']} keeps {occ['kept']} of its {occ['of']} FFN channels\n"


OCCUPANCY = registry.Section("occupancy", occupancy_markdown)


@pytest.fixture
def occupancy_stage():
    registry.register("measure", "ffn-occupancy", OccupancyConfig, "test-only: FFN channels by rounded weight",
                      consumes=(QuantizedWeights,), produces=(ModelSpec,), reshape=reshape,
                      report=(OCCUPANCY,))(apply)
    CALLS.clear()
    yield
    del registry._REGISTRY[("measure", "ffn-occupancy")]


def write_recipe(tmp_path, keep_first: float, formats=(), first=("quantize",)):
    stages = {"quantize": {"stage": "quantize", "method": "rtn", "bits": 4, "group_size": 32},
              "measure": {"stage": "measure", "method": "ffn-occupancy", "keep_first": keep_first}}
    doc = {"version": 1, "model": {"path": str(STORIES260K)},
           "calibration": {"sources": [str(CAL)], "nsamples": 4, "seqlen": 64},
           "stages": [stages[s] for s in (*first, "measure")],
           "eval": {"data": [str(TEXT / "tinystories" / "tinystories_val.txt")], "max_tokens": 512,
                    "generation": {"prompts": 0}},
           "export": {"formats": list(formats)}}
    path = tmp_path / f"measure-{keep_first}-{'-'.join(formats) or 'none'}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_a_registered_stage_runs_in_a_recipe_and_resumes_from_its_hand_off(tmp_path, occupancy_stage):
    out = tmp_path / "out"
    rc, stdout, err = invoke("run", write_recipe(tmp_path, 0.5), "--output", out, "--json")
    assert rc == 0, err
    first = json.loads(stdout)
    assert CALLS == ["01-measure-ffn-occupancy"]
    saved = json.loads((out / "stages" / "01-measure-ffn-occupancy" / "model_spec.json").read_text())
    assert len(saved["kept_ffn"]["0"]) == saved["blocks"][0]["ffn"] < saved["blocks"][1]["ffn"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert "stages/01-measure-ffn-occupancy/model_spec.json" in manifest["files"]
    assert manifest["stages"]["01-measure-ffn-occupancy"]["metrics"]["kept"] == saved["blocks"][0]["ffn"]
    # its report section: report.json's `occupancy`, rendered by its own registration between the stages' sections
    n = saved["blocks"][0]["ffn"]
    assert first["occupancy"] == {"kept": n, "of": 172, "block": 0}
    md = (out / "report.md").read_text()
    section = f"\n## FFN occupancy\n\nblock 0 keeps {n} of its 172 FFN channels\n"
    assert section in md and md.index("## Stages") < md.index(section) < md.index("## Evaluation")

    rc, stdout, err = invoke("run", write_recipe(tmp_path, 0.5), "--output", out, "--resume", "--json")
    assert rc == 0, err
    again = json.loads(stdout)
    assert CALLS == ["01-measure-ffn-occupancy"]  # not applied again: its ModelSpec was loaded
    assert all(s["resumed"] for s in again["stages"] if s["name"] in ("quantize", "measure"))
    log = (out / "run.log").read_text()
    assert "stage 01-measure-ffn-occupancy (finished earlier: its hand-offs are loaded)" in log
    # the loaded QuantizedWeights and the loaded spec rebuild the same model: the evaluation is identical
    assert again["eval"] == first["eval"]


def test_the_bind_step_checks_its_hand_offs_and_the_exports_against_its_shapes(tmp_path, occupancy_stage):
    rc, stdout, err = invoke("run", write_recipe(tmp_path, 0.5, ["hf"]), "--output", tmp_path / "a", "--dry-run")
    assert rc == 1 and "export hf cannot hold the shapes the stages produce: per-layer FFN widths" in err
    rc, stdout, err = invoke("run", write_recipe(tmp_path, 0.5, ["onnx"]), "--output", tmp_path / "b", "--dry-run")
    assert rc == 0, err  # a traced graph bakes each layer's width in
    assert "structure: block 0 ffn" in stdout
    rc, _, err = invoke("run", write_recipe(tmp_path, 1.0, ["hf"]), "--output", tmp_path / "c", "--dry-run")
    assert rc == 0, err
    rc, _, err = invoke("run", write_recipe(tmp_path, 1.0, first=()), "--output", tmp_path / "d", "--dry-run")
    assert rc == 1 and "consumes a QuantizedWeights, which no earlier stage produces" in err
    assert CALLS == []  # plan time never applies a stage


def test_inspect_prints_the_structure_of_an_export(tmp_path, occupancy_stage):
    out = tmp_path / "out"
    rc, _, err = invoke("run", write_recipe(tmp_path, 1.0, ["hf"]), "--output", out)
    assert rc == 0, err
    rc, stdout, err = invoke("inspect", out)
    assert rc == 0, err
    assert "structure: 5 of 5 blocks, hidden 64" in stdout and "ffn channels: 172" in stdout
