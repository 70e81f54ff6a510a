"""The layout the code is read by (README "Layout", docs/stages.md "Adding a stage"): one package per stage kind,
a small root, no import cycles, no stage named by the run's own modules."""

from __future__ import annotations

import ast
import re

from conftest import REPO

PACKAGE = REPO / "compress"
STAGE_PACKAGES = ("quantize", "allocate", "prune", "select", "finetune", "rotation", "export", "publish", "models")
ROOT_LIMIT = 26


def product_modules() -> dict[str, tuple[ast.Module, bool]]:
    """Every module of the installed package by dotted name, with whether it is a package (compress/eval and
    compress/kernels are links to the top-level eval/ and kernels/: followed)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):  # rglob follows the links
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = (ast.parse(path.read_text(), str(path)), path.name == "__init__.py")
    return out


def imports(name: str, tree: ast.Module, is_package: bool, known) -> set[str]:
    """The product modules `name` imports, inside functions too (`from pkg import mod` names the module)."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n and n != name:
                found.add(n)
    return found


def test_one_package_per_stage_kind_and_a_small_root():
    assert not (PACKAGE / "methods").exists()
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= ROOT_LIMIT, root
    for pkg in STAGE_PACKAGES:
        doc = ast.get_docstring(ast.parse((PACKAGE / pkg / "__init__.py").read_text()))
        assert doc and "owns" in doc, f"compress/{pkg}/__init__.py: say what the package owns"


def test_no_import_cycle_and_no_import_of_the_lab():
    mods = product_modules()
    graph = {m: imports(m, tree, is_package, mods) for m, (tree, is_package) in mods.items()}
    for m, (tree, _) in mods.items():
        lab = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
               and any(a == "bench" or a.startswith("bench.") for a in
                       ([x.name for x in n.names] if isinstance(n, ast.Import) else [n.module or ""]))]
        assert not lab, f"{m} imports the lab (bench/)"
    # a cycle is a path back to where it started: depth-first search with the path on a stack
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m, path):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(n):] + [n]))
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_modules_are_loaded_by_import_statements_only():
    """Nothing is imported by a string but the registry's own stage modules."""
    for m, (tree, _) in product_modules().items():
        calls = [n for n in ast.walk(tree)
                 if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "import_module"]
        assert not calls or m == "compress.registry", m


def test_the_run_names_no_method_and_no_report_section():
    """bind, the pipeline, the spine and the allocate package ask registrations what they can do; the pipeline and
    the report render every stage's report section without naming one."""
    methods = re.compile(r'"(rtn|gptq|autoround|moe|prunepath)"')
    for path in [PACKAGE / "bind.py", PACKAGE / "pipeline.py", PACKAGE / "quantize" / "spine.py",
                 *sorted((PACKAGE / "allocate").glob("*.py"))]:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if methods.search(line):
                assert re.search(r'method: Literal\["\w+"\] = "\w+"', line), f"{path.name}:{i}: {line.strip()}"
    from compress import registry

    keys = set(registry.sections())
    assert {"allocation", "routers", "selection", "structure", "adapted_groups"} <= keys
    report = (REPO / "eval" / "report.py").read_text()
    assert not [k for k in keys if f'"{k}"' in report]
    pipeline = (PACKAGE / "pipeline.py").read_text()  # (its dry-run plan has a `structure` key of its own)
    assert not [k for k in keys if re.search(rf'report\[\s*"{k}"|report\.get\("{k}"|\["metrics"\]\["{k}"', pipeline)]
