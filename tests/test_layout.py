"""The package's layout: the runtime (what a serving or training process imports) never
imports the tools (``graft.tools``: info, tune, fuzz, bench, profile's command line,
conformance, patches), and every ``graft.*`` import names a real file."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "graft"
# The command line's launcher (`python -m graft`) is the one runtime file that starts a tool.
LAUNCHERS = {PACKAGE / "__main__.py"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every module a file imports: import statements (relative ones resolved) and
    importlib.import_module / __import__ calls with a literal name."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            found.append((node.lineno, node.args[0].value))
    return found


def _runtime_files():
    tools = PACKAGE / "tools"
    return [p for p in PACKAGE.rglob("*.py") if tools not in p.parents and p not in LAUNCHERS]


def test_runtime_never_imports_the_tools():
    offenders = [f"{p.relative_to(ROOT)}:{line}: {name}" for p in _runtime_files()
                 for line, name in _imports(p) if name == "graft.tools" or name.startswith("graft.tools.")]
    assert offenders == [], "the runtime imports the tools:\n" + "\n".join(offenders)


def test_the_walk_sees_a_tools_import():
    # The check above can fail: a file importing a tool is found, relative imports included.
    sample = PACKAGE / "tools" / "bench" / "overhead.py"
    names = {name for _, name in _imports(sample)}
    assert any(n.startswith("graft.tools.bench") for n in names), names


def test_every_graft_import_resolves_to_a_file():
    missing = []
    for path in PACKAGE.rglob("*.py"):
        for line, name in _imports(path):
            if not (name == "graft" or name.startswith("graft.")):
                continue
            target = ROOT.joinpath(*name.split("."))
            if not (target.with_suffix(".py").is_file() or (target / "__init__.py").is_file()
                    or target.with_suffix(".pyi").is_file()):
                # `from graft.x import name`: name is an attribute of graft.x, not a module.
                parent = ROOT.joinpath(*name.split(".")[:-1])
                if any(f.is_file() for f in (parent.with_suffix(".py"), parent.with_suffix(".pyi"), parent / "__init__.py")):
                    continue
                missing.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert missing == [], "\n".join(missing)
