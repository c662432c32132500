"""The shape of the code in broker/, mirroring/ and wire/, read with `ast`: no class over
MAX_CLASS_LINES and no function over MAX_FUNCTION_LINES, a docstring at the top of every
module saying what it owns, and no trio in mirroring/ (the rules are pure: time comes in as
`now`, effects go out as return values). A failure names the file and what is too long."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("broker", "mirroring", "wire")
MAX_CLASS_LINES = 600
MAX_FUNCTION_LINES = 100

# Files still being reshaped, which may exceed the sizes meanwhile. Each entry leaves this list
# as soon as its file fits.
OVERSIZE_ALLOWED: set[str] = set()


def _modules():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(), filename=str(path))


MODULES = list(_modules())


def _lines(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def oversize(tree: ast.AST) -> list[str]:
    """Every class and function in `tree` over its limit, as 'class Name: N lines'."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and _lines(node) > MAX_CLASS_LINES:
            out.append(f"class {node.name}: {_lines(node)} lines (at most {MAX_CLASS_LINES})")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _lines(node) > MAX_FUNCTION_LINES:
            out.append(f"function {node.name} (line {node.lineno}): {_lines(node)} lines "
                       f"(at most {MAX_FUNCTION_LINES})")
    return out


def imports_trio(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "trio" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "trio":
            return True
    return False


@pytest.mark.parametrize("path, tree", MODULES, ids=[p for p, _ in MODULES])
def test_classes_and_functions_fit(path, tree):
    if path in OVERSIZE_ALLOWED:
        pytest.skip("still being reshaped (OVERSIZE_ALLOWED)")
    too_long = oversize(tree)
    assert not too_long, f"{path}: " + "; ".join(too_long)


@pytest.mark.parametrize("path, tree", MODULES, ids=[p for p, _ in MODULES])
def test_every_module_says_what_it_owns(path, tree):
    assert ast.get_docstring(tree), f"{path} has no docstring at its top saying what it owns"


@pytest.mark.parametrize("path, tree", [(p, t) for p, t in MODULES if p.startswith("mirroring/")],
                         ids=[p for p, _ in MODULES if p.startswith("mirroring/")])
def test_mirroring_does_not_import_trio(path, tree):
    assert not imports_trio(tree), f"{path} imports trio: mirroring/ is pure logic"


def test_the_checks_catch_what_they_look_for():
    """The checks themselves: a long class and function are named, a trio import is seen."""
    long_class = "class Big:\n" + "    x = 1\n" * MAX_CLASS_LINES
    long_function = "def big():\n" + "    pass\n" * MAX_FUNCTION_LINES
    assert oversize(ast.parse(long_class)) == [f"class Big: {MAX_CLASS_LINES + 1} lines (at most {MAX_CLASS_LINES})"]
    assert oversize(ast.parse(long_function))[0].startswith("function big (line 1)")
    assert not oversize(ast.parse("class Small:\n    x = 1\n"))
    assert imports_trio(ast.parse("import trio.testing"))
    assert imports_trio(ast.parse("from trio import sleep"))
    assert not imports_trio(ast.parse("from .trio_free import x\nimport triolet"))
