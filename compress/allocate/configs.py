"""Configs of the `allocate` methods (docs/allocate.md)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, field_validator, model_validator

from compress.allocate.problem import Option, gguf_option
from compress.config import GGMLType, StrictModel, check_group_size
from compress.qweight import KEEP_BITS


class OptionSpec(StrictModel):
    bits: Optional[int] = Field(None, description="2..8, or 16 = keep the chunk in fp16")
    treatment: Literal["minmax", "clip", "keep"] = Field("minmax", description="minmax RTN, activation-weighted "
                                                                                "clipping search, or keep (16 bits)")
    gguf: Optional[GGMLType] = Field(None, description="instead of bits: a llama.cpp type for a whole tensor (the "
                                                       "next quantize stage rounds on llama.cpp's grids, `gguf`)")

    @model_validator(mode="after")
    def _pair(self):
        if (self.bits is None) == (self.gguf is None):
            raise ValueError("an option is either `bits` (with a treatment) or a llama.cpp type `gguf`")
        if self.gguf is not None:
            if "treatment" in self.model_fields_set:
                raise ValueError("a `gguf` option takes no treatment: llama.cpp's fit of that type rounds it")
            return self
        if (self.bits == KEEP_BITS) != (self.treatment == "keep"):
            raise ValueError("bits 16 goes with treatment `keep` and only with it")
        if self.bits != KEEP_BITS and not 2 <= self.bits <= 8:
            raise ValueError(f"bits must be 2..8 or 16, got {self.bits}")
        return self


def default_options() -> list[OptionSpec]:
    return [OptionSpec(bits=b, treatment=t) for b in (2, 3, 4, 8) for t in ("minmax", "clip")] + [
        OptionSpec(bits=16, treatment="keep")]


# the options when the next quantize stage rounds on llama.cpp's grids: the types llama.cpp's K mixes are made of
GGUF_OPTIONS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0")


class AllocateConfig(StrictModel):
    stage: Literal["allocate"] = "allocate"
    method: str
    budget: float = Field(..., gt=0, description="global effective bits per weight (scales, zeros, plan metadata "
                                                 "included); never exceeded")
    group_size: Optional[int] = Field(None, description="group length; default and requirement: the next quantize "
                                                       "stage's")
    chunk_size: Optional[int] = Field(None, gt=0, description="unit width in input columns, a multiple of "
                                                             "group_size (default: group_size)")
    sym: Optional[bool] = Field(None, description="symmetric quantization; default and requirement: the next "
                                                  "quantize stage's")
    options: list[OptionSpec] = Field(default_factory=default_options, min_length=1,
                                      description="(bits, treatment) options per unit")

    _gs = field_validator("group_size")(lambda cls, v: v if v is None else check_group_size(v))

    @model_validator(mode="after")
    def _chunks(self):
        if self.group_size == -1:
            raise ValueError("group_size -1 (per-channel) cannot be cut into chunks; use a group size")
        if self.group_size is not None and self.chunk_size is not None and self.chunk_size % self.group_size:
            raise ValueError(f"chunk_size {self.chunk_size} is not a multiple of group_size {self.group_size}")
        labels = [(o.bits, o.treatment, o.gguf) for o in self.options]
        if len(set(labels)) != len(labels):
            raise ValueError("options are listed more than once")
        if len({o.gguf is None for o in self.options}) > 1:
            raise ValueError("options are either all llama.cpp types (`gguf`) or all bit widths")
        return self

    def option_list(self) -> list[Option]:
        return [gguf_option(o.gguf) if o.gguf else Option(o.bits, o.treatment) for o in self.options]

    @property
    def gguf(self) -> bool:
        """The options are llama.cpp types: one per tensor (docs/gguf.md#mixed-precision-plans)."""
        return any(o.gguf for o in self.options)

    def widths(self) -> set[int]:
        """Every bit width a layer may end up with (the exports plan their containers for these)."""
        return {o.bits for o in self.option_list()}


class SelectionSlice(StrictModel):
    """The calibration slice that measures layer sensitivities, picks the RL controller's final plan and
    scores the `refine` moves."""
    select_samples: int = Field(32, ge=1, description="calibration sequences of the selection slice (final-plan "
                                                      "pick, layer sensitivities, refine)")
    select_seqlen: int = Field(256, ge=2, description="tokens per selection-slice sequence")
    refine: int = Field(0, ge=0, description="after the search, this many random pair moves (one unit one option "
                                             "up, another one down), each kept when it lowers the selection slice's "
                                             "loss (rl: its terminal's kind; else perplexity) within the budget; "
                                             "0 = off")


class KnapsackConfig(AllocateConfig, SelectionSlice):
    sensitivity: Literal["layer", "unit", "none"] = Field(
        "none", description="weight each layer's (or unit's) proxy errors by its measured perplexity sensitivity "
                            "on the selection slice, as the rl controller does by default")


class GreedyConfig(KnapsackConfig):
    method: Literal["greedy"] = "greedy"


class LagrangianConfig(KnapsackConfig):
    method: Literal["lagrangian"] = "lagrangian"


class UniformConfig(AllocateConfig):
    method: Literal["uniform"] = "uniform"


class RLConfig(AllocateConfig, SelectionSlice):
    method: Literal["rl"] = "rl"
    updates: int = Field(50, ge=1, description="PPO updates")
    episodes: int = Field(8, ge=1, description="episodes per update")
    epochs: int = Field(4, ge=1)
    minibatch: int = Field(256, ge=1, description="steps per PPO minibatch")
    lr: float = Field(3e-4, gt=0)
    entropy: float = Field(0.01, ge=0)
    hidden: int = Field(256, ge=8)
    terminal: Literal["ppl", "kl", "hidden_mse", "none"] = Field("ppl", description="terminal reward from the real "
                                                                                   "model")
    kappa: float = Field(10.0, ge=0, description="terminal reward scale")
    reward_samples: int = Field(8, ge=1, description="calibration sequences for the terminal reward")
    reward_seqlen: int = Field(128, ge=2, description="tokens per terminal-reward sequence")
    sensitivity: Literal["layer", "unit", "none"] = Field(
        "layer", description="weight each layer's (or unit's) proxy errors by its measured loss sensitivity (needs "
                             "a terminal reward)")
    warm_start: int = Field(100, ge=0, description="behaviour-cloning steps toward the greedy plan before PPO "
                                                   "(0 = none); that plan is also a final candidate")
    keep_best: int = Field(8, ge=1, description="best training episodes kept as final candidates")
    steps: Literal["unit", "layer"] = Field("unit", description="PPO steps: one per unit, or one per layer with "
                                                                "factorised per-chunk actions")
    seed: Optional[int] = Field(None, ge=0, description="PPO seed (default: calibration.seed)")


class FileConfig(StrictModel):
    stage: Literal["allocate"] = "allocate"
    method: Literal["file"] = "file"
    path: str = Field(..., min_length=1, description="plan.json of an earlier run")

    def widths(self) -> set[int]:
        return set()  # read from the plan file when the stage runs
