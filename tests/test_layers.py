"""The house rules of the tree, checked on the source (docs/design.md, "Layers"):

* no import cycles among the library's modules, counting imports inside functions too (a
  cycle hidden behind a lazy import is still a cycle); the package root's lazy
  conveniences aside, since every module is inside that package anyway;
* the kvpack format, the handoff protocol, the store and the strict-input toolkit import no
  ML framework, anywhere (not even lazily);
* the library never imports the command layer, and commands never import each other
  (only their shared ``_common`` and ``_examples``; ``man`` also reads ``_gendocs``, the one
  place the manual pages are made from the app).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FRAMEWORKS = ("torch", "transformers", "mlx", "mlx_lm", "vllm", "accelerate")


def _modules() -> dict[str, Path]:
    out = {}
    for base, prefix in ((ROOT / "muser_cli", "muser_cli"), (ROOT / "commands", "muser_cli.commands")):
        for p in base.rglob("*.py"):
            parts = p.relative_to(base).with_suffix("").parts
            name = ".".join((prefix, *parts))
            out[name.removesuffix(".__init__")] = p
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(path: Path, name: str) -> tuple[set[str], set[str], set[str]]:
    """(muser modules imported at module level, inside functions, every imported top-level package)."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    top: set[str] = set()
    lazy: set[str] = set()
    anywhere: set[str] = set()

    def targets(node: ast.AST) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        assert isinstance(node, ast.ImportFrom)
        base = node.module or ""
        if node.level:
            pkg = name.split(".")
            pkg = pkg if is_pkg else pkg[:-1]
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join([*pkg, base] if base else pkg)
        return [base, *(f"{base}.{a.name}" for a in node.names)]

    def visit(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", "") == "TYPE_CHECKING":
                continue
            inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for t in targets(child):
                    anywhere.add(t.split(".")[0])
                    r = _resolve(t) if t.startswith("muser_cli") else None
                    if r and r != name:
                        (lazy if inner else top).add(r)
            visit(child, inner)

    visit(tree, False)
    return top, lazy, anywhere


GRAPH = {name: _imports(path, name) for name, path in MODULES.items()}


def test_no_import_cycles():
    graph = {k: {t for t in v[0] | v[1] if t != "muser_cli"} for k, v in GRAPH.items() if k != "muser_cli"}
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(v: str) -> None:
        state[v] = 1
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(w):] + [w]))
            if w not in state:
                walk(w)
        stack.pop()
        state[v] = 2

    for v in sorted(graph):
        if v not in state:
            walk(v)


def test_framework_free_layers():
    free = ("muser_cli.kvpack", "muser_cli.handoff", "muser_cli.reuse", "muser_cli.strict", "muser_cli.errors",
            "muser_cli.model.info", "muser_cli.schedule", "muser_cli.fsio", "muser_cli.threads")
    for name, (_, _, anywhere) in GRAPH.items():
        if name.startswith(free):
            heavy = sorted(anywhere & set(FRAMEWORKS))
            assert not heavy, f"{name} imports {heavy}"


def test_library_never_imports_commands_and_commands_not_each_other():
    for name, (top, lazy, _) in GRAPH.items():
        top = top | lazy
        if not name.startswith("muser_cli.commands"):
            assert not any(t.startswith("muser_cli.commands") for t in top), name
        elif name != "muser_cli.commands":
            shared = {"muser_cli.commands._common", "muser_cli.commands._examples"} | ({"muser_cli.commands._gendocs"}
                                                       if name == "muser_cli.commands.man" else set())
            others = {t for t in top if t.startswith("muser_cli.commands.") and t not in shared}
            assert not others, f"{name} imports {sorted(others)}"


def test_no_module_uses_another_modules_private_name():
    """Issue 25 item 8: what another module needs is public, in its right home. Neither
    ``from muser_cli.x import _name`` nor ``x._name`` on an imported muser module, lazily or not
    (a private module itself, as ``commands._common``, may be imported)."""
    found = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        bound: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("muser_cli"):
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    if full in MODULES:
                        bound[a.asname or a.name] = full
                    elif a.name.startswith("_") and not a.name.startswith("__") and node.module != name:
                        found.append(f"{name}: from {node.module} import {a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname and a.name in MODULES:
                        bound[a.asname] = a.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                found.append(f"{name}: {bound[node.value.id]}.{node.attr}")
    assert found == []


# ------------------------------------------------------------------ the map (issue #36 item 6)
#: Each room of the library and what it may import (besides its own modules and the package
#: root): the same table as docs/design.md's "Layers", bottom up. A room is a package under
#: muser_cli/ or a module at its top.
SHARED = {"errors", "about", "units", "strict", "threads", "paths", "fsio"}
MAY_IMPORT = {
    "errors": set(), "about": set(), "units": set(),
    "strict": {"errors"}, "threads": {"errors"}, "paths": {"errors"}, "fsio": {"errors"},
    "kvpack": {"errors", "strict", "threads"},
    "costcurve": set(),
    "model": {"kvpack", "errors", "fsio", "paths"},
    "schedule": {"kvpack", "model", "about", "units", "errors"},
    "engines": {"kvpack", "model", "schedule", "errors"},
    "reuse": {"kvpack", "model", "fsio", "paths", "strict", "units", "errors"},
    "gate": {"engines", "kvpack", "model", "reuse", "errors"},
    "interop": {"engines", "kvpack", "model", "schedule", "fsio", "strict", "errors"},
    "rows": {"engines", "gate", "kvpack", "model", "reuse", "schedule", "errors"},
    "produce": {"engines", "kvpack", "model", "reuse", "rows", "schedule", "about", "errors"},
    "handoff": {"kvpack", "fsio", "paths", "strict", "errors"},
    "consumer": {"handoff", "rows", "gate", "engines", "kvpack", "model", "reuse", "schedule", "about", "paths",
                 "strict", "costcurve", "threads", "errors"},
    "pulllane": {"handoff", "produce", "rows", "gate", "engines", "kvpack", "model", "reuse", "schedule",
                 "paths", "strict", "costcurve", "errors"},  # the producer: nothing of the consumer's (#48)
    "batch": {"consumer", "engines", "model", "reuse", "schedule", "fsio", "paths", "strict", "errors"},
    "service": {"batch", "consumer", "pulllane", "handoff", "engines", "model", "schedule", "units", "costcurve",
                "errors"},
}
MAY_IMPORT["bench"] = set(MAY_IMPORT) - {"bench", "service", "batch"}


def _room(module: str) -> str:
    parts = module.split(".")
    return "commands" if parts[1:2] == ["commands"] else (parts[1] if len(parts) > 1 else "")


def test_every_room_is_in_the_map_and_imports_only_what_it_may():
    rooms = {_room(m) for m in MODULES} - {"", "commands"}
    assert rooms == set(MAY_IMPORT), f"rooms not in the map: {sorted(rooms - set(MAY_IMPORT))}; " \
                                     f"gone: {sorted(set(MAY_IMPORT) - rooms)}"
    wrong = []
    for name, (top, lazy, _) in GRAPH.items():
        room = _room(name)
        if room in ("", "commands"):
            continue
        for target in top | lazy:
            there = _room(target)
            if there not in ("", room) and there not in MAY_IMPORT[room]:
                wrong.append(f"{name} -> {target}")
    assert wrong == [], "imports the map does not allow (docs/design.md, Layers)"


def test_the_design_map_names_every_package_and_top_module():
    page = (ROOT / "docs" / "design.md").read_text()
    layers = page[page.index("## Layers"):page.index("## Module sizes")]
    packages = sorted({p.parent.relative_to(ROOT / "muser_cli").as_posix() for p in (ROOT / "muser_cli").rglob("__init__.py")} - {"."})
    missing = [p for p in packages if f" {p.rpartition('/')[2]}/ " not in layers]
    tops = sorted(p.stem for p in (ROOT / "muser_cli").glob("*.py") if p.stem != "__init__")
    missing += [m for m in tops if f"  {m} " not in layers]
    assert missing == [], f"docs/design.md's map leaves out {missing}"
    assert len(tops) <= 10, f"{len(tops)} modules at the top of muser_cli/: group them into packages"


LAZY_REASON = "# lazy:"


def test_imports_of_muser_inside_functions_say_why():
    """Issue #36 item 4: a function-level import of muser's own modules only where a framework or
    optional package, a real cycle, or `muser --help`'s start-up asks for it, with the reason
    on its line."""
    unexplained = []
    for name, path in MODULES.items():
        lines = path.read_text().splitlines()
        tree = ast.parse(path.read_text())

        def visit(node: ast.AST, inner: bool) -> None:
            for child in ast.iter_child_nodes(node):
                nested = inner or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                if nested and isinstance(child, (ast.Import, ast.ImportFrom)):
                    mods = [child.module or ""] if isinstance(child, ast.ImportFrom) else [a.name for a in child.names]
                    own = child.level if isinstance(child, ast.ImportFrom) else 0
                    if own or any(m.startswith("muser_cli") for m in mods):
                        text = " ".join(lines[child.lineno - 1:child.end_lineno])
                        if LAZY_REASON not in text and not _in_optional_guard(child, tree):
                            unexplained.append(f"{path.relative_to(ROOT)}:{child.lineno}")
                visit(child, nested)

        visit(tree, False)
    assert unexplained == []


def _in_optional_guard(node: ast.AST, tree: ast.AST) -> bool:
    """Inside ``try: ... except ImportError`` (an optional package's guard, as decode --serve's)."""
    for t in ast.walk(tree):
        if isinstance(t, ast.Try) and node in t.body:
            return any(h.type is not None and "ImportError" in ast.unparse(h.type) for h in t.handlers)
    return False
