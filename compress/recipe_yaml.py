"""Recipe text: the YAML read safely (size, depth and alias limits), each key's `file:line`, `${VAR}`
interpolation and `--set` overrides. compress/recipe.py builds the validated recipe from what this reads."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from compress.errors import BadInput

SUPPORTED_VERSIONS = (1,)
Loc = tuple  # path into the recipe: str keys and int list indices


@dataclass
class Locator:
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


def read_yaml(path: Path):
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


def line_map(root, file: str) -> dict:
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


def check_top(data, loc8: Locator) -> None:
    if data is None:
        raise BadInput(f"recipe {loc8.file} is empty: expected a mapping with `version`, `model` and `stages`")
    if not isinstance(data, dict):
        kind = "a list" if isinstance(data, list) else f"a {type(data).__name__}"
        raise BadInput(f"the top level of a recipe must be a mapping, got {kind} at {loc8.file}:{loc8.lines[()][0]}")


def check_version(data: dict, loc8: Locator) -> None:
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


def interpolate(obj, loc: Loc, loc8: Locator):
    """A fresh copy of `obj` (no shared YAML aliases) with `${VAR}` substituted in string values."""
    if isinstance(obj, dict):
        return {k: interpolate(v, loc + (k,), loc8) for k, v in obj.items()}
    if isinstance(obj, list):
        return [interpolate(v, loc + (i,), loc8) for i, v in enumerate(obj)]
    if isinstance(obj, str) and "${" in obj:
        value = _VAR.sub(lambda m: _substitute(m, loc, loc8), obj)
        if _VAR.search(obj.replace("$${", "")):
            loc8.templates[loc] = obj
        return value
    return obj


def _substitute(m: re.Match, loc: Loc, loc8: Locator) -> str:
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


def apply_set(data: dict, spec: str, origins: dict) -> None:
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


def replace_key(data: dict, loc: Loc, value, label: str, origins: dict) -> None:
    """CLI replacement of one key; a missing section is created, a malformed one is left to validation."""
    parent = data
    for k in loc[:-1]:
        parent = parent.setdefault(k, {})
        if not isinstance(parent, dict):
            return
    parent[loc[-1]] = value
    origins[loc] = label


def dotted(loc: Loc) -> str:
    return ".".join(str(p) for p in loc)


def leaf(loc: Loc) -> str:
    """`bits` for ('stages', 0, 'bits'); `data[1]` for ('eval', 'data', 1)."""
    if not loc:
        return "recipe"
    if isinstance(loc[-1], int) and len(loc) > 1:
        return f"{leaf(loc[:-1])}[{loc[-1]}]"
    return str(loc[-1])


def with_where(loc: Loc, msg: str, loc8: Locator | None) -> str:
    if loc8 is None:
        return f"{msg} ({dotted(loc)})"
    return f"{msg} (`{dotted(loc)}` {loc8.where(loc)[1]})"
