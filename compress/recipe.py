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
      sources: [data/valid.txt]          # .txt/.jsonl/.tsv files, directories, or `hf:<dataset>[:split]`
      text_field: text
      nsamples: 128
      seqlen: 512
      seed: 0
    stages:                              # each item validated by registry.get(stage, method).config
      - {stage: quantize, method: autoround, bits: 4, group_size: 128, iters: 50}
    eval:
      data: [data/wiki.test.raw]
      window: 256
      max_tokens: 20000                  # optional cap
      text_slice: [0.0, 1.0]             # optional fraction [start, end) of each eval file
      enabled: true
    export:
      formats: [hf]                      # names registered as ("export", name), or `- {format: hf, ...}`

Resolution order: YAML -> `${VAR}` / `${VAR:-default}` interpolation in string values (the default is
used when VAR is unset or empty; `$${` writes a literal `${`; artifacts record `LoadedRecipe.recorded`, where
such a value is the reference as written) -> `--set dotted.key=value` overrides
(value parsed as YAML; list items by index, `stages.0.bits=3`) -> the dedicated CLI replacements
(`--model`, `--calibration`, `--eval-data`, `--seed`) -> validation.

Relative local paths (model.path, calibration.sources, eval.data) are resolved against the current
working directory of the process, NOT the directory of the recipe file; `.resolved` keeps them as
written. `LoadedRecipe.resolved` is the validated recipe with every default filled in (JSON types),
and `.sha256` hashes its canonical JSON (sorted keys), so it is independent of key order in the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Sequence, Union, get_args

import yaml
from pydantic import BaseModel, Field, SerializeAsAny, ValidationError, field_validator

from compress import registry
from compress.config import StrictModel
from compress.errors import BadInput

SUPPORTED_VERSIONS = (1,)
Loc = tuple  # path into the recipe: str keys and int list indices


# -- schema -----------------------------------------------------------------------------------------
class ModelSource(StrictModel):
    path: str = Field(..., min_length=1, description="Hub id `org/name`, local directory or .gguf file")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    gguf_file: Optional[str] = Field(None, description="GGUF file name inside `path`")
    stream: bool = Field(False, description="read one block at a time from the safetensors shards "
                                            "(models larger than memory; no in-run evaluation)")


class CalibrationSpec(StrictModel):
    sources: list[str] = Field(default_factory=list, description="text files, directories, or hf:<id>[:split]")
    text_field: str = Field("text", description="field holding the text in .jsonl/.tsv/hub rows")
    nsamples: int = Field(128, gt=0)
    seqlen: int = Field(512, gt=0)
    seed: int = Field(0, ge=0)


class GenerationSpec(StrictModel):
    prompts: int = Field(16, ge=0, description="held-out prompts for greedy continuation (0 = off)")
    prompt_tokens: int = Field(32, gt=0, description="tokens per prompt")
    new_tokens: int = Field(64, gt=0, description="greedy tokens generated per prompt")


class EvalSpec(StrictModel):
    data: list[str] = Field(default_factory=list, description="text files to compare FP vs compressed on")
    window: int = Field(256, gt=0, description="tokens per evaluation window")
    max_tokens: Optional[int] = Field(None, gt=0, description="cap on evaluated tokens per file")
    text_slice: Optional[tuple[float, float]] = Field(None, description="fraction [start, end) of each file")
    probe_train: Optional[str] = Field(
        None, description="encoders: labeled TSV to train the linear probe on (each `data` file is a labeled test TSV)")
    generation: GenerationSpec = Field(default_factory=GenerationSpec,
                                       description="causal models: greedy continuation agreement FP vs compressed")
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


class Recipe(StrictModel):
    version: Literal[1]
    description: str = ""
    model: ModelSource
    calibration: CalibrationSpec = Field(default_factory=CalibrationSpec)
    stages: list[SerializeAsAny[BaseModel]] = Field(..., description="stage configs, run in order")
    eval: EvalSpec = Field(default_factory=EvalSpec)
    export: ExportSpec = Field(default_factory=ExportSpec)

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


def stage_methods() -> dict[str, list[str]]:
    """Stages allowed in `stages:` (exports live in `export.formats`) -> their registered methods."""
    return {s: registry.methods(s) for s in registry.stages() if s != "export"}


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
@dataclass
class _Locator:
    """Maps a recipe loc to `file:line` (from the YAML node tree) or to the CLI option that set it."""

    file: str
    lines: dict = field(default_factory=dict)  # loc -> (key line, value line), 1-based
    origins: dict = field(default_factory=dict)  # loc -> "--set a.b=1" / "--model"
    templates: dict = field(default_factory=dict)  # loc -> the string as written, where `${VAR}` was substituted

    def where(self, loc: Loc, *, key: bool = False) -> tuple[float, str]:
        """(sort key, "at recipe.yaml:7" or "in --set a.b=1") for the deepest known prefix of `loc`."""
        for n in range(len(loc), -1, -1):
            if loc[:n] in self.origins:
                return float("inf"), f"in {self.origins[loc[:n]]}"
        for n in range(len(loc), -1, -1):
            if loc[:n] in self.lines:
                kline, vline = self.lines[loc[:n]]
                line = kline if key or n < len(loc) else vline
                return line, f"at {self.file}:{line}"
        return 0, f"in {self.file}"


@dataclass(frozen=True)
class LoadedRecipe:
    recipe: Recipe
    resolved: dict  # validated recipe with defaults, JSON types; paths as written
    sha256: str  # of json.dumps(resolved, sort_keys=True)
    path: Path
    locator: _Locator = field(default=None, repr=False, compare=False)

    @property
    def recorded(self) -> dict:
        """`resolved` as it may be written into artifacts: each value that came from `${VAR}` interpolation
        is the reference as written (`${HF_TOKEN}`), never the variable's value."""
        out = json.loads(json.dumps(self.resolved))
        loc8 = self.locator or _Locator("")
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
    node, data = _read_yaml(path)
    loc8 = _Locator(str(path), _line_map(node, str(path)) if node is not None else {})
    _check_top(data, loc8)
    data = _interpolate(data, (), loc8)
    for spec in overrides:
        _apply_set(data, spec, loc8.origins)
    for loc, value, label in ((("model", "path"), model, "--model"),
                              (("calibration", "sources"), calibration, "--calibration"),
                              (("eval", "data"), eval_data, "--eval-data"),
                              (("calibration", "seed"), seed, "--seed")):
        if value is not None:
            _replace(data, loc, list(value) if isinstance(value, (list, tuple)) else value, label, loc8.origins)
    _check_version(data, loc8)
    recipe = _validate(data, loc8)
    resolved = recipe.model_dump(mode="json")
    return LoadedRecipe(recipe, resolved, canonical_sha256(resolved), path, loc8)


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
    _, data = _read_yaml(recipe_file(path))
    desc = data.get("description") if isinstance(data, dict) else None
    return str(desc).strip().splitlines()[0] if desc else ""


# -- reading YAML -----------------------------------------------------------------------------------
def _read_yaml(path: Path):
    """(root node, plain data) from one parse; YAML errors become BadInput with the line."""
    if not path.is_file():
        what = "is not a file" if path.exists() else "does not exist"
        raise BadInput(f"recipe file `{path}` {what}")
    text = _recipe_text(path)
    _check_shape(text, path)
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as e:
        raise BadInput(_yaml_error(e, path)) from None
    finally:
        loader.dispose()
    return node, data


MAX_BYTES, MAX_DEPTH, MAX_ALIASES, MAX_NODES = 1 << 20, 32, 64, 100_000


def _recipe_text(path: Path) -> str:
    if path.stat().st_size > MAX_BYTES:
        raise BadInput(f"recipe file `{path}` is {path.stat().st_size:,} bytes; a recipe is at most {MAX_BYTES:,}")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadInput(f"recipe file `{path}` is not UTF-8 text (byte {e.start}: {e.reason}); "
                       "is it a recipe YAML file?") from None


def _check_shape(text: str, path: Path) -> None:
    """Refuse, before building anything, a recipe nested deeper than MAX_DEPTH, with more than MAX_ALIASES
    aliases, or whose aliases expand to more than MAX_NODES values (a 'billion laughs' file is a few
    hundred bytes that expand to gigabytes). One pass over the YAML event stream, linear in the file."""
    aliases, expanded = 0, {}  # anchor -> values it expands to
    stack = [[None, 0]]  # per open collection: [anchor, values inside it so far]
    try:
        for ev in yaml.parse(text, Loader=yaml.SafeLoader):
            line = ev.start_mark.line + 1
            if isinstance(ev, yaml.CollectionStartEvent):
                if len(stack) > MAX_DEPTH:
                    raise BadInput(f"recipe `{path}` nests deeper than {MAX_DEPTH} levels at line {line}")
                stack.append([ev.anchor, 1])
                continue
            if isinstance(ev, yaml.CollectionEndEvent):
                anchor, n = stack.pop()
                if anchor:
                    expanded[anchor] = n
            elif isinstance(ev, yaml.AliasEvent):
                aliases += 1
                if aliases > MAX_ALIASES:
                    raise BadInput(f"recipe `{path}` uses more than {MAX_ALIASES} YAML aliases (line {line}); "
                                   "write the values out")
                n = expanded.get(ev.anchor, 1)
            elif isinstance(ev, yaml.ScalarEvent):
                n = 1
                if ev.anchor:
                    expanded[ev.anchor] = 1
            else:
                continue
            stack[-1][1] += n
            if sum(c[1] for c in stack) > MAX_NODES:
                raise BadInput(f"recipe `{path}` expands to more than {MAX_NODES:,} values through YAML aliases "
                               f"(line {line}); write the values out")
    except yaml.YAMLError:
        return  # the full parse reports it, with its line


def _yaml_error(e: yaml.YAMLError, path: Path) -> str:
    """e.g. "bad YAML at r.yaml:15: expected ',' or ']', but got ':' (while parsing a flow sequence
    started at line 14)"."""
    problem, context = getattr(e, "problem", None), getattr(e, "context", None)
    pmark, cmark = getattr(e, "problem_mark", None), getattr(e, "context_mark", None)
    mark = pmark or cmark
    where = f"{path}:{mark.line + 1}" if mark else str(path)
    what = problem or str(e)
    if context:
        started = f" started at line {cmark.line + 1}" if cmark and pmark and cmark.line != pmark.line else ""
        what += f" ({context}{started})"
    return f"bad YAML at {where}: {what}"


def _line_map(root, file: str) -> dict:
    """loc -> (line of the key, line of the value), 1-based; duplicate keys are an error."""
    lines = {(): (root.start_mark.line + 1, root.start_mark.line + 1)}
    stack: list = [(root, ())]
    while stack:
        node, loc = stack.pop()
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for k, v in node.value:
                key = k.value if isinstance(k, yaml.ScalarNode) else str(k.start_mark)
                if key in seen:
                    raise BadInput(f"duplicate key `{key}` at {file}:{k.start_mark.line + 1} "
                                   f"(first at line {seen[key]})")
                seen[key] = k.start_mark.line + 1
                scalar = isinstance(v, yaml.ScalarNode)  # a collection's errors point at its key
                lines[loc + (key,)] = (k.start_mark.line + 1, (v if scalar else k).start_mark.line + 1)
                if len(loc) < 32:
                    stack.append((v, loc + (key,)))
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                lines[loc + (i,)] = (v.start_mark.line + 1, v.start_mark.line + 1)
                if len(loc) < 32:
                    stack.append((v, loc + (i,)))
    return lines


def _check_top(data, loc8: _Locator) -> None:
    if data is None:
        raise BadInput(f"recipe {loc8.file} is empty: expected a mapping with `version`, `model` and `stages`")
    if not isinstance(data, dict):
        kind = "a list" if isinstance(data, list) else f"a {type(data).__name__}"
        raise BadInput(f"the top level of a recipe must be a mapping, got {kind} at {loc8.file}:{loc8.lines[()][0]}")


def _check_version(data: dict, loc8: _Locator) -> None:
    if "version" not in data:
        raise BadInput(f"missing required key `version` {loc8.where((), key=True)[1]} "
                       f"(add `version: {SUPPORTED_VERSIONS[-1]}`)")
    v = data["version"]
    if type(v) is not int or v not in SUPPORTED_VERSIONS:
        raise BadInput(f"unsupported recipe version `{v}` {loc8.where(('version',))[1]}; "
                       f"this compress reads version {', '.join(map(str, SUPPORTED_VERSIONS))}")


# -- interpolation, overrides, replacements ----------------------------------------------------------
_VAR = re.compile(r"\$(\$)?\{([^}]*)\}")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _interpolate(obj, loc: Loc, loc8: _Locator):
    """A fresh copy of `obj` (no shared YAML aliases) with `${VAR}` substituted in string values."""
    if isinstance(obj, dict):
        return {k: _interpolate(v, loc + (k,), loc8) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_interpolate(v, loc + (i,), loc8) for i, v in enumerate(obj)]
    if isinstance(obj, str) and "${" in obj:
        value = _VAR.sub(lambda m: _substitute(m, loc, loc8), obj)
        if _VAR.search(obj.replace("$${", "")):
            loc8.templates[loc] = obj
        return value
    return obj


def _substitute(m: re.Match, loc: Loc, loc8: _Locator) -> str:
    if m.group(1):  # `$${...}` is a literal `${...}`
        return m.group(0)[1:]
    name, sep, default = m.group(2).partition(":-")
    where = f"`{dotted(loc)}` {loc8.where(loc)[1]}"
    if not _NAME.fullmatch(name):
        raise BadInput(f"malformed `{m.group(0)}` in {where}; write `${{NAME}}` or `${{NAME:-default}}`")
    value = os.environ.get(name)
    if value is None or (sep and value == ""):
        if sep:
            return default
        raise BadInput(f"environment variable `{name}` is not set (used by {where}); "
                       f"set it or write `${{{name}:-default}}`")
    return value


def _parse_value(raw: str):
    """A YAML scalar (`3`, `false`, `null`, `''`) or flow collection (`[a, b]`, `{format: hf}`); any other
    text that YAML would read as a block collection (`note: x`, `- a`) or cannot parse stays a string."""
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    if isinstance(value, (dict, list)) and not raw.lstrip().startswith(("[", "{")):
        return raw
    return value


def _apply_set(data: dict, spec: str, origins: dict) -> None:
    """Apply one `--set a.b.0.c=value`. Missing mapping keys are created (validation then reports unknown
    ones with a suggestion); list indices must exist (negative ones count from the end)."""
    key, eq, raw = spec.partition("=")
    parts = key.strip().split(".")
    if not eq or not all(parts):
        raise BadInput(f"--set expects dotted.key=value (e.g. stages.0.bits=3), got `{spec}`")
    container, loc = data, ()
    for i, part in enumerate(parts):
        k = _step(container, part, loc, spec)
        loc += (k,)
        if i == len(parts) - 1:
            container[k] = _parse_value(raw)
        else:
            if isinstance(container, dict) and k not in container:
                container[k] = {}
                origins.setdefault(loc, f"--set {spec}")  # errors about the new key point at the option
            container = container[k]
    origins[loc] = f"--set {spec}"


def _step(container, part: str, loc: Loc, spec: str):
    if isinstance(container, dict):
        return part
    if isinstance(container, list):
        if not re.fullmatch(r"-?\d+", part):
            raise BadInput(f"--set {spec}: `{dotted(loc)}` is a list; index it, e.g. `{dotted(loc)}.0`")
        idx, n = int(part), len(container)
        if not -n <= idx < n:
            raise BadInput(f"--set {spec}: index {idx} is out of range for `{dotted(loc)}` ({n} items)")
        return idx % n
    raise BadInput(f"--set {spec}: `{dotted(loc)}` is a {type(container).__name__}, not a mapping or list")


def _replace(data: dict, loc: Loc, value, label: str, origins: dict) -> None:
    """CLI replacement of one key; a missing section is created, a malformed one is left to validation."""
    parent = data
    for k in loc[:-1]:
        parent = parent.setdefault(k, {})
        if not isinstance(parent, dict):
            return
    parent[loc[-1]] = value
    origins[loc] = label


# -- validation with file:line messages --------------------------------------------------------------
@dataclass
class _Err:
    loc: Loc
    kind: str  # unknown_key | missing | value | custom
    msg: str = ""
    choices: Sequence[str] = ()
    suffix: str = ""


def _validate(data: dict, loc8: _Locator) -> Recipe:
    errors: list[_Err] = []
    data = dict(data)
    if data.get("stages") == []:
        errors.append(_Err(("stages",), "value", "no stages: a recipe needs at least one (e.g. `- {stage: quantize, "
                                                 "method: rtn}`)"))
    if isinstance(data.get("stages"), list):
        items = [_stage_config(item, ("stages", i), errors) for i, item in enumerate(data["stages"])]
        data["stages"] = items if all(c is not None for c in items) else []
    exp = data.get("export")
    if isinstance(exp, dict) and isinstance(exp.get("formats"), list):
        fmts = [_export_config(item, ("export", "formats", i), errors) for i, item in enumerate(exp["formats"])]
        data["export"] = {**exp, "formats": [f for f in fmts if f is not None]}
    recipe = None
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        errors.extend(_from_pydantic(e, (), Recipe))
    if errors:
        raise BadInput(_format(errors, loc8))
    return recipe


def _stage_config(item, loc: Loc, errors: list) -> BaseModel | None:
    if not isinstance(item, dict):
        errors.append(_Err(loc, "value", f"must be a mapping with `stage` and `method`, got {type(item).__name__}"))
        return None
    missing = [k for k in ("stage", "method") if k not in item]
    if missing:
        errors.extend(_Err(loc + (k,), "missing") for k in missing)
        return None
    known = stage_methods()
    stage, method = item["stage"], item["method"]
    bad = [k for k in ("stage", "method") if not isinstance(item[k], str)]
    if bad:
        errors.extend(_Err(loc + (k,), "value", f"must be a name, got {type(item[k]).__name__}") for k in bad)
        return None
    if stage not in known:
        hint = " (export formats go under `export.formats`)" if stage == "export" else ""
        errors.append(_unknown_name(loc + ("stage",), "stage", stage, sorted(known), hint=hint))
        return None
    if method not in known[stage]:
        errors.append(_unknown_name(loc + ("method",), "method", method, known[stage], f" for stage `{stage}`"))
        return None
    cls = registry.get(stage, method).config
    return _validate_with(cls, item, loc, errors)


def _export_config(item, loc: Loc, errors: list):
    if not isinstance(item, (str, dict)):
        errors.append(_Err(loc, "value", "must be a format name or a mapping with `format`"))
        return None
    if isinstance(item, dict) and "format" not in item:
        errors.append(_Err(loc + ("format",), "missing"))
        return None
    name = item if isinstance(item, str) else item["format"]
    if not isinstance(name, str):
        errors.append(_Err(loc + ("format",), "value", f"must be a format name, got {type(name).__name__}"))
        return None
    known = registry.methods("export")
    if name not in known:
        at = loc if isinstance(item, str) else loc + ("format",)
        errors.append(_unknown_name(at, "export format", name, known))
        return None
    cls = registry.get("export", name).config
    return item if isinstance(item, str) else _validate_with(cls, item, loc, errors)


def _validate_with(cls: type[BaseModel], item: dict, loc: Loc, errors: list):
    try:
        return cls.model_validate(item)
    except ValidationError as e:
        errors.extend(_from_pydantic(e, loc, cls))
        return None


def _unknown_name(loc: Loc, what: str, name, known: Sequence[str], scope: str = "", hint: str = "") -> _Err:
    """e.g. "unknown method `gtpq` for stage `quantize` at r.yaml:9, did you mean `gptq`? (known: ...)"."""
    return _Err(loc, "custom", f"unknown {what} `{name}`{scope}",
                suffix=f"{registry.suggest(name, known)} (known: {', '.join(known)}){hint}")


def _from_pydantic(exc: ValidationError, prefix: Loc, root: type[BaseModel]) -> list[_Err]:
    out = []
    for e in exc.errors():
        rel = tuple(e["loc"])
        if e["type"] == "extra_forbidden":
            cls = _model_at(root, rel[:-1])
            out.append(_Err(prefix + rel, "unknown_key", choices=list(cls.model_fields) if cls else []))
        elif e["type"] == "missing":
            out.append(_Err(prefix + rel, "missing"))
        else:
            msg = e["msg"].removeprefix("Value error, ")
            suffix = ""
            if e["type"] == "literal_error" and isinstance(e.get("input"), str):
                suffix = registry.suggest(e["input"], re.findall(r"'([^']*)'", e["ctx"]["expected"]))
            out.append(_Err(prefix + rel, "value", msg, suffix=suffix))
    return out


def _model_at(cls, loc: Loc):
    """The pydantic model class that validates the mapping at `loc` below `cls`, or None."""
    for part in loc:
        if isinstance(part, int):
            continue
        f = cls.model_fields.get(part) if cls else None
        cls = _inner_model(f.annotation) if f else None
    return cls


def _inner_model(ann):
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann
    for arg in get_args(ann):
        found = _inner_model(arg)
        if found is not None and found.model_fields:
            return found
    return None


def _format(errors: list[_Err], loc8: _Locator) -> str:
    msgs = [_format_one(e, loc8) for e in errors]
    msgs.sort(key=lambda m: m[0])
    return "\n".join(dict.fromkeys(m[1] for m in msgs))


def _format_one(e: _Err, loc8: _Locator) -> tuple[float, str]:
    if e.kind == "unknown_key":
        line, where = loc8.where(e.loc, key=True)
        hint = registry.suggest(e.loc[-1], e.choices)
        if not hint and e.choices:
            hint = f" (valid keys: {', '.join(e.choices)})"
        return line, f"unknown key `{e.loc[-1]}` {where}{hint}"
    if e.kind == "missing":
        line, where = loc8.where(e.loc[:-1], key=True)
        parent = f" in `{dotted(e.loc[:-1])}`" if e.loc[:-1] else ""
        return line, f"missing required key `{e.loc[-1]}`{parent} {where}"
    line, where = loc8.where(e.loc)
    if e.kind == "custom":
        return line, f"{e.msg} {where}{e.suffix}"
    return line, f"`{leaf(e.loc)}` {where}: {e.msg}{e.suffix}"


def dotted(loc: Loc) -> str:
    return ".".join(str(p) for p in loc)


def leaf(loc: Loc) -> str:
    """`bits` for ('stages', 0, 'bits'); `data[1]` for ('eval', 'data', 1)."""
    if not loc:
        return "recipe"
    if isinstance(loc[-1], int) and len(loc) > 1:
        return f"{leaf(loc[:-1])}[{loc[-1]}]"
    return str(loc[-1])


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
    from compress.models.loading import resolve_source

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


def with_where(loc: Loc, msg: str, loc8: _Locator | None) -> str:
    if loc8 is None:
        return f"{msg} ({dotted(loc)})"
    return f"{msg} (`{dotted(loc)}` {loc8.where(loc)[1]})"
