"""What the layout tests (tests/engine, tests/rollout, tests/weight_sync: test_layout.py) read: the
modules a source file imports."""

import ast
import pathlib


def imported_modules(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, module) for every module a file imports (`from a import b` as a.b), wherever the import
    statement stands (lazy imports and TYPE_CHECKING ones included)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def imported(path: pathlib.Path, package: str) -> list[tuple[int, str]]:
    """(line, module) for every import of `package`'s modules in the file at `path`."""
    return [(line, m) for line, m in imported_modules(path) if m.startswith(package + ".")]
