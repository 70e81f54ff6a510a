"""Recipe validation errors with `file:line`: pydantic's errors on the stage, export and section configs
turned into one message per problem, each naming where it was written (or the CLI option that set it)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence, get_args

from pydantic import BaseModel, ValidationError

from compress import registry
from compress.recipe_yaml import Loc, Locator, dotted, leaf


@dataclass
class Problem:
    loc: Loc
    kind: str  # unknown_key | missing | value | custom
    msg: str = ""
    choices: Sequence[str] = ()
    suffix: str = ""


def stage_config(item, loc: Loc, errors: list) -> BaseModel | None:
    if not isinstance(item, dict):
        errors.append(Problem(loc, "value", f"must be a mapping with `stage` and `method`, got {type(item).__name__}"))
        return None
    missing = [k for k in ("stage", "method") if k not in item]
    if missing:
        errors.extend(Problem(loc + (k,), "missing") for k in missing)
        return None
    known = {st: registry.methods(st) for st in registry.stages() if st != "export"}
    stage, method = item["stage"], item["method"]
    bad = [k for k in ("stage", "method") if not isinstance(item[k], str)]
    if bad:
        errors.extend(Problem(loc + (k,), "value", f"must be a name, got {type(item[k]).__name__}") for k in bad)
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


def export_config(item, loc: Loc, errors: list):
    if not isinstance(item, (str, dict)):
        errors.append(Problem(loc, "value", "must be a format name or a mapping with `format`"))
        return None
    if isinstance(item, dict) and "format" not in item:
        errors.append(Problem(loc + ("format",), "missing"))
        return None
    name = item if isinstance(item, str) else item["format"]
    if not isinstance(name, str):
        errors.append(Problem(loc + ("format",), "value", f"must be a format name, got {type(name).__name__}"))
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
        errors.extend(from_pydantic(e, loc, cls))
        return None


def _unknown_name(loc: Loc, what: str, name, known: Sequence[str], scope: str = "", hint: str = "") -> Problem:
    """e.g. "unknown method `gtpq` for stage `quantize` at r.yaml:9, did you mean `gptq`? (known: ...)"."""
    return Problem(loc, "custom", f"unknown {what} `{name}`{scope}",
                suffix=f"{registry.suggest(name, known)} (known: {', '.join(known)}){hint}")


def from_pydantic(exc: ValidationError, prefix: Loc, root: type[BaseModel]) -> list[Problem]:
    out = []
    for e in exc.errors():
        rel = tuple(e["loc"])
        if e["type"] == "extra_forbidden":
            cls = _model_at(root, rel[:-1])
            out.append(Problem(prefix + rel, "unknown_key", choices=list(cls.model_fields) if cls else []))
        elif e["type"] == "missing":
            out.append(Problem(prefix + rel, "missing"))
        else:
            msg = e["msg"].removeprefix("Value error, ")
            suffix = ""
            if e["type"] == "literal_error" and isinstance(e.get("input"), str):
                suffix = registry.suggest(e["input"], re.findall(r"'([^']*)'", e["ctx"]["expected"]))
            out.append(Problem(prefix + rel, "value", msg, suffix=suffix))
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


def format_problems(errors: list[Problem], loc8: Locator) -> str:
    msgs = [_format_one(e, loc8) for e in errors]
    msgs.sort(key=lambda m: m[0])
    return "\n".join(dict.fromkeys(m[1] for m in msgs))


def _format_one(e: Problem, loc8: Locator) -> tuple[float, str]:
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
