"""The structure of the library as rooms: each package under muser_cli/ (and each module at its
top), its modules and lines, and the rooms it imports (at module level or inside functions).

    python scripts/rooms.py [ROOT]      # ROOT: a checkout (default: this one)

Reads the source only (ast); imports nothing of muser's. The house rules themselves are
checked by tests/test_layers.py; this prints the picture they keep.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path


def rooms(root: Path) -> tuple[dict[str, list[Path]], dict[str, set[str]], int]:
    lib = root / "muser_cli"
    members: dict[str, list[Path]] = defaultdict(list)
    for path in sorted(lib.rglob("*.py")):
        rel = path.relative_to(lib).parts
        if rel[0] == "commands":
            continue
        members["(package root)" if rel == ("__init__.py",) else rel[0].removesuffix(".py")].append(path)
    arrows: dict[str, set[str]] = defaultdict(set)
    lazy = 0
    for room, paths in members.items():
        for path in paths:
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("muser_cli."):
                    names = [node.module]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names if a.name.startswith("muser_cli.")]
                for name in names:
                    target = name.split(".")[1]
                    if target != room and target != "commands":
                        arrows[room].add(target)
            for fn in ast.walk(tree):
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lazy += sum(isinstance(n, ast.ImportFrom) and ((n.module or "").startswith("muser_cli") or n.level > 0)
                                for n in ast.walk(fn))
    return members, arrows, lazy


def main() -> None:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]
    members, arrows, lazy = rooms(root)
    tops = sorted(r for r, ps in members.items() if len(ps) == 1 and ps[0].parent == root / "muser_cli"
                  and r != "(package root)")
    print(f"{root}: {len(members) - 1} rooms, {len(tops)} modules at the top of muser_cli/, "
          f"{lazy} imports of muser's own modules inside functions")
    for room in sorted(members, key=lambda r: (r in tops, r)):
        lines = sum(len(p.read_text().splitlines()) for p in members[room])
        kind = "module " if room in tops else "package"
        print(f"  {kind} {room:16} {len(members[room]):3} files {lines:6} lines  -> {' '.join(sorted(arrows[room])) or '-'}")


if __name__ == "__main__":
    main()
