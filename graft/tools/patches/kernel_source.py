"""Lift a ``@triton.jit`` kernel's source out of an adapter module, so a patch carries the
very kernel graft tests and benchmarks, not a hand-copied variant."""
from __future__ import annotations

import ast
import importlib
import inspect
import textwrap

from graft.tools.patches.template import PatchError


def function_source(module_name: str, function_name: str) -> str:
    """Source of a top-level function (decorators included) in ``module_name``."""
    module = importlib.import_module(module_name)
    source = inspect.getsource(module)
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function_name:
            start = min([d.lineno for d in node.decorator_list] + [node.lineno])
            lines = source.splitlines()[start - 1 : node.end_lineno]
            return textwrap.dedent("\n".join(lines)) + "\n"
    raise PatchError(f"{module_name} has no top-level function {function_name!r} to put into the patch")
