"""What the layout tests read of a file: the modules of one package it imports, wherever the import
statement stands (lazy imports and TYPE_CHECKING ones included)."""

import ast
import pathlib


def imported(path: pathlib.Path, package: str) -> list[tuple[int, str]]:
    """(line, module.name) for every import of `package`'s modules in the file at `path`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return [(line, m) for line, m in out if m.startswith(package + ".")]
